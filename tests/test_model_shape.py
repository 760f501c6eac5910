"""Model shapes: built-in names, config.json files, model directories, models and peft models, counted like
the real models (``core.model_shape``)."""

from __future__ import annotations

import json

import peft
import pytest
import torch
from tiny_models import CONFIGS, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_oomb.core.model_shape import (LORA_TARGETS, ModelShape, builtin_names, expert_layers, load_config_dict,
                                             transformers_config)
from lightning_oomb.kernels.page_table import StoreSpec


def test_builtin_shapes_load_and_count_like_the_real_models():
    assert set(builtin_names()) >= {"smollm2-135m", "qwen2.5-0.5b", "qwen2.5-7b", "qwen3-8b", "llama-3.1-8b",
                                    "qwen3-30b-a3b", "gemma-3-12b", "gpt-oss-20b"}
    for name in builtin_names():
        shape = ModelShape.from_name(name)
        with torch.device("meta"):  # the real module tree, no memory
            model = AutoModelForCausalLM.from_config(transformers_config(load_config_dict(name)))
        assert shape.total_params == sum(p.numel() for p in model.parameters()), name
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        # Mixtures of experts: the stacked expert weights and the routers, parameters of their own modules (not a
        # hybrid's depthwise convolutions, which multiply no matrix; not GPT-OSS's stacked expert biases).
        other = sum(p.numel() for m in model.modules()
                    if not isinstance(m, (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d))
                    for name, p in m.named_parameters(recurse=False) if p.dim() >= 2 and not name.endswith("bias"))
        assert shape.matmul_params == linear + other, name


@pytest.mark.parametrize("family", sorted(set(CONFIGS) - {"starcoder2"}))
def test_every_family_counts_like_its_model(family):
    """Parameters and weight-matrix parameters of each family's tiny model (OLMo 2's q, k norms over all heads,
    GPT-OSS's expert and router biases and attention sinks). Starcoder2's ungated MLP is counted as a gated
    one: a third matrix more than it holds, an overestimate."""
    model = tiny_model(family)
    shape = ModelShape.resolve(model)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    matrices = sum(p.numel() for m in model.modules() if not isinstance(m, torch.nn.Embedding)
                   for name, p in m.named_parameters(recurse=False) if p.dim() >= 2 and not name.endswith("bias"))
    assert shape.matmul_params == matrices


@pytest.mark.parametrize("model_type", ["nemotron_h", "falcon_h1", "lfm2", "jamba", "minimax", "deepseek_v2", "opt"])
def test_families_the_fields_do_not_describe_count_all_their_parameters(model_type):
    """MLA, hybrids' MLP-only and parallel layers, learned positions: the total (weights, gradients, optimizer
    state in the plan) is what transformers builds from the config, counted on the meta device; a tensor-parallel
    part and a config that builds no model fall back to the fields' formulas."""
    from every_family import tiny_config

    from lightning_oomb.core.model_shape import counted_params

    config = tiny_config(model_type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    assert shape.decoder_params + shape.root_params == shape.total_params
    assert ModelShape.resolve(tiny_model("qwen2")).tensor_parallel_part(2).counted_params == 0
    assert counted_params(object()) == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_lora_on_experts_counts_peft_adapters(family):
    """lora_params(rank, experts=True): peft's adapters on q, k, v, o and on the stacked expert weights
    (target_parameters), A (rank x experts, in) and B (out, rank x experts) per stack."""
    model = tiny_model(family)
    shape = ModelShape.resolve(model)
    stacks = [p for n, p in model.named_parameters() if p.dim() == 3]
    assert shape.n_layers * shape.layer_expert_params == sum(p.numel() for p in stacks)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=list(LORA_TARGETS), target_parameters=[
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    assert shape.lora_params(4, experts=True) == sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert shape.lora_params(4) < shape.lora_params(4, experts=True)


def test_qwen2_5_7b_numbers_of_the_design():
    shape = ModelShape.from_name("qwen2.5-7b")
    assert shape.matmul_params == pytest.approx(7.07e9, rel=0.01)
    assert (shape.n_layers, shape.q_width) == (28, 3584)
    assert shape.kv_bytes_per_token(torch.bfloat16) == 57_344
    assert shape.kv_bytes_per_token(torch.float32) == 114_688
    spec = StoreSpec(n_layers=28, n_kv_heads=4, head_dim=128, dtype=torch.bfloat16)
    assert spec.bytes_per_token() == 57_344 + 114_688  # the engine's own count agrees


def test_shape_from_config_dir_model_and_peft(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(load_config_dict("qwen2.5-0.5b")))
    from_dir = ModelShape.resolve(tmp_path)
    assert ModelShape.resolve(tmp_path / "config.json") == from_dir
    assert from_dir.matmul_params == ModelShape.from_name("qwen2.5-0.5b").matmul_params
    model = tiny_model("qwen2")
    shape = ModelShape.resolve(model)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=list(LORA_TARGETS)))
    assert ModelShape.resolve(lora) == shape
    assert shape.lora_params(4) == sum(p.numel() for p in lora.parameters() if p.requires_grad)
    with pytest.raises(FileNotFoundError, match="built-in"):
        ModelShape.resolve("no-such-model")


