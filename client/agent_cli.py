"""``lossreduce agent``: run a node agent outside Ray until SIGTERM/SIGINT.

The agent's own flags come from :class:`AgentTarget` (the coordinator and what
it serves) and :class:`~lossreduce.client.agent.AgentSettings`, by the one rule
of :mod:`lossreduce.settings_cli` (``local_ranks`` -> ``--local-ranks``),
except the token, which only the environment carries (``LOSSREDUCE_TOKEN``:
command lines are visible to every user). Before it serves, the agent asks the
coordinator for its rounds once, so an unreachable coordinator or refused
credentials end the command with one line naming the coordinator.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from lossreduce.client.agent import AgentSettings, NodeAgent
from lossreduce.errors import AuthenticationError, CoordinatorUnavailableError
from lossreduce.settings_cli import FlagError, SettingsParser, add_settings_flags, parse_settings

__all__ = ["PROG", "AgentTarget", "build_parser", "main"]

PROG = "lossreduce agent"
# Secrets travel in the environment only (command lines are visible to every user); the
# agent always streams upstream, so use_stream is no flag of its.
_EXCLUDED = ("token", "tls_root_cert_pem", "use_stream")


class AgentTarget(BaseModel):
    """Which coordinator the agent forwards to, and which rounds it serves."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    upstream: str = Field(description="gRPC target of the coordinator, HOST:PORT.")
    job: str | None = Field(
        default=None, description="Serve this job only (default: any job the ranks name)."
    )
    group: str | None = Field(
        default=None, description="Serve this group only (default: any group of the job)."
    )
    world_size: int | None = Field(
        default=None, ge=1, description="World size of the job (default: from the requests)."
    )


def build_parser() -> argparse.ArgumentParser:
    parser = SettingsParser(
        prog=PROG,
        description="Run a node agent: the ranks of this node reduce through it (the "
        "coordinator's own service), and it sends the coordinator one contribution per "
        "round. The bearer token is read from LOSSREDUCE_TOKEN only.",
    )
    add_settings_flags(
        parser, AgentTarget, metavars={"upstream": "HOST:PORT", "job": "JOB", "group": "GROUP"}
    )
    add_settings_flags(
        parser,
        AgentSettings,
        exclude=_EXCLUDED,
        shown_defaults={"metrics_port": "None ('off'; 0 picks a port)"},
        metavars={"host": "HOST", "port": "PORT", "metrics_port": "PORT"},
    )
    return parser


async def _serve(target: AgentTarget, settings: AgentSettings) -> None:
    agent = NodeAgent(
        target.upstream,
        job=target.job,
        group=target.group,
        world_size=target.world_size,
        settings=settings,
    )
    await agent.start()
    try:
        await agent.check_upstream()
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_requested.set)
        ranks = (
            "learned from the first round"
            if settings.local_ranks is None
            else (",".join(map(str, settings.local_ranks)))
        )
        print(
            f"lossreduce agent serving on {agent.target} for the coordinator at "
            f"{target.upstream} (local ranks: {ranks}; metrics: {agent.metrics_url or 'off'})",
            flush=True,
        )
        try:
            await stop_requested.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
    finally:
        await agent.stop()


def main(argv: Sequence[str]) -> int:
    try:
        args = build_parser().parse_args(list(argv))
        target = parse_settings(AgentTarget, args)
        settings = parse_settings(AgentSettings, args)
    except FlagError as err:
        return err.report(PROG)
    try:
        asyncio.run(_serve(target, settings))
    except (AuthenticationError, CoordinatorUnavailableError, OSError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    print(f"{PROG}: stopped", flush=True)
    return 0
