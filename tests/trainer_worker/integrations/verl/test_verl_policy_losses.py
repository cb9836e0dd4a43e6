"""Every policy loss verl 0.9.1 registers, through LossReduceTrainingWorker and verl's real engine.

One PPO mini-batch (the tiny batch, its old and reference log-probabilities near the
model's own so that clipping, covariances and importance weights act) per case, on
verl's FSDP2 engine on CPU, with plain SGD at lr 1 (the update is minus the gradient):

- against the formulas: the update of :func:`policy_references.policy_update`, verl's own
  loss function called once on the whole mini-batch with verl's aggregation for the
  mode (a statistic verl takes over its call is then taken over the whole mini-batch),
  in every mode that has a meaning for the loss;
- split invariance: 1 and 2 ranks, micro-batches of 1, 2 and 4 and ``use_dynamic_bsz``;
- the A/B: stock verl's ``TrainingWorker`` seeing the whole mini-batch in one call (one
  rank, one micro-batch) against lossreduce in the same aggregation;
- stock verl's split dependence for ``clip_cov``, ``kl_cov``, ``geo_mean`` and a
  normalized ``bypass_mode`` next to lossreduce's invariance (and its ``per_call``
  scope, which is verl's behaviour);
- the statistics' rounds through the coordinator, bit for bit with torch.distributed;
  a rank whose share is empty taking part;
- ``clip_cov``'s draw on a rerun: two launches of one config with verl's default job
  (whose rounds carry each launch's run id) draw the same tokens, on 1 and 2 ranks, and
  another ``actor.data_loader_seed`` draws others;
- the statistics pass where it is free: with ``old_log_prob`` recomputed by the worker
  itself (verl's ``compute_log_prob``) and the trainer mode's flag, a step's first
  mini-batch takes its statistic from ``old_log_prob`` instead of a forward, and trains
  as with the forward (``reuse_old_log_prob=False``): bit for bit on 2 ranks, to float32
  rounding on 1 rank with micro-batches of 1 (where the two forwards differ by one step).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer_worker.integrations.verl import policy_references, tiny_verl
from tests.trainer_worker.integrations.verl.verl_runs import (
    LR,
    Case,
    LayoutRuns,
    batch_of,
    relative,
)

UPDATE_RTOL = 1e-6
"""Between two runs of verl's engine (layouts, backends, stock verl): float32 reordering."""
FORMULA_RTOL = 1e-5
"""Against the one-process reference (Hugging Face's forward, not verl's engine)."""
SPLIT_DEPENDENT = 1e-3
"""What a split-dependent statistic moves the update by, at least, on this batch."""


def _bypass(**fields: Any) -> Any:
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    return RolloutCorrectionConfig(**fields)


# loss name (as the tests call it) -> (verl loss_mode, actor.policy_loss options)
LOSSES: dict[str, tuple[str, tuple[tuple[str, Any], ...]]] = {
    "vanilla": ("vanilla", ()),
    "dppo_tv": ("dppo_tv", ()),
    "dppo_kl": ("dppo_kl", ()),
    "gspo": ("gspo", ()),
    "sapo": ("sapo", ()),
    "gpg": ("gpg", ()),
    # A share of 0.2: 4 of 22 tokens drawn among the candidates (covariance in (0, 10)).
    "clip_cov": (
        "clip_cov",
        (("clip_cov_ratio", 0.2), ("clip_cov_lb", 0.0), ("clip_cov_ub", 10.0)),
    ),
    # Every candidate drawn: the draw no longer matters, so verl's randperm and
    # lossreduce's seeded keys select the same tokens (the formula and A/B cases).
    "clip_cov_all": (
        "clip_cov",
        (("clip_cov_ratio", 1.0), ("clip_cov_lb", 0.0), ("clip_cov_ub", 10.0)),
    ),
    "kl_cov": ("kl_cov", (("kl_cov_ratio", 0.2),)),
    "geo_mean": ("geo_mean", ()),
    "dro": ("dro", (("dro_beta", 0.1),)),
    "cispo": ("cispo", ()),
    "bypass_mode": ("bypass_mode", ()),
    # REINFORCE with token importance weights normalized to mean 1 and token rejection.
    "bypass_reinforce": (
        "bypass_mode",
        (
            (
                "rollout_correction",
                _bypass(
                    loss_type="reinforce",
                    rollout_is="token",
                    rollout_is_threshold=2.0,
                    rollout_is_batch_normalize=True,
                    rollout_rs="token_k1",
                    rollout_rs_threshold="0.85_1.15",
                ),
            ),
        ),
    ),
}
SEQ_MEAN_ONLY = {"sapo", "geo_mean"}
MODES: dict[str, float | None] = {
    "token_mean": None,
    "seq_mean": None,
    "prompt_mean": None,
    "constant": float(tiny_verl.RESPONSE_LEN),
}
FORMULA_LOSSES = [name for name in LOSSES if name != "clip_cov"]
SPLIT_LOSSES = [name for name in LOSSES if name != "clip_cov_all"]
# (ranks, micro-batch size per rank, use_dynamic_bsz) against the formula case's dp1-mb2.
SPLITS: dict[str, tuple[int, int, bool]] = {
    "dp1-mb1": (1, 1, False),
    "dp1-dyn": (1, 4, True),
    "dp2-mb1": (2, 1, False),
    "dp2-mb2": (2, 2, False),
    "dp2-dyn": (2, 2, True),
}
# verl's per-call statistics, and the layouts that show them.
PER_CALL = ["clip_cov", "kl_cov", "geo_mean", "bypass_reinforce"]
WITH_STATISTIC = {"clip_cov", "kl_cov", "bypass_reinforce"}
"""geo_mean's mean over the call's rows is the aggregation itself, always lossreduce's."""
DEPENDENCE_ONE = "dp1-mb4"
"""The one-rank layout of stock verl's split dependence: 2 calls of 4 responses."""


