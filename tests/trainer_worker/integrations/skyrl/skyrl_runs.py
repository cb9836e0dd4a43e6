"""Runs of SkyRL's real FSDP policy worker and of ``LossReducePolicyWorker`` on the tiny setup.

A layout is a number of data-parallel ranks (1 or 2, gloo on loopback, spawned here)
and a micro-batch size; every rank of a layout runs the same list of :class:`Case` s
in a row, each on a fresh worker (SkyRL's FSDP strategy on lossreduce's CPU platform
for SkyRL), one ``forward_backward`` call per case, and saves per case every
parameter's gradient (before the optimizer), the normalizers the worker used, what
its optimizer step did, and any error.

A ``stock`` case is SkyRL as it ships: the advantages divided by SkyRL's driver-side
``apply_loss_reduction_to_advantages_minibatch`` over the whole mini-batch (what
``RayPPOTrainer._normalize_advantages`` does), then SkyRL's ``FSDPPolicyWorkerBase``.
A ``critic`` case trains the critic instead (``LossReduceCriticWorker``, its ``mode``
the settings' ``critic_mode``), a ``stock-critic`` case SkyRL's ``FSDPCriticWorkerBase``;
both save the critic's weights before the update (``initial``).
"""

from __future__ import annotations

import os
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.spawn import spawn

from tests.trainer_worker.integrations.skyrl import tiny_skyrl

QUIET_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "LOG_LEVEL": "ERROR",
}


@dataclass(frozen=True)
class Case:
    name: str
    # lossreduce; stock: SkyRL's own worker and driver-side division; critic, stock-critic
    worker: str = "lossreduce"
    mode: str = "token_mean"
    kl_mode: str = "token_mean"
    entropy_mode: str = "token_mean"
    divisor: float | None = None
    loss_reduction: str = "token_mean"  # SkyRL's, for the stock worker
    kl: bool = True
    entropy: bool = True
    zero_advantages: bool = False  # isolate the KL and entropy gradients
    normalizer: str = "torch"
    coordinator: str | None = None
    on_empty_step: str = "raise"
    batch: str = "default"  # see batch_of
    optimizer: str = "none"  # none: gradients only; sgd (lr 1); adamw: SkyRL's own
    step: bool = False  # call optim_step after forward_backward
    max_tokens: int = -1  # SkyRL's max_tokens_per_microbatch (token-based micro-batches)
    policy_loss: str = "regular"
    rollout_logprobs: bool = False  # the batch carries the rollout's log-probabilities
    on_policy: bool = False  # old log-probabilities are the model's own (ratios start at 1)
    without_old: bool = False  # no old log-probabilities: SkyRL skipped their forward
    z_score: bool = False  # the trainer's advantage_batch_normalize, over the whole batch
    extra: dict[str, Any] = field(default_factory=dict)  # more lossreduce settings


