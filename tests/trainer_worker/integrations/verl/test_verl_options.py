"""The verl options lossreduce's actor refuses at start, the mini-batch plan, the settings,
and how a verl launch finds the worker (entry point, trainer mode, worker swap)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from functools import partial
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.integrations.settings import ReductionSettings
from lossreduce.trainer_worker.integrations.verl.launch import reduction_settings
from lossreduce.trainer_worker.integrations.verl.options import (
    actor_problems,
    critic_problems,
    engine_problems,
    raise_problems,
)
from lossreduce.trainer_worker.integrations.verl.plan import (
    bad_inputs,
    dispatched_bad_inputs,
    group_ids,
    plan_mini_batch,
)
from lossreduce.trainer_worker.integrations.verl.policy_losses import POLICY_LOSSES
from lossreduce.trainer_worker.integrations.verl.settings import VerlReductionSettings
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode, PolicyGradientReduction
from lossreduce.trainer_worker.step_rows import StepRows


def actor(**fields: Any) -> Any:
    from verl.workers.config import ActorConfig, PolicyLossConfig

    if isinstance(fields.get("policy_loss"), dict):
        fields["policy_loss"] = PolicyLossConfig(**fields["policy_loss"])
    base: dict[str, Any] = {
        "strategy": "fsdp2",
        "ppo_mini_batch_size": 8,
        "ppo_micro_batch_size_per_gpu": 2,
        "rollout_n": 1,
    }
    return ActorConfig(**{**base, **fields})


def settings(**fields: Any) -> VerlReductionSettings:
    return VerlReductionSettings(**fields)


# -- refusals -------------------------------------------------------------------------


def test_the_defaults_are_honoured_in_every_mode() -> None:
    for mode, divisor in [
        ("token_mean", None),
        ("seq_mean", None),
        ("prompt_mean", None),
        ("constant", 5.0),
    ]:
        assert actor_problems(actor(), settings(mode=mode, divisor=divisor)) == []


@pytest.mark.parametrize(
    ("mode", "agg"),
    [
        ("token_mean", "token-mean"),
        ("seq_mean", "seq-mean-token-mean"),
        ("constant", "seq-mean-token-sum-norm"),
    ],
)
def test_the_verl_mode_that_means_the_same_is_accepted(mode: str, agg: str) -> None:
    divisor = 5.0 if mode == "constant" else None
    assert actor_problems(actor(loss_agg_mode=agg), settings(mode=mode, divisor=divisor)) == []


@pytest.mark.parametrize(
    ("mode", "agg"),
    [
        ("token_mean", "seq-mean-token-mean"),
        ("seq_mean", "token-sum"),
        ("prompt_mean", "seq-mean-token-sum"),
        ("constant", "seq-mean-token-mean"),
    ],
)
def test_a_loss_agg_mode_that_would_be_silently_replaced_is_refused(mode: str, agg: str) -> None:
    divisor = 5.0 if mode == "constant" else None
    (problem,) = actor_problems(actor(loss_agg_mode=agg), settings(mode=mode, divisor=divisor))
    assert f"actor.loss_agg_mode={agg!r}" in problem
    same = {"seq_mean": "seq-mean-token-mean", "constant": "seq-mean-token-sum-norm"}.get(mode)
    if same is None:  # token_mean's verl mode is verl's default; prompt_mean has none
        assert problem.endswith("; leave it at verl's default 'token-mean'")
    else:
        assert problem.endswith(
            f"; set {same!r} (the same in verl) or leave verl's default 'token-mean'"
        )
    assert mode in problem


def test_a_loss_scale_factor_other_than_the_divisor_is_refused() -> None:
    (problem,) = actor_problems(actor(loss_scale_factor=7), settings(mode="constant", divisor=5))
    assert "actor.loss_scale_factor=7" in problem
    assert actor_problems(actor(loss_scale_factor=5), settings(mode="constant", divisor=5)) == []


def test_an_engine_of_its_own_scaling_is_refused_naming_the_role_and_the_option() -> None:
    (problem,) = engine_problems(type("Engine", (), {"strategy": "veomni"})())
    assert "actor.strategy='veomni'" in problem
    assert "averaged over the engine's data-parallel group" in problem
    (problem,) = engine_problems(type("Engine", (), {"strategy": "torchtitan"})(), "critic")
    assert "critic.strategy='torchtitan'" in problem
    for strategy in ("fsdp", "fsdp2", "megatron"):
        assert engine_problems(type("Engine", (), {"strategy": strategy})()) == []


# -- verl's policy losses ------------------------------------------------------------------

REGISTERED = [
    "vanilla",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dro",
    "cispo",
    "bypass_mode",
]
"""verl 0.9.1's registered policy losses (``@register_policy_loss`` in core_algos)."""
MODE_DIVISORS = {"token_mean": None, "seq_mean": None, "prompt_mean": None, "constant": 5.0}
SEQ_MEAN_ONLY = {"sapo", "geo_mean"}
# The options each loss needs beyond verl's defaults to run at all.
NEEDS = {"dro": {"dro_beta": 0.1}}


