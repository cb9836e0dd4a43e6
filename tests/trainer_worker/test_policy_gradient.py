"""The four policy-gradient reductions against the semantics document."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossreduce.errors import LossReduceError, ReductionConfigError, ReductionInputError
from lossreduce.trainer_worker import PolicyGradientReduction, zero_masked

# The worked example of docs/reduction-semantics.md.
L = torch.tensor([[1, 1, 1], [1, 1, 1], [3, 3, 3], [3, 3, 3]], dtype=torch.float64)
M = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
GROUPS = [2, 2]
WORKED = [
    # mode, divisor, global loss, normalizer (one process: local == global)
    ("token_mean", None, 2.2, 10),
    ("seq_mean", None, 2.0, 4),
    ("prompt_mean", None, 2.0, 2),
    ("constant", 10, 0.55, 4),
]


def pack(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Padded rows with their full width -> packed 1-D tensors and cu_seqlens."""
    rows, width = tensors[0].shape
    cu = torch.arange(0, rows * width + 1, width, dtype=torch.int32)
    return [t.reshape(-1) for t in tensors], cu


@pytest.mark.parametrize(("mode", "divisor", "expected", "count"), WORKED)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_worked_example(
    mode: str, divisor: float | None, expected: float, count: int, packed: bool
) -> None:
    pg = PolicyGradientReduction(mode, divisor)
    loss, mask, cu = L, M, None
    if packed:
        (loss, mask), cu = pack(L, M)
    data = {"loss_mask": mask, "group_sizes": torch.tensor(GROUPS)}
    if cu is not None:
        data["cu_seqlens"] = cu
    mean = pg.aggregate(loss, mask, cu_seqlens=cu, group_sizes=GROUPS)
    total = pg.aggregate(loss, mask, cu_seqlens=cu, group_sizes=GROUPS, local_mean=False)
    n = pg.normalizer(data)
    assert n.dtype == torch.float64
    assert float(n) == count
    assert math.isclose(float(mean), expected, rel_tol=1e-15)
    assert math.isclose(float(total) / float(n), expected, rel_tol=1e-15)


def test_padded_and_packed_agree_with_ragged_lengths() -> None:
    # Three responses of lengths 2, 4, 1 in groups [2, 1]; padding holds NaN.
    lengths = [2, 4, 1]
    gen = torch.Generator().manual_seed(3)
    loss_rows = [torch.randn(n, generator=gen, dtype=torch.float64) for n in lengths]
    mask_rows = [torch.tensor([1, 1]), torch.tensor([0, 1, 1, 0]), torch.tensor([1])]
    padded_loss = torch.full((3, 4), math.nan, dtype=torch.float64)
    padded_mask = torch.zeros(3, 4, dtype=torch.long)
    for i, (lr, mr) in enumerate(zip(loss_rows, mask_rows, strict=True)):
        padded_loss[i, : len(lr)], padded_mask[i, : len(mr)] = lr, mr
    packed_loss, packed_mask = torch.cat(loss_rows), torch.cat(mask_rows)
    cu = torch.tensor([0, 2, 6, 7])
    for mode, divisor in [
        ("token_mean", None),
        ("seq_mean", None),
        ("prompt_mean", None),
        ("constant", 4.0),
    ]:
        pg = PolicyGradientReduction(mode, divisor)
        for local_mean in (True, False):
            a = pg.aggregate(padded_loss, padded_mask, group_sizes=[2, 1], local_mean=local_mean)
            b = pg.aggregate(
                packed_loss, packed_mask, cu_seqlens=cu, group_sizes=[2, 1], local_mean=local_mean
            )
            torch.testing.assert_close(a, b, rtol=1e-15, atol=0.0)
        na = pg.normalizer({"loss_mask": padded_mask, "group_sizes": torch.tensor([2, 1])})
        nb = pg.normalizer(
            {"loss_mask": packed_mask, "cu_seqlens": cu, "group_sizes": torch.tensor([2, 1])}
        )
        assert float(na) == float(nb)


