"""``lossreduce train``: GRPO-style training on Ray workers.

Every field of :class:`TrainSettings` is a flag named by the one rule of
:mod:`lossreduce.settings_cli` (``--field-name``; booleans also get
``--no-field-name``) whose help is the field's description. Values are
validated by the settings model, so a bad one gives one line naming the flag
and the value. Exit status: 0 on success, 1 when the run or ``--verify``
fails, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape

from lossreduce.settings_cli import (
    FlagError,
    SettingsParser,
    add_settings_flags,
    parse_settings,
)
from lossreduce.trainer_worker.train.engines.registry import engine_names
from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = ["PROG", "build_parser", "main", "settings_from_argv"]

PROG = "lossreduce train"


def build_parser() -> argparse.ArgumentParser:
    parser = SettingsParser(
        prog=PROG,
        description="Run GRPO-style RL on Ray trainer workers whose global loss normalizers "
        "come from the lossreduce coordinator (or torch.distributed).",
    )
    add_settings_flags(
        parser,
        TrainSettings,
        metavars={
            "address": "ADDRESS",
            "engine": "{" + ",".join(engine_names()) + "}",
            "coordinator": "HOST:PORT",
            "job": "NAME",
            "model": "PATH",
            "out": "DIR",
            "run": "ID",
            "tls_ca": "PATH",
        },
    )
    return parser


def settings_from_argv(argv: Sequence[str]) -> TrainSettings:
    """Flags -> validated settings; raises :class:`~lossreduce.settings_cli.FlagError`."""
    return parse_settings(TrainSettings, build_parser().parse_args(list(argv)))


def main(argv: Sequence[str]) -> int:
    try:
        settings = settings_from_argv(argv)
    except FlagError as err:
        return err.report(PROG)

    from lossreduce.trainer_worker.train.driver import TrainingFailedError, run

    console = Console()
    try:
        result = run(settings, console=console)
    except TrainingFailedError as err:
        console.print(f"[bold red]{PROG}: failed:[/] {escape(str(err))}", highlight=False)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    if result.verify is not None:
        report = result.verify
        verdict = "PASSED" if report.passed else "FAILED"
        console.print(
            f"--verify {verdict}: max abs gradient diff {report.max_abs_diff:.3e} "
            f"(tolerance {report.tolerance:.3e}); loss {report.distributed_loss:.9g} over "
            f"{report.world_size} workers vs {report.single_loss:.9g} in one process",
            highlight=False,
        )
        return 0 if report.passed else 1
    return 0
