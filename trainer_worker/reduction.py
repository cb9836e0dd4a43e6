"""Loss terms and reductions: what a loss is made of and how each part is normalized.

A :class:`LossReduction` pairs a ``loss_fn`` with one or more named
:class:`LossTerm` terms. For a microbatch ``b`` each term yields a local value
``v_b`` (from ``loss_fn``) and a local normalizer ``n_b`` (from its
``normalizer_fn``); with the global normalizer ``N`` (the sum of ``n_b`` over
every rank and microbatch) its share of the global loss is

- mean term: ``v_b * n_b / N`` (``v_b`` is the local mean),
- sum term: ``v_b / N`` (``v_b`` is the local numerator),

and the total loss is the sum of the shares (``docs/reduction-semantics.md``).
:func:`scaled_loss` computes exactly that; :func:`local_partials` the per-term
partial a rank sends for reduction.

A bad term or reduction definition raises
:class:`~lossreduce.errors.ReductionConfigError`; a ``loss_fn`` or normalizer
returning the wrong terms or shapes raises
:class:`~lossreduce.errors.ReductionInputError` (both also ``ValueError``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from lossreduce.errors import (
    InconsistentNormalizerError,
    ReductionConfigError,
    ReductionInputError,
)
from lossreduce.rules import check_term_name

__all__ = [
    "Batch",
    "InconsistentNormalizerError",
    "LocalPartials",
    "LossFn",
    "LossReduction",
    "LossTerm",
    "NormalizerFn",
    "ReductionKind",
    "check_local_consistency",
    "floats_of",
    "local_partials",
    "scaled_loss",
]

Batch = Mapping[str, Tensor]
"""A batch or microbatch: named tensors (``loss_mask``, ``cu_seqlens``, ...)."""

NormalizerFn = Callable[[Batch], Tensor]
"""Microbatch -> its local normalizer ``n_b >= 0`` (a 0-d tensor)."""

LossFn = Callable[[Tensor, Batch], Tensor | Mapping[str, Tensor]]
"""(model output, microbatch) -> one term's 0-d value, or a mapping name -> value."""

ReductionKind = Literal["mean", "sum"]


@dataclass(frozen=True)
class LossTerm:
    """One named part of a loss with its own normalizer.

    ``contract`` is what ranks compare for agreement (defaults to ``reduction``;
    :meth:`PolicyGradientReduction.term` sets e.g. ``mean:prompt_mean``).
    """

    name: str
    normalizer_fn: NormalizerFn
    reduction: ReductionKind = "mean"
    contract: str = field(default="")

    def __post_init__(self) -> None:
        problem = check_term_name(self.name)
        if problem is not None:
            raise ReductionConfigError(f"LossTerm: {problem}")
        if self.reduction not in ("mean", "sum"):
            raise ReductionConfigError(
                f"LossTerm {self.name!r}: reduction={self.reduction!r} must be 'mean' or 'sum'"
            )
        if not self.contract:
            object.__setattr__(self, "contract", self.reduction)
        elif not self.contract.startswith(f"{self.reduction}:") and self.contract != self.reduction:
            raise ReductionConfigError(
                f"LossTerm {self.name!r}: contract {self.contract!r} does not describe a "
                f"{self.reduction!r} term (it must start with '{self.reduction}:')"
            )


class LossReduction:
    """A loss function and the terms it returns, each with its own normalizer.

    ``loss_fn(output, microbatch)`` returns a 0-d tensor when there is one
    term, or a mapping from every term name to its 0-d value.
    """

    def __init__(self, loss_fn: LossFn, terms: Sequence[LossTerm]) -> None:
        if not terms:
            raise ReductionConfigError("LossReduction needs at least one LossTerm")
        names = [t.name for t in terms]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ReductionConfigError(
                f"LossReduction: term names must be unique; repeated: {duplicates}"
            )
        self.loss_fn = loss_fn
        self.terms: tuple[LossTerm, ...] = tuple(terms)

    @classmethod
    def mean(
        cls, loss_fn: LossFn, normalizer_fn: NormalizerFn, name: str = "loss"
    ) -> LossReduction:
        """One mean term: ``loss_fn`` returns the local mean (the callback contract)."""
        return cls(loss_fn, [LossTerm(name, normalizer_fn, "mean")])

    @classmethod
    def sum(cls, loss_fn: LossFn, normalizer_fn: NormalizerFn, name: str = "loss") -> LossReduction:
        """One sum term: ``loss_fn`` returns the local numerator."""
        return cls(loss_fn, [LossTerm(name, normalizer_fn, "sum")])

    def __repr__(self) -> str:
        return f"LossReduction({', '.join(f'{t.name}={t.contract}' for t in self.terms)})"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.terms)

    @property
    def contracts(self) -> dict[str, str]:
        """Term name -> contract, sent with the partials for the agreement check."""
        return {t.name: t.contract for t in self.terms}

    def losses(self, output: Tensor, microbatch: Batch) -> dict[str, Tensor]:
        """Run ``loss_fn`` and return every term's 0-d value by name."""
        result = self.loss_fn(output, microbatch)
        if isinstance(result, Tensor):
            if len(self.terms) != 1:
                raise ReductionInputError(
                    f"loss_fn returned one tensor but the reduction has {len(self.terms)} terms "
                    f"{list(self.names)}; return a mapping from each term name to its value"
                )
            values = {self.terms[0].name: result}
        else:
            values = dict(result)
            missing = [n for n in self.names if n not in values]
            extra = sorted(set(values) - set(self.names))
            if missing or extra:
                raise ReductionInputError(
                    f"loss_fn returned terms {sorted(values)} but the reduction declares "
                    f"{list(self.names)} (missing: {missing}, extra: {extra})"
                )
        for name, value in values.items():
            if value.dim() != 0:
                raise ReductionInputError(
                    f"loss_fn returned a tensor of shape {tuple(value.shape)} for term {name!r}; "
                    "each term's value must be 0-d (a local mean or sum)"
                )
        return {n: values[n] for n in self.names}

    def normalizers(self, microbatch: Batch) -> dict[str, Tensor]:
        """Every term's local normalizer for ``microbatch`` (float64 0-d)."""
        out: dict[str, Tensor] = {}
        for term in self.terms:
            n = torch.as_tensor(term.normalizer_fn(microbatch)).to(torch.float64)
            if n.dim() != 0:
                raise ReductionInputError(
                    f"the normalizer of term {term.name!r} returned shape {tuple(n.shape)}; "
                    "it must be a 0-d count"
                )
            out[term.name] = n
        return out


