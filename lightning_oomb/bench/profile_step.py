"""Where does a train_step's time go? GPU time by kernel, grouped, and the time of every chunk.

    python -m lightning_oomb.bench.profile_step --model qwen2.5-7b --context 32k [--chunk 4096] [--budget-pages 64]
        [--selection chunk] [--grad-dtype bfloat16] [--offload host] [--checkpoint-layers] [--keep-attention 0]

Each report also gives every stream's busy time and how much of the side streams' ran behind the compute.
--offload host keeps a sparse step's pages in host memory, --keep-attention 0 recomputes every chunk's
attention in stage 2 (as a 1M-token step must), --chunks A:B profiles chunk ranges of one step and prints
its chunk timeline (docs/benchmarks.md, "The measurement scripts").
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from .. import train_step
from ..cli_flags import (
    add_budget_pages, add_chunk, add_grad_dtype, add_offload, add_selection, per_query_tile,
)
from ..core.config import ChunkConfig, SparseConfig
from ..core.model_shape import ModelShape
from ..core.schedule import ChunkedSequence
from ..core.units import parse_tokens
from .config import BenchConfig
from .modes import packed_position_ids
from .sweep import build_model

# Our kernels by exact name (dense, sparse and Hopper Gluon kernels of each direction); cuBLAS by substring.
KERNEL_GROUPS = {
    "attention forward": ("_fwd_kernel", "_sparse_fwd_kernel", "_past_forward_kernel"),
    "attention dK/dV": ("_dkdv_kernel", "_page_dkdv_kernel", "_past_dkdv_kernel"),
    "attention dQ": ("_dq_kernel", "_sparse_dq_kernel", "_past_dq_kernel"),
    "host gradient pages (side stream)": (
        "_add_staged_kernel", "_read_rows_kernel", "_copy_pages_kernel",
    ),
}
MATMUL_KEYS = ("gemm", "sm90_xmma", "cutlass", "nvjet", "gemv")


def _group(name: str) -> str:
    for group, kernels in KERNEL_GROUPS.items():
        if name in kernels:
            return group
    if any(k in name.lower() for k in MATMUL_KEYS):
        return "matmul (cuBLAS)"
    return "other"


def parse_chunk_ranges(text: str, n_chunks: int) -> list[tuple[int, int]]:
    """"A:B,C:D" -> [(A, B), (C, D)]: chunk ranges [A, B) of a step of ``n_chunks`` chunks, not overlapping."""
    ranges = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            first, end = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"a chunk range is FIRST:END (chunk indices, END excluded), got {part!r}") from None
        if not 0 <= first < end <= n_chunks:
            raise ValueError(f"chunk range {part!r} must satisfy 0 <= FIRST < END <= {n_chunks} (chunks of the step)")
        ranges.append((first, end))
    ranges.sort()
    for (_, end), (first, _) in zip(ranges, ranges[1:]):
        if first < end:
            raise ValueError(f"chunk ranges overlap: {text!r}")
    return ranges


def chunk_seconds(marks: list[tuple[int, int]], elapsed_ms: list[float]) -> dict[tuple[int, int], float]:
    """{(stage, chunk): seconds} from the (stage, chunk) marks in step order and the milliseconds from the
    step's start to each mark: a chunk's time runs from the mark before it to its own."""
    seconds, before = {}, 0.0
    for mark, ms in zip(marks, elapsed_ms):
        seconds[mark] = (ms - before) / 1e3
        before = ms
    return seconds


def timeline_lines(seconds: dict[tuple[int, int], float], n_chunks: int, bin_chunks: int) -> list[str]:
    """Per stage, the total and the mean seconds per chunk of every ``bin_chunks`` chunks (stage 2 listed in
    its order: last chunk first)."""
    lines = []
    for stage in (1, 2):
        order = range(n_chunks) if stage == 1 else reversed(range(n_chunks))
        times = [(c, seconds[(stage, c)]) for c in order]
        lines.append(f"stage {stage}: {sum(t for _, t in times):.2f} s")
        for i in range(0, len(times), bin_chunks):
            part = times[i : i + bin_chunks]
            ms = [1e3 * t for _, t in part]
            lines.append(f"  chunks {part[0][0]:>4}..{part[-1][0]:<4} {sum(ms) / len(ms):8.1f} ms per chunk "
                         f"(min {min(ms):.1f}, max {max(ms):.1f})")
    return lines


class ProfiledStep:
    """The observer of one step: marks every chunk's end with a CUDA event and runs one profiler per stage of
    each chunk range [first, end): stage 1 from the end of chunk first - 1 to that of end - 1, stage 2 from
    the end of chunk ``end`` (or of stage 1) to that of ``first``."""

    def __init__(self, ranges: list[tuple[int, int]], n_chunks: int, activities, record_shapes: bool):
        self.marks: list[tuple[int, int]] = []
        self.events: list[torch.cuda.Event] = []
        self.start = torch.cuda.Event(enable_timing=True)
        self.opens: dict[tuple[int, int], tuple[int, int, int]] = {}  # mark -> (stage, first, end) opening
        self.closes: dict[tuple[int, int], tuple[int, int, int]] = {}
        for first, end in ranges:
            self.opens[(1, first - 1) if first else (0, 0)] = (1, first, end)
            self.closes[(1, end - 1)] = (1, first, end)
            self.opens[(2, end) if end < n_chunks else (1, n_chunks - 1)] = (2, first, end)
            self.closes[(2, first)] = (2, first, end)
        self.profiles = {key: profile(activities=activities, record_shapes=record_shapes) for key in self.closes.values()}
        self.walls: dict[tuple[int, int, int], float] = {}
        self._opened: dict[tuple[int, int, int], float] = {}

    def begin(self) -> None:
        torch.cuda.synchronize()
        self.start.record()
        self._boundary((0, 0))

    def __call__(self, stage: int, index: int, start: int, end: int) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.marks.append((stage, index))
        self.events.append(event)
        self._boundary((stage, index))

    def _boundary(self, mark: tuple[int, int]) -> None:
        if mark in self.closes:
            key = self.closes[mark]
            torch.cuda.synchronize()
            self.walls[key] = time.perf_counter() - self._opened.pop(key)
            self.profiles[key].stop()
        if mark in self.opens:  # after the close: one range's stage-1 end is the next range's start
            key = self.opens[mark]
            torch.cuda.synchronize()
            self.profiles[key].start()
            self._opened[key] = time.perf_counter()

    def seconds(self) -> dict[tuple[int, int], float]:
        torch.cuda.synchronize()
        return chunk_seconds(self.marks, [self.start.elapsed_time(e) for e in self.events])


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals, as sorted disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def stream_overlap(activity: list[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
    """(stream, busy, busy while the compute stream was busy) per stream, compute stream first, from
    (stream, start, end) of every kernel and copy on the GPU (any time unit). The compute stream is the one
    busy longest; a side stream's work that overlaps it is hidden behind the compute."""
    by_stream: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for stream, start, end in activity:
        by_stream[stream].append((start, end))
    busy = {stream: merged(spans) for stream, spans in by_stream.items()}
    length = {stream: sum(b - a for a, b in spans) for stream, spans in busy.items()}
    compute = max(length, key=length.get)
    rows = [(compute, length[compute], length[compute])]
    for stream in sorted(s for s in busy if s != compute):
        rows.append((stream, length[stream], overlap(busy[stream], busy[compute])))
    return rows


