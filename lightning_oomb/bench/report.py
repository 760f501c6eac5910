"""What a sweep writes: results.csv, results.md (machine, date, command line, settings, table) and results.png.

The plot draws step time and peak GPU memory (host memory on a CPU) against context length, log-log, with the
FLOP floor of docs/planner.md ("Time") and, for the modes the planner models, its predicted peak.
"""

from __future__ import annotations

import csv
import datetime
from pathlib import Path

from ..core.model_shape import ModelShape
from ..core.units import GIB
from .config import BenchConfig
from .modes import MODES
from .results import CSV_COLUMNS, PointResult, float_cell



def markdown_table(results: list[PointResult]) -> str:
    """The results as a Markdown table, printed at the end of a sweep and written into results.md."""
    head = ("| mode | context | status | step time (s) | tokens/s | peak GPU (GiB) | planned GPU (GiB) "
            "| peak host (GiB) | FLOP floor (s) | fraction of floor |")
    rows = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        row = r.row()
        cells = [
            r.mode, f"{r.context:,}", r.status,
            float_cell(r.step_time_s) and f"{r.step_time_s:.4g}",
            float_cell(r.tokens_per_s) and f"{r.tokens_per_s:,.0f}",
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
                     + {True: "query tile", False: "chunk (one selection for all its query tiles)",
                        None: "query tile (per chunk in the modes with host pages: SparseConfig.per_query_tile "
                              "None)"}[config.per_query_tile])
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
