"""The one interface every engine of ``lossreduce train`` implements.

An *engine* is what trains on the worker group: it starts one worker per
placement slot, runs optimizer steps on them and reports each step's
:class:`~lossreduce.trainer_worker.train.outputs.StepRecord`, replays a step in
one process for ``--verify``, and checks its own flags before Ray starts. The
driver owns everything around it — Ray, the coordinator actor, placement,
node agents, TLS, outputs and the progress bar — and never names an engine:
it looks the engine up in :mod:`~lossreduce.trainer_worker.train.engines.registry`
and drives it through :class:`Engine`.

Life of an engine in one run::

    spec.check_flags(settings)          # TrainSettings' validator: before anything starts
    spec.check_environment(settings)    # LOSSREDUCE_* its workers read: before Ray starts
    engine = spec.load()(settings, job, out_dir)   # before Ray: bad input costs nothing
    engine.start(cluster)               # the workers, in their placement bundles
    engine.describe()                   # the run's first line
    engine.train(observers)  or  engine.verify()
    engine.shutdown(graceful)           # always, also after a failure

Every wait on the workers is bounded, and a dead, failing or hung rank ends
the run with :class:`~lossreduce.trainer_worker.train.worker_group.TrainingFailedError`
naming it (engines gather through
:class:`~lossreduce.trainer_worker.train.worker_group.WorkerGroup`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pydantic import SecretStr

if TYPE_CHECKING:
    from lossreduce.trainer_worker.train.outputs import StepObserver
    from lossreduce.trainer_worker.train.placement import WorkerPlacement
    from lossreduce.trainer_worker.train.train_settings import TrainSettings
    from lossreduce.trainer_worker.train.verify import VerifyReport

__all__ = ["REDUCTION_GROUP", "Engine", "EngineFactory", "EngineSpec", "WorkerCluster"]

REDUCTION_GROUP = "policy"
"""Coordinator group of the policy's rounds, whatever the engine."""


@dataclass(frozen=True)
class WorkerCluster:
    """Where the engine's workers go and how each reaches its normalizers."""

    placement: WorkerPlacement
    """One bundle per rank, in rank order."""
    targets: Sequence[str | None]
    """``targets[rank]``: the coordinator or that rank's node agent (None with the torch
    normalizer)."""
    token: SecretStr | None
    """Bearer token every rank sends (None: send none)."""
    tls_ca: Sequence[bytes | None]
    """``tls_ca[rank]``: the CA its target's certificate chains to (None: plaintext)."""
    failure_notes: Callable[[], Sequence[str]] = field(default=tuple)
    """Asked when a phase fails, for more to report (the node agents that are gone)."""


class Engine(Protocol):
    """One run's engine, built before Ray starts (see the module's docstring)."""

    def start(self, cluster: WorkerCluster) -> None:
        """Start one worker per slot of ``cluster.placement`` and join them in one
        torch.distributed group."""
        ...

    def describe(self) -> str:
        """The run's first line: what trains where, and how the normalizers travel."""
        ...

    def train(self, observers: Sequence[StepObserver]) -> None:
        """Run ``--steps`` optimizer steps; each finished step's record goes to
        every observer (``on_rollout`` then ``on_step``), in step order."""
        ...

    def verify(self) -> VerifyReport:
        """Train one step on the workers and replay it in one process with all the
        data; compare the gradients."""
        ...

    def shutdown(self, graceful: bool) -> None:
        """End the workers (after closing their clients and process groups when
        ``graceful``); safe to call when :meth:`start` never ran or failed."""
        ...


EngineFactory = Callable[["TrainSettings", str, Path], Engine]
"""``factory(settings, job, out_dir)``: an engine for one run, or
:class:`~lossreduce.trainer_worker.train.worker_group.TrainingFailedError` naming
what is missing (a framework not installed, a checkpoint that does not load)."""


@dataclass(frozen=True)
class EngineSpec:
    """An engine as the registry lists it: pure, importable without its framework."""

    name: str
    """The value of ``--engine``."""
    summary: str
    """One line for ``--engine``'s help."""
    check_flags: Callable[[TrainSettings], None]
    """Raise ValueError naming the first flag this engine cannot honour; pure."""
    load: Callable[[], EngineFactory]
    """Import the engine (and its framework) and return its factory."""
    check_environment: Callable[[TrainSettings], None] = field(
        default=lambda settings: None  # most engines' workers read no LOSSREDUCE_* variable
    )
    """Raise :class:`~lossreduce.errors.ReductionConfigError` naming each bad
    ``LOSSREDUCE_*`` variable its workers would read (for what no flag sets); no Ray,
    no framework."""
