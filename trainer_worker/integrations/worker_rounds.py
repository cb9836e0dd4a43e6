"""One rank's lossreduce rounds inside a framework's training worker: the run, its claim,
its normalizer backend, a round per mini-batch, and the round counter kept with the
framework's checkpoint.

A framework worker (one data-parallel rank of the policy) owns one
:class:`WorkerRounds` and tells it, through :class:`DataParallel`, who its peers
are. What the worker reduces (its plan, its loss) is its own; this class only
makes each mini-batch's round give every rank the same answer or the same error:

- :meth:`WorkerRounds.reduce` sends the rank's partials for one mini-batch. A rank
  whose inputs are bad (a NaN advantage at an active token) poisons its partial so
  that every peer aborts instead of training without it: it raises
  :class:`~lossreduce.errors.InvalidPartialError` naming what was bad, its peers
  :class:`~lossreduce.errors.RoundAbortedError` naming it. An empty mini-batch
  raises :class:`~lossreduce.errors.EmptyNormalizerError` on every rank, or with
  ``on_empty_step='skip'`` returns None on every rank.
- :meth:`WorkerRounds.claim` claims the (job, group) at the coordinator from the
  round the run sends first, before any rollout, so a launch another run holds
  stops at start-up; the worker keeps :attr:`WorkerRounds.round` with its checkpoint
  (:func:`round_file`) so that a resumed run continues its rounds.

Imports no framework: the worker passes its process group in.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lossreduce.errors import EmptyNormalizerError, InvalidPartialError, RankContext
from lossreduce.trainer_worker.integrations.run_identity import resolve_run
from lossreduce.trainer_worker.integrations.settings import ReductionSettings
from lossreduce.trainer_worker.normalizers import (
    CoordinatorNormalizer,
    GlobalNormalizer,
    LocalNormalizer,
    TorchDistributedNormalizer,
    claim_run,
)
from lossreduce.trainer_worker.step_rows import StepRows, group_ids

if TYPE_CHECKING:
    from lossreduce.client import ClientSettings, ReductionClient
    from lossreduce.trainer_worker.integrations.coordinator_actor import JoinedCoordinator

__all__ = [
    "DataParallel",
    "RunClaim",
    "WorkerRounds",
    "coordinator_client",
    "describe_claims",
    "gather_rows",
    "reduce_round",
    "round_file",
    "round_metrics",
]


@dataclass(frozen=True)
class DataParallel:
    """The ranks that hold different data and reduce together, as the worker sees them."""

    group: Any  # torch.distributed process group of the data-parallel ranks
    rank: int  # this rank's index in it
    size: int  # how many ranks it has
    round_group: str  # the reduction group's name (``policy``, ``policy.sp1``...)


@dataclass(frozen=True)
class RunClaim:
    """What one rank claimed at start-up (:meth:`WorkerRounds.claim`)."""

    run: str
    job: str
    group: str
    step: int
    """The first round the run sends: 0, or where its checkpoint left the counter."""
    took_over: bool
    """The coordinator handed this run the claim of a run it replaced (a resume)."""

    def describe(self) -> str:
        """One line for the launch's log: which run holds which group from which round."""
        how = ", taken over from the run it resumes" if self.took_over else ""
        return (
            f"lossreduce: run {self.run!r} claimed job {self.job!r} group {self.group!r} "
            f"from round {self.step}{how}"
        )


def describe_claims(claims: list[RunClaim]) -> list[str]:
    """One line per group the ranks claimed (every rank of a group claims the same run
    and round); a takeover is reported once if any rank's claim made it."""
    took: dict[tuple[str, str, str, int], bool] = {}
    for c in claims:
        key = (c.run, c.job, c.group, c.step)
        took[key] = took.get(key, False) or c.took_over
    return [RunClaim(*key, took_over).describe() for key, took_over in sorted(took.items())]


def round_file(checkpoint: str, rank: int) -> str:
    """Where a rank keeps its round counter in a checkpoint folder (one file per rank:
    a node-local checkpoint folder holds its own ranks' files). A string join, so that a
    cloud URI (``s3://bucket/ckpt``) stays one."""
    return posixpath.join(checkpoint, f"lossreduce_round_rank{rank}.json")


