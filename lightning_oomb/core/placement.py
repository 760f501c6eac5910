"""Where a training step's pages live, decided before anything is allocated: ``place_step`` (called by the
engine for every step and by PagedKVCallback at fit start) checks the step's plan (``core.plan``) against
the GPU's free memory and the run's host memory budget, chooses the GPU or pinned host memory for the pages
and how much of stage 1 to keep for stage 2, and refuses with the plan what cannot fit (docs/planner.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from ..integrations.transformers import causal_lm
from .attention import uses_triton
from .config import ChunkConfig
from .host_memory import available_host_memory, host_budget, host_headroom, process_host_bytes
from .model_shape import ModelShape, _kv_dtype
from .plan import Plan, PlanConfig, PlanError, plan
from .plan.assumptions import (
    FIRST_STEP_RUNTIME_BYTES, HOST_GROWTH_BYTES, OFFLOAD_SEGMENT_TOKENS, OFFLOAD_STAGING_SHARE,
    PLACEMENT_HEADROOM_SHARE,
)
from .plan.memory import loss_grad_bytes
from .plan.config import Pages
from .quantization import Quantization
from .plan.placement import asked_graphs, host_kept_for_stage_2, kept_for_stage_2, page_choices, place_pages
from .units import GIB

# Lines of a plan that exist before a step starts (the model, its gradients and optimizer state, the CUDA
# context); everything else is what the step itself allocates.
_RESIDENT_LINES = ("weights", "gradients", "optimizer state", "bf16 weight copies", "CUDA context")


@dataclass(frozen=True)
class Placement:
    """Where a step keeps its pages: ``where`` "gpu" (the device) or "host" (pinned host memory, streamed
    through the GPU in segments of ``segment_tokens`` tokens of each of ``batch`` sequences). With "gpu" and
    sparse attention, the KV-gradient pages of ``host_grad_layers`` layers (spread over those without a
    sliding window) may live in pinned host memory, added into from the GPU (``PagePool``). With every page on
    the GPU, stage 1 keeps the autograd graphs of the last ``graph_chunks`` chunks and the attention outputs of
    the ``kept_chunks`` chunks before them for stage 2, which then skips their forward or their attention
    forward. A step that
    computes its loss in stage 1 (a served forward) keeps every chunk's dL/dh until stage 2 where
    ``loss_grads`` says: "gpu" (the device), "host" (pinned host memory), or "recomputed" (not kept: stage 2
    runs the output layer again). With the pages on the GPU or streamed, stage 1 may also keep
    the attention outputs of the first ``host_kept_chunks`` chunks in pinned host memory. With sparse
    attention, the K/V pages of ``host_kv_layers`` layers may live in pinned host memory too, of which each
    attention call gathers the selected pages (``PagePool``).

    ``host_limit``: the pinned host bytes the host memory budget leaves beyond the process and its growth
    allowance, which the pool's ``HostLedger`` holds it to; None: unchecked (a CPU device). ``host_budget``:
    that budget (bytes); ``host_process``: the process's bytes from which the growth allowance counts. A step
    that reuses the pool places itself against the same two (the run has one budget, decided once).
    ``plan``: the plan of the step as placed (the run's memory by line, against the GPU and the host memory
    budget), for people."""

    where: str
    segment_tokens: int
    batch: int = 1
    host_grad_layers: int = 0
    kept_chunks: int = 0
    graph_chunks: int = 0
    loss_grads: str = "gpu"
    host_kept_chunks: int = 0
    host_limit: int | None = None
    host_kv_layers: int = 0
    host_budget: int | None = field(default=None, compare=False)
    host_process: int = field(default=0, compare=False)
    plan: "Plan | None" = field(default=None, compare=False, repr=False)


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (a DTensor's local shard), whose gradient the rank allocates."""
    return p.to_local() if isinstance(p, DTensor) else p


def run_host_budget(host_memory: int | None, process: int, reused: Placement | None,
                    pending_host_bytes: int = 0) -> tuple[int, int]:
    """(the host memory budget a step places itself against, the process bytes its growth allowance
    HOST_GROWTH_BYTES counts from), in bytes. A step with a pool of its own: ``host_budget(host_memory)`` and
    ``process`` as it is now. A step reusing the pool that placement ``reused`` made: that placement's budget,
    the run's one, and its process, unless the process has since grown past the allowance (then the excess).
    ``reused.host_process`` includes what that placement set aside for the optimizer's first update; while
    the update is still pending (``pending_host_bytes``, which this step counts again) it is left out, so
    the second step before the first update is not refused for the same bytes counted twice."""
    if reused is None or reused.host_budget is None:
        return host_budget(host_memory), process
    return reused.host_budget, max(process - HOST_GROWTH_BYTES, reused.host_process - pending_host_bytes)


