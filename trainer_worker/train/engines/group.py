"""What engines whose ranks are Ray actors of one :class:`WorkerGroup` share."""

from __future__ import annotations

from pathlib import Path

import torch

from lossreduce.trainer_worker.train.rollouts import RolloutBatch, Samples, build_batch
from lossreduce.trainer_worker.train.task import DigitTask, stream_seed
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.worker_group import WorkerGroup

__all__ = ["GroupEngine", "sample_step"]


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

    def shutdown(self, graceful: bool) -> None:
        """End the workers, if any were started."""
        if self._workers is not None:
            self._workers.shutdown(graceful)


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
