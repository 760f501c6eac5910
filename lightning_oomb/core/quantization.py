"""QLoRA's 4-bit base weights: what the ``quantization`` option takes (``Quantization``, the module's and the
planner's) and the bytes bitsandbytes holds for a weight it quantises (``four_bit_bytes``).

bitsandbytes (``quantize_4bit``, as ``Params4bit`` calls it through transformers' ``BitsAndBytesConfig``) packs
two 4-bit codes a byte and keeps, per block of ``BLOCK`` weights, the block's absolute maximum: a float32, or
with double quantisation an 8-bit code of it, the float32 absmax of every ``NESTED_BLOCK`` of those codes, one
float32 offset and the 256-entry float32 map of the 8-bit codes. Each quantised tensor also has its own copy of
the 16-entry float32 map of its 4-bit type. transformers quantises the ``nn.Linear`` layers but the output layer
(``replace_with_bnb_linear`` takes modules of type nn.Linear exactly; ``get_keys_to_not_convert``: the output
embeddings, tied weights and the last module stay in the compute dtype), so the embeddings, norms, biases and
lm_head keep their dtype, and so do a mixture of experts' experts (transformers 5 holds each layer's experts as
fused (n_experts, ...) nn.Parameters) and routers (an nn.Parameter too).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from .errors import SetupError

if TYPE_CHECKING:
    from .model_shape import ModelShape

QUANT_TYPES = ("nf4", "fp4")
BLOCK = 64  # weights per absmax block: quantize_4bit's default, which Params4bit keeps
NESTED_BLOCK = 256  # absmax codes per second-level block with double quantisation (quantize_4bit's)
TYPE_MAP_BYTES = 16 * 4  # the 4-bit type's float32 map, one copy per quantised tensor
NESTED_MAP_BYTES = 256 * 4 + 4  # double quantisation: the 8-bit map of the absmax codes and the offset, per tensor


@dataclasses.dataclass(frozen=True)
class Quantization:
    """``quantization``: the base weights in bitsandbytes' 4-bit ``quant_type`` ("nf4", QLoRA's normal float, or
    "fp4"); ``double_quant`` also quantises the per-block scales (about 0.4 bits a weight less)."""

    quant_type: str = "nf4"
    double_quant: bool = False

    @classmethod
    def parse(cls, value: "Quantization | str | dict | None", option: str = "quantization") -> "Quantization | None":
        """From itself, the YAML's value or the planner's: None (no quantisation), a type (``nf4``) or a dict
        (``{quant_type: nf4, double_quant: true}``); a SetupError names what is wrong, and ``option``."""
        if value is None or isinstance(value, cls):
            return value
        fields = {"quant_type": value} if isinstance(value, str) else value
        options = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(fields, dict) or set(fields) - set(options):
            unknown = sorted(set(fields) - set(options)) if isinstance(fields, dict) else [repr(value)]
            raise SetupError(f"{option} takes a 4-bit type ({', '.join(QUANT_TYPES)}) or a dict of "
                             f"{' and '.join(options)}; got {', '.join(map(str, unknown))}")
        spec = cls(**fields)
        if spec.quant_type not in QUANT_TYPES:
            raise SetupError(f"{option}: quant_type must be one of {', '.join(QUANT_TYPES)} "
                             f"(bitsandbytes' 4-bit types), got {spec.quant_type!r}")
        if not isinstance(spec.double_quant, bool):
            raise SetupError(f"{option}: double_quant must be true or false, got {spec.double_quant!r}")
        return spec

    @classmethod
    def of_model(cls, config: object) -> "Quantization | None":
        """The 4-bit quantisation a transformers model config says its weights were loaded with (its
        ``quantization_config``: a ``BitsAndBytesConfig`` or its dict), None for any other."""
        q = getattr(config, "quantization_config", None)
        get = q.get if isinstance(q, dict) else lambda name, default=None: getattr(q, name, default)
        if q is None or not get("load_in_4bit", False):
            return None
        return cls(get("bnb_4bit_quant_type", "fp4"), bool(get("bnb_4bit_use_double_quant", False)))

    def hf_config(self, compute_dtype: torch.dtype):
        """transformers' ``BitsAndBytesConfig`` for ``from_pretrained``, computing in ``compute_dtype``."""
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=self.quant_type,
                                  bnb_4bit_use_double_quant=self.double_quant, bnb_4bit_compute_dtype=compute_dtype)

    def describe(self) -> str:
        return self.quant_type + (", double-quantised" if self.double_quant else "")

    def absmax_bytes(self, n: int) -> int:
        """Bytes of the per-block scales of a tensor of ``n`` weights (the maps not included)."""
        blocks = math.ceil(n / BLOCK)
        return blocks + 4 * math.ceil(blocks / NESTED_BLOCK) if self.double_quant else 4 * blocks

    def tensor_bytes(self, n: int) -> int:
        """Bytes bitsandbytes holds for one weight tensor of ``n`` elements in 4 bits: the packed codes, the
        per-block scales and the tensor's maps (the module docstring says which)."""
        maps = TYPE_MAP_BYTES + (NESTED_MAP_BYTES if self.double_quant else 0)
        return math.ceil(n / 2) + self.absmax_bytes(n) + maps

    def weight_bytes(self, shape: "ModelShape") -> int:
        """Bytes bitsandbytes holds for the 4-bit weights of a model of ``shape``: every decoder layer's
        nn.Linear weights, q, k, v, o, gate, up and down (``tensor_bytes`` each); the output layer, embeddings,
        norms, and a mixture's experts and routers (nn.Parameters of no nn.Linear) are not quantised."""
        return sum(g.layers * sum(self.tensor_bytes(n) for n in g.linear) for g in shape.layer_groups)