def dependence_two(loss: str) -> str:
    """The two-rank layout: 4 calls of 1 response on each rank (verl's geo_mean sums
    their means, so its update doubles), but micro-batches of 2 for bypass_mode: rank 1
    would get a call of only the fully masked response, where stock verl's bypass_mode
    raises on that rank alone and leaves rank 0 waiting in its next collective."""
    return "dp2-mb2" if loss == "bypass_reinforce" else "dp2-mb1"


VERL_AGG = {"token_mean": "token-mean", "seq_mean": "seq-mean-token-mean"}


def modes_of(loss: str) -> list[str]:
    return ["seq_mean"] if loss in SEQ_MEAN_ONLY else list(MODES)


def split_mode(loss: str) -> str:
    """One mode per loss for the layouts: ``prompt_mean`` where it applies to a loss with
    a statistic (its row weights span ranks), else the loss's first mode."""
    if loss in SEQ_MEAN_ONLY:
        return "seq_mean"
    return "prompt_mean" if loss in {"kl_cov", "bypass_reinforce"} else "token_mean"


CLIP_COV_JOB = "test-clip_cov"
"""Every clip_cov case's job: the draw is seeded by (job, data_loader_seed, round)."""
DEFAULT_JOB = "verl-ppo"
"""verl's default job, as the draw keys it: without the run id its rounds carry."""
OTHER_LOADER_SEED = 7
"""An ``actor.data_loader_seed`` other than verl's default 42."""
# A rerun: clip_cov with the default job under two run ids (two launches), and a third
# launch with another data_loader_seed. (name, run, data_loader_seed)
RERUNS: list[tuple[str, str, int | None]] = [
    ("clip_cov-rerun-a", "launch-a", None),
    ("clip_cov-rerun-b", "launch-b", None),
    ("clip_cov-rerun-seed", "launch-a", OTHER_LOADER_SEED),
]


REUSED = ["kl_cov", "clip_cov", "bypass_reinforce"]
"""The losses whose statistic needs the current log-probabilities."""


# layout name -> (ranks, micro-batch size, mini-batches) of the reuse cases, against the
# recompute's inference micro-batches of 4.
REUSE_LAYOUTS: dict[str, tuple[int, int, int]] = {
    # The two forwards agree bit for bit; the second mini-batch runs the forward.
    "dp2-mb2": (2, 2, 2),
    # Training micro-batches of 1: the two forwards round one of the 22 tokens'
    # log-probability differently (2.4e-7, one float32 step).
    "dp1-mb1": (1, 1, 1),
}


def reuse_cases(world: int) -> list[Case]:
    """Each of :data:`REUSED` in the :data:`REUSE_LAYOUTS` of ``world`` ranks,
    ``old_log_prob`` recomputed by the worker and flagged current: reusing it on the first
    mini-batch, and not."""
    return [
        loss_case(
            f"{loss}-{'reused' if reuse else 'forward'}-{layout}",
            loss,
            split_mode(loss),
            batch="default",
            mini_batches=mini_batches,
            recomputed=True,
            reuse=reuse,
            micro=micro,
        )
        for layout, (ranks, micro, mini_batches) in REUSE_LAYOUTS.items()
        if ranks == world
        for loss in REUSED
        for reuse in (True, False)
    ]


