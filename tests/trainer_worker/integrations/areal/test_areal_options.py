"""What the AReaL integration decides before any process group: the version
check, refusals at construction, the settings, the per-batch plan and the
gradient weighting (in this process, the real AReaL config classes)."""

from __future__ import annotations

import math

import pytest
import torch
from areal.api.cli_args import PPOActorConfig, PPOConfig, TeacherConfig
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.integrations.areal import (
    ArealReductionSettings,
    LossReduceFSDPPPOActor,
    LossReducePPOTrainer,
    check_areal_version,
)
from lossreduce.trainer_worker.integrations.areal.actor import _gradient_scaled, _with_groups
from lossreduce.trainer_worker.integrations.areal.plan import (
    GROUP_KEY,
    ROW_KEY,
    plan_batch,
    token_weights,
)
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode, PolicyGradientReduction


def _actor_config(**options: object) -> PPOActorConfig:
    return PPOActorConfig(experiment_name="e", trial_name="t", path="/nonexistent", **options)


def test_the_areal_version_is_checked_at_import() -> None:
    check_areal_version("1.0.4")
    with pytest.raises(ImportError, match=r"areal>=1\.0\.4,<1\.0\.5, but areal 1\.1\.0"):
        check_areal_version("1.1.0")


@pytest.mark.parametrize(
    ("option", "named"),
    [
        ({"enable_tree_training": True}, "enable_tree_training=True"),
        ({"is_critic": True}, "is_critic=True"),
    ],
)
def test_what_would_be_silently_wrong_is_refused_at_construction(
    option: dict[str, object], named: str
) -> None:
    # Refused before AReaL's engine reads the (here missing) model folder.
    with pytest.raises(ReductionConfigError, match=named):
        LossReduceFSDPPPOActor(_actor_config(**option), reduction=ArealReductionSettings())


def test_a_teacher_needs_token_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AREAL_SPMD_MODE", "1")  # torchrun's launch, where reduction= applies
    teacher = TeacherConfig(engine_type="train", train=_actor_config())
    config = PPOConfig(experiment_name="e", trial_name="t", teacher=teacher)
    with pytest.raises(ReductionConfigError, match="teacher is set"):
        LossReducePPOTrainer(
            config, reduction=ArealReductionSettings(mode=PolicyGradientMode.SEQ_MEAN)
        )


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOSSREDUCE_MODE", "constant")
    monkeypatch.setenv("LOSSREDUCE_DIVISOR", "512")
    monkeypatch.setenv("LOSSREDUCE_ON_EMPTY_STEP", "skip")
    got = ArealReductionSettings()
    assert got.reduction.contract == "mean:constant:divisor=512"
    assert got.on_empty_step == "skip"


def test_settings_take_a_coordinator_without_address_and_refuse_constant_without_divisor() -> None:
    # No address: the ranks start or join the job's coordinator actor on their Ray cluster
    # (test_areal_actor's joined case), and outside one ask for the address at the first
    # step (its unjoined case).
    settings = ArealReductionSettings(normalizer="coordinator")
    assert settings.coordinator is None
    assert ArealReductionSettings.joins_ray_coordinator
    with pytest.raises(ValidationError, match="divisor"):
        ArealReductionSettings(mode=PolicyGradientMode.CONSTANT)


# -- the plan: the worked example of docs/reduction-semantics.md ------------------------------

MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.float32)
GROUPS = torch.tensor([0, 0, 1, 1])[:, None].expand(4, 3)


def _batch(**changes: torch.Tensor) -> dict[str, torch.Tensor]:
    batch = {
        "loss_mask": MASK.clone(),
        "advantages": torch.ones(4, 3),
        "logprobs": torch.zeros(4, 3),
        GROUP_KEY: GROUPS,
    }
    batch.update(changes)
    return batch


@pytest.mark.parametrize(
    ("mode", "divisor", "normalizer", "weights"),
    [
        ("token_mean", None, 10.0, [1, 1, 1, 1]),
        ("seq_mean", None, 4.0, [1 / 3, 1, 1 / 3, 1 / 3]),
        ("prompt_mean", None, 2.0, [1 / 4, 1 / 4, 1 / 6, 1 / 6]),
        ("constant", 10.0, 4.0, [0.1, 0.1, 0.1, 0.1]),
    ],
)
def test_the_plan_gives_the_worked_examples_losses(
    mode: str, divisor: float | None, normalizer: float, weights: list[float]
) -> None:
    plan = plan_batch(PolicyGradientReduction(mode, divisor), _batch(), token_weight=10.0)
    assert plan.problems == ()
    assert plan.partials == {"pg": normalizer, "rows": 4.0}
    torch.testing.assert_close(plan.row_weights, torch.tensor(weights, dtype=torch.float64))
    # The docs' per-token losses l = [[1]*3, [1]*3, [3]*3, [3]*3] under these weights.
    loss = torch.tensor([1.0, 1.0, 3.0, 3.0], dtype=torch.float64)[:, None].expand(4, 3)
    per_token = token_weights(plan, {"pg": normalizer}, MASK)
    want = {"token_mean": 2.2, "seq_mean": 2.0, "prompt_mean": 2.0, "constant": 0.55}[mode]
    assert float((per_token * loss * MASK).sum()) == pytest.approx(want, rel=1e-15)


