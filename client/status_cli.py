"""``lossreduce status``: which rounds are live, and which rank are we waiting for?

Lists a coordinator's live and recently finished rounds (``ListRounds``), or
one round in detail (``GetRound`` with ``--group`` and ``--step``), as a plain
table: job, group, step, state, arrived/world, missing ranks, age, error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lossreduce.client import ClientSettings, channel_options
from lossreduce.client._transport import call_metadata, channel_credentials
from lossreduce.settings_cli import FlagError, SettingsParser, add_settings_flags, parse_settings
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

__all__ = ["PROG", "StatusSettings", "format_ranks", "format_table", "main"]

PROG = "lossreduce status"

_STATE_NAMES = {
    pb.ROUND_STATE_COLLECTING: "collecting",
    pb.ROUND_STATE_COMPLETED: "completed",
    pb.ROUND_STATE_FAILED: "failed",
    pb.ROUND_STATE_UNKNOWN: "unknown",
}
_COLUMNS = ("JOB", "GROUP", "RUN", "STEP", "STATE", "ARRIVED", "MISSING RANKS", "AGE", "ERROR")


def format_ranks(ranks: Iterable[int]) -> str:
    """Compact rank list: ``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8``; ``-`` when empty."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans) or "-"


def _row(status: pb.RoundStatus) -> tuple[str, ...]:
    error = status.error.message if status.HasField("error") and status.error.code else ""
    arrived = len(status.arrived_ranks)
    return (
        status.round.job,
        status.round.group,
        status.run or "-",
        str(status.round.step),
        _STATE_NAMES.get(status.state, "?"),
        f"{arrived}/{status.world_size}" if status.world_size else "-",
        format_ranks(status.missing_ranks),
        f"{status.age_seconds:.1f}s",
        error,
    )


def format_table(rounds: Sequence[pb.RoundStatus]) -> str:
    """The rounds as an aligned text table (the last column, the error, is not padded)."""
    rows = [_COLUMNS, *(_row(s) for s in rounds)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS) - 1)]
    lines = [
        "  ".join(
            [*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]]
        ).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


class StatusSettings(BaseModel):
    """What ``lossreduce status`` asks which coordinator (the bearer token comes from
    LOSSREDUCE_TOKEN only: command lines are visible to every user)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    coordinator: str = Field(description="gRPC target of the coordinator, HOST:PORT.")
    job: str = Field(default="", description="Only this job (default: every job).")
    group: str | None = Field(
        default=None, description="With --step (and --job): show one round via GetRound."
    )
    step: int | None = Field(
        default=None, ge=0, description="With --group (and --job): the round's step."
    )
    timeout_s: float = Field(
        default=10.0, gt=0, allow_inf_nan=False, description="Deadline of the RPC, in seconds."
    )
    tls_root_cert: Path | None = Field(
        default=None, description="PEM CA bundle to verify a TLS coordinator with."
    )
    tls_client_cert: Path | None = Field(
        default=None, description="PEM client certificate (mutual TLS)."
    )
    tls_client_key: Path | None = Field(default=None, description="PEM key of --tls-client-cert.")
    tls_server_name: str | None = Field(
        default=None, description="Name expected in the coordinator's certificate."
    )

    @model_validator(mode="after")
    def _one_round(self) -> StatusSettings:
        if (self.group is None) != (self.step is None):
            raise ValueError("--group and --step go together")
        if self.group is not None and not self.job:
            raise ValueError("--group and --step need --job")
        return self


def _parser() -> argparse.ArgumentParser:
    parser = SettingsParser(
        prog=PROG,
        description="List the live and recent rounds of a coordinator and the ranks they wait for.",
    )
    add_settings_flags(
        parser, StatusSettings, metavars={"coordinator": "HOST:PORT", "group": "GROUP"}
    )
    return parser


def _connect(settings: StatusSettings) -> tuple[grpc.Channel, tuple[tuple[str, str], ...]]:
    """A channel with the credentials of the flags (and LOSSREDUCE_TOKEN), and its call metadata."""
    client = ClientSettings(
        tls_root_cert=settings.tls_root_cert,
        tls_client_cert=settings.tls_client_cert,
        tls_client_key=settings.tls_client_key,
        tls_server_name=settings.tls_server_name,
    )
    credentials = channel_credentials(client)
    options = channel_options(client)
    if credentials is None:
        channel = grpc.insecure_channel(settings.coordinator, options=options)
    else:
        channel = grpc.secure_channel(settings.coordinator, credentials, options=options)
    return channel, call_metadata(client)


def main(argv: Sequence[str]) -> int:
    try:
        settings = parse_settings(StatusSettings, _parser().parse_args(list(argv)))
    except FlagError as err:
        return err.report(PROG)
    channel, metadata = _connect(settings)
    with channel:
        stub = pb_grpc.ReductionCoordinatorStub(channel)
        try:
            if settings.group is None:
                rounds = list(
                    stub.ListRounds(
                        pb.ListRoundsRequest(job=settings.job),
                        timeout=settings.timeout_s,
                        metadata=metadata,
                    ).rounds
                )
            else:
                key = pb.RoundKey(job=settings.job, group=settings.group, step=settings.step)
                rounds = [
                    stub.GetRound(
                        pb.GetRoundRequest(round=key), timeout=settings.timeout_s, metadata=metadata
                    )
                ]
        except grpc.RpcError as err:
            print(
                f"{PROG}: cannot query {settings.coordinator}: {err.code().name} {err.details()}",
                file=sys.stderr,
            )
            return 1
    if not rounds:
        scope = f"job {settings.job!r}" if settings.job else "any job"
        print(f"no live or recent rounds for {scope} on {settings.coordinator}")
        return 0
    # Stuck rounds first, then the newest steps of each job and group.
    rounds.sort(
        key=lambda s: (
            s.state != pb.ROUND_STATE_COLLECTING,
            s.round.job,
            s.round.group,
            -s.round.step,
        )
    )
    print(format_table(rounds))
    return 0