def gpu_room(device: torch.device, gpu_memory: int | None = None) -> tuple[int, int]:
    """(bytes the process may still allocate on ``device``, the memory it is placed against): the device's
    free memory plus what the caching allocator holds unused, of the whole device; with a budget of
    ``gpu_memory`` bytes (``ChunkConfig.gpu_memory``) at most that budget less what is allocated, against a
    device of that size."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    room = free + torch.cuda.memory_reserved(device) - allocated
    if gpu_memory is None:
        return room, total
    return min(room, gpu_memory - allocated), min(total, gpu_memory)


def place_step(
    model: Any, batch: int, seq_len: int, config: ChunkConfig, device: torch.device,
    reusable_gpu_bytes: int = 0, reusable_host_bytes: int = 0, stage_1_loss: bool = False,
    optimizer: str = "none", pending_gpu_bytes: int = 0, pending_host_bytes: int = 0,
    host_grad_layers: int | None = None,
    agree: Callable[[list[int]], list[int]] = lambda values: values, host_kv_layers: int | None = None,
    kv_head_split: int = 1, document_length: int | None = None, reused: Placement | None = None,
    training: bool = True,
) -> Placement:
    """Decide where a step's pages live, and refuse, before anything is allocated, a step that cannot fit.

    ``config`` is the step's ChunkConfig; its ``offload`` is "gpu", "host" or "auto" (the GPU when the step
    fits there, the host when it fits only there). With sparse attention the host holds KV-gradient pages
    and then K/V pages, layer by layer: of every layer with "host", of the fewest layers that make the step
    fit with "auto" (``host_layer_counts``; ``host_grad_layers`` and ``host_kv_layers``, when given: those
    of a pool every step must use). On CUDA compares what the step allocates (pages or their staging, one chunk's activations,
    the loss pieces, parameter gradients not yet allocated, ``pending_gpu_bytes`` the run allocates later,
    such as optimizer state its first update creates; ``pending_host_bytes`` what that update adds to the
    process's host memory beyond the growth allowance) with the device's free memory plus
    ``reusable_gpu_bytes`` (a pool the step would reuse or replace). Host memory has one budget
    (``config.host_memory``, else ``host_memory.host_budget()``): what the process holds now (less
    ``reusable_host_bytes`` of a pool it reuses), HOST_GROWTH_BYTES for what it may add, and every pinned
    block the step makes must fit in it. Raises PlanError with the plan and what would make it fit. On a
    CPU device, whose memory is the host's, the step (what it adds to the process) and the host lines together
    must fit in the budget.

    With every page on the GPU it also decides how many chunks' autograd graphs and attention outputs
    stage 1 keeps for stage 2 (``config.keep_graphs``, ``config.keep_attention``: that many, refused if
    they do not fit; None: the last chunk's graph, attention outputs in KEPT_ATTENTION_SHARE of the memory
    the step leaves free (none on a CPU device), more graphs in KEPT_GRAPHS_SHARE of what is left, and the
    attention outputs of the first chunks in what the host memory budget leaves). With streamed pages only
    the last: the attention outputs of the first chunks in pinned host memory (``keep_attention=None``).

    ``stage_1_loss``: the step computes its loss in stage 1 and keeps every chunk's dL/dh for stage 2: on
    the GPU when every page is there and they fit in what the step leaves free (before anything is kept
    for stage 2), else in pinned host memory. Only where no placement of the pages leaves room for them
    anywhere does stage 2 compute them again (``loss_grads="recomputed"``: the output layer's forward once
    more, about 2 x vocab x hidden FLOPs a token), so every step that fits with them keeps them.
    ``optimizer`` (a name of ``PLAN_OPTIMIZERS``) is only for the plan the placement carries.

    ``training`` False: a forward over the chunks alone (``eval_loss``, ``generate``, scoring), which keeps no
    gradients, KV-gradient pages, dL/dh or stage-1 results for a stage 2 (PlanConfig.training).

    ``agree``: maps this process's free GPU bytes and host room to the least over the data-parallel ranks
    (``core.ranks``), so that every rank, placing the same step against the same memory, decides alike.
    ``kv_head_split``: this rank is one of that many tensor-parallel ranks (``Ranks.kv_head_split``), holding
    their share of the KV heads' pages and of the decoder layers: the step is planned for that part.
    ``document_length``: the sequences are packed from documents of about that many tokens (the plan's time
    counts attention within them; memory does not depend on it).
    ``reused``: the placement of the pool this step reuses (``reusable_host_bytes``): its host budget stays the
    run's, and its growth allowance counts from the process as it was then, so that a step is not refused
    for memory the placement that made the pool already accounted for.
    """
    page = config.page_size
    sparse = config.sparse is not None
    n_chunks = -(-seq_len // config.chunk_size)
    keep, keep_graphs = config.keep_attention, config.keep_graphs
    process = max(0, process_host_bytes() - reusable_host_bytes)
    budget, grown_from = run_host_budget(config.host_memory, process, reused, pending_host_bytes)

    def not_kept(where: str) -> tuple[int, int]:
        for name, value in (("keep_attention", keep), ("keep_graphs", keep_graphs)):
            if value:
                raise PlanError(
                    f"{name}={value} keeps stage 1's results on the GPU next to every page, but this step's "
                    f"pages go to host memory ({where}); set {name}=None (or 0)"
                )
        return 0, 0

    def last_graph_only(host_grad_layers: int) -> tuple[int, int]:
        # With host gradient layers the GPU has no room for stage 1's results but the last chunk's graph,
        # which costs nothing (stage 2 would hold it next) and is done before stage 2 moves any layer.
        graphs = asked_graphs(n_chunks, config.checkpoint_layers, keep_graphs)
        if keep or graphs > 1:
            raise PlanError(
                f"keep_attention={keep} and keep_graphs={keep_graphs} keep stage 1's results on the GPU, which has "
                f"no room for them next to this step's pages ({host_grad_layers} layers' KV-gradient pages go to "
                "host memory); set keep_attention=None and keep_graphs=None (or at most 1)"
            )
        return 0, graphs

    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    peft_config = getattr(model, "peft_config", None)
    adapter = next(iter(peft_config.values())) if peft_config else None
    lora_rank = adapter.r if adapter is not None else 0
    # peft's target_parameters on a mixture of experts: its stacked expert weights adapted too
    lora_experts = bool(getattr(adapter, "target_parameters", None)) and ModelShape.resolve(model).n_experts > 0
    # QLoRA: the base weights as bitsandbytes holds them (4 bits), not at the weights' dtype
    quantization = Quantization.of_model(causal_lm(model).config) if lora_rank else None
    if torch.is_autocast_enabled(device.type):
        precision = "bf16-mixed"
    else:
        # the weights' dtype (LoRA adapters may train in float32 under bf16-true)
        precision = "32-true" if params and params[0].dtype == torch.float32 else "bf16-true"

    def step_plan(pages: Pages, segment: int, **decided: Any) -> Plan:
        """The plan of this step with ``pages``, streamed in segments of ``segment`` tokens, and what else
        ``decided`` names (PlanConfig's fields)."""
        # plan() shares its host memory among the tensor-parallel ranks; budget is this process's share already.
        # The optimizer's state is a resident line, which the checks below leave out (they count what is still
        # pending in ``missing``); the plan names it so that a refusal's plan and suggestions count it.
        chunk = ChunkConfig.build(config, chunk_size=min(config.chunk_size, seq_len),
                                  host_memory=budget * kv_head_split, segment_tokens=segment)
        return plan(model, PlanConfig(
            seq_len, chunk, batch=batch, lora_rank=lora_rank, lora_experts=lora_experts, quantization=quantization,
            optimizer=optimizer,
            precision=precision, tensor_parallel=kv_head_split, fused_ops=uses_triton(config.attention, device),
            host_process_bytes=process, host_pending_bytes=pending_host_bytes, pages=pages, training=training,
            **decided,
        ), gpu_memory=gpu_total)

    def placed(placement: Placement) -> Placement:
        """``placement`` with its pinned-byte limit and the plan of the step as placed."""
        result = step_plan(
            Pages(placement.where == "host", placement.host_grad_layers, placement.host_kv_layers),
            placement.segment_tokens, kept_chunks=placement.kept_chunks, graph_chunks=placement.graph_chunks,
            host_kept_chunks=placement.host_kept_chunks, stage_1_loss=stage_1_loss,
            loss_grads=placement.loss_grads, document_length=document_length,
        )
        if device.type != "cuda":
            result.gpu_lines.pop("CUDA context and workspaces (assumed)", None)
            result.device = "cpu"
            check_on_cpu(result)
            return dataclasses.replace(placement, plan=result)
        if placement.where == "gpu":
            result.placed_against = (needed_on_gpu(result), free)
        # the next step's growth allowance counts from what this one planned the process to reach
        return dataclasses.replace(placement, host_limit=host_free, host_budget=budget,
                                   host_process=grown_from + pending_host_bytes, plan=result)

    missing = pending_gpu_bytes
    if training:
        missing += sum(_local(p).numel() * p.element_size() for p in trainable if p.grad is None)

    def check_on_cpu(step: Plan) -> None:
        """A CPU run keeps everything in RAM: the host lines (the process, its growth allowance, host pages) and
        what the step adds to the process must fit in the budget. Checked where a pool is placed; a step that
        reuses one was placed with it (its process has grown by what the first step left cached)."""
        adds = sum(v for k, v in step.gpu_lines.items() if not k.startswith(_RESIDENT_LINES)) + missing
        need = step.peak_host_bytes + max(0, adds - reusable_gpu_bytes)
        if reused is not None or need <= budget:
            step.notes.append(f"no CUDA device: the step's memory is this machine's RAM too; with the process and "
                              f"its growth allowance it needs {need / GIB:.2f} GiB of the host memory budget of "
                              f"{budget / GIB:.2f} GiB")
            return
        free = available_host_memory()
        made = ("the host_memory given" if config.host_memory is not None else
                f"the process plus what is free, less a {host_headroom(available=free) / GIB:.2f} GiB headroom")
        raise PlanError(
            f"this CPU run needs {need / GIB:.2f} GiB of host memory (the process's {process / GIB:.2f} GiB, "
            f"{HOST_GROWTH_BYTES / GIB:.0f} GiB for its growth, {adds / GIB:.2f} GiB for the step) but this machine "
            f"has {free / GIB:.2f} GiB free and the run's host memory budget is {budget / GIB:.2f} GiB ({made}); "
            "nothing was allocated for it. Free memory, give host_memory, or train a smaller model or context"
            f"\n\n{step}"
        )

    if device.type != "cuda":
        gpu_total = host_free = budget
        segment = config.segment_tokens or max(page, min(config.chunk_size, seq_len))
        if config.offload == "host":
            not_kept("offload='host'")
            graphs = 0
        else:  # the last chunk's graph (free: stage 2 would hold it next), none with layer checkpointing
            graphs = asked_graphs(n_chunks, config.checkpoint_layers, keep_graphs) if training else 0
        # keep_attention=None: nothing on a CPU device, whose memory is the host's
        kept = min(keep or 0, n_chunks - graphs) if training else 0
        if sparse:
            n_layers = ModelShape.resolve(model).full_kv_layers  # window layers keep theirs on the device
            layers = n_layers if config.offload == "host" else 0
            return placed(Placement("gpu", segment, batch, layers, kept, graphs, host_kv_layers=layers))
        if config.offload == "host":
            return placed(Placement("host", segment, batch))
        return placed(Placement("gpu", segment, batch, kept_chunks=kept, graph_chunks=graphs))
    free, gpu_total = gpu_room(device, config.gpu_memory)
    free += reusable_gpu_bytes
    free -= int(PLACEMENT_HEADROOM_SHARE * gpu_total) + (0 if reusable_gpu_bytes else FIRST_STEP_RUNTIME_BYTES)
    host_free = budget - grown_from - HOST_GROWTH_BYTES - pending_host_bytes  # room for pinned blocks
    free, host_free = agree([free, host_free])
    shape = ModelShape.resolve(model).tensor_parallel_part(kv_head_split)
    chunk_tokens = batch * min(config.chunk_size, seq_len)
    loss_grads = stage_1_loss * training * loss_grad_bytes(shape, chunk_tokens, n_chunks, precision)

    def needed_on_gpu(step: Plan) -> int:
        return sum(v for k, v in step.gpu_lines.items() if not k.startswith(_RESIDENT_LINES)) + missing

    def pinned_of(step: Plan) -> int:
        return sum(v for k, v in step.host_lines.items() if k.startswith("pinned"))

    def host_short(pinned: int) -> str:
        return (
            f"{pinned / GIB:.2f} GiB of pinned host memory, but the host memory budget of {budget / GIB:.2f} GiB "
            f"leaves {host_free / GIB:.2f} GiB beyond the process's {process / GIB:.2f} GiB and a "
            f"{HOST_GROWTH_BYTES / GIB:.0f} GiB allowance for its growth"
            + ("" if config.host_memory is not None else
               f" (the budget: the process plus MemAvailable, less a {host_headroom() / GIB:.1f} GiB headroom)")
            + "; host_memory sets the budget"
        )

    def segment_tokens() -> int:
        if config.segment_tokens is not None:
            return config.segment_tokens
        # The longest segment whose double-buffered staging takes at most OFFLOAD_STAGING_SHARE of what the
        # step leaves free (at least one page, at most OFFLOAD_SEGMENT_TOKENS).
        needed = needed_on_gpu(step_plan(Pages(streamed=True), page))
        per_token = (shape.kv_bytes_per_token(_kv_dtype(precision))
                     + training * shape.kv_bytes_per_token(config.grad_dtype))
        per_token //= shape.kv_layers
        staging = max(0, free - needed) * OFFLOAD_STAGING_SHARE
        segment = int(staging // (2 * batch * per_token)) // page * page
        return min(max(segment, page), OFFLOAD_SEGMENT_TOKENS)

    steps: dict[Pages, Plan] = {}

    def step_of(pages: Pages) -> Plan:
        if pages not in steps:
            steps[pages] = step_plan(pages, segment_tokens() if pages.streamed else page)
        return steps[pages]

    def needs(pages: Pages) -> tuple[int, int]:
        return needed_on_gpu(step_of(pages)), pinned_of(step_of(pages))

    every = shape.full_kv_layers if sparse else shape.kv_layers  # a sparse step keeps window layers' on the GPU
    choices = page_choices(config.offload, sparse, every)
    if sparse and host_grad_layers is not None:  # the run's pool decided the layers
        choices = [Pages(host_grad_layers=host_grad_layers, host_kv_layers=host_kv_layers or 0)]
    # A dense step with its pages on the GPU pins nothing: it is not refused where the process alone has
    # outgrown the host budget.
    decision = place_pages(choices, needs, free, host_free if sparse else max(host_free, 0), loss_grads)
    pages, where = decision.pages, decision.loss_grads
    if not sparse and config.offload != "gpu" and (pages.streamed or not decision.fits):
        not_kept("offload='host'" if config.offload == "host" else "the step does not fit on the GPU")
    if not decision.fits:
        last = choices[-1]
        step, (needed, pinned) = step_of(last), needs(last)
        gpu_part = (f"{needed / GIB:.2f} GiB of GPU memory ({free / GIB:.2f} GiB free beyond a "
                    f"{PLACEMENT_HEADROOM_SHARE:.0%} reserve)")
        if sparse:
            pages_named = "KV-gradient and K/V pages" if training else "K/V pages"
            where = {"gpu": "on the GPU", "auto": f"with the {pages_named} of every layer in host memory",
                     "host": f"with the {pages_named} in host memory"}[config.offload]
            if host_grad_layers is not None:
                where = (f"with the KV-gradient pages of {last.host_grad_layers} and the K/V pages of "
                         f"{last.host_kv_layers} of {every} layers in host memory (the run's page pool)")
            raise PlanError(
                f"{where} this sparse step needs {gpu_part} and {host_short(pinned)}; nothing was allocated for it."
                + (" offload='auto' moves pages to the host, layer by layer." if config.offload == "gpu" else "")
                + f"\n\n{step}"
            )
        if not last.streamed:
            raise PlanError(
                f"this step needs {needed / GIB:.2f} GiB beyond what is already allocated but the GPU has "
                f"{free / GIB:.2f} GiB free beyond a {PLACEMENT_HEADROOM_SHARE:.0%} reserve; nothing was allocated "
                f"for it. offload='host' (or 'auto') keeps the pages in pinned host memory.\n\n{step}"
            )
        pinned += loss_grads if pinned + loss_grads <= host_free else 0
        raise PlanError(
            f"with its pages in pinned host memory this step needs {gpu_part} and {host_short(pinned)}; "
            f"nothing was allocated for it.\n\n{step}"
        )
    step = step_of(pages)
    needed, pinned = needs(pages)
    pinned += loss_grads if where == "host" else 0
    if pages.streamed:
        # The GPU holds only staging, so stage 1's attention outputs wait for stage 2 in pinned host memory, where
        # the budget has room: stage 2 then skips their attention forward and the streaming of its past.
        host_kept = host_kept_for_stage_2(step, host_free - pinned, 0, 0, keep) if training else 0
        return placed(Placement("host", step.config.segment_tokens, batch, loss_grads=where if loss_grads else "gpu",
                                host_kept_chunks=host_kept))
    spare = free - needed - (loss_grads if where == "gpu" else 0)
    n, m = pages.host_grad_layers, pages.host_kv_layers
    if not training:
        kept, host_kept = (0, 0), 0
    else:
        kept = kept_for_stage_2(step, spare, keep, keep_graphs) if n == 0 else last_graph_only(n)
        host_kept = host_kept_for_stage_2(step, host_free - pinned, *kept, keep)
    return placed(Placement("gpu", config.segment_tokens or OFFLOAD_SEGMENT_TOKENS, batch, n, *kept,
                            loss_grads=where, host_kept_chunks=host_kept, host_kv_layers=m))
