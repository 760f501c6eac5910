"""Sparse attention kernels against the dense kernels on the same attended work (CUDA).

    python -m lightning_oomb.bench.sparse_kernels [--past 131072] [--budget 64] [--chunk 4096]
        [--grad-dtype float32|bfloat16] [--sweep]

Qwen2.5-7B heads (28 query heads, 4 KV heads, head dim 128), bf16, one chunk of --chunk queries. The sparse
kernels run over a past of --past tokens with --budget pages of 128 per query tile (1 sink, 4 local, the
rest random and distinct per tile and KV head, so that tiles share only the sink and local pages); the dense
kernels over a past of budget * 128 tokens, where every query attends to the same number of keys. The ratio
is the cost of the page lists and of the page-stationary dK/dV pass against the dense key-stationary one.
The sparse backward is also timed with the KV-gradient pages in pinned host memory (what one layer of
``PagePool(host_grad_layers=...)`` costs a chunk: the selected pages cross the bus inside the kernel).
With --sweep it also times the sparse kernels over candidate tile shapes (BLOCK_M, BLOCK_N, warps, stages):
the forward alone, then the backward with one kernel's tiles varied and the others at their defaults.
"""

from __future__ import annotations

import argparse

import torch


def _timed(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def _problem(past: int, t: int, n_kv: int = 4, group: int = 7, d: int = 128, ps: int = 128,
             grad_dtype: torch.dtype = torch.float32, host_grads: bool = False):
    from ..core.pages import PagePool, StoreSpec

    spec = StoreSpec(n_layers=1, n_kv_heads=n_kv, head_dim=d, dtype=torch.bfloat16, grad_dtype=grad_dtype)
    pages = -(-(past + t) // ps)
    pool = PagePool(spec, pages, ps, "cuda", host_grad_layers=int(host_grads))
    table = pool.allocate(1, past + t)
    for x in (pool.k, pool.v):
        x.normal_()
    store = pool.layer(0, table)
    rand = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v, do = rand(1, n_kv * group, t, d), rand(1, n_kv, t, d), rand(1, n_kv, t, d), rand(1, n_kv * group, t, d)
    return store, q, k, v, do


def _selection(past: int, t: int, budget: int, n_kv: int = 4, ps: int = 128) -> torch.Tensor:
    n_past, n_tiles = -(-past // ps), -(-t // ps)
    forced = torch.tensor([0, *range(n_past - 4, n_past)])
    middle = torch.arange(1, n_past - 4)
    lists = []
    for _ in range(n_kv * n_tiles):
        pick = middle[torch.randperm(len(middle))[: budget - 5]]
        lists.append(torch.cat([forced, pick]).sort().values)
    return torch.stack(lists).view(1, n_kv, n_tiles, budget).int().cuda()


SWEEP = {
    # The first of each list was the default before the sweep of docs/bench/h200-sparse-kernels-sweep.txt.
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3)],
    "dq": [(128, 64, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 8, 3), (128, 64, 8, 3), (128, 32, 4, 3)],
    "dkdv": [(32, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
}


def sweep(store, q, k, v, do, sel, past: int, scale: float, pairs: float) -> None:
    """Print the time and rate of each candidate tile shape (see the module notes)."""
    import dataclasses

    from ..kernels import chunk_attention as dense
    from ..kernels import sparse_attention as sparse
    from ..kernels.chunk_attention import Tiles

    base = sparse.default_tiles(q.shape[-1], q.dtype)
    chunk_tiles = dense.default_tiles(q.shape[-1], q.dtype)
    out, lse = sparse.attention_forward(q, k, v, store, past, scale, sel)
    for kind, candidates in SWEEP.items():
        for shape in candidates:
            tiles = Tiles(*shape)
            try:
                if kind == "fwd":
                    ms = _timed(lambda: sparse._forward(q, k, v, store, past, scale, sel, tiles))
                    work = 4 * 128 * pairs
                else:
                    kt = dataclasses.replace(base, **{kind: tiles})
                    ms = _timed(lambda: sparse._backward(do, q, k, v, out, lse, store, past, scale, sel, kt,
                                                         chunk_tiles))
                    work = 10 * 128 * pairs
            except Exception as error:  # a shape that does not compile (shared memory) is a result
                print(f"sweep {kind:5s} {shape}: {type(error).__name__}")
                continue
            print(f"sweep {kind:5s} {shape}: {ms:.3f} ms ({work / ms / 1e9:.0f} TFLOP/s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--past", type=int, default=131072)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--grad-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype of the KV-gradient pages")
    parser.add_argument("--sweep", action="store_true", help="also time candidate tile shapes")
    args = parser.parse_args(argv)
    grad_dtype = getattr(torch, args.grad_dtype)
    from ..kernels import chunk_attention as dense
    from ..kernels import sparse_attention as sparse

    torch.manual_seed(0)
    store, q, k, v, do = _problem(args.past, args.chunk, grad_dtype=grad_dtype)
    sel = _selection(args.past, args.chunk, args.budget)
    scale = 128**-0.5
    out, lse = sparse.attention_forward(q, k, v, store, args.past, scale, sel)
    s_fwd = _timed(lambda: sparse.attention_forward(q, k, v, store, args.past, scale, sel))
    s_bwd = _timed(lambda: sparse.attention_backward(do, q, k, v, out, lse, store, args.past, scale, sel))
    host_store = _problem(args.past, args.chunk, grad_dtype=grad_dtype, host_grads=True)[0]
    host_store.k.copy_(store.k)
    host_store.v.copy_(store.v)
    h_bwd = _timed(lambda: sparse.attention_backward(do, q, k, v, out, lse, host_store, args.past, scale, sel))
    del host_store
    dense_past = args.budget * 128
    dstore, dq, dk, dv, ddo = _problem(dense_past, args.chunk)
    dout, dlse = dense.attention_forward(dq, dk, dv, dstore, dense_past, scale)
    d_fwd = _timed(lambda: dense.attention_forward(dq, dk, dv, dstore, dense_past, scale))
    d_bwd = _timed(lambda: dense.attention_backward(ddo, dq, dk, dv, dout, dlse, dstore, dense_past, scale))
    pairs = args.chunk * (dense_past + args.chunk / 2) * 28
    tflops = lambda ms, work: work / ms / 1e9  # noqa: E731
    print(f"chunk {args.chunk}, sparse past {args.past:,} tokens with {args.budget} pages per tile; "
          f"dense past {dense_past:,}")
    print(f"sparse forward {s_fwd:.2f} ms ({tflops(s_fwd, 4 * 128 * pairs):.0f} TFLOP/s), "
          f"backward {s_bwd:.2f} ms ({tflops(s_bwd, 10 * 128 * pairs):.0f} TFLOP/s at 2.5x forward work)")
    print(f"dense  forward {d_fwd:.2f} ms ({tflops(d_fwd, 4 * 128 * pairs):.0f} TFLOP/s), "
          f"backward {d_bwd:.2f} ms ({tflops(d_bwd, 10 * 128 * pairs):.0f} TFLOP/s)")
    print(f"sparse / dense: forward {s_fwd / d_fwd:.2f}, backward {s_bwd / d_bwd:.2f}")
    print(f"sparse backward with {args.grad_dtype} KV-gradient pages in pinned host memory: {h_bwd:.2f} ms "
          f"({h_bwd - s_bwd:+.2f} ms against pages on the GPU)")
    if args.sweep:
        sweep(store, q, k, v, do, sel, args.past, scale, pairs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
