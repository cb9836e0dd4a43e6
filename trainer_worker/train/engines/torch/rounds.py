"""A torch-engine rank's rounds: :class:`~lossreduce.trainer_worker.integrations.worker_rounds.WorkerRounds`
from what the driver gives a worker (the job, the run, the coordinator and its credentials)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import SecretStr

from lossreduce.trainer_worker.integrations.worker_rounds import DataParallel, WorkerRounds
from lossreduce.trainer_worker.train.engines.base import REDUCTION_GROUP

if TYPE_CHECKING:
    import torch

    from lossreduce.client import ClientSettings

__all__ = ["EngineRounds", "engine_rounds"]


@dataclass(frozen=True)
class EngineRounds:
    """The :class:`~lossreduce.trainer_worker.integrations.worker_rounds.RoundSettings`
    of a ``lossreduce train`` worker: the driver names the job and the run, and gives
    the coordinator's address (its own actor's or the operator's) with its credentials."""

    job: str
    normalizer: str
    run: str | None
    on_empty_step: str
    call_timeout_s: float
    coordinator: str | None = None
    token: SecretStr | None = None
    tls_ca: bytes | None = None

    def __post_init__(self) -> None:
        if self.normalizer == "coordinator" and self.coordinator is None:
            raise ValueError(
                f"job {self.job!r}: normalizer 'coordinator' needs a coordinator address"
            )

    @property
    def client(self) -> ClientSettings:
        from lossreduce.client import ClientSettings

        return ClientSettings(
            call_timeout_s=self.call_timeout_s, token=self.token, tls_root_cert_pem=self.tls_ca
        )

    def job_of(self, run: str) -> str:
        """The driver's job, whatever the run."""
        return self.job


def engine_rounds(
    settings: EngineRounds, *, rank: int, world_size: int, device: torch.device
) -> WorkerRounds:
    """Rank ``rank`` of ``world_size``'s rounds over the default process group (the
    rank alone when ``world_size`` is 1), in the train job's reduction group."""
    return WorkerRounds(
        settings,
        lambda: DataParallel(group=None, rank=rank, size=world_size, round_group=REDUCTION_GROUP),
        device=lambda: device,
    )
