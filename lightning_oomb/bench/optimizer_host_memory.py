"""Host memory of an optimizer's first (compiling) CUDA step with the GPU full, as a long-context step leaves it.

Builds ``--optimizer`` (a torchao choice) over bf16 weights of Qwen2.5-7B's largest shapes (the embedding and
the output layer, 152064 x 3584, and one MLP projection), fills the GPU but for ``--room`` GiB, and steps twice.
Prints one JSON line: the process's host memory (anonymous and shared resident pages) and the machine's
available memory (MemAvailable, which also counts Inductor's compile workers) before and after each step, what
torch's pinned allocator holds, the step times and the GPU peak. ``--inductor-default`` runs the
steps under Inductor's default settings instead of the one kernel configuration the optimizer is built with
(core/torchao_optim.py), for the comparison; each run wants an empty ``TORCHINDUCTOR_CACHE_DIR``, or Inductor
reuses the configurations an earlier run chose.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python -m lightning_oomb.bench.optimizer_host_memory \\
        --optimizer adamw8bit-kahan [--inductor-default]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

GIB = 1 << 30
SHAPES = ((152064, 3584), (152064, 3584), (18944, 3584))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", default="adamw8bit-kahan", help="a torchao choice of model.optimizer")
    parser.add_argument("--room", type=float, default=10.0, help="GPU memory left free for the step (GiB)")
    parser.add_argument("--inductor-default", action="store_true",
                        help="step under Inductor's default settings (each kernel's configurations tried)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..core.host_memory import available_host_memory, process_host_bytes
    from ..core.optimizers import OptimizerSpec
    from ..core.torchao_optim import OneConfigStep

    if not torch.cuda.is_available():
        print("optimizer_host_memory: needs a CUDA device", file=sys.stderr)
        return 2
    spec = OptimizerSpec.parse(args.optimizer)
    if spec.choice is None or spec.choice.package != "torchao":
        print(f"optimizer_host_memory: --optimizer must be a torchao choice, got {args.optimizer!r}", file=sys.stderr)
        return 2
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = spec.build(params, lr=1e-5, weight_decay=0.0)

    def step() -> None:
        # OneConfigStep's step sets the one configuration; the class after it in the MRO steps without it
        (super(OneConfigStep, optimizer) if args.inductor_default else optimizer).step()
        torch.cuda.synchronize()

    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(max(0, free - int(args.room * GIB)), dtype=torch.uint8, device="cuda")  # noqa: F841
    result = {"optimizer": args.optimizer, "inductor": "default" if args.inductor_default else "one configuration",
              "torch": torch.__version__, "device": torch.cuda.get_device_name(),
              "host_before_gib": round(process_host_bytes() / GIB, 3),
              "available_before_gib": round(available_host_memory() / GIB, 3)}
    for i in (1, 2):
        start = time.perf_counter()
        step()
        result[f"step{i}_s"] = round(time.perf_counter() - start, 4)
        result[f"host_after_step{i}_gib"] = round(process_host_bytes() / GIB, 3)
        result[f"available_after_step{i}_gib"] = round(available_host_memory() / GIB, 3)
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    result["pinned_allocator_held_gib"] = round(stats.get("allocated_bytes.current", 0) / GIB, 3)
    result["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
