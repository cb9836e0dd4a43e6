"""What the lossreduce trainer mode costs a whole ``main_ppo`` training step.

Launches verl's own ``python -m verl.trainer.main_ppo``
(:mod:`lossreduce.trainer_worker.cpu_standins.verl.launch`: the tiny CPU launch of the
docs, 2 gloo ranks) alternately as stock verl
(``loss_agg_mode=token-mean``, the default trainer mode) and with
``trainer.v1.trainer_mode=lossreduce`` (``mode=token_mean`` through the job's own
coordinator actor), in ABBA order so that drift in the machine's speed hits both
alike. Each launch's step time is verl's own ``timing_s/step`` (rollout, reward,
log-probabilities, the reference policy, advantages, the actor update, the weight
sync), read from its file logger; every launch's first steps (warm-up) are left
out, and the medians over all kept steps are compared. ``timing_s/update_actor``,
the part of the step the trainer mode changes, is compared alike, and the worker's
own round latency (``lossreduce/round_latency_s``: a mini-batch's wait for its
normalizers, which includes waiting for the slower rank) is reported beside them.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lossreduce.trainer_worker.cpu_standins.verl.launch import (
    overrides,
    run_main_ppo,
    write_inputs,
)

__all__ = [
    "ROUND_KEY",
    "STOCK",
    "TRAINER_MODE",
    "MainPpoBenchError",
    "MainPpoBenchResult",
    "MainPpoBenchSettings",
    "abba_order",
    "kept_timings",
    "run_main_ppo_bench",
]

STOCK = ["actor_rollout_ref.actor.loss_agg_mode=token-mean"]
"""The stock launch's part: verl's own token-mean normalization."""
TRAINER_MODE = [
    "trainer.v1.trainer_mode=lossreduce",
    "+actor_rollout_ref.lossreduce.mode=token_mean",
    "+actor_rollout_ref.lossreduce.normalizer=coordinator",
]
"""The lossreduce launch's part: the trainer mode with token-mean's meaning, through the
job's own coordinator actor (every mini-batch a round)."""
STEP_KEY = "timing_s/step"
UPDATE_KEY = "timing_s/update_actor"
ROUND_KEY = "actor/lossreduce/round_latency_s"
"""The lossreduce worker's round latency, per mini-batch (verl logs the step's mean)."""


class MainPpoBenchError(RuntimeError):
    """A ``main_ppo`` launch of the bench failed or did not log its steps."""


class MainPpoBenchSettings(BaseModel):
    """The workload of :func:`run_main_ppo_bench`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    blocks: int = Field(
        default=1,
        ge=1,
        description="ABBA blocks; each launches stock, lossreduce, lossreduce, stock.",
    )
    steps: int = Field(default=10, ge=2, description="Training steps of each launch.")
    skip_steps: int = Field(
        default=2, ge=0, description="First steps of each launch left out (warm-up)."
    )
    launch_timeout_s: float = Field(
        default=900.0, gt=0, description="Bound on one launch, start-up included."
    )

    @model_validator(mode="after")
    def _kept(self) -> MainPpoBenchSettings:
        if self.steps <= self.skip_steps:
            raise ValueError(f"steps {self.steps} must exceed skip_steps {self.skip_steps}")
        return self


@dataclass(frozen=True)
class MainPpoBenchResult:
    """Median seconds per ``main_ppo`` step (and actor update) of each side, and the ratio."""

    lossreduce_step_s: float
    stock_step_s: float
    lossreduce_steps: int
    stock_steps: int
    lossreduce_update_s: float
    stock_update_s: float
    lossreduce_round_s: float
    """Median of the steps' mean round latency (a mini-batch's wait for its normalizers)."""
    launches: int

    @property
    def ratio(self) -> float:
        """lossreduce / stock median step time (1.03 = 3% slower)."""
        return self.lossreduce_step_s / self.stock_step_s

    @property
    def update_ratio(self) -> float:
        """lossreduce / stock median actor-update time."""
        return self.lossreduce_update_s / self.stock_update_s


def abba_order(blocks: int) -> list[bool]:
    """Launch order, True for the lossreduce trainer mode: stock, lossreduce, lossreduce,
    stock, once per block."""
    return [False, True, True, False] * blocks


def kept_timings(steps: list[dict[str, Any]], skip: int, key: str) -> list[float]:
    """``key``'s value in each step record of verl's file logger, the first ``skip``
    steps left out; a record without it is an error (verl renamed its timer)."""
    kept = sorted(steps, key=lambda s: int(s["step"]))[skip:]
    missing = [int(s["step"]) for s in kept if key not in s["data"]]
    if missing:
        raise MainPpoBenchError(f"verl logged no {key!r} at steps {missing}")
    return [float(s["data"][key]) for s in kept]


def run_main_ppo_bench(settings: MainPpoBenchSettings | None = None) -> MainPpoBenchResult:
    """Median ``main_ppo`` step time with the lossreduce trainer mode vs stock verl, ABBA."""
    settings = settings or MainPpoBenchSettings()
    steps: dict[bool, list[float]] = {True: [], False: []}
    updates: dict[bool, list[float]] = {True: [], False: []}
    rounds: list[float] = []
    order = abba_order(settings.blocks)
    with tempfile.TemporaryDirectory(prefix="lossreduce-main-ppo-bench-") as scratch:
        # Every launch reads the same inputs; each writes its metrics to a folder of its own.
        inputs = write_inputs(Path(scratch))
        for index, ours in enumerate(order):
            folder = Path(scratch) / f"launch-{index}"
            folder.mkdir()
            args = [*overrides(inputs, steps=settings.steps), *(TRAINER_MODE if ours else STOCK)]
            run = run_main_ppo(folder, args, timeout=settings.launch_timeout_s)
            if run.returncode != 0 or run.logged != list(range(1, settings.steps + 1)):
                raise MainPpoBenchError(
                    f"main_ppo launch {index} ({'lossreduce' if ours else 'stock'}) exited "
                    f"{run.returncode} after logging steps {run.logged} of {settings.steps}:\n"
                    f"{run.output[-4000:]}"
                )
            seconds = kept_timings(run.steps, settings.skip_steps, STEP_KEY)
            steps[ours] += seconds
            updates[ours] += kept_timings(run.steps, settings.skip_steps, UPDATE_KEY)
            if ours:
                rounds += kept_timings(run.steps, settings.skip_steps, ROUND_KEY)
            print(
                f"    main_ppo launch {index} ({'lossreduce' if ours else 'stock'}): median "
                f"step {statistics.median(seconds) * 1e3:.0f} ms over {len(seconds)} steps",
                flush=True,
            )
    return MainPpoBenchResult(
        lossreduce_step_s=statistics.median(steps[True]),
        stock_step_s=statistics.median(steps[False]),
        lossreduce_steps=len(steps[True]),
        stock_steps=len(steps[False]),
        lossreduce_update_s=statistics.median(updates[True]),
        stock_update_s=statistics.median(updates[False]),
        lossreduce_round_s=statistics.median(rounds),
        launches=len(order),
    )
