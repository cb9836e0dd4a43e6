"""mbridge 0.15.1 against Megatron-Core 0.17 and later, for every framework that builds
its Megatron model through mbridge (AReaL's Megatron engine; verl's with
``vanilla_mbridge=True``).

mbridge 0.15.1's ``get_model`` compares with ``ModelType.encoder_and_decoder``, a member
Megatron-Core 0.17.0 removed (its ``ModelType`` keeps only ``encoder_or_decoder``): every
model build stops there with ``AttributeError: type object 'ModelType' has no attribute
'encoder_and_decoder'``, on a GPU too. :func:`install` gives mbridge's ``util`` module a
``ModelType`` with both names; the one it builds models with is Megatron-Core's own
member. It changes no installed file and imports no RL framework (mbridge and
Megatron-Core only when :func:`install` runs).
"""

from __future__ import annotations

import types

__all__ = ["install"]


def install() -> None:
    """Give mbridge the ``ModelType`` it compares with (idempotent; a no-op where
    Megatron-Core still has ``encoder_and_decoder``)."""
    import mbridge.core.util as mbridge_util
    from megatron.core.enums import ModelType

    if hasattr(ModelType, "encoder_and_decoder"):
        return
    mbridge_util.ModelType = types.SimpleNamespace(
        encoder_or_decoder=ModelType.encoder_or_decoder,
        encoder_and_decoder=object(),  # equal to no model type Megatron-Core has
    )
