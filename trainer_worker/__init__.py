"""The reduction library, normalizer backends and the engine boundary.

A loss is a :class:`LossReduction` of named terms (:class:`LossTerm`); each term's
share of the global loss is its local value scaled by its local normalizer
over the global normalizer, which a :class:`GlobalNormalizer` backend sums
over ranks (one process, torch.distributed, or the coordinator). See
``docs/reduction-semantics.md`` for the formulas.
"""

# The package's own imports follow the torch check, so that a missing or unsupported
# torch is reported as such before any module of the package needs it.
# ruff: noqa: E402

from lossreduce._versions import TRAINER_INSTALL, check_torch

try:
    import torch
except ModuleNotFoundError as error:
    # The service side (`pip install lossreduce`) has no torch: say what brings it.
    if error.name != "torch":
        raise  # torch itself is there but broken: its own error says more
    raise ModuleNotFoundError(
        f"lossreduce.trainer_worker needs torch, which is not installed; "
        f"install the trainer side: {TRAINER_INSTALL}",
        name="torch",
    ) from error

check_torch(torch.__version__)

from lossreduce.trainer_worker.engine import (
    EvalResult,
    ForwardFn,
    ReductionEngine,
    Splitter,
    StepStats,
    TorchTrainEngine,
    TrainEngine,
    combine_eval,
    eval_batch_with_reduction,
    train_batch_with_reduction,
)
from lossreduce.trainer_worker.microbatch import (
    MicrobatchSettings,
    MicrobatchSplitter,
    split_microbatches,
)
from lossreduce.trainer_worker.normalizers import (
    CoordinatorNormalizer,
    GlobalNormalizer,
    LocalNormalizer,
    NormalizerHandle,
    OnEmptyStep,
    ReadyHandle,
    SupportsReduce,
    SupportsResult,
    TorchDistributedNormalizer,
)
from lossreduce.trainer_worker.policy_gradient import (
    PolicyGradientMode,
    PolicyGradientReduction,
    forced_local_sums,
    zero_masked,
)
from lossreduce.trainer_worker.reduction import (
    Batch,
    InconsistentNormalizerError,
    LocalPartials,
    LossFn,
    LossReduction,
    LossTerm,
    NormalizerFn,
    ReductionKind,
    check_local_consistency,
    floats_of,
    local_partials,
    scaled_loss,
)

__all__ = [
    "Batch",
    "CoordinatorNormalizer",
    "EvalResult",
    "ForwardFn",
    "GlobalNormalizer",
    "InconsistentNormalizerError",
    "LocalNormalizer",
    "LocalPartials",
    "LossFn",
    "LossReduction",
    "LossTerm",
    "MicrobatchSettings",
    "MicrobatchSplitter",
    "NormalizerFn",
    "NormalizerHandle",
    "OnEmptyStep",
    "PolicyGradientMode",
    "PolicyGradientReduction",
    "ReadyHandle",
    "ReductionEngine",
    "ReductionKind",
    "Splitter",
    "StepStats",
    "SupportsReduce",
    "SupportsResult",
    "TorchDistributedNormalizer",
    "TorchTrainEngine",
    "TrainEngine",
    "check_local_consistency",
    "combine_eval",
    "eval_batch_with_reduction",
    "floats_of",
    "forced_local_sums",
    "local_partials",
    "scaled_loss",
    "split_microbatches",
    "train_batch_with_reduction",
    "zero_masked",
]

# The training job (``lossreduce train``) lives in ``lossreduce.trainer_worker.train``
# and is imported explicitly, so using the reduction library never imports Ray.
