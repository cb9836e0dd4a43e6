"""``lossreduce serve``: run the coordinator until SIGTERM/SIGINT.

Every :class:`CoordinatorSettings` field is a flag named by the one rule of
:mod:`lossreduce.settings_cli` (``round_timeout_s`` -> ``--round-timeout-s``),
except the token, which only the environment may carry. Unset flags fall back
to ``LOSSREDUCE_*`` variables, then to the defaults. A bad value is a one-line
error naming the flag (or variable) and the value.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from lossreduce.settings_cli import (
    NONE_WORDS,
    FlagError,
    SettingsParser,
    add_settings_flags,
    parse_settings,
)

from .app import Coordinator, serve
from .hardening import CONFIG_ERRORS
from .settings import SERVE_JOURNAL, CoordinatorSettings

__all__ = ["PROG", "SERVE_JOURNAL", "build_parser", "main", "settings_from_args"]

PROG = "lossreduce serve"
# Secrets are read from the environment only: command lines are visible to every user.
_ENV_ONLY = ("token",)


def build_parser() -> argparse.ArgumentParser:
    parser = SettingsParser(
        prog=PROG,
        description="Run the lossreduce reduction coordinator (gRPC, health, reflection, /metrics). "
        "Every flag can also be set as LOSSREDUCE_<FIELD> (e.g. LOSSREDUCE_ROUND_TIMEOUT_S).",
    )
    add_settings_flags(
        parser,
        CoordinatorSettings,
        exclude=_ENV_ONLY,
        shown_defaults={
            "metrics_port": f"{CoordinatorSettings.model_fields['metrics_port'].default} "
            "('off' disables it)",
            "journal": f"./{SERVE_JOURNAL} ('none' disables it)",
        },
        metavars={"host": "HOST", "port": "PORT", "metrics_port": "PORT"},
    )
    return parser


def settings_from_args(args: argparse.Namespace) -> CoordinatorSettings:
    """Settings from parsed flags over the environment, with the journal ``serve`` keeps
    by default; raises :class:`~lossreduce.settings_cli.FlagError`."""
    defaults: dict[str, object] = {}
    env_journal = os.environ.get("LOSSREDUCE_JOURNAL")
    if env_journal is None:
        defaults["journal"] = SERVE_JOURNAL
    elif env_journal.lower() in (*NONE_WORDS, ""):
        defaults["journal"] = None
    return parse_settings(CoordinatorSettings, args, defaults=defaults)


def main(argv: Sequence[str]) -> int:
    try:
        settings = settings_from_args(build_parser().parse_args(list(argv)))
    except FlagError as err:
        return err.report(PROG)

    async def run() -> None:
        ready: asyncio.Future[Coordinator] = asyncio.get_running_loop().create_future()
        ready.add_done_callback(_announce)
        await serve(settings, ready=ready)

    try:
        asyncio.run(run())
    except CONFIG_ERRORS as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    print(f"{PROG}: stopped", flush=True)
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
