"""Model shapes: built-in names, config.json files, model directories, models and peft models, counted like
the real models (``core.model_shape``)."""

from __future__ import annotations

import json

import peft
import pytest
import torch
from tiny_models import tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_oomb.core.model_shape import LORA_TARGETS, ModelShape, builtin_names, load_config_dict, transformers_config
from lightning_oomb.kernels.page_table import StoreSpec


def test_builtin_shapes_load_and_count_like_the_real_models():
    assert set(builtin_names()) >= {"qwen2.5-0.5b", "qwen2.5-7b", "qwen3-8b", "llama-3.1-8b"}
    for name in builtin_names():
        shape = ModelShape.from_name(name)
        with torch.device("meta"):  # the real module tree, no memory
            model = AutoModelForCausalLM.from_config(transformers_config(load_config_dict(name)))
        assert shape.total_params == sum(p.numel() for p in model.parameters()), name
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert shape.matmul_params == linear, name


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
    assert shape.layer_active_matmul_params == attention + 3 * 32 * (2 * 16 + 24) + 32 * 4 + 32
