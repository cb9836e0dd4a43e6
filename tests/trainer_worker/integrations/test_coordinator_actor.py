"""Ranks of a framework's job start or join the job's coordinator actor (``join_coordinator_actor``).

Real Ray: ranks are Ray actors that each call ``join_coordinator_actor`` at the
same moment, then reduce through the endpoint they got; on two raylets the
coordinator listens beyond loopback, over the run's own TLS. The journals go
to each test's own ``tmp_path``: a clean end of the rank that created the actor
removes them; after a killed one, whatever Ray's end of the actor left goes with the
retention sweep.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from pydantic import SecretStr, ValidationError
from ray.exceptions import RayActorError

from lossreduce.client import ClientSettings, ReductionClient
from lossreduce.errors import CoordinatorUnavailableError, UsageError
from lossreduce.ports import LOOPBACK
from lossreduce.trainer_worker.integrations.coordinator_actor import (
    ActorJournalSettings,
    CoordinatorEndpoint,
    get_coordinator_actor,
    join_coordinator_actor,
    start_coordinator_actor,
    sweep_journals,
)
from tests.ray_support import local_ray
from tests.trainer_worker.train.multinode_harness import local_cluster

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


class Rank:
    """One rank of a job: joins the job's coordinator, then reduces its value."""

    def join(self, job: str, journal_dir: Path) -> CoordinatorEndpoint:
        self.joined = join_coordinator_actor(
            job, round_timeout_s=20.0, startup_timeout_s=60.0, journal_dir=journal_dir
        )
        self.endpoint = self.joined.endpoint
        return self.endpoint

    def owns(self) -> bool:
        """Whether this rank's call created the coordinator actor (and so owns it)."""
        return self.joined.journal is not None

    def pid(self) -> int:
        return os.getpid()

    def drop(self) -> None:
        """Let go of the coordinator actor's handle, as a framework done with it."""
        del self.joined

    def close(self) -> None:
        self.joined.close()

    def leave(self) -> None:
        """End this rank's process cleanly, as a framework's worker at the end of a job."""
        ray.actor.exit_actor()

    def reduce(self, job: str, rank: int, world: int, value: float) -> dict[str, float]:
        settings = ClientSettings(
            call_timeout_s=30.0,
            token=self.endpoint.token,
            tls_root_cert_pem=self.endpoint.ca_cert,
        )
        with ReductionClient(
            self.endpoint.target,
            job=job,
            group="actor",
            rank=rank,
            world_size=world,
            settings=settings,
        ) as client:
            return client.reduce(0, {"pg": value})

    def reduce_without_token(self, job: str) -> str:
        settings = ClientSettings(
            call_timeout_s=10.0, retry_budget_s=0.0, tls_root_cert_pem=self.endpoint.ca_cert
        )
        try:
            with ReductionClient(
                self.endpoint.target,
                job=job,
                group="actor",
                rank=0,
                world_size=1,
                settings=settings,
            ) as client:
                client.reduce(0, {"pg": 1.0})
        except Exception as err:
            return type(err).__name__
        return "accepted"


def _ranks(count: int, strategy: str = "DEFAULT") -> list[ray.actor.ActorHandle]:
    cls = ray.remote(num_cpus=0.1, scheduling_strategy=strategy)(Rank)
    return [cls.remote() for _ in range(count)]


@pytest.fixture(scope="module")
def one_node() -> Iterator[None]:
    with local_ray():
        yield


def test_every_rank_joins_one_coordinator_with_one_fresh_token(
    one_node: None, tmp_path: Path
) -> None:
    ranks = _ranks(3)
    endpoints = ray.get([r.join.remote("join-one", tmp_path) for r in ranks], timeout=120)
    assert len({(e.target, e.token.get_secret_value()) for e in endpoints}) == 1
    endpoint = endpoints[0]
    assert endpoint.target.startswith(f"{LOOPBACK}:")
    assert endpoint.ca_cert is None  # one node: plaintext on loopback
    assert len(endpoint.token.get_secret_value()) >= 32
    totals = ray.get(
        [r.reduce.remote("join-one", i, 3, float(i + 1)) for i, r in enumerate(ranks)],
        timeout=120,
    )
    assert totals == [{"pg": 6.0}] * 3
    assert ray.get(ranks[0].reduce_without_token.remote("join-one"), timeout=60) == (
        "AuthenticationError"
    )
    # Another job gets a coordinator and a token of its own.
    (other,) = ray.get([_ranks(1)[0].join.remote("join-two", tmp_path)], timeout=120)
    assert other.target != endpoint.target
    assert other.token.get_secret_value() != endpoint.token.get_secret_value()


