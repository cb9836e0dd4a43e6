"""Where a verl engine's ranks stand: which hold the same rows, and which compute the loss.

A mini-batch's rows are split over the engine's data-parallel group
(``engine.get_data_parallel_group()``); every other rank of the worker group holds
the same rows as some data-parallel rank:

- FSDP with Ulysses sequence parallelism: the ranks of one sequence-parallel group
  (each runs the same rows, a slice of every sequence);
- Megatron: the ranks of one tensor-, pipeline- and context-parallel group (each runs
  the same rows, a slice of every weight, layer range or sequence).

Counting the rows once per data-parallel rank gives the global normalizers; every
position in such a group (``sp1``, ``tp0.pp1``, ...) therefore reduces over the
data-parallel ranks in a round of its own, named by :func:`round_suffix`, and all of
them get the same answer. Megatron computes the loss on the last pipeline stage only
(:func:`computes_loss`); the earlier stages take part in the rounds all the same, so
that a bad input or an empty mini-batch stops every rank.

Megatron's positions come from Megatron-Core's ``parallel_state``, imported only for an
engine whose strategy is ``megatron``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["computes_loss", "round_suffix"]


def _is_megatron(engine: Any) -> bool:
    return getattr(getattr(engine, "engine_config", None), "strategy", None) == "megatron"


def round_suffix(engine: Any) -> str:
    """``''`` where no other rank holds this rank's rows; else this rank's position
    among the ranks that do: ``'.sp<i>'`` (Ulysses), ``'.tp<t>.pp<p>.cp<c>'`` (Megatron,
    each part only where its size exceeds 1)."""
    if _is_megatron(engine):
        return _megatron_suffix(engine)
    mesh = getattr(engine, "ulysses_device_mesh", None)
    return "" if mesh is None else f".sp{mesh['sp'].get_local_rank()}"


def _megatron_suffix(engine: Any) -> str:
    from megatron.core import parallel_state as mpu

    if engine.engine_config.dynamic_context_parallel:
        # Every rank of the data- and context-parallel plane holds the whole mini-batch,
        # and the engine's data-parallel group is the rank alone.
        return f".dcp{mpu.get_data_parallel_rank(with_context_parallel=True)}"
    parts = [
        ("tp", mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()),
        (
            "pp",
            mpu.get_pipeline_model_parallel_rank(),
            mpu.get_pipeline_model_parallel_world_size(),
        ),
        ("cp", mpu.get_context_parallel_rank(), mpu.get_context_parallel_world_size()),
    ]
    return "".join(f".{name}{rank}" for name, rank, size in parts if size > 1)


def computes_loss(engine: Any) -> bool:
    """Whether this rank's engine calls the loss function: every rank of FSDP; the last
    pipeline stage of Megatron (the earlier stages send activations forward)."""
    if not _is_megatron(engine):
        return True
    from megatron.core import parallel_state as mpu

    return bool(mpu.is_pipeline_last_stage(ignore_virtual=True))
