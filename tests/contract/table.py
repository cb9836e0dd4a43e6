"""The contract every framework keeps, once, as a table: one row per framework adapter.

Every framework worker that lossreduce serves keeps the same promises, on 1 and 2 gloo
ranks, with the framework's own worker and the data of its own test harness:

- an empty step (every response masked on every rank) is raised on every rank, or with
  ``on_empty_step='skip'`` skipped on every rank, and no weight moves;
- a NaN at an active token of one rank is refused on every rank before backward: that
  rank names what was bad, its peers name that rank, and no weight moves;
- a NaN under the mask does no harm: the update is the clean run's, bit for bit;
- a rank without active tokens takes part in the round: every rank gets the same
  normalizers and the same update, and nobody raises;
- the coordinator backend gives the torch backend's normalizers and update bit for bit.

A row is a :class:`ContractAdapter`: it says how to run one :class:`Case` on 1 or 2 ranks
of its framework and reads each rank's :class:`RankOutcome`. Each framework's lane runs
its own row (``test_contract.py`` in its test folder imports :mod:`tests.contract.checks`
and provides the ``contract`` fixture); :data:`ROWS` lists every row, and the main suite
checks that every integration has one.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest
import torch

__all__ = ["ROOT", "ROWS", "Case", "ContractAdapter", "RankOutcome", "cached_runs", "outcome_of"]

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: spawned ranks import the harness modules (``tests.*``) from it."""

K = TypeVar("K", bound=Hashable)
RankResults = list[dict[str, Any]]


class Case(enum.Enum):
    """The mini-batches of the contract; the adapter builds each from its harness's data."""

    CLEAN = "clean"
    """A mini-batch with active tokens on every rank (torch backend)."""
    EMPTY_RAISE = "empty-raise"
    """Every response masked on every rank, ``on_empty_step='raise'``."""
    EMPTY_SKIP = "empty-skip"
    """Every response masked on every rank, ``on_empty_step='skip'``."""
    NAN_ACTIVE = "nan-active"
    """CLEAN with a NaN input (an advantage) at an active token of the last rank."""
    NAN_MASKED = "nan-masked"
    """CLEAN with a NaN input at a masked token of the last rank."""
    RANK_WITHOUT_TOKENS = "rank-without-tokens"
    """Every response of the last rank masked; the other ranks' are not."""
    COORDINATOR = "coordinator"
    """CLEAN through the coordinator backend."""


@dataclass
class RankOutcome:
    """What one rank of one case left: its error (if any), its parameters' update, the
    normalizers its last round gave, and how many steps it skipped as empty."""

    update: dict[str, torch.Tensor]
    normalizers: dict[str, float] | None = None
    skipped_steps: int = 0
    error: str | None = None
    """The exception's class name."""
    message: str = ""
    blamed: tuple[int, ...] = field(default_factory=tuple)
    """The ranks the error names as the cause (its own for an InvalidPartialError)."""

    def moved(self) -> bool:
        """Whether any parameter changed."""
        return any(bool(delta.any()) for delta in self.update.values())

    def finite(self) -> bool:
        return all(math.isfinite(float(delta.abs().sum())) for delta in self.update.values())


def outcome_of(result: Mapping[str, Any]) -> RankOutcome:
    """A rank's outcome from a harness result of the common shape (``update``,
    ``normalizers``, ``skipped_steps``, and ``error`` with ``type``, ``message``,
    ``rank``, ``ranks``): verl's ``measured_step`` and those built like it."""
    error = result.get("error")
    blamed: tuple[int, ...] = ()
    if error is not None:
        own = error.get("rank") if error["type"] == "InvalidPartialError" else None
        blamed = (own,) if own is not None else tuple(error.get("ranks") or ())
    return RankOutcome(
        update=dict(result["update"]),
        normalizers=result.get("normalizers"),
        skipped_steps=int(result.get("skipped_steps") or 0),
        error=None if error is None else error["type"],
        message="" if error is None else error["message"],
        blamed=blamed,
    )


def cached_runs(
    run: Callable[[K], RankResults],
    label: str,
    report: Callable[[K, RankResults], None] | None = None,
) -> Callable[[K], RankResults]:
    """key -> ``run(key)`` (every rank's results), each key run once with :data:`ROOT` on
    ``sys.path`` (spawned ranks import the run module by name); prints its time, refuses
    a crashed rank."""
    cache: dict[K, RankResults] = {}

    def get(key: K) -> RankResults:
        if key not in cache:
            with pytest.MonkeyPatch.context() as patch:
                patch.syspath_prepend(str(ROOT))
                started = time.perf_counter()
                cache[key] = run(key)
                print(f"{label} {key}: {time.perf_counter() - started:.1f} s")
                if report is not None:
                    report(key, cache[key])
            for rank, result in enumerate(cache[key]):
                assert "crash" not in result, f"{label} {key} rank {rank}: {result['crash']}"
        return cache[key]

    return get


class ContractAdapter(Protocol):
    """One framework's row: how its worker runs a :class:`Case`."""

    name: str
    """The row's name (``verl``, ``areal-megatron``, ...)."""

    def outcomes(self, case: Case, world: int) -> list[RankOutcome]:
        """Every rank's outcome of ``case`` on ``world`` gloo ranks (1 or 2), rank order."""
        ...


ROWS: dict[str, str] = {
    "verl": "tests/trainer_worker/integrations/verl/test_contract.py",
    "verl-megatron": "tests/trainer_worker/integrations/verl/megatron/test_contract.py",
    "areal": "tests/trainer_worker/integrations/areal/test_contract.py",
    "areal-megatron": "tests/trainer_worker/integrations/areal/megatron/test_contract.py",
    "skyrl": "tests/trainer_worker/integrations/skyrl/test_contract.py",
    "trl": "tests/trainer_worker/integrations/trl/test_contract.py",
}
"""Every row of the table: the framework (and engine) and the lane module that runs it."""
