"""One rank of a several-GPU step: its memory lines (``core.plan.memory``) and its collectives
(``core.plan.collectives``), data parallel, sharded and tensor parallel, against Qwen2.5-7B counted by hand."""

from __future__ import annotations

import pytest

from lightning_oomb.core.plan import plan


def test_data_parallel_plan_is_one_rank_with_its_bucket_share_and_all_reduce():
    """plan(devices=N) (oomb_ddp): each rank's GPU memory is the one-GPU step's plus the float32 bucket its
    gradients are averaged through; its host budget is the machine's divided among the ranks; the step adds a
    ring all-reduce of the float32 gradients at COLLECTIVE_GBPS."""
    from lightning_oomb.core.plan.assumptions import COLLECTIVE_GBPS
    from lightning_oomb.core.ranks import GRADIENT_BUCKET_BYTES
    from lightning_oomb.core.units import GIB

    kwargs = dict(chunk_size=4096, gpu_memory=140 * GIB, host_memory=500 * GIB, checkpoint_layers=False)
    one = plan("qwen2.5-7b", 131072, **kwargs)
    four = plan("qwen2.5-7b", 131072, devices=4, **kwargs)
    assert four.peak_gpu_bytes - one.peak_gpu_bytes == GRADIENT_BUCKET_BYTES
    assert four.host_memory == 500 * GIB // 4 and one.host_memory == 500 * GIB
    trainable = four.shape.total_params
    want = 2 * 3 / 4 * 4 * trainable / (COLLECTIVE_GBPS * 1e9)
    assert four.time.all_reduce_s == pytest.approx(want) and one.time.all_reduce_s == 0
    assert four.time.predicted_s - one.time.predicted_s == pytest.approx(want)
    assert "4 data-parallel ranks (oomb_ddp), memory per GPU" in str(four)
    with pytest.raises(ValueError, match="devices must be an integer >= 1"):
        plan("qwen2.5-7b", 131072, devices=0, **kwargs)


# Qwen2.5-7B by hand: a decoder layer holds q, o (3584 x 3584), k, v (3584 x 512), the q/k/v biases, the MLP
# (3 x 3584 x 18944) and two norms; the root the embedding and the untied output layer (152064 x 3584 each)
# and the final norm.
QWEN_LAYER = 2 * 3584 * 3584 + 2 * 3584 * 512 + (3584 + 2 * 512) + 3 * 3584 * 18944 + 2 * 3584
QWEN_LAYERS = 28 * QWEN_LAYER
QWEN_ROOT = 2 * 152064 * 3584 + 3584


def _line(p, prefix: str) -> int:
    (value,) = [v for k, v in p.gpu_lines.items() if k.startswith(prefix)]
    return value


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("sharding", ["zero1", "zero2", "zero3"])
def test_sharded_plan_is_one_rank_of_oomb_model_parallel(devices, sharding):
    """Per GPU, bf16-true AdamW: the root (embeddings, final norm, output layer) whole with its float32 bucket;
    the decoder layers' weights as 1/N shards plus what is gathered (zero1/zero2: all of them for the step,
    zero3: two layers), their gradients 1/N in bf16 (zero1: whole, float32) plus one layer's reduce-scatter in
    flight (bf16 and float32), their AdamW state 1/N. Every other line is the one-GPU step's."""
    from lightning_oomb.core.plan.assumptions import COLLECTIVE_GBPS
    from lightning_oomb.core.ranks import GRADIENT_BUCKET_BYTES
    from lightning_oomb.core.units import GIB

    assert QWEN_LAYERS + QWEN_ROOT == 7_615_616_512
    kwargs = dict(chunk_size=4096, gpu_memory=140 * GIB, host_memory=500 * GIB, checkpoint_layers=False)
    one = plan("qwen2.5-7b", 131072, **kwargs)
    rank = plan("qwen2.5-7b", 131072, devices=devices, sharding=sharding, **kwargs)
    n, bf16, fp32 = devices, 2, 4
    want = {
        "weights: root": bf16 * QWEN_ROOT,
        "weights: decoder layers": bf16 * QWEN_LAYERS // n,
        "gathered weights": bf16 * (2 * QWEN_LAYER if sharding == "zero3" else QWEN_LAYERS),
        "gradients: root": bf16 * QWEN_ROOT,
        "gradients: decoder layers": fp32 * QWEN_LAYERS if sharding == "zero1" else bf16 * QWEN_LAYERS // n,
        "reduce-scatter in flight": (bf16 + fp32) * QWEN_LAYER,
        "optimizer state: root": 2 * bf16 * QWEN_ROOT,
        "optimizer state: decoder layers": 2 * bf16 * QWEN_LAYERS // n,
        "gradient all-reduce bucket": GRADIENT_BUCKET_BYTES,
    }
    assert {prefix: _line(rank, prefix) for prefix in want} == want
    whole = sum(_line(one, prefix) for prefix in ("weights", "gradients", "optimizer state"))
    assert whole == (bf16 + bf16 + 2 * bf16) * (QWEN_LAYERS + QWEN_ROOT)  # weights, gradients, AdamW state
    assert rank.peak_gpu_bytes == one.peak_gpu_bytes - whole + sum(want.values())
    assert rank.host_memory == 500 * GIB // n
    # Collectives (ring: (N-1)/N of the buffer per rank for a gather or reduce-scatter), none hidden.
    chunks, share = 32, (n - 1) / n
    gathers = {"zero1": 1, "zero2": 1, "zero3": 3 * chunks}[sharding]
    reductions = 1 if sharding == "zero1" else chunks
    layers_s = (gathers * share * bf16 * QWEN_LAYERS + reductions * share * fp32 * QWEN_LAYERS) / (COLLECTIVE_GBPS * 1e9)
    assert rank.time.sharding_s == pytest.approx(layers_s)
    assert rank.time.all_reduce_s == pytest.approx(2 * share * fp32 * QWEN_ROOT / (COLLECTIVE_GBPS * 1e9))
    assert rank.time.predicted_s - one.time.predicted_s == pytest.approx(layers_s + rank.time.all_reduce_s)
    text = str(rank)
    assert f"{n} data-parallel ranks (oomb_model_parallel, sharding {sharding}" in text
    assert f"{COLLECTIVE_GBPS:g} GB/s bus bandwidth assumed, none hidden behind the compute" in text
    assert f"reduce-scatter of the decoder layers' gradients (float32): {reductions} x" in text


