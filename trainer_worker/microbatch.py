"""Split a rank's batch into microbatches that keep prompt groups whole.

A prompt group is never split (``prompt_mean`` divides by its whole
denominator), so the unit of splitting is the group: ``group_sizes`` lists the
responses per prompt, or every response is its own group when there is none.
Groups are assigned largest first to the least loaded microbatch (by tokens),
then each microbatch keeps the groups in their original order.

Layouts: padded batches hold ``[B, ...]`` tensors (one row per response);
packed batches hold ``cu_seqlens`` ``[B + 1]`` and per-token ``[total_tokens, ...]``
tensors, plus optional per-response ``[B, ...]`` ones. A response's token
count is its packed length, or the row sum of ``attention_mask`` when a
padded batch has one (otherwise every padded row counts the full width ``T``).
"""

from __future__ import annotations

import itertools

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import ErrorDetails
from torch import Tensor
from typing_extensions import Self

from lossreduce.errors import ReductionConfigError, ReductionInputError
from lossreduce.trainer_worker.policy_gradient import checked_group_sizes, packed_lengths
from lossreduce.trainer_worker.reduction import Batch

__all__ = ["MicrobatchSettings", "MicrobatchSplitter", "split_microbatches"]

_MASK_KEYS = ("loss_mask", "denominator_mask")