def rerun_cases(world: int) -> list[Case]:
    """:data:`RERUNS` on ``world`` ranks (micro-batches of 2 on one, of 1 on two)."""
    return [
        loss_case(
            name, "clip_cov", "token_mean", job="", run=run, loader_seed=seed, micro=3 - world
        )
        for name, run, seed in RERUNS
    ]


def loss_case(name: str, loss: str, mode: str, **fields: Any) -> Case:
    loss_mode, options = LOSSES[loss]
    if loss == "clip_cov":
        fields.setdefault("job", CLIP_COV_JOB)
    return Case(
        name,
        mode=mode,
        divisor=MODES[mode],
        loss_mode=loss_mode,
        policy_loss=options,
        batch=fields.pop("batch", "near"),
        **fields,
    )


def stock_case(name: str, loss: str, agg: str, **fields: Any) -> Case:
    loss_mode, options = LOSSES[loss]
    return Case(
        name,
        worker="verl",
        loss_agg_mode=agg,
        loss_mode=loss_mode,
        policy_loss=options,
        batch=fields.pop("batch", "near"),
        **fields,
    )


def dp1_cases() -> list[Case]:
    cases = [
        loss_case(f"{loss}-{mode}", loss, mode)
        for loss in FORMULA_LOSSES
        for mode in modes_of(loss)
    ]
    cases += [
        loss_case(f"{loss}-{split}", loss, split_mode(loss), micro=micro, dynamic=dynamic)
        for loss in SPLIT_LOSSES
        for split, (ranks, micro, dynamic) in SPLITS.items()
        if ranks == 1
    ]
    # The A/B: stock verl sees the whole mini-batch in one call.
    cases += [
        stock_case(f"verl-{loss}", loss, "token-mean", micro=tiny_verl.BATCH)
        for loss in FORMULA_LOSSES
        if loss not in SEQ_MEAN_ONLY
    ]
    # verl counts a fully masked response in its seq-mean denominators: no such row here.
    cases += [
        case
        for loss in sorted(SEQ_MEAN_ONLY)
        for case in (
            # verl ignores loss_agg_mode for these policy losses; token-mean keeps its KL
            # and entropy token means, as lossreduce's are.
            stock_case(f"verl-{loss}-dense", loss, "token-mean", micro=8, batch="near-dense"),
            loss_case(f"{loss}-dense", loss, "seq_mean", batch="near-dense"),
        )
    ]
    cases += dependence_cases(1)
    cases += rerun_cases(1)
    cases += reuse_cases(1)
    return cases


def dependence_cases(world: int) -> list[Case]:
    cases = []
    for loss in PER_CALL:
        split = DEPENDENCE_ONE if world == 1 else dependence_two(loss)
        micro = int(split.removeprefix(f"dp{world}-mb"))
        # The same torch seed before every build: verl's clip_cov draws with torch.randperm.
        cases.append(stock_case(f"verl-{loss}-{split}", loss, "token-mean", micro=micro, seed=7))
        if loss in WITH_STATISTIC:
            cases.append(
                loss_case(
                    f"{loss}-per_call-{split}",
                    loss,
                    split_mode(loss),
                    micro=micro,
                    statistics="per_call",
                )
            )
        if world == 1:
            cases.append(loss_case(f"{loss}-{split}", loss, split_mode(loss), micro=micro))
    return cases


def dp2_cases(target: str) -> list[Case]:
    cases = [
        loss_case(f"{loss}-{split}", loss, split_mode(loss), micro=micro, dynamic=dynamic)
        for loss in SPLIT_LOSSES
        for split, (ranks, micro, dynamic) in SPLITS.items()
        if ranks == 2
    ]
    cases += dependence_cases(2)
    cases += [
        # The statistics' rounds through a coordinator (group actor.stats).
        loss_case(
            "kl_cov-coordinator",
            "kl_cov",
            "prompt_mean",
            normalizer="coordinator",
            coordinator=target,
        ),
        loss_case(
            "clip_cov-coordinator",
            "clip_cov",
            "token_mean",
            normalizer="coordinator",
            coordinator=target,
        ),
        loss_case(
            "bypass_reinforce-coordinator",
            "bypass_reinforce",
            "prompt_mean",
            normalizer="coordinator",
            coordinator=target,
        ),
        # Rank 1 holds no active token: it takes part in every round and trains nothing.
        *(
            loss_case(f"{loss}-rank1-masked", loss, split_mode(loss), batch="near-rank1_masked")
            for loss in ("kl_cov", "clip_cov", "bypass_reinforce", "geo_mean")
        ),
        loss_case("kl_cov-nan", "kl_cov", "token_mean", batch="near-nan_advantage"),
        *rerun_cases(2),
        *reuse_cases(2),
    ]
    return cases