def test_qwen2_moe_counts_its_qkv_biases_and_shared_expert_gate():
    """Qwen2-MoE's q/k/v biases (``qkv_bias``) and the sigmoid gate of its shared expert, an nn.Linear(hidden, 1)
    per layer: the meta-device model's parameters, and the gate among the weights a token goes through."""
    config = AutoConfig.for_model("qwen2_moe", vocab_size=101, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.resolve(model)
    assert shape.qkv_bias and shape.shared_gate
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    attention = 2 * 32 * 32 + 2 * 32 * 16
    assert shape.active_matmul_params == 2 * (attention + 3 * 32 * (2 * 16 + 24) + 32 * 4 + 32) + 101 * 32


MOE = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, num_experts_per_tok=2, pad_token_id=0)
# Mixtures with dense layers among those with experts, each by its family's own fields (and Mixtral, experts in
# every layer); the last two have attention of their own (MLA), so only their MLPs are compared.
MIXED = {
    "qwen2_moe-mlp_only_layers": ("qwen2_moe", dict(num_experts=4, moe_intermediate_size=16,
                                                    shared_expert_intermediate_size=24, mlp_only_layers=[0, 2])),
    "qwen3_moe-sparse_step": ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=16, head_dim=8,
                                                decoder_sparse_step=2)),
    "qwen3_moe-both": ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=16, head_dim=8, decoder_sparse_step=2,
                                         mlp_only_layers=[3])),
    "mixtral": ("mixtral", dict(num_local_experts=4)),
    "deepseek_v3-first_k_dense_replace": ("deepseek_v3", dict(n_routed_experts=4, moe_intermediate_size=16,
                                                              n_shared_experts=2, first_k_dense_replace=2)),
    "glm4_moe_lite-mlp_layer_types": ("glm4_moe_lite", dict(n_routed_experts=4, moe_intermediate_size=16,
                                                            mlp_layer_types=["dense", "sparse", "dense", "sparse"])),
}
OWN_ATTENTION = ("deepseek_v3", "glm4_moe_lite")


def mlp_params(group) -> int:
    """Weight parameters of one MLP of a layer group: its nn.Linear weights after q, k, v, o, and its experts'."""
    return sum(group.linear[4:]) + group.fused


@pytest.mark.parametrize("case", list(MIXED))
def test_mixtures_count_their_dense_layers_as_dense(case):
    """Which layers hold experts and what each layer holds, against the meta-device model transformers builds
    from the config: the layers with 3D (fused expert) parameters, each layer's MLP parameters, its nn.Linear
    weights (what bitsandbytes would quantise), and where the attention is one ModelShape knows, every
    parameter of each layer and of the model."""
    model_type, fields = MIXED[case]
    config = AutoConfig.for_model(model_type, **MOE, **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config)
    layers = model.model.layers
    assert expert_layers(config) == [any(p.dim() == 3 for p in layer.parameters()) for layer in layers]
    kinds = [g for g in shape.layer_groups for _ in range(g.layers)]
    assert len(kinds) == len(layers) and shape.dense_layers == expert_layers(config).count(False)
    built = sorted(sum(p.numel() for p in layer.mlp.parameters()) for layer in layers)
    assert built == sorted(mlp_params(g) for g in kinds)
    if model_type in OWN_ATTENTION:
        return
    per_layer = shape.layer_bias_params + shape.layer_norm_params
    assert sorted(sum(p.numel() for p in layer.parameters()) for layer in layers) == sorted(
        sum(g.linear) + g.fused + per_layer for g in kinds)
    linear = sum(m.weight.numel() for m in layers.modules() if type(m) is torch.nn.Linear)
    assert shape.linear_params == linear
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    assert shape.largest_layer_params == max(sum(p.numel() for p in layer.parameters()) for layer in layers)


@pytest.mark.parametrize("case", [c for c in MIXED if MIXED[c][0] not in OWN_ATTENTION])
def test_mixtures_time_the_weights_a_token_goes_through(case):
    """active_matmul_params (P_mm) against the matmul FLOPs torch counts in a forward of the model on a few
    tokens (its experts one by one, transformers' eager experts): 2 per weight a token goes through, in a
    dense layer its dense MLP, in a layer with experts its two of four, the shared expert and its gate, and the
    router."""
    from torch.utils.flop_counter import FlopCounterMode

    model_type, fields = MIXED[case]
    config = AutoConfig.for_model(model_type, **MOE, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    tokens = 7
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=torch.randint(0, 101, (1, tokens)))
    counts = counter.get_flop_counts()["Global"]
    matmul = sum(v for op, v in counts.items() if str(op) in ("aten.mm", "aten.addmm"))
    assert matmul == 2 * tokens * ModelShape.from_config(config).active_matmul_params
