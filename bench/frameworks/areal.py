"""What lossreduce's normalizers cost inside AReaL's PPO update.

Times ``ppo_update`` of the LossReduce actor (``token_mean``, the torch
backend) against the same update of AReaL's own actor, for one of AReaL's
engines (:attr:`ArealBenchSettings.engine`: FSDP, Archon or Megatron), on one
process (gloo), a small Qwen2 built in code and a fixed batch of uneven prompt
groups, so that the measured step is the training work alone, where a fixed
overhead shows most. Both actors live in the same process, loaded from the
same weights; runs alternate ABBA so drift (thermal, other load) hits both
alike; the first step of each run is dropped as warm-up and the medians are
compared. Without CUDA, Archon runs with its CPU settings
(:func:`lossreduce.trainer_worker.cpu_standins.areal.archon.archon_cpu_config`) and
Megatron on the Megatron CPU platform
(:mod:`lossreduce.trainer_worker.cpu_standins.areal.megatron`), as the tests run them.

With ``m2_threshold`` set the same run also times both actors with AReaL's
M2PO on (``use_decoupled_loss``, a ``prox_logp`` that drifted from the
rollout's): AReaL masks each micro-batch inside its loss, the LossReduce actor
reduces one cut-off over the step first (``m2po='global'``, extra normalizer
rounds before the forward). Both ratios come from one run, side by side, with
the cut-off's own time and rounds.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from lossreduce.bench.frameworks.abba import ABBA, EOS, PAD, save_qwen2
from lossreduce.ports import free_port
from lossreduce.trainer_worker.integrations.areal.settings import ArealReductionSettings

__all__ = [
    "ENGINES",
    "ArealBenchResult",
    "ArealBenchSettings",
    "M2POBenchResult",
    "run_areal_bench",
]

ArealEngine = Literal["fsdp", "archon", "megatron"]
ENGINES: tuple[ArealEngine, ...] = ("fsdp", "archon", "megatron")
"""AReaL's training engines the bench can time, in its report's order."""


class ArealBenchSettings(BaseModel):
    """The workload of :func:`run_areal_bench`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: ArealEngine = Field(
        default="fsdp",
        description="AReaL's training engine of both actors: fsdp (FSDPPPOActor), archon "
        "(ArchonPPOActor) or megatron (MegatronPPOActor, which needs AReaL's [megatron] "
        "packages).",
    )
    steps: int = Field(
        default=8, ge=2, description="ppo_update calls per run (the first is warm-up)."
    )
    blocks: int = Field(
        default=2, ge=1, description="ABBA blocks; each block runs each actor twice."
    )
    groups: int = Field(default=8, ge=1, description="Prompt groups per update.")
    group_size: int = Field(default=4, ge=1, description="Responses per prompt group.")
    max_length: int = Field(
        default=96, ge=8, description="Longest response with its prompt, in tokens."
    )
    max_tokens_per_mb: int = Field(
        default=512, ge=8, description="AReaL's actor.mb_spec.max_tokens_per_mb."
    )
    hidden_size: int = Field(default=128, ge=8, description="Width of the Qwen2 model.")
    layers: int = Field(default=2, ge=1, description="Transformer layers of the Qwen2 model.")
    vocab_size: int = Field(default=64, ge=8, description="Vocabulary size of the toy tokenizer.")
    m2_threshold: float | None = Field(
        default=None,
        gt=0,
        description="actor.m2_threshold of the M2PO pair of actors; None runs only the "
        "pair without M2PO.",
    )
    threads: int = Field(
        default=1,
        ge=1,
        description="torch CPU threads while measuring (1: a shared small machine's other load "
        "then slows both actors alike instead of oversubscribing the cores).",
    )


@dataclass(frozen=True)
class M2POBenchResult:
    """The M2PO pair: median ``ppo_update`` seconds, and the global cut-off's own cost."""

    lossreduce_step_s: float
    areal_step_s: float
    cut_s: float  # median seconds of the cut-off's rounds in the LossReduce actor's step
    rounds: int  # normalizer rounds of one cut-off (the largest seen)
    kept: int  # tokens the cut-off kept of `active` (the same batch every step)
    active: int

    @property
    def ratio(self) -> float:
        """lossreduce (global mask) / AReaL (per-micro-batch mask) median step time."""
        return self.lossreduce_step_s / self.areal_step_s

    @property
    def cut_share(self) -> float:
        """The cut-off's rounds as a share of the LossReduce actor's median step."""
        return self.cut_s / self.lossreduce_step_s


