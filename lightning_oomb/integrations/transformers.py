"""Wiring into transformers: an AttentionInterface entry that routes every layer's attention to the step, and
``bind``, which sets it and the swapped ops (integrations.fused_ops) for a step. No model class is modified:
instances get a ``forward`` attribute and the modeling module its ``apply_rotary_pos_emb`` for a step,
restored after it. What the engine refuses: integrations.support.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from ..recurrent import carried_kind, carried_layers
from .fused_ops import accumulating_linears
from .fused_ops import fused_ops as swapped_fused_ops

ATTN_NAME = "lightning_oomb"


class ChunkAttender(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,  # noqa: E704
               window: int | None = None, sinks: torch.Tensor | None = None,
               softcap: float | None = None) -> torch.Tensor: ...

    def carry(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor: ...  # noqa: E704


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
    if not getattr(module, "is_causal", True):
        raise ValueError("lightning_oomb attention is causal only")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    device = query.device.type
    if torch.is_autocast_enabled(device):
        # As SDPA under autocast (transformers' own bf16-mixed attention): q, k, v in the autocast dtype. RoPE's
        # float32 cos/sin make q and k float32 under bf16-mixed while v stays bf16; the K/V store is bf16 too.
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))  # GPT-OSS: a learned logit per head in each softmax
    # Gemma 2's attn_logit_softcapping: scores softcap * tanh(q.k * scale / softcap)
    softcap = kwargs.get("softcap")
    out = _active.attend(module.layer_idx, query, key, value, scale, window=sliding_window(module), sinks=sinks,
                         softcap=None if softcap is None else float(softcap))
    return out.transpose(1, 2).contiguous(), None


def _carried_forward(layer: nn.Module, hidden_states: torch.Tensor, *args, attention_mask=None,
                     **kwargs) -> Any:
    """The forward of a state-carrying layer (lightning_oomb.recurrent) during a step: the chunk from the state
    the chunk before it left, through the step's ``carry``, returned as the layer's own forward returns it."""
    if attention_mask is not None:
        raise ValueError("lightning_oomb runs state-carrying layers without a padding mask; mask labels with -100")
    return carried_kind(layer).returns(_active.carry(layer, hidden_states))


# No mask function is registered for it, on purpose: for an implementation absent from transformers'
# AttentionMaskInterface ``create_causal_mask`` returns None at once. With one, it would first look for packed
# sequences in the position ids (a Python ``if`` on a GPU tensor): the host waiting for the GPU at every chunk.
AttentionInterface.register(ATTN_NAME, _oomb_attention)


def layer_windows(model: nn.Module) -> dict[int, int]:
    """The sliding window (tokens) of each attention layer that has one, by layer index (empty: full causal
    attention only)."""
    return {m.layer_idx: w for m in causal_lm(model).modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")
            for w in [sliding_window(m)] if w is not None}


def sliding_window(attention: nn.Module) -> int | None:
    """The sliding window of an attention layer in tokens, None for full causal attention. Layers of models
    that mix both (Gemma 3, Qwen2) carry theirs as ``sliding_window``; where the layer has no such attribute
    the model's mask applies ``config.sliding_window`` to every layer (Mistral, Mixtral, Phi-3, StarCoder2)."""
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window
    config = getattr(attention, "config", None)
    if config is None or getattr(config, "use_sliding_window", True) is False:
        return None
    return getattr(config, "sliding_window", None)


@dataclass(frozen=True)
class LogitHead:
    """What a causal LM does to ``lm_head(h)`` before its loss, in transformers' order: ``logits * scale``
    (Cohere's ``logit_scale``, Falcon-H1's ``lm_head_multiplier``), ``logits / divisor`` (Granite's
    ``logits_scaling``), then ``softcap * tanh(logits / softcap)`` (``final_logit_softcapping``: Gemma 2,
    NanoChat). The identity is LogitHead()."""

    scale: float = 1.0
    divisor: float = 1.0
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.divisor == 1.0 and self.softcap is None

    @property
    def multiplier(self) -> float:
        """scale / divisor: the one factor a fused kernel applies (exactly the two steps where either is a power
        of two, as every released checkpoint's is; else within a unit in the last place)."""
        return self.scale / self.divisor

    def apply(self, logits: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """The model's logits from ``lm_head(h)``: the operations of its forward, in ``logits``' dtype (with
        ``inplace``, over ``logits``, no autograd)."""
        if inplace:
            if self.scale != 1.0:
                logits.mul_(self.scale)
            if self.divisor != 1.0:
                logits.div_(self.divisor)
            if self.softcap is not None:
                logits.div_(self.softcap).tanh_().mul_(self.softcap)
            return logits
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.divisor != 1.0:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


# Model types whose logits_scaling multiplies the logits (muP), where Granite's divides them.
MULTIPLYING_LOGITS_SCALING = ("hyperclovax",)
# Model types whose config names the factor on the logits otherwise than logit_scale (Falcon-H1's muP).
LOGIT_SCALE_FIELD = {"falcon_h1": "lm_head_multiplier"}


def logit_head(model: nn.Module) -> LogitHead:
    """The ``LogitHead`` of the causal LM in ``model``, from its config. Fields that are absent, None or not a
    number change nothing here; a model whose forward does otherwise than its fields say is found by
    integrations.support's probe of its logits, and refused."""
    cfg = causal_lm(model).config

    def number(field: str) -> float | None:
        value = getattr(cfg, field, None)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    scale_field = LOGIT_SCALE_FIELD.get(cfg.model_type, "logit_scale")
    scale, divisor, softcap = number(scale_field), number("logits_scaling"), number("final_logit_softcapping")
    if divisor is not None and cfg.model_type in MULTIPLYING_LOGITS_SCALING:
        scale, divisor = divisor, None
    return LogitHead(1.0 if scale is None else scale, 1.0 if divisor is None else divisor, softcap)


def head_input(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The last hidden state (B, T, d) as the output layer ``head`` reads it: in its weight's dtype. Mamba's models
    keep their residual stream in float32 (residual_in_fp32) and cast it before lm_head; any other model's
    hidden state is in that dtype already (no copy), or under autocast, which casts inside the matmul."""
    dtype = head.weight.dtype
    if hidden.dtype == dtype or not dtype.is_floating_point or torch.is_autocast_enabled(hidden.device.type):
        return hidden
    return hidden.to(dtype)


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


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of the causal LM in ``model``, in order (transformers' checkpointable layers)."""
    return [m for m in causal_lm(model).modules() if isinstance(m, GradientCheckpointingLayer)]


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
    layers = decoder_layers(lm)
    if checkpoint_layers and not layers:
        raise NotImplementedError(f"{type(lm).__name__} has no checkpointable decoder layers")
    saved_ckpt = [(m, m.__dict__.get("gradient_checkpointing"), m.__dict__.get("_gradient_checkpointing_func")) for m in layers]
    lm.set_attn_implementation(ATTN_NAME)
    if checkpoint_layers:
        for m in layers:
            m.gradient_checkpointing = True
            m._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    carried = carried_layers(lm)
    for m in carried:
        m.forward = partial(_carried_forward, m)
    _active = attender
    try:
        with accumulating_linears(lm), swapped_fused_ops(lm) if fused_ops else contextlib.nullcontext():
            yield
    finally:
        _active = None
        for m in carried:
            m.__dict__.pop("forward", None)
        lm.set_attn_implementation(saved_impl)
        for m, flag, func in saved_ckpt:
            for name, value in (("gradient_checkpointing", flag), ("_gradient_checkpointing_func", func)):
                if value is None:
                    m.__dict__.pop(name, None)
                else:
                    setattr(m, name, value)
