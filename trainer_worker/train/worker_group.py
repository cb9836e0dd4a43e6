"""The trainer workers as one group: startup, bounded waits, failure reports.

Every wait on the workers is bounded. When a worker dies or raises, the others
get up to the round timeout (plus :data:`FAILURE_GRACE_S`) to report their own
error — with the coordinator they receive ``RoundTimeoutError`` naming the
missing rank instead of hanging — then :class:`TrainingFailedError` names the
dead rank, its node, and what every other rank saw.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from lossreduce.trainer_worker.train.placement import BundleSlot, WorkerPlacement, describe_slot
from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = [
    "FAILURE_GRACE_S",
    "TrainingFailedError",
    "WorkerGroup",
    "death_reason",
    "describe_failure",
    "place_rank",
    "short_error",
    "worker_name",
]

FAILURE_GRACE_S = 10.0
"""After a rank fails, how long beyond the round timeout its peers get to report."""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class TrainingFailedError(RuntimeError):
    """The run stopped: a rank died, raised, or hung. The message says which and where."""


def worker_name(job: str, rank: int) -> str:
    """The Ray actor name of a rank (``ray.get_actor`` finds it)."""
    return f"lossreduce-worker-{job}-{rank}"


def short_error(err: BaseException) -> str:
    """``Type: first line`` of an error (of its cause, for Ray's wrapped task errors)."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        err = cause
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(err).__name__}: {first[:400]}"


def death_reason(err: BaseException) -> str:
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
    notes: Sequence[str] = (),
) -> str:
    """One message naming every dead, failed and hung rank with its node, then ``notes``
    (e.g. which node agents are gone)."""
    where = f"step {step} ({what})" if step is not None else what
    parts = [
        f"rank {r} on {describe_slot(slots[r])} died ({reason})"
        for r, reason in sorted(dead.items())
    ]
    parts += [
        f"rank {r} on {describe_slot(slots[r])} failed: {msg}" for r, msg in sorted(errors.items())
    ]
    # Hung ranks by node: a lost node shows up as all of its ranks at once.
    by_node: dict[str, list[int]] = {}
    for rank in hung:
        by_node.setdefault(describe_slot(slots[rank]), []).append(rank)
    parts += [f"ranks {ranks} on {node} did not answer in time" for node, ranks in by_node.items()]
    parts += notes
    return f"{where} failed: " + "; ".join(parts)


def place_rank(actor_cls: Any, config: Any, job: str, rank: int, placement: WorkerPlacement) -> Any:
    """Start ``actor_cls(config)`` as ``rank``: named, never restarted, in its bundle."""
    return actor_cls.options(
        name=worker_name(job, rank),
        max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=placement.group,
            placement_group_bundle_index=placement.slots[rank].bundle_index,
        ),
        **placement.actor_resources(),
    ).remote(config)


class WorkerGroup:
    """The rank-ordered actor handles and bounded waits on them."""

    def __init__(
        self, handles: Sequence[Any], placement: WorkerPlacement, settings: TrainSettings
    ) -> None:
        self.handles = list(handles)
        self.slots = placement.slots
        self.settings = settings
        self.failure_notes: Callable[[], Sequence[str]] = tuple
        """Asked when a phase fails, for more to report (the node agents that are gone)."""

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
                    dead[rank] = death_reason(err)
                except Exception as err:  # a rank's own error, reported with its rank
                    errors[rank] = short_error(err)
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
                    notes=self.failure_notes(),
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
