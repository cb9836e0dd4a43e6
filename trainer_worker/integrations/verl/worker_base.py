"""What lossreduce's verl actor and critic workers share: the run, its rounds, its claim.

:class:`ReducingTrainingWorker` is verl's engine ``TrainingWorker`` with the parts of
a lossreduce worker that do not depend on the loss: the settings, the run's
identity and claim, the normalizer backends (the main one, and one of its own for
the mini-batch statistics), the round counter kept with verl's checkpoint, one
round per mini-batch whose answer (or error) is the same on every rank, the skipped
empty mini-batch, and each row's place in the batch the trainer dispatched, carried
through verl's split and shuffle (:data:`DISPATCHED_ROW_KEY`) for the errors that name
rows. The actor (:class:`~.worker.LossReduceTrainingWorker`)
and the critic (:class:`~.critic.LossReduceCriticWorker`) add their plan and loss.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from verl.single_controller.base.decorator import (
    Dispatch,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import TrainingWorker

from lossreduce.errors import ReductionInputError
from lossreduce.trainer_worker.integrations.verl.options import engine_problems, raise_problems
from lossreduce.trainer_worker.integrations.verl.parallel import round_suffix
from lossreduce.trainer_worker.integrations.verl.settings import VerlReductionSettings
from lossreduce.trainer_worker.integrations.worker_rounds import (
    DataParallel,
    RunClaim,
    WorkerRounds,
    describe_claims,
    gather_rows,
    round_metrics,
)
from lossreduce.trainer_worker.integrations.worker_rounds import round_file as _shared_round_file
from lossreduce.trainer_worker.normalizers import GlobalNormalizer
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode
from lossreduce.trainer_worker.step_rows import StepRows

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "DISPATCHED_ROW_KEY",
    "DISPATCHED_SHARE_KEY",
    "STATS_SUFFIX",
    "ReducingTrainingWorker",
    "RunClaim",
    "describe_claims",
    "round_metrics",
]

STATS_SUFFIX = ".stats"
"""The mini-batch statistics reduce in a group of their own, ``<group>.stats`` (after
the rank's position: ``actor.sp1.stats``), with a round numbering of their own."""

DISPATCHED_ROW_KEY = "lossreduce_dispatched_row"
"""The batch field holding each row's index in the batch the trainer sent
(``update_actor``, the critic's ``train_mini_batch``; ``[B]`` int64), attached before
verl's data loader splits the rank's share into mini-batches and (with ``shuffle``)
reorders it: an error names the rows where the user finds them."""
DISPATCHED_SHARE_KEY = "lossreduce_dispatched_share"
"""The batch's non-tensor field holding how many rows the rank was sent."""


class ReducingTrainingWorker(TrainingWorker):  # type: ignore[misc]
    """verl's ``TrainingWorker`` whose mini-batches reduce through lossreduce (a base:
    the actor and the critic say which group they reduce in and what they send).

    ``reduction`` defaults to :class:`VerlReductionSettings` read from
    ``LOSSREDUCE_*``. ``skipped_steps`` counts mini-batches skipped as empty;
    ``last_normalizers`` holds the global normalizers the last mini-batch used.
    """

    role: ClassVar[str] = "actor"
    """``actor`` or ``critic``: the verl config section its options are named by."""

    def __init__(self, config: Any, reduction: VerlReductionSettings | None = None) -> None:
        self.reduction_settings = reduction if reduction is not None else VerlReductionSettings()
        if config.engine_config is not None:
            raise_problems(
                engine_problems(config.engine_config, self.role), self.reduction_settings
            )
        super().__init__(config)
        raise_problems(engine_problems(self.engine_config, self.role), self.reduction_settings)
        self.skipped_steps = 0
        self.last_normalizers: dict[str, float] | None = None
        self.rounds = WorkerRounds(self.reduction_settings, self._data_parallel_group)
        """This rank's rounds: the run, the claim, the backends, the round counter."""

    def base_group(self) -> str:
        """The group of this worker's rounds as configured (the actor's or the critic's)."""
        settings = self.reduction_settings
        return settings.group if self.role == "actor" else settings.critic_group

    # -- the run and its rounds -----------------------------------------------------

    def use_settings(self, settings: VerlReductionSettings) -> None:
        """Reduce under ``settings`` from now on (before the first round: the rounds'
        names follow them); the round counter (a restored checkpoint's) is kept."""
        kept = self.rounds.round
        self.reduction_settings = settings
        self.rounds = WorkerRounds(settings, self._data_parallel_group)
        self.rounds.round = kept

    def identity(self) -> tuple[str, str]:
        """(run, job) of this worker's rounds, resolved at the claim (or else the first
        mini-batch) over the whole worker group, not one sequence-parallel index's
        data-parallel group: every index must reduce under the same job."""
        return self.rounds.identity()

    def claim(self) -> RunClaim:
        """Claim this worker group's (job, group) for its run, at the round it sends first
        (0 for a new run, the checkpoint's round counter once ``load_checkpoint`` restored
        it), before any rollout: a launch the coordinator refuses
        (:class:`~lossreduce.errors.RunConflictError` naming the holder) stops at start-up
        instead of at its first mini-batch. A no-op but for the identity with the torch
        normalizer, which no other run can reach. Every rank calls it (the identity may be
        a collective)."""
        return self.rounds.claim()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[untyped-decorator]
    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
    ) -> Any:
        """verl's checkpoint, plus this rank's round counter: a run resumed from it
        continues its rounds where this one stood instead of numbering them from 0."""
        saved = super().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep)
        Path(_round_file(local_path)).write_text(self.rounds.saved())
        return saved

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[untyped-decorator]
    def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False
    ) -> Any:
        """verl's checkpoint, and the round counter saved with it (if any)."""
        path = Path(_round_file(local_path))
        if path.is_file():
            self.rounds.restore(path.read_text())
        return super().load_checkpoint(local_path, hdfs_path, del_local_after_load)

    # -- the normalizer backends ------------------------------------------------------

    def normalizer(self, suffix: str = "") -> GlobalNormalizer:
        """The backend summing partials over the data-parallel group, for the rounds of
        group ``<group><suffix>`` (made on first use)."""
        return self.rounds.normalizer(suffix)

    def data_parallel(self) -> tuple[int, int]:
        """(rank, world size) of this worker in its data-parallel group."""
        return self.engine.get_data_parallel_rank(), self.engine.get_data_parallel_size()

    def _data_parallel_group(self) -> DataParallel:
        rank, world = self.data_parallel()
        return DataParallel(
            group=self.engine.get_data_parallel_group(),
            rank=rank,
            size=world,
            # Ranks that hold the same rows (a Ulysses group, Megatron's model-parallel
            # ranks): each position reduces over the data-parallel ranks in a round of
            # its own.
            round_group=self.base_group() + round_suffix(self.engine),
        )

    def close(self) -> None:
        """Close the coordinator clients, if any; the next mini-batch opens new ones."""
        self.rounds.close()

    # -- the rows as the trainer dispatched them ----------------------------------------

    @register(  # type: ignore[untyped-decorator]
        dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False
    )
    def train_mini_batch(self, data: Any) -> Any:
        """verl's, with each row's index in the batch the trainer sent attached first
        (:data:`DISPATCHED_ROW_KEY`): verl's dispatch gives data-parallel rank ``r`` the
        ``r``-th of equal chunks, in order."""
        rank, _ = self.data_parallel()
        share = int(data.shape[0])
        data[DISPATCHED_ROW_KEY] = rank * share + torch.arange(share, dtype=torch.int64)
        tu.assign_non_tensor(data, **{DISPATCHED_SHARE_KEY: share})
        return super().train_mini_batch(data)

    def dispatched_rows(self, data: Any) -> tuple[Tensor, int]:
        """``([B] int64, share)``: each row of the mini-batch ``data``'s index in the batch
        the trainer sent, and how many rows of it this rank was sent. A mini-batch given to
        ``train_batch`` directly counts as that batch (its rows in their order)."""
        rows = data.get(DISPATCHED_ROW_KEY, None)
        if rows is None:
            rank, _ = self.data_parallel()
            share = int(data.shape[0])
            return rank * share + torch.arange(share, dtype=torch.int64), share
        return rows.cpu(), int(tu.get(data, DISPATCHED_SHARE_KEY))

    # -- one mini-batch's round -------------------------------------------------------

    def step_rows(self, data: Any, mask: Tensor, mode: PolicyGradientMode) -> tuple[StepRows, int]:
        """The rows a mini-batch's plan needs and this rank's index among their holders:
        this rank's alone (index 0), or for ``prompt_mean`` every rank's (a group's tokens
        and its owner span ranks), rank-major (index: the data-parallel rank)."""
        tokens = mask.sum(-1).to(torch.float64).cpu()  # [B] D_i
        n = tokens.shape[0]
        if mode is not PolicyGradientMode.PROMPT_MEAN:
            zeros = torch.zeros(n, dtype=torch.long)
            return StepRows(process=zeros, window=zeros, group=zeros, tokens=tokens), 0
        uids = tu.get(data, key="uid", default=None)
        if uids is None:
            raise ReductionInputError(
                f"job {self.identity()[1]!r}: mode 'prompt_mean' needs the prompt "
                "group of every response (verl's non-tensor field 'uid'), which this "
                "mini-batch lacks"
            )
        rank, world = self.data_parallel()
        group = self.engine.get_data_parallel_group()
        return gather_rows(list(map(str, uids)), tokens, world=world, group=group), rank

    def next_round(self) -> int:
        """The round of the mini-batch about to train (every mini-batch takes one)."""
        return self.rounds.next_step()

    def reduce(
        self,
        step: int,
        partials: dict[str, Tensor],
        contracts: dict[str, str],
        bad: list[str],
        poisoned: str,
    ) -> dict[str, float] | None:
        """The step's global normalizers; None for a skipped empty step; or the round's
        error, the same on every rank (:func:`~..worker_rounds.reduce_round`)."""
        return self.rounds.reduce(step, partials, contracts, bad, poisoned)

    def skipped(self, data: Any) -> Any:
        """No forward, backward or optimizer step; the lr schedule still advances."""
        self.skipped_steps += 1
        lr = self.engine.lr_scheduler_step() if tu.get(data, "update_lr_scheduler", False) else None
        if not self.engine.is_mp_src_rank_with_outputs():
            return None
        metrics: dict[str, Any] = {"loss": 0.0, "grad_norm": 0.0, "mfu": 0.0}
        metrics.update(round_metrics(self.rounds.round - 1, {}, 0.0, skipped=True))
        if lr is not None:
            metrics["lr"] = lr
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})


def _round_file(checkpoint: str) -> str:
    """This rank's round-counter file in a checkpoint folder."""
    return _shared_round_file(checkpoint, dist.get_rank() if dist.is_initialized() else 0)
