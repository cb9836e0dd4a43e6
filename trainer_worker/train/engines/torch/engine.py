"""The driver's side of ``--engine torch``: rollouts, shards, steps, ``--verify``.

Per step the engine draws the prompts, has every worker sample responses for
its slice of them, scores and filters the responses (whole prompt groups,
variable sizes), computes group-relative advantages, shards whole groups
across the ranks balancing tokens, and has every worker train on its shard.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from lossreduce.trainer_worker.train.engines.base import WorkerCluster
from lossreduce.trainer_worker.train.engines.group import GroupEngine, rank_gradients, sample_step
from lossreduce.trainer_worker.train.engines.torch.replay import single_process_gradients
from lossreduce.trainer_worker.train.engines.torch.worker import (
    TrainerWorker,
    WorkerConfig,
    WorkerStepResult,
)
from lossreduce.trainer_worker.train.outputs import StepObserver, StepRecord
from lossreduce.trainer_worker.train.rollouts import RolloutBatch, shard_groups
from lossreduce.trainer_worker.train.task import DigitTask
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.verify import VerifyReport, compare_gradients
from lossreduce.trainer_worker.train.worker_group import (
    TrainingFailedError,
)

__all__ = ["TorchEngine"]


class TorchEngine(GroupEngine):
    """:class:`~lossreduce.trainer_worker.train.engines.base.Engine` of ``--engine torch``."""

    def __init__(self, settings: TrainSettings, job: str, out_dir: Path) -> None:
        super().__init__(settings, job, out_dir)
        self.task = DigitTask(settings.prompt_len, settings.response_len, settings.max_step)

    def start(self, cluster: WorkerCluster) -> None:
        """One actor per slot in rank order, joined in one torch.distributed group."""
        settings = self.settings
        configs = [
            WorkerConfig(
                job=self.job,
                rank=rank,
                world_size=settings.workers,
                coordinator=cluster.targets[rank],
                coordinator_token=cluster.token,
                coordinator_tls_ca=cluster.tls_ca[rank],
                settings=settings,
            )
            for rank in range(len(cluster.placement.slots))
        ]
        self._start_ranks(TrainerWorker, configs, cluster)

    def describe(self) -> str:
        return f"mode {self.settings.mode}"

    def train(self, observers: Sequence[StepObserver]) -> None:
        self._train_sampled(self.task, observers, self._recorded_step)

    def _recorded_step(
        self, step: int, batch: RolloutBatch, reward: float, started: float
    ) -> StepRecord:
        results = self._train_step(batch, reward, step)
        return _record(step, batch, reward, results, time.perf_counter() - started)

    def verify(self) -> VerifyReport:
        workers = self.workers
        batch, reward = self._rollouts(0)
        results = self._train_step(batch, reward, 0, capture=True)
        if results[0].skipped:
            raise TrainingFailedError(
                f"--verify: step 0 was empty ({results[0].skip_reason}); try another --seed"
            )
        gradients = rank_gradients(workers, 0)
        single, single_loss = single_process_gradients(self.settings, self.job, batch)
        return compare_gradients(
            gradients,
            single,
            world_size=len(workers),
            distributed_loss=sum(results[0].losses.values()),
            single_loss=single_loss,
        )

    def _rollouts(self, step: int) -> tuple[RolloutBatch, float]:
        """Sample on every worker, score, filter: the step's batch and its mean reward."""
        return sample_step(self.settings, self.task, self.workers, step)

    def _train_step(
        self, batch: RolloutBatch, reward: float, step: int, capture: bool = False
    ) -> list[WorkerStepResult]:
        workers = self.workers
        shards = shard_groups(batch.group_tokens(), len(workers))
        futures = [
            h.train.remote(step, batch.select_groups(shards[r]), reward, capture)
            for r, h in enumerate(workers.handles)
        ]
        results: list[WorkerStepResult] = workers.gather(futures, "training", step)
        return results


def _record(
    step: int,
    batch: RolloutBatch,
    reward: float,
    results: Sequence[WorkerStepResult],
    seconds: float,
) -> StepRecord:
    first = results[0]
    # Show normalizers in the loss's term order (backends may return them sorted).
    order = [*first.losses, *sorted(set(first.normalizers) - set(first.losses))]
    return StepRecord(
        step=step,
        reward=reward,
        losses=dict(first.losses),
        normalizers={term: first.normalizers[term] for term in order},
        round_latency_s=max(r.round_latency_s for r in results),
        normalizer_wait_s=max(r.normalizer_wait_s for r in results),
        step_seconds=seconds,
        skipped=first.skipped,
        responses=len(batch),
        groups=len(batch.group_sizes),
        tokens=batch.num_tokens,
    )
