"""LossReduceGRPOTrainer against the real TRL on CPU: partition invariance, TRL's own
loss types on the same data, AdamW's state across an empty step the coordinator skipped,
and the round behind the first forward (alone and through the coordinator). What every
framework keeps (empty steps raised or skipped on every process, a NaN under the mask
harmless, the coordinator's answer bit for bit, ...) is TRL's row of the contract table,
``test_contract.py``.

Each layout (processes x gradient accumulation, steps per generation) runs
all its cases once (two-process layouts are spawned with gloo on loopback)
and the tests read the cached results. The completions of a step are fixed
(``tiny_grpo.Rollout``), so the expected update of one plain-SGD optimizer
step comes from :func:`tiny_grpo.reference_update`, the formulas evaluated
row by row in one process without TRL.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl", reason="needs the trl extra: pip install 'lossreduce[trl]'")

from lossreduce.ports import free_port
from tests.trainer_worker.integrations.trl import tiny_grpo
from tests.trainer_worker.integrations.trl.trl_runs import LR, Case, Layout, run

pytestmark = [
    # transformers and TRL announce their own deprecations while a trainer is built.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*experimental.*:UserWarning"),
]

MODES: dict[str, float | None] = {
    "token_mean": None,
    "seq_mean": None,
    "prompt_mean": None,
    "constant": float(tiny_grpo.MAX_COMPLETION),
}
# The mode cases' loss type -> (prefix of their names, beta): sapo's KL is refused.
FORMULA_CASES = {"dapo": ("", 0.05), "sapo": ("sapo-", 0.0)}
TRL_LOSS_TYPES = ["dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
ENTROPY = 0.1
# Where stock TRL and lossreduce divide by the same count: no KL (TRL divides it as the
# policy term), no entropy bonus, no masked completion (TRL counts masked rows).
SAME_COUNT: dict[str, Any] = {"beta": 0.0, "entropy_coef": 0.0, "mask_truncated": False}

LAYOUTS = {
    "1x1": Layout("1x1", processes=1, per_device=12, accumulation=1, steps_per_generation=1),
    "1x4": Layout("1x4", processes=1, per_device=3, accumulation=4, steps_per_generation=4),
    "2x2": Layout("2x2", processes=2, per_device=3, accumulation=2, steps_per_generation=2),
    "2x1-spg2": Layout(
        "2x1-spg2", processes=2, per_device=3, accumulation=1, steps_per_generation=2
    ),
}
UPDATE_RTOL = 1e-5
"""max |update - reference update| / max |reference update|: float32 reordering
is ~1e-7 here; a wrong normalizer is off by tens of percent."""
OWN_RTOL = 1e-6
"""The same against stock TRL's own update, measured at most 3.6e-7."""


def mode_cases() -> list[Case]:
    return [Case(name=m, mode=m, divisor=d, entropy_coef=ENTROPY) for m, d in MODES.items()]


def trl_cases() -> list[Case]:
    return [
        Case(name=f"trl-{lt}-H{h}", trainer="trl", loss_type=lt, entropy_coef=h)
        for lt in TRL_LOSS_TYPES
        for h in (0.0, ENTROPY)
    ]


def own_division_cases() -> list[Case]:
    """Every loss type in its own division, lossreduce's (``own-``) and stock TRL's
    (``stock-``, one process), where both divide by the same count."""
    return [
        Case(name=f"own-{lt}", loss_type=lt, mode=mode, divisor=divisor, **SAME_COUNT)
        for lt, (mode, divisor) in tiny_grpo.OWN_DIVISION.items()
    ]


def sapo_cases() -> list[Case]:
    """sapo (beta=0, its KL refused) in every mode with the entropy bonus."""
    return [
        Case(name=f"sapo-{m}", loss_type="sapo", mode=m, divisor=d, beta=0.0)
        for m, d in MODES.items()
    ]


def empty_case(name: str, **fields: Any) -> Case:
    """Step 1 trains, step 2 has only truncated (masked) completions; AdamW."""
    defaults: dict[str, Any] = {"optim": "adamw_torch", "max_steps": 2, "empty_from_step": 1}
    return Case(name=name, **{**defaults, **fields})


def reuse_case() -> Case:
    """Each generation batch trained on twice (num_iterations=2): two optimizer steps."""
    return Case(name="reuse", mode="prompt_mean", num_iterations=2, max_steps=2)


def overlap_cases() -> list[Case]:
    """The policy-gradient term alone (beta=0, no entropy): the first forward of a
    step may run while its round is in flight; the same run without that (also for
    sapo, whose division is undone per row)."""
    pg_only: dict[str, Any] = {"mode": "prompt_mean", "beta": 0.0, "entropy_coef": 0.0}
    return [
        Case(name="overlap", **pg_only),
        Case(name="no-overlap", overlap=False, **pg_only),
        Case(name="sapo-overlap", loss_type="sapo", **pg_only),
        Case(name="sapo-no-overlap", loss_type="sapo", overlap=False, **pg_only),
        empty_case("overlap-empty-raise", on_empty_step="raise", **pg_only),
        empty_case("overlap-empty-skip", on_empty_step="skip", **pg_only),
    ]


