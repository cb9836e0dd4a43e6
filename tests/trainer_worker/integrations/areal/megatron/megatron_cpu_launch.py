"""Runs an AReaL launch script on the CPU platform of AReaL's Megatron engine, unchanged.

``torchrun ... megatron_cpu_launch.py SCRIPT ARGS...``: in every rank, installs
:mod:`lossreduce.trainer_worker.integrations.areal.megatron_cpu` and runs ``SCRIPT`` as
``__main__`` with ``ARGS`` inside its ``CudaToCpu`` mode, as if torchrun had run
``SCRIPT ARGS...`` on a GPU machine. The launch script itself stays the docs' one.
"""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: megatron_cpu_launch.py SCRIPT [ARGS...]")
    from lossreduce.trainer_worker.integrations.areal import megatron_cpu

    megatron_cpu.install()
    # The script reads its own arguments from sys.argv, as under torchrun directly.
    sys.argv = list(argv)
    with megatron_cpu.CudaToCpu():
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
