"""Wiring into transformers: an AttentionInterface entry; the fused Triton ops (RMSNorm, RoPE, SwiGLU) and
the decoder's in-place-gradient linear layers (kernels.linear), swapped in for a step; and the checks that
refuse models this engine would not compute exactly. No model class is modified: instances get a
``forward`` attribute and the modeling module its ``apply_rotary_pos_emb`` for a step, restored after it.
"""

from __future__ import annotations

import contextlib
import sys
from functools import partial
from typing import Callable, Iterator, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

ATTN_NAME = "lightning_oomb"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE variants whose frequencies depend on the sequence length seen, which differs per chunk.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class ChunkAttender(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor: ...  # noqa: E704


_active: ChunkAttender | None = None


def _oomb_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """AttentionInterface entry: (B, H_q, T, D) queries -> (B, T, H_q, D), no weights."""
    if _active is None:
        raise RuntimeError(
            f"the '{ATTN_NAME}' attention ran outside a lightning_oomb step; call the model through "
            "lightning_oomb.train_step/eval_loss or OOMBStrategy"
        )
    if attention_mask is not None:
        raise ValueError("lightning_oomb attention is causal only and takes no attention mask")
    if dropout:
        raise ValueError(
            f"attention dropout {dropout} would give stage 1 and stage 2 different K/V; set attention_dropout=0"
        )
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise ValueError(f"lightning_oomb attention does not implement `{name}`")
    if not getattr(module, "is_causal", True):
        raise ValueError("lightning_oomb attention is causal only")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    device = query.device.type
    if torch.is_autocast_enabled(device):
        # As SDPA under autocast (transformers' own bf16-mixed attention): q, k, v in the autocast dtype. RoPE's
        # float32 cos/sin make q and k float32 under bf16-mixed while v stays bf16; the K/V store is bf16 too.
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    out = _active.attend(module.layer_idx, query, key, value, scale)
    return out.transpose(1, 2).contiguous(), None


# No mask function is registered for it, on purpose: for an implementation absent from transformers'
# AttentionMaskInterface ``create_causal_mask`` returns None at once. With one, it would first look for packed
# sequences in the position ids (a Python ``if`` on a GPU tensor): the host waiting for the GPU at every chunk.
AttentionInterface.register(ATTN_NAME, _oomb_attention)


def causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers causal LM inside ``model`` (unwrapping peft), or a clear error."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(inner, PreTrainedModel) or not isinstance(inner.get_output_embeddings(), nn.Linear):
        raise TypeError(
            f"lightning_oomb trains transformers causal LMs (e.g. Qwen2ForCausalLM); got {type(model).__name__}"
        )
    return inner


def find_causal_lm(module: nn.Module) -> PreTrainedModel:
    """The one transformers causal LM inside a LightningModule (``self.model`` or any other name)."""
    found = [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, PreTrainedModel) and isinstance(m.get_output_embeddings(), nn.Linear)
    ]
    if len(found) != 1:
        names = ", ".join(name or "<root>" for name, _ in found) or "none"
        raise TypeError(
            f"lightning_oomb needs exactly one transformers causal LM inside the LightningModule, found {names}"
        )
    return found[0][1]


def _rope_type(config) -> str:
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(config, attr, None)
        if isinstance(params, dict) and ("rope_type" in params or "type" in params):
            return params.get("rope_type", params.get("type"))
    return "default"


def check_supported(model: nn.Module, seq_len: int) -> None:
    """Refuse, before any compute, what this engine would not compute exactly for ``seq_len`` tokens."""
    lm = causal_lm(model)
    cfg = lm.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"model_type {cfg.model_type!r} is not supported; lightning_oomb implements "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (dense causal attention with RoPE)"
        )
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None) is not None:
            raise NotImplementedError(f"{name} is not implemented by lightning_oomb attention")
    rope = _rope_type(cfg)
    if rope in LENGTH_DEPENDENT_ROPE:
        raise NotImplementedError(
            f"rope_type {rope!r} changes its frequencies with the sequence length, so chunks would see other "
            "positions than the full sequence; use a static RoPE (default, linear, llama3, yarn)"
        )
    windows = {getattr(m, "sliding_window", None) for m in lm.modules() if hasattr(m, "layer_idx")}
    if cfg.model_type == "mistral" or "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        windows.add(cfg.sliding_window)
    windows.discard(None)
    if windows and seq_len > min(windows):
        raise NotImplementedError(
            f"the model uses sliding-window attention (window {min(windows)}) and the sequence has {seq_len} "
            "tokens, so the window would cut attention; lightning_oomb implements full causal attention only: "
            "disable the window (config.use_sliding_window=False / sliding_window=None) or use sequences no "
            "longer than the window"
        )
    if lm.training and getattr(cfg, "attention_dropout", 0.0):
        raise NotImplementedError(
            f"attention_dropout={cfg.attention_dropout} in training mode would make stage 2 recompute other "
            "K/V than stage 1 stored; set config.attention_dropout=0.0"
        )


