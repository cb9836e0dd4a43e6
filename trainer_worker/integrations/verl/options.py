"""Which verl options the lossreduce actor honours, and the refusal of the others at start.

Everything here reads verl's config objects by attribute and imports no verl,
so the rules are unit-tested without it. Each refusal names the verl option,
its value and why, all at once in one :class:`~lossreduce.errors.ReductionConfigError`.
"""

from __future__ import annotations

from typing import Any

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.integrations.verl.policy_losses import (
    POLICY_LOSSES,
    policy_loss,
    policy_option,
)
from lossreduce.trainer_worker.integrations.verl.settings import VerlReductionSettings
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode, PolicyGradientReduction

__all__ = [
    "SUPPORTED_STRATEGIES",
    "VERL_EQUIVALENT",
    "actor_problems",
    "critic_problems",
    "engine_problems",
    "raise_problems",
]

SUPPORTED_STRATEGIES = frozenset({"fsdp", "fsdp2"})
"""verl engine strategies tested with this worker (Megatron and VeOmni are not)."""

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


def engine_problems(engine_config: Any, role: str = "actor") -> list[str]:
    """Why the engine config of ``role`` (actor or critic) cannot be honoured (empty when
    it can)."""
    strategy = getattr(engine_config, "strategy", None)
    if strategy not in SUPPORTED_STRATEGIES:
        return [
            f"{role}.strategy={strategy!r}: only verl's FSDP engines "
            f"({', '.join(sorted(SUPPORTED_STRATEGIES))}) are tested with lossreduce"
        ]
    return []


def actor_problems(actor: Any, settings: VerlReductionSettings) -> list[str]:
    """Why the ``ActorConfig`` cannot be honoured with ``settings`` (empty when it can)."""
    problems = _policy_loss_problems(actor.policy_loss, settings)
    problems += _aggregation_problems("actor", actor, settings.reduction)
    if actor.get("use_prefix_grouper", False):
        problems.append("actor.use_prefix_grouper=True: its shared-prefix layout is not supported")
    return problems


def critic_problems(critic: Any, settings: VerlReductionSettings) -> list[str]:
    """Why the ``CriticConfig`` cannot be honoured with ``settings`` (empty when it can)."""
    return _aggregation_problems("critic", critic, settings.critic_reduction)


def _policy_loss_problems(config: Any, settings: VerlReductionSettings) -> list[str]:
    name = config.get("loss_mode", "vanilla")
    loss = policy_loss(name)
    if loss is None:
        return [
            f"actor.policy_loss.loss_mode={name!r} is not one of verl 0.9.1's policy losses "
            f"({', '.join(POLICY_LOSSES)}): lossreduce weighs rows through the per-token loss "
            "those multiply by rollout_is_weights, and a loss it does not know need not be "
            "linear in it"
        ]
    problems = [p for p in [loss.mode_problem(settings.mode)] if p is not None]
    for key in ("clip_cov_ratio", "kl_cov_ratio"):
        if name == key.removesuffix("_ratio") and not policy_option(config, key) > 0:
            problems.append(
                f"actor.policy_loss.{key}={config.get(key, None)!r}: verl needs a share > 0"
            )
    if name == "dro":
        beta = config.get("dro_beta", None)
        if beta is None or not beta > 0:
            problems.append(f"actor.policy_loss.dro_beta={beta!r}: DRO needs a penalty > 0")
    if name == "bypass_mode":
        correction = config.get("rollout_correction", None)
        # verl's PolicyLossConfig defaults it (RolloutCorrectionConfig: ppo_clip).
        loss_type = "ppo_clip" if correction is None else correction.get("loss_type", "ppo_clip")
        if loss_type not in {"ppo_clip", "reinforce"}:
            problems.append(
                f"actor.policy_loss.rollout_correction.loss_type={loss_type!r}: bypass_mode "
                "runs 'ppo_clip' or 'reinforce'"
            )
    return problems


def _aggregation_problems(role: str, config: Any, reduction: PolicyGradientReduction) -> list[str]:
    """verl's ``loss_agg_mode`` and ``loss_scale_factor`` of ``role`` against lossreduce's
    ``reduction`` for it: verl's default or the same aggregation, nothing that would be
    silently replaced."""
    problems: list[str] = []
    mode_key = "mode" if role == "actor" else "critic_mode"
    divisor_key = "DIVISOR" if role == "actor" else "CRITIC_DIVISOR"
    agg = config.loss_agg_mode
    same = VERL_EQUIVALENT[reduction.mode]
    if agg not in {_VERL_DEFAULT_AGG, same}:
        if same in {None, _VERL_DEFAULT_AGG}:
            fix = f"leave it at verl's default {_VERL_DEFAULT_AGG!r}"
        else:
            fix = f"set {same!r} (the same in verl) or leave verl's default {_VERL_DEFAULT_AGG!r}"
        problems.append(
            f"{role}.loss_agg_mode={agg!r} would be silently replaced by lossreduce's "
            f"{mode_key} {reduction.mode.value!r}; {fix}"
        )
    scale = config.loss_scale_factor
    if scale is not None and (
        reduction.mode is not PolicyGradientMode.CONSTANT or float(scale) != reduction.divisor
    ):
        problems.append(
            f"{role}.loss_scale_factor={scale!r}: lossreduce's constant divisor is "
            f"{reduction.divisor!r} ({mode_key} {reduction.mode.value!r}); set "
            f"LOSSREDUCE_{divisor_key} instead"
        )
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
