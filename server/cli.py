"""``lossreduce serve``: run the coordinator until SIGTERM/SIGINT.

Every :class:`CoordinatorSettings` field is a flag: the field name with dashes
and without its ``_s`` unit suffix (``round_timeout_s`` -> ``--round-timeout``,
in seconds). Unset flags fall back to ``LOSSREDUCE_*`` variables, then to the
defaults. A bad value is a one-line error naming the flag and the value.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from .app import Coordinator, serve
from .hardening import CONFIG_ERRORS
from .settings import CoordinatorSettings

__all__ = ["build_parser", "flag_name", "main", "settings_from_args"]

_OFF = ("off", "none", "")
# Fields whose flag value 'off'/'none' means None.
_NULLABLE = ("metrics_port", "journal")
# Secrets are read from the environment only: command lines are visible to every user.
_ENV_ONLY = ("token",)
SERVE_JOURNAL = Path("lossreduce-journal.sqlite3")
"""The journal ``lossreduce serve`` keeps unless ``--journal`` or LOSSREDUCE_JOURNAL says otherwise."""


def flag_name(field: str) -> str:
    """The command-line flag of a settings field: ``round_timeout_s`` -> ``--round-timeout``."""
    return "--" + field.removesuffix("_s").replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lossreduce serve",
        description="Run the lossreduce reduction coordinator (gRPC, health, reflection, /metrics). "
        "Every flag can also be set as LOSSREDUCE_<FIELD> (e.g. LOSSREDUCE_ROUND_TIMEOUT_S).",
    )
    for name, field in CoordinatorSettings.model_fields.items():
        if name in _ENV_ONLY:
            continue
        default = field.default
        if name == "metrics_port":
            default = f"{default} ('off' disables it)"
        if name == "journal":
            default = f"./{SERVE_JOURNAL} ('none' disables it)"
        if field.annotation is bool:
            parser.add_argument(
                flag_name(name),
                dest=name,
                action="store_true",
                default=None,
                help=f"{field.description} [env LOSSREDUCE_{name.upper()}=1]",
            )
            continue
        parser.add_argument(
            flag_name(name),
            dest=name,
            metavar="SECONDS" if name.endswith("_s") else name.upper(),
            default=None,
            help=f"{field.description} [default: {default}; env LOSSREDUCE_{name.upper()}]",
        )
    return parser


def settings_from_args(args: argparse.Namespace) -> CoordinatorSettings:
    """Settings from parsed flags (raw strings, validated by the model) over the environment."""
    given: dict[str, object] = {
        name: value for name, value in vars(args).items() if value is not None
    }
    for name in _NULLABLE:
        value = given.get(name)
        if isinstance(value, str) and value.lower() in _OFF:
            given[name] = None
    if "journal" not in given and "LOSSREDUCE_JOURNAL" not in os.environ:
        given["journal"] = SERVE_JOURNAL
    elif os.environ.get("LOSSREDUCE_JOURNAL", "x").lower() in _OFF and "journal" not in given:
        given["journal"] = None
    return CoordinatorSettings.model_validate(given)


def _one_line(err: ValidationError, args: argparse.Namespace) -> str:
    first = err.errors()[0]
    field = str(first["loc"][0]) if first["loc"] else ""
    value = getattr(args, field, None)
    if value is None:  # came from the environment
        return f"invalid LOSSREDUCE_{field.upper()}: {first['msg']}"
    return f"invalid {flag_name(field)} {value!r}: {first['msg']}"


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        settings = settings_from_args(args)
    except ValidationError as err:
        print(f"lossreduce serve: {_one_line(err, args)}", file=sys.stderr)
        return 2

    async def run() -> None:
        ready: asyncio.Future[Coordinator] = asyncio.get_running_loop().create_future()
        ready.add_done_callback(_announce)
        await serve(settings, ready=ready)

    try:
        asyncio.run(run())
    except CONFIG_ERRORS as err:
        print(f"lossreduce serve: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"lossreduce serve: {err}", file=sys.stderr)
        return 1
    print("lossreduce serve: stopped", flush=True)
    return 0


def _announce(ready: asyncio.Future[Coordinator]) -> None:
    if ready.cancelled() or ready.exception() is not None:
        return
    coordinator = ready.result()
    metrics = coordinator.metrics_url or "off"
    print(
        f"lossreduce coordinator serving on {coordinator.target} (metrics: {metrics}; "
        f"round timeout {coordinator.settings.round_timeout_s:g} s)",
        flush=True,
    )
