"""The ``lossreduce`` console script: one entry point, one module per subcommand.

Each subcommand lives with the component it drives and is imported only when
chosen, so ``lossreduce serve`` never pays for importing torch or Ray.

A plain ``pip install lossreduce`` is the service side (``serve``, ``status``,
``agent``); ``train`` and ``bench`` need the trainer side (``lossreduce[trainer]``).
Run without it, they say so and what to install, instead of an ImportError traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from lossreduce._versions import TRAINER_INSTALL, UnsupportedVersionError


class Command(NamedTuple):
    module: str
    """Exposes ``main(argv) -> int``."""
    help: str
    """One line for ``lossreduce --help``."""
    needs: tuple[str, ...] = ()
    """Top-level modules of the trainer extra the command imports; none for the
    service side, whose dependencies every install has."""


TRAINER_MODULES = ("torch", "ray", "rich", "matplotlib", "cryptography")
"""The import names of pyproject.toml's ``trainer`` extra."""

COMMANDS: dict[str, Command] = {
    "serve": Command("lossreduce.server.cli", "run the reduction coordinator (gRPC + /metrics)"),
    "status": Command(
        "lossreduce.client.status_cli", "list live and recent rounds of a coordinator"
    ),
    "agent": Command(
        "lossreduce.client.agent_cli",
        "run a node agent: one aggregated contribution per node and round",
    ),
    "train": Command(
        "lossreduce.trainer_worker.train.cli",
        "run GRPO-style training on Ray workers",
        needs=TRAINER_MODULES,
    ),
    "bench": Command(
        "lossreduce.bench.cli",
        "benchmark the coordinator against gloo, TCPStore, Ray",
        needs=("torch", "ray", "matplotlib"),
    ),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: lossreduce COMMAND [ARGS...]", "", "commands:"]
    for name, command in COMMANDS.items():
        side = " (needs lossreduce[trainer])" if command.needs else ""
        lines.append(f"  {name:<{width}}  {command.help}{side}")
    lines += ["", "Run 'lossreduce COMMAND --help' for a command's flags."]
    return "\n".join(lines)


def missing_modules(names: Iterable[str]) -> list[str]:
    """Those of ``names`` (top-level modules) that cannot be imported here.

    Found without importing them: torch and Ray take seconds to import, and the check
    runs before the command's module is.
    """
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # a meta-path finder that refuses the name outright
            found = False
        if not found:
            missing.append(name)
    return missing


def trainer_side_hint(command: str, missing: Sequence[str]) -> str:
    """What ``lossreduce COMMAND`` prints when the trainer side is not installed."""
    return (
        f"lossreduce {command}: needs the trainer side, and {', '.join(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} not installed "
        f"(`pip install lossreduce` is the service side only).\n"
        f"Install the trainer side: {TRAINER_INSTALL}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from lossreduce import __version__

        print(f"lossreduce {__version__}")
        return 0
    name = args[0]
    if name not in COMMANDS:
        print(
            f"lossreduce: unknown command {name!r}; choose one of {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    command = COMMANDS[name]
    missing = missing_modules(command.needs)
    if missing:
        print(trainer_side_hint(name, missing), file=sys.stderr)
        return 1
    try:
        module = importlib.import_module(command.module)
    except ModuleNotFoundError as error:
        # One of the command's trainer-side modules is found but one of its parts is
        # not (a partial install): the same hint. Any other missing module is a bug
        # or a broken environment, and its traceback says which.
        top = (error.name or "").partition(".")[0]
        if top not in command.needs:
            raise
        print(trainer_side_hint(name, [top]), file=sys.stderr)
        return 1
    except UnsupportedVersionError as error:
        # Already says which version is installed and which range to install.
        print(f"lossreduce {name}: {error}", file=sys.stderr)
        return 1
    code: int = module.main(args[1:])
    return code


if __name__ == "__main__":
    sys.exit(main())
