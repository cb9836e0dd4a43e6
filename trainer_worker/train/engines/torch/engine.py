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

import ray
import torch

from lossreduce.trainer_worker.train.engines.base import WorkerCluster
from lossreduce.trainer_worker.train.engines.group import GroupEngine, sample_rollouts, shard_batch
from lossreduce.trainer_worker.train.engines.torch.replay import single_process_gradients
from lossreduce.trainer_worker.train.engines.torch.worker import (
    TrainerWorker,
    WorkerConfig,
    WorkerStepResult,
)
from lossreduce.trainer_worker.train.outputs import StepObserver, StepRecord
from lossreduce.trainer_worker.train.rollouts import (
    RolloutBatch,
)
from lossreduce.trainer_worker.train.task import DigitTask
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.verify import VerifyReport, compare_gradients
from lossreduce.trainer_worker.train.worker_group import (
    TrainingFailedError,
    WorkerGroup,
    place_rank,
)

__all__ = ["TorchEngine"]


class TorchEngine(GroupEngine):
    """:class:`~lossreduce.trainer_worker.train.engines.base.Engine` of ``--engine torch``."""

    def __init__(self, settings: TrainSettings, job: str, out_dir: Path) -> None:
        super().__init__(settings, job, out_dir)
        self.task = DigitTask(settings.prompt_len, settings.response_len, settings.max_step)

    def start(self, cluster: WorkerCluster) -> None:
        """One actor per slot in rank order, joined in one torch.distributed group."""
        settings, placement = self.settings, cluster.placement
        actor_cls = ray.remote(TrainerWorker)
        handles = []
        for rank in range(len(placement.slots)):
            config = WorkerConfig(
                job=self.job,
                rank=rank,
                world_size=settings.workers,
                coordinator=cluster.targets[rank],
                coordinator_token=cluster.token,
                coordinator_tls_ca=cluster.tls_ca[rank],
                settings=settings,
            )
            handles.append(place_rank(actor_cls, config, self.job, rank, placement))
        workers = self._workers = WorkerGroup(handles, placement, settings)
        workers.failure_notes = cluster.failure_notes
        # Every rank constructed first (torch imported, policy built: slow on a busy node),
        # so the rendezvous timeout covers only the join itself.
        workers.gather([h.where.remote() for h in handles], "startup", None)
        # Rank 0 picks the rendezvous address on its node; everyone joins it.
        addr, port = workers.gather([handles[0].rendezvous_address.remote()], "startup", None)[0]
        workers.gather([h.setup.remote(addr, port) for h in handles], "process-group setup", None)

    def describe(self) -> str:
        return f"mode {self.settings.mode}"

    def train(self, observers: Sequence[StepObserver]) -> None:
        for step in range(self.settings.steps):
            start = time.perf_counter()
            batch, reward = self._rollouts(step)
            for observer in observers:
                observer.on_rollout(step)
            results = self._train_step(batch, reward, step)
            record = _record(step, batch, reward, results, time.perf_counter() - start)
            for observer in observers:
                observer.on_step(record)

    def verify(self) -> VerifyReport:
        workers = self.workers
        batch, reward = self._rollouts(0)
        results = self._train_step(batch, reward, 0, capture=True)
        if results[0].skipped:
            raise TrainingFailedError(
                f"--verify: step 0 was empty ({results[0].skip_reason}); try another --seed"
            )
        per_rank = workers.gather(
            [h.gradients.remote() for h in workers.handles], "gradient fetch", 0
        )
        for rank, grads in enumerate(per_rank[1:], start=1):
            unequal = [n for n in grads if not torch.equal(grads[n], per_rank[0][n])]
            if unequal:
                raise TrainingFailedError(
                    f"--verify: rank {rank}'s summed gradients differ from rank 0's for {unequal}"
                )
        single, single_loss = single_process_gradients(self.settings, self.job, batch)
        return compare_gradients(
            per_rank[0],
            single,
            world_size=len(workers),
            distributed_loss=sum(results[0].losses.values()),
            single_loss=single_loss,
        )

    def _rollouts(self, step: int) -> tuple[RolloutBatch, float]:
        """Sample on every worker, score, filter: the step's batch and its mean reward."""
        return sample_rollouts(self.task, self.settings, self.workers, step)

    def _train_step(
        self, batch: RolloutBatch, reward: float, step: int, capture: bool = False
    ) -> list[WorkerStepResult]:
        workers = self.workers
        futures = [
            h.train.remote(step, shard, reward, capture)
            for h, shard in zip(workers.handles, shard_batch(batch, len(workers)), strict=True)
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
