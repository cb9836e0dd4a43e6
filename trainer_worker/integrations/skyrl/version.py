"""Which SkyRL the integration was tested with, checked before any of SkyRL is used.

The worker and the trainer rely on SkyRL internals (``RayPPOTrainer._normalize_advantages``,
the policy worker's ``forward_backward`` and its micro-batch iterator): the release
they were tested with, as the ``skyrl`` extra pins. Imports no SkyRL.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

__all__ = ["SKYRL_TESTED", "check_skyrl_version", "require_skyrl"]

SKYRL_TESTED = (Version("0.4.0"), Version("0.4.1"))
"""SkyRL versions the integration was tested with: [first, second)."""


def check_skyrl_version(installed: str) -> None:
    """Raise ImportError unless ``installed`` is in :data:`SKYRL_TESTED`."""
    low, high = SKYRL_TESTED
    if not low <= Version(installed) < high:
        raise ImportError(
            f"lossreduce.trainer_worker.integrations.skyrl was tested with skyrl>={low},<{high}, "
            f"but skyrl {installed} is installed; install 'skyrl[fsdp]=={low}' as "
            "docs/frameworks/skyrl.md says"
        )


def require_skyrl() -> None:
    """ImportError unless a tested SkyRL is installed (called before SkyRL is imported)."""
    try:
        installed = version("skyrl")
    except PackageNotFoundError as err:
        raise ImportError(
            "lossreduce.trainer_worker.integrations.skyrl needs SkyRL: install "
            "'skyrl[fsdp]==0.4.0', then 'lossreduce[skyrl]' (docs/frameworks/skyrl.md)"
        ) from err
    check_skyrl_version(installed)
