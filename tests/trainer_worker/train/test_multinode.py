"""``lossreduce train`` on a real Ray cluster of three raylets (node agents, TLS, faults).

One cluster serves the whole module; every run spreads 4 tiny workers over the
3 nodes (SPREAD), so there are 3 node agents and the embedded coordinator
listens beyond loopback, over the run's own TLS. The run that removes a raylet
goes last: the cluster has two nodes after it.
"""

from __future__ import annotations

import io
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from pydantic import SecretStr
from ray.cluster_utils import Cluster
from ray.exceptions import GetTimeoutError, RayActorError
from rich.console import Console

from lossreduce.client import ClientSettings, ReductionClient
from lossreduce.errors import CoordinatorUnavailableError
from lossreduce.server import (
    CoordinatorSettings,
    CoordinatorThread,
    JournalSettings,
    RoundJournal,
)
from lossreduce.trainer_worker.integrations import coordinator_actor
from lossreduce.trainer_worker.integrations.coordinator_actor import get_coordinator_actor
from lossreduce.trainer_worker.integrations.tls import RunTls, make_run_tls
from lossreduce.trainer_worker.train.agent_actor import agent_name
from lossreduce.trainer_worker.train.driver import RunResult, run
from lossreduce.trainer_worker.train.outputs import StepRecord
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.worker_group import TrainingFailedError, worker_name
from tests.trainer_worker.train.multinode_harness import local_cluster, session_logs

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

ROUND_TIMEOUT_S = 5.0
STEP_TIMEOUT_S = 90.0
STEPS = 3