def test_partial_groups_and_denominator_mask() -> None:
    # Groups of sizes [3, 1, 2]; group 1 is entirely inactive; rejection drops
    # tokens from the loss mask but not from the denominator mask.
    loss = torch.tensor(
        [[2.0, 4.0], [6.0, 8.0], [1.0, 1.0], [5.0, 5.0], [3.0, 9.0], [7.0, 7.0]],
        dtype=torch.float64,
    )
    d = torch.tensor([[1, 1], [1, 0], [0, 0], [0, 0], [1, 1], [1, 1]])
    m = torch.tensor([[1, 0], [1, 0], [0, 0], [0, 0], [1, 1], [0, 0]])
    groups = [3, 1, 2]
    token_sum = 2 + 6 + 3 + 9
    seq_means = [2 / 2, 6 / 1, 12 / 2, 0 / 2]  # active sequences only
    expected = {
        "token_mean": (token_sum / 7, 7),
        "seq_mean": (sum(seq_means) / 4, 4),
        "prompt_mean": (((2 + 6) / 3 + 12 / 4) / 2, 2),
        "constant": (token_sum / (5 * 4), 4),
    }
    for mode, (value, count) in expected.items():
        pg = PolicyGradientReduction(mode, 5 if mode == "constant" else None)
        got = pg.aggregate(loss, m, denominator_mask=d, group_sizes=groups)
        n = pg.normalizer(
            {"loss_mask": m, "denominator_mask": d, "group_sizes": torch.tensor(groups)}
        )
        assert math.isclose(float(got), value, rel_tol=1e-15), mode
        assert float(n) == count, mode


def test_microbatch_without_active_units_is_zero_with_finite_grads() -> None:
    loss = torch.tensor(
        [[math.nan, math.inf], [-math.inf, math.nan]], dtype=torch.float64, requires_grad=True
    )
    mask = torch.zeros(2, 2, dtype=torch.bool)
    for mode, divisor in [
        ("token_mean", None),
        ("seq_mean", None),
        ("prompt_mean", None),
        ("constant", 2.0),
    ]:
        pg = PolicyGradientReduction(mode, divisor)
        value = pg.aggregate(loss, mask, group_sizes=[1, 1])
        assert float(value.detach()) == 0.0
        assert float(pg.normalizer({"loss_mask": mask, "group_sizes": torch.tensor([1, 1])})) == 0.0
        (grad,) = torch.autograd.grad(value, loss)
        assert torch.equal(grad, torch.zeros_like(grad))


def test_empty_packed_microbatch_is_zero_not_a_crash() -> None:
    # A microbatch without sequences once crashed: its empty list of sequence
    # lengths became a float tensor, which repeat_interleave rejects.
    value = PolicyGradientReduction("seq_mean").aggregate(
        torch.zeros(0, dtype=torch.float64), torch.zeros(0), cu_seqlens=torch.tensor([0])
    )
    assert value.dtype == torch.float64
    assert float(value) == 0.0
    padded = PolicyGradientReduction("prompt_mean").aggregate(
        torch.zeros(0, 4), torch.zeros(0, 4), group_sizes=[]
    )
    assert float(padded) == 0.0


EVERY_MODE = [("token_mean", None), ("seq_mean", None), ("prompt_mean", None), ("constant", 3.0)]


@settings(max_examples=80, deadline=None)
@given(
    mode=st.sampled_from(EVERY_MODE),
    packed=st.booleans(),
    width=st.integers(0, 4),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
    mask_dtype=st.sampled_from([torch.bool, torch.int64, torch.float32]),
    groups=st.sampled_from(["list", "int64", "float32"]),
    with_denominator=st.booleans(),
    local_mean=st.booleans(),
)
def test_microbatch_without_sequences_is_zero_in_every_mode_and_layout(
    *,
    mode: tuple[str, float | None],
    packed: bool,
    width: int,
    dtype: torch.dtype,
    mask_dtype: torch.dtype,
    groups: str,
    with_denominator: bool,
    local_mean: bool,
) -> None:
    shape = (0,) if packed else (0, width)  # packed [0] with cu_seqlens [0], or padded [0, T]
    loss = torch.zeros(shape, dtype=dtype, requires_grad=True)
    mask = torch.zeros(shape, dtype=mask_dtype)
    cu = torch.tensor([0], dtype=torch.int32) if packed else None
    sizes_tensor = torch.zeros(0, dtype=torch.float32 if groups == "float32" else torch.int64)
    group_sizes: list[int] | torch.Tensor = [] if groups == "list" else sizes_tensor
    denominator = torch.zeros(shape, dtype=mask_dtype) if with_denominator else None
    pg = PolicyGradientReduction(*mode)
    value = pg.aggregate(
        loss,
        mask,
        denominator_mask=denominator,
        cu_seqlens=cu,
        group_sizes=group_sizes,
        local_mean=local_mean,
    )
    assert value.shape == ()
    assert value.dtype == torch.promote_types(dtype, torch.float32)
    assert float(value.detach()) == 0.0
    data = {"loss_mask": mask, "group_sizes": sizes_tensor}
    if cu is not None:
        data["cu_seqlens"] = cu
    if denominator is not None:
        data["denominator_mask"] = denominator
    n = pg.normalizer(data)
    assert n.dtype == torch.float64
    assert float(n) == 0.0
    (grad,) = torch.autograd.grad(value, loss)
    assert grad.shape == loss.shape
    assert torch.isfinite(grad).all()
    assert torch.equal(grad, torch.zeros_like(grad))


