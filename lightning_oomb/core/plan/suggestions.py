"""What would make a step fit, or run faster: single changes with their plans, and all of them together."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..config import SparseConfig
from .config import SHARDINGS, PlanConfig
from .report import Plan, Suggestion

MIN_SUGGESTED_CHUNK = 256  # tokens: the smallest chunk suggested; below it matmuls get too thin to keep the GPU busy


def suggestions_for(result: Plan, estimate: Callable[[PlanConfig], Plan],
                    fewest_on_host: Callable[[PlanConfig], Plan]) -> list[Suggestion]:
    """Single changes that make the step fit (each with its numbers); all of them together when no single one
    does; sparse attention when attention dominates the step's FLOPs."""
    c = result.config
    found: list[Suggestion] = []
    if not result.fits:
        if not c.checkpoint_layers:
            found.append(Suggestion("layer checkpointing", estimate(c.checkpointed(True)),
                                    "--checkpoint-layers on", "checkpoint_layers=True"))
        halvings = []
        chunk = min(c.chunk_size, c.context) // 2
        while chunk >= MIN_SUGGESTED_CHUNK:
            halvings.append(chunk)
            chunk //= 2
        if halvings:
            # Memory falls with the chunk: the first halving that fits is the largest; if none does, the half.
            plans = (estimate(c.replace(chunk_size=k)) for k in halvings)
            smaller = next((p for p in plans if p.fits), None)
            smaller = smaller or estimate(c.replace(chunk_size=halvings[0]))
            k = smaller.config.chunk_size
            found.append(Suggestion("smaller chunks", smaller, f"--chunk {k}", f"chunk_size={k}"))
        if c.precision != "bf16-true":
            found.append(Suggestion("bf16 parameters and optimizer state",
                                    estimate(c.replace(precision="bf16-true")),
                                    "--precision bf16-true", "precision='bf16-true'"))
        if c.lora_rank == 0 and c.tensor_parallel == 1:  # LoRA under tensor parallel is not built
            found.append(Suggestion("LoRA rank 16 on q, k, v, o", estimate(c.replace(lora_rank=16)),
                                    "--lora-rank 16", "lora_rank=16"))
        if c.grad_dtype != torch.bfloat16:
            found.append(Suggestion("bf16 KV-gradients", estimate(c.replace(grad_dtype=torch.bfloat16)),
                                    "--grad-dtype bfloat16", "grad_dtype=torch.bfloat16"))
        if c.sparse:
            hosted = fewest_on_host(c)
            h = hosted.config
            if (h.host_grad_layers, h.host_kv_layers) != (c.host_grad_layers, c.host_kv_layers):
                found.append(Suggestion(
                    f"KV-gradient pages of {h.host_grad_layers} layers in pinned host memory"
                    + (f", K/V pages of {h.host_kv_layers}" if h.host_kv_layers else ""), hosted,
                    "--offload auto", "offload='auto'"))
        elif not c.streamed:
            found.append(Suggestion("K/V and KV-gradient pages in pinned host memory, streamed",
                                    estimate(c.replace(streamed=True)), "--offload host", "offload='host'"))
        stronger = SHARDINGS[SHARDINGS.index(c.sharding) + 1:] if c.devices > 1 else ()
        stronger = [mode for mode in stronger if mode != "zero1"]  # zero1 holds every gradient whole, in float32
        if stronger:
            # The least sharding that fits (the more it shards, the more it gathers); else the most.
            plans = (estimate(c.replace(sharding=mode)) for mode in stronger)
            sharded = next((p for p in plans if p.fits), None) or estimate(c.replace(sharding="zero3"))
            mode = sharded.config.sharding
            found.append(Suggestion(f"oomb_model_parallel: the decoder layers sharded over the {c.devices} ranks, "
                                    f"{mode}", sharded, f"--sharding {mode}", f"sharding={mode!r}"))
        if found and not any(x.plan.fits for x in found):
            combined = c
            for x in found:  # every change at once; of the chunk sizes the smallest
                changed = _changes(c, x.plan.config)
                if "chunk_size" in changed:
                    changed["chunk_size"] = min(changed["chunk_size"], combined.chunk_size)
                combined = combined.replace(**changed)
            if len(found) > 1:
                found.append(Suggestion("all of the above together", estimate(combined),
                                        " ".join(x.cli for x in found), ", ".join(x.python for x in found)))
    per_chunk = _one_selection_per_chunk(result, fewest_on_host)
    if per_chunk is not None:
        found.append(per_chunk)
    larger = _larger_chunks(result, estimate)
    if larger is not None:
        found.append(larger)
    t = result.time
    if t.attention_flops > t.linear_flops and not c.sparse:
        config = SparseConfig()
        sparse = estimate(c.replace(sparse=config, streamed=False))
        if c.streamed:  # sparse moves the fewest layers' pages to host memory, gradient pages first
            sparse = fewest_on_host(sparse.config)
        # A step that does not fit here is no suggestion, nor one that is not a tenth faster (on a tiny model the
        # selection costs more than the attention it skips).
        if sparse.fits and sparse.time.predicted_s <= 0.9 * t.predicted_s:
            found.append(Suggestion(
                f"page-level sparse attention: at most {config.attended_past_tokens(c.page_size):,} past tokens per "
                "query", sparse, f"--budget-pages {config.budget_pages}",
                f"sparse=SparseConfig(budget_pages={config.budget_pages})", goal="time"))
    return found


