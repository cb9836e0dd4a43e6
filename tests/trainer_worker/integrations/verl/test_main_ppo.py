"""verl's own ``python -m verl.trainer.main_ppo`` with the lossreduce trainer mode, on CPU.

The launch of docs/frameworks/verl.md (:mod:`.main_ppo_launch`): 3 GRPO steps on 2
gloo ranks, 2 mini-batches (optimizer steps) a step, ``prompt_mean`` through the
job's own coordinator actor, which the first rank starts inside verl's Ray job
(no address given). Everything is verl's own but generation (lossreduce's CPU
rollout, seeded per request).

The A/B pair: stock ``main_ppo`` (``loss_agg_mode=token-mean``, the default trainer
mode) and the lossreduce trainer mode with ``mode=token_mean``, 2 steps each on the
same seed. Step 2 samples from the weights after step 1, so equal step-2 metrics
would say the first update was the same too; they are not yet (the xfail's reason).

Three launches, about 2.5 minutes each on 2 cores (most of it Ray and verl starting).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.trainer_worker.integrations.verl import main_ppo_launch
from tests.trainer_worker.integrations.verl.main_ppo_launch import (
    LOSSREDUCE,
    STEPS,
    Launch,
    run_main_ppo,
    write_inputs,
)

ROOT = Path(__file__).resolve().parents[4]
DOCS = ROOT / "docs" / "frameworks" / "verl.md"
MINI_BATCHES = 2  # data.train_batch_size / actor.ppo_mini_batch_size
AB_STEPS = 2
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


def _launch(folder: Path, args: list[str], steps: int = STEPS, mini_batch_size: int = 2) -> Launch:
    inputs = write_inputs(folder)
    settings = main_ppo_launch.overrides(inputs, steps=steps, mini_batch_size=mini_batch_size)
    run = run_main_ppo(folder, [*settings, *args])
    assert run.returncode == 0, run.output[-8000:]
    assert [s["step"] for s in run.steps] == list(range(1, steps + 1)), run.output[-4000:]
    return run


def _data(run: Launch, step: int) -> dict[str, Any]:
    return dict(run.steps[step - 1]["data"])


@pytest.fixture(scope="module")
def lossreduce_run(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    return _launch(tmp_path_factory.mktemp("lossreduce"), LOSSREDUCE)


@pytest.fixture(scope="module")
def ab_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Launch, Launch]:
    # One mini-batch a step: the agent loop hands verl's TransferQueue the responses in
    # the order they finish, so with two the split (and the second mini-batch's
    # update) differs from run to run; one update of the whole batch does not.
    stock = _launch(
        tmp_path_factory.mktemp("stock"),
        ["actor_rollout_ref.actor.loss_agg_mode=token-mean"],
        AB_STEPS,
        mini_batch_size=4,
    )
    ours = _launch(
        tmp_path_factory.mktemp("token-mean"),
        ["trainer.v1.trainer_mode=lossreduce", "+actor_rollout_ref.lossreduce.mode=token_mean"],
        AB_STEPS,
        mini_batch_size=4,
    )
    return stock, ours


def test_lossreduce_normalized_every_mini_batch(lossreduce_run: Launch) -> None:
    for step in range(1, STEPS + 1):
        data = _data(lossreduce_run, step)
        # One coordinator round per mini-batch, numbered on from the step before.
        first = (step - 1) * MINI_BATCHES
        assert data["actor/lossreduce/round_min"] == first
        assert data["actor/lossreduce/round_max"] == first + MINI_BATCHES - 1
        assert data["actor/lossreduce/skipped"] == 0.0
        # prompt_mean: the prompts with a response in the mini-batch (4 responses, 2
        # a prompt; verl's balancing may split a group over two mini-batches), averaged
        # over the step's two; the KL term's token count is positive too.
        assert 2.0 <= data["actor/lossreduce/normalizer/pg"] <= 4.0
        assert data["actor/lossreduce/normalizer/kl"] > 0.0
        assert data["actor/lossreduce/round_latency_s"] > 0.0


def test_the_run_trained(lossreduce_run: Launch) -> None:
    # Rewards varied within groups (else GRPO's advantages, and the update, are zero).
    assert any(_data(lossreduce_run, s)["actor/grad_norm"] > 0 for s in range(1, STEPS + 1))
    # After an update the policy differs from the reference, so the KL loss is not zero.
    assert _data(lossreduce_run, STEPS)["actor/kl_loss"] != 0.0


@pytest.mark.xfail(
    strict=True,
    reason="not yet the same: with one mini-batch a step the rollouts (scores, lengths) and "
    "step 2's pg_loss (-0.0471403) match, but step 1's grad_norm is 0.635177 stock vs 0.635135 "
    "lossreduce (6.5e-5 relative; two runs of either differ about as much) and step 2's "
    "kl_loss 0.000523 vs 0.000911 in every run (stock's looks bfloat16-rounded); not yet explained",
)
def test_stock_and_lossreduce_token_mean_give_the_same_first_update(
    ab_runs: tuple[Launch, Launch],
) -> None:
    stock, ours = ab_runs
    assert _data(stock, 1)["actor/grad_norm"] > 0, "the first step did not move the weights"
    assert not any(k.startswith("actor/lossreduce/") for k in _data(stock, 1))
    assert "actor/lossreduce/normalizer/pg" in _data(ours, 1)
    for step in range(1, AB_STEPS + 1):
        theirs, mine = _data(stock, step), _data(ours, step)
        for key in COMPARED:
            # abs_tol: step 1's pg_loss is zero but for rounding (ratio 1, advantages
            # summing to zero over responses of one length).
            assert math.isclose(mine[key], theirs[key], rel_tol=1e-6, abs_tol=1e-6), (
                step,
                key,
                mine[key],
                theirs[key],
            )


def test_the_docs_show_the_launch_the_test_runs() -> None:
    assert f"```bash\n{main_ppo_launch.documented_command()}```" in DOCS.read_text()
