"""Memory by line (``core.plan.memory``): KV-gradient dtypes and offloaded pages."""

from __future__ import annotations

import torch

from lightning_oomb.core.plan import plan
from lightning_oomb.core.units import parse_tokens

H200 = dict(gpu_memory=141e9, host_memory=128e9, checkpoint_auto=True)


def line(lines: dict[str, int], start: str) -> int:
    """The bytes of the plan line whose name starts with ``start``."""
    return next(v for k, v in lines.items() if k.startswith(start))


def test_bf16_kv_gradient_pages_take_two_bytes_a_value():
    p = plan("qwen2.5-7b", 32768, grad_dtype=torch.bfloat16, **H200)
    grads = next(v for k, v in p.gpu_lines.items() if k.startswith("KV-gradient pages"))
    assert grads == 57_344 * 32768


def test_offload_plan_is_flat_on_the_gpu_and_holds_the_pages_on_the_host():
    plans = {n: plan("qwen2.5-7b", parse_tokens(n), streamed=True, segment_tokens=65536, **H200) for n in ("64K", "256K")}
    assert plans["64K"].peak_gpu_bytes == plans["256K"].peak_gpu_bytes  # nothing on the GPU grows with L
    for n, p in plans.items():
        assert not any(k.startswith(("K/V pages", "KV-gradient pages")) for k in p.gpu_lines)
        pinned = sum(v for k, v in p.host_lines.items() if k.startswith("pinned"))
        assert pinned == parse_tokens(n) * (57_344 + 114_688)
        assert "offloaded to pinned host memory" in str(p)
    staging = next(v for k, v in plans["64K"].gpu_lines.items() if k.startswith("offload staging: 2 segments"))
    assert staging == 2 * 65536 * (57_344 + 114_688) // 28  # K, V, dK, dV of one layer, two halves


def test_fit_start_plan_counts_lora_on_experts():
    """The plan a step makes of a peft model (core.placement.place_step, as at fit start): with target_parameters
    on a mixture of experts it counts the adapters of the stacked expert weights as trainable, and what their
    forward keeps; with q, k, v, o alone the plan is the one it always was."""
    import peft
    from tiny_models import tiny_model

    from lightning_oomb.core.config import ChunkConfig
    from lightning_oomb.core.placement import place_step

    def placed(target_parameters):
        model = peft.get_peft_model(tiny_model("qwen3_moe"), peft.LoraConfig(
            r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], target_parameters=target_parameters))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        p = place_step(model, 1, 64, ChunkConfig(chunk_size=32, page_size=16), torch.device("cpu")).plan
        return p, trainable

    plain, plain_trainable = placed(None)
    experts, experts_trainable = placed(["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    assert not plain.config.lora_experts and experts.config.lora_experts
    assert "LoRA rank 4 (experts too)" in str(experts) and "experts too" not in str(plain)
    for p, trainable in ((plain, plain_trainable), (experts, experts_trainable)):
        gradients = next(v for k, v in p.gpu_lines.items() if k.startswith("gradients"))
        assert gradients == 4 * trainable  # float32 adapters
    activations = [next(v for k, v in p.gpu_lines.items() if k.startswith("activations")) for p in (plain, experts)]
    assert activations[1] > activations[0]


def test_a_mixture_with_dense_layers_holds_each_layer_as_built():
    """Qwen3-MoE with experts in every second layer (decoder_sparse_step=2), the others a dense MLP: weights,
    gradients and AdamW's state of full training are the meta-built model's parameters; sharded, the layers
    gathered or reduce-scattered one at a time are the largest, those with experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_oomb.core.optimizers import plan_state_bytes
    from lightning_oomb.core.plan.assumptions import ZERO3_GATHERED_LAYERS

    config = AutoConfig.for_model("qwen3_moe", vocab_size=1000, hidden_size=256, intermediate_size=1024,
                                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    options = dict(precision="bf16-true", optimizer="adamw", gpu_memory=2**40, host_memory=2**40)
    one = plan(model, 4096, **options).gpu_lines
    assert line(one, "weights (bf16") == line(one, "gradients (bf16") == 2 * params
    assert line(one, "optimizer state") == int(plan_state_bytes("adamw", 2) * params)
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    assert layers[0] < layers[1]  # dense, then experts
    sharded = plan(model, 4096, devices=2, sharding="zero3", **options).gpu_lines
    assert line(sharded, "gathered weights") == ZERO3_GATHERED_LAYERS * max(layers) * 2
    assert line(sharded, "reduce-scatter in flight") == max(layers) * (2 + 4)
    assert line(sharded, "weights: decoder layers") == -(-sum(layers) // 2) * 2
