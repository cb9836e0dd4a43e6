"""One rank's lossreduce rounds inside a training worker: the run, its claim, its
normalizer backends, a round per mini-batch, and the round counter kept with the
framework's checkpoint.

The one place outside :mod:`lossreduce.trainer_worker.normalizers` that builds a
normalizer backend: every framework's worker (verl's actor and critic on FSDP and
Megatron, AReaL's actors, TRL's trainer, SkyRL's worker) and the built-in torch engine
hold a :class:`WorkerRounds`.

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
  (:func:`round_file`, :meth:`WorkerRounds.saved` and :meth:`WorkerRounds.restore`)
  so that a resumed run continues its rounds.
- A worker with rounds besides its normalizers (verl's mini-batch statistics, AReaL's
  global M2PO cut-off) names them by a *suffix*: group ``<round_group><suffix>``, a
  backend of their own, the same job, run and peers.

The backend follows the settings: ``torch`` sums over the data-parallel process group
(the rank alone when the group has one rank), ``coordinator`` dials the configured
address or else joins the job's coordinator actor on the process's Ray cluster.

Imports no framework: the worker passes its process group in.
"""

from __future__ import annotations

import json
import math
import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lossreduce.errors import (
    EmptyNormalizerError,
    InvalidPartialError,
    LossReduceError,
    RankContext,
    format_terms,
)
from lossreduce.rules import check_partial
from lossreduce.trainer_worker.integrations.run_identity import resolve_run
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
    "RoundSettings",
    "RunClaim",
    "WorkerRounds",
    "bad_input_error",
    "coordinator_client",
    "describe_claims",
    "gather_rows",
    "poison",
    "reduce_round",
    "round_file",
    "round_metrics",
]


class RoundSettings(Protocol):
    """What :class:`WorkerRounds` reads from a worker's settings (every framework's
    :class:`~lossreduce.trainer_worker.integrations.settings.ReductionSettings` has it)."""

    @property
    def normalizer(self) -> str:
        """``torch`` or ``coordinator``."""

    @property
    def coordinator(self) -> str | None:
        """The coordinator's ``HOST:PORT``; None joins the job's Ray coordinator actor."""

    @property
    def client(self) -> ClientSettings:
        """How the coordinator client calls."""

    @property
    def on_empty_step(self) -> str:
        """``raise`` or ``skip``."""

    @property
    def run(self) -> str | None:
        """The run as configured; None takes the launcher's or rank 0's draw."""

    def job_of(self, run: str) -> str:
        """The job the rounds of ``run`` carry."""


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
    ``data_parallel`` (called once, when first needed) its peers, ``device`` (called when
    the run id is drawn) where rank 0's draw is shared from (NCCL needs a CUDA tensor)."""

    def __init__(
        self,
        settings: RoundSettings,
        data_parallel: Callable[[], DataParallel],
        *,
        device: Callable[[], Any] | None = None,
    ) -> None:
        self.settings = settings
        self._data_parallel = data_parallel
        self._device = device
        self._dp: DataParallel | None = None
        self.round = 0
        """The next mini-batch's round (its step)."""
        self._identity: tuple[str, str] | None = None
        self._normalizers: dict[str, GlobalNormalizer] = {}
        self._clients: dict[str, ReductionClient] = {}
        self._joined: JoinedCoordinator | None = None

    @property
    def dp(self) -> DataParallel:
        """This rank's data-parallel group (resolved on first use)."""
        if self._dp is None:
            self._dp = self._data_parallel()
        return self._dp

    @property
    def started(self) -> bool:
        """Whether a backend was made (a claim or a round): the rounds' names are fixed."""
        return bool(self._normalizers)

    def group(self, suffix: str = "") -> str:
        """The reduction group of the rounds named by ``suffix`` ('' for the normalizers)."""
        return self.dp.round_group + suffix

    def identity(self) -> tuple[str, str]:
        """(run, job) of these rounds: the settings' run, else the launcher's, else rank
        0's draw shared over the default process group (every rank must call it)."""
        if self._identity is None:
            device = None if self._device is None else self._device()
            run = resolve_run(self.settings.run, device=device)
            self._identity = run, self.settings.job_of(run)
        return self._identity

    @property
    def job(self) -> str:
        """The job these rounds carry (resolves the identity: every rank must call it)."""
        return self.identity()[1]

    def normalizer(self, suffix: str = "") -> GlobalNormalizer:
        """The backend summing partials over the data-parallel group for the rounds of
        ``suffix`` (made on first use)."""
        if suffix not in self._normalizers:
            self._normalizers[suffix] = self._make_normalizer(suffix)
        return self._normalizers[suffix]

    def claim(self) -> RunClaim:
        """Claim the (job, group) from the round the run sends first (nothing to claim
        with the torch backend, which no other run reaches)."""
        run, job = self.identity()
        took_over = claim_run(self.normalizer(), self.round)
        return RunClaim(run, job, self.group(), self.round, took_over)

    def advance_to(self, step: int) -> None:
        """Number the next round at least ``step`` (a framework whose own counter says
        where a recovered run stands, such as AReaL's weight version)."""
        self.round = max(self.round, step)

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
        poisoned: str | Sequence[str],
    ) -> dict[str, float] | None:
        """:func:`reduce_round` through this rank's backend."""
        return reduce_round(
            self.normalizer(),
            step,
            partials,
            contracts,
            bad=bad,
            poisoned=poisoned,
            on_empty_step=self.settings.on_empty_step,
            rank=self.dp.rank,
        )

    def saved(self) -> str:
        """The round counter as a checkpoint keeps it (:func:`round_file`)."""
        return json.dumps({"round": self.round})

    def restore(self, saved: str) -> None:
        """Continue from a checkpoint's round counter (:meth:`saved`)."""
        self.round = int(json.loads(saved)["round"])

    def close(self) -> None:
        """Close the coordinator clients, if any; the next round opens new ones."""
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._normalizers.clear()

    # -- the backend ----------------------------------------------------------------

    def _make_normalizer(self, suffix: str) -> GlobalNormalizer:
        settings, dp = self.settings, self.dp
        run, job = self.identity()
        group = self.group(suffix)
        if settings.normalizer == "coordinator":
            from lossreduce.client import ReductionClient

            target, client, self._joined = coordinator_client(settings, job, self._joined)
            self._clients[suffix] = ReductionClient(
                target,
                job=job,
                group=group,
                run=run,
                rank=dp.rank,
                world_size=dp.size,
                settings=client,
            )
            return CoordinatorNormalizer(self._clients[suffix])
        if dp.size == 1:
            return LocalNormalizer(job=job, group=group)
        return TorchDistributedNormalizer(dp.group, job=job, group=group)


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
    poisoned: str | Sequence[str],
    on_empty_step: str,
    rank: int,
) -> dict[str, float] | None:
    """One mini-batch's global normalizers; None for a skipped empty mini-batch
    (``on_empty_step='skip'``); or the round's error, the same on every rank.

    ``bad`` lists what is wrong with this rank's inputs
    (:func:`~lossreduce.trainer_worker.step_rows.bad_inputs`, a bad loss weight). Then
    the ``poisoned`` terms' partials are sent as NaN (:func:`poison`): every peer aborts
    instead of training without this rank, and this rank's error names what was bad and
    what it sent (:func:`bad_input_error`)."""
    sent = poison(partials, poisoned, bad)
    try:
        totals = normalizer.reduce(step, sent, dict(contracts))
    except EmptyNormalizerError:
        if bad:
            raise AssertionError("a round with a NaN partial was found empty") from None
        if on_empty_step == "raise":
            raise
        return None
    except LossReduceError as err:
        if not bad:
            raise
        raise bad_input_error(err, step, rank, bad, sent) from err
    if bad:
        raise AssertionError("a round with a NaN partial returned normalizers")
    return {term: float(n) for term, n in totals.items()}


