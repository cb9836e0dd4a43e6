"""Normalizer backends: one validation, one set of errors, the same gradients.

The multi-process tests spawn world-size 2 and 4 gloo groups on CPU (see
``dist_harness.py``): TorchDistributedNormalizer and CoordinatorNormalizer
(a real coordinator on a free loopback port) must give the gradients of a
single-process LocalNormalizer run, and an empty or invalid step must fail on
every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing.spawn import spawn

from lossreduce.client import ReductionClient
from lossreduce.errors import (
    ClientClosedError,
    ContractMismatchError,
    EmptyNormalizerError,
    InvalidPartialError,
    LossReduceError,
    RoundAbortedError,
    UsageError,
)
from lossreduce.ports import free_port
from lossreduce.server import CoordinatorSettings, CoordinatorThread
from lossreduce.trainer_worker import (
    CoordinatorNormalizer,
    GlobalNormalizer,
    LocalNormalizer,
    MicrobatchSettings,
    MicrobatchSplitter,
    NormalizerHandle,
    TorchDistributedNormalizer,
    TorchTrainEngine,
)
from tests.trainer_worker import dist_harness
from tests.trainer_worker.toy import (
    THREE_TERMS,
    build_batch,
    forward,
    make_model,
    make_reduction,
    reference_loss_and_grads,
    reference_normalizer,
)

ROOT = Path(__file__).resolve().parents[2]
ROUND_TIMEOUT_S = 20.0
"""The coordinator's round timeout: a peer of a malformed rank must hear well before it."""
T = torch.tensor


def test_local_normalizer_returns_float64_partials() -> None:
    out = LocalNormalizer().reduce(
        3, {"pg": T(4.0), "kl": T(7, dtype=torch.int64)}, {"pg": "mean", "kl": "sum"}
    )
    assert out == {"kl": T(7.0, dtype=torch.float64), "pg": T(4.0, dtype=torch.float64)}
    assert list(out) == ["pg", "kl"]  # the caller's order
    assert all(v.dtype == torch.float64 for v in out.values())
    assert isinstance(LocalNormalizer(), GlobalNormalizer)


@pytest.mark.parametrize(
    ("partials", "error", "message"),
    [
        (
            {"pg": T(math.nan)},
            InvalidPartialError,
            r"job 'j' group 'g' step 7 rank 0: invalid local partial 'pg'=nan \(nan\); a partial must be finite and >= 0",
        ),
        (
            {"pg": T(-1.0), "kl": T(2.0)},
            InvalidPartialError,
            r"invalid local partial 'pg'=-1.0 \(negative\)",
        ),
        ({"pg": T(math.inf)}, InvalidPartialError, r"'pg'=inf \(infinite\)"),
        (
            {"pg": T(0.0), "kl": T(0.0)},
            EmptyNormalizerError,
            r"job 'j' group 'g' step 7 rank 0: global normalizer 'kl'=0.0, 'pg'=0.0 is not finite and > 0 .*no rank runs backward",
        ),
        (
            {"pg": T([1.0, 2.0])},
            InvalidPartialError,
            r"malformed request: a partial is one number, but got shapes \{'pg': \(2,\)\}",
        ),
        (
            {"bad name": T(1.0)},
            InvalidPartialError,
            r"malformed request: term name 'bad name' must match",
        ),
        ({}, InvalidPartialError, r"malformed request: no terms were sent"),
    ],
)
def test_local_normalizer_validation(
    partials: dict[str, torch.Tensor], error: type[Exception], message: str
) -> None:
    contracts = dict.fromkeys(partials, "mean")
    with pytest.raises(error, match=message) as info:
        LocalNormalizer(job="j", group="g").reduce(7, partials, contracts)
    err = info.value
    assert (err.job, err.group, err.step, err.rank) == ("j", "g", 7, 0)  # type: ignore[attr-defined]


