"""Why a request is refused before it reaches a round: limits, shutdown, stale
steps, and another run holding the group.

Pure functions of the coordinator's settings and what the round table knows;
each returns the error to answer (about the request's round) or None. The
round table (:mod:`lossreduce.server.round_table`) calls them in order before
it opens or joins a round, so a refused request changes no round.
"""

from __future__ import annotations

import time

from lossreduce.contribution import Contribution
from lossreduce.errors import (
    CoordinatorUnavailableError,
    InvalidPartialError,
    LimitExceededError,
    LossReduceError,
    RunConflictError,
    StaleRoundError,
    describe_round,
)

from .limits import check_contract_lengths, check_group_names, check_run_name
from .outcomes import RoundKey, key_error
from .run_claims import ClaimVerdict
from .settings import CoordinatorSettings
from .step_window import StepWindow

__all__ = [
    "claim_limit_error",
    "limit_error",
    "new_round_refusal",
    "request_limit_error",
    "run_conflict_error",
]


def limit_error(
    key: RoundKey, rank: int | None, name: str, what: str, limit: int
) -> LimitExceededError:
    """``what`` exceeds the coordinator setting ``name`` (= ``limit``)."""
    return key_error(
        LimitExceededError,
        key,
        f"{what} exceeds the coordinator limit {name}={limit}",
        rank=rank,
        limit=name,
    )


def claim_limit_error(
    s: CoordinatorSettings, key: RoundKey, rank: int, run: str
) -> InvalidPartialError | None:
    """A claim (``Claim``) naming no run, or a job, group or run over the name limit, or None."""
    named = check_group_names(key, rank, max_name_length=s.max_name_length)
    if named is None:
        named = check_run_name(key, rank, run, max_name_length=s.max_name_length)
    if named is not None or run:
        return named
    return InvalidPartialError(
        f"job {key.job!r} group {key.group!r} step {key.step}: rank {rank} claimed the group "
        "without a run id (a claim names the run it is for)",
        job=key.job,
        group=key.group,
        step=key.step,
        rank=rank,
    )


def request_limit_error(
    s: CoordinatorSettings, key: RoundKey, c: Contribution, group: StepWindow | None
) -> LossReduceError | None:
    """A request over a size limit (names, run, contracts, terms, world size), or None."""
    if group is None:
        # A group's job and group names were judged when it was opened.
        named = check_group_names(key, c.rank, max_name_length=s.max_name_length)
        if named is not None:
            return named
    if c.run:
        bad_run = check_run_name(key, c.rank, c.run, max_name_length=s.max_name_length)
        if bad_run is not None:
            return bad_run
    if group is None or c.contracts != group.judged_contracts:
        long_contract = check_contract_lengths(
            key, c.rank, c.terms, c.contracts, max_contract_length=s.max_contract_length
        )
        if long_contract is not None:
            return long_contract
        if group is not None:
            group.judged_contracts = c.contracts
    for name, value, limit in (
        ("max_terms", len(c.terms), s.max_terms),
        ("max_world_size", c.world_size, s.max_world_size),
    ):
        if value > limit:
            return limit_error(key, c.rank, name, f"{name.removeprefix('max_')} {value}", limit)
    if c.world_size == 0:
        return key_error(
            InvalidPartialError,
            key,
            f"rank {c.rank} sent world_size 0",
            rank=c.rank,
            ranks=(c.rank,),
        )
    return None


def new_round_refusal(
    s: CoordinatorSettings,
    key: RoundKey,
    group: StepWindow | None,
    *,
    closing: bool,
    jobs: int,
    groups_of_job: int | None,
) -> LossReduceError | None:
    """Why round ``key`` may not open, or None. ``jobs`` counts the known jobs,
    ``groups_of_job`` the known groups of ``key.job`` (None: the job is new)."""
    if closing:
        return key_error(
            CoordinatorUnavailableError,
            key,
            "the coordinator is shutting down and opens no new rounds",
        )
    if group is None:
        if groups_of_job is None and jobs >= s.max_jobs:
            return limit_error(key, None, "max_jobs", f"job {jobs + 1}", s.max_jobs)
        if groups_of_job is not None and groups_of_job >= s.max_groups_per_job:
            return limit_error(
                key,
                None,
                "max_groups_per_job",
                f"group {groups_of_job + 1}",
                s.max_groups_per_job,
            )
        return None
    floor = group.is_stale(key.step, s)
    if floor is not None:
        return key_error(
            StaleRoundError,
            key,
            f"step is stale; the newest step of the group is "
            f"{group.newest_step} and steps up to {floor} are no longer retained "
            f"(retained_steps={s.retained_steps}, finished_cache_size={s.finished_cache_size})",
            limit="retained_steps",
        )
    if len(group.live) >= s.max_rounds_in_flight:
        return limit_error(
            key,
            None,
            "max_rounds_in_flight",
            f"round {len(group.live) + 1} in flight",
            s.max_rounds_in_flight,
        )
    return None


def _utc(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


def run_conflict_error(
    s: CoordinatorSettings, key: RoundKey, rank: int, verdict: ClaimVerdict, *, wall: float
) -> RunConflictError:
    """The refusal of ``verdict.run``'s contribution, saying who holds the group and what
    to change. ``wall`` is now (Unix seconds), for the claim's age."""
    age = max(0.0, wall - verdict.since)
    held = (
        f"run {verdict.holder!r} holds job {key.job!r} group {key.group!r} since "
        f"{_utc(verdict.since)} ({age:.0f} s ago; its newest step is {verdict.newest_step})"
    )
    if verdict.run == verdict.holder:
        detail = (
            f"run {verdict.run!r} holds job {key.job!r} group {key.group!r} since "
            f"{_utc(verdict.since)} ({age:.0f} s ago), taken over from a replaced run whose "
            f"newest step was {verdict.floor}; steps up to {verdict.floor} are that run's, so "
            f"this run must continue past step {verdict.floor}"
        )
    elif verdict.replaced:
        detail = (
            f"run {verdict.run!r} was replaced: {held}, a run resumed past this run's steps. "
            "Stop this run; the resumed one continues the job"
        )
    else:
        detail = (
            f"run {verdict.run!r} is refused: {held}. Two runs may not share a job and group: "
            "give this run a unique job, or omit job so the default includes the run id, or "
            f"wait until the holder has been idle for idle_group_ttl_s={s.idle_group_ttl_s:g} s; "
            f"a run resumed from a checkpoint must continue past step {verdict.newest_step}"
        )
    return RunConflictError(
        f"{describe_round(key.job, key.group, key.step)} rank {rank}: {detail}",
        holder=verdict.holder,
        held_since=verdict.since,
        job=key.job,
        group=key.group,
        step=key.step,
        rank=rank,
        run=verdict.run,
    )
