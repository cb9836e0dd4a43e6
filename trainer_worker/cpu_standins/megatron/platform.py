"""One CPU platform for Megatron-Core, so that a framework's real Megatron engine
trains without a GPU (the tests; on a GPU, only its layer spec is of use, where
Transformer Engine is not installed: ``scripts/gpu_check_megatron.py``).

A Megatron-Core GPT model built by mbridge, and an engine written for CUDA around it,
meet CUDA in four places; each is redirected here without changing a file of the
framework, mbridge or Megatron-Core. AReaL 1.0.4's ``MegatronEngine`` is the engine
this is tested with (:mod:`lossreduce.trainer_worker.cpu_standins.areal.megatron` adds
AReaL's own version fixes); any other framework's Megatron engine that builds its model
through mbridge uses this same platform, with its own fixes beside it:

1. **Devices.** An engine sets ``self.device = torch.device(LOCAL_RANK)`` (AReaL's
   ``initialize``), which is ``cuda:0``, builds the model under ``with self.device:``
   and moves every micro-batch there; mbridge calls
   ``model.cuda(torch.cuda.current_device())`` and Megatron-Core allocates its gradient
   buffers on ``torch.cuda.current_device()``. :class:`CudaToCpu`, a torch function
   mode, turns every CUDA device argument of a torch call into the CPU, and
   ``torch.cuda.current_device`` answers 0 (which the mode maps to the CPU).
2. **The RNG tracker.** Megatron-Core's ``CudaRNGStatesTracker`` keeps CUDA
   generator states; :class:`CpuRNGStatesTracker` keeps CPU ones, and forks the
   CPU generator the same way.
3. **The layer spec.** mbridge asks for Transformer Engine's layer spec
   (``use_transformer_engine=True``); :func:`cpu_decoder_block_spec` gives
   Megatron-Core's local modules in the same layout (the norm inside the
   column-parallel linear, so that mbridge's Hugging Face name mapping holds).
4. **Packed attention.** Engines feed packed sequences (``thd``, ``cu_seqlens``),
   which only Transformer Engine's attention takes; :class:`PackedDotProductAttention`
   masks per packed sequence (what TE's varlen kernel does on a GPU).

Call :func:`install` in every rank's process before building the engine (after the
framework's own fixes, if it has any), and run the engine inside :class:`CudaToCpu`.
Context parallelism is not covered: Megatron-Core's local attention refuses it
(``DotProductAttention`` asserts ``context_parallel_size == 1``; only
``TEDotProductAttention`` implements it). This module imports no RL framework, only
Megatron-Core and mbridge.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import mbridge.core.llm_bridge as mbridge_llm
import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)
from torch import Tensor
from torch.nn import functional
from torch.overrides import TorchFunctionMode

__all__ = [
    "CpuRNGStatesTracker",
    "CudaToCpu",
    "NormColumnParallelLinear",
    "PackedDotProductAttention",
    "SequenceParallelRMSNorm",
    "cpu_decoder_block_spec",
    "install",
]

_CPU = torch.device("cpu")


# -- 1. devices --------------------------------------------------------------------------------


def _on_cpu(device: Any) -> Any:
    """``device`` itself unless it names a CUDA device (an int is one to torch)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    if isinstance(device, str | torch.device) and torch.device(device).type == "cuda":
        return _CPU
    return device


class CudaToCpu(TorchFunctionMode):
    """Every torch call asked for a CUDA device gets the CPU instead.

    Covers the ``device=`` argument of factories (also the one ``with
    torch.device("cuda:0"):`` adds, since that mode sits above this one),
    ``Tensor.to``/``Tensor.cuda`` and ``Module.cuda``/``Module.to`` (which call them).
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is Tensor.cuda:
            return args[0]
        if func is Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's distributed optimizer accepts torch.cuda.*Tensor parameters only.
            name: str = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        if func is Tensor.to:
            args = tuple(_on_cpu(a) if i > 0 else a for i, a in enumerate(args))
        return func(*args, **kwargs)


def _current_device() -> int:
    return 0


# -- 2. the RNG tracker ------------------------------------------------------------------------


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):  # type: ignore[misc]
    """Megatron-Core's named RNG states, on the CPU generator."""

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"RNG tracker: seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG tracker: state {name!r} is already tracked")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"RNG tracker: state {name!r} was never added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


# -- 3. the layer spec -------------------------------------------------------------------------


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # Hugging Face's Qwen2RMSNorm: normalize in float32, scale in the weight's dtype.
    normed = functional.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(weight.dtype)