GAP_BUCKETS_US = (20, 100, 1000, 10000)


def idle_gaps(spans: list[tuple[float, float, str]]) -> list[tuple[float, str, str]]:
    """(length, name before, name after) of every idle gap between the consecutive (start, end, name) spans of
    one stream, longest first (the spans' time unit)."""
    spans = sorted(spans)
    gaps, reach, last = [], None, ""
    for start, end, name in spans:
        if reach is not None and start > reach:
            gaps.append((start - reach, last, name))
        if reach is None or end >= reach:
            reach, last = end, name
    return sorted(gaps, key=lambda g: -g[0])


def gap_causes(
    kernels: list[tuple[float, float, int]], launched: dict[int, float], host: list[tuple[float, float, str]],
    min_gap: float,
) -> tuple[float, float, float, dict[str, float]]:
    """Who made one stream's gaps of at least ``min_gap``: (host, device, unknown, host_ops). ``kernels`` are
    the stream's (start, end, correlation id), ``launched`` each correlation id's launch call's end on the host,
    ``host`` the host's (start, end, name) spans (runtime calls, ops). A gap's part before the next kernel's
    launch returned is the host's (the GPU had nothing queued), the rest the device's (queued work waited:
    for another stream, an event); ``host_ops`` the host spans overlapping the host's parts, by name."""
    by_host = defaultdict(float)
    host_s = device_s = unknown_s = 0.0
    spans = sorted(host)
    reach = None
    for start, end, corr in sorted(kernels):
        if reach is not None and start - reach >= min_gap:
            launch = launched.get(corr)
            if launch is None:
                unknown_s += start - reach
            else:
                late = min(max(launch - reach, 0.0), start - reach)
                host_s += late
                device_s += start - reach - late
                for a, b, name in spans:
                    if a >= reach + late:
                        break
                    by_host[name] += max(0.0, min(b, reach + late) - max(a, reach))
        reach = end if reach is None else max(reach, end)
    return host_s, device_s, unknown_s, dict(by_host)


