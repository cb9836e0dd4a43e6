"""Runs of TRL's GRPOTrainer and of LossReduceGRPOTrainer on the tiny setup, per layout.

A layout is (processes, per-device batch, gradient accumulation, steps per
generation); every process of a layout runs the same list of :class:`Case` s
in a row and saves, per case, each parameter's update after the run and over
its last optimizer step, the window's rows (which completions the first
optimizer step trained on), the optimizer state, the normalizers of the last
step's round, and any error. Multi-process layouts are spawned with
gloo on loopback through accelerate's environment variables.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.spawn import spawn

from tests.trainer_worker.integrations.trl import tiny_grpo

LR = 1.0


@dataclass(frozen=True)
class Layout:
    name: str
    processes: int
    per_device: int
    accumulation: int
    steps_per_generation: int


@dataclass(frozen=True)
class Case:
    name: str
    trainer: str = "lossreduce"  # or "trl": plain GRPOTrainer with its own loss_type
    mode: str = "token_mean"
    divisor: float | None = None
    loss_type: str = "dapo"
    beta: float = 0.05
    entropy_coef: float = 0.1
    mask_truncated: bool = True
    normalizer: str = "torch"
    coordinator: str | None = None
    on_empty_step: str = "raise"
    optim: str = "sgd"
    max_steps: int = 1
    num_iterations: int = 1
    empty_from_step: int | None = None
    shorter_from_step: int | None = None
    overlap: bool = True
    job: str | None = None  # None: test-<name>; "": the trainer's default (trl-grpo-<run>)
    save_steps: int = 0  # 0: no checkpoints
    ray_address: str | None = None  # each process joins this Ray cluster for the case
    truncated_processes: tuple[int, ...] = ()  # these processes' completions all masked
    nan_advantage: str | None = None  # "active" or "masked": see _poison_advantage


def _config(case: Case, layout: Layout, out: Path) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=layout.per_device,
        gradient_accumulation_steps=layout.accumulation,
        steps_per_generation=layout.steps_per_generation,
        num_generations=tiny_grpo.NUM_GENERATIONS,
        max_completion_length=tiny_grpo.MAX_COMPLETION,
        max_steps=case.max_steps,
        num_iterations=case.num_iterations,
        learning_rate=LR,
        optim=case.optim,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        report_to=[],
        logging_steps=1,
        save_strategy="steps" if case.save_steps else "no",
        save_steps=case.save_steps or 500,
        scale_rewards="none",
        beta=case.beta,
        loss_type=case.loss_type,
        entropy_coef=case.entropy_coef,
        mask_truncated_completions=case.mask_truncated,
        disable_tqdm=True,
        ddp_timeout=120,
        seed=7,
    )


def make_trainer(case: Case, layout: Layout, model_dir: Path, out: Path) -> Any:
    from trl import GRPOTrainer

    from lossreduce.trainer_worker.integrations.settings import GRPOReductionSettings
    from lossreduce.trainer_worker.integrations.trl import LossReduceGRPOTrainer

    args = _config(case, layout, out)
    rollout = tiny_grpo.Rollout(
        empty_from_step=case.empty_from_step,
        shorter_from_step=case.shorter_from_step,
        truncated_processes=case.truncated_processes,
    )
    common: dict[str, Any] = {
        "args": args,
        "train_dataset": tiny_grpo.dataset(),
        "processing_class": tiny_grpo.tokenizer(),
        "rollout_func": rollout,
    }
    if case.trainer == "trl":
        trainer = GRPOTrainer(str(model_dir), tiny_grpo.reward_func, **common)
    else:
        fields: dict[str, Any] = {
            "mode": case.mode,
            "divisor": case.divisor,
            "normalizer": case.normalizer,
            "coordinator": case.coordinator,
            "on_empty_step": case.on_empty_step,
            "overlap": case.overlap,
        }
        if case.job != "":
            fields["job"] = case.job or f"test-{case.name}"
        settings = GRPOReductionSettings.model_validate(fields)
        trainer = LossReduceGRPOTrainer(
            str(model_dir), tiny_grpo.reward_func, reduction=settings, **common
        )
    if trainer.ref_model is not None:
        tiny_grpo.perturb(trainer.accelerator.unwrap_model(trainer.ref_model))
    if case.nan_advantage is not None:
        _poison_advantage(trainer, case.nan_advantage)
    return trainer


def _poison_advantage(trainer: Any, where: str) -> None:
    """After TRL scores each generation batch, the last process sets the advantage of its
    first row with active tokens (``where='active'``) or of its first fully masked
    (truncated) row (``'masked'``) to NaN.

    TRL computes the advantages itself and replaces a NaN with 0 (``nan_to_num``), and a
    reward function's NaN or None never reaches them as NaN: the only way a NaN advantage
    reaches the loss is a trainer subclass that sets the advantages after TRL scored the
    batch, as done here."""
    generate = trainer._generate_and_score_completions

    def poisoned(inputs: Any) -> dict[str, Any]:
        output: dict[str, Any] = generate(inputs)
        accelerator = trainer.accelerator
        if accelerator.process_index == accelerator.num_processes - 1:
            mask = output["completion_mask"]
            if "tool_mask" in output:
                mask = mask * output["tool_mask"]
            tokens = mask.sum(-1)
            rows = (tokens > 0 if where == "active" else tokens == 0).nonzero().flatten()
            assert rows.numel() > 0, f"no {where} row on the last process"
            advantages = output["advantages"].clone()
            advantages[int(rows[0])] = float("nan")
            output["advantages"] = advantages
            # Where the NaN is in the generation batch as generated (TRL shuffles next).
            trainer.poisoned_row = int(rows[0])
        return output

    trainer._generate_and_score_completions = poisoned


def _params(trainer: Any) -> dict[str, torch.Tensor]:
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _window_rows(trainer: Any, layout: Layout) -> list[tuple[int, int]]:
    """(prompt, generation) of this process's rows in the first optimizer step."""
    rows = []
    for piece in (trainer._buffered_inputs or [])[: layout.accumulation]:
        for ids, mask in zip(piece["completion_ids"], piece["completion_mask"], strict=True):
            del mask
            completion = [int(t) for t in ids.tolist()]
            for prompt, gens in tiny_grpo.COMPLETIONS.items():
                for gen, want in enumerate(gens):
                    if completion[: len(want)] == want and all(
                        t == tiny_grpo.PAD for t in completion[len(want) :]
                    ):
                        rows.append((prompt, gen))
    return rows


