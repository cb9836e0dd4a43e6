"""Loss terms, reductions and the scaling arithmetic."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from lossreduce.errors import ReductionConfigError, ReductionInputError
from lossreduce.trainer_worker import (
    InconsistentNormalizerError,
    LossReduction,
    LossTerm,
    PolicyGradientReduction,
    check_local_consistency,
    local_partials,
    scaled_loss,
)

BAD_KIND: Any = "median"  # not a ReductionKind; typed Any to reach the runtime check


def count(mb):
    return mb["loss_mask"].sum()


def test_term_defaults_and_contracts() -> None:
    term = LossTerm("pg", count)
    assert (term.reduction, term.contract) == ("mean", "mean")
    assert LossTerm("kl", count, "sum").contract == "sum"
    assert LossTerm("kl", count, "sum", contract="sum:token_mean").contract == "sum:token_mean"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: LossTerm("", count), r"LossTerm: term names must be non-empty"),
        (lambda: LossTerm("has space", count), r"term name 'has space' must match"),
        (
            lambda: LossTerm("pg", count, BAD_KIND),
            r"LossTerm 'pg': reduction='median' must be 'mean' or 'sum'",
        ),
        (
            lambda: LossTerm("pg", count, "sum", contract="mean:seq_mean"),
            r"contract 'mean:seq_mean' does not describe a 'sum' term",
        ),
        (lambda: LossReduction(lambda o, b: o, []), r"needs at least one LossTerm"),
        (
            lambda: LossReduction(
                lambda o, b: o, [LossTerm("a", count), LossTerm("a", count, "sum")]
            ),
            r"term names must be unique; repeated: \['a'\]",
        ),
    ],
)
def test_bad_definitions_are_rejected(build, message: str) -> None:
    with pytest.raises(ReductionConfigError, match=message):
        build()


def test_losses_accept_a_tensor_or_a_complete_mapping() -> None:
    single = LossReduction.mean(lambda out, mb: out.sum(), count)
    assert list(single.losses(torch.ones(3), {})) == ["loss"]
    assert LossReduction.sum(lambda out, mb: out.sum(), count, name="s").terms[0].reduction == "sum"
    two = LossReduction(
        lambda out, mb: {"b": out.sum(), "a": out.mean()},
        [LossTerm("a", count), LossTerm("b", count, "sum")],
    )
    assert list(two.losses(torch.ones(3), {})) == ["a", "b"]
    assert two.contracts == {"a": "mean", "b": "sum"}
    assert repr(two) == "LossReduction(a=mean, b=sum)"


@pytest.mark.parametrize(
    ("loss_fn", "message"),
    [
        (
            lambda out, mb: out.sum(),
            r"loss_fn returned one tensor but the reduction has 2 terms \['a', 'b'\]",
        ),
        (
            lambda out, mb: {"a": out.sum()},
            r"returned terms \['a'\] .* \(missing: \['b'\], extra: \[\]\)",
        ),
        (
            lambda out, mb: {"a": out.sum(), "b": out.sum(), "c": out.sum()},
            r"\(missing: \[\], extra: \['c'\]\)",
        ),
        (
            lambda out, mb: {"a": out, "b": out.sum()},
            r"shape \(3,\) for term 'a'; each term's value must be 0-d",
        ),
    ],
)
def test_loss_fn_must_return_every_declared_term(loss_fn, message: str) -> None:
    reduction = LossReduction(loss_fn, [LossTerm("a", count), LossTerm("b", count, "sum")])
    with pytest.raises(ReductionInputError, match=message):
        reduction.losses(torch.ones(3), {})


def test_normalizer_must_be_a_count() -> None:
    reduction = LossReduction.mean(lambda out, mb: out.sum(), lambda mb: mb["loss_mask"])
    with pytest.raises(
        ReductionInputError, match=r"normalizer of term 'loss' returned shape \(2,\)"
    ):
        reduction.normalizers({"loss_mask": torch.ones(2)})


def test_partials_sum_microbatches_and_are_zero_without_any() -> None:
    reduction = LossReduction.mean(lambda out, mb: out.sum(), count)
    lp = local_partials(reduction, [{"loss_mask": torch.ones(3)}, {"loss_mask": torch.ones(4)}])
    assert [float(n["loss"]) for n in lp.per_microbatch] == [3.0, 4.0]
    assert float(lp.partials["loss"]) == 7.0
    assert lp.partials["loss"].dtype == torch.float64
    assert float(local_partials(reduction, []).partials["loss"]) == 0.0


def test_scaled_loss_mean_and_sum_shares() -> None:
    reduction = LossReduction(
        lambda out, mb: out, [LossTerm("m", count), LossTerm("s", count, "sum")]
    )
    value = torch.tensor(2.0, dtype=torch.float32, requires_grad=True)
    total, shares = scaled_loss(
        reduction,
        {"m": value, "s": value * 3},
        {"m": torch.tensor(4.0, dtype=torch.float64), "s": torch.tensor(5.0, dtype=torch.float64)},
        {"m": torch.tensor(10.0, dtype=torch.float64), "s": torch.tensor(8.0, dtype=torch.float64)},
    )
    assert math.isclose(float(shares["m"].detach()), 2.0 * 4 / 10, rel_tol=1e-7)
    assert math.isclose(float(shares["s"].detach()), 6.0 / 8, rel_tol=1e-7)
    assert total.dtype == torch.float32
    total.backward()
    assert value.grad is not None
    assert math.isclose(float(value.grad), 0.4 + 3 / 8, rel_tol=1e-7)


def test_consistency_check_catches_a_normalizer_counting_another_mask() -> None:
    pg = PolicyGradientReduction("token_mean")
    loss = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 0]])
    d = torch.tensor([[1, 1, 1]])
    mean = pg.aggregate(loss, m)  # counts m: 1.5
    total = pg.aggregate(loss, m, local_mean=False)  # 3.0
    good = LossReduction.mean(lambda out, mb: out, pg.normalizer)
    check_local_consistency(
        good,
        {"loss": mean},
        {"loss": total},
        {"loss": pg.normalizer({"loss_mask": m})},
        where="step 0",
    )
    wrong = pg.normalizer({"loss_mask": m, "denominator_mask": d})  # 3 tokens, not 2
    with pytest.raises(
        InconsistentNormalizerError,
        match=r"step 0 term 'loss': local mean 1.5 \* local normalizer 3.0 = 4.5, but the local sum is 3.0",
    ):
        check_local_consistency(
            good, {"loss": mean}, {"loss": total}, {"loss": wrong}, where="step 0"
        )