def batch_of(case: Case) -> tiny_skyrl.Rows:
    if case.batch == "dense":
        batch = tiny_skyrl.rows(masked_row=None)
    elif case.batch == "all_masked":
        batch = tiny_skyrl.rows(all_masked=True)
    else:
        batch = tiny_skyrl.rows()
    if case.batch == "nan_return":
        returns = batch.returns.clone()
        returns[6, -1] = float("nan")  # rank 1's row 2 on two ranks; an active token
        batch = replace(batch, returns=returns)
    elif case.batch == "critic_masked_nan":
        # The masked response and a padding token of an active one (row 0 is left-padded).
        values, returns = batch.values.clone(), batch.returns.clone()
        for tensor in (values, returns):
            tensor[tiny_skyrl.MASKED_ROW] = float("nan")
            tensor[0, 0] = float("nan")
        batch = replace(batch, values=values, returns=returns)
    if case.batch == "nan_advantage":
        advantages = batch.advantages.clone()
        advantages[6, -1] = float("nan")  # rank 1's row 2 on two ranks; an active token
        batch = tiny_skyrl.with_advantages(batch, advantages)
    elif case.batch == "inf_advantage":
        advantages = batch.advantages.clone()
        advantages[1, -1] = float("inf")  # rank 0's row 1 on two ranks
        batch = tiny_skyrl.with_advantages(batch, advantages)
    elif case.batch == "masked_nan":
        advantages = batch.advantages.clone()
        advantages[tiny_skyrl.MASKED_ROW] = float("nan")  # only masked tokens
        batch = tiny_skyrl.with_advantages(batch, advantages)
    elif case.batch in ("masked_nan_padding", "masked_zero_padding"):
        # The masked response and a padding token of an active one (row 0 is left-padded).
        value = float("nan") if case.batch == "masked_nan_padding" else 0.0
        advantages = batch.advantages.clone()
        advantages[tiny_skyrl.MASKED_ROW] = value
        advantages[0, 0] = value
        batch = tiny_skyrl.with_advantages(batch, advantages)
    elif case.batch == "rank1_masked":
        loss_mask = batch.loss_mask.clone()
        loss_mask[batch.size // 2 :] = 0  # every response of rank 1 on two ranks
        batch = replace(batch, loss_mask=loss_mask)
    if case.zero_advantages:
        batch = tiny_skyrl.with_advantages(batch, torch.zeros_like(batch.advantages))
    if case.z_score:
        from lossreduce.trainer_worker.integrations.skyrl.plan import z_score

        # LossReduceRayPPOTrainer's z-score, on the driver's whole batch.
        batch = tiny_skyrl.with_advantages(batch, z_score(batch.advantages, batch.loss_mask))
    return batch


def _trainer_config(case: Case, model_dir: Path, micro: int) -> Any:
    from skyrl.train.config.config import MixedPrecisionConfig

    from lossreduce.trainer_worker.integrations.skyrl.config import LossReduceTrainerConfig

    cfg = LossReduceTrainerConfig()
    cfg.policy.model.path = str(model_dir)
    cfg.flash_attn = False
    cfg.remove_microbatch_padding = False
    cfg.gradient_checkpointing = False
    cfg.micro_train_batch_size_per_gpu = micro
    cfg.max_tokens_per_microbatch = case.max_tokens
    cfg.policy.fsdp_config.mixed_precision = MixedPrecisionConfig(
        param_dtype="fp32", reduce_dtype="fp32", buffer_dtype="fp32"
    )
    for optimizer in (cfg.policy.optimizer_config, cfg.critic.optimizer_config):
        optimizer.max_grad_norm = 0.0 if case.optimizer != "adamw" else 1.0
        optimizer.lr = 1e-2
        optimizer.weight_decay = 0.1
    if is_critic(case):
        cfg.critic.model.path = str(tiny_skyrl.critic_dir(model_dir))
        cfg.critic.fsdp_config.mixed_precision = MixedPrecisionConfig(
            param_dtype="fp32", reduce_dtype="fp32", buffer_dtype="fp32"
        )
    algorithm = cfg.algorithm
    algorithm.temperature = 1.0
    algorithm.policy_loss_type = case.policy_loss
    algorithm.loss_reduction = case.loss_reduction
    algorithm.eps_clip_low = algorithm.eps_clip_high = tiny_skyrl.CLIP
    algorithm.use_kl_loss = case.kl
    algorithm.kl_loss_coef = tiny_skyrl.KL_COEF
    algorithm.kl_estimator_type = "k3"
    algorithm.use_entropy_loss = case.entropy
    algorithm.entropy_loss_coef = tiny_skyrl.ENTROPY_COEF
    if case.worker in ("lossreduce", "critic"):
        mode = "critic_mode" if case.worker == "critic" else "mode"
        settings: dict[str, Any] = {
            mode: case.mode,
            "kl_mode": case.kl_mode,
            "entropy_mode": case.entropy_mode,
            "normalizer": case.normalizer,
            "on_empty_step": case.on_empty_step,
            "job": f"skyrl-test-{case.name}",
            "run": "skyrltest",
            **case.extra,
        }
        if case.worker == "critic":
            del settings["kl_mode"], settings["entropy_mode"]
        if case.divisor is not None:
            settings["divisor"] = case.divisor
        if case.coordinator is not None:
            settings["coordinator"] = case.coordinator
        cfg.lossreduce = settings
    return cfg


def is_critic(case: Case) -> bool:
    """Whether the case trains the critic."""
    return case.worker in ("critic", "stock-critic")


def _stock_advantages(case: Case, batch: tiny_skyrl.Rows, micro: int) -> tiny_skyrl.Rows:
    """What SkyRL's driver hands the workers: advantages divided by SkyRL's counts."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import (
        apply_loss_reduction_to_advantages_minibatch,
    )

    scaled = apply_loss_reduction_to_advantages_minibatch(
        advantages=batch.advantages,
        loss_mask=batch.loss_mask,
        loss_reduction=case.loss_reduction,
        micro_batch_size=micro,
        max_seq_len=int(case.divisor or batch.response_length),
        prompt_boundaries=batch.prompt_boundaries(),
    )
    return tiny_skyrl.with_advantages(batch, scaled)


@dataclass(frozen=True)
class Layout:
    """What every rank of one spawn shares."""

    world: int
    micro: int
    port: int
    model_dir: Path
    cases: tuple[Case, ...]
    out: Path


def _worker(case: Case, rank: int, layout: Layout) -> Any:
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import (
        FSDPCriticWorkerBase,
        FSDPPolicyWorkerBase,
    )

    from lossreduce.trainer_worker.integrations.skyrl.critic import LossReduceCriticWorker
    from lossreduce.trainer_worker.integrations.skyrl.worker import LossReducePolicyWorker

    cls = {
        "lossreduce": LossReducePolicyWorker,
        "stock": FSDPPolicyWorkerBase,
        "critic": LossReduceCriticWorker,
        "stock-critic": FSDPCriticWorkerBase,
    }[case.worker]
    worker = cls(
        cfg=_trainer_config(case, layout.model_dir, layout.micro),
        world_size=layout.world,
        rank=rank,
        local_rank=0,
        master_addr="127.0.0.1",
        master_port=layout.port,
        sequence_parallel_size=1,
    )
    worker.init_worker_process_group()
    path = tiny_skyrl.critic_dir(layout.model_dir) if is_critic(case) else layout.model_dir
    worker.init_model(str(path))
    if case.optimizer == "sgd":
        worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=1.0)
        worker.scheduler = torch.optim.lr_scheduler.LambdaLR(worker.optimizer, lambda _: 1.0)
    return worker


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    local = getattr(tensor, "to_local", None)
    return (local() if local is not None else tensor).detach().clone()


def _run_case(case: Case, rank: int, layout: Layout) -> dict[str, Any]:
    from lossreduce.trainer_worker.integrations.skyrl.plan import PROMPT_FIELD

    worker = _worker(case, rank, layout)
    model = worker.model if is_critic(case) else worker.model.model
    batch = batch_of(case)
    if case.on_policy:
        batch = tiny_skyrl.on_policy(batch, layout.model_dir)
    if case.worker == "stock":
        batch = _stock_advantages(case, batch, layout.micro)
    mine = tiny_skyrl.shard(batch, rank, layout.world)
    extra = {PROMPT_FIELD: mine.group}
    if case.rollout_logprobs:
        # What the inference engine reported: close to the old policy's.
        extra["rollout_logprobs"] = mine.old_log_probs + 0.05 * torch.sin(mine.old_log_probs)
    data = tiny_skyrl.training_batch(mine, **extra)
    if case.without_old:
        data["action_log_probs"] = None
    before = {n: _full(p) for n, p in model.named_parameters()}
    result: dict[str, Any] = {"error": None, "error_type": None}
    if is_critic(case):
        result["initial"] = before
    try:
        output = worker.forward_backward(data)
        result["metrics"] = dict(output.metrics)
        result["grads"] = {
            n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None
        }
        if case.step:
            result["grad_norm"] = worker.optim_step()
            result["update"] = {n: _full(p) - before[n] for n, p in model.named_parameters()}
            state = worker.optimizer.state
            result["optimizer_steps"] = sum(int(s.get("step", 0)) for s in state.values())
    except Exception as err:
        result["error"] = f"{type(err).__name__}: {err}"
        result["error_type"] = type(err).__name__
        result["error_info"] = {
            "type": type(err).__name__,
            "message": str(err),
            "rank": getattr(err, "rank", None),
            "ranks": getattr(err, "ranks", ()),
        }
        result["traceback"] = traceback.format_exc()
        # The gradients the failed call left, this rank's shards (no collective): none
        # where it raised before any backward.
        result["grads_left"] = {
            n: _local(p.grad) for n, p in model.named_parameters() if p.grad is not None
        }
    result["normalizers"] = getattr(worker, "last_normalizers", None)
    result["skipped_steps"] = getattr(worker, "skipped_steps", None)
    return result


def _rank_main(rank: int, layout: Layout) -> None:
    os.environ.update(QUIET_ENV)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(layout.port))
    from lossreduce.trainer_worker.cpu_standins.skyrl.platform import install

    install()
    results = {case.name: _run_case(case, rank, layout) for case in layout.cases}
    torch.save(results, layout.out / f"rank{rank}.pt")
    import torch.distributed as dist

    dist.destroy_process_group()


def run(
    world: int, micro: int, cases: list[Case], model_dir: Path, out: Path
) -> list[dict[str, Any]]:
    """Every case on ``world`` ranks with micro-batches of ``micro`` rows; per rank, the
    results by case name."""
    from lossreduce.ports import free_port

    out.mkdir(parents=True, exist_ok=True)
    layout = Layout(world, micro, free_port(), model_dir, tuple(cases), out)
    spawn(_rank_main, args=(layout,), nprocs=world)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def describe(case: Case) -> dict[str, Any]:
    """A case as plain data (for failure messages)."""
    return asdict(case)
