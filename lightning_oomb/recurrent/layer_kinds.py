"""Which decoder layers of a model attend and keep K/V pages, by the layer kinds its transformers config names
(``layer_types``, or ``layers_block_type`` in some hybrids' configs)."""

from __future__ import annotations

from typing import Any

# Layer kinds that keep no K/V pages: layers whose token mixing carries a state from token to token (this room's
# layers), and layers of an MLP or experts only (Nemotron-H).
CARRIED_KINDS = ("linear_attention", "mamba", "conv")
NO_KV_KINDS = CARRIED_KINDS + ("mlp", "moe")
# Families whose decoder layers are a norm and a state-space mixer alone: no attention, no MLP.
STATE_SPACE_FAMILIES = ("mamba", "falcon_mamba", "mamba2")
# Families whose every decoder layer runs attention and a state-space mixer side by side (no layer kinds named).
PARALLEL_HYBRIDS = ("falcon_h1",)


def layer_kinds(config: Any) -> list[str]:
    """The config's kind of each decoder layer, by layer index (empty where it names none)."""
    return list(getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or [])


def kv_layer_indices(config: Any) -> list[int]:
    """The decoder layers that attend and keep K/V pages, ascending: every layer, but those the layer kinds name as
    state-carrying or MLP-only, and none of a state-space family's. A step's page pool holds these layers' pages,
    in this order."""
    if getattr(config, "model_type", "") in STATE_SPACE_FAMILIES:
        return []
    kinds = layer_kinds(config)
    if not kinds:
        return list(range(config.num_hidden_layers))
    return [i for i, kind in enumerate(kinds) if kind not in NO_KV_KINDS]
