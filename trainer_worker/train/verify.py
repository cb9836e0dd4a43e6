"""``--verify``: partition invariance end to end, on one step.

The same batch is reduced once across the R workers (their gradients after
the all-reduce) and once in one process holding all the data with a
:class:`LocalNormalizer`. Every parameter's gradient must agree:

    max |g_R - g_1|  <=  VERIFY_RTOL * G + VERIFY_ATOL

where ``G`` is the largest ``|g_1|`` entry of the whole model (the scale of
the gradient). In float32 a reordered sum is off by a few ulps of that scale,
far inside ``1e-5``; a wrong normalizer (a per-rank or per-microbatch mean)
is off by tens of percent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rich.table import Table
from torch import Tensor

__all__ = [
    "VERIFY_ATOL",
    "VERIFY_RTOL",
    "GradientDiff",
    "VerifyReport",
    "compare_gradients",
]

VERIFY_RTOL = 1e-5
"""Allowed difference relative to the largest gradient entry of the model."""
VERIFY_ATOL = 1e-9
"""Absolute floor of the allowed difference (all-zero gradients)."""


@dataclass(frozen=True)
class GradientDiff:
    """One parameter's comparison."""

    name: str
    shape: tuple[int, ...]
    max_abs_grad: float
    max_abs_diff: float


@dataclass(frozen=True)
class VerifyReport:
    """All parameters' comparisons and the verdict."""

    diffs: tuple[GradientDiff, ...]
    scale: float
    tolerance: float
    world_size: int
    distributed_loss: float
    single_loss: float

    @property
    def max_abs_diff(self) -> float:
        return max((d.max_abs_diff for d in self.diffs), default=0.0)

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance

    def table(self) -> Table:
        table = Table(
            title=f"--verify: gradients over {self.world_size} workers vs. one process "
            f"(tolerance {self.tolerance:.3g} = {VERIFY_RTOL:g} x max|g| {self.scale:.3g} "
            f"+ {VERIFY_ATOL:g})"
        )
        table.add_column("parameter")
        table.add_column("shape")
        table.add_column("max |grad|", justify="right")
        table.add_column("max abs diff", justify="right")
        for d in self.diffs:
            table.add_row(
                d.name,
                "x".join(map(str, d.shape)),
                f"{d.max_abs_grad:.3e}",
                f"{d.max_abs_diff:.3e}",
            )
        return table


def compare_gradients(
    distributed: Mapping[str, Tensor],
    single: Mapping[str, Tensor],
    *,
    world_size: int,
    distributed_loss: float,
    single_loss: float,
) -> VerifyReport:
    """Compare two parameter-name -> gradient mappings (same names required)."""
    if set(distributed) != set(single):
        raise ValueError(
            f"gradients name different parameters: only distributed {sorted(set(distributed) - set(single))}, "
            f"only single {sorted(set(single) - set(distributed))}"
        )
    diffs = []
    for name, ref in single.items():
        got = distributed[name].to(ref.device, ref.dtype)
        diffs.append(
            GradientDiff(
                name=name,
                shape=tuple(ref.shape),
                max_abs_grad=float(ref.abs().max()) if ref.numel() else 0.0,
                max_abs_diff=float((got - ref).abs().max()) if ref.numel() else 0.0,
            )
        )
    scale = max((d.max_abs_grad for d in diffs), default=0.0)
    return VerifyReport(
        diffs=tuple(diffs),
        scale=scale,
        tolerance=VERIFY_RTOL * scale + VERIFY_ATOL,
        world_size=world_size,
        distributed_loss=distributed_loss,
        single_loss=single_loss,
    )
