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

Beside it: :mod:`.reference_runs` (the formulas' update in plain PyTorch),
:mod:`.m2po_runs` (the M2PO reference), :mod:`.archon_runs` (the Archon actor) and
:mod:`.varlen_attention` (the attention above).
"""

from __future__ import annotations

import functools
import math
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from torch.multiprocessing.spawn import spawn

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
M2_THRESHOLD = 0.04  # actor.m2_threshold of the M2PO cases
WHOLE_SHARD = 16 * T  # max_tokens_per_mb that holds a rank's whole shard in one micro-batch


BAD_WEIGHTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "inf_rank1": lambda count: count * math.inf,
    "nan_rank1": lambda count: count * math.nan,
    "negative_rank1": lambda count: -1.0 * count,
    "off_rank1": lambda count: count + 1,
}
"""Rank 1's ``loss_weight_fn``, given AReaL's own (the active-token count)."""

NORMALIZER = "lossreduce/normalizer/"
"""The prefix of the normalizers among the LossReduce actor's train stats."""

JOINED = "ray"
"""``Case.coordinator`` of a case given no coordinator address: its ranks start or join
the job's coordinator actor on their Ray cluster (:attr:`Job.ray_address`), and are
refused outside one."""


@dataclass(frozen=True)
class Case:
    """One ``ppo_update`` call (after ``prelude`` real steps) on every rank."""

    name: str
    impl: str = "lossreduce"  # or "stock": AReaL's own FSDPPPOActor
    mode: str = "token_mean"
    max_tokens: int = ONE_PER_MB
    normalizer: str = "torch"
    # base, nan_advantage, nan_advantage_rank1, masked_nan, all_masked, masked_odd (see
    # group_rows)
    data: str = "base"
    # count (AReaL's own), or a bad loss_weight_fn on rank 1: inf_rank1, nan_rank1,
    # negative_rank1 (-1 times the count), off_rank1 (the count + 1, disagreeing with the
    # mask); a bad one calls train_batch directly with it.
    weight: str = "count"
    on_empty_step: str = "raise"
    optimizer: str = "sgd"  # sgd, adamw (weight decay 0.1)
    prelude: int = 0  # real steps taken before the measured one
    coordinator: str = ""  # HOST:PORT (with_coordinator sets it), or JOINED: no address
    # M2PO: actor.m2_threshold (with use_decoupled_loss=true), actor.prox_logp_method and
    # the reduction's m2po setting; None keeps M2PO off.
    m2_threshold: float | None = None
    prox_logp_method: str = "recompute"
    m2po: str = "global"
    # AReaL's training engine: fsdp (FSDPPPOActor) or archon (ArchonPPOActor, run on CPU
    # as archon_cpu_config sets it up).
    engine: str = "fsdp"

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.mode,
            "normalizer": self.normalizer,
            "on_empty_step": self.on_empty_step,
            "job": f"areal-{self.name}",
        }
        if self.mode == "constant":
            out["divisor"] = DIVISOR
        if self.normalizer == "coordinator" and self.coordinator != JOINED:
            out["coordinator"] = self.coordinator
        if self.m2_threshold is not None:
            out["m2po"] = self.m2po
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
    if data == "all_masked" or (data in ("masked_odd", "m2po_masked_odd") and group % 2 == 1):
        loss_mask = torch.zeros_like(loss_mask)
    if data == "nan_advantage" and rank == 0 and group == 0:
        advantages[0, PROMPT] = math.nan
    # Group 1 is rank 1's first on two ranks (the only rank's second on one): a NaN
    # advantage at its first row's active token PROMPT, or at its first masked response token.
    if data == "nan_advantage_rank1" and group == 1:
        assert loss_mask[0, PROMPT], "the NaN must sit at an active token"
        advantages[0, PROMPT] = math.nan
    if data == "masked_nan" and group == 1:
        masked = attention[0] & ~loss_mask[0] & (positions[0] >= PROMPT - 1)  # [T]
        advantages[0, int(masked.nonzero()[0])] = math.nan
    prox = old.clone()
    if data.startswith("m2po"):
        prox = m2po_prox(group, old, loss_mask, data, rank)
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "loss_mask": loss_mask.float(),
        "advantages": advantages,
        "logprobs": old,
        "prox_logp": prox,
        "rewards": advantages.sum(-1),
        "kl_rewards": torch.zeros(b, T),
        "tot_rewards": torch.zeros(b, T),
    }


