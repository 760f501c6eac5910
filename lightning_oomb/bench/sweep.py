"""The sweep of ``lightning-oomb bench``: one model, every mode at every context length, a line per point.

The model is randomly initialised at the shape of ``--model`` (bf16 on CUDA, float32 on CPU), built once;
each mode's setup and teardown run around its points, and memory is freed between points.
"""

from __future__ import annotations

import platform
import time
from typing import Callable

import torch
from torch import nn

from ..core.model_shape import LORA_TARGETS, ModelShape, load_config_dict, transformers_config
from ..core.units import GIB, human_count
from ..kernels import host_pages
from .config import BenchConfig
from .measure import free_memory, measure
from .modes import MODES, check_modes
from .results import PointResult


def machine_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name and "(CPU)": for the log, the report and the plot."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} (CPU)"


def build_model(config: BenchConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The randomly initialised model of ``config.model``'s shape, built on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(config.seed)
    hf_config = transformers_config(load_config_dict(config.model))
    hf_config.use_cache = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=dtype)
    if config.lora_rank > 0:
        import peft

        lora = peft.LoraConfig(r=config.lora_rank, lora_alpha=16, target_modules=list(LORA_TARGETS))
        # Adapters in the model's dtype, as Lightning's bf16-true would hold them.
        model = peft.get_peft_model(model, lora, autocast_adapter_dtype=False)
    return model.train()


def _elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"


def progress_line(index: int, total: int, r: PointResult, elapsed: float) -> str:
    """The log line of point ``index`` of ``total``: what the step placed where, its time, peaks and loss."""
    head = f"[{index}/{total}] {r.mode:<9} L={r.context:>9,}"
    if r.host_grad_layers:
        head += f"  (KV-gradient pages of {r.host_grad_layers} layers on the host"
        if r.host_kv_layers:
            head += f", K/V pages of {r.host_kv_layers} ({r.kv_pages_gathered:,} pages gathered)"
        if r.host_grads_moved_at:
            moved = r.host_grads_moved_at
            head += f", {len(moved)} moved to the GPU in stage 2 at {moved[0]:,}-{moved[-1]:,} live tokens"
        head += ")"
    kept = [f"graphs of the last {r.graph_chunks}" if r.graph_chunks else "",
            f"attention outputs of {r.kept_chunks} on the GPU" if r.kept_chunks else "",
            f"attention outputs of the first {r.host_kept_chunks} on the host" if r.host_kept_chunks else ""]
    if any(kept):
        head += f"  (kept from stage 1, in chunks: {', '.join(k for k in kept if k)})"
    if r.status != "ok":
        return f"{head}  {r.status}  (elapsed {_elapsed(elapsed)})"
    gpu = f"  peak GPU {r.peak_gpu_bytes / GIB:.2f} GiB" if r.peak_gpu_bytes is not None else ""
    if r.alloc_retries:
        gpu += f" ({r.alloc_retries} allocator retries)"
    step = f"{r.step_time_s:.4g} s/step"
    if r.pin_s and r.pin_s >= 0.05 * r.step_time_s:  # a pool made in the timed step (--warmup 0)
        step += f" ({r.pin_s:.3g} s of it pinning host memory)"
    if r.kv_gather_ahead_s or r.kv_gather_s:
        step += f" (gathers {r.kv_gather_s:.3g} s on the compute stream, {r.kv_gather_ahead_s:.3g} s ahead)"
    if r.grad_add_s:
        step += f" (host gradient additions {r.grad_add_s:.3g} s on their stream)"
    return (
        f"{head}  {step}  {r.tokens_per_s:,.0f} tok/s{gpu}  "
        f"host {r.peak_host_bytes / GIB:.2f} GiB  {r.floor_fraction:.1%} of floor  loss {r.loss:.3f}  "
        f"(elapsed {_elapsed(elapsed)})"
    )


def bench_device(config: BenchConfig) -> torch.device:
    """The device ``config.device`` names; auto: CUDA if present, else the CPU."""
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def _print_now(line: str) -> None:
    print(line, flush=True)  # progress must show while a long sweep runs, also when piped to a file


def run(config: BenchConfig, log: Callable[[str], None] = _print_now) -> list[PointResult]:
    """The sweep: every mode of ``config.modes`` at every length, on one model."""
    check_modes(config)
    device = bench_device(config)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = ModelShape.resolve(config.model)
    started = time.perf_counter()
    model = build_model(config, device, dtype)
    log(f"built {shape.name} ({human_count(shape.total_params)} params, {str(dtype).removeprefix('torch.')}) on "
        f"{machine_name(device)} in {_elapsed(time.perf_counter() - started)}")
    results: list[PointResult] = []
    total = len(config.modes) * len(config.lengths)
    launch = host_pages.AddLaunch.parse(config.add_launch) if config.add_launch else host_pages.ADD_LAUNCH
    gather = host_pages.GATHER_AHEAD_PROGRAMS if config.gather_programs is None else config.gather_programs
    with host_pages.side_launches(launch, gather):
        for name in config.modes:
            mode = MODES[name]
            mode.setup(model, config)
            try:
                for context in config.lengths:
                    result = measure(mode, model, context, config, device, shape)
                    results.append(result)
                    log(progress_line(len(results), total, result, time.perf_counter() - started))
            finally:
                mode.teardown(model, config)
                free_memory(model, device)
    return results
