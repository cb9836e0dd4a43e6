"""The four policy-gradient reductions: token, sequence, prompt and constant means.

``docs/reduction-semantics.md`` is the contract. Each mode turns per-token
losses ``l`` under a numerator mask ``m`` (``loss_mask``) and a denominator mask
``d`` (``denominator_mask``, default ``m``) into a microbatch's local value and
its local normalizer ``n`` (the count of active units):

- ``token_mean``: value ``sum(l*m)``, ``n`` = tokens with ``d``;
- ``seq_mean``: value ``sum over active i of sum_t(l*m) / D_i``, ``n`` = active sequences;
- ``prompt_mean``: value ``sum over active g of sum_{i in g}(l*m) / sum_{i in g} D_i``,
  ``n`` = active prompt groups;
- ``constant``: value ``sum(l*m) / C``, ``n`` = active sequences.

``aggregate`` returns that value divided by ``n`` (the local mean, a mean term)
or the value itself (``local_mean=False``, a sum term); ``normalizer`` returns
``n``. Both read the same masks through one code path, so they always count the
same units. Inputs are padded ``[B, T]`` or packed 1-D ``[total_tokens]`` with
``cu_seqlens`` ``[B + 1]``; both give the same result. A microbatch without
sequences (padded ``[0, T]``, packed with ``cu_seqlens = [0]``, no groups) is
valid in every mode: value 0, normalizer 0, zero gradients.

Bad settings raise :class:`~lossreduce.errors.ReductionConfigError`, malformed
inputs :class:`~lossreduce.errors.ReductionInputError` (both also ``ValueError``).

Masked positions never enter arithmetic: the loss is selected with
``torch.where`` before any sum, so a NaN or inf in a masked token neither
reaches the value nor (through this function) a gradient. Inputs to the loss
(advantages, log-probabilities) must be masked the same way before they are
combined; :func:`zero_masked` does that.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, SupportsIndex

import torch
from torch import Tensor

from lossreduce._compat import StrEnum
from lossreduce.errors import ReductionConfigError, ReductionInputError

if TYPE_CHECKING:
    from collections.abc import Iterator

    from lossreduce.trainer_worker.reduction import LossTerm

__all__ = [
    "PolicyGradientMode",
    "PolicyGradientReduction",
    "checked_group_sizes",
    "forced_local_sums",
    "packed_lengths",
    "zero_masked",
]

GroupSizes = Tensor | Sequence[int]

# Set by the engine's debug check: every aggregate() returns its local sum, so
# the engine can compare mean * normalizer against the sum the loss counted.
_FORCE_LOCAL_SUM: ContextVar[bool] = ContextVar("lossreduce_force_local_sum", default=False)


@contextmanager
def forced_local_sums() -> Iterator[None]:
    """Within this block every :meth:`PolicyGradientReduction.aggregate` returns
    its local sum whatever ``local_mean`` says (used by the engine's debug check)."""
    token = _FORCE_LOCAL_SUM.set(True)
    try:
        yield
    finally:
        _FORCE_LOCAL_SUM.reset(token)


class PolicyGradientMode(StrEnum):
    """What the policy-gradient loss weighs equally."""

    TOKEN_MEAN = "token_mean"
    SEQ_MEAN = "seq_mean"
    PROMPT_MEAN = "prompt_mean"
    CONSTANT = "constant"


def zero_masked(values: Tensor, mask: Tensor) -> Tensor:
    """``values`` with every position where ``mask`` is zero replaced by 0.

    Apply it to the *inputs* of a token loss (advantages, log-probabilities)
    before combining them: ``torch.where`` on the loss output alone still sends
    ``0 * nan = nan`` into the gradient of whatever produced the NaN.
    """
    if values.shape != mask.shape:
        raise ReductionInputError(
            f"zero_masked: values has shape {tuple(values.shape)} but mask has "
            f"shape {tuple(mask.shape)}; they must match"
        )
    return torch.where(
        mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device)
    )


@dataclass(frozen=True)
class _Layout:
    """Where each sequence's tokens live: rows of a padded batch or packed segments."""

    n_sequences: int
    seq_index: Tensor | None  # [total_tokens] sequence id of each packed token; None when padded

    def per_sequence(self, values: Tensor) -> Tensor:
        """Sum token values per sequence: [B, T] or [total_tokens] -> [B]."""
        if self.seq_index is None:
            return values.sum(dim=-1)
        out = torch.zeros(self.n_sequences, dtype=values.dtype, device=values.device)
        return out.index_add(0, self.seq_index, values)


