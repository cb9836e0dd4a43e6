"""Microbatch splitting keeps prompt groups whole and balances tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossreduce.errors import ReductionConfigError, ReductionInputError
from lossreduce.trainer_worker import MicrobatchSettings, MicrobatchSplitter, split_microbatches
from tests.trainer_worker.toy import build_batch, make_groups


def _response_ids(mb: dict[str, torch.Tensor]) -> list[int]:
    return [int(v) for v in mb["response_id"].tolist()]


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=8),
    seed=st.integers(0, 2**31),
    packed=st.booleans(),
    n=st.integers(1, 5),
)
def test_groups_stay_whole_and_every_token_is_kept(
    sizes: list[int], seed: int, packed: bool, n: int
) -> None:
    groups = make_groups(seed, sizes)
    batch = build_batch(groups, packed=packed)
    batch["response_id"] = torch.arange(sum(sizes))
    batch["temperature"] = torch.tensor(0.7)
    mbs = split_microbatches(batch, MicrobatchSettings(n_microbatches=n))
    assert len(mbs) == min(n, len(sizes))
    starts = [sum(sizes[:g]) for g in range(len(sizes))]
    seen: list[int] = []
    for mb in mbs:
        ids = _response_ids(mb)
        seen += ids
        # Whole groups, in their original order, with their sizes.
        rebuilt = []
        for size in mb["group_sizes"].tolist():
            rebuilt.append(ids[: int(size)])
            ids = ids[int(size) :]
        for group in rebuilt:
            g = starts.index(group[0])
            assert group == list(range(starts[g], starts[g] + sizes[g]))
        assert mb["temperature"] is batch["temperature"]
        if packed:
            lengths = mb["cu_seqlens"].diff().tolist()
            assert mb["loss_mask"].shape[0] == sum(lengths) == mb["x"].shape[0]
            seq_start = 0
            for rid, length in zip(_response_ids(mb), lengths, strict=True):
                want = groups_flat(groups)[rid]
                torch.testing.assert_close(
                    mb["advantages"][seq_start : seq_start + length], want.adv, equal_nan=True
                )
                seq_start += length
    assert sorted(seen) == list(range(sum(sizes)))


def groups_flat(groups):
    return [s for g in groups for s in g]


def test_tokens_are_balanced_largest_first() -> None:
    # Packed groups of 8, 5, 4, 3 tokens into 2 microbatches: {8} + {5, 4, 3}? LPT: 8 | 5 -> 8 | 5+4
    # -> 8+3 | 9 -> loads 11 and 9.
    lengths = [8, 5, 4, 3]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    batch = {
        "loss_mask": torch.ones(sum(lengths)),
        "cu_seqlens": cu,
        "response_id": torch.arange(4),
    }
    mbs = MicrobatchSplitter(MicrobatchSettings(n_microbatches=2))(batch)
    assert [_response_ids(mb) for mb in mbs] == [[0, 3], [1, 2]]
    assert [int(mb["cu_seqlens"][-1]) for mb in mbs] == [11, 9]


def test_max_tokens_packs_first_fit_decreasing() -> None:
    attention = torch.tensor(
        [[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]]
    )
    batch = {
        "loss_mask": attention,
        "attention_mask": attention,
        "group_sizes": torch.tensor([2, 1, 1]),
    }
    # Group tokens: 6, 6, 2; at most 8 per microbatch.
    mbs = split_microbatches(batch, MicrobatchSettings(max_tokens=8))
    assert [mb["group_sizes"].tolist() for mb in mbs] == [[2, 1], [1]]
    assert [int(mb["attention_mask"].sum()) for mb in mbs] == [8, 6]
    # A group larger than the budget still travels whole, alone.
    alone = split_microbatches(batch, MicrobatchSettings(max_tokens=3))
    assert [mb["group_sizes"].tolist() for mb in alone] == [[2], [1], [1]]


def test_settings_need_exactly_one_limit() -> None:
    with pytest.raises(
        ReductionConfigError,
        match=r"^MicrobatchSettings\(n_microbatches=None, max_tokens=None\): set exactly one of",
    ):
        MicrobatchSettings()
    with pytest.raises(ReductionConfigError, match="set exactly one of n_microbatches"):
        MicrobatchSettings(n_microbatches=2, max_tokens=10)
    with pytest.raises(
        ReductionConfigError,
        match=r"\(n_microbatches=0, max_tokens=None\): n_microbatches: Input should be greater than 0$",
    ) as info:
        MicrobatchSettings(n_microbatches=0)
    assert isinstance(info.value, ValueError)
    assert MicrobatchSettings.model_validate({"max_tokens": 8}) == MicrobatchSettings(max_tokens=8)
    for field in MicrobatchSettings.model_fields.values():
        assert field.description


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"mask": torch.ones(2, 3)}, r"needs 'loss_mask' to be split; it holds \['mask'\]"),
        (
            {"loss_mask": torch.ones(2, 3), "group_sizes": torch.tensor([3])},
            r"group_sizes=\[3\] sum to 3 but the batch holds 2 sequences",
        ),
        (
            {"loss_mask": torch.ones(2, 3), "extra": torch.ones(5)},
            r"batch\['extra'\] has leading size 5; expected 2 \(responses\)$",
        ),
        (
            {
                "loss_mask": torch.ones(5),
                "cu_seqlens": torch.tensor([0, 2, 5]),
                "extra": torch.ones(3),
            },
            r"batch\['extra'\] has leading size 3; expected 2 \(responses\) or 5 \(packed tokens\)",
        ),
        (
            {"loss_mask": torch.ones(2, 3), "group_sizes": torch.tensor([0.5, 1.5])},
            r"group_sizes=\[0.5, 1.5\] must all be whole numbers >= 1",
        ),
        (
            {"loss_mask": torch.ones(5), "cu_seqlens": torch.tensor([0, 3, 2, 5])},
            r"cu_seqlens=\[0, 3, 2, 5\] must start at 0, never decrease",
        ),
        (
            {"loss_mask": torch.ones(5), "cu_seqlens": torch.tensor([0, 2, 4])},
            r"cu_seqlens=\[0, 2, 4\] must .* end at the number of packed tokens \(5\)",
        ),
        (
            {
                "loss_mask": torch.ones(2),
                "cu_seqlens": torch.tensor([0, 0, 2]),
                "extra": torch.ones(2),
            },
            r"batch\['extra'\] has leading size 2, which is both the number of responses and of packed tokens",
        ),
    ],
)
def test_bad_batches_are_rejected(batch: dict[str, torch.Tensor], message: str) -> None:
    with pytest.raises(ReductionInputError, match=message):
        split_microbatches(batch, MicrobatchSettings(n_microbatches=2))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_batch_without_responses_gives_no_microbatch(packed: bool) -> None:
    assert (
        split_microbatches(build_batch([], packed=packed), MicrobatchSettings(n_microbatches=2))
        == []
    )
