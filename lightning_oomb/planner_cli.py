"""``lightning-oomb plan``: print the memory and time plan of a training step before running it.

Exit status 0 when the step fits, 1 when it does not (the plan then lists what would make it fit).
Token counts take K = 1024 and M = 1024 * 1024; memory takes 141GB = 141e9 bytes or 80GiB = 80 * 2**30.
"""

from __future__ import annotations

import argparse
import sys

import torch

from .core.config import SparseConfig
from .core.model_shape import PRECISIONS, builtin_names
from .core.planner import DEFAULT_MATMUL_TFLOPS, OFFLOAD_SEGMENT_TOKENS, OPTIMIZERS, plan_placed
from .core.units import argparse_type, parse_bytes, parse_tokens

CHECKPOINT_CHOICES = {"on": True, "off": False, "auto": None}
GRAD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-oomb plan",
        description="Memory and time of one chunk-recurrent training step, before running it. "
        "Token counts: K = 1024, M = 1024*1024 (1M = 1,048,576). Memory: 141GB = 141e9 bytes, 80GiB = 80*2^30.",
    )
    parser.add_argument("--model", required=True,
                        help=f"built-in shape ({', '.join(builtin_names())}), a config.json or a model directory")
    parser.add_argument("--context", required=True, type=argparse_type(parse_tokens), help="tokens per sequence, e.g. 1M")
    parser.add_argument("--chunk", type=argparse_type(parse_tokens), default=4096, help="tokens per chunk (default 4096)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    parser.add_argument("--page-size", type=int, default=128, help="tokens per KV page (default 128)")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA rank on q,k,v,o (0: full training)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16-true")
    parser.add_argument("--checkpoint-layers", choices=tuple(CHECKPOINT_CHOICES), default="auto",
                        help="layer checkpointing in stage 2; auto: off if the step fits without it")
    parser.add_argument("--grad-dtype", choices=tuple(GRAD_DTYPES), default="float32",
                        help="dtype of the KV-gradient pages")
    parser.add_argument("--offload", choices=("auto", "gpu", "host"), default="auto",
                        help="where the K/V and KV-gradient pages live; auto: the GPU if the step fits there, "
                        "else pinned host memory (as a training step decides)")
    parser.add_argument("--segment-tokens", type=argparse_type(parse_tokens), default=OFFLOAD_SEGMENT_TOKENS,
                        help=f"with the pages on the host: tokens per streamed segment (default {OFFLOAD_SEGMENT_TOKENS:,})")
    parser.add_argument("--sparse-budget", type=int, default=0, metavar="PAGES",
                        help="page-level sparse attention with this many past pages per query tile (SparseConfig's "
                        "other fields at their defaults); 0: dense. Sparse steps keep K/V on the GPU: --offload "
                        "moves only KV-gradient pages (auto: of the fewest layers that fit; host: of all)")
    parser.add_argument("--gpu-memory", type=argparse_type(parse_bytes), default=None,
                        help="GPU memory with its unit, e.g. 140GiB for an H200 (what torch sees; default: this machine's CUDA device)")
    parser.add_argument("--host-memory", type=argparse_type(parse_bytes), default=None,
                        help="the run's host memory budget with its unit, e.g. 112GiB (default: this machine's RAM less max(8 GiB, 10%%))")
    parser.add_argument("--matmul-tflops", type=float, default=DEFAULT_MATMUL_TFLOPS,
                        help=f"dense bf16 matmul peak of the GPU in TFLOP/s (default {DEFAULT_MATMUL_TFLOPS:g}, H200)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the plan; 0 when the step fits, 1 when it does not."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    sparse = SparseConfig(budget_pages=args.sparse_budget) if args.sparse_budget else None

    try:
        result = plan_placed(
            args.model,
            args.context,
            offload=args.offload,
            sparse=sparse,
            chunk_size=args.chunk,
            batch=args.batch,
            page_size=args.page_size,
            lora_rank=args.lora,
            optimizer=args.optimizer,
            precision=args.precision,
            checkpoint_layers=CHECKPOINT_CHOICES[args.checkpoint_layers],
            grad_dtype=GRAD_DTYPES[args.grad_dtype],
            gpu_memory=args.gpu_memory,
            host_memory=args.host_memory,
            matmul_tflops=args.matmul_tflops,
            segment_tokens=args.segment_tokens,
        )
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    result.suggestion_style = "cli"
    print(result)
    return 0 if result.fits else 1


if __name__ == "__main__":
    sys.exit(main())