@dataclass(frozen=True)
class ArealBenchResult:
    """Median seconds of one ``ppo_update`` for each actor."""

    lossreduce_step_s: float
    areal_step_s: float
    lossreduce_steps: int
    areal_steps: int
    m2po: M2POBenchResult | None = None  # with ArealBenchSettings.m2_threshold

    @property
    def ratio(self) -> float:
        """lossreduce / AReaL median step time (1.03 = 3% slower)."""
        return self.lossreduce_step_s / self.areal_step_s


def _save_model(settings: ArealBenchSettings, folder: Path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(settings.vocab_size)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=words[PAD], eos_token=words[EOS]
    ).save_pretrained(folder)
    # Weights on disk, loaded by every actor: Megatron always loads from the path, and
    # the same seed gives other weights through Archon's sharded initialization.
    saved = save_qwen2(
        folder,
        settings,
        # Archon on CPU pads each micro-batch to its token budget, positions included.
        max_positions=max(2 * settings.max_length, settings.max_tokens_per_mb),
        seed=0,
    )
    return str(saved)


def _batch(settings: ArealBenchSettings) -> list[dict[str, torch.Tensor]]:
    """One trajectory dict per prompt group, as ``ppo_update`` receives them."""
    gen = torch.Generator().manual_seed(0)
    length, prompt = settings.max_length, 8
    out = []
    for _ in range(settings.groups):
        b = settings.group_size
        lengths = torch.randint(prompt + 2, length + 1, (b,), generator=gen)  # [b]
        positions = torch.arange(length)[None, :]  # [1, T]
        attention = positions < lengths[:, None]  # [b, T]
        mask = (positions >= prompt - 1) & (positions < lengths[:, None] - 1)  # [b, T]
        old = (-4.0 + 0.1 * torch.randn(b, length, generator=gen)) * mask
        advantages = torch.randn(b, 1, generator=gen).expand(b, length) * mask
        # The recomputed proximal log-probs drifted from the rollout's (what M2PO cuts).
        drift = 0.15 * torch.randn(b, length, generator=gen) * mask
        out.append(
            {
                "input_ids": torch.randint(2, settings.vocab_size, (b, length), generator=gen)
                * attention,
                "attention_mask": attention,
                "loss_mask": mask.float(),
                "advantages": advantages.contiguous(),
                "logprobs": old,
                "prox_logp": old + drift,
                "rewards": advantages[:, 0].contiguous(),
                "kl_rewards": torch.zeros(b, length),
                "tot_rewards": torch.zeros(b, length),
            }
        )
    return out


def _actor(lossreduce: bool, model_dir: str, settings: ArealBenchSettings, m2po: bool) -> Any:
    from areal.api.alloc_mode import ParallelStrategy
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, PPOActorConfig
    from areal.api.io_struct import FinetuneSpec

    from lossreduce.trainer_worker.integrations.areal.actors import (
        areal_actor_class,
        lossreduce_actor,
    )

    config = PPOActorConfig(
        experiment_name="lossreduce-bench",
        trial_name=("lossreduce" if lossreduce else "areal") + ("-m2po" if m2po else ""),
        path=model_dir,
        init_from_scratch=False,
        dtype="float32",
        attn_impl="sdpa",
        optimizer=OptimizerConfig(lr=1e-5, lr_scheduler_type="constant"),
        mb_spec=MicroBatchSpec(max_tokens_per_mb=settings.max_tokens_per_mb),
        backend=f"{settings.engine}:d1",
        ppo_n_minibatches=1,
    )
    if m2po:
        config.m2_threshold = settings.m2_threshold
        config.use_decoupled_loss = True
    if settings.engine == "archon" and not torch.cuda.is_available():
        from lossreduce.trainer_worker.cpu_standins.areal.archon import archon_cpu_config

        archon_cpu_config(config)
    if settings.engine == "megatron":
        from areal.api.cli_args import DistributedDataParallelConfig, MegatronEngineConfig

        config.megatron = MegatronEngineConfig(
            ddp=DistributedDataParallelConfig(use_distributed_optimizer=True)
        )
    stock: Any = areal_actor_class(settings.engine)
    actor = (
        lossreduce_actor(stock)(config, reduction=ArealReductionSettings(job="areal-bench"))
        if lossreduce
        else stock(config)
    )
    actor.create_process_group(ParallelStrategy(data_parallel_size=1))
    torch.manual_seed(0)
    actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=64, train_batch_size=8))
    return actor


