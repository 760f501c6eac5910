"""Which transformers causal LMs the engine trains exactly: any whose layers mix tokens only in attention called
through transformers' AttentionInterface (causal, a RoPE or position embedding that does not depend on the
sequence length) and whose loss is the cross-entropy of ``lm_head(h)`` as the model's head changes it
(``LogitHead``: a scale, a soft cap). ``check_supported`` refuses every other model before any compute, in one
line naming what stands in the way and what to set.
"""

from __future__ import annotations

import sys
import weakref
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
import transformers

from ..recurrent import carried_kind, missing_function
from ..recurrent.layer_kinds import kv_layer_indices
from .decoder import decoder_of
from .router_balance import router_class
from .transformers import causal_lm, head_input, logit_head

# RoPE variants whose frequencies depend on the sequence length seen, which differs per chunk.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# Layer kinds that mix tokens only through attention; any other (conv, linear attention, mamba) would need its
# own state carried across chunk borders.
ATTENTION_LAYERS = ("full_attention", "sliding_attention")
# Layer kinds some hybrids' layer_types also name that mix no tokens (their own MLP or experts' layer).
TOKENWISE_LAYERS = ("mlp", "moe")
# Model types whose attention layers call transformers' AttentionInterface though their class does not declare
# ``_supports_attention_backend`` (each trained against its whole-sequence training in tests/test_model_families.py).
INTERFACE_WITHOUT_FLAG = ("stablelm", "falcon", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "bamba",
                          "nemotron_h", "granitemoehybrid", "jamba", "falcon_h1")
# Families whose attention layers call attention more than once a forward, with the same keys and other values,
# by model_type: what those values are. The K/V pages hold one value per layer and token, so each call would
# attend to the last call's values of the past.
REPEATED_ATTENTION = {
    "diffllama": "each half of its values (differential attention: the two outputs then mixed with lambda)",
}
PROBE_TOKENS = 8
_loss_checked: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models whose loss was probed


def _rope_type(config) -> str:
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(config, attr, None)
        if isinstance(params, dict) and ("rope_type" in params or "type" in params):
            return params.get("rope_type", params.get("type"))
    return "default"


def _alibi(cfg) -> bool:
    """Whether the model biases its attention scores by ALiBi: BLOOM always, MPT and Falcon where their config
    says so (``attn_config.alibi``, ``alibi``)."""
    attention = getattr(cfg, "attn_config", None)
    return (cfg.model_type == "bloom" or getattr(cfg, "alibi", False) is True
            or getattr(attention, "alibi", False) is True)


def check_supported(model: nn.Module) -> None:
    """Refuse, before any compute, what this engine would not compute exactly, whatever the sequence length.
    Sliding windows are computed (each layer's own, the keys before it masked and their pages skipped)."""
    lm = causal_lm(model)
    cfg = lm.config
    name = f"{type(lm).__name__} (model_type {cfg.model_type!r})"
    decoder = decoder_of(lm)
    # State-carrying layers that lightning_oomb.recurrent runs chunk by chunk, and what lies inside them.
    carried = {n: m for n, m in decoder.named_modules() if carried_kind(m) is not None}
    inside = {n for n, _ in decoder.named_modules() if any(n == c or n.startswith(c + ".") for c in carried)}
    other_layers = _uncarried_kinds(getattr(cfg, "layer_types", None) or [], carried.values())
    convs = [n for n, m in decoder.named_modules() if isinstance(m, (nn.Conv1d, nn.Conv2d)) and n not in inside]
    if other_layers or convs:
        what = f"layers of kind {', '.join(other_layers)}" if other_layers else f"convolutions over tokens ({convs[0]})"
        raise NotImplementedError(f"{name} has {what}, which mix tokens outside attention: chunks would cut them; "
                                  "not supported")
    lacking = next((f for m in carried.values() for f in [missing_function(m)] if f), None)
    if lacking is not None:
        raise NotImplementedError(f"{name}'s state-carrying layers run chunk by chunk through transformers' "
                                  f"{lacking}, which transformers {transformers.__version__} lacks: upgrade "
                                  "transformers")
    if _alibi(cfg):
        raise NotImplementedError(
            f"{name} adds ALiBi position biases (a slope per head times the key's distance) to its attention "
            "scores, which lightning_oomb's attention does not compute: not supported"
        )
    # After the layer kinds and ALiBi: what stands in the way is named before the own-code attention it comes with.
    # A model whose every layer is a carried state-space or linear-attention layer attends nowhere: nothing to route.
    if _attends(cfg, carried.values()) and not _calls_attention_interface(lm):
        raise NotImplementedError(
            f"{name} computes attention in its own code, not through transformers' AttentionInterface, which "
            "lightning_oomb routes chunk by chunk: not supported"
        )
    repeated = REPEATED_ATTENTION.get(cfg.model_type)
    if repeated is not None:
        raise NotImplementedError(
            f"{name} calls attention twice per layer, with the same keys and {repeated}; lightning_oomb's K/V pages "
            "hold one set of values per layer and token, so its chunks would attend to the second call's values in "
            "both: not supported"
        )
    attention = [m for m in lm.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]
    if any(m.is_causal is False for m in attention):
        raise NotImplementedError(f"{name} has bidirectional attention layers: lightning_oomb attention is causal "
                                  "only")
    if getattr(cfg, "output_router_logits", False) and router_class(lm) is None:
        raise NotImplementedError(
            f"{name} has output_router_logits=True, which adds the experts' load-balancing loss, and records no "
            "router logits that lightning_oomb can find: set config.output_router_logits=False"
        )
    rope = _rope_type(cfg)
    if rope in LENGTH_DEPENDENT_ROPE:
        raise NotImplementedError(
            f"rope_type {rope!r} changes its frequencies with the sequence length, so chunks would see other "
            "positions than the full sequence; use a static RoPE (default, linear, llama3, yarn)"
        )
    if lm.training:
        _check_deterministic_training(lm, name)
    _check_loss_is_cross_entropy(lm, name)


