"""The ``lossreduce`` console script: one entry point, one module per subcommand.

Each subcommand lives with the component it drives and is imported only when
chosen, so ``lossreduce serve`` never pays for importing torch or Ray.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module exposing ``main(argv) -> int``, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("lossreduce.server.cli", "run the reduction coordinator (gRPC + /metrics)"),
    "status": ("lossreduce.client.status_cli", "list live and recent rounds of a coordinator"),
    "agent": (
        "lossreduce.client.agent_cli",
        "run a node agent: one aggregated contribution per node and round",
    ),
    "train": ("lossreduce.trainer_worker.train.cli", "run GRPO-style training on Ray workers"),
    "bench": (
        "lossreduce.server.bench.cli",
        "benchmark the coordinator against gloo, TCPStore, Ray",
    ),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: lossreduce COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'lossreduce COMMAND --help' for a command's flags."]
    return "\n".join(lines)


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
    module = importlib.import_module(COMMANDS[name][0])
    code: int = module.main(args[1:])
    return code


if __name__ == "__main__":
    sys.exit(main())