def test_the_table_holds_exactly_verls_registry() -> None:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    assert set(POLICY_LOSSES) == set(POLICY_LOSS_REGISTRY) == set(REGISTERED)


@pytest.mark.parametrize("loss", REGISTERED)
@pytest.mark.parametrize("mode", list(MODE_DIVISORS))
def test_every_loss_runs_in_the_modes_that_mean_something_and_is_refused_in_the_others(
    loss: str, mode: str
) -> None:
    config = actor(policy_loss={"loss_mode": loss, **NEEDS.get(loss, {})})
    problems = actor_problems(config, settings(mode=mode, divisor=MODE_DIVISORS[mode]))
    if loss in SEQ_MEAN_ONLY and mode != "seq_mean":
        (problem,) = problems
        assert f"actor.policy_loss.loss_mode={loss!r} with lossreduce mode {mode!r}" in problem
        assert problem.endswith("set mode to seq_mean")
        # The reason is the math: one loss per response (geo_mean), SAPO's own aggregation.
        assert (
            ("per response" in problem)
            if loss == "geo_mean"
            else ("seq-mean-token-mean" in problem)
        )
    else:
        assert problems == []


def test_a_loss_verl_does_not_ship_is_refused_naming_the_seam() -> None:
    (problem,) = actor_problems(actor(policy_loss={"loss_mode": "my_loss"}), settings())
    assert "actor.policy_loss.loss_mode='my_loss' is not one of verl 0.9.1's" in problem
    assert "rollout_is_weights" in problem


def test_options_verl_would_refuse_only_at_the_first_call_are_refused_at_start() -> None:
    (dro,) = actor_problems(actor(policy_loss={"loss_mode": "dro"}), settings())
    assert "actor.policy_loss.dro_beta=None" in dro
    (kl_cov,) = actor_problems(
        actor(policy_loss={"loss_mode": "kl_cov", "kl_cov_ratio": 0.0}), settings()
    )
    assert "actor.policy_loss.kl_cov_ratio=0.0" in kl_cov
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    bad = RolloutCorrectionConfig(loss_type="bogus")
    (bypass,) = actor_problems(
        actor(policy_loss={"loss_mode": "bypass_mode", "rollout_correction": bad}), settings()
    )
    assert "rollout_correction.loss_type='bogus'" in bypass


def test_the_statistics_scope_and_the_critic_settings_are_validated() -> None:
    assert VerlReductionSettings().statistics == "mini_batch"
    with pytest.raises(ReductionConfigError, match="statistics=everywhere"):
        reduction_settings({"statistics": "everywhere"})
    with pytest.raises(ReductionConfigError, match="critic_divisor"):
        reduction_settings({"critic_mode": "constant"})
    with pytest.raises(ReductionConfigError, match="groups of their own"):
        reduction_settings({"critic_group": "actor"})


