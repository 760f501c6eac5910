"""``lightning-oomb plan``: print the memory and time plan of a training step before running it.

Exit status 0 when the step fits, 1 when it does not (the plan then lists what would make it fit). With
``--max-context``: the longest context that fits, as a table over full training and LoRA, dense and sparse,
next to the machine's physical limit.
Token counts take K = 1024 and M = 1024 * 1024; memory takes 141GB = 141e9 bytes or 80GiB = 80 * 2**30.
"""

from __future__ import annotations

import argparse
import sys
import textwrap


from .cli_flags import (
    SPARSE, STEP, OneLineParser, add_budget_pages, add_chunk, add_grad_dtype, add_offload, add_page_size, add_selection,
    per_query_tile,
)
from .core.config import ChunkConfig, SparseConfig
from .core.host_memory import host_budget, host_headroom, machine_host_memory
from .core.model_shape import PRECISIONS, builtin_names
from .core.quantization import QUANT_TYPES
from .core.plan import (
    DEFAULT_MATMUL_TFLOPS, OFFLOAD_SEGMENT_TOKENS, OPTIMIZERS, SHARDINGS, PlanConfig, max_context, plan_placed,
    this_gpu_memory,
)
from .core.plan.formatting import duration as _duration, gib as _gib
from .core.units import argparse_type, parse_bytes, parse_tokens

# "auto" is the planner's choice (off if the step fits without it), not a ChunkConfig value.
CHECKPOINT_CHOICES = ("on", "off", "auto")


