"""AReaL's M2PO (``actor.m2_threshold``) with the LossReduce actor, on the real AReaL
1.0.4 ``ppo_update`` (FSDP, gloo, CPU; :mod:`.areal_runs`).

One fixed step of 56 active tokens whose recomputed ``prox_logp`` drifted from
the rollout's log-probabilities (:func:`.areal_runs.m2po_prox`), under
``use_decoupled_loss=true``, ``prox_logp_method=recompute`` and
``m2_threshold=0.04``. Layouts: one rank or two; one micro-batch per rank
(``whole``), one sequence per micro-batch (``one``) or several (``several``).

- Stock AReaL and the LossReduce actor with ``m2po='local'`` decide the mask
  per micro-batch: the update moves with the layout (measured here, numbers on
  docs/frameworks/areal.md).
- With ``m2po='global'`` (the default) the update is the same in every layout
  and equals the formula over the tokens a mask decided over the whole step
  keeps, in every mode; AReaL's loss sees exactly those tokens.
- Edges: every token masked, a rank without active tokens, NaN or inf in either
  log-probability, ``prox_logp_method=loglinear``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from areal.api.cli_args import PPOActorConfig
from areal.trainer.ppo.actor import _apply_m2po_masking, grpo_loss_fn
from areal.utils.data import concat_batch

from lossreduce.errors import ReductionConfigError
from lossreduce.ports import free_port
from lossreduce.trainer_worker.integrations.areal import (
    ArealReductionSettings,
    LossReduceFSDPPPOActor,
)
from lossreduce.trainer_worker.integrations.areal.m2po import (
    RoundPlace,
    global_mask,
    loss_threshold,
    without_local_m2po,
)
from lossreduce.trainer_worker.integrations.areal.plan import plan_batch
from lossreduce.trainer_worker.normalizers import LocalNormalizer
from lossreduce.trainer_worker.policy_gradient import PolicyGradientReduction
from tests.trainer_worker.integrations.areal import actor_checks as checks
from tests.trainer_worker.integrations.areal import areal_runs, m2po_runs
from tests.trainer_worker.integrations.areal.actor_checks import RankResults
from tests.trainer_worker.integrations.areal.areal_runs import (
    GROUP_SIZES,
    M2_THRESHOLD,
    MODES,
    ONE_PER_MB,
    SEVERAL_PER_MB,
    SHARDS,
    WHOLE_SHARD,
    Case,
    Job,
)

Results = Callable[[int], RankResults]

LAYOUTS = {"one": ONE_PER_MB, "several": SEVERAL_PER_MB, "whole": WHOLE_SHARD}
GLOBAL_LAYOUTS: dict[str, dict[int, tuple[str, ...]]] = {
    "token_mean": {1: ("one", "whole"), 2: ("one", "whole")},
    "seq_mean": {1: ("one", "several", "whole"), 2: ("one", "whole")},
    "prompt_mean": {1: ("one", "several", "whole"), 2: ("one",)},
    "constant": {1: ("one", "whole"), 2: ("one",)},
}
"""The global mask's layouts per mode (every mode on one and two ranks, one sequence
per micro-batch and the whole shard in one)."""
SPLIT_LAYOUTS: dict[int, tuple[str, ...]] = {1: ("one", "whole"), 2: ("one", "whole")}
"""The layouts the per-micro-batch mask is measured in."""
SPLIT_CASES = ("stock", "local-seq_mean")
"""Stock AReaL (a token mean) and the LossReduce actor with m2po='local' in seq_mean."""


def _m2po(name: str, **fields: Any) -> Case:
    return Case(name, data=fields.pop("data", "m2po"), m2_threshold=M2_THRESHOLD, **fields)


def _cases(world: int, target: str) -> list[Case]:
    cases = []
    for layout in SPLIT_LAYOUTS[world]:
        cases.append(_m2po(f"stock-{layout}", impl="stock", max_tokens=LAYOUTS[layout]))
        cases.append(
            _m2po(
                f"local-seq_mean-{layout}",
                mode="seq_mean",
                m2po="local",
                max_tokens=LAYOUTS[layout],
            )
        )
    for mode, layouts in GLOBAL_LAYOUTS.items():
        cases += [
            _m2po(f"global-{mode}-{layout}", mode=mode, max_tokens=LAYOUTS[layout])
            for layout in layouts[world]
        ]
    cases.append(_m2po("masked-odd", mode="seq_mean", data="m2po_masked_odd"))
    if world == 1:
        return cases
    cases += [
        _m2po("coordinator-token_mean", normalizer="coordinator"),
        _m2po("nan-prox", data="m2po_nan_prox", optimizer="adamw", prelude=1),
        _m2po("inf-old", data="m2po_inf_old", normalizer="coordinator", optimizer="adamw"),
        _m2po("all-cut-raise", data="m2po_all_cut", optimizer="adamw"),
        _m2po(
            "all-cut-skip",
            data="m2po_all_cut",
            on_empty_step="skip",
            optimizer="adamw",
            prelude=1,
        ),
    ]
    return areal_runs.with_coordinator(cases, target)


@pytest.fixture(scope="module")
def results(coordinator_target: str, tmp_path_factory: pytest.TempPathFactory) -> Results:
    """world size -> every rank's results (each world run once per module)."""
    model_dir = areal_runs.save_model(tmp_path_factory.mktemp("tiny-qwen2"))

    def run(world: int) -> RankResults:
        return areal_runs.run(
            Job(
                world,
                _cases(world, coordinator_target),
                str(model_dir),
                str(tmp_path_factory.mktemp(f"m2po-world{world}")),
                free_port(),
                extra={"m2po_reference": "m2po"} if world == 1 else {},
            )
        )

    return checks.cached_runs(run, "AReaL M2PO world")


