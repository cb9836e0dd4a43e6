"""The engine boundary and the reference TorchTrainEngine, in one process."""

from __future__ import annotations

import concurrent.futures
import copy
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from lossreduce.errors import (
    ClientClosedError,
    EmptyNormalizerError,
    InvalidPartialError,
    LossReduceError,
    ReductionConfigError,
    ReductionInputError,
    RoundAbortedError,
)
from lossreduce.trainer_worker import (
    EvalResult,
    GlobalNormalizer,
    InconsistentNormalizerError,
    LocalNormalizer,
    LossReduction,
    LossTerm,
    MicrobatchSettings,
    MicrobatchSplitter,
    NormalizerHandle,
    PolicyGradientReduction,
    ReadyHandle,
    TorchTrainEngine,
    TrainEngine,
    combine_eval,
    eval_batch_with_reduction,
    train_batch_with_reduction,
    zero_masked,
)
from lossreduce.trainer_worker.reduction import Batch, LossFn, NormalizerFn
from tests.trainer_worker.toy import (
    THREE_TERMS,
    TermSpec,
    build_batch,
    channel_loss,
    forward,
    grads_of,
    make_groups,
    make_model,
    make_reduction,
    reference_loss_and_grads,
    reference_normalizer,
    reference_term,
)

GROUPS = make_groups(11, [3, 1, 4, 2, 2], p_keep=0.8)


