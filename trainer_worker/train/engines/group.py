"""What engines whose ranks are Ray actors of one :class:`WorkerGroup` share."""

from __future__ import annotations

from pathlib import Path

from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.worker_group import WorkerGroup

__all__ = ["GroupEngine"]


class GroupEngine:
    """An engine's run state: its settings, job and output folder, and the worker
    group once started. Subclasses implement the rest of
    :class:`~lossreduce.trainer_worker.train.engines.base.Engine`."""

    def __init__(self, settings: TrainSettings, job: str, out_dir: Path) -> None:
        self.settings = settings
        self.job = job
        self.out_dir = out_dir
        self._workers: WorkerGroup | None = None

    @property
    def workers(self) -> WorkerGroup:
        """The started worker group; RuntimeError before :meth:`start` placed it."""
        if self._workers is None:
            raise RuntimeError(f"{type(self).__name__}: the workers are not started")
        return self._workers

    def shutdown(self, graceful: bool) -> None:
        """End the workers, if any were started."""
        if self._workers is not None:
            self._workers.shutdown(graceful)
