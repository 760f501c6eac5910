"""The planner's entry points: ``plan`` (one step, checkpointing and pages placed as asked), ``plan_placed``
(the pages placed as a training step would place them) and ``max_context`` (the longest context that fits)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..host_memory import host_budget
from ..model_shape import ModelShape, _kv_dtype
from ..pages import window_page_slots
from .config import Pages, PlanConfig
from .estimate import estimate_step
from .memory import loss_grad_bytes
from .placement import asked_graphs, host_kept_for_stage_2, kept_for_stage_2, page_choices, place_pages
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


def plan(model: Any, config: PlanConfig | int, *, checkpoint_auto: bool = False, **options: Any) -> Plan:
    """Plan one training step: ``config`` as given, its pages where ``config.pages`` puts them.

    model: a ModelShape, a built-in name (``builtin_names()``), a config.json or model directory, a transformers
    config (or its dict) or model. config: a PlanConfig, or the context (tokens per sequence); ``options``
    replace its fields by name (``PlanConfig.build``: ChunkConfig's, Pages' and PlanConfig's). The GPU is
    ``config.chunk.gpu_memory`` bytes (None: this machine's CUDA device). The host memory budget is
    ``config.chunk.host_memory`` (None: the
    budget a run started now would get, ``host_memory.host_budget()``), divided among the ``devices`` x
    ``tensor_parallel`` ranks, as the strategies divide it; the plan is one rank's. checkpoint_auto: layer
    checkpointing off if the step fits without it, else on, whatever ``checkpoint_layers`` asks.
    ``config.loss_grads`` None: where ``place_step`` would keep a served step's dL/dh (``placement.place_pages``).
    """
    return _plan(model, PlanConfig.build(config, **options), checkpoint_auto)


def _plan(model: Any, config: PlanConfig, checkpoint_auto: bool,
          choices: list[Pages] | None = None) -> Plan:
    """``plan``, with the pages at the first of ``choices`` that fits (for each layer-checkpointing setting)
    where given, else at ``config.pages``."""
    shape = ModelShape.resolve(model)
    machine = ""
    gpu_memory = config.chunk.gpu_memory
    if gpu_memory is None:
        gpu_memory, machine = this_gpu_memory()
    host_memory = config.chunk.host_memory
    if host_memory is None:
        host_memory = host_budget()
    gpu_memory, host_memory = int(gpu_memory), int(host_memory)
    decide_loss_grads = config.loss_grads is None
    base = config.replace(loss_grads=config.loss_grads or "gpu")
    if checkpoint_auto:
        base = base.checkpointed(False)
    shape = shape.tensor_parallel_part(base.tensor_parallel)
    # each process's share: the strategies divide the budget among a machine's processes alike
    host_memory //= base.devices * base.tensor_parallel

    usable_gpu = usable_gpu_bytes(gpu_memory)

    def placed(config: PlanConfig, choices: list[Pages], host_room: float) -> Plan:
        """The plan of ``config`` with the pages of the first of ``choices`` that fits, as ``place_step`` decides
        (``place_pages``), a served step's dL/dh placed too unless ``loss_grads`` was given."""
        kept = 0  # every chunk's dL/dh a served step keeps, where this plan decides their place
        if decide_loss_grads and config.stage_1_loss and config.loss_grads != "recomputed":
            kept = loss_grad_bytes(shape, config.chunk_tokens, config.n_chunks, config.precision)
        plans: dict[Pages, Plan] = {}

        def with_pages(pages: Pages, **changes: Any) -> PlanConfig:
            return dataclasses.replace(config, pages=pages, **changes)

        def needs(pages: Pages) -> tuple[int, int]:
            changes = {"loss_grads": "recomputed"} if kept else {}
            p = plans[pages] = estimate_step(shape, with_pages(pages, **changes), gpu_memory, host_memory, machine)
            return p.peak_gpu_bytes, p.peak_host_bytes

        decision = place_pages(choices, needs, usable_gpu, host_room, kept)
        if not kept or decision.loss_grads == "recomputed":
            return plans[decision.pages]
        return estimate_step(shape, with_pages(decision.pages, loss_grads=decision.loss_grads), gpu_memory,
                             host_memory, machine)

    def estimate(config: PlanConfig) -> Plan:
        """``config`` as it is, a served step's dL/dh where it fits on the GPU (a suggestion's numbers)."""
        return placed(config, [config.pages], math.inf)

    def fewest_on_host(config: PlanConfig) -> Plan:
        """``config`` with the fewest sparse layers' pages on the host that fit the GPU."""
        return placed(config, page_choices("auto", True, shape.full_kv_layers), math.inf)

    def placed_as_asked(config: PlanConfig) -> Plan:
        # Host layers are chosen for each layer-checkpointing setting: checkpointing may need fewer.
        return placed(config, choices or [config.pages], host_memory)

    result = placed_as_asked(base)
    other = placed_as_asked(base.checkpointed(not base.checkpoint_layers))
    if checkpoint_auto and not result.fits:
        result, other = other, result
    result.checkpoint_auto = checkpoint_auto
    result.other_activation_bytes = next(v for k, v in other.gpu_lines.items() if k.startswith("activations"))
    # What would make a step fit or run faster is about training (LoRA, checkpointing, gradient dtypes).
    result.suggestions = suggestions_for(result, estimate, fewest_on_host) if base.training else []
    if shape.carried_layers:
        states = ("their border states are counted" if shape.carried_state_bytes else
                  "their border states are not in this plan (a training step counts them before it starts)")
        mixing = ("their token mixing counted in FLOPs at attention's efficiency" if shape.carried_mixing_flops else
                  "their token mixing as free")
        if shape.carried_ops != ((0.0, 0.0), (0.0, 0.0)):
            mixing += " and in the operations their torch path launches (counted on the meta device)"
        if not shape.kv_layers:
            result.notes.append(
                f"every layer carries a state across chunk borders ({shape.model_type}): no layer attends, so "
                f"there are no K/V pages; their projections are planned, {mixing}; {states}")
            return result
        if shape.carried_layers == shape.n_layers:
            result.notes.append(
                f"every layer runs a state-space mixer beside its attention ({shape.model_type}): K/V pages for "
                f"all {shape.kv_layers}, the mixers' weights in the model's total, {mixing}; {states}")
            return result
        weights = "counted as built" if shape.carried_matrices else "planned as attention's"
        result.notes.append(
            f"{shape.carried_layers} of {shape.n_layers} layers carry a state across chunk borders "
            f"({shape.model_type}): K/V pages for the other {shape.kv_layers} only; their projections "
            f"{weights}, {mixing}; {states}")
    return result


def plan_placed(model: Any, config: PlanConfig | int, *, checkpoint_auto: bool = False, **options: Any) -> Plan:
    """``plan`` with the pages placed as a training step with ``config.chunk.offload`` ("auto", "gpu", "host")
    would place them: dense steps stream every page from the host ("host", or "auto" when it fits only
    there); sparse steps put the KV-gradient and K/V pages of every layer ("host") in host memory, or the
    fewest layers' pages that fit ("auto": gradient pages first, then K/V pages); with every page on the GPU,
    what stage 1 keeps for stage 2 kept as a step would keep it (``_kept_for_stage_2``). ``config.pages`` is
    not read. The other arguments are ``plan``'s."""
    config = PlanConfig.build(config, **options)
    offload = config.chunk.offload
    if config.sparse is not None:
        choices = page_choices(offload, True, ModelShape.resolve(model).full_kv_layers)
        # "auto": _plan tries them in order, for each checkpointing setting
        result = _plan(model, config.replace(pages=choices[0]), checkpoint_auto,
                       choices if len(choices) > 1 else None)
        c = result.config
        if c.host_grad_layers and offload == "auto":
            result.notes.append("the KV-gradient pages do not all fit on the GPU: offload='auto' keeps those of "
                                f"{c.host_grad_layers} layers in pinned host memory"
                                + (f", and the K/V pages of {c.host_kv_layers}" if c.host_kv_layers else ""))
        return _kept_for_stage_2(result)
    # Dense: the pages in page_choices' order, each placement with both checkpointing settings (_plan).
    first, *others = page_choices(offload, False, ModelShape.resolve(model).kv_layers)
    result = _plan(model, config.replace(pages=first), checkpoint_auto)
    if not result.fits:
        for pages in others:  # "auto": every page streamed from the host
            on_host = _plan(model, config.replace(pages=pages), checkpoint_auto)
            if on_host.fits:
                on_host.notes.append("the pages do not fit on the GPU: offload='auto' puts them in pinned host memory")
                return _kept_for_stage_2(on_host)
    return _kept_for_stage_2(result)


def max_context(model: Any, config: PlanConfig | None = None, *, limit: int = 1 << 30,
                checkpoint_auto: bool = False, **options: Any) -> ContextLimit:
    """The longest context (tokens per sequence, a multiple of the chunk, at most ``limit``) whose step fits,
    as ``plan_placed`` would place it, and the machine's physical limit (``ContextLimit``). ``config`` (None:
    the defaults) and the other arguments as ``plan_placed`` takes them; each length tried replaces the
    context. Assumes that a step that fits at some length fits at every shorter one."""
    base = PlanConfig.build(limit if config is None else config, **options)
    chunk_size = base.chunk_size

    def placed(chunks: int, config: PlanConfig = base, auto: bool = checkpoint_auto) -> Plan:
        return plan_placed(model, config.replace(context=chunks * chunk_size), checkpoint_auto=auto)

    one = placed(1)
    # The machine's limit starts from the smallest fixed cost: with layer checkpointing unless it is refused.
    refused = not (checkpoint_auto or base.checkpoint_layers)
    least = one if refused else placed(1, base.checkpointed(True), False)
    c = least.config
    shape = least.shape
    # Sliding-window layers' gradient pages can be a ring of their window (core.pages.gradient_ring_pages),
    # which no token adds to, and their K/V pages those a later chunk's window reaches
    # (core.pages.window_page_slots: their share of a long sequence's pages): the limit counts the rest.
    full = shape.kv_layers - shape.window_layers
    kept = 0.0
    if shape.window_layers:
        long = 64 * c.chunk_size
        kept = window_page_slots(long, c.chunk_size, c.page_size, shape.window)[1] / math.ceil(long / c.page_size)
    kv_layer = shape.kv_bytes_per_token(_kv_dtype(c.precision)) / shape.kv_layers
    grad_layer = shape.kv_bytes_per_token(c.grad_dtype) / shape.kv_layers
    per_token = math.ceil(c.batch * (kv_layer * (full + shape.window_layers * kept) + grad_layer * full))
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
    keep_attention=None) in what this plan leaves free, as place_step decides it: on the GPU where every page
    is there, then the first chunks' outputs in the host memory budget's room (with streamed pages only
    those); their memory and the stage-2 work they save, said in a note."""
    c = result.config
    if not result.fits:
        return result
    if not c.pages.on_host:
        kept, graphs = kept_for_stage_2(result, result.usable_gpu_bytes - result.peak_gpu_bytes)
    else:  # host layers keep no more than the last chunk's graph on the GPU; streamed pages nothing
        kept, graphs = 0, 0 if c.streamed else asked_graphs(c.n_chunks, c.checkpoint_layers, None)
    host_kept = 0
    if result.shape.kv_layers:  # a model that attends nowhere has no attention outputs to keep
        host_kept = host_kept_for_stage_2(result, result.host_memory - result.peak_host_bytes, kept, graphs)
    if not (kept or graphs or host_kept):
        return result
    placed = estimate_step(result.shape, dataclasses.replace(c, kept_chunks=kept, graph_chunks=graphs,
                                                             host_kept_chunks=host_kept),
                           result.gpu_memory, result.host_memory, result.machine)
    placed.checkpoint_auto, placed.other_activation_bytes = result.checkpoint_auto, result.other_activation_bytes
    placed.suggestions = result.suggestions
    kept_where = []
    outputs = kept if result.shape.kv_layers else 0  # a model that attends nowhere keeps graphs only
    if graphs and outputs:
        kept_where.append(f"autograd graphs of the last {graphs} and the attention outputs of {outputs} more "
                          f"of {c.n_chunks} chunks in the GPU memory to spare")
    elif graphs or outputs:
        what = "autograd graphs" if graphs else "attention outputs"
        kept_where.append(f"{what} of the last {graphs or outputs} of {c.n_chunks} chunks in the GPU memory to spare")
    if host_kept:
        first = "the first chunk" if host_kept == 1 else f"the first {host_kept} chunks"
        kept_where.append(f"attention outputs of {first} in pinned host memory")
    placed.notes = result.notes + [
        f"a step keeps stage 1's {' and '.join(kept_where)} (keep_graphs=None, keep_attention=None), so stage 2 "
        "skips their forward or their attention forward"
    ] if kept_where else result.notes
    return placed
