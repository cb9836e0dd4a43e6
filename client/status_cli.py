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

from lossreduce.client import ClientSettings, channel_options
from lossreduce.client._transport import call_metadata, channel_credentials
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

__all__ = ["format_ranks", "format_table", "main"]

_STATE_NAMES = {
    pb.ROUND_STATE_COLLECTING: "collecting",
    pb.ROUND_STATE_COMPLETED: "completed",
    pb.ROUND_STATE_FAILED: "failed",
    pb.ROUND_STATE_UNKNOWN: "unknown",
}
_COLUMNS = ("JOB", "GROUP", "STEP", "STATE", "ARRIVED", "MISSING RANKS", "AGE", "ERROR")


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lossreduce status",
        description="List the live and recent rounds of a coordinator and the ranks they wait for.",
    )
    parser.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="gRPC target")
    parser.add_argument("--job", default="", help="only this job (default: every job)")
    parser.add_argument("--group", help="with --step: show one round via GetRound")
    parser.add_argument("--step", type=int, help="with --group: the round's step")
    parser.add_argument(
        "--timeout", type=float, default=10.0, metavar="SECONDS", help="RPC deadline [default: 10]"
    )
    # Credentials, as the client takes them; the bearer token comes from LOSSREDUCE_TOKEN.
    for flag, help_ in (
        ("--tls-root-cert", "PEM CA bundle to verify a TLS coordinator with"),
        ("--tls-client-cert", "PEM client certificate (mutual TLS)"),
        ("--tls-client-key", "PEM key of --tls-client-cert"),
    ):
        parser.add_argument(flag, type=Path, help=help_)
    parser.add_argument("--tls-server-name", help="name expected in the coordinator's certificate")
    return parser


def _connect(args: argparse.Namespace) -> tuple[grpc.Channel, tuple[tuple[str, str], ...]]:
    """A channel with the credentials of the flags (and LOSSREDUCE_TOKEN), and its call metadata."""
    settings = ClientSettings(
        tls_root_cert=args.tls_root_cert,
        tls_client_cert=args.tls_client_cert,
        tls_client_key=args.tls_client_key,
        tls_server_name=args.tls_server_name,
    )
    credentials = channel_credentials(settings)
    options = channel_options(settings)
    if credentials is None:
        channel = grpc.insecure_channel(args.coordinator, options=options)
    else:
        channel = grpc.secure_channel(args.coordinator, credentials, options=options)
    return channel, call_metadata(settings)


def main(argv: Sequence[str]) -> int:
    parser = _parser()
    args = parser.parse_args(list(argv))
    if (args.group is None) != (args.step is None):
        print("lossreduce status: --group and --step go together", file=sys.stderr)
        return 2
    if args.group is not None and not args.job:
        print("lossreduce status: --group and --step need --job", file=sys.stderr)
        return 2
    channel, metadata = _connect(args)
    with channel:
        stub = pb_grpc.ReductionCoordinatorStub(channel)
        try:
            if args.group is None:
                rounds = list(
                    stub.ListRounds(
                        pb.ListRoundsRequest(job=args.job), timeout=args.timeout, metadata=metadata
                    ).rounds
                )
            else:
                key = pb.RoundKey(job=args.job, group=args.group, step=args.step)
                rounds = [
                    stub.GetRound(
                        pb.GetRoundRequest(round=key), timeout=args.timeout, metadata=metadata
                    )
                ]
        except grpc.RpcError as err:
            print(
                f"lossreduce status: cannot query {args.coordinator}: "
                f"{err.code().name} {err.details()}",
                file=sys.stderr,
            )
            return 1
    if not rounds:
        scope = f"job {args.job!r}" if args.job else "any job"
        print(f"no live or recent rounds for {scope} on {args.coordinator}")
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
