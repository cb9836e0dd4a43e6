"""The critic's per-token value loss (:func:`~lossreduce.trainer_worker.integrations.skyrl.plan.
value_token_loss`) against SkyRL's own ``ppo_critic_loss``, in this process: SkyRL's loss is
the mean over the rows of each row's token mean of it, with and without ``value_clip``."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossreduce.trainer_worker.integrations.skyrl.plan import value_token_loss


@settings(max_examples=100, deadline=None)
@given(
    rows=st.integers(1, 4),
    width=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    value_clip=st.sampled_from([None, 0.05, 0.2, 1.0]),
)
def test_skyrls_critic_loss_is_a_mean_of_row_means_of_the_token_loss(
    rows: int, width: int, seed: int, value_clip: float | None
) -> None:
    from skyrl.backends.skyrl_train.utils.ppo_utils import ppo_critic_loss

    gen = torch.Generator().manual_seed(seed)
    values, old, returns = (torch.randn(rows, width, generator=gen) for _ in range(3))
    mask = (torch.rand(rows, width, generator=gen) > 0.3).float()
    skyrls, _ = ppo_critic_loss(
        values, old, returns, config=SimpleNamespace(value_clip=value_clip), loss_mask=mask
    )
    per_token = value_token_loss(values, old, returns, value_clip)  # [B, T]
    row_means = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    torch.testing.assert_close(row_means.mean(), skyrls, rtol=1e-6, atol=1e-7)