def _uncarried_kinds(layer_types: list[str], carried: Iterable[nn.Module]) -> list[str]:
    """The layer kinds of ``layer_types`` (the config's, by layer index) that mix tokens outside attention and
    are not carried: a kind some layer has in its config with no state-carrying layer of that index (``carried``:
    those of the model, e.g. LFM2's "conv", MiniMax's "linear_attention")."""
    indices = {m.layer_idx for m in carried}
    return sorted({kind for i, kind in enumerate(layer_types) if kind not in ATTENTION_LAYERS + TOKENWISE_LAYERS
                   and i not in indices})


def _attends(cfg, carried: Iterable[nn.Module]) -> bool:
    """Whether some decoder layer attends: one the config's layer kinds give K/V pages, or one that no
    state-carrying layer stands for (pure state-space models, Mamba's and Mamba-2's, have neither)."""
    indices = {m.layer_idx for m in carried}
    if not indices:  # (multimodal configs may hold their layer count elsewhere: nothing is read from them here)
        return True
    return bool(kv_layer_indices(cfg)) or any(i not in indices for i in range(cfg.num_hidden_layers))


def _calls_attention_interface(lm: nn.Module) -> bool:
    """Whether ``lm``'s attention goes through transformers' AttentionInterface: its class says so, or it is one
    of INTERFACE_WITHOUT_FLAG and its modeling module, in the installed transformers, looks the function up there
    (older releases of those families computed attention in their own code)."""
    if getattr(lm, "_supports_attention_backend", False):
        return True
    modeling = sys.modules.get(type(lm).__module__)
    return lm.config.model_type in INTERFACE_WITHOUT_FLAG and "ALL_ATTENTION_FUNCTIONS" in vars(modeling or object)


def _check_deterministic_training(lm: nn.Module, name: str) -> None:
    """Stage 2 recomputes each chunk's forward: anything random in training would make it another forward."""
    cfg = lm.config
    if getattr(cfg, "attention_dropout", 0.0):
        raise NotImplementedError(
            f"attention_dropout={cfg.attention_dropout} in training mode would make stage 2 recompute other "
            "K/V than stage 1 stored; set config.attention_dropout=0.0"
        )
    dropout = next((n for n, m in lm.named_modules() if isinstance(m, nn.Dropout) and m.p > 0), None)
    if dropout is not None:
        raise NotImplementedError(
            f"{name} has dropout in training mode ({dropout}, p={lm.get_submodule(dropout).p}): stage 2 would "
            "recompute another forward than stage 1's; set the config's dropout probabilities to 0"
        )
    if getattr(cfg, "router_jitter_noise", 0.0):
        raise NotImplementedError(
            f"router_jitter_noise={cfg.router_jitter_noise} in training mode routes tokens at random: stage 2 "
            "would route them otherwise than stage 1; set config.router_jitter_noise=0.0"
        )


def _check_loss_is_cross_entropy(lm: nn.Module, name: str) -> None:
    """The model's own loss and logits on a few tokens against cross-entropy of head(lm_head(decoder(ids))), what
    the engine computes (``head``: its ``LogitHead``, from the config): whatever else a model adds (a scale no
    config field names, an auxiliary loss) shows here. Once per model; skipped for weights not yet made (meta) or
    sharded (DTensor), whose families the checks above already cover."""
    if lm in _loss_checked:
        return
    params = list(lm.parameters())
    if any(p.is_meta or isinstance(p, DTensor) for p in params):
        return
    device = params[0].device
    ids = (torch.arange(PROBE_TOKENS, device=device) % lm.get_output_embeddings().weight.shape[0])[None]
    # The classes' own forwards: a served model's instance forward is the engine, which comes back here. A
    # mask of ones spares transformers its search for packed documents in the position ids.
    mask = torch.ones_like(ids)
    decoder = decoder_of(lm)
    # The experts' load-balancing loss, which the engine adds itself (integrations/router_balance.py), left out.
    extra = {"output_router_logits": False} if hasattr(lm.config, "output_router_logits") else {}
    with torch.no_grad():
        out = type(lm).forward(lm, input_ids=ids, attention_mask=mask, labels=ids, use_cache=False, **extra)
        hidden = type(decoder).forward(decoder, input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        head = lm.get_output_embeddings()
        logits = logit_head(lm).apply(head(head_input(head, hidden)))
        loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    same_logits = out.logits.shape == logits.shape and torch.allclose(out.logits.float(), logits.float(),
                                                                      rtol=1e-3, atol=1e-3)
    if not same_logits or not torch.allclose(out.loss.float(), loss, rtol=1e-3, atol=1e-4):
        what = "logits" if not same_logits else f"loss ({out.loss.item():.6g} against {loss.item():.6g})"
        raise NotImplementedError(
            f"{name}'s {what} differ from the cross-entropy of lm_head(hidden states) on {PROBE_TOKENS} tokens "
            "(with the logit scale and soft cap its config names): "
            "the model adds something (a scale, a cap, an auxiliary loss) that lightning_oomb's chunked loss "
            "does not compute; not supported"
        )
    _loss_checked.add(lm)
