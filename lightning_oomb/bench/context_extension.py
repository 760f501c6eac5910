"""Context extension by fine-tuning: held-out passkey accuracy by length and step, from TensorBoard logs.

    python -m lightning_oomb.bench.context_extension RUNS_DIR --out DIR
    python -m lightning_oomb.bench.context_extension DIR/summary.json --out DIR   # redraw from a summary

``RUNS_DIR/<arm>-<seed>/version_0`` as ``docs/bench/context-extension-h200.sh`` writes them (``before``: the
pretrained model's ``lightning-oomb validate``). Writes ``summary.json``, ``summary.md`` and, with
matplotlib, ``accuracy.png`` to ``DIR`` (docs/benchmarks.md, "The measurement scripts").
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from ..core.units import human_tokens, parse_tokens
from .scalars import read_scalars

ACC = re.compile(r"^val/retrieval_acc_(\w+)$")


def read_run(folder: Path) -> dict:
    """Scalars of one TensorBoard run: {"acc": {length: [[step, acc], ...]}, "steps", "seconds", "loss"}."""
    acc: dict[int, list] = {}
    steps, loss, first, last = 0, None, None, None
    for tag, points in read_scalars(folder).items():
        match = ACC.match(tag)
        if match:
            acc.setdefault(parse_tokens(match.group(1)), []).extend([p.step, p.value] for p in points)
        elif tag == "train/loss" and points:
            steps, loss = max(p.step for p in points) + 1, points[-1].value
            first, last = points[0].wall_time, points[-1].wall_time
    return {"acc": {n: sorted(v) for n, v in sorted(acc.items())}, "steps": steps, "loss": loss,
            "seconds": (last - first) if first is not None else None}


def summarize(runs_dir: Path) -> dict:
    """{run name: read_run(...)} for every folder of ``runs_dir`` that holds TensorBoard events."""
    return {d.name: read_run(d) for d in sorted(runs_dir.iterdir())
            if d.is_dir() and next(d.rglob("events.out.tfevents.*"), None)}


def load_summary(path: Path) -> dict:
    """A ``summary.json`` as ``summarize`` returned it (JSON's string keys back to token counts)."""
    runs = json.loads(path.read_text())
    for run in runs.values():
        run["acc"] = {int(n): points for n, points in run["acc"].items()}
    return runs


def final_accuracy(run: dict) -> dict[int, float]:
    return {n: points[-1][1] for n, points in run["acc"].items() if points}


def table(summary: dict) -> str:
    """Markdown: one row per run (final accuracy at each length), then the mean of each arm."""
    lengths = sorted({n for run in summary.values() for n in run["acc"]})
    head = "| run | steps | training s | " + " | ".join(human_tokens(n) for n in lengths) + " |"
    rows = [head, "|" + "---|" * (3 + len(lengths))]
    arms: dict[str, list[dict]] = {}
    for name, run in summary.items():
        final = final_accuracy(run)
        arms.setdefault(re.sub(r"-\d+$", "", name), []).append(final)
        seconds = f"{run['seconds']:.0f}" if run["seconds"] else ""
        rows.append(f"| {name} | {run['steps']} | {seconds} | "
                    + " | ".join(f"{final[n]:.2f}" if n in final else "" for n in lengths) + " |")
    rows.append("")
    rows.append("| arm (mean over seeds) | runs | " + " | ".join(human_tokens(n) for n in lengths) + " |")
    rows.append("|" + "---|" * (2 + len(lengths)))
    for arm, finals in arms.items():
        cells = [f"{statistics.mean(f[n] for f in finals if n in f):.2f}" if any(n in f for f in finals) else ""
                 for n in lengths]
        rows.append(f"| {arm} | {len(finals)} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def plot(summary: dict, path: Path, train_length: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_length, by_step) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"before": "gray", "exact": "tab:blue", "nocross": "tab:orange", "short8k": "tab:green"}
    before = final_accuracy(summary["before"]).get(train_length) if "before" in summary else None
    for name, run in summary.items():
        arm = re.sub(r"-\d+$", "", name)
        color = colors.get(arm, "black")
        final = final_accuracy(run)
        label = arm if name.endswith("-0") or arm == name else None
        by_length.plot(list(final), list(final.values()), "o-", color=color, label=label, alpha=0.8)
        points = run["acc"].get(train_length, [])
        if points and arm != "before":
            steps = ([0] if before is not None else []) + [p[0] for p in points]
            values = ([before] if before is not None else []) + [p[1] for p in points]
            by_step.plot(steps, values, "o-", color=color, label=label, alpha=0.8)
    lengths = sorted({n for run in summary.values() for n in run["acc"]})
    by_length.set_xscale("log", base=2)
    by_length.set_xticks(lengths, [human_tokens(n) for n in lengths])
    by_length.set(xlabel="held-out length (tokens)", ylabel="passkey accuracy (whole answer)",
                  title="after training", ylim=(-0.03, 1.03))
    by_step.set(xlabel="step (0: the pretrained model)", ylabel=f"accuracy at {human_tokens(train_length)}",
                title="during training", ylim=(-0.03, 1.03))
    for ax in (by_length, by_step):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_oomb.bench.context_extension", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs_dir", type=Path, help="a folder of TensorBoard runs, or a summary.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train-length", type=parse_tokens, default=65536, help="the training length (64K)")
    args = parser.parse_args(argv)
    if args.runs_dir.suffix == ".json" and args.runs_dir.is_file():
        summary = load_summary(args.runs_dir)
    elif args.runs_dir.is_dir():
        summary = summarize(args.runs_dir)
    else:
        parser.error(f"{args.runs_dir} is neither a folder of runs nor a summary.json")
    if not summary:
        parser.error(f"{args.runs_dir} holds no TensorBoard runs")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.out.resolve() != args.runs_dir.resolve().parent:
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "summary.md").write_text(table(summary))
    try:
        plot(summary, args.out / "accuracy.png", args.train_length)
    except ImportError:
        print("matplotlib is not installed: no plot")
    print(table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
