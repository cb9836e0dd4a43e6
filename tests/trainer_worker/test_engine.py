"""The engine boundary and the reference TorchTrainEngine, in one process."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from lossreduce.errors import EmptyNormalizerError, ReductionConfigError, ReductionInputError
from lossreduce.trainer_worker import (
    EvalResult,
    InconsistentNormalizerError,
    LocalNormalizer,
    LossReduction,
    MicrobatchSettings,
    MicrobatchSplitter,
    PolicyGradientReduction,
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


def test_readme_example_runs() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("\n## How an engine uses a reduction\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert blocks, "the README's engine section has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {"__name__": "readme_example"})
