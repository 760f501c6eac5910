"""The ops swapped into a transformers model for a step: the decoder's linear layers that add their weight
gradients in place (kernels.linear), and the fused Triton ops (RMSNorm, SwiGLU, RoPE) where the model's own
module computes the same function.

Matching is by behaviour, not by name: the first time a class (or a modeling module's ``apply_rotary_pos_emb``)
is met, its own forward and the fused op run on a small random input in float32 on the model's device, and the
fused op is used only if they agree. A Gemma RMSNorm (``x * (1 + w)``), a GELU MLP, an interleaved or partial
RoPE then keep the model's own code: a family the ops do not fit runs slower, never differently.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
from functools import partial
from typing import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from .decoder import decoder_of

# Agreement asked of a fused op on the probe, in float32: the ops round once where the model's code rounds
# at every operation (~1e-7 apart); a different function is off by O(1).
PROBE_TOLERANCE = 1e-4
PROBE_ROWS = 4

_agrees: dict[object, bool] = {}  # class or (modeling module, rotary class) -> the probe's answer
_keeps_dtype: dict[object, bool] = {}  # a modeling module's apply_rotary_pos_emb -> _rope_keeps_dtype's answer


def _probe(key: object, device: torch.device, ours: Callable[[], torch.Tensor],
           theirs: Callable[[], torch.Tensor]) -> bool:
    """Whether ``ours()`` equals ``theirs()`` within PROBE_TOLERANCE, asked once per ``key``, in float32 (not
    under the step's autocast). An op that refuses the input (another layout) does not agree."""
    if key not in _agrees:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            try:
                a, b = ours(), theirs()
                _agrees[key] = a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=PROBE_TOLERANCE,
                                                                     atol=PROBE_TOLERANCE)
            except (ValueError, RuntimeError, TypeError, IndexError):
                _agrees[key] = False
    return _agrees[key]


def _randn(*shape: int, device: torch.device) -> torch.Tensor:
    """Probe data from its own generator: a probe leaves the run's random stream as it was."""
    generator = torch.Generator(device=device).manual_seed(0)
    return torch.randn(*shape, generator=generator, device=device)


def _linear(n_in: int, n_out: int, device: torch.device) -> nn.Linear:
    layer = nn.utils.skip_init(nn.Linear, n_in, n_out, bias=False, device=device)
    layer.weight.data = _randn(n_out, n_in, device=device) / n_in**0.5
    return layer


