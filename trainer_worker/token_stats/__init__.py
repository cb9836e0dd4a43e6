"""Statistics over every rank's tokens: exact global sums and a global k-th key.

Some policy losses take statistics over the tokens of one micro-batch call: a
mean of advantages and of log-probabilities, the top-k tokens by covariance, a
random draw of tokens, a mean of importance weights. Their gradient then
depends on how a mini-batch is split. Taken once over the whole mini-batch
(every rank's tokens), they do not. This package computes them through a
:class:`~lossreduce.trainer_worker.GlobalNormalizer` (one process,
torch.distributed or the coordinator), which only sums named partials: a few
rounds of integer counts and exact sums, never an all-gather of the values,
with results that are exact and bit-identical whatever the split. See
``docs/reduction-semantics.md``, "Statistics over the whole mini-batch".

Public API (stable):

- :func:`global_exact_sums`: per name, the count and the exact sum of every
  rank's float values (:class:`ExactSum`, with the correctly rounded ``value``
  and ``mean``), in two rounds; a NaN or infinite value fails every rank.
- :func:`global_kth_smallest`: the ``k``-th smallest int64 key of every
  rank's keys (:class:`KthKey`; ties at the threshold kept together), a
  K-ary search over the key range with counts only, at most
  :func:`kth_worst_case_rounds` rounds.
- :func:`float_order_keys`, :func:`draw_keys`, :func:`seed_of`: keys that
  order float values, or draw tokens by a seed and their identities, the same
  in every layout.
- :data:`ROUND_STRIDE`, :func:`stats_round_step`: the round keys
  (``step * ROUND_STRIDE + round``), so give these statistics a normalizer of
  their own and each statistic of a mini-batch a step of its own.
- :func:`exact_sums_in_process`, :func:`kth_smallest_in_process`: every rank's
  rounds run in one process, summed as the backends sum, for tests and
  measurements.
- :func:`sums_worst_case_rounds`, :func:`kth_worst_case_rounds`: the bounds
  on the number of rounds.
"""

from lossreduce.trainer_worker.token_stats.keys import draw_keys, float_order_keys, seed_of
from lossreduce.trainer_worker.token_stats.kth import (
    KthKey,
    global_kth_smallest,
    kth_smallest_in_process,
    kth_worst_case_rounds,
)
from lossreduce.trainer_worker.token_stats.sums import (
    ExactSum,
    exact_sums_in_process,
    global_exact_sums,
    sums_worst_case_rounds,
)
from lossreduce.trainer_worker.token_stats.wire import (
    DEFAULT_MAX_TERMS,
    ROUND_STRIDE,
    stats_round_step,
)

__all__ = [
    "DEFAULT_MAX_TERMS",
    "ROUND_STRIDE",
    "ExactSum",
    "KthKey",
    "draw_keys",
    "exact_sums_in_process",
    "float_order_keys",
    "global_exact_sums",
    "global_kth_smallest",
    "kth_smallest_in_process",
    "kth_worst_case_rounds",
    "seed_of",
    "stats_round_step",
    "sums_worst_case_rounds",
]
