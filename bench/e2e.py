"""End to end: a ``lossreduce train`` step with the coordinator vs torch.distributed.

Runs ``lossreduce train`` alternately with ``--normalizer torch`` and
``--normalizer coordinator`` (ABBA order, so a drift in the machine's speed
hits both alike), reads each run's ``metrics.jsonl`` and compares the median
step wall time. Every run's first steps (start-up: model build, Ray workers
warming up) are left out.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lossreduce.bench.frameworks.areal import ArealBenchSettings
    from lossreduce.bench.frameworks.skyrl import SkyRLBenchSettings
    from lossreduce.bench.frameworks.verl import VerlBenchSettings
    from lossreduce.trainer_worker.integrations.verl.settings import StatisticsScope

__all__ = [
    "FRAMEWORK_E2E_KEYS",
    "TRL_TARGET_RATIO",
    "E2EError",
    "E2EResult",
    "abba",
    "run_areal_e2e",
    "run_e2e",
    "run_frameworks_e2e",
    "run_skyrl_e2e",
    "run_trl_e2e",
    "run_verl_e2e",
    "run_verl_main_ppo_e2e",
    "run_verl_megatron_e2e",
    "run_verl_statistics_e2e",
    "step_seconds",
]

NORMALIZERS = ("torch", "coordinator")

TRL_TARGET_RATIO = 1.03
"""A TRL GRPO step with lossreduce's normalizers may take at most 3% longer than
the same step with TRL's own ``dapo`` normalization."""


class E2EError(RuntimeError):
    """A ``lossreduce train`` run of the end-to-end comparison failed."""


@dataclass(frozen=True)
class E2EResult:
    """Median step time per normalizer over every measured step of every run."""

    median_step_s: dict[str, float]
    median_round_latency_s: dict[str, float]
    steps_measured: dict[str, int]
    runs: int
    ratio: float
    """Median coordinator step / median torch step (the target: <= 1.02)."""


def abba(pairs: int) -> list[str]:
    """Run order: torch, coordinator, coordinator, torch, ... (``pairs`` of each)."""
    order: list[str] = []
    for index in range(pairs):
        order += list(NORMALIZERS if index % 2 == 0 else reversed(NORMALIZERS))
    return order