def cases_for(layout: str, target: str) -> list[Case]:
    if layout == "1x1":
        return [
            *trl_cases(),
            reuse_case(),
            *[
                Case(name=f"stock-{lt}", trainer="trl", loss_type=lt, **SAME_COUNT)
                for lt in tiny_grpo.OWN_DIVISION
            ],
            # luspo in the default token_mean, against stock luspo (trl-luspo-H0.0).
            Case(name="luspo-token_mean", loss_type="luspo", entropy_coef=0.0),
        ] + [
            empty_case(f"trl-{lt}-empty", trainer="trl", loss_type=lt, beta=0.0, entropy_coef=0.0)
            for lt in TRL_LOSS_TYPES
        ]
    if layout == "1x4":
        return [*mode_cases(), *trl_cases(), reuse_case(), *own_division_cases(), *sapo_cases()]
    if layout == "2x2":
        return [
            *mode_cases(),
            reuse_case(),
            *trl_cases(),
            *own_division_cases(),
            *sapo_cases(),
            *overlap_cases(),
            Case(
                name="coordinator-overlap",
                mode="prompt_mean",
                beta=0.0,
                entropy_coef=0.0,
                normalizer="coordinator",
                coordinator=target,
            ),
            empty_case(
                "coordinator-empty-skip",
                mode="prompt_mean",
                on_empty_step="skip",
                normalizer="coordinator",
                coordinator=target,
            ),
        ]
    return [
        *mode_cases(),
        *sapo_cases(),
        Case(name="trl-dapo-H0.0", trainer="trl", entropy_coef=0.0),
    ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_grpo.save_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def results(
    model_dir: Path, coordinator_target: str, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], list[dict[str, Any]]]:
    """layout name -> every process's results of its cases (run once per module)."""
    cache: dict[str, list[dict[str, Any]]] = {}
    root = Path(__file__).resolve().parents[4]

    def get(layout: str) -> list[dict[str, Any]]:
        if layout not in cache:
            with pytest.MonkeyPatch.context() as patch:
                # Spawned ranks import the run module by name.
                patch.syspath_prepend(str(root))
                out = tmp_path_factory.mktemp(layout)
                cache[layout] = run(
                    LAYOUTS[layout],
                    cases_for(layout, coordinator_target),
                    model_dir,
                    out,
                    free_port(),
                )
            for rank, result in enumerate(cache[layout]):
                assert "crash" not in result, f"{layout} rank {rank}: {result['crash']}"
        return cache[layout]

    return get


def case_results(
    results: Callable[[str], list[dict[str, Any]]], layout: str, case: str
) -> list[dict[str, Any]]:
    per_rank = [r[case] for r in results(layout)]
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"{layout} {case} rank {rank}: {result['traceback']}"
    return per_rank


def relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return tiny_grpo.relative_error(got, want)


def norm(update: dict[str, torch.Tensor]) -> float:
    """The update's L2 norm over every parameter."""
    return math.sqrt(sum(float(u.double().pow(2).sum()) for u in update.values()))


# -- partition invariance --------------------------------------------------------------


@pytest.mark.parametrize("loss_type", list(FORMULA_CASES))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layout", ["1x4", "2x2", "2x1-spg2"])
def test_one_optimizer_step_equals_the_formula_whatever_the_split(
    results: Callable[[str], list[dict[str, Any]]],
    model_dir: Path,
    layout: str,
    mode: str,
    loss_type: str,
) -> None:
    """sapo's gradient at ratio 1 is the clipped loss's, -A * grad(log p), so the same
    reference holds for it (with beta=0: its KL is refused)."""
    prefix, beta = FORMULA_CASES[loss_type]
    per_rank = case_results(results, layout, prefix + mode)
    # The completions the first optimizer step trained on, over every process
    # (with steps_per_generation=2 and no accumulation: half the generation batch).
    rows = [tiny_grpo.Row(p, g) for r in per_rank for p, g in r["rows"]]
    want_rows = len(tiny_grpo.PROMPTS) * tiny_grpo.NUM_GENERATIONS
    assert len(rows) == want_rows // (2 if layout == "2x1-spg2" else 1)
    want = tiny_grpo.reference_update(
        model_dir,
        rows,
        mode=mode,
        divisor=MODES[mode],
        lr=LR,
        beta=beta,
        entropy_coef=ENTROPY,
        mask_truncated=True,
    )
    for rank, result in enumerate(per_rank):
        assert relative(result["update"], want) <= UPDATE_RTOL, (layout, loss_type, mode, rank)
        for name, delta in want.items():
            expected = result["before"][name] + delta
            got = result["before"][name] + result["update"][name]
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    # Every process holds the same parameters after the step.
    for result in per_rank[1:]:
        for name, delta in per_rank[0]["update"].items():
            assert torch.equal(result["update"][name], delta), name


