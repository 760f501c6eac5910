"""Saved activations of a step's chunk: what each decoder layer and the rest of the model keep for backward in
stage 2, in bytes (docs/planner.md, "What it counts")."""

from __future__ import annotations

import dataclasses
import math

from ..model_shape import PROFILES, ModelShape
from .assumptions import UNMODELLED_ACTIVATION_FACTOR

# Families whose decoder layers' saved tensors the formulas count (tests/test_plan_activations.py checks each
# against a real chunk); "" is a shape given by hand, counted as a Llama layer.
MODELLED_FAMILIES = ("", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "qwen3_moe", "mixtral",
                     "gpt_oss")


def activations_modelled(shape: ModelShape) -> bool:
    """Whether the formulas model ``shape``'s family; other families' layers are counted at
    UNMODELLED_ACTIVATION_FACTOR times a Llama layer's (the plan's activation line says so)."""
    return shape.model_type in MODELLED_FAMILIES


def expert_adapter_bytes(shape: ModelShape, tokens: int, precision: str = "bf16-true") -> int:
    """What LoRA on the stacked expert weights (peft's target_parameters) adds to one layer's saved tensors for
    ``tokens`` tokens, in bytes. peft computes each adapted stack W + scale x B @ A for the experts' forward,
    whose matmuls keep it for backward: one layer's expert weights again, in the weights' dtype (a fixed
    cost per layer and chunk, whatever the chunk's length). The weights now need a gradient, so the matmuls
    keep their inputs too: each token's hidden state once per chosen expert, and its experts' down inputs."""
    p = PROFILES[precision]
    top_k = shape.routed_intermediate // shape.expert_intermediate if shape.n_experts else 0
    per_token = p.linear * (top_k * shape.hidden + shape.routed_intermediate)
    return shape.layer_expert_params * p.param + tokens * per_token


def routed_expert_bytes(shape: ModelShape, precision: str = "bf16-true", lora_rank: int = 0) -> int:
    """Bytes one token saves in a layer's routed experts, as transformers' grouped-matmul experts save them
    (its other expert implementations save the same tensors): the router's probabilities (float32), the
    chosen experts and their order (int64) and weights; per chosen expert the gate and up outputs, the
    activation and the expert's output (before its routing weight), and with trainable experts also the
    token's hidden state gathered for it and the down projection's input. LoRA on q, k, v, o leaves the
    experts frozen (``expert_adapter_bytes`` adds what adapters on them save). Under autocast counted in
    float32, as the CPU's autocast leaves grouped matmuls (whether CUDA's casts them is not measured)."""
    if not shape.n_experts:
        return 0
    p = PROFILES[precision]
    h, e = shape.hidden, shape.expert_intermediate
    top_k = shape.routed_intermediate // e
    per_expert = h + 3 * e if lora_rank > 0 else 2 * h + 4 * e
    if shape.clamped_experts:  # GPT-OSS: its clamped gate, sigmoid, up + 1 and glu (frozen experts in bf16: 2e)
        per_expert += 3 * e
    return (4 if p.autocast_weight_copies else p.linear) * top_k * per_expert + 4 * shape.n_experts + 48 * top_k


def _mlp_bytes(p, width: int, fused: bool, lora: bool, down_input: bool) -> int:
    """Bytes one token saves in a gated MLP of ``width`` hidden units: gate, up, the activation and down's
    input with the model's own ops (three under LoRA, the frozen down projection keeping no input); the fused
    SwiGLU keeps gate and up (and down's input where ``down_input``)."""
    if fused:
        return (2 if lora or not down_input else 3) * p.linear * width
    return (3 if lora else 4) * p.linear * width