# One of 2 tensor-parallel ranks of Qwen2.5-7B's decoder layer by hand: half of each matrix and of the q/k/v
# biases, both norms whole.
QWEN_LAYER_TP2 = (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944) // 2 + (3584 + 2 * 512) // 2 + 2 * 3584


def test_tensor_parallel_plan_is_one_rank():
    """plan(tensor_parallel=2), bf16-true AdamW, 128K, per GPU: the K/V and KV-gradient pages half the one-GPU
    step's; the decoder layers' weights, gradients and AdamW state those of half of each layer, norms whole;
    the root whole, with the float32 bucket the strategy averages the whole weights' gradients through; the
    activations' attention and MLP parts halved, the hidden-size parts whole (by hand); the host budget
    halved. Every other line is the one-GPU step's."""
    from lightning_oomb.core.ranks import GRADIENT_BUCKET_BYTES
    from lightning_oomb.core.units import GIB

    kwargs = dict(chunk_size=4096, gpu_memory=140 * GIB, host_memory=500 * GIB, checkpoint_layers=False)
    one = plan("qwen2.5-7b", 131072, **kwargs)
    rank = plan("qwen2.5-7b", 131072, tensor_parallel=2, **kwargs)
    for prefix in ("K/V pages", "KV-gradient pages"):
        assert 2 * _line(rank, prefix) == _line(one, prefix)
    bf16 = 2
    want = {
        "weights: root": bf16 * QWEN_ROOT,
        "weights: decoder layers": bf16 * 28 * QWEN_LAYER_TP2,
        "gradients: root": bf16 * QWEN_ROOT,
        "gradients: decoder layers": bf16 * 28 * QWEN_LAYER_TP2,
        "optimizer state: root": 2 * bf16 * QWEN_ROOT,
        "optimizer state: decoder layers": 2 * bf16 * 28 * QWEN_LAYER_TP2,
        "gradient all-reduce bucket": GRADIENT_BUCKET_BYTES,
    }
    assert {prefix: _line(rank, prefix) for prefix in want} == want
    # Saved per token and layer (fused ops): the norms' inputs and rstd, 2(2h + 4); 14 query and 2 KV heads' q,
    # k, v, output, lse and o_proj's input; gate, up and down_proj's input, which a DTensor shard saves (1/2 of
    # I = 18944 each); the norms' outputs 2·2h. Per token once: ids, RoPE cos/sin, the final norm.
    attention = 2 * (1792 + 256) + 2 * 256 + 2 * 1792 + 4 * 14 + 2 * 1792
    layer = 2 * (2 * 3584 + 4) + attention + 3 * 2 * 9472 + 2 * 2 * 3584
    assert _line(rank, "activations") == 4096 * (28 * layer + 8 + 2 * 128 * 2 + 2 * 3584 + 4)
    assert _line(rank, "backward working set") == 4096 * layer
    changed = ("weights", "gradients", "optimizer state", "gradient all-reduce", "activations", "backward",
               "K/V pages", "KV-gradient pages")
    assert {k: v for k, v in one.gpu_lines.items() if not k.startswith(changed)} == {
        k: v for k, v in rank.gpu_lines.items() if not k.startswith(changed)}
    assert rank.host_memory == 250 * GIB and rank.shape.n_kv_heads == 2