def make_engine(*, n_microbatches: int = 3, lr: float = 0.1, **kw) -> TorchTrainEngine:
    model = make_model()
    return TorchTrainEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        LocalNormalizer(job="test"),
        MicrobatchSplitter(MicrobatchSettings(n_microbatches=n_microbatches)),
        forward_fn=forward,
        **kw,
    )


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_train_step_matches_the_reference(packed: bool) -> None:
    engine = make_engine(debug_check=True)
    before = [p.detach().clone() for p in engine.model.parameters()]
    stats = engine.train_batch_with_reduction(
        build_batch(GROUPS, packed=packed), make_reduction(THREE_TERMS)
    )
    loss, grads = reference_loss_and_grads(make_model(), GROUPS, THREE_TERMS)
    assert not stats.skipped
    assert (stats.step, stats.n_microbatches, engine.step) == (0, 3, 1)
    assert math.isclose(stats.loss, loss, rel_tol=1e-12)
    assert stats.normalizers == {s.name: reference_normalizer(GROUPS, s) for s in THREE_TERMS}
    assert stats.local_normalizers == stats.normalizers
    for got, want, old, new in zip(
        grads_of(engine.model), grads, before, engine.model.parameters(), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(new.detach(), old - 0.1 * want, rtol=1e-12, atol=1e-12)
    flat = stats.as_dict()
    assert flat["loss"] == stats.loss
    assert flat["normalizer/pg"] == stats.normalizers["pg"]
    assert flat["skipped"] == 0.0


def test_eval_returns_each_terms_global_value_and_the_total() -> None:
    engine = make_engine()
    result = engine.eval_batch_with_reduction(
        build_batch(GROUPS, packed=False), make_reduction(THREE_TERMS)
    )
    model = make_model()
    with torch.no_grad():
        expected = {s.name: float(reference_term(model, GROUPS, s)) for s in THREE_TERMS}
    for name, value in expected.items():
        assert math.isclose(result.terms[name], value, rel_tol=1e-12)
    assert math.isclose(result.loss, sum(expected.values()), rel_tol=1e-12)
    assert all(p.grad is None for p in engine.model.parameters())
    assert engine.model.training


class FixedNormalizer:
    """Stands in for the other ranks of an in-process split: returns the global sums."""

    def __init__(self, totals: Mapping[str, float]) -> None:
        self.totals = totals

    def start(
        self,
        step: int,
        partials: Mapping[str, torch.Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> NormalizerHandle:
        return ReadyHandle(lambda: self.reduce(step, partials, contracts))

    def reduce(
        self,
        step: int,
        partials: Mapping[str, torch.Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> dict[str, torch.Tensor]:
        return {k: torch.tensor(v, dtype=torch.float64) for k, v in self.totals.items()}


def test_eval_shares_of_ranks_combine_to_the_global_value() -> None:
    reduction = make_reduction(THREE_TERMS)
    totals = {s.name: reference_normalizer(GROUPS, s) for s in THREE_TERMS}
    results = []
    for shard in (GROUPS[:2], GROUPS[2:]):
        engine = make_engine()
        engine.normalizer = FixedNormalizer(totals)
        results.append(engine.eval_batch_with_reduction(build_batch(shard, packed=True), reduction))
    combined = combine_eval(results)
    with torch.no_grad():
        expected = {s.name: float(reference_term(make_model(), GROUPS, s)) for s in THREE_TERMS}
    for name, value in expected.items():
        assert math.isclose(combined.terms[name], value, rel_tol=1e-12)
    assert combined.normalizers == totals
    with pytest.raises(ReductionInputError, match="at least one rank"):
        combine_eval([])
    with pytest.raises(ReductionInputError, match=r"results of steps \[0, 5\]"):
        combine_eval([results[0], EvalResult(5, False, 0.0, dict(results[0].terms))])


def _single_mean() -> tuple[LossFn, NormalizerFn]:
    pg = PolicyGradientReduction("seq_mean")

    def loss_fn(out: torch.Tensor, mb: Batch) -> torch.Tensor:
        adv = zero_masked(mb["advantages"], mb["loss_mask"])
        token_loss = channel_loss(0, out[..., 0], adv)
        return pg.aggregate(token_loss, mb["loss_mask"], denominator_mask=mb["denominator_mask"])

    def weight_fn(mb: Batch) -> torch.Tensor:
        return pg.normalizer(
            {"loss_mask": mb["loss_mask"], "denominator_mask": mb["denominator_mask"]}
        )

    return loss_fn, weight_fn


class CallbackOnlyEngine:
    """An engine with only the callback contract (like an existing FSDP engine)."""

    def __init__(self, inner: TorchTrainEngine) -> None:
        self.inner = inner

    def train_batch(
        self, input: Batch, loss_fn: LossFn, loss_weight_fn: NormalizerFn
    ) -> dict[str, float]:
        return self.inner.train_batch(input, loss_fn, loss_weight_fn)

    def eval_batch(
        self, input: Batch, loss_fn: LossFn, loss_weight_fn: NormalizerFn
    ) -> dict[str, float]:
        return self.inner.eval_batch(input, loss_fn, loss_weight_fn)


def test_single_mean_term_maps_onto_the_callback_contract_unchanged() -> None:
    loss_fn, weight_fn = _single_mean()
    batch = build_batch(GROUPS, packed=False)
    via_callback = make_engine()
    direct = via_callback.train_batch(batch, loss_fn, weight_fn)
    adapter_engine = CallbackOnlyEngine(make_engine())
    assert isinstance(adapter_engine, TrainEngine)
    via_adapter = train_batch_with_reduction(
        adapter_engine, batch, LossReduction.mean(loss_fn, weight_fn)
    )
    assert via_adapter == direct
    evaluated = eval_batch_with_reduction(
        adapter_engine, batch, LossReduction.mean(loss_fn, weight_fn)
    )
    assert evaluated["step"] == 1.0
    assert torch.equal(grads_of(via_callback.model)[0], grads_of(adapter_engine.inner.model)[0])
    spec = TermSpec("loss", "seq_mean", channel=0)
    assert math.isclose(
        direct["loss"], float(reference_term(make_model(), GROUPS, spec).detach()), rel_tol=1e-12
    )
    explicit = train_batch_with_reduction(
        make_engine(), batch, LossReduction.mean(loss_fn, weight_fn)
    )
    assert explicit == direct


@pytest.mark.parametrize(
    "reduction",
    [
        LossReduction.sum(lambda out, mb: out.sum(), lambda mb: mb["loss_mask"].sum()),
        make_reduction(THREE_TERMS),
    ],
    ids=["sum", "three-terms"],
)
def test_callback_only_engine_rejects_what_it_cannot_express(reduction: LossReduction) -> None:
    engine = CallbackOnlyEngine(make_engine())
    with pytest.raises(
        NotImplementedError,
        match=r"CallbackOnlyEngine only has the callback contract .* needs an engine with train_batch_with_reduction",
    ):
        train_batch_with_reduction(engine, build_batch(GROUPS, packed=False), reduction)
    with pytest.raises(NotImplementedError, match="only has the callback contract"):
        eval_batch_with_reduction(engine, build_batch(GROUPS, packed=False), reduction)


def _empty_batch() -> dict[str, torch.Tensor]:
    batch = build_batch(GROUPS, packed=False)
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    batch["denominator_mask"] = torch.zeros_like(batch["denominator_mask"])
    return batch


def test_empty_step_raises_by_default() -> None:
    engine = make_engine()
    with pytest.raises(
        EmptyNormalizerError,
        match=r"job 'test' group 'default' step 0 rank 0: global normalizer 'distill'=0.0, 'entropy'=0.0, 'pg'=0.0 is not finite and > 0",
    ) as info:
        engine.train_batch_with_reduction(_empty_batch(), make_reduction(THREE_TERMS))
    assert info.value.terms == ("distill", "entropy", "pg")
    assert engine.step == 1


def test_empty_step_is_skipped_without_backward_or_optimizer_step() -> None:
    engine = make_engine(on_empty_step="skip")
    before = [p.detach().clone() for p in engine.model.parameters()]
    stats = engine.train_batch_with_reduction(_empty_batch(), make_reduction(THREE_TERMS))
    assert stats.skipped
    assert "global normalizer" in stats.skip_reason
    assert stats.as_dict()["skipped"] == 1.0
    assert all(p.grad is None for p in engine.model.parameters())
    for old, new in zip(before, engine.model.parameters(), strict=True):
        assert torch.equal(old, new.detach())
    assert engine.eval_batch_with_reduction(_empty_batch(), make_reduction(THREE_TERMS)).skipped


def test_rank_without_microbatches_contributes_zero_gradients_to_a_sync() -> None:
    synced: list[list[torch.Tensor]] = []
    engine = make_engine(grad_sync=lambda model: synced.append(grads_of(model)))
    engine.normalizer = FixedNormalizer({s.name: 1.0 for s in THREE_TERMS})
    batch = build_batch(GROUPS[:0], packed=True)
    stats = engine.train_batch_with_reduction(batch, make_reduction(THREE_TERMS))
    assert stats.n_microbatches == 0
    assert stats.local_normalizers == {"distill": 0.0, "entropy": 0.0, "pg": 0.0}
    assert [bool(torch.all(g == 0)) for g in synced[0]] == [True, True]


def test_rank_without_microbatches_runs_a_zero_backward_for_gradient_hooks() -> None:
    # Gradient sync through hooks (as DDP's reducer does) fires only in a backward:
    # a rank without microbatches must still run one, reaching every parameter.
    engine = make_engine()
    engine.normalizer = FixedNormalizer({s.name: 1.0 for s in THREE_TERMS})
    hooked: list[torch.Tensor] = []
    for param in engine.model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: hooked.append(p.grad.detach().clone()))
    before = [p.detach().clone() for p in engine.model.parameters()]
    stats = engine.train_batch_with_reduction(
        build_batch(GROUPS[:0], packed=True), make_reduction(THREE_TERMS)
    )
    assert (stats.skipped, stats.n_microbatches, stats.loss) == (False, 0, 0.0)
    assert stats.terms == {"distill": 0.0, "entropy": 0.0, "pg": 0.0}
    shapes = sorted(tuple(p.shape) for p in engine.model.parameters())
    assert sorted(tuple(h.shape) for h in hooked) == shapes  # once per parameter
    assert all(bool(torch.all(h == 0)) for h in hooked)
    for old, new in zip(before, engine.model.parameters(), strict=True):
        assert torch.equal(old, new.detach())  # zero gradients: plain SGD leaves them


def test_debug_check_catches_loss_and_normalizer_counting_different_masks() -> None:
    pg = PolicyGradientReduction("token_mean")

    def loss_fn(out: torch.Tensor, mb: Batch) -> torch.Tensor:
        return pg.aggregate(out[..., 0], mb["loss_mask"])  # counts loss_mask...

    def weight_fn(mb: Batch) -> torch.Tensor:
        # ...but the normalizer counts the denominator mask.
        return pg.normalizer(
            {"loss_mask": mb["loss_mask"], "denominator_mask": mb["denominator_mask"]}
        )

    batch = build_batch(GROUPS, packed=False)
    assert int(batch["denominator_mask"].sum()) != int(batch["loss_mask"].sum())
    make_engine(debug_check=False).train_batch(batch, loss_fn, weight_fn)  # silently wrong
    with pytest.raises(
        InconsistentNormalizerError,
        match=r"step 0 microbatch 0 term 'loss': local mean .* but the local sum is",
    ):
        make_engine(debug_check=True).train_batch(batch, loss_fn, weight_fn)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"on_empty_step": "ignore"}, r"on_empty_step='ignore' must be 'raise' or 'skip'"),
        ({"grad_average_world_size": 0}, r"grad_average_world_size=0 must be >= 1"),
    ],
)
def test_bad_engine_options(kw, message: str) -> None:
    with pytest.raises(ReductionConfigError, match=message):
        make_engine(**kw)