def poison(
    partials: Mapping[str, Tensor], poisoned: str | Sequence[str], bad: list[str]
) -> dict[str, Tensor]:
    """The partials a rank sends: as they are, or with ``bad`` inputs each ``poisoned``
    term's as NaN (one already invalid goes as it is, so the peers' error names it)."""
    sent = dict(partials)
    if bad:
        for term in [poisoned] if isinstance(poisoned, str) else poisoned:
            value = sent.get(term)
            if value is None or check_partial(float(value)) is None:
                sent[term] = torch.tensor(math.nan, dtype=torch.float64, device=_device(value))
    return sent


def bad_input_error(
    answer: LossReduceError, step: int, rank: int, bad: list[str], sent: Mapping[str, Tensor]
) -> InvalidPartialError:
    """This rank's error for a round it poisoned (``answer``, the round's own error):
    what was bad in its inputs, and what it sent so that no rank trains on them."""
    terms = sorted(sent)
    values = [float(sent[t]) for t in terms]
    here = RankContext(answer.job or "", answer.group or "", step, rank)
    return here.error(
        InvalidPartialError,
        f"cannot train on this rank's mini-batch: {'; '.join(bad)}; sent "
        f"{format_terms(terms, values)} so that no rank trains on it",
        terms=terms,
        values=values,
    )


def _device(value: Tensor | None) -> torch.device | None:
    return None if value is None else value.device


def coordinator_client(
    settings: RoundSettings, job: str, joined: JoinedCoordinator | None
) -> tuple[str, ClientSettings, JoinedCoordinator | None]:
    """Where a rank's client dials and how: ``settings.coordinator`` with the configured
    client, or else ``job``'s coordinator actor on this Ray cluster (``joined``, or joined
    here: started unless a peer did first), with the actor's own token and CA. Returns the
    joined actor too, which the caller holds while it lives (Ray ends an actor nobody
    holds)."""
    if settings.coordinator is not None:
        return settings.coordinator, settings.client, joined
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
