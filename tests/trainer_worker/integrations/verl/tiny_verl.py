"""A tiny offline PPO mini-batch for verl's real engine worker, and its independent reference.

No hub access: a word-level tokenizer and a 1-layer ``Qwen2``
(``cpu_standins.verl.launch.save_model``) saved to a temporary folder (verl's
``HFModelConfig`` loads it from that path), and a fixed batch of 8 responses to 2
prompts (4 per prompt group): uneven response lengths, one response fully masked,
advantages and old/ref log-probabilities from a seeded generator. The batch is built
in the layout verl's trainer hands ``update_actor`` (left-padded prompts, right-padded
responses, converted to verl's no-padding layout by verl's own
``left_right_2_no_padding``).

:func:`reference_loss` recomputes the loss of one mini-batch from the formulas
of the reduction semantics with plain torch, row by row, on one process.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from transformers import Qwen2ForCausalLM

# The model and its tokenizer are the CPU launch's (cpu_standins.verl.launch.save_model).
from lossreduce.trainer_worker.cpu_standins.verl.launch import PAD

PROMPT_LEN = 3
BATCH = 8
RESPONSE_LEN = 5
# One prompt per group, 4 responses each: (prompt tokens, responses' tokens).
PROMPTS = [[2, 3, 4], [5, 6, 7]]
RESPONSES = [
    [[8, 9, 1], [10, 1], [11, 12, 13, 14, 15], [16, 17, 18, 1]],
    [[19, 1], [20, 21, 22, 23, 24], [25, 1], [26, 27, 2, 1]],
]
MASKED_ROW = 5
"""This response's loss mask is all zero (e.g. filtered as truncated): verl
still counts it in every seq-mean denominator."""
CLIP = 0.2
KL_COEF = 0.1
ENTROPY_COEFF = 0.01


@dataclass(frozen=True)
class Rows:
    """The padded batch, one row per response: what the reference needs."""

    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R]
    response_mask: torch.Tensor  # [B, R]
    advantages: torch.Tensor  # [B, R]
    old_log_probs: torch.Tensor  # [B, R]
    ref_log_prob: torch.Tensor  # [B, R]
    uid: list[str] = field(default_factory=list)  # [B] prompt group of each row
    values: torch.Tensor | None = None  # [B, R] the critic's old values
    returns: torch.Tensor | None = None  # [B, R] the critic's targets

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])


def rows(*, masked_row: int | None = MASKED_ROW, all_masked: bool = False) -> Rows:
    """The 8-row batch; ``masked_row`` has an all-zero loss mask, ``all_masked`` masks all."""
    input_ids, attention, response_mask, uid = [], [], [], []
    for g, (prompt, responses) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        for response in responses:
            pad = RESPONSE_LEN - len(response)
            input_ids.append(prompt + response + [PAD] * pad)
            attention.append([1] * (PROMPT_LEN + len(response)) + [0] * pad)
            response_mask.append([1] * len(response) + [0] * pad)
            uid.append(f"prompt-{g}")
    mask = torch.tensor(response_mask, dtype=torch.long)
    if masked_row is not None:
        mask[masked_row] = 0
    if all_masked:
        mask.zero_()
    gen = torch.Generator().manual_seed(3)
    shape = mask.shape
    old = -2.0 - torch.rand(shape, generator=gen)
    ref = old + 0.3 * torch.randn(shape, generator=gen)
    advantages = torch.randn(shape[0], 1, generator=gen).expand(shape).clone()
    values = 0.3 * torch.randn(shape, generator=gen)
    returns = values + 0.5 * torch.randn(shape, generator=gen)
    return Rows(
        input_ids=torch.tensor(input_ids),
        attention_mask=torch.tensor(attention),
        response_mask=mask,
        advantages=advantages,
        old_log_probs=old,
        ref_log_prob=ref,
        uid=uid,
        values=values,
        returns=returns,
    )


def shard(batch: Rows, rank: int, world: int) -> Rows:
    """Rank ``rank``'s contiguous share, as verl's dispatch hands it out."""
    per = batch.size // world
    return select(batch, list(range(rank * per, (rank + 1) * per)))


def select(batch: Rows, pick: list[int]) -> Rows:
    """The rows ``pick`` of ``batch``, in that order."""
    return Rows(
        input_ids=batch.input_ids[pick],
        attention_mask=batch.attention_mask[pick],
        response_mask=batch.response_mask[pick],
        advantages=batch.advantages[pick],
        old_log_probs=batch.old_log_probs[pick],
        ref_log_prob=batch.ref_log_prob[pick],
        uid=[batch.uid[i] for i in pick],
        values=None if batch.values is None else batch.values[pick],
        returns=None if batch.returns is None else batch.returns[pick],
    )


def near_policy(batch: Rows, model_dir: Path, scale: float = 0.1) -> Rows:
    """``batch`` with old and reference log-probabilities within ``scale`` (seeded noise)
    of the model's own: ratios near 1, so the policy losses' clipping, covariances and
    importance weights all act on the batch (the default batch's are far off)."""
    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    with torch.no_grad():
        lp, _ = _log_probs(model.float(), batch)
    gen = torch.Generator().manual_seed(5)
    old = lp + scale * torch.randn(lp.shape, generator=gen)
    ref = lp + scale * torch.randn(lp.shape, generator=gen)
    return dataclasses.replace(batch, old_log_probs=old, ref_log_prob=ref)


LOADER_SEED = 1
"""The data loader's seed the trainer sends by default here (``actor.data_loader_seed``);
verl's ``train_mini_batch`` shuffles rank ``r``'s share with ``seed + r``."""
SHUFFLE_SEED = 9
"""A loader seed whose shuffle moves row 6 (to another mini-batch or place) in two
mini-batches on one rank and on rank 1 of two (:func:`loader_order`); seed 1 leaves it
in place on rank 1."""


def tensordict(
    batch: Rows,
    *,
    mini_batch_size: int,
    epochs: int = 1,
    shuffle: bool = False,
    seed: int = LOADER_SEED,
) -> Any:
    """``batch`` as the TensorDict verl's trainer sends ``update_actor``.

    ``mini_batch_size`` is global (all ranks), as the trainer sets it:
    ``ppo_mini_batch_size * rollout.n``; ``shuffle``: ``actor.shuffle`` (``critic.shuffle``);
    ``seed``: ``actor.data_loader_seed`` (``critic.data_loader_seed``).
    """
    from tensordict import NonTensorStack, TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    n = batch.size
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    td = TensorDict(
        {
            "input_ids": batch.input_ids,
            "attention_mask": batch.attention_mask,
            "position_ids": position_ids,
            "prompts": batch.input_ids[:, :PROMPT_LEN],
            "responses": batch.input_ids[:, PROMPT_LEN:],
            "response_mask": batch.response_mask,
            "advantages": batch.advantages,
            "old_log_probs": batch.old_log_probs,
            "ref_log_prob": batch.ref_log_prob,
            **(
                {}
                if batch.values is None or batch.returns is None
                else {"values": batch.values, "returns": batch.returns}
            ),
            "uid": NonTensorStack(*batch.uid),
        },
        batch_size=[n],
    )
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(
        td,
        calculate_entropy=True,
        global_batch_size=mini_batch_size,
        mini_batch_size=mini_batch_size,
        epochs=epochs,
        seed=seed,
        dataloader_kwargs={"shuffle": shuffle},
        compute_loss=True,
        temperature=1.0,
    )
    return td


def loader_order(
    share: int, mini_batches: int, rank: int, *, shuffle: bool, seed: int
) -> list[list[int]]:
    """The rows of rank ``rank``'s share (``0..share-1``, as dispatched) in the order of
    the mini-batches verl's ``train_mini_batch`` makes of them (its own data loader, with
    the trainer's ``seed``)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    td = TensorDict({"row": torch.arange(share)}, batch_size=[share])
    loader = tu.make_iterator(
        td,
        mini_batch_size=share // mini_batches,
        epochs=1,
        seed=seed + rank,
        dataloader_kwargs={"shuffle": shuffle},
    )
    return [mini["row"].tolist() for mini in loader]


def shuffle_moves(row: int, world: int, mini_batches: int) -> bool:
    """Whether verl's loader, shuffling with :data:`SHUFFLE_SEED`, puts row ``row`` of the
    batch (dispatched over ``world`` ranks, on the last of them) in another mini-batch or
    place than without the shuffle: where it does, a name read off the mini-batch the check
    sees, split in dispatch order, would name another row."""
    rank = world - 1
    share = BATCH // world
    mine = row - rank * share
    kept, moved = (
        [(m, rows.index(mine)) for m, rows in enumerate(order) if mine in rows]
        for order in (
            loader_order(share, mini_batches, rank, shuffle=flag, seed=SHUFFLE_SEED)
            for flag in (False, True)
        )
    )
    return moved != kept


def bad_row(name: str, row: int, world: int) -> str:
    """The bad-input line naming row ``row`` of the batch as the trainer dispatched it
    over ``world`` ranks (one bad token)."""
    share = BATCH // world
    rank = row // share
    return (
        f"{name}: nan at 1 active tokens of rank {rank} rows [{row - rank * share}] "
        f"(mini-batch rows [{row}])"
    )


# -- the reference -----------------------------------------------------------------


def _log_probs(model: torch.nn.Module, batch: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Per response token: (log-probability, entropy), each [B, R]."""
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids
    ).logits  # [B, P + R, V]
    logits = logits[:, PROMPT_LEN - 1 : -1].float()  # [B, R, V]: predicts response tokens
    log_p = torch.log_softmax(logits, dim=-1)
    target = batch.input_ids[:, PROMPT_LEN:]
    token_lp = log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return token_lp, entropy