def test_contracts_must_name_the_same_terms() -> None:
    with pytest.raises(
        InvalidPartialError, match=r"contracts name \['kl'\] but partials name \['pg'\]"
    ):
        LocalNormalizer().reduce(0, {"pg": T(1.0)}, {"kl": "mean"})


def test_contracts_are_optional() -> None:
    out = LocalNormalizer().reduce(0, {"pg": T(2.0)})
    assert out == {"pg": T(2.0, dtype=torch.float64)}


def test_torch_backend_needs_a_process_group() -> None:
    with pytest.raises(
        UsageError, match=r"needs an initialized torch\.distributed process group"
    ) as info:
        TorchDistributedNormalizer(job="j", group="g")
    assert isinstance(info.value, ValueError)
    assert (info.value.job, info.value.group) == ("j", "g")


class ScriptedClient:
    """A coordinator answer for the local check of CoordinatorNormalizer."""

    job = "j"
    group = "g"
    rank = 2
    world_size = 4

    def __init__(self, answer: dict[str, float] | Exception) -> None:
        self.answer = answer
        self.sent: list[tuple[int, dict[str, float], dict[str, str] | None]] = []

    def reduce_start(self, step: int, partials: Any, contracts: Any = None) -> ScriptedPending:
        self.sent.append((step, dict(partials), contracts))
        return ScriptedPending(self.answer)


class ScriptedPending:
    """A round in flight until :attr:`answered` is set; then it has ``answer``."""

    def __init__(self, answer: dict[str, float] | Exception) -> None:
        self.answer = answer
        self.answered = True
        self.results = 0

    def done(self) -> bool:
        return self.answered

    def result(self, timeout: float | None = None) -> dict[str, float]:
        self.results += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return dict(self.answer)


def test_coordinator_normalizer_sends_floats_and_checks_the_answer() -> None:
    client = ScriptedClient({"kl": 3.0, "pg": 12.0})
    out = CoordinatorNormalizer(client).reduce(
        4, {"pg": T(5.0), "kl": T([1.0])}, {"pg": "mean:seq_mean", "kl": "sum"}
    )
    assert out == {"pg": T(12.0, dtype=torch.float64), "kl": T(3.0, dtype=torch.float64)}
    assert list(out) == ["pg", "kl"]  # the caller's order, not the coordinator's
    assert client.sent == [(4, {"pg": 5.0, "kl": 1.0}, {"pg": "mean:seq_mean", "kl": "sum"})]
    broken = CoordinatorNormalizer(ScriptedClient({"pg": 0.0}))
    with pytest.raises(
        EmptyNormalizerError, match=r"job 'j' group 'g' step 4 rank 2: global normalizer 'pg'=0.0"
    ):
        broken.reduce(4, {"pg": T(5.0)})
    wrong = CoordinatorNormalizer(ScriptedClient({"kl": 1.0}))
    with pytest.raises(LossReduceError, match=r"answered terms \['kl'\] for partials \['pg'\]"):
        wrong.reduce(4, {"pg": T(5.0)})