def _reference(results: Results) -> dict[str, Any]:
    reference: dict[str, Any] = results(1)[0]["m2po_reference"]
    return reference


def _kept_per_group(data: str = "m2po") -> list[int]:
    rows = [areal_runs.group_rows(g, data) for g in range(len(GROUP_SIZES))]
    return [int(k.sum()) for k in m2po_runs.global_m2po_keep(rows, M2_THRESHOLD)]


def _layouts(world_layouts: dict[int, tuple[str, ...]], name: str) -> list[tuple[int, str]]:
    return [(w, f"{name}-{layout}") for w, layouts in world_layouts.items() for layout in layouts]


# -- the split dependence of AReaL's per-micro-batch mask ---------------------------------------


def test_the_data_has_a_mask_to_decide() -> None:
    kept = _kept_per_group()
    active = [
        int(areal_runs.group_rows(g, "m2po")["loss_mask"].count_nonzero())
        for g in range(len(GROUP_SIZES))
    ]
    assert sum(active) == 56
    assert sum(kept) == 54  # the global mask drops two tokens


@pytest.mark.parametrize("name", SPLIT_CASES)
def test_a_per_micro_batch_mask_depends_on_the_split(results: Results, name: str) -> None:
    start = results(1)[0][f"{name}-whole"]["initial"]
    updates = {
        (world, case): checks.update(results(world)[0][case])
        for world, case in _layouts(SPLIT_LAYOUTS, name)
    }
    # Kept tokens (AReaL's loss counts what its mask left) per layout, over the ranks.
    kept = {
        (world, case): sum(r[case]["stats"]["n_valid_tokens"] for r in results(world))
        for world, case in _layouts(SPLIT_LAYOUTS, name)
    }
    assert kept == {
        (1, f"{name}-one"): 49,
        (1, f"{name}-whole"): 54,
        (2, f"{name}-one"): 49,
        (2, f"{name}-whole"): 54,
    }
    one_seq = updates[(1, f"{name}-one")]
    whole = updates[(1, f"{name}-whole")]
    # One sequence per micro-batch moves the update; the same micro-batches on two
    # ranks do not.
    assert checks.relative(one_seq, whole, start) > 0.1
    assert checks.relative(updates[(2, f"{name}-one")], one_seq, start) < 1e-6
    # Two ranks of one micro-batch each keep as many tokens, not the same ones.
    assert checks.relative(updates[(2, f"{name}-whole")], whole, start) > 0.01


def test_stock_areal_with_one_micro_batch_is_the_global_formula(
    results: Results,
) -> None:
    result = results(1)[0]["stock-whole"]
    want = _reference(results)["token_mean"]["params"]
    assert checks.relative(checks.update(result), want, result["initial"]) < 1e-6


# -- the global mask: invariant and the formula ---------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_the_global_mask_gives_the_formula_in_every_layout(results: Results, mode: str) -> None:
    want = _reference(results)[mode]["params"]
    start = results(1)[0][f"global-{mode}-one"]["initial"]
    for world, case in _layouts(GLOBAL_LAYOUTS[mode], f"global-{mode}"):
        for rank, result in enumerate(results(world)):
            error = checks.relative(checks.update(result[case]), want, start)
            assert error < 1e-6, f"world {world} rank {rank} {case}: {error}"