TINY: dict[str, Any] = {
    "workers": 4,
    "placement": "SPREAD",
    "steps": STEPS,
    "prompts_per_step": 8,
    "samples_per_prompt": 4,
    "d_model": 16,
    "heads": 2,
    "layers": 1,
    "kl_coef": 0.05,
    "progress": False,
    "round_timeout_s": ROUND_TIMEOUT_S,
    "step_timeout_s": STEP_TIMEOUT_S,
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with local_cluster(nodes=3) as started:
        yield started


def tiny(out: Path, job: str, **overrides: Any) -> TrainSettings:
    return TrainSettings.model_validate({**TINY, "out": out, "job": job, **overrides})


def numbers(result: RunResult) -> list[tuple[int, dict[str, float], dict[str, float]]]:
    return [(r.step, r.losses, r.normalizers) for r in result.records]


def coordinator_of(job: str) -> Any:
    return get_coordinator_actor(job)


def remote_rank(job: str) -> tuple[int, str]:
    """The highest rank not on the driver's node (the coordinator's), and its node id."""
    driver_node = ray.get_runtime_context().get_node_id()
    for rank in reversed(range(TINY["workers"])):
        worker = ray.get_actor(worker_name(job, rank))
        _, node, _ = ray.get(worker.where.remote(), timeout=60)
        if node != driver_node:
            return rank, node
    raise AssertionError("every rank is on the driver's node: SPREAD did not spread")


class TlsProbe:
    """After step 0, from outside the run: scrape /metrics and try clients without the CA."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.metrics = b""
        self.refused: list[BaseException] = []

    def on_rollout(self, step: int) -> None:
        pass

    def on_step(self, record: StepRecord) -> None:
        if record.step != 0:
            return
        actor = coordinator_of(self.job)
        target: str = ray.get(actor.target.remote(), timeout=30)
        port = ray.get(actor.metrics_port.remote(), timeout=30)
        host = target.rpartition(":")[0]
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as reply:
            self.metrics = reply.read()
        another_ca = make_run_tls("another-run", [host]).ca_cert
        for settings in (
            ClientSettings(retry_budget_s=0.5, token=None),  # plaintext
            ClientSettings(retry_budget_s=0.5, token=None, tls_root_cert_pem=another_ca),
        ):
            client = ReductionClient(
                target, job=self.job, group="intruder", rank=0, world_size=1, settings=settings
            )
            with client, pytest.raises(CoordinatorUnavailableError) as caught:
                client.reduce(0, {"pg": 1.0})
            self.refused.append(caught.value)


@pytest.fixture(scope="module")
def aggregated(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RunResult, str, TlsProbe, RunTls]:
    """The default path on 3 nodes: agents (auto) and TLS; its console output and TLS probe."""
    made: list[RunTls] = []

    def recording(job: str, hosts: list[str]) -> RunTls:
        made.append(make_run_tls(job, hosts))
        return made[-1]

    patch = pytest.MonkeyPatch()
    patch.setattr(coordinator_actor, "make_run_tls", recording)
    out = io.StringIO()
    probe = TlsProbe("mn-node")
    try:
        result = run(
            tiny(tmp_path_factory.mktemp("node"), "mn-node"),
            console=Console(file=out, width=200),
            observers=[probe],
        )
    finally:
        patch.undo()
    assert len(made) == 1, "the driver made no CA for a multi-node run"
    return result, out.getvalue(), probe, made[0]


def test_the_run_spans_three_nodes_through_agents_over_tls(
    aggregated: tuple[RunResult, str, TlsProbe, RunTls],
) -> None:
    result, console, probe, _ = aggregated
    assert "4 workers (CPU, SPREAD, 3 nodes)" in console
    assert "over TLS through 3 node agents" in console
    assert [r.step for r in result.records] == list(range(STEPS))
    # Scraped after step 0: one contribution per node reached the coordinator, not per rank.
    series = 'lossreduce_contributions_total{group="policy",job="mn-node"}'
    (line,) = [x for x in probe.metrics.decode().splitlines() if x.startswith(series)]
    assert float(line.split()[-1]) == 3.0, line


def test_aggregation_on_off_and_torch_give_bit_identical_results(
    aggregated: tuple[RunResult, str, TlsProbe, RunTls], tmp_path: Path
) -> None:
    on = aggregated[0]
    off = run(tiny(tmp_path / "off", "mn-off", aggregation="off"))
    torch = run(tiny(tmp_path / "torch", "mn-torch", normalizer="torch"))
    assert numbers(on) == numbers(off) == numbers(torch)
    assert all(r.losses for r in on.records), "a step was skipped: nothing compared"


def test_verify_passes_on_three_nodes(cluster: Cluster, tmp_path: Path) -> None:
    result = run(tiny(tmp_path, "mn-verify", verify=True))
    assert result.verify is not None
    assert result.verify.passed


def test_a_client_without_the_run_ca_is_refused(
    aggregated: tuple[RunResult, str, TlsProbe, RunTls],
) -> None:
    probe = aggregated[2]
    assert len(probe.refused) == 2
    assert all("UNAVAILABLE" in str(err) or "unavailable" in str(err) for err in probe.refused)


def test_the_server_key_is_in_no_log_and_no_metric(
    cluster: Cluster, aggregated: tuple[RunResult, str, TlsProbe, RunTls]
) -> None:
    _, console, probe, tls = aggregated
    # Any 64-character line of the key's base64 body would give it away.
    lines = [
        line
        for line in tls.server.private_key.splitlines()
        if line and not line.startswith(b"-----")
    ]
    assert lines
    assert probe.metrics
    haystacks = {"driver console": console.encode(), "/metrics": probe.metrics}
    haystacks |= {str(path): path.read_bytes() for path in session_logs(cluster)}
    for where, text in haystacks.items():
        for line in lines:
            assert line not in text, f"a line of the server key is in {where}"


def test_an_external_tls_coordinator_takes_tls_ca(
    aggregated: tuple[RunResult, str, TlsProbe, RunTls],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node_ip = ray.util.get_node_ip_address()
    tls = make_run_tls("external", [node_ip])
    files = {
        "ca.pem": tls.ca_cert,
        "cert.pem": tls.server.cert_chain,
        "key.pem": tls.server.private_key,
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    token = "external-token-" + "y" * 20
    monkeypatch.setenv("LOSSREDUCE_TOKEN", token)
    settings = CoordinatorSettings(
        host="0.0.0.0",
        port=0,
        metrics_port=None,
        round_timeout_s=ROUND_TIMEOUT_S,
        token=SecretStr(token),
        tls_cert=tmp_path / "cert.pem",
        tls_key=tmp_path / "key.pem",
    )
    with CoordinatorThread(settings) as coordinator:
        external = {"steps": 2, "tls_ca": tmp_path / "ca.pem"}
        # Loopback is the wrong node for the ranks and agents elsewhere: refused, said why.
        with pytest.raises(TrainingFailedError, match="is a loopback address"):
            run(
                tiny(
                    tmp_path / "lo",
                    "mn-lo",
                    coordinator=f"127.0.0.1:{coordinator.port}",
                    **external,
                )
            )
        target = f"{node_ip}:{coordinator.port}"
        result = run(tiny(tmp_path / "run", "mn-external", coordinator=target, **external))
    assert numbers(result) == numbers(aggregated[0])[:2]


class KillCoordinator:
    """Kills the coordinator actor (Ray restarts it) before ``step`` trains; reads the
    journal after the last step (the driver deletes it at stop)."""

    def __init__(self, job: str, step: int) -> None:
        self.job, self.step = job, step
        self.pids: tuple[int, int] | None = None
        self.journal_steps: list[tuple[str, int]] = []
        self._killed = 0

    def on_rollout(self, step: int) -> None:
        if step != self.step:
            return
        actor = coordinator_of(self.job)
        self._killed = ray.get(actor.pid.remote(), timeout=60)
        ray.kill(actor, no_restart=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if ray.get(actor.pid.remote(), timeout=60) != self._killed:
                    return
            except RayActorError:
                return
            time.sleep(0.1)

    def on_step(self, record: StepRecord) -> None:
        if record.step == self.step:
            self.pids = (self._killed, ray.get(coordinator_of(self.job).pid.remote(), timeout=60))
        if record.step == STEPS - 1:
            (journal,) = Path(coordinator_actor.default_journal(self.job)).parent.glob(
                f"lossreduce-coordinator-{self.job}-*.sqlite3"
            )
            with RoundJournal(JournalSettings(path=journal)) as reader:
                self.journal_steps = [(r.group, r.step) for r in reader.records(self.job)]


def test_a_killed_coordinator_actor_loses_no_round_and_counts_none_twice(
    aggregated: tuple[RunResult, str, TlsProbe, RunTls], tmp_path: Path
) -> None:
    killer = KillCoordinator("mn-restart", step=1)
    result = run(tiny(tmp_path, "mn-restart"), observers=[killer])
    assert killer.pids is not None, "the kill never happened"
    assert killer.pids[0] != killer.pids[1], "no restart happened"
    # Same numbers as the run without the kill: every round summed each rank once.
    assert numbers(result) == numbers(aggregated[0])
    # One journal row per step: the restart neither lost a round nor decided one twice.
    steps = [step for _, step in killer.journal_steps]
    assert steps == list(range(STEPS)), killer.journal_steps


def _accepts(host: str, port: int) -> bool:
    """Whether something still accepts TCP connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


class KillAgent:
    """Kills the node agent of a node other than the driver's as ``step``'s training is
    sent: the other nodes' agents open the round, this node's ranks find no agent."""

    def __init__(self, job: str, step: int) -> None:
        self.job, self.step = job, step
        self.node = ""
        self.killed_at = 0.0

    def on_rollout(self, step: int) -> None:
        if step != self.step:
            return
        _, self.node = remote_rank(self.job)
        agent = ray.get_actor(agent_name(self.job, self.node))
        host, port = ray.get(agent.target.remote(), timeout=60).rsplit(":", 1)
        self.killed_at = time.monotonic()
        ray.kill(agent, no_restart=True)
        # ray.kill only requests the kill, and Ray may call the actor dead while its
        # process (whose thread serves the ranks) still runs: wait until Ray says so
        # *and* the agent's port refuses connections, so that no rank's contribution
        # of this step can still reach the coordinator through it.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                ray.get(agent.target.remote(), timeout=60)
            except RayActorError:
                if not _accepts(host, int(port)):
                    return
            time.sleep(0.1)
        raise AssertionError("the agent still answers 60 s after ray.kill")

    def on_step(self, record: StepRecord) -> None:
        pass


def test_a_killed_agent_fails_its_ranks_clearly_and_releases_the_peers(
    cluster: Cluster, tmp_path: Path
) -> None:
    killer = KillAgent("mn-agent", step=1)
    with pytest.raises(TrainingFailedError) as caught:
        run(tiny(tmp_path, "mn-agent", steps=4), observers=[killer])
    waited = time.monotonic() - killer.killed_at
    message = str(caught.value)
    assert "the agent on node " in message
    assert f"(id {killer.node[:12]})" in message
    assert "is gone" in message
    # The peers on the other nodes were answered by the coordinator, not left waiting.
    assert "RoundTimeoutError" in message, message
    assert waited < STEP_TIMEOUT_S, message


class RemoveNode:
    """Removes the raylet of a node other than the driver's before ``step`` trains."""

    def __init__(self, cluster: Cluster, job: str, step: int) -> None:
        self.cluster, self.job, self.step = cluster, job, step
        self.rank, self.node = -1, ""
        self.removed_at = 0.0

    def on_rollout(self, step: int) -> None:
        if step != self.step:
            return
        self.rank, self.node = remote_rank(self.job)
        (raylet,) = [n for n in self.cluster.worker_nodes if n.node_id == self.node]
        self.removed_at = time.monotonic()
        self.cluster.remove_node(raylet, allow_graceful=False)
        # The rank's process may outlive its raylet for a moment and train a fast step:
        # wait until Ray has declared the node (and so the rank) dead.
        worker = ray.get_actor(worker_name(self.job, self.rank))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                ray.get(worker.where.remote(), timeout=5)
            except RayActorError:
                return
            except GetTimeoutError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"rank {self.rank} still answers 60 s after its raylet was removed")

    def on_step(self, record: StepRecord) -> None:
        pass


def test_a_removed_raylet_ends_the_run_naming_its_node_and_ranks(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Last in the module: the cluster has one node fewer afterwards.
    remover = RemoveNode(cluster, "mn-raylet", step=1)
    with pytest.raises(TrainingFailedError) as caught:
        run(tiny(tmp_path, "mn-raylet", steps=4), observers=[remover])
    waited = time.monotonic() - remover.removed_at
    message = str(caught.value)
    assert message.startswith("step 1 (training) failed"), message
    assert f"(id {remover.node[:12]})" in message
    assert f"rank {remover.rank} on node" in message
    assert waited < STEP_TIMEOUT_S, message
