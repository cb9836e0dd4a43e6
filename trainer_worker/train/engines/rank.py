"""What the rank actors of engines on the task's token ids share (the worker side).

A rank of such an engine is a Ray actor that says where it runs, picks the
rendezvous address (rank 0), joins its process group in ``setup`` and samples
its slice of each step's prompts from its own policy; the driver's side of
that protocol is :mod:`.group` (:func:`~.group.join_group`,
:func:`~.group.sample_step`).
"""

from __future__ import annotations

import ray
import torch
from pydantic import BaseModel, ConfigDict, Field, SecretStr
from torch import nn

from lossreduce.ports import free_port
from lossreduce.trainer_worker.train.rollouts import Samples, sample_responses
from lossreduce.trainer_worker.train.task import stream_seed
from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = ["RankActor", "RankConfig", "sample_slice"]


class RankConfig(BaseModel):
    """What every rank needs to start: who it is and how it reaches its normalizers."""

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


class RankActor:
    """The placement side of a rank: its device, where it runs, its rendezvous address."""

    device: torch.device

    def where(self) -> tuple[str, str, str]:
        """(node IP, node id, device) of this worker, for messages."""
        return (
            ray.util.get_node_ip_address(),
            ray.get_runtime_context().get_node_id(),
            str(self.device),
        )

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0 only: an address and free port on its node for torch.distributed."""
        # Free on every interface: peers on other nodes dial the node's IP.
        return ray.util.get_node_ip_address(), free_port("0.0.0.0")


def sample_slice(
    settings: TrainSettings,
    policy: nn.Module,
    reference: nn.Module | None,
    *,
    step: int,
    prompt_tokens: torch.Tensor,
    first_prompt: int,
    device: torch.device,
) -> Samples:
    """Responses for prompts ``first_prompt ...`` of ``step``, sampled on ``device`` (the
    policy's) and returned on CPU; the generator is seeded from ``(seed, step, first_prompt)``, so
    the draws do not depend on which rank samples them."""
    generator = torch.Generator().manual_seed(
        stream_seed(settings.seed, "sample", step, first_prompt)
    )
    samples = sample_responses(
        policy,
        reference,
        prompt_tokens.to(device),
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