def test_nan_in_masked_inputs_never_reaches_a_gradient() -> None:
    logp = torch.tensor([[0.1, 0.2, 0.3]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, math.nan, math.inf]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0]])
    pg = PolicyGradientReduction("token_mean")
    # Masking the inputs keeps the gradient finite...
    value = pg.aggregate(-logp * zero_masked(adv, mask), mask)
    (grad,) = torch.autograd.grad(value, logp)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 0.0, 0.0]], dtype=torch.float64))
    # ...while selecting only the output (what the docs warn about) leaks NaN.
    leaky = torch.where(mask.bool(), -logp * adv, 0.0).sum()
    (grad,) = torch.autograd.grad(leaky, logp)
    assert torch.isnan(grad).any()


def test_token_penalty_folds_only_into_token_mean() -> None:
    loss = torch.ones(2, 3, dtype=torch.float64)
    penalty = torch.full((2, 3), 0.5, dtype=torch.float64)
    mask = torch.ones(2, 3)
    folded = PolicyGradientReduction("token_mean").aggregate(loss, mask, token_penalty=penalty)
    assert float(folded) == 1.5
    for mode, divisor in [("seq_mean", None), ("prompt_mean", None), ("constant", 3.0)]:
        with pytest.raises(
            ReductionConfigError, match=rf"cannot be folded into a '{mode}'.*own term"
        ):
            PolicyGradientReduction(mode, divisor).aggregate(
                loss, mask, token_penalty=penalty, group_sizes=[2]
            )


def test_contracts_and_terms() -> None:
    assert PolicyGradientReduction("prompt_mean").contract == "mean:prompt_mean"
    assert PolicyGradientReduction("constant", 1024).contract == "mean:constant:divisor=1024"
    assert PolicyGradientReduction("constant", 1024.0).contract == "mean:constant:divisor=1024"
    assert PolicyGradientReduction("constant", 2.5).contract == "mean:constant:divisor=2.5"
    term = PolicyGradientReduction("seq_mean").term("pg", "sum")
    assert (term.name, term.reduction, term.contract) == ("pg", "sum", "sum:seq_mean")
    assert (
        repr(PolicyGradientReduction("token_mean")) == "PolicyGradientReduction('mean:token_mean')"
    )


@pytest.mark.parametrize(
    ("mode", "divisor", "message"),
    [
        ("median", None, r"mode='median' is not one of 'token_mean', 'seq_mean'"),
        ("constant", None, r"mode 'constant' needs a divisor .* got None"),
        ("constant", 0, r"divisor must be positive and finite, got 0"),
        ("constant", -3.0, r"divisor must be positive and finite, got -3.0"),
        ("constant", math.inf, r"divisor must be positive and finite, got inf"),
        ("constant", math.nan, r"divisor must be positive and finite, got nan"),
        ("constant", True, r"needs a divisor .* got True"),
        ("seq_mean", 10, r"divisor=10 is only valid with mode 'constant', not 'seq_mean'"),
    ],
)
def test_bad_configuration_is_rejected(mode: str, divisor: float | None, message: str) -> None:
    with pytest.raises(ReductionConfigError, match=message) as info:
        PolicyGradientReduction(mode, divisor)
    # One exception tree, and still a ValueError for callers that catch that.
    assert isinstance(info.value, LossReduceError)
    assert isinstance(info.value, ValueError)


def _call(mode: str, loss: torch.Tensor, mask: torch.Tensor, **kw: object) -> None:
    PolicyGradientReduction(mode).aggregate(loss, mask, **kw)  # type: ignore[arg-type]


ONES = torch.ones(2, 3)