@pytest.mark.parametrize("mode", MODES)
def test_areals_loss_sees_exactly_the_globally_kept_tokens(results: Results, mode: str) -> None:
    kept = _kept_per_group()
    for world, case in _layouts(GLOBAL_LAYOUTS[mode], f"global-{mode}"):
        for rank, result in enumerate(results(world)):
            stats = result[case]["stats"]
            # AReaL's own per-micro-batch mask was off: its loss counted the
            # kept tokens of this rank's shard, no fewer.
            assert stats["n_valid_tokens"] == sum(kept[g] for g in SHARDS[world][rank])
            assert stats["lossreduce/m2po/kept"] == sum(kept)
            assert stats["lossreduce/m2po/active"] == 56


def test_areals_own_mask_would_have_cut_more_after_the_global_cut() -> None:
    # After the global cut, some one-sequence micro-batch still has a mean m2 above
    # the threshold: AReaL's mask, left on, would cut it again.
    keep = m2po_runs.global_m2po_keep(
        [areal_runs.group_rows(g, "m2po") for g in range(len(GROUP_SIZES))], M2_THRESHOLD
    )
    extra = 0
    for g in range(len(GROUP_SIZES)):
        rows = areal_runs.group_rows(g, "m2po")
        for i in range(GROUP_SIZES[g]):
            mask = keep[g][i : i + 1]
            local = _apply_m2po_masking(
                rows["logprobs"][i : i + 1], rows["prox_logp"][i : i + 1], mask, M2_THRESHOLD
            )
            extra += int(mask.sum()) - int(local.sum())
    assert extra > 0


def test_the_coordinator_gives_the_torch_backends_update(
    results: Results,
) -> None:
    for rank in (0, 1):
        run = results(2)[rank]
        coordinator = checks.update(run["coordinator-token_mean"])
        torch_backend = checks.update(run["global-token_mean-one"])
        assert all(torch.equal(coordinator[n], torch_backend[n]) for n in torch_backend)
        assert run["coordinator-token_mean"]["stats"]["lossreduce/m2po/kept"] == 54


def test_the_loss_function_loses_only_its_m2po() -> None:
    loss_fn = functools.partial(
        grpo_loss_fn, eps_clip=0.2, eps_clip_higher=None, c_clip=None, m2_threshold=0.04
    )
    assert loss_threshold(loss_fn) == 0.04
    off = without_local_m2po(loss_fn)
    assert isinstance(off, functools.partial)
    assert off.func is grpo_loss_fn
    assert off.keywords == {**loss_fn.keywords, "m2_threshold": None}
    assert loss_threshold(off) is None


def _one_process() -> RoundPlace:
    return RoundPlace(LocalNormalizer(job="m2po", group="actor.m2po"), 0, 1, "m2po", "actor.m2po")


def _step_batch() -> dict[str, Any]:
    batch: dict[str, Any] = concat_batch(
        [areal_runs.group_rows(g, "m2po") for g in range(len(GROUP_SIZES))]
    )[0]
    return batch


M2PO_LOSS = functools.partial(
    grpo_loss_fn, eps_clip=0.2, eps_clip_higher=None, c_clip=None, m2_threshold=M2_THRESHOLD
)


def test_the_mask_in_one_process_is_the_reference() -> None:
    batch = _step_batch()
    masked = global_mask(batch, M2PO_LOSS, M2_THRESHOLD, _one_process, 0)
    assert masked is not None
    want = torch.cat(
        m2po_runs.global_m2po_keep(
            [areal_runs.group_rows(g, "m2po") for g in range(len(GROUP_SIZES))], M2_THRESHOLD
        )
    )  # [B, T]
    assert torch.equal(masked.batch["loss_mask"] != 0, want)
    assert (masked.cut.kept, masked.cut.total) == (54, 56)
    assert loss_threshold(masked.loss_fn) is None
    # Everything else in the batch is untouched.
    assert all(masked.batch[k] is batch[k] for k in batch if k != "loss_mask")


@pytest.mark.parametrize(("mode", "partial"), [("token_mean", 51.0), ("seq_mean", 13.0)])
def test_the_normalizers_count_the_kept_tokens(mode: str, partial: float) -> None:
    # The first response drifts far on its 3 active tokens: the mask drops them
    # all, so the response is inactive (seq_mean counts 13 of 14), and they leave
    # the token count with the 2 the step's mask drops anyway (51 kept of 56).
    batch = _step_batch()
    first = batch["loss_mask"][0] != 0  # [T]
    batch["prox_logp"][0] = torch.where(first, batch["logprobs"][0] + 1.0, batch["prox_logp"][0])
    masked = global_mask(batch, M2PO_LOSS, M2_THRESHOLD, _one_process, 0)
    assert masked is not None
    assert not bool(masked.batch["loss_mask"][0].any())
    plan = plan_batch(
        PolicyGradientReduction(mode),
        masked.batch,
        float(masked.batch["loss_mask"].count_nonzero()),
    )
    assert plan.partials["pg"] == partial
    assert masked.cut.kept == 51