@pytest.mark.parametrize("layout", ["1x4", "2x2"])
def test_reused_generations_train_the_same_whatever_the_split(
    results: Callable[[str], list[dict[str, Any]]], layout: str
) -> None:
    """num_iterations=2: the second step reuses the batch off-policy (ratios and
    clipping now matter); both steps still match one process and one micro-step."""
    (whole,) = case_results(results, "1x1", "reuse")
    assert len(whole["params"]) == 2
    for result in case_results(results, layout, "reuse"):
        assert relative(result["update"], whole["update"]) <= UPDATE_RTOL
        # Only the first pass over the batch ran (and waited for) a round.
        first, second = result["logs"]
        assert first["lossreduce/round_latency_s"] > 0.0
        assert second["lossreduce/round_latency_s"] == 0.0
        assert second["lossreduce/normalizer_wait_s"] == 0.0


# -- TRL's own loss types on the same data ----------------------------------------------

# loss_type, entropy bonus -> is one optimizer step's update the same for 1 process
# x 4 micro-steps and 2 processes x 2 micro-steps as for 1 process x 1 micro-step?
TRL_SPLIT_INVARIANT = {
    ("dapo", 0.0): True,
    ("dapo", ENTROPY): False,
    ("grpo", 0.0): True,
    ("grpo", ENTROPY): False,
    ("dr_grpo", 0.0): True,
    ("dr_grpo", ENTROPY): False,
    ("bnpo", 0.0): False,
    ("bnpo", ENTROPY): False,
    ("cispo", 0.0): True,
    ("cispo", ENTROPY): False,
    ("sapo", 0.0): True,
    ("sapo", ENTROPY): False,
    ("luspo", 0.0): True,
    ("luspo", ENTROPY): False,
    ("vespo", 0.0): True,
    ("vespo", ENTROPY): False,
}


def test_trl_loss_types_split_invariance_as_measured(
    results: Callable[[str], list[dict[str, Any]]],
) -> None:
    measured = {}
    for lt in TRL_LOSS_TYPES:
        for h in (0.0, ENTROPY):
            name = f"trl-{lt}-H{h}"
            whole = case_results(results, "1x1", name)[0]["update"]
            errors = [
                relative(case_results(results, layout, name)[0]["update"], whole)
                for layout in ("1x4", "2x2")
            ]
            measured[lt, h] = max(errors) <= UPDATE_RTOL
    assert measured == TRL_SPLIT_INVARIANT


@pytest.mark.parametrize("loss_type", list(tiny_grpo.OWN_DIVISION))
@pytest.mark.parametrize("layout", ["1x4", "2x2"])
def test_each_loss_type_in_its_own_mode_gives_stock_trls_update(
    results: Callable[[str], list[dict[str, Any]]], layout: str, loss_type: str
) -> None:
    """Where both divide by the same count, lossreduce in the mode of the loss type's own
    division, split over micro-steps and processes, gives stock TRL's update of one
    process and one micro-step: luspo in constant with divisor 1, sapo (its per-row
    division undone through the advantage) in seq_mean, ..."""
    (stock,) = case_results(results, "1x1", f"stock-{loss_type}")
    for result in case_results(results, layout, f"own-{loss_type}"):
        assert relative(result["update"], stock["update"]) <= OWN_RTOL, (layout, loss_type)
    assert max(u.abs().max().item() for u in stock["update"].values()) > 0


def test_luspo_in_the_default_token_mean_is_not_luspos_update(
    results: Callable[[str], list[dict[str, Any]]],
) -> None:
    """What the construction notice warns about: stock luspo divides its loss, KL
    included, by the step's completions (masked ones too), the default token_mean by its
    active tokens, so the whole update shrinks by completions / tokens (12 / 29 here)."""
    (token_mean,) = case_results(results, "1x1", "luspo-token_mean")
    (stock,) = case_results(results, "1x1", "trl-luspo-H0.0")
    rows = tiny_grpo.all_rows()
    tokens = sum(len(r.completion) for r in rows if not r.truncated)
    ratio = norm(token_mean["update"]) / norm(stock["update"])
    assert ratio == pytest.approx(len(rows) / tokens, rel=1e-5)
    assert relative(token_mean["update"], stock["update"]) > 0.5


