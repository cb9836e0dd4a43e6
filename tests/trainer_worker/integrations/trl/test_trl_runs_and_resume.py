"""Many runs against one coordinator, with the real TRL: a resumed run continues its
rounds at TRL's global step, runs with the default job never meet, and a second run
under a job another run holds is refused before any answer.

Each run is a real ``LossReduceGRPOTrainer`` in this process (one process, the
tiny offline setup), dialling one real coordinator on a free loopback port
that outlives the runs, as a shared ``lossreduce serve`` does. The second
half of a run answers its prompts with shorter completions
(``tiny_grpo.SHORTER``), so a round it shared with the first half could not
give it its own token count.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl", reason="needs the trl extra: pip install 'lossreduce[trl]'")

import lossreduce.client
from lossreduce.client import ReductionClient
from lossreduce.errors import RunConflictError
from lossreduce.server import CoordinatorSettings, CoordinatorThread
from tests.conftest import TEST_SETTINGS
from tests.trainer_worker.integrations.trl import tiny_grpo
from tests.trainer_worker.integrations.trl.trl_runs import Case, Layout, make_trainer

pytestmark = [
    # transformers and TRL announce their own deprecations while a trainer is built.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*experimental.*:UserWarning"),
]

# One optimizer step per generation batch of all 12 completions.
ONE_PROCESS = Layout("1x1", processes=1, per_device=12, accumulation=1, steps_per_generation=1)


def tokens(table: dict[int, list[list[int]]]) -> float:
    """token_mean's N of a step over ``table``: tokens of every completion that ends in
    EOS (truncated ones are masked)."""
    return float(sum(len(c) for gens in table.values() for c in gens if c[-1] == tiny_grpo.EOS))


class Sent:
    """Every round a client of this test sent: (job, step, partial of 'pg'), and the run
    each went out under."""

    def __init__(self) -> None:
        self.rounds: list[tuple[str, int, float]] = []
        self.runs: list[str] = []


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Sent:
    """The real client, noting each round it starts (the trainer dials through it)."""
    record = Sent()

    class NotingClient(ReductionClient):
        def reduce_start(self, step: int, partials: Any, contracts: Any = None) -> Any:
            record.rounds.append((self.job, step, float(partials["pg"])))
            record.runs.append(self.run)
            return super().reduce_start(step, partials, contracts)

    monkeypatch.setattr(lossreduce.client, "ReductionClient", NotingClient)
    return record


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_grpo.save_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def coordinator() -> Iterator[str]:
    thread = CoordinatorThread(CoordinatorSettings.model_validate(TEST_SETTINGS)).start()
    yield thread.target
    thread.stop()


def train(case: Case, model_dir: Path, out: Path, resume: Path | None = None) -> Any:
    trainer = make_trainer(case, ONE_PROCESS, model_dir, out)
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    finally:
        trainer.close()
    return trainer


def normalizers(trainer: Any) -> list[float]:
    return [h["lossreduce/normalizer/pg"] for h in trainer.state.log_history if "loss" in h]


def test_a_resumed_run_continues_at_trls_global_step_with_answers_of_its_own(
    model_dir: Path, coordinator: str, sent: Sent, tmp_path: Path
) -> None:
    case = Case(
        name="resume",
        normalizer="coordinator",
        coordinator=coordinator,
        job="team-resume",
        shorter_from_step=2,
        save_steps=2,
    )
    first = train(Case(**{**case.__dict__, "max_steps": 2}), model_dir, tmp_path)
    checkpoint = tmp_path / "checkpoint-2"
    assert checkpoint.is_dir()
    second = train(Case(**{**case.__dict__, "max_steps": 4}), model_dir, tmp_path, checkpoint)

    # One job on the wire (it was given), one round per optimizer step, each step once.
    assert [(job, step) for job, step, _ in sent.rounds] == [("team-resume", s) for s in range(4)]
    # Each half got the sum of what it sent itself, and the halves sent different counts:
    # a resumed run numbering its rounds from 0 would have met the first half's rounds.
    full, short = tokens(tiny_grpo.COMPLETIONS), tokens(tiny_grpo.SHORTER)
    assert full != short
    assert [partial for *_, partial in sent.rounds] == [full, full, short, short]
    assert normalizers(first) == [full, full]
    # The resumed trainer's log starts with the checkpoint's history.
    assert normalizers(second) == [full, full, short, short]
    assert second.state.global_step == 4
    assert first.reduction_run != second.reduction_run
    assert sent.runs == [first.reduction_run] * 2 + [second.reduction_run] * 2
    assert first.reduction_job == second.reduction_job == "team-resume"


def test_two_runs_with_the_default_job_never_meet(
    model_dir: Path, coordinator: str, sent: Sent, tmp_path: Path
) -> None:
    shared = Case(name="default", normalizer="coordinator", coordinator=coordinator, job="")
    first = train(Case(**{**shared.__dict__, "max_steps": 2}), model_dir, tmp_path / "a")
    # The same script again, whose completions differ from its first step on.
    second = train(
        Case(**{**shared.__dict__, "max_steps": 2, "shorter_from_step": 0}),
        model_dir,
        tmp_path / "b",
    )
    assert normalizers(first) == [tokens(tiny_grpo.COMPLETIONS)] * 2
    assert normalizers(second) == [tokens(tiny_grpo.SHORTER)] * 2
    jobs = [job for job, *_ in sent.rounds]
    assert (
        jobs == [f"trl-grpo-{first.reduction_run}"] * 2 + [f"trl-grpo-{second.reduction_run}"] * 2
    )
    assert first.reduction_run != second.reduction_run


def test_a_second_run_under_a_job_another_run_holds_is_refused_before_it_trains(
    model_dir: Path, coordinator: str, sent: Sent, tmp_path: Path
) -> None:
    held = Case(name="held", normalizer="coordinator", coordinator=coordinator, job="team-held")
    first = train(Case(**{**held.__dict__, "max_steps": 2}), model_dir, tmp_path / "a")
    # The same script, relaunched under the same job while the first run's claim holds.
    again = make_trainer(
        Case(**{**held.__dict__, "max_steps": 2, "shorter_from_step": 0}),
        ONE_PROCESS,
        model_dir,
        tmp_path / "b",
    )
    model = again.accelerator.unwrap_model(again.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        with pytest.raises(RunConflictError) as info:
            again.train()
    finally:
        again.close()
    err = info.value
    assert (err.job, err.step, err.run, err.holder) == (
        "team-held",
        0,
        again.reduction_run,
        first.reduction_run,
    )
    assert f"run {first.reduction_run!r} holds job 'team-held'" in str(err)
    assert "omit job so the default includes the run id" in str(err)
    # Refused at its first round: no optimizer step, the weights as they were.
    assert again.state.global_step == 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert [step for job, step, _ in sent.rounds if job == "team-held"] == [0, 1, 0]
