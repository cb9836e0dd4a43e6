"""verl's own ``python -m verl.trainer.main_ppo`` with ``model_engine=megatron`` and the
lossreduce trainer mode, on CPU.

The FSDP launch of docs/frameworks/verl.md with the actor's and the reference policy's
engine switched to verl's Megatron engine (:func:`engine_overrides`: ``model_engine=megatron``,
packed rows, ``vanilla_mbridge=True``; bfloat16 parameters, verl's Megatron default) and
the Megatron stand-ins loaded in every process: 3 GRPO steps on 2 gloo ranks, 2
mini-batches a step, ``prompt_mean`` through the job's own coordinator actor. Everything
is verl's own but generation (lossreduce's CPU rollout, which takes the Megatron actor's
weights through mbridge's export after every update).

One launch, about 3 to 4.5 minutes on 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lossreduce.trainer_worker.cpu_standins.verl.launch import (
    LOSSREDUCE,
    STEPS,
    Launch,
    engine_overrides,
    launch_env,
    overrides,
    run_main_ppo,
    write_inputs,
)

ROOT = Path(__file__).resolve().parents[5]
DOCS = ROOT / "docs" / "frameworks" / "verl.md"
MINI_BATCHES = 2  # data.train_batch_size / actor.ppo_mini_batch_size

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    folder = tmp_path_factory.mktemp("megatron")
    settings = overrides(write_inputs(folder), strategy="megatron")
    run = run_main_ppo(folder, [*settings, *LOSSREDUCE], timeout=840, megatron=True)
    assert run.returncode == 0, run.output[-8000:]
    assert run.logged == list(range(1, STEPS + 1)), run.output[-4000:]
    return run


def test_every_mini_batch_of_every_step_took_a_round(megatron_run: Launch) -> None:
    for step in range(1, STEPS + 1):
        data = dict(megatron_run.steps[step - 1]["data"])
        first = (step - 1) * MINI_BATCHES
        assert data["actor/lossreduce/round_min"] == first
        assert data["actor/lossreduce/round_max"] == first + MINI_BATCHES - 1
        assert data["actor/lossreduce/skipped"] == 0.0
        assert 2.0 <= data["actor/lossreduce/normalizer/pg"] <= 4.0
        assert data["actor/lossreduce/normalizer/kl"] > 0.0


def test_the_megatron_actor_trained_and_the_rollout_took_its_weights(megatron_run: Launch) -> None:
    steps = [dict(s["data"]) for s in megatron_run.steps]
    assert any(s["actor/grad_norm"] > 0 for s in steps)
    # The reference stays the initial policy: after an update the KL loss is not zero.
    assert steps[-1]["actor/kl_loss"] != 0.0
    assert "lossreduce: run" in megatron_run.output  # the ranks claimed their rounds


def test_the_docs_show_the_megatron_launch_the_test_runs() -> None:
    """The Megatron lines of the verl page are :func:`engine_overrides` and the
    environment this launch sets."""
    text = DOCS.read_text()
    for line in engine_overrides("megatron"):
        assert f"    {line} \\\n" in text, line
    modules = launch_env(megatron=True)["VERL_USE_EXTERNAL_MODULES"]
    assert f"VERL_USE_EXTERNAL_MODULES={modules}" in text
