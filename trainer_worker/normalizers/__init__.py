"""Global normalizer backends: one interface, three ways to sum the partials.

Every rank sends, per loss term, the sum of its microbatch normalizers (its
*partial*); the backend returns every term's global normalizer ``N`` (the sum
over ranks) or raises. All three backends judge the same way, with the rules of
:mod:`lossreduce.rules`, and raise the same :mod:`lossreduce.errors` types:

- :class:`InvalidPartialError` on the rank whose partial is NaN, infinite or
  negative (naming rank, term and value); its peers raise
  :class:`RoundAbortedError` naming that rank;
- :class:`ContractMismatchError` when ranks disagree on terms or contracts;
- :class:`EmptyNormalizerError` on every rank when a global normalizer is not
  finite and > 0 (naming job, step, terms and values).

A rank whose request is malformed (a bad term name, contracts that do not
name exactly its terms, a partial that is not one number) still takes part
in the round, so that its peers fail at once instead of waiting: it raises
:class:`InvalidPartialError` saying what was wrong, its peers a
:class:`ContractMismatchError` (torch.distributed) or a
:class:`RoundAbortedError` naming it (coordinator).

No rank ever returns normalizers while a peer raises: that is how distributed
jobs deadlock. Global sums are ``math.fsum`` over the partials in rank order,
so every backend gives bit-identical normalizers for the same data, and every
backend returns them in the caller's term order (the order of ``partials``).
``contracts`` is optional everywhere: ``None`` sends the empty contract for
every term.

Every backend has a blocking ``reduce`` and a non-blocking ``start``, which
returns a :class:`NormalizerHandle` while the round is in flight, so an engine
can run a forward pass meanwhile (``reduce`` is ``start(...).wait()``). A
handle's ``wait`` returns the same normalizers or raises the same error as
``reduce``, again on every call. Each step's partials are turned into floats
with one device-to-host copy for all terms (one device sync, not one per term).
"""

from lossreduce.trainer_worker.normalizers.base import (
    GlobalNormalizer,
    NormalizerHandle,
    OnEmptyStep,
    ReadyHandle,
    claim_run,
)
from lossreduce.trainer_worker.normalizers.coordinator import (
    CoordinatorNormalizer,
    SupportsClaim,
    SupportsReduce,
    SupportsResult,
)
from lossreduce.trainer_worker.normalizers.local import LocalNormalizer
from lossreduce.trainer_worker.normalizers.torch_dist import TorchDistributedNormalizer

__all__ = [
    "CoordinatorNormalizer",
    "GlobalNormalizer",
    "LocalNormalizer",
    "NormalizerHandle",
    "OnEmptyStep",
    "ReadyHandle",
    "SupportsClaim",
    "SupportsReduce",
    "SupportsResult",
    "TorchDistributedNormalizer",
    "claim_run",
]
