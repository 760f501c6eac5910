"""What does a bf16 KV-gradient store cost in gradient accuracy? Same step, float32 store vs bf16 store.

    python -m lightning_oomb.bench.grad_store_precision --model qwen2.5-7b --lengths 32k,128k

For each length: one train_step with the float32 store and one with the bf16 store on the same random
bf16 model and tokens; reports the relative error of the whole parameter gradient (norm over all
parameters) and the worst single parameter, and the KV-gradient store's size in each dtype.
"""

from __future__ import annotations

import argparse

import torch

from .. import train_step
from ..cli_flags import add_chunk
from ..core.model_shape import ModelShape
from ..core.schedule import release_cached_pool
from ..core.units import parse_tokens
from .config import BenchConfig
from .sweep import build_model


def _grads(model: torch.nn.Module, ids: torch.Tensor, chunk: int, grad_dtype: torch.dtype) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    train_step(model, ids, chunk_size=chunk, grad_dtype=grad_dtype)
    release_cached_pool(model)
    return [p.grad for p in model.parameters()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--lengths", default="32k,128k")
    add_chunk(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    shape = ModelShape.resolve(args.model)
    model = build_model(BenchConfig(model=args.model), torch.device("cuda"), torch.bfloat16)
    print(f"{args.model}, chunk {args.chunk}, {torch.cuda.get_device_name()}")
    print("| context | gradient rel. error, bf16 vs fp32 store | worst parameter | store fp32 (GiB) | store bf16 (GiB) |")
    print("|---:|---:|---|---:|---:|")
    for length in (parse_tokens(x) for x in args.lengths.split(",")):
        ids = torch.randint(0, shape.vocab, (1, length), device="cuda")
        want = [g.clone() for g in _grads(model, ids, args.chunk, torch.float32)]  # bf16, like param.grad
        got = _grads(model, ids, args.chunk, torch.bfloat16)
        diff2 = sum(float((g.float() - w.float()).pow(2).sum()) for g, w in zip(got, want))
        ref2 = sum(float(w.float().pow(2).sum()) for w in want)
        names = [n for n, _ in model.named_parameters()]
        worst = max(
            (float((g.float() - w.float()).norm() / w.float().norm()), n) for g, w, n in zip(got, want, names)
        )
        per_token = shape.kv_bytes_per_token(torch.float32) / 2**30
        print(f"| {length:,} | {(diff2 / ref2) ** 0.5:.2e} | {worst[1]} {worst[0]:.2e} | "
              f"{per_token * length:.1f} | {per_token * length / 2:.1f} |", flush=True)
        del want, got


if __name__ == "__main__":
    main()
