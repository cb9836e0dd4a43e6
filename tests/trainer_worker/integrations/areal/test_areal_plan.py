"""The plan's weight check, as a property: in every mode, a ``loss_weight_fn`` value
is accepted exactly when it is AReaL's active-token count, and an invalid one
(NaN, inf, negative) is what the round is sent, so every rank's error names it.

Pure torch, no processes: :func:`plan_batch` runs before any round or forward.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossreduce.rules import check_partial
from lossreduce.trainer_worker.integrations.areal.plan import (
    GROUP_KEY,
    POLICY_TERM,
    plan_batch,
)
from lossreduce.trainer_worker.policy_gradient import PolicyGradientReduction

MODES = {
    "token_mean": PolicyGradientReduction("token_mean"),
    "seq_mean": PolicyGradientReduction("seq_mean"),
    "prompt_mean": PolicyGradientReduction("prompt_mean"),
    "constant": PolicyGradientReduction("constant", divisor=8.0),
}

# The weight a caller's loss_weight_fn may give, relative to the true count.
WEIGHTS = st.one_of(
    st.just("count"),
    st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -0.0]),
    st.floats(min_value=-1e9, max_value=1e9, allow_nan=False),
)


@settings(max_examples=200, deadline=None)
@given(
    mode=st.sampled_from(sorted(MODES)),
    mask=st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=1, max_size=5),
    weight=WEIGHTS,
)
def test_a_weight_is_accepted_only_when_it_is_the_token_count(
    mode: str, mask: list[list[bool]], weight: object
) -> None:
    loss_mask = torch.tensor(mask, dtype=torch.float32)  # [B, T]
    rows = loss_mask.shape[0]
    batch = {
        "loss_mask": loss_mask,
        "advantages": torch.ones_like(loss_mask),
        GROUP_KEY: torch.arange(rows)[:, None].expand(rows, 4) // 2,  # [B, T]: pairs of rows
    }
    count = float(loss_mask.sum())
    value = count if weight == "count" else float(weight)  # type: ignore[arg-type]
    plan = plan_batch(MODES[mode], batch, value)
    weight_problems = [p for p in plan.problems if "loss_weight_fn" in p]
    invalid = check_partial(value) is not None
    # -0.0 == 0.0: a zero count given as -0.0 is that count.
    assert bool(weight_problems) == (invalid or value != count), (value, count, plan.problems)
    assert len(plan.problems) == len(weight_problems)  # the rest of the batch is fine
    if weight_problems:
        shown = "nan" if math.isnan(value) else str(value)
        assert f"loss_weight_fn gives {shown} " in weight_problems[0]
    if invalid:
        # The round sees the bad value itself in every mode, not the mode's own unit.
        pg = plan.partials[POLICY_TERM]
        assert check_partial(pg) is not None
        assert math.isnan(pg) if math.isnan(value) else pg == value
