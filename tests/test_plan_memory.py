"""Memory by line (``core.plan.memory``): KV-gradient dtypes and offloaded pages."""

from __future__ import annotations

import torch

from lightning_oomb.core.plan import plan
from lightning_oomb.core.units import parse_tokens

H200 = dict(gpu_memory=141e9, host_memory=128e9, checkpoint_auto=True)


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
