"""verl's own ``main_ppo`` with the lossreduce trainer mode and the policy losses beyond
``vanilla``, on CPU: one launch per family.

- **GSPO with a critic**: ``actor.policy_loss.loss_mode=gspo`` (a sequence-level ratio)
  in lossreduce's ``seq_mean`` (GSPO's own aggregation), PPO with GAE advantages
  (``algorithm.adv_estimator=gae``), so verl's critic trains too, through
  ``LossReduceCriticWorker`` with a normalizer of its own (group ``critic``).
- **Clip-Cov**: ``loss_mode=clip_cov`` with GRPO (conftest's ``clip_cov_float32``, shared
  with ``test_main_ppo_resume.py`` as its uninterrupted run): the covariance and the draw
  taken over the whole mini-batch (a no-grad forward, then the statistics' rounds through
  the job's own coordinator actor, group ``actor.stats``), in float32, one mini-batch a
  step, so each mini-batch's statistic reuses ``old_log_prob`` (the trainer mode says the
  actor recomputed it for this update) instead of a forward. ``kl_cov`` takes the same
  pass and rounds (its top share instead of the draw), and the forward runs on a step's
  later mini-batches; their tests are the worker's (``test_verl_policy_losses.py``).

3 steps each (GSPO: 2 mini-batches a step), on 2 gloo ranks, everything verl's own but
the CPU rollout. 1 to 1.5 minutes a launch on 2 cores.
"""

from __future__ import annotations

import pytest

from tests.trainer_worker.integrations.verl.main_ppo_launch import (
    STEPS,
    Launch,
    launched,
    step_data,
)

MINI_BATCHES = 2

pytestmark = pytest.mark.timeout(900)

GSPO_WITH_CRITIC = [
    "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
    "trainer.v1.trainer_mode=lossreduce",
    "+actor_rollout_ref.lossreduce.mode=seq_mean",
]


@pytest.fixture(scope="module")
def gspo_run(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    return launched(tmp_path_factory.mktemp("gspo-critic"), GSPO_WITH_CRITIC, critic=True)


def _rounds(data: dict[str, float], role: str, step: int, mini_batches: int = MINI_BATCHES) -> None:
    first = (step - 1) * mini_batches
    assert data[f"{role}/lossreduce/round_min"] == first
    assert data[f"{role}/lossreduce/round_max"] == first + mini_batches - 1
    assert data[f"{role}/lossreduce/skipped"] == 0.0


def test_gspo_and_the_critic_take_their_normalizers_every_mini_batch(gspo_run: Launch) -> None:
    for step in range(1, STEPS + 1):
        data = step_data(gspo_run, step)
        _rounds(data, "actor", step)
        _rounds(data, "critic", step)
        # seq_mean: the responses of a mini-batch (4, all active); the critic's
        # token_mean: its tokens, the same count as the actor's KL term.
        assert data["actor/lossreduce/normalizer/pg"] == 4.0
        assert data["critic/lossreduce/normalizer/vf"] == data["actor/lossreduce/normalizer/kl"]
        assert data["critic/lossreduce/normalizer/vf"] > 0.0
    assert any(step_data(gspo_run, s)["critic/grad_norm"] > 0 for s in range(1, STEPS + 1))


def test_the_critic_claims_its_group_at_start_up(gspo_run: Launch) -> None:
    assert "group 'critic' from round 0" in gspo_run.output
    assert "group 'actor' from round 0" in gspo_run.output


def test_clip_cov_draws_over_each_whole_mini_batch(clip_cov_float32: Launch) -> None:
    for step in range(1, STEPS + 1):
        data = step_data(clip_cov_float32, step)
        _rounds(data, "actor", step, mini_batches=1)
        # max(1, int(0.2 * N)) of the mini-batch's N active tokens (more where a drawn
        # token's twin, the same response to the same prompt, comes with it), drawn among
        # more candidates: another draw would zero other tokens' loss.
        tokens = data["actor/lossreduce/stats/active_tokens"]
        assert tokens == data["actor/lossreduce/normalizer/pg"]
        drawn = data["actor/lossreduce/stats/selected"]
        assert drawn >= max(1, int(0.2 * tokens))
        assert data["actor/lossreduce/stats/candidates"] > drawn
        # One mini-batch a step, whose old_log_prob the actor recomputed with the same
        # weights (the trainer mode says so): its statistic reuses it, no forward.
        assert data["actor/lossreduce/stats/forward_skipped"] == 1.0
    assert all(step_data(clip_cov_float32, s)["actor/grad_norm"] > 0 for s in range(1, STEPS + 1))