def _join_negative_values(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``--gpu-memory -80GiB`` as ``--gpu-memory=-80GiB``: argparse takes a value starting with '-' for an option
    and says "expected one argument"; joined, the option's own check names what is wrong with the value."""
    takes_value = {o for a in parser._actions if a.option_strings and a.nargs is None and a.const is None
                   for o in a.option_strings}
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in takes_value and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and argv[i + 1] not in parser._option_string_actions:
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="lightning-oomb plan",
        description="Memory and time of one chunk-recurrent training step, before running it. "
        "Token counts: K = 1024, M = 1024*1024 (1M = 1,048,576). Memory: 141GB = 141e9 bytes, 80GiB = 80*2^30.",
    )
    parser.add_argument("--model", required=True,
                        help=f"built-in shape ({', '.join(builtin_names())}), a config.json or a model directory")
    parser.add_argument("--context", type=argparse_type(parse_tokens), help="tokens per sequence, e.g. 1M")
    parser.add_argument("--max-context", action="store_true",
                        help="instead of one plan: the longest context that fits, for full training (--optimizer) "
                        f"and LoRA (--lora-rank, default rank 16), dense and sparse (--budget-pages, default "
                        f"{SPARSE['budget_pages']} pages), "
                        "with the other options as given, next to the machine's physical limit")
    add_chunk(parser)
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    add_page_size(parser)
    parser.add_argument("--lora-rank", type=int, default=0, metavar="RANK",
                        help="LoRA rank on q,k,v,o (0: full training)")
    parser.add_argument("--lora-experts", action="store_true",
                        help="with LoRA: adapters on a mixture of experts' stacked expert weights too "
                        "(CausalLMModule's lora_target_parameters)")
    parser.add_argument("--quantization", choices=QUANT_TYPES, default=None,
                        help="QLoRA: the frozen base weights in bitsandbytes' 4 bits (CausalLMModule's quantization), "
                        "under the LoRA adapters of --lora-rank; with --max-context a row of its own")
    parser.add_argument("--double-quant", action="store_true",
                        help="with --quantization: the per-block scales in 8 bits too (bnb_4bit_use_double_quant)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16-true")
    parser.add_argument("--checkpoint-layers", choices=CHECKPOINT_CHOICES, default="auto",
                        help="layer checkpointing in stage 2; auto: off if the step fits without it")
    add_grad_dtype(parser)
    add_offload(parser, help="where the K/V and KV-gradient pages live; auto: the GPU if the step fits there, "
                "else pinned host memory (as a training step decides)")
    parser.add_argument("--segment-tokens", type=argparse_type(parse_tokens), default=STEP["segment_tokens"],
                        help="with the pages on the host: tokens per streamed segment (default: the longest a "
                        f"step streams, {OFFLOAD_SEGMENT_TOKENS:,})")
    add_budget_pages(parser, default=0, help="page-level sparse attention with this many past pages per query tile "
                     "(SparseConfig's other fields at their defaults); 0: dense. Sparse steps move pages by layer: "
                     "--offload auto: KV-gradient pages, then K/V pages, of the fewest layers that fit; host: of all")
    add_selection(parser)
    parser.add_argument("--gpu-memory", type=argparse_type(parse_bytes), default=None,
                        help="GPU memory with its unit, e.g. 140GiB for an H200 (what torch sees; default: this machine's CUDA device)")
    parser.add_argument("--host-memory", type=argparse_type(parse_bytes), default=None,
                        help="the run's host memory budget with its unit, e.g. 112GiB (default: what a run started now would get: the memory this machine has available less max(8 GiB, 10%% of its RAM) or half of it if less)")
    parser.add_argument("--document-length", type=argparse_type(parse_tokens), default=None, metavar="TOKENS",
                        help="sequences packed from documents of this many tokens, e.g. 32K (position ids "
                        "restarting every TOKENS): attention within documents only; default one document per sequence")
    parser.add_argument("--devices", type=int, default=1,
                        help="data-parallel GPUs of one machine, each with --batch sequences: memory per GPU, the "
                        "host budget divided among them, the collectives in the step time")
    parser.add_argument("--sharding", choices=SHARDINGS, default="none",
                        help="with --devices N: none plans an oomb_ddp rank (every weight whole); zero1, zero2, zero3 "
                        "an oomb_model_parallel rank with that sharding of the decoder layers (default none)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                        help="GPUs of one machine that split each decoder layer by KV heads (oomb_model_parallel's "
                        "tensor_parallel_size), all on the same batch: memory per GPU, the host budget divided "
                        "among them, their all-reduces in the step time; T must divide the model's KV heads, "
                        "attention heads and MLP width (default 1)")
    parser.add_argument("--matmul-tflops", type=float, default=DEFAULT_MATMUL_TFLOPS,
                        help=f"dense bf16 matmul peak of the GPU in TFLOP/s (default {DEFAULT_MATMUL_TFLOPS:g}, H200)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the plan; 0 when the step fits, 1 when it does not."""
    parser = build_parser()
    args = parser.parse_args(_join_negative_values(sys.argv[1:] if argv is None else list(argv), parser))
    if args.context is not None and args.max_context:
        parser.error("--context and --max-context exclude each other: --context TOKENS plans one step, "
                     "--max-context finds the longest that fits")
    if args.context is None and not args.max_context:
        parser.error("give --context TOKENS (one plan) or --max-context (the longest context that fits)")
    if args.double_quant and args.quantization is None:
        parser.error("--double-quant quantises the scales of 4-bit weights: give --quantization nf4 (or fp4) too")
    try:  # the answer is printed whole, so that a refused option prints nothing but its one line
        lines = [assumptions(args), ""]
        config = plan_config(args)
        machine = dict(gpu_memory=args.gpu_memory, checkpoint_auto=args.checkpoint_layers == "auto")
        if args.max_context:
            print("\n".join([*lines, context_table(args.model, args, config, machine)]))
            return 0
        result = plan_placed(args.model, config, **machine)
        result.suggestion_style = "cli"
        lines.append(str(result))
        if not result.fits and not any(s.plan.fits for s in result.suggestions if s.goal == "memory"):
            lines += ["", what_it_would_take(args.model, result, max_context(args.model, config, **machine))]
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    print("\n".join(lines))
    return 0 if result.fits else 1


def plan_config(args: argparse.Namespace) -> PlanConfig:
    """The step the flags ask for: the step options through ChunkConfig (which checks them), the run's around
    them. The step computes its loss in stage 1, as ``lightning-oomb fit`` runs it (a served forward keeps
    every chunk's dL/dh). With --max-context the context is a chunk: each length tried replaces it."""
    chunk = ChunkConfig.build(
        chunk_size=args.chunk, page_size=args.page_size, checkpoint_layers=args.checkpoint_layers == "on",
        grad_dtype=args.grad_dtype, offload=args.offload, segment_tokens=args.segment_tokens,
        host_memory=args.host_memory,
        sparse=_sparse(args.budget_pages, args.selection) if args.budget_pages else None,
    )
    quantization = (None if args.quantization is None
                    else {"quant_type": args.quantization, "double_quant": args.double_quant})
    return PlanConfig(
        args.context or chunk.chunk_size, chunk, batch=args.batch, lora_rank=args.lora_rank,
        lora_experts=args.lora_experts,
        quantization=quantization, optimizer=args.optimizer, precision=args.precision, matmul_tflops=args.matmul_tflops,
        devices=args.devices, document_length=args.document_length, sharding=args.sharding,
        tensor_parallel=args.tensor_parallel, stage_1_loss=True,
    )


def assumptions(args: argparse.Namespace) -> str:
    """The first lines of every answer: the GPU (its matmul rate and memory) and the host budget planned for,
    and whence."""
    if args.matmul_tflops == DEFAULT_MATMUL_TFLOPS:
        rate = f"an H200's matmul rate, {args.matmul_tflops:g} TFLOP/s dense bf16 (--matmul-tflops sets another GPU's)"
    else:
        rate = f"a GPU of {args.matmul_tflops:g} TFLOP/s dense bf16 (--matmul-tflops)"
    if args.gpu_memory is None:
        total, name = this_gpu_memory()
        gpu = f"{_gib(total)} GiB of GPU memory (this machine's {name}; --gpu-memory plans for another)"
    else:
        gpu = f"{_gib(args.gpu_memory)} GiB of GPU memory (--gpu-memory)"
    ram = machine_host_memory()
    if args.host_memory is None:
        host = (f"host budget {_gib(host_budget())} GiB (this machine's: available memory less a "
                f"{_gib(host_headroom())} GiB headroom; --host-memory plans for another)")
    elif args.host_memory > ram:
        host = (f"host budget {_gib(args.host_memory)} GiB (--host-memory; more than this machine's "
                f"{_gib(ram)} GiB of RAM: planning for another machine)")
    else:
        host = f"host budget {_gib(args.host_memory)} GiB (--host-memory)"
    return textwrap.fill(f"Assumed: {rate}, with {gpu}; {host}.", width=110, break_on_hyphens=False)


def _sparse(budget_pages: int, selection: str) -> SparseConfig:
    return SparseConfig(budget_pages=budget_pages, per_query_tile=per_query_tile(selection))


def what_it_would_take(model: str, result, limit) -> str:
    """When no change fits: the longest context that does with these options, and what the asked one needs."""
    c = result.config
    stored = c.context * limit.bytes_per_token
    longest = f"{limit.context:,} tokens" if limit.context else "not even one chunk"
    return textwrap.fill(
        f"What {c.context:,} tokens would take: with these options the longest context that fits here is {longest} "
        f"(lightning-oomb plan --max-context). {c.context:,} tokens store {_gib(stored)} GiB of K, V and their "
        f"gradients; this machine holds {limit.physical_tokens:,} tokens of them in all (GPU and host budget). "
        "Past that: a host with more memory (dense steps stream every page from there; sparse steps keep the "
        "pages of the layers that do not fit there, gathering the selected ones), or several GPUs.", width=110)


def context_table(model: str, args: argparse.Namespace, config: PlanConfig, machine: dict) -> str:
    """The longest context of each common case (``config`` with its training and attention replaced), one row
    each, next to the machine's physical limit; ``machine``: ``max_context``'s other arguments."""
    rank, budget = args.lora_rank or 16, args.budget_pages or SPARSE["budget_pages"]
    sparse_rows = config.replace(sparse=_sparse(budget, args.selection)).sparse  # per_query_tile decided by offload
    per = "" if sparse_rows.per_query_tile else ", one selection per chunk"
    full = dict(lora_rank=0, quantization=None, optimizer=args.optimizer)
    cases = [(f"full training, {args.optimizer}", full)]
    experts = " (experts too)" if args.lora_experts else ""
    if args.tensor_parallel == 1 or args.lora_rank:  # LoRA under tensor parallel is not built: refused when asked
        cases.append((f"LoRA rank {rank}{experts}", dict(lora_rank=rank, quantization=None, optimizer="adamw")))
    if config.quantization is not None:
        cases.append((f"QLoRA rank {rank}{experts}, {config.quantization.describe()}",
                      dict(lora_rank=rank, quantization=config.quantization, optimizer="adamw")))
    rows = []
    for name, options in cases:
        for attention, sparse in (("dense", None), (f"sparse {budget} pages{per}", sparse_rows)):
            limit = max_context(model, config, sparse=sparse, **options, **machine)
            p = limit.plan
            fitted = f"{limit.context:,}" if limit.context else "none"
            time = _duration(p.time.predicted_s) if limit.context else "-"
            rows.append((f"{name}, {attention}", fitted, f"{_gib(p.peak_gpu_bytes)}", f"{_gib(p.peak_host_bytes)}",
                         time, f"{limit.physical_tokens:,}"))
    head = ("case", "longest context", "GPU GiB", "host GiB", "step", "machine limit")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    p = limit.plan
    machine = f"{p.machine + ': ' if p.machine else ''}GPU {_gib(p.gpu_memory)} GiB, host budget {_gib(p.host_memory)} GiB"
    note = textwrap.fill(
        "The machine limit: the GPU memory a one-chunk step leaves free plus the host memory budget's room for "
        "pinned pages, over the bytes a token stores (K, V and their gradients, "
        + (f"the {p.shape.kv_layers} layers with K/V pages" if p.shape.layers_without_kv else "all layers")
        + ("; the sliding-window layers' gradients are a ring of their window, their K/V the pages a later "
           "chunk's window reaches" if p.shape.window_layers else "")
        + "). Dense steps past "
        "the GPU stream every page from the host; sparse steps keep the KV-gradient pages, then the K/V pages, "
        "of as many layers there as they need, gathering each chunk's selected pages.", width=110)
    ranks = ([f"{args.devices} data-parallel ranks (sharding {args.sharding})"] if args.devices > 1 else []) + (
        [f"{args.tensor_parallel} tensor-parallel ranks"] if args.tensor_parallel > 1 else [])
    return "\n".join([
        f"Longest context per step of {model} ({machine}; offload {args.offload}, chunk {args.chunk:,}, "
        f"{args.precision}, KV-gradients {args.grad_dtype}, batch {args.batch}"
        + (f"; per GPU of {' x '.join(ranks)}" if ranks else "") + "):", "",
        line(head), *(line(r) for r in rows), "", note,
    ])


if __name__ == "__main__":
    sys.exit(main())
