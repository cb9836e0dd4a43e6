"""Body of the AReaL tests: the real AReaL 1.0.4 ``FSDPPPOActor`` on CPU, gloo, one
spawned process per rank.

Every process of a layout runs the same list of cases in a row (as a real job
would), each on a fresh actor built from the same seed, and saves what it
measured: the parameters after the step, the step's stats, the error it
raised, and whether the weights and optimizer state were left untouched.

The data is fixed: six prompt groups of uneven size ([3, 1, 2, 4, 2, 2]
responses, 14 in all) of responses 6 to 10 tokens long, handed to
``ppo_update`` as one trajectory dict per group, the way AReaL's rollout
produces them. Two ranks hold groups 0, 2, 4 and 1, 3, 5.

Two test-only choices, both outside the code under test:

- ``TORCH_COMPILE_DISABLE=1``: AReaL compiles its log-probability function
  with torch.compile even on CPU, which costs about 40 s per process; eager
  runs the same code.
- transformers' ``sdpa`` attention is replaced by one that masks per packed
  sequence from the ``cu_seq_lens_q`` AReaL passes (what flash-attn's varlen
  kernel does on a GPU), so a micro-batch may hold several sequences without
  attention leaking between them. Stock and LossReduce actors use the same one.
"""

from __future__ import annotations

import functools
import math
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from torch.multiprocessing.spawn import spawn
from torch.nn import functional

GROUP_SIZES = [3, 1, 2, 4, 2, 2]
SHARDS = {1: [[0, 1, 2, 3, 4, 5]], 2: [[0, 2, 4], [1, 3, 5]]}
T = 10  # padded length of every trajectory dict
PROMPT = 3
LR = 0.5
EPS_CLIP = 0.2
DIVISOR = 8.0  # C of mode "constant"
ONE_PER_MB = T  # max_tokens_per_mb that fits one response (every response is > T / 2 long)
SEVERAL_PER_MB = 4 * T
VOCAB = 28
MODES = ("token_mean", "seq_mean", "prompt_mean", "constant")


BAD_WEIGHTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "inf_rank1": lambda count: count * math.inf,
    "nan_rank1": lambda count: count * math.nan,
    "negative_rank1": lambda count: -1.0 * count,
    "off_rank1": lambda count: count + 1,
}
"""Rank 1's ``loss_weight_fn``, given AReaL's own (the active-token count)."""


@dataclass(frozen=True)
class Case:
    """One ``ppo_update`` call (after ``prelude`` real steps) on every rank."""

    name: str
    impl: str = "lossreduce"  # or "stock": AReaL's own FSDPPPOActor
    mode: str = "token_mean"
    max_tokens: int = ONE_PER_MB
    normalizer: str = "torch"
    data: str = "base"  # base, nan_advantage, all_masked, masked_odd
    # count (AReaL's own), or a bad loss_weight_fn on rank 1: inf_rank1, nan_rank1,
    # negative_rank1 (-1 times the count), off_rank1 (the count + 1, disagreeing with the
    # mask); a bad one calls train_batch directly with it.
    weight: str = "count"
    on_empty_step: str = "raise"
    optimizer: str = "sgd"  # sgd, adamw (weight decay 0.1)
    prelude: int = 0  # real steps taken before the measured one
    coordinator: str = ""

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.mode,
            "normalizer": self.normalizer,
            "on_empty_step": self.on_empty_step,
            "job": f"areal-{self.name}",
        }
        if self.mode == "constant":
            out["divisor"] = DIVISOR
        if self.normalizer == "coordinator":
            out["coordinator"] = self.coordinator
        return out


# -- data ------------------------------------------------------------------------------


