"""Chunk-attention kernels against SDPA's flash backend (or cuDNN's) on a CUDA GPU.

    python -m lightning_oomb.bench.kernels [--out kernels.csv] [--sweep | --chunk-sweep] [--sdpa-backend cudnn]

Qwen2.5-7B's attention heads in bf16: a chunk of 4096 queries over a paged past of 0 to 512K tokens, forward
and backward timed apart, next to SDPA on a causal sequence of the same total length; every size is first
checked against the reference (docs/benchmarks.md, "The measurement scripts", says what TFLOP/s count).
"""

from __future__ import annotations

import argparse
import csv
import math
import time

import torch

from ..cli_flags import add_chunk
from ..core import reference_attention as ref
from ..core.pages import PagePool
from ..kernels import chunk_attention as tri
from ..kernels.page_table import LayerStore, StoreSpec

H_Q, H_KV, D = 28, 4, 128
PAGE = 128
DTYPE = torch.bfloat16
DEVICE = "cuda"  # the module's functions also run on "cpu" under TRITON_INTERPRET=1 (a smoke test only)


def make_store(past: int, t: int, seed: int = 0) -> tuple[PagePool, LayerStore]:
    """A one-layer pool of exactly the pages for past + t tokens, random K/V, slots in random order."""
    torch.manual_seed(seed)
    spec = StoreSpec(n_layers=1, n_kv_heads=H_KV, head_dim=D, dtype=DTYPE)
    n_pages = -(-(past + t) // PAGE)
    pool = PagePool(spec, num_pages=n_pages, page_size=PAGE, device=DEVICE)
    table = pool.allocate(1, past + t)
    table.slots = torch.randperm(n_pages, device=DEVICE).view(1, n_pages).int()
    pool.k.normal_()
    pool.v.normal_()
    return pool, pool.layer(0, table)


def chunk_inputs(t: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    q = torch.randn(1, H_Q, t, D, device=DEVICE, dtype=DTYPE)
    k = torch.randn(1, H_KV, t, D, device=DEVICE, dtype=DTYPE)
    v = torch.randn(1, H_KV, t, D, device=DEVICE, dtype=DTYPE)
    dout = torch.randn(1, H_Q, t, D, device=DEVICE, dtype=DTYPE)
    return q, k, v, dout


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(past: int, tiles: tri.KernelTiles, t: int = 256) -> dict[str, float]:
    """Kernel vs reference (fp32 math on the same bf16 values) for t queries after the full past."""
    pool, store = make_store(past, t)
    q, k, v, dout = chunk_inputs(t)
    scale = D**-0.5
    before = pool.dk.clone(), pool.dv.clone()
    results = []
    for fwd, bwd in (
        (lambda *a: tri._forward(*a, tiles.fwd), lambda *a: tri._backward(*a, tiles)),
        (ref.attention_forward, ref.attention_backward),
    ):
        pool.dk.copy_(before[0])
        pool.dv.copy_(before[1])
        out, lse = fwd(q, k, v, store, past, scale)
        dq, dk, dv = bwd(dout, q, k, v, out, lse, store, past, scale)
        results.append((out, lse, dq, dk, dv, *store.read(0, past, grads=True)))
    names = ["out", "lse", "dq", "dk", "dv", "store_dk", "store_dv"]
    errs = {n: rel(a, b) for n, a, b in zip(names, *results) if b.numel()}
    # For scale: the relative error of rounding normal fp32 values to bf16 once.
    x = torch.randn(1 << 20, device=DEVICE)
    errs["bf16_rounding"] = rel(x.bfloat16(), x)
    return errs


def timed(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of fn(). One timed call when a single call takes over a second."""
    import triton.testing

    if DEVICE == "cpu":
        c0 = time.perf_counter()
        fn()
        return (time.perf_counter() - c0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()  # compiles what it has not yet
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    first = start.elapsed_time(end)
    if first > 1000:
        return first
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def kernel_flops(past: int, t: int) -> float:
    return 4.0 * D * H_Q * (t * past + t * (t + 1) / 2)


def sdpa_flops(length: int) -> float:
    return 4.0 * D * H_Q * length * (length + 1) / 2


def time_kernels(past: int, t: int, tiles: tri.KernelTiles) -> tuple[float, float]:
    pool, store = make_store(past, t)
    q, k, v, dout = chunk_inputs(t)
    scale = D**-0.5
    out, lse = tri._forward(q, k, v, store, past, scale, tiles.fwd)
    fwd = timed(lambda: tri._forward(q, k, v, store, past, scale, tiles.fwd))
    bwd = timed(lambda: tri._backward(dout, q, k, v, out, lse, store, past, scale, tiles))
    if DEVICE == "cuda":  # where the backward's time goes, per kernel
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            tri._backward(dout, q, k, v, out, lse, store, past, scale, tiles)
            torch.cuda.synchronize()
        parts = [(e.key, e.device_time_total / 1e3) for e in prof.key_averages() if e.device_time_total > 0]
        print(f"  past {past}: backward kernels (ms): " + ", ".join(f"{k[:40]} {ms:.2f}" for k, ms in parts), flush=True)
    del pool, store
    return fwd, bwd


SDPA_BACKENDS = ("flash", "cudnn")


def time_sdpa(length: int, repeat_kv: bool = False, backend: str = "flash") -> tuple[float, float, str]:
    """SDPA's (forward ms, backward ms, how K/V were given) on a causal sequence of ``length`` tokens, with its
    ``backend``: "flash" (FlashAttention 2) or "cudnn" (cuDNN's fused attention)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    torch.manual_seed(2)
    q = torch.randn(1, H_Q, length, D, device=DEVICE, dtype=DTYPE, requires_grad=True)
    k = torch.randn(1, H_KV, length, D, device=DEVICE, dtype=DTYPE, requires_grad=True)
    v = torch.randn(1, H_KV, length, D, device=DEVICE, dtype=DTYPE, requires_grad=True)
    dout = torch.randn(1, H_Q, length, D, device=DEVICE, dtype=DTYPE)
    with sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]):
        try:
            if repeat_kv:
                raise RuntimeError("K/V repeated to H_q heads on request")
            with torch.no_grad():
                sdpa(q[:, :, :128], k[:, :, :128], v[:, :, :128], is_causal=True, enable_gqa=True)
            mode = "enable_gqa"

            def run(grad: bool):
                with torch.set_grad_enabled(grad):
                    return sdpa(q, k, v, is_causal=True, enable_gqa=True)
        except RuntimeError:  # a backend without GQA support: repeat K/V (its cost is not timed)
            mode = "repeat_kv"
            kr = k.detach().repeat_interleave(H_Q // H_KV, 1).requires_grad_()
            vr = v.detach().repeat_interleave(H_Q // H_KV, 1).requires_grad_()

            def run(grad: bool):
                with torch.set_grad_enabled(grad):
                    return sdpa(q, kr, vr, is_causal=True)

        fwd = timed(lambda: run(False))
        out = run(True)
        inputs = (q, k, v) if mode == "enable_gqa" else (q, kr, vr)
        bwd = timed(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True))
    return fwd, bwd, mode


def sweep(t: int) -> tri.KernelTiles:
    """Try a few tile shapes per kernel (at past 32K; the dK/dV chunk split at past 0); keep the fastest."""
    base = tri.default_tiles(D, DTYPE)
    fwd_opts = [tri.Tiles(128, 128, 8, 3), tri.Tiles(128, 64, 8, 3), tri.Tiles(64, 128, 4, 3), tri.Tiles(64, 64, 4, 4)]
    # dK/dV with 64-row query tiles: the sparse page kernel's sweep chose them at a 1M past. 128 query rows
    # over 64 keys (P^T dO and dS^T Q reducing over 128 rows) measured 1.5-1.9x slower on the H200.
    dkdv_opts = [tri.Tiles(32, 128, 8, 3), tri.Tiles(32, 128, 8, 4), tri.Tiles(64, 128, 8, 2), tri.Tiles(64, 128, 8, 3),
                 tri.Tiles(64, 64, 4, 3), tri.Tiles(128, 64, 8, 3), tri.Tiles(128, 64, 4, 2)]
    dq_opts = [tri.Tiles(128, 64, 8, 2), tri.Tiles(128, 64, 8, 3), tri.Tiles(128, 128, 8, 2)]
    past = 32768
    pool, store = make_store(past, t)
    q, k, v, dout = chunk_inputs(t)
    scale = D**-0.5
    out, lse = tri._forward(q, k, v, store, past, scale, base.fwd)

    def best(label, opts, make, run):
        scores = []
        for o in opts:
            try:
                c0 = time.time()
                cfg = make(o)
                run(cfg)  # compile
                c1 = time.time()
                ms = timed(lambda: run(cfg), warmup_ms=10, rep_ms=50)
                print(f"  sweep {label} {o}: {ms:.3f} ms (compile {c1 - c0:.1f} s)", flush=True)
                scores.append((ms, o))
            except Exception as e:  # out of shared memory etc.
                print(f"  sweep {label} {o}: failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return min(scores, key=lambda s: s[0])[1]

    fwd = best("fwd", fwd_opts, lambda o: o, lambda c: tri._forward(q, k, v, store, past, scale, c))
    dkdv = best("dkdv", dkdv_opts, lambda o: tri.KernelTiles(fwd, o, base.dq),
                lambda c: tri._backward(dout, q, k, v, out, lse, store, past, scale, c))
    dq = best("dq", dq_opts, lambda o: tri.KernelTiles(fwd, dkdv, o),
              lambda c: tri._backward(dout, q, k, v, out, lse, store, past, scale, c))
    del pool, store
    pool, store = make_store(0, t)
    out, lse = tri._forward(q, k, v, store, 0, scale, fwd)
    split = best("chunk_split@past0", [1, H_Q // H_KV], lambda s: tri.KernelTiles(fwd, dkdv, dq, s),
                 lambda c: tri._backward(dout, q, k, v, out, lse, store, 0, scale, c))
    chosen = tri.KernelTiles(fwd, dkdv, dq, None if split != 1 else 1)
    print(f"  sweep chose {chosen}", flush=True)
    return chosen


def chunk_sweep(t: int) -> None:
    """Time each Triton kernel over the chunk's own keys alone (causal, no past) for a few tile shapes: all a
    step on an sm_90 GPU runs in Triton once the warp-specialised kernels take the past (dense and sparse).
    TFLOP/s count the kernel's matmuls over the unmasked half: forward 2, dQ 3, dK/dV 4."""
    pool, store = make_store(0, t)
    q, k, v, dout = chunk_inputs(t)
    scale = D**-0.5
    base = tri.default_tiles(D, DTYPE)
    out, lse = tri._forward(q, k, v, store, 0, scale, base.fwd)
    delta = tri.launch_delta(out, dout)
    row_terms = tri.softmax_row_terms(lse, delta, scale)
    state = torch.empty(q.shape, dtype=torch.float32, device=DEVICE), torch.empty_like(lse)
    partial = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    per_matmul = kernel_flops(0, t) / 2
    kernels = {
        "fwd": (2, [tri.Tiles(128, 128, 8, 3), tri.Tiles(128, 64, 8, 3), tri.Tiles(128, 64, 4, 3),
                    tri.Tiles(64, 128, 4, 3), tri.Tiles(64, 64, 4, 3)],
                lambda o: tri.launch_forward(q, k, v, store, 0, 0, scale, o, True, *state, carry=False)),
        "dq": (3, [tri.Tiles(128, 128, 8, 2), tri.Tiles(128, 128, 8, 3), tri.Tiles(128, 64, 8, 2),
                   tri.Tiles(128, 64, 8, 3), tri.Tiles(128, 64, 4, 2), tri.Tiles(64, 128, 4, 2),
                   tri.Tiles(64, 128, 4, 3), tri.Tiles(64, 128, 8, 3), tri.Tiles(64, 64, 4, 3)],
               lambda o: tri.launch_dq(dout, q, k, v, lse, delta, store, 0, 0, scale, o, True, partial,
                                        accumulate=False)),
        "dkdv": (4, [tri.Tiles(64, 128, 8, 3), tri.Tiles(32, 128, 8, 3), tri.Tiles(64, 128, 4, 3),
                     tri.Tiles(64, 64, 4, 3), tri.Tiles(128, 128, 8, 2)],
                 lambda o: tri.launch_dkdv(dout, q, k, v, *row_terms, store, 0, 0, 0, scale,
                                           tri.KernelTiles(base.fwd, o, base.dq), chunk=True)),
    }
    print(f"chunk's own keys only, T={t} (defaults: {base}):", flush=True)
    for name, (matmuls, opts, run) in kernels.items():
        for o in opts:
            try:
                run(o)  # compile
                ms = timed(lambda: run(o), warmup_ms=10, rep_ms=50)
                print(f"  {name} {o}: {ms:.3f} ms, {matmuls * per_matmul / ms / 1e9:.0f} TFLOP/s", flush=True)
            except Exception as e:  # out of shared memory etc.
                print(f"  {name} {o}: failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
    del pool, store


def print_resources(*kernels) -> None:
    """Registers and local memory of every compiled variant of the given Triton kernels, as the driver
    reports them once the GPU loaded each: spills in a loop cost local-memory traffic every iteration."""
    for fn in kernels:
        for caches in getattr(fn, "device_caches", {}).values():
            for compiled in caches[0].values():  # the kernel cache comes first in every Triton 3.x release
                meta = compiled.metadata
                # Set when the GPU loaded the kernel; a candidate that failed to load has none. Triton's
                # n_spills is the driver's local memory size in bytes divided by 4.
                regs, spills = getattr(compiled, "n_regs", "?"), getattr(compiled, "n_spills", None)
                local = "?" if spills is None else 4 * spills
                print(f"  {compiled.name}: {meta.num_warps} warps, {meta.num_stages} stages, {regs} registers, "
                      f"{local} B of local memory (spills) per thread, {meta.shared} B shared", flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pasts", default="0,32768,131072,524288", help="comma-separated past lengths")
    add_chunk(ap, help="queries per chunk (T)")
    ap.add_argument("--out", default=None, help="also write the table as CSV here")
    ap.add_argument("--sweep", action="store_true", help="pick tile shapes by a short sweep first")
    ap.add_argument("--chunk-sweep", action="store_true",
                    help="only time each kernel over the chunk's own keys for a few tile shapes, then stop")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the SDPA baseline")
    ap.add_argument("--sdpa-repeat-kv", action="store_true",
                    help="time SDPA on K/V repeated to all query heads (multi-head) instead of enable_gqa")
    ap.add_argument("--sdpa-backend", choices=SDPA_BACKENDS, default="flash",
                    help="SDPA's backend for the baseline: flash (FlashAttention 2, default) or cudnn")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    import triton

    pasts = [int(p) for p in args.pasts.split(",")]
    t = args.chunk
    print(f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else DEVICE} | torch {torch.__version__} | triton {triton.__version__}", flush=True)
    if args.chunk_sweep:
        chunk_sweep(t)
        print_resources(tri._fwd_kernel, tri._dq_kernel, tri._dkdv_kernel)
        return
    tiles = sweep(t) if args.sweep else tri.default_tiles(D, DTYPE)
    print(f"tiles: {tiles}", flush=True)

    print("correctness (relative norm error vs fp32 reference on the same bf16 values, T=256 after the full past):")
    for past in pasts:
        errs = check(past, tiles)
        print(f"  past {past:>7}: " + " ".join(f"{k}={v:.1e}" for k, v in errs.items()), flush=True)
        torch.cuda.empty_cache()

    rows = []
    for past in pasts:
        fwd, bwd = time_kernels(past, t, tiles)
        torch.cuda.empty_cache()
        f = kernel_flops(past, t)
        row = {"past": past, "T": t, "fwd_ms": fwd, "bwd_ms": bwd,
               "fwd_tflops": f / fwd / 1e9, "bwd_tflops": 2.5 * f / bwd / 1e9}
        if not args.no_sdpa:
            length = past + t
            sf, sb, mode = time_sdpa(length, args.sdpa_repeat_kv, args.sdpa_backend)
            torch.cuda.empty_cache()
            s = sdpa_flops(length)
            row.update({"sdpa_fwd_ms": sf, "sdpa_bwd_ms": sb, "sdpa_fwd_tflops": s / sf / 1e9,
                        "sdpa_bwd_tflops": 2.5 * s / sb / 1e9, "sdpa_mode": f"{args.sdpa_backend} {mode}"})
            row["fwd_ratio"] = row["fwd_tflops"] / row["sdpa_fwd_tflops"]
            row["bwd_ratio"] = row["bwd_tflops"] / row["sdpa_bwd_tflops"]
        print("  " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
        rows.append(row)

    print("compiled kernels (the sweep's candidates too):")
    print_resources(tri._fwd_kernel, tri._dq_kernel, tri._dkdv_kernel)
    print()
    print("| past | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | SDPA fwd TFLOP/s | SDPA bwd TFLOP/s | fwd ratio | bwd ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        get = lambda key, fmt: (fmt.format(r[key]) if key in r and not math.isnan(r[key]) else "-")  # noqa: E731
        print(f"| {r['past']} | {r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} | {r['bwd_ms']:.2f} | {r['bwd_tflops']:.0f} | "
              f"{get('sdpa_fwd_tflops', '{:.0f}')} | {get('sdpa_bwd_tflops', '{:.0f}')} | "
              f"{get('fwd_ratio', '{:.2f}')} | {get('bwd_ratio', '{:.2f}')} |")
    if args.out:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
