"""Runs an AReaL launch script on the CPU platform of AReaL's Megatron engine, unchanged.

``torchrun ... megatron_cpu_launch.py SCRIPT ARGS...``: in every rank, installs
:mod:`lossreduce.trainer_worker.cpu_standins.areal.megatron` (AReaL's version fixes and
the Megatron CPU platform) and runs ``SCRIPT`` as ``__main__`` with ``ARGS`` inside the
platform's ``CudaToCpu`` mode, as if torchrun had run
``SCRIPT ARGS...`` on a GPU machine. The launch script itself stays the docs' one.
"""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: megatron_cpu_launch.py SCRIPT [ARGS...]")
    from lossreduce.trainer_worker.cpu_standins.areal import megatron as areal_megatron
    from lossreduce.trainer_worker.cpu_standins.megatron.platform import CudaToCpu

    areal_megatron.install()
    # The script reads its own arguments from sys.argv, as under torchrun directly.
    sys.argv = list(argv)
    with CudaToCpu():
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
