"""Limits on what a request may name: job and group names, contract strings.

The round table already bounds terms per contribution, world size, rounds
in flight, groups per job and jobs, and gRPC bounds the message size
(``max_message_bytes``); term names follow :func:`lossreduce.rules.check_term_name`.
What was left unbounded is checked here, by the round table before a
contribution can open a round (so a stream gets the refusal in that request's
response and goes on):

- job and group names: non-empty, at most ``max_name_length`` characters, printable
  (no control characters: names end up in logs, metric labels and ``lossreduce status``);
- each term's contract string: at most ``max_contract_length`` characters;
- a run id (``ReduceRequest.run``), when given: as a job name (it is a metric
  label and appears in messages and ``lossreduce status``).

Each violation is an ``InvalidPartialError`` (INVALID_ARGUMENT) for the sender
only, whose ``limit`` names the setting. Messages quote at most the first 32
characters of an offending name, so a hostile megabyte-long name is not echoed
back or logged.
"""

from __future__ import annotations

from lossreduce.errors import InvalidPartialError

__all__ = ["check_contract_lengths", "check_group_names", "check_request_names", "check_run_name"]

_QUOTE = 32


def _quote(name: str) -> str:
    return repr(name) if len(name) <= _QUOTE else f"{name[:_QUOTE]!r}... ({len(name)} characters)"


def _name_problem(name: str, max_length: int) -> str | None:
    if not name:
        return "is empty"
    if len(name) > max_length:
        return f"is {len(name)} characters long, over the limit max_name_length={max_length}"
    if not name.isprintable():
        return "contains control or other non-printable characters"
    return None


def check_group_names(
    key: tuple[str, str, int], rank: int, *, max_name_length: int
) -> InvalidPartialError | None:
    """Why the job or group name of round ``key`` (job, group, step) breaks a limit, or None.

    The round table asks once per group, when a contribution would open it: the
    names of a group that exists were judged when it was opened."""
    job, group, step = key
    for what, name in (("job", job), ("group", group)):
        problem = _name_problem(name, max_length=max_name_length)
        if problem is not None:
            return InvalidPartialError(
                f"{what} name {_quote(name)} {problem} (sent by rank {rank} for step {step})",
                job=job[:_QUOTE],
                group=group[:_QUOTE],
                step=step,
                rank=rank,
                limit="max_name_length",
            )
    return None


def check_run_name(
    key: tuple[str, str, int], rank: int, run: str, *, max_name_length: int
) -> InvalidPartialError | None:
    """Why the run a contribution names breaks the name limit, or None (an empty run,
    from a client that names none, is fine)."""
    problem = _name_problem(run, max_length=max_name_length) if run else None
    if problem is None:
        return None
    job, group, step = key
    return InvalidPartialError(
        f"job {job!r} group {group!r} step {step}: run {_quote(run)} {problem} "
        f"(sent by rank {rank})",
        job=job,
        group=group,
        step=step,
        rank=rank,
        limit="max_name_length",
    )


def check_contract_lengths(
    key: tuple[str, str, int],
    rank: int,
    terms: tuple[str, ...],
    contracts: tuple[str, ...],
    *,
    max_contract_length: int,
) -> InvalidPartialError | None:
    """Why a contract string of a contribution to round ``key`` is too long, or None."""
    job, group, step = key
    for term, contract in zip(terms, contracts, strict=True):
        if len(contract) > max_contract_length:
            return InvalidPartialError(
                f"job {job!r} group {group!r} step {step}: rank {rank} sent a contract of "
                f"{len(contract)} characters for term {_quote(term)}, over the limit "
                f"max_contract_length={max_contract_length}",
                job=job,
                group=group,
                step=step,
                rank=rank,
                terms=(term[:_QUOTE],),
                limit="max_contract_length",
            )
    return None


def check_request_names(
    key: tuple[str, str, int],
    rank: int,
    terms: tuple[str, ...],
    contracts: tuple[str, ...],
    *,
    max_name_length: int,
    max_contract_length: int,
) -> InvalidPartialError | None:
    """Why a contribution to round ``key`` (job, group, step) breaks a name limit, or None:
    :func:`check_group_names`, then :func:`check_contract_lengths`."""
    named = check_group_names(key, rank, max_name_length=max_name_length)
    if named is not None:
        return named
    return check_contract_lengths(
        key, rank, terms, contracts, max_contract_length=max_contract_length
    )