def test_non_finite_inputs_are_problems_only_at_active_tokens() -> None:
    advantages = torch.ones(4, 3)
    advantages[1, 2] = math.nan  # masked: harmless
    logprobs = torch.zeros(4, 3)
    logprobs[2, 1] = -math.inf
    plan = plan_batch(
        PolicyGradientReduction("token_mean"),
        _batch(advantages=advantages, logprobs=logprobs),
        10.0,
    )
    assert plan.problems == ("logprobs is -inf at active token (row 2, position 1)",)


def test_a_problem_names_its_row_as_ppo_update_received_it() -> None:
    """AReaL splits ``ppo_update``'s batch into ``ppo_n_minibatches`` optimizer steps by
    balancing lengths, out of order: the actor numbers every row there (``ROW_KEY``) and a
    problem names that number, not the row's place in the step's batch."""
    data = [
        {"attention_mask": torch.ones(2, 3)},
        {"attention_mask": torch.ones(3, 5)},
    ]
    tagged = _with_groups(data)
    assert [d[ROW_KEY][:, 0].tolist() for d in tagged] == [[0, 1], [2, 3, 4]]
    assert [d[GROUP_KEY][:, 0].tolist() for d in tagged] == [[0, 0], [1, 1, 1]]
    assert all(d[ROW_KEY].shape == d["attention_mask"].shape for d in tagged)
    # A step's batch holding rows 4, 0, 3 and 1 of ppo_update's, in that order.
    advantages = torch.ones(4, 3)
    advantages[2, 1] = math.nan
    rows = torch.tensor([4, 0, 3, 1])[:, None].expand(4, 3)
    plan = plan_batch(
        PolicyGradientReduction("token_mean"),
        _batch(advantages=advantages, **{ROW_KEY: rows}),
        10.0,
    )
    assert plan.problems == ("advantages is nan at active token (row 3, position 1)",)


def test_a_mask_that_is_not_0_or_1_and_a_wrong_weight_are_problems() -> None:
    mask = MASK.clone()
    mask[0, 0] = math.inf
    plan = plan_batch(PolicyGradientReduction("token_mean"), _batch(loss_mask=mask), 10.0)
    assert plan.problems[0].startswith("loss_mask holds inf at (row 0, position 0)")
    plan = plan_batch(PolicyGradientReduction("seq_mean"), _batch(), 12.0)
    assert "loss_weight_fn gives 12.0" in plan.problems[0]


def test_prompt_mean_without_groups_is_a_problem() -> None:
    batch = _batch()
    del batch[GROUP_KEY]
    plan = plan_batch(PolicyGradientReduction("prompt_mean"), batch, 10.0)
    assert "needs the batch's prompt groups" in plan.problems[0]


def test_a_teacher_makes_distill_a_term_of_its_own() -> None:
    plan = plan_batch(
        PolicyGradientReduction("token_mean"), _batch(teacher_logp=torch.zeros(4, 3)), 10.0
    )
    assert plan.partials == {"pg": 10.0, "rows": 4.0, "distill": 10.0}
    assert plan.contracts["distill"] == "mean:token_mean"


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=8),
    st.floats(0.0, 1e3),
)
def test_gradient_scaling_keeps_the_value_and_scales_the_gradient(
    values: list[float], scale: float
) -> None:
    x = torch.tensor(values, requires_grad=True)
    factors = torch.full_like(x, scale)
    y = _gradient_scaled(x, factors)
    assert torch.equal(y.detach(), x.detach())
    (y * 2.0).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, 2.0 * factors)


def test_lossreduce_actor_puts_the_mixin_first_once_per_class() -> None:
    from areal.engine.fsdp_engine import FSDPPPOActor

    from lossreduce.trainer_worker.integrations.areal import LossReduceActorMixin, lossreduce_actor

    assert lossreduce_actor(FSDPPPOActor) is LossReduceFSDPPPOActor

    class OtherActor(FSDPPPOActor):  # type: ignore[misc]
        """Stands for MegatronPPOActor or ArchonPPOActor, which cannot be imported here."""

    made = lossreduce_actor(OtherActor)
    assert made.__mro__[1:3] == (LossReduceActorMixin, OtherActor)
    assert lossreduce_actor(OtherActor) is made


def test_reduction_settings_are_refused_in_single_controller_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The controller's workers read LOSSREDUCE_* from their environment, never the
    trainer's ``reduction``: refused before AReaL's init, naming what to set instead."""
    monkeypatch.delenv("AREAL_SPMD_MODE", raising=False)
    config = PPOConfig(experiment_name="e", trial_name="t")
    with pytest.raises(ReductionConfigError) as caught:
        LossReducePPOTrainer(
            config, reduction=ArealReductionSettings(mode=PolicyGradientMode.SEQ_MEAN)
        )
    message = str(caught.value)
    for needle in ("single-controller mode", "LOSSREDUCE_*", "scheduling_spec env_vars"):
        assert needle in message, message


@pytest.mark.parametrize("build", ["trainer", "actor"])
def test_a_bad_variable_is_refused_before_areal_starts_naming_it(
    build: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One line naming the variable, its value and the choices, before AReaL's own init
    (here, before it reads its config at all)."""
    monkeypatch.setenv("LOSSREDUCE_MODE", "bogus")
    cls = LossReducePPOTrainer if build == "trainer" else LossReduceFSDPPPOActor
    with pytest.raises(ReductionConfigError) as caught:
        cls(config=None)
    message = str(caught.value)
    assert "\n" not in message
    assert "LOSSREDUCE_MODE=bogus: must be one of token_mean, seq_mean, prompt_mean, constant" in (
        message
    )
