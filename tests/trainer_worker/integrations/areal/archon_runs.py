"""The Archon side of the AReaL tests' harness (:mod:`.areal_runs`): the weights Archon
loads and its actor, stock or with lossreduce, on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.trainer_worker.integrations.areal.areal_runs import VOCAB, Case, tiny_qwen2

__all__ = ["make_archon_actor", "save_weights"]


def save_weights(folder: Path, seed: int = 0) -> Path:
    """Weights for :func:`.areal_runs.save_model`'s config in ``folder`` (what the Archon
    cases load)."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    Qwen2ForCausalLM(tiny_qwen2(VOCAB)).save_pretrained(folder)
    return folder


def make_archon_actor(case: Case, config: Any) -> Any:
    """AReaL's ``ArchonPPOActor`` (stock or with lossreduce) for ``case`` on CPU."""
    import torch.distributed as dist
    from areal.api.alloc_mode import ParallelStrategy
    from areal.api.io_struct import FinetuneSpec
    from areal.experimental.engine.archon_engine import ArchonPPOActor

    from lossreduce.trainer_worker.cpu_standins.areal.archon import archon_cpu_config
    from lossreduce.trainer_worker.integrations.areal import ArealReductionSettings
    from lossreduce.trainer_worker.integrations.areal.actors import LossReduceArchonPPOActor

    archon_cpu_config(config)
    # Archon initializes its sharded parameters with DTensor's random generator, so a
    # seed gives different weights on one and two ranks: load save_weights' instead.
    config.init_from_scratch = False
    if case.impl == "stock":
        actor = ArchonPPOActor(config)
    else:
        actor = LossReduceArchonPPOActor(
            config, reduction=ArealReductionSettings.model_validate(case.settings())
        )
    # Archon reads its layout from the strategy (FSDP from the world size): data parallel
    # over every rank.
    actor.create_process_group(ParallelStrategy(data_parallel_size=dist.get_world_size()))
    torch.manual_seed(0)  # the same initial weights in every case and on every rank
    actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=64, train_batch_size=8))
    return actor
