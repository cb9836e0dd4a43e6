"""The contract's columns as tests (:mod:`tests.contract.table`): a lane's
``test_contract.py`` imports them and provides the ``contract`` fixture (its row)."""

from __future__ import annotations

import pytest
import torch

from tests.contract.table import Case, ContractAdapter, RankOutcome

__all__ = [
    "test_a_nan_at_an_active_token_is_refused_on_every_rank_before_backward",
    "test_a_nan_under_the_mask_does_no_harm",
    "test_a_rank_without_tokens_takes_part_in_the_round",
    "test_an_empty_step_is_raised_on_every_rank",
    "test_an_empty_step_is_skipped_on_every_rank",
    "test_the_coordinator_gives_torch_distributeds_answer_bit_for_bit",
]


def same_update(got: RankOutcome, want: RankOutcome) -> bool:
    return got.update.keys() == want.update.keys() and all(
        torch.equal(got.update[name], delta) for name, delta in want.update.items()
    )


def no_error(outcomes: list[RankOutcome], what: str) -> None:
    for rank, outcome in enumerate(outcomes):
        assert outcome.error is None, f"{what} rank {rank}: {outcome.error}: {outcome.message}"


@pytest.mark.parametrize("world", [1, 2])
def test_an_empty_step_is_raised_on_every_rank(contract: ContractAdapter, world: int) -> None:
    outcomes = contract.outcomes(Case.EMPTY_RAISE, world)
    assert len(outcomes) == world
    for rank, outcome in enumerate(outcomes):
        assert outcome.error == "EmptyNormalizerError", (rank, outcome.error, outcome.message)
        assert not outcome.moved(), f"rank {rank} moved its weights on an empty step"


@pytest.mark.parametrize("world", [1, 2])
def test_an_empty_step_is_skipped_on_every_rank(contract: ContractAdapter, world: int) -> None:
    outcomes = contract.outcomes(Case.EMPTY_SKIP, world)
    no_error(outcomes, "empty-skip")
    for rank, outcome in enumerate(outcomes):
        assert outcome.skipped_steps == 1, (rank, outcome.skipped_steps)
        assert not outcome.moved(), f"rank {rank} moved its weights on a skipped step"


def test_a_nan_at_an_active_token_is_refused_on_every_rank_before_backward(
    contract: ContractAdapter,
) -> None:
    *peers, culprit = contract.outcomes(Case.NAN_ACTIVE, 2)
    assert culprit.error == "InvalidPartialError", (culprit.error, culprit.message)
    assert "nan" in culprit.message.lower(), culprit.message
    assert culprit.blamed == (1,), culprit.blamed
    for peer in peers:
        assert peer.error == "RoundAbortedError", (peer.error, peer.message)
        assert 1 in peer.blamed, (peer.blamed, peer.message)
    for rank, outcome in enumerate([*peers, culprit]):
        assert not outcome.moved(), f"rank {rank} ran backward on a refused step"


@pytest.mark.parametrize("world", [1, 2])
def test_a_nan_under_the_mask_does_no_harm(contract: ContractAdapter, world: int) -> None:
    masked = contract.outcomes(Case.NAN_MASKED, world)
    clean = contract.outcomes(Case.CLEAN, world)
    no_error(masked, "nan-masked")
    no_error(clean, "clean")
    for rank, (got, want) in enumerate(zip(masked, clean, strict=True)):
        assert want.moved(), f"rank {rank}: the clean step did not train"
        assert same_update(got, want), f"rank {rank}: a NaN under the mask changed the update"
        assert got.normalizers == want.normalizers


def test_a_rank_without_tokens_takes_part_in_the_round(contract: ContractAdapter) -> None:
    outcomes = contract.outcomes(Case.RANK_WITHOUT_TOKENS, 2)
    no_error(outcomes, "rank-without-tokens")
    first = outcomes[0]
    assert first.normalizers, "no normalizers were reported"
    assert all(v > 0 for v in first.normalizers.values()), first.normalizers
    assert first.moved()
    assert first.finite()
    for rank, outcome in enumerate(outcomes[1:], start=1):
        assert outcome.normalizers == first.normalizers, (rank, outcome.normalizers)
        assert same_update(outcome, first), f"rank {rank}'s update differs from rank 0's"


def test_the_coordinator_gives_torch_distributeds_answer_bit_for_bit(
    contract: ContractAdapter,
) -> None:
    coordinator = contract.outcomes(Case.COORDINATOR, 2)
    torch_backend = contract.outcomes(Case.CLEAN, 2)
    no_error(coordinator, "coordinator")
    for rank, (got, want) in enumerate(zip(coordinator, torch_backend, strict=True)):
        assert got.normalizers == want.normalizers, rank
        assert same_update(got, want), f"rank {rank}: the coordinator's update differs"
