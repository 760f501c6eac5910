"""The two-stage chunk-recurrent schedule (docs/architecture.md, "The algorithm in one page").

Stage 1 (fill, no autograd but for the last chunks, whose graphs it keeps: ``keep_graphs``): chunks
0..C-1 run forward; every attention layer writes the chunk's post-RoPE K, V into the paged store and attends
over everything stored so far. Where the chunk's last hidden state is not used there (no loss, kept graph or
logits), the forward ends at the last layer's store: the rest only feeds the output layer.
Stage 2 (backward): chunks C-1..0 re-run forward with autograd (those with a kept graph need not);
attention reads the past from the store as constants; the chunk's loss gradient dL/dh is backpropagated
through the decoder, which adds the past's dK, dV into the store and hands the chunk's own K, V their
complete gradient (later chunks ran first). The output layer's gradient is summed over chunks in float32
and delivered once at the end. Summed over chunks, the parameter gradients are those of full-sequence
training. Stage 1 may keep attention outputs for stage 2, which then skips those attention forwards: of the
chunks just before the kept graphs on the GPU, of the first chunks in pinned host memory. With layer
checkpointing, a layer's recompute in stage 2 takes the attention outputs of the chunk's stage-2 forward.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..integrations.decoder import decoder_of
from ..integrations.router_balance import RouterBalance
from ..integrations.support import check_supported
from ..integrations.transformers import bind, causal_lm, decoder_layers, head_input, layer_windows, logit_head
from ..kernels.page_table import LayerStore, StoreSpec
from ..recurrent import border_state_bytes, carried_layers
from ..recurrent.layer_kinds import kv_layer_indices
from ..recurrent.states import ChunkStates
from .attention import chunk_attention, chunk_attention_with_lse, resolve_backend, uses_triton
from .config import PER_CHUNK_OVER_DOCUMENTS, ChunkConfig, SparseConfig
from .documents import IGNORE_INDEX, chunk_documents, document_starts, ignore_across_borders
from .errors import SetupError
from .kept_attention import HostKeptAttention
from .loss import HeadGradients, linear_cross_entropy
from .model_shape import ModelShape, head_dim, kv_heads, value_dim
from .pages import PagePool, gradient_ring_pages, stage_2_gather_order
from .optimizers import pending_state
from .placement import Placement, place_step
from .plan import PlanError
from .ranks import Ranks
from .sparse import select_pages, update_summaries


class _LastKVStored(Exception):
    """Raised by the last attention layer in stage 1 once its K, V are stored and its pages selected, when
    nothing else of the chunk's forward is needed there (no loss, kept graph or logits): the rest of the
    decoder (that layer's attention, its MLP, the final norm) only feeds the output layer."""


# Called after every chunk of both stages with (stage 1 or 2, chunk index, start, end): memory traces.
ChunkObserver = Callable[[int, int, int, int], None]

# Called before every chunk of both stages with (stage 1 or 2, chunk index); stage 2 runs the indices down to 0.
# A sharded strategy decides there what its collectives do around the chunk (lightning/model_parallel.py keeps
# the gathered weights until stage 2's last chunk).
ChunkHook = Callable[[int, int], None]

# (spec, pages needed, with_grads, placement) -> a pool with at least that many pages of that spec, placed
# so. A provider may also have ``held_bytes()``: (GPU bytes, host bytes) of a pool it already holds, which
# the step reuses or replaces, and ``host_grad_layers()``, ``host_kv_layers()``: the host gradient and host
# K/V layers of a pool every step must use (None: the step chooses).
PoolProvider = Callable[[StoreSpec, int, bool, Placement], PagePool]

_model_pools: "weakref.WeakKeyDictionary[nn.Module, tuple[PagePool, Placement]]" = weakref.WeakKeyDictionary()


def _held(model: nn.Module) -> tuple[PagePool | None, Placement | None]:
    """The pool kept for ``model`` and the placement that made it (None, None: none)."""
    return _model_pools.get(model, (None, None))


def cached_pool_provider(model: nn.Module, page_size: int, device: torch.device) -> PoolProvider:
    """Pools kept per model and reused across steps; replaced only when a step needs a bigger or other one."""

    def provide(spec: StoreSpec, pages: int, with_grads: bool, placement: Placement) -> PagePool:
        pool = _held(model)[0]
        fits = (
            pool is not None
            and pool.spec == spec
            and pool.page_size == page_size
            and pool.num_pages >= pages
            and (pool.with_grads or not with_grads)
            and pool.placement == placement.where
            and (not with_grads or _holds_host_grad_layers(pool.host_grad_layers, placement.host_grad_layers))
            and pool.host_kv_layers == placement.host_kv_layers
            and (not pool.on_host or pool.streamer.half_pages * page_size >= placement.batch * placement.segment_tokens)
        )
        if not fits:
            _model_pools.pop(model, None)
            pool = None  # drop the old pool before allocating the new one
            pool = new_pool(spec, pages, page_size, device, with_grads, placement)
            _model_pools[model] = pool, placement
        return pool

    def held_bytes() -> tuple[int, int]:
        pool = _held(model)[0]
        return (0, 0) if pool is None else pool_bytes(pool)

    def pool_placement() -> Placement | None:
        return _held(model)[1]

    provide.held_bytes = held_bytes
    provide.pool_placement = pool_placement
    return provide


def _holds_host_grad_layers(held: int, placed: int) -> bool:
    # A pool with more host gradient layers than placed needs less GPU memory: reusing it saves pinning its
    # host pages again (tens of seconds at 1M) when free GPU memory drifts across a layer's boundary.
    return held == placed or 0 < placed < held


def new_pool(
    spec: StoreSpec, pages: int, page_size: int, device: torch.device, with_grads: bool, placement: Placement
) -> PagePool:
    """A pool of ``pages`` pages placed as ``placement`` says."""
    segment = placement.batch * placement.segment_tokens if placement.where == "host" else None
    return PagePool(spec, pages, page_size, device, with_grads=with_grads, placement=placement.where,
                    segment_tokens=segment, host_grad_layers=placement.host_grad_layers if with_grads else 0,
                    host_limit=placement.host_limit, host_kv_layers=placement.host_kv_layers)


def pool_bytes(pool: PagePool) -> tuple[int, int]:
    """(GPU bytes, host bytes) a pool holds."""
    return (pool.gpu_nbytes, pool.host_nbytes)


def cached_pool(model: nn.Module) -> PagePool | None:
    """The page pool ``train_step``/``eval_loss`` keep for ``model`` between steps, if any."""
    return _held(causal_lm(model))[0]


def release_cached_pool(model: nn.Module) -> None:
    """Free the page pool ``train_step``/``eval_loss`` keep for ``model`` between steps."""
    _model_pools.pop(causal_lm(model), None)


def _check_tokens(input_ids: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must hold token ids (int64 or int32), got dtype {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] < 1 or input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids must hold at least one sequence of at least 2 tokens, got shape {tuple(input_ids.shape)}"
        )
    if labels is None:
        labels = input_ids
    if not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape:
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be integer token ids (or -100 to ignore), got dtype {labels.dtype}")
    # Token t predicts t + 1 over the WHOLE sequence, as transformers' ForCausalLMLoss shifts.
    shifted = torch.full_like(labels, IGNORE_INDEX, dtype=torch.int64)
    shifted[:, :-1] = labels[:, 1:]
    return shifted.to(input_ids.device)


def _check_weights(loss_weights: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The labels' weights (B, L) shifted as ``_check_tokens`` shifts the labels, float32; None stays None."""
    if loss_weights is None:
        return None
    if not isinstance(loss_weights, torch.Tensor) or loss_weights.shape != input_ids.shape:
        shape = tuple(loss_weights.shape) if isinstance(loss_weights, torch.Tensor) else type(loss_weights).__name__
        raise ValueError(f"loss_weights must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}")
    if not loss_weights.is_floating_point() or not bool(torch.isfinite(loss_weights).all()) or \
            bool((loss_weights < 0).any()):
        raise ValueError("loss_weights must be finite, non-negative floats (a weight per label)")
    shifted = torch.zeros(loss_weights.shape, dtype=torch.float32, device=input_ids.device)
    shifted[:, :-1] = loss_weights[:, 1:]
    return shifted


class ChunkedSequence:
    """One batch of sequences through the two stages. Create, ``fill()``, then ``backward()`` once.

    stage_1_loss: stage 1 computes every chunk's loss, so that ``fill`` returns it (a served forward must
    return the loss before its backward). When training it computes each chunk's dL/dh and the output
    layer's gradient right there and keeps dL/dh for stage 2 (on the GPU, or in pinned host memory where the
    placement says), which then backpropagates the decoder only: the output layer runs once per chunk.
    Where the placement finds no room for them (``Placement.loss_grads == "recomputed"``), stage 1 computes
    the loss alone and stage 2 runs the output layer again, as without stage_1_loss.

    ranks: the data-parallel ranks this step agrees its batch shape, loss normaliser and placement with
    (``core.ranks``); the default is one process. before_chunk: called before each chunk of both stages
    (``ChunkHook``), before anything of the chunk runs. training False: a forward alone (``fill(with_grads=False)``,
    ``extend``), placed without gradients, KV-gradient pages or anything kept for stage 2.
    """

    def __init__(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        config: ChunkConfig = ChunkConfig(),
        pools: PoolProvider | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        observer: ChunkObserver | None = None,
        stage_1_loss: bool = False,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        position_ids: torch.Tensor | None = None,
        ranks: Ranks = Ranks(),
        before_chunk: ChunkHook | None = None,
        training: bool = True,
        loss_weights: torch.Tensor | None = None,
    ):
        self.stage_1_loss = stage_1_loss
        self.training = training
        self.before_chunk = before_chunk
        targets = _check_tokens(input_ids, labels)
        ranks.check_batch(tuple(input_ids.shape), config.chunk_size, config.page_size)
        # Packed documents (core/documents.py): None, or each token's document start (B, L) int32.
        self.doc_start = document_starts(position_ids, input_ids)
        self._chunk_doc_start: torch.Tensor | None = None  # the current chunk's (B, T), contiguous
        self._chunk_one_document: int | None = None  # the current chunk's, from self.one_document
        self._chunk_first_page = 0  # the page of the current chunk's first key (self.first_keys)
        self.targets = ignore_across_borders(targets, self.doc_start)
        # Each target's weight in the loss (B, L) float32, 0 where there is no target; None: all 1.
        self.weights = _check_weights(loss_weights, input_ids)
        if self.weights is not None:
            self.weights.masked_fill_(self.targets == IGNORE_INDEX, 0.0)
        self.observer = observer
        self.model = model
        self.lm = causal_lm(model)
        check_supported(model)
        check_chunked_forward(model, config.host_memory)
        # The experts' load-balancing loss of the whole sequence, where the model adds it.
        self.balance = RouterBalance(self.lm) if getattr(self.lm.config, "output_router_logits", False) else None
        self.input_ids = input_ids
        self.config = config
        self.device = input_ids.device
        self.backend = resolve_backend(config.attention, self.device, sparse=config.sparse is not None)
        if config.sparse is not None and not config.sparse.per_query_tile and self.doc_start is not None:
            raise ValueError(PER_CHUNK_OVER_DOCUMENTS)
        self.fused_ops = uses_triton(config.attention, self.device)
        # The states of the state-carrying layers (lightning_oomb.recurrent) across chunk borders, if the model has any.
        self.states = ChunkStates(input_ids.shape[0]) if carried_layers(self.lm) else None
        if self.states is not None and self.doc_start is not None:
            raise ValueError(
                f"{type(self.lm).__name__} carries a state (linear attention, state space, short convolution) from "
                "token to token, across the starts of packed documents too: train packed documents without document "
                "masking (position_ids), or one document per sequence"
            )
        # Page selections made in stage 1, by (chunk index, layer), kept until the chunk's stage-2 backward.
        self.selections: dict[tuple[int, int], torch.Tensor] = {}
        # Attention (out, lse) from stage 1 of the placement.kept_chunks chunks before those whose graphs it
        # keeps, by (chunk, layer), until the chunk's stage-2 backward.
        self.kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # Those of the first placement.host_kept_chunks chunks, in pinned host memory (made at the first save).
        self.host_kept: HostKeptAttention | None = None
        # (last hidden state with its graph, dL/dh, loss) of the last placement.graph_chunks chunks, run with
        # autograd in stage 1, by chunk index, until stage 2 backpropagates them.
        self.graphs: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = {}
        # (loss, dL/dh) of the other chunks when stage 1 computes the losses (stage_1_loss), by chunk index.
        self.loss_grads: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        # float32 sums of the output layer's gradients, from the first chunk's loss to the end of stage 2.
        self.head_grads: HeadGradients | None = None
        self._chunk = 0
        self._last_layer = self.lm.config.num_hidden_layers - 1
        self._hidden_needed = True  # stage 1: whether this chunk's last hidden state is used
        self.pools = pools or cached_pool_provider(self.lm, config.page_size, self.device)
        seq_len = input_ids.shape[1]
        self.chunks = [(s, min(s + config.chunk_size, seq_len)) for s in range(0, seq_len, config.chunk_size)]
        # Packed documents, per chunk start: the first key its queries see (host pages skip the segments
        # before), and the start of the one document all its queries belong to, where they do (the kernels
        # then run it as an unpacked chunk over the keys from there).
        self.first_keys, self.one_document = None, {}
        if self.doc_start is not None:
            self.first_keys, self.one_document = chunk_documents(position_ids, self.chunks)
        cfg = self.lm.config
        windows = layer_windows(self.lm)
        widest = max(windows.values(), default=0)
        # The page pool's layers: the decoder layers that attend (a hybrid's state-carrying layers keep no K/V),
        # by their transformers layer index.
        self.kv_slots = {layer: slot for slot, layer in enumerate(kv_layer_indices(cfg))}
        self.spec_base = dict(
            grad_dtype=config.grad_dtype,
            n_layers=len(self.kv_slots),
            # this rank's share of the heads (tensor parallel)
            n_kv_heads=kv_heads(cfg) // ranks.kv_head_split,
            head_dim=head_dim(cfg),
            v_head_dim=value_dim(cfg),
            window_layers=tuple(sorted(self.kv_slots[layer] for layer in windows)),
            window=widest,
            grad_ring_pages=gradient_ring_pages(widest, config.chunk_size, config.page_size) if windows else 0,
            chunk_size=config.chunk_size if windows else 0,
        )
        self.decoder = decoder_of(self.lm)
        self.head = self.lm.get_output_embeddings()
        self.logit_head = logit_head(self.lm)  # what the model does to the output layer's logits
        reusable = getattr(self.pools, "held_bytes", lambda: (0, 0))()
        held_layers = getattr(self.pools, "host_grad_layers", lambda: None)()
        held_kv_layers = getattr(self.pools, "host_kv_layers", lambda: None)()
        pool_placement = getattr(self.pools, "pool_placement", lambda: None)()
        optimizer, pending, pending_host = pending_state(optimizers)
        # Stage 1 keeps the state-carrying layers' border states on the device until stage 2 has used them; the
        # plan counts them where the model's shape knows their size.
        borders = 0
        if self.states is not None and not ModelShape.resolve(self.lm).carried_state_bytes:
            borders = border_state_bytes(self.lm, input_ids.shape[0], len(self.chunks))
        self.placement = place_step(model, input_ids.shape[0], seq_len, config, self.device, *reusable,
                                    stage_1_loss=stage_1_loss, optimizer=optimizer,
                                    pending_gpu_bytes=pending + ranks.step_gpu_bytes + borders,
                                    pending_host_bytes=pending_host,
                                    host_grad_layers=held_layers, agree=ranks.least, host_kv_layers=held_kv_layers,
                                    kv_head_split=ranks.kv_head_split, reused=pool_placement, training=training)
        # Valid labels per chunk, read once and only after the placement fits (a long sequence's mask is
        # itself hundreds of MB): a chunk whose labels are all valid needs no boolean mask in its
        # loss (a mask's data-dependent shape would make the host wait for the GPU at every chunk).
        labelled = self.targets != IGNORE_INDEX
        vocab = self.head.weight.shape[0]
        out_of_range = labelled & ((self.targets < 0) | (self.targets >= vocab))
        if out_of_range.any():  # the loss kernel would read outside its row of logits
            bad = self.targets[out_of_range][0].item()
            raise ValueError(
                f"labels hold token id {bad}, outside the output layer's vocabulary [0, {vocab}); labels are "
                "token ids of the model's tokenizer, or -100 for positions without a loss"
            )
        pad = len(self.chunks) * config.chunk_size - seq_len
        per_chunk = torch.nn.functional.pad(labelled, (0, pad)).view(-1, len(self.chunks), config.chunk_size)
        per_chunk = per_chunk.sum((0, 2)).tolist()
        self._fully_labelled = [n == labelled.shape[0] * (e - s) for n, (s, e) in zip(per_chunk, self.chunks)]
        if num_items_in_batch is not None:
            valid = float(num_items_in_batch) if self.weights is not None else int(num_items_in_batch)
        elif self.weights is not None:  # the weighted mean: the weights' sum over the batch (and the ranks)
            valid = ranks.items(float(self.weights.sum(dtype=torch.float64)))
        else:
            valid = ranks.items(sum(per_chunk))
        if valid == 0:
            what = "every label's loss weight is 0" if sum(per_chunk) else "every label is -100"
            raise ValueError(f"{what}: there is no token to compute a loss on")
        self.n_valid = valid
        reference_on_gpu = self.device.type == "cuda" and config.attention == "reference"
        if self.placement.host_grad_layers and (config.sparse is None or reference_on_gpu):
            # Only the sparse kernels stage their page gradients for host-mapped pages.
            raise ValueError(
                f"gradient pages in host memory ({self.placement.host_grad_layers} layers) need sparse attention "
                f"with attention='triton' or 'auto' on CUDA, got attention={config.attention!r}, "
                f"sparse={config.sparse!r}"
            )
        if self.placement.host_kv_layers and config.sparse is None:
            # Dense attention reads every past page: host pages go through the streamed tier instead.
            raise ValueError(
                f"K/V pages of {self.placement.host_kv_layers} layers in host memory need sparse attention; "
                "dense steps keep pages in host memory with offload='host'"
            )
        self.pool: PagePool | None = None
        self.table = None
        self._stage = "new"
        self._start = 0
        self._with_grads = True
        self._window_cache: tuple[tuple[int, int] | None, torch.Tensor | None] = (None, None)
        self._stored = 0  # extend(): the tokens whose K/V are in the pages
        self._bound = False  # inside bound()

    # -- called by every state-carrying layer through the transformers integration --------------------
    def carry(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The output (B, T, d) of a state-carrying layer on the current chunk (lightning_oomb.recurrent)."""
        return self.states.run(layer, hidden, self._chunk, keep_borders=self._with_grads,
                               recompute=self._stage == "recompute")

    # -- called by every attention layer through the transformers integration -------------------------
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None = None, sinks: torch.Tensor | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """The layer's attention for the current chunk; ``window``: a sliding window of that many tokens (each query
        sees itself and the window - 1 keys before it), None for full causal attention; ``sinks``: (H_q,)
        attention-sink logits (core/attention.py), or None; ``softcap``: scores soft-capped to
        softcap * tanh(score / softcap), or None."""
        if self.pool is None:
            self._take_pages(k.dtype)
        slot = self.kv_slots.get(layer_idx)
        if slot is None:
            raise NotImplementedError(f"layer {layer_idx} of {type(self.lm).__name__} attends, but its config's "
                                      "layer kinds say it keeps no K/V: not supported")
        store = self.pool.layer(slot, self.table)
        key = (self._chunk, slot)
        fill = self._stage == "fill"
        sparse = self.config.sparse
        selection = None
        bounds = self._chunk_bounds(window, q.shape[2])
        with torch.no_grad():  # a chunk whose graph stage 1 keeps runs with autograd: the store is no part of it
            if fill:
                spec = self.pool.spec
                if k.dtype != spec.dtype:
                    raise RuntimeError(f"layer {layer_idx} produced K in {k.dtype}, the store holds {spec.dtype}")
                if (k.shape[1], k.shape[-1], v.shape[-1]) != (spec.n_kv_heads, spec.head_dim, spec.v_dim):
                    raise RuntimeError(
                        f"layer {layer_idx} hands attention {k.shape[1]} K/V heads, keys {k.shape[-1]} and values "
                        f"{v.shape[-1]} wide; its config says {spec.n_kv_heads} heads, {spec.head_dim} and "
                        f"{spec.v_dim}, which the pages hold")
                store.write(k, v, self._start)
            if sparse is not None and fill:
                summaries = self.pool.summaries(sparse.score, slot)
                # Select from the past's summaries, then add this chunk's keys for the chunks after it.
                selection = select_pages(q, store, summaries, sparse, self._start, bounds[0])
                update_summaries(store, summaries, sparse.score, self._start, self._start + k.shape[2])
                if self._with_grads:
                    self.selections[key] = selection
            elif sparse is not None:
                selection = self.selections[key]
        if fill and layer_idx == self._last_layer and not self._hidden_needed:
            raise _LastKVStored
        store, start, doc_start, one_document = self._past(store, selection is None, *bounds)
        if fill and self._with_grads and self._keeps_attention(self._chunk):
            self.kept[key] = chunk_attention_with_lse(q, k, v, store, start, scale, self.backend, selection,
                                                      doc_start, one_document, sinks, softcap)
            return self.kept[key][0]
        if fill and self._with_grads and self._chunk < self.placement.host_kept_chunks:
            out, lse = chunk_attention_with_lse(q, k, v, store, start, scale, self.backend, selection, doc_start,
                                                one_document, sinks, softcap)
            if self.host_kept is None:
                self.host_kept = self.pool.host_kept_attention(self.placement.host_kept_chunks, out, lse)
            self.host_kept.save(self._chunk, slot, out, lse)
            return out
        if not fill and key not in self.kept and self.host_kept is not None and key in self.host_kept.saved:
            self.kept[key] = self.host_kept.fetch(*key)
        if not fill and key not in self.kept and self.config.checkpoint_layers:
            # The layer checkpoint's recompute takes this forward's (out, lse) rather than attending again:
            # one layer's output per layer of the chunk, held until the chunk's backward is done. Without
            # autograd: the checkpoint counts the tensors its forward saves.
            with torch.no_grad():
                self.kept[key] = chunk_attention_with_lse(q, k, v, store, start, scale, self.backend, selection,
                                                          doc_start, one_document, sinks, softcap)
        return chunk_attention(q, k, v, store, start, scale, self.backend, selection, self.kept.get(key), doc_start,
                               one_document, sinks, softcap)

    def _chunk_bounds(self, window: int | None, queries: int) -> tuple[torch.Tensor | None, int | None, int]:
        """The current chunk's (doc_start, one_document, page) for a layer with a sliding ``window`` (None: full
        causal attention): doc_start (B, T) int32 each query's first visible key, from its document and its
        window, or None where neither cuts; one_document the start of the one document every query belongs
        to, where the window cuts nothing; page the page of the chunk's first visible key."""
        doc_start, one, page = self._chunk_doc_start, self._chunk_one_document, self._chunk_first_page
        lower = self._window_starts(window, queries)
        if lower is not None:
            doc_start = lower if doc_start is None else torch.maximum(doc_start, lower)
            one = None
            page = max(page, max(self._start - window + 1, 0) // self.config.page_size)
        return doc_start, one, page

    def _past(self, store: LayerStore, dense: bool, doc_start: torch.Tensor | None, one: int | None,
              page: int) -> tuple[LayerStore, int, torch.Tensor | None, int | None]:
        """(store, start, doc_start, one_document) for the current chunk's attention (``_chunk_bounds``). Dense:
        the store from the page of the chunk's first visible key on, every position counted from that page
        (``LayerStore.from_page``), so that no kernel visits, or launches a program for, the keys before it
        (the key-stationary dK/dV kernel has one per past key tile). Pages streamed from the host skip the segments
        before the chunk's document and window already (``core/offload.py``); a sparse selection names pages of
        the whole store and none before the first visible key (``core.sparse.select_pages``)."""
        if not dense or not page or store.streamer is not None:
            return store, self._start, doc_start, one
        offset = page * self.config.page_size
        return (store.from_page(page), self._start - offset, doc_start - offset,
                None if one is None else one - offset)

    def _window_starts(self, window: int | None, queries: int) -> torch.Tensor | None:
        """(B, T) int32 first key each of the chunk's queries sees in a sliding window of ``window`` tokens
        (transformers' ``kv_idx > q_idx - window``); None where the window cuts no key of this chunk."""
        end = self._start + queries
        if window is None or end <= window:
            return None
        if self._window_cache[0] != (self._chunk, window):
            positions = torch.arange(self._start, end, device=self.device, dtype=torch.int32)
            starts = (positions - (window - 1)).clamp_min(0)
            self._window_cache = ((self._chunk, window), starts.expand(self.input_ids.shape[0], -1).contiguous())
        return self._window_cache[1]

    def _keeps_graph(self, index: int) -> bool:
        return self._with_grads and index >= len(self.chunks) - self.placement.graph_chunks

    def _keeps_attention(self, index: int) -> bool:
        # The kept outputs serve the chunks just before those whose graphs stage 1 keeps (which hold theirs).
        first_graph = len(self.chunks) - self.placement.graph_chunks
        return first_graph - self.placement.kept_chunks <= index < first_graph

    def _take_pages_without_attention(self) -> None:
        """A model that attends nowhere (pure state-space models) takes its pool, of no layers and no bytes, at
        the start of stage 1 rather than at a first attention call that never comes: the step's page bookkeeping
        (zeroing and reading gradient pages, a host buffer of dL/dh, release) then runs as for any model."""
        if self.pool is None and not self.kv_slots:
            self._take_pages(self.head.weight.dtype)

    def _take_pages(self, dtype: torch.dtype) -> None:
        spec = StoreSpec(dtype=dtype, **self.spec_base)
        batch, seq_len = self.input_ids.shape
        pages = batch * -(-seq_len // self.config.page_size)
        self.pool = self.pools(spec, pages, self._with_grads, self.placement)
        self.pool.host.limit = self.placement.host_limit  # this step's room for pinned blocks
        self.table = self.pool.allocate(batch, seq_len, self.first_keys)

    def _chunk_hidden(self, start: int, end: int) -> torch.Tensor:
        self._start = start
        ids = self.input_ids[:, start:end]
        pos = torch.arange(start, end, device=self.device).unsqueeze(0).expand(ids.shape[0], -1)
        if self.doc_start is not None:  # RoPE positions restart with every document
            self._chunk_doc_start = self.doc_start[:, start:end].contiguous()
            self._chunk_one_document = self.one_document.get(start)
            self._chunk_first_page = self.first_keys[start] // self.config.page_size
            pos = pos - self._chunk_doc_start
        try:
            hidden = self.decoder(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        except _LastKVStored:
            return None
        return head_input(self.head, hidden)

    def _chunk_loss(
        self, hidden: torch.Tensor, start: int, end: int, with_grads: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(loss of the chunk, dL/dh (B, T, d) when ``with_grads`` and the decoder trains); ``with_grads``
        also adds the output layer's gradient into ``head_grads``."""
        targets = self.targets[:, start:end]
        weights = None if self.weights is None else self.weights[:, start:end].reshape(-1)
        flat = hidden.detach().reshape(-1, hidden.shape[-1])
        keep = None
        if self._fully_labelled[self._chunk]:
            rows, targets = flat, targets.reshape(-1)
        else:
            keep = (targets != IGNORE_INDEX).reshape(-1)
            rows, targets = flat[keep], targets.reshape(-1)[keep]
            weights = None if weights is None else weights[keep]
        if with_grads and self.head_grads is None:
            self.head_grads = HeadGradients(self.head)
        loss, grad_rows = linear_cross_entropy(
            rows, self.head.weight, self.head.bias, targets, self.n_valid,
            self.head_grads if with_grads else None, with_grad_hidden=with_grads and self._decoder_trains,
            fused=self.fused_ops, head=self.logit_head, weights=weights,
        )
        if grad_rows is None:
            return loss, None
        if keep is None:
            return loss, grad_rows.view_as(hidden)
        grad = torch.zeros_like(flat)
        grad[keep] = grad_rows
        return loss, grad.view_as(hidden)

    def _keep_loss_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        if grad is None or self.placement.loss_grads != "host":
            return grad
        rows = self.input_ids.shape[0] * min(self.config.chunk_size, self.input_ids.shape[1])
        block = self.pool.loss_grad_buffer(len(self.chunks), rows * grad.shape[-1], grad.dtype)
        host = block[self._chunk, : grad.numel()].view(grad.shape)
        return host.copy_(grad, non_blocking=True)  # in stream order: stage 2's copy back waits for it

    # -- the two stages -------------------------------------------------------------------------------
    def fill(self, with_grads: bool = True, keep_last: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Stage 1. Returns (loss, logits): the loss (float32 scalar) with ``stage_1_loss``, and the logits
        (B, keep_last, V) of the last ``keep_last`` positions, else None."""
        if self._stage != "new":
            raise RuntimeError("fill() runs once per ChunkedSequence")
        if with_grads and not self.training:
            raise RuntimeError("this sequence was placed for a forward alone (training=False): fill(with_grads=False)")
        if with_grads and not any(p.requires_grad for p in self.model.parameters()):
            raise RuntimeError("no parameter of the model requires grad")
        self._stage, self._with_grads = "fill", with_grads
        self._decoder_trains = any(p.requires_grad for p in self.decoder.parameters())
        self._take_pages_without_attention()
        total = torch.zeros((), dtype=torch.float32, device=self.device) if self.stage_1_loss else None
        kept = []
        first_kept = self.input_ids.shape[1] - keep_last
        with torch.no_grad(), bind(self.model, self, fused_ops=self.fused_ops), self._balance_hooks():
            for index, (start, end) in enumerate(self.chunks):
                if self.before_chunk is not None:
                    self.before_chunk(1, index)
                self._set_chunk(index)
                keeps_graph = self._keeps_graph(index)
                # The load-balancing loss counts the last layer's routing too: then stage 1 runs it whole.
                self._hidden_needed = (keeps_graph or self.stage_1_loss or (keep_last > 0 and end > first_kept)
                                       or self.balance is not None)
                with torch.set_grad_enabled(keeps_graph):
                    hidden = self._chunk_hidden(start, end)
                if keeps_graph or self.stage_1_loss:
                    keeps_grads = with_grads and (keeps_graph or self.placement.loss_grads != "recomputed")
                    loss, grad = self._chunk_loss(hidden, start, end, keeps_grads)
                    if keeps_graph:
                        self.graphs[index] = (hidden, grad, loss)
                    elif keeps_grads:
                        self.loss_grads[index] = (loss, self._keep_loss_grad(grad))
                    if self.stage_1_loss:
                        total += loss
                if keep_last and end > first_kept:
                    logits = self.head(hidden[:, max(0, first_kept - start) :])
                    kept.append(self.logit_head.apply(logits, inplace=True))
                if self.observer is not None:
                    self.observer(1, index, start, end)
        if self.stage_1_loss and self.balance is not None:
            total += self.balance.loss()
        return total, (torch.cat(kept, dim=1) if kept else None)

    def extend(self, end: int, keep_last: int = 0) -> torch.Tensor | None:
        """Stage 1 without gradients over input_ids' tokens [stored, end), after the ``stored`` tokens that
        earlier calls wrote into the pages (none at first), in fill's chunks of ``chunk_size`` (the first one
        from ``stored`` on); returns the logits
        (B, keep_last, V) of the span's last ``keep_last`` positions, else None. ``fill`` runs every chunk at
        once; decoding needs the tokens one at a time, each chosen from the logits before it, so a caller may
        write input_ids[:, stored:end] between calls (lightning_oomb.evaluation). No loss, no load-balancing
        loss."""
        stored = self._stored
        if self._stage not in ("new", "fill") or (self._stage == "fill" and (self._with_grads or not stored)):
            raise RuntimeError("extend() continues its own stage 1 only: not after fill() or backward()")
        if not stored < end <= self.input_ids.shape[1] or not 0 <= keep_last <= end - stored:
            raise ValueError(f"extend({end}, keep_last={keep_last}) after {stored} stored tokens of "
                             f"{self.input_ids.shape[1]}: needs {stored} < end <= {self.input_ids.shape[1]} and "
                             f"keep_last <= {end - stored}")
        self._stage, self._with_grads, self._decoder_trains = "fill", False, False
        self._take_pages_without_attention()
        first_kept = end - keep_last
        kept = []
        binding = contextlib.nullcontext() if self._bound else self.bound()
        chunk = self.config.chunk_size
        with torch.no_grad(), binding:
            # Pieces that end at multiples of chunk_size: a sliding-window layer's pages are laid out by the chunks
            # of fill (core.pages.window_page_slots), which no write may cross.
            for start in [stored, *range((stored // chunk + 1) * chunk, end, chunk)]:
                stop = min((start // chunk + 1) * chunk, end)
                self._set_chunk(self._chunk + 1 if stored else 0)  # a new key for the chunk's selections
                self._hidden_needed = stop > first_kept
                hidden = self._chunk_hidden(start, stop)
                if stop > first_kept:
                    logits = self.head(hidden[:, max(0, first_kept - start):])
                    kept.append(self.logit_head.apply(logits, inplace=True))
                self._stored = stored = stop
        return torch.cat(kept, dim=1) if kept else None

    @contextlib.contextmanager
    def bound(self) -> Iterator[None]:
        """The model's attention routed to this sequence for every ``extend`` inside. Each ``bind`` walks every
        module of the model: once per decoded token, that is a quarter of a tiny model's decoding time on a CPU."""
        with bind(self.model, self, fused_ops=self.fused_ops):
            self._bound = True
            try:
                yield
            finally:
                self._bound = False

    def backward(self, grad_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """Stage 2: adds d(grad_scale * loss)/d(param) to every param.grad; returns the loss (detached)."""
        if self._stage != "fill" or not self._with_grads:
            raise RuntimeError("backward() needs a fill(with_grads=True) before it, and runs once")
        self._stage = "recompute"
        grad = torch.as_tensor(grad_scale, dtype=torch.float32, device=self.device)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.balance is not None:
            self.balance.grad_scale = grad
        try:
            with torch.enable_grad(), bind(self.model, self, self.config.checkpoint_layers, self.fused_ops), \
                    self._balance_hooks():
                for index in reversed(range(len(self.chunks))):
                    if self.before_chunk is not None:
                        self.before_chunk(2, index)
                    start, end = self.chunks[index]
                    self._set_chunk(index)
                    if not self.config.cross_chunk_gradients:
                        self.pool.zero_grads(self.table, start, end)
                    if self.pool.host_layers and not self.graphs:
                        # Pages after this chunk are dead: host gradient layers move into them. Not while a
                        # graph from stage 1 waits: it holds its layers' stores as they were.
                        self.pool.move_host_grads_to_gpu(self.table, end)
                    self._announce_gathers(index, start)
                    if index in self.graphs:
                        hidden, dhidden, loss = self.graphs.pop(index)
                    elif index in self.loss_grads:  # stage 1 computed the loss: the decoder's backward is left
                        loss, dhidden = self.loss_grads.pop(index)
                        if dhidden is not None:
                            hidden = self._chunk_hidden(start, end)
                            dhidden = dhidden.to(self.device, non_blocking=True)
                    else:
                        hidden = self._chunk_hidden(start, end)
                        loss, dhidden = self._chunk_loss(hidden, start, end, with_grads=True)
                    if dhidden is not None:
                        torch.autograd.backward(hidden, dhidden.mul_(grad.to(dhidden.dtype)))
                    for done in (self.selections, self.kept):  # this chunk's forward and backward are done
                        for key in [key for key in done if key[0] == index]:
                            del done[key]
                    if self.states is not None:
                        self.states.done(index)
                    self.pool.chunk_grads_read(self.table, start, end)
                    total += loss
                    if self.observer is not None:
                        self.observer(2, index, start, end)
            if self.head_grads is not None:
                self.head_grads.deliver(grad)
            if self.balance is not None:
                total += self.balance.loss()
        finally:
            self.release()
        return total

    def _set_chunk(self, index: int) -> None:
        self._chunk = index
        if self.balance is not None:
            self.balance.chunk = index

    def _balance_hooks(self):
        return self.balance.hooks() if self.balance is not None else contextlib.nullcontext()

    def _announce_gathers(self, index: int, start: int) -> None:
        # Stage 1 made every selection of the chunk: the host K/V layers' gathers can run ahead of their calls.
        staging = self.pool.kv_staging
        if staging is None:
            return
        host = self.pool.host_kv_layer_ids
        saved = self.host_kept.saved if self.host_kept is not None else ()
        stored = {layer for layer in host if (index, layer) in self.kept or (index, layer) in saved}
        order = stage_2_gather_order(host, stored, index in self.graphs)
        staging.expect([(self.pool.layer(layer, self.table), self.selections[(index, layer)]) for layer in order],
                       start)

    def release(self) -> None:
        """Give the pages back to the pool (idempotent)."""
        if self.table is not None:
            self.pool.free(self.table)
            self.table = None
            if self.pool.kv_staging is not None:  # a gather of the freed pages
                self.pool.kv_staging.forget()
        self.selections.clear()
        self.kept.clear()
        if self.states is not None:
            self.states.clear()
        self.graphs.clear()
        self.loss_grads.clear()
        self.head_grads = None
        self._stage = "done"


def train_step(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    loss_weights: torch.Tensor | None = None,
    config: ChunkConfig | None = None,
    **options: Any,
) -> torch.Tensor:
    """Add to every ``param.grad`` what ``model(input_ids=input_ids, labels=labels).loss.backward()`` adds.

    input_ids, labels: (batch, seq_len) token ids; labels default to input_ids, -100 is ignored, and are
    shifted over the whole sequence. position_ids: None, or (batch, seq_len) positions that restart at 0 where a
    document starts (packed documents, as transformers' DataCollatorWithFlattening makes them): each token
    then attends only within its document, RoPE takes these positions, and a document's last token predicts
    nothing (core/documents.py). Returns the loss (float32 scalar, detached): the mean token
    cross-entropy over the valid labels of the batch, in nats. Memory: activations of one chunk of
    ``chunk_size`` tokens plus the paged K/V store and its gradients (``grad_dtype``, float32 by default).
    config, options: the step's ``ChunkConfig`` (None: its defaults) with any of its fields given by name
    (``chunk_size=8192, sparse=SparseConfig()``); with sparse attention the gradient is that of the sparse
    model, exact for the pages selected in stage 1.
    optimizer: the optimizer whose ``step`` follows: the state its first step creates (AdamW: two copies of
    the trainable weights) is left free when the step is placed, so that the update fits after it.
    num_items_in_batch: the count of valid (shifted) labels the loss is divided by; None: this batch's. Data
    parallel ranks pass the count over all ranks' batches, so that their gradients summed (one all-reduce
    after the step) are one process's gradient of all the batches together (tests/test_distributed.py).
    loss_weights: None, or (batch, seq_len) float weights, one per label (aligned with ``labels``, shifted with
    them): the loss is then the weighted mean sum(w x CE) / sum(w) over the valid labels (of all ranks; or
    divided by ``num_items_in_batch`` where given). Weights of 1 / (a document's labels) make it the mean over
    documents of each document's mean (``core.documents.document_loss_weights``).
    """
    config = ChunkConfig.build(config, **options)
    seq = ChunkedSequence(model, input_ids, labels, config, num_items_in_batch=num_items_in_batch,
                          optimizers=() if optimizer is None else (optimizer,), position_ids=position_ids,
                          loss_weights=loss_weights)
    try:
        seq.fill()
        return seq.backward()
    finally:
        seq.release()


def eval_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    loss_weights: torch.Tensor | None = None,
    config: ChunkConfig | None = None,
    **options: Any,
) -> torch.Tensor:
    """``model(input_ids=input_ids, labels=labels).loss`` under no_grad, one chunk of activations at a time.

    Same shapes, label, position_ids and loss_weights rules, ``config`` and ``options`` as ``train_step`` (the
    options of the backward, such as ``grad_dtype``, do nothing here); holds K/V pages but no gradient pages.
    """
    config = ChunkConfig.build(config, **options)
    seq = ChunkedSequence(model, input_ids, labels, config, stage_1_loss=True, position_ids=position_ids,
                          training=False, loss_weights=loss_weights)
    try:
        return seq.fill(with_grads=False)[0]
    finally:
        seq.release()


# -- the probe of a model's chunked forward --------------------------------------------------------------
# Its tokens, in chunks of PROBE_CHUNK over pages of PROBE_PAGE: page borders fall inside chunks, chunk borders
# inside pages, and the last chunk is short.
PROBE_TOKENS, PROBE_CHUNK, PROBE_PAGE = 16, 6, 4
# A position's output differs where the norm of its difference exceeds this share of its norm: 1e-4 in float32
# (the two forwards of random 36-layer models agree to ~6e-6 on an H100); PROBE_EPS times the machine epsilon of
# a lower precision, where they round differently (bf16: 25%; random Llama-7B agrees to ~5%). Pages that hold
# other values than the model attends to (DiffLlama) differ by ~100%; smaller errors are the float32 tests' to
# find.
PROBE_RTOL, PROBE_EPS = 1e-4, 32
# Failures of the engine on a model, which the probe turns into its refusal; not a refusal of the setup, of
# memory, or one already said.
_ENGINE_FAILURES = (AttributeError, IndexError, KeyError, RuntimeError, TypeError, ValueError)
# Not the model's doing: a refusal, bad input, or a step that does not fit (the run itself meets them too).
_NOT_ENGINE_FAILURES = (NotImplementedError, SetupError, PlanError, torch.OutOfMemoryError)
_forward_checked: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models whose chunked forward was probed


def check_chunked_forward(model: nn.Module, host_memory: int | None = None) -> None:
    """Refuse a model whose forward in chunks over the K/V pages is not its whole-sequence forward, whatever
    the cause, even one that nothing in its config names (DiffLlama calls attention twice per layer, with the
    same keys and other values, so the pages hold the second call's values for both).

    Stage 1 of the engine on PROBE_TOKENS tokens (reference attention, no gradients, pages of its own, freed
    after) against the model class's own forward, position by position: every decoder layer's output, the
    logits, and the loss, which moves by at most twice the largest change of a logit unless something else
    differs. NotImplementedError in one line naming the first that differs; also where the engine fails on the
    model. Once per model; skipped for weights not yet made (meta) or sharded (DTensor). Leaves the random
    number generators, the model's mode and its gradients as they were. ``host_memory``: the run's host memory
    budget (ChunkConfig's), which the probe's step is placed against as the run's steps are.
    """
    lm = causal_lm(model)
    if lm in _forward_checked or any(p.is_meta or isinstance(p, DTensor) for p in lm.parameters()):
        return
    check_supported(lm)  # first the refusals by name (and out of the hooks: its own probe runs the model)
    _forward_checked.add(lm)  # the probe's own sequence comes back here
    try:
        _probe_chunked_forward(lm, host_memory)
    except BaseException:
        _forward_checked.discard(lm)
        raise


def _probe_chunked_forward(lm: nn.Module, host_memory: int | None) -> None:
    """check_chunked_forward's probe of ``lm``, a transformers causal LM with its weights made."""
    name = f"{type(lm).__name__} (model_type {lm.config.model_type!r})"
    device = lm.get_output_embeddings().weight.device
    vocab = lm.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(0)).to(device)
    layers = decoder_layers(lm)
    outputs: list[list[torch.Tensor]] = [[] for _ in layers]  # each layer's, one tensor per call

    def keep(index: int):
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            outputs[index].append((out[0] if isinstance(out, tuple) else out).detach())
        return hook

    hooks = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            # The class's forward: a served model's instance forward is the engine. A mask of ones spares
            # transformers its search for packed documents in the position ids.
            whole = type(lm).forward(lm, input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids,
                                     use_cache=False)
            whole_layers = [torch.cat(o, dim=1) if o else None for o in outputs]
            for o in outputs:
                o.clear()
            config = ChunkConfig(chunk_size=PROBE_CHUNK, page_size=PROBE_PAGE, attention="reference",
                                 host_memory=host_memory)

            def own_pool(spec: StoreSpec, pages: int, with_grads: bool, placement: Placement) -> PagePool:
                return new_pool(spec, pages, PROBE_PAGE, device, with_grads, placement)

            try:
                seq = ChunkedSequence(lm, ids, config=config, pools=own_pool, stage_1_loss=True)
                try:
                    loss, logits = seq.fill(with_grads=False, keep_last=PROBE_TOKENS)
                finally:
                    seq.release()
            except _NOT_ENGINE_FAILURES:
                raise
            except _ENGINE_FAILURES as e:
                what = " ".join(str(e).split())
                raise NotImplementedError(f"{name}: lightning_oomb's chunked forward fails on it "
                                          f"({type(e).__name__}: {what}); not supported") from e
            chunked_layers = [torch.cat(o, dim=1) if o else None for o in outputs]
    finally:
        for hook in hooks:
            hook.remove()
    compared = [*zip(whole_layers, chunked_layers), (whole.logits, logits)]
    eps = max(_epsilon(t.dtype, device) for pair in compared for t in pair if t is not None)
    rtol = max(PROBE_RTOL, PROBE_EPS * eps)
    worst = [_worst_position(want, got) for want, got in compared]
    loss_tol = 2 * worst[-1][1] + rtol * max(abs(whole.loss.item()), 1.0)
    against = f"loss {loss.item():.6g} in chunks against {whole.loss.item():.6g} whole"
    differs = next((i for i, (rel, _, _) in enumerate(worst) if rel > rtol), None)
    if differs is None and abs(loss.item() - whole.loss.item()) <= loss_tol:
        return
    if differs is None:
        what = f"the {against}"
    else:
        rel, diff, position = worst[differs]
        output = "the logits" if differs == len(layers) else f"decoder layer {differs}'s output"
        what = (f"{output} at position {position}, by up to {diff:.3g} ({rel:.2g} of its norm there, tolerance "
                f"{rtol:.2g}); {against}")
    raise NotImplementedError(
        f"{name}: its forward in chunks of {PROBE_CHUNK} tokens over lightning_oomb's K/V pages differs from its "
        f"whole-sequence forward on {PROBE_TOKENS} tokens: {what}; lightning_oomb would train it wrongly, not "
        "supported"
    )


def _epsilon(dtype: torch.dtype, device: torch.device) -> float:
    """The machine epsilon of computing in ``dtype`` on ``device``: float32 matrix products on CUDA run in TF32 (10
    mantissa bits) or bf16 where ``torch.set_float32_matmul_precision`` allows it."""
    if dtype == torch.float32 and device.type == "cuda":
        precision = torch.get_float32_matmul_precision()
        if precision != "highest":
            return 2.0**-10 if precision == "high" else 2.0**-7
    return torch.finfo(dtype).eps


def _worst_position(want: torch.Tensor | None, got: torch.Tensor | None) -> tuple[float, float, int]:
    """(norm of the difference / norm of ``want``, largest difference of an element, position) at the position
    where that ratio is largest; (inf, inf, 0) where one is missing or has another shape (a layer that ran in one
    forward only). (1, T, ...) each."""
    if want is None and got is None:  # a layer outside the decoder's forward
        return 0.0, 0.0, 0
    if want is None or got is None or got.shape != want.shape:
        return float("inf"), float("inf"), 0
    want, got = want[0].float().flatten(1), got[0].float().flatten(1)  # (T, features)
    rel = (got - want).norm(dim=1) / want.norm(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    position = int(rel.argmax())
    return rel[position].item(), (got[position] - want[position]).abs().max().item(), position
