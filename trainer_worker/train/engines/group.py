"""What engines whose ranks are Ray actors of one :class:`WorkerGroup` share.

- :class:`GroupEngine`: the run's state and the workers' shutdown;
- :class:`RankConfig`: what every rank needs to start, engines add their own fields;
- :func:`rank_location` and :func:`rendezvous_address`: a rank's answers to the
  driver's startup questions;
- :func:`sample_rollouts`, :func:`sample_slice` and :func:`shard_batch`: a
  step's rollouts sampled on the workers, then scored, filtered and sharded in
  whole prompt groups on the driver, for engines whose workers sample the task's token ids with
  :func:`~lossreduce.trainer_worker.train.rollouts.sample_responses`.
"""

from __future__ import annotations

from pathlib import Path

import ray
import torch
from pydantic import BaseModel, ConfigDict, Field, SecretStr
from torch import nn

from lossreduce.ports import free_port
from lossreduce.trainer_worker.train.rollouts import (
    RolloutBatch,
    Samples,
    build_batch,
    sample_responses,
    shard_groups,
)
from lossreduce.trainer_worker.train.task import DigitTask, stream_seed
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.worker_group import WorkerGroup

__all__ = [
    "GroupEngine",
    "RankConfig",
    "rank_location",
    "rendezvous_address",
    "sample_rollouts",
    "sample_slice",
    "shard_batch",
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

    def shutdown(self, graceful: bool) -> None:
        """End the workers, if any were started."""
        if self._workers is not None:
            self._workers.shutdown(graceful)


class RankConfig(BaseModel):
    """What one rank needs to start."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job: str = Field(description="Job name of the coordinator rounds and metrics.")
    rank: int = Field(ge=0, description="This worker's rank.")
    world_size: int = Field(ge=1, description="Number of ranks.")
    coordinator: str | None = Field(
        description="HOST:PORT of the coordinator, or of this node's agent when the run "
        "aggregates per node (None with the torch normalizer)."
    )
    coordinator_token: SecretStr | None = Field(
        description="Bearer token the coordinator accepts (None: send none)."
    )
    coordinator_tls_ca: bytes | None = Field(
        default=None,
        description="PEM CA the coordinator's TLS certificate chains to (None: plaintext, "
        "e.g. to a coordinator or agent on loopback).",
    )
    settings: TrainSettings = Field(description="The run's settings.")


def rank_location(device: str) -> tuple[str, str, str]:
    """(node IP, node id, ``device``) of the calling Ray actor, for messages."""
    return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), device


def rendezvous_address() -> tuple[str, int]:
    """An address and free port on the calling actor's node for torch.distributed."""
    # Free on every interface: peers on other nodes dial the node's IP.
    return ray.util.get_node_ip_address(), free_port("0.0.0.0")


def sample_rollouts(
    task: DigitTask, settings: TrainSettings, workers: WorkerGroup, step: int
) -> tuple[RolloutBatch, float]:
    """Sample on the workers (``sample(step, prompt_tokens, first_prompt)`` each, on
    consecutive slices of the step's prompts), score, filter: the step's batch and
    the mean reward of every sampled response."""
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


@torch.no_grad()
def sample_slice(
    settings: TrainSettings,
    policy: nn.Module,
    reference: nn.Module | None,
    prompt_tokens: torch.Tensor,
    *,
    step: int,
    first_prompt: int,
) -> Samples:
    """A worker's responses for prompts ``first_prompt ...`` of ``step``, on CPU, drawn
    with the generator of ``(seed, step, first_prompt)`` (a rerun draws the same)."""
    generator = torch.Generator().manual_seed(
        stream_seed(settings.seed, "sample", step, first_prompt)
    )
    samples = sample_responses(
        policy,
        reference,
        prompt_tokens,
        samples_per_prompt=settings.samples_per_prompt,
        response_len=settings.response_len,
        temperature=settings.temperature,
        generator=generator,
    )
    return Samples(
        tokens=samples.tokens.cpu(),
        loss_mask=samples.loss_mask.cpu(),
        old_logprobs=samples.old_logprobs.cpu(),
        ref_logprobs=samples.ref_logprobs.cpu(),
    )


def shard_batch(batch: RolloutBatch, world_size: int) -> list[RolloutBatch]:
    """Each rank's shard of ``batch``: whole prompt groups, balancing tokens."""
    return [
        batch.select_groups(groups) for groups in shard_groups(batch.group_tokens(), world_size)
    ]
