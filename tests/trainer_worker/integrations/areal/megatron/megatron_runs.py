"""Body of the Megatron tests: the real AReaL 1.0.4 ``MegatronPPOActor`` (Megatron-Core
0.17.0 through mbridge 0.15.1) on CPU, gloo, one spawned process per rank.

The cases, the data and the reference are the FSDP tests' (:mod:`..areal_runs`): six
prompt groups of uneven size, handed to ``ppo_update`` one trajectory dict per group,
each case on a fresh actor loaded from the same saved weights. Layouts:

- ``dp1``: one rank;
- ``dp2``: two data-parallel ranks, groups 0, 2, 4 and 1, 3, 5;
- ``tp2``: tensor parallel 2 x data parallel 1, both ranks holding every group.

Test-only choices, outside the code under test: the CPU platform
(:mod:`lossreduce.trainer_worker.cpu_standins.megatron.platform`: local layer spec,
packed attention, CPU RNG tracker, CUDA device arguments mapped to the CPU). The
optimizer is AReaL's default, Megatron's distributed optimizer, over gloo.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from torch.multiprocessing.spawn import spawn

from tests.trainer_worker.integrations.areal import areal_runs, reference_runs
from tests.trainer_worker.integrations.areal.areal_runs import (
    EPS_CLIP,
    LR,
    Case,
)

SGD_EPS = 1e8
"""Adam's eps for the SGD cases: far above any gradient here, so that the first step's
denominator ``sqrt(v) + eps`` rounds to ``eps`` in float32 and the update is
``(LR * eps) * g / eps``, SGD's."""

LAYOUTS = {"dp1": (1, 1, 1), "dp2": (2, 1, 1), "tp2": (2, 2, 1), "cp2": (2, 1, 2)}
"""layout -> (world size, tensor-parallel size, context-parallel size)."""


def save_model(folder: Path) -> Path:
    """The FSDP tests' tiny Qwen2 and tokenizer, with weights (the Megatron engine
    always loads them from the path) and two key-value heads: Megatron splits the
    key-value groups between tensor-parallel ranks."""
    from transformers import Qwen2ForCausalLM

    areal_runs.save_model(folder)
    config = areal_runs.tiny_qwen2(areal_runs.VOCAB)
    config.num_key_value_heads = 2
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def shard_data(layout: str, rank: int, data: str = "base") -> list[dict[str, torch.Tensor]]:
    world, tp, cp = LAYOUTS[layout]
    # AReaL's tp-cp-ep-dp-pp order: the tensor- and context-parallel ranks of one
    # data-parallel rank are adjacent, and hold its data.
    return areal_runs.shard_data(world // (tp * cp), rank // (tp * cp), data)


def make_actor(case: Case, model_dir: str, layout: str) -> Any:
    from areal.api.alloc_mode import ParallelStrategy
    from areal.api.cli_args import (
        DistributedDataParallelConfig,
        MegatronEngineConfig,
        MicroBatchSpec,
        OptimizerConfig,
        PPOActorConfig,
    )
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.megatron_engine import MegatronPPOActor

    from lossreduce.trainer_worker.integrations.areal import ArealReductionSettings
    from lossreduce.trainer_worker.integrations.areal.actors import lossreduce_actor

    world, tp, cp = LAYOUTS[layout]
    if case.optimizer == "sgd":
        # SGD's step, taken by Adam (see the module docstring): beta1 = 0, eps >> |g|.
        optimizer = OptimizerConfig(
            type="adam",
            lr=LR * SGD_EPS,
            eps=SGD_EPS,
            beta1=0.0,
            weight_decay=0.0,
            gradient_clipping=1e9,
            warmup_steps_proportion=0.0,
            lr_scheduler_type="constant",
        )
    else:
        optimizer = OptimizerConfig(
            type="adam",
            lr=1e-2,
            weight_decay=0.1,
            gradient_clipping=1e9,
            warmup_steps_proportion=0.0,
            lr_scheduler_type="constant",
        )
    config = PPOActorConfig(
        experiment_name="lossreduce-test",
        trial_name=case.name,
        path=model_dir,
        dtype="float32",
        optimizer=optimizer,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=case.max_tokens),
        megatron=MegatronEngineConfig(
            ddp=DistributedDataParallelConfig(use_distributed_optimizer=True)
        ),
        ppo_n_minibatches=1,
        eps_clip=EPS_CLIP,
        temperature=1.0,
    )
    if case.impl == "stock":
        actor = MegatronPPOActor(config)
    else:
        actor = lossreduce_actor(MegatronPPOActor)(
            config, reduction=ArealReductionSettings.model_validate(case.settings())
        )
    actor.create_process_group(
        ParallelStrategy(
            tensor_parallel_size=tp,
            context_parallel_size=cp,
            data_parallel_size=world // (tp * cp),
        )
    )
    actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=64, train_batch_size=8))
    return actor


