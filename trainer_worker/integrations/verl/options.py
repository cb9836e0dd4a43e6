"""Which verl options the lossreduce actor honours, and the refusal of the others at start.

Everything here reads verl's config objects by attribute and imports no verl,
so the rules are unit-tested without it. Each refusal names the verl option,
its value and why, all at once in one :class:`~lossreduce.errors.ReductionConfigError`.
"""

from __future__ import annotations

from typing import Any

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.integrations.verl.settings import VerlReductionSettings
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode

__all__ = [
    "SUPPORTED_LOSS_MODES",
    "SUPPORTED_STRATEGIES",
    "VERL_EQUIVALENT",
    "actor_problems",
    "engine_problems",
    "raise_problems",
]

SUPPORTED_STRATEGIES = frozenset({"fsdp", "fsdp2"})
"""verl engine strategies tested with this worker (Megatron and VeOmni are not)."""

SUPPORTED_LOSS_MODES = frozenset({"vanilla"})
"""verl policy losses whose per-token loss is scaled by ``rollout_is_weights`` right
before its aggregation: the seam this worker weighs rows through (tested)."""

VERL_EQUIVALENT: dict[PolicyGradientMode, str | None] = {
    PolicyGradientMode.TOKEN_MEAN: "token-mean",
    PolicyGradientMode.SEQ_MEAN: "seq-mean-token-mean",
    PolicyGradientMode.CONSTANT: "seq-mean-token-sum-norm",
    PolicyGradientMode.PROMPT_MEAN: None,
}
"""The verl ``loss_agg_mode`` that means what each mode means (``prompt_mean`` has
none). A run may leave verl's default (``token-mean``) or set this one; any other
value would be silently overridden, so it is refused."""

_VERL_DEFAULT_AGG = "token-mean"


def engine_problems(engine_config: Any) -> list[str]:
    """Why the engine config cannot be honoured (empty when it can)."""
    strategy = getattr(engine_config, "strategy", None)
    if strategy not in SUPPORTED_STRATEGIES:
        return [
            f"actor.strategy={strategy!r}: only verl's FSDP engines "
            f"({', '.join(sorted(SUPPORTED_STRATEGIES))}) are tested with lossreduce"
        ]
    return []


def actor_problems(actor: Any, settings: VerlReductionSettings) -> list[str]:
    """Why the ``ActorConfig`` cannot be honoured with ``settings`` (empty when it can)."""
    problems: list[str] = []
    loss_mode = actor.policy_loss.get("loss_mode", "vanilla")
    if loss_mode not in SUPPORTED_LOSS_MODES:
        problems.append(
            f"actor.policy_loss.loss_mode={loss_mode!r}: lossreduce weighs rows through the "
            f"per-token loss of {sorted(SUPPORTED_LOSS_MODES)} only"
        )
    agg = actor.loss_agg_mode
    same = VERL_EQUIVALENT[settings.mode]
    if agg not in {_VERL_DEFAULT_AGG, same}:
        if same in {None, _VERL_DEFAULT_AGG}:
            fix = f"leave it at verl's default {_VERL_DEFAULT_AGG!r}"
        else:
            fix = f"set {same!r} (the same in verl) or leave verl's default {_VERL_DEFAULT_AGG!r}"
        problems.append(
            f"actor.loss_agg_mode={agg!r} would be silently replaced by lossreduce's mode "
            f"{settings.mode.value!r}; {fix}"
        )
    scale = actor.loss_scale_factor
    if scale is not None and (
        settings.mode is not PolicyGradientMode.CONSTANT or float(scale) != settings.divisor
    ):
        problems.append(
            f"actor.loss_scale_factor={scale!r}: lossreduce's constant divisor is "
            f"{settings.divisor!r} (mode {settings.mode.value!r}); set LOSSREDUCE_DIVISOR instead"
        )
    if actor.get("use_prefix_grouper", False):
        problems.append("actor.use_prefix_grouper=True: its shared-prefix layout is not supported")
    return problems


def raise_problems(problems: list[str], settings: VerlReductionSettings) -> None:
    """Raise one :class:`ReductionConfigError` naming every problem, if there is any."""
    if problems:
        raise ReductionConfigError(
            f"lossreduce's verl actor (job {settings.job!r}, mode {settings.mode.value!r}) "
            f"cannot honour: {'; '.join(problems)}",
            job=settings.job,
            group=settings.group,
        )
