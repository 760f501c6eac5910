"""The planner's entry points: ``plan`` (one step, checkpointing and pages placed as asked), ``plan_placed``
(the pages placed as a training step would place them) and ``max_context`` (the longest context that fits)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..config import OFFLOADS, SparseConfig
from ..host_memory import host_budget
from ..model_shape import ModelShape, Precision, _kv_dtype
from .assumptions import DEFAULT_MATMUL_TFLOPS, OFFLOAD_SEGMENT_TOKENS
from .config import PlanConfig, Sharding
from .estimate import estimate_step
from .memory import loss_grad_bytes
from .placement import Pages, kept_for_stage_2, page_choices, place_pages
from .report import ContextLimit, Plan, usable_gpu_bytes
from .suggestions import suggestions_for


def this_gpu_memory() -> tuple[int, str]:
    """(total bytes, name) of this machine's current CUDA device; ValueError when there is none."""
    if not torch.cuda.is_available():
        raise ValueError(
            "there is no CUDA device on this machine to plan for: give the GPU's memory "
            "(gpu_memory=140 * 2**30, or --gpu-memory 140GiB for an H200, 79GiB for an H100/A100 80GB: what torch "
            "sees of them)"
        )
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(props.total_memory), props.name


def plan(
    model: Any,
    context: int,
    *,
    stage_1_loss: bool = False,
    loss_grads: str | None = None,
    host_process_bytes: int | None = None,
    host_pending_bytes: int | None = None,
    chunk_size: int = 4096,
    batch: int = 1,
    page_size: int = 128,
    lora_rank: int = 0,
    optimizer: str = "adamw",
    precision: Precision = "bf16-true",
    checkpoint_layers: bool | None = None,
    grad_dtype: torch.dtype = torch.float32,
    gpu_memory: int | float | None = None,
    host_memory: int | float | None = None,
    matmul_tflops: float = DEFAULT_MATMUL_TFLOPS,
    sparse: SparseConfig | dict | None = None,
    offload: bool = False,
    segment_tokens: int = OFFLOAD_SEGMENT_TOKENS,
    host_grad_layers: int | None = 0,
    kept_chunks: int = 0,
    graph_chunks: int = 0,
    host_kept_chunks: int = 0,
    fused_ops: bool = True,
    devices: int = 1,
    host_kv_layers: int = 0,
    document_length: int | None = None,
    sharding: Sharding = "none",
    tensor_parallel: int = 1,
) -> Plan:
    """Plan one training step of ``batch`` sequences of ``context`` tokens; the other keywords are
    ``PlanConfig``'s fields, these decided here when None:

    model: a ModelShape, a built-in name (``builtin_names()``), a config.json or model directory, a
    transformers config (or its dict) or model. checkpoint_layers None: off if the step fits, else on.
    gpu_memory None: this machine's CUDA device. host_memory None: the budget a run started now would get
    (``host_memory.host_budget()``), divided among the ``devices`` x ``tensor_parallel`` ranks, as the
    strategies divide it; the plan is one rank's. host_grad_layers None (sparse): the fewest layers' pages on
    the host that fit (``placement.page_choices``). loss_grads None: where ``place_step`` would keep a served
    step's dL/dh (``placement.place_pages``). sparse: a SparseConfig or its dict.
    """
    shape = ModelShape.resolve(model)
    machine = ""
    if gpu_memory is None:
        gpu_memory, machine = this_gpu_memory()
    if host_memory is None:
        host_memory = host_budget()
    gpu_memory, host_memory = int(gpu_memory), int(host_memory)
    base = PlanConfig(
        context=context,
        chunk_size=chunk_size,
        batch=batch,
        page_size=page_size,
        lora_rank=lora_rank,
        optimizer=optimizer,
        precision=precision,
        checkpoint_layers=bool(checkpoint_layers),
        grad_dtype=grad_dtype,
        matmul_tflops=matmul_tflops,
        sparse=SparseConfig.coerce(sparse),
        offload=offload,
        segment_tokens=segment_tokens,
        host_grad_layers=host_grad_layers or 0,
        kept_chunks=kept_chunks,
        graph_chunks=graph_chunks,
        host_kept_chunks=host_kept_chunks,
        fused_ops=fused_ops,
        stage_1_loss=stage_1_loss,
        loss_grads=loss_grads or "gpu",
        host_process_bytes=host_process_bytes,
        host_pending_bytes=host_pending_bytes,
        devices=devices,
        host_kv_layers=host_kv_layers,
        document_length=document_length,
        sharding=sharding,
        tensor_parallel=tensor_parallel,
    )
    shape = shape.tensor_parallel_part(base.tensor_parallel)
    # each process's share: the strategies divide the budget among a machine's processes alike
    host_memory //= base.devices * base.tensor_parallel

    usable_gpu = usable_gpu_bytes(gpu_memory)

    def placed(config: PlanConfig, choices: list[Pages], host_room: float) -> Plan:
        """The plan of ``config`` with the pages of the first of ``choices`` that fits, as ``place_step`` decides
        (``place_pages``), a served step's dL/dh placed too unless ``loss_grads`` was given."""
        kept = 0  # every chunk's dL/dh a served step keeps, where this plan decides their place
        if loss_grads is None and config.stage_1_loss and config.loss_grads != "recomputed":
            kept = loss_grad_bytes(shape, config.chunk_tokens, config.n_chunks, config.precision)
        plans: dict[Pages, Plan] = {}

        def with_pages(pages: Pages, **changes: Any) -> PlanConfig:
            return dataclasses.replace(config, offload=pages.offload, host_grad_layers=pages.host_grad_layers,
                                       host_kv_layers=pages.host_kv_layers, **changes)

        def needs(pages: Pages) -> tuple[int, int]:
            changes = {"loss_grads": "recomputed"} if kept else {}
            p = plans[pages] = estimate_step(shape, with_pages(pages, **changes), gpu_memory, host_memory, machine)
            return p.peak_gpu_bytes, p.peak_host_bytes

        decision = place_pages(choices, needs, usable_gpu, host_room, kept)
        if not kept or decision.loss_grads == "recomputed":
            return plans[decision.pages]
        return estimate_step(shape, with_pages(decision.pages, loss_grads=decision.loss_grads), gpu_memory,
                             host_memory, machine)

    def own_pages(config: PlanConfig) -> list[Pages]:
        return [Pages(config.offload, config.host_grad_layers, config.host_kv_layers)]

    def estimate(config: PlanConfig) -> Plan:
        """``config`` as it is, a served step's dL/dh where it fits on the GPU (a suggestion's numbers)."""
        return placed(config, own_pages(config), math.inf)

    def fewest_on_host(config: PlanConfig) -> Plan:
        """``config`` with the fewest sparse layers' pages on the host that fit the GPU."""
        return placed(config, page_choices("auto", True, shape.n_layers), math.inf)

    def placed_as_asked(config: PlanConfig) -> Plan:
        # Host layers are chosen for each layer-checkpointing setting: checkpointing may need fewer.
        sparse_auto = host_grad_layers is None and config.sparse
        choices = page_choices("auto", True, shape.n_layers) if sparse_auto else own_pages(config)
        return placed(config, choices, host_memory)

    result = placed_as_asked(base)
    other = placed_as_asked(dataclasses.replace(base, checkpoint_layers=not base.checkpoint_layers))
    if checkpoint_layers is None and not result.fits:
        result, other = other, result
        result.checkpoint_auto = True
    elif checkpoint_layers is None:
        result.checkpoint_auto = True
    result.other_activation_bytes = next(v for k, v in other.gpu_lines.items() if k.startswith("activations"))
    result.suggestions = suggestions_for(result, estimate, fewest_on_host)
    return result


