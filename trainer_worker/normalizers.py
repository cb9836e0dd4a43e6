"""Global normalizer backends: one interface, three ways to sum the partials.

Every rank sends, per loss term, the sum of its microbatch normalizers (its
*partial*); the backend returns every term's global normalizer ``N`` (the sum
over ranks) or raises. All three backends judge the same way, with the rules of
:mod:`lossreduce.rules`, and raise the same :mod:`lossreduce.errors` types:

- :class:`InvalidPartialError` on the rank whose partial is NaN, infinite or
  negative (naming rank, term and value); its peers raise
  :class:`RoundAbortedError` naming that rank;
- :class:`ContractMismatchError` when ranks disagree on terms or contracts;
- :class:`EmptyNormalizerError` on every rank when a global normalizer is not
  finite and > 0 (naming job, step, terms and values).

A rank whose request is malformed (a bad term name, contracts that do not
name exactly its terms, a partial that is not one number) still takes part
in the round, so that its peers fail at once instead of waiting: it raises
:class:`InvalidPartialError` saying what was wrong, its peers a
:class:`ContractMismatchError` (torch.distributed) or a
:class:`RoundAbortedError` naming it (coordinator).

No rank ever returns normalizers while a peer raises: that is how distributed
jobs deadlock. Global sums are ``math.fsum`` over the partials in rank order,
so every backend gives bit-identical normalizers for the same data, and every
backend returns them in the caller's term order (the order of ``partials``).
``contracts`` is optional everywhere: ``None`` sends the empty contract for
every term.

Every backend has a blocking ``reduce`` and a non-blocking ``start``, which
returns a :class:`NormalizerHandle` while the round is in flight, so an engine
can run a forward pass meanwhile (``reduce`` is ``start(...).wait()``). A
handle's ``wait`` returns the same normalizers or raises the same error as
``reduce``, again on every call. Each step's partials are turned into floats
with one device-to-host copy for all terms (one device sync, not one per term).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

from lossreduce.errors import (
    ContractMismatchError,
    EmptyNormalizerError,
    InvalidPartialError,
    LossReduceError,
    RankContext,
    RoundAbortedError,
    UsageError,
    format_terms,
)
from lossreduce.rules import check_global_normalizer, check_partial, check_term_name, exact_sum
from lossreduce.trainer_worker.reduction import floats_of

__all__ = [
    "CoordinatorNormalizer",
    "GlobalNormalizer",
    "LocalNormalizer",
    "NormalizerHandle",
    "OnEmptyStep",
    "ReadyHandle",
    "SupportsReduce",
    "SupportsResult",
    "TorchDistributedNormalizer",
]

OnEmptyStep = Literal["raise", "skip"]
"""What an engine does when a global normalizer is empty; every rank receives the
same :class:`EmptyNormalizerError`, so the policy acts identically everywhere:
``raise`` re-raises it, ``skip`` runs no backward and no optimizer step and
reports the step as skipped."""


@runtime_checkable
class NormalizerHandle(Protocol):
    """A round in flight, as :meth:`GlobalNormalizer.start` returns it."""

    def done(self) -> bool:
        """True once :meth:`wait` would not block."""
        ...

    def wait(self) -> dict[str, Tensor]:
        """The round's normalizers, as ``reduce`` returns them, or its error
        (the same error again on every call)."""
        ...

    @property
    def latency_s(self) -> float | None:
        """Seconds from the start of the round to its answer (None until known).

        The answer's arrival where the backend reports it (a torch.distributed
        work future); otherwise the first :meth:`done` or :meth:`wait` that saw
        it, an upper bound."""
        ...


@runtime_checkable
class GlobalNormalizer(Protocol):
    """Sums per-term partials over all ranks of one step."""

    def start(
        self,
        step: int,
        partials: Mapping[str, Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> NormalizerHandle:
        """Start the round and return at once (a backend may block for a round
        trip it cannot defer; its docstring says so). Errors are raised by the
        handle's ``wait``."""
        ...

    def reduce(
        self,
        step: int,
        partials: Mapping[str, Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> dict[str, Tensor]:
        """Every term's global normalizer (float64 0-d, on the partials' device),
        in the order of ``partials``."""
        ...


def _problems(partials: Mapping[str, Tensor], contracts: Mapping[str, str] | None) -> list[str]:
    """Why this rank's request is malformed (empty when it is not)."""
    problems = [why for why in map(check_term_name, partials) if why is not None]
    if not partials:
        problems.append("no terms were sent")
    if contracts is not None and set(contracts) != set(partials):
        problems.append(f"contracts name {sorted(contracts)} but partials name {sorted(partials)}")
    shapes = {name: tuple(p.shape) for name, p in partials.items() if p.numel() != 1}
    if shapes:
        problems.append(f"a partial is one number, but got shapes {shapes}")
    return problems


def _malformed(
    rnd: RankContext, problems: Sequence[str], terms: Iterable[str]
) -> InvalidPartialError:
    return rnd.error(
        InvalidPartialError, f"malformed request: {'; '.join(problems)}", terms=sorted(terms)
    )


def _local_values(
    rnd: RankContext, partials: Mapping[str, Tensor], contracts: Mapping[str, str] | None
) -> tuple[list[str], list[float], list[str]]:
    """(term names sorted, their float partials, their contracts); a malformed request raises.

    Sorted, so ranks that list the same terms in another order exchange the same rows.
    """
    problems = _problems(partials, contracts)
    if problems:
        raise _malformed(rnd, problems, partials)
    terms = sorted(partials)
    values = floats_of([partials[t] for t in terms])
    return terms, values, [contracts[t] if contracts is not None else "" for t in terms]


def _invalid(
    terms: Sequence[str], values: Sequence[float]
) -> tuple[list[str], list[float], list[str]]:
    bad = [(t, v, check_partial(v)) for t, v in zip(terms, values, strict=True)]
    bad = [(t, v, p) for t, v, p in bad if p is not None]
    return [t for t, _, _ in bad], [v for _, v, _ in bad], [str(p) for _, _, p in bad]


def _raise_for_invalid(
    rnd: RankContext, rows: Sequence[Sequence[float]], terms: Sequence[str]
) -> None:
    """Raise on every rank if any rank's partial is invalid: the culprit gets
    InvalidPartialError, its peers RoundAbortedError naming it."""
    for culprit, row in enumerate(rows):
        bad_terms, bad_values, problems = _invalid(terms, row)
        if not bad_terms:
            continue
        described = f"{format_terms(bad_terms, bad_values)} ({', '.join(problems)})"
        if culprit == rnd.rank:
            raise rnd.error(
                InvalidPartialError,
                f"invalid local partial {described}; a partial must be finite and >= 0",
                terms=bad_terms,
                values=bad_values,
            )
        raise rnd.error(
            RoundAbortedError,
            f"round aborted because rank {culprit} sent an invalid partial {described}",
            terms=bad_terms,
            values=bad_values,
            ranks=[culprit],
        )


def _finish(
    rnd: RankContext,
    terms: Sequence[str],
    totals: Sequence[float],
    device: torch.device,
    order: Iterable[str],
) -> dict[str, Tensor]:
    """Check every global normalizer is finite and > 0; return them in ``order``."""
    bad = [
        (t, v) for t, v in zip(terms, totals, strict=True) if check_global_normalizer(v) is not None
    ]
    if bad:
        names, values = [t for t, _ in bad], [v for _, v in bad]
        raise rnd.error(
            EmptyNormalizerError,
            f"global normalizer {format_terms(names, values)} is not finite and > 0 (no active "
            "unit on any rank?); no rank runs backward for this step",
            terms=names,
            values=values,
        )
    total_of = dict(zip(terms, totals, strict=True))
    names = list(order)
    # One host-to-device copy for all terms: [terms] float64, split into 0-d views.
    stacked = torch.tensor([total_of[t] for t in names], dtype=torch.float64, device=device)
    return dict(zip(names, stacked.unbind(0), strict=True))


def _device(partials: Mapping[str, Tensor]) -> torch.device:
    return next(iter(partials.values())).device if partials else torch.device("cpu")


class _Round:
    """A handle's shared part: the answer or error once known, and when it came.

    Subclasses say whether the answer is there (``done``) and how to collect
    it (``_collect``, called by the first ``wait`` only).
    """

    def __init__(self, started: float | None = None) -> None:
        self._started = time.perf_counter() if started is None else started
        self._answered: float | None = None
        self._result: dict[str, Tensor] | None = None
        self._error: LossReduceError | None = None

    @property
    def latency_s(self) -> float | None:
        return None if self._answered is None else self._answered - self._started

    def _stamp(self) -> None:
        if self._answered is None:
            self._answered = time.perf_counter()

    def _collect(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def wait(self) -> dict[str, Tensor]:
        if self._result is None and self._error is None:
            try:
                self._result = self._collect()
            except LossReduceError as err:
                self._error = err
            finally:
                self._stamp()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return dict(self._result)


class ReadyHandle(_Round):
    """A round answered when it starts: ``answer`` runs at once, and ``wait``
    returns what it returned or raises what it raised.

    For one process, and for a backend with only a blocking reduce: its
    ``start`` may be ``ReadyHandle(lambda: self.reduce(step, partials, contracts))``.
    """

    def __init__(self, answer: Callable[[], dict[str, Tensor]]) -> None:
        super().__init__()
        self._answer = answer
        # A round's error is raised by wait(), like every backend's: keep it for then.
        with contextlib.suppress(LossReduceError):
            self.wait()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "answered"
        return f"ReadyHandle({state}, latency_s={self.latency_s})"

    def done(self) -> bool:
        return True

    def _collect(self) -> dict[str, Tensor]:
        return self._answer()


def _raising(error: LossReduceError) -> Callable[[], dict[str, Tensor]]:
    def answer() -> dict[str, Tensor]:
        raise error

    return answer


class _Backend:
    """What every backend shares: ``reduce`` is ``start(...).wait()``."""

    def start(
        self,
        step: int,
        partials: Mapping[str, Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> NormalizerHandle:
        raise NotImplementedError

    def reduce(
        self,
        step: int,
        partials: Mapping[str, Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> dict[str, Tensor]:
        return self.start(step, partials, contracts).wait()


class LocalNormalizer(_Backend):
    """One process: the global normalizer is the local partial, validated."""

    def __init__(self, *, job: str = "local", group: str = "default") -> None:
        self.job = job
        self.group = group

    def __repr__(self) -> str:
        return f"LocalNormalizer(job={self.job!r}, group={self.group!r})"

    def start(
        self,
        step: int,
        partials: Mapping[str, Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> NormalizerHandle:
        """Answered at once: there is no peer to wait for."""
        return ReadyHandle(lambda: self._answer(step, partials, contracts))

    def _answer(
        self, step: int, partials: Mapping[str, Tensor], contracts: Mapping[str, str] | None
    ) -> dict[str, Tensor]:
        rnd = RankContext(self.job, self.group, step, 0)
        terms, values, _ = _local_values(rnd, partials, contracts)
        _raise_for_invalid(rnd, [values], terms)
        return _finish(rnd, terms, [exact_sum([v]) for v in values], _device(partials), partials)


def _contract_digest(step: int, terms: Sequence[str], contracts: Sequence[str]) -> list[float]:
    """[step, n_terms, 48-bit digest of the (term, contract) pairs], exact in float64."""
    text = "\n".join(f"{t}\t{c}" for t, c in zip(terms, contracts, strict=True))
    (digest,) = struct.unpack(
        ">Q", b"\0\0" + hashlib.blake2b(text.encode(), digest_size=6).digest()
    )
    return [float(step), float(len(terms)), float(digest)]


class TorchDistributedNormalizer(_Backend):
    """torch.distributed: gather every rank's partials and sum them in rank order.

    Two small collectives per step over ``process_group`` (``None``: the
    default group): an ``all_gather`` of a fixed-size header (step, number of
    terms, digest of the term names and contracts), so ranks that disagree all
    raise :class:`ContractMismatchError` before any shape-dependent
    collective; then an ``all_gather`` of the ``[terms]`` float64 partials.
    :meth:`start` blocks for the first (the second is sized by it) and only
    starts the second (``async_op``); the handle's ``wait`` waits for it.

    Why gather rather than ``all_reduce``: every rank then sees every rank's
    partials, so (a) every rank validates the same rows and raises the same
    error (an invalid partial anywhere aborts the step everywhere; the
    culprit raises :class:`InvalidPartialError`, the peers
    :class:`RoundAbortedError`), and (b) the sum is ``math.fsum`` in rank order,
    bit-identical to the coordinator's; an ``all_reduce`` sums in an order
    the backend chooses. The tensors are ``[world, terms]`` float64: tiny.

    A rank whose request is malformed (bad term names, contracts that do not
    match its partials) raises :class:`InvalidPartialError` after sending a
    header no peer matches, so its peers raise :class:`ContractMismatchError`
    rather than wait.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        job: str = "torch",
        group: str = "default",
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError(
                f"TorchDistributedNormalizer for job {job!r} group {group!r} needs an "
                "initialized torch.distributed process group (call "
                "torch.distributed.init_process_group first)",
                job=job,
                group=group,
            )
        self.process_group = process_group
        self.job = job
        self.group = group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)

    def __repr__(self) -> str:
        return (
            f"TorchDistributedNormalizer(job={self.job!r}, group={self.group!r}, "
            f"rank={self.rank}, world_size={self.world_size})"
        )

    def _gather(self, row: list[float], device: torch.device) -> list[list[float]]:
        local = torch.tensor(row, dtype=torch.float64, device=device)
        rows = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(rows, local, group=self.process_group)
        # One device-to-host copy for the [world, len(row)] table.
        return [[float(v) for v in r] for r in torch.stack(rows).tolist()]

    def start(
        self,
        step: int,
        partials: Mapping[str, Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> NormalizerHandle:
        """Exchange the headers (blocking: the partials' collective is sized by
        them), then start the partials' ``all_gather`` without waiting for it."""
        started = time.perf_counter()
        rnd = RankContext(self.job, self.group, step, self.rank)
        device = _device(partials)
        try:
            terms, values, term_contracts = _local_values(rnd, partials, contracts)
            header = _contract_digest(step, terms, term_contracts)
        except InvalidPartialError as err:
            # Still take part in the header exchange (a header no peer can match)
            # so the peers abort instead of waiting for this rank forever.
            self._gather([float(step), -1.0, -1.0], device)
            return ReadyHandle(_raising(err))
        headers = self._gather(header, device)
        disagree = [r for r, h in enumerate(headers) if h != headers[0]]
        if disagree:
            return ReadyHandle(
                _raising(
                    rnd.error(
                        ContractMismatchError,
                        f"ranks disagree on the step, term names or contracts (rank 0 differs "
                        f"from ranks {disagree}); this rank sends "
                        f"{dict(zip(terms, term_contracts, strict=True))}",
                        terms=terms,
                        ranks=[0, *disagree],
                    )
                )
            )
        return _TorchRound(
            self, rnd, terms=terms, values=values, device=device, order=partials, started=started
        )


class _TorchRound(_Round):
    """The partials' ``all_gather`` in flight (an ``async_op`` work handle)."""

    def __init__(
        self,
        normalizer: TorchDistributedNormalizer,
        rnd: RankContext,
        *,
        terms: list[str],
        values: list[float],
        device: torch.device,
        order: Iterable[str],
        started: float,
    ) -> None:
        super().__init__(started)
        self._rnd = rnd
        self._terms = terms
        self._device = device
        self._order = list(order)
        local = torch.tensor(values, dtype=torch.float64, device=device)  # [terms]
        self._rows = [torch.empty_like(local) for _ in range(normalizer.world_size)]
        work = dist.all_gather(self._rows, local, group=normalizer.process_group, async_op=True)
        assert work is not None  # async_op=True always returns a work handle
        self._work = work
        # A backend without work futures: the answer is stamped when first seen.
        with contextlib.suppress(NotImplementedError, RuntimeError):
            work.get_future().add_done_callback(lambda _: self._stamp())

    def __repr__(self) -> str:
        return f"_TorchRound(step={self._rnd.step}, rank={self._rnd.rank}, done={self.done()})"

    def done(self) -> bool:
        if self._result is not None or self._error is not None:
            return True
        finished = bool(self._work.is_completed())
        if finished:
            self._stamp()
        return finished

    def _collect(self) -> dict[str, Tensor]:
        self._work.wait()
        rows = torch.stack(self._rows).tolist()  # [world, terms], one device sync
        _raise_for_invalid(self._rnd, rows, self._terms)
        totals = [exact_sum(row[i] for row in rows) for i in range(len(self._terms))]
        return _finish(self._rnd, self._terms, totals, self._device, self._order)


class SupportsResult(Protocol):
    """A coordinator round in flight (:class:`lossreduce.client.PendingReduction`)."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> dict[str, float]: ...


class SupportsReduce(Protocol):
    """What :class:`CoordinatorNormalizer` needs of the coordinator client
    (:class:`lossreduce.client.ReductionClient`): its identity and ``reduce_start``."""

    @property
    def job(self) -> str: ...

    @property
    def group(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def reduce_start(
        self,
        step: int,
        partials: Mapping[str, float],
        contracts: Mapping[str, str] | None = None,
    ) -> SupportsResult: ...


class _PendingRound(_Round):
    """A coordinator round in flight; ``collect`` turns the client's answer into
    the normalizers (or the error) once it is there."""

    def __init__(
        self,
        pending: SupportsResult,
        collect: Callable[[SupportsResult], dict[str, Tensor]],
        started: float,
    ) -> None:
        super().__init__(started)
        self._pending = pending
        self._collect_from = collect

    def __repr__(self) -> str:
        return f"_PendingRound({self._pending!r})"

    def done(self) -> bool:
        finished = self._pending.done()
        if finished:
            self._stamp()
        return finished

    def _collect(self) -> dict[str, Tensor]:
        return self._collect_from(self._pending)


class CoordinatorNormalizer(_Backend):
    """The reduction coordinator over gRPC, through a connected client.

    The coordinator applies the rules of :mod:`lossreduce.rules` to every
    rank's partials and answers every rank with the same normalizers or the
    same error type; the client raises it here, naming the client's job,
    group and rank. Partials are not pre-validated: an invalid one must reach
    the coordinator so that the peers learn of it (:class:`RoundAbortedError`)
    instead of timing out. A malformed request is sent too, with a NaN partial
    for every term it names, so the coordinator aborts the round for the
    peers; this rank then raises :class:`InvalidPartialError` saying what was
    malformed (chained to the coordinator's answer).

    ``start`` sends the partials with the client's ``reduce_start`` and
    returns without waiting for the answer.
    """

    def __init__(self, client: SupportsReduce) -> None:
        self.client = client

    def __repr__(self) -> str:
        return f"CoordinatorNormalizer({self.client!r})"

    def start(
        self,
        step: int,
        partials: Mapping[str, Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> NormalizerHandle:
        started = time.perf_counter()
        client = self.client
        rnd = RankContext(client.job, client.group, step, client.rank)
        problems = _problems(partials, contracts)
        if not problems:
            names = list(partials)
            values = dict(zip(names, floats_of([partials[t] for t in names]), strict=True))
            device = _device(partials)

            def answer(pending: SupportsResult) -> dict[str, Tensor]:
                got = pending.result()
                terms = sorted(got)
                if terms != sorted(partials):
                    raise rnd.error(
                        LossReduceError,
                        f"the coordinator answered terms {terms} for partials {sorted(partials)}",
                        terms=sorted(set(terms) ^ set(partials)),
                    )
                return _finish(rnd, terms, [got[t] for t in terms], device, names)

            return _PendingRound(client.reduce_start(step, values, contracts), answer, started)
        named = [*partials, *(t for t in contracts or {} if t not in partials)]
        local = _malformed(rnd, problems, named)
        poisoned = dict.fromkeys(named, math.nan)

        def malformed(pending: SupportsResult) -> dict[str, Tensor]:
            try:
                pending.result()
            except LossReduceError as answer:
                raise local from answer
            raise local

        sent = client.reduce_start(step, poisoned, {t: (contracts or {}).get(t, "") for t in named})
        return _PendingRound(sent, malformed, started)