def group_rows(group: int, data: str = "base", rank: int = 0) -> dict[str, torch.Tensor]:
    """Trajectory dict of one prompt group, as ``ppo_update`` receives it."""
    gen = torch.Generator().manual_seed(100 + group)
    b = GROUP_SIZES[group]
    lengths = torch.randint(T // 2 + 1, T + 1, (b,), generator=gen)  # [b]
    positions = torch.arange(T)[None, :]  # [1, T]
    attention = positions < lengths[:, None]  # [b, T]
    ids = torch.randint(2, VOCAB, (b, T), generator=gen) * attention
    # AReaL's loss mask after compute_advantages: position t predicts token t + 1.
    loss_mask = (positions >= PROMPT - 1) & (positions < lengths[:, None] - 1)
    loss_mask &= torch.rand(b, T, generator=gen) > 0.15  # some response tokens masked
    advantages = torch.randn(b, T, generator=gen) * loss_mask
    old = (-3.3 + 0.05 * torch.randn(b, T, generator=gen)) * loss_mask
    # masked_odd: groups 1, 3, 5 (all of rank 1's on two ranks) have no active token.
    if data == "all_masked" or (data == "masked_odd" and group % 2 == 1):
        loss_mask = torch.zeros_like(loss_mask)
    if data == "nan_advantage" and rank == 0 and group == 0:
        advantages[0, PROMPT] = math.nan
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "loss_mask": loss_mask.float(),
        "advantages": advantages,
        "logprobs": old,
        "prox_logp": old.clone(),
        "rewards": advantages.sum(-1),
        "kl_rewards": torch.zeros(b, T),
        "tot_rewards": torch.zeros(b, T),
    }


def shard_data(world: int, rank: int, data: str = "base") -> list[dict[str, torch.Tensor]]:
    return [group_rows(g, data, rank) for g in SHARDS[world][rank]]


# -- the varlen test attention ------------------------------------------------------------


def varlen_sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence of ``cu_seq_lens_q``."""
    length = query.shape[2]  # query [1, H, S, D], key/value [1, H_kv, S, D]
    positions = torch.arange(length, device=query.device)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        segment = torch.zeros_like(positions)
    else:
        segment = torch.bucketize(positions, cu[1:].to(query.device, torch.int64), right=True)
    mask = (segment[:, None] == segment[None, :]) & (positions[:, None] >= positions[None, :])
    repeat = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(repeat, dim=1)
    value = value.repeat_interleave(repeat, dim=1)
    out = functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def use_varlen_attention() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = varlen_sdpa


# -- model folder ---------------------------------------------------------------------------


def save_model(folder: Path) -> Path:
    """A tiny Qwen2 config and a word-level tokenizer (AReaL loads both from the path)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", *(chr(c) for c in range(ord("a"), ord("a") + VOCAB - 2))]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>"
    ).save_pretrained(folder)
    tiny_qwen2(VOCAB).save_pretrained(folder)
    return folder


