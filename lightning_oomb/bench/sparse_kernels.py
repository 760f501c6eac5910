"""Sparse attention kernels against the dense kernels on the same attended work (CUDA).

    python -m lightning_oomb.bench.sparse_kernels [--past 131072] [--budget-pages 64] [--chunk 4096]
        [--grad-dtype float32|bfloat16] [--sweep]

Qwen2.5-7B heads in bf16, one chunk: the sparse kernels over --past tokens with --budget-pages pages per query tile,
the dense kernels over budget pages of past, so that every query attends to as many keys; then the sparse
backward with its gradient pages in pinned host memory, alone and among a layer's other work; with --sweep,
candidate tile shapes (docs/benchmarks.md, "The measurement scripts").
"""

from __future__ import annotations

import argparse

import torch

from ..cli_flags import add_budget_pages, add_chunk, add_grad_dtype


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


def _stores(past: int, t: int, n_kv: int = 4, d: int = 128, ps: int = 128,
            grad_dtype: torch.dtype = torch.float32, layers: int = 1, host_layers: int = 0):
    """One LayerStore per layer over a past of ``past`` tokens (random K/V), the gradient pages of
    ``host_layers`` of them (spread as in a step) in pinned host memory, the others on the GPU."""
    from ..kernels.page_table import StoreSpec
    from ..core.pages import PagePool

    spec = StoreSpec(n_layers=layers, n_kv_heads=n_kv, head_dim=d, dtype=torch.bfloat16, grad_dtype=grad_dtype)
    pages = -(-(past + t) // ps)
    pool = PagePool(spec, pages, ps, "cuda", host_grad_layers=host_layers)
    table = pool.allocate(1, past + t)
    for x in (pool.k, pool.v):
        x.normal_()
    return [pool.layer(i, table) for i in range(layers)]


def _problem(past: int, t: int, n_kv: int = 4, group: int = 7, d: int = 128, ps: int = 128,
             grad_dtype: torch.dtype = torch.float32):
    store = _stores(past, t, n_kv, d, ps, grad_dtype)[0]
    rand = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v, do = rand(1, n_kv * group, t, d), rand(1, n_kv, t, d), rand(1, n_kv, t, d), rand(1, n_kv * group, t, d)
    return store, q, k, v, do


def _layer_linear_backward(t: int, hidden: int = 3584, ffn: int = 18944):
    """The matmuls of one Qwen2.5-7B layer's linear backward for a chunk of ``t`` tokens (4 x params x t FLOPs),
    as seven (t x hidden) @ (hidden x ffn) products."""
    a = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, ffn, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(t, ffn, device="cuda", dtype=torch.bfloat16)

    def run():
        for _ in range(7):
            torch.mm(a, w, out=out)

    return run


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
    # Candidate (BLOCK_M, BLOCK_N, warps, stages) of each kernel; sparse_attention.default_tiles holds the pick.
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3)],
    "dq": [(128, 64, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 8, 3), (128, 64, 8, 3), (128, 32, 4, 3)],
    "dkdv": [(32, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
}


def sweep(store, q, k, v, do, sel, past: int, scale: float, pairs: float) -> None:
    """Print the time and rate of each candidate tile shape (docs/benchmarks.md, "The measurement scripts")."""
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--past", type=int, default=131072)
    add_budget_pages(parser)
    add_chunk(parser)
    add_grad_dtype(parser)
    parser.add_argument("--layers", type=int, default=4, help="layers of gradient pages in the host comparison")
    parser.add_argument("--host-layers", type=int, default=None,
                        help="of those, layers whose gradient pages live on the host, spread as in a step "
                             "(default: all)")
    parser.add_argument("--add-launch", default=None,
                        help="launches of the kernel adding the staged gradients into host pages, comma list of "
                             "PROGRAMSxROWSxWARPS (default: kernels.host_pages.ADD_LAUNCH)")
    parser.add_argument("--sweep", action="store_true", help="also time candidate tile shapes")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    grad_dtype = getattr(torch, args.grad_dtype)
    from ..kernels import chunk_attention as dense
    from ..kernels import host_pages
    from ..kernels import sparse_attention as sparse

    torch.manual_seed(0)
    store, q, k, v, do = _problem(args.past, args.chunk, grad_dtype=grad_dtype)
    sel = _selection(args.past, args.chunk, args.budget_pages)
    scale = 128**-0.5
    out, lse = sparse.attention_forward(q, k, v, store, args.past, scale, sel)
    s_fwd = _timed(lambda: sparse.attention_forward(q, k, v, store, args.past, scale, sel))
    s_bwd = _timed(lambda: sparse.attention_backward(do, q, k, v, out, lse, store, args.past, scale, sel))
    linear = _layer_linear_backward(args.chunk)
    lin = _timed(linear)
    launches = ([host_pages.AddLaunch.parse(x) for x in args.add_launch.split(",")] if args.add_launch
                else [host_pages.ADD_LAUNCH])
    layer_ms = {}
    n_host = args.layers if args.host_layers is None else args.host_layers
    if not 1 <= n_host <= args.layers:
        parser.error(f"--host-layers must be in [1, --layers={args.layers}], got {n_host}")
    for host_grads in (False, True):
        stores = _stores(args.past, args.chunk, grad_dtype=grad_dtype, layers=args.layers,
                         host_layers=n_host if host_grads else 0)

        def backward_only(stores=stores):
            for s in stores:
                sparse.attention_backward(do, q, k, v, out, lse, s, args.past, scale, sel)

        def layers(stores=stores):
            for s in stores:
                sparse.attention_backward(do, q, k, v, out, lse, s, args.past, scale, sel)
                linear()

        for launch in launches if host_grads else [None]:
            with host_pages.side_launches(launch or host_pages.ADD_LAUNCH, host_pages.GATHER_AHEAD_PROGRAMS):
                layer_ms[launch] = (_timed(backward_only, 3) / args.layers, _timed(layers, 3) / args.layers)
        del stores
    dense_past = args.budget_pages * 128
    dstore, dq, dk, dv, ddo = _problem(dense_past, args.chunk)
    dout, dlse = dense.attention_forward(dq, dk, dv, dstore, dense_past, scale)
    d_fwd = _timed(lambda: dense.attention_forward(dq, dk, dv, dstore, dense_past, scale))
    d_bwd = _timed(lambda: dense.attention_backward(ddo, dq, dk, dv, dout, dlse, dstore, dense_past, scale))
    pairs = args.chunk * (dense_past + args.chunk / 2) * 28
    tflops = lambda ms, work: work / ms / 1e9  # noqa: E731
    print(f"chunk {args.chunk}, sparse past {args.past:,} tokens with {args.budget_pages} pages per tile; "
          f"dense past {dense_past:,}")
    print(f"sparse forward {s_fwd:.2f} ms ({tflops(s_fwd, 4 * 128 * pairs):.0f} TFLOP/s), "
          f"backward {s_bwd:.2f} ms ({tflops(s_bwd, 10 * 128 * pairs):.0f} TFLOP/s at 2.5x forward work)")
    print(f"dense  forward {d_fwd:.2f} ms ({tflops(d_fwd, 4 * 128 * pairs):.0f} TFLOP/s), "
          f"backward {d_bwd:.2f} ms ({tflops(d_bwd, 10 * 128 * pairs):.0f} TFLOP/s)")
    print(f"sparse / dense: forward {s_fwd / d_fwd:.2f}, backward {s_bwd / d_bwd:.2f}")
    g_bwd, g_layer = layer_ms[None]
    print(f"{args.grad_dtype} KV-gradient pages of {args.layers} layers on the GPU: sparse backwards back to back "
          f"{g_bwd:.2f} ms per layer; one layer = sparse backward + its linear backward ({lin:.2f} ms of matmuls) "
          f"{g_layer:.2f} ms")
    per_host = args.layers / n_host  # the differences are per layer of the mix: per host layer, scaled
    for launch in launches:
        h_bwd, h_layer = layer_ms[launch]
        print(f"... {n_host} of them in pinned host memory, adding with {launch.programs} programs x "
              f"{launch.block_rows} rows x {launch.num_warps} warps: back to back {h_bwd:.2f} ms per layer; "
              f"one layer {h_layer:.2f} ms ({(h_layer - g_layer) * per_host:+.2f} ms per host layer and chunk)")
    if args.sweep:
        sweep(store, q, k, v, do, sel, args.past, scale, pairs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
