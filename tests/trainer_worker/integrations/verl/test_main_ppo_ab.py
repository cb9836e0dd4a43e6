"""A/B on one seed: stock ``main_ppo`` (``loss_agg_mode=token-mean``, the default
trainer mode) against the lossreduce trainer mode with ``mode=token_mean``.

The trainer mode must change nothing but who computes the normalization, so the
two give the same updates: 2 steps each, one mini-batch a step (with two, the
split follows the order in which the agent loop's responses finish, which varies
from run to run), the rollout seeded per request. Step 2 samples from the weights
after step 1, so equal step-2 metrics say the first update was the same too.

Both run in float32. verl's FSDP engine computes in bfloat16 under autocast when
``fsdp_config.mixed_precision`` is unset, whatever ``model_dtype`` says; the two
equivalent ways of scaling the loss (verl's, and lossreduce's ``n_b / N``) then
round differently in every bfloat16 matmul of the backward, and bfloat16 runs on
CPU differ run to run by about as much (6.5e-5 in the gradient norm, either side).
In float32 they agree to 1e-7 (the gradient norms were identical where measured).

Two launches, 1 to 2 minutes each on 2 cores.
"""

from __future__ import annotations

import math

import pytest

from tests.trainer_worker.integrations.verl.main_ppo_launch import (
    COMPUTE_IN_FLOAT32,
    ONE_MINI_BATCH,
    TOKEN_MEAN,
    Launch,
    launched,
    step_data,
)

STEPS = 2
# What the first update decides, read from verl's file logger.
COMPARED = [
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/grad_norm",
    "actor/entropy",
    "critic/score/mean",
    "response_length/mean",
]

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def ab_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Launch, Launch]:
    stock = launched(
        tmp_path_factory.mktemp("stock"),
        [*COMPUTE_IN_FLOAT32, "actor_rollout_ref.actor.loss_agg_mode=token-mean"],
        STEPS,
        mini_batch_size=ONE_MINI_BATCH,
    )
    # The trainer mode in token_mean with the torch normalizer.
    ours = launched(
        tmp_path_factory.mktemp("token-mean"),
        [*COMPUTE_IN_FLOAT32, *TOKEN_MEAN],
        STEPS,
        mini_batch_size=ONE_MINI_BATCH,
    )
    return stock, ours


def test_stock_and_lossreduce_token_mean_give_the_same_first_update(
    ab_runs: tuple[Launch, Launch],
) -> None:
    stock, ours = ab_runs
    assert step_data(stock, 1)["actor/grad_norm"] > 0, "the first step did not move the weights"
    assert not any(k.startswith("actor/lossreduce/") for k in step_data(stock, 1))
    assert "actor/lossreduce/normalizer/pg" in step_data(ours, 1)
    for step in range(1, STEPS + 1):
        theirs, mine = step_data(stock, step), step_data(ours, step)
        for key in COMPARED:
            # abs_tol: step 1's pg_loss is zero but for rounding (ratio 1, advantages
            # summing to zero over responses of one length).
            assert math.isclose(mine[key], theirs[key], rel_tol=1e-6, abs_tol=1e-6), (
                step,
                key,
                mine[key],
                theirs[key],
            )
