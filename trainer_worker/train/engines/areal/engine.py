"""The driver's side of ``--engine areal``: rollouts, shards, AReaL steps, ``--verify``.

Per step, as with the torch engine: the driver draws the prompts, every
worker samples responses for its slice from its AReaL actor's policy, the
driver scores and filters them (whole prompt groups, variable sizes),
computes GRPO's group-relative advantages, shards whole groups across the
ranks balancing tokens, and every worker runs AReaL's PPO update on its
shard. AReaL's own inference servers (SGLang, vLLM) are not used: the job
samples itself.

``--verify`` trains one step on the workers, then replays the same batch in
one more AReaL actor of one rank, and compares the gradients each optimizer
saw (:func:`~lossreduce.trainer_worker.train.verify.compare_gradients`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayError

from lossreduce.trainer_worker.train.engines.areal.model import save_policy
from lossreduce.trainer_worker.train.engines.areal.worker import (
    ArealStepResult,
    ArealWorker,
    ArealWorkerConfig,
)
from lossreduce.trainer_worker.train.engines.base import WorkerCluster
from lossreduce.trainer_worker.train.engines.group import ShardedEngine
from lossreduce.trainer_worker.train.outputs import StepRecord
from lossreduce.trainer_worker.train.rollouts import RolloutBatch, shard_batch
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.verify import VerifyReport, compare_gradients
from lossreduce.trainer_worker.train.worker_group import (
    TrainingFailedError,
    short_error,
    worker_name,
)

__all__ = ["ArealEngine"]


class ArealEngine(ShardedEngine[ArealStepResult]):
    """:class:`~lossreduce.trainer_worker.train.engines.base.Engine` of ``--engine areal``.

    Built on the driver before Ray starts: the built-in policy is saved to
    ``<out>/model``, where every rank's AReaL actor loads it.
    """

    def __init__(self, settings: TrainSettings, job: str, out_dir: Path) -> None:
        super().__init__(settings, job, out_dir, record=_record)
        self.model_path = save_policy(settings, (out_dir / "model").resolve())

    def start(self, cluster: WorkerCluster) -> None:
        """One AReaL actor per slot in rank order, joined in one process group."""
        configs = [
            self._config(rank, self.settings.workers, cluster.targets[rank], cluster)
            for rank in range(len(cluster.placement.slots))
        ]
        self._start_ranks(ArealWorker, configs, cluster)

    def describe(self) -> str:
        return (
            f"mode {self.settings.mode}, AReaL FSDPPPOActor + LossReduce on the built-in "
            f"tiny Qwen2 ({self.model_path})"
        )

    def verify(self) -> VerifyReport:
        workers = self.workers
        batch, results = self._verified_step()
        (distributed,) = workers.gather([workers.handles[0].gradients.remote()], "gradients", 0)
        single, single_loss = self._replay(batch)
        return compare_gradients(
            distributed,
            single,
            world_size=len(workers),
            distributed_loss=math.fsum(r.loss_share for r in results),
            single_loss=single_loss,
        )

    # -- internals ---------------------------------------------------------------

    def _config(
        self, rank: int, world_size: int, target: str | None, cluster: WorkerCluster | None
    ) -> ArealWorkerConfig:
        coordinator = target if self.settings.normalizer == "coordinator" else None
        return ArealWorkerConfig(
            job=self.job,
            rank=rank,
            world_size=world_size,
            coordinator=coordinator,
            coordinator_token=cluster.token if cluster is not None else None,
            coordinator_tls_ca=cluster.tls_ca[rank] if cluster is not None else None,
            model_path=self.model_path,
            settings=self.settings,
        )

    def _train_step(
        self, batch: RolloutBatch, step: int, capture: bool = False
    ) -> list[ArealStepResult]:
        workers = self.workers
        futures = [
            h.train.remote(step, shard, capture)
            for h, shard in zip(workers.handles, shard_batch(batch, len(workers)), strict=True)
        ]
        results: list[ArealStepResult] = workers.gather(futures, "training", step)
        return results

    def _replay(self, batch: RolloutBatch) -> tuple[dict[str, torch.Tensor], float]:
        """The same step in one more AReaL actor of one rank, on all of ``batch``."""
        handle = (
            ray.remote(ArealWorker)
            .options(name=f"{worker_name(self.job, len(self.workers))}-replay", num_cpus=0)
            .remote(self._config(0, 1, None, None))
        )
        limit = self.settings.step_timeout_s
        try:
            _bounded(handle.where.remote(), limit)
            _bounded(
                handle.setup.remote(*_bounded(handle.rendezvous_address.remote(), limit)), limit
            )
            result: ArealStepResult = _bounded(handle.train.remote(0, batch, True), limit)
            grads: dict[str, torch.Tensor] = _bounded(handle.gradients.remote(), limit)
            _bounded(handle.shutdown.remote(), limit)
        finally:
            ray.kill(handle)
        return grads, result.loss_share


def _bounded(ref: Any, timeout_s: float) -> Any:
    """The one-rank replay's answer within ``timeout_s``, or TrainingFailedError saying why."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError as err:
        raise TrainingFailedError(
            f"--verify: the one-process replay did not answer within {timeout_s:g} s"
        ) from err
    except RayError as err:
        raise TrainingFailedError(
            f"--verify: the one-process replay failed: {short_error(err)}"
        ) from err


def _record(
    step: int,
    batch: RolloutBatch,
    reward: float,
    results: Sequence[ArealStepResult],
    seconds: float,
) -> StepRecord:
    first = results[0]
    round_s = max(r.round_seconds for r in results)
    return StepRecord(
        step=step,
        reward=reward,
        losses={} if first.skipped else {"pg": math.fsum(r.loss_share for r in results)},
        normalizers=dict(first.normalizers),
        round_latency_s=round_s,
        normalizer_wait_s=round_s,
        step_seconds=seconds,
        skipped=first.skipped,
        responses=len(batch),
        groups=len(batch.group_sizes),
        tokens=batch.num_tokens,
    )