def _gap_lines(gaps: list[tuple[float, str, str]], largest: int) -> list[str]:
    edges = (0, *GAP_BUCKETS_US, float("inf"))
    lines = []
    for lo, hi in zip(edges, edges[1:]):
        part = [g for g, _, _ in gaps if lo <= g < hi]
        if part:
            label = f">= {lo} us" if hi == float("inf") else f"{lo}-{hi} us"
            lines.append(f"    gaps {label:<12} {len(part):>7} x, {sum(part) / 1e6:8.3f} s")
    for gap, before, after in gaps[:largest]:
        lines.append(f"    {gap / 1e3:8.2f} ms after {before[:45]:<45} before {after[:45]}")
    return lines


def _print_gap_causes(prof, compute_stream: int) -> None:
    # From the raw events: kernels and their launch calls share a correlation id (absent without the host side).
    events = prof.profiler.kineto_results.events()
    kernels = [(e.start_ns(), e.end_ns(), e.correlation_id()) for e in events
               if e.device_type().name == "CUDA" and e.device_resource_id() == compute_stream]
    launched = {e.correlation_id(): e.end_ns() for e in events
                if e.device_type().name == "CPU" and e.name().startswith(("cudaLaunch", "cuLaunch", "cudaMemcpy",
                                                                         "cudaMemset"))}
    if not launched:
        return
    host = [(e.start_ns(), e.end_ns(), e.name()) for e in events if e.device_type().name == "CPU"]
    host_s, device_s, unknown_s, ops = gap_causes(kernels, launched, host, min_gap=GAP_BUCKETS_US[0] * 1e3)
    print(f"    gaps >= {GAP_BUCKETS_US[0]} us: {host_s / 1e9:.3f} s the host's (its next kernel not yet launched), "
          f"{device_s / 1e9:.3f} s queued work waiting, {unknown_s / 1e9:.3f} s unmatched; the host meanwhile:")
    for name, ns in sorted(ops.items(), key=lambda kv: -kv[1])[:12]:
        print(f"      {ns / 1e9:8.3f} s  {name[:80]}")


