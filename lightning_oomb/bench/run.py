"""``lightning-oomb bench``: step time and peak memory of training modes over context lengths.

    lightning-oomb bench --model qwen2.5-7b --lengths 16k,32k,64k,128k --modes baseline,oomb \\
        [--chunk 4096] [--lora 16] [--repeats 3] [--warmup 1] [--out DIR] [--attention auto] [--checkpoint-layers]
        [--document-length 32K]

One randomly initialised model of the given shape (bf16 on CUDA, float32 on CPU) is built once and every
mode runs on it at every length: warm-up steps, then ``--repeats`` timed steps (median reported). A step is
a forward and backward with gradients zeroed before it (set_to_none) and no optimizer step. Modes:
- baseline: transformers' full-sequence forward and backward, SDPA attention, gradient checkpointing
  (non-reentrant), ``model(input_ids, labels=input_ids).loss``;
- oomb: ``lightning_oomb.train_step`` (chunk-recurrent, exact gradient);
- sparse: ``train_step`` with page-level sparse attention, ``SparseConfig(budget_pages=--budget-pages)``
  (the other SparseConfig fields at their defaults). Its floor counts the sparse attention FLOPs.
Later modes join through ``register_mode``. ``--document-length D`` packs every sequence from documents of
D tokens (position ids restarting every D tokens, the last document shorter), given to the lightning_oomb
modes' ``train_step``: attention stays within each document; the floor and the plan count that attention
only. The baseline cannot take them (its SDPA attention would cross the borders): bench it at D tokens
instead. An out-of-memory point is recorded as "OOM" and the sweep goes
on. Written to --out: results.csv, results.md (machine, date, command line, table) and results.png (step
time and peak GPU memory against context length, log-log, with the FLOP floor of docs/planner.md, "Time").

The floor is the same for every dense mode (8 P_mm L + 9 n_layers d_q L^2 at --matmul-tflops, no extra layer
checkpointing recompute), so "fraction of floor" compares modes on the same useful work. For oomb rows
the planner's predicted peak (minus its CUDA context allowance, which max_memory_allocated does not see)
and predicted time are recorded next to the measurement: that is how the planner's assumptions are
calibrated (docs/planner.md).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import shlex
import sys
from pathlib import Path

from ..core.model_shape import ModelShape, load_config_dict
from ..core.planner import DEFAULT_MATMUL_TFLOPS
from ..core.units import GIB, argparse_type, parse_tokens
from ..kernels import host_pages
from .config import BenchConfig
from .modes import MODES, check_modes
from .results import CSV_COLUMNS, PointResult, float_cell
from .sweep import bench_device, machine_name, run


# == reporting ============================================================================================


def markdown_table(results: list[PointResult]) -> str:
    head = ("| mode | context | status | step time (s) | tokens/s | peak GPU (GiB) | planned GPU (GiB) "
            "| peak host (GiB) | FLOP floor (s) | fraction of floor |")
    rows = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        row = r.row()
        cells = [
            r.mode, f"{r.context:,}", r.status,
            float_cell(r.step_time_s) and f"{r.step_time_s:.4g}", float_cell(r.tokens_per_s) and f"{r.tokens_per_s:,.0f}",
            row["peak_gpu_gib"] and f"{float(row['peak_gpu_gib']):.2f}",
            row["planned_gpu_gib"] and f"{float(row['planned_gpu_gib']):.2f}",
            row["peak_host_gib"] and f"{float(row['peak_host_gib']):.2f}",
            f"{r.floor_s:.4g}", float_cell(r.floor_fraction) and f"{r.floor_fraction:.1%}",
        ]
        rows.append("| " + " | ".join(c or "–" for c in cells) + " |")
    return "\n".join(rows)


def write_outputs(results: list[PointResult], config: BenchConfig, command: str, machine: str) -> dict[str, Path]:
    """results.csv, results.md and results.png under ``config.out``; returns their paths."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "results.csv", "md": out / "results.md", "png": out / "results.png"}
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(r.row() for r in results)
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    settings = (
        f"model `{config.model}`, batch {config.batch}, chunk {config.chunk_size}, page {config.page_size}, "
        f"{'LoRA rank ' + str(config.lora_rank) if config.lora_rank else 'all parameters trainable'}, "
        f"attention `{config.attention}`, layer checkpointing (oomb) {'on' if config.checkpoint_layers else 'off'}, "
        f"{config.warmup} warm-up + {config.repeats} timed steps (median), "
        f"FLOP floor at {config.matmul_tflops:g} TFLOP/s"
    )
    if any(MODES[m].sparse for m in config.modes):
        settings += (f", sparse: {config.budget_pages} pages per "
                     + ("query tile" if config.per_query_tile else "chunk (one selection for all its query tiles)"))
    if config.document_length is not None:
        settings += (f", sequences packed from documents of {config.document_length:,} tokens (position ids "
                     "restarting at 0 for each)")
    modes = "\n".join(f"- `{m}`: {MODES[m].description}" for m in config.modes)
    paths["md"].write_text(
        f"# lightning-oomb bench\n\n- machine: {machine}\n- date: {date}\n- command: `{command}`\n"
        f"- settings: {settings}\n{modes}\n\n{markdown_table(results)}\n\n![step time and peak memory](results.png)\n"
    )
    plot(results, config, machine, paths["png"])
    return paths