def round_metrics(
    step: int, totals: Mapping[str, float], latency: float, *, skipped: bool
) -> dict[str, float]:
    """One mini-batch's round as metrics: its normalizers, its step twice (frameworks
    reduce a step's per-mini-batch values by the key's name, min, max or else mean, so
    ``round_min``/``round_max`` span a training step's rounds), its latency, whether it
    was skipped as empty."""
    out = {f"lossreduce/normalizer/{term}": value for term, value in totals.items()}
    out["lossreduce/round_min"] = float(step)
    out["lossreduce/round_max"] = float(step)
    out["lossreduce/round_latency_s"] = latency
    out["lossreduce/skipped"] = float(skipped)
    return out


class WorkerRounds:
    """The rounds of one data-parallel rank: ``settings`` name the backend and the job,
    ``data_parallel`` (called once, when the backend is first needed) its peers."""

    def __init__(
        self, settings: ReductionSettings, data_parallel: Callable[[], DataParallel]
    ) -> None:
        self.settings = settings
        self._data_parallel = data_parallel
        self._dp: DataParallel | None = None
        self.round = 0
        """The next mini-batch's round (its step)."""
        self._identity: tuple[str, str] | None = None
        self._normalizer: GlobalNormalizer | None = None
        self._client: ReductionClient | None = None
        self._joined: JoinedCoordinator | None = None

    @property
    def dp(self) -> DataParallel:
        """This rank's data-parallel group (resolved on first use)."""
        if self._dp is None:
            self._dp = self._data_parallel()
        return self._dp

    def identity(self) -> tuple[str, str]:
        """(run, job) of these rounds: the settings' run, else the launcher's, else rank
        0's draw shared over the default process group (every rank must call it)."""
        if self._identity is None:
            run = resolve_run(self.settings.run)
            self._identity = run, self.settings.job_of(run)
        return self._identity

    def normalizer(self) -> GlobalNormalizer:
        """The backend summing partials over the data-parallel group (made on first use)."""
        if self._normalizer is None:
            self._normalizer = self._make_normalizer()
        return self._normalizer

    def claim(self) -> RunClaim:
        """Claim the (job, group) from the round the run sends first (nothing to claim
        with the torch backend, which no other run reaches)."""
        run, job = self.identity()
        took_over = claim_run(self.normalizer(), self.round)
        return RunClaim(run, job, self.dp.round_group, self.round, took_over)

    def next_step(self) -> int:
        """The round of the mini-batch about to be reduced; counts it."""
        self.identity()
        step = self.round
        self.round += 1
        return step

    def reduce(
        self,
        step: int,
        partials: Mapping[str, Tensor],
        contracts: Mapping[str, str],
        bad: list[str],
        poisoned_term: str,
    ) -> dict[str, float] | None:
        """:func:`reduce_round` through this rank's backend."""
        return reduce_round(
            self.normalizer(),
            step,
            partials,
            contracts,
            bad=bad,
            poisoned_term=poisoned_term,
            on_empty_step=self.settings.on_empty_step,
            rank=self.dp.rank,
        )

    def close(self) -> None:
        """Close the coordinator client, if any; the next round opens a new one."""
        if self._client is not None:
            self._client.close()
        self._client = None
        self._normalizer = None

    # -- the backend ----------------------------------------------------------------

    def _make_normalizer(self) -> GlobalNormalizer:
        settings, dp = self.settings, self.dp
        run, job = self.identity()
        if settings.normalizer == "coordinator":
            from lossreduce.client import ReductionClient

            target, client = self._coordinator(job)
            self._client = ReductionClient(
                target,
                job=job,
                group=dp.round_group,
                run=run,
                rank=dp.rank,
                world_size=dp.size,
                settings=client,
            )
            return CoordinatorNormalizer(self._client)
        if dp.size == 1:
            return LocalNormalizer(job=job, group=dp.round_group)
        return TorchDistributedNormalizer(dp.group, job=job, group=dp.round_group)

    def _coordinator(self, job: str) -> tuple[str, ClientSettings]:
        target, client, self._joined = coordinator_client(self.settings, job, self._joined)
        return target, client


