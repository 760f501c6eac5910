"""``lightning-oomb bench``: step time and peak memory of training modes over context lengths.

    lightning-oomb bench --model qwen2.5-7b --lengths 16k,32k,64k,128k --modes baseline,oomb \\
        [--chunk 4096] [--lora-rank 16] [--repeats 3] [--warmup 1] [--out DIR] [--attention auto] [--checkpoint-layers]
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

This module is the command line. The sweep is in sweep.py (one point of it: measure.py), the modes in
modes.py, the outputs in report.py.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..cli_flags import (
    STEP, OneLineParser, add_budget_pages, add_chunk, add_grad_dtype, add_page_size, add_selection, per_query_tile,
)
from ..core.config import ATTENTIONS, ChunkConfig
from ..core.errors import SetupError
from ..core.model_shape import load_config_dict
from ..core.plan.assumptions import DEFAULT_MATMUL_TFLOPS
from ..core.units import argparse_type, parse_tokens
from ..kernels import host_pages
from .config import BenchConfig
from .modes import MODES, check_modes, step_options
from .report import markdown_table, write_outputs
from .sweep import bench_device, machine_name, run


def build_parser() -> argparse.ArgumentParser:
    """The options of ``lightning-oomb bench``."""
    parser = OneLineParser(
        prog="lightning-oomb bench",
        description="Step time and peak memory of training modes over context lengths (K = 1024 tokens, M = 1024^2).",
    )
    parser.add_argument("--model", default="qwen2.5-7b",
                        help="built-in shape, a config.json or a model directory (default qwen2.5-7b)")
    parser.add_argument("--lengths", type=argparse_type(parse_tokens, many=True), default=BenchConfig.lengths,
                        help="context lengths, e.g. 16k,32k,64k,128k")
    parser.add_argument("--modes", type=argparse_type(str.strip, many=True), default=BenchConfig.modes,
                        help=f"comma-separated, from: {', '.join(MODES)}")
    add_chunk(parser)
    add_page_size(parser)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--lora-rank", type=int, default=0, metavar="RANK",
                        help="train LoRA adapters of this rank on q,k,v,o")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per point (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per point before timing")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    parser.add_argument("--attention", choices=ATTENTIONS, default=STEP["attention"], help="oomb attention")
    parser.add_argument("--checkpoint-layers", action="store_true", help="oomb: checkpoint decoder layers in stage 2")
    add_grad_dtype(parser, help="oomb modes: dtype of the KV-gradient pages")
    add_budget_pages(parser)
    add_selection(parser)
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
    """Run ``lightning-oomb bench ARGV`` (None: the command line's): check the options, sweep, write the outputs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    config = BenchConfig(
        model=args.model, lengths=args.lengths, modes=args.modes, chunk_size=args.chunk, page_size=args.page_size,
        batch=args.batch, lora_rank=args.lora_rank, repeats=args.repeats, warmup=args.warmup, attention=args.attention,
        checkpoint_layers=args.checkpoint_layers, grad_dtype=args.grad_dtype, budget_pages=args.budget_pages,
        per_query_tile=per_query_tile(args.selection), add_launch=args.add_launch, gather_programs=args.gather_programs,
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
        for mode in config.modes:  # the step options, checked before a model is built
            ChunkConfig(**step_options(config, MODES[mode].sparse_config(config)))
    except (FileNotFoundError, SetupError) as error:
        parser.error(str(error))
    results = run(config)
    command = "lightning-oomb bench " + shlex.join(argv)
    paths = write_outputs(results, config, command, machine_name(bench_device(config)))
    print()
    print(markdown_table(results))
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