class SequenceParallelRMSNorm(torch.nn.Module):
    """RMSNorm whose weight Megatron all-reduces over tensor parallelism under
    sequence parallelism (each rank normalizes its own slice of the tokens)."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Megatron's finalize_model_grads all-reduces the grads marked so.
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, hidden: Tensor) -> Tensor:  # [s, b, h] -> [s, b, h]
        return _rms_norm(hidden, self.weight, self.eps)


class NormColumnParallelLinear(ColumnParallelLinear):  # type: ignore[misc]
    """RMSNorm then Megatron-Core's column-parallel linear, in Transformer Engine's
    ``LayerNormColumnParallelLinear`` layout: the norm's weight is ``layer_norm_weight``."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, **options: Any) -> None:
        # Megatron builds every spec module with its own keyword set: passed on whole.
        super().__init__(input_size, output_size, config=config, **options)
        self.norm_eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(
            torch.ones(input_size, dtype=config.params_dtype)
        )
        self.layer_norm_weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(
        self,
        input_: Tensor,
        weight: Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        normed = _rms_norm(input_, self.layer_norm_weight, self.norm_eps)  # [s/tp, b, h]
        out: tuple[Tensor, Tensor | None] = super().forward(normed, weight, runtime_gather_output)
        return out


def _segments(length: int, packed: PackedSeqParams | None, device: torch.device) -> Tensor:
    """The packed sequence of every position: [length] int64."""
    positions = torch.arange(length, device=device)
    if packed is None:
        return torch.zeros_like(positions)
    cu = (
        packed.cu_seqlens_q_padded
        if packed.cu_seqlens_q_padded is not None
        else packed.cu_seqlens_q
    )
    return torch.bucketize(positions, cu[1:].to(device, torch.int64), right=True)


class PackedDotProductAttention(DotProductAttention):  # type: ignore[misc]
    """Causal attention within each packed sequence (``thd``) or over the whole
    (unpacked ``sbhd``) batch; no dropout (the engine disables it)."""

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        *,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise NotImplementedError("PackedDotProductAttention: attention_bias is not supported")
        if query.dim() == 3:  # thd: [t, np, hn] -> [t, 1, np, hn]
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        length, batch, heads, head_dim = query.shape  # [s, b, np, hn]
        segment = _segments(length, packed_seq_params, query.device)
        positions = torch.arange(length, device=query.device)
        allowed = (segment[:, None] == segment[None, :]) & (
            positions[:, None] >= positions[None, :]
        )  # [s, s]
        repeat = heads // key.shape[2]
        key = key.repeat_interleave(repeat, dim=2)  # [s, b, np, hn]
        value = value.repeat_interleave(repeat, dim=2)
        out = functional.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3),
            key.permute(1, 2, 0, 3),
            value.permute(1, 2, 0, 3),
            attn_mask=allowed,
            scale=self.softmax_scale,
        )  # [b, np, s, hn]
        return out.permute(2, 0, 1, 3).reshape(length, batch, heads * head_dim)


def _dense_layer_spec() -> ModuleSpec:
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=NormColumnParallelLinear,
                    core_attention=PackedDotProductAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=gpt_layer_specs.get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(
                    linear_fc1=NormColumnParallelLinear, linear_fc2=RowParallelLinear
                ),
            ),
            mlp_bda=gpt_layer_specs.get_bias_dropout_add,
        ),
    )


def cpu_decoder_block_spec(
    config: TransformerConfig,
    *,
    use_transformer_engine: bool,
    normalization: str | None = None,
    qk_l2_norm: bool | None = False,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
) -> TransformerBlockSubmodules:
    """``get_gpt_decoder_block_spec``'s block for dense RMSNorm models, built of
    Megatron-Core's local modules whatever ``use_transformer_engine`` asks."""
    unsupported = {
        "num_moe_experts": config.num_moe_experts,
        "multi_latent_attention": config.multi_latent_attention,
        "qk_layernorm": config.qk_layernorm,
        "qk_l2_norm": qk_l2_norm,
        "pipeline_model_parallel_layout": config.pipeline_model_parallel_layout,
    }
    used = {k: v for k, v in unsupported.items() if v}
    if used or config.normalization != "RMSNorm":
        raise NotImplementedError(
            f"the CPU layer spec builds dense RMSNorm models only; this config has "
            f"normalization={config.normalization!r} and {used}"
        )
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    layers = [_dense_layer_spec() for _ in range(config.num_layers)][offset : offset + count]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=SequenceParallelRMSNorm)


# -- installing it -----------------------------------------------------------------------------


def install() -> None:
    """Redirect this process's CUDA calls of a Megatron engine to the CPU (see the
    module docstring); then run the engine inside :class:`CudaToCpu`."""
    mbridge_llm.get_gpt_decoder_block_spec = cpu_decoder_block_spec
    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    torch.cuda.current_device = _current_device
