"""Which SkyRL options lossreduce's policy and critic workers honour, and the refusal of
the others.

Everything here reads SkyRL's config objects by attribute and imports no SkyRL,
so the rules are unit-tested without it. :func:`config_problems` lists every
option of a launch that lossreduce cannot honour, naming the option, its value,
what is allowed and why; :func:`raise_problems` raises them all at once in one
:class:`~lossreduce.errors.ReductionConfigError`. The entrypoint checks them in
the driver before Ray starts, and every policy and critic worker checks them again
when it is built.
"""

from __future__ import annotations

from typing import Any

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.integrations.skyrl.settings import SkyRLReductionSettings
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode

__all__ = [
    "REFUSED_POLICY_LOSSES",
    "SKYRL_EQUIVALENT",
    "config_problems",
    "raise_problems",
]

SKYRL_EQUIVALENT: dict[PolicyGradientMode, str] = {
    PolicyGradientMode.TOKEN_MEAN: "token_mean",
    PolicyGradientMode.SEQ_MEAN: "sequence_mean",
    PolicyGradientMode.PROMPT_MEAN: "prompt_mean",
    PolicyGradientMode.CONSTANT: "seq_mean_token_sum_norm",
}
"""SkyRL's ``algorithm.loss_reduction`` that weighs what each mode weighs. SkyRL counts
fully masked responses (and empty prompt groups) in its denominators, lossreduce does
not; otherwise they agree. A launch may leave SkyRL's default (``token_mean``) or set
the mode's counterpart; anything else would be silently replaced and is refused."""

_SKYRL_DEFAULT_REDUCTION = "token_mean"

REFUSED_POLICY_LOSSES: dict[str, str] = {
    "cross_entropy": (
        "its per-token loss is -log pi(y) without the advantage, and the policy loss is "
        "divided through the advantages (SkyRL pre-scales them, lossreduce scales them by "
        "w_i / N), so it would stay a plain sum over tokens that no mode divides"
    ),
    "clip_cov": (
        "it centres advantages and log-probabilities on their mean over one micro-batch's "
        "tokens and draws the tokens it clips from that micro-batch, inside the forward: "
        "which tokens train depends on how the mini-batch is split, and the covariance "
        "bounds compare advantages that the normalizer has already divided"
    ),
    "kl_cov": (
        "it ranks one micro-batch's tokens by the covariance of advantages and "
        "log-probabilities, inside the forward, and penalizes its top share: which tokens "
        "are penalized depends on how the mini-batch is split, and the ranking compares "
        "advantages that the normalizer has already divided"
    ),
}
"""SkyRL 0.4 policy losses whose loss no global normalizer makes the formula of a mode,
and why. Every other registered loss (``regular``, ``dual_clip``, ``gspo``, ``cispo``,
``sapo``, ``dppo``, ``rollout_is``, ``importance_sampling``, and a custom one registered
with ``PolicyLossRegistry``) gives a masked sum of per-token losses that are positively
homogeneous in the token's advantage (``l(c * A) = c * l(A)`` for ``c > 0``), which is
what SkyRL's own pre-scaling of the advantages already requires."""


def config_problems(cfg: Any, settings: SkyRLReductionSettings) -> list[str]:
    """Why SkyRL's ``cfg.trainer`` (a ``TrainerConfig``) cannot run with ``settings``."""
    problems: list[str] = []
    strategy = getattr(cfg, "strategy", "fsdp")
    if strategy != "fsdp":
        problems.append(
            f"trainer.strategy={strategy!r}: lossreduce's policy worker is SkyRL's FSDP "
            "worker; SkyRL's Megatron worker takes its KL and entropy terms as means over "
            "each micro-batch inside Megatron's loss function, where no global normalizer "
            "reaches them, so its update would depend on the micro-batch split"
        )
    algorithm = cfg.algorithm
    loss = str(algorithm.policy_loss_type)
    if loss in REFUSED_POLICY_LOSSES:
        problems.append(
            f"trainer.algorithm.policy_loss_type={loss!r}: {REFUSED_POLICY_LOSSES[loss]}"
        )
    problems += _reduction_problems(algorithm, settings)
    return problems


def _reduction_problems(algorithm: Any, settings: SkyRLReductionSettings) -> list[str]:
    reduction = str(algorithm.loss_reduction)
    if reduction == "token_mean_legacy":
        return [
            "trainer.algorithm.loss_reduction='token_mean_legacy': a mean of micro-batch "
            "token means, which depends on trainer.micro_train_batch_size_per_gpu; "
            f"lossreduce's mode {settings.mode.value!r} replaces it, so leave SkyRL's "
            f"default {_SKYRL_DEFAULT_REDUCTION!r}"
        ]
    same = SKYRL_EQUIVALENT[settings.mode]
    if reduction not in {_SKYRL_DEFAULT_REDUCTION, same}:
        return [
            f"trainer.algorithm.loss_reduction={reduction!r} would be silently replaced by "
            f"lossreduce's mode {settings.mode.value!r}; set trainer.algorithm.loss_reduction="
            f"{same!r} (the same in SkyRL) or leave SkyRL's default, or set "
            f"trainer.lossreduce.mode to the mode you mean"
        ]
    if reduction == "seq_mean_token_sum_norm" and algorithm.max_seq_len is not None:
        divisor = settings.divisor
        if divisor is None or float(algorithm.max_seq_len) != divisor:
            return [
                f"trainer.algorithm.max_seq_len={algorithm.max_seq_len!r} is SkyRL's "
                f"seq_mean_token_sum_norm divisor, but trainer.lossreduce.divisor={divisor!r}; "
                "set them equal"
            ]
    return []


def raise_problems(problems: list[str], settings: SkyRLReductionSettings) -> None:
    """Raise one :class:`ReductionConfigError` naming every problem, if there is any."""
    if problems:
        raise ReductionConfigError(
            f"lossreduce's SkyRL workers (job {settings.job!r}, mode "
            f"{settings.mode.value!r}) cannot honour: {'; '.join(problems)}",
            job=settings.job,
            group=settings.group,
        )
