"""The planner for QLoRA (``plan(..., quantization="nf4")``, ``lightning-oomb plan --quantization nf4``): the
4-bit weights as bitsandbytes holds them (tests/test_qlora.py checks the bytes against a quantised model), the
dequantisation's workspace and time, and what it is refused without."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_oomb.cli import main as cli_main
from lightning_oomb.core.config import SparseConfig
from lightning_oomb.core.errors import SetupError
from lightning_oomb.core.plan import max_context, plan
from lightning_oomb.core.plan.assumptions import DEQUANT_GBPS
from lightning_oomb.core.plan.timing import dequant_seconds
from lightning_oomb.core.quantization import Quantization
from lightning_oomb.core.units import GIB

CARD = dict(gpu_memory=24 * GIB, host_memory=64 * GIB, grad_dtype="bfloat16", checkpoint_auto=True)


def test_qlora_holds_the_decoder_layers_in_4_bits_and_one_dequantised_matrix():
    """Qwen2.5-7B, nf4: 4 bits and a float32 absmax per 64 weights of its 6.53B decoder-layer matrix weights;
    the embeddings, lm_head, norms and biases stay bf16; one MLP matrix (3584 x 18944) dequantised at a time."""
    lora = plan("qwen2.5-7b", 32768, lora_rank=16, **CARD)
    qlora = plan("qwen2.5-7b", 32768, lora_rank=16, quantization="nf4", **CARD)
    lines = qlora.gpu_lines
    four_bit = next(v for k, v in lines.items() if k.startswith("weights (4-bit nf4"))
    matrices = 28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944)
    assert four_bit == matrices // 2 + 4 * matrices // 64 + 28 * 7 * 64
    assert lines["dequantised weight (one layer's largest, bf16, transient)"] == 3584 * 18944 * 2
    weights = lambda p: sum(v for k, v in p.gpu_lines.items() if k.startswith(("weights", "dequantised")))  # noqa: E731
    assert weights(lora) - weights(qlora) > 8.5 * GIB  # bf16's 2 bytes a weight against about 0.56
    assert "QLoRA rank 16 (base weights in 4-bit nf4)" in str(qlora)
    double = plan("qwen2.5-7b", 32768, lora_rank=16, quantization={"quant_type": "nf4", "double_quant": True}, **CARD)
    assert double.peak_gpu_bytes < qlora.peak_gpu_bytes  # 8-bit scales: about 0.4 bits a weight less


def test_dequantisation_adds_a_pass_over_the_4_bit_weights_per_matmul_pass():
    """Each pass of the decoder layers' matmuls (stage 1, stage 2's forward, the backward, a checkpoint's
    recompute) reads the 4-bit weights and writes them in bf16, at DEQUANT_GBPS scaled with the matmul rate."""
    options = dict(lora_rank=16, gpu_memory=2**50, host_memory=2**50, checkpoint_layers=True)
    lora = plan("qwen2.5-7b", 32768, **options)
    qlora = plan("qwen2.5-7b", 32768, quantization="nf4", **options)
    c = qlora.config
    one_pass = (qlora.gpu_lines[next(k for k in qlora.gpu_lines if k.startswith("weights (4-bit"))]
                + qlora.shape.linear_params * 2) / (DEQUANT_GBPS * 1e9)
    assert dequant_seconds(qlora.shape, c) == pytest.approx(one_pass)
    assert qlora.time.dequant_s == pytest.approx(4 * 8 * one_pass)  # 8 chunks, 3 passes and the recompute each
    assert qlora.time.predicted_s == pytest.approx(lora.time.predicted_s + qlora.time.dequant_s)
    slower = plan("qwen2.5-7b", 32768, quantization="nf4", matmul_tflops=395.0, **options)
    assert slower.time.dequant_s == pytest.approx(2 * qlora.time.dequant_s)
    assert "dequantising the 4-bit weights" in str(qlora) and "dequantising" not in str(lora)


def test_qlora_of_a_mixture_of_experts_quantises_its_linear_layers_only():
    """Qwen2-MoE built on the meta device: bitsandbytes (transformers' replace_with_bnb_linear) quantises the
    modules of type nn.Linear, so q, k, v, o and the shared expert with its gate, not the experts (fused
    (n_experts, ...) nn.Parameters) nor the router: those stay bf16 in the other weights line, and the dequantised
    matrix is the largest nn.Linear's, the shared expert's, not an expert's. One pass of dequantisation reads and
    writes the quantised weights only."""
    config = AutoConfig.for_model("qwen2_moe", vocab_size=1000, hidden_size=256, intermediate_size=1024,
                                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=512, shared_expert_intermediate_size=384)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = [m.weight.numel() for layer in model.model.layers for m in layer.modules() if type(m) is torch.nn.Linear]
    assert len(linear) == 2 * (4 + 3 + 1)
    options = dict(lora_rank=8, gpu_memory=2**40, host_memory=2**40)
    step = plan(model, 4096, quantization="nf4", **options)
    lines = step.gpu_lines
    nf4 = Quantization("nf4")
    assert next(v for k, v in lines.items() if k.startswith("weights (4-bit")) == sum(map(nf4.tensor_bytes, linear))
    other = sum(p.numel() for p in model.parameters()) - sum(linear)
    bf16 = next(k for k in lines if k.startswith("weights (bf16"))
    assert lines[bf16] == other * 2 + step.shape.lora_params(8) * 4 and "experts, routers" in bf16
    assert lines["dequantised weight (one layer's largest, bf16, transient)"] == 256 * 384 * 2
    one_pass = (sum(map(nf4.tensor_bytes, linear)) + 2 * sum(linear)) / (DEQUANT_GBPS * 1e9)
    assert dequant_seconds(step.shape, step.config) == pytest.approx(one_pass)


def test_qlora_fits_a_longer_context_than_lora_on_a_24_gib_gpu():
    for pages in (dict(offload="gpu"), dict(sparse=SparseConfig(budget_pages=64))):
        lora = max_context("qwen2.5-7b", lora_rank=16, **CARD, **pages)
        qlora = max_context("qwen2.5-7b", lora_rank=16, quantization="nf4", **CARD, **pages)
        assert qlora.context > lora.context > 0, pages


def test_quantization_needs_lora_and_a_4_bit_type(capsys):
    with pytest.raises(SetupError, match=r"quantization='nf4' freezes the base weights .* give lora_rank > 0"):
        plan("qwen2.5-7b", 4096, quantization="nf4", gpu_memory=2**40)
    with pytest.raises(SetupError, match="quant_type must be one of nf4, fp4"):
        plan("qwen2.5-7b", 4096, lora_rank=16, quantization="int4", gpu_memory=2**40)
    with pytest.raises(SetupError, match="oomb_model_parallel does not shard 4-bit weights"):
        plan("qwen2.5-7b", 4096, lora_rank=16, quantization="nf4", devices=2, sharding="zero2", gpu_memory=2**40)
    for args, message in ((["--context", "4K"], "give lora_rank > 0 (--lora-rank 16)"),
                          (["--max-context"], "give lora_rank > 0 (--lora-rank 16)")):
        with pytest.raises(SystemExit) as exit_:
            cli_main(["plan", "--model", "qwen2.5-7b", "--gpu-memory", "24GiB", "--quantization", "nf4", *args])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err
    with pytest.raises(SystemExit) as exit_:
        cli_main(["plan", "--model", "qwen2.5-7b", "--gpu-memory", "24GiB", "--context", "4K", "--double-quant"])
    assert exit_.value.code == 2 and "give --quantization nf4" in capsys.readouterr().err


def test_the_context_table_has_a_qlora_row(capsys):
    assert cli_main(["plan", "--model", "qwen2.5-0.5b", "--max-context", "--gpu-memory", "24GiB", "--host-memory",
                     "64GiB", "--lora-rank", "8", "--quantization", "fp4", "--double-quant"]) == 0
    out = capsys.readouterr().out
    assert "QLoRA rank 8, fp4, double-quantised, dense" in out and "LoRA rank 8, dense" in out