def test_a_model_that_needs_a_forward_fn_is_named() -> None:
    model = make_model()  # nn.Linear: model(microbatch) cannot take a dict
    engine = TorchTrainEngine(
        torch.nn.Identity(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        LocalNormalizer(),
        MicrobatchSplitter(MicrobatchSettings(n_microbatches=1)),
    )
    with pytest.raises(
        ReductionConfigError, match=r"model\(microbatch\) returned dict; pass a forward_fn"
    ):
        engine.train_batch_with_reduction(
            build_batch(GROUPS, packed=False), make_reduction(THREE_TERMS)
        )


class WithEmptyMicrobatches:
    """A splitter that adds microbatches without sequences first, in the middle and last."""

    def __init__(self, packed: bool) -> None:
        self.inner = MicrobatchSplitter(MicrobatchSettings(n_microbatches=2))
        self.packed = packed

    def __call__(self, batch: Batch) -> list[dict[str, torch.Tensor]]:
        empty = build_batch([], packed=self.packed)
        first, second = self.inner(batch)
        return [empty, first, empty, second, empty]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_empty_microbatches_change_nothing(packed: bool) -> None:
    engine = make_engine(debug_check=True)
    engine.splitter = WithEmptyMicrobatches(packed)
    stats = engine.train_batch_with_reduction(
        build_batch(GROUPS, packed=packed), make_reduction(THREE_TERMS)
    )
    loss, grads = reference_loss_and_grads(make_model(), GROUPS, THREE_TERMS)
    assert (stats.skipped, stats.n_microbatches) == (False, 5)
    assert math.isclose(stats.loss, loss, rel_tol=1e-12)
    assert stats.normalizers == {s.name: reference_normalizer(GROUPS, s) for s in THREE_TERMS}
    for got, want in zip(grads_of(engine.model), grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_model_called_with_the_microbatch_by_default() -> None:
    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = make_model()

        def forward(self, mb: Batch) -> torch.Tensor:
            return forward(self.inner, mb)

    model = Wrapped()
    engine = TorchTrainEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        LocalNormalizer(),
        MicrobatchSplitter(MicrobatchSettings(max_tokens=16)),
    )
    stats = engine.train_batch_with_reduction(
        build_batch(GROUPS, packed=True), make_reduction(THREE_TERMS)
    )
    loss, _ = reference_loss_and_grads(make_model(), GROUPS, THREE_TERMS)
    assert math.isclose(stats.loss, loss, rel_tol=1e-12)
    assert (
        "TorchTrainEngine(normalizer=LocalNormalizer(job='local', group='default'), step=1"
        in repr(engine)
    )


def test_the_docs_engine_example_runs() -> None:
    page = (Path(__file__).parents[2] / "docs" / "engines.md").read_text()
    # The page's part on the reduction library, before its sections (the
    # section on the engines of `lossreduce train` sketches an interface).
    intro = page.split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", intro, flags=re.DOTALL)
    assert blocks, "docs/engines.md has no python example before its sections"
    for block in blocks:
        exec(compile(block, "docs/engines.md", "exec"), {"__name__": "docs_example"})


# ------------------------------------------------------------------ overlap


class Recorder:
    """Counts forwards, and backwards through a gradient hook on every parameter."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.forwards = 0
        self.backwards = 0
        for param in model.parameters():
            param.register_hook(self._on_grad)

    def forward(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        self.forwards += 1
        return forward(model, batch)

    def _on_grad(self, grad: torch.Tensor) -> torch.Tensor:
        self.backwards += 1
        return grad


def trained_engine(
    normalizer: GlobalNormalizer, **kw: Any
) -> tuple[TorchTrainEngine, Recorder, dict[str, Any]]:
    """An engine after one good step (so gradients and Adam state exist), a
    recorder of what it runs next, and a snapshot to compare against."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    recorder = Recorder(model)
    engine = TorchTrainEngine(
        model,
        optimizer,
        LocalNormalizer(job="test"),
        MicrobatchSplitter(MicrobatchSettings(n_microbatches=3)),
        forward_fn=recorder.forward,
        **kw,
    )
    engine.train_batch_with_reduction(build_batch(GROUPS, packed=True), make_reduction(THREE_TERMS))
    engine.normalizer = normalizer
    recorder.forwards = recorder.backwards = 0
    return engine, recorder, snapshot(engine)


def snapshot(engine: TorchTrainEngine) -> dict[str, Any]:
    return {
        "params": [p.detach().clone() for p in engine.model.parameters()],
        "grads": grads_of(engine.model),
        "optimizer": copy.deepcopy(engine.optimizer.state_dict()),
    }


def assert_untouched(engine: TorchTrainEngine, before: dict[str, Any]) -> None:
    """Parameters, gradients and optimizer state are exactly as in ``before``."""
    after = snapshot(engine)
    for name in ("params", "grads"):
        for old, new in zip(before[name], after[name], strict=True):
            assert torch.equal(old, new), name
    old_state, new_state = before["optimizer"]["state"], after["optimizer"]["state"]
    assert old_state.keys() == new_state.keys()
    for index, state in old_state.items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(new_state[index][key]))


