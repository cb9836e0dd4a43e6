"""verl's own ``python -m verl.trainer.main_ppo`` with the lossreduce trainer mode, on CPU.

The launch of docs/frameworks/verl.md (:mod:`.main_ppo_launch`): 3 GRPO steps on 2
gloo ranks, 2 mini-batches (optimizer steps) a step, ``prompt_mean`` through the
job's own coordinator actor, which the first rank starts inside verl's Ray job
(no address given). Everything is verl's own but generation (lossreduce's CPU
rollout, seeded per request).

The A/B pair against stock ``main_ppo`` is ``test_main_ppo_ab.py``.

One launch, 1 to 2 minutes on 2 cores (most of it Ray and verl starting).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer_worker.integrations.verl import main_ppo_launch
from tests.trainer_worker.integrations.verl.main_ppo_launch import (
    LOSSREDUCE,
    STEPS,
    Launch,
    launched,
    step_data,
)

ROOT = Path(__file__).resolve().parents[4]
DOCS = ROOT / "docs" / "frameworks" / "verl.md"
MINI_BATCHES = 2  # data.train_batch_size / actor.ppo_mini_batch_size

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def lossreduce_run(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    return launched(tmp_path_factory.mktemp("lossreduce"), LOSSREDUCE)


def test_lossreduce_normalized_every_mini_batch(lossreduce_run: Launch) -> None:
    for step in range(1, STEPS + 1):
        data = step_data(lossreduce_run, step)
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
    assert any(step_data(lossreduce_run, s)["actor/grad_norm"] > 0 for s in range(1, STEPS + 1))
    # After an update the policy differs from the reference, so the KL loss is not zero.
    assert step_data(lossreduce_run, STEPS)["actor/kl_loss"] != 0.0


def test_the_docs_show_the_launch_the_test_runs() -> None:
    assert f"```bash\n{main_ppo_launch.documented_command()}```" in DOCS.read_text()
