"""Where a step's GPU memory peaks, chunk by chunk, and how the peak grows with the context.

    python -m lightning_oomb.bench.memory_trace --model qwen2.5-7b --lengths 64k,256k --offload host

One step per length (random bf16 weights, all parameters trainable). With --verbose, after every chunk of
stage 1 and stage 2 it prints the memory allocated and the peak so far. Per length: the step's GPU peak and
host peak (RSS) next to what the planner predicts for them; at the end the GPU peak's growth per 10K tokens
between consecutive lengths.
"""

from __future__ import annotations

import argparse
import time

import torch

from ..cli_flags import add_chunk, add_offload
from ..core.config import ChunkConfig
from ..core.host_memory import peak_process_host_bytes, reset_peak_process_host_bytes
from ..core.model_shape import ModelShape
from ..core.plan import CUDA_CONTEXT_BYTES, Pages, PlanConfig, plan
from ..core.schedule import ChunkedSequence, release_cached_pool
from ..core.units import GIB, parse_tokens
from .config import BenchConfig
from .sweep import build_model


def trace_step(model, context: int, config: ChunkConfig, vocab: int, verbose: bool) -> tuple[int, int, float, ChunkedSequence]:
    """One train step of ``context`` tokens; returns (peak GPU bytes, peak host bytes, seconds, the sequence)."""
    ids = torch.randint(0, vocab, (1, context), device="cuda")
    model.zero_grad(set_to_none=False)  # gradients allocated before: the step's own memory is what grows
    release_cached_pool(model)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    reset_peak_process_host_bytes()

    def observe(stage: int, index: int, start: int, end: int) -> None:
        if verbose:
            torch.cuda.synchronize()
            print(f"  stage {stage} chunk {index:4d} [{start:>9,}, {end:>9,}): allocated "
                  f"{torch.cuda.memory_allocated() / GIB:7.3f} GiB, peak {torch.cuda.max_memory_allocated() / GIB:7.3f} GiB",
                  flush=True)

    began = time.perf_counter()
    seq = ChunkedSequence(model, ids, config=config, observer=observe)
    seq.fill()
    seq.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), peak_process_host_bytes(), time.perf_counter() - began, seq


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--lengths", default="64k,256k")
    add_chunk(parser)
    add_offload(parser, default="host")  # what this tool traces: the streamed pages
    parser.add_argument("--verbose", action="store_true", help="print every chunk")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    lengths = [parse_tokens(x) for x in args.lengths.split(",")]
    model = build_model(BenchConfig(model=args.model), torch.device("cuda"), torch.bfloat16)
    vocab = ModelShape.resolve(args.model).vocab
    config = ChunkConfig(chunk_size=args.chunk, offload=args.offload)
    peaks = []
    for context in lengths:
        print(f"{args.model}, context {context:,}, offload {args.offload}:", flush=True)
        peak, host, seconds, seq = trace_step(model, context, config, vocab, args.verbose)
        peaks.append(peak)
        placement = seq.placement
        predicted = plan(args.model, PlanConfig(context, config, optimizer="none"), gpu_memory=1 << 62,
                         host_memory=1 << 62, pages=Pages(streamed=placement.where == "host"),
                         segment_tokens=placement.segment_tokens)
        planned_gpu = predicted.peak_gpu_bytes - CUDA_CONTEXT_BYTES  # the plan's line for what torch never counts
        print(f"  step {seconds:.1f} s (first at this length: pool allocation included), pages on "
              f"{placement.where}, segment {placement.segment_tokens:,} tokens\n"
              f"  GPU peak {peak / GIB:.3f} GiB (planned {planned_gpu / GIB:.3f}, {planned_gpu / peak - 1:+.1%}); "
              f"host peak {host / GIB:.3f} GiB (planned {predicted.peak_host_bytes / GIB:.3f}, "
              f"{predicted.peak_host_bytes / host - 1:+.1%})", flush=True)
        del seq
    for (a, pa), (b, pb) in zip(zip(lengths, peaks), zip(lengths[1:], peaks[1:])):
        print(f"peak growth {a:,} -> {b:,} tokens: {(pb - pa) / 2**20:.1f} MiB, "
              f"{(pb - pa) / 1e6 / ((b - a) / 1e4):.2f} MB per 10K tokens")


if __name__ == "__main__":
    main()
