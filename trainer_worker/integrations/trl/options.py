"""What :class:`~lossreduce.trainer_worker.integrations.trl.LossReduceGRPOTrainer` supports:
the TRL versions it was tested with, its loss terms, each TRL loss type's own division as
a lossreduce mode (and the line saying where a run's mode is another), its reduction
settings as validated from its ``reduction`` argument and ``LOSSREDUCE_*``, the GRPOConfig
options it refuses, and the coordinator actor it refuses to reach outside a Ray cluster.

Imports no TRL, so the version check can run before TRL's own modules load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from packaging.version import Version

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.integrations.run_identity import launcher_run
from lossreduce.trainer_worker.integrations.settings import GRPOReductionSettings
from lossreduce.trainer_worker.integrations.settings_errors import validate_settings
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode, PolicyGradientReduction

__all__ = [
    "CLIPPED",
    "ENTROPY_TERM",
    "KL_TERM",
    "POLICY_TERM",
    "ROW_MEAN",
    "TOKEN_SUM",
    "TRL_TESTED",
    "check_trl_version",
    "division_notice",
    "own_division",
    "reduction_settings",
    "refuse_coordinator_without_ray",
    "refuse_unsupported",
]

TRL_TESTED = (Version("1.16"), Version("1.17"))
"""TRL versions this trainer was tested with: [first, second). It relies on
TRL internals (the ``dapo`` normalization branch, the generation buffer)."""

POLICY_TERM = "pg"
KL_TERM = "kl"
ENTROPY_TERM = "entropy"

# Per-token losses of these loss types share one formula (PPO clipping) and
# differ only in their division, which this trainer replaces by driving TRL's
# token-sum ("dapo") branch; cispo and vespo already end in that branch.
CLIPPED = frozenset({"grpo", "bnpo", "dr_grpo", "dapo", "luspo"})
TOKEN_SUM = frozenset({"cispo", "vespo"})
# TRL computes sapo's per-token loss only in front of its per-sequence-mean branch
# (shared with grpo), which divides row i by its own token count D_i, averages the
# micro-step's B rows and divides by the accumulation steps. The per-token loss
# -sigmoid(tau * (ratio - 1)) * 4 / tau * A is positively homogeneous in A (tau is
# picked by the sign of A), so scaling each row's advantage by D_i * B * GA undoes
# that division for the policy term; the KL term, added to the per-token loss before
# the division, has one scalar beta and cannot be undone per row (refused below).
ROW_MEAN = frozenset({"sapo"})

_OWN_MODE: dict[str, PolicyGradientMode] = {
    "dapo": PolicyGradientMode.TOKEN_MEAN,
    "bnpo": PolicyGradientMode.TOKEN_MEAN,
    "cispo": PolicyGradientMode.TOKEN_MEAN,
    "vespo": PolicyGradientMode.TOKEN_MEAN,
    "grpo": PolicyGradientMode.SEQ_MEAN,
    "sapo": PolicyGradientMode.SEQ_MEAN,
    "dr_grpo": PolicyGradientMode.CONSTANT,
    "luspo": PolicyGradientMode.CONSTANT,
}
_MODE_DIVIDES = {
    PolicyGradientMode.TOKEN_MEAN: "by the step's tokens",
    PolicyGradientMode.SEQ_MEAN: "each completion by its own tokens, then by the step's "
    "completions",
    PolicyGradientMode.PROMPT_MEAN: "each prompt group by its own tokens, then by the step's "
    "groups",
    PolicyGradientMode.CONSTANT: "by {divisor}the step's completions",
}


def check_trl_version(version: str) -> None:
    """Raise ImportError unless ``version`` is in :data:`TRL_TESTED`."""
    low, high = TRL_TESTED
    if not low <= Version(version) < high:
        raise ImportError(
            f"LossReduceGRPOTrainer was tested with trl>={low},<{high}, but trl {version} is "
            f"installed; install a tested version with pip install 'lossreduce[trl]'"
        )


def reduction_settings(
    reduction: GRPOReductionSettings | Mapping[str, Any] | None,
) -> GRPOReductionSettings:
    """The trainer's ``reduction`` argument as settings: as given, or validated from a
    mapping of fields (named ``reduction.<field>``) over ``LOSSREDUCE_*`` variables;
    :class:`ReductionConfigError` names every bad value, its source and what is allowed."""
    if isinstance(reduction, GRPOReductionSettings):
        return reduction
    return validate_settings(
        GRPOReductionSettings,
        reduction,
        what="LossReduceGRPOTrainer reduction settings",
        key_prefix="reduction",
    )


def refuse_unsupported(args: Any, settings: GRPOReductionSettings) -> None:
    """Raise :class:`ReductionConfigError` naming every GRPOConfig option this trainer
    cannot honour exactly."""
    problems: list[str] = []
    loss_type = args.loss_type
    if loss_type not in CLIPPED | TOKEN_SUM | ROW_MEAN:
        problems.append(
            f"loss_type={loss_type!r}: not a loss type of TRL {TRL_TESTED[0]}; use one of "
            f"{sorted(CLIPPED | TOKEN_SUM | ROW_MEAN)}"
        )
    if loss_type in ROW_MEAN and args.beta != 0.0:
        problems.append(
            f"loss_type={loss_type!r} with beta={args.beta}: TRL adds beta * KL to {loss_type}'s "
            "per-token loss and divides each completion's sum by its own token count D_i, so "
            "completion i's KL is divided by D_i; lossreduce's KL term is a token_mean over the "
            "step's N_kl tokens, which would need beta * D_i / N_kl for each completion, and TRL "
            "has one beta (the policy term alone is scaled per completion, through its "
            "advantage); set beta=0"
        )
    if getattr(args, "use_liger_loss", False):
        problems.append("use_liger_loss=True: the Liger loss computes its own normalization")
    if args.top_entropy_quantile < 1.0:
        problems.append(
            f"top_entropy_quantile={args.top_entropy_quantile}: its token mask is re-drawn per "
            "micro-step from the current entropies, so no normalizer can count it in advance"
        )
    if args.use_adaptive_entropy:
        problems.append(
            "use_adaptive_entropy=True: the adaptive coefficient is not supported; use a "
            "fixed entropy_coef"
        )
    spg, ga = args.steps_per_generation, args.gradient_accumulation_steps
    if spg % ga != 0:
        problems.append(
            f"steps_per_generation={spg} is not a multiple of gradient_accumulation_steps={ga}: "
            "an optimizer step would span two generation batches, and its normalizer would be "
            "needed before its second half is generated"
        )
    if problems:
        raise ReductionConfigError(
            f"LossReduceGRPOTrainer (job {settings.job!r}, mode {settings.mode.value!r}) cannot "
            f"honour these GRPOConfig options: {'; '.join(problems)}",
            job=settings.job,
            group=settings.group,
        )


def own_division(args: Any) -> PolicyGradientReduction:
    """The lossreduce reduction that means what TRL's ``args.loss_type`` divides by:
    ``luspo`` sums each completion's tokens and averages over completions (``constant``,
    divisor 1), ``dr_grpo`` divides by ``max_completion_length`` x completions. For the
    loss types :func:`refuse_unsupported` admits."""
    mode = _OWN_MODE[args.loss_type]
    if args.loss_type == "luspo":
        return PolicyGradientReduction(mode, 1.0)
    if args.loss_type == "dr_grpo":
        return PolicyGradientReduction(mode, float(args.max_completion_length))
    return PolicyGradientReduction(mode)


def _number(value: float) -> str:
    return f"{int(value)}" if value.is_integer() else repr(value)


def _named(reduction: PolicyGradientReduction) -> str:
    divisor = reduction.divisor
    if divisor is None:
        return f"mode={reduction.mode.value!r}"
    return f"mode={reduction.mode.value!r}, divisor={_number(divisor)}"


def _divides(reduction: PolicyGradientReduction) -> str:
    divisor = reduction.divisor
    times = "" if divisor is None or divisor == 1.0 else f"{_number(divisor)} x "
    return _MODE_DIVIDES[reduction.mode].format(divisor=times)


def division_notice(args: Any, settings: GRPOReductionSettings, job: str) -> str | None:
    """One line saying which division the run gets where ``settings`` do not reproduce
    ``args.loss_type``'s own (None where they do): the loss type, the run's mode and the
    mode that would keep the type's division."""
    own, used = own_division(args), settings.reduction
    if own.contract == used.contract:
        return None
    loss_type = args.loss_type
    return (
        f"LossReduceGRPOTrainer (job {job!r}): loss_type={loss_type!r} divides its policy loss "
        f"{_divides(own)} ({_named(own)}); this run divides it {_divides(used)} "
        f"({_named(used)}, from its reduction settings), so the update is not {loss_type}'s "
        f"own; set {_named(own)} to keep {loss_type}'s division"
    )


