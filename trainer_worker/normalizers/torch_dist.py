"""torch.distributed: every rank's partials gathered and summed in rank order."""

from __future__ import annotations

import contextlib
import hashlib
import struct
import time
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lossreduce.errors import ContractMismatchError, InvalidPartialError, RankContext, UsageError
from lossreduce.rules import exact_sum
from lossreduce.trainer_worker.normalizers._checks import (
    device_of,
    finish,
    local_values,
    raise_for_invalid,
)
from lossreduce.trainer_worker.normalizers.base import (
    NormalizerHandle,
    ReadyHandle,
    _Backend,
    _raising,
    _Round,
)

__all__ = ["TorchDistributedNormalizer"]


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
        device = device_of(partials)
        try:
            terms, values, term_contracts = local_values(rnd, partials, contracts)
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
        raise_for_invalid(self._rnd, rows, self._terms)
        totals = [exact_sum(row[i] for row in rows) for i in range(len(self._terms))]
        return finish(self._rnd, self._terms, totals, self._device, self._order)
