"""What engines whose ranks are Ray actors of one :class:`WorkerGroup` share."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import ray
import torch

from lossreduce.trainer_worker.train.engines.base import WorkerCluster
from lossreduce.trainer_worker.train.engines.rank import RankConfig
from lossreduce.trainer_worker.train.rollouts import RolloutBatch, Samples, build_batch
from lossreduce.trainer_worker.train.task import DigitTask, stream_seed
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.worker_group import (
    TrainingFailedError,
    WorkerGroup,
    place_rank,
)

if TYPE_CHECKING:
    from lossreduce.trainer_worker.train.outputs import StepObserver, StepRecord

__all__ = [
    "GroupEngine",
    "ShardedEngine",
    "ShardedStepResult",
    "join_group",
    "rank_gradients",
    "sample_step",
]


class GroupEngine:
    """An engine's run state: its settings, job and output folder, and the worker
    group once started. Subclasses implement the rest of
    :class:`~lossreduce.trainer_worker.train.engines.base.Engine`."""

    def __init__(self, settings: TrainSettings, job: str, out_dir: Path) -> None:
        self.settings = settings
        self.job = job
        self.out_dir = out_dir
        self._workers: WorkerGroup | None = None

    @property
    def workers(self) -> WorkerGroup:
        """The started worker group; RuntimeError before :meth:`start` placed it."""
        if self._workers is None:
            raise RuntimeError(f"{type(self).__name__}: the workers are not started")
        return self._workers

    def _start_ranks(
        self, worker_cls: type, configs: Sequence[RankConfig], cluster: WorkerCluster
    ) -> WorkerGroup:
        """``worker_cls(config)`` as one named actor per slot in rank order, joined in
        one process group (:func:`join_group`)."""
        actor_cls = ray.remote(worker_cls)
        placement = cluster.placement
        handles = [
            place_rank(actor_cls, config, self.job, config.rank, placement) for config in configs
        ]
        workers = self._workers = WorkerGroup(handles, placement, self.settings)
        workers.failure_notes = cluster.failure_notes
        join_group(workers)
        return workers

    def _train_sampled(
        self,
        task: DigitTask,
        observers: Sequence[StepObserver],
        train_step: Callable[[int, RolloutBatch, float, float], StepRecord],
    ) -> None:
        """``--steps`` steps of rollouts from the workers' own sampler (:func:`sample_step`):
        ``train_step(step, batch, reward, started)`` trains one and returns its record
        (``started``: the step's ``time.perf_counter()`` before sampling); each observer
        hears ``on_rollout`` then ``on_step``."""
        for step in range(self.settings.steps):
            started = time.perf_counter()
            batch, reward = sample_step(self.settings, task, self.workers, step)
            for observer in observers:
                observer.on_rollout(step)
            record = train_step(step, batch, reward, started)
            for observer in observers:
                observer.on_step(record)

    def shutdown(self, graceful: bool) -> None:
        """End the workers, if any were started."""
        if self._workers is not None:
            self._workers.shutdown(graceful)


class ShardedStepResult(Protocol):
    """What :class:`ShardedEngine` reads of a rank's report after a step."""

    @property
    def skipped(self) -> bool:
        """Whether the step had nothing to train."""
        ...


ResultT = TypeVar("ResultT", bound=ShardedStepResult)


class ShardedEngine(GroupEngine, ABC, Generic[ResultT]):
    """A :class:`GroupEngine` on the built-in task whose step trains the workers' sampled
    batch on every rank at once (:meth:`_train_step`: one result per rank) and records it
    with ``record(step, batch, reward, results, seconds)`` (``seconds``: the step's wall
    time, sampling included): the verl and AReaL engines.

    One place for what their ``train`` and ``--verify`` do alike, so that the engines'
    steps, and the step 0 that ``--verify`` compares, cannot drift apart.
    """

    def __init__(
        self,
        settings: TrainSettings,
        job: str,
        out_dir: Path,
        *,
        record: Callable[[int, RolloutBatch, float, Sequence[ResultT], float], StepRecord],
    ) -> None:
        super().__init__(settings, job, out_dir)
        self.task = DigitTask(settings.prompt_len, settings.response_len, settings.max_step)
        self._record = record

    def train(self, observers: Sequence[StepObserver]) -> None:
        """``--steps`` sampled steps (:meth:`GroupEngine._train_sampled`)."""
        self._train_sampled(self.task, observers, self._recorded_step)

    def _recorded_step(
        self, step: int, batch: RolloutBatch, reward: float, started: float
    ) -> StepRecord:
        results = self._train_step(batch, step)
        return self._record(step, batch, reward, results, time.perf_counter() - started)

    def _verified_step(self) -> tuple[RolloutBatch, list[ResultT]]:
        """``--verify``'s step 0 on the workers, each keeping its gradients: the batch and
        the ranks' results, or :class:`TrainingFailedError` when it had nothing to train
        (no gradients to compare)."""
        batch, _ = sample_step(self.settings, self.task, self.workers, 0)
        results = self._train_step(batch, 0, capture=True)
        if results[0].skipped:
            raise TrainingFailedError("--verify: step 0 was empty; try another --seed")
        return batch, results

    @abstractmethod
    def _train_step(self, batch: RolloutBatch, step: int, capture: bool = False) -> list[ResultT]:
        """``step`` on every rank, each on its share of ``batch`` (``capture``: each keeps
        its gradients): the ranks' results in rank order."""


def sample_step(
    settings: TrainSettings, task: DigitTask, workers: WorkerGroup, step: int
) -> tuple[RolloutBatch, float]:
    """One step's rollouts on workers whose ``sample(step, prompt_tokens, first_prompt)``
    returns :class:`Samples`: each samples its slice of the step's prompts; the driver
    scores, filters and attaches group advantages. The batch and its mean reward."""
    prompts = task.sample_prompts(
        settings.prompts_per_step,
        torch.Generator().manual_seed(stream_seed(settings.seed, "prompts", step)),
    )
    count, world = len(prompts), len(workers)
    bounds = [r * count // world for r in range(world + 1)]
    ranks = [r for r in range(world) if bounds[r + 1] > bounds[r]]
    futures = [
        workers.handles[r].sample.remote(step, prompts.tokens[bounds[r] : bounds[r + 1]], bounds[r])
        for r in ranks
    ]
    samples = Samples.concat(workers.gather(futures, "sampling", step, ranks))
    prompt_len = prompts.tokens.shape[1]
    targets = prompts.targets.repeat_interleave(settings.samples_per_prompt, dim=0)
    rewards = task.score(samples.tokens[:, prompt_len:], targets)  # [N]
    batch = build_batch(samples, rewards, settings.samples_per_prompt, prompt_len)
    return batch, float(rewards.mean())


def join_group(workers: WorkerGroup) -> None:
    """Every rank constructed, then joined in one process group at rank 0's address.

    Construction first (torch imported, policy built: slow on a busy node), so the
    rendezvous timeout covers only the join itself; the ranks' ``setup(addr, port)``
    joins it.
    """
    handles = workers.handles
    workers.gather([h.where.remote() for h in handles], "startup", None)
    addr, port = workers.gather([handles[0].rendezvous_address.remote()], "startup", None)[0]
    workers.gather([h.setup.remote(addr, port) for h in handles], "process-group setup", None)


def rank_gradients(workers: WorkerGroup, step: int) -> dict[str, torch.Tensor]:
    """The gradients every rank captured in ``step`` (its ``gradients()``), which the
    gradient sync must have made equal on every rank: rank 0's, or
    :class:`TrainingFailedError` naming the first rank and parameters that differ."""
    per_rank = workers.gather(
        [h.gradients.remote() for h in workers.handles], "gradient fetch", step
    )
    for rank, grads in enumerate(per_rank[1:], start=1):
        unequal = [n for n in grads if not torch.equal(grads[n], per_rank[0][n])]
        if unequal:
            raise TrainingFailedError(
                f"--verify: rank {rank}'s synced gradients differ from rank 0's for {unequal}"
            )
    first: dict[str, torch.Tensor] = per_rank[0]
    return first