@pytest.mark.parametrize(
    ("partials", "contracts", "sent", "message"),
    [
        (
            {"pg": T(1.0)},
            {"kl": "mean"},
            ({"pg": math.nan, "kl": math.nan}, {"pg": "", "kl": "mean"}),
            r"contracts name \['kl'\] but partials name \['pg'\]",
        ),
        (
            {"bad name": T(1.0)},
            None,
            ({"bad name": math.nan}, {"bad name": ""}),
            r"term name 'bad name' must match",
        ),
        (
            {"pg": T([1.0, 2.0])},
            {"pg": "mean"},
            ({"pg": math.nan}, {"pg": "mean"}),
            r"a partial is one number, but got shapes \{'pg': \(2,\)\}",
        ),
        ({}, None, ({}, {}), r"no terms were sent"),
    ],
)
def test_coordinator_normalizer_still_sends_a_malformed_request(
    partials: dict[str, torch.Tensor],
    contracts: dict[str, str] | None,
    sent: tuple[dict[str, float], dict[str, str]],
    message: str,
) -> None:
    # The coordinator rejects the NaN partials for this rank and aborts the
    # round for its peers at once; this rank raises what was wrong locally.
    answer = InvalidPartialError("job 'j' group 'g' step 4: rank 2 sent invalid partial")
    client = ScriptedClient(answer)
    with pytest.raises(
        InvalidPartialError, match=rf"job 'j' group 'g' step 4 rank 2: malformed request: {message}"
    ) as info:
        CoordinatorNormalizer(client).reduce(4, partials, contracts)
    assert info.value is not answer
    assert info.value.__cause__ is answer
    assert (info.value.job, info.value.group, info.value.step, info.value.rank) == ("j", "g", 4, 2)
    [(step, got_partials, got_contracts)] = client.sent
    assert step == 4
    assert list(got_partials) == list(sent[0])
    assert all(math.isnan(v) for v in got_partials.values())
    assert got_contracts == sent[1]


def test_local_start_answers_at_once_and_wait_raises_the_same_error_every_time() -> None:
    handle = LocalNormalizer().start(3, {"pg": T(4.0), "kl": T(2.0)})
    assert isinstance(handle, NormalizerHandle)
    assert handle.done()
    assert handle.latency_s is not None
    assert handle.wait() == LocalNormalizer().reduce(3, {"pg": T(4.0), "kl": T(2.0)})
    failed = LocalNormalizer(job="j").start(3, {"pg": T(math.nan)})  # does not raise
    assert failed.done()
    with pytest.raises(InvalidPartialError, match=r"step 3 rank 0: invalid local partial") as first:
        failed.wait()
    with pytest.raises(InvalidPartialError) as second:
        failed.wait()
    assert first.value is second.value


def test_coordinator_start_sends_at_once_and_waits_for_the_answer_later() -> None:
    client = ScriptedClient({"pg": 12.0, "kl": 3.0})
    handle = CoordinatorNormalizer(client).start(4, {"pg": T(5.0), "kl": T(1.0)})
    assert client.sent == [(4, {"pg": 5.0, "kl": 1.0}, None)]  # sent before any wait
    assert isinstance(handle, NormalizerHandle)
    pending = handle._pending  # type: ignore[attr-defined]
    pending.answered = False
    in_flight = (handle.done(), handle.latency_s)
    pending.answered = True
    answered = (handle.done(), handle.latency_s)
    assert in_flight == (False, None)
    assert answered[0]
    assert answered[1] is not None
    assert handle.wait() == {"pg": T(12.0, dtype=torch.float64), "kl": T(3.0, dtype=torch.float64)}
    assert handle.wait() == handle.wait()
    assert pending.results == 1  # the answer is collected once
    closed = ClientClosedError("job 'j' group 'g' step 4 rank 2: the client was closed")
    failed = CoordinatorNormalizer(ScriptedClient(closed)).start(4, {"pg": T(5.0)})
    for _ in range(2):
        with pytest.raises(ClientClosedError) as info:
            failed.wait()
        assert info.value is closed


# ------------------------------------------------------------------ multi-process


def test_closing_the_client_mid_round_raises_before_any_backward(coordinator) -> None:
    # Rank 1 never comes: the round is in flight when the forward closes the client.
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    with ReductionClient(
        coordinator.target, job="close-mid-round", group="g", rank=0, world_size=2
    ) as client:
        forwards = []

        def close_during_forward(m: torch.nn.Module, batch: Any) -> torch.Tensor:
            forwards.append(1)
            client.close()
            return forward(m, batch)

        engine = TorchTrainEngine(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            CoordinatorNormalizer(client),
            MicrobatchSplitter(MicrobatchSettings(n_microbatches=2)),
            forward_fn=close_during_forward,
        )
        backwards = dist_harness.BackwardCounter(model)
        with pytest.raises(ClientClosedError, match=r"job 'close-mid-round' rank 0 was closed"):
            engine.train_batch_with_reduction(
                build_batch(dist_harness.all_groups(), packed=True), make_reduction(THREE_TERMS)
            )
    assert (len(forwards), backwards.count) == (1, 0)
    for param, old in zip(model.parameters(), before, strict=True):
        assert param.grad is None
        assert torch.equal(param.detach(), old)


