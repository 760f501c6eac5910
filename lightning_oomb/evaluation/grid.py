"""A RULER task x length grid on a model in memory: every sample decoded greedily over the engine's K/V pages
(``generate``), scored as RULER does, and the grid as a text table or a heatmap. ``lightning-oomb evaluate`` and
the Lightning layer's ``LongContextEvalCallback`` both run it, so a grid scores the same from either."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..core.units import human_tokens
from .generate import generate
from .ruler import Tokenizer, make_sample, score

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_grid(model: torch.nn.Module, tokenizer: Tokenizer, tasks: list[str], lengths: list[int], samples: int,
             seed: int, options: dict[str, Any], device: str | torch.device,
             progress: Callable[[str], None] | None = _stderr, chat: bool = False) -> dict:
    """Every task at every length (in tokens): ``samples`` prompts each, decoded greedily without gradients
    (the task's max_new_tokens, EOS of the tokenizer's or the model's), scored as RULER does. ``options``:
    ``generate``'s (a ``config=ChunkConfig`` and/or its fields). ``progress``: called with one line per task
    and length (None: silent). ``chat``: the prompts in the tokenizer's chat template (``ruler.compose``).
    Returns {task: {length: {"score": 0-100, "samples": [{tokens, references, prediction, new_tokens, seconds},
    ...]}}}: ``tokens`` the prompt's, ``new_tokens`` those generated (EOS included), ``seconds`` the wall time of
    its prefill and decoding."""
    eos = tokenizer.eos_token_id
    results: dict = {t: {} for t in tasks}
    total, done = len(tasks) * len(lengths), 0
    for n in lengths:
        for t in tasks:
            start = time.perf_counter()
            rows = []
            for i in range(samples):
                sample = make_sample(t, n, tokenizer, i, seed, chat)
                ids = torch.tensor([tokenizer.encode(sample.prompt, add_special_tokens=sample.add_special_tokens)],
                                   device=device)
                began = time.perf_counter()
                with torch.no_grad():
                    out = generate(model, ids, sample.max_new_tokens, eos_token_id=eos, **options)
                new = out[0, ids.shape[1]:].tolist()  # copies to the host, so the time includes the GPU's work
                seconds = time.perf_counter() - began
                prediction = tokenizer.decode(new, skip_special_tokens=True)
                rows.append(dict(tokens=ids.shape[1], references=sample.references, prediction=prediction,
                                 new_tokens=len(new), seconds=round(seconds, 3)))
            value = score(t, [r["prediction"] for r in rows], [r["references"] for r in rows])
            results[t][n] = dict(score=value, samples=rows)
            done += 1
            if progress is not None:
                prompts = f"{samples} sample" + "s" * (samples != 1)
                progress(f"[{done}/{total}] {t} at {human_tokens(n)}: {value:.1f} ({prompts}, "
                         f"{time.perf_counter() - start:.1f} s)")
    return results


def format_table(scores: dict[str, dict[str, float]], tasks: list[str], lengths: list[str]) -> str:
    """The scores (0-100) as a text table: a row per task, a column per length, and the tasks' mean."""
    head = ["task", *lengths]
    rows = [[t, *(f"{scores[t][n]:.1f}" for n in lengths)] for t in tasks]
    rows.append(["mean", *(f"{sum(scores[t][n] for t in tasks) / len(tasks):.1f}" for n in lengths)])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(head), *(line(r) for r in rows)])


def draw_grid(ax: Any, scores: dict[str, dict[str, float]], tasks: list[str], lengths: list[str],
              title: str = "") -> Any:
    """The scores (0-100) as a task x length heatmap on the matplotlib axes ``ax`` (0 red, 100 green), each
    cell labelled; returns the image (for a colorbar)."""
    grid = [[scores[t][n] for n in lengths] for t in tasks]
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(len(lengths)), lengths)
    ax.set_yticks(range(len(tasks)), tasks)
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("context length (tokens)")
    ax.set_title(title)
    return image


def grid_figure(scores: dict[str, dict[str, float]], tasks: list[str], lengths: list[str], title: str = "") -> Figure:
    """The heatmap of ``draw_grid`` as a matplotlib Figure (the Agg backend: no display needed), titled
    "RULER (no downloaded data): <title>"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 3, 0.45 * len(tasks) + 1.5))
    image = draw_grid(ax, scores, tasks, lengths, f"RULER (no downloaded data){': ' + title if title else ''}")
    fig.colorbar(image, ax=ax, label="score")
    fig.tight_layout()
    return fig


def heatmap(scores: dict[str, dict[str, float]], tasks: list[str], lengths: list[str], path: Path,
            title: str = "") -> None:
    """The grid of ``grid_figure`` written as a PNG to ``path``."""
    fig = grid_figure(scores, tasks, lengths, title)  # sets the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