def plan_placed(model: Any, context: int, *, offload: str = "auto", sparse: SparseConfig | dict | None = None,
                **kwargs: Any) -> Plan:
    """``plan`` with the pages placed as a training step with ``offload`` ("auto", "gpu", "host") would place
    them: dense steps stream every page from the host ("host", or "auto" when it fits only there); sparse
    steps put the KV-gradient and K/V pages of every layer ("host") in host memory, or the fewest layers'
    pages that fit ("auto": gradient pages first, then K/V pages). Other keyword arguments go to ``plan``."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}, got {offload!r}")
    sparse = SparseConfig.coerce(sparse)
    if sparse is not None:
        choices = page_choices(offload, True, ModelShape.resolve(model).n_layers)
        if len(choices) > 1:  # "auto": plan() tries them in order, for each checkpointing setting
            result = plan(model, context, sparse=sparse, host_grad_layers=None, **kwargs)
        else:
            result = plan(model, context, sparse=sparse, host_grad_layers=choices[0].host_grad_layers,
                          host_kv_layers=choices[0].host_kv_layers, **kwargs)
        c = result.config
        if c.host_grad_layers and offload == "auto":
            result.notes.append("the KV-gradient pages do not all fit on the GPU: offload='auto' keeps those of "
                                f"{c.host_grad_layers} layers in pinned host memory"
                                + (f", and the K/V pages of {c.host_kv_layers}" if c.host_kv_layers else ""))
        return _kept_for_stage_2(result)
    # Dense: the pages in page_choices' order, each placement with both checkpointing settings (plan()).
    first, *others = page_choices(offload, False, 0)
    result = plan(model, context, offload=first.offload, **kwargs)
    if not result.fits:
        for pages in others:  # "auto": every page streamed from the host
            on_host = plan(model, context, offload=pages.offload, **kwargs)
            if on_host.fits:
                on_host.notes.append("the pages do not fit on the GPU: offload='auto' puts them in pinned host memory")
                return on_host
    return _kept_for_stage_2(result)


def max_context(model: Any, *, offload: str = "auto", chunk_size: int = 4096, limit: int = 1 << 30,
                **kwargs: Any) -> ContextLimit:
    """The longest context (tokens per sequence, a multiple of ``chunk_size``, at most ``limit``) whose step
    fits, as ``plan_placed`` with ``offload`` would place it, and the machine's physical limit
    (``ContextLimit``). Other keyword arguments go to ``plan_placed`` (batch, lora_rank, sparse, optimizer,
    gpu_memory, host_memory, ...). Assumes that a step that fits at some length fits at every shorter one."""
    def placed(chunks: int) -> Plan:
        return plan_placed(model, chunks * chunk_size, offload=offload, chunk_size=chunk_size, **kwargs)

    one = placed(1)
    # The machine's limit starts from the smallest fixed cost: with layer checkpointing unless it is refused.
    least = one if kwargs.get("checkpoint_layers") is False else plan_placed(
        model, chunk_size, offload=offload, chunk_size=chunk_size, **{**kwargs, "checkpoint_layers": True})
    c = least.config
    per_token = c.batch * (least.shape.kv_bytes_per_token(_kv_dtype(c.precision))
                           + least.shape.kv_bytes_per_token(c.grad_dtype))
    host_room = least.host_memory - sum(v for k, v in least.host_lines.items() if k.startswith("process"))
    # The one-chunk step's own pages on the GPU are room for tokens too (its pinned ones are in host_room).
    own_pages = sum(v for k, v in least.gpu_lines.items() if k.startswith(("K/V pages", "KV-gradient pages")))
    gpu_room = least.usable_gpu_bytes - least.peak_gpu_bytes + own_pages
    physical = max(0, gpu_room + host_room) // per_token
    if not one.fits:
        return ContextLimit(0, one, physical, per_token)
    low, high, best = 1, 2, one  # placed(low) fits; find a high that does not
    most = max(1, limit // chunk_size)
    while high <= most:
        result = placed(high)
        if not result.fits:
            break
        low, best, high = high, result, 2 * high
    high = min(high, most + 1)
    while high - low > 1:
        mid = (low + high) // 2
        result = placed(mid)
        if result.fits:
            low, best = mid, result
        else:
            high = mid
    return ContextLimit(low * chunk_size, best, physical, per_token)


def _kept_for_stage_2(result: Plan) -> Plan:
    """The plan with the chunks' autograd graphs and attention outputs a step would keep (keep_graphs=None,
    keep_attention=None) in what this plan leaves free, as place_step decides it: their memory and the
    stage-2 work they save, said in a note."""
    c = result.config
    if c.offload or c.host_grad_layers or c.host_kv_layers or not result.fits:
        return result
    kept, graphs = kept_for_stage_2(result, result.usable_gpu_bytes - result.peak_gpu_bytes)
    if not (kept or graphs):
        return result
    placed = estimate_step(result.shape, dataclasses.replace(c, kept_chunks=kept, graph_chunks=graphs),
                       result.gpu_memory, result.host_memory, result.machine)
    placed.checkpoint_auto, placed.other_activation_bytes = result.checkpoint_auto, result.other_activation_bytes
    placed.suggestions = result.suggestions
    placed.notes = result.notes + [
        f"a step keeps stage 1's autograd graphs of the last {graphs} and the attention outputs of {kept} more "
        f"of {c.n_chunks} chunks in the memory to spare (keep_graphs=None, keep_attention=None), so stage 2 "
        "skips their forward or their attention forward"
    ]
    return placed