def report(prof, wall: float, title: str, top: int, ops: int) -> None:
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    gpu_total = sum(e.device_time_total for e in kernels) / 1e6
    groups: dict[str, float] = defaultdict(float)
    for e in kernels:
        groups[_group(e.key)] += e.device_time_total / 1e6
    print(f"\n{title}: wall {wall:.2f} s, GPU busy {gpu_total:.2f} s")
    for name, seconds in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<34} {seconds:8.3f} s  {100 * seconds / wall:5.1f}% of wall")
    print(f"top {top} kernels by GPU time:")
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[:top]:
        print(f"  {e.device_time_total / 1e6:8.3f} s  x{e.count:<6} {e.key[:100]}")
    activity = [(e.device_resource_id, e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]
    if activity:
        rows = stream_overlap([a[:3] for a in activity])
        gaps = idle_gaps([a[1:] for a in activity if a[0] == rows[0][0]])
        print("streams (busy; a side stream's share of it while the compute stream was busy):")
        print(f"  compute stream {rows[0][0]:<4} {rows[0][1] / 1e6:8.3f} s, idle between its first and last "
              f"kernel {sum(g for g, _, _ in gaps) / 1e6:.3f} s:")
        print("\n".join(_gap_lines(gaps, largest=8)))
        _print_gap_causes(prof, rows[0][0])
        side, hidden = sum(r[1] for r in rows[1:]), sum(r[2] for r in rows[1:])
        for stream, busy, shared in rows[1:]:
            print(f"  side stream {stream:<7} {busy / 1e6:8.3f} s, {100 * shared / busy:5.1f}% hidden")
        if side:
            print(f"  side streams       {side / 1e6:8.3f} s, {100 * hidden / side:5.1f}% hidden")
    if ops:
        # The host's calls into the CUDA runtime: a synchronising one (a host wait) idles the GPU behind it.
        calls = [e for e in prof.key_averages() if e.key.startswith("cuda") and e.device_type.name == "CPU"]
        print("top CUDA runtime calls by host time:")
        for e in sorted(calls, key=lambda e: -e.cpu_time_total)[:12]:
            print(f"  {e.cpu_time_total / 1e6:8.3f} s  x{e.count:<7} {e.key[:60]}")
        # The op that launched each kernel: which elementwise work (norm, RoPE, SiLU, copies) costs what.
        rows = [
            e for e in prof.key_averages(group_by_input_shape=True)
            if e.self_device_time_total > 0 and e.device_type.name == "CPU"
        ]
        print(f"top {ops} torch ops by GPU time (self), with input shapes:")
        for e in sorted(rows, key=lambda e: -e.self_device_time_total)[:ops]:
            print(f"  {e.self_device_time_total / 1e6:8.3f} s  x{e.count:<6} {e.key[:40]:<40} {str(e.input_shapes)[:90]}")


def _write_trace(prof, prefix: str, name: str) -> None:
    if prefix:
        path = f"{prefix}-{name}.json"
        prof.export_chrome_trace(path)
        with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path)
        print(f"trace: {path}.gz", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--context", default="32k")
    add_chunk(parser)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--ops", type=int, default=0, help="also list this many torch ops (with input shapes) by GPU time")
    add_budget_pages(parser, default=0, help="sparse attention with this many past pages per query tile; 0: dense")
    add_selection(parser)
    add_grad_dtype(parser)
    add_offload(parser)
    parser.add_argument("--checkpoint-layers", action="store_true", help="checkpoint each layer in stage 2")
    parser.add_argument("--keep-attention", type=int, default=None,
                        help="chunks whose attention outputs stage 1 keeps (default: as many as fit)")
    parser.add_argument("--keep-graphs", type=int, default=None,
                        help="chunks whose autograd graphs stage 1 keeps (default: the last, plus as many as fit)")
    parser.add_argument("--document-length", default=None, metavar="TOKENS",
                        help="pack the sequence from documents of this many tokens (position ids restarting)")
    parser.add_argument("--chunks", default="", metavar="FIRST:END,...",
                        help="profile only these chunk ranges of the step, and print its chunk timeline "
                             "(default: profile the whole step)")
    parser.add_argument("--trace", default="", metavar="PREFIX",
                        help="also write each profile as a gzipped Chrome trace, PREFIX-<profile>.json.gz, with the "
                             "host's side (each kernel's launch, the runtime calls)")
    parser.add_argument("--timeline-bin", type=int, default=16, help="with --chunks: chunks per timeline line")
    parser.add_argument("--warmup-context", default="64k", help="with --chunks: tokens of the warm-up steps")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    sparse = (SparseConfig(budget_pages=args.budget_pages, per_query_tile=per_query_tile(args.selection))
              if args.budget_pages else None)
    context = parse_tokens(args.context)
    n_chunks = -(-context // args.chunk)
    try:
        ranges = parse_chunk_ranges(args.chunks, n_chunks)
    except ValueError as error:
        parser.error(str(error))
    model = build_model(BenchConfig(model=args.model), torch.device("cuda"), torch.bfloat16)
    vocab = ModelShape.resolve(args.model).vocab
    ids = torch.randint(0, vocab, (1, context), device="cuda")
    document_length = parse_tokens(args.document_length) if args.document_length else None
    positions = packed_position_ids(ids, document_length)
    options = dict(chunk_size=args.chunk, sparse=sparse, grad_dtype=getattr(torch, args.grad_dtype),
                   offload=args.offload, checkpoint_layers=args.checkpoint_layers,
                   keep_attention=args.keep_attention, keep_graphs=args.keep_graphs)
    # The CPU side only when the ops are asked for: recording every op slows the host that feeds the GPU.
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.ops or args.trace else [])
    kind = f"sparse, budget {args.budget_pages} pages" if sparse else "dense"
    packed = f", packed from documents of {document_length:,} tokens" if document_length else ""
    print(f"{args.model}, {kind}, context {context:,}, chunk {args.chunk}{packed}", flush=True)
    if not ranges:
        train_step(model, ids, position_ids=positions, **options)
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        with profile(activities=activities, record_shapes=args.ops > 0) as prof:
            t = time.perf_counter()
            train_step(model, ids, position_ids=positions, **options)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        report(prof, wall, "the step", args.top, args.ops)
        _write_trace(prof, args.trace, "step")
        return
    warmup_ids = ids[:, : parse_tokens(args.warmup_context)]
    warmup_positions = None if positions is None else positions[:, : warmup_ids.shape[1]]
    for offload in ("gpu", "host") if sparse else ("gpu",):
        train_step(model, warmup_ids, position_ids=warmup_positions,
                   **{**options, "offload": offload, "keep_attention": 0, "keep_graphs": 0})
    model.zero_grad(set_to_none=False)
    step = ProfiledStep(ranges, n_chunks, activities, args.ops > 0)
    seq = ChunkedSequence(model, ids, position_ids=positions, config=ChunkConfig(**options), observer=step)
    t = time.perf_counter()
    try:
        step.begin()
        seq.fill()
        seq.backward()
    finally:
        seq.release()
    seconds = step.seconds()
    print(f"step: {time.perf_counter() - t:.2f} s wall (profiled chunk ranges included)")
    print("\n".join(timeline_lines(seconds, n_chunks, args.timeline_bin)), flush=True)
    for (stage, first, end), prof in step.profiles.items():
        report(prof, step.walls[(stage, first, end)], f"stage {stage}, chunks {first}..{end - 1}", args.top, args.ops)
        _write_trace(prof, args.trace, f"stage{stage}-chunks{first}-{end - 1}")


if __name__ == "__main__":
    main()
