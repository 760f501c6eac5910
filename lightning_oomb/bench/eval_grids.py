"""The RULER grids a ``LongContextEvalCallback`` logged, side by side: its first evaluation and its last.

    python -m lightning_oomb.bench.eval_grids RUN_DIR --out grids.png [--prefix eval]

RUN_DIR: a TensorBoard run folder (searched recursively for event files) holding ``<prefix>/<task>/<length>``
scalars (fractions in [0, 1]). Prints each grid as ``lightning-oomb evaluate`` prints its table (scores 0-100)
and writes the two heatmaps into one PNG (needs matplotlib).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..core.units import parse_tokens
from ..evaluation.grid import draw_grid, format_table
from ..evaluation.ruler import TASKS
from .scalars import read_scalars


def read_grids(run: Path, prefix: str = "eval") -> dict[int, dict[str, dict[str, float]]]:
    """{step: {task: {length label: score 0-100}}} of every evaluation logged under ``run``."""
    grids: dict[int, dict[str, dict[str, float]]] = {}
    for tag, points in read_scalars(run).items():
        parts = tag.split("/")
        if len(parts) != 3 or parts[0] != prefix or parts[1] not in TASKS:
            continue
        for e in points:
            grids.setdefault(e.step, {}).setdefault(parts[1], {})[parts[2]] = 100 * e.value
    return grids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a TensorBoard run folder")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--prefix", default="eval", help="the callback's prefix (default eval)")
    args = parser.parse_args(argv)
    grids = read_grids(args.run, args.prefix)
    if not grids:
        parser.error(f"{args.run} holds no {args.prefix}/<task>/<length> scalars of LongContextEvalCallback")
    steps = sorted(grids)[:: max(len(grids) - 1, 1)]  # the first evaluation and the last
    tasks = [t for t in TASKS if t in grids[steps[0]]]
    lengths = sorted(grids[steps[0]][tasks[0]], key=parse_tokens)
    for step in steps:
        print(f"step {step}\n{format_table(grids[step], tasks, lengths)}\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(steps), figsize=(1.1 * len(lengths) * len(steps) + 4, 0.45 * len(tasks) + 1.6),
                             squeeze=False)
    for ax, step in zip(axes[0], steps):
        image = draw_grid(ax, grids[step], tasks, lengths, f"step {step}")
    for ax in axes[0][1:]:
        ax.set_yticks([])
    fig.colorbar(image, ax=list(axes[0]), label="RULER score")
    fig.savefig(args.out, dpi=80, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
