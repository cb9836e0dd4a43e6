"""What SkyRL's two lossreduce workers share: :class:`SkyRLRoundsMixin`.

Placed before SkyRL's FSDP worker class (the policy's and the critic's), it reads and
checks lossreduce's settings when the worker is built, holds the worker's
:class:`~lossreduce.trainer_worker.integrations.worker_rounds.WorkerRounds` (one round per
mini-batch, over the worker's data-parallel ranks, in the worker's reduction group),
claims the run's job and group before the first rollout, keeps the round counter next
to SkyRL's checkpoint, gathers the rows ``prompt_mean`` needs, and turns the optimizer
step after a skipped empty mini-batch into nothing.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.backends.skyrl_train.utils.io import io

from lossreduce.errors import ReductionInputError
from lossreduce.trainer_worker.integrations.skyrl.config import reduction_settings
from lossreduce.trainer_worker.integrations.skyrl.options import config_problems, raise_problems
from lossreduce.trainer_worker.integrations.skyrl.plan import PROMPT_FIELD
from lossreduce.trainer_worker.integrations.skyrl.settings import SkyRLReductionSettings
from lossreduce.trainer_worker.integrations.worker_rounds import (
    DataParallel,
    RunClaim,
    WorkerRounds,
    gather_rows,
    round_file,
)
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode, PolicyGradientReduction
from lossreduce.trainer_worker.step_rows import StepRows, TermPlan

__all__ = ["SkyRLRoundsMixin"]


class SkyRLRoundsMixin:
    """The rounds of one SkyRL worker (place before ``FSDPPolicyWorkerBase`` or
    ``FSDPCriticWorkerBase``). ``skipped_steps`` counts mini-batches skipped as empty;
    ``last_normalizers`` holds the global normalizers the last mini-batch used."""

    role: ClassVar[Literal["policy", "critic"]]
    """Which of SkyRL's models the worker trains."""

    # What SkyRL's worker provides.
    cfg: Any
    sequence_parallel_size: int
    mesh_rank: Any
    device_mesh: Any

    def __init__(
        self,
        *,
        cfg: Any,
        world_size: int,
        rank: int,
        local_rank: int,
        master_addr: str | None,
        master_port: int | None,
        sequence_parallel_size: int,
        record_memory: bool = False,
    ) -> None:
        self.reduction_settings: SkyRLReductionSettings = reduction_settings(cfg)
        raise_problems(config_problems(cfg, self.reduction_settings), self.reduction_settings)
        super().__init__(  # type: ignore[call-arg]
            cfg=cfg,
            world_size=world_size,
            rank=rank,
            local_rank=local_rank,
            master_addr=master_addr,
            master_port=master_port,
            sequence_parallel_size=sequence_parallel_size,
            record_memory=record_memory,
        )
        self.rounds = WorkerRounds(self.reduction_settings, self._data_parallel)
        self.skipped_steps = 0
        self.last_normalizers: dict[str, float] | None = None
        self._skip_optimizer_step = False

    def round_group(self) -> str:
        """This worker's reduction group (before the sequence-parallel suffix): the
        settings' ``critic_group`` for the critic, ``group`` for the policy."""
        settings = self.reduction_settings
        return settings.critic_group if self.role == "critic" else settings.group

    def _data_parallel(self) -> DataParallel:
        group = self.round_group()
        if self.sequence_parallel_size > 1:
            # Ranks of one sequence-parallel group hold the same rows: each index within
            # such a group reduces over the data-parallel ranks in a round of its own.
            group = f"{group}.sp{self.mesh_rank.sp}"
        return DataParallel(
            group=self.device_mesh.get_group("dp"),
            rank=self.mesh_rank.dp,
            size=self.mesh_rank.dp_size,
            round_group=group,
        )

    # -- the run and its rounds -----------------------------------------------------

    def claim(self) -> RunClaim:
        """Claim this worker group's (job, group) for its run at the round it sends first
        (0 for a new run, the checkpoint's counter once ``load_checkpoint`` restored it),
        before any rollout; every rank calls it."""
        return self.rounds.claim()

    def save_checkpoint(self, ckpt_dir: str, tokenizer: Any = None) -> None:
        """SkyRL's checkpoint, plus this rank's round counter."""
        super().save_checkpoint(ckpt_dir, tokenizer=tokenizer)  # type: ignore[misc]
        path = round_file(ckpt_dir, dist.get_rank())
        with io.open_file(path, "w") as f:
            f.write(self.rounds.saved())

    def load_checkpoint(
        self,
        ckpt_dir: str,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
    ) -> Any:
        """SkyRL's checkpoint, and the round counter saved with it (if any)."""
        path = round_file(ckpt_dir, dist.get_rank())
        if io.exists(path):
            with io.open_file(path, "r") as f:
                self.rounds.restore(f.read())
        return super().load_checkpoint(  # type: ignore[misc]
            ckpt_dir,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
        )

    def optim_step(self) -> float | None:
        """SkyRL's optimizer step, or nothing after a skipped empty mini-batch."""
        if self._skip_optimizer_step:
            self._skip_optimizer_step = False
            return None
        return super().optim_step()  # type: ignore[misc,no-any-return]

    # -- one mini-batch -------------------------------------------------------------

    def _rows(
        self,
        data: TrainingInputBatch,
        tokens: torch.Tensor,
        reductions: dict[str, PolicyGradientReduction],
    ) -> tuple[StepRows, int]:
        """The rows the plan needs and this rank's index among them (``tokens``: ``[B]``,
        each row's ``D_i``)."""
        n = tokens.shape[0]
        if all(r.mode is not PolicyGradientMode.PROMPT_MEAN for r in reductions.values()):
            zeros = torch.zeros(n, dtype=torch.long)
            return StepRows(process=zeros, window=zeros, group=zeros, tokens=tokens), 0
        groups = data.get(PROMPT_FIELD)
        if groups is None:
            raise ReductionInputError(
                f"job {self.rounds.identity()[1]!r}: mode 'prompt_mean' needs the prompt "
                f"group of every row (the batch field {PROMPT_FIELD!r} that "
                "LossReduceRayPPOTrainer adds), which this mini-batch lacks"
            )
        # A group's tokens and owner span ranks: every rank sees every rank's rows.
        dp = self.rounds.dp
        keys = [str(g) for g in groups.cpu().tolist()]
        return gather_rows(keys, tokens, world=dp.size, group=dp.group), dp.rank

    def _take_round(
        self, step: int, plan: TermPlan, bad: list[str], term: str
    ) -> tuple[dict[str, float] | None, float]:
        """Reduce a mini-batch's round (``bad`` poisons ``term``) and record it: its
        normalizers, or (None) a skipped empty mini-batch, whose optimizer step then does
        nothing. Also the round's latency in seconds."""
        started = time.perf_counter()
        totals = self.rounds.reduce(step, plan.partials, plan.contracts, bad, term)
        latency = time.perf_counter() - started
        self.last_normalizers = totals
        self._skip_optimizer_step = totals is None
        if totals is None:
            self.skipped_steps += 1
        return totals, latency
