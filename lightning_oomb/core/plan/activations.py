"""Saved activations of a step's chunk: what each decoder layer and the rest of the model keep for backward in
stage 2, in bytes (docs/planner.md, "What it counts")."""

from __future__ import annotations

from ..model_shape import PROFILES, ModelShape


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


def layer_activation_bytes(
    shape: ModelShape, tokens: int, precision: str = "bf16-true", lora_rank: int = 0, fused_ops: bool = True,
    lora_experts: bool = False,
) -> int:
    """Bytes one decoder layer saves for backward in stage 2 for ``tokens`` tokens (batch x chunk).

    Per token: norm statistics and outputs, q, k, v, the attention output and log-sum-exp, o_proj's input and
    the MLP's tensors, as transformers' Llama/Qwen2/Qwen3 layers with lightning_oomb's attention save them
    (the formulas: docs/planner.md, "What it counts"; tests/test_plan_activations.py counts real ones).
    ``lora_rank`` > 0: peft adapters on q, k, v, o, the rest frozen; ``lora_experts``: on the stacked expert
    weights too (``expert_adapter_bytes``). ``fused_ops``: the Triton steps' RMSNorm/RoPE/SwiGLU (False:
    transformers' own ops). A tensor-parallel rank's ``shape`` (``ModelShape.tensor_parallel_part``) has its
    part of the heads and MLP width.
    """
    if lora_experts and lora_rank > 0:
        return (layer_activation_bytes(shape, tokens, precision, lora_rank, fused_ops)
                + expert_adapter_bytes(shape, tokens, precision))
    p = PROFILES[precision]
    h, i, dq, dkv = shape.hidden, shape.intermediate, shape.q_width, shape.kv_width
    lora = lora_rank > 0
    attention = p.qk * (dq + dkv) + p.v * dkv + p.qk * dq + 4 * shape.n_heads + p.linear * dq
    if fused_ops:
        # down_proj's input is saved, not recomputed, under autocast and on tensor-parallel ranks (a DTensor
        # shard, which kernels.linear.swiglu_linear does not take)
        down_input = p.autocast_weight_copies or shape.tensor_parallel > 1
        mlp = 2 if lora or not down_input else 3  # gate, up (and down_proj's input)
        per_token = 2 * (p.residual * h + 4) + attention + mlp * p.linear * i
        if lora:
            per_token += 4 * lora_rank * p.linear + (3 * 2 * h if p.autocast_weight_copies else p.linear * h)
        elif p.autocast_weight_copies:
            per_token += 5 * 2 * h
        else:
            per_token += 2 * p.linear * h
        if shape.qk_norm:  # input (the projection's output) and rstd per head
            per_token += p.linear * (dq + dkv) + 4 * (shape.n_heads + shape.n_kv_heads)
        return tokens * per_token
    norm_stats = 2 * (4 * h + 4)
    if not lora:
        per_token = norm_stats + 2 * p.residual * h + attention + 4 * p.linear * i
        if p.autocast_weight_copies:
            per_token += 5 * 2 * h  # five bf16 casts of the fp32 norm outputs
        else:
            per_token += 2 * p.linear * h  # the two norm outputs, saved by the projections reading them
        qk_norm_outputs = p.linear * (dq + dkv)
    else:
        per_token = norm_stats + attention + 3 * p.linear * i + 4 * lora_rank * p.linear
        # The q, k, v adapters save the first norm's output, under autocast one bf16 cast each.
        per_token += 3 * 2 * h if p.autocast_weight_copies else p.linear * h
        qk_norm_outputs = 0
    if shape.qk_norm:
        per_token += 4 * (dq + dkv) + 4 * (shape.n_heads + shape.n_kv_heads) + qk_norm_outputs
    return tokens * per_token


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
    rope = 2 * shape.head_dim * p.param
    if fused_ops:
        return tokens * (rope if lora_rank > 0 else 8 + rope + p.residual * h + 4)
    final_norm_stats = 4 * h + 4
    if lora_rank > 0:
        first_norm_stats_not_saved = 4 * h + 4
        return tokens * (rope + final_norm_stats - first_norm_stats_not_saved)
    return tokens * (8 + rope + final_norm_stats + p.residual * h)


def activation_bytes(
    shape: ModelShape, tokens: int, precision: str = "bf16-true", checkpoint_layers: bool = False, lora_rank: int = 0,
    fused_ops: bool = True, lora_experts: bool = False,
) -> int:
    """Saved activations of one chunk's stage-2 forward (``tokens`` = batch x chunk tokens), in bytes.

    Without checkpointing: every layer's saved tensors. With it: each layer's input (T x hidden, residual
    dtype, kept by the checkpoint for the recompute) and attention output and log-sum-exp (q's dtype and
    float32 per head, which the recompute takes instead of attending again), plus one layer's full
    activations (the recompute).
    fused_ops: the Triton steps' fused RMSNorm/RoPE/SwiGLU (False: transformers' own ops). lora_experts: LoRA on
    the stacked expert weights too (``expert_adapter_bytes``).
    """
    one_layer = layer_activation_bytes(shape, tokens, precision, lora_rank, fused_ops, lora_experts)
    if checkpoint_layers:
        p = PROFILES[precision]
        per_layer = shape.hidden * p.residual + shape.q_width * p.qk + 4 * shape.n_heads
        layers = shape.n_layers * tokens * per_layer + one_layer
    else:
        layers = shape.n_layers * one_layer
    return layers + model_activation_bytes(shape, tokens, precision, lora_rank, fused_ops)
