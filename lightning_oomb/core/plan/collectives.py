"""The collectives one step issues per rank with several GPUs (data parallel, sharded, tensor parallel) and
their seconds at COLLECTIVE_GBPS (docs/planner.md, "Several GPUs", "Tensor parallel")."""

from __future__ import annotations

from dataclasses import dataclass

from ..model_shape import PROFILES, ModelShape
from .assumptions import COLLECTIVE_GBPS, TP_COLWISE, TP_ROWWISE
from .config import PlanConfig
from .formatting import bytes_name


@dataclass(frozen=True)
class Collective:
    """One collective a step issues on every rank, ``calls`` times per step, each moving ``bus_bytes`` over a
    rank's link (the mean of the calls where a shorter last chunk moves less): a ring reduce-scatter or
    all-gather of a B-byte buffer (N - 1) / N x B, an all-reduce twice that. ``kind``: "all-reduce",
    "all-gather" or "reduce-scatter"; ``activations``: it sums a tensor-parallel layer's activations or their
    gradients (else weights or their gradients); ``seconds``: all calls at ``COLLECTIVE_GBPS``."""

    kind: str
    what: str
    calls: int
    bus_bytes: float
    activations: bool = False

    @property
    def seconds(self) -> float:
        return self.calls * self.bus_bytes / (COLLECTIVE_GBPS * 1e9)


def trainable_split(shape: "ModelShape", lora_rank: int, lora_experts: bool = False) -> tuple[int, int]:
    """(trainable parameters inside the decoder layers, trainable parameters of the root: embeddings, final norm,
    output layer). LoRA trains only adapters, which sit in the layers (``lora_experts``: on the stacked expert
    weights too)."""
    if lora_rank:
        return shape.lora_params(lora_rank, lora_experts), 0
    return shape.decoder_params, shape.root_params


def step_collectives(shape: "ModelShape", c: "PlanConfig") -> list[Collective]:
    """The collectives one step of ``c`` issues per rank. oomb_ddp (sharding "none"): the float32 all-reduce of
    every gradient after stage 2. Sharding (oomb_model_parallel, as its class docstring says): the decoder
    layers' weights all-gathered (zero1 and zero2: once per step, in stage 1's first chunk; zero3: for every
    chunk's forward in both stages, less the stage-2 forwards that kept graphs skip, and again for its
    backward), their gradients reduce-scattered in float32 (zero2 and zero3: after every chunk's backward;
    zero1: once, after the last), and the root's gradients all-reduced in float32 after stage 2. Tensor
    parallel: ``tensor_parallel_collectives``, and the whole weights' gradients all-reduced in float32 over the
    T ranks (alone) or, with sharding over data-parallel ranks too (``shape``: one rank's part), the root's over
    all D x T ranks. None on one device."""
    found = tensor_parallel_collectives(shape, c) if c.tensor_parallel > 1 else []
    n = c.devices
    world = n * c.tensor_parallel
    if n == 1:
        if c.tensor_parallel > 1:
            replicated = shape.n_layers * shape.layer_replicated_params + shape.root_params
            found.append(Collective("all-reduce", "the whole weights' gradients (float32)", 1,
                                    2 * (world - 1) / world * 4 * replicated))
        return found
    layer_trainable, root_trainable = trainable_split(shape, c.lora_rank, c.lora_experts)
    if c.sharding == "none":
        return [Collective("all-reduce", "every gradient (float32)", 1, 2 * (n - 1) / n * 4 * (layer_trainable +
                                                                                           root_trainable))]
    share = (n - 1) / n
    weights = shape.decoder_params + (layer_trainable if c.lora_rank else 0)
    param = PROFILES[c.precision].param
    graphs = 0 if c.checkpoint_layers else min(c.graph_chunks, c.n_chunks)
    gathers = 3 * c.n_chunks - graphs if c.sharding == "zero3" else 1
    found += [
        Collective("all-gather", f"the decoder layers' weights ({bytes_name(param)})", gathers,
                   share * weights * param),
        Collective("reduce-scatter", "the decoder layers' gradients (float32)",
                   1 if c.sharding == "zero1" else c.n_chunks, share * layer_trainable * 4),
    ]
    if root_trainable:
        found.append(Collective("all-reduce", "the root's gradients (float32)", 1,
                                2 * (world - 1) / world * 4 * root_trainable))
    return found


def tensor_parallel_collectives(shape: "ModelShape", c: "PlanConfig") -> list[Collective]:
    """The all-reduces one step of ``c`` issues on each of its ``c.tensor_parallel`` ranks (``shape``: one rank's
    part), as torch's tensor parallelism runs the decoder layers: in every forward of a layer, o_proj's and
    down_proj's outputs (RowwiseParallel: each rank's partial sums), (batch x chunk tokens x hidden) in the
    linear dtype; in every backward, the gradients of q/k/v_proj's and gate/up_proj's inputs (ColwiseParallel:
    each module sums its own), the same size in the dtype of their input, the normed residual stream. A layer
    runs forward in stage 1 (not the last layer where stage 1 ends at its K/V store), in stage 2 (not for a
    chunk whose graph stage 1 kept; kept attention outputs spare only the attention) and again in a layer
    checkpoint's recompute, which ends when down_proj has saved its input (torch's non-reentrant checkpoint
    stops there), before down_proj's all-reduce."""
    ring = 2 * (c.tensor_parallel - 1) / c.tensor_parallel  # of the buffer, per all-reduce
    p = PROFILES[c.precision]
    layers = shape.n_layers
    graphs = 0 if c.checkpoint_layers else min(c.graph_chunks, c.n_chunks)
    forwards = forward_tokens = 0  # all-reduces of o_proj's and down_proj's outputs, and their tokens summed
    for index, start in enumerate(range(0, c.context, c.chunk_size)):
        graph = index >= c.n_chunks - graphs
        passes = layers - (not graph and not c.stage_1_loss) + (0 if graph else layers)  # stage 1, stage 2
        calls = TP_ROWWISE * passes + (TP_ROWWISE - 1) * layers * c.checkpoint_layers  # and the recompute
        forwards += calls
        forward_tokens += calls * c.batch * min(c.chunk_size, c.context - start)
    backwards, backward_tokens = TP_COLWISE * layers * c.n_chunks, TP_COLWISE * layers * c.batch * c.context
    return [
        Collective("all-reduce", f"o_proj's and down_proj's outputs ({bytes_name(p.linear)}), every layer forward",
                   forwards, ring * forward_tokens * shape.hidden * p.linear / forwards, activations=True),
        Collective("all-reduce", f"the input gradients of q/k/v_proj and gate/up_proj ({bytes_name(p.residual)}), "
                   "every layer backward", backwards, ring * backward_tokens * shape.hidden * p.residual / backwards,
                   activations=True),
    ]
