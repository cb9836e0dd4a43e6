"""The statistic lossreduce's SkyRL trainer takes over the whole batch: the z-score of the
advantages (``trainer.algorithm.advantage_batch_normalize``), in this process.

SkyRL's driver centres the advantages on the mean of every entry of the batch (padding
and masked tokens too) and scales them by their deviation over the response tokens, so
one NaN under the mask turns every advantage NaN, and lossreduce's check of the
mini-batch then blames every active token. ``LossReduceRayPPOTrainer`` takes both over
the active tokens only (:func:`~lossreduce.trainer_worker.integrations.skyrl.plan.z_score`).
The worker-level runs (a masked NaN trains as a 0 there, an active NaN is refused naming
its row alone) are in ``test_skyrl_worker.py``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossreduce.trainer_worker.integrations.skyrl.plan import z_score
from tests.trainer_worker.integrations.skyrl import tiny_skyrl

# Importing SkyRL's trainer in this process imports torch._inductor, whose mkldnn module
# uses torch.jit.script_method.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)


def _trainer_self() -> Any:
    """What ``_normalize_advantages`` reads of its trainer: the config, z-score on."""
    from lossreduce.trainer_worker.integrations.skyrl.config import LossReduceSkyRLConfig

    cfg = LossReduceSkyRLConfig()
    cfg.trainer.algorithm.advantage_batch_normalize = True
    return SimpleNamespace(cfg=cfg)


def _masked_nan_batch() -> Any:
    """The tiny mini-batch with a NaN advantage at every token of its masked response."""
    batch = tiny_skyrl.rows()
    advantages = batch.advantages.clone()
    advantages[tiny_skyrl.MASKED_ROW] = math.nan
    return tiny_skyrl.training_batch(tiny_skyrl.with_advantages(batch, advantages))


@pytest.fixture(scope="module")
def trainers() -> tuple[Any, Any]:
    """SkyRL's ``RayPPOTrainer`` and lossreduce's (imported with the CPU platform)."""
    from lossreduce.trainer_worker.cpu_standins.skyrl.platform import install

    install()
    from skyrl.train.trainer import RayPPOTrainer

    from lossreduce.trainer_worker.integrations.skyrl.trainer import LossReduceRayPPOTrainer

    return RayPPOTrainer, LossReduceRayPPOTrainer


def test_skyrls_own_z_score_spreads_a_masked_nan_to_every_advantage(
    trainers: tuple[Any, Any],
) -> None:
    stock, _ = trainers
    data = _masked_nan_batch()
    out = stock._normalize_advantages(_trainer_self(), data, [(0, tiny_skyrl.BATCH)])
    assert bool(out["advantages"].isnan().all())


def test_lossreduces_z_score_reads_active_tokens_only(trainers: tuple[Any, Any]) -> None:
    """The trainer's z-score leaves every active advantage finite, with mean 0 and
    variance 1 over the active tokens, and those equal the batch's with 0 under the mask."""
    _, ours = trainers
    data = _masked_nan_batch()
    mask = data["loss_mask"].bool()
    boundaries = tiny_skyrl.rows().prompt_boundaries()
    out = ours._normalize_advantages(_trainer_self(), data, [(0, tiny_skyrl.BATCH)], boundaries)
    active = out["advantages"][mask].double()
    assert bool(active.isfinite().all())
    assert abs(float(active.mean())) < 1e-7
    assert float(active.var(unbiased=False)) == pytest.approx(1.0, rel=1e-6)
    zeroed = torch.where(mask, tiny_skyrl.rows().advantages, 0.0)
    assert torch.equal(z_score(zeroed, data["loss_mask"])[mask], out["advantages"][mask])


def test_where_every_entry_is_active_it_is_skyrls_z_score(trainers: tuple[Any, Any]) -> None:
    """Without padding or a masked token both take the same mean and deviation."""
    stock, _ = trainers
    gen = torch.Generator().manual_seed(5)
    advantages = torch.randn(6, 4, generator=gen)
    ones = torch.ones(6, 4, dtype=torch.long)
    data = tiny_skyrl.training_batch(
        tiny_skyrl.Rows(
            sequences=torch.ones(6, 6, dtype=torch.long),
            attention_mask=torch.ones(6, 6, dtype=torch.long),
            response_mask=ones,
            loss_mask=ones,
            advantages=advantages,
            old_log_probs=torch.zeros(6, 4),
            ref_log_probs=torch.zeros(6, 4),
            group=torch.arange(6),
            values=torch.zeros(6, 4),
            returns=torch.zeros(6, 4),
        )
    )
    # SkyRL then divides by its token_mean count (24); undo it to read the z-score alone.
    skyrls = stock._normalize_advantages(_trainer_self(), data, [(0, 6)])["advantages"] * 24
    torch.testing.assert_close(z_score(advantages, ones), skyrls, rtol=1e-6, atol=1e-6)


_VALUES = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 5),
    width=st.integers(1, 6),
    data=st.data(),
)
def test_masked_entries_move_nothing_and_a_bad_active_token_stays_where_it_is(
    rows: int, width: int, data: st.DataObject
) -> None:
    shape = (rows, width)
    n = rows * width
    values = torch.tensor(data.draw(st.lists(_VALUES, min_size=n, max_size=n))).view(shape)
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n))).view(shape)
    junk = data.draw(st.sampled_from([math.nan, math.inf, -math.inf, 7.0]))
    scored = z_score(values, mask.long())
    # Anything under the mask: the active tokens' z-scores do not move.
    polluted = torch.where(mask, values, junk)
    assert torch.equal(z_score(polluted, mask.long())[mask], scored[mask])
    if int(mask.sum()) >= 2:
        active = scored[mask].double()
        assert abs(float(active.mean())) <= 1e-4 * max(1.0, float(active.abs().max()))
    # A non-finite active token stays non-finite and alone.
    if bool(mask.any()):
        where = int(data.draw(st.integers(0, int(mask.sum()) - 1)))
        flat = mask.flatten().nonzero().flatten()[where]
        bad = values.clone().flatten()
        bad[flat] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        out = z_score(bad.view(shape), mask.long()).flatten()
        finite = out.isfinite()
        assert not bool(finite[flat])
        others = mask.flatten().clone()
        others[flat] = False
        assert bool(finite[others].all())