def test_trl_dapo_guesses_the_step_token_count_when_a_generation_feeds_two_steps(
    results: Callable[[str], list[dict[str, Any]]], model_dir: Path
) -> None:
    """steps_per_generation=2 with no accumulation: TRL divides each step by half the
    generation batch's tokens, not by the step's own; the lossreduce token_mean is exact."""
    per_rank = case_results(results, "2x1-spg2", "trl-dapo-H0.0")
    rows = [tiny_grpo.Row(p, g) for r in per_rank for p, g in r["rows"]]
    want = tiny_grpo.reference_update(
        model_dir,
        rows,
        mode="token_mean",
        divisor=None,
        lr=LR,
        beta=0.05,
        entropy_coef=0.0,
        mask_truncated=True,
    )
    assert relative(per_rank[0]["update"], want) > 0.01


def test_trl_loss_types_step_on_an_all_masked_batch(
    results: Callable[[str], list[dict[str, Any]]],
) -> None:
    """TRL raises nothing on a step with no active token and AdamW still moves
    the weights (its momentum); the logged loss is 0, not NaN."""
    for lt in TRL_LOSS_TYPES:
        (result,) = case_results(results, "1x1", f"trl-{lt}-empty")
        first, second = result["params"]
        moved = max(float((second[n] - first[n]).abs().max()) for n in first)
        assert moved > 0, lt
        assert result["losses"][1] == 0.0, lt


# -- empty steps ------------------------------------------------------------------------


def test_empty_step_skipped_by_the_coordinator_leaves_weights_and_adam_state_bit_identical(
    results: Callable[[str], list[dict[str, Any]]],
) -> None:
    """(The torch backend's skip is the contract's, test_contract.py.)"""
    for result in case_results(results, "2x2", "coordinator-empty-skip"):
        assert result["skipped_steps"] == 1
        assert all(math.isfinite(loss) for loss in result["losses"])
        (first, second), (adam1, adam2) = result["params"], result["optimizer"]
        for name in first:
            assert torch.equal(first[name], second[name]), name
        assert adam1.keys() == adam2.keys()
        assert len(adam1) > 0
        for key, state in adam1.items():
            for field, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(adam2[key][field]))


# -- the round behind the first forward ---------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "sapo-"])
def test_a_forward_run_during_the_round_gives_the_bit_identical_update(
    results: Callable[[str], list[dict[str, Any]]], prefix: str
) -> None:
    """(sapo's division is undone in its advantages and applied after TRL's loss, with
    or without the overlap.)"""
    overlapped = case_results(results, "2x2", f"{prefix}overlap")
    waited = case_results(results, "2x2", f"{prefix}no-overlap")
    for got, want in zip(overlapped, waited, strict=True):
        assert [log["lossreduce/overlapped"] for log in got["logs"]] == [1.0]
        assert [log["lossreduce/overlapped"] for log in want["logs"]] == [0.0]
        for log in got["logs"] + want["logs"]:
            assert 0.0 <= log["lossreduce/normalizer_wait_s"] < 60.0
            assert 0.0 < log["lossreduce/round_latency_s"] < 60.0
        # The loss divided after the forward by TRL's own divisor: the same floats.
        assert got["losses"] == want["losses"]
        for name, update in got["update"].items():
            assert torch.equal(update, want["update"][name]), name
        assert max(u.abs().max().item() for u in got["update"].values()) > 0


def test_the_coordinator_backend_overlaps_too_and_gives_the_same_update(
    results: Callable[[str], list[dict[str, Any]]],
) -> None:
    coordinator = case_results(results, "2x2", "coordinator-overlap")
    torch_backend = case_results(results, "2x2", "overlap")
    for got, want in zip(coordinator, torch_backend, strict=True):
        assert [log["lossreduce/overlapped"] for log in got["logs"]] == [1.0]
        assert relative(got["update"], want["update"]) <= 1e-6


def test_an_empty_step_found_after_the_forward_raises_before_any_backward(
    results: Callable[[str], list[dict[str, Any]]],
) -> None:
    for result in results("2x2"):
        error = result["overlap-empty-raise"].get("error")
        assert error is not None, result
        assert error["type"] == "EmptyNormalizerError", error
        assert (error["step"], tuple(error["terms"])) == (1, ("pg",))
        assert len(result["overlap-empty-raise"]["params"]) == 1  # step 2 never stepped


def test_an_empty_step_found_after_the_forward_is_skipped_without_a_trace(
    results: Callable[[str], list[dict[str, Any]]],
) -> None:
    for result in case_results(results, "2x2", "overlap-empty-skip"):
        assert result["skipped_steps"] == 1
        assert [log["lossreduce/overlapped"] for log in result["logs"]] == [1.0, 1.0]
        (first, second), (adam1, adam2) = result["params"], result["optimizer"]
        for name in first:
            assert torch.equal(first[name], second[name]), name
        for key, state in adam1.items():
            for field, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(adam2[key][field]))
