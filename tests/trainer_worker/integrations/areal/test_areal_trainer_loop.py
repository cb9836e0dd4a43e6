"""``LossReducePPOTrainer`` runs AReaL 1.0.4's own trainer loop on CPU, with the FSDP
and the Archon engine.

``grpo_launch.py`` (the launch of docs/frameworks/areal.md) runs under
``torchrun`` on 2 gloo ranks in AReaL's SPMD mode for 3 steps: AReaL's
``RLVRWorkflow`` (GRPO, ``n_samples`` 2, a rule reward) generates through
``RemotevLLMEngine`` from ``rollout_server.py`` (why not vLLM: its docstring),
AReaL recomputes log-probabilities, computes group-normalized advantages,
runs the PPO update through the LossReduce actor, and sends the new weights to
the server from disk after every step. The same script with AReaL's own import
is the stock run of the A/B comparison (same seed, same server seed).

The A/B is one a wrong normalizer fails: plain SGD with gradient clipping off
(:data:`AB_OVERRIDES`), so the first update is ``-lr`` times the gradient
itself, compared with stock AReaL's to 1e-6 along with AReaL's logged grad norm;
and one sequence per micro-batch, because on CPU packed micro-batches make
stock AReaL differ from itself. Every round's normalizers are AReaL's own counts
of that step (``n_valid_tokens``, ``n_seqs``).

``actor.backend: archon:d2`` runs with Archon's two CPU settings
(``ARCHON_CPU_OVERRIDES``: sdpa attention, micro-batches padded to their token
budget). Two launches per engine (the stock one for one step), 1 to 4 minutes
each on 2 cores.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from lossreduce.server import CoordinatorSettings, CoordinatorThread
from lossreduce.trainer_worker.integrations.areal.actor import ROUNDS_PER_VERSION
from lossreduce.trainer_worker.integrations.areal.archon_cpu import ARCHON_CPU_OVERRIDES
from tests.conftest import TEST_SETTINGS
from tests.trainer_worker.integrations.areal import trainer_loop

STEPS = 3
BATCH = 4  # prompts per step (train_dataset.batch_size)
SAMPLES = 2  # gconfig.n_samples
JOB = "areal-loop"
DOCS = trainer_loop.ROOT / "docs" / "frameworks" / "areal.md"

AB_OVERRIDES = (
    "actor.optimizer.type=sgd",
    "actor.optimizer.lr=0.1",
    "actor.optimizer.gradient_clipping=1.0e9",  # never reached: clipping off
    # A prompt is 3 tokens and a response 1 to 4, so two sequences never fit in 7.
    "actor.mb_spec.max_tokens_per_mb=7",
)
ENGINES: dict[str, tuple[str, ...]] = {
    "fsdp": ("actor.backend=fsdp:d2",),
    "archon": ("actor.backend=archon:d2", *ARCHON_CPU_OVERRIDES),
}


@dataclass
class Launch:
    stdout: str
    server_log: dict[str, Any]
    weights: dict[int, dict[str, torch.Tensor]]  # version -> what the server received
    rounds: list[Any]  # the coordinator's rounds of the job (LossReduce only)

    def logged(self, key: str) -> list[float]:
        """Every value AReaL's stats table printed for ``key`` (one per step), as printed
        (``.4e``: 5 significant digits)."""
        pattern = rf"│ {re.escape(key)}\s+│\s*([0-9.e+-]+|nan|inf)"
        return [float(v) for v in re.findall(pattern, self.stdout)]


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("loop")
    return trainer_loop.save_policy(folder / "model"), trainer_loop.save_prompts(
        folder / "prompts.jsonl"
    )


def _launch(
    stock: bool,
    policy: tuple[Path, Path],
    work: Path,
    env: dict[str, str],
    overrides: tuple[str, ...] = (),
) -> tuple[str, dict[str, Any], dict[int, dict[str, torch.Tensor]]]:
    model, prompts = policy
    run = trainer_loop.launch(
        stock, work, model=model, prompts=prompts, env=env, overrides=overrides
    )
    assert run.done.returncode == 0, f"{run.done.stdout[-4000:]}\n{run.done.stderr[-6000:]}"
    return run.done.stdout, run.server_log, run.weights


@pytest.fixture(scope="module", params=sorted(ENGINES))
def engine(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def lossreduce_run(
    engine: str, policy: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Launch]:
    thread = CoordinatorThread(CoordinatorSettings.model_validate(TEST_SETTINGS)).start()
    try:
        env = {
            "LOSSREDUCE_MODE": "token_mean",
            "LOSSREDUCE_NORMALIZER": "coordinator",
            "LOSSREDUCE_COORDINATOR": thread.target,
            "LOSSREDUCE_JOB": JOB,
        }
        stdout, log, weights = _launch(
            False,
            policy,
            tmp_path_factory.mktemp(f"lossreduce-{engine}"),
            env,
            (*ENGINES[engine], *AB_OVERRIDES),
        )
        rounds = list(thread.coordinator.table.rounds(JOB))
        yield Launch(stdout, log, weights, rounds)
    finally:
        thread.stop()


@pytest.fixture(scope="module")
def stock_run(
    engine: str, policy: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Launch:
    # The comparison needs the first update only.
    stdout, log, weights = _launch(
        True,
        policy,
        tmp_path_factory.mktemp(f"stock-{engine}"),
        {},
        (*ENGINES[engine], *AB_OVERRIDES, "total_train_steps=1"),
    )
    return Launch(stdout, log, weights, [])


def _initial(policy: tuple[Path, Path]) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(policy[0]).state_dict())


def _normalizers(rnd: Any) -> dict[str, float]:
    return {v.term: v.value for v in rnd.outcome.normalizers}


def test_areals_loop_runs_with_the_lossreduce_trainer(lossreduce_run: Launch) -> None:
    assert "Training completes" in lossreduce_run.stdout
    log = lossreduce_run.server_log
    # Every step's responses came from the server, and every step's weights went back.
    # AReaL's rollout may start the next step's prompts before the run ends.
    assert STEPS * BATCH * SAMPLES <= log["completions"] <= (STEPS + 1) * BATCH * SAMPLES
    assert log["versions"] == [1, 2, 3]
    assert log["paused"] == STEPS
    assert log["unknown"] == []


def test_every_round_normalizes_by_areals_own_counts(lossreduce_run: Launch) -> None:
    rounds = sorted(lossreduce_run.rounds, key=lambda r: r.key.step)
    # One round per update, numbered from the weight version it trained (so a
    # resumed run continues where its checkpoint left off).
    assert [r.key.step for r in rounds] == [v * ROUNDS_PER_VERSION for v in range(STEPS)]
    for rnd in rounds:
        assert rnd.outcome is not None
        assert rnd.outcome.kind == "completed"
    # token_mean's pg is the step's active tokens over both ranks, and rows its
    # sequences: AReaL's own n_valid_tokens and n_seqs of the same step.
    assert [_normalizers(r)["pg"] for r in rounds] == lossreduce_run.logged(
        "ppo_actor/n_valid_tokens"
    )
    assert [_normalizers(r)["rows"] for r in rounds] == lossreduce_run.logged("ppo_actor/n_seqs")
    assert lossreduce_run.logged("ppo_actor/n_seqs") == [BATCH * SAMPLES] * STEPS
    # The same normalizers in AReaL's own stats, once per step.
    assert lossreduce_run.logged("ppo_actor/update/lossreduce/normalizer/pg") == [
        _normalizers(r)["pg"] for r in rounds
    ]


def test_stock_and_lossreduce_token_mean_give_the_same_first_sgd_update(
    lossreduce_run: Launch, stock_run: Launch, policy: tuple[Path, Path]
) -> None:
    start = _initial(policy)
    ours, theirs = lossreduce_run.weights[1], stock_run.weights[1]
    assert sorted(ours) == sorted(theirs) == sorted(start)
    moved = sum(float((theirs[n].double() - start[n].double()).pow(2).sum()) for n in start)
    assert moved > 0, "the first step did not move the weights"
    diff = sum(float((ours[n].double() - theirs[n].double()).pow(2).sum()) for n in start)
    print(f"first SGD update, lossreduce against stock: relative {(diff / moved) ** 0.5:.1e}")
    assert (diff / moved) ** 0.5 < 1e-6
    assert stock_run.server_log["versions"] == [1]
    # The same step's gradient norm (as AReaL prints it) and the same token count.
    (stock_norm,) = stock_run.logged("ppo_actor/update/grad_norm")
    assert stock_norm > 0
    assert lossreduce_run.logged("ppo_actor/update/grad_norm")[0] == pytest.approx(
        stock_norm, rel=1e-4
    )
    assert (
        lossreduce_run.logged("ppo_actor/n_valid_tokens")[0]
        == stock_run.logged("ppo_actor/n_valid_tokens")[0]
    )


def test_the_docs_show_the_launch_the_test_runs() -> None:
    page = DOCS.read_text()
    launch = trainer_loop.LAUNCH.read_text()
    body = launch[launch.index("import sys") :]
    assert f"```python\n{body}```" in page