def m2po_prox(
    group: int, old: torch.Tensor, loss_mask: torch.Tensor, data: str, rank: int
) -> torch.Tensor:
    """A recomputed ``prox_logp`` that drifted from the rollout's ``old`` [b, T].

    Most active tokens drift by about 0.1 (m2 near 0.01), one in six by 0.3 to 0.6
    (m2 0.09 to 0.36): the whole step's mean m2 is above :data:`M2_THRESHOLD`, and
    micro-batches differ in how many outliers they hold. Variants:

    - ``m2po_masked_odd``: groups 1, 3, 5 (all of rank 1's on two ranks) have no active token;
    - ``m2po_nan_prox``: rank 0's first active token of group 0 has a NaN ``prox_logp``;
    - ``m2po_inf_old``: rank 1's (or the only rank's) group 1 has an inf ``old`` log-prob,
      written into ``old`` itself;
    - ``m2po_all_cut``: every active token drifts by 1 (m2 1, far above the threshold).
    """
    gen = torch.Generator().manual_seed(500 + group)
    b = old.shape[0]
    drift = 0.1 * torch.randn(b, T, generator=gen)
    outlier = torch.rand(b, T, generator=gen) < 1 / 6
    drift = torch.where(
        outlier, torch.sign(drift) * (0.3 + 0.3 * torch.rand(b, T, generator=gen)), drift
    )
    if data == "m2po_all_cut":
        drift = torch.ones(b, T)
    prox = old + drift * loss_mask
    active = loss_mask.nonzero()
    if data == "m2po_nan_prox" and rank == 0 and group == 0 and len(active):
        prox[tuple(active[0])] = math.nan
    if data == "m2po_inf_old" and group == 1 and len(active):
        old[tuple(active[0])] = -math.inf
    return prox


def shard_data(world: int, rank: int, data: str = "base") -> list[dict[str, torch.Tensor]]:
    rows = [group_rows(g, data, rank) for g in SHARDS[world][rank]]
    if data == "teacher":
        # A teacher's log-probabilities beside the base data: AReaL adds its distillation
        # penalty (a token mean over the same loss mask) to the PPO loss.
        for g, row in zip(SHARDS[world][rank], rows, strict=True):
            gen = torch.Generator().manual_seed(700 + g)
            noise = 0.1 * torch.randn(row["logprobs"].shape, generator=gen)
            row["teacher_logp"] = (row["logprobs"] + noise) * row["loss_mask"]  # [b, T]
    return rows


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
        backend=f"{case.engine}:d{world}",
        ppo_n_minibatches=1,
        eps_clip=EPS_CLIP,
        temperature=1.0,
    )
    if case.engine == "archon":
        from tests.trainer_worker.integrations.areal.archon_runs import make_archon_actor

        return make_archon_actor(case, config)
    if case.m2_threshold is not None:
        config.m2_threshold = case.m2_threshold
        config.use_decoupled_loss = True
        config.prox_logp_method = case.prox_logp_method
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
    """Every parameter, gathered whole, under its Hugging Face name (Archon's own
    names are translated by its state-dict adapter)."""
    from torch.distributed.tensor import DTensor

    params = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in actor.model.named_parameters()
    }
    adapter = getattr(actor, "state_dict_adapter", None)
    if adapter is not None:
        converted: dict[str, torch.Tensor] = adapter.to_hf(params)
        return converted
    return params


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
    return measured_step(actor, case, shard_data(world, rank, case.data), bad_rank=rank == 1)


def measured_step(
    actor: Any, case: Case, data: list[dict[str, torch.Tensor]], bad_rank: bool
) -> dict[str, float]:
    """AReaL's own ``ppo_update`` of ``data`` (its train stats), or for a bad
    ``case.weight`` its PPO loss through ``train_batch`` with that ``loss_weight_fn``
    on the ``bad_rank`` (every other rank weighs by its token count)."""
    from areal.utils import stats_tracker

    if case.weight == "count":
        stats_tracker.export(reset=True)  # drop what earlier steps recorded
        actor.ppo_update(data)
        stats = stats_tracker.export(reset=True)
        return {k.removeprefix("ppo_actor/update/"): float(v) for k, v in stats.items()}
    # A bad loss weight on one rank, everything else AReaL's own PPO update.
    from areal.trainer.ppo.actor import grpo_loss_fn
    from areal.utils.data import concat_batch

    batch, _ = concat_batch(data)
    for key in ("rewards", "kl_rewards", "tot_rewards"):
        batch.pop(key)
    actor.train()
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
        if not bad_rank:
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
        out = measure(
            actor, lambda: _update(actor, case, world, rank), full_params, optimizer_state
        )
        if case.coordinator == JOINED and "error" not in out:
            out["dialed"] = joined_targets(actor)
        return out
    finally:
        actor.destroy()


def joined_targets(actor: Any) -> tuple[str, str]:
    """(where the actor's client dialed, where the job's coordinator actor on this Ray
    cluster serves) after a step of a :data:`JOINED` case."""
    import ray

    dialed: str = actor.rounds.normalizer().client.target
    from lossreduce.trainer_worker.integrations.coordinator_actor import get_coordinator_actor

    coordinator = get_coordinator_actor(actor.rounds.job)
    serves: str = ray.get(coordinator.target.remote(), timeout=60)
    return dialed, serves