@pytest.fixture(scope="module")
def coordinator():
    settings = CoordinatorSettings.model_validate(
        {"port": 0, "metrics_port": None, "round_timeout_s": ROUND_TIMEOUT_S}
    )
    with CoordinatorThread(settings) as coord:
        yield coord


def run_world(
    world: int,
    tmp_path: Path,
    target: str | None,
    monkeypatch: pytest.MonkeyPatch,
    entry: Callable[[int, int, int, str, Any], None] = dist_harness.worker,
) -> list[dict[str, Any]]:
    # Spawned ranks import the harness by name: put the repository root on their path.
    monkeypatch.syspath_prepend(str(ROOT))
    spawn(
        entry,
        args=(world, free_port(), str(tmp_path), target),
        nprocs=world,
        join=True,
    )
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_backends_match_the_local_normalizer(
    world: int, tmp_path: Path, coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = run_world(world, tmp_path, coordinator.target, monkeypatch)
    groups = dist_harness.all_groups()

    # The single-process run with LocalNormalizer on all the data equals the reference...
    local = dist_harness.train(LocalNormalizer(), groups, sync=False)
    ref_loss, ref_grads = reference_loss_and_grads(make_model(), groups, THREE_TERMS)
    assert math.isclose(local["stats"]["loss"], ref_loss, rel_tol=1e-12)
    for got, want in zip(local["grads"], ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    # ...and every rank of every distributed backend agrees with it.
    for name in ("torch_sum", "torch_ddp", "coord_sum"):
        losses = []
        for rank, res in enumerate(results):
            got = res[name]
            assert "error" not in got, (name, rank, got)
            for g, want in zip(got["grads"], local["grads"], strict=True):
                torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)
            for p, want in zip(got["params"], local["params"], strict=True):
                torch.testing.assert_close(p, want, rtol=1e-12, atol=1e-12)
            for spec in THREE_TERMS:
                # Exact sums: the same normalizer on every rank, bit for bit.
                assert got["stats"][f"normalizer/{spec.name}"] == reference_normalizer(groups, spec)
            losses.append(got["stats"]["loss"])
        assert math.isclose(math.fsum(losses), ref_loss, rel_tol=1e-12), name

    # The round overlapped with the first forward (the default) or waited for
    # before it: the same numbers, bit for bit, on every backend.
    for name in ("torch_sum", "torch_ddp", "coord_sum"):
        for res in results:
            overlapped, serial = res[name], res[f"{name}_serial"]
            assert {**overlapped["stats"], "step": 0} == {**serial["stats"], "step": 0}, name
            for key in ("grads", "params"):
                for a, b in zip(overlapped[key], serial[key], strict=True):
                    assert torch.equal(a, b), (name, key)

    for prefix in ("torch", "coord"):
        raised = [res[f"{prefix}_empty_raise"] for res in results]
        assert {r["error"] for r in raised} == {"EmptyNormalizerError"}, raised
        assert [r["rank"] for r in raised] == list(range(world))
        assert all(
            "global normalizer" in r["message"] and "'pg'=0.0" in r["message"] for r in raised
        )
        skipped = [res[f"{prefix}_empty_skip"] for res in results]
        assert all(s["skipped"] for s in skipped), skipped
        assert all(all(torch.all(g == 0) for g in s["grads"]) for s in skipped)
        assert [s["backwards"] for s in skipped] == [0] * world, skipped

        # A failed round raises on every rank before any backward: the forward
        # done meanwhile is dropped, parameters and gradients untouched.
        for scenario in ("empty_raise", "invalid", "mismatch"):
            failed = [res[f"{prefix}_{scenario}"] for res in results]
            assert all(f["backwards"] == 0 and f["untouched"] for f in failed), failed

        invalid = [res[f"{prefix}_invalid"] for res in results]
        assert invalid[1]["error"] == "InvalidPartialError", invalid
        assert "'pg'=nan" in invalid[1]["message"]
        for rank, res in enumerate(invalid):
            if rank != 1:
                assert res["error"] == "RoundAbortedError", res
                assert res["ranks"] == (1,)
                assert "rank 1" in res["message"]

    malformed = [res["torch_malformed"] for res in results]
    assert malformed[0]["error"] == "InvalidPartialError", malformed
    assert "contracts name ['kl'] but partials name ['pg']" in malformed[0]["message"]
    assert {r["error"] for r in malformed[1:]} == {"ContractMismatchError"}, malformed

    mismatch = [res["torch_mismatch"] for res in results]
    assert {r["error"] for r in mismatch} == {ContractMismatchError.__name__}, mismatch
    assert all("disagree" in r["message"] for r in mismatch)

    # The coordinator backend: a malformed rank still reaches the coordinator,
    # so its peers hear of it at once rather than at the round timeout.
    malformed = [res["coord_malformed"] for res in results]
    assert malformed[0]["error"] == InvalidPartialError.__name__, malformed
    assert "contracts name ['kl'] but partials name ['pg']" in malformed[0]["message"]
    assert malformed[0]["rank"] == 0
    for rank, res in enumerate(malformed[1:], start=1):
        assert res["error"] == RoundAbortedError.__name__, res
        assert (res["ranks"], res["rank"]) == ((0,), rank), res
        assert "rank 0" in res["message"]
        assert res["seconds"] < ROUND_TIMEOUT_S / 2, res

    mismatch = [res["coord_mismatch"] for res in results]
    assert {r["error"] for r in mismatch} == {ContractMismatchError.__name__}, mismatch
    assert all("rank 0" in r["message"] for r in mismatch), mismatch

    # Every backend returns the terms in the caller's order.
    for name in ("torch_order", "coord_order"):
        assert [res[name] for res in results] == [
            {"terms": list(dist_harness.UNSORTED_TERMS)}
        ] * world, name


def test_a_rank_without_microbatches_takes_part_in_the_gradient_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 1 has no microbatches: it must still join DDP's (or grad_sync's) all-reduce,
    # not fail after the normalizer round while rank 0 waits in it.
    results = run_world(2, tmp_path, None, monkeypatch, entry=dist_harness.empty_rank_worker)
    local = dist_harness.train(LocalNormalizer(), dist_harness.all_groups(), sync=False)
    for name in ("torch_ddp", "torch_sum"):
        for rank, res in enumerate(results):
            got = res[name]
            assert "error" not in got, (name, rank, got)
            for g, want in zip(got["grads"], local["grads"], strict=True):
                torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)
            for p, want in zip(got["params"], local["params"], strict=True):
                torch.testing.assert_close(p, want, rtol=1e-12, atol=1e-12)
            assert got["stats"]["microbatches"] == (2.0 if rank == 0 else 0.0), (name, rank)
            for spec in THREE_TERMS:
                assert (
                    got["stats"][f"normalizer/{spec.name}"]
                    == local["stats"][f"normalizer/{spec.name}"]
                )
        rank_0, rank_1 = (res[name]["stats"] for res in results)
        assert math.isclose(rank_0["loss"], local["stats"]["loss"], rel_tol=1e-12), name
        assert rank_1["loss"] == 0.0, name
        assert all(rank_1[f"loss/{spec.name}"] == 0.0 for spec in THREE_TERMS), name