def _layout(loss_mask: Tensor, cu_seqlens: Tensor | None) -> _Layout:
    if loss_mask.dim() == 2:
        if cu_seqlens is not None:
            raise ReductionInputError(
                f"cu_seqlens is only for packed 1-D inputs, but loss_mask is padded with shape "
                f"{tuple(loss_mask.shape)}"
            )
        return _Layout(n_sequences=loss_mask.shape[0], seq_index=None)
    if loss_mask.dim() != 1:
        raise ReductionInputError(
            f"loss_mask must be padded [B, T] or packed [total_tokens], got shape "
            f"{tuple(loss_mask.shape)}"
        )
    if cu_seqlens is None:
        raise ReductionInputError(
            f"packed 1-D inputs (loss_mask shape {tuple(loss_mask.shape)}) need cu_seqlens, "
            "the cumulative sequence offsets [B + 1]"
        )
    lengths = packed_lengths(cu_seqlens, loss_mask.shape[0])
    return _Layout(n_sequences=len(lengths), seq_index=_owner_ids(lengths, loss_mask.device))


def packed_lengths(cu_seqlens: Tensor, total_tokens: int) -> list[int]:
    """The sequence lengths ``[B]`` of packed ``cu_seqlens`` ``[B + 1]``, checked to
    start at 0, never decrease and end at ``total_tokens`` (``[0]``: no sequence).

    The one check of packed offsets, shared by the reduction and the splitter.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ReductionInputError(
            f"cu_seqlens must be 1-D [B + 1], got shape {tuple(cu_seqlens.shape)}"
        )
    given: list[object] = cu_seqlens.tolist()
    offsets = [_whole(v) for v in given]
    if None in offsets:
        raise ReductionInputError(f"cu_seqlens={given} must hold whole token offsets")
    whole = [v for v in offsets if v is not None]
    lengths = [b - a for a, b in itertools.pairwise(whole)]
    if whole[0] != 0 or whole[-1] != total_tokens or any(n < 0 for n in lengths):
        raise ReductionInputError(
            f"cu_seqlens={whole} must start at 0, never decrease and end at the number of "
            f"packed tokens ({total_tokens})"
        )
    return lengths


def _owner_ids(counts: Sequence[int], device: torch.device) -> Tensor:
    """[sum(counts)] id ``i`` repeated ``counts[i]`` times (token -> sequence, sequence -> group).

    The counts tensor is built as int64 explicitly: ``torch.tensor([])`` would be
    float32, which ``repeat_interleave`` rejects, and an empty microbatch is valid.
    """
    return torch.repeat_interleave(
        torch.arange(len(counts), device=device),
        torch.tensor(counts, dtype=torch.long, device=device),
    )


def checked_group_sizes(group_sizes: GroupSizes, n_sequences: int) -> list[int]:
    """``group_sizes`` as ints, checked to be whole, >= 1 and to tile ``n_sequences``.

    The one check of prompt groups, shared by the reduction and the microbatch
    splitter; ``[]`` is valid for a microbatch without sequences.
    """
    if isinstance(group_sizes, Tensor):
        if group_sizes.dim() != 1:
            raise ReductionInputError(
                f"group_sizes must be 1-D (one size per prompt group), got shape "
                f"{tuple(group_sizes.shape)}"
            )
        given: list[object] = group_sizes.tolist()
    else:
        given = list(group_sizes)
    sizes = [_whole(v) for v in given]
    if any(size is None or size < 1 for size in sizes):
        raise ReductionInputError(f"group_sizes={given} must all be whole numbers >= 1")
    counts = [size for size in sizes if size is not None]
    if sum(counts) != n_sequences:
        raise ReductionInputError(
            f"group_sizes={counts} sum to {sum(counts)} but the batch holds {n_sequences} "
            "sequences; groups must tile the batch (a group is never split)"
        )
    return counts


def _whole(value: object) -> int | None:
    """``value`` as an int if it is a whole number (``2`` or ``2.0``), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    return operator.index(value) if isinstance(value, SupportsIndex) else None


