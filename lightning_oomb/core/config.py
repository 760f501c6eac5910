"""How a step is computed, in two plain dataclasses: ``ChunkConfig`` (chunks, pages, attention backend,
checkpointing, where the pages live, what stage 1 keeps, the host memory budget) and ``SparseConfig``
(page-level sparse attention). Each field is declared, defaulted, documented and validated here, once:
``train_step`` and ``eval_loss`` take the fields as keywords, ``OOMBStrategy`` takes them as its arguments
with these defaults and documents them with this docstring (``option_docs``), and ``SparseCausalLMModule``
takes ``SparseConfig``'s fields with its defaults.
"""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from .errors import SetupError
from .units import parse_bytes

Attention = Literal["auto", "reference", "triton"]
Offload = Literal["auto", "gpu", "host"]
SparseScore = Literal["mean", "minmax"]
ATTENTIONS: tuple[str, ...] = get_args(Attention)
OFFLOADS: tuple[str, ...] = get_args(Offload)
SPARSE_SCORES: tuple[str, ...] = get_args(SparseScore)


# Packed documents (position_ids) under one page selection per chunk: refused at set-up and at step start.
PER_CHUNK_OVER_DOCUMENTS = (
    "SparseConfig(per_query_tile=False) (the default with offload='host') selects one page set per chunk, which "
    "packed documents cannot share; set per_query_tile: true (SparseConfig, or SparseCausalLMModule's argument) "
    "to select per query tile, or train without position_ids (document_masking: false)"
)