class InFlight:
    """A round answered by a timer thread ``delay_s`` after it starts."""

    def __init__(self, answer: Callable[[], dict[str, torch.Tensor]], delay_s: float) -> None:
        self._future: concurrent.futures.Future[dict[str, torch.Tensor]] = (
            concurrent.futures.Future()
        )
        self._started = time.perf_counter()
        self._answered: float | None = None
        self._timer = threading.Timer(delay_s, self._answer, args=(answer,))
        self._timer.start()

    def _answer(self, answer: Callable[[], dict[str, torch.Tensor]]) -> None:
        try:
            self._future.set_result(answer())
        except LossReduceError as err:
            self._future.set_exception(err)
        self._answered = time.perf_counter()

    @property
    def latency_s(self) -> float | None:
        return None if self._answered is None else self._answered - self._started

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> dict[str, torch.Tensor]:
        return self._future.result()


class DelayedNormalizer:
    """Answers like ``inner`` (or raises ``error``), ``delay_s`` after the round starts."""

    def __init__(
        self, inner: GlobalNormalizer, delay_s: float, error: LossReduceError | None = None
    ) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.error = error
        self.started: list[int] = []

    def start(
        self,
        step: int,
        partials: Mapping[str, torch.Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> NormalizerHandle:
        self.started.append(step)
        error = self.error

        def answer() -> dict[str, torch.Tensor]:
            if error is not None:
                raise error
            return self.inner.reduce(step, partials, contracts)

        return InFlight(answer, self.delay_s)

    def reduce(
        self,
        step: int,
        partials: Mapping[str, torch.Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> dict[str, torch.Tensor]:
        return self.start(step, partials, contracts).wait()


def test_the_round_is_in_flight_during_the_first_forward() -> None:
    normalizer = DelayedNormalizer(LocalNormalizer(job="test"), delay_s=0.0)
    engine, recorder, _ = trained_engine(normalizer)
    seen: list[tuple[int, int]] = []

    def watch(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        seen.append((len(normalizer.started), recorder.backwards))
        return recorder.forward(model, batch)

    engine.forward_fn = watch
    engine.train_batch_with_reduction(build_batch(GROUPS, packed=True), make_reduction(THREE_TERMS))
    # The round started before the first forward, and no backward ran before it.
    assert seen[0] == (1, 0)
    assert recorder.forwards == 3
    assert recorder.backwards > 0


@pytest.mark.parametrize(
    "error",
    [
        InvalidPartialError("job 'test' group 'default' step 1 rank 0: invalid local partial"),
        RoundAbortedError("job 'test' group 'default' step 1 rank 0: rank 1 sent 'pg'=nan"),
        ClientClosedError("job 'test' group 'default' step 1 rank 0: the client was closed"),
    ],
    ids=["culprit", "peer", "closed"],
)
def test_a_failed_round_raises_before_any_backward_and_drops_the_forward(
    error: LossReduceError,
) -> None:
    engine, recorder, before = trained_engine(
        DelayedNormalizer(LocalNormalizer(job="test"), delay_s=0.05, error=error)
    )
    with pytest.raises(type(error)) as info:
        engine.train_batch_with_reduction(
            build_batch(GROUPS, packed=True), make_reduction(THREE_TERMS)
        )
    assert info.value is error
    assert (recorder.forwards, recorder.backwards) == (1, 0)  # the overlapped forward only
    assert_untouched(engine, before)
    assert engine.step == 2


def nan_normalizer() -> LossReduction:
    """One mean term whose normalizer is NaN (a bug in the normalizer)."""
    base = make_reduction([TermSpec("pg", "token_mean", channel=0)])
    term = base.terms[0]
    return LossReduction(
        base.loss_fn,
        [LossTerm("pg", lambda mb: torch.tensor(math.nan), "mean", term.contract)],
    )


def test_a_nan_partial_raises_at_the_wait_with_overlap() -> None:
    engine, recorder, before = trained_engine(LocalNormalizer(job="test"))
    with pytest.raises(InvalidPartialError, match=r"step 1 rank 0: invalid local partial 'pg'=nan"):
        engine.train_batch_with_reduction(build_batch(GROUPS, packed=True), nan_normalizer())
    assert (recorder.forwards, recorder.backwards) == (1, 0)
    assert_untouched(engine, before)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_skipped_step_runs_no_backward_and_no_optimizer_step(overlap: bool) -> None:
    engine, recorder, before = trained_engine(
        DelayedNormalizer(LocalNormalizer(job="test"), delay_s=0.05),
        on_empty_step="skip",
        overlap=overlap,
    )
    stats = engine.train_batch_with_reduction(_empty_batch(), make_reduction(THREE_TERMS))
    assert stats.skipped
    assert "global normalizer 'distill'=0.0" in stats.skip_reason
    assert stats.normalizers == {}
    assert stats.local_normalizers == {"distill": 0.0, "entropy": 0.0, "pg": 0.0}
    assert (recorder.forwards, recorder.backwards) == ((1 if overlap else 0), 0)
    assert_untouched(engine, before)
    assert engine.eval_batch_with_reduction(_empty_batch(), make_reduction(THREE_TERMS)).skipped


def test_an_empty_step_raises_the_same_error_with_and_without_overlap() -> None:
    messages = []
    for overlap in (True, False):
        engine, recorder, before = trained_engine(LocalNormalizer(job="test"), overlap=overlap)
        with pytest.raises(EmptyNormalizerError) as info:
            engine.train_batch_with_reduction(_empty_batch(), make_reduction(THREE_TERMS))
        messages.append(str(info.value))
        assert recorder.backwards == 0
        assert_untouched(engine, before)
    assert messages[0] == messages[1]


@pytest.mark.parametrize("n_microbatches", [1, 3])
def test_overlap_changes_no_number(n_microbatches: int) -> None:
    runs = []
    for overlap in (True, False):
        engine = make_engine(n_microbatches=n_microbatches, overlap=overlap, debug_check=True)
        train = [
            engine.train_batch_with_reduction(
                build_batch(GROUPS[i:], packed=True), make_reduction(THREE_TERMS)
            )
            for i in range(2)
        ]
        evaluated = engine.eval_batch_with_reduction(
            build_batch(GROUPS, packed=False), make_reduction(THREE_TERMS)
        )
        runs.append(([s.as_dict() for s in train], evaluated.as_dict(), snapshot(engine)))
    (train_a, eval_a, state_a), (train_b, eval_b, state_b) = runs
    assert train_a == train_b
    assert eval_a == eval_b
    for name in ("params", "grads"):
        for a, b in zip(state_a[name], state_b[name], strict=True):
            assert torch.equal(a, b), name


def test_the_wait_is_timed_apart_from_the_round() -> None:
    # The round takes 0.2 s; the first forward 0.5 s: with overlap the engine
    # finds the answer there, without it the engine sits out the whole round.
    results = {}
    for overlap in (True, False):
        engine, recorder, _ = trained_engine(
            DelayedNormalizer(LocalNormalizer(job="test"), delay_s=0.2), overlap=overlap
        )

        def slow_first(
            model: torch.nn.Module, batch: Batch, rec: Recorder = recorder
        ) -> torch.Tensor:
            if rec.forwards == 0:
                time.sleep(0.5)
            return rec.forward(model, batch)

        engine.forward_fn = slow_first
        results[overlap] = engine.train_batch_with_reduction(
            build_batch(GROUPS, packed=True), make_reduction(THREE_TERMS)
        )
    for stats in results.values():
        assert stats.round_latency_s >= 0.2
    # Generous bounds: they tell the two apart, not how fast this machine is.
    assert results[True].normalizer_wait_s < 0.15
    assert results[False].normalizer_wait_s >= 0.15