def _check_divisor(mode: PolicyGradientMode, divisor: float | None) -> float | None:
    if mode is not PolicyGradientMode.CONSTANT:
        if divisor is not None:
            raise ReductionConfigError(
                f"divisor={divisor!r} is only valid with mode 'constant', not {mode.value!r}"
            )
        return None
    if divisor is None or isinstance(divisor, bool):
        raise ReductionConfigError(
            f"mode 'constant' needs a divisor (the length budget C), got {divisor!r}"
        )
    value = float(divisor)
    if not math.isfinite(value) or value <= 0:
        raise ReductionConfigError(f"divisor must be positive and finite, got {divisor!r}")
    return value


class PolicyGradientReduction:
    """One of the four policy-gradient reductions, as a term's loss and normalizer.

    ``aggregate`` gives a microbatch's local mean (or sum), ``normalizer`` its
    local normalizer, ``contract`` the canonical string ranks compare, and
    ``term(name)`` the :class:`LossTerm` that ties them together.
    """

    def __init__(
        self,
        mode: PolicyGradientMode | str,
        divisor: float | None = None,
    ) -> None:
        try:
            self.mode = PolicyGradientMode(mode)
        except ValueError:
            valid = ", ".join(repr(m.value) for m in PolicyGradientMode)
            raise ReductionConfigError(f"mode={mode!r} is not one of {valid}") from None
        self.divisor = _check_divisor(self.mode, divisor)

    def __repr__(self) -> str:
        return f"PolicyGradientReduction({self.contract!r})"

    @property
    def contract(self) -> str:
        """``mean:<mode>`` (``mean:constant:divisor=<C>``): what ranks must agree on."""
        return self.contract_for("mean")

    def contract_for(self, reduction: Literal["mean", "sum"]) -> str:
        """The contract of this reduction used as a ``reduction`` term."""
        text = f"{reduction}:{self.mode.value}"
        if self.divisor is not None:
            c = self.divisor
            text += f":divisor={int(c)}" if c.is_integer() else f":divisor={c!r}"
        return text

    def term(self, name: str, reduction: Literal["mean", "sum"] = "mean") -> LossTerm:
        """A :class:`LossTerm` named ``name`` whose normalizer is :meth:`normalizer`.

        Its loss must be :meth:`aggregate` with ``local_mean=True`` for a mean
        term and ``local_mean=False`` for a sum term.
        """
        from lossreduce.trainer_worker.reduction import LossTerm

        return LossTerm(name, self.normalizer, reduction, contract=self.contract_for(reduction))

    def aggregate(
        self,
        loss: Tensor,
        loss_mask: Tensor,
        *,
        denominator_mask: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        group_sizes: GroupSizes | None = None,
        local_mean: bool = True,
        token_penalty: Tensor | None = None,
    ) -> Tensor:
        """The microbatch's local mean (``local_mean=True``) or local sum, 0-d.

        ``loss``, ``loss_mask`` and ``denominator_mask`` are ``[B, T]`` or
        packed ``[total_tokens]`` (then ``cu_seqlens`` ``[B + 1]`` is needed);
        ``group_sizes`` (``prompt_mean`` only) lists the responses per prompt.
        ``token_penalty`` folds a per-token penalty into the token loss; that
        is exact only in ``token_mean`` and rejected otherwise.
        """
        if loss.shape != loss_mask.shape:
            raise ReductionInputError(
                f"loss has shape {tuple(loss.shape)} but loss_mask has shape "
                f"{tuple(loss_mask.shape)}; they must match"
            )
        if token_penalty is not None:
            if self.mode is not PolicyGradientMode.TOKEN_MEAN:
                raise ReductionConfigError(
                    f"token_penalty cannot be folded into a {self.mode.value!r} policy-gradient "
                    f"term: it would be normalized per {self._unit()} instead of per token, so its "
                    "weight would depend on response lengths and batch composition. Give it its "
                    "own term with its own normalizer, e.g. "
                    "PolicyGradientReduction('token_mean').term('distill')"
                )
            if token_penalty.shape != loss.shape:
                raise ReductionInputError(
                    f"token_penalty has shape {tuple(token_penalty.shape)} but loss has shape "
                    f"{tuple(loss.shape)}; they must match"
                )
            loss = zero_masked(loss, loss_mask) + zero_masked(token_penalty, loss_mask)
        numerator, count = self._reduce(loss, loss_mask, denominator_mask, cu_seqlens, group_sizes)
        if local_mean and not _FORCE_LOCAL_SUM.get():
            # A microbatch without active units has numerator 0: 0 / 1, never 0 / 0.
            return numerator / count.to(numerator.dtype).clamp(min=1)
        return numerator

    def normalizer(self, data: Mapping[str, Tensor]) -> Tensor:
        """The microbatch's local normalizer (active units), a float64 0-d tensor.

        Reads ``loss_mask`` and, where present, ``denominator_mask``,
        ``cu_seqlens`` and ``group_sizes`` from ``data``.
        """
        if "loss_mask" not in data:
            raise ReductionInputError(
                f"the normalizer of {self.contract!r} needs data['loss_mask']; the data holds "
                f"{sorted(data)}"
            )
        mask = data["loss_mask"]
        zeros = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
        _, count = self._reduce(
            zeros,
            mask,
            data.get("denominator_mask"),
            data.get("cu_seqlens"),
            data.get("group_sizes"),
        )
        return count.to(torch.float64)

    def _unit(self) -> str:
        return {
            PolicyGradientMode.TOKEN_MEAN: "token",
            PolicyGradientMode.SEQ_MEAN: "sequence",
            PolicyGradientMode.PROMPT_MEAN: "prompt group",
            PolicyGradientMode.CONSTANT: "sequence",
        }[self.mode]

    def _reduce(
        self,
        loss: Tensor,
        loss_mask: Tensor,
        denominator_mask: Tensor | None,
        cu_seqlens: Tensor | None,
        group_sizes: GroupSizes | None,
    ) -> tuple[Tensor, Tensor]:
        """(local numerator with grad, local count of active units)."""
        layout = _layout(loss_mask, cu_seqlens)
        m = loss_mask.bool()
        if denominator_mask is None:
            d = m
        else:
            if denominator_mask.shape != loss_mask.shape:
                raise ReductionInputError(
                    f"denominator_mask has shape {tuple(denominator_mask.shape)} but loss_mask "
                    f"has shape {tuple(loss_mask.shape)}; they must match"
                )
            d = denominator_mask.bool()
            outside = int((m & ~d).sum())
            if outside:
                raise ReductionInputError(
                    f"loss_mask has {outside} tokens outside denominator_mask; the denominator "
                    "mask (pre-rejection tokens) must cover every token whose loss counts"
                )
        if group_sizes is None and self.mode is PolicyGradientMode.PROMPT_MEAN:
            raise ReductionInputError(
                "mode 'prompt_mean' needs group_sizes (responses per prompt group)"
            )
        # Sums and counts in at least float32: bfloat16 cannot even count past 256.
        loss = loss.to(torch.promote_types(loss.dtype, torch.float32))
        # Select before summing: a NaN/inf loss at a masked token never enters the sum.
        masked = torch.where(m, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
        if self.mode is PolicyGradientMode.TOKEN_MEAN:
            return masked.sum(), d.sum()
        seq_num = layout.per_sequence(masked)  # [B]
        seq_den = layout.per_sequence(d.to(loss.dtype))  # [B] = D_i
        if self.mode is PolicyGradientMode.CONSTANT:
            assert self.divisor is not None
            return seq_num.sum() / self.divisor, (seq_den > 0).sum()
        if self.mode is PolicyGradientMode.SEQ_MEAN:
            # Inactive sequences have seq_num == 0 (loss_mask is inside d): 0 / 1.
            return (seq_num / seq_den.clamp(min=1)).sum(), (seq_den > 0).sum()
        assert group_sizes is not None
        sizes = checked_group_sizes(group_sizes, layout.n_sequences)
        group_index = _owner_ids(sizes, loss.device)  # [B]
        n_groups = len(sizes)
        group_num = torch.zeros(n_groups, dtype=loss.dtype, device=loss.device).index_add(
            0, group_index, seq_num
        )  # [G]
        group_den = torch.zeros(n_groups, dtype=loss.dtype, device=loss.device).index_add(
            0, group_index, seq_den
        )  # [G]
        return (group_num / group_den.clamp(min=1)).sum(), (group_den > 0).sum()