def gather_rows(keys: list[str], tokens: Tensor, *, world: int, group: Any) -> StepRows:
    """Every data-parallel rank's rows of one mini-batch, rank-major, for ``prompt_mean``
    (a prompt group's tokens and its owner span ranks): ``keys`` names this rank's rows'
    prompt groups, ``tokens`` (``[B]``) their ``D_i``; ``group`` is the data-parallel
    process group of ``world`` ranks (an all-gather of the keys and counts)."""
    mine = (list(keys), tokens.tolist())
    gathered: list[Any] = [mine]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
    process = [r for r, (g_keys, _) in enumerate(gathered) for _ in g_keys]
    return StepRows(
        process=torch.tensor(process, dtype=torch.long),
        window=torch.zeros(len(process), dtype=torch.long),
        group=torch.tensor(
            group_ids([k for g_keys, _ in gathered for k in g_keys]), dtype=torch.long
        ),
        tokens=torch.tensor([t for _, g_tokens in gathered for t in g_tokens], dtype=torch.float64),
    )


def reduce_round(
    normalizer: GlobalNormalizer,
    step: int,
    partials: Mapping[str, Tensor],
    contracts: Mapping[str, str],
    *,
    bad: list[str],
    poisoned_term: str,
    on_empty_step: str,
    rank: int,
) -> dict[str, float] | None:
    """One mini-batch's global normalizers; None for a skipped empty mini-batch
    (``on_empty_step='skip'``); or the round's error, the same on every rank. ``bad`` lists
    this rank's bad inputs (:func:`~lossreduce.trainer_worker.step_rows.bad_inputs`): then
    ``poisoned_term``'s partial is sent as NaN, so every peer aborts too instead of training
    without this rank, and this rank's error names what was bad."""
    sent = dict(partials)
    if bad:
        sent[poisoned_term] = torch.tensor(math.nan, dtype=torch.float64)
    try:
        totals = normalizer.reduce(step, sent, dict(contracts))
    except InvalidPartialError as err:
        if not bad:
            raise
        here = RankContext(err.job, err.group, step, rank)
        raise here.error(
            InvalidPartialError,
            f"bad input at active tokens ({'; '.join(bad)}); no rank trains on this mini-batch",
            terms=(poisoned_term,),
            values=(math.nan,),
        ) from err
    except EmptyNormalizerError:
        if on_empty_step == "raise":
            raise
        return None
    return {term: float(n) for term, n in totals.items()}


def coordinator_client(
    settings: ReductionSettings, job: str, joined: JoinedCoordinator | None
) -> tuple[str, ClientSettings, JoinedCoordinator | None]:
    """Where a rank's client dials and how: ``settings.coordinator`` with the configured
    client, or else ``job``'s coordinator actor on this Ray cluster (``joined``, or joined
    here: started unless a peer did first), with the actor's own token and CA. Returns the
    joined actor too, which the caller holds while it lives (Ray ends an actor nobody
    holds)."""
    coordinator = getattr(settings, "coordinator", None)
    if coordinator is not None:
        return str(coordinator), settings.client, joined
    if joined is None:
        from lossreduce.trainer_worker.integrations.coordinator_actor import (
            join_coordinator_actor,
        )

        # The actor's rounds wait at most as long as a client call does.
        round_timeout_s = max(1.0, settings.client.call_timeout_s - 30.0)
        joined = join_coordinator_actor(
            job, round_timeout_s=round_timeout_s, startup_timeout_s=60.0
        )
    endpoint = joined.endpoint
    # The actor's own token and CA (a run's, made fresh) replace any configured.
    given = settings.client.model_dump(exclude={"token", "tls_root_cert_pem"})
    client = type(settings.client).model_validate(
        {**given, "token": endpoint.token, "tls_root_cert_pem": endpoint.ca_cert}
    )
    return endpoint.target, client, joined