def layer_activation_bytes(
    shape: ModelShape, tokens: int, precision: str = "bf16-true", lora_rank: int = 0, fused_ops: bool = True,
    lora_experts: bool = False, expert_layer: bool | None = None,
) -> int:
    """Bytes one decoder layer saves for backward in stage 2 for ``tokens`` tokens (batch x chunk).

    Per token: norm statistics and outputs, q, k, v, the attention output and log-sum-exp, o_proj's input and
    the MLP's tensors, as transformers' layers with lightning_oomb's attention save them (the formulas:
    docs/planner.md, "What it counts"; tests/test_plan_activations.py counts real ones of each family).
    ``lora_rank`` > 0: peft adapters on q, k, v, o, the rest frozen; ``lora_experts``: on the stacked expert
    weights too (``expert_adapter_bytes``). ``fused_ops``: the Triton steps' RMSNorm/RoPE/SwiGLU (False:
    transformers' own ops), which Gemma 3's layers do not take. ``expert_layer``: a mixture's layer with
    experts (True) or a dense one (False); None: whichever saves more. A tensor-parallel rank's ``shape``
    (``ModelShape.tensor_parallel_part``) has its part of the heads and MLP width. A family the formulas
    do not model (``activations_modelled``) is counted at UNMODELLED_ACTIVATION_FACTOR times a Llama layer.
    """
    if not activations_modelled(shape):
        as_llama = dataclasses.replace(shape, model_type="")
        return math.ceil(UNMODELLED_ACTIVATION_FACTOR * layer_activation_bytes(
            as_llama, tokens, precision, lora_rank, fused_ops, lora_experts, expert_layer))
    if expert_layer is None:  # the larger of the kinds of layer the model has
        has_experts = shape.n_experts and shape.dense_layers < shape.n_layers
        has_dense = not shape.n_experts or shape.dense_layers
        kinds = [kind for kind, present in ((True, has_experts), (False, has_dense)) if present]
        return max(layer_activation_bytes(shape, tokens, precision, lora_rank, fused_ops, lora_experts, kind)
                   for kind in kinds)
    if lora_experts and lora_rank > 0 and expert_layer:
        return (layer_activation_bytes(shape, tokens, precision, lora_rank, fused_ops, expert_layer=True)
                + expert_adapter_bytes(shape, tokens, precision))
    p = PROFILES[precision]
    h, dq, dkv, dv, do = shape.hidden, shape.q_width, shape.kv_width, shape.v_width, shape.out_width
    lora = lora_rank > 0
    gemma = shape.norm_style == "gemma"
    fused_ops = fused_ops and not gemma  # x (1 + w) norms and a GELU MLP: the model's own ops run
    fused_mlp = fused_ops and not shape.fused_projections  # the fused SwiGLU takes gate_proj and up_proj
    # The MLP: a dense one (a mixture's dense layers, or its shared expert) and the routed experts.
    width = (shape.shared_intermediate if expert_layer else shape.dense_intermediate) if shape.n_experts \
        else shape.intermediate
    routed = routed_expert_bytes(shape, precision, lora_rank) if expert_layer else 0
    # q and k, v, the output (in q's dtype) and its lse, o's input
    attention = p.qk * (dq + dkv) + p.v * dv + p.qk * do + 4 * shape.n_heads + p.linear * do
    if shape.attention_sinks:  # the output rescaled by the sink's share: its float32 copy and the factor
        attention += (4 * do if p.qk != 4 else 0) + 4 * shape.n_heads
    if shape.fused_projections:  # v, a view of qkv_proj's output, keeps all of it
        attention += p.linear * (dq + dkv + dv)
    if fused_ops:
        # down_proj's input is saved, not recomputed, under autocast and on tensor-parallel ranks (a DTensor
        # shard, which kernels.linear.swiglu_linear does not take)
        down_input = p.autocast_weight_copies or shape.tensor_parallel > 1
        per_token = 2 * (p.residual * h + 4) + attention + _mlp_bytes(p, width, fused_mlp, lora, down_input) + routed
        if lora:
            per_token += 4 * lora_rank * p.linear + (3 * 2 * h if p.autocast_weight_copies else p.linear * h)
        elif p.autocast_weight_copies:
            per_token += 5 * 2 * h
        else:
            per_token += 2 * p.linear * h
        if shape.qk_norm:  # input (the projection's output) and rstd per head
            per_token += p.linear * (dq + dkv) + 4 * (shape.n_heads + shape.n_kv_heads)
        return tokens * per_token
    # Each norm keeps its float32 input and rstd; with trainable weights also the normalised input that the
    # weight multiplies: in the model's dtype, or Gemma's float32.
    norm_stats = shape.layer_norms * (4 * h + 4)
    normalized = 4 if gemma else p.residual
    mlp = _mlp_bytes(p, width, False, lora, False) + routed
    if not lora:
        per_token = norm_stats + shape.layer_norms * normalized * h + attention + mlp
        if p.autocast_weight_copies:
            per_token += 5 * 2 * h  # five bf16 casts of the fp32 norm outputs
        else:
            per_token += 2 * p.linear * h  # the two norm outputs, saved by the projections reading them
        qk_norm_outputs = (4 if gemma else p.linear) * (dq + dkv)
    else:
        per_token = norm_stats + attention + mlp + 4 * lora_rank * p.linear
        # The q, k, v adapters save the first norm's output, under autocast one bf16 cast each.
        per_token += 3 * 2 * h if p.autocast_weight_copies else p.linear * h
        qk_norm_outputs = 0
    if shape.qk_norm:
        per_token += 4 * (dq + dkv) + 4 * (shape.n_heads + shape.n_kv_heads) + qk_norm_outputs
    return tokens * per_token


