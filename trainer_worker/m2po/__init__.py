"""The global M2PO mask: one cut-off over the whole mini-batch, on every rank.

M2PO masks the tokens with the largest second moment ``m2 = (old_logp -
prox_logp)^2`` until the mean ``m2`` of the rest is below the threshold. Decided
per micro-batch (as AReaL does inside its loss), the kept tokens depend on the
split; decided here, over the active tokens of *all* ranks before the forward,
they do not. See ``docs/reduction-semantics.md``, "The M2PO mask".

The rule (value-based, so ties are decided by value, never by position): with
``N(c)`` and ``S(c)`` the count and the exact sum of the ``m2`` values ``<= c``,
a cut-off ``c`` is admissible when ``N(c) == 0`` or ``S(c) < threshold * N(c)``
(strictly, as AReaL). Admissibility only shrinks as ``c`` grows, so there is a
largest admissible data value ``c*``; the kept tokens are those with
``m2 <= c*``. When even the smallest value alone is not below the threshold no
token is kept (AReaL keeps one token there; which one depends on its sort).
The comparison is exact (integer arithmetic on the float64 values), so the
answer depends only on the multiset of values, not on their order or split.

Public API (stable):

- :func:`m2_values`: the float64 ``m2`` of a batch's active tokens.
- :func:`m2po_keep_reference`, :func:`m2po_cutoff_reference`: the exact
  single-process rule over all values of a mini-batch.
- :func:`global_m2po_cutoff`: the same cut-off computed over every rank's
  values through a :class:`~lossreduce.trainer_worker.GlobalNormalizer`
  (torch.distributed or the coordinator), in a few rounds of counts and exact
  sums per candidate cut-off, never an all-gather of the values. Returns an
  :class:`M2POCut`, whose ``keep`` turns a rank's ``m2`` into its keep mask.
- :data:`M2PO_STEP_STRIDE`, :func:`m2po_round_step`: the round keys the search
  uses (``step * M2PO_STEP_STRIDE + round``), so give it a normalizer of its own
  (for the coordinator: a client of a separate group such as ``"<group>.m2po"``).
- :func:`m2po_cutoff_in_process`: every rank's search run in one process (the
  same rounds, summed as the backends sum), for tests and measurements.
- :func:`worst_case_rounds`: the bound on the number of rounds.
"""

from lossreduce.trainer_worker.m2po.exact import (
    m2_values,
    m2po_cutoff_reference,
    m2po_keep_reference,
)
from lossreduce.trainer_worker.m2po.search import (
    M2POCut,
    global_m2po_cutoff,
    m2po_cutoff_in_process,
)
from lossreduce.trainer_worker.m2po.wire import (
    DEFAULT_MAX_TERMS,
    M2PO_STEP_STRIDE,
    m2po_round_step,
    worst_case_rounds,
)

__all__ = [
    "DEFAULT_MAX_TERMS",
    "M2PO_STEP_STRIDE",
    "M2POCut",
    "global_m2po_cutoff",
    "m2_values",
    "m2po_cutoff_in_process",
    "m2po_cutoff_reference",
    "m2po_keep_reference",
    "m2po_round_step",
    "worst_case_rounds",
]