def _larger_chunks(result: Plan, estimate: Callable[[PlanConfig], Plan]) -> Suggestion | None:
    """When the GPU waits for the host's kernel launches for a tenth of a fitting step (a small model in small
    chunks): the fastest of the larger chunk sizes (doubling up to the context) that still fits, if it saves a
    tenth."""
    c, t = result.config, result.time
    if not result.fits or t.launch_s < 0.1 * t.predicted_s:
        return None
    best = result
    chunk = c.chunk_size * 2
    while chunk < 2 * c.context:
        candidate = estimate(c.replace(chunk_size=min(chunk, c.context)))
        if not candidate.fits:
            break
        if candidate.time.predicted_s < best.time.predicted_s:
            best = candidate
        chunk *= 2
    if best.time.predicted_s > 0.9 * t.predicted_s:
        return None
    k = best.config.chunk_size
    return Suggestion("larger chunks: fewer, larger kernels, so that the GPU waits less for the host to launch "
                      "them", best, f"--chunk {k}", f"chunk_size={k}", goal="time")


def _one_selection_per_chunk(result: Plan, fewest_on_host: Callable[[PlanConfig], Plan]) -> Suggestion | None:
    """With host K/V layers and a selection per query tile, whose gathers grow with the past: one selection per
    chunk (another sparse pattern: every tile of a chunk attends to the same pages), which bounds a chunk's
    gather to ``budget_pages`` per KV head, when it makes a step fit that does not, or saves a tenth of one
    that does."""
    c = result.config
    if not (c.sparse and c.sparse.per_query_tile and c.host_kv_layers):
        return None
    other = fewest_on_host(c.replace(sparse=dataclasses.replace(c.sparse, per_query_tile=False)))
    if not other.fits or (result.fits and other.time.predicted_s > 0.9 * result.time.predicted_s):
        return None
    b = c.sparse.budget_pages
    return Suggestion(f"one page selection per chunk: a host K/V layer gathers at most {b} pages per KV head "
                      "for it (every query tile of a chunk then attends to the same pages)", other,
                      "--selection chunk", "sparse=SparseConfig(..., per_query_tile=False)",
                      goal="memory" if not result.fits else "time")


def _changes(before: PlanConfig, after: PlanConfig) -> dict[str, Any]:
    """The fields, by name (ChunkConfig's, Pages' and PlanConfig's, as ``PlanConfig.replace`` takes them), in
    which ``after`` differs from ``before``."""
    changed: dict[str, Any] = {}
    for part in ("chunk", "pages", None):
        old, new = (before, after) if part is None else (getattr(before, part), getattr(after, part))
        for f in dataclasses.fields(old):
            if f.name not in ("chunk", "pages") and getattr(new, f.name) != getattr(old, f.name):
                changed[f.name] = getattr(new, f.name)
    return changed
