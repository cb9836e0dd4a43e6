"""Fixes for the versions AReaL 1.0.4's ``[megatron]`` extra pins, on any device.

With megatron-core 0.17.0, mbridge 0.15.1, megatron-bridge 0.4.0 and transformers
5.3.0 (AReaL's own pin), ``MegatronPPOActor`` cannot be imported or initialized as
released; each stop below is what the CPU tests met, and none depends on the CPU:

1. ``import areal.engine.megatron_engine`` imports megatron-bridge, which imports
   Transformer Engine unconditionally (``ModuleNotFoundError: No module named
   'transformer_engine'`` where TE is absent; TE's torch extension is a CUDA build).
2. mbridge's ``get_model`` names ``ModelType.encoder_and_decoder``, which
   Megatron-Core 0.17.0 removed (``AttributeError``): the fix every framework's
   mbridge build needs, :mod:`lossreduce.trainer_worker.integrations.mbridge_compat`.
3. mbridge reads ``hf_config.rope_theta``, which transformers 5 keeps in
   ``rope_parameters`` (``AttributeError: 'Qwen2Config' object has no attribute
   'rope_theta'``).
4. AReaL builds mbridge's Megatron config in bfloat16 whatever the engine's ``dtype``
   (unless gradient checkpointing is on).

:func:`install` applies the four fixes to this process, changing no installed file.
It is what the tests (and ``scripts/gpu_check_megatron.py``) run with; until
AReaL, mbridge or megatron-bridge release fixes, a Megatron run of AReaL 1.0.4 needs
it too.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import mbridge.core.llm_bridge as mbridge_llm

from lossreduce.trainer_worker.integrations import mbridge_compat

__all__ = ["install"]


# -- megatron-bridge without Transformer Engine -----------------------------------------------

_NO_TE = (
    "megatron-bridge 0.4.0 imports transformer_engine.pytorch unconditionally "
    "(megatron/bridge/peft/lora.py and lora_layers.py), and Transformer Engine's torch "
    "extension is built against CUDA"
)


class _NeedsTransformerEngine:
    """What ``megatron.bridge``'s ``AutoBridge`` and ``LoRA`` are here: unusable."""

    def __init__(self, *_: object, **__: object) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} is unavailable without Transformer Engine: {_NO_TE}"
        )

    @classmethod
    def from_hf_pretrained(cls, *_: object, **__: object) -> None:
        raise NotImplementedError(
            f"{cls.__name__} is unavailable without Transformer Engine: {_NO_TE}"
        )


def _megatron_bridge_stand_in() -> None:
    """``megatron.bridge`` for AReaL's two module-level imports of it, where Transformer
    Engine is absent. AReaL uses them only with ``bridge_type='megatron-bridge'`` or LoRA;
    the default ``mbridge`` (what the tests run) never touches them."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return
    bridge = types.ModuleType("megatron.bridge", _NO_TE)
    peft = types.ModuleType("megatron.bridge.peft", _NO_TE)
    lora = types.ModuleType("megatron.bridge.peft.lora", _NO_TE)
    bridge.AutoBridge = type("AutoBridge", (_NeedsTransformerEngine,), {})  # type: ignore[attr-defined]
    lora.LoRA = type("LoRA", (_NeedsTransformerEngine,), {})  # type: ignore[attr-defined]
    bridge.peft = peft  # type: ignore[attr-defined]
    peft.lora = lora  # type: ignore[attr-defined]
    sys.modules.update(
        {"megatron.bridge": bridge, "megatron.bridge.peft": peft, "megatron.bridge.peft.lora": lora}
    )


# -- mbridge 0.15.1 against Megatron-Core 0.17.0 ------------------------------------------------


_gptmodel_args = mbridge_llm.LLMBridge._get_gptmodel_args


def _gptmodel_args_with_rope_theta(bridge: Any) -> dict[str, Any]:
    """mbridge 0.15.1 reads ``hf_config.rope_theta``, which transformers 5 keeps in
    ``rope_parameters['rope_theta']`` only (AttributeError in ``get_model``, on a GPU
    too): the config gets the attribute from there first."""
    config = bridge.hf_config
    if not hasattr(config, "rope_theta"):
        config.rope_theta = config.rope_parameters["rope_theta"]
    args: dict[str, Any] = _gptmodel_args(bridge)
    return args


def _float32_bridge() -> None:
    """AReaL sets ``bridge.dtype = engine dtype`` after mbridge built its Megatron
    config in bfloat16 (mbridge's default), and rebuilds that config only under
    gradient checkpointing (``set_extra_args``): a ``dtype='float32'`` engine trains
    bfloat16 parameters (on a GPU too). The config is rebuilt with the engine's dtype."""
    from areal.engine.megatron_engine import MegatronEngine

    build = MegatronEngine._build_hf_mcore_bridge
    if getattr(build, "lossreduce_fix", False):
        return

    def build_in_engine_dtype(engine: Any) -> Any:
        bridge = build(engine)
        config = getattr(bridge, "config", None)
        if config is not None and config.params_dtype != engine.dtype:
            bridge.config = bridge._build_config()
        return bridge

    build_in_engine_dtype.lossreduce_fix = True  # type: ignore[attr-defined]
    MegatronEngine._build_hf_mcore_bridge = build_in_engine_dtype


# -- installing it -----------------------------------------------------------------------------


def install() -> None:
    """Apply the four fixes of the module docstring to this process (idempotent)."""
    _megatron_bridge_stand_in()
    mbridge_compat.install()
    mbridge_llm.LLMBridge._get_gptmodel_args = _gptmodel_args_with_rope_theta
    _float32_bridge()
