"""What every backend judges the same way: a rank's request, every rank's
partials, the global normalizers (with the rules of :mod:`lossreduce.rules`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from lossreduce.errors import (
    EmptyNormalizerError,
    InvalidPartialError,
    RankContext,
    RoundAbortedError,
    format_terms,
)
from lossreduce.rules import check_global_normalizer, check_partial, check_term_name
from lossreduce.trainer_worker.reduction import floats_of

__all__ = [
    "device_of",
    "finish",
    "local_values",
    "malformed_error",
    "raise_for_invalid",
    "request_problems",
]


def request_problems(
    partials: Mapping[str, Tensor], contracts: Mapping[str, str] | None
) -> list[str]:
    """Why this rank's request is malformed (empty when it is not)."""
    problems = [why for why in map(check_term_name, partials) if why is not None]
    if not partials:
        problems.append("no terms were sent")
    if contracts is not None and set(contracts) != set(partials):
        problems.append(f"contracts name {sorted(contracts)} but partials name {sorted(partials)}")
    shapes = {name: tuple(p.shape) for name, p in partials.items() if p.numel() != 1}
    if shapes:
        problems.append(f"a partial is one number, but got shapes {shapes}")
    return problems


def malformed_error(
    rnd: RankContext, problems: Sequence[str], terms: Iterable[str]
) -> InvalidPartialError:
    return rnd.error(
        InvalidPartialError, f"malformed request: {'; '.join(problems)}", terms=sorted(terms)
    )


def local_values(
    rnd: RankContext, partials: Mapping[str, Tensor], contracts: Mapping[str, str] | None
) -> tuple[list[str], list[float], list[str]]:
    """(term names sorted, their float partials, their contracts); a malformed request raises.

    Sorted, so ranks that list the same terms in another order exchange the same rows.
    """
    problems = request_problems(partials, contracts)
    if problems:
        raise malformed_error(rnd, problems, partials)
    terms = sorted(partials)
    values = floats_of([partials[t] for t in terms])
    return terms, values, [contracts[t] if contracts is not None else "" for t in terms]


def _invalid(
    terms: Sequence[str], values: Sequence[float]
) -> tuple[list[str], list[float], list[str]]:
    bad = [(t, v, check_partial(v)) for t, v in zip(terms, values, strict=True)]
    bad = [(t, v, p) for t, v, p in bad if p is not None]
    return [t for t, _, _ in bad], [v for _, v, _ in bad], [str(p) for _, _, p in bad]


def raise_for_invalid(
    rnd: RankContext, rows: Sequence[Sequence[float]], terms: Sequence[str]
) -> None:
    """Raise on every rank if any rank's partial is invalid: the culprit gets
    InvalidPartialError, its peers RoundAbortedError naming it."""
    for culprit, row in enumerate(rows):
        bad_terms, bad_values, problems = _invalid(terms, row)
        if not bad_terms:
            continue
        described = f"{format_terms(bad_terms, bad_values)} ({', '.join(problems)})"
        if culprit == rnd.rank:
            raise rnd.error(
                InvalidPartialError,
                f"invalid local partial {described}; a partial must be finite and >= 0",
                terms=bad_terms,
                values=bad_values,
            )
        raise rnd.error(
            RoundAbortedError,
            f"round aborted because rank {culprit} sent an invalid partial {described}",
            terms=bad_terms,
            values=bad_values,
            ranks=[culprit],
        )


def finish(
    rnd: RankContext,
    terms: Sequence[str],
    totals: Sequence[float],
    device: torch.device,
    order: Iterable[str],
) -> dict[str, Tensor]:
    """Check every global normalizer is finite and > 0; return them in ``order``."""
    bad = [
        (t, v) for t, v in zip(terms, totals, strict=True) if check_global_normalizer(v) is not None
    ]
    if bad:
        names, values = [t for t, _ in bad], [v for _, v in bad]
        raise rnd.error(
            EmptyNormalizerError,
            f"global normalizer {format_terms(names, values)} is not finite and > 0 (no active "
            "unit on any rank?); no rank runs backward for this step",
            terms=names,
            values=values,
        )
    total_of = dict(zip(terms, totals, strict=True))
    names = list(order)
    # One host-to-device copy for all terms: [terms] float64, split into 0-d views.
    stacked = torch.tensor([total_of[t] for t in names], dtype=torch.float64, device=device)
    return dict(zip(names, stacked.unbind(0), strict=True))


def device_of(partials: Mapping[str, Tensor]) -> torch.device:
    return next(iter(partials.values())).device if partials else torch.device("cpu")