def _device(m: nn.Module) -> torch.device:
    p = next(m.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _fused_rms_norm(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    from ..kernels.rms_norm import rms_norm

    return rms_norm(hidden_states, module.weight, module.variance_epsilon)


def _rms_norm_agrees(m: nn.Module) -> bool:
    if not (hasattr(m, "variance_epsilon") and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dim() == 1):
        return False
    if type(m) in _agrees:  # asked once per class: no probe data built again at every step's bind
        return _agrees[type(m)]
    device, n = _device(m), m.weight.shape[0]
    probe = copy.copy(m)  # the same attributes, its own small float32 weight (the model's may be a shard)
    probe._parameters = {"weight": nn.Parameter(1 + 0.1 * _randn(n, device=device))}
    x = _randn(PROBE_ROWS, n, device=device)
    return _probe(type(m), device, lambda: _fused_rms_norm(probe, x), lambda: type(m).forward(probe, x))


def _fused_mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from ..kernels.linear import swiglu_linear
    from ..kernels.swiglu import silu_mul

    down = module.down_proj
    gate, up = module.gate_proj(x), module.up_proj(x)
    ours = getattr(down.__dict__.get("forward"), "func", None) is _accumulating_forward  # our plain nn.Linear
    if ours and not isinstance(down.weight, DTensor):  # not tensor parallel (see _accumulating_forward)
        return swiglu_linear(gate, up, down.weight, down.bias)
    return down(silu_mul(gate, up))


def _mlp_agrees(m: nn.Module) -> bool:
    if not all(isinstance(getattr(m, a, None), nn.Module) for a in ("gate_proj", "up_proj", "down_proj")):
        return False
    if type(m) in _agrees:
        return _agrees[type(m)]
    device = _device(m)
    # Its own small float32 layers, the model's activation: the probe asks what the forward computes, which no
    # width changes, and takes no memory from a step placed to the last GiB.
    hidden, inner = 32, 48
    probe = copy.copy(m)
    probe._modules = {**m._modules, "gate_proj": _linear(hidden, inner, device),
                      "up_proj": _linear(hidden, inner, device), "down_proj": _linear(inner, hidden, device)}
    x = _randn(PROBE_ROWS, hidden, device=device)
    return _probe(type(m), device, lambda: _fused_mlp(probe, x), lambda: type(m).forward(probe, x))


def _fused_rope(original, q, k, cos, sin, unsqueeze_dim=1, keep_dtype=False):
    if unsqueeze_dim != 1 or cos.shape[-1] != q.shape[-1]:  # another layout, or a partial rotary: the model's own
        return original(q, k, cos, sin, unsqueeze_dim)
    from ..kernels.rope import apply_rope

    return apply_rope(q, k, cos, sin, out_dtype=q.dtype if keep_dtype else None)


def _rope_keeps_dtype(original, device: torch.device) -> bool:
    """Whether ``original`` (a modeling module's apply_rotary_pos_emb) returns q's dtype for bf16 q, k and
    float32 cos, sin over the whole head (OLMo 2 casts back) rather than the promoted float32 (Llama's
    q * cos). A function that takes no such cos (GPT-OSS's halves) never meets the fused op."""
    if original not in _keeps_dtype:
        q = torch.zeros(1, 1, 2, 4, dtype=torch.bfloat16, device=device)
        cos = torch.ones(1, 2, 4, device=device)
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            try:
                _keeps_dtype[original] = original(q, q, cos, cos)[0].dtype == torch.bfloat16
            except (ValueError, RuntimeError, TypeError, IndexError):
                _keeps_dtype[original] = False
    return _keeps_dtype[original]


def _rope_agrees(modeling, lm: PreTrainedModel) -> bool:
    """Whether ``modeling.apply_rotary_pos_emb`` equals the fused RoPE on the cos/sin of the model's own rotary
    embedding (its layout: halves or interleaved, the whole head or part of it)."""
    rotary = next((m for m in lm.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    cfg = lm.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if rotary is None:
        return False
    original = modeling.apply_rotary_pos_emb
    key = (modeling, type(rotary), head_dim, tuple(getattr(rotary, "inv_freq", torch.empty(0)).shape))
    if key in _agrees:
        return _agrees[key]
    device, tokens = _device(lm), 8

    def cos_sin():
        x = torch.zeros(1, tokens, head_dim, device=device)
        position_ids = torch.arange(tokens, device=device)[None]
        if "layer_type" in inspect.signature(rotary.forward).parameters:
            return rotary(x, position_ids, (getattr(cfg, "layer_types", None) or ["full_attention"])[0])
        return rotary(x, position_ids)

    q, k = _randn(1, 2, tokens, head_dim, device=device), 0.5 * _randn(1, 1, tokens, head_dim, device=device)

    def run(apply):
        cos, sin = cos_sin()
        return torch.cat([t.flatten() for t in apply(q, k, cos.float(), sin.float())])

    return _probe(key, device, lambda: run(partial(_fused_rope, original)), lambda: run(original))


def _accumulating_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    from ..kernels.linear import accumulating_linear

    # A tensor-parallel layer's weight is a DTensor shard at every call (an FSDP layer's is whole while it
    # computes): nn.Linear's own computation, whose DTensor ops TP's input and output hooks around it expect.
    if isinstance(module.weight, DTensor):
        return nn.functional.linear(x, module.weight, module.bias)
    return accumulating_linear(x, module.weight, module.bias)


@contextlib.contextmanager
def instance_forwards(forwards: list[tuple[nn.Module, Callable]]) -> Iterator[None]:
    """Give each module the instance ``forward`` paired with it for the block (its class is untouched)."""
    for m, forward in forwards:
        m.forward = forward
    try:
        yield
    finally:
        for m, _ in forwards:
            del m.forward


@contextlib.contextmanager
def fused_ops(lm: PreTrainedModel) -> Iterator[None]:
    """Swap the model's RMSNorm, SwiGLU MLP and RoPE for the fused Triton ops for the block, where its own
    computes the same function (probed once per class): each in one pass over memory, rounded once."""
    forwards = []
    for m in lm.modules():
        if "forward" in m.__dict__:  # someone else's instance forward (accelerate's hooks): left as it is
            continue
        name = type(m).__name__
        if name.endswith("RMSNorm") and _rms_norm_agrees(m):
            forwards.append((m, partial(_fused_rms_norm, m)))
        elif name.endswith("MLP") and _mlp_agrees(m):
            forwards.append((m, partial(_fused_mlp, m)))
    modeling = {sys.modules[type(m).__module__] for m in lm.modules() if hasattr(m, "layer_idx")}
    modeling = [mod for mod in modeling if hasattr(mod, "apply_rotary_pos_emb") and _rope_agrees(mod, lm)]
    originals = [mod.apply_rotary_pos_emb for mod in modeling]
    for mod, original in zip(modeling, originals):
        keep = _rope_keeps_dtype(original, _device(lm))
        mod.apply_rotary_pos_emb = partial(_fused_rope, original, keep_dtype=keep)
    try:
        with instance_forwards(forwards):
            yield
    finally:
        for mod, original in zip(modeling, originals):
            mod.apply_rotary_pos_emb = original


@contextlib.contextmanager
def accumulating_linears(lm: PreTrainedModel) -> Iterator[None]:
    """The decoder's nn.Linear layers (not subclasses such as quantized or LoRA layers, nor layers with
    someone else's instance forward) add their weight gradients into ``.grad`` in place for the block."""
    linears = [m for m in decoder_of(lm).modules() if type(m) is nn.Linear and "forward" not in m.__dict__]
    with instance_forwards([(m, partial(_accumulating_forward, m)) for m in linears]):
        yield
