"""verl's engine workers with lossreduce's validated global normalizers.

:class:`LossReduceTrainingWorker` is verl's ``TrainingWorker`` with one seam
changed: ``train_batch(data)``, which sees each *whole* PPO mini-batch (one
optimizer step) before the engine splits it into micro-batches. There, once
per mini-batch and before any forward:

1. the rank computes each row's weight and one partial normalizer per term
   (:mod:`.plan`: the policy gradient in lossreduce's mode; verl's KL loss and
   entropy bonus as ``token_mean`` terms of their own), over active units only;
2. the normalizer backend sums and validates the partials over the engine's
   data-parallel group (``engine.get_data_parallel_group()``: with Ulysses
   sequence parallelism, the ranks that hold different data; every rank of a
   sequence-parallel group holds the same rows and reduces in its own round);
3. the micro-batches run verl's engine with :func:`.loss.micro_batch_loss`,
   which divides by those normalizers, never by verl's ``batch_num_tokens``
   or ``global_batch_size``.

Bad input gets the same answer on every rank before any backward: a NaN or
inf advantage, log-probability or importance weight at an active token makes
this rank send a NaN partial, so it raises
:class:`~lossreduce.errors.InvalidPartialError` naming itself, the input and
its value, and its peers :class:`~lossreduce.errors.RoundAbortedError`
naming it. An empty mini-batch (no active token on any rank) raises
:class:`~lossreduce.errors.EmptyNormalizerError` on every rank, or with
``on_empty_step='skip'`` runs no forward, backward or optimizer step: weights,
optimizer state and its step counter stay as they were (the learning-rate
schedule still advances with verl's training steps).

Before any of that, :meth:`LossReduceTrainingWorker.claim` claims the run's job and
group at the coordinator from the round the run sends first (0, or the round counter
``load_checkpoint`` restored), so a launch another run holds the group against stops at
start-up; ``save_checkpoint`` keeps that counter next to verl's checkpoint.

:class:`LossReduceActorRolloutRefWorker` is verl's ``ActorRolloutRefWorker``
building its actor from this worker, with settings from its config's
``lossreduce`` key (``+actor_rollout_ref.lossreduce.mode=seq_mean``) over
``LOSSREDUCE_*`` variables.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from verl.single_controller.base.decorator import (
    Dispatch,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker
from verl.workers.utils.losses import ppo_loss

from lossreduce.errors import (
    EmptyNormalizerError,
    InvalidPartialError,
    RankContext,
    ReductionInputError,
    UsageError,
)
from lossreduce.trainer_worker.integrations.run_identity import resolve_run
from lossreduce.trainer_worker.integrations.verl.launch import reduction_settings
from lossreduce.trainer_worker.integrations.verl.loss import (
    ROW_WEIGHT_KEY,
    StepNormalizers,
    micro_batch_loss,
    padded,
)
from lossreduce.trainer_worker.integrations.verl.options import (
    actor_problems,
    engine_problems,
    raise_problems,
)
from lossreduce.trainer_worker.integrations.verl.plan import (
    POLICY_TERM,
    MiniBatchPlan,
    bad_inputs,
    group_ids,
    plan_mini_batch,
)
from lossreduce.trainer_worker.integrations.verl.settings import VerlReductionSettings
from lossreduce.trainer_worker.normalizers import (
    CoordinatorNormalizer,
    GlobalNormalizer,
    LocalNormalizer,
    TorchDistributedNormalizer,
    claim_run,
)
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode
from lossreduce.trainer_worker.step_rows import StepRows

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from lossreduce.client import ClientSettings, ReductionClient
    from lossreduce.trainer_worker.integrations.coordinator_actor import JoinedCoordinator

__all__ = [
    "LossReduceActorRolloutRefWorker",
    "LossReduceTrainingWorker",
    "RunClaim",
    "describe_claims",
]


class LossReduceTrainingWorker(TrainingWorker):  # type: ignore[misc]
    """verl's ``TrainingWorker`` whose PPO mini-batches are normalized by lossreduce.

    ``reduction`` defaults to :class:`VerlReductionSettings` read from
    ``LOSSREDUCE_*``. ``skipped_steps`` counts mini-batches skipped as empty;
    ``last_normalizers`` holds the global normalizers the last mini-batch used.
    """

    def __init__(self, config: Any, reduction: VerlReductionSettings | None = None) -> None:
        self.reduction_settings = reduction if reduction is not None else VerlReductionSettings()
        if config.engine_config is not None:
            raise_problems(engine_problems(config.engine_config), self.reduction_settings)
        super().__init__(config)
        raise_problems(engine_problems(self.engine_config), self.reduction_settings)
        self.policy_reduction = self.reduction_settings.reduction
        self.skipped_steps = 0
        self.last_normalizers: dict[str, float] | None = None
        self._round = 0
        self._identity: tuple[str, str] | None = None
        self._sum_config: Any = None
        self._normalizer: GlobalNormalizer | None = None
        self._client: ReductionClient | None = None
        self._joined: JoinedCoordinator | None = None

    # -- the loss function ----------------------------------------------------------

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[untyped-decorator]
    def set_loss_fn(self, loss_fn: Callable[..., Any]) -> None:
        """Take verl's ``partial(ppo_loss, config=actor_config)``; refuse anything else
        (a distillation loss, an SFT loss) and every actor option lossreduce cannot honour."""
        settings = self.reduction_settings
        config = None
        if isinstance(loss_fn, functools.partial) and loss_fn.func is ppo_loss:
            config = loss_fn.keywords.get("config")
        if config is None:
            raise_problems(
                [f"loss function {loss_fn!r}: only verl's ppo_loss (actor) is supported"],
                settings,
            )
        assert config is not None  # raise_problems raised otherwise
        raise_problems(actor_problems(config, settings), settings)
        # verl's aggregation in token-sum with dp_size 1 is a plain masked sum.
        self._sum_config = dataclasses.replace(config, global_batch_info={"dp_size": 1})
        self.loss_fn = loss_fn

    @contextmanager
    def _normalized_loss(self, normalizers: StepNormalizers) -> Iterator[None]:
        # verl's own loss stays in place outside training (infer_batch may compute it).
        stock = self.loss_fn
        self.loss_fn = functools.partial(micro_batch_loss, normalizers, self._sum_config)
        try:
            yield
        finally:
            self.loss_fn = stock

    # -- the run and its rounds -----------------------------------------------------

    def identity(self) -> tuple[str, str]:
        """(run, job) of this worker's rounds, resolved at the claim (or else the first
        mini-batch): every rank of the worker group calls both, so rank 0's draw can be
        shared then."""
        if self._identity is None:
            settings = self.reduction_settings
            # The whole worker group, not one sequence-parallel index's data-parallel
            # group: every index must reduce under the same job.
            run = resolve_run(settings.run)
            self._identity = run, settings.job_of(run)
        return self._identity

    def claim(self) -> RunClaim:
        """Claim this worker group's (job, group) for its run, at the round it sends first
        (0 for a new run, the checkpoint's round counter once ``load_checkpoint`` restored
        it), before any rollout: a launch the coordinator refuses
        (:class:`~lossreduce.errors.RunConflictError` naming the holder) stops at start-up
        instead of at its first mini-batch. A no-op but for the identity with the torch
        normalizer, which no other run can reach. Every rank calls it (the identity may be
        a collective)."""
        run, job = self.identity()
        took_over = claim_run(self.normalizer(), self._round)
        return RunClaim(run, job, self._round_group(), self._round, took_over)

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
        _round_file(local_path).write_text(json.dumps({"round": self._round}))
        return saved

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[untyped-decorator]
    def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False
    ) -> Any:
        """verl's checkpoint, and the round counter saved with it (if any)."""
        path = _round_file(local_path)
        if path.is_file():
            self._round = int(json.loads(path.read_text())["round"])
        return super().load_checkpoint(local_path, hdfs_path, del_local_after_load)

    # -- the normalizer backend -----------------------------------------------------

    def normalizer(self) -> GlobalNormalizer:
        """The backend summing partials over the data-parallel group (made on first use)."""
        if self._normalizer is None:
            self._normalizer = self._make_normalizer()
        return self._normalizer

    def _round_group(self) -> str:
        # Ranks of one sequence-parallel group hold the same rows: each index within
        # such a group reduces over the data-parallel ranks in a round of its own.
        mesh = getattr(self.engine, "ulysses_device_mesh", None)
        group = self.reduction_settings.group
        return group if mesh is None else f"{group}.sp{mesh['sp'].get_local_rank()}"

    def _make_normalizer(self) -> GlobalNormalizer:
        settings = self.reduction_settings
        if settings.normalizer == "coordinator":
            from lossreduce.client import ReductionClient

            target, client = self._coordinator()
            run, job = self.identity()
            self._client = ReductionClient(
                target,
                job=job,
                group=self._round_group(),
                run=run,
                rank=self.engine.get_data_parallel_rank(),
                world_size=self.engine.get_data_parallel_size(),
                settings=client,
            )
            return CoordinatorNormalizer(self._client)
        _, job = self.identity()
        if self.engine.get_data_parallel_size() == 1:
            return LocalNormalizer(job=job, group=self._round_group())
        return TorchDistributedNormalizer(
            self.engine.get_data_parallel_group(), job=job, group=self._round_group()
        )

    def _coordinator(self) -> tuple[str, ClientSettings]:
        """Where the client dials and how: the configured address, or else the job's
        coordinator actor on this Ray cluster, started here unless a peer did first."""
        settings = self.reduction_settings
        if settings.coordinator is not None:
            return settings.coordinator, settings.client
        from lossreduce.trainer_worker.integrations.coordinator_actor import (
            join_coordinator_actor,
        )

        # The actor's rounds wait at most as long as a client call does.
        round_timeout_s = max(1.0, settings.client.call_timeout_s - 30.0)
        # Held while this worker lives: Ray ends an actor nobody holds.
        self._joined = join_coordinator_actor(
            self.identity()[1], round_timeout_s=round_timeout_s, startup_timeout_s=60.0
        )
        endpoint = self._joined.endpoint
        # The actor's own token and CA (a run's, made fresh) replace any configured.
        given = settings.client.model_dump(exclude={"token", "tls_root_cert_pem"})
        client = type(settings.client).model_validate(
            {**given, "token": endpoint.token, "tls_root_cert_pem": endpoint.ca_cert}
        )
        return endpoint.target, client

    def close(self) -> None:
        """Close the coordinator client, if any; the next mini-batch opens a new one."""
        if self._client is not None:
            self._client.close()
        self._client = None
        self._normalizer = None

    # -- one mini-batch -------------------------------------------------------------

    def _rows(self, data: Any, tokens: torch.Tensor) -> tuple[StepRows, int]:
        """The rows the plan needs and this rank's index among them."""
        n = tokens.shape[0]
        if self.policy_reduction.mode is not PolicyGradientMode.PROMPT_MEAN:
            zeros = torch.zeros(n, dtype=torch.long)
            return StepRows(process=zeros, window=zeros, group=zeros, tokens=tokens), 0
        uids = tu.get(data, key="uid", default=None)
        if uids is None:
            raise ReductionInputError(
                f"job {self.identity()[1]!r}: mode 'prompt_mean' needs the prompt "
                "group of every response (verl's non-tensor field 'uid'), which this "
                "mini-batch lacks"
            )
        # A group's tokens and owner span ranks: every rank sees every rank's rows.
        mine = (list(map(str, uids)), tokens.tolist())
        group = self.engine.get_data_parallel_group()
        world = self.engine.get_data_parallel_size()
        gathered: list[Any] = [None] * world
        if world == 1:
            gathered = [mine]
        else:
            dist.all_gather_object(gathered, mine, group=group)
        ids = group_ids([u for g_uids, _ in gathered for u in g_uids])
        process = [r for r, (g_uids, _) in enumerate(gathered) for _ in g_uids]
        all_tokens = [t for _, g_tokens in gathered for t in g_tokens]
        rows = StepRows(
            process=torch.tensor(process, dtype=torch.long),
            window=torch.zeros(len(process), dtype=torch.long),
            group=torch.tensor(ids, dtype=torch.long),
            tokens=torch.tensor(all_tokens, dtype=torch.float64),
        )
        return rows, self.engine.get_data_parallel_rank()

    def plan(self, data: Any) -> tuple[MiniBatchPlan, list[str]]:
        """This rank's plan for the mini-batch ``data`` and its bad inputs (if any)."""
        mask = padded(data["response_mask"]).bool()  # [B, R]
        tokens = mask.sum(-1).to(torch.float64).cpu()  # [B] D_i
        rows, rank = self._rows(data, tokens)
        config = self._sum_config
        plan = plan_mini_batch(
            self.policy_reduction,
            rows,
            rank,
            kl=bool(config.use_kl_loss),
            entropy=config.entropy_coeff != 0,
        )
        inputs = {name: padded(data[name]) for name in ("advantages", "old_log_probs")}
        for name, wanted in (
            ("ref_log_prob", config.use_kl_loss),
            ("rollout_is_weights", "rollout_is_weights" in data.keys()),  # noqa: SIM118
        ):
            if wanted:
                inputs[name] = padded(data[name])
        found = bad_inputs(
            mask.cpu(),
            {k: v.cpu() for k, v in inputs.items()},
            self.engine.get_data_parallel_rank(),
        )
        return plan, found

    def _reduce(self, step: int, plan: MiniBatchPlan, bad: list[str]) -> dict[str, float] | None:
        """The step's global normalizers; None for a skipped empty step; or the round's
        error, the same on every rank."""
        partials = dict(plan.partials)
        if bad:
            # Poison the round so every peer aborts too instead of training without us.
            partials[POLICY_TERM] = torch.tensor(math.nan, dtype=torch.float64)
        try:
            totals = self.normalizer().reduce(step, partials, plan.contracts)
        except InvalidPartialError as err:
            if not bad:
                raise
            here = RankContext(err.job, err.group, step, self.engine.get_data_parallel_rank())
            raise here.error(
                InvalidPartialError,
                f"bad input at active tokens ({'; '.join(bad)}); no rank trains on this mini-batch",
                terms=(POLICY_TERM,),
                values=(math.nan,),
            ) from err
        except EmptyNormalizerError:
            if self.reduction_settings.on_empty_step == "raise":
                raise
            return None
        return {term: float(n) for term, n in totals.items()}

    @register(  # type: ignore[untyped-decorator]
        dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False
    )
    def train_batch(self, data: Any) -> Any:
        """One PPO mini-batch (one optimizer step) normalized by lossreduce."""
        if self._sum_config is None:
            raise_problems(
                ["no loss function: call set_loss_fn(ppo_loss) first"], self.reduction_settings
            )
        self.identity()
        step = self._round
        self._round += 1
        plan, bad = self.plan(data)
        started = time.perf_counter()
        totals = self._reduce(step, plan, bad)
        latency = time.perf_counter() - started
        self.last_normalizers = totals
        if totals is None:
            self.skipped_steps += 1
            return self._skipped(data)
        data[ROW_WEIGHT_KEY] = plan.weights.to(torch.float32)
        with self._normalized_loss(StepNormalizers(totals)):
            output = super().train_batch(data)
        if output is not None:
            metrics = tu.get(output, "metrics")
            metrics.update(_round_metrics(step, totals, latency, skipped=False))
        return output

    def _skipped(self, data: Any) -> Any:
        """No forward, backward or optimizer step; the lr schedule still advances."""
        lr = self.engine.lr_scheduler_step() if tu.get(data, "update_lr_scheduler", False) else None
        if not self.engine.is_mp_src_rank_with_outputs():
            return None
        metrics: dict[str, Any] = {"loss": 0.0, "grad_norm": 0.0, "mfu": 0.0}
        metrics.update(_round_metrics(self._round - 1, {}, 0.0, skipped=True))
        if lr is not None:
            metrics["lr"] = lr
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})


