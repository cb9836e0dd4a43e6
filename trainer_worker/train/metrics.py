"""Worker metrics through Ray's metrics API (``ray.util.metrics``).

Ray's own Prometheus export scrapes them, adding a ``ray_`` prefix: e.g.
``ray_lossreduce_worker_reward``. Labels are bounded — ``job``, plus
``term`` on per-term series — never a rank or a step. Every rank records the
same global values (losses and normalizers are summed across ranks before
they get here), so a dashboard may take any series or their ``max``.

Must be constructed inside a Ray worker or driver process (``ray.init`` done).
"""

from __future__ import annotations

from collections.abc import Mapping

from ray.util import metrics as ray_metrics

__all__ = ["STEP_SECONDS_BUCKETS", "WorkerMetrics"]

STEP_SECONDS_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
"""Histogram boundaries of ``lossreduce_worker_step_seconds``."""


class WorkerMetrics:
    """The worker-side series of one job."""

    def __init__(self, job: str) -> None:
        self.job = job
        self._tags = {"job": job}
        self._step_seconds = ray_metrics.Histogram(
            "lossreduce_worker_step_seconds",
            description="Wall time of one training step on a worker (partials, reduce, "
            "backward, gradient all-reduce, optimizer step), in seconds.",
            boundaries=STEP_SECONDS_BUCKETS,
            tag_keys=("job",),
        )
        self._loss = ray_metrics.Gauge(
            "lossreduce_worker_loss",
            description="Global loss of each term at the last step (summed over ranks).",
            tag_keys=("job", "term"),
        )
        self._normalizer = ray_metrics.Gauge(
            "lossreduce_worker_global_normalizer",
            description="Global normalizer of each term at the last step.",
            tag_keys=("job", "term"),
        )
        self._reward = ray_metrics.Gauge(
            "lossreduce_worker_reward",
            description="Mean reward of the last step's rollouts (before filtering).",
            tag_keys=("job",),
        )
        self._skipped = ray_metrics.Counter(
            "lossreduce_worker_skipped_steps",
            description="Steps skipped because no rank had an active unit (--on-empty-step skip).",
            tag_keys=("job",),
        )

    def record_step(
        self,
        seconds: float,
        losses: Mapping[str, float],
        normalizers: Mapping[str, float],
        reward: float,
        skipped: bool,
    ) -> None:
        """Record one finished step; a skipped step has no losses to report."""
        self._step_seconds.observe(seconds, tags=self._tags)
        self._reward.set(reward, tags=self._tags)
        if skipped:
            self._skipped.inc(1.0, tags=self._tags)
            return
        for term, value in losses.items():
            self._loss.set(value, tags={"job": self.job, "term": term})
        for term, value in normalizers.items():
            self._normalizer.set(value, tags={"job": self.job, "term": term})
