"""A tiny offline policy mini-batch for SkyRL's real FSDP policy worker, and its reference.

No hub access: a 1-layer ``Qwen2`` built from a config and saved to a temporary folder
(SkyRL's ``HFModelWrapper`` loads it from that path), and a fixed mini-batch of 8
responses to 3 prompts (prompt groups of 3, 2 and 3: uneven, as SkyRL's step-wise
trajectories make them), laid out by SkyRL's own ``convert_prompts_responses_to_batch_tensors``
(left-padded sequences, right-aligned responses): uneven response lengths, one response
fully masked, advantages and old/reference log-probabilities from a seeded generator.

:func:`reference_loss` recomputes one mini-batch's loss from the formulas of
docs/reduction-semantics.md with plain torch on one process: SkyRL's ``regular`` PPO
loss, its ``k3`` KL estimator and the token entropy, each term in its own mode.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

PAD = 0
EOS = 1
VOCAB = 128
"""At least 100: the padding micro-batches of SkyRL's token-based iterator draw token ids
below 100."""
GROUPS = (
    ([5, 6, 7], [[8, 9, EOS], [10, EOS], [11, 12, 13, 14, EOS]]),
    ([15, 16], [[17, 18, 19, EOS], [20, EOS]]),
    ([21, 22, 23], [[24, 25, 26, 27, EOS], [28, EOS], [29, 30, 31, EOS]]),
)
"""(prompt tokens, its responses' tokens) per prompt group: 3, 2 and 3 responses."""
BATCH = sum(len(responses) for _, responses in GROUPS)
MASKED_ROW = 4
"""This response's loss mask is all zero (filtered, e.g. truncated): SkyRL still counts
it in its ``sequence_mean`` denominator and in its KL mean."""
CLIP = 0.2
KL_COEF = 0.1
ENTROPY_COEF = 0.01


def critic_dir(model_dir: Path) -> Path:
    """Where :func:`save_model` puts the critic's model."""
    return model_dir / "critic"


def save_model(folder: Path) -> Path:
    """A seeded 1-layer Qwen2 over :data:`VOCAB` tokens, saved to ``folder``, and the same
    with tied embeddings in :func:`critic_dir` for the critic.

    The critic's are tied because SkyRL 0.4.0 builds an untied critic on every rank but
    the first from ``transformers.modeling_utils.no_init_weights``
    (``get_llm_for_sequence_regression``), which transformers 5.16.1 no longer has: stock
    SkyRL's critic fails at start on two ranks with an untied model (docs/frameworks/
    skyrl.md)."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    config.tie_word_embeddings = True
    Qwen2ForCausalLM(config).save_pretrained(critic_dir(folder))
    return folder


@dataclass(frozen=True)
class Rows:
    """The mini-batch, one row per response, in SkyRL's layout."""

    sequences: torch.Tensor  # [B, L] left-padded prompt + response
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, R] right-aligned
    loss_mask: torch.Tensor  # [B, R]
    advantages: torch.Tensor  # [B, R]
    old_log_probs: torch.Tensor  # [B, R]
    ref_log_probs: torch.Tensor  # [B, R]
    group: torch.Tensor  # [B] prompt group of each row
    values: torch.Tensor  # [B, R] the critic's values at the rollout (old values)
    returns: torch.Tensor  # [B, R]

    @property
    def size(self) -> int:
        return int(self.sequences.shape[0])

    @property
    def response_length(self) -> int:
        return int(self.response_mask.shape[1])

    def prompt_boundaries(self) -> list[tuple[int, int]]:
        """SkyRL's ``policy_prompt_boundaries``: each group's (start, end) rows."""
        out: list[tuple[int, int]] = []
        for g in sorted(set(self.group.tolist())):
            rows = (self.group == g).nonzero().flatten()
            out.append((int(rows[0]), int(rows[-1]) + 1))
        return out


