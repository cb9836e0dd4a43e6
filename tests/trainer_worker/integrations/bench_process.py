"""A framework bench run in a process of its own, as ``lossreduce bench`` runs it: importing
a framework (AReaL, Megatron-Core) warns, which a test process would turn into errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["bench_result"]

ROOT = Path(__file__).resolve().parents[3]


def bench_result(code: str, env: dict[str, str]) -> tuple[Any, str]:
    """Run ``code`` (which prints one line ``RESULT <json>``) in a fresh interpreter in the
    repository, with this environment plus ``env``: the parsed result and the output."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "TORCH_COMPILE_DISABLE": "1", **env},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT ")), done.stdout
