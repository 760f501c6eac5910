"""Saved activations of a step's chunk: what each decoder layer and the rest of the model keep for backward in
stage 2, in bytes (docs/planner.md, "What it counts")."""

from __future__ import annotations

from ..model_shape import PROFILES, ModelShape


def layer_activation_bytes(
    shape: ModelShape, tokens: int, precision: str = "bf16-true", lora_rank: int = 0, fused_ops: bool = True
) -> int:
    """Bytes one decoder layer saves for backward in stage 2 for ``tokens`` tokens (batch x chunk).

    Derived from transformers' Llama/Qwen2/Qwen3 decoder layer with lightning_oomb's attention (and checked
    against counted saved tensors in tests/test_plan_activations.py). Full training:
    - each RMSNorm (2): its float32 input copy (pow), rsqrt (1 float per token), the normalised input in
      the residual dtype (saved by the weight multiply) and its output (saved by the projections after it);
    - attention (ChunkAttention): q, k after RoPE, v, the output (q's dtype), log-sum-exp (fp32 per head);
      o_proj saves its input (the output made contiguous, in the linear dtype);
    - MLP: gate output (SiLU), SiLU output and up output (the product), the product (down_proj): 4 x I;
    - Qwen3 QK-norm: float32 copies of q and k, rsqrt per head, normalised q, k in the linear dtype;
    - bf16-mixed: the projections save autocast's bf16 casts of the fp32 norm output instead, one cast per
      projection (q, k, v, gate, up); the bf16 weight copies are a separate line of the plan.
    RoPE multiplies by cos/sin that need no gradient, so it saves only cos/sin (counted once per model).

    LoRA (peft adapters on q, k, v, o; everything else frozen): a frozen linear layer saves only its
    weight, a frozen norm weight makes the norm skip its normalised input, so what remains is the norm
    statistics, the first norm's output (read by the q/k/v adapters), attention as above, o's input (its
    adapter), the MLP without down_proj's input (3 x I), and each adapter's rank-r intermediate.

    fused_ops (the Triton steps, lightning_oomb.kernels): each RMSNorm saves its input (in its own dtype)
    and one fp32 rstd per row instead of the fp32 copy and the normalised input; SwiGLU saves gate and up,
    not silu(gate) (one I less), and without autocast the trained down projection recomputes its input,
    the product (kernels.linear.swiglu_linear: another I less), except on tensor-parallel ranks, whose down
    projection is a DTensor shard that swiglu_linear does not take.

    A tensor-parallel rank's ``shape`` (``ModelShape.tensor_parallel_part``) has its own heads and MLP width:
    the attention and MLP terms are its part, the hidden-size terms whole.
    """
    p = PROFILES[precision]
    h, i, dq, dkv = shape.hidden, shape.intermediate, shape.q_width, shape.kv_width
    lora = lora_rank > 0
    attention = p.qk * (dq + dkv) + p.v * dkv + p.qk * dq + 4 * shape.n_heads + p.linear * dq
    if fused_ops:
        down_input = p.autocast_weight_copies or shape.tensor_parallel > 1  # saved, not recomputed
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
    fused_ops: bool = True,
) -> int:
    """Saved activations of one chunk's stage-2 forward (``tokens`` = batch x chunk tokens), in bytes.

    Without checkpointing: every layer's saved tensors. With it: each layer's input (T x hidden, residual
    dtype, kept by the checkpoint for the recompute) and attention output and log-sum-exp (q's dtype and
    float32 per head, which the recompute takes instead of attending again), plus one layer's full
    activations (the recompute).
    fused_ops: the Triton steps' fused RMSNorm/RoPE/SwiGLU (False: transformers' own ops).
    """
    one_layer = layer_activation_bytes(shape, tokens, precision, lora_rank, fused_ops)
    if checkpoint_layers:
        p = PROFILES[precision]
        per_layer = shape.hidden * p.residual + shape.q_width * p.qk + 4 * shape.n_heads
        layers = shape.n_layers * tokens * per_layer + one_layer
    else:
        layers = shape.n_layers * one_layer
    return layers + model_activation_bytes(shape, tokens, precision, lora_rank, fused_ops)
