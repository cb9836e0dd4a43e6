"""What ``clip_cov``'s draw is keyed by: the seed (job, verl's ``data_loader_seed``, the
round) and each row's identity from its tokens, pure torch, no worker.

The row identity is checked against :func:`policy_references.row_identity`, the same
formula written on Python integers: the same sequence gets the same identity whatever
the other rows, their order or the padding, so the draw does not depend on the order in
which verl's rollout returned the rows.
"""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossreduce.trainer_worker.integrations.verl.statistics import clip_cov_seed, row_identities
from tests.trainer_worker.integrations.verl.policy_references import row_identity

VOCAB = 2**31  # token ids as large as real vocabularies get, and then some

sequences = st.lists(
    st.lists(st.integers(0, VOCAB), min_size=1, max_size=12), min_size=1, max_size=6
)


def packed(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` one after another, and where each starts (a nested tensor's values and
    offsets)."""
    tokens = torch.tensor([x for row in rows for x in row], dtype=torch.int64)
    lengths = torch.tensor([len(row) for row in rows])
    return tokens, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])


@settings(max_examples=60, deadline=None)
@given(sequences, st.randoms(use_true_random=False))
def test_a_rows_identity_is_its_tokens_formula_whatever_the_other_rows_and_their_order(
    rows: list[list[int]], rng: random.Random
) -> None:
    got = row_identities(*packed(rows)).tolist()
    assert got == [row_identity(row) for row in rows]
    order = list(range(len(rows)))
    rng.shuffle(order)
    shuffled = row_identities(*packed([rows[i] for i in order])).tolist()
    assert shuffled == [got[i] for i in order]


def test_equal_sequences_share_an_identity_and_any_change_moves_it() -> None:
    base = [5, 9, 2, 7]
    ids = row_identities(*packed([base, base, [5, 9, 2, 8], [9, 5, 2, 7], base[:3], [*base, 0]]))
    assert ids[0] == ids[1]
    # One token, the order of two, one token fewer or more: another identity.
    assert len(set(ids[1:].tolist())) == 5


def test_the_seed_keeps_what_a_rerun_keeps_and_moves_with_the_rest() -> None:
    seed = clip_cov_seed("verl-ppo", 42, 3)
    assert seed == clip_cov_seed("verl-ppo", 42, 3)
    others = {
        clip_cov_seed("verl-ppo-3f9c2a7e", 42, 3),  # a run-qualified job is another job
        clip_cov_seed("verl-ppo", 7, 3),
        clip_cov_seed("verl-ppo", None, 3),
        clip_cov_seed("verl-ppo", 42, 4),
    }
    assert seed not in others
    assert len(others) == 4