def reference_loss(
    model: torch.nn.Module,
    batch: Rows,
    mode: str,
    divisor: float | None = None,
    *,
    kl_coef: float = KL_COEF,
    entropy_coeff: float = ENTROPY_COEFF,
) -> torch.Tensor:
    """One process, the whole mini-batch: pg in ``mode`` + KL and entropy as token means.

    Units are counted over active responses only (a fully masked response is
    neither in a numerator nor in a denominator).
    """
    lp, entropy = _log_probs(model, batch)
    m = batch.response_mask.bool()
    ratio = torch.exp(torch.where(m, lp - batch.old_log_probs, 0.0).clamp(-20, 20))
    adv = torch.where(m, batch.advantages, 0.0)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
    pg = torch.where(adv < 0, torch.minimum(-adv * 3.0, pg), pg)  # dual clip, c = 3
    pg = torch.where(m, pg, 0.0)
    d = m.sum(-1).double()  # [B] D_i
    active = d > 0
    seq_sum = pg.sum(-1).double()  # [B]
    if mode == "token_mean":
        pg_loss = seq_sum.sum() / d.sum()
    elif mode == "seq_mean":
        pg_loss = (seq_sum[active] / d[active]).sum() / active.sum()
    elif mode == "constant":
        assert divisor is not None
        pg_loss = seq_sum.sum() / (divisor * active.sum())
    elif mode == "prompt_mean":
        groups = sorted(set(batch.uid))
        total, n_groups = torch.zeros((), dtype=torch.float64), 0
        for g in groups:
            rows_g = torch.tensor([u == g for u in batch.uid])
            tokens = d[rows_g].sum()
            if tokens > 0:
                total = total + seq_sum[rows_g].sum() / tokens
                n_groups += 1
        pg_loss = total / n_groups
    else:
        raise ValueError(mode)
    n_tokens = d.sum()
    # verl's low_var_kl: clamp(exp(ref - lp) - (ref - lp) - 1, -10, 10).
    kl_in = torch.where(m, batch.ref_log_prob - lp, 0.0).clamp(-20, 20)
    kl = (kl_in.exp() - kl_in - 1).clamp(-10, 10)
    kl_loss = torch.where(m, kl, 0.0).sum().double() / n_tokens
    ent_loss = torch.where(m, entropy, 0.0).sum().double() / n_tokens
    return pg_loss + kl_coef * kl_loss - entropy_coeff * ent_loss


def reference_grads(
    model_dir: Path,
    batch: Rows,
    mode: str,
    divisor: float | None = None,
    *,
    kl_coef: float = KL_COEF,
    entropy_coeff: float = ENTROPY_COEFF,
) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of :func:`reference_loss`, by name."""
    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    model.float()
    loss = reference_loss(model, batch, mode, divisor, kl_coef=kl_coef, entropy_coeff=entropy_coeff)
    assert math.isfinite(float(loss.detach()))
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
