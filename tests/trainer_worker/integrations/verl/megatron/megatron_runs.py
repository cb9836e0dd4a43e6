"""Runs of verl 0.9.1's Megatron engine under ``TrainingWorker`` and ``LossReduceTrainingWorker``.

The FSDP tests' data and cases (:mod:`..verl_runs`: 8 responses to 2 prompts, one fully
masked, the KL loss and entropy bonus on) run on verl's real ``MegatronEngine``
(Megatron-Core through mbridge, ``use_remove_padding=True``: packed ``thd`` micro-batches),
one ``train_mini_batch`` per case on a fresh worker, in one of the layouts of
:data:`LAYOUTS` (gloo ranks spawned here). Each rank saves per case every parameter's
update (gathered over tensor and pipeline parallelism into Hugging Face names by
mbridge's export), the optimizer's state, the normalizers, its round group, the counts
verl's own engine handed the loss, and any error.

On CPU (``Job.device='cpu'``, the tests), with these test-only choices, outside the code
under test (on CUDA, ``scripts/gpu_check_verl_megatron.py``: nccl, no stand-in,
Megatron-Bridge where it is installed, the same float32 and SGD):

- the CPU stand-ins of :mod:`lossreduce.trainer_worker.cpu_standins.verl.megatron`
  (mbridge's fix, the one Megatron CPU platform, its ``CudaToCpu`` mode), and
  ``vanilla_mbridge=True`` (verl's default, Megatron-Bridge, needs Transformer Engine);
- float32 parameters: verl's ``McoreEngineConfig`` accepts ``bfloat16`` and ``float16``
  only, and the tests compare updates to 1e-6, so ``dtype`` is set to ``float32`` on the
  config object after its check (verl's engine and optimizer builder have a float32 path);
- SGD's step taken by Megatron's distributed optimizer, which is Adam only: ``beta1 = 0``
  and ``eps`` far above every gradient, so that the first step is ``(lr / eps) x g``
  (:data:`SGD_EPS`), as the AReaL Megatron tests do.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.spawn import spawn

from lossreduce.trainer_worker.cpu_standins.verl.env import MEGATRON_CPU_ENV
from tests.trainer_worker.integrations.verl import tiny_verl
from tests.trainer_worker.integrations.verl.verl_runs import (
    LR,
    VERL_ENV,
    Case,
    batch_of,
    case_loss,
    measured_step,
    ready_worker,
)

LAYOUTS: dict[str, tuple[int, int, int, int]] = {
    "dp1": (1, 1, 1, 1),
    "dp2": (2, 1, 1, 1),
    "tp2": (2, 2, 1, 1),
    "pp2": (2, 1, 2, 1),
    "cp2": (2, 1, 1, 2),
}
"""layout -> (world size, tensor-, pipeline-, context-parallel size); data parallel is
what remains."""

SGD_EPS = 1e8
"""Adam's eps for the SGD cases: far above any gradient here, so the first step's
denominator ``sqrt(v) + eps`` rounds to ``eps`` in float32 and the update is
``(LR * eps) * g / eps``."""


@dataclass(frozen=True)
class MegatronCase(Case):
    """A :class:`~..verl_runs.Case` on the Megatron engine (its ``role='critic'``: verl's
    Megatron value model, mbridge's value head on the language model)."""

    policy_loss: tuple[tuple[str, Any], ...] = (("kl_cov_ratio", 0.25),)


def save_model(folder: Path) -> Path:
    """The FSDP tests' tiny Qwen2 with 2 layers (one per pipeline stage) and 2 key-value
    heads (one per tensor-parallel rank), and their tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lossreduce.trainer_worker.cpu_standins.verl import launch as cpu_launch

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(cpu_launch.WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=cpu_launch.PAD,
        eos_token_id=cpu_launch.EOS,
        bos_token_id=cpu_launch.EOS,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    cpu_launch.tokenizer().save_pretrained(folder)
    return folder


def _worker(
    case: MegatronCase, model_dir: Path, layout: str, seen: list[dict[str, Any]], vanilla: bool
) -> Any:
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import (
        HFModelConfig,
        McoreEngineConfig,
        McoreOptimizerConfig,
        TrainingWorkerConfig,
    )

    _, tp, pp, cp = LAYOUTS[layout]
    engine = McoreEngineConfig(
        vanilla_mbridge=vanilla,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        micro_batch_size_per_gpu=case.micro,
        max_token_len_per_gpu=20,
        use_dynamic_bsz=case.dynamic,
    )
    object.__setattr__(engine, "dtype", "float32")  # see the module docstring
    sgd = case.optimizer == "sgd"
    optim = McoreOptimizerConfig(
        optimizer="adam",
        lr=LR * SGD_EPS if sgd else 1e-2,
        clip_grad=1e9,
        weight_decay=0.0 if sgd else 0.1,
        total_training_steps=10,
        lr_decay_style="constant",
        override_optimizer_config={"adam_beta1": 0.0, "adam_eps": SGD_EPS} if sgd else {},
    )
    config = TrainingWorkerConfig(
        model_type="value_model" if case.role == "critic" else "language_model",
        model_config=HFModelConfig(path=str(model_dir), use_remove_padding=True),
        engine_config=engine,
        optimizer_config=optim,
        checkpoint_config=CheckpointConfig(),
    )
    loss = case_loss(case, "megatron")
    if case.worker == "verl":
        loss = partial(_recorded, seen, loss)
    return ready_worker(case, config, loss)


def _recorded(seen: list[dict[str, Any]], loss_fn: Any, **call: Any) -> Any:
    """verl's loss, recording the counts verl's engine handed it (its own normalizers)."""
    data = call["data"]
    seen.append({"batch_num_tokens": data["batch_num_tokens"], "dp_size": data["dp_size"]})
    return loss_fn(**call)


def _params(worker: Any, *, local: bool = False) -> dict[str, torch.Tensor]:
    """Every weight in Hugging Face names, gathered over tensor and pipeline parallelism
    (a collective: every rank calls it), on the CPU; with ``local``, this rank's own
    weights in Megatron's names (a value head has no Hugging Face name)."""
    engine = worker.engine
    if local:
        return {
            f"{i}.{name}": p.detach().float().cpu().clone()
            for i, chunk in enumerate(engine.module)
            for name, p in chunk.named_parameters()
        }
    if engine.vanilla_bridge:
        exported = engine.bridge.export_weights(engine.module)
    else:  # Megatron-Bridge (on a GPU with Transformer Engine)
        exported = engine.bridge.export_hf_weights(engine.module)
    return {name: t.detach().float().cpu().clone() for name, t in exported}


def _optimizer_state(worker: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    optimizer = worker.engine.optimizer
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            tensors = (v for v in state.values() if isinstance(v, torch.Tensor))
            out.extend(v.detach().cpu().clone() for v in tensors)
    return out


def run_case(
    case: MegatronCase, model_dir: Path, layout: str, *, vanilla: bool = True
) -> dict[str, Any]:
    """One case on a fresh worker (``vanilla``: the model built through mbridge, verl's
    ``vanilla_mbridge``; else through Megatron-Bridge)."""
    from megatron.core import parallel_state as mpu

    seen: list[dict[str, Any]] = []
    try:
        worker = _worker(case, model_dir, layout, seen, vanilla)
    except Exception as err:
        return {"init_error": {"type": type(err).__name__, "message": str(err)}}
    data = tiny_verl.tensordict(
        tiny_verl.shard(
            batch_of(case, model_dir),
            mpu.get_data_parallel_rank(),
            mpu.get_data_parallel_world_size(),
        ),
        mini_batch_size=tiny_verl.BATCH // case.mini_batches,
        epochs=case.epochs,
    )
    local = case.role == "critic"
    result = measured_step(
        worker,
        data,
        params=lambda: _params(worker, local=local),
        optimizer_state=lambda: _optimizer_state(worker),
        label=f"case {case.name}",
    )
    result["verl_counts"] = seen
    close = getattr(worker, "close", None)
    if close is not None:
        close()
    return result


@dataclass(frozen=True)
class Job:
    """What every rank of one layout runs."""

    layout: str
    cases: list[MegatronCase]
    model_dir: str
    out_dir: str
    port: int
    device: str = "cpu"
    """``cpu`` (gloo, the CPU stand-ins, mbridge) or ``cuda`` (one GPU a rank, nccl,
    Megatron-Bridge and Transformer Engine where installed: scripts/gpu_check.sh)."""


def _prepare(rank: int, job: Job) -> tuple[str, bool]:
    """This rank's environment; the collective backend, and whether mbridge builds the model."""
    import importlib.util
    import warnings

    world = LAYOUTS[job.layout][0]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job.port),
        RANK=str(rank),
        LOCAL_RANK=str(rank) if job.device == "cuda" else "0",
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        TORCH_COMPILE_DISABLE="1",
        OMP_NUM_THREADS="1",
    )
    # Megatron-Core and verl warn on import and on use (no Transformer Engine or Apex,
    # deprecations, the legacy mbridge): this process is not pytest's.
    warnings.filterwarnings("ignore")
    if job.device == "cpu":
        os.environ.update({**VERL_ENV, **MEGATRON_CPU_ENV})
        # The CPU stand-ins of verl's Megatron engine (installed on import).
        import lossreduce.trainer_worker.cpu_standins.verl.megatron  # noqa: F401

        return "gloo", True
    vanilla = importlib.util.find_spec("megatron.bridge") is None
    if vanilla:
        from lossreduce.trainer_worker.integrations import mbridge_compat

        mbridge_compat.install()
    torch.cuda.set_device(rank)
    return "nccl", vanilla


def run_rank(rank: int, job: Job) -> None:
    """One rank: every case in a row; saves ``rank{rank}.pt``."""
    backend, vanilla = _prepare(rank, job)
    results: dict[str, Any] = {}
    try:
        torch.distributed.init_process_group(backend, rank=rank, world_size=LAYOUTS[job.layout][0])
        for case in job.cases:
            results[case.name] = run_case(case, Path(job.model_dir), job.layout, vanilla=vanilla)
    except Exception:
        results["crash"] = traceback.format_exc()
    finally:
        from megatron.core import parallel_state as mpu

        if mpu.is_initialized():
            mpu.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    torch.save(results, Path(job.out_dir) / f"rank{rank}.pt")


def run(job: Job) -> list[dict[str, Any]]:
    """Every rank's results of ``job`` (spawned processes on loopback)."""
    Path(job.out_dir).mkdir(parents=True, exist_ok=True)
    world = LAYOUTS[job.layout][0]
    spawn(run_rank, args=(job,), nprocs=world, join=True)
    return [torch.load(Path(job.out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