def step_seconds(metrics: Path, skip: int) -> tuple[list[float], list[float]]:
    """Step wall times and round latencies of one run, its first ``skip`` steps left out."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    kept = [row for row in rows if not row.get("skipped")][skip:]
    return [float(r["step_seconds"]) for r in kept], [float(r["round_latency_s"]) for r in kept]


def run_e2e(
    out: Path, *, steps: int, pairs: int, workers: int, skip: int, timeout_s: float
) -> E2EResult:
    """Run the comparison; every run's output lands under ``out``."""
    times: dict[str, list[float]] = {n: [] for n in NORMALIZERS}
    rounds: dict[str, list[float]] = {n: [] for n in NORMALIZERS}
    order = abba(pairs)
    for index, normalizer in enumerate(order):
        run_dir = out / f"e2e-{index}-{normalizer}"
        command = [
            sys.executable,
            "-m",
            "lossreduce.cli",
            "train",
            "--normalizer",
            normalizer,
            "--steps",
            str(steps),
            "--workers",
            str(workers),
            "--job",
            f"bench-e2e-{index}",
            "--no-progress",
            "--no-verify",
            "--out",
            str(run_dir),
        ]
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if proc.returncode != 0:
            raise E2EError(
                f"lossreduce train --normalizer {normalizer} (run {index}) exited with "
                f"{proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            )
        seconds, latencies = step_seconds(run_dir / "metrics.jsonl", skip)
        times[normalizer] += seconds
        rounds[normalizer] += latencies
        print(
            f"  e2e run {index}: --normalizer {normalizer}: median step "
            f"{statistics.median(seconds) * 1e3:.1f} ms over {len(seconds)} steps",
            flush=True,
        )
    medians = {n: statistics.median(times[n]) for n in NORMALIZERS}
    return E2EResult(
        median_step_s=medians,
        median_round_latency_s={n: statistics.median(rounds[n]) for n in NORMALIZERS},
        steps_measured={n: len(times[n]) for n in NORMALIZERS},
        runs=len(order),
        ratio=medians["coordinator"] / medians["torch"],
    )


def _framework_step(
    label: str, baseline: str, field: str, result: Any
) -> dict[str, float | int | bool]:
    """Print and return one framework's step with lossreduce vs its own ``baseline``
    (``result`` has ``lossreduce_step_s``, ``{field}_step_s``, the step counts of both
    and ``ratio``), judged against :data:`TRL_TARGET_RATIO`."""
    base_s, base_steps = getattr(result, f"{field}_step_s"), getattr(result, f"{field}_steps")
    met = result.ratio <= TRL_TARGET_RATIO
    print(
        f"  {label} step: lossreduce {result.lossreduce_step_s * 1e3:.1f} ms vs {baseline} "
        f"{base_s * 1e3:.1f} ms (median of {result.lossreduce_steps} / {base_steps} steps, "
        f"ABBA): ratio {result.ratio:.3f}, target <= {TRL_TARGET_RATIO} "
        f"{'met' if met else 'NOT met'}",
        flush=True,
    )
    return {
        "lossreduce_step_s": result.lossreduce_step_s,
        f"{field}_step_s": base_s,
        "lossreduce_steps": result.lossreduce_steps,
        f"{field}_steps": base_steps,
        "ratio": result.ratio,
        "met": met,
    }


def run_trl_e2e() -> dict[str, float | int | bool] | None:
    """A TRL GRPO optimizer step with lossreduce's normalizers vs TRL's own ``dapo``
    (median over steps, ABBA order, one process): the ratio and whether it meets
    :data:`TRL_TARGET_RATIO`; None, said in one line, when TRL is not installed."""
    try:
        from lossreduce.bench.frameworks.trl import run_trl_bench
    except ImportError as err:
        print(f"  TRL step: skipped ({err})", flush=True)
        return None
    return _framework_step("TRL", "dapo", "dapo", run_trl_bench())


def _verl_missing(label: str) -> bool:
    """Whether verl is missing, said in one line naming ``label``. Looked up, not
    imported: verl must not load before its platform is chosen."""
    import importlib.util

    if importlib.util.find_spec("verl") is not None:
        return False
    print(f"  {label}: skipped (verl is not installed: pip install 'lossreduce[verl]')")
    return True


def run_verl_e2e() -> dict[str, float | int | bool] | None:
    """A verl actor mini-batch step with lossreduce's normalizers vs verl's own
    ``token-mean`` (median over steps, ABBA order, one process): the ratio and whether
    it meets :data:`TRL_TARGET_RATIO` (the same 3%); None, said in one line, when verl
    is not installed."""
    if _verl_missing("verl step"):
        return None
    # Imports verl only inside run_verl_bench, after choosing its platform.
    from lossreduce.bench.frameworks.verl import run_verl_bench

    return _framework_step("verl", "token-mean", "verl", run_verl_bench())


def run_verl_megatron_e2e(
    workload: VerlBenchSettings | None = None,
) -> dict[str, float | int | bool] | None:
    """:func:`run_verl_e2e` on verl's Megatron engine (both workers; ``workload`` with its
    ``strategy`` replaced), where verl's ``mcore`` packages are installed (megatron-core
    and mbridge); None, said in one line, where they are not."""
    if _verl_missing("verl Megatron step"):
        return None
    if not _megatron_installed():
        print(
            "  verl Megatron step: skipped (needs megatron-core and mbridge: "
            "docs/frameworks/verl.md, Megatron)",
            flush=True,
        )
        return None
    from lossreduce.bench.frameworks.verl import VerlBenchSettings, run_verl_bench

    workload = workload or VerlBenchSettings()
    result = run_verl_bench(workload.model_copy(update={"strategy": "megatron"}))
    return _framework_step("verl Megatron", "token-mean", "verl", result)


STATISTICS_MINI_BATCHES = (1, 4)
"""PPO mini-batches a step :func:`run_verl_statistics_e2e` times: one, where every
mini-batch is a step's first, and four, where one in four is."""
STATISTICS_VARIANTS: tuple[tuple[StatisticsScope, bool, str], ...] = (
    ("mini_batch", False, "mini_batch"),
    ("mini_batch", True, "mini_batch_reused"),
    ("per_call", False, "per_call"),
)
"""(statistics, the batch marked with old_log_prob current, label): lossreduce's statistic
over the mini-batch with a forward on every mini-batch, with ``old_log_prob`` reused on a
step's first (as the trainer mode marks its batches), and verl's own per call."""


def run_verl_statistics_e2e() -> dict[str, float | int] | None:
    """What verl's ``kl_cov`` costs with its statistic over the whole mini-batch: a
    lossreduce actor step against stock verl's ``kl_cov`` (per micro-batch, in the loss),
    at 1 and 4 mini-batches a step (:data:`STATISTICS_MINI_BATCHES`), for each of
    :data:`STATISTICS_VARIANTS`: ``statistics='mini_batch'`` with a no-grad forward of
    every mini-batch, the same with the batch marked as the trainer mode marks one whose
    ``old_log_prob`` the actor recomputed (a step's first mini-batch reuses it, no
    forward), and ``statistics='per_call'`` (verl's own), each ABBA in one process. No
    target: the forward is the price of a split-invariant statistic; None, said in one
    line, when verl is not installed."""
    if _verl_missing("verl kl_cov step"):
        return None
    from lossreduce.bench.frameworks.verl import VerlBenchSettings, run_verl_bench

    out: dict[str, float | int] = {}
    for mini_batches in STATISTICS_MINI_BATCHES:
        for scope, current, label in STATISTICS_VARIANTS:
            result = run_verl_bench(
                VerlBenchSettings(
                    loss_mode="kl_cov",
                    statistics=scope,
                    mini_batches=mini_batches,
                    old_log_probs_current=current,
                )
            )
            print(
                f"  verl kl_cov step, {mini_batches} mini-batch(es), {label}: lossreduce "
                f"{result.lossreduce_step_s * 1e3:.1f} ms vs verl "
                f"{result.verl_step_s * 1e3:.1f} ms (median of {result.lossreduce_steps} / "
                f"{result.verl_steps} steps, ABBA): ratio {result.ratio:.3f}",
                flush=True,
            )
            key = f"mb{mini_batches}_{label}"
            out[f"{key}_lossreduce_step_s"] = result.lossreduce_step_s
            out[f"{key}_verl_step_s"] = result.verl_step_s
            out[f"{key}_ratio"] = result.ratio
    return out


def run_verl_main_ppo_e2e() -> dict[str, float | int | bool] | None:
    """A whole verl ``main_ppo`` training step with ``trainer.v1.trainer_mode=lossreduce``
    vs stock verl's ``token-mean`` (the tiny CPU launch of docs/frameworks/verl.md, four
    launches in ABBA order, median over their steps): the ratio, the actor update's
    ratio, and whether the step meets :data:`TRL_TARGET_RATIO` (the same 1.03); None,
    said in one line, when verl is not installed."""
    if _verl_missing("verl main_ppo step"):
        return None
    from lossreduce.bench.frameworks.verl_main_ppo import run_main_ppo_bench

    result = run_main_ppo_bench()
    step = _framework_step("verl main_ppo", "stock token-mean", "stock", result)
    print(
        f"  verl main_ppo actor update: lossreduce {result.lossreduce_update_s * 1e3:.1f} ms vs "
        f"stock {result.stock_update_s * 1e3:.1f} ms: ratio {result.update_ratio:.3f}; "
        f"lossreduce's round {result.lossreduce_round_s * 1e3:.1f} ms a mini-batch",
        flush=True,
    )
    return {
        **step,
        "lossreduce_update_s": result.lossreduce_update_s,
        "stock_update_s": result.stock_update_s,
        "update_ratio": result.update_ratio,
        "lossreduce_round_s": result.lossreduce_round_s,
        "launches": result.launches,
    }


def run_skyrl_e2e(
    workload: SkyRLBenchSettings | None = None,
) -> dict[str, float | int | bool] | None:
    """A SkyRL policy update with lossreduce's normalizers vs SkyRL's own ``token_mean``
    (median over updates, ABBA order, one process; ``workload`` or the default): the ratio
    and whether it meets :data:`TRL_TARGET_RATIO` (the same 1.03); None, said in one line,
    when SkyRL is not installed (it has an environment of its own:
    docs/frameworks/skyrl.md)."""
    import importlib.util

    if importlib.util.find_spec("skyrl") is None:
        print(
            "  SkyRL step: skipped (SkyRL is not installed: docs/frameworks/skyrl.md)",
            flush=True,
        )
        return None
    # Imports SkyRL only inside run_skyrl_bench, after its CPU platform where there is no GPU.
    from lossreduce.bench.frameworks.skyrl import run_skyrl_bench

    return _framework_step("SkyRL", "token_mean", "skyrl", run_skyrl_bench(workload))


def run_areal_e2e(
    workload: ArealBenchSettings | None = None,
) -> dict[str, dict[str, float | int | bool]] | None:
    """AReaL's PPO update with the LossReduce actor vs AReaL's own, for each of AReaL's
    engines that is installed (median over steps, ABBA order, one process; ``workload``
    for all of them, its ``engine`` replaced): each engine's ratio and whether it meets
    :data:`TRL_TARGET_RATIO` (the same 1.03); None, said in one line, where AReaL is not
    installed (it has an environment of its own: docs/frameworks/areal.md)."""
    try:
        from lossreduce.bench.frameworks.areal import (
            ENGINES,
            ArealBenchSettings,
            run_areal_bench,
        )
    except ImportError as err:
        print(f"  AReaL step: skipped ({err})", flush=True)
        return None
    workload = workload or ArealBenchSettings()
    results: dict[str, dict[str, float | int | bool]] = {}
    for engine in ENGINES:
        if engine == "megatron" and not _megatron_installed():
            print(
                "  AReaL megatron step: skipped (needs AReaL's [megatron] packages, "
                "megatron-core and mbridge: docs/frameworks/areal.md)",
                flush=True,
            )
            continue
        result = run_areal_bench(workload.model_copy(update={"engine": engine}))
        results[engine] = _framework_step(f"AReaL {engine}", "AReaL", "areal", result)
    return results


def _megatron_installed() -> bool:
    import importlib.util

    try:
        return all(importlib.util.find_spec(m) is not None for m in ("megatron.core", "mbridge"))
    except ModuleNotFoundError:  # no `megatron` package at all
        return False


def _framework_steps() -> tuple[tuple[str, str, Callable[[], object]], ...]:
    # (payload key, what is compared, the run): run_frameworks_e2e's order.
    return (
        ("e2e_trl", "a TRL GRPO step, lossreduce normalizers vs TRL's dapo", run_trl_e2e),
        ("e2e_verl", "a verl actor step, lossreduce normalizers vs verl's token-mean", run_verl_e2e),
        ("e2e_verl_megatron", "a verl Megatron actor step, lossreduce vs verl's token-mean",
         run_verl_megatron_e2e),
        ("e2e_verl_statistics", "verl's kl_cov, its statistic over the mini-batch vs per call, "
         "at 1 and 4 mini-batches a step",
         run_verl_statistics_e2e),
        ("e2e_verl_main_ppo", "verl main_ppo, the lossreduce trainer mode vs stock",
         run_verl_main_ppo_e2e),
        ("e2e_areal", "AReaL's PPO update, LossReduce actor vs AReaL's own", run_areal_e2e),
        ("e2e_skyrl", "a SkyRL policy update, lossreduce vs SkyRL's token_mean", run_skyrl_e2e),
    )  # fmt: skip


FRAMEWORK_E2E_KEYS = tuple(key for key, _, _ in _framework_steps())
"""The bench payload's keys for :func:`run_frameworks_e2e`'s results (None: not run)."""


def run_frameworks_e2e(main_ppo: bool) -> dict[str, object]:
    """Every framework's step with lossreduce against its own, each where the framework is
    installed (None, said in one line, where not); ``main_ppo``: verl's whole
    ``main_ppo`` step too. Keyed by :data:`FRAMEWORK_E2E_KEYS`."""
    out: dict[str, object] = dict.fromkeys(FRAMEWORK_E2E_KEYS)
    for key, what, run in _framework_steps():
        if key == "e2e_verl_main_ppo" and not main_ppo:
            continue
        print(f"end to end: {what}", flush=True)
        out[key] = run()
    return out
