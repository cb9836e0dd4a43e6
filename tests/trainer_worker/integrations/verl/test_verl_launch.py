"""No silent fallback: a verl launch given lossreduce's settings runs the lossreduce
trainer mode or stops before Ray starts, naming the flag to set.

verl's own config (``ppo_trainer.yaml``, composed by Hydra with a launch's
overrides) is checked by :func:`check_launch`, and one real ``python -m
verl.trainer.main_ppo`` shows the plugin's wrap of ``validate_config`` stops the
launch in its driver.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.integrations.verl.launch import check_launch

LOSSREDUCE = ["+actor_rollout_ref.lossreduce.mode=prompt_mean"]


def composed(overrides: list[str]) -> Any:
    """verl's ``ppo_trainer`` config with ``overrides``, as ``main_ppo`` composes it."""
    from hydra import compose, initialize_config_module

    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.v1.trainer_mode=lossreduce", *LOSSREDUCE],
        ["trainer.v1.trainer_mode=lossreduce"],  # the settings from LOSSREDUCE_* or defaults
        [],  # a stock launch
        ["trainer.v1.trainer_mode=colocate_async"],  # no lossreduce asked for
    ],
)
def test_a_launch_that_runs_what_it_asks_for_passes(overrides: list[str]) -> None:
    check_launch(composed(overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            LOSSREDUCE,
            "actor_rollout_ref.lossreduce is set, but trainer.v1.trainer_mode=sync is a trainer "
            "that trains with verl's own normalization: set trainer.v1.trainer_mode=lossreduce",
        ),
        (
            ["trainer.v1.trainer_mode=colocate_async", *LOSSREDUCE],
            "trainer.v1.trainer_mode=colocate_async is an asynchronous trainer mode, which "
            "lossreduce does not run",
        ),
        (
            ["trainer.v1.trainer_mode=separate_async", *LOSSREDUCE],
            "trainer.v1.trainer_mode=separate_async is an asynchronous trainer mode",
        ),
        (
            ["trainer.use_v1=False", "trainer.v1.trainer_mode=lossreduce", *LOSSREDUCE],
            "actor_rollout_ref.lossreduce is set, but trainer.use_v1=False runs verl's legacy "
            "trainer, which trains with verl's own normalization: set trainer.use_v1=True",
        ),
        (
            ["trainer.use_v1=False", "trainer.v1.trainer_mode=lossreduce"],
            "trainer.v1.trainer_mode=lossreduce, but trainer.use_v1=False",
        ),
    ],
)
def test_a_launch_that_would_not_run_lossreduce_is_refused_naming_the_flag(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ReductionConfigError, match="set trainer") as caught:
        check_launch(composed(overrides))
    assert message in str(caught.value)


def main_ppo(tmp_path: Path, overrides: list[str]) -> subprocess.CompletedProcess[str]:
    """The real entry point, in a fresh process that loads the plugin through verl's entry
    point as a user's does."""
    env = {**os.environ, "VERL_LOGGING_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *overrides],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,  # Hydra writes its outputs/ folder here
        check=False,
    )


def test_main_ppo_stops_in_its_driver_before_ray_starts(tmp_path: Path) -> None:
    """The legacy trainer with lossreduce's settings."""
    done = main_ppo(tmp_path, ["trainer.use_v1=False", *LOSSREDUCE])
    assert done.returncode != 0
    assert "ReductionConfigError" in done.stderr, done.stderr[-3000:]
    assert "set trainer.use_v1=True" in done.stderr
    assert "ray init kwargs" not in done.stdout  # stopped before main_ppo starts Ray


@pytest.mark.parametrize(
    ("overrides", "environ", "source"),
    [
        (
            ["trainer.v1.trainer_mode=lossreduce", "+actor_rollout_ref.lossreduce.mode=bogus"],
            {},
            "actor_rollout_ref.lossreduce.mode=bogus",
        ),
        (
            ["trainer.v1.trainer_mode=lossreduce"],
            {"LOSSREDUCE_MODE": "bogus"},
            "LOSSREDUCE_MODE=bogus",
        ),
    ],
)
def test_a_bad_setting_is_refused_before_ray_naming_its_source(
    overrides: list[str], environ: dict[str, str], source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ReductionConfigError) as caught:
        check_launch(composed(overrides))
    first_line = str(caught.value).splitlines()[0]
    assert source in first_line
    for allowed in ("token_mean", "seq_mean", "prompt_mean", "constant"):
        assert allowed in first_line


def test_main_ppo_refuses_a_bad_setting_in_its_driver_before_ray_starts(tmp_path: Path) -> None:
    """A bogus mode stops the launch in seconds, not after the workers start (they would
    refuse it too, inside a Ray actor error)."""
    done = main_ppo(
        tmp_path, ["trainer.v1.trainer_mode=lossreduce", "+actor_rollout_ref.lossreduce.mode=bogus"]
    )
    assert done.returncode != 0
    assert "ReductionConfigError" in done.stderr, done.stderr[-3000:]
    assert "actor_rollout_ref.lossreduce.mode=bogus" in done.stderr
    assert "ray init kwargs" not in done.stdout  # stopped before main_ppo starts Ray


# -- the actor's and critic's options, before Ray ------------------------------------------


@pytest.mark.parametrize("loss", ["sapo", "geo_mean"])
def test_a_policy_loss_in_a_mode_without_meaning_is_refused_before_ray(loss: str) -> None:
    overrides = [
        "trainer.v1.trainer_mode=lossreduce",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}",
    ]
    with pytest.raises(ReductionConfigError) as caught:
        check_launch(composed(overrides))
    assert f"actor.policy_loss.loss_mode={loss!r} with lossreduce mode 'token_mean'" in str(
        caught.value
    )
    check_launch(composed([*overrides, "+actor_rollout_ref.lossreduce.mode=seq_mean"]))


def test_every_other_registered_loss_passes_the_launch_check() -> None:
    for loss in ("gspo", "clip_cov", "kl_cov", "cispo", "bypass_mode", "dppo_tv"):
        check_launch(
            composed(
                [
                    "trainer.v1.trainer_mode=lossreduce",
                    f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}",
                ]
            )
        )


def test_the_critics_options_are_checked_when_the_launch_has_a_critic() -> None:
    overrides = [
        "trainer.v1.trainer_mode=lossreduce",
        "algorithm.adv_estimator=gae",
        "critic.loss_agg_mode=seq-mean-token-sum",
    ]
    config = composed(overrides)
    check_launch(config, use_critic=False)
    with pytest.raises(ReductionConfigError) as caught:
        check_launch(config, use_critic=True)
    assert "critic.loss_agg_mode='seq-mean-token-sum'" in str(caught.value)
    check_launch(
        composed(
            [
                *overrides[:2],
                "critic.loss_agg_mode=seq-mean-token-mean",
                "+actor_rollout_ref.lossreduce.critic_mode=seq_mean",
            ]
        ),
        use_critic=True,
    )


def test_main_ppo_refuses_a_policy_loss_mode_pair_in_its_driver(tmp_path: Path) -> None:
    done = main_ppo(
        tmp_path,
        [
            "trainer.v1.trainer_mode=lossreduce",
            "actor_rollout_ref.actor.policy_loss.loss_mode=sapo",
        ],
    )
    assert done.returncode != 0
    assert "ReductionConfigError" in done.stderr, done.stderr[-3000:]
    assert "set mode to seq_mean" in done.stderr
    assert "ray init kwargs" not in done.stdout  # stopped before main_ppo starts Ray
