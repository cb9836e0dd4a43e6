"""``lossreduce train --engine trl``: the driver's side of a TRL run on the worker group.

The driver (:mod:`lossreduce.trainer_worker.train.driver`) sets up Ray, the
coordinator actor and the placement, then drives this engine: one
:class:`TRLWorker` per placement slot, a rendezvous on rank 0's node, and every
rank's ``train()`` of ``--steps`` optimizer steps. Rank 0's
step records arrive through a Ray queue and feed the progress bar,
``metrics.jsonl`` and the plot; a dead, failing or hung rank ends the run with
:class:`TrainingFailedError` naming it, as with the torch engine.

``--verify`` trains one step on the workers, keeps the completions they
trained on and their gradients (after the processes' average), then replays
the same completions in one process in the driver and compares the gradients.
"""

from __future__ import annotations

import queue as stdlib_queue
import time
from collections.abc import Sequence
from pathlib import Path

import ray
from ray.util.queue import Empty, Queue

from lossreduce.trainer_worker.train.engines.base import WorkerCluster
from lossreduce.trainer_worker.train.engines.group import GroupEngine
from lossreduce.trainer_worker.train.engines.trl.model import PolicyCheckpoint, prepare_policy
from lossreduce.trainer_worker.train.engines.trl.worker import (
    StepReporter,
    TRLRunSummary,
    TRLWorker,
    TRLWorkerConfig,
    build_trainer,
    reduction_settings,
)
from lossreduce.trainer_worker.train.outputs import StepObserver, StepRecord
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.verify import VerifyReport, compare_gradients
from lossreduce.trainer_worker.train.worker_group import (
    TrainingFailedError,
    WorkerGroup,
    place_rank,
)

__all__ = ["TRLEngine"]

POLL_S = 0.5
"""How often the driver looks for step records and finished ranks."""


class TRLEngine(GroupEngine):
    """:class:`~lossreduce.trainer_worker.train.engines.base.Engine` of ``--engine trl``.

    Built on the driver before Ray starts: the policy checkpoint (``--model``, or
    the built-in tiny Qwen2 saved under the run's output directory) is checked
    here, so bad input costs nothing.
    """

    def __init__(self, settings: TrainSettings, job: str, out_dir: Path) -> None:
        super().__init__(settings, job, out_dir)
        self.policy: PolicyCheckpoint = prepare_policy(settings, out_dir)

    def start(self, cluster: WorkerCluster) -> None:
        """One :class:`TRLWorker` per slot; they join their process group in ``run``."""
        settings, placement = self.settings, cluster.placement
        actor_cls = ray.remote(TRLWorker)
        seen: dict[str, int] = {}
        handles = []
        for rank, slot in enumerate(placement.slots):
            local_rank = seen[slot.node_id] = seen.get(slot.node_id, -1) + 1
            config = TRLWorkerConfig(
                job=self.job,
                rank=rank,
                world_size=settings.workers,
                local_rank=local_rank,
                coordinator=cluster.targets[rank] if settings.normalizer == "coordinator" else None,
                coordinator_token=cluster.token,
                coordinator_tls_ca=cluster.tls_ca[rank],
                model_path=self.policy.path,
                built_in=self.policy.built_in,
                pad_with_eos=self.policy.pad_with_eos,
                out_dir=self.out_dir.resolve(),
                settings=settings,
            )
            handles.append(place_rank(actor_cls, config, self.job, rank, placement))
        self._workers = WorkerGroup(handles, placement, settings)
        self._workers.failure_notes = cluster.failure_notes

    def describe(self) -> str:
        policy = self.policy
        line = (
            f"mode {self.settings.mode}, policy "
            + ("built-in tiny Qwen2" if policy.built_in else str(policy.path))
            + f" ({policy.path})"
        )
        return "\n".join([line, *policy.notes])

    def train(self, observers: Sequence[StepObserver]) -> None:
        _train(self.workers, self.settings.steps, observers)

    def verify(self) -> VerifyReport:
        settings, workers, policy = self.settings, self.workers, self.policy
        summaries = _train(workers, 1, ())
        first = summaries[0]
        if first.skipped_steps or first.gradients is None or first.loss is None:
            raise TrainingFailedError(
                "--verify: step 0 was empty on the workers; try another --seed"
            )
        replay = [row for s in summaries for row in (s.rollouts or [])]
        trainer = build_trainer(
            settings,
            policy.path,
            self.out_dir / "trl-verify",
            reduction_settings(settings, self.job, normalizer="torch"),
            world_size=len(workers),
            steps=1,
            pad_with_eos=policy.pad_with_eos,
            replay=replay,
        )
        reporter = StepReporter(trainer, None, capture=True)
        trainer.add_callback(reporter)
        trainer.train()
        if reporter.gradients is None or reporter.loss is None:
            raise TrainingFailedError("--verify: the one-process step was empty")
        return compare_gradients(
            first.gradients,
            reporter.gradients,
            world_size=len(workers),
            distributed_loss=first.loss,
            single_loss=reporter.loss,
        )


def _train(
    workers: WorkerGroup, steps: int, observers: Sequence[StepObserver]
) -> list[TRLRunSummary]:
    """Every rank's run; rank 0's records go to ``observers`` as they come."""
    addr, port = workers.gather([workers.handles[0].rendezvous_address.remote()], "startup", None)[
        0
    ]
    records = Queue(actor_options={"num_cpus": 0})
    try:
        futures = [h.run.remote(addr, port, records, steps) for h in workers.handles]
        quiet_since = time.monotonic()
        limit = workers.settings.step_timeout_s
        while time.monotonic() - quiet_since < limit:
            if _drain(records, observers, timeout_s=POLL_S):
                quiet_since = time.monotonic()
            done, _ = ray.wait(futures, num_returns=len(futures), timeout=0)
            if done:
                break  # a rank finished or failed: gather() reports which, with a bound
        summaries: list[TRLRunSummary] = workers.gather(futures, "training", None)
        _drain(records, observers, timeout_s=0.0)
        return summaries
    finally:
        records.shutdown()


def _drain(records: Queue, observers: Sequence[StepObserver], timeout_s: float) -> bool:
    """Hand every queued record to the observers; whether there was one."""
    got = False
    while True:
        try:
            record: StepRecord = records.get(block=timeout_s > 0 and not got, timeout=timeout_s)
        except (Empty, stdlib_queue.Empty):
            return got
        got = True
        for observer in observers:
            observer.on_rollout(record.step)
            observer.on_step(record)