@contextlib.contextmanager
def _platform(engine: ArealEngine) -> Iterator[None]:
    """Where Megatron runs: its model-parallel state over the bench's one-process group
    (the engine makes it only with a group of its own), on the Megatron CPU platform
    when there is no CUDA."""
    if engine != "megatron":
        yield
        return
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    from lossreduce.trainer_worker.integrations.areal import megatron_compat

    platform: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if torch.cuda.is_available():
        megatron_compat.install()
    else:
        from lossreduce.trainer_worker.cpu_standins.areal import megatron as areal_megatron
        from lossreduce.trainer_worker.cpu_standins.megatron.platform import CudaToCpu

        areal_megatron.install()
        platform = CudaToCpu()
    with platform:
        mpu.initialize_model_parallel(order="tp-cp-ep-dp-pp")
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        try:
            yield
        finally:
            mpu.destroy_model_parallel()


_CUT = "ppo_actor/update/lossreduce/m2po/"


def _run(
    actor: Any, data: list[dict[str, torch.Tensor]], steps: int
) -> tuple[list[float], list[dict[str, float]]]:
    """Seconds of each step but the first (warm-up), and the M2PO stats of each."""
    from areal.utils import stats_tracker

    seconds, cuts = [], []
    for _ in range(steps):
        started = time.perf_counter()
        actor.ppo_update([dict(d) for d in data])
        seconds.append(time.perf_counter() - started)
        stats = stats_tracker.export(reset=True)  # outside the timing
        cuts.append({k.removeprefix(_CUT): v for k, v in stats.items() if k.startswith(_CUT)})
    return seconds[1:], cuts[1:]


def run_areal_bench(settings: ArealBenchSettings | None = None) -> ArealBenchResult:
    """Median ``ppo_update`` time of the LossReduce actor vs AReaL's own, for
    ``settings.engine``, ABBA."""
    settings = settings or ArealBenchSettings()
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
    }.items():
        os.environ.setdefault(key, value)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", rank=0, world_size=1)
    # (lossreduce, m2po) -> step times; the M2PO pair only with a threshold.
    kinds = [(True, False), (False, False)]
    if settings.m2_threshold is not None:
        kinds += [(True, True), (False, True)]
    times: dict[tuple[bool, bool], list[float]] = {kind: [] for kind in kinds}
    cuts: list[dict[str, float]] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        with (
            _platform(settings.engine),
            tempfile.TemporaryDirectory(prefix="lossreduce-areal-bench-") as folder,
        ):
            model_dir = _save_model(settings, Path(folder))
            actors = {kind: _actor(kind[0], model_dir, settings, kind[1]) for kind in kinds}
            data = _batch(settings)
            for _ in range(settings.blocks):
                for masked in sorted({m for _, m in kinds}):
                    for lossreduce in ABBA:
                        got, cut = _run(actors[lossreduce, masked], data, settings.steps)
                        times[lossreduce, masked] += got
                        if lossreduce and masked:
                            cuts += cut
            for actor in actors.values():
                actor.destroy()
    finally:
        torch.set_num_threads(threads)
        if own_group:
            dist.destroy_process_group()
    m2po = None
    if settings.m2_threshold is not None:
        m2po = M2POBenchResult(
            lossreduce_step_s=statistics.median(times[True, True]),
            areal_step_s=statistics.median(times[False, True]),
            cut_s=statistics.median(c["seconds"] for c in cuts),
            rounds=int(max(c["rounds"] for c in cuts)),
            kept=int(cuts[-1]["kept"]),
            active=int(cuts[-1]["active"]),
        )
    return ArealBenchResult(
        lossreduce_step_s=statistics.median(times[True, False]),
        areal_step_s=statistics.median(times[False, False]),
        lossreduce_steps=len(times[True, False]),
        areal_steps=len(times[False, False]),
        m2po=m2po,
    )
