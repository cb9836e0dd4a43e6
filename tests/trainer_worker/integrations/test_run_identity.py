"""The run identity every integration resolves: explicit, the launcher's, or rank 0's
draw shared over a real gloo process group; and the job name it gives."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import start_processes

from lossreduce.ports import free_port
from lossreduce.trainer_worker.integrations.run_identity import (
    RUN_PATTERN,
    clean_run,
    draw_run,
    launcher_run,
    resolve_run,
    run_job,
)
from lossreduce.trainer_worker.integrations.settings import GRPOReductionSettings


def test_an_explicit_run_wins_over_the_launcher() -> None:
    environ = {"TORCHELASTIC_RUN_ID": "elastic-7"}
    assert resolve_run("mine", environ=environ) == "mine"
    assert resolve_run(None, environ=environ) == "elastic-7"


def test_torchruns_placeholder_id_is_not_a_run() -> None:
    # torchrun without --rdzv-id passes the same "none" to every launch.
    assert launcher_run({"TORCHELASTIC_RUN_ID": "none"}) is None
    assert launcher_run({"TORCHELASTIC_RUN_ID": " "}) is None
    assert launcher_run({}) is None


def test_a_launcher_id_is_cleaned_into_a_run_id() -> None:
    run = launcher_run({"TORCHELASTIC_RUN_ID": "slurm/1234:5 " + "x" * 60})
    assert run is not None
    assert re.fullmatch(RUN_PATTERN, run)
    assert run.startswith("slurm-1234-5-")
    with pytest.raises(ValueError, match="no usable character"):
        clean_run("   ")


def test_without_a_process_group_each_draw_is_new() -> None:
    assert not dist.is_initialized()
    runs = {resolve_run(None, environ={}) for _ in range(50)}
    assert len(runs) == 50
    assert all(re.fullmatch(RUN_PATTERN, r) for r in runs)
    assert re.fullmatch(r"[0-9a-f]{8}", draw_run())


def test_the_default_job_carries_the_run_and_an_explicit_job_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LOSSREDUCE_JOB", raising=False)
    monkeypatch.delenv("LOSSREDUCE_RUN", raising=False)
    assert GRPOReductionSettings().job_of("ab12") == "trl-grpo-ab12"
    # Even an explicit job equal to the default is taken as given.
    assert GRPOReductionSettings(job="trl-grpo").job_of("ab12") == "trl-grpo"
    monkeypatch.setenv("LOSSREDUCE_JOB", "team-a")
    monkeypatch.setenv("LOSSREDUCE_RUN", "r-1")
    settings = GRPOReductionSettings()
    assert (settings.run, settings.job_of("r-1")) == ("r-1", "team-a")
    assert run_job("x", "y", explicit_job=False) == "x-y"


def test_a_run_id_that_cannot_be_a_name_is_refused() -> None:
    with pytest.raises(ValueError, match="run"):
        GRPOReductionSettings(run="has space")


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    try:
        # A subgroup whose first member is global rank 1: its draw is the one shared.
        sub = dist.new_group([1, 2])
        whole = resolve_run(None, environ={})
        part = resolve_run(None, group=sub, environ={}) if rank in (1, 2) else None
        torch.save({"whole": whole, "part": part}, Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def _launch(out: Path) -> list[dict[str, str | None]]:
    out.mkdir()
    # fork: the ranks need nothing from a fresh interpreter, and this test module is not
    # importable by name in one.
    start_processes(_rank, args=(free_port(), str(out)), nprocs=3, start_method="fork")
    return [torch.load(out / f"{r}.pt") for r in range(3)]


def test_rank_zeros_draw_is_shared_and_each_launch_draws_anew(tmp_path: Path) -> None:
    first = _launch(tmp_path / "first")
    second = _launch(tmp_path / "second")
    for launch in (first, second):
        assert len({r["whole"] for r in launch}) == 1
        assert launch[1]["part"] == launch[2]["part"] is not None
    assert first[0]["whole"] != second[0]["whole"]