def measure(
    actor: Any,
    step: Callable[[], dict[str, float]],
    params: Callable[[Any], dict[str, torch.Tensor]],
    state: Callable[[Any], list[torch.Tensor]],
) -> dict[str, Any]:
    """What ``step`` on ``actor`` did: the parameters before and after (``params``), its
    stats or error (and the ranks the error names: ``error_ranks``, its ``rank`` and
    ``ranks``), its time, whether it left weights and optimizer state (``state``)
    untouched, the normalizers of its last round (``normalizers``, as the actor's
    ``train_batch`` returned them, None for none) and the actor's skipped-step count."""
    before = params(actor)
    state_before = state(actor)
    out: dict[str, Any] = {"initial": before}
    normalizers: dict[str, float] = {}
    train_batch = actor.train_batch

    def recorded(*args: Any, **kwargs: Any) -> dict[str, float]:
        stats: dict[str, float] = train_batch(*args, **kwargs)
        normalizers.clear()
        normalizers.update(
            {k.removeprefix(NORMALIZER): v for k, v in stats.items() if k.startswith(NORMALIZER)}
        )
        return stats

    actor.train_batch = recorded  # AReaL's PPO update calls its engine's, the actor's own
    started = time.perf_counter()
    try:
        out["stats"] = step()
    except Exception as err:
        out["error"] = (type(err).__name__, str(err))
        out["error_ranks"] = (getattr(err, "rank", None), tuple(getattr(err, "ranks", ())))
    finally:
        del actor.train_batch
    out["seconds"] = time.perf_counter() - started
    out["normalizers"] = dict(normalizers) or None
    out["params"] = params(actor)
    state_after = state(actor)
    out["untouched"] = (
        all(torch.equal(out["params"][n], before[n]) for n in before)
        and len(state_before) == len(state_after)
        and all(torch.equal(a, b) for a, b in zip(state_before, state_after, strict=True))
    )
    out["skipped_steps"] = getattr(actor, "skipped_steps", None)
    return out


# -- the exact-sum case -------------------------------------------------------------------------


def run_exact_sum(model_dir: str, world: int, rank: int) -> dict[str, float]:
    """16,777,217 tokens on rank 0 and 1 on rank 1, summed by the actor's normalizer
    and by AReaL's own compute_total_loss_weight over the same data-parallel group."""
    from types import SimpleNamespace

    from areal.engine.core.train_engine import compute_total_loss_weight

    actor = make_actor(Case("exact-sum"), model_dir, world)
    try:
        local = float(2**24 + 1) if rank == 0 else 1.0
        ours = actor.rounds.normalizer().reduce(
            0, {"pg": torch.tensor(local, dtype=torch.float64)}, {"pg": "mean:token_mean"}
        )["pg"]
        mb_list = SimpleNamespace(mbs=[{"w": torch.tensor(int(local))}])
        theirs = compute_total_loss_weight(mb_list, lambda mb: mb["w"], actor.data_parallel_group)
        return {"lossreduce": float(ours), "areal": float(theirs)}
    finally:
        actor.destroy()


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
    ray_address: str | None = None
    """A Ray cluster every rank joins first (:data:`JOINED` cases start or join the
    job's coordinator actor on it)."""


def run_rank(rank: int, job: Job) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job.port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(job.world),
        LOCAL_WORLD_SIZE=str(job.world),
    )
    from tests.trainer_worker.integrations.areal.varlen_attention import use_varlen_attention

    use_varlen_attention()
    # One default group for every case (an actor that made its own would tear it down).
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=job.world)
    if job.ray_address is not None:
        import ray

        # Each rank a Ray driver in a namespace of its own, as under torchrun: the
        # coordinator actor's own namespace makes them meet.
        ray.init(
            address=job.ray_address,
            logging_level="ERROR",
            log_to_driver=False,
        )
    results: dict[str, Any] = {}
    try:
        for case in job.cases:
            results[case.name] = run_case(case, job.model_dir, job.world, rank)
        if job.exact_sum:
            results["exact-sum"] = run_exact_sum(job.model_dir, job.world, rank)
        if job.reference and rank == 0:
            from tests.trainer_worker.integrations.areal.reference_runs import reference_updates

            first = next(iter(results.values()))
            results["reference"] = reference_updates(job.model_dir, first["initial"])
        m2po_data = job.extra.get("m2po_reference")
        if m2po_data is not None and rank == 0:
            from tests.trainer_worker.integrations.areal.m2po_runs import m2po_reference_updates

            first = next(iter(results.values()))
            results["m2po_reference"] = m2po_reference_updates(
                job.model_dir, first["initial"], M2_THRESHOLD, m2po_data
            )
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, Path(job.out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
    if job.ray_address is not None:
        import ray

        ray.shutdown()


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
    """``cases`` with the coordinator at ``target`` (but those that join the job's actor)."""
    return [
        replace(c, coordinator=target)
        if c.normalizer == "coordinator" and c.coordinator != JOINED
        else c
        for c in cases
    ]
