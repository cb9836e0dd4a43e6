"""The training driver: Ray, the coordinator, placement, workers, the GRPO loop.

Per step the driver draws the prompts, has every worker sample responses for
its slice of them, scores and filters the responses (whole prompt groups,
variable sizes), computes group-relative advantages, shards whole groups
across the ranks balancing tokens, and has every worker train on its shard.

Failures (a dead, failing or hung rank, a cluster that cannot hold the
workers) end the run with :class:`TrainingFailedError`, whose message names
the rank and its node (see :mod:`lossreduce.trainer_worker.train.worker_group`).
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import ray
import torch
from pydantic import SecretStr
from ray.exceptions import GetTimeoutError, RayActorError
from rich.console import Console

from lossreduce.client import ClientSettings
from lossreduce.errors import UsageError
from lossreduce.server.security import is_loopback
from lossreduce.trainer_worker.train.coordinator_actor import (
    CoordinatorHandle,
    start_coordinator_actor,
)
from lossreduce.trainer_worker.train.grpo import shard_groups
from lossreduce.trainer_worker.train.outputs import RunOutputs, StepRecord
from lossreduce.trainer_worker.train.placement import WorkerPlacement, create_worker_placement
from lossreduce.trainer_worker.train.rollout import RolloutBatch, Samples, build_batch, stream_seed
from lossreduce.trainer_worker.train.task import DigitTask
from lossreduce.trainer_worker.train.tls import read_ca
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.verify import (
    VerifyReport,
    compare_gradients,
    single_process_gradients,
)
from lossreduce.trainer_worker.train.worker import REDUCTION_GROUP, WorkerStepResult
from lossreduce.trainer_worker.train.worker_group import (
    TrainingFailedError,
    WorkerGroup,
    death_reason,
    short_error,
)

if TYPE_CHECKING:
    from lossreduce.trainer_worker.train.agent_actor import NodeAgents
    from lossreduce.trainer_worker.train.trl_model import PolicyCheckpoint

__all__ = ["RunResult", "StepObserver", "TrainingFailedError", "default_out_dir", "run"]

STARTUP_TIMEOUT_S = 120.0
"""Bound on placing the workers, starting them and the coordinator."""


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
    except Exception as err:
        # Ray raises a bare Exception when a raylet misses its 30 s registration window
        # (an overloaded machine); anything else Ray raises here is as much the run's end.
        # What a failed local start spawned is not left running.
        ray.shutdown()
        where = f"--address {settings.address}" if settings.address else "a local Ray cluster"
        raise TrainingFailedError(f"cannot start or join {where}: {short_error(err)}") from err
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


def aggregates(settings: TrainSettings, placement: WorkerPlacement) -> bool:
    """Whether the run uses node agents: ``--aggregation node``, or ``auto`` over many nodes."""
    if settings.normalizer != "coordinator" or settings.aggregation == "off":
        return False
    return settings.aggregation == "node" or len({s.node_id for s in placement.slots}) > 1


def _check_reachable_from_every_node(settings: TrainSettings, placement: WorkerPlacement) -> None:
    """A loopback ``--coordinator`` is this node's only: ranks and agents elsewhere miss it."""
    if settings.coordinator is None:
        return
    nodes = {s.node_id for s in placement.slots}
    host = settings.coordinator.rpartition(":")[0]
    if len(nodes) > 1 and is_loopback(host):
        raise TrainingFailedError(
            f"--coordinator {settings.coordinator} is a loopback address, but the {settings.workers} "
            f"workers span {len(nodes)} nodes, whose ranks and agents would each dial their own "
            "node; give an address every node reaches (e.g. this node's IP)"
        )


def _start_agents(
    settings: TrainSettings,
    job: str,
    placement: WorkerPlacement,
    *,
    upstream: str,
    token: SecretStr | None,
    tls_ca: bytes | None,
) -> NodeAgents:
    """The node agents, upstream to the coordinator with the run's credentials."""
    # Imported here: a run without agents (one node, the torch normalizer) needs none of it.
    from lossreduce.client.agent import AgentSettings
    from lossreduce.trainer_worker.train.agent_actor import start_node_agents

    agent_settings = AgentSettings(
        call_timeout_s=settings.round_timeout_s + 30,
        # Below the round timeout, so that the coordinator's timeout names only the ranks
        # that never came (the agent forwards late ones as they come).
        node_timeout_s=settings.round_timeout_s / 2,
        token=token,
        tls_root_cert_pem=tls_ca,
    )
    try:
        return start_node_agents(
            placement.slots,
            upstream,
            job=job,
            group=REDUCTION_GROUP,
            settings=agent_settings,
            timeout_s=STARTUP_TIMEOUT_S,
        )
    except RuntimeError as err:
        raise TrainingFailedError(str(err)) from err


def _rollouts(
    settings: TrainSettings, task: DigitTask, workers: WorkerGroup, step: int
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
    workers: WorkerGroup, batch: RolloutBatch, reward: float, step: int, capture: bool = False
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
        normalizer_wait_s=max(r.normalizer_wait_s for r in results),
        step_seconds=seconds,
        skipped=first.skipped,
        responses=len(batch),
        groups=len(batch.group_sizes),
        tokens=batch.num_tokens,
    )


