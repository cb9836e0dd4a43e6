"""lossreduce inside AReaL: PPO actors with lossreduce's global per-term normalizers.

- :class:`LossReduceFSDPPPOActor`: AReaL's ``FSDPPPOActor`` whose PPO update
  uses the configured policy-gradient mode (``token_mean``, ``seq_mean``,
  ``prompt_mean``, ``constant``), exact float64 normalizers validated on every
  rank, and torch.distributed or the lossreduce coordinator to sum them.
- :class:`LossReduceArchonPPOActor`: the same for AReaL's Archon engine.
- :func:`lossreduce_actor`: the same for another AReaL actor class, e.g.
  ``MegatronPPOActor`` (see docs/frameworks/areal.md for what runs on which engine).
- :class:`LossReducePPOTrainer`: AReaL's ``PPOTrainer`` building that actor
  (the one change to an AReaL launch script).
- :class:`ArealReductionSettings`: how they normalize (``LOSSREDUCE_*``).

AReaL pins a torch that conflicts with lossreduce's, so ``lossreduce[areal]``
cannot depend on it; install ``areal`` as docs/frameworks/areal.md says.
Importing this package checks the installed AReaL version.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

__all__ = [
    "AREAL_TESTED",
    "ArealReductionSettings",
    "LossReduceActorMixin",
    "LossReduceArchonPPOActor",
    "LossReduceFSDPPPOActor",
    "LossReducePPOTrainer",
    "check_areal_version",
    "lossreduce_actor",
]

AREAL_TESTED = (Version("1.0.4"), Version("1.0.5"))
"""AReaL versions the actors were tested with: [first, second). They rely on
AReaL internals (the train_batch weight arithmetic, ``cu_seqlens`` packing,
the PPO loss dividing by the micro-batch's token count)."""


def check_areal_version(installed: str) -> None:
    """Raise ImportError unless ``installed`` is in :data:`AREAL_TESTED`."""
    low, high = AREAL_TESTED
    if not low <= Version(installed) < high:
        raise ImportError(
            f"lossreduce.trainer_worker.integrations.areal was tested with areal>={low},<{high}, "
            f"but areal {installed} is installed; install areal=={low} as "
            "docs/frameworks/areal.md says"
        )


try:
    _installed = version("areal")
except PackageNotFoundError as err:  # pragma: no cover - exercised only without AReaL
    raise ImportError(
        "lossreduce.trainer_worker.integrations.areal needs AReaL: pip install "
        "areal==1.0.4 and then 'lossreduce[areal]' (docs/frameworks/areal.md)"
    ) from err
check_areal_version(_installed)

from lossreduce.trainer_worker.integrations.areal.actor import LossReduceActorMixin  # noqa: E402
from lossreduce.trainer_worker.integrations.areal.actors import (  # noqa: E402
    LossReduceArchonPPOActor,
    LossReduceFSDPPPOActor,
    lossreduce_actor,
)
from lossreduce.trainer_worker.integrations.areal.settings import (  # noqa: E402
    ArealReductionSettings,
)
from lossreduce.trainer_worker.integrations.areal.trainer import LossReducePPOTrainer  # noqa: E402
