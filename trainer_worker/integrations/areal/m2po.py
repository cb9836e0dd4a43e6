"""AReaL's M2PO mask decided over the whole optimizer step (setting ``m2po='global'``).

AReaL 1.0.4 applies M2PO (``actor.m2_threshold``) inside its loss function,
to each micro-batch on its own (``_apply_m2po_masking``), so which tokens
train depends on how the step is split over ranks and micro-batches, and the
token counts its engine weighs micro-batches with include the tokens M2PO then
drops. With ``m2po='global'`` the LossReduce actor instead

1. computes every active token's ``m2 = (old_logp - prox_logp)^2`` before the
   forward (``prox_logp`` is an input when ``prox_logp_method`` is
   ``recompute`` or ``metrics``);
2. reduces one cut-off over the data-parallel group through the normalizer
   backend (:func:`lossreduce.trainer_worker.m2po.global_m2po_cutoff`: the
   same on every rank, equal to the single-process rule over the whole step);
3. drops the tokens above it from the batch's ``loss_mask``, so the
   normalizers and AReaL's own per-micro-batch counts see only the kept tokens
   (``D_i`` is a response's kept tokens; a response with none is inactive);
4. turns AReaL's per-micro-batch masking off for the loss call: after the
   global cut a micro-batch's own mean ``m2`` may still be above the
   threshold, and it would cut again.

``m2po='local'`` keeps AReaL's per-micro-batch mask as it is (split-dependent;
docs/frameworks/areal.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.m2po import M2POCut, global_m2po_cutoff
from lossreduce.trainer_worker.normalizers import GlobalNormalizer

__all__ = [
    "GROUP_SUFFIX",
    "THRESHOLD_KEYWORD",
    "GlobalMask",
    "RoundPlace",
    "global_mask",
    "loss_threshold",
    "m2po_config_problems",
    "without_local_m2po",
]

GROUP_SUFFIX = ".m2po"
"""The cut-off's rounds reduce in a group of their own, ``<group>.m2po`` (their steps
are ``step * M2PO_STEP_STRIDE + round``, a numbering of their own)."""

LossFn = Callable[..., Tensor]

THRESHOLD_KEYWORD = "m2_threshold"
"""The keyword of AReaL's ``grpo_loss_fn`` that turns its per-micro-batch M2PO on."""

# AReaL's prox_logp methods that approximate prox_logp from the current forward
# (areal.utils.constants.ProxLogpMethod.skips_forward_pass): no prox_logp before it.
_FORWARD_PROX_METHODS = ("loglinear",)


def m2po_config_problems(config: Any, m2po: str) -> list[str]:
    """Why an AReaL ``PPOActorConfig`` cannot have a global M2PO mask (empty: it can).

    The mask is decided before the forward from ``prox_logp``; a method that
    approximates ``prox_logp`` from the forward's own log-probabilities leaves
    nothing to decide it from.
    """
    threshold = getattr(config, "m2_threshold", None)
    if threshold is None or m2po != "global":
        return []
    method = str(getattr(config, "prox_logp_method", "recompute"))
    if getattr(config, "use_decoupled_loss", False) and method in _FORWARD_PROX_METHODS:
        return [
            f"m2_threshold={threshold} with use_decoupled_loss=True and "
            f"prox_logp_method={method!r}: AReaL skips the proximal forward and "
            "approximates prox_logp from the training forward itself, so the M2PO mask "
            "cannot be decided over the whole step before the forward (m2po='global'); "
            "use prox_logp_method 'recompute' or 'metrics', or LOSSREDUCE_M2PO=local for "
            "AReaL's per-micro-batch mask, which depends on the micro-batch split"
        ]
    return []


def loss_threshold(loss_fn: LossFn) -> float | None:
    """The M2PO threshold AReaL's loss function would apply (None: no M2PO).

    ``ppo_update`` passes ``functools.partial(grpo_loss_fn, ..., m2_threshold=...)``.
    """
    if isinstance(loss_fn, functools.partial):
        value = loss_fn.keywords.get(THRESHOLD_KEYWORD)
        return None if value is None else float(value)
    return None


