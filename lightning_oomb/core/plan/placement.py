"""Where a step's pages live and what stage 1 keeps for stage 2, decided from the bytes the GPU and the host
have room for. The run's placement (``core.placement.place_step``: measured free memory) and the planner
(``search.plan``: the plan's memory less its reserve) both decide here (docs/planner.md, "Host memory")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..model_shape import _kv_dtype
from ..units import GIB
from .assumptions import KEPT_ATTENTION_SHARE, KEPT_GRAPHS_SHARE, PLACEMENT_HEADROOM_SHARE
from .config import Pages
from .memory import graph_chunk_bytes, kept_chunk_bytes
from .report import Plan, PlanError


@dataclass(frozen=True)
class PagesPlaced:
    """The decision: ``pages``, and where a step computing its loss in stage 1 keeps each chunk's dL/dh until
    stage 2 (``loss_grads``: "gpu", "host", or "recomputed": not kept). ``fits``: False when no choice fits;
    ``pages`` is then the first choice that fits the GPU (else the last), keeping its dL/dh."""

    pages: Pages
    loss_grads: str
    fits: bool


def host_layer_counts(n_layers: int) -> list[tuple[int, int]]:
    """(host gradient layers, host K/V layers) in the order a sparse step moves pages to the host: the
    KV-gradient pages first, layer by layer, then, with all of those there, the K/V pages."""
    return [(n, 0) for n in range(n_layers + 1)] + [(n_layers, m) for m in range(1, n_layers + 1)]


def page_choices(offload: str, sparse: bool, n_layers: int) -> list[Pages]:
    """The placements of a step's pages that ``offload`` ("gpu", "auto", "host") allows, in the order they are
    tried: fewest pages on the host first. Dense: every page on the GPU or every page streamed; sparse: the
    pages of whole layers (``host_layer_counts``), of none ("gpu") or all ("host"). ``n_layers``: the layers
    whose pages may go to the host (sparse: those without a sliding window, ``ModelShape.full_kv_layers``). With
    none (pure state-space models; every layer windowed, sparse) there is nothing to place: only "on the GPU"."""
    if not n_layers:
        return [Pages()]
    if sparse:
        every = Pages(host_grad_layers=n_layers, host_kv_layers=n_layers)
        by_layers = [Pages(host_grad_layers=n, host_kv_layers=m) for n, m in host_layer_counts(n_layers)]
        return {"gpu": [Pages()], "auto": by_layers, "host": [every]}[offload]
    return {"gpu": [Pages()], "auto": [Pages(), Pages(streamed=True)], "host": [Pages(streamed=True)]}[offload]


def place_pages(choices: Sequence[Pages], needs: Callable[[Pages], tuple[int, float]], gpu_room: float,
                host_room: float, loss_grad_bytes: int = 0) -> PagesPlaced:
    """The first of ``choices`` whose step fits, and where its kept dL/dh go.

    ``needs(pages)``: (GPU bytes, pinned host bytes) the step needs with those pages, without kept dL/dh;
    ``gpu_room``, ``host_room``: what the GPU and the host have for them (bytes). ``loss_grad_bytes``: every
    chunk's dL/dh a step computing its loss in stage 1 keeps: on the GPU when no page is on the host and they
    fit there, else pinned. Only where keeping them fits under no choice are they recomputed in stage 2.
    """
    seen: dict[Pages, tuple[int, float]] = {}

    def need(pages: Pages) -> tuple[int, float]:
        if pages not in seen:
            seen[pages] = needs(pages)
        return seen[pages]

    for recomputed in (False, True) if loss_grad_bytes else (False,):
        kept = 0 if recomputed else loss_grad_bytes
        for pages in choices:
            gpu, pinned = need(pages)
            on_host = pages.on_host or gpu + kept > gpu_room
            if gpu <= gpu_room and pinned + (kept if on_host else 0) <= host_room:
                return PagesPlaced(pages, "recomputed" if recomputed else "host" if on_host else "gpu", True)
    fallback = next((pages for pages in choices if need(pages)[0] <= gpu_room), choices[-1])
    gpu = need(fallback)[0]
    on_gpu = not fallback.on_host and gpu + loss_grad_bytes <= gpu_room
    return PagesPlaced(fallback, "gpu" if on_gpu else "host", False)


def keepable_chunks(spare_bytes: float, chunk_bytes: int, n_chunks: int, share: float = KEPT_ATTENTION_SHARE) -> int:
    """Chunks of ``chunk_bytes`` each (attention outputs, or with KEPT_GRAPHS_SHARE autograd graphs) a step keeps
    by default when ``spare_bytes`` of GPU memory are left beyond it: those that fit in ``share`` of them, at
    most ``n_chunks``. None of ``chunk_bytes`` 0: a model that attends nowhere has no attention outputs."""
    if chunk_bytes <= 0:
        return 0
    return min(n_chunks, int(share * max(0.0, spare_bytes)) // chunk_bytes)


def asked_graphs(n_chunks: int, checkpoint_layers: bool, keep_graphs: int | None) -> int:
    """Autograd graphs stage 1 keeps before any share of spare memory: none with layer checkpointing, else
    ``keep_graphs`` or (None) the last chunk's, which costs nothing (stage 2 would hold it next)."""
    return 0 if checkpoint_layers else min(n_chunks, 1 if keep_graphs is None else keep_graphs)


