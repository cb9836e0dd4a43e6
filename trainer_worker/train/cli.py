"""``lossreduce train``: GRPO-style training on Ray workers.

Every field of :class:`TrainSettings` is a flag named by the one rule of
:mod:`lossreduce.settings_cli` (``--field-name``; booleans also get
``--no-field-name``) whose help is the field's description. Values are
validated by the settings model before Ray starts, and so are the
``LOSSREDUCE_*`` variables the chosen engine's workers would read: a bad one
gives one line naming the flag (or variable), the value and what is allowed,
the message of a :class:`~lossreduce.errors.ReductionConfigError`. Exit status:
0 on success, 1 when the run or ``--verify`` fails, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape

from lossreduce.errors import ReductionConfigError
from lossreduce.settings_cli import (
    FlagError,
    SettingsParser,
    add_settings_flags,
    flag_name,
    given_settings,
)
from lossreduce.trainer_worker.integrations.settings_errors import validate_settings
from lossreduce.trainer_worker.train.engines.registry import engine_names, get_engine
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
    """Flags -> validated settings, with the engine's ``LOSSREDUCE_*`` variables checked.

    Raises :class:`~lossreduce.settings_cli.FlagError` for flags argparse refuses
    (unknown, missing value) and :class:`~lossreduce.errors.ReductionConfigError` for a
    bad value, naming its flag or variable, the value and what is allowed.
    """
    given = given_settings(build_parser().parse_args(list(argv)), TrainSettings)
    settings = validate_settings(
        TrainSettings, given, what="", sources={name: flag_name(name) for name in given}
    )
    get_engine(settings.engine).check_environment(settings)
    return settings


def main(argv: Sequence[str]) -> int:
    try:
        settings = settings_from_argv(argv)
    except FlagError as err:
        return err.report(PROG)
    except ReductionConfigError as err:
        return FlagError(str(err)).report(PROG)

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
