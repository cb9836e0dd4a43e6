"""The training driver: Ray, the coordinator, placement, workers, the GRPO loop.

Per step the driver draws the prompts, has every worker sample responses for
its slice of them, scores and filters the responses (whole prompt groups,
variable sizes), computes group-relative advantages, shards whole groups
across the ranks balancing tokens, and has every worker train on its shard.

Failures: every wait on the workers is bounded. When a worker dies or raises,
the driver gives the others up to the round timeout (plus a margin) to report
their own error — with the coordinator they get ``RoundTimeoutError`` naming
the missing rank, instead of hanging — then raises :class:`TrainingFailedError`
naming the dead rank, its node, and what each other rank saw.
"""

from __future__ import annotations

import re
import secrets
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import ray
import torch
from pydantic import SecretStr
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from rich.console import Console

from lossreduce.client import ClientSettings
from lossreduce.trainer_worker.coordinator_actor import CoordinatorHandle, start_coordinator_actor
from lossreduce.trainer_worker.engine import TorchTrainEngine
from lossreduce.trainer_worker.grpo import GRPOLoss, shard_groups
from lossreduce.trainer_worker.microbatch import MicrobatchSettings, MicrobatchSplitter
from lossreduce.trainer_worker.normalizers import LocalNormalizer
from lossreduce.trainer_worker.outputs import RunOutputs, StepRecord
from lossreduce.trainer_worker.placement import (
    BundleSlot,
    WorkerPlacement,
    create_worker_placement,
    describe_slot,
)
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode
from lossreduce.trainer_worker.rollout import RolloutBatch, Samples, build_batch, stream_seed
from lossreduce.trainer_worker.task import DigitTask
from lossreduce.trainer_worker.train_settings import TrainSettings
from lossreduce.trainer_worker.verify import VerifyReport, compare_gradients
from lossreduce.trainer_worker.worker import (
    REDUCTION_GROUP,
    TrainerWorker,
    WorkerConfig,
    WorkerStepResult,
    build_policy,
)

__all__ = [
    "FAILURE_GRACE_S",
    "RunResult",
    "StepObserver",
    "TrainingFailedError",
    "describe_failure",
    "run",
    "worker_name",
]

FAILURE_GRACE_S = 10.0
"""After a rank fails, how long beyond the round timeout its peers get to report."""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

STARTUP_TIMEOUT_S = 120.0
"""Bound on placing the workers, starting them and the coordinator."""


class TrainingFailedError(RuntimeError):
    """The run stopped: a rank died, raised, or hung. The message says which and where."""


class StepObserver(Protocol):
    """Gets told about progress (the progress bar, tests that inject faults)."""

    def on_rollout(self, step: int) -> None:
        """The step's rollouts are in; training is about to be dispatched."""

    def on_step(self, record: StepRecord) -> None:
        """The step finished on every rank."""


@dataclass(frozen=True)
class RunResult:
    """What a finished run produced."""

    job: str
    out_dir: Path
    records: tuple[StepRecord, ...]
    verify: VerifyReport | None


def worker_name(job: str, rank: int) -> str:
    """The Ray actor name of a rank (``ray.get_actor`` finds it)."""
    return f"lossreduce-worker-{job}-{rank}"


def _short(err: BaseException) -> str:
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        err = cause
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(err).__name__}: {first[:400]}"