@pytest.fixture(scope="module")
def results(
    model_dir: Path, coordinator_target: str, tmp_path_factory: pytest.TempPathFactory
) -> LayoutRuns:
    return LayoutRuns(
        lambda world: dp2_cases(coordinator_target) if world == 2 else dp1_cases(),
        model_dir,
        tmp_path_factory.mktemp("policy-losses"),
    )


def actor_config(loss: str, loader_seed: int | None = None) -> Any:
    from verl.workers.config import ActorConfig, PolicyLossConfig

    loss_mode, options = LOSSES[loss]
    return ActorConfig(
        strategy="fsdp2",
        ppo_mini_batch_size=tiny_verl.BATCH,
        ppo_micro_batch_size_per_gpu=2,
        clip_ratio=tiny_verl.CLIP,
        rollout_n=1,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, **dict(options)),
        **({} if loader_seed is None else {"data_loader_seed": loader_seed}),
    )


def clip_cov_reference(
    model_dir: Path, rows: tiny_verl.Rows, drawn: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``clip_cov``'s update with its own draw off (no covariance is above +inf) and the
    ``drawn`` tokens' loss zeroed: a token mean weighted 0 there."""
    config = actor_config("clip_cov")
    off = dataclasses.replace(
        config, policy_loss=dataclasses.replace(config.policy_loss, clip_cov_lb=math.inf)
    )
    return policy_references.policy_update(
        model_dir, rows, off, "token_mean", lr=LR, token_weights=(~drawn).float()
    )


def formula(model_dir: Path, loss: str, mode: str, batch: str = "near") -> dict[str, torch.Tensor]:
    rows = batch_of(Case("reference", batch=batch), model_dir)
    return policy_references.policy_update(
        model_dir, rows, actor_config(loss), mode, MODES[mode], lr=LR
    )


# -- every loss, every mode, against the formulas --------------------------------------------


@pytest.mark.parametrize(
    ("loss", "mode"), [(loss, mode) for loss in FORMULA_LOSSES for mode in modes_of(loss)]
)
def test_every_loss_in_every_mode_equals_the_formula(
    results: LayoutRuns, model_dir: Path, loss: str, mode: str
) -> None:
    (got,) = results.case(1, f"{loss}-{mode}")
    assert relative(got["update"], formula(model_dir, loss, mode)) <= FORMULA_RTOL
    want_pg = {"token_mean": 22.0, "seq_mean": 7.0, "prompt_mean": 2.0, "constant": 7.0}[mode]
    assert got["normalizers"] == {"pg": want_pg, "kl": 22.0, "entropy": 22.0}


def split_base(loss: str) -> str:
    """The dp1 case each layout is compared with: the formula case (micro-batches of 2),
    or for the drawing clip_cov (no formula case) its dp1 case with micro-batches of 4."""
    return "clip_cov-dp1-mb4" if loss == "clip_cov" else f"{loss}-{split_mode(loss)}"


@pytest.mark.parametrize("loss", SPLIT_LOSSES)
@pytest.mark.parametrize("split", list(SPLITS))
def test_every_loss_trains_the_same_whatever_the_split(
    results: LayoutRuns, loss: str, split: str
) -> None:
    world = SPLITS[split][0]
    (base,) = results.case(1, split_base(loss))
    for rank, got in enumerate(results.case(world, f"{loss}-{split}")):
        assert relative(got["update"], base["update"]) <= UPDATE_RTOL, (loss, split, rank)
        assert got["normalizers"] == base["normalizers"]


def test_clip_covs_draw_is_the_documented_seeded_draw_in_every_layout(
    results: LayoutRuns, model_dir: Path
) -> None:
    """4 of the 22 active tokens (share 0.2) are drawn among the candidates by the keys of
    (job, round, row in the mini-batch, position): the update equals the formula with
    exactly those tokens' loss zeroed, in every layout, and the draw is a real one (more
    candidates than drawn)."""
    rows = batch_of(Case("reference", batch="near"), model_dir)
    config = actor_config("clip_cov")
    drawn = policy_references.clip_cov_draw(model_dir, rows, config, CLIP_COV_JOB)
    assert int(drawn.sum()) == 4
    want = clip_cov_reference(model_dir, rows, drawn)
    for split, world in [("dp1-mb4", 1), *((s, SPLITS[s][0]) for s in SPLITS)]:
        for got in results.case(world, f"clip_cov-{split}"):
            metrics = got["metrics"]
            assert metrics["lossreduce/stats/active_tokens"] == [22.0]
            assert metrics["lossreduce/stats/selected"] == [4.0]
            assert metrics["lossreduce/stats/candidates"][0] > 4.0
            assert relative(got["update"], want) <= FORMULA_RTOL, split


def test_clip_covs_draw_is_the_same_on_a_rerun_and_moves_with_the_data_loader_seed(
    results: LayoutRuns, model_dir: Path
) -> None:
    """Two launches of one config with verl's default job run under run ids of their own
    (their rounds' jobs differ) and draw the same tokens, those of the job without the run
    id: the same update bit for bit, the formula's with those tokens zeroed, on 1 and 2
    ranks. Another ``data_loader_seed`` draws other tokens (and moves the update)."""
    rows = batch_of(Case("reference", batch="near"), model_dir)
    want = {}
    for seed in (None, OTHER_LOADER_SEED):
        config = actor_config("clip_cov", seed)
        drawn = policy_references.clip_cov_draw(model_dir, rows, config, DEFAULT_JOB)
        assert int(drawn.sum()) == 4
        want[seed] = clip_cov_reference(model_dir, rows, drawn)
    assert relative(want[OTHER_LOADER_SEED], want[None]) >= SPLIT_DEPENDENT
    for world in (1, 2):
        first, second, other = (results.case(world, name) for name, _, _ in RERUNS)
        for rank in range(world):
            assert first[rank]["job"] == f"{DEFAULT_JOB}-launch-a"
            assert second[rank]["job"] == f"{DEFAULT_JOB}-launch-b"
            for name, delta in first[rank]["update"].items():
                assert torch.equal(second[rank]["update"][name], delta), (world, rank, name)
            assert relative(first[rank]["update"], want[None]) <= FORMULA_RTOL, (world, rank)
            assert relative(other[rank]["update"], want[OTHER_LOADER_SEED]) <= FORMULA_RTOL
            assert other[rank]["metrics"]["lossreduce/stats/selected"] == [4.0]


@pytest.mark.parametrize("layout", list(REUSE_LAYOUTS))
@pytest.mark.parametrize("loss", REUSED)
def test_the_first_mini_batch_reuses_old_log_prob_and_trains_the_same(
    results: LayoutRuns, loss: str, layout: str
) -> None:
    """The weights that recomputed old_log_prob train the first mini-batch: its statistic
    from old_log_prob (no forward) equals the forward's, and a later mini-batch (moved
    weights) runs the forward. Bit for bit where the two forwards agree bit for bit,
    within float32 reordering where they differ by one rounding step: the same tokens
    selected, the importance mean to 1e-6, the same update to 1e-6."""
    world, _, mini_batches = REUSE_LAYOUTS[layout]
    exact = layout == "dp2-mb2"
    reused = results.case(world, f"{loss}-reused-{layout}")
    forward = results.case(world, f"{loss}-forward-{layout}")
    for rank in range(world):
        ours, theirs = reused[rank]["metrics"], forward[rank]["metrics"]
        assert ours["lossreduce/stats/forward_skipped"] == [1.0] + [0.0] * (mini_batches - 1)
        assert theirs["lossreduce/stats/forward_skipped"] == [0.0] * mini_batches
        stats = [k for k in theirs if k.startswith("lossreduce/stats/") and "skipped" not in k]
        assert stats, theirs.keys()
        for key in stats:
            if exact or not key.endswith("importance_mean"):
                assert ours[key] == theirs[key], (rank, key)
            else:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-6), (rank, key)
        if exact:
            for name, delta in forward[rank]["update"].items():
                assert torch.equal(reused[rank]["update"][name], delta), (rank, name)
        else:
            assert relative(reused[rank]["update"], forward[rank]["update"]) <= UPDATE_RTOL