def rows(*, masked_row: int | None = MASKED_ROW, all_masked: bool = False) -> Rows:
    """The 8-row mini-batch; ``masked_row`` has an all-zero loss mask, ``all_masked``
    masks every row."""
    from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors

    prompts = [prompt for prompt, responses in GROUPS for _ in responses]
    responses = [response for _, group in GROUPS for response in group]
    group = [g for g, (_, members) in enumerate(GROUPS) for _ in members]
    masks = [[1] * len(r) for r in responses]
    if masked_row is not None:
        masks[masked_row] = [0] * len(responses[masked_row])
    if all_masked:
        masks = [[0] * len(r) for r in responses]
    rewards = [[0.0] * len(r) for r in responses]
    sequences, attention, response_mask, _, loss_mask, *_ = (
        convert_prompts_responses_to_batch_tensors(
            PAD, prompts, responses, rewards, masks, None, None, None
        )
    )
    gen = torch.Generator().manual_seed(3)
    shape = response_mask.shape
    old = -2.0 - torch.rand(shape, generator=gen)
    ref = old + 0.3 * torch.randn(shape, generator=gen)
    advantages = torch.randn(shape[0], 1, generator=gen).expand(shape).clone()
    # Old values near the returns, so that value_clip clips some tokens and not others.
    returns = torch.randn(shape, generator=gen)
    values = returns + 0.4 * torch.randn(shape, generator=gen)
    return Rows(
        sequences=sequences,
        attention_mask=attention,
        response_mask=response_mask,
        loss_mask=loss_mask.long(),
        advantages=advantages * response_mask,
        old_log_probs=old,
        ref_log_probs=ref,
        group=torch.tensor(group),
        values=values * response_mask,
        returns=returns * response_mask,
    )


def on_policy(batch: Rows, model_dir: Path) -> Rows:
    """``batch`` with the old log-probabilities the model at ``model_dir`` gives its
    responses: importance ratios start at 1, as in a first on-policy update (losses that
    zero the tokens whose ratio is far from 1, like ``rollout_is``, then train)."""
    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    with torch.no_grad():
        log_probs, _ = _log_probs(model.float(), batch)
    return replace(batch, old_log_probs=log_probs.detach())


def with_advantages(batch: Rows, advantages: torch.Tensor) -> Rows:
    """``batch`` with other advantages (``[B, R]``)."""
    return replace(batch, advantages=advantages)


def shard(batch: Rows, rank: int, world: int) -> Rows:
    """Rank ``rank``'s contiguous share, as SkyRL's dispatch chunks a mini-batch."""
    per = batch.size // world
    pick = list(range(rank * per, (rank + 1) * per))
    return Rows(**{k: getattr(batch, k)[pick] for k in batch.__dataclass_fields__})


def training_batch(batch: Rows, **extra: torch.Tensor) -> Any:
    """``batch`` as the ``TrainingInputBatch`` a policy worker's ``forward_backward`` gets."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

    data = TrainingInputBatch(
        {
            "sequences": batch.sequences,
            "attention_mask": batch.attention_mask,
            "response_mask": batch.response_mask,
            "loss_mask": batch.loss_mask,
            "advantages": batch.advantages,
            "action_log_probs": batch.old_log_probs,
            "base_action_log_probs": batch.ref_log_probs,
            "values": batch.values,
            "returns": batch.returns,
            **extra,
        }
    )
    data.metadata = {"response_length": batch.response_length}
    return data


# -- the reference -----------------------------------------------------------------


def _log_probs(model: torch.nn.Module, batch: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Per response token: (log-probability, entropy), each [B, R]."""
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=batch.sequences, attention_mask=batch.attention_mask, position_ids=position_ids
    ).logits  # [B, L, V]
    r = batch.response_length
    logits = logits[:, -r - 1 : -1].float()  # [B, R, V]: predicts the response tokens
    log_p = torch.log_softmax(logits, dim=-1)
    target = batch.sequences[:, -r:]
    token_lp = log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return token_lp, entropy


def _reduce(per_token: torch.Tensor, batch: Rows, mode: str, divisor: float | None) -> torch.Tensor:
    """The formula of ``mode`` over the whole batch (active units only)."""
    m = batch.loss_mask.bool()
    x = torch.where(m, per_token, 0.0).double()
    d = m.sum(-1).double()  # [B] D_i
    active = d > 0
    row_sum = x.sum(-1)  # [B]
    if mode == "token_mean":
        return row_sum.sum() / d.sum()
    if mode == "seq_mean":
        return (row_sum[active] / d[active]).sum() / active.sum()
    if mode == "constant":
        assert divisor is not None
        return row_sum.sum() / (divisor * active.sum())
    if mode == "prompt_mean":
        total, groups = torch.zeros((), dtype=torch.float64), 0
        for g in sorted(set(batch.group.tolist())):
            members = batch.group == g
            tokens = d[members].sum()
            if tokens > 0:
                total = total + row_sum[members].sum() / tokens
                groups += 1
        return total / groups
    raise ValueError(mode)


