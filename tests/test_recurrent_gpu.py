"""On the GPU: every state-carrying family at widths the Triton kernels take (attention heads of 64), in bf16, each
gradient within twice the error of transformers' own bf16 full-sequence run against float32
(``check_bf16_within_full_sequence_error``: 2000 tokens, chunks of 512, so three borders carry a state)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

from test_model_families import check_bf16_within_full_sequence_error  # noqa: E402

# Shared by every family: vocabulary of check_bf16's random tokens, attention of 4 heads of 64 (2 K/V heads).
WIDTHS = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=8192)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2,
              mamba_chunk_size=256)
LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
              linear_conv_kernel_dim=4, head_dim=64)
GPU_FAMILIES = {
    "qwen3_next": dict(**WIDTHS, **LINEAR, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                       mlp_only_layers=[0, 1]),
    "qwen3_5_text": dict(**WIDTHS, **LINEAR, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
    "bamba": dict(**WIDTHS, **MAMBA2, num_hidden_layers=2, attn_layer_indices=[1]),
    "falcon_h1": dict(**WIDTHS, **MAMBA2, num_hidden_layers=2, head_dim=64, mamba_d_ssm=512),
    "jamba": dict(**WIDTHS, num_hidden_layers=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=16,
                  attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=4, num_experts_per_tok=2, use_mambapy=False),
    "minimax": dict(**WIDTHS, num_hidden_layers=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
                    block_size=256, layer_types=["linear_attention", "full_attention"]),
    "lfm2": dict(**WIDTHS, num_hidden_layers=2, layer_types=["conv", "full_attention"], conv_L_cache=4,
                 conv_bias=True),
    "mamba": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, state_size=16, num_hidden_layers=2,
                  conv_kernel=4, time_step_rank=16, use_mambapy=False),
    "mamba2": dict(vocab_size=4096, hidden_size=256, state_size=64, num_hidden_layers=2, conv_kernel=4, num_heads=8,
                   head_dim=64, expand=2, n_groups=1, chunk_size=256),
}


def gpu_model(family: str) -> torch.nn.Module:
    """``family`` at ``GPU_FAMILIES``' widths with its default random weights (Gated DeltaNet's decays spread), on
    the GPU in float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **GPU_FAMILIES[family])
    model = AutoModelForCausalLM.from_config(config).cuda().float().train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" in name and family.startswith("qwen3"):
                p.uniform_(-2, 1)
    return model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", list(GPU_FAMILIES))
def test_bf16_state_carrying_family_within_full_sequence_bf16_error(family):
    """Each bf16 gradient within twice the error of transformers' own bf16 full-sequence run, plus 2e-3."""
    check_bf16_within_full_sequence_error(gpu_model(family), family)
