"""Where does a train_step's time go? GPU time by kernel, grouped, for one step after a warm-up.

    python -m lightning_oomb.bench.profile_step --model qwen2.5-7b --context 32k [--chunk 4096] [--budget-pages 64]
        [--grad-dtype bfloat16] [--offload host] [--keep-attention 0]

With --budget-pages, the step runs page-level sparse attention (SparseConfig(budget_pages=...)); its kernels
fall into the same groups (forward, dK/dV, dQ). With --offload host a sparse step keeps every layer's
gradient pages in host memory (their additions run on a side stream, beside the compute: GPU busy then
counts both streams); --keep-attention 0 recomputes every chunk's attention in stage 2, as a 1M-token
step must.

--last-chunks N profiles only the last N chunks of the step (stage 1's, then stage 2's, which runs them
first): the chunks with the longest past, at the cost of one unprofiled step, so that a 1M-token step
fits in one run. The warm-up step then runs at --warmup-context tokens (default 64k), once with every page
on the GPU and, for a sparse step, once with every gradient page on the host, so that the profiled window
compiles nothing.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from .. import train_step
from ..core.planner import ModelShape, parse_tokens
from ..core.schedule import ChunkConfig, ChunkedSequence
from ..core.sparse import SparseConfig
from .run import BenchConfig, build_model

# Our kernels by exact name (dense, sparse and Hopper Gluon kernels of each direction); cuBLAS by substring.
KERNEL_GROUPS = {
    "attention forward": ("_fwd_kernel", "_sparse_fwd_kernel", "_past_forward_kernel"),
    "attention dK/dV": ("_dkdv_kernel", "_page_dkdv_kernel", "_past_dkdv_kernel"),
    "attention dQ": ("_dq_kernel", "_sparse_dq_kernel", "_past_dq_kernel"),
    "host gradient pages (side stream)": ("_add_staged_kernel", "_zero_pages_kernel", "_read_rows_kernel"),
}
MATMUL_KEYS = ("gemm", "sm90_xmma", "cutlass", "nvjet", "gemv")


def _group(name: str) -> str:
    for group, kernels in KERNEL_GROUPS.items():
        if name in kernels:
            return group
    if any(k in name.lower() for k in MATMUL_KEYS):
        return "matmul (cuBLAS)"
    return "other"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--context", default="32k")
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--ops", type=int, default=0, help="also list this many torch ops (with input shapes) by GPU time")
    parser.add_argument("--budget-pages", type=int, default=0, help="sparse attention with this budget (0: dense)")
    parser.add_argument("--grad-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--offload", choices=("auto", "gpu", "host"), default="auto")
    parser.add_argument("--keep-attention", type=int, default=None,
                        help="chunks whose attention outputs stage 1 keeps (default: as many as fit)")
    parser.add_argument("--keep-graphs", type=int, default=None,
                        help="chunks whose autograd graphs stage 1 keeps (default: the last, plus as many as fit)")
    parser.add_argument("--last-chunks", type=int, default=0,
                        help="profile only the step's last this many chunks (0: the whole step)")
    parser.add_argument("--warmup-context", default="64k", help="with --last-chunks: tokens of the warm-up steps")
    args = parser.parse_args(argv)
    sparse = SparseConfig(budget_pages=args.budget_pages) if args.budget_pages else None
    context = parse_tokens(args.context)
    n_chunks = -(-context // args.chunk)
    if not 0 <= args.last_chunks < n_chunks:
        parser.error(f"--last-chunks must be in [0, {n_chunks - 1}] for {n_chunks} chunks, got {args.last_chunks}")
    model = build_model(BenchConfig(model=args.model), torch.device("cuda"), torch.bfloat16)
    vocab = ModelShape.resolve(args.model).vocab
    ids = torch.randint(0, vocab, (1, context), device="cuda")
    options = dict(chunk_size=args.chunk, sparse=sparse, grad_dtype=getattr(torch, args.grad_dtype),
                   offload=args.offload, keep_attention=args.keep_attention, keep_graphs=args.keep_graphs)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    if args.last_chunks:
        warmup_ids = ids[:, : parse_tokens(args.warmup_context)]
        for offload in ("gpu", "host") if sparse else ("gpu",):
            train_step(model, warmup_ids, **{**options, "offload": offload, "keep_attention": 0, "keep_graphs": 0})
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        prof = profile(activities=activities, record_shapes=args.ops > 0)
        first = n_chunks - args.last_chunks
        window = {}

        def observe(stage: int, index: int, start: int, end: int) -> None:
            # After stage 1's chunk first - 1: the window opens; after stage 2's chunk ``first``: it closes.
            if (stage, index) == (1, first - 1):
                torch.cuda.synchronize()
                prof.start()
                window["start"] = time.perf_counter()
            elif (stage, index) == (2, first):
                torch.cuda.synchronize()
                window["wall"] = time.perf_counter() - window["start"]
                prof.stop()

        seq = ChunkedSequence(model, ids, config=ChunkConfig(**options), observer=observe)
        try:
            seq.fill()
            seq.backward()
        finally:
            seq.release()
        wall = window["wall"]
    else:
        train_step(model, ids, **options)
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        with profile(activities=activities, record_shapes=args.ops > 0) as prof:
            t = time.perf_counter()
            train_step(model, ids, **options)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    gpu_total = sum(e.device_time_total for e in kernels) / 1e6
    groups: dict[str, float] = defaultdict(float)
    for e in kernels:
        groups[_group(e.key)] += e.device_time_total / 1e6
    kind = f"sparse, budget {args.budget_pages} pages" if sparse else "dense"
    what = f"its last {args.last_chunks} chunks (both stages)" if args.last_chunks else "the step"
    print(f"{args.model}, {kind}, context {context:,}, chunk {args.chunk}, {what}: wall {wall:.2f} s, "
          f"GPU busy {gpu_total:.2f} s")
    for name, seconds in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<32} {seconds:8.3f} s  {100 * seconds / wall:5.1f}% of wall")
    print(f"\ntop {args.top} kernels by GPU time:")
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[: args.top]:
        print(f"  {e.device_time_total / 1e6:8.3f} s  x{e.count:<6} {e.key[:100]}")

    if args.ops:
        # The op that launched each kernel: which elementwise work (norm, RoPE, SiLU, copies) costs what.
        ops = [
            e for e in prof.key_averages(group_by_input_shape=True)
            if e.self_device_time_total > 0 and e.device_type.name == "CPU"
        ]
        print(f"\ntop {args.ops} torch ops by GPU time (self), with input shapes:")
        for e in sorted(ops, key=lambda e: -e.self_device_time_total)[: args.ops]:
            shapes = str(e.input_shapes)[:90]
            print(f"  {e.self_device_time_total / 1e6:8.3f} s  x{e.count:<6} {e.key[:40]:<40} {shapes}")


if __name__ == "__main__":
    main()