@dataclass(frozen=True)
class Terms:
    """Which terms a reference loss has, and each one's mode."""

    mode: str = "token_mean"
    kl_mode: str = "token_mean"
    entropy_mode: str = "token_mean"
    divisor: float | None = None
    pg: bool = True
    kl: bool = True
    entropy: bool = True
    kl_coef: float = KL_COEF
    entropy_coef: float = ENTROPY_COEF


def reference_loss(model: torch.nn.Module, batch: Rows, terms: Terms) -> torch.Tensor:
    """One process, the whole mini-batch: SkyRL's ``regular`` PPO loss in ``mode``, its
    ``k3`` KL in ``kl_mode`` and the entropy bonus in ``entropy_mode``."""
    lp, entropy = _log_probs(model, batch)
    m = batch.loss_mask.bool()
    adv = torch.where(m, batch.advantages, 0.0)
    ratio = torch.exp(torch.where(m, lp - batch.old_log_probs, 0.0).clamp(-20, 20))
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    loss = torch.zeros((), dtype=torch.float64)
    if terms.pg:
        loss = loss + _reduce(pg, batch, terms.mode, terms.divisor)
    if terms.kl:
        # k3: exp(ref - lp) - (ref - lp) - 1, both clamped as SkyRL clamps them.
        diff = torch.where(m, batch.ref_log_probs - lp, 0.0).clamp(-20, 20)
        kl = (diff.exp() - diff - 1).clamp(-10, 10)
        divisor = terms.divisor if terms.kl_mode == "constant" else None
        loss = loss + terms.kl_coef * _reduce(kl, batch, terms.kl_mode, divisor)
    if terms.entropy:
        divisor = terms.divisor if terms.entropy_mode == "constant" else None
        loss = loss - terms.entropy_coef * _reduce(entropy, batch, terms.entropy_mode, divisor)
    return loss


def reference_grads(model_dir: Path, batch: Rows, terms: Terms) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of :func:`reference_loss`, by name."""
    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    model.float()
    reference_loss(model, batch, terms).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# -- the critic's reference ------------------------------------------------------------


def critic_values(state: dict[str, torch.Tensor], model_dir: Path, batch: Rows) -> torch.Tensor:
    """SkyRL's critic (its ``CriticModel``: the Qwen2 backbone and a bias-free value head)
    with the weights ``state`` (by SkyRL's parameter names), on ``batch``: the value of
    every response token, ``[B, R]``, as a function of the weights in ``state``."""
    from torch.func import functional_call
    from transformers import Qwen2Model

    config = Qwen2Config.from_pretrained(critic_dir(model_dir))
    config._attn_implementation = "sdpa"
    backbone = Qwen2Model(config).float()
    head = torch.nn.Linear(config.hidden_size, 1, bias=False)
    position_ids = batch.attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(batch.attention_mask == 0, 1)
    inner = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    hidden = functional_call(
        backbone,
        inner,
        args=(batch.sequences,),
        kwargs={"attention_mask": batch.attention_mask, "position_ids": position_ids},
    ).last_hidden_state  # [B, L, H]
    values: torch.Tensor = functional_call(head, {"weight": state["value_head.weight"]}, (hidden,))
    return values.squeeze(-1)[:, :-1][:, -batch.response_length :]


def reference_value_grads(
    state: dict[str, torch.Tensor],
    model_dir: Path,
    batch: Rows,
    *,
    mode: str,
    divisor: float | None,
    value_clip: float | None,
) -> dict[str, torch.Tensor]:
    """Every critic parameter's gradient of the value loss
    ``0.5 * max((clip(V) - R)^2, (V - R)^2)`` reduced in ``mode`` over the whole batch
    (active units only), from the weights ``state``, by SkyRL's parameter names."""
    weights = {n: w.detach().clone().float().requires_grad_(True) for n, w in state.items()}
    values = critic_values(weights, model_dir, batch)
    m = batch.loss_mask.bool()
    old = torch.where(m, batch.values, 0.0)
    returns = torch.where(m, batch.returns, 0.0)
    loss = (values - returns) ** 2
    if value_clip is not None:
        clipped = old + (values - old).clamp(-value_clip, value_clip)
        loss = torch.max((clipped - returns) ** 2, loss)
    _reduce(0.5 * loss, batch, mode, divisor).backward()
    return {n: w.grad.detach().clone() for n, w in weights.items() if w.grad is not None}
