"""The policy of ``lossreduce train --engine areal`` and how AReaL's FSDP actor is configured.

AReaL's ``FSDPPPOActor`` loads its policy (weights and tokenizer) from a
Hugging Face checkpoint folder: the built-in tiny Qwen2 over the task's ids
(:func:`~lossreduce.trainer_worker.train.hf_policy.save_task_qwen2`) is saved
with a word-level tokenizer over the same ids (AReaL loads one; the run never
tokenizes text). :func:`actor_config` maps the run's flags onto AReaL's
``PPOActorConfig``.

Two choices for CPU, both in the worker's own process:

- :func:`use_per_sequence_attention`: AReaL packs a micro-batch's sequences
  into one row with ``cu_seqlens``; on a GPU flash-attn's varlen kernel keeps
  them apart, but transformers' ``sdpa`` without it attends across them. The
  replacement masks causally within each packed sequence, from the
  ``cu_seq_lens_q`` AReaL passes, which is what the varlen kernel does.
- :func:`eager_on_cpu`: AReaL compiles its log-probability function with
  ``torch.compile`` on first use, tens of seconds per process on CPU for a
  model this small; eager runs the same code.

Imports AReaL (``.venv-areal``, docs/frameworks/areal.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, PPOActorConfig
from tokenizers import Tokenizer, models
from torch.nn import functional
from transformers import PreTrainedTokenizerFast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lossreduce.trainer_worker.train.hf_policy import save_task_qwen2
from lossreduce.trainer_worker.train.task import BOS, EOS
from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = [
    "GRADIENT_CLIP",
    "actor_config",
    "eager_on_cpu",
    "per_sequence_sdpa",
    "save_policy",
    "use_per_sequence_attention",
]

GRADIENT_CLIP = 1.0
"""Gradient-norm clip of a training run (``--verify`` compares raw gradients: none)."""


def task_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose ids are the task's: ``"0"``..``"9"``, EOS, BOS."""
    vocab = {str(d): d for d in range(10)} | {"<eos>": EOS, "<bos>": BOS}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>", bos_token="<bos>"
    )


def save_policy(settings: TrainSettings, folder: Path) -> Path:
    """The built-in policy and its tokenizer, seeded from ``--seed``, saved to ``folder``."""
    save_task_qwen2(settings, folder)
    task_tokenizer().save_pretrained(folder)
    return folder


def actor_config(
    settings: TrainSettings, model_path: Path, world_size: int, *, trial: str, verify: bool
) -> PPOActorConfig:
    """AReaL's configuration of one rank's actor for this run.

    One PPO minibatch per step (the step's whole shard in one ``train_batch``),
    ``--microbatches`` micro-batches, Adam at ``--lr`` without weight decay,
    fp32, GRPO's rewards as given (no reward or advantage normalization: the
    driver's group-relative advantages are the rewards), and ``--kl-coef`` as
    AReaL's KL-in-reward coefficient ``kl_ctl``.
    """
    return PPOActorConfig(
        experiment_name="lossreduce-train",
        trial_name=trial,
        path=str(model_path),
        init_from_scratch=False,
        dtype="float32",
        attn_impl="sdpa",
        optimizer=OptimizerConfig(
            type="adam",
            lr=settings.lr,
            weight_decay=0.0,
            # --verify compares raw gradients; clipping would hide a wrong scale.
            gradient_clipping=1e30 if verify else GRADIENT_CLIP,
            warmup_steps_proportion=0.0,
            lr_scheduler_type="constant",
        ),
        mb_spec=MicroBatchSpec(n_mbs=settings.microbatches),
        backend=f"fsdp:d{world_size}",
        ppo_n_minibatches=1,
        eps_clip=settings.clip_eps,
        temperature=settings.temperature,
        kl_ctl=settings.kl_coef,
        discount=1.0,
        gae_lambda=1.0,
        recompute_logprob=True,
        use_decoupled_loss=False,
        max_new_tokens=settings.response_len,
        reward_clip=1e9,
    )


def per_sequence_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention that never crosses a packed sequence's boundary.

    ``query`` is ``[b, H, S, D]``, ``key``/``value`` ``[b, H_kv, S, D]``; AReaL's
    packed micro-batches are ``b = 1`` with ``cu_seq_lens_q`` ``[n + 1]``. Without
    it (the sampler's padded ``[N, T]`` forward) every row is one sequence.
    """
    length = query.shape[2]
    position = torch.arange(length, device=query.device)  # [S]
    starts = kwargs.get("cu_seq_lens_q")
    if isinstance(starts, torch.Tensor):
        sequence = torch.bucketize(position, starts[1:].to(query.device), right=True)  # [S]
    else:
        sequence = torch.zeros_like(position)
    allowed = (sequence[:, None] == sequence[None, :]) & (position[:, None] >= position[None, :])
    groups = query.shape[1] // key.shape[1]  # grouped-query attention: repeat the kv heads
    out = functional.scaled_dot_product_attention(
        query,
        key.repeat_interleave(groups, dim=1),
        value.repeat_interleave(groups, dim=1),
        attn_mask=allowed,  # [S, S]
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
    )
    return out.transpose(1, 2).contiguous(), None  # [b, S, H, D]


def use_per_sequence_attention() -> None:
    """Make transformers' ``sdpa`` :func:`per_sequence_sdpa` in this process."""
    ALL_ATTENTION_FUNCTIONS["sdpa"] = per_sequence_sdpa


def eager_on_cpu() -> None:
    """Run ``torch.compile``'d functions eagerly in this process when it has no GPU."""
    if not torch.cuda.is_available():
        torch.compiler.set_stance("force_eager")