@pytest.mark.parametrize(
    ("mode", "loss", "mask", "kw", "message"),
    [
        (
            "token_mean",
            ONES,
            torch.ones(2, 4),
            {},
            r"loss has shape \(2, 3\) but loss_mask has shape \(2, 4\)",
        ),
        (
            "token_mean",
            ONES,
            ONES,
            {"denominator_mask": torch.ones(3, 2)},
            r"denominator_mask has shape \(3, 2\)",
        ),
        (
            "token_mean",
            torch.ones(2, 3, 1),
            torch.ones(2, 3, 1),
            {},
            r"padded \[B, T\] or packed .* \(2, 3, 1\)",
        ),
        ("seq_mean", torch.ones(6), torch.ones(6), {}, r"packed 1-D inputs .* need cu_seqlens"),
        (
            "seq_mean",
            torch.ones(6),
            torch.ones(6),
            {"cu_seqlens": torch.tensor([0, 2, 5])},
            r"cu_seqlens=\[0, 2, 5\] must .* end at the number of packed tokens \(6\)",
        ),
        (
            "seq_mean",
            torch.ones(6),
            torch.ones(6),
            {"cu_seqlens": torch.tensor([0, 4, 2, 6])},
            r"cu_seqlens=\[0, 4, 2, 6\] must start at 0, never decrease",
        ),
        (
            "seq_mean",
            ONES,
            ONES,
            {"cu_seqlens": torch.tensor([0, 3, 6])},
            r"cu_seqlens is only for packed 1-D inputs",
        ),
        ("prompt_mean", ONES, ONES, {}, r"'prompt_mean' needs group_sizes"),
        (
            "prompt_mean",
            ONES,
            ONES,
            {"group_sizes": [1]},
            r"group_sizes=\[1\] sum to 1 but the batch holds 2 sequences",
        ),
        (
            "prompt_mean",
            ONES,
            ONES,
            {"group_sizes": [3, -1]},
            r"group_sizes=\[3, -1\] must all be whole numbers >= 1",
        ),
        (
            "prompt_mean",
            ONES,
            ONES,
            {"group_sizes": torch.tensor([1.5, 0.5])},
            r"group_sizes=\[1.5, 0.5\] must all be whole numbers >= 1",
        ),
        (
            "prompt_mean",
            ONES,
            ONES,
            {"group_sizes": torch.tensor([math.nan, 2.0])},
            r"group_sizes=\[nan, 2.0\] must all be whole numbers >= 1",
        ),
        (
            "prompt_mean",
            ONES,
            ONES,
            {"group_sizes": [True, True]},
            r"group_sizes=\[True, True\] must all be whole numbers >= 1",
        ),
        (
            "seq_mean",
            torch.ones(0),
            torch.ones(0),
            {"cu_seqlens": torch.zeros(0)},
            r"cu_seqlens must be 1-D \[B \+ 1\], got shape \(0,\)",
        ),
        (
            "seq_mean",
            torch.ones(3),
            torch.ones(3),
            {"cu_seqlens": torch.tensor([0.0, 1.5, 3.0])},
            r"cu_seqlens=\[0.0, 1.5, 3.0\] must hold whole token offsets",
        ),
        (
            "prompt_mean",
            ONES,
            ONES,
            {"group_sizes": torch.ones(1, 2)},
            r"group_sizes must be 1-D .* \(1, 2\)",
        ),
        (
            "token_mean",
            ONES,
            ONES,
            {"denominator_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])},
            r"loss_mask has 1 tokens outside denominator_mask",
        ),
    ],
)
def test_bad_inputs_name_the_argument_and_values(
    mode: str, loss: torch.Tensor, mask: torch.Tensor, kw: dict[str, object], message: str
) -> None:
    with pytest.raises(ReductionInputError, match=message):
        _call(mode, loss, mask, **kw)


def test_normalizer_needs_a_loss_mask() -> None:
    with pytest.raises(
        ReductionInputError, match=r"needs data\['loss_mask'\]; the data holds \['mask'\]"
    ):
        PolicyGradientReduction("token_mean").normalizer({"mask": ONES})


def test_zero_masked_checks_shapes() -> None:
    with pytest.raises(
        ReductionInputError, match=r"values has shape \(2, 3\) but mask has shape \(3,\)"
    ):
        zero_masked(ONES, torch.ones(3))


def test_low_precision_losses_are_reduced_in_float32() -> None:
    # 301 tokens of loss 1.0 in one response: bfloat16 cannot represent 301, so a
    # bfloat16 sum would be off; the reduction sums and divides in float32.
    loss = torch.ones(1, 301, dtype=torch.bfloat16)
    mask = torch.ones(1, 301)
    for mode in ("token_mean", "seq_mean", "prompt_mean"):
        value = PolicyGradientReduction(mode).aggregate(
            loss, mask, group_sizes=[1], local_mean=False
        )
        assert value.dtype == torch.float32
        expected = 301.0 if mode == "token_mean" else 1.0
        assert float(value) == expected, mode