# -- the A/B against stock verl ---------------------------------------------------------------


@pytest.mark.parametrize("loss", [loss for loss in FORMULA_LOSSES if loss not in SEQ_MEAN_ONLY])
def test_equals_stock_verl_seeing_the_mini_batch_in_one_call(
    results: LayoutRuns, loss: str
) -> None:
    (ours,) = results.case(1, f"{loss}-token_mean")
    (stock,) = results.case(1, f"verl-{loss}")
    assert relative(ours["update"], stock["update"]) <= UPDATE_RTOL


@pytest.mark.parametrize("loss", sorted(SEQ_MEAN_ONLY))
def test_sequence_losses_equal_stock_verl_in_seq_mean(results: LayoutRuns, loss: str) -> None:
    (ours,) = results.case(1, f"{loss}-dense")
    (stock,) = results.case(1, f"verl-{loss}-dense")
    assert relative(ours["update"], stock["update"]) <= UPDATE_RTOL


# -- verl's per-call statistics: split-dependent in stock verl, not in lossreduce -------------


@pytest.mark.parametrize("loss", PER_CALL)
def test_stock_verl_depends_on_the_split_and_lossreduce_does_not(
    results: LayoutRuns, loss: str
) -> None:
    two = dependence_two(loss)
    (stock_one,) = results.case(1, f"verl-{loss}-{DEPENDENCE_ONE}")
    stock_two = results.case(2, f"verl-{loss}-{two}")
    (ours_one,) = results.case(1, f"{loss}-{DEPENDENCE_ONE}")
    ours_two = results.case(2, f"{loss}-{two}")
    for rank in range(2):
        assert relative(stock_two[rank]["update"], stock_one["update"]) >= SPLIT_DEPENDENT, rank
        assert relative(ours_two[rank]["update"], ours_one["update"]) <= UPDATE_RTOL, rank
    if loss in WITH_STATISTIC:
        # statistics='per_call' is verl's behaviour: split-dependent too.
        (call_one,) = results.case(1, f"{loss}-per_call-{DEPENDENCE_ONE}")
        for got in results.case(2, f"{loss}-per_call-{two}"):
            assert relative(got["update"], call_one["update"]) >= SPLIT_DEPENDENT