def carried_mixing_bytes(shape: ModelShape, tokens: int, precision: str = "bf16-true") -> int:
    """Bytes one state-carrying layer's token mixing saves for backward over ``tokens`` tokens (batch x chunk),
    on top of what ``layer_activation_bytes`` counts for its decoder layer: measured on the meta device
    (``ModelShape.carried_saved``), with the weights' dtype of ``precision``; 0 for a model without such layers."""
    if not shape.carried_layers:
        return 0
    per_token, fixed = shape.carried_saved[0 if PROFILES[precision].param == 2 else 1]
    return fixed + tokens * per_token


def model_activation_bytes(
    shape: ModelShape, tokens: int, precision: str = "bf16-true", lora_rank: int = 0, fused_ops: bool = True
) -> int:
    """Bytes saved outside the decoder layers: embedding indices (int64), RoPE cos and sin (shared by all
    layers, in the embedding's dtype) and the final RMSNorm. With LoRA the embedding is frozen (no indices
    saved, and the first layer's input needs no gradient, so its first norm saves nothing) and the final
    norm's weight is frozen (no normalised input saved). fused_ops: a norm saves its input and an fp32 rstd
    (see ``layer_activation_bytes``); with LoRA the final norm's then cancels the first layer's."""
    p = PROFILES[precision]
    h = shape.hidden
    gemma = shape.norm_style == "gemma"
    # Gemma 3's sliding-window and global layers each have their RoPE (other bases): two cos, sin pairs.
    rope_sets = 2 if gemma and 0 < shape.window_layers < shape.n_layers else 1
    rope = rope_sets * 2 * shape.head_dim * p.param
    if fused_ops and not gemma:
        return tokens * (rope if lora_rank > 0 else 8 + rope + p.residual * h + 4)
    final_norm_stats = 4 * h + 4
    if lora_rank > 0:
        first_norm_stats_not_saved = 4 * h + 4
        return tokens * (rope + final_norm_stats - first_norm_stats_not_saved)
    return tokens * (8 + rope + final_norm_stats + (4 if gemma else p.residual) * h)


def activation_bytes(
    shape: ModelShape, tokens: int, precision: str = "bf16-true", checkpoint_layers: bool = False, lora_rank: int = 0,
    fused_ops: bool = True, lora_experts: bool = False,
) -> int:
    """Saved activations of one chunk's stage-2 forward (``tokens`` = batch x chunk tokens), in bytes.

    Without checkpointing: every layer's saved tensors. With it: each layer's input (T x hidden, residual
    dtype, kept by the checkpoint for the recompute) and attention output and log-sum-exp (q's dtype and
    float32 per head, which the recompute takes instead of attending again), plus one layer's full
    activations (the recompute). A state-carrying layer adds what its token mixing saves
    (``carried_mixing_bytes``).
    fused_ops: the Triton steps' fused RMSNorm/RoPE/SwiGLU (False: transformers' own ops). lora_experts: LoRA on
    the stacked expert weights too (``expert_adapter_bytes``).
    """
    if checkpoint_layers:
        p = PROFILES[precision]
        per_layer = shape.hidden * p.residual + shape.out_width * p.qk + 4 * shape.n_heads
        one_layer = (layer_activation_bytes(shape, tokens, precision, lora_rank, fused_ops, lora_experts)
                     + carried_mixing_bytes(shape, tokens, precision))
        layers = shape.n_layers * tokens * per_layer + one_layer
    else:
        experts = shape.n_layers - shape.dense_layers if shape.n_experts else 0
        layers = sum(n * layer_activation_bytes(shape, tokens, precision, lora_rank, fused_ops, lora_experts, kind)
                     for n, kind in ((experts, True), (shape.n_layers - experts, False)) if n)
        layers += shape.carried_layers * carried_mixing_bytes(shape, tokens, precision)
    return layers + model_activation_bytes(shape, tokens, precision, lora_rank, fused_ops)