@dataclass(frozen=True, kw_only=True)
class SparseConfig:
    """Page-level sparse attention over the stored past; ``None`` where a config is taken means dense.

    budget_pages: past pages each query tile attends to (sinks and local window included). A query tile
        whose past has no more pages than this attends densely.
    sink_pages: the first pages of the sequence, always attended.
    local_pages: the pages just before the chunk, always attended (the chunk itself is always attended).
    score: "mean" (query . mean key of the page) or "minmax" (Quest's upper bound with per-page min/max).
    per_kv_head: True selects pages per (query tile, KV head); False one selection per query tile for all
        heads.
    per_query_tile: True selects pages per query tile of ``page_size`` queries; False one selection per
        chunk, by the mean query of all its tiles, that every tile attends to: a chunk then reads at most
        ``budget_pages`` distinct past pages per KV head, which bounds what layers with K/V pages in host
        memory gather for it (docs/architecture.md, "Host K/V pages for sparse steps"). Not with packed
        documents. None: decided by the ``ChunkConfig`` that holds it, from its ``offload``: False with
        "host" (every layer's K/V pages in host memory, where per-tile gathers grow with the past), True
        otherwise.
    """

    budget_pages: int = 64
    sink_pages: int = 1
    local_pages: int = 4
    score: SparseScore = "mean"
    per_kv_head: bool = True
    per_query_tile: bool | None = None

    def __post_init__(self):
        for name, low in (("budget_pages", 1), ("sink_pages", 0), ("local_pages", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise SetupError(f"SparseConfig.{name} must be an integer >= {low}, got {value!r}")
        if self.sink_pages + self.local_pages > self.budget_pages:
            raise SetupError(
                f"SparseConfig: sink_pages + local_pages ({self.sink_pages} + {self.local_pages}) must not exceed "
                f"budget_pages ({self.budget_pages})"
            )
        if self.score not in SPARSE_SCORES:
            raise SetupError(f"SparseConfig.score must be 'mean' or 'minmax', got {self.score!r}")
        if not isinstance(self.per_kv_head, bool):
            raise SetupError(f"SparseConfig.per_kv_head must be True or False, got {self.per_kv_head!r}")
        if self.per_query_tile is not None and not isinstance(self.per_query_tile, bool):
            raise SetupError(f"SparseConfig.per_query_tile must be True, False or None (decided by offload), got "
                             f"{self.per_query_tile!r}")

    @classmethod
    def coerce(cls, value: "SparseConfig | dict | None") -> "SparseConfig | None":
        """A SparseConfig from itself, a dict of its fields (as a YAML config gives it) or None (dense)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise SetupError(
                    f"sparse: unknown option(s) {', '.join(sorted(unknown))}; "
                    f"known: {', '.join(cls.__dataclass_fields__)}"
                )
            return cls(**value)
        raise TypeError(f"sparse must be a SparseConfig, a dict of its fields or None, got {type(value).__name__}")

    def attended_past_tokens(self, page_size: int) -> int:
        """Most past tokens one query attends to."""
        return self.budget_pages * page_size


@dataclass(frozen=True, kw_only=True)
class ChunkConfig:
    """How a sequence is cut and computed.

    Args:
        chunk_size: tokens per chunk (activation memory is that of one chunk).
        page_size: tokens per page of the KV store.
        attention: "auto" (Triton on CUDA, reference elsewhere), "reference" or "triton". The Triton kernels
            cover attention and the fused RMSNorm, RoPE and SwiGLU ops swapped in for the step
            (lightning_oomb.kernels; the same functions, rounded once instead of after every elementwise op).
        checkpoint_layers: checkpoint each decoder layer inside a chunk's stage-2 forward.
        cross_chunk_gradients: False drops the gradient that later chunks send to earlier chunks' K, V
            (an ablation: training then no longer follows the full-sequence gradient).
        grad_dtype: dtype of the KV-gradient store, "float32" or "bfloat16" (or the torch dtype): bfloat16
            halves its memory, each chunk's contribution rounded to bf16 as it is added (docs/benchmarks.md).
        sparse: None (dense attention) or a ``SparseConfig`` (or a dict of its fields): page-level sparse
            attention over the past (lightning_oomb.core.sparse). Its ``per_query_tile`` None is decided here:
            one selection per chunk with offload="host", per query tile otherwise.
        offload: where the K/V and KV-gradient pages live: "gpu", "host" (pinned host memory, streamed through
            the GPU: GPU memory flat in the context length) or "auto" (the GPU when the step fits there, else the
            host; lightning_oomb.core.placement.place_step).
        segment_tokens: with offload, tokens per sequence of each streamed segment; None: chosen from the GPU
            memory the step leaves free (on a CPU device: one chunk).
        keep_attention: stage 1 keeps the attention outputs (and log-sum-exps) of the last that many chunks
            before those whose graphs it keeps (``keep_graphs``) for stage 2, which then skips their attention
            forward: the same numbers, one attention pass less per kept chunk, at the memory of one query tensor
            per layer and chunk. None: as many as fit in half the GPU memory the step leaves free, none when
            pages live in host memory or on a CPU device; then, when that leaves chunks to recompute, the
            outputs of the first chunks in pinned host memory, as many as fit in what the host memory budget
            leaves (``host_memory``; lightning_oomb.core.kept_attention).
        keep_graphs: stage 1 runs the last that many chunks with autograd and keeps their graphs; stage 2
            starts with their backward and recomputes only the chunks before them: the same numbers, one forward
            less per kept graph. The last chunk's graph costs no memory (stage 2 would hold it next), each
            other one a chunk's activations. None: the last chunk's, plus as many as fit in
            core.plan.assumptions.KEPT_GRAPHS_SHARE of the GPU memory left free after the kept attention outputs; none when
            pages live in host memory or layers are checkpointed.
        host_memory: the run's host memory budget, bytes (a whole number, 128e9 too) or a size with its unit such
            as "100GiB": what the training process may hold in host memory in all, its own resident set and every
            pinned page included. None: what it holds when the step is placed plus what the machine has
            available, less max(8 GiB, 10% of the RAM) or half of what is available if less
            (lightning_oomb.core.host_memory).
            Every pinned block a step makes is decided against it before any is made; a step that cannot fit is
            refused.
        gpu_memory: the run's GPU memory budget, bytes or a size with its unit such as "24GiB": every step is
            placed against it as against a card of that size (a shared GPU, or planning for a smaller card on a
            larger one). OOMBStrategy also holds the process's allocations to it
            (torch.cuda.set_per_process_memory_fraction). None: the device's free memory.
    """

    chunk_size: int = 4096
    page_size: int = 128
    attention: Attention = "auto"
    checkpoint_layers: bool = False
    cross_chunk_gradients: bool = True
    grad_dtype: torch.dtype | str = "float32"
    sparse: SparseConfig | None = None
    offload: Offload = "auto"
    segment_tokens: int | None = None
    keep_attention: int | None = None
    keep_graphs: int | None = None
    host_memory: int | float | str | None = None
    gpu_memory: int | float | str | None = None

    def __post_init__(self):
        object.__setattr__(self, "sparse", SparseConfig.coerce(self.sparse))
        if self.sparse is not None and self.sparse.per_query_tile is None:
            object.__setattr__(self, "sparse", dataclasses.replace(self.sparse,
                                                                   per_query_tile=self.offload != "host"))
        for name in ("host_memory", "gpu_memory"):
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                object.__setattr__(self, name, int(value))
            if isinstance(value, str):
                try:
                    object.__setattr__(self, name, parse_bytes(value))
                except ValueError as e:
                    raise SetupError(f"{name}: {e}") from None
        dtype = getattr(torch, self.grad_dtype) if isinstance(self.grad_dtype, str) else self.grad_dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise SetupError(f"grad_dtype must be float32 or bfloat16, got {self.grad_dtype!r}")
        object.__setattr__(self, "grad_dtype", dtype)
        for name in ("chunk_size", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SetupError(f"{name} must be an integer >= 1, got {value!r}")
        if self.attention not in ATTENTIONS:
            raise SetupError(f"attention must be 'auto', 'reference' or 'triton', got {self.attention!r}")
        if self.offload not in OFFLOADS:
            raise SetupError(f"offload must be one of {', '.join(map(repr, OFFLOADS))}, got {self.offload!r}")
        if self.segment_tokens is not None and (
            isinstance(self.segment_tokens, bool) or not isinstance(self.segment_tokens, int) or self.segment_tokens < 1
        ):
            raise SetupError(f"segment_tokens must be None or an integer >= 1, got {self.segment_tokens!r}")
        for name in ("keep_attention", "keep_graphs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise SetupError(f"{name} must be None or an integer >= 0, got {value!r}")
        for name in ("host_memory", "gpu_memory"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise SetupError(f"{name} must be None or a number of bytes >= 1, got {value!r}")
        if self.keep_graphs and self.checkpoint_layers:
            raise SetupError(
                "keep_graphs keeps whole chunks' activations from stage 1, which checkpoint_layers=True exists to "
                "avoid; set keep_graphs=None (or 0)"
            )

    @classmethod
    def build(cls, config: "ChunkConfig | None" = None, **options: Any) -> "ChunkConfig":
        """``config`` (None: every field's default) with the fields named in ``options`` replaced; an unknown
        name is refused with the known ones."""
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise SetupError(f"unknown step option(s) {', '.join(sorted(unknown))}; the options are ChunkConfig's "
                             f"fields: {', '.join(cls.__dataclass_fields__)}")
        return cls(**options) if config is None else dataclasses.replace(config, **options)


def option_defaults(cls: type) -> dict[str, Any]:
    """The declared default of each field of the dataclass ``cls``, by name, as written (grad_dtype "float32")."""
    return {f.name: f.default for f in dataclasses.fields(cls)}


def option_docs(cls: type) -> str:
    """The "Args:" section of the dataclass ``cls``'s docstring: its fields' documentation, for the docstring
    of an entry point that takes them as arguments (the Lightning CLI's help reads it there)."""
    doc = textwrap.dedent(cls.__doc__.split("\n", 1)[1])
    return doc[doc.index("Args:"):].rstrip() + "\n"