def tiny_qwen2(vocab: int) -> Any:
    """The tests' Qwen2 config: one layer of width 16; id 0 pads, 1 ends."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )


# -- one case ---------------------------------------------------------------------------------


def make_actor(case: Case, model_dir: str, world: int) -> Any:
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, PPOActorConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPPPOActor

    from lossreduce.trainer_worker.integrations.areal import (
        ArealReductionSettings,
        LossReduceFSDPPPOActor,
    )

    optimizer = OptimizerConfig(
        type="sgd" if case.optimizer == "sgd" else "adam",
        lr=LR if case.optimizer == "sgd" else 1e-2,
        weight_decay=0.0 if case.optimizer == "sgd" else 0.1,
        gradient_clipping=1e9,
        warmup_steps_proportion=0.0,
        lr_scheduler_type="constant",
    )
    config = PPOActorConfig(
        experiment_name="lossreduce-test",
        trial_name=case.name,
        path=model_dir,
        init_from_scratch=True,
        dtype="float32",
        attn_impl="sdpa",
        optimizer=optimizer,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=case.max_tokens),
        backend=f"fsdp:d{world}",
        ppo_n_minibatches=1,
        eps_clip=EPS_CLIP,
        temperature=1.0,
    )
    if case.impl == "stock":
        actor = FSDPPPOActor(config)
    else:
        actor = LossReduceFSDPPPOActor(
            config, reduction=ArealReductionSettings.model_validate(case.settings())
        )
    actor.create_process_group()
    torch.manual_seed(0)  # the same initial weights in every case and on every rank
    actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=64, train_batch_size=8))
    return actor


def full_params(actor: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in actor.model.named_parameters()
    }


def optimizer_state(actor: Any) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = []
    for state in actor.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                out.append(local.detach().clone())
    return out


def _update(actor: Any, case: Case, world: int, rank: int) -> dict[str, float]:
    """The measured step; returns AReaL's train stats."""
    from areal.utils import stats_tracker

    data = shard_data(world, rank, case.data)
    if case.weight == "count":
        stats_tracker.export(reset=True)  # drop what earlier steps recorded
        actor.ppo_update(data)
        stats = stats_tracker.export(reset=True)
        return {k.removeprefix("ppo_actor/update/"): float(v) for k, v in stats.items()}
    # A bad loss weight on rank 1, everything else AReaL's own PPO update.
    from areal.utils.data import concat_batch

    batch, _ = concat_batch(data)
    batch.pop("rewards")
    batch.pop("kl_rewards")
    batch.pop("tot_rewards")
    actor.train()
    from areal.trainer.ppo.actor import grpo_loss_fn

    if case.impl == "lossreduce":
        # What the actor's ppo_update adds: one prompt group per trajectory dict.
        from lossreduce.trainer_worker.integrations.areal.plan import GROUP_KEY

        batch[GROUP_KEY] = torch.cat(
            [
                torch.full(d["attention_mask"].shape, i, dtype=torch.int64)
                for i, d in enumerate(data)
            ]
        )  # [B, T]

    def weight(x: dict[str, Any]) -> torch.Tensor:
        count: torch.Tensor = x["loss_mask"].count_nonzero()
        if rank != 1:
            return count
        bad: torch.Tensor = BAD_WEIGHTS[case.weight](count)
        return bad

    return dict(
        actor.train_batch(
            batch,
            loss_fn=functools.partial(
                grpo_loss_fn, eps_clip=EPS_CLIP, eps_clip_higher=None, c_clip=None
            ),
            loss_weight_fn=weight,
        )
    )


def run_case(case: Case, model_dir: str, world: int, rank: int) -> dict[str, Any]:
    actor = make_actor(case, model_dir, world)
    try:
        for _ in range(case.prelude):
            actor.ppo_update(shard_data(world, rank))
        before = full_params(actor)
        state_before = optimizer_state(actor)
        out: dict[str, Any] = {"initial": before}
        try:
            out["stats"] = _update(actor, case, world, rank)
        except Exception as err:
            out["error"] = (type(err).__name__, str(err))
        out["params"] = full_params(actor)
        state_after = optimizer_state(actor)
        out["untouched"] = (
            all(torch.equal(out["params"][n], before[n]) for n in before)
            and len(state_before) == len(state_after)
            and all(torch.equal(a, b) for a, b in zip(state_before, state_after, strict=True))
        )
        out["skipped_steps"] = getattr(actor, "skipped_steps", None)
        return out
    finally:
        actor.destroy()


# -- the exact-sum case -------------------------------------------------------------------------


def run_exact_sum(model_dir: str, world: int, rank: int) -> dict[str, float]:
    """16,777,217 tokens on rank 0 and 1 on rank 1, summed by the actor's normalizer
    and by AReaL's own compute_total_loss_weight over the same data-parallel group."""
    from types import SimpleNamespace

    from areal.engine.core.train_engine import compute_total_loss_weight

    actor = make_actor(Case("exact-sum"), model_dir, world)
    try:
        local = float(2**24 + 1) if rank == 0 else 1.0
        ours = actor.normalizer().reduce(
            0, {"pg": torch.tensor(local, dtype=torch.float64)}, {"pg": "mean:token_mean"}
        )["pg"]
        mb_list = SimpleNamespace(mbs=[{"w": torch.tensor(int(local))}])
        theirs = compute_total_loss_weight(mb_list, lambda mb: mb["w"], actor.data_parallel_group)
        return {"lossreduce": float(ours), "areal": float(theirs)}
    finally:
        actor.destroy()