def _tokens_label(n: float) -> str:
    n = int(round(n))
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def plot(results: list[PointResult], config: BenchConfig, machine: str, path: Path) -> None:
    """Two log-log panels against context length: step time (with the FLOP floor) and peak GPU memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.8))
    lengths = sorted({r.context for r in results})
    for name in config.modes:
        points = [r for r in results if r.mode == name]
        ok = [r for r in points if r.status == "ok"]
        line = ax_time.plot([r.context for r in ok], [r.step_time_s for r in ok], "o-", label=name)[0]
        color = line.get_color()
        with_memory = [r for r in ok if r.peak_gpu_bytes is not None]
        memory_of = {r.context: r.peak_gpu_bytes for r in with_memory}
        if not with_memory:  # CPU: the host peak is what there is
            memory_of = {r.context: r.peak_host_bytes for r in ok}
        ax_mem.plot(list(memory_of), [v / GIB for v in memory_of.values()], "o-", color=color, label=name)
        planned = [r for r in points if r.planned_gpu_allocated_bytes is not None]
        if planned and with_memory:
            ax_mem.plot([r.context for r in planned], [r.planned_gpu_allocated_bytes / GIB for r in planned], ":",
                        color=color, label=f"{name} (planned)")
        failed = [r for r in points if r.status != "ok"]
        for ax in (ax_time, ax_mem):
            for r in failed:
                ax.plot(r.context, 0.95, "x", color=color, markersize=10, transform=ax.get_xaxis_transform())
                ax.annotate(r.status, (r.context, 0.95), xycoords=ax.get_xaxis_transform(), color=color,
                            textcoords="offset points", xytext=(4, -12), fontsize=8)
    floors = {r.context: r.floor_s for r in results}
    ax_time.plot(lengths, [floors[n] for n in lengths], "k--", label=f"FLOP floor ({config.matmul_tflops:g} TFLOP/s)")
    on_gpu = any(r.peak_gpu_bytes is not None for r in results)
    ax_time.set_ylabel("step time (s)")
    ax_mem.set_ylabel("peak GPU memory allocated (GiB)" if on_gpu else "peak host RSS (GiB)")
    tokens = FuncFormatter(lambda x, _: _tokens_label(x))
    measured = any(r.status == "ok" for r in results)
    for ax in (ax_time, ax_mem):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(tokens)
        if ax is ax_time or measured:  # a sweep whose every point failed has no memory to draw
            ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{ModelShape.resolve(config.model).name} on {machine}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# == command line =========================================================================================


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-oomb bench",
        description="Step time and peak memory of training modes over context lengths (K = 1024 tokens, M = 1024^2).",
    )
    parser.add_argument("--model", default="qwen2.5-7b",
                        help="built-in shape, a config.json or a model directory (default qwen2.5-7b)")
    parser.add_argument("--lengths", type=argparse_type(parse_tokens, many=True), default=BenchConfig.lengths,
                        help="context lengths, e.g. 16k,32k,64k,128k")
    parser.add_argument("--modes", type=argparse_type(str.strip, many=True), default=BenchConfig.modes,
                        help=f"comma-separated, from: {', '.join(MODES)}")
    parser.add_argument("--chunk", type=argparse_type(parse_tokens), default=4096, help="tokens per chunk (default 4096)")
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="train LoRA adapters of this rank on q,k,v,o")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per point (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per point before timing")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    parser.add_argument("--attention", choices=("auto", "reference", "triton"), default="auto", help="oomb attention")
    parser.add_argument("--checkpoint-layers", action="store_true", help="oomb: checkpoint decoder layers in stage 2")
    parser.add_argument("--grad-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="oomb modes: dtype of the KV-gradient pages (default float32)")
    parser.add_argument("--budget-pages", type=int, default=64, help="sparse: past pages per query tile (default 64)")
    parser.add_argument("--selection", choices=("tile", "chunk"), default="tile",
                        help="sparse: one page selection per query tile (default) or per chunk, which bounds the "
                        "pages a host K/V layer gathers (SparseConfig.per_query_tile=False)")
    parser.add_argument("--add-launch", default="", metavar="PROGRAMSxROWSxWARPS",
                        help="sparse with host gradient layers: launch of the kernel adding their staged gradients "
                             "(default: kernels.host_pages.ADD_LAUNCH)")
    parser.add_argument("--gather-programs", type=int, default=None, metavar="N",
                        help="sparse with host K/V layers: persistent programs of the gathers that run ahead of "
                             "their calls (default: kernels.host_pages.GATHER_AHEAD_PROGRAMS)")
    parser.add_argument("--matmul-tflops", type=float, default=DEFAULT_MATMUL_TFLOPS,
                        help="matmul peak in TFLOP/s for the FLOP floor")
    parser.add_argument("--document-length", type=argparse_type(parse_tokens), default=None, metavar="TOKENS",
                        help="pack each sequence from documents of this many tokens, e.g. 32K (position ids "
                             "restarting every TOKENS; lightning_oomb modes only); default one document per sequence")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cuda, cuda:1, cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    config = BenchConfig(
        model=args.model, lengths=args.lengths, modes=args.modes, chunk_size=args.chunk, page_size=args.page_size,
        batch=args.batch, lora_rank=args.lora, repeats=args.repeats, warmup=args.warmup, attention=args.attention,
        checkpoint_layers=args.checkpoint_layers, grad_dtype=args.grad_dtype, budget_pages=args.budget_pages,
        per_query_tile=args.selection == "tile", add_launch=args.add_launch, gather_programs=args.gather_programs,
        matmul_tflops=args.matmul_tflops,
        document_length=args.document_length,
        out=args.out, device=args.device, seed=args.seed,
    )
    if config.add_launch:
        try:
            host_pages.AddLaunch.parse(config.add_launch)
        except ValueError as error:
            parser.error(str(error))
    for name, value in (("--repeats", config.repeats), ("--batch", config.batch),
                        ("--gather-programs", 1 if config.gather_programs is None else config.gather_programs)):
        if value < 1:
            parser.error(f"{name} must be >= 1")
    if config.warmup < 0:
        parser.error("--warmup must be >= 0")
    try:
        check_modes(config)
    except ValueError as error:
        parser.error(str(error))
    try:
        load_config_dict(config.model)
    except FileNotFoundError as error:
        parser.error(str(error))
    results = run(config)
    paths = write_outputs(results, config, "lightning-oomb bench " + shlex.join(argv), machine_name(bench_device(config)))
    print()
    print(markdown_table(results))
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