def _journals(folder: Path, job: str) -> list[str]:
    return sorted(p.name for p in folder.glob(f"lossreduce-coordinator-{job}-*.sqlite3*"))


def _joined_with_a_round(
    job: str, folder: Path
) -> tuple[ray.actor.ActorHandle, ray.actor.ActorHandle, int]:
    """Two ranks join ``job``'s coordinator and reduce one round: the owner rank, the
    other one, and the owner's process id."""
    ranks = _ranks(2)
    ray.get([r.join.remote(job, folder) for r in ranks], timeout=120)
    assert ray.get([r.reduce.remote(job, i, 2, 1.0) for i, r in enumerate(ranks)], timeout=120)
    owns = ray.get([r.owns.remote() for r in ranks], timeout=60)
    assert sorted(owns) == [False, True], "exactly one rank's call creates the actor"
    owner, other = (ranks[0], ranks[1]) if owns[0] else (ranks[1], ranks[0])
    assert any(name.endswith(".sqlite3") for name in _journals(folder, job))
    # However old it looks, the sweep keeps the journal of a live coordinator.
    assert sweep_journals(folder, 1.0, now=time.time() + 30 * 86_400.0) == []
    return owner, other, ray.get(owner.pid.remote(), timeout=60)


def _wait_dead(actor: ray.actor.ActorHandle) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            ray.get(actor.pid.remote(), timeout=10)
        except RayActorError:
            return
        time.sleep(0.2)
    raise AssertionError("the coordinator actor outlived the rank that created it")


def test_a_clean_exit_of_the_rank_that_created_the_actor_removes_its_journal(
    one_node: None, tmp_path: Path
) -> None:
    owner, _other, _ = _joined_with_a_round("journal-clean", tmp_path)
    coordinator = get_coordinator_actor("journal-clean")
    with contextlib.suppress(RayActorError):  # the call ends the process it runs in
        ray.get(owner.leave.remote(), timeout=60)
    _wait_dead(coordinator)  # not detached: it ends with its owner
    deadline = time.monotonic() + 60
    while _journals(tmp_path, "journal-clean") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _journals(tmp_path, "journal-clean") == []


def test_an_actor_every_rank_let_go_of_removes_its_journal(one_node: None, tmp_path: Path) -> None:
    owner, other, _ = _joined_with_a_round("journal-dropped", tmp_path)
    # No handle anywhere (this test holds none): Ray ends the actor gracefully.
    ray.get([owner.drop.remote(), other.drop.remote()], timeout=60)
    deadline = time.monotonic() + 60
    while _journals(tmp_path, "journal-dropped") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _journals(tmp_path, "journal-dropped") == []
    assert ray.get(owner.pid.remote(), timeout=60), "the owner lives on"


def test_close_on_the_owner_stops_the_actor_and_removes_its_journal(
    one_node: None, tmp_path: Path
) -> None:
    owner, other, _ = _joined_with_a_round("journal-close", tmp_path)
    ray.get(other.close.remote(), timeout=60)  # not the owner: nothing happens
    assert _journals(tmp_path, "journal-close") != []
    ray.get(owner.close.remote(), timeout=120)
    assert _journals(tmp_path, "journal-close") == []
    with pytest.raises(ValueError, match="journal-close"):
        get_coordinator_actor("journal-close")


def test_a_killed_owner_ends_the_actor_and_its_journal_goes_by_the_retention(
    one_node: None, tmp_path: Path
) -> None:
    _owner, _other, pid = _joined_with_a_round("journal-crash", tmp_path)
    coordinator = get_coordinator_actor("journal-crash")
    os.kill(pid, signal.SIGKILL)  # a crash: no exit handler runs in the owner
    _wait_dead(coordinator)
    time.sleep(1.0)  # let an ending actor's own cleanup finish first
    # Ray ends an actor whose creator died either gracefully (its __ray_shutdown__
    # removes the journal) or outright (the journal stays); which, is a race inside
    # Ray (seen both ways on one machine). A journal left is held by no one any more:
    # a start past the retention removes it.
    if _journals(tmp_path, "journal-crash"):
        assert sweep_journals(tmp_path, 1.0, now=time.time() + 30 * 86_400.0)
    assert _journals(tmp_path, "journal-crash") == []