@pytest.mark.parametrize("checkpoint_layers", [False, True])
def test_tensor_parallel_collectives_by_hand(checkpoint_layers):
    """4 ranks, Qwen2.5-7B, 10,000 tokens in chunks of 4096 (the last of 1808), its graph kept. Without layer
    checkpointing stage 1 runs 27 layers of the first two chunks (it ends at the last layer's K/V store) and 28
    of the last, stage 2 28 of the first two: 2 x 55 all-reduces of o_proj's and down_proj's outputs for each of
    those, 2 x 28 for the last. With it no graph is kept: stage 1 27 layers of each chunk, stage 2 28, the
    recompute 28, of which only o_proj's all-reduces (it stops once down_proj saved its input). The backward
    all-reduces the input gradients of q, k, v, gate and up in every layer and chunk; the whole weights'
    gradients (the root and both norms of each layer) once, in float32. A ring all-reduce over 4 ranks moves
    1.5 x its buffer, (chunk tokens x 3584) in bf16."""
    from lightning_oomb.core.plan.assumptions import COLLECTIVE_GBPS
    from lightning_oomb.core.plan.collectives import step_collectives
    from lightning_oomb.core.units import GIB

    rank = plan("qwen2.5-7b", 10000, chunk_size=4096, tensor_parallel=4, checkpoint_layers=checkpoint_layers,
                graph_chunks=1, gpu_memory=140 * GIB, host_memory=500 * GIB)
    forward, backward, gradients = step_collectives(rank.shape, rank.config)
    if checkpoint_layers:
        calls, tokens = 3 * (2 * 55 + 28), (2 * 55 + 28) * 10000
    else:
        calls, tokens = 2 * 2 * 55 + 2 * 28, 2 * 55 * 2 * 4096 + 2 * 28 * 1808
    assert forward.calls == calls and forward.calls * forward.bus_bytes == pytest.approx(1.5 * tokens * 3584 * 2)
    assert backward.calls == 5 * 28 * 3
    assert backward.calls * backward.bus_bytes == pytest.approx(1.5 * 5 * 28 * 10000 * 3584 * 2)
    assert (gradients.calls, gradients.bus_bytes) == (1, 1.5 * 4 * (QWEN_ROOT + 28 * 2 * 3584))
    t = rank.time
    assert t.tensor_parallel_s == pytest.approx((forward.calls * forward.bus_bytes + backward.calls * backward.bus_bytes)
                                                / (COLLECTIVE_GBPS * 1e9))
    assert t.all_reduce_s == pytest.approx(gradients.bus_bytes / (COLLECTIVE_GBPS * 1e9)) and t.sharding_s == 0
    assert t.predicted_s == pytest.approx(t.compute_s + t.launch_s + t.tensor_parallel_s + t.all_reduce_s)


def test_tensor_parallel_inside_sharded_data_parallel():
    """2-D (oomb_model_parallel with data_parallel_size D and tensor_parallel_size T): each rank's part of the
    decoder layers (1/T by KV heads) sharded 1/D by FSDP, pages of H_kv/T heads, the root whole; collectives:
    the tensor-parallel all-reduces of the T-rank plan, FSDP's gathers and reduce-scatters of the D-rank plan
    of that part, the root's gradients averaged over all D x T ranks; the host budget shared by all."""
    from lightning_oomb.core.plan.collectives import step_collectives
    from lightning_oomb.core.units import GIB

    common = dict(chunk_size=4096, gpu_memory=140 * GIB, host_memory=448 * GIB, optimizer="adamw", checkpoint_auto=True)
    tp = plan("qwen2.5-7b", 256 << 10, tensor_parallel=2, **common)
    both = plan("qwen2.5-7b", 256 << 10, tensor_parallel=2, devices=2, sharding="zero2", **common)
    fsdp = plan("qwen2.5-7b", 256 << 10, devices=2, sharding="zero2", **common)

    def line(p, prefix):
        return next(v for k, v in p.gpu_lines.items() if k.startswith(prefix))

    assert line(both, "K/V pages") == line(tp, "K/V pages") == line(fsdp, "K/V pages") // 2
    layers = line(tp, "weights: decoder layers")  # this rank's part, whole
    assert line(both, "weights: decoder layers, 1/2 shard of this rank's 1/2 by KV heads") == layers // 2
    assert line(both, "gathered weights: decoder layers") == layers
    assert line(both, "weights: root") == line(tp, "weights: root") == line(fsdp, "weights: root")
    assert "; 2 data-parallel ranks (oomb_model_parallel, sharding zero2: " in str(both)
    assert "; 2 tensor-parallel ranks each (oomb_model_parallel, split by KV heads), memory per GPU" in str(both)
    forward, backward, gather, scatter, root = step_collectives(both.shape, both.config)
    assert (forward, backward) == tuple(step_collectives(tp.shape, tp.config)[:2])
    assert gather.bus_bytes == 0.5 * layers and scatter.calls == both.config.n_chunks
    assert root.bus_bytes == 2 * 3 / 4 * 4 * both.shape.root_params  # a ring over 4 ranks
    assert both.host_memory == 112 * GIB  # 448 GiB shared by the 4 processes of the machine
