"""What :class:`~lossreduce.trainer_worker.integrations.trl.LossReduceGRPOTrainer` supports:
the TRL versions it was tested with, its loss terms, its reduction settings as validated
from its ``reduction`` argument and ``LOSSREDUCE_*``, the GRPOConfig options it refuses,
and the coordinator actor it refuses to reach outside a Ray cluster.

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

__all__ = [
    "CLIPPED",
    "ENTROPY_TERM",
    "KL_TERM",
    "POLICY_TERM",
    "TOKEN_SUM",
    "TRL_TESTED",
    "check_trl_version",
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
    if loss_type not in CLIPPED | TOKEN_SUM:
        problems.append(
            f"loss_type={loss_type!r}: TRL computes its per-token loss only in its per-sequence-"
            f"mean branch, whose division cannot be replaced; use one of "
            f"{sorted(CLIPPED | TOKEN_SUM)}"
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