def test_a_start_sweeps_journals_older_than_the_retention(one_node: None, tmp_path: Path) -> None:
    day = 86_400.0
    now = time.time()
    files = {
        "lossreduce-coordinator-gone-0123456789ab.sqlite3": now - 3 * day,
        "lossreduce-coordinator-gone-0123456789ab.sqlite3-wal": now - 3 * day,
        "lossreduce-coordinator-gone-0123456789ab.sqlite3-shm": now - 3 * day,
        # Its main file is old, its write-ahead log fresh: still written to, kept.
        "lossreduce-coordinator-busy-aaaaaaaaaaaa.sqlite3": now - 3 * day,
        "lossreduce-coordinator-busy-aaaaaaaaaaaa.sqlite3-wal": now - 60.0,
        "lossreduce-coordinator-fresh-bbbbbbbbbbbb.sqlite3": now - 0.5 * day,
        # Old, but a live coordinator holds it (an idle run): kept.
        "lossreduce-coordinator-idle-cccccccccccc.sqlite3": now - 3 * day,
        # Not a journal some run named: never touched.
        "lossreduce-coordinator-notes.txt": now - 30 * day,
    }
    for name, mtime in files.items():
        (tmp_path / name).write_bytes(b"")
        os.utime(tmp_path / name, (mtime, mtime))
    held = os.open(tmp_path / "lossreduce-coordinator-idle-cccccccccccc.sqlite3", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_SH)  # as a live CoordinatorActor holds its journal
    handle = start_coordinator_actor(
        "sweeper",
        5.0,
        SecretStr("s" * 32),
        journal_dir=tmp_path,
        retention=ActorJournalSettings(journal_retention_days=1.0),
    )
    try:
        handle.wait_ready(120)
        assert handle.journal is not None
        assert handle.journal.parent == tmp_path
        left = {p.name for p in tmp_path.iterdir()}
        assert left - {f"{handle.journal.name}{s}" for s in ("", "-wal", "-shm")} == {
            name for name in files if "-gone-" not in name
        }
    finally:
        handle.stop()
        os.close(held)
    assert _journals(tmp_path, "sweeper") == [], "a clean stop removes the run's own journal"


def test_the_retention_is_read_from_the_environment_and_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOSSREDUCE_COORDINATOR_JOURNAL_RETENTION_DAYS", "2.5")
    assert ActorJournalSettings().journal_retention_days == 2.5
    monkeypatch.setenv("LOSSREDUCE_COORDINATOR_JOURNAL_RETENTION_DAYS", "0")
    with pytest.raises(ValidationError, match=r"journal_retention_days[\s\S]*input_value='0'"):
        ActorJournalSettings()


def test_outside_a_ray_cluster_the_address_is_asked_for() -> None:
    if ray.is_initialized():
        ray.shutdown()
    with pytest.raises(UsageError, match=r"job 'lone'.*not connected to one.*coordinator=HOST"):
        join_coordinator_actor("lone", round_timeout_s=5.0, startup_timeout_s=5.0)


def test_on_two_nodes_the_joined_coordinator_serves_over_the_runs_tls(tmp_path: Path) -> None:
    with local_cluster(nodes=2):
        ranks = _ranks(2, strategy="SPREAD")
        endpoints = ray.get([r.join.remote("join-tls", tmp_path) for r in ranks], timeout=120)
        assert endpoints[0] == endpoints[1]
        endpoint = endpoints[0]
        assert endpoint.ca_cert is not None
        assert b"BEGIN CERTIFICATE" in endpoint.ca_cert
        assert not endpoint.target.startswith(f"{LOOPBACK}:")
        totals = ray.get(
            [r.reduce.remote("join-tls", i, 2, 2.0**i) for i, r in enumerate(ranks)], timeout=120
        )
        assert totals == [{"pg": 3.0}] * 2
        # Plaintext is refused: the token never crosses the network in clear.
        plain = ClientSettings(call_timeout_s=5.0, retry_budget_s=0.0, token=SecretStr("x"))
        with (
            pytest.raises(CoordinatorUnavailableError),
            ReductionClient(
                endpoint.target, job="join-tls", group="actor", rank=0, world_size=1, settings=plain
            ) as client,
        ):
            client.reduce(1, {"pg": 1.0})
