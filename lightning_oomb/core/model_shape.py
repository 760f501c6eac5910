"""What the planner needs of a model: its shape, from a built-in name (``lightning_oomb/model_shapes``), a
config.json or a model directory (no weights read), and what each training precision stores in which dtype."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

from ..recurrent.layer_kinds import (CARRIED_KINDS, PARALLEL_HYBRIDS, STATE_SPACE_FAMILIES, kv_layer_indices,
                                     layer_kinds)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
SHAPES_DIR = Path(__file__).resolve().parent.parent / "model_shapes"

Precision = Literal["bf16-true", "bf16-mixed", "32-true"]
PRECISIONS = ("bf16-true", "bf16-mixed", "32-true")


def builtin_names() -> list[str]:
    """Names of the model shapes shipped in ``lightning_oomb/model_shapes`` (e.g. ``qwen2.5-7b``)."""
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


def load_config_dict(model: str | os.PathLike) -> dict[str, Any]:
    """The config.json fields of a built-in name, a config.json file, or a model directory (no weights read)."""
    text = str(model)
    if text in builtin_names():
        path = SHAPES_DIR / f"{text}.json"
    else:
        path = Path(text)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{text!r} is neither a built-in model shape ({', '.join(builtin_names())}) nor a config.json "
                "file or a directory holding one"
            )
    try:
        with open(path) as f:
            fields = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable config.json ({type(e).__name__}: {e})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{path} is not a config.json: it holds a JSON {type(fields).__name__}, not an object")
    return _special_floats(fields)


_FLOAT_TAGS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _special_floats(value: Any) -> Any:
    """``value`` read from a config.json with the floats JSON cannot hold restored: transformers writes
    infinities and NaN as {"__float__": "Infinity"} (Mamba-2's time_step_limit (0.0, inf))."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in _FLOAT_TAGS:
            return _FLOAT_TAGS[value["__float__"]]
        return {k: _special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_special_floats(v) for v in value]
    return value


def counted_params(config: Any) -> int:
    """Parameters of the causal LM transformers builds from ``config`` (a config object), counted on the meta
    device without memory, once per distinct config; 0 where none can be built here."""
    return _on_meta(config).params


def carried_saved(config: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    """What one state-carrying layer of the model built from ``config`` saves for backward over a chunk, beyond
    its decoder layer's other parts: (bytes per token, fixed bytes) with bf16 weights, then with float32 weights,
    measured by running the layer's chunk on the meta device (lightning_oomb.recurrent.saved); zeros where the
    model has no such layer or cannot be built or run there."""
    return _on_meta(config).saved


def carried_ops(config: Any) -> tuple[tuple[float, float], tuple[float, float]]:
    """The operations one state-carrying layer of the model built from ``config`` launches over a chunk of one
    sequence: (per token, fixed) in its forward, then in its backward, counted by running the layer's chunk on
    the meta device (lightning_oomb.recurrent.saved); zeros where the model has no such layer or cannot be built
    or run there (a fused kernel, such as flash-linear-attention's, runs on no meta tensors)."""
    return _on_meta(config).ops


class _Measured(NamedTuple):
    params: int
    saved: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (0, 0))
    ops: tuple[tuple[float, float], tuple[float, float]] = ((0.0, 0.0), (0.0, 0.0))


_MEASURED: dict[str, _Measured] = {}
# Two chunk lengths, multiples of every carried kernel's block (64 or 256 tokens): bytes(T) = fixed + T x per token,
# and so the operations, one loop pass per block.
_SAVED_TOKENS = (1024, 2048)


def _on_meta(config: Any) -> _Measured:
    try:
        key = config.to_json_string()
    except (AttributeError, TypeError, ValueError):
        return _Measured(0)
    if key not in _MEASURED:
        _MEASURED[key] = _measure_on_meta(config)
    return _MEASURED[key]


def _line(short: float, long: float) -> tuple[float, float]:
    """(per token, fixed) of a count measured at both _SAVED_TOKENS lengths."""
    per_token = (long - short) / (_SAVED_TOKENS[1] - _SAVED_TOKENS[0])
    return per_token, max(0.0, short - per_token * _SAVED_TOKENS[0])


def _measure_on_meta(config: Any) -> _Measured:
    from transformers import AutoModelForCausalLM

    from ..recurrent import carried_layers
    from ..recurrent.saved import launched_ops, saved_bytes

    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")  # the families' own remarks about their configs
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # a config transformers builds no causal LM from here: the fields' formulas count
        return _Measured(0)
    params = sum(p.numel() for p in model.parameters())
    layers = carried_layers(model)
    if not layers:
        return _Measured(params)
    saved = []
    try:
        for dtype in (torch.bfloat16, torch.float32):
            layer = layers[0].to(dtype)
            short, long = (saved_bytes(layer, t, config.hidden_size) for t in _SAVED_TOKENS)
            per_token = math.ceil(_line(short, long)[0])  # whole bytes, rounded up
            saved.append((per_token, max(0, short - per_token * _SAVED_TOKENS[0])))
    except Exception:  # a kernel that cannot run on meta tensors: the plan says its saved tensors are unknown
        return _Measured(params)
    try:
        (forward_short, backward_short), (forward_long, backward_long) = (
            launched_ops(layer, t, config.hidden_size) for t in _SAVED_TOKENS)
    except Exception:  # a backward that cannot run on meta tensors: its launches go uncounted
        return _Measured(params, (saved[0], saved[1]))
    ops = (_line(forward_short, forward_long), _line(backward_short, backward_long))
    return _Measured(params, (saved[0], saved[1]), ops)


def transformers_config(config: dict[str, Any]):
    """A transformers config built from config.json fields, so that the family's defaults apply."""
    from transformers import AutoConfig

    fields = dict(config)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError("the config has no `model_type` (e.g. qwen2, llama)")
    for key in ("architectures", "transformers_version"):
        fields.pop(key, None)
    return AutoConfig.for_model(model_type, **fields)


def _windows(config: Any) -> dict[str, int]:
    """The sliding window and how many layers have it: those of ``layer_types`` that say so, or every layer
    where the config sets a window without layer types (Mistral, Mixtral, Phi-3, StarCoder2), as the models'
    masks apply it (integrations.transformers.sliding_window)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return {}
    types = getattr(config, "layer_types", None)
    layers = sum(t == "sliding_attention" for t in types) if types else config.num_hidden_layers
    return {"window": int(window), "window_layers": layers} if layers else {}


# Families whose attention's q_proj also projects a gate of the attention output, per query channel.
GATED_QUERY_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")

def _carried_fields(config: Any) -> dict[str, int]:
    """How many layers carry a state across chunk borders, and its bytes per sequence over all of them
    (lightning_oomb.recurrent: the convolution's last inputs, 2-byte, and the float32 recurrence), from the
    config fields of Gated DeltaNet (Qwen3-Next, Qwen3.5), Mamba-2 (Mamba-2, Bamba, Granite 4, Nemotron-H) and
    Mamba-1 (Mamba, Falcon-Mamba, Jamba) layers; bytes 0 for the other kinds."""
    layers = sum(kind in CARRIED_KINDS for kind in layer_kinds(config))
    parallel = getattr(config, "model_type", "") in PARALLEL_HYBRIDS
    if parallel:  # a mixer beside every layer's attention
        layers = config.num_hidden_layers
    if not layers:
        return {}
    get = lambda *names: next((getattr(config, n) for n in names if getattr(config, n, None)), 0)  # noqa: E731
    model_type = getattr(config, "model_type", "")
    if get("linear_num_value_heads"):  # Gated DeltaNet
        heads, hidden = get("linear_num_value_heads"), config.hidden_size
        key_dim = get("linear_num_key_heads") * get("linear_key_head_dim")
        value_dim = heads * get("linear_value_head_dim")
        conv = (2 * key_dim + value_dim) * (get("linear_conv_kernel_dim") - 1)
        recurrent = heads * get("linear_key_head_dim") * get("linear_value_head_dim")
        # q, k, v and the output gate z in, the beta and decay inputs b and a, out; the convolution's weights,
        # A_log and dt_bias per head, the gated norm's weight
        params = {"carried_matrices": (hidden * (2 * key_dim + 2 * value_dim), hidden * 2 * heads, value_dim * hidden),
                  "carried_vector_params": (2 * key_dim + value_dim) * get("linear_conv_kernel_dim") + 2 * heads
                  + get("linear_value_head_dim")}
        # The chunked delta rule in chunks of 64, per value head and token: q.k, k.k, the triangular
        # system's products with v and k, q's and k's products with the state, the chunk's scores with the
        # new values, the state's update.
        d_k, d_v, c = get("linear_key_head_dim"), get("linear_value_head_dim"), 64
        params["carried_mixing_flops"] = heads * (2 * c * (3 * d_k + 2 * d_v) + 6 * d_k * d_v)
    elif get("mamba_n_heads", "mamba_num_heads") or model_type == "mamba2":
        conv, recurrent, params = _mamba2_fields(config, get)
    elif get("mamba_dt_rank") or model_type in ("mamba", "falcon_mamba"):
        conv, recurrent, params = _mamba1_fields(config, get)
    else:
        return {"carried_layers": layers}
    params["carried_mixing_flops"] = layers * params.get("carried_mixing_flops", 0)
    if parallel:  # the layers keep their attention: the mixer's weights are in the model's counted total
        params.pop("carried_matrices", None)
        params.pop("carried_vector_params", None)
    return {"carried_layers": layers, "carried_state_bytes": layers * (2 * conv + 4 * recurrent), **params}


def _mamba2_fields(config: Any, get) -> tuple[int, int, dict[str, Any]]:
    """A Mamba-2 mixer's border state, elements: the convolution's (x, B, C of the last kernel - 1 tokens) and the
    SSM state's (heads x head_dim x state); and its parameters: in_proj (gate, x, B, C, dt) and out_proj; the
    convolution's weights and bias, dt_bias, A_log and D per head, the gated norm's weight. Hybrids name the
    fields mamba_*, Mamba-2's own config plainly."""
    plain = getattr(config, "model_type", "") == "mamba2"
    heads = config.num_heads if plain else get("mamba_n_heads", "mamba_num_heads")
    head_dim = config.head_dim if plain else get("mamba_d_head", "mamba_head_dim")
    state, groups = get("mamba_d_state", "ssm_state_size", "state_size"), get("mamba_n_groups", "n_groups")
    kernel = get("mamba_d_conv", "conv_kernel")
    hidden = config.hidden_size
    # Falcon-H1 may set the mixer's width itself (mamba_d_ssm), as its mixer reads it
    inner = get("mamba_d_ssm") or int(get("mamba_expand", "expand") * hidden)
    conv_dim = inner + 2 * groups * state
    # The SSD scan in chunks of c tokens, per head and token: C.B within the chunk, its masked product with x,
    # the chunk's state from B and x, and C's product with the state passed in.
    c = get("mamba_chunk_size", "chunk_size") or 256
    params = {"carried_matrices": (hidden * (inner + conv_dim + heads), inner * hidden),
              "carried_vector_params": conv_dim * (kernel + 1) + 3 * heads + inner,
              "carried_mixing_flops": heads * (2 * c * (state + head_dim) + 4 * state * head_dim)}
    return conv_dim * (kernel - 1), heads * head_dim * state, params


def _mamba1_fields(config: Any, get) -> tuple[int, int, dict[str, Any]]:
    """A Mamba-1 mixer's border state, elements: the convolution's (its inputs of the last kernel - 1 tokens) and
    the SSM state's (intermediate x state); and its parameters: in_proj (x and the gate), x_proj (dt, B, C),
    dt_proj, out_proj; the convolution's weights and bias, dt_proj's bias, A_log and D. Jamba names the fields
    mamba_* (its mixer expand x hidden wide), Mamba and Falcon-Mamba plainly."""
    hidden = config.hidden_size
    inner = int(get("mamba_expand") * hidden) if get("mamba_expand") else config.intermediate_size
    state, kernel = get("mamba_d_state", "state_size"), get("mamba_d_conv", "conv_kernel")
    rank = int(get("mamba_dt_rank", "time_step_rank"))
    # The selective scan, per token: the state's decay and input (exp(dt A), dt B x) and its read-out by C,
    # elementwise over intermediate x state.
    params = {"carried_matrices": (hidden * 2 * inner, inner * (rank + 2 * state), rank * inner, inner * hidden),
              "carried_vector_params": inner * (kernel + 3 + state),
              "carried_mixing_flops": 8 * inner * state}
    return inner * (kernel - 1), inner * state, params


# Mixtures of experts whose config says, by a rule of their own, which decoder layers hold experts (the others a
# dense MLP of intermediate_size), as transformers' modeling code of the family applies it. Configs with
# `mlp_layer_types` say it layer by layer; the other families are counted with experts in every layer.
SPARSE_STEP_FAMILIES = ("qwen2_moe", "qwen3_moe", "qwen3_next")  # mlp_only_layers, decoder_sparse_step
FIRST_K_DENSE_FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe", "dots1")  # first_k_dense_replace
NUM_DENSE_FAMILIES = ("afmoe", "lfm2_moe")  # num_dense_layers
# Mixtures whose shared expert is DeepSeek's: n_shared_experts experts of moe_intermediate_size, as one MLP.
SHARED_EXPERTS_FAMILIES = ("axk1", "axk2", "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1", "glm4_moe",
                           "glm4_moe_lite", "glm_moe_dsa", "hy_v4", "kimi_linear", "minicpm5_moe", "solar_open")
# Mixtures whose shared expert's output is scaled by a sigmoid gate, an nn.Linear(hidden, 1).
SHARED_GATE_FAMILIES = ("qwen2_moe", "qwen3_next")


def expert_layers(config: Any) -> list[bool]:
    """Whether each decoder layer of a mixture-of-experts ``config`` holds experts, as transformers builds it
    (every layer where the family is none of those above and the config has no ``mlp_layer_types``)."""
    n = config.num_hidden_layers
    model_type = getattr(config, "model_type", "")
    kinds = getattr(config, "mlp_layer_types", None)
    if kinds is not None and set(kinds) <= {"sparse", "dense"}:
        # transformers' per-layer field (its configs validate these two values; the families' layers build
        # experts where it says "sparse")
        return [kind == "sparse" for kind in kinds]
    if model_type in SPARSE_STEP_FAMILIES:
        dense = set(config.mlp_only_layers or ())
        return [i not in dense and (i + 1) % config.decoder_sparse_step == 0 for i in range(n)]
    if model_type in FIRST_K_DENSE_FAMILIES:
        # DeepSeek's own modeling code also reads `moe_layer_freq`; transformers' does not, so neither does this.
        return [i >= (config.first_k_dense_replace or 0) for i in range(n)]
    if model_type in NUM_DENSE_FAMILIES:
        return [i >= config.num_dense_layers for i in range(n)]
    return [True] * n


def _shared_width(config: Any, width: int) -> int:
    """Width of a mixture's shared expert (0: none): Qwen's ``shared_expert_intermediate_size``, or DeepSeek's
    ``n_shared_experts`` experts of ``width`` as one MLP."""
    shared = getattr(config, "shared_expert_intermediate_size", None) or 0
    if not shared and getattr(config, "model_type", "") in SHARED_EXPERTS_FAMILIES:
        shared = (getattr(config, "n_shared_experts", None) or 0) * width
    return shared


# Fields that name the MLP's width in families without intermediate_size: GPT-2 and GPT-BigCode (StarCoder 1,
# SantaCoder; None: 4 x hidden), OPT and Moshi, CTRL, Falcon.
MLP_WIDTH_FIELDS = ("n_inner", "ffn_dim", "dff", "ffn_hidden_size")


def mlp_width(config: Any) -> int:
    """The hidden units of a dense decoder layer's MLP (of a mixture of experts: of an expert, unless the config
    names that otherwise). Moshi's ffn_dim is the output of its gated MLP's first projection, gate and up
    together: its width is half of that. ValueError where the config names none of these fields."""
    width = getattr(config, "intermediate_size", None)
    if width:
        return width
    for field in MLP_WIDTH_FIELDS:
        if hasattr(config, field):
            width = getattr(config, field) or 4 * config.hidden_size
            return width // 2 if getattr(config, "model_type", "") == "moshi" else width
    names = ", ".join(("intermediate_size", *MLP_WIDTH_FIELDS))
    raise ValueError(f"{type(config).__name__} names its MLP width in none of the fields {names}: lightning_oomb "
                     "cannot size this model")


def latent_attention(config: Any) -> bool:
    """Whether ``config`` is of multi-head latent attention (DeepSeek V2/V3's MLA): K and V expanded for every
    query head from a shared latent, keys of a part without RoPE (``qk_nope_head_dim``) and one with it
    (``qk_rope_head_dim``), values ``v_head_dim`` wide."""
    return (getattr(config, "qk_nope_head_dim", None) is not None
            and getattr(config, "qk_rope_head_dim", None) is not None)


def attends(config: Any) -> bool:
    """Whether some decoder layer of ``config`` attends (keeps K/V pages); pure state-space models do not."""
    return bool(kv_layer_indices(config))


def kv_heads(config: Any) -> int:
    """The K/V heads each attention layer hands to attention, which the K/V pages store:
    ``num_key_value_heads``, or one per query head where the config names none. JetMoE repeats its K/V heads
    for each of the num_experts_per_tok attention experts of a token (as many as its query heads), tiled
    rather than grouped: its pages hold them repeated, which is what its queries attend to (the planner then
    counts its K/V projections that many times too, a small overestimate of its weights). Latent attention
    expands its keys and values for every query head, whatever ``num_key_value_heads`` says. 0 where no layer
    attends."""
    if not attends(config):
        return 0
    if getattr(config, "model_type", "") == "jetmoe" or latent_attention(config):
        return config.num_attention_heads
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def head_dim(config: Any) -> int:
    """Channels of one query and key head: ``head_dim``, or hidden_size / num_attention_heads; of latent
    attention, qk_nope_head_dim + qk_rope_head_dim (its configs' ``head_dim`` is the RoPE part). 0 where no layer
    attends (Mamba-2's ``head_dim`` is its SSM heads')."""
    if not attends(config):
        return 0
    if latent_attention(config):
        return config.qk_nope_head_dim + config.qk_rope_head_dim
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def value_dim(config: Any) -> int:
    """Channels of one value head (and of the attention output's): ``v_head_dim`` where the config names one
    (DeepSeek's MLA, MiMo-V2-Flash), else ``head_dim``."""
    return (getattr(config, "v_head_dim", None) or head_dim(config)) if attends(config) else 0


def _mlp_fields(config: Any) -> dict[str, Any]:
    """ModelShape's MLP fields of ``config``: ``intermediate`` for a dense model; for a mixture of experts the
    experts', the shared expert's and the dense layers' widths, and how many layers are dense."""
    if getattr(config, "model_type", "") in STATE_SPACE_FAMILIES:
        return dict(intermediate=0)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    kinds = expert_layers(config) if experts else []
    if not any(kinds):
        return dict(intermediate=mlp_width(config))
    # Qwen-MoE's and DeepSeek's experts have their own width; Mixtral's are intermediate_size wide
    width = getattr(config, "moe_intermediate_size", None) or mlp_width(config)
    shared = _shared_width(config, width)
    dense = kinds.count(False)
    return dict(intermediate=config.num_experts_per_tok * width + shared, n_experts=experts,
                expert_intermediate=width, shared_intermediate=shared,
                shared_gate=bool(shared) and getattr(config, "model_type", "") in SHARED_GATE_FAMILIES,
                dense_layers=dense, dense_intermediate=mlp_width(config) if dense else 0)


class LayerGroup(NamedTuple):
    """Decoder layers built alike (``ModelShape.layer_groups``).

    layers: how many. linear: elements of each weight matrix one of them holds in an nn.Linear: q, k, v, o, then
    a dense MLP's gate, up, down, or a mixture's shared expert's and its gate. fused: elements of its other
    weight matrices, nn.Parameters of no nn.Linear: every expert's gate, up and down (transformers stores them
    fused, (n_experts, ...)) and the router. active: weight-matrix elements one token goes through (its experts,
    the shared expert and the router of a mixture).
    """

    layers: int
    linear: tuple[int, ...]
    fused: int
    active: int


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a decoder-only transformer (Llama / Qwen2 / Qwen3 / Mistral families, and
    mixtures of experts).

    Biases and QK-norm only change ``total_params``; ``matmul_params`` counts weight matrices.
    Mixture of experts (``n_experts`` > 0): each layer but ``dense_layers`` of them (a dense MLP of width
    ``dense_intermediate``; ``expert_layers`` says which) holds ``n_experts`` SwiGLU experts of width
    ``expert_intermediate``, a router and maybe a shared expert, and each token goes through ``intermediate`` of
    them in total (its experts' widths together, plus the shared expert's): memory counts every expert, time a
    token's (``layer_groups``), activations a token's in every layer.
    ``tensor_parallel``: the ranks each decoder layer is split over (``tensor_parallel_part``), whose head counts
    and MLP width are then one rank's.
    """

    n_layers: int
    hidden: int
    intermediate: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # of queries and keys
    vocab: int
    tied_embeddings: bool
    name: str = "custom"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm of each query and key head (Qwen3, Gemma 3), or of all of them (OLMo 2)
    qk_norm_whole: bool = False  # OLMo 2: one norm over all query heads, one over all key heads
    layer_norms: int = 2  # hidden-size RMSNorms per layer (Gemma 3: also after attention and after the MLP)
    # "llama": weight x the normalised input cast to the model's dtype; "gemma": x (1 + weight) in float32, which
    # the fused RMSNorm does not compute (the model's own norms and GELU MLP run: core.plan.activations)
    norm_style: str = "llama"
    model_type: str = ""  # transformers' name of the family ("" when given by hand)
    fused_projections: bool = False  # Phi-3: q, k, v in one linear layer (qkv_proj), gate and up in another
    expert_biases: bool = False  # GPT-OSS: a bias per expert on gate/up and down, and on the router
    clamped_experts: bool = False  # GPT-OSS: gate and up clamped, glu = gate sigmoid(alpha gate), (up + 1) glu
    attention_sinks: bool = False  # GPT-OSS: a learned sink logit per query head and layer
    tensor_parallel: int = 1
    # Hybrids: layers that keep no K/V pages (state-carrying or MLP-only layers, kv_layer_indices), and the
    # bytes per sequence of the states the state-carrying ones hand across a chunk border (0 where not known)
    layers_without_kv: int = 0
    carried_layers: int = 0
    carried_state_bytes: int = 0
    # What a state-carrying layer holds instead of attention (where known): the elements of its nn.Linear weights
    # (the projections in and out) and its other parameters (convolution, decay and norm weights)
    carried_matrices: tuple[int, ...] = ()
    carried_vector_params: int = 0
    carried_mixing_flops: int = 0  # forward FLOPs of the state-carrying layers' token mixing per token, all layers
    # What one state-carrying layer's token mixing saves for backward, measured on the meta device
    # (``carried_saved``): (bytes per token, fixed bytes) with bf16 weights, then with float32 ones
    carried_saved: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (0, 0))
    # The operations one state-carrying layer's token mixing launches over a chunk of one sequence, counted on the
    # meta device (``carried_ops``): (per token, fixed) in its forward, then in its backward
    carried_ops: tuple[tuple[float, float], tuple[float, float]] = ((0.0, 0.0), (0.0, 0.0))
    gated_queries: bool = False  # Qwen3-Next, Qwen3.5: q_proj also projects a sigmoid gate of the output
    n_experts: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    shared_gate: bool = False  # Qwen2-MoE: a hidden -> 1 linear gate scales the shared expert's output
    dense_layers: int = 0  # of a mixture of experts: layers with a dense MLP instead, dense_intermediate wide
    dense_intermediate: int = 0
    window: int = 0  # tokens of the sliding window of window_layers of the layers (0: none)
    window_layers: int = 0
    v_head_dim: int = 0  # of values and the attention output, where not head_dim (0: head_dim)
    # All parameters of the model transformers builds from the config, counted on the meta device (0: where it
    # cannot be built, and for a tensor-parallel part): ``total_params`` whatever the family's layers hold that
    # the fields above do not describe (MLA, hybrids' MLP-only and parallel layers, learned positions)
    counted_params: int = 0

    # -- constructors -----------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> "ModelShape":
        """From a transformers config object or a config.json dict."""
        if isinstance(config, dict):
            config = transformers_config(config)
        model_type = getattr(config, "model_type", "")
        n_heads = config.num_attention_heads if attends(config) else 0
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            n_layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            **_mlp_fields(config),
            **_windows(config),
            n_heads=n_heads,
            n_kv_heads=kv_heads(config),
            head_dim=head_dim(config),
            v_head_dim=value_dim(config) if value_dim(config) != head_dim(config) else 0,
            vocab=config.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            name=name or getattr(config, "name_or_path", "") or model_type or "custom",
            # Qwen2 always has q/k/v biases, Qwen2-MoE by `qkv_bias`; Llama and Qwen3 put `attention_bias` on
            # q, k, v and o.
            qkv_bias=model_type == "qwen2" or attention_bias or (model_type == "qwen2_moe" and config.qkv_bias),
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", "olmo2") + GATED_QUERY_FAMILIES,
            gated_queries=model_type in GATED_QUERY_FAMILIES,
            qk_norm_whole=model_type == "olmo2",
            fused_projections=model_type == "phi3",
            expert_biases=model_type == "gpt_oss",
            clamped_experts=model_type == "gpt_oss",
            attention_sinks=model_type == "gpt_oss",
            layer_norms={"gemma3_text": 4, **dict.fromkeys(STATE_SPACE_FAMILIES, 1)}.get(model_type, 2),
            norm_style="gemma" if model_type == "gemma3_text" else "llama",
            model_type=model_type,
            layers_without_kv=config.num_hidden_layers - len(kv_layer_indices(config)),
            **_carried_fields(config),
            counted_params=counted_params(config),
            carried_saved=carried_saved(config),
            carried_ops=carried_ops(config),
        )

    @classmethod
    def from_name(cls, name: str) -> "ModelShape":
        """A built-in shape: one of ``builtin_names()``."""
        if name not in builtin_names():
            raise ValueError(f"unknown model shape {name!r}; built-in: {', '.join(builtin_names())}")
        return cls.from_config(load_config_dict(name), name=name)

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> "ModelShape":
        """From a config.json file or a pretrained model directory (reads its config.json only)."""
        p = Path(path)
        return cls.from_config(load_config_dict(p), name=(p.name if p.is_dir() else p.parent.name) or p.stem)

    @classmethod
    def resolve(cls, model: Any) -> "ModelShape":
        """A ModelShape, a built-in name, a config.json / model directory path, a transformers config or
        config dict, or a transformers model (peft-wrapped is fine)."""
        if isinstance(model, ModelShape):
            return model
        if isinstance(model, (str, os.PathLike)):
            if str(model) in builtin_names():
                return cls.from_name(str(model))
            return cls.from_path(model)
        if isinstance(model, dict):
            return cls.from_config(model)
        if isinstance(model, torch.nn.Module):
            inner = model.get_base_model() if hasattr(model, "get_base_model") else model
            if not hasattr(inner, "config"):
                raise TypeError(f"{type(model).__name__} has no transformers config")
            return cls.from_config(inner.config)
        if hasattr(model, "num_hidden_layers"):
            return cls.from_config(model)
        raise TypeError(f"cannot read a model shape from {type(model).__name__}")

    def tensor_parallel_part(self, size: int, option: str = "tensor_parallel") -> "ModelShape":
        """What one of ``size`` tensor-parallel ranks holds and computes (OOMBModelParallelStrategy's
        ``tensor_parallel_size``): each decoder layer split by KV heads, so the query and KV heads, with their
        q/k/v rows and biases and o's columns, and the MLP's hidden units, with gate/up's rows and biases and
        down's columns, are 1/size; the hidden size, the norms, o's and down's biases (added after the sum over
        the ranks), the embeddings and the output layer are whole. ValueError, naming the fix and the setting
        ``option`` that asked for ``size``, when ``size`` does not divide the KV heads, attention heads or MLP
        width."""
        if size == 1:
            return self
        if self.n_experts:
            raise ValueError(f"{option}={size}: tensor parallelism of mixture-of-experts layers is not built; use "
                             f"{option}=1")
        for name, count in (("num_key_value_heads", self.n_kv_heads), ("num_attention_heads", self.n_heads),
                            ("intermediate_size", self.intermediate)):
            if count % size:
                raise ValueError(f"{option}={size} does not divide {name}={count} of {self.name}; use a "
                                 f"divisor of num_key_value_heads={self.n_kv_heads} (each rank computes whole KV "
                                 "heads)")
        return dataclasses.replace(self, n_heads=self.n_heads // size, n_kv_heads=self.n_kv_heads // size,
                                   intermediate=self.intermediate // size, tensor_parallel=size, counted_params=0)

    # -- sizes ------------------------------------------------------------------------------------------
    @property
    def q_width(self) -> int:
        """d_q = n_heads * head_dim."""
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Channels of a token's keys: n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        """Channels of one value head."""
        return self.v_head_dim or self.head_dim

    @property
    def v_width(self) -> int:
        """Channels of a token's values: n_kv_heads * value_dim."""
        return self.n_kv_heads * self.value_dim

    @property
    def out_width(self) -> int:
        """Channels of a token's attention output (o's input): n_heads * value_dim."""
        return self.n_heads * self.value_dim

    @property
    def attention_matrices(self) -> tuple[int, int, int, int]:
        """Elements of q, k, v and o of one decoder layer (latent attention's low-rank projections are counted as
        these full ones)."""
        q = self.hidden * self.q_width * (2 if self.gated_queries else 1)
        return q, self.hidden * self.kv_width, self.hidden * self.v_width, self.out_width * self.hidden

    @property
    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """The decoder layers by kind, each kind's weight matrices (``LayerGroup``): all alike in a dense model;
        a mixture's layers with experts, then its dense layers (if any); a hybrid's state-carrying layers (where
        their matrices are known) in groups of their own after them, taken from the first groups."""
        groups = self._attention_layer_groups()
        left = self.carried_layers if self.carried_matrices else 0
        attention, carried = sum(self.attention_matrices), sum(self.carried_matrices)
        split = []
        for g in groups:
            n = min(left, g.layers)
            left -= n
            rest = g.linear[len(self.attention_matrices):]
            split.append(g._replace(layers=g.layers - n))
            if n:
                split.append(LayerGroup(n, self.carried_matrices + rest, g.fused, g.active - attention + carried))
        return tuple(g for g in split if g.layers)

    def _attention_layer_groups(self) -> tuple[LayerGroup, ...]:
        attention = self.attention_matrices
        if not self.n_experts:
            mlp = (self.hidden * self.intermediate,) * 3
            return (LayerGroup(self.n_layers, attention + mlp, 0, sum(attention + mlp)),)
        shared = (self.hidden * self.shared_intermediate,) * 3 if self.shared_intermediate else ()
        shared += (self.hidden,) if self.shared_gate else ()
        router = self.hidden * self.n_experts
        experts = LayerGroup(self.n_layers - self.dense_layers, attention + shared,
                             3 * self.hidden * self.expert_intermediate * self.n_experts + router,
                             sum(attention) + 3 * self.hidden * self.intermediate + router
                             + (self.hidden if self.shared_gate else 0))
        if not self.dense_layers:
            return (experts,)
        mlp = (self.hidden * self.dense_intermediate,) * 3
        return experts, LayerGroup(self.dense_layers, attention + mlp, 0, sum(attention + mlp))

    @property
    def linear_params(self) -> int:
        """Weight-matrix parameters the decoder layers hold in nn.Linear layers (what bitsandbytes quantises)."""
        return sum(g.layers * sum(g.linear) for g in self.layer_groups)

    @property
    def decoder_matmul_params(self) -> int:
        """Weight-matrix parameters of all decoder layers: their nn.Linear layers, experts and routers."""
        return sum(g.layers * (sum(g.linear) + g.fused) for g in self.layer_groups)

    @property
    def head_params(self) -> int:
        """Parameters of the output layer (lm_head), vocab x hidden."""
        return self.vocab * self.hidden

    @property
    def matmul_params(self) -> int:
        """Weight-matrix parameters held: every linear layer, expert and router, lm_head included, not the input
        embedding."""
        return self.decoder_matmul_params + self.head_params

    @property
    def active_matmul_params(self) -> int:
        """P_mm of docs/planner.md, "Time": the weight-matrix parameters one token goes through, lm_head
        included (``matmul_params`` but for a mixture of experts)."""
        return sum(g.layers * g.active for g in self.layer_groups) + self.head_params

    @property
    def layer_bias_params(self) -> int:
        """Vector parameters of one decoder layer besides its norms: biases (of q, k, v, o, a dense MLP, GPT-OSS's
        experts and router) and GPT-OSS's attention sinks."""
        n = (self.q_width + self.kv_width + self.v_width) if self.qkv_bias else 0
        n += self.hidden if self.o_bias else 0
        n += (2 * self.intermediate + self.hidden) if self.mlp_bias and not self.n_experts else 0
        if self.expert_biases:
            n += self.n_experts * (2 * self.expert_intermediate + self.hidden + 1)
        return n + (self.n_heads if self.attention_sinks else 0)

    @property
    def layer_norm_params(self) -> int:
        """RMSNorm weights of one decoder layer: ``layer_norms`` of the hidden size, and the q and k norms."""
        return self.layer_norms * self.hidden + self._qk_norm_params

    @property
    def _qk_norm_params(self) -> int:
        return (self.q_width + self.kv_width if self.qk_norm_whole else 2 * self.head_dim) if self.qk_norm else 0

    @property
    def layer_replicated_params(self) -> int:
        """Parameters of one decoder layer that tensor parallelism keeps whole on every rank: the norms and the
        biases of o and down."""
        return self.layer_norm_params + (self.hidden if self.o_bias else 0) + (self.hidden if self.mlp_bias else 0)

    @property
    def decoder_params(self) -> int:
        """All parameters of the decoder layers: matrices, biases, norms (what FSDP2 shards)."""
        if self.counted_params:
            return self.counted_params - self.root_params
        carried = 0
        if self.carried_matrices:
            carried = self.carried_layers * (self.carried_vector_params - self._qk_norm_params)
        return self.decoder_matmul_params + self.n_layers * (self.layer_bias_params + self.layer_norm_params) + carried

    @property
    def largest_layer_params(self) -> int:
        """All parameters of the largest decoder layer (what FSDP2 gathers, or reduce-scatters, at a time)."""
        return max(sum(g.linear) + g.fused for g in self.layer_groups) + self.layer_bias_params + self.layer_norm_params

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embedding, lm_head unless tied, final norm."""
        embedding = self.vocab * self.hidden
        return embedding + (0 if self.tied_embeddings else self.head_params) + self.hidden

    @property
    def total_params(self) -> int:
        """All parameters: layers (matrices, biases, norms), embedding, lm_head unless tied, final norm."""
        return self.decoder_params + self.root_params

    @property
    def layer_expert_params(self) -> int:
        """Elements of one layer's stacked expert weights: gate, up and down of every routed expert (0 without
        experts; a shared expert is a plain MLP, not counted)."""
        return 3 * self.n_experts * self.hidden * self.expert_intermediate

    @property
    def routed_intermediate(self) -> int:
        """Hidden units of the routed experts one token goes through: its top-k experts' widths together."""
        return self.intermediate - self.shared_intermediate if self.n_experts else 0

    def lora_params(self, rank: int, experts: bool = False) -> int:
        """Adapter parameters of rank ``rank`` on q, k, v, o of every layer: r x (in + out) per projection (one
        for Phi-3's fused qkv_proj).
        ``experts``: also on the stacked expert weights (peft's target_parameters): r x (in + out) per expert
        for gate/up (hidden -> 2 x width) and for down (width -> hidden)."""
        qkv = (self.hidden + self.q_width + self.kv_width + self.v_width if self.fused_projections
               else 3 * self.hidden + self.q_width + self.kv_width + self.v_width)
        attention = self.n_layers * (qkv + self.out_width + self.hidden)
        adapted_experts = 0
        if experts and self.n_experts:  # only the layers that hold experts
            per_layer = self.n_experts * (3 * self.expert_intermediate + 2 * self.hidden)
            adapted_experts = (self.n_layers - self.dense_layers) * per_layer
        return rank * (attention + adapted_experts)

    @property
    def kv_layers(self) -> int:
        """Layers with K/V pages: every layer but a hybrid's layers_without_kv."""
        return self.n_layers - self.layers_without_kv

    @property
    def full_kv_layers(self) -> int:
        """Layers with K/V pages and no sliding window: those whose pages grow with the context, and the only
        ones a sparse step may keep in host memory (a window layer's stay on the GPU: core.pages)."""
        return self.kv_layers - min(self.window_layers, self.kv_layers)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V (or of dK and dV) of one token over all layers with pages in ``dtype``: keys kv_width
        wide, values v_width."""
        return self.kv_layers * (self.kv_width + self.v_width) * _itemsize(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# == what each precision stores in which dtype ============================================================


@dataclass(frozen=True)
class DtypeProfile:
    """Bytes per element of what a step holds, under a Lightning precision setting.

    param: parameters, their gradients and (torch.optim) optimizer state. linear: outputs of linear layers.
    residual: the residual stream (embedding output and the sums). qk: q and k after RoPE, which is also
    the dtype of the K/V store (the store takes k's dtype). v: the value projection.
    """

    param: int
    linear: int
    residual: int
    qk: int
    v: int
    autocast_weight_copies: bool


PROFILES: dict[str, DtypeProfile] = {
    "bf16-true": DtypeProfile(param=2, linear=2, residual=2, qk=2, v=2, autocast_weight_copies=False),
    "32-true": DtypeProfile(param=4, linear=4, residual=4, qk=4, v=4, autocast_weight_copies=False),
    # fp32 parameters under bf16 autocast: linear outputs are bf16, the residual stream stays fp32; RoPE's fp32
    # cos/sin make q and k fp32, which attention casts to bf16 as SDPA does under autocast (what it saves and
    # the K/V store are bf16).
    "bf16-mixed": DtypeProfile(param=4, linear=2, residual=4, qk=2, v=2, autocast_weight_copies=True),
}


def _kv_dtype(precision: str) -> torch.dtype:
    return torch.float32 if PROFILES[precision].qk == 4 else torch.bfloat16
