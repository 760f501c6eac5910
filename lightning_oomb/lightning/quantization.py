"""QLoRA: the base model's linear layers held in 4 bits by bitsandbytes (loaded through transformers'
``BitsAndBytesConfig``) and frozen, under LoRA adapters that train. The option itself, ``Quantization``, and
the bytes it holds are core's (``core.quantization``), which the planner counts.

The chunked engine leaves bitsandbytes' ``Linear4bit`` layers as they are (it swaps only plain ``nn.Linear``
for its accumulating linears, and the fused MLP falls back to the layer's own forward), so a step's gradient
is the quantised model's full-sequence gradient.
"""

from __future__ import annotations

import importlib.util

import torch

from ..core.errors import SetupError


def check_installed() -> None:
    """A SetupError naming the extra when bitsandbytes or peft is missing (before any weight is read)."""
    missing = [name for name in ("bitsandbytes", "peft") if importlib.util.find_spec(name) is None]
    if missing:
        raise SetupError(f"model.quantization needs {' and '.join(missing)}, not installed here: "
                         "pip install 'lightning-oomb[qlora]'")


def is_quantized(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a bitsandbytes 4-bit weight (a ``Params4bit`` with its quantisation state)."""
    return getattr(tensor, "quant_state", None) is not None


def parameter_count(model: torch.nn.Module) -> int:
    """The model's parameters, a 4-bit weight counted as the weights it holds (not its packed bytes)."""
    return sum(p.quant_state.shape.numel() if is_quantized(p) else p.numel() for p in model.parameters())


def keep_trainable_on_cpu(model: torch.nn.Module) -> None:
    """Turn off bitsandbytes' CPU repacking of 4-bit weights, which it does at the first forward in eval mode
    without gradients (a validation step) on CPUs with AVX512-BF16: the repacked weights take a path without
    autograd, on which later training forwards fail, and the repacking fails outright for layers narrower
    than a quantisation block. Without it a CPU computes with the weights as loaded, as a GPU does."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


def restore_quant_states(model: torch.nn.Module, state_dict: dict) -> None:
    """Put the 4-bit weights a state dict holds back into ``model``'s 4-bit layers, in place.

    A 4-bit layer's state dict holds its packed weight and, under ``<weight>.absmax``, ``<weight>.quant_map``
    and so on, the quantisation state that ``load_state_dict`` does not know; each layer's entries are taken
    out of ``state_dict`` into a new ``Params4bit`` (bitsandbytes' ``from_prequantized``, as transformers
    loads a saved 4-bit model), leaving the packed weight itself for ``load_state_dict`` (strict) to copy.
    """
    from bitsandbytes.nn import Params4bit

    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not is_quantized(weight):
            continue
        key = f"{name}.weight"
        stats = {k[len(key) + 1:]: state_dict.pop(k) for k in list(state_dict) if k.startswith(key + ".")}
        if not stats or key not in state_dict:
            continue
        module.weight = Params4bit.from_prequantized(state_dict[key], stats, requires_grad=False,
                                                     device=weight.device, module=module)
