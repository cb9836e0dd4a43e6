"""``lossreduce train``: GRPO-style training on Ray workers.

Every field of :class:`TrainSettings` is a flag (``--field-name``; booleans
also get ``--no-field-name``) whose help is the field's description. Values
are validated by the settings model, so a bad one gives one line naming the
flag and the value. Exit status: 0 on success, 1 when the run or ``--verify``
fails, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Sequence

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = ["UsageError", "build_parser", "flag_name", "main", "parse_settings"]

PROG = "lossreduce train"


class UsageError(ValueError):
    """Bad command-line arguments; the message is one line naming the flag and value."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(message)


def flag_name(field: str) -> str:
    """``round_timeout_s`` -> ``--round-timeout-s``."""
    return "--" + field.replace("_", "-")


_METAVARS = {"address": "ADDRESS", "coordinator": "HOST:PORT", "job": "NAME", "out": "DIR"}


def _metavar(name: str, annotation: object) -> str:
    choices = _choices(annotation)
    if choices:
        return "|".join(choices)
    if name in _METAVARS:
        return _METAVARS[name]
    return "N" if int in (annotation, *typing.get_args(annotation)) else "X"


def _choices(annotation: object) -> list[str]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return [str(a) for a in args]
    return [c for a in args for c in _choices(a)]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Run GRPO-style RL on Ray trainer workers whose global loss normalizers "
        "come from the lossreduce coordinator (or torch.distributed).",
        argument_default=argparse.SUPPRESS,
    )
    for name, field in TrainSettings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        help_text = f"{field.description} [default: {default}]"
        if field.annotation is bool:
            parser.add_argument(
                flag_name(name), action=argparse.BooleanOptionalAction, help=help_text
            )
            continue
        parser.add_argument(
            flag_name(name), metavar=_metavar(name, field.annotation), help=help_text
        )
    return parser


def _describe(err: ValidationError, given: dict[str, object]) -> str:
    parts = []
    for problem in err.errors():
        message = str(problem["msg"]).removeprefix("Value error, ")
        loc = problem["loc"]
        if loc and isinstance(loc[0], str) and loc[0] in given:
            parts.append(f"{flag_name(loc[0])} {given[loc[0]]!s}: {message}")
        else:
            parts.append(message)
    return "; ".join(parts)


def parse_settings(argv: Sequence[str]) -> TrainSettings:
    """Flags -> validated settings, or :class:`UsageError`."""
    given = vars(build_parser().parse_args(list(argv)))
    try:
        return TrainSettings.model_validate(given)
    except ValidationError as err:
        raise UsageError(_describe(err, given)) from None


def main(argv: Sequence[str]) -> int:
    try:
        settings = parse_settings(argv)
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)

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
