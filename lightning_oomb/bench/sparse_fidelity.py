"""How close page-level sparse attention is to dense, on a model that has learned to use a long context.

    python -m lightning_oomb.bench.sparse_fidelity --config examples/passkey_cpu.yaml --page-size 16 \\
        --out docs/bench/cpu-sparse-fidelity.md

Random weights attend almost uniformly, so this first trains the demo's model densely on its passkey task;
then it compares the sparse gradient with the dense one for each budget (--budget-pages), score and selection,
and trains the same model sparsely (--train-budget-pages) to compare held-out accuracy. Runs on the CPU in minutes
and writes a markdown report (docs/benchmarks.md, "The measurement scripts").
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from pathlib import Path

import torch
import yaml
from lightning.pytorch import Trainer

from .. import train_step
from ..cli_flags import add_page_size
from ..core.config import SparseConfig
from ..core.schedule import cached_pool, release_cached_pool
from ..core.units import argparse_type
from ..lightning import OOMBStrategy, PasskeyDataModule
from ..lightning.module import CausalLMModule
from ..lightning.sparse import SparseCausalLMModule


def _train(module, data: PasskeyDataModule, steps: int, chunk_size: int, page_size: int) -> float:
    """Fit ``module`` for ``steps`` steps under OOMBStrategy; returns the held-out retrieval accuracy."""
    trainer = Trainer(
        accelerator="cpu", max_steps=steps, strategy=OOMBStrategy(chunk_size=chunk_size, page_size=page_size),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(module, datamodule=data)
    trainer.limit_val_batches = 1.0
    return float(trainer.validate(module, datamodule=data, verbose=False)[0]["val/retrieval_acc"])


def _gradient(model, ids, labels, chunk_size: int, page_size: int, sparse) -> tuple[torch.Tensor, float, float]:
    """(the gradient of all parameters, float64; the loss; past pages gathered per attention call, sparse)."""
    model.zero_grad(set_to_none=True)
    release_cached_pool(model)
    loss = train_step(model, ids, labels, chunk_size=chunk_size, page_size=page_size, sparse=sparse,
                      offload="host" if sparse else "gpu")
    flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    staging = cached_pool(model).kv_staging
    per_call = staging.pages_staged / staging.calls if staging is not None and staging.calls else 0.0
    release_cached_pool(model)
    return flat.double(), float(loss), per_call  # float64: cosines of ~1 - 1e-6 must not round past 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="examples/passkey_cpu.yaml")
    add_page_size(parser, default=16)  # the demo's sequences are short: pages of 16 give a past of many pages
    parser.add_argument("--budget-pages", type=argparse_type(int, many=True), default=(8, 16, 32, 64, 128, 256),
                        metavar="PAGES,...", help="the sparse budgets compared, past pages per query tile")
    parser.add_argument("--sequences", type=int, default=4, help="held-out sequences the gradients are averaged over")
    parser.add_argument("--train-budget-pages", type=int, default=16, metavar="PAGES",
                        help="budget of the sparse-trained model (past pages per query tile)")
    parser.add_argument("--train-score", choices=("mean", "minmax"), default="mean",
                        help="page score of the sparse-trained model")
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="KV heads of the model (default: the YAML's; must divide its query heads); per-head and "
                        "shared selection differ only with more than one KV head")
    parser.add_argument("--out", type=Path, default=Path("sparse-fidelity.md"))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    cfg = yaml.safe_load(Path(args.config).read_text())
    chunk_size = cfg["trainer"]["strategy"]["init_args"]["chunk_size"]
    steps = cfg["trainer"]["max_steps"]
    model_args = dict(cfg["model"])
    if args.kv_heads:
        model_args["config"] = {**model_args["config"], "num_key_value_heads": args.kv_heads}
    data_args = cfg["data"]["init_args"]
    torch.manual_seed(cfg.get("seed_everything", 0))

    def data() -> PasskeyDataModule:
        return PasskeyDataModule(**data_args)

    print(f"training the dense model: {steps} steps of {data_args['seq_len']} tokens", flush=True)
    dense = CausalLMModule(**model_args)
    dense_acc = _train(dense, data(), steps, chunk_size, args.page_size)
    print(f"  dense held-out retrieval accuracy {dense_acc:.2f} ({time.perf_counter() - started:.0f} s)", flush=True)

    held_out = data()
    batch = [held_out.val_set[i] for i in range(args.sequences)]
    model = dense.model
    rows = []
    dense_grads = [_gradient(model, b["input_ids"][None], b["labels"][None], chunk_size, args.page_size, None)
                   for b in batch]
    selections = {"per KV head": dict(per_kv_head=True), "shared": dict(per_kv_head=False),
                  "per chunk, per KV head": dict(per_kv_head=True, per_query_tile=False)}
    for budget in args.budget_pages:
        for score in ("mean", "minmax"):
            for name, selection in selections.items():
                sparse = SparseConfig(budget_pages=budget, score=score, **selection)
                cos, err, loss_err, gathered = [], [], [], []
                for b, (g_dense, l_dense, _) in zip(batch, dense_grads):
                    g, loss, per_call = _gradient(model, b["input_ids"][None], b["labels"][None], chunk_size,
                                                  args.page_size, sparse)
                    cos.append(float(torch.nn.functional.cosine_similarity(g, g_dense, dim=0)))
                    err.append(float((g - g_dense).norm() / g_dense.norm()))
                    loss_err.append(abs(loss - l_dense) / abs(l_dense))
                    gathered.append(per_call)
                n = len(cos)
                rows.append((budget, score, name, sum(cos) / n, min(cos), sum(err) / n, max(err),
                             sum(loss_err) / n, sum(gathered) / n))
                print(f"  budget {budget:4d} {score:6s} {name:22s} cosine {rows[-1][3]:.5f} "
                      f"rel. error {rows[-1][5]:.4f} pages per call {rows[-1][8]:.1f}", flush=True)

    print(f"training the sparse model (budget {args.train_budget_pages} pages)", flush=True)
    torch.manual_seed(cfg.get("seed_everything", 0))
    sparse_module = SparseCausalLMModule(**model_args, budget_pages=args.train_budget_pages,
                                         sparse_score=args.train_score)
    sparse_acc = _train(sparse_module, data(), steps, chunk_size, args.page_size)
    print(f"  sparse held-out retrieval accuracy {sparse_acc:.2f}", flush=True)

    seq_len = data_args["seq_len"]
    pages = seq_len // args.page_size
    table = ["| budget (pages) | score | selection | cosine (mean) | cosine (min) | rel. error (mean) "
             "| rel. error (max) | loss rel. error | past pages per attention call |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    table += [f"| {b} | {s} | {h} | {c:.5f} | {cmin:.5f} | {e:.4f} | {emax:.4f} | {le:.2e} | {g:.1f} |"
              for b, s, h, c, cmin, e, emax, le, g in rows]
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        f"# Sparse attention fidelity on a trained passkey model\n\n- machine: {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}\n- date: {date}\n"
        f"- command: `python -m lightning_oomb.bench.sparse_fidelity --config {args.config} --page-size {args.page_size} "
        f"--budget-pages {','.join(map(str, args.budget_pages))} --sequences {args.sequences} "
        f"--train-budget-pages {args.train_budget_pages} "
        f"--train-score {args.train_score}"
        f"{f' --kv-heads {args.kv_heads}' if args.kv_heads else ''}`\n"
        f"- model and task: `{args.config}` ({steps} steps, sequences of {seq_len} tokens, chunks of {chunk_size}), "
        f"pages of {args.page_size} tokens ({pages} pages per sequence; a chunk's past has up to "
        f"{(seq_len - chunk_size) // args.page_size}), sink 1 page, local window 4 pages; float32, reference attention\n"
        f"- wall time: {time.perf_counter() - started:.0f} s\n\n"
        f"Gradient of all parameters, sparse against dense, over {args.sequences} held-out sequences of the dense-trained "
        f"model; the last column is the mean over a step's attention calls of the distinct past pages the chunk's "
        f"selections name (what a layer with K/V pages in host memory gathers for the call):\n\n"
        + "\n".join(table) + "\n\n"
        f"Held-out retrieval accuracy ({len(held_out.val_set)} sequences): dense-trained {dense_acc:.2f}, "
        f"sparse-trained (budget {args.train_budget_pages} pages, score {args.train_score}, per KV head) {sparse_acc:.2f}.\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