def _fused_rms_norm(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    from ..kernels.rms_norm import rms_norm

    return rms_norm(hidden_states, module.weight, module.variance_epsilon)


def _fused_mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from ..kernels.linear import swiglu_linear
    from ..kernels.swiglu import silu_mul

    down = module.down_proj
    gate, up = module.gate_proj(x), module.up_proj(x)
    ours = getattr(down.__dict__.get("forward"), "func", None) is _accumulating_forward  # our plain nn.Linear
    if ours and not isinstance(down.weight, DTensor):  # not tensor parallel (see _accumulating_forward)
        return swiglu_linear(gate, up, down.weight, down.bias)
    return down(silu_mul(gate, up))


def _fused_rope(original, q, k, cos, sin, unsqueeze_dim=1):
    if unsqueeze_dim != 1:  # another layout than the supported models use: transformers' own function
        return original(q, k, cos, sin, unsqueeze_dim)
    from ..kernels.rope import apply_rope

    return apply_rope(q, k, cos, sin)


@contextlib.contextmanager
def _instance_forwards(forwards: list[tuple[nn.Module, Callable]]) -> Iterator[None]:
    """Give each module the instance ``forward`` paired with it for the block (its class is untouched)."""
    for m, forward in forwards:
        m.forward = forward
    try:
        yield
    finally:
        for m, _ in forwards:
            del m.forward


@contextlib.contextmanager
def _fused_ops(lm: PreTrainedModel) -> Iterator[None]:
    """Swap transformers' RMSNorm, SwiGLU MLP and RoPE for the fused Triton ops (lightning_oomb.kernels) in
    ``lm`` for the block: the same functions, each in one pass over memory and rounded once."""
    forwards = []
    for m in lm.modules():
        name = type(m).__name__
        if "forward" in m.__dict__:  # someone else's instance forward (accelerate's hooks): left as it is
            continue
        if name.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and m.weight.dim() == 1:
            forwards.append((m, partial(_fused_rms_norm, m)))
        elif name.endswith("MLP") and all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj")):
            if lm.config.hidden_act == "silu":
                forwards.append((m, partial(_fused_mlp, m)))
    modeling = {sys.modules[type(m).__module__] for m in lm.modules() if hasattr(m, "layer_idx")}
    modeling = [mod for mod in modeling if hasattr(mod, "apply_rotary_pos_emb")]
    originals = [mod.apply_rotary_pos_emb for mod in modeling]
    for mod, original in zip(modeling, originals):
        mod.apply_rotary_pos_emb = partial(_fused_rope, original)
    try:
        with _instance_forwards(forwards):
            yield
    finally:
        for mod, original in zip(modeling, originals):
            mod.apply_rotary_pos_emb = original


def _accumulating_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    from ..kernels.linear import accumulating_linear

    # A tensor-parallel layer's weight is a DTensor shard at every call (an FSDP layer's is whole while it
    # computes): nn.Linear's own computation, whose DTensor ops TP's input and output hooks around it expect.
    if isinstance(module.weight, DTensor):
        return nn.functional.linear(x, module.weight, module.bias)
    return accumulating_linear(x, module.weight, module.bias)


@contextlib.contextmanager
def _accumulating_linears(lm: PreTrainedModel) -> Iterator[None]:
    """The decoder's nn.Linear layers (not subclasses such as quantized or LoRA layers, nor layers with
    someone else's instance forward) add their weight gradients into ``.grad`` in place for the block."""
    linears = [m for m in lm.get_decoder().modules() if type(m) is nn.Linear and "forward" not in m.__dict__]
    with _instance_forwards([(m, partial(_accumulating_forward, m)) for m in linears]):
        yield


@contextlib.contextmanager
def bind(
    model: nn.Module, attender: ChunkAttender, checkpoint_layers: bool = False, fused_ops: bool = False
) -> Iterator[None]:
    """Route the model's attention to ``attender``, let the decoder's linear layers add their weight
    gradients in place (and checkpoint each decoder layer if asked, and swap in the fused Triton ops if
    asked); restore after."""
    global _active
    lm = causal_lm(model)
    if _active is not None:
        raise RuntimeError("a lightning_oomb step is already running; steps cannot be nested")
    if checkpoint_layers and not lm.training:
        raise ValueError("checkpoint_layers=True needs the model in training mode (model.train())")
    saved_impl = lm.config._attn_implementation
    layers = [m for m in lm.modules() if isinstance(m, GradientCheckpointingLayer)]
    if checkpoint_layers and not layers:
        raise NotImplementedError(f"{type(lm).__name__} has no checkpointable decoder layers")
    saved_ckpt = [(m, m.__dict__.get("gradient_checkpointing"), m.__dict__.get("_gradient_checkpointing_func")) for m in layers]
    lm.set_attn_implementation(ATTN_NAME)
    if checkpoint_layers:
        for m in layers:
            m.gradient_checkpointing = True
            m._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    _active = attender
    try:
        with _accumulating_linears(lm), _fused_ops(lm) if fused_ops else contextlib.nullcontext():
            yield
    finally:
        _active = None
        lm.set_attn_implementation(saved_impl)
        for m, flag, func in saved_ckpt:
            for name, value in (("gradient_checkpointing", flag), ("_gradient_checkpointing_func", func)):
                if value is None:
                    m.__dict__.pop(name, None)
                else:
                    setattr(m, name, value)
