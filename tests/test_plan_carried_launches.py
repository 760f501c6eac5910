"""A hybrid's step time counts the operations its state-carrying layers launch (ModelShape.carried_ops): counted
on the meta device, they are what the layer runs on real tensors, and they bound the measured hybrid step."""

from __future__ import annotations

import pytest
import torch
from test_recurrent import tiny_mamba2, tiny_qwen3_next

from lightning_oomb.core.model_shape import ModelShape, load_config_dict, transformers_config
from lightning_oomb.core.plan import plan
from lightning_oomb.recurrent import carried_layers
from lightning_oomb.recurrent.saved import _CountOps, launched_ops


@pytest.mark.parametrize("build", [tiny_qwen3_next, tiny_mamba2], ids=["gated-delta", "mamba2"])
def test_meta_counts_are_the_real_layers_operations(build):
    """The line (per token, fixed) fitted on the meta device at 1024 and 2048 tokens gives the operations the
    layer's chunk runs on CPU tensors at 320 tokens, forward and backward, exactly: the gated delta rule's torch
    path loops over blocks of 64 tokens (operations grow with the chunk), the SSD scan's is vectorised."""
    model = build()
    shape = ModelShape.from_config(model.config)
    (forward_per_token, forward_fixed), (backward_per_token, backward_fixed) = shape.carried_ops
    assert forward_fixed > 0 and backward_fixed > 0
    assert (forward_per_token > 0) == (build is tiny_qwen3_next)
    layer = carried_layers(model)[0].float()
    assert launched_ops(layer, 320, model.config.hidden_size) == (forward_per_token * 320 + forward_fixed,
                                                                  backward_per_token * 320 + backward_fixed)
    with _CountOps() as counted:  # the counter itself, on a known op sequence
        torch.ones(3).add(1).mul(2)
    assert counted.count == 3


def test_hybrid_step_counts_its_launches():
    """Eight layers of Qwen3-Next-80B-A3B, LoRA 16, 128K in chunks of 4096 as `lightning-oomb fit` placed it on
    an H100 80GB (docs/benchmarks.md, "Hybrid models through `lightning-oomb fit`"): transformers' torch path of
    the gated delta rule launched about 1.6M operations; with them the plan comes within 10% of the measured
    21.03 s step, where the FLOPs alone gave 3.4 s; the plan says where the time goes."""
    config = load_config_dict("qwen3-next-80b-a3b")
    config["num_hidden_layers"] = 8
    shape = ModelShape.from_config(transformers_config(config))
    step = plan(shape, 131072, lora_rank=16, optimizer="adamw", precision="bf16-true", chunk_size=4096,
                gpu_memory=10**15, host_memory=10**15, graph_chunks=2, kept_chunks=30, stage_1_loss=True)
    assert step.time.predicted_s == pytest.approx(21.03, rel=0.10)
    assert step.time.compute_s < 0.2 * step.time.predicted_s and step.time.carried_ops > 1e6
    assert "the state-carrying layers' token mixing launches" in str(step)