class MicrobatchSettings(BaseModel):
    """How a rank's batch is cut into microbatches (set exactly one field).

    Constructing it with bad values raises
    :class:`~lossreduce.errors.ReductionConfigError` (a ``ValueError``) naming
    every field and value at fault, like every other failure of the library.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_microbatches: int | None = Field(
        default=None,
        gt=0,
        description="Split into this many token-balanced microbatches (fewer when there are "
        "fewer prompt groups).",
    )
    max_tokens: int | None = Field(
        default=None,
        gt=0,
        description="Pack prompt groups into as few microbatches of at most this many tokens as "
        "first-fit-decreasing finds; a group larger than this gets a microbatch of its own.",
    )

    def __init__(self, *, n_microbatches: int | None = None, max_tokens: int | None = None) -> None:
        try:
            super().__init__(n_microbatches=n_microbatches, max_tokens=max_tokens)
        except ValidationError as err:
            problems = "; ".join(_describe_problem(e) for e in err.errors())
            raise ReductionConfigError(
                f"MicrobatchSettings(n_microbatches={n_microbatches!r}, "
                f"max_tokens={max_tokens!r}): {problems}"
            ) from None

    @model_validator(mode="after")
    def _exactly_one(self) -> Self:
        if (self.n_microbatches is None) == (self.max_tokens is None):
            # pydantic wants a ValueError here; __init__ turns it into ReductionConfigError.
            raise ValueError(
                f"set exactly one of n_microbatches ({self.n_microbatches}) and max_tokens "
                f"({self.max_tokens})"
            )
        return self


def _describe_problem(error: ErrorDetails) -> str:
    # pydantic prefixes a validator's own ValueError with "Value error, ".
    message = error["msg"].removeprefix("Value error, ")
    field = ".".join(str(part) for part in error["loc"])
    return f"{field}: {message}" if field else message


class MicrobatchSplitter:
    """A callable ``batch -> microbatches`` holding its settings (the engine's splitter)."""

    def __init__(self, settings: MicrobatchSettings) -> None:
        self.settings = settings

    def __repr__(self) -> str:
        return f"MicrobatchSplitter({self.settings!r})"

    def __call__(self, batch: Batch) -> list[dict[str, Tensor]]:
        return split_microbatches(batch, self.settings)


def _sizes(batch: Batch) -> tuple[int, list[int], Tensor | None]:
    """(number of responses, tokens per response, cu_seqlens or None)."""
    if "loss_mask" not in batch:
        raise ReductionInputError(
            f"a batch needs 'loss_mask' to be split; it holds {sorted(batch)}"
        )
    cu = batch.get("cu_seqlens")
    if cu is not None:
        lengths = packed_lengths(cu, batch["loss_mask"].shape[0])
        return len(lengths), lengths, cu
    n = batch["loss_mask"].shape[0]
    if "attention_mask" in batch:
        return n, [int(v) for v in batch["attention_mask"].reshape(n, -1).sum(dim=1).tolist()], None
    width = batch["loss_mask"].shape[1] if batch["loss_mask"].dim() > 1 else 1
    return n, [width] * n, None


def _groups(batch: Batch, n_sequences: int) -> list[int]:
    sizes = batch.get("group_sizes")
    if sizes is None:
        return [1] * n_sequences
    return checked_group_sizes(sizes, n_sequences)


def _assign(weights: list[int], settings: MicrobatchSettings) -> list[list[int]]:
    """Group indices per microbatch, each sorted; empty microbatches dropped."""
    order = sorted(range(len(weights)), key=lambda g: (-weights[g], g))
    bins: list[list[int]] = []
    loads: list[int] = []
    if settings.n_microbatches is not None:
        count = min(settings.n_microbatches, len(weights))
        bins, loads = [[] for _ in range(count)], [0] * count
        for g in order:
            target = min(range(count), key=lambda b: (loads[b], b))
            bins[target].append(g)
            loads[target] += weights[g]
    else:
        assert settings.max_tokens is not None
        for g in order:
            fits = [b for b in range(len(bins)) if loads[b] + weights[g] <= settings.max_tokens]
            if fits:
                bins[fits[0]].append(g)
                loads[fits[0]] += weights[g]
            else:
                bins.append([g])
                loads.append(weights[g])
    chosen = [sorted(b) for b in bins if b]
    return sorted(chosen, key=lambda b: b[0])


def split_microbatches(batch: Batch, settings: MicrobatchSettings) -> list[dict[str, Tensor]]:
    """Cut ``batch`` into microbatches of whole prompt groups, balancing tokens.

    Every tensor is sliced by response (padded rows, or per-response tensors of
    a packed batch) or by token (packed per-token tensors, whose leading size
    is the number of packed tokens); ``cu_seqlens`` and ``group_sizes`` are
    rebuilt for each microbatch; 0-d tensors are shared.
    """
    n_seq, lengths, cu = _sizes(batch)
    group_sizes = _groups(batch, n_seq)
    starts = [sum(group_sizes[:g]) for g in range(len(group_sizes))]
    weights = [sum(lengths[s : s + n]) for s, n in zip(starts, group_sizes, strict=True)]
    total_tokens = sum(lengths)
    token_keys: set[str] = set()
    for key, value in batch.items():
        if key in ("cu_seqlens", "group_sizes") or value.dim() == 0:
            continue
        lead = value.shape[0]
        if cu is not None and key in _MASK_KEYS:
            token_keys.add(key)  # masks are per token by definition
        elif (
            cu is not None
            and lead == total_tokens
            and (lead != n_seq or all(n == 1 for n in lengths))
        ):
            token_keys.add(key)
        elif lead != n_seq:
            raise ReductionInputError(
                f"batch[{key!r}] has leading size {lead}; expected {n_seq} (responses)"
                + (f" or {total_tokens} (packed tokens)" if cu is not None else "")
            )
        elif cu is not None and lead == total_tokens:
            raise ReductionInputError(
                f"batch[{key!r}] has leading size {lead}, which is both the number of responses "
                f"and of packed tokens with lengths {lengths}; cannot tell how to split it"
            )

    offsets = list(itertools.accumulate(lengths, initial=0))  # [B + 1]
    microbatches: list[dict[str, Tensor]] = []
    for groups in _assign(weights, settings):
        seqs = [s for g in groups for s in range(starts[g], starts[g] + group_sizes[g])]
        seq_index = torch.tensor(seqs, dtype=torch.long)
        mb: dict[str, Tensor] = {}
        if cu is not None:
            token_index = torch.tensor(
                [t for s in seqs for t in range(offsets[s], offsets[s + 1])], dtype=torch.long
            )
            new_cu = [0]
            for s in seqs:
                new_cu.append(new_cu[-1] + lengths[s])
            mb["cu_seqlens"] = torch.tensor(new_cu, dtype=cu.dtype, device=cu.device)
        for key, value in batch.items():
            if key in ("cu_seqlens", "group_sizes"):
                continue
            if value.dim() == 0:
                mb[key] = value
            elif key in token_keys:
                mb[key] = value.index_select(0, token_index.to(value.device))
            else:
                mb[key] = value.index_select(0, seq_index.to(value.device))
        if "group_sizes" in batch:
            gs = batch["group_sizes"]
            mb["group_sizes"] = torch.tensor(
                [group_sizes[g] for g in groups], dtype=gs.dtype, device=gs.device
            )
        microbatches.append(mb)
    return microbatches
