"""The SkyRL integration's pure parts, without SkyRL: its settings, its refusals, its plan.

SkyRL's config objects are read by attribute, so plain namespaces stand in for them here;
the real SkyRL runs in ``tests/trainer_worker/integrations/skyrl`` (``make test-skyrl``).
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.integrations.settings_errors import validate_settings
from lossreduce.trainer_worker.integrations.skyrl import SkyRLReductionSettings
from lossreduce.trainer_worker.integrations.skyrl.options import (
    REFUSED_POLICY_LOSSES,
    SKYRL_EQUIVALENT,
    config_problems,
    raise_problems,
)
from lossreduce.trainer_worker.integrations.skyrl.plan import (
    ENTROPY_TERM,
    KL_TERM,
    POLICY_TERM,
    prompt_ids,
    row_scales,
    term_reductions,
    token_share,
)
from lossreduce.trainer_worker.integrations.skyrl.version import check_skyrl_version
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode, PolicyGradientReduction
from lossreduce.trainer_worker.step_rows import StepRows, plan_terms


def trainer(**algorithm: Any) -> SimpleNamespace:
    """A stand-in for SkyRL's ``TrainerConfig`` with SkyRL's defaults."""
    fields = {
        "policy_loss_type": "regular",
        "loss_reduction": "token_mean",
        "max_seq_len": None,
        **algorithm,
    }
    return SimpleNamespace(
        strategy="fsdp",
        algorithm=SimpleNamespace(**fields),
        critic=SimpleNamespace(model=SimpleNamespace(path=None)),
    )


def settings(**fields: Any) -> SkyRLReductionSettings:
    return SkyRLReductionSettings(**fields)


# -- settings ---------------------------------------------------------------------------


def test_every_term_defaults_to_token_mean() -> None:
    s = settings()
    assert s.reduction.contract == "mean:token_mean"
    assert s.kl_reduction.contract == s.entropy_reduction.contract == "mean:token_mean"
    assert s.job == "skyrl-ppo"
    assert s.group == "policy"


def test_the_divisor_goes_to_every_term_in_constant_and_only_there() -> None:
    s = settings(mode="seq_mean", kl_mode="constant", entropy_mode="constant", divisor=8)
    assert s.reduction.divisor is None
    assert s.kl_reduction.contract_for("sum") == "sum:constant:divisor=8"
    assert s.entropy_reduction.divisor == 8.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kl_mode": "constant"}, "kl_mode='constant' needs divisor=C"),
        ({"divisor": 4}, "divisor=4.0 is only valid when mode, kl_mode, entropy_mode or critic"),
        ({"critic_mode": "constant"}, "critic_mode='constant' needs divisor=C"),
        ({"critic_group": "policy"}, "critic_group='policy' equals group"),
        ({"entropy_mode": "bogus"}, "trainer.lossreduce.entropy_mode=bogus: must be one of"),
    ],
)
def test_a_bad_setting_names_the_key_and_what_is_allowed(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ReductionConfigError, match=None) as caught:
        validate_settings(
            SkyRLReductionSettings,
            fields,
            what="SkyRL's lossreduce settings",
            key_prefix="trainer.lossreduce",
        )
    assert message in str(caught.value)


# -- refusals ---------------------------------------------------------------------------


def test_skyrls_defaults_run() -> None:
    assert config_problems(trainer(), settings()) == []
    assert (
        config_problems(trainer(loss_reduction="prompt_mean"), settings(mode="prompt_mean")) == []
    )


@pytest.mark.parametrize(
    "loss",
    ["regular", "dual_clip", "gspo", "cispo", "sapo", "dppo", "rollout_is", "importance_sampling"],
)
def test_every_homogeneous_policy_loss_runs(loss: str) -> None:
    assert config_problems(trainer(policy_loss_type=loss), settings()) == []


@pytest.mark.parametrize("loss", sorted(REFUSED_POLICY_LOSSES))
def test_a_policy_loss_no_normalizer_can_divide_is_refused_with_why(loss: str) -> None:
    (problem,) = config_problems(trainer(policy_loss_type=loss), settings())
    assert problem.startswith(f"trainer.algorithm.policy_loss_type={loss!r}: ")
    assert REFUSED_POLICY_LOSSES[loss] in problem


@pytest.mark.parametrize("mode", list(PolicyGradientMode))
def test_skyrls_loss_reduction_may_be_its_default_or_the_same_mode(
    mode: PolicyGradientMode,
) -> None:
    divisor = 8.0 if mode is PolicyGradientMode.CONSTANT else None
    s = settings(mode=mode, divisor=divisor)
    same = SKYRL_EQUIVALENT[mode]
    assert config_problems(trainer(loss_reduction=same, max_seq_len=8), s) == []
    assert config_problems(trainer(loss_reduction="token_mean"), s) == []
    other = next(v for m, v in SKYRL_EQUIVALENT.items() if v not in (same, "token_mean"))
    (problem,) = config_problems(trainer(loss_reduction=other, max_seq_len=8), s)
    assert f"loss_reduction={other!r} would be silently replaced" in problem


def test_a_mean_of_micro_batch_means_is_refused() -> None:
    (problem,) = config_problems(trainer(loss_reduction="token_mean_legacy"), settings())
    assert "token_mean_legacy" in problem
    assert "micro_train_batch_size_per_gpu" in problem


def test_skyrls_constant_divisor_must_be_lossreduces() -> None:
    s = settings(mode="constant", divisor=8)
    (problem,) = config_problems(
        trainer(loss_reduction="seq_mean_token_sum_norm", max_seq_len=16), s
    )
    assert "max_seq_len=16" in problem
    assert "divisor=8.0" in problem


def test_a_critic_runs_and_megatron_is_refused_with_the_other_problems_in_one_error() -> None:
    cfg = trainer()
    cfg.critic.model.path = "/models/critic"
    assert config_problems(cfg, settings()) == []
    cfg.strategy = "megatron"
    cfg.algorithm.policy_loss_type = "clip_cov"
    problems = config_problems(cfg, settings())
    assert [p.split("=")[0] for p in problems] == [
        "trainer.strategy",
        "trainer.algorithm.policy_loss_type",
    ]
    with pytest.raises(ReductionConfigError) as caught:
        raise_problems(problems, settings())
    assert "trainer.strategy='megatron'" in str(caught.value)
    assert "policy_loss_type='clip_cov'" in str(caught.value)


def test_the_critic_has_a_mode_and_a_group_of_its_own() -> None:
    s = settings()
    assert s.critic_reduction.contract == "mean:token_mean"
    assert s.critic_group == "critic"
    s = settings(critic_mode="constant", divisor=8)
    assert s.critic_reduction.contract_for("sum") == "sum:constant:divisor=8"
    assert s.reduction.divisor is None


def test_the_skyrl_version_is_checked() -> None:
    check_skyrl_version("0.4.0")
    with pytest.raises(ImportError, match=re.escape("skyrl>=0.4.0,<0.4.1")):
        check_skyrl_version("0.5.0")


# -- the plan -------------------------------------------------------------------------------


def test_each_row_gets_its_prompt_group_and_padding_rows_groups_of_their_own() -> None:
    assert prompt_ids([(0, 3), (3, 5)], 7).tolist() == [0, 0, 0, 1, 1, 2, 3]


def test_terms_that_are_off_are_not_planned() -> None:
    pg = PolicyGradientReduction("seq_mean")
    assert list(term_reductions(pg, None, None)) == [POLICY_TERM]
    token = PolicyGradientReduction("token_mean")
    assert list(term_reductions(pg, token, token)) == [POLICY_TERM, KL_TERM, ENTROPY_TERM]


def test_row_scales_are_the_formulas_weights_over_the_global_normalizer() -> None:
    # Two ranks' rows: tokens 3, 0 (masked), 2 on rank 0; 4, 1 on rank 1; groups 0, 0, 1, 1, 2.
    rows = StepRows(
        process=torch.tensor([0, 0, 0, 1, 1]),
        window=torch.zeros(5, dtype=torch.long),
        group=torch.tensor([0, 0, 1, 1, 2]),
        tokens=torch.tensor([3.0, 0.0, 2.0, 4.0, 1.0], dtype=torch.float64),
    )
    terms = term_reductions(
        PolicyGradientReduction("prompt_mean"),
        PolicyGradientReduction("seq_mean"),
        PolicyGradientReduction("token_mean"),
    )
    plans = [plan_terms(terms, rows, rank) for rank in (0, 1)]
    totals = {term: sum(float(p.partials[term]) for p in plans) for term in terms}
    # 3 active groups, 4 active responses, 10 tokens.
    assert totals == {POLICY_TERM: 3.0, KL_TERM: 4.0, ENTROPY_TERM: 10.0}
    scales = row_scales(plans[0], totals)
    # Group 1 spans both ranks: its tokens are 2 + 4.
    assert scales[POLICY_TERM].tolist() == [1 / 3 / 3, 1 / 3 / 3, 1 / 6 / 3]
    assert scales[KL_TERM].tolist() == [1 / 3 / 4, 0.0, 1 / 2 / 4]
    assert scales[ENTROPY_TERM].tolist() == [1 / 10, 0.0, 1 / 10]


def test_a_share_ignores_nan_under_the_mask() -> None:
    values = torch.tensor([[1.0, float("nan")], [2.0, 3.0]], requires_grad=True)
    mask = torch.tensor([[1, 0], [1, 1]])
    share = token_share(values, mask, torch.tensor([0.5, 0.25], dtype=torch.float64))
    assert float(share.detach()) == 0.5 * 1.0 + 0.25 * 5.0
    share.backward()
    assert values.grad is not None
    assert torch.isfinite(values.grad).all()