@dataclasses.dataclass(frozen=True)
class RunClaim:
    """What one rank claimed at start-up (:meth:`LossReduceTrainingWorker.claim`)."""

    run: str
    job: str
    group: str
    step: int
    """The first round the run sends: 0, or where its checkpoint left the counter."""
    took_over: bool
    """The coordinator handed this run the claim of a run it replaced (a resume)."""

    def describe(self) -> str:
        """One line for the launch's log: which run holds which group from which round."""
        how = ", taken over from the run it resumes" if self.took_over else ""
        return (
            f"lossreduce: run {self.run!r} claimed job {self.job!r} group {self.group!r} "
            f"from round {self.step}{how}"
        )


def describe_claims(claims: list[RunClaim]) -> list[str]:
    """One line per group the ranks claimed (every rank of a group claims the same run and
    round). A takeover is reported to the one rank whose claim made it, whichever came
    first; the group's line says so if any rank's did."""
    took: dict[tuple[str, str, str, int], bool] = {}
    for c in claims:
        key = (c.run, c.job, c.group, c.step)
        took[key] = took.get(key, False) or c.took_over
    return [RunClaim(*key, took_over).describe() for key, took_over in sorted(took.items())]


def _round_file(checkpoint: str) -> Path:
    """Where a rank keeps its round counter in a checkpoint folder (one file per rank:
    a node-local checkpoint folder holds its own ranks' files)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Path(checkpoint) / f"lossreduce_round_rank{rank}.json"


def _round_metrics(
    step: int, totals: dict[str, float], latency: float, *, skipped: bool
) -> dict[str, float]:
    out = {f"lossreduce/normalizer/{term}": value for term, value in totals.items()}
    # The mini-batch's round, twice: verl reduces a step's per-mini-batch values by
    # the key's name (min, max, else mean), so the logged pair spans the step's rounds
    # and shows how many ran.
    out["lossreduce/round_min"] = float(step)
    out["lossreduce/round_max"] = float(step)
    out["lossreduce/round_latency_s"] = latency
    out["lossreduce/skipped"] = float(skipped)
    return out


class LossReduceActorRolloutRefWorker(ActorRolloutRefWorker):  # type: ignore[misc]
    """verl's ``ActorRolloutRefWorker`` whose actor is a :class:`LossReduceTrainingWorker`.

    Settings come from the worker config's ``lossreduce`` key (the launch's
    ``+actor_rollout_ref.lossreduce.<field>=...``), over ``LOSSREDUCE_*``.
    """

    def __init__(self, config: Any, role: str, distillation_config: Any = None) -> None:
        super().__init__(config, role, distillation_config=distillation_config)
        # Explicit fields win over LOSSREDUCE_* (pydantic-settings reads those in __init__).
        self.reduction_settings = reduction_settings(config.get("lossreduce", None))
        self.actor_worker_cls: Callable[..., LossReduceTrainingWorker] = functools.partial(
            LossReduceTrainingWorker, reduction=self.reduction_settings
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[untyped-decorator]
    def claim_rounds(self) -> RunClaim:
        """The actor's :meth:`LossReduceTrainingWorker.claim`, on every rank (the trainer
        mode calls it once verl's trainer has loaded its checkpoint, or found none)."""
        actor = self.actor
        if not isinstance(actor, LossReduceTrainingWorker):
            raise UsageError(
                f"role {self.role!r}: claim_rounds needs the actor built by init_model(), "
                f"which this worker has not (actor: {type(actor).__name__})"
            )
        return actor.claim()
