"""Prefill and decoding speed of ``lightning_oomb.generate`` against the plan, and against transformers' own
cached greedy decoding where it fits.

Random weights of a built-in shape (or a config.json), bf16 on the GPU (float32 on the CPU), a random prompt of
each length: ``generate`` prefills it chunk by chunk into the K/V pages (dense, or sparse with
``--budget-pages``) and decodes ``--new-tokens`` tokens. Prefill: from the call to the first new token (page
allocation included); decoding: the median seconds between later tokens. Before the first timed point each mode
(and transformers) runs once on a prompt of two chunks, so that no timed point carries the kernels' compilation
and autotuning. With ``--transformers`` the same
prompt through the model itself (one forward with ``use_cache``, then a token at a time over its cache), and
how many of its greedy tokens equal the engine's; a length it cannot hold is recorded as out of memory.

    python -m lightning_oomb.bench.generate_speed --model qwen2.5-7b --lengths 128K,1M --new-tokens 16 \\
        [--modes dense,sparse] [--budget-pages 64] [--transformers] --out DIR

Writes DIR/results.csv and DIR/results.md (machine, date, command, table).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import inspect
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from ..cli_flags import OneLineParser, add_budget_pages, add_chunk, add_offload, add_page_size
from ..core.units import human_tokens, parse_tokens
from .measure import sync

MODES = ("dense", "sparse")


@dataclass
class SpeedResult:
    """One (runner, mode, length) point; times in seconds, blank where not measured."""

    runner: str  # lightning_oomb or transformers
    mode: str
    context: int
    new_tokens: int
    status: str = "ok"
    prefill_s: float = math.nan
    decode_s_per_token: float = math.nan
    planned_prefill_s: float = math.nan
    planned_decode_s_per_token: float = math.nan
    peak_gpu_gib: float = math.nan
    same_tokens: str = ""  # transformers: how many of its greedy tokens equal the engine's, "k/n"


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan


def timed_generate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int,
                   **options) -> tuple[float, float, torch.Tensor]:
    """(prefill seconds, median seconds per later token, the new tokens (B, n)) of ``lightning_oomb.generate``."""
    from ..evaluation.generate import generate

    marks: list[float] = []

    def mark(tokens: torch.Tensor) -> bool:  # called after each new token: the clock, never a stop
        sync(ids.device)
        marks.append(time.perf_counter())
        return False

    started = time.perf_counter()
    out = generate(model, ids, max_new_tokens=new_tokens, eos_token_id=[], stop=mark, **options)
    steps = [b - a for a, b in zip(marks, marks[1:])]
    return marks[0] - started, statistics.median(steps) if steps else math.nan, out[:, ids.shape[1]:]


@torch.no_grad()
def timed_transformers(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> tuple[float, float, torch.Tensor]:
    """The same through the model itself: one forward over the prompt with its cache, then a token at a time."""
    device = ids.device
    # transformers renamed past_key_values to cache (argument and output field); both are served.
    cache = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    started = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    prefill = time.perf_counter() - started
    chosen, steps = [token], []
    for _ in range(new_tokens - 1):
        started = time.perf_counter()
        out = model(input_ids=token, use_cache=True, **{cache: getattr(out, cache)})
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        chosen.append(token)
        sync(device)
        steps.append(time.perf_counter() - started)
    return prefill, statistics.median(steps) if steps else math.nan, torch.cat(chosen, dim=1)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m lightning_oomb.bench.generate_speed",
                           description="Prefill and decoding speed of lightning_oomb.generate against the plan")
    parser.add_argument("--model", required=True, help="a built-in shape (qwen2.5-7b, ...) or a config.json")
    parser.add_argument("--lengths", required=True, help="prompt lengths, e.g. 128K,1M")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens decoded after each prompt (>= 2)")
    parser.add_argument("--modes", default="dense", help=f"any of {', '.join(MODES)} (sparse: --budget-pages)")
    parser.add_argument("--transformers", action="store_true",
                        help="also transformers' own cached greedy decoding of the same prompts")
    add_chunk(parser)
    add_page_size(parser)
    add_offload(parser)
    add_budget_pages(parser, default=64, help="past pages per query tile in the sparse mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        lengths = sorted({parse_tokens(x) for x in args.lengths.split(",") if x.strip()})
    except ValueError as e:
        parser.error(f"--lengths: {e}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        parser.error(f"--modes: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODES)}")
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be >= 2 (the decoding time is between tokens), got {args.new_tokens}")

    from ..core.config import SparseConfig
    from ..core.errors import SetupError
    from ..core.model_shape import ModelShape
    from ..core.plan.timing import generation_time
    from .config import BenchConfig
    from .sweep import build_model

    try:
        sparse_config = SparseConfig(budget_pages=args.budget_pages) if "sparse" in modes else None
        shape = ModelShape.resolve(args.model)
    except (SetupError, ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(BenchConfig(model=args.model, seed=args.seed), device, dtype).eval()
    # Random weights have no trained length: let generate reach the longest prompt plus its new tokens (the
    # default RoPE does not read this field, so the timed work is the same).
    reach = lengths[-1] + args.new_tokens
    model.config.max_position_embeddings = max(getattr(model.config, "max_position_embeddings", 0) or 0, reach)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    generator = torch.Generator().manual_seed(args.seed)
    results: list[SpeedResult] = []
    # One untimed run of each mode on a prompt of two chunks and a short past (Triton compiles and autotunes its
    # kernels at their first launch; Inductor the fused ops at theirs).
    warm = torch.randint(0, shape.vocab, (1, min(2 * args.chunk, lengths[0])), generator=generator).to(device)
    for mode in modes:
        timed_generate(model, warm, 2, chunk_size=args.chunk, page_size=args.page_size, offload=args.offload,
                       sparse=sparse_config if mode == "sparse" else None)
    if args.transformers:
        timed_transformers(model, warm, 2)
    for n in lengths:
        ids = torch.randint(0, shape.vocab, (1, n), generator=generator).to(device)
        ours: dict[str, torch.Tensor] = {}
        for mode in modes:
            sparse = sparse_config if mode == "sparse" else None
            plan = generation_time(shape, n, args.chunk, args.page_size, sparse, 1, dtype_bytes)
            r = SpeedResult("lightning_oomb", mode, n, args.new_tokens, planned_prefill_s=plan.prefill_s,
                            planned_decode_s_per_token=plan.decode_s)
            _reset_peak(device)
            try:
                r.prefill_s, r.decode_s_per_token, ours[mode] = timed_generate(
                    model, ids, args.new_tokens, chunk_size=args.chunk, page_size=args.page_size,
                    offload=args.offload, sparse=sparse)
            except torch.OutOfMemoryError:
                r.status = "out of memory"
            r.peak_gpu_gib = _peak_gib(device)
            results.append(r)
            print(_line(r), flush=True)
        if args.transformers:
            r = SpeedResult("transformers", "dense", n, args.new_tokens)
            _reset_peak(device)
            try:
                r.prefill_s, r.decode_s_per_token, theirs = timed_transformers(model, ids, args.new_tokens)
                if "dense" in ours:
                    same = int((theirs == ours["dense"]).all(dim=0).sum())
                    r.same_tokens = f"{same}/{args.new_tokens}"
            except torch.OutOfMemoryError:
                r.status = "out of memory"
            r.peak_gpu_gib = _peak_gib(device)
            results.append(r)
            print(_line(r), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m lightning_oomb.bench.generate_speed", *(argv or sys.argv[1:])])
    write_results(results, out, device, command)
    print(f"wrote {out / 'results.csv'} and {out / 'results.md'}")
    return 0


def _cell(x: object) -> str:
    if isinstance(x, float):
        return "" if math.isnan(x) else f"{x:.6g}"
    return str(x)


def _line(r: SpeedResult) -> str:
    if r.status != "ok":
        return f"{r.runner:<15} {r.mode:<6} {human_tokens(r.context):>6}: {r.status}"
    planned = (f" (plan {r.planned_prefill_s:.3g} s, {r.planned_decode_s_per_token * 1e3:.3g} ms)"
               if not math.isnan(r.planned_prefill_s) else "")
    return (f"{r.runner:<15} {r.mode:<6} {human_tokens(r.context):>6}: prefill {r.prefill_s:.3g} s, "
            f"{r.decode_s_per_token * 1e3:.3g} ms a new token{planned}"
            + (f", GPU peak {r.peak_gpu_gib:.2f} GiB" if not math.isnan(r.peak_gpu_gib) else "")
            + (f", {r.same_tokens} tokens as the engine's" if r.same_tokens else ""))


def write_results(results: list[SpeedResult], out: Path, device: torch.device, command: str) -> None:
    """results.csv (one row a point) and results.md (machine, date, command, the table)."""
    names = [f.name for f in fields(SpeedResult)]
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(names)
        writer.writerows([_cell(v) for v in asdict(r).values()] for r in results)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    rows = ["| runner | mode | context | status | prefill s (plan) | ms a new token (plan) | GPU peak GiB "
            "| same tokens |", "|---|---|---:|---|---:|---:|---:|---|"]
    for r in results:
        plan_p = f" ({r.planned_prefill_s:.3g})" if not math.isnan(r.planned_prefill_s) else ""
        planned_ms = r.planned_decode_s_per_token * 1e3
        plan_d = f" ({planned_ms:.3g})" if not math.isnan(planned_ms) else ""
        rows.append(f"| {r.runner} | {r.mode} | {r.context:,} | {r.status} | {_cell(r.prefill_s)}{plan_p} | "
                    f"{_cell(r.decode_s_per_token * 1e3)}{plan_d} | {_cell(r.peak_gpu_gib)} | {r.same_tokens} |")
    head = f"# generate_speed\n\n- machine: {machine}\n- date: {date}\n- command: `{command}`\n\n"
    (out / "results.md").write_text(head + "\n".join(rows) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