def kept_for_stage_2(
    step: Plan, spare_bytes: float, keep_attention: int | None = None, keep_graphs: int | None = None
) -> tuple[int, int]:
    """(attention outputs, autograd graphs) of chunks stage 1 keeps for stage 2 in ``step`` with every page on
    the GPU, when ``spare_bytes`` are free beyond its plan (which keeps neither): those asked for (PlanError
    when they do not fit), else the last chunk's graph (it costs nothing), attention outputs in
    KEPT_ATTENTION_SHARE of the spare memory and more graphs in KEPT_GRAPHS_SHARE of what is left. No graphs
    with layer checkpointing; the chunks with graphs need no kept outputs."""
    c = step.config
    n = c.n_chunks
    per_output = kept_chunk_bytes(step.shape, c.chunk_tokens, _kv_dtype(c.precision))
    per_graph = graph_chunk_bytes(step.shape, c)
    graphs = asked_graphs(n, c.checkpoint_layers, keep_graphs)
    graph_bytes = max(0, graphs - 1) * per_graph
    if keep_attention is None:
        kept = keepable_chunks(spare_bytes - graph_bytes, per_output, n)
    else:
        kept = min(keep_attention, n)
    left = spare_bytes - graph_bytes - kept * per_output
    if left < 0:
        raise PlanError(
            f"keep_attention={keep_attention} and keep_graphs={keep_graphs} need {graph_bytes / GIB:.2f} GiB for "
            f"kept graphs and {kept * per_output / GIB:.2f} GiB for the attention outputs of {kept} chunks, but "
            f"{spare_bytes / GIB:.2f} GiB are free beyond the step and a {PLACEMENT_HEADROOM_SHARE:.0%} reserve; "
            "nothing was allocated for it. None keeps as many as fit"
        )
    if keep_graphs is None and graphs:
        graphs += keepable_chunks(left, per_graph, n - graphs, KEPT_GRAPHS_SHARE)
    return min(kept, n - graphs), graphs


def host_kept_for_stage_2(step: Plan, host_spare_bytes: float, kept: int, graphs: int,
                          keep_attention: int | None = None) -> int:
    """First chunks whose attention outputs stage 1 keeps in pinned host memory for ``step`` when it keeps
    ``kept`` chunks' outputs and ``graphs`` graphs on the GPU and the host memory budget has
    ``host_spare_bytes`` left beyond everything else the run holds: as many whole chunks as fit there and
    stage 2 would recompute (keep_attention=None), else none."""
    c = step.config
    if keep_attention is not None:
        return 0
    whole = c.context // c.chunk_size  # a shorter last chunk has other shapes
    per_output = kept_chunk_bytes(step.shape, c.chunk_tokens, _kv_dtype(c.precision))
    return keepable_chunks(host_spare_bytes, per_output, min(whole, c.n_chunks - kept - graphs), 1.0)
