"""The cases ``test_skyrl_worker.py`` runs in each layout (:func:`layout_cases`), and the
layouts: every rank of a layout runs its cases in one spawned run (:mod:`.skyrl_runs`).

Every layout runs the KL and entropy cases; the invariance layouts every policy mode;
the critic layouts every critic mode; ``dp2-mb2`` the A/B against stock SkyRL, the bad
input and empty cases of the policy and the critic, and every registered policy loss.
"""

from __future__ import annotations

from typing import Any

from tests.trainer_worker.integrations.skyrl.skyrl_runs import Case

DIVISOR = 5.0
MODES: dict[str, float | None] = {
    "token_mean": None,
    "seq_mean": None,
    "prompt_mean": None,
    "constant": DIVISOR,
}
LAYOUTS: dict[str, tuple[int, int]] = {
    # name -> (ranks, micro-batch size per rank): 8 responses in one mini-batch.
    "dp1-mb8": (1, 8),
    "dp1-mb4": (1, 4),
    "dp1-mb2": (1, 2),
    "dp1-mb1": (1, 1),
    "dp2-mb4": (2, 4),
    "dp2-mb2": (2, 2),
    "dp2-mb1": (2, 1),
}
INVARIANCE_LAYOUTS = ("dp1-mb8", "dp1-mb1", "dp2-mb4", "dp2-mb2", "dp2-mb1")
PG_ONLY: dict[str, Any] = {"kl": False, "entropy": False}
POLICY_LOSSES = (
    "regular",
    "dual_clip",
    "gspo",
    "cispo",
    "sapo",
    "dppo",
    "rollout_is",
    "importance_sampling",
)
"""SkyRL 0.4's registered policy losses that lossreduce runs (the others are refused)."""
SGD: dict[str, Any] = {"optimizer": "sgd", "step": True}
ENTROPY_ONLY: dict[str, Any] = {"kl": False, "zero_advantages": True}
CRITIC_LAYOUTS = ("dp1-mb8", "dp1-mb1", "dp2-mb1")
"""Where the critic runs in every mode: one micro-batch, 8 micro-batches, 2 ranks x 4."""
VALUE_CLIP = 0.2
"""SkyRL's default ``algorithm.value_clip``, which the critic cases keep."""
KL_ONLY: dict[str, Any] = {"entropy": False, "zero_advantages": True}


def layout_cases(layout: str, target: str) -> list[Case]:
    world, _ = LAYOUTS[layout]
    cases = [
        Case("stock-entropy", worker="stock", **ENTROPY_ONLY),
        Case("entropy", **ENTROPY_ONLY),
        Case("stock-kl", worker="stock", **KL_ONLY),
        Case("kl-seq_mean", kl_mode="seq_mean", **KL_ONLY),
        Case("stock-pg", worker="stock", **PG_ONLY),
        Case("pg", **PG_ONLY),
    ]
    if layout in INVARIANCE_LAYOUTS:
        cases += [Case(f"all-{mode}", mode=mode, divisor=div) for mode, div in MODES.items()]
        cases.append(
            Case(
                "mixed-modes",
                mode="seq_mean",
                kl_mode="constant",
                entropy_mode="prompt_mean",
                divisor=DIVISOR,
            )
        )
        cases.append(Case("token-budget", mode="prompt_mean", max_tokens=12))
    if layout in ("dp1-mb8", "dp2-mb2"):
        cases.append(Case("zscore-masked-nan", batch="masked_nan_padding", z_score=True, **SGD))
    if layout in CRITIC_LAYOUTS:
        cases += [
            Case(f"critic-{mode}", worker="critic", mode=mode, divisor=div)
            for mode, div in MODES.items()
        ]
    if layout == "dp1-mb8":
        cases.append(Case("stock-critic", worker="stock-critic", **SGD))
    if layout == "dp2-mb1":
        cases.append(
            Case("critic-token-budget", worker="critic", mode="prompt_mean", max_tokens=12)
        )
    if world == 2 and layout == "dp2-mb2":
        cases += [
            Case("nan-advantage", mode="prompt_mean", batch="nan_advantage"),
            Case(
                "inf-advantage-coordinator",
                batch="inf_advantage",
                normalizer="coordinator",
                coordinator=target,
            ),
            Case(
                "empty-raise-coordinator",
                batch="all_masked",
                normalizer="coordinator",
                coordinator=target,
            ),
            Case(
                "empty-skip",
                batch="all_masked",
                on_empty_step="skip",
                optimizer="adamw",
                step=True,
            ),
            Case("adamw-step", optimizer="adamw", step=True),
            Case("stock-ab", worker="stock", optimizer="sgd", step=True, **PG_ONLY),
            Case("ab", optimizer="sgd", step=True, **PG_ONLY),
            Case(
                "stock-ab-dense",
                worker="stock",
                batch="dense",
                entropy=False,
                optimizer="sgd",
                step=True,
            ),
            Case(
                "ab-dense-seq-kl",
                batch="dense",
                kl_mode="seq_mean",
                entropy=False,
                optimizer="sgd",
                step=True,
            ),
            Case("seq_mean-counts", mode="seq_mean", **PG_ONLY),
            Case("zscore-masked-zero", batch="masked_zero_padding", z_score=True, **SGD),
            Case("zscore-nan-active", mode="prompt_mean", batch="nan_advantage", z_score=True),
            Case("stock-critic-ab-dense", worker="stock-critic", batch="dense", **SGD),
            Case("critic-ab-dense", worker="critic", mode="seq_mean", batch="dense", **SGD),
            Case("critic-sgd", worker="critic", **SGD),
            Case("critic-masked-nan", worker="critic", batch="critic_masked_nan", **SGD),
            Case("critic-nan-return", worker="critic", mode="prompt_mean", batch="nan_return"),
            Case(
                "critic-empty-raise-coordinator",
                worker="critic",
                batch="all_masked",
                normalizer="coordinator",
                coordinator=target,
            ),
            Case(
                "critic-empty-skip",
                worker="critic",
                batch="all_masked",
                on_empty_step="skip",
                optimizer="adamw",
                step=True,
            ),
            Case("critic-adamw-step", worker="critic", optimizer="adamw", step=True),
            Case(
                "stock-nan-advantage",
                worker="stock",
                batch="nan_advantage",
                optimizer="adamw",
                step=True,
            ),
            Case("stock-empty", worker="stock", batch="all_masked", optimizer="adamw", step=True),
        ]
        for loss in POLICY_LOSSES:
            for worker in ("stock", "lossreduce"):
                cases.append(
                    Case(
                        f"{worker}-loss-{loss}",
                        worker=worker,
                        policy_loss=loss,
                        rollout_logprobs=True,
                        on_policy=True,
                        # SkyRL skips the old log-probabilities' forward for these two.
                        without_old=loss in ("rollout_is", "dppo"),
                        **PG_ONLY,
                    )
                )
    return cases