def test_no_threshold_is_no_mask() -> None:
    loss_fn = functools.partial(grpo_loss_fn, eps_clip=0.2, eps_clip_higher=None, c_clip=None)
    assert global_mask(_step_batch(), loss_fn, None, _one_process, 0) is None


def test_a_mask_without_prox_logp_or_an_unknown_loss_is_refused() -> None:
    batch = _step_batch()
    batch.pop("prox_logp")
    with pytest.raises(ReductionConfigError, match=r"step 3: m2_threshold=0\.04 .* prox_logp"):
        global_mask(batch, M2PO_LOSS, M2_THRESHOLD, _one_process, 3)

    def own_loss(logprobs: torch.Tensor, entropy: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor:
        return logprobs.sum()

    with pytest.raises(ReductionConfigError, match="needs AReaL's grpo_loss_fn"):
        global_mask(_step_batch(), own_loss, M2_THRESHOLD, _one_process, 0)


# -- edges, the same on every rank ----------------------------------------------------------------


def test_a_rank_without_active_tokens_takes_part(
    results: Results,
) -> None:
    one = results(1)[0]["masked-odd"]
    kept = _kept_per_group("m2po_masked_odd")
    assert sum(kept[g] for g in SHARDS[2][1]) == 0
    checks.two_ranks_give_one(one, results(2), "masked-odd", same_on_ranks=False)
    for rank, result in enumerate(results(2)):
        got = result["masked-odd"]
        assert got["stats"]["lossreduce/m2po/kept"] == sum(kept)
        assert got["stats"]["n_valid_tokens"] == sum(kept[g] for g in SHARDS[2][rank])


def test_a_nan_log_probability_is_named_on_every_rank(
    results: Results,
) -> None:
    (kind0, msg0), (kind1, msg1) = checks.errors(results(2), "nan-prox")
    assert kind0 == "InvalidPartialError", msg0
    assert "rank 0" in msg0, msg0
    assert "m2 value nan at row 0 position 2" in msg0, msg0
    assert kind1 == "RoundAbortedError", msg1
    assert "[0]" in msg1, msg1


def test_an_inf_log_probability_is_named_on_every_rank_through_the_coordinator(
    results: Results,
) -> None:
    (kind0, msg0), (kind1, msg1) = checks.errors(results(2), "inf-old")
    assert kind1 == "InvalidPartialError", msg1
    assert "rank 1" in msg1, msg1
    assert "m2 value inf" in msg1, msg1
    assert kind0 == "RoundAbortedError", msg0
    assert "[1]" in msg0, msg0


def test_every_token_masked_is_an_empty_step_on_every_rank(
    results: Results,
) -> None:
    for kind, message in checks.errors(results(2), "all-cut-raise"):
        assert kind == "EmptyNormalizerError", message
    assert checks.errors(results(2), "all-cut-skip") == [("", ""), ("", "")]
    for result in results(2):
        stats = result["all-cut-skip"]["stats"]
        assert stats["update_successful"] == 0.0
        assert stats["lossreduce/skipped"] == 1.0
        assert stats["lossreduce/m2po/kept"] == 0.0


# -- refused before training ---------------------------------------------------------------------


def test_a_mask_that_needs_the_forward_is_refused_at_construction() -> None:
    config = PPOActorConfig(
        experiment_name="e",
        trial_name="t",
        path="/nonexistent",
        m2_threshold=M2_THRESHOLD,
        use_decoupled_loss=True,
        prox_logp_method="loglinear",
    )
    with pytest.raises(ReductionConfigError) as refused:
        LossReduceFSDPPPOActor(config, reduction=ArealReductionSettings())
    message = str(refused.value)
    assert "m2_threshold=0.04" in message
    assert "prox_logp_method='loglinear'" in message
    assert "before the forward" in message
    # m2po='local' keeps AReaL's own mask: accepted (it fails later, on the model path).
    with pytest.raises(OSError, match="nonexistent"):
        LossReduceFSDPPPOActor(config, reduction=ArealReductionSettings(m2po="local"))


def test_the_m2po_setting_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ArealReductionSettings().m2po == "global"
    monkeypatch.setenv("LOSSREDUCE_M2PO", "local")
    assert ArealReductionSettings().m2po == "local"
    monkeypatch.setenv("LOSSREDUCE_M2PO", "bogus")
    config = PPOActorConfig(experiment_name="e", trial_name="t", path="/nonexistent")
    with pytest.raises(ReductionConfigError, match="LOSSREDUCE_M2PO=bogus"):
        LossReduceFSDPPPOActor(config)