def test_a_critic_aggregation_that_would_be_replaced_is_refused() -> None:
    from verl.workers.config import CriticConfig

    critic = CriticConfig(
        strategy="fsdp2",
        loss_agg_mode="seq-mean-token-mean",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=2,
    )
    (problem,) = critic_problems(critic, settings())
    assert "critic.loss_agg_mode='seq-mean-token-mean'" in problem
    assert "critic_mode 'token_mean'" in problem
    assert critic_problems(critic, settings(critic_mode="seq_mean")) == []


def test_every_problem_is_named_in_one_error() -> None:
    with pytest.raises(ReductionConfigError, match=r"cannot honour: a; b") as info:
        raise_problems(["a", "b"], settings(job="j"))
    assert info.value.job == "j"


def test_the_worker_refuses_a_loss_other_than_verls_ppo_loss() -> None:
    from verl.workers.utils.losses import sft_loss

    from lossreduce.trainer_worker.integrations.verl import LossReduceTrainingWorker

    worker = LossReduceTrainingWorker.__new__(LossReduceTrainingWorker)
    worker.reduction_settings = settings()
    with pytest.raises(ReductionConfigError, match="only verl's ppo_loss"):
        worker.set_loss_fn(partial(sft_loss, config=actor()))


# -- settings ----------------------------------------------------------------------------


def test_settings_read_lossreduce_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOSSREDUCE_MODE", "constant")
    monkeypatch.setenv("LOSSREDUCE_DIVISOR", "512")
    got = VerlReductionSettings()
    assert got.reduction.contract_for("sum") == "sum:constant:divisor=512"
    assert (
        VerlReductionSettings(mode=PolicyGradientMode.SEQ_MEAN, divisor=None).mode.value
        == "seq_mean"
    )


def test_the_coordinator_backend_without_an_address_joins_the_jobs_actor() -> None:
    """No address: the ranks start or join the job's coordinator actor on their Ray
    cluster (test_verl_worker's joined-coordinator case); every other integration's
    settings still ask for one."""
    settings = VerlReductionSettings(normalizer="coordinator")
    assert settings.coordinator is None
    assert VerlReductionSettings.joins_ray_coordinator
    with pytest.raises(ValueError, match="needs coordinator=HOST:PORT"):
        ReductionSettings(normalizer="coordinator")


# -- the plan ----------------------------------------------------------------------------


def rows(tokens: list[float], groups: list[int], process: list[int]) -> StepRows:
    n = len(tokens)
    return StepRows(
        process=torch.tensor(process),
        window=torch.zeros(n, dtype=torch.long),
        group=torch.tensor(groups),
        tokens=torch.tensor(tokens, dtype=torch.float64),
    )


def test_the_plan_counts_active_units_only() -> None:
    batch = rows([3, 0, 2, 4], [0, 0, 1, 1], [0, 0, 1, 1])
    seq = plan_mini_batch(PolicyGradientReduction("seq_mean"), batch, 0, kl=True, entropy=False)
    assert float(seq.partials["pg"]) == 1.0  # the masked row is not counted
    assert float(seq.partials["kl"]) == 3.0
    assert "entropy" not in seq.partials
    assert seq.weights.tolist() == [1 / 3, 0.0]
    assert seq.contracts == {"pg": "sum:seq_mean", "kl": "sum:token_mean"}
    groups = plan_mini_batch(
        PolicyGradientReduction("prompt_mean"), batch, 1, kl=False, entropy=True
    )
    assert float(groups.partials["pg"]) == 1.0  # group 1 lives on rank 1
    assert groups.weights.tolist() == [1 / 6, 1 / 6]


def test_group_ids_number_uids_in_order_of_appearance() -> None:
    assert group_ids(["b", "a", "b", "c"]) == [0, 1, 0, 2]


def test_bad_inputs_name_the_input_its_value_and_rows_and_ignore_masked_positions() -> None:
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([[0.0, math.nan], [1.0, math.inf]])
    assert bad_inputs(mask, {"advantages": adv}) == [
        "advantages: nan at 1 active tokens of rank 0 rows [0] (mini-batch rows [0])"
    ]
    # Rank 1 of two ranks' even split holds the mini-batch's rows 2 and 3.
    assert bad_inputs(mask, {"advantages": adv}, rank=1) == [
        "advantages: nan at 1 active tokens of rank 1 rows [0] (mini-batch rows [2])"
    ]
    assert bad_inputs(torch.tensor([[1, 0], [1, 0]]), {"advantages": adv}) == []


