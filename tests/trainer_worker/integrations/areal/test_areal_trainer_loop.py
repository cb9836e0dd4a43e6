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
each on 2 cores. The launches and checks are :mod:`.trainer_loop`'s, shared with the
Megatron engine's trainer-loop test (``megatron/test_megatron_trainer_loop.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lossreduce.trainer_worker.cpu_standins.areal.archon import ARCHON_CPU_OVERRIDES
from lossreduce.trainer_worker.integrations.areal.actor import ROUNDS_PER_VERSION
from tests.trainer_worker.integrations.areal import trainer_loop
from tests.trainer_worker.integrations.areal.trainer_loop import LoopRun

DOCS = trainer_loop.ROOT / "docs" / "frameworks" / "areal.md"

AB_OVERRIDES = (
    "actor.optimizer.type=sgd",
    f"actor.optimizer.lr={trainer_loop.SGD_LR}",
    *trainer_loop.AB_OVERRIDES,
)
ENGINES: dict[str, tuple[str, ...]] = {
    "fsdp": ("actor.backend=fsdp:d2",),
    "archon": ("actor.backend=archon:d2", *ARCHON_CPU_OVERRIDES),
}


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return trainer_loop.save_inputs(tmp_path_factory.mktemp("loop"))


@pytest.fixture(scope="module", params=sorted(ENGINES))
def engine(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def lossreduce_run(
    engine: str, policy: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> LoopRun:
    return trainer_loop.lossreduce_loop(
        policy, tmp_path_factory.mktemp(f"lossreduce-{engine}"), (*ENGINES[engine], *AB_OVERRIDES)
    )


@pytest.fixture(scope="module")
def stock_run(
    engine: str, policy: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> LoopRun:
    return trainer_loop.stock_loop(
        policy, tmp_path_factory.mktemp(f"stock-{engine}"), (*ENGINES[engine], *AB_OVERRIDES)
    )


def test_areals_loop_runs_with_the_lossreduce_trainer(lossreduce_run: LoopRun) -> None:
    trainer_loop.check_loop_ran(lossreduce_run)


def test_every_round_normalizes_by_areals_own_counts(lossreduce_run: LoopRun) -> None:
    trainer_loop.check_rounds_are_areals_counts(lossreduce_run, ROUNDS_PER_VERSION)


def test_stock_and_lossreduce_token_mean_give_the_same_first_sgd_update(
    lossreduce_run: LoopRun, stock_run: LoopRun, policy: tuple[Path, Path]
) -> None:
    trainer_loop.check_first_update(lossreduce_run, stock_run, policy[0], tolerance=1e-6)


def test_the_docs_show_the_launch_the_test_runs() -> None:
    page = DOCS.read_text()
    launch = trainer_loop.LAUNCH.read_text()
    body = launch[launch.index("import sys") :]
    assert f"```python\n{body}```" in page