def _train_loop(
    settings: TrainSettings, workers: WorkerGroup, observers: Sequence[StepObserver]
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


def _verify(settings: TrainSettings, job: str, workers: WorkerGroup) -> VerifyReport:
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
    single, single_loss = single_process_gradients(settings, job, batch)
    return compare_gradients(
        per_rank[0],
        single,
        world_size=len(workers),
        distributed_loss=sum(results[0].losses.values()),
        single_loss=single_loss,
    )


def _describe_run(
    settings: TrainSettings,
    job: str,
    placement: WorkerPlacement,
    *,
    target: str | None,
    tls_ca: bytes | None,
    agents: NodeAgents | None,
) -> str:
    """The run's first line: who trains where, and how the normalizers travel."""
    nodes = len({s.node_id for s in placement.slots})
    line = (
        f"lossreduce train: job {job!r}, {settings.workers} workers "
        f"({'GPU' if placement.use_gpu else 'CPU'}, {settings.placement}, "
        f"{nodes} node{'s' if nodes > 1 else ''}), normalizer {settings.normalizer}"
    )
    if settings.normalizer == "coordinator":
        line += f" at {target}{' over TLS' if tls_ca is not None else ''}"
    if agents is not None:
        line += f" through {len(agents.actors)} node agents"
    return line + f", mode {settings.mode}"


def _wait_ready(coordinator: CoordinatorHandle | None) -> None:
    """Wait for the embedded coordinator actor to serve (no-op without one)."""
    if coordinator is None:
        return
    try:
        coordinator.wait_ready(STARTUP_TIMEOUT_S)
    except (RayActorError, GetTimeoutError) as err:
        raise TrainingFailedError(
            f"the coordinator actor {coordinator.name} did not start: {death_reason(err)}"
        ) from err


def default_out_dir(now: datetime | None = None) -> Path:
    """``runs/<UTC timestamp>``."""
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / stamp


def _prepare_trl(settings: TrainSettings, out_dir: Path) -> PolicyCheckpoint:
    """The TRL engine's policy checkpoint (imports TRL only when asked for)."""
    try:
        # Imports TRL and checks its version: a missing or untested TRL fails here.
        from lossreduce.trainer_worker.train.trl_job import prepare_policy
    except ImportError as err:
        raise TrainingFailedError(f"--engine trl: {err}") from err
    try:
        return prepare_policy(settings, out_dir)
    except UsageError as err:
        raise TrainingFailedError(str(err)) from err


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
    # --engine trl: its policy checkpoint is checked before Ray starts (bad input costs nothing).
    trl_policy = _prepare_trl(settings, out_dir) if settings.engine == "trl" else None
    with _ray_session(settings) as started_local:
        coordinator: CoordinatorHandle | None = None
        placement: WorkerPlacement | None = None
        workers: WorkerGroup | None = None
        agents: NodeAgents | None = None
        failed = True
        try:
            target = settings.coordinator
            # An external coordinator takes the operator's token ($LOSSREDUCE_TOKEN)
            # and --tls-ca; the embedded one a fresh token and CA of this run.
            token = ClientSettings().token if target is not None else None
            try:
                tls_ca = None if settings.tls_ca is None else read_ca(settings.tls_ca)
            except UsageError as err:
                raise TrainingFailedError(str(err)) from err
            if settings.normalizer == "coordinator" and target is None:
                token = SecretStr(secrets.token_urlsafe(32))
                coordinator = start_coordinator_actor(job, settings.round_timeout_s, token)
                target, tls_ca = coordinator.target, coordinator.ca_cert
            if started_local:
                _check_capacity(settings)
            try:
                placement = create_worker_placement(
                    settings.workers, settings.placement, STARTUP_TIMEOUT_S
                )
            except TimeoutError as err:
                raise TrainingFailedError(f"--placement {settings.placement}: {err}") from err
            _check_reachable_from_every_node(settings, placement)
            targets: list[str | None] = [target] * settings.workers
            cas = [tls_ca] * settings.workers
            if target is not None and aggregates(settings, placement):
                # Agents connect upstream at start: the coordinator serves first.
                _wait_ready(coordinator)
                agents = _start_agents(
                    settings, job, placement, upstream=target, token=token, tls_ca=tls_ca
                )
                # Ranks reach their node's agent over loopback: plaintext, same token.
                targets = [agents.target_of(rank) for rank in range(settings.workers)]
                cas = [None] * settings.workers
            if trl_policy is not None:
                from lossreduce.trainer_worker.train.trl_job import run_trl

                _wait_ready(coordinator)
                result = run_trl(
                    settings,
                    job,
                    out_dir,
                    trl_policy,
                    placement,
                    targets=targets,
                    token=token,
                    tls_ca=cas,
                    console=console,
                    observers=observers,
                )
                failed = False
                return result
            workers = WorkerGroup.start(
                settings, job, placement, targets=targets, token=token, tls_ca=cas
            )
            if agents is not None:
                workers.failure_notes = agents.dead
            _wait_ready(coordinator)
            console.print(
                _describe_run(settings, job, placement, target=target, tls_ca=tls_ca, agents=agents)
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
            try:
                if workers is not None:
                    workers.shutdown(graceful=not failed)
            finally:
                try:
                    if agents is not None:
                        agents.stop()
                    if placement is not None:
                        placement.remove()
                finally:
                    if coordinator is not None:
                        coordinator.stop()