def test_dispatched_bad_inputs_name_the_rows_as_the_trainer_sent_them() -> None:
    """Rank 1 of two, sent rows 4-7 of 8; verl's loader handed it rows 6 and 4 in that
    order: the bad rows are 6 and 4 of the batch, 2 and 0 of the rank's share."""
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([[math.nan, 0.0], [math.inf, 1.0]])
    rows = torch.tensor([6, 4])
    assert dispatched_bad_inputs(mask, {"advantages": adv}, 1, rows, 4) == [
        "advantages: nan at 2 active tokens of rank 1 rows [0, 2] (mini-batch rows [4, 6])"
    ]
    # In dispatch order, the names are bad_inputs' own.
    assert dispatched_bad_inputs(mask, {"advantages": adv}, 1, torch.tensor([2, 3]), 2) == (
        bad_inputs(mask, {"advantages": adv}, rank=1)
    )
    assert dispatched_bad_inputs(torch.tensor([[0, 1], [0, 1]]), {"a": adv}, 1, rows, 4) == []


# -- how a verl launch finds the worker -------------------------------------------------------


def test_the_verl_plugins_entry_point_names_the_plugin_module() -> None:
    (point,) = [p for p in entry_points(group="verl.plugins") if p.name == "lossreduce"]
    assert point.value == "lossreduce.trainer_worker.integrations.verl.plugin"


def test_importing_verl_registers_the_lossreduce_trainer_mode() -> None:
    """A fresh process: ``import verl`` loads the entry point, as every verl process does."""
    code = (
        "import verl\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls\n"
        "print(get_trainer_cls('lossreduce').__name__)\n"
    )
    env = {**os.environ, "VERL_LOGGING_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=Path(__file__).resolve().parents[4],
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "LossReducePPOTrainer"


def test_the_trainer_mode_swaps_the_actor_and_critic_workers_only() -> None:
    import ray
    from verl.trainer.ppo.utils import Role
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    from lossreduce.trainer_worker.integrations.verl import (
        LossReduceActorRolloutRefWorker,
        LossReduceCriticWorker,
    )
    from lossreduce.trainer_worker.integrations.verl.plugin import actor_worker_mapping

    stock = ray.remote(ActorRolloutRefWorker)
    critic = ray.remote(TrainingWorker)
    swapped = actor_worker_mapping(
        {Role.ActorRollout: stock, Role.RefPolicy: stock, Role.Critic: critic}
    )
    ours: Any = swapped[Role.ActorRollout]
    assert ours.__ray_actor_class__ is LossReduceActorRolloutRefWorker
    assert swapped[Role.RefPolicy] is stock
    ours_critic: Any = swapped[Role.Critic]
    assert ours_critic.__ray_actor_class__ is LossReduceCriticWorker


def test_the_actor_rollout_worker_reads_its_settings_from_the_lossreduce_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``+actor_rollout_ref.lossreduce.<field>=...`` reaches the actor worker it builds."""
    from omegaconf import OmegaConf

    from lossreduce.ports import free_port
    from lossreduce.trainer_worker.integrations.verl import (
        LossReduceActorRolloutRefWorker,
        LossReduceTrainingWorker,
    )

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("LOSSREDUCE_JOB", "from-env")
    config = OmegaConf.create(
        {
            "actor": {"strategy": "fsdp2"},
            "rollout": {},
            "ref": {},
            "lossreduce": {"mode": "constant", "divisor": 64},
        }
    )
    worker = LossReduceActorRolloutRefWorker(config, "actor_rollout")
    settings = worker.reduction_settings
    assert (settings.mode, settings.divisor, settings.job) == (
        PolicyGradientMode.CONSTANT,
        64.0,
        "from-env",
    )
    build: Any = worker.actor_worker_cls
    assert build.func is LossReduceTrainingWorker
    assert build.keywords == {"reduction": settings}
