"""What AReaL prints that the run does not need, silenced before AReaL is imported.

Importing this module calls :func:`quiet_areal` (the worker module imports it
before AReaL, the engine's loader before the integration).

AReaL logs at INFO from every process (its configuration, every micro-batch,
the attention kernels it compiled at import), and on a CPU machine warns at
import that NVIDIA's Transformer Engine is absent and, with torch 2.13, that
its FSDP engine slices a flattened device-mesh dimension. The driver shows the
run's progress; warnings and errors of AReaL still show.
"""

from __future__ import annotations

import logging.config
import warnings

__all__ = ["quiet_areal"]

_NOTICES = (
    "Transformer Engine and Apex are not installed",
    "Slicing a flattened dim from root mesh",
)
"""How the UserWarnings begin that AReaL 1.0.4 raises on every CPU run."""


def quiet_areal() -> None:
    """In this process: AReaL logs warnings and errors only, and its CPU notices are
    not shown. Without AReaL installed, nothing to do (its import says so later)."""
    for notice in _NOTICES:
        warnings.filterwarnings("ignore", f"{notice}.*", UserWarning)
    try:
        from areal.utils import logging as areal_logging
    except ImportError:
        return
    # AReaL re-applies this dictionary on every getLogger call: lower it at the source.
    for handler in areal_logging.log_config["handlers"].values():
        handler["level"] = "WARNING"
    logging.config.dictConfig(areal_logging.log_config)


quiet_areal()