def _death_reason(err: BaseException) -> str:
    """Why an actor died, in one line (its constructor's exception when it had one)."""
    lines = [line.strip() for line in _ANSI.sub("", str(err)).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    if "creation task" in lines[0]:
        return f"its constructor raised {lines[-1][:400]}"
    return lines[0][:400]


def describe_failure(
    what: str,
    step: int | None,
    slots: Sequence[BundleSlot],
    *,
    dead: Mapping[int, str],
    errors: Mapping[int, str],
    hung: Sequence[int],
) -> str:
    """One message naming every dead, failed and hung rank with its node."""
    where = f"step {step} ({what})" if step is not None else what
    parts = [
        f"rank {r} on {describe_slot(slots[r])} died ({reason})"
        for r, reason in sorted(dead.items())
    ]
    parts += [
        f"rank {r} on {describe_slot(slots[r])} failed: {msg}" for r, msg in sorted(errors.items())
    ]
    if hung:
        parts.append(f"ranks {list(hung)} did not answer in time")
    return f"{where} failed: " + "; ".join(parts)


class _Workers:
    """The rank-ordered actor handles and bounded waits on them."""

    def __init__(
        self, handles: Sequence[Any], placement: WorkerPlacement, settings: TrainSettings
    ) -> None:
        self.handles = list(handles)
        self.slots = placement.slots
        self.settings = settings

    def __len__(self) -> int:
        return len(self.handles)

    def gather(
        self,
        futures: Sequence[Any],
        what: str,
        step: int | None,
        ranks: Sequence[int] | None = None,
    ) -> list[Any]:
        """Results in rank order; :class:`TrainingFailedError` if any rank dies, raises or hangs."""
        ranks = list(range(len(futures))) if ranks is None else list(ranks)
        pending = dict(zip(futures, ranks, strict=True))
        results: dict[int, Any] = {}
        dead: dict[int, str] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + self.settings.step_timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except RayActorError as err:
                    dead[rank] = _death_reason(err)
                except Exception as err:  # a rank's own error, reported with its rank
                    errors[rank] = _short(err)
                if dead or errors:
                    # Give the peers the round timeout to learn of it and report.
                    grace = self.settings.round_timeout_s + FAILURE_GRACE_S
                    deadline = min(deadline, time.monotonic() + grace)
        if dead or errors or pending:
            raise TrainingFailedError(
                describe_failure(
                    what,
                    step,
                    self.slots,
                    dead=dead,
                    errors=errors,
                    hung=sorted(pending.values()),
                )
            )
        return [results[r] for r in ranks]

    def shutdown(self, graceful: bool) -> None:
        """Close clients and process groups (when ``graceful``), then end the actors."""
        if graceful:
            refs = [h.shutdown.remote() for h in self.handles]
            ray.wait(refs, num_returns=len(refs), timeout=10)
        for handle in self.handles:
            ray.kill(handle)


@contextmanager
def _ray_session(settings: TrainSettings) -> Iterator[bool]:
    """Join or start Ray; shut down only what this run started.

    Yields whether this run started a local cluster (whose size is then final).
    """
    if ray.is_initialized():
        yield False
        return
    try:
        if settings.address is None:
            ray.init(num_cpus=settings.num_cpus, include_dashboard=False, logging_level="WARNING")
        else:
            _check_reachable(settings.address)
            ray.init(address=settings.address, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as err:
        where = f"--address {settings.address}" if settings.address else "a local Ray cluster"
        raise TrainingFailedError(f"cannot start or join {where}: {_short(err)}") from err
    try:
        yield settings.address is None
    finally:
        ray.shutdown()


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A ``HOST:PORT`` Ray address must accept a TCP connection (Ray itself retries
    for minutes); ``auto`` and ``ray://`` addresses are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConnectionError(f"nothing answers at {address} ({err})") from err


def _check_capacity(settings: TrainSettings) -> None:
    """Fail at once when a local cluster can never hold the workers' bundles."""
    resources = ray.cluster_resources()
    kind = "GPU" if resources.get("GPU", 0.0) >= 1.0 else "CPU"
    have = int(resources.get(kind, 0.0))
    if have < settings.workers:
        raise TrainingFailedError(
            f"--workers {settings.workers} needs {settings.workers} {kind} bundles, but the "
            f"local Ray cluster has {have} {kind}s (raise --num-cpus or lower --workers)"
        )


def _start_workers(
    settings: TrainSettings,
    job: str,
    placement: WorkerPlacement,
    coordinator: str | None,
    token: SecretStr | None,
) -> _Workers:
    actor_cls = ray.remote(TrainerWorker)
    handles = []
    for rank, slot in enumerate(placement.slots):
        config = WorkerConfig(
            job=job,
            rank=rank,
            world_size=settings.workers,
            coordinator=coordinator,
            coordinator_token=token,
            settings=settings,
        )
        handle = actor_cls.options(
            name=worker_name(job, rank),
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement.group, placement_group_bundle_index=slot.bundle_index
            ),
            **placement.actor_resources(),
        ).remote(config)
        handles.append(handle)
    workers = _Workers(handles, placement, settings)
    # Rank 0 picks the rendezvous address on its node; everyone joins it.
    addr, port = workers.gather([handles[0].rendezvous_address.remote()], "startup", None)[0]
    workers.gather([h.setup.remote(addr, port) for h in handles], "process-group setup", None)
    return workers


def _rollouts(
    settings: TrainSettings, task: DigitTask, workers: _Workers, step: int
) -> tuple[RolloutBatch, float]:
    """Sample on every worker, score, filter: the step's batch and its mean reward."""
    prompts = task.sample_prompts(
        settings.prompts_per_step,
        torch.Generator().manual_seed(stream_seed(settings.seed, "prompts", step)),
    )
    count, world = len(prompts), len(workers)
    bounds = [r * count // world for r in range(world + 1)]
    ranks = [r for r in range(world) if bounds[r + 1] > bounds[r]]
    futures = [
        workers.handles[r].sample.remote(step, prompts.tokens[bounds[r] : bounds[r + 1]], bounds[r])
        for r in ranks
    ]
    samples = Samples.concat(workers.gather(futures, "sampling", step, ranks))
    prompt_len = prompts.tokens.shape[1]
    targets = prompts.targets.repeat_interleave(settings.samples_per_prompt, dim=0)
    rewards = task.score(samples.tokens[:, prompt_len:], targets)  # [N]
    batch = build_batch(samples, rewards, settings.samples_per_prompt, prompt_len)
    return batch, float(rewards.mean())


def _train_step(
    workers: _Workers, batch: RolloutBatch, reward: float, step: int, capture: bool = False
) -> list[WorkerStepResult]:
    shards = shard_groups(batch.group_tokens(), len(workers))
    futures = [
        h.train.remote(step, batch.select_groups(shards[r]), reward, capture)
        for r, h in enumerate(workers.handles)
    ]
    results: list[WorkerStepResult] = workers.gather(futures, "training", step)
    return results


def _record(
    step: int,
    batch: RolloutBatch,
    reward: float,
    results: Sequence[WorkerStepResult],
    seconds: float,
) -> StepRecord:
    first = results[0]
    # Show normalizers in the loss's term order (backends may return them sorted).
    order = [*first.losses, *sorted(set(first.normalizers) - set(first.losses))]
    return StepRecord(
        step=step,
        reward=reward,
        losses=dict(first.losses),
        normalizers={term: first.normalizers[term] for term in order},
        round_latency_s=max(r.round_latency_s for r in results),
        step_seconds=seconds,
        skipped=first.skipped,
        responses=len(batch),
        groups=len(batch.group_sizes),
        tokens=batch.num_tokens,
    )


def _train_loop(
    settings: TrainSettings, workers: _Workers, observers: Sequence[StepObserver]
) -> None:
    task = DigitTask(settings.prompt_len, settings.response_len, settings.max_step)
    for step in range(settings.steps):
        start = time.perf_counter()
        batch, reward = _rollouts(settings, task, workers, step)
        for observer in observers:
            observer.on_rollout(step)
        results = _train_step(workers, batch, reward, step)
        record = _record(step, batch, reward, results, time.perf_counter() - start)
        for observer in observers:
            observer.on_step(record)


def _single_process_gradients(
    settings: TrainSettings, job: str, batch: RolloutBatch
) -> tuple[dict[str, torch.Tensor], float]:
    """The same step in this process on all the data: (gradients, total loss)."""
    device = torch.device("cpu")
    policy = build_policy(settings, device)
    loss = GRPOLoss(
        PolicyGradientMode(settings.mode),
        divisor=settings.effective_divisor,
        kl_coef=settings.kl_coef,
        clip_eps=settings.clip_eps,
        prompt_len=batch.prompt_len,
    )
    captured: dict[str, torch.Tensor] = {}

    def capture(model: torch.nn.Module) -> None:
        captured.update(
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        )

    engine = TorchTrainEngine(
        policy,
        torch.optim.Adam(policy.parameters(), lr=settings.lr),
        LocalNormalizer(job=job, group=REDUCTION_GROUP),
        MicrobatchSplitter(MicrobatchSettings(n_microbatches=settings.microbatches)),
        forward_fn=loss.forward,
        on_empty_step="raise",
        grad_sync=capture,
    )
    stats = engine.train_batch_with_reduction(batch.as_input(device), loss.reduction)
    return captured, stats.loss


def _verify(settings: TrainSettings, job: str, workers: _Workers) -> VerifyReport:
    task = DigitTask(settings.prompt_len, settings.response_len, settings.max_step)
    batch, reward = _rollouts(settings, task, workers, 0)
    results = _train_step(workers, batch, reward, 0, capture=True)
    if results[0].skipped:
        raise TrainingFailedError(
            f"--verify: step 0 was empty ({results[0].skip_reason}); try another --seed"
        )
    per_rank = workers.gather([h.gradients.remote() for h in workers.handles], "gradient fetch", 0)
    for rank, grads in enumerate(per_rank[1:], start=1):
        unequal = [n for n in grads if not torch.equal(grads[n], per_rank[0][n])]
        if unequal:
            raise TrainingFailedError(
                f"--verify: rank {rank}'s summed gradients differ from rank 0's for {unequal}"
            )
    single, single_loss = _single_process_gradients(settings, job, batch)
    return compare_gradients(
        per_rank[0],
        single,
        world_size=len(workers),
        distributed_loss=sum(results[0].losses.values()),
        single_loss=single_loss,
    )


def default_out_dir(now: datetime | None = None) -> Path:
    """``runs/<UTC timestamp>``."""
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / stamp


def run(
    settings: TrainSettings,
    *,
    console: Console | None = None,
    observers: Sequence[StepObserver] = (),
) -> RunResult:
    """Run training (or ``--verify``) end to end; raise :class:`TrainingFailedError` on failure."""
    console = console or Console()
    now = datetime.now(UTC)
    job = settings.job or f"train-{now.strftime('%Y%m%d-%H%M%S')}"
    out_dir = settings.out or default_out_dir(now)
    with _ray_session(settings) as started_local:
        coordinator: CoordinatorHandle | None = None
        placement: WorkerPlacement | None = None
        workers: _Workers | None = None
        failed = True
        try:
            target = settings.coordinator
            # An external coordinator takes the operator's token ($LOSSREDUCE_TOKEN);
            # the embedded one a fresh token of this run.
            token = ClientSettings().token if target is not None else None
            if settings.normalizer == "coordinator" and target is None:
                token = SecretStr(secrets.token_urlsafe(32))
                coordinator = start_coordinator_actor(job, settings.round_timeout_s, token)
                target = coordinator.target
            if started_local:
                _check_capacity(settings)
            try:
                placement = create_worker_placement(
                    settings.workers, settings.placement, STARTUP_TIMEOUT_S
                )
            except TimeoutError as err:
                raise TrainingFailedError(f"--placement {settings.placement}: {err}") from err
            workers = _start_workers(settings, job, placement, target, token)
            if coordinator is not None:
                coordinator.wait_ready(STARTUP_TIMEOUT_S)
            console.print(
                f"lossreduce train: job {job!r}, {settings.workers} workers "
                f"({'GPU' if placement.use_gpu else 'CPU'}, {settings.placement}), "
                f"normalizer {settings.normalizer}"
                + (f" at {target}" if settings.normalizer == "coordinator" else "")
                + f", mode {settings.mode}"
            )
            if settings.verify:
                report = _verify(settings, job, workers)
                console.print(report.table())
                failed = False
                return RunResult(job, out_dir, (), report)
            with RunOutputs(
                out_dir, settings.steps, progress=settings.progress, console=console
            ) as outputs:
                _train_loop(settings, workers, [outputs, *observers])
            outputs.finish()
            failed = False
            return RunResult(job, out_dir, tuple(outputs.records), None)
        finally:
            if workers is not None:
                workers.shutdown(graceful=not failed)
            if placement is not None:
                placement.remove()
            if coordinator is not None:
                coordinator.stop()
