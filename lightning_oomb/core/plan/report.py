"""What a plan says: ``Plan`` (memory by line, time, fit, suggestions) and its text, ``Suggestion``,
``ContextLimit`` (the longest context that fits), and ``PlanError`` (a step that would not fit)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import SparseConfig
from ..model_shape import ModelShape
from ..units import GIB
from .assumptions import (
    CARRIED_OP_LAUNCH_S, COLLECTIVE_GBPS, DEFAULT_MATMUL_TFLOPS, DEQUANT_GBPS, HOST_GATHER_GBPS, KERNEL_LAUNCH_S,
    LINEAR_EFFICIENCY, PLACEMENT_HEADROOM_SHARE, PORTABLE_ATTENTION_EFFICIENCY, STREAM_GBPS,
)
from .collectives import step_collectives
from .config import PlanConfig
from .formatting import dtype_name, duration, gb, gib
from .timing import StepTime



SHARDING_SUMMARY = {
    "zero1": "layers' weights gathered once per step, gradients summed whole and reduce-scattered once",
    "zero2": "layers' weights gathered once per step, gradients reduce-scattered after every chunk",
    "zero3": "layers' weights gathered for every chunk's forward and backward, gradients reduce-scattered after "
             "every chunk",
}



def usable_gpu_bytes(gpu_memory: int) -> int:
    """Bytes of ``gpu_memory`` a step may plan for: all of it less PLACEMENT_HEADROOM_SHARE."""
    return int(gpu_memory * (1 - PLACEMENT_HEADROOM_SHARE))


class PlanError(RuntimeError):
    """A step would not fit in memory; the message is the formatted plan with its suggestions."""


@dataclass
class Suggestion:
    """A change that would make a step fit (goal "memory") or run faster (goal "time"), with its plan: in
    words, as flags of ``lightning-oomb plan`` (``cli``) and as keyword arguments of ``plan()`` and the
    training API (``python``)."""

    change: str
    plan: "Plan"
    cli: str
    python: str
    goal: str = "memory"

    def render(self, style: str = "python") -> str:
        p = self.plan
        verdict = "fits" if p.fits else "still does not fit"
        host = f", host {gib(p.peak_host_bytes)} GiB" if p.config.streamed or p.config.host_grad_layers else ""
        how = self.cli if style == "cli" else self.python
        return (f"- {self.change} ({how}): GPU {gib(p.peak_gpu_bytes)} GiB{host}, {verdict}; "
                f"step ≈ {duration(p.time.predicted_s)}")

    def __str__(self) -> str:
        return self.render()


@dataclass
class Plan:
    """Memory (bytes, per named line) and time of one step of ``config`` for ``shape`` (the model, or with
    ``config.tensor_parallel`` > 1 one rank's part of it) on a machine."""

    shape: ModelShape
    config: PlanConfig
    gpu_lines: dict[str, int]
    host_lines: dict[str, int]
    time: StepTime
    gpu_memory: int
    host_memory: int
    machine: str = ""
    checkpoint_auto: bool = False
    other_activation_bytes: int | None = None
    # "cpu": a step on a CPU device, whose "GPU" lines are host memory too; printed without GPU-only lines.
    device: str = "cuda"
    # How suggestions name their changes: "python" (keyword arguments) or "cli" (lightning-oomb plan's flags).
    suggestion_style: str = "python"
    notes: list[str] = field(default_factory=list)
    suggestions: list[Suggestion] = field(default_factory=list)
    # A step placed on the GPU (core.placement): (the bytes it still allocates, the bytes free beyond the reserve),
    # measured where the plan assumes; its verdict is the placement's.
    placed_against: tuple[int, int] | None = None

    @property
    def peak_gpu_bytes(self) -> int:
        return sum(self.gpu_lines.values())

    @property
    def peak_host_bytes(self) -> int:
        return sum(self.host_lines.values())

    @property
    def usable_gpu_bytes(self) -> int:
        """GPU memory a step may plan for: all of it less the reserve ``place_step`` keeps."""
        return usable_gpu_bytes(self.gpu_memory)

    @property
    def fits(self) -> bool:
        """What ``place_step`` would decide: the GPU lines within the memory less its reserve, the host lines
        within the host memory budget."""
        return self.peak_gpu_bytes <= self.usable_gpu_bytes and self.peak_host_bytes <= self.host_memory

    def check(self) -> "Plan":
        """Raise PlanError (with this plan as the message) when the step does not fit; else return self."""
        if not self.fits:
            raise PlanError(str(self))
        return self

    def __str__(self) -> str:
        c, s = self.config, self.shape
        rank = f"rank {c.lora_rank}" + (" (experts too)" if c.lora_experts and s.n_experts else "")
        training = f"LoRA {rank}" if c.lora_rank else "full training"
        if c.quantization is not None:
            training = f"QLoRA {rank} (base weights in 4-bit {c.quantization.describe()})"
        if not c.training:
            training = "forward only (no gradients)"
        ckpt = "on" if c.checkpoint_layers else "off"
        if self.checkpoint_auto:
            ckpt += " (auto)"
        head = (
            f"Plan: {s.name}, context {c.context:,} tokens x batch {c.batch}, chunk {c.chunk_size:,}, "
            f"page {c.page_size}; {training}, optimizer {c.optimizer}, {c.precision}, layer checkpointing "
            f"{ckpt}, KV-gradients {dtype_name(c.grad_dtype)}"
        ) if c.training else (
            f"Plan: {s.name}, context {c.context:,} tokens x batch {c.batch}, chunk {c.chunk_size:,}, "
            f"page {c.page_size}; {training}, {c.precision}"
        )
        if c.devices > 1 and c.sharding == "none":
            head += f"; {c.devices} data-parallel ranks (oomb_ddp), memory per GPU"
        elif c.devices > 1:
            head += (f"; {c.devices} data-parallel ranks (oomb_model_parallel, sharding {c.sharding}: "
                     f"{SHARDING_SUMMARY[c.sharding]})" + ("" if c.tensor_parallel > 1 else ", memory per GPU"))
        if c.tensor_parallel > 1:
            head += (f"; {c.tensor_parallel} tensor-parallel ranks" + (" each" if c.devices > 1 else "")
                     + " (oomb_model_parallel, split by KV heads), memory per GPU")
        if c.document_length is not None and c.document_length < c.context:
            head += f"; packed from documents of {c.document_length:,} tokens"
        if c.streamed:
            head += f"; pages offloaded to pinned host memory, streamed in segments of {c.segment_tokens:,} tokens"
        if c.host_grad_layers and c.training:
            head += f"; KV-gradient pages of {c.host_grad_layers} of {s.kv_layers} layers in pinned host memory"
        if c.host_kv_layers:
            head += f"; K/V pages of {c.host_kv_layers} of {s.kv_layers} layers in pinned host memory"
        if c.stage_1_loss and c.loss_grads == "recomputed":
            head += "; each chunk's dL/dh computed again in stage 2 (no room to keep it)"
        if not c.fused_ops:
            head += "; transformers' own RMSNorm/RoPE/SwiGLU"
        if isinstance(c.sparse, SparseConfig):
            sp = c.sparse
            head += (
                f"; sparse attention: {sp.budget_pages} pages per query tile ({sp.sink_pages} sink, "
                f"{sp.local_pages} local), score {sp.score}, {'per KV head' if sp.per_kv_head else 'shared'}"
                + ("" if sp.per_query_tile else ", one selection per chunk")
            )
        cpu = self.device == "cpu"
        gpu_lines, host_lines = self.gpu_lines, self.host_lines
        unit, amount = "GiB", gib
        if cpu:
            # A CPU run is small: MiB when the step is under a GiB, and lines that round to nothing left out.
            if self.peak_gpu_bytes < GIB:
                unit, amount = "MiB", lambda n: f"{n / 2**20:.2f}"
            gpu_lines = {k: v for k, v in gpu_lines.items() if float(amount(v))}
            host_lines = {k: v for k, v in host_lines.items() if float(amount(v))}
        width = max(len(k) for k in [*gpu_lines, *host_lines]) + 2
        rows = [head, "", f"{'Step memory (this CPU run: host RAM)' if cpu else 'GPU memory':<{width}}{unit:>10}"]
        rows += [f"  {k:<{width - 2}}{amount(v):>10}" for k, v in gpu_lines.items()]
        rows.append(f"  {'total':<{width - 2}}{amount(self.peak_gpu_bytes):>10}")
        rows += ["", f"{'Host memory':<{width}}{unit:>10}"]
        rows += [f"  {k:<{width - 2}}{amount(v):>10}" for k, v in host_lines.items()]
        rows.append(f"  {'total':<{width - 2}}{amount(self.peak_host_bytes):>10}")
        t = self.time
        # A forward alone's time is the generation plan's (plan.timing.generation_time), not a training step's.
        rows += [] if cpu or not c.training else [
            "",
            f"Step FLOPs {t.total_flops:.3g} (linear {t.linear_flops:.3g}, attention {t.attention_flops:.3g}, "
            f"checkpoint recompute {t.recompute_flops:.3g}"
            + (f", token mixing of the state-carrying layers {t.mixing_flops:.3g}" if t.mixing_flops else "") + ")",
            f"Step time: floor {duration(t.floor_s)} at {t.matmul_tflops:g} TFLOP/s; predicted "
            f"{duration(t.predicted_s)} (linear at {LINEAR_EFFICIENCY:.0%}, attention"
            + (" and token mixing" if t.mixing_flops else "") + f" at {t.attention_efficiency:.0%} of the peak"
            + (f", {_portable_share(t):.0%} of it at {PORTABLE_ATTENTION_EFFICIENCY:.0%}: packed "
               "chunks that hold a document border or whose document starts mid-page run the "
               "portable Triton kernels, docs/planner.md" if t.portable_attention_flops else "")
            + (f", plus {duration(t.launch_s)} of the GPU waiting for the host to launch small kernels "
               f"({KERNEL_LAUNCH_S * 1e6:g} us each; larger chunks launch fewer"
               + (f"; the state-carrying layers' token mixing launches {t.carried_ops:.3g} operations, "
                  f"{CARRIED_OP_LAUNCH_S * 1e6:g} us each: transformers' torch path, which a fused kernel such "
                  "as flash-linear-attention's replaces" if t.carried_ops else "") + ")"
               if t.launch_s >= 0.005 * t.predicted_s else "")
            + (f", plus {duration(t.host_add_s)} for the host gradient layers" if t.host_add_s else "")
            + (f", plus {duration(t.host_gather_s)} of gathering the host K/V layers' selected pages "
               f"({gb(t.host_gather_bytes)} at {HOST_GATHER_GBPS:g} GB/s; stage 2's behind the compute)"
               if t.host_gather_bytes else "")
            + (f", plus {duration(t.stream_s)} of streaming the host pages ({gb(t.stream_bytes)} in at "
               f"{STREAM_GBPS:g} GB/s, each chunk's behind its compute)" if t.stream_bytes else "")
            + _collectives_time(t, c)
            + (f", plus {duration(t.dequant_s)} dequantising the 4-bit weights for each matmul (assumed "
               f"{DEQUANT_GBPS * t.matmul_tflops / DEFAULT_MATMUL_TFLOPS:.0f} GB/s)" if t.dequant_s else "")
            + ", calibrate with lightning-oomb bench)",
        ]
        collectives = step_collectives(s, c) if c.sharding != "none" or c.tensor_parallel > 1 else []
        if collectives:
            rows.append(f"Collectives per step and rank (ring, {COLLECTIVE_GBPS:g} GB/s bus bandwidth assumed, none "
                        "hidden behind the compute):")
            rows += [f"  {x.kind} of {x.what}: {x.calls} x {gib(x.bus_bytes)} GiB, {duration(x.seconds)}"
                     for x in collectives]
        if self.other_activation_bytes is not None and c.training:
            other = "on" if not c.checkpoint_layers else "off"
            rows.append(f"Activations with layer checkpointing {other}: {amount(self.other_activation_bytes)} {unit}")
        rows += [f"Note: {n}" for n in self.notes]
        if cpu:
            return "\n".join(rows)
        machine = (
            f"GPU {gb(self.gpu_memory)} ({gib(self.gpu_memory)} GiB){' ' + self.machine if self.machine else ''}, "
            f"host {gb(self.host_memory)} ({gib(self.host_memory)} GiB)"
        )
        rows.append("")
        reserve = f"beyond the {PLACEMENT_HEADROOM_SHARE:.0%} reserve a step keeps"
        if self.placed_against is not None:
            needed, free = self.placed_against
            over = self.peak_gpu_bytes - self.usable_gpu_bytes
            rows.append(
                f"PLACED on {machine}, against the memory measured: the step allocates {gib(needed)} GiB more on "
                f"the GPU, {gib(free)} GiB is free {reserve}"
                + (f" (the planned total above is {gib(over)} GiB over: its assumed lines are not what this process "
                   "holds)" if over > 0 else ""))
        elif self.fits:
            rows.append(
                f"FITS on {machine}: {gib(self.usable_gpu_bytes - self.peak_gpu_bytes)} GiB of GPU memory to spare "
                f"{reserve}"
            )
        else:
            short = []
            if self.peak_gpu_bytes > self.usable_gpu_bytes:
                short.append(f"GPU short by {gib(self.peak_gpu_bytes - self.usable_gpu_bytes)} GiB {reserve}")
            if self.peak_host_bytes > self.host_memory:
                short.append(f"host short by {gib(self.peak_host_bytes - self.host_memory)} GiB")
            rows.append(f"DOES NOT FIT on {machine}: {', '.join(short)}")
        memory = [x for x in self.suggestions if x.goal == "memory" and self.placed_against is None]
        faster = [x for x in self.suggestions if x.goal == "time"]
        if memory:
            rows += ["What would make it fit:", *(x.render(self.suggestion_style) for x in memory)]
        if faster:
            rows += ["What would make it faster:", *(x.render(self.suggestion_style) for x in faster)]
        return "\n".join(rows)


def _collectives_time(t: StepTime, c: PlanConfig) -> str:
    """What the collectives add to the predicted step time, in the words of the plan's time line."""
    if c.tensor_parallel > 1 and c.sharding == "none":
        return (f", plus {duration(t.tensor_parallel_s)} for the decoder layers' tensor-parallel all-reduces and "
                f"{duration(t.all_reduce_s)} for the whole weights' gradient all-reduce at {COLLECTIVE_GBPS:g} GB/s")
    if c.sharding == "none":
        return (f", plus {duration(t.all_reduce_s)} for the gradients' all-reduce at {COLLECTIVE_GBPS:g} GB/s"
                if t.all_reduce_s else "")
    text = f", plus {duration(t.sharding_s)} for the decoder layers' all-gathers and reduce-scatters"
    if t.tensor_parallel_s:
        text += f", {duration(t.tensor_parallel_s)} for their tensor-parallel all-reduces"
    if t.all_reduce_s:
        text += f" and {duration(t.all_reduce_s)} for the root's all-reduce"
    return text + f" at {COLLECTIVE_GBPS:g} GB/s"


def _portable_share(t: StepTime) -> float:
    return t.portable_attention_flops / t.attention_flops


@dataclass
class ContextLimit:
    """The longest context a step fits, next to what the machine could hold.

    ``context``: the most tokens per sequence (a multiple of the chunk) whose step fits as a training step
    with the asked ``offload`` would place it (0: not even one chunk); ``plan``: that step's plan (or the
    one-chunk plan that does not fit). ``physical_tokens``: the machine's limit for any placement: the GPU
    memory the one-chunk step leaves free plus the host memory budget's room for pinned pages, over the
    bytes a token stores (K, V and their gradients over all layers; the dL/dh a served step keeps is left
    out). ``bytes_per_token``: that
    divisor, the bytes one token of the batch stores."""

    context: int
    plan: Plan
    physical_tokens: int
    bytes_per_token: int

    def __str__(self) -> str:
        p = self.plan
        if not self.context:
            return f"not even one chunk of {p.config.chunk_size:,} tokens fits:\n\n{p}"
        return (f"{self.context:,} tokens fit ({p.config.n_chunks} chunks of {p.config.chunk_size:,}): GPU "
                f"{gib(p.peak_gpu_bytes)} GiB, host {gib(p.peak_host_bytes)} GiB, step ≈ "
                f"{duration(p.time.predicted_s)}; the machine holds {self.physical_tokens:,} tokens of K/V "
                "and their gradients")