class _Snapshot:
    """Parameters and optimizer state after each optimizer step."""

    def __init__(self) -> None:
        self.params: list[dict[str, torch.Tensor]] = []
        self.optimizer: list[dict[str, Any]] = []


def run_case(case: Case, layout: Layout, model_dir: Path, out: Path) -> dict[str, Any]:
    """One case's results; with ``case.ray_address`` this process joins that Ray cluster
    first, and leaves it after."""
    if case.ray_address is None:
        return _run_case(case, layout, model_dir, out)
    import ray

    ray.init(
        address=case.ray_address,
        logging_level="WARNING",
        log_to_driver=False,
    )
    try:
        return _run_case(case, layout, model_dir, out)
    finally:
        ray.shutdown()


def _actor_target(trainer: Any) -> str:
    """Where the job's coordinator actor (in lossreduce's Ray namespace) serves; every
    process asks before any leaves (the actor ends with the process that started it)."""
    import ray

    from lossreduce.trainer_worker.integrations.coordinator_actor import get_coordinator_actor

    actor = get_coordinator_actor(trainer.reduction_job)
    target: str = ray.get(actor.endpoint.remote(), timeout=60).target
    trainer.accelerator.wait_for_everyone()
    return target


def _run_case(case: Case, layout: Layout, model_dir: Path, out: Path) -> dict[str, Any]:
    from transformers import TrainerCallback

    trainer = make_trainer(case, layout, model_dir, out)
    before = _params(trainer)
    snapshot = _Snapshot()

    class Record(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            snapshot.params.append(_params(trainer))
            state_dict = trainer.optimizer.state_dict()["state"]
            snapshot.optimizer.append(
                {
                    k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                    for k, s in state_dict.items()
                }
            )

    trainer.add_callback(Record())
    result: dict[str, Any] = {}
    try:
        trainer.train()
    except Exception as err:
        result["error"] = {
            "type": type(err).__name__,
            "message": str(err),
            "terms": getattr(err, "terms", ()),
            "step": getattr(err, "step", None),
            "rank": getattr(err, "rank", None),
            "ranks": getattr(err, "ranks", ()),
        }
        result["traceback"] = traceback.format_exc()
    after = _params(trainer)
    result["before"] = before
    result["update"] = {n: after[n] - before[n] for n in before}
    # The last optimizer step's own update: from the parameters after the step before it
    # (a step that raised left the parameters as they were after the last one that ran).
    steps = [before, *snapshot.params]
    last = steps[-1] if "error" in result else steps[max(len(steps) - 2, 0)]
    result["step_update"] = {n: after[n] - last[n] for n in before}
    result["params"] = snapshot.params
    result["optimizer"] = snapshot.optimizer
    result["rows"] = _window_rows(trainer, layout)
    result["skipped_steps"] = getattr(trainer, "skipped_steps", None)
    result["poisoned_row"] = getattr(trainer, "poisoned_row", None)
    result["job"] = getattr(trainer, "reduction_job", None)
    result["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result["logs"] = [h for h in trainer.state.log_history if "loss" in h]
    # The normalizers of the last optimizer step's round (None: it raised or was skipped).
    last_log = result["logs"][-1] if result["logs"] and "error" not in result else {}
    prefix = "lossreduce/normalizer/"
    result["normalizers"] = {
        k[len(prefix) :]: v for k, v in last_log.items() if k.startswith(prefix)
    } or None
    if case.ray_address is not None and "error" not in result:
        result["actor_target"] = _actor_target(trainer)
    close = getattr(trainer, "close", None)
    if close is not None:
        close()
    return result


@dataclass(frozen=True)
class Job:
    """What every process of one layout runs."""

    layout: Layout
    cases: list[Case]
    model_dir: str
    out_dir: str
    port: int


def run_layout(rank: int, job: Job) -> None:
    """One process of ``job.layout``: every case in a row; saves ``rank{rank}.pt``."""
    layout = job.layout
    if layout.processes > 1:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(job.port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(layout.processes),
            LOCAL_WORLD_SIZE=str(layout.processes),
        )
    torch.manual_seed(0)
    results: dict[str, Any] = {}
    out_dir = Path(job.out_dir)
    try:
        for case in job.cases:
            results[case.name] = run_case(case, layout, Path(job.model_dir), out_dir / case.name)
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, out_dir / f"rank{rank}.pt")


def run(
    layout: Layout, cases: list[Case], model_dir: Path, out_dir: Path, port: int
) -> list[dict[str, Any]]:
    """Every process's results of ``layout`` (spawned when it has several)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    job = Job(layout, cases, str(model_dir), str(out_dir), port)
    if layout.processes == 1:
        run_layout(0, job)
    else:
        spawn(run_layout, args=(job,), nprocs=layout.processes, join=True)
    return [
        torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(layout.processes)
    ]
