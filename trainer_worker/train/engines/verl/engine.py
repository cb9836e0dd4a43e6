"""``lossreduce train --engine verl``: the driver's side of a verl run on the worker group.

The driver (:mod:`lossreduce.trainer_worker.train.driver`) sets up Ray, the
coordinator actor and the placement, then drives this engine: one
:class:`VerlWorker` per placement slot, joined in one torch.distributed group.
Per step, as with ``--engine torch``, the workers sample their slices of the
step's prompts, the driver scores and filters them and computes the GRPO
advantages (:func:`~lossreduce.trainer_worker.train.engines.group.sample_step`),
shards whole prompt groups over the ranks balancing tokens, and every rank
trains one verl PPO mini-batch on its shard. A dead, failing or hung rank ends
the run with
:class:`~lossreduce.trainer_worker.train.worker_group.TrainingFailedError` naming it.

``--verify`` trains one step on the workers, keeps their gradients (after
verl's data-parallel average), then trains the same batch on one
:class:`VerlWorker` in the driver (a process group of one, the torch
normalizer) and compares the gradients.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from lossreduce.ports import LOOPBACK, free_port
from lossreduce.trainer_worker.train.engines.base import WorkerCluster
from lossreduce.trainer_worker.train.engines.group import ShardedEngine, rank_gradients
from lossreduce.trainer_worker.train.engines.verl.worker import (
    VerlStepResult,
    VerlWorker,
    VerlWorkerConfig,
    padded_rows,
)
from lossreduce.trainer_worker.train.hf_policy import save_task_qwen2
from lossreduce.trainer_worker.train.outputs import StepRecord
from lossreduce.trainer_worker.train.rollouts import RolloutBatch, shard_groups
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.verify import VerifyReport, compare_gradients

__all__ = ["VerlEngine"]


class VerlEngine(ShardedEngine[VerlStepResult]):
    """:class:`~lossreduce.trainer_worker.train.engines.base.Engine` of ``--engine verl``.

    Built on the driver before Ray starts: the built-in tiny Qwen2 is saved under
    the run's output directory (``<out>/model``), where every rank of the node loads it.
    """

    def __init__(self, settings: TrainSettings, job: str, out_dir: Path) -> None:
        super().__init__(settings, job, out_dir, record=_record)
        self.model_dir = save_task_qwen2(settings, (out_dir / "model").resolve())

    def start(self, cluster: WorkerCluster) -> None:
        """One actor per slot in rank order, joined in one torch.distributed group."""
        settings = self.settings
        coordinator = settings.normalizer == "coordinator"
        configs = [
            VerlWorkerConfig(
                job=self.job,
                rank=rank,
                world_size=settings.workers,
                coordinator=cluster.targets[rank] if coordinator else None,
                coordinator_token=cluster.token,
                coordinator_tls_ca=cluster.tls_ca[rank],
                model_path=self.model_dir,
                settings=settings,
            )
            for rank in range(len(cluster.placement.slots))
        ]
        self._start_ranks(VerlWorker, configs, cluster)

    def describe(self) -> str:
        return (
            f"mode {self.settings.mode}, verl's FSDP2 actor (LossReduceTrainingWorker) on the "
            f"built-in tiny Qwen2 ({self.model_dir}), rollouts from the job's sampler"
        )

    def verify(self) -> VerifyReport:
        workers = self.workers
        batch, results = self._verified_step()
        gradients = rank_gradients(workers, 0)
        single, single_result = self._replay(batch)
        return compare_gradients(
            gradients,
            single,
            world_size=len(workers),
            distributed_loss=sum(results[0].losses.values()),
            single_loss=sum(single_result.losses.values()),
        )

    def _train_step(
        self, batch: RolloutBatch, step: int, capture: bool = False
    ) -> list[VerlStepResult]:
        workers = self.workers
        shards = shard_groups(batch.group_tokens(), len(workers))
        sizes = [sum(batch.group_sizes[g] for g in shard) for shard in shards]
        rows = padded_rows(sizes, self.settings.microbatches)
        futures = [
            h.train.remote(step, batch.select_groups(shards[r]), shards[r], rows, capture)
            for r, h in enumerate(workers.handles)
        ]
        results: list[VerlStepResult] = workers.gather(futures, "training", step)
        return results

    def _replay(self, batch: RolloutBatch) -> tuple[dict[str, torch.Tensor], VerlStepResult]:
        """The batch's step on one verl worker in this process, with the torch normalizer."""
        config = VerlWorkerConfig(
            job=f"{self.job}-verify",
            rank=0,
            world_size=1,
            coordinator=None,
            coordinator_token=None,
            cpu_threads=None,
            model_path=self.model_dir,
            settings=self.settings.model_copy(update={"normalizer": "torch"}),
        )
        # verl's platform stays chosen for the process (verl stays imported); only the
        # rendezvous variables of this group of one are undone.
        replay = VerlWorker(config)
        with _scoped_environ():
            try:
                replay.setup(LOOPBACK, free_port())
                groups = list(range(len(batch.group_sizes)))
                rows = padded_rows([len(batch)], self.settings.microbatches)
                result = replay.train(0, batch, groups, rows, capture_gradients=True)
                return replay.gradients(), result
            finally:
                replay.shutdown()


@contextmanager
def _scoped_environ() -> Iterator[None]:
    """The driver's environment back as it was after the replay set its rank variables
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


def _record(
    step: int,
    batch: RolloutBatch,
    reward: float,
    results: Sequence[VerlStepResult],
    seconds: float,
) -> StepRecord:
    first = results[0]
    latency = max(r.round_latency_s for r in results)
    return StepRecord(
        step=step,
        reward=reward,
        losses=dict(first.losses),
        normalizers=dict(first.normalizers),
        round_latency_s=latency,
        # The integration's round blocks before the first forward: all of it is waited for.
        normalizer_wait_s=latency,
        step_seconds=seconds,
        skipped=first.skipped,
        responses=len(batch),
        groups=len(batch.group_sizes),
        tokens=batch.num_tokens,
    )