# -- the reference ---------------------------------------------------------------------------------


def reference_updates(
    model_dir: str, initial: dict[str, torch.Tensor]
) -> dict[str, dict[str, Any]]:
    """Each mode's SGD update from docs/reduction-semantics.md, row by row, in plain
    PyTorch on the same initial weights (no AReaL, no code under test)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(initial)
    rows = [group_rows(g) for g in range(len(GROUP_SIZES))]
    out = {}
    for mode in MODES:
        model.zero_grad()
        total: Any = None
        per_group = []
        for g, group in enumerate(rows):
            per_row = []
            for i in range(GROUP_SIZES[g]):
                length = int(group["attention_mask"][i].sum())
                ids = group["input_ids"][i : i + 1, :length]
                logits = model(input_ids=ids).logits[0].float()  # [L, V]
                logp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
                m = group["loss_mask"][i, : length - 1].bool()
                adv = group["advantages"][i, : length - 1]
                ratio = torch.exp(logp - group["prox_logp"][i, : length - 1])
                clipped = ratio.clamp(1 - EPS_CLIP, 1 + EPS_CLIP)
                token_loss = torch.maximum(-adv * ratio, -adv * clipped)
                per_row.append((torch.where(m, token_loss, 0.0).sum(), float(m.sum())))
            per_group.append(per_row)
        flat = [r for g in per_group for r in g]
        if mode == "token_mean":
            total = sum(s for s, _ in flat) / sum(d for _, d in flat)
        elif mode == "seq_mean":
            active = [(s, d) for s, d in flat if d > 0]
            total = sum(s / d for s, d in active) / len(active)
        elif mode == "constant":
            active = [(s, d) for s, d in flat if d > 0]
            total = sum(s for s, _ in active) / (DIVISOR * len(active))
        else:
            groups = [g for g in per_group if sum(d for _, d in g) > 0]
            total = sum(sum(s for s, _ in g) / sum(d for _, d in g) for g in groups) / len(groups)
        total.backward()
        out[mode] = {
            "loss": float(total.detach()),
            "params": {n: (p - LR * p.grad).detach().clone() for n, p in model.named_parameters()},
        }
    return out


# -- processes --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    world: int
    cases: list[Case]
    model_dir: str
    out_dir: str
    port: int
    reference: bool = False
    exact_sum: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def run_rank(rank: int, job: Job) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job.port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(job.world),
        LOCAL_WORLD_SIZE=str(job.world),
    )
    use_varlen_attention()
    # One default group for every case (an actor that made its own would tear it down).
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=job.world)
    results: dict[str, Any] = {}
    try:
        for case in job.cases:
            results[case.name] = run_case(case, job.model_dir, job.world, rank)
        if job.exact_sum:
            results["exact-sum"] = run_exact_sum(job.model_dir, job.world, rank)
        if job.reference and rank == 0:
            first = next(iter(results.values()))
            results["reference"] = reference_updates(job.model_dir, first["initial"])
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, Path(job.out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def run(job: Job) -> list[dict[str, Any]]:
    """Every rank's results of ``job`` (spawned processes, gloo on loopback)."""
    Path(job.out_dir).mkdir(parents=True, exist_ok=True)
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    # Ranks share this machine's cores: one thread each (oversubscribed, a tiny
    # model's backward is 20 times slower).
    os.environ["OMP_NUM_THREADS"] = "1"
    spawn(run_rank, args=(job,), nprocs=job.world, join=True)
    return [
        torch.load(Path(job.out_dir) / f"rank{r}.pt", weights_only=False) for r in range(job.world)
    ]


def with_coordinator(cases: list[Case], target: str) -> list[Case]:
    return [replace(c, coordinator=target) if c.normalizer == "coordinator" else c for c in cases]