@dataclass(frozen=True)
class LocalPartials:
    """A rank's local normalizers: per microbatch, and their per-term sum (its partial)."""

    per_microbatch: tuple[dict[str, Tensor], ...]
    partials: dict[str, Tensor]


def floats_of(values: Sequence[Tensor]) -> list[float]:
    """One-element tensors (any shape, any device) as doubles, with one
    device-to-host copy for all of them: a GPU syncs once, not once per value."""
    if not values:
        return []
    device = values[0].device
    # [values] float64: exact for the float and integer dtypes a count comes in.
    stacked = torch.stack(
        [v.detach().reshape(()).to(device=device, dtype=torch.float64) for v in values]
    )
    return [float(v) for v in stacked.tolist()]


def local_partials(reduction: LossReduction, microbatches: Sequence[Batch]) -> LocalPartials:
    """Compute every term's local normalizer over all of a rank's microbatches.

    The partial of a term is the sum of its microbatch normalizers (float64;
    counts are integers, so the sum is exact). A rank without microbatches
    still has a partial: 0.
    """
    per_mb = tuple(reduction.normalizers(mb) for mb in microbatches)
    partials = {
        name: torch.stack([n[name] for n in per_mb]).sum()
        if per_mb
        else torch.zeros((), dtype=torch.float64)
        for name in reduction.names
    }
    return LocalPartials(per_microbatch=per_mb, partials=partials)


def scaled_loss(
    reduction: LossReduction,
    losses: Mapping[str, Tensor],
    local_normalizers: Mapping[str, Tensor],
    global_normalizers: Mapping[str, Tensor],
) -> tuple[Tensor, dict[str, Tensor]]:
    """This microbatch's share of the global loss: (total, share per term).

    mean: ``v_b * n_b / N``; sum: ``v_b / N``. The ratio is formed in float64
    and cast to the loss dtype, so a zero ``n_b`` gives exactly 0.
    """
    shares: dict[str, Tensor] = {}
    for term in reduction.terms:
        value = losses[term.name]
        n_global = global_normalizers[term.name].to(device=value.device, dtype=torch.float64)
        if term.reduction == "mean":
            n_local = local_normalizers[term.name].to(device=value.device, dtype=torch.float64)
            scale = n_local / n_global
        else:
            scale = 1.0 / n_global
        shares[term.name] = value * scale.to(value.dtype)
    total = torch.stack(list(shares.values())).sum()
    return total, shares


def check_local_consistency(
    reduction: LossReduction,
    means: Mapping[str, Tensor],
    sums: Mapping[str, Tensor],
    local_normalizers: Mapping[str, Tensor],
    *,
    where: str,
) -> None:
    """Raise :class:`InconsistentNormalizerError` where a mean term's
    ``mean * n_b`` is not its ``sum`` (relative tolerance of the loss dtype)."""
    for term in reduction.terms:
        if term.reduction != "mean":
            continue
        mean = float(means[term.name].detach())
        total = float(sums[term.name].detach())
        n = float(local_normalizers[term.name])
        eps = torch.finfo(means[term.name].dtype).eps
        tolerance = 64 * eps * max(abs(total), abs(mean * n), 1.0)
        if not math.isclose(mean * n, total, rel_tol=0.0, abs_tol=tolerance):
            raise InconsistentNormalizerError(
                f"{where} term {term.name!r}: local mean {mean!r} * local normalizer {n!r} = "
                f"{mean * n!r}, but the local sum is {total!r}; the loss and its normalizer "
                "count different units (e.g. different masks)"
            )