def full_params(actor: Any) -> dict[str, torch.Tensor]:
    """The model in Hugging Face names, tensor-parallel shards gathered (mbridge's export)."""
    return {name: t.detach().clone() for name, t in actor.bridge.export_weights(actor.model)}


def optimizer_state(actor: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for state in opt.optimizer.state.values():
            out.extend(v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor))
    return out


def run_case(case: Case, model_dir: str, layout: str, rank: int) -> dict[str, Any]:
    try:
        actor = make_actor(case, model_dir, layout)
    except Exception as err:
        return {"init_error": (type(err).__name__, str(err), traceback.format_exc())}
    try:
        for _ in range(case.prelude):
            actor.ppo_update(shard_data(layout, rank))
        return areal_runs.measure(
            actor, lambda: _update(actor, case, layout, rank), full_params, optimizer_state
        )
    finally:
        actor.destroy()


def _update(actor: Any, case: Case, layout: str, rank: int) -> dict[str, float]:
    """The measured step: AReaL's ``ppo_update`` (its stats), or ``train_batch`` with a
    bad ``loss_weight_fn`` on data-parallel rank 1 (the FSDP tests' bad weights)."""
    _, tp, cp = LAYOUTS[layout]
    dp_rank = rank // (tp * cp)
    return areal_runs.measured_step(
        actor, case, shard_data(layout, rank, case.data), bad_rank=dp_rank == 1
    )


# -- processes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    layout: str
    cases: list[Case]
    model_dir: str
    out_dir: str
    port: int
    reference: bool = False
    # "cpu" (the CPU platform, gloo) or "cuda" (one GPU per rank, nccl, the version fixes
    # only; Transformer Engine's layer spec where it is installed, else the local one).
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)


def run_rank(rank: int, job: Job) -> None:
    world, tp, cp = LAYOUTS[job.layout]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job.port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    import contextlib
    import importlib.util

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    from lossreduce.trainer_worker.cpu_standins.areal import megatron as areal_megatron
    from lossreduce.trainer_worker.cpu_standins.megatron import platform as megatron_cpu
    from lossreduce.trainer_worker.integrations.areal import megatron_compat

    results: dict[str, Any] = {}
    platform: contextlib.AbstractContextManager[Any]
    if job.device == "cpu":
        areal_megatron.install()
        backend, platform = "gloo", megatron_cpu.CudaToCpu()
    else:
        megatron_compat.install()
        if importlib.util.find_spec("transformer_engine") is None:
            import mbridge.core.llm_bridge as mbridge_llm

            mbridge_llm.get_gpt_decoder_block_spec = megatron_cpu.cpu_decoder_block_spec
        torch.cuda.set_device(rank)
        backend, platform = "nccl", contextlib.nullcontext()
    with platform:
        # One default group and one Megatron layout for every case, as the engine makes
        # them (an engine that made its own would tear them down after its case).
        dist.init_process_group(backend, rank=rank, world_size=world)
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=tp, context_parallel_size=cp, order="tp-cp-ep-dp-pp"
        )
        tensor_parallel.model_parallel_cuda_manual_seed(42)
        try:
            for case in job.cases:
                results[case.name] = run_case(case, job.model_dir, job.layout, rank)
            if job.reference and rank == 0:
                first = next(iter(results.values()))
                results["reference"] = reference_runs.reference_updates(
                    job.model_dir, first["initial"]
                )
        except Exception:
            results["crash"] = traceback.format_exc()
        torch.save(results, Path(job.out_dir) / f"rank{rank}.pt")
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


def run(job: Job) -> list[dict[str, Any]]:
    """Every rank's results of ``job`` (spawned processes on loopback), on the CPU."""
    Path(job.out_dir).mkdir(parents=True, exist_ok=True)
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"
    world = LAYOUTS[job.layout][0]
    spawn(run_rank, args=(job,), nprocs=world, join=True)
    return [
        torch.load(Path(job.out_dir) / f"rank{r}.pt", weights_only=False, map_location="cpu")
        for r in range(world)
    ]