# -- backends, empty shares, bad input ----------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "torch_case"),
    [
        ("kl_cov-coordinator", "kl_cov-dp2-mb2"),
        ("clip_cov-coordinator", "clip_cov-dp2-mb2"),
        ("bypass_reinforce-coordinator", "bypass_reinforce-dp2-mb2"),
    ],
)
def test_the_statistics_through_the_coordinator_equal_torch_distributed_bit_for_bit(
    results: LayoutRuns, case: str, torch_case: str
) -> None:
    for got, want in zip(results.case(2, case), results.case(2, torch_case), strict=True):
        assert got["normalizers"] == want["normalizers"]
        for name, delta in want["update"].items():
            assert torch.equal(got["update"][name], delta), name


@pytest.mark.parametrize("loss", ["kl_cov", "clip_cov", "bypass_reinforce", "geo_mean"])
def test_a_rank_without_active_tokens_takes_part_in_the_statistics(
    results: LayoutRuns, model_dir: Path, loss: str
) -> None:
    mode = split_mode(loss)
    rows = batch_of(Case("ref", batch="near-rank1_masked"), model_dir)
    if loss == "clip_cov":
        # 2 of the 14 active tokens (share 0.2), all of them on rank 0.
        drawn = policy_references.clip_cov_draw(model_dir, rows, actor_config(loss), CLIP_COV_JOB)
        assert int(drawn.sum()) == 2
        want = clip_cov_reference(model_dir, rows, drawn)
    else:
        want = policy_references.policy_update(
            model_dir, rows, actor_config(loss), mode, MODES[mode], lr=LR
        )
    for got in results.case(2, f"{loss}-rank1-masked"):
        assert relative(got["update"], want) <= FORMULA_RTOL


def test_a_nan_advantage_stops_every_rank_before_the_statistics_pass(results: LayoutRuns) -> None:
    culprit, peer = results.case(2, "kl_cov-nan", ok=False)[::-1]
    assert culprit["error"]["type"] == "InvalidPartialError", culprit.get("traceback")
    assert peer["error"]["type"] == "RoundAbortedError", peer.get("traceback")
    for got in (culprit, peer):
        assert all(not bool(d.any()) for d in got["update"].values())
