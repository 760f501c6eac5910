"""The time model: FLOPs and seconds of a step (``core.plan.timing``), host transfers
(``core.plan.host_transfers``) and collectives (``core.plan.collectives``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_oomb.core.config import SparseConfig
from lightning_oomb.core.model_shape import ModelShape
from lightning_oomb.core.plan import plan, step_time

H200 = dict(gpu_memory=141e9, host_memory=128e9, checkpoint_auto=True)


def test_step_time_reproduces_the_design_floors():
    shape = ModelShape.from_name("qwen2.5-7b")
    for context, seconds in ((32 << 10, 3.6), (64 << 10, 9.6), (128 << 10, 29.0), (1 << 20, 22 * 60)):
        t = step_time(shape, context, matmul_tflops=790.0)
        assert t.floor_s == pytest.approx(seconds, rel=0.03), context
        assert t.predicted_s > t.floor_s
    lora = step_time(shape, 32 << 10, lora_rank=16)
    assert lora.linear_flops < step_time(shape, 32 << 10).linear_flops


@pytest.mark.parametrize("context, chunk, document, attended", [
    (200, 16, 37, 10**9), (200, 16, 16, 10**9), (200, 16, 5, 10**9), (200, 16, 1, 10**9), (200, 16, 200, 10**9),
    (200, 16, 37, 20), (203, 32, 50, 24),
])
def test_packed_attention_pairs_count_each_query_within_its_document(context, chunk, document, attended):
    """The planner's (query, key) pairs of packed documents against a count query by query: a query sees its
    document's keys before the chunk (at most ``attended`` of them) and, causally, its document's keys of the
    chunk (the diagonal counted as half a pair, as the unpacked formula does)."""
    from lightning_oomb.core.plan.timing import _chunk_pairs

    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        doc = [t - t % document for t in range(start, start + n)]
        counted = sum(min(max(0, start - d), attended) + t - max(start, d) + 0.5
                      for t, d in zip(range(start, start + n), doc))
        assert _chunk_pairs(start, n, attended, document) == pytest.approx(counted, rel=1e-12), start


def test_packed_step_costs_its_documents_attention():
    """1M tokens packed from 32K documents: the attention of 32 separate 32K steps, the linear layers of 1M
    tokens; one document as long as the sequence is the unpacked step exactly. The plan and its CLI say it."""
    shape = ModelShape.from_name("qwen2.5-7b")
    packed = step_time(shape, 1 << 20, document_length=32 << 10)
    one = step_time(shape, 32 << 10)
    assert packed.attention_flops == pytest.approx(32 * one.attention_flops, rel=1e-12)
    assert packed.linear_flops == pytest.approx(32 * one.linear_flops, rel=1e-12)
    for sparse in (None, SparseConfig(budget_pages=64)):
        unpacked = step_time(shape, 300_000, chunk_size=3000, sparse=sparse, page_size=100)
        assert step_time(shape, 300_000, chunk_size=3000, sparse=sparse, page_size=100,
                         document_length=300_000) == unpacked
    assert plan(shape, 1 << 20, document_length=32 << 10, **H200).time.attention_flops == packed.attention_flops
    with pytest.raises(ValueError, match="document_length"):
        plan(shape, 1 << 20, document_length=0, **H200)


def test_packed_chunks_in_the_portable_kernels_are_counted_at_their_rate():
    """Dense packed chunks holding a document border, or of a document that starts mid-page, count at
    PORTABLE_ATTENTION_EFFICIENCY (docs/planner.md); those of documents starting on a page, sparse steps and
    unpacked ones at ATTENTION_EFFICIENCY."""
    from lightning_oomb.core.plan.timing import _chunk_pairs, _runs_portable

    shape = ModelShape.from_name("qwen2.5-7b")
    assert step_time(shape, 1 << 20, document_length=32 << 10).portable_attention_flops == 0
    assert step_time(shape, 1 << 20, document_length=30000, sparse=SparseConfig()).portable_attention_flops == 0
    # 30,000-token documents, chunks of 4096, pages of 128: chunk 7 holds the first border, chunks 8-13 belong
    # to the document starting at 30,000 (mid-page), chunks 0-6 to the one at 0.
    assert [_runs_portable(i * 4096, 4096, 30000, 128) for i in range(15)] == [False] * 7 + [True] * 8
    per_pair = 4 * shape.q_width * shape.n_layers  # forward FLOPs of one (query, key) pair, all layers
    for checkpoint_layers in (False, True):
        # 64K tokens: chunks 7-15 portable (chunk 15's document starts at 60,000, mid-page); 0-2 kept on the host.
        t = step_time(shape, 1 << 16, document_length=30000, checkpoint_layers=checkpoint_layers, host_kept_chunks=3)
        pairs = sum(_chunk_pairs(i * 4096, 4096, 1 << 16, 30000) for i in range(7, 16))
        assert t.portable_attention_flops == pytest.approx(per_pair * pairs * 4.5, rel=1e-12)  # no recompute
        assert t.predicted_s > dataclasses.replace(t, portable_attention_flops=0).predicted_s


def test_host_gradient_layers_time_reproduces_the_steps_it_was_fitted_to():
    """Every layer's gradient pages on the host cost whole H200 steps +3.7 s at 256K and +15.6 s at 512K
    (docs/benchmarks.md, measured before stage 2 moved host layers to the GPU: here kept graphs of every chunk
    stop the moves); the planner adds that to its prediction, and nothing without host layers."""
    from lightning_oomb.core.plan.config import PlanConfig
    from lightning_oomb.core.plan.timing import expected_selected_pages
    from lightning_oomb.core.plan.host_transfers import host_add_seconds

    shape = ModelShape.from_name("qwen2.5-7b")
    sparse = SparseConfig()
    for context, seconds in ((256 << 10, 3.74), (512 << 10, 15.61)):
        c = PlanConfig.build(context, optimizer="none", grad_dtype=torch.bfloat16, sparse=sparse, host_grad_layers=28,
                       graph_chunks=context // 4096)
        assert host_add_seconds(shape, c) == pytest.approx(seconds, rel=0.02), context
    assert host_add_seconds(shape, PlanConfig.build(1 << 20, sparse=sparse)) == 0.0
    unmoved = dict(grad_dtype=torch.bfloat16, sparse=sparse, graph_chunks=256)
    one = host_add_seconds(shape, PlanConfig.build(1 << 20, host_grad_layers=1, **unmoved))
    assert host_add_seconds(shape, PlanConfig.build(1 << 20, host_grad_layers=16, **unmoved)) == pytest.approx(16 * one)
    # Expected distinct pages: all of a short past; a long past's sink, local window and random picks.
    assert expected_selected_pages(40, sparse, 32) == 40
    assert 5 + 59 < expected_selected_pages(8192, sparse, 32) < 5 + 32 * 59
    sixteen = PlanConfig.build(1 << 20, grad_dtype=torch.bfloat16, sparse=sparse, host_grad_layers=16)
    p = plan("qwen2.5-7b", 1 << 20, optimizer="none", grad_dtype=torch.bfloat16, sparse=sparse, host_grad_layers=16,
             gpu_memory=1 << 62, host_memory=1 << 62)
    without = dataclasses.replace(p.time, host_add_s=0.0)
    assert p.time.predicted_s == pytest.approx(without.predicted_s + host_add_seconds(shape, sixteen))
    assert "for the host gradient layers" in str(p)


def test_host_layers_move_to_the_gpu_as_stage_2_frees_pages():
    """1M tokens, 16 host layers of 28: none moves while the past is long, all have moved before stage 2 is
    halfway, and only the chunks before that pay for them; moves need batch 1 and bf16 gradient pages."""
    from lightning_oomb.core.plan.config import PlanConfig
    from lightning_oomb.core.plan.host_transfers import host_add_seconds, host_layers_left

    shape = ModelShape.from_name("qwen2.5-7b")
    c = PlanConfig.build(1 << 20, grad_dtype=torch.bfloat16, sparse=SparseConfig(), host_grad_layers=16)
    left = host_layers_left(shape, c)
    assert left[-1] == 16 and left[0] == 0 and left == sorted(left)
    assert 128 < left.index(16) < 256 and left.index(1) > 128  # stage 2 runs chunks 255..0: all moved before 128
    unmoved = host_add_seconds(shape, c.replace(graph_chunks=256))
    assert 0 < host_add_seconds(shape, c) < unmoved / 2
    for kept in (dict(grad_dtype=torch.float32), dict(batch=2, context=1 << 19)):
        assert set(host_layers_left(shape, c.replace(**kept))) == {16}


def test_generation_time_counts_prefill_flops_reads_and_launches():
    """The plan's generation time: the prefill's FLOPs are the forward's (2 x P_mm per token less the output
    layer, which runs for the last position only, plus the attention); a new token reads the weights and every
    K/V it attends to, and waits for its layers' launches where those take longer."""
    from lightning_oomb.core.plan.assumptions import KERNEL_LAUNCH_S, KERNELS_PER_LAYER_FORWARD
    from lightning_oomb.core.plan.timing import generation_time

    shape = ModelShape.resolve("qwen2.5-7b")
    n = 131072
    dense = generation_time(shape, n)
    pairs = n * n / 2
    linear = 2.0 * (shape.active_matmul_params - shape.head_params) * n + 2.0 * shape.head_params
    attention = 2.0 * (shape.q_width + shape.out_width) * pairs * shape.n_layers
    assert dense.prefill_flops == pytest.approx(linear + attention)
    kv = n * shape.n_layers * (shape.kv_width + shape.v_width) * 2
    assert dense.decode_bytes == pytest.approx(shape.active_matmul_params * 2 + kv)
    sparse = generation_time(shape, n, sparse=SparseConfig(budget_pages=64))
    assert sparse.prefill_s < dense.prefill_s / 2 and sparse.decode_bytes < dense.decode_bytes
    launches = shape.n_layers * KERNELS_PER_LAYER_FORWARD * KERNEL_LAUNCH_S
    assert dense.decode_s >= launches
    small = generation_time("smollm2-135m", 65536, chunk_size=4096)
    assert small.prefill_s >= 16 * ModelShape.resolve("smollm2-135m").n_layers * KERNELS_PER_LAYER_FORWARD * KERNEL_LAUNCH_S
