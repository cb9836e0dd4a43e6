"""Integer keys for :func:`~lossreduce.trainer_worker.token_stats.global_kth_smallest`.

A statistic that picks tokens (the ``k`` with the largest covariance, a seeded
random draw of ``k`` candidates) becomes "every token whose key is ``<=`` the
global ``k``-th smallest key" once each token has an int64 key that orders as
the choice must:

- :func:`float_order_keys`: keys ordered as the float64 values are, so the
  ``k`` largest values are the ``k`` smallest keys of ``-x``;
- :func:`draw_keys`: pseudo-random keys that depend only on a seed and each
  token's identity (its row and position in the mini-batch), not on the rank,
  the device or the split, so the "random" choice is the same in every layout;
- :func:`seed_of`: a stable 64-bit seed from strings and integers (the job,
  the step, the purpose), the same in every process.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from lossreduce.errors import ReductionInputError, UsageError

__all__ = ["draw_keys", "float_order_keys", "mix64", "seed_of"]

_LOW63 = (1 << 63) - 1


def _signed(value: int) -> int:
    """``value`` modulo ``2**64`` as a signed int64."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


# SplitMix64 (Steele, Lea, Flood 2014): its increment and its two multipliers.
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` is arithmetic on int64)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: Tensor) -> Tensor:
    """SplitMix64's finalizer of ``x + golden``: a bijection of int64, bit for bit on any device.

    ``x``: int64, any shape. Only wrapping int64 addition and multiplication,
    xor and shifts, which every torch device computes alike.
    """
    z = x + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MUL1
    z = (z ^ _shift_right(z, 27)) * _MUL2
    return z ^ _shift_right(z, 31)


def draw_keys(seed: int, *ids: Tensor) -> Tensor:
    """Pseudo-random int64 keys, one per identity: ``mix64(...mix64(mix64(seed) ^ ids[0]) ^ ...)``.

    ``seed``: any int (taken modulo ``2**64``), e.g. from :func:`seed_of`.
    ``ids``: integer tensors of broadcastable shapes naming each token (e.g.
    its row in the mini-batch ``[B, 1]`` and its position ``[1, T]``); the
    keys have their broadcast shape and the first id's device. Equal seeds and
    identities give equal keys on every rank and device, so
    ``global_kth_smallest(draw_keys(seed, rows, positions), k)`` draws the
    same ``k`` tokens whatever the split. Distinct identities give distinct
    keys for one seed and all but the last id fixed (each step is a bijection);
    two tokens may share a key otherwise, with chance about ``2**-64`` a pair,
    and share the draw's fate then.
    """
    if not ids:
        raise UsageError("draw_keys needs at least one id tensor (e.g. rows and positions)")
    for i, part in enumerate(ids):
        if part.is_floating_point() or part.is_complex() or part.dtype == torch.bool:
            raise UsageError(f"draw_keys id {i} has dtype {part.dtype}; ids are integer tensors")
    device = ids[0].device
    key = mix64(torch.tensor(_signed(seed), dtype=torch.int64, device=device))
    for part in ids:
        key = mix64(key ^ part.to(device=device, dtype=torch.int64))
    return key


def float_order_keys(x: Tensor) -> Tensor:
    """int64 keys ordered as the values of ``x`` are: ``a < b`` exactly when ``key(a) < key(b)``.

    ``x``: any float dtype and shape (taken as float64, which every float
    dtype converts to exactly). ``-0.0`` and ``+0.0`` get the same key (0);
    infinities order at the ends; NaN has no place in the order and raises
    :class:`ReductionInputError` naming its position, here, before any round:
    check the values (e.g. with
    :func:`~lossreduce.trainer_worker.token_stats.global_exact_sums`, which
    fails on every rank) before a collective that needs their keys.
    """
    if not x.is_floating_point():
        raise UsageError(f"float_order_keys takes a float tensor, not {x.dtype}")
    values = x.detach().to(torch.float64)
    nan = torch.isnan(values)
    if bool(nan.any()):
        index = int(torch.nonzero(nan.reshape(-1))[0, 0])
        raise ReductionInputError(
            f"float_order_keys: value nan at flat position {index} of {tuple(x.shape)} has no "
            "place in the order of the values"
        )
    bits = (values + 0.0).view(torch.int64)  # + 0.0 turns -0.0 into 0.0
    # A negative value's pattern is -2**63 + magnitude: flip the magnitude so
    # that larger magnitudes give smaller keys (-1 - magnitude).
    return torch.where(bits < 0, bits ^ _LOW63, bits)


def seed_of(*parts: str | int) -> int:
    """A 64-bit seed (``0 <= seed < 2**64``) from strings and integers, the same in every process.

    A BLAKE2b digest of the parts, each tagged with its type and length, so
    ``("a", 1)`` and ``("a1",)`` differ (Python's ``hash`` of a string is
    salted per process and would differ between ranks).
    """
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, (str, int)):
            raise UsageError(f"seed_of takes strings and integers, not {part!r}")
        if isinstance(part, str):
            tag, data = b"s", part.encode()
        else:
            tag, data = b"i", str(part).encode()
        digest.update(tag + len(data).to_bytes(8, "little") + data)
    return int.from_bytes(digest.digest(), "little")
