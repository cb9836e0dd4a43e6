"""``LossReducePPOTrainer`` runs AReaL 1.0.4's own trainer loop on CPU with the Megatron
engine (``actor.backend: megatron:d2``, Megatron-Core 0.17.0 through mbridge 0.15.1).

The launch is the FSDP and Archon trainer-loop test's (``test_areal_trainer_loop.py``):
the docs' ``grpo_launch.py``, unchanged, under ``torchrun`` on 2 gloo ranks in AReaL's
SPMD mode for 3 steps against ``rollout_server.py``, and the same script with AReaL's
own import for one step (the stock run). Each rank runs it through
``megatron_cpu_launch.py``, which installs the CPU platform
(:mod:`lossreduce.trainer_worker.cpu_standins.megatron.platform`) first. Everything
else is AReaL's own: the engine creates its process groups and Megatron's layout,
builds the model through mbridge, trains with Megatron's distributed optimizer (over
gloo) and sends every version to the server from disk (mbridge's Hugging Face export);
the saver, evaluator and recovery are off in ``grpo_loop.yaml``, as for FSDP.

The checks are :mod:`..trainer_loop`'s, the FSDP test's: every step served and sent
back, one coordinator round per update normalizing by AReaL's own ``n_valid_tokens``
and ``n_seqs``, and the first update equal to stock AReaL's with its grad norm. AReaL's
Megatron engine cannot build an SGD optimizer, so the A/B's SGD step is taken by Adam
as in the Megatron actor tests (``megatron_runs.SGD_EPS``): ``beta1 = 0``,
``eps = 1e8``, ``lr = 0.1 * 1e8``; the test checks that the update's norm is then
``0.1`` times AReaL's logged grad norm, as SGD's: the update is linear in the gradient,
so a wrong normalizer moves it by its factor. Two launches, 25 to 40 s each; the module
takes about a minute on 2 quiet cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer_worker.integrations.areal import trainer_loop
from tests.trainer_worker.integrations.areal.megatron.megatron_runs import SGD_EPS
from tests.trainer_worker.integrations.areal.trainer_loop import SGD_LR, LoopRun

WRAPPER = Path(__file__).resolve().parent / "megatron_cpu_launch.py"

OVERRIDES = (
    "actor.backend=megatron:d2",
    # SGD's step, taken by Adam (see the module docstring). grpo_loop.yaml names no
    # eps or beta1, and AReaL applies the options to the YAML before its config
    # classes, so they are added ("+").
    "actor.optimizer.type=adam",
    f"actor.optimizer.lr={SGD_LR * SGD_EPS}",
    f"+actor.optimizer.eps={SGD_EPS}",
    "+actor.optimizer.beta1=0.0",
    *trainer_loop.AB_OVERRIDES,
)

TOLERANCE = 1e-6
"""The first updates' relative difference allowed, the FSDP test's (measured from run
to run: 0.0 or 9.8e-8, float32 rounding, as the FSDP and Archon loops' 0.0 and 8.3e-8;
a wrong normalizer, ``seq_mean``'s, gave 0.61)."""


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return trainer_loop.save_inputs(tmp_path_factory.mktemp("loop"))


@pytest.fixture(scope="module")
def lossreduce_run(policy: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> LoopRun:
    return trainer_loop.lossreduce_loop(
        policy, tmp_path_factory.mktemp("lossreduce-megatron"), OVERRIDES, WRAPPER
    )


@pytest.fixture(scope="module")
def stock_run(policy: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> LoopRun:
    return trainer_loop.stock_loop(
        policy, tmp_path_factory.mktemp("stock-megatron"), OVERRIDES, WRAPPER
    )


def test_areals_loop_runs_with_the_lossreduce_megatron_actor(lossreduce_run: LoopRun) -> None:
    trainer_loop.check_loop_ran(lossreduce_run)
    # AReaL built the Megatron engine (through mbridge), not another backend's.
    assert "Using mbridge to create models" in lossreduce_run.stdout


def test_every_round_normalizes_by_areals_own_counts(lossreduce_run: LoopRun) -> None:
    # Without the actor's ROUNDS_PER_VERSION: this process imports neither AReaL nor
    # Megatron-Core (only the launched ranks do; both warn on import here).
    trainer_loop.check_rounds_are_areals_counts(lossreduce_run, None)


def test_stock_and_lossreduce_token_mean_give_the_same_first_sgd_update(
    lossreduce_run: LoopRun, stock_run: LoopRun, policy: tuple[Path, Path]
) -> None:
    _, moved = trainer_loop.check_first_update(lossreduce_run, stock_run, policy[0], TOLERANCE)
    # Adam took SGD's step: the update is lr times the gradient, its norm lr times
    # AReaL's logged grad norm (5 digits). So the update is linear in the gradient, and
    # a normalizer off by a factor would be off by that factor above.
    (grad_norm,) = stock_run.logged("ppo_actor/update/grad_norm")
    print(f"stock grad norm {grad_norm:.4e}, update norm {moved:.5e}")
    assert moved == pytest.approx(SGD_LR * grad_norm, rel=1e-4)
