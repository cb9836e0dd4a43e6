"""What a training run shows and leaves behind.

- a live progress bar (rich): step, reward, each term's loss and global
  normalizer, round latency and the part of it a rank waited for;
- a final summary table;
- ``metrics.jsonl`` (one JSON object per step) and ``plot.png`` (reward and
  losses against step) in the run's output directory.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

__all__ = ["RunOutputs", "StepObserver", "StepRecord"]


@dataclass(frozen=True)
class StepRecord:
    """One finished step, as the driver saw it."""

    step: int
    reward: float
    """Mean reward of all sampled responses (before filtering)."""
    losses: dict[str, float]
    """Global loss of each term (summed over ranks); empty when skipped."""
    normalizers: dict[str, float]
    """Global normalizer of each term; empty when skipped."""
    round_latency_s: float
    """Slowest rank's normalizer round, from its start to its answer."""
    step_seconds: float
    """Driver wall time of the step: rollouts, filtering, training."""
    skipped: bool
    """True when the step had no active unit and ``--on-empty-step skip`` applied."""
    responses: int
    """Responses kept after filtering."""
    groups: int
    """Prompt groups kept after filtering."""
    tokens: int
    """Loss tokens kept after filtering."""
    normalizer_wait_s: float = 0.0
    """Longest time a rank was blocked waiting for its round; the rest of the
    round hid behind that rank's first forward."""


def _fmt_terms(values: dict[str, float]) -> str:
    return " ".join(f"{term}={value:.4g}" for term, value in values.items()) or "-"


class StepObserver(Protocol):
    """Gets told about progress (the progress bar, tests that inject faults)."""

    def on_rollout(self, step: int) -> None:
        """The step's rollouts are in; training is about to be dispatched."""

    def on_step(self, record: StepRecord) -> None:
        """The step finished on every rank."""


class RunOutputs:
    """Progress bar, JSONL, plot and summary of one run (a context manager)."""

    def __init__(
        self, out_dir: Path, total_steps: int, *, progress: bool, console: Console | None = None
    ) -> None:
        self.out_dir = out_dir
        self.jsonl_path = out_dir / "metrics.jsonl"
        self.plot_path = out_dir / "plot.png"
        self.console = console or Console()
        self.records: list[StepRecord] = []
        self._total = total_steps
        self._progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=20),
            TextColumn("{task.description}"),
            console=self.console,
            disable=not progress,
        )
        self._task = self._progress.add_task("starting", total=total_steps)

    def __enter__(self) -> RunOutputs:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path.write_text("")
        self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._progress.stop()

    def on_rollout(self, step: int) -> None:
        """Rollouts are in; nothing to show until the step finishes."""

    def on_step(self, record: StepRecord) -> None:
        self.records.append(record)
        with self.jsonl_path.open("a") as fh:
            fh.write(json.dumps(asdict(record), sort_keys=True) + "\n")
        state = (
            "skipped (empty step)"
            if record.skipped
            else (f"loss {_fmt_terms(record.losses)} | N {_fmt_terms(record.normalizers)}")
        )
        self._progress.update(
            self._task,
            completed=len(self.records),
            description=(
                f"reward {record.reward:.3f} | {state} | "
                f"round {1000 * record.round_latency_s:.1f} ms "
                f"(waited {1000 * record.normalizer_wait_s:.1f} ms)"
            ),
        )

    def summary_table(self) -> Table:
        table = Table(title="lossreduce train: summary")
        table.add_column("metric")
        table.add_column("value", justify="right")
        recs = self.records
        if not recs:
            table.add_row("steps", "0")
            return table
        trained = [r for r in recs if not r.skipped]
        table.add_row("steps (trained / skipped)", f"{len(trained)} / {len(recs) - len(trained)}")
        table.add_row("reward first -> last", f"{recs[0].reward:.3f} -> {recs[-1].reward:.3f}")
        table.add_row("reward best", f"{max(r.reward for r in recs):.3f}")
        if trained:
            last = trained[-1]
            for term, value in last.losses.items():
                table.add_row(f"loss {term} (last)", f"{value:.5g}")
            for term, value in last.normalizers.items():
                table.add_row(f"global normalizer {term} (last)", f"{value:g}")
            mean_latency = sum(r.round_latency_s for r in trained) / len(trained)
            table.add_row("round latency mean", f"{1000 * mean_latency:.1f} ms")
        latency = statistics.median(r.round_latency_s for r in recs)
        wait = statistics.median(r.normalizer_wait_s for r in recs)
        table.add_row(
            "round latency / normalizer wait median", f"{1000 * latency:.1f} / {1000 * wait:.1f} ms"
        )
        table.add_row("step time mean", f"{sum(r.step_seconds for r in recs) / len(recs):.2f} s")
        table.add_row("metrics", str(self.jsonl_path))
        table.add_row("plot", str(self.plot_path))
        return table

    def finish(self) -> None:
        """Write the plot and print the summary table."""
        self._progress.stop()
        self.write_plot()
        self.console.print(self.summary_table())

    def write_plot(self) -> None:
        # Imported here, where the plot is drawn: matplotlib is slow to import and
        # nothing else of a run needs it.
        import matplotlib

        matplotlib.use("Agg")  # headless: workers and CI have no display
        import matplotlib.pyplot as plt

        steps = [r.step for r in self.records]
        fig, (ax_reward, ax_loss, ax_norm) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
        ax_reward.plot(steps, [r.reward for r in self.records], marker=".", color="tab:green")
        ax_reward.set_ylabel("mean reward")
        ax_reward.set_ylim(0, 1)
        ax_reward.grid(alpha=0.3)
        terms = sorted({t for r in self.records for t in r.losses})
        for term in terms:
            points = [(r.step, r.losses[term]) for r in self.records if term in r.losses]
            ax_loss.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=term)
        ax_loss.set_ylabel("global loss per term")
        ax_loss.grid(alpha=0.3)
        for term in terms:
            points = [(r.step, r.normalizers[term]) for r in self.records if term in r.normalizers]
            ax_norm.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=term)
        ax_norm.set_xlabel("step")
        ax_norm.set_ylabel("global normalizer N")
        ax_norm.grid(alpha=0.3)
        if terms:
            # Counts of tokens, responses and groups differ by orders of magnitude.
            ax_norm.set_yscale("log")
            ax_loss.legend()
            ax_norm.legend()
        fig.suptitle("lossreduce train")
        fig.tight_layout()
        fig.savefig(self.plot_path, dpi=100)
        plt.close(fig)