def without_local_m2po(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` with AReaL's per-micro-batch M2PO turned off (the global mask replaces it)."""
    if not isinstance(loss_fn, functools.partial) or THRESHOLD_KEYWORD not in loss_fn.keywords:
        return loss_fn
    keywords = {**loss_fn.keywords, THRESHOLD_KEYWORD: None}
    return functools.partial(loss_fn.func, *loss_fn.args, **keywords)


@dataclass(frozen=True)
class GlobalMask:
    """One optimizer step's batch and loss function under the global M2PO mask."""

    batch: dict[str, Any]  # the step's batch, its loss_mask without the dropped tokens
    loss_fn: LossFn  # AReaL's loss with its per-micro-batch M2PO off
    cut: M2POCut  # the cut-off, kept and active tokens over all ranks, rounds, bytes

    def stats(self) -> dict[str, float]:
        """What the step's stats gain (``lossreduce/m2po/...``)."""
        return {
            "lossreduce/m2po/kept": float(self.cut.kept),
            "lossreduce/m2po/active": float(self.cut.total),
            "lossreduce/m2po/rounds": float(self.cut.rounds),
            "lossreduce/m2po/seconds": self.cut.seconds,
        }


@dataclass(frozen=True)
class RoundPlace:
    """Where a rank's cut-off rounds go: the backend and the names its errors carry."""

    normalizer: GlobalNormalizer  # used by the cut-off's rounds only
    rank: int
    world_size: int
    job: str
    group: str


def global_mask(
    batch: dict[str, Any],
    loss_fn: LossFn,
    configured: float | None,
    place_of: Callable[[], RoundPlace],
    step: int,
) -> GlobalMask | None:
    """The step's global M2PO mask (collective: every data-parallel rank calls it), or
    None when the loss applies no M2PO.

    ``configured`` is ``actor.m2_threshold``; ``place_of`` gives the cut-off's
    backend (made only when there is a cut-off to reduce). Raises :class:`ReductionConfigError`
    when the mask cannot be decided before the forward (no ``prox_logp`` in the
    batch) or AReaL's own mask could not be turned off (a loss function that is
    not AReaL's ``grpo_loss_fn`` partial); raises on every rank, from the
    cut-off's first round, when any rank has a non-finite log-probability at an
    active token.
    """
    threshold = loss_threshold(loss_fn)
    if threshold is None and configured is None:
        return None
    place = place_of()
    if threshold is None:
        if configured is not None and not isinstance(loss_fn, functools.partial):
            raise ReductionConfigError(
                f"job {place.job!r} step {step}: m2_threshold={configured} with m2po='global' "
                f"needs AReaL's grpo_loss_fn (a functools.partial with {THRESHOLD_KEYWORD!r}) "
                f"to turn its per-micro-batch M2PO off, got {loss_fn!r}",
                job=place.job,
                group=place.group,
                step=step,
            )
        return None
    prox = batch.get("prox_logp")
    if not isinstance(prox, Tensor):
        raise ReductionConfigError(
            f"job {place.job!r} step {step}: m2_threshold={threshold} with m2po='global' "
            "decides the M2PO mask before the forward from the batch's prox_logp, but the "
            "batch has none (prox_logp_method 'loglinear' skips its forward); use "
            "prox_logp_method 'recompute' or 'metrics', or m2po='local'",
            job=place.job,
            group=place.group,
            step=step,
        )
    loss_mask = batch["loss_mask"]  # [B, T]
    delta = batch["logprobs"].to(torch.float64) - prox.to(torch.float64)  # [B, T]
    m2 = delta * delta  # [B, T] float64
    active = loss_mask != 0  # [B, T]
    cut = global_m2po_cutoff(
        m2,
        threshold,
        place.normalizer,
        step,
        rank=place.rank,
        world_size=place.world_size,
        mask=active,
        job=place.job,
        group=place.group,
    )
    kept = cut.keep(m2, active)  # [B, T]
    masked = torch.where(kept, loss_mask, torch.zeros_like(loss_mask))
    return GlobalMask({**batch, "loss_mask": masked}, without_local_m2po(loss_fn), cut)