def refuse_coordinator_without_ray(settings: GRPOReductionSettings) -> None:
    """Raise :class:`ReductionConfigError` when ``normalizer='coordinator'`` has no address
    and this process is connected to no Ray cluster: its rounds would go to the job's
    coordinator actor, which only a Ray cluster runs. Checked before TRL loads anything
    (the run, unless set or the launcher's, is drawn later: the job then names it
    ``<run>``)."""
    if settings.normalizer != "coordinator" or settings.coordinator is not None:
        return
    try:
        import ray
    except ImportError:
        connected, why = False, " (Ray is not installed here)"
    else:
        connected, why = ray.is_initialized(), ""
    if connected:
        return
    run = settings.run or launcher_run()
    job = settings.job_of(run or "<run>")
    named = f"run {run!r}" if run else "run not drawn yet"
    raise ReductionConfigError(
        f"LossReduceGRPOTrainer (job {job!r}, {named}, group {settings.group!r}): "
        "normalizer='coordinator' without a coordinator address sends the rounds to the "
        "job's coordinator actor on this process's Ray cluster, but the process is not "
        f"connected to one{why}; pass coordinator=HOST:PORT (LOSSREDUCE_COORDINATOR), or "
        "connect every process to one Ray cluster (ray.init) before building the trainer",
        job=job,
        group=settings.group,
        run=run or "",
    )
