"""``plan`` and ``max_context`` (``core.plan.search``), and what they suggest (``core.plan.suggestions``)."""

from __future__ import annotations

import pytest
import torch

from lightning_oomb.core.config import SparseConfig
from lightning_oomb.core.plan import PlanError, plan
from lightning_oomb.core.units import parse_tokens

# checkpoint_auto: layer checkpointing off where the step fits without it, as `lightning-oomb plan` decides
H200 = dict(gpu_memory=141e9, host_memory=128e9, checkpoint_auto=True)


def test_plan_that_fits_says_so():
    p = plan("qwen2.5-0.5b", parse_tokens("32K"), **H200)
    assert p.fits and p.check() is p
    assert not p.config.checkpoint_layers and p.checkpoint_auto  # auto: off, because it fits without
    assert not [s for s in p.suggestions if s.goal == "memory"]
    text = str(p)
    assert "FITS on GPU 141.00 GB" in text and "host 128.00 GB" in text
    assert "K/V pages" in text and "KV-gradient pages (float32)" in text
    assert p.peak_gpu_bytes == sum(p.gpu_lines.values())


def test_a_placed_step_states_the_placements_verdict():
    """A step placed on the GPU against measured memory prints the placement's verdict, with how far its planned
    total (assumed lines) is over, and no suggestions to make it fit."""
    p = plan("qwen2.5-7b", parse_tokens("1M"), **H200)
    assert not p.fits
    p.placed_against = (3 << 30, 4 << 30)
    text = str(p)
    assert "PLACED on GPU 141.00 GB" in text and "allocates 3.00 GiB more on the GPU, 4.00 GiB is free" in text
    assert "the planned total above is" in text
    assert "DOES NOT FIT" not in text and "What would make it fit" not in text


def test_plan_that_does_not_fit_lists_suggestions_with_numbers():
    p = plan("qwen2.5-7b", parse_tokens("1M"), **H200)
    assert not p.fits
    assert p.config.checkpoint_layers  # auto turned it on, and it still does not fit
    kv = next(v for k, v in p.gpu_lines.items() if k.startswith("K/V pages"))
    grads = next(v for k, v in p.gpu_lines.items() if k.startswith("KV-gradient pages"))
    assert (kv, grads) == (57_344 * 2**20, 114_688 * 2**20)
    changes = {s.change: s for s in p.suggestions}
    assert {"smaller chunks", "LoRA rank 16 on q, k, v, o", "bf16 KV-gradients",
            "K/V and KV-gradient pages in pinned host memory, streamed"} <= set(changes)
    offload = changes["K/V and KV-gradient pages in pinned host memory, streamed"]
    assert (offload.cli, offload.python) == ("--offload host", "offload='host'")
    assert offload.plan.peak_gpu_bytes < p.peak_gpu_bytes and offload.plan.peak_host_bytes > p.peak_host_bytes
    assert changes["LoRA rank 16 on q, k, v, o"].plan.peak_gpu_bytes < p.peak_gpu_bytes
    text = str(p)
    assert "DOES NOT FIT" in text and "What would make it fit" in text
    assert "- bf16 KV-gradients (grad_dtype=torch.bfloat16)" in text  # the API's keywords by default
    p.suggestion_style = "cli"
    assert "- bf16 KV-gradients (--grad-dtype bfloat16)" in str(p)  # lightning-oomb plan's flags
    with pytest.raises(PlanError, match="DOES NOT FIT"):
        p.check()


def test_auto_checkpointing_turns_on_when_needed_and_flags_are_kept():
    tight = dict(gpu_memory=80e9, host_memory=128e9)
    auto = plan("qwen2.5-7b", parse_tokens("32K"), lora_rank=16, checkpoint_auto=True, **tight)
    assert auto.fits and not auto.config.checkpoint_layers
    forced = plan("qwen2.5-7b", parse_tokens("32K"), lora_rank=16, checkpoint_layers=True, **tight)
    assert forced.config.checkpoint_layers and not forced.checkpoint_auto
    assert forced.time.recompute_flops > 0
    full = plan("qwen2.5-7b", parse_tokens("32K"), checkpoint_auto=True, **tight)  # full training: needs checkpointing on 80 GB
    assert full.config.checkpoint_layers and full.fits
    asked = plan("qwen2.5-7b", parse_tokens("32K"), **tight)  # without checkpoint_auto: the config as asked
    assert not asked.config.checkpoint_layers and not asked.checkpoint_auto and not asked.fits


def test_plan_without_gpu_memory_on_a_cpu_machine_asks_for_the_flag():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ValueError, match="--gpu-memory"):
        plan("qwen2.5-7b", 32768)


def test_all_changes_together_when_none_fits_alone():
    """At 4M tokens no single change fits: the last memory suggestion takes every one of them at once."""
    p = plan("qwen2.5-7b", parse_tokens("4M"), **H200)
    memory = [s for s in p.suggestions if s.goal == "memory"]
    together = memory[-1]
    assert together.change == "all of the above together" and not any(s.plan.fits for s in memory[:-1])
    assert together.cli == " ".join(s.cli for s in memory[:-1])
    c = together.plan.config
    assert c.lora_rank == 16 and c.grad_dtype == torch.bfloat16 and c.streamed and c.chunk_size < 4096


@pytest.mark.parametrize("options", [
    dict(),
    dict(lora_rank=16),
    dict(sparse=SparseConfig(budget_pages=64), grad_dtype=torch.bfloat16),
    dict(sparse=SparseConfig(budget_pages=64), grad_dtype=torch.bfloat16, optimizer="none"),
])
def test_max_context_is_the_longest_that_fits(options):
    """The longest context fits and one chunk more does not, as plan_placed would place each; the machine's
    physical limit (every page on the GPU or pinned on the host) is never below it."""
    from lightning_oomb.core.plan.search import max_context, plan_placed

    limit = max_context("qwen2.5-7b", **H200, **options)
    assert limit.context % 4096 == 0 and limit.context >= 4096
    assert limit.plan.fits and limit.plan.config.context == limit.context
    assert not plan_placed("qwen2.5-7b", limit.context + 4096, **H200, **options).fits
    assert limit.physical_tokens >= limit.context


@pytest.mark.parametrize("gpu_gib", [24, 40, 48, 80, 140])
def test_max_context_never_exceeds_the_machine_limit(gpu_gib):
    """Over the built-in shapes (Gemma 3 12B's sliding-window layers keep their gradient pages in a ring;
    Qwen3-30B-A3B is a mixture of experts), 16 and 64 GiB hosts, dense and sparse: the longest context that
    fits is at most what the machine holds in all (GPU and host budget over the bytes a token stores)."""
    from lightning_oomb.core.model_shape import builtin_names
    from lightning_oomb.core.plan.search import max_context

    for name in builtin_names():
        for host_gib in (16, 64):
            for case in (dict(), dict(sparse=SparseConfig(budget_pages=64), lora_rank=16)):
                limit = max_context(name, gpu_memory=gpu_gib * 2**30, host_memory=host_gib * 2**30,
                                    stage_1_loss=True, checkpoint_auto=True, **case)
                assert limit.context <= limit.physical_tokens, (name, host_gib, case, limit.context,
                                                                limit.physical_tokens)


def test_max_context_is_zero_when_not_one_chunk_fits():
    from lightning_oomb.core.plan.search import max_context

    limit = max_context("qwen2.5-7b", gpu_memory=16e9, host_memory=128e9, checkpoint_auto=True)  # AdamW state alone is 28 GiB
    assert limit.context == 0 and not limit.plan.fits and "not even one chunk" in str(limit)


def test_host_kv_gathers_per_query_tile_suggest_one_selection_per_chunk():
    """QLoRA at 512K on a 24 GiB card: with K/V pages of some layers on the host, a selection per query tile
    gathers most of the past for every chunk; one per chunk bounds it, fits with fewer host layers and is
    offered as a faster step; a step that already selects per chunk is offered nothing of the kind."""
    from lightning_oomb.core.plan import plan_placed

    options = dict(lora_rank=16, quantization="nf4", grad_dtype="bfloat16", checkpoint_layers=True,
                   gpu_memory=24 << 30, host_memory=64 << 30)
    tile = plan_placed("qwen2.5-7b", 1 << 19, sparse={"budget_pages": 64}, **options)
    assert tile.fits and tile.config.host_kv_layers
    offered = [s for s in tile.suggestions if s.cli == "--selection chunk"]
    assert len(offered) == 1 and offered[0].goal == "time" and offered[0].plan.fits
    assert offered[0].plan.time.predicted_s < 0.9 * tile.time.predicted_s
    chunk = plan_placed("qwen2.5-7b", 1 << 19, sparse={"budget_pages": 64, "per_query_tile": False}, **options)
    assert not [s for s in chunk.suggestions if s.cli == "--selection chunk"]


def test_sparse_attention_is_offered_only_where_it_is_faster():
    """On the demo's tiny model at 2,048 tokens attention outweighs the matmuls, but selecting pages costs more
    than the attention it skips: sparse attention is not offered as a faster step; at 256K tokens of Qwen3-8B,
    where it saves most of the step, it is."""
    import yaml
    from pathlib import Path

    demo = yaml.safe_load((Path(__file__).resolve().parents[1] / "examples" / "passkey_cpu.yaml").read_text())
    tiny = plan(demo["model"]["config"], 2048, chunk_size=256, page_size=32, **H200)
    assert tiny.time.attention_flops > tiny.time.linear_flops
    assert not [s for s in tiny.suggestions if "sparse attention" in s.change]
    from lightning_oomb.core.plan import plan_placed

    big = plan_placed("qwen3-8b", parse_tokens("256K"), gpu_memory=140 << 30, host_memory=500 << 30)
    offered = [s for s in big.suggestions if "sparse attention" in s.change]
    assert offered and offered[0].plan.time.predicted_s <= 0.9 * big.time.predicted_s


def test_larger_chunks_are_offered_where_the_gpu_waits_for_launches():
    """SmolLM2-135M at 64K in chunks of 4096 waits for the host's kernel launches for half its step: the plan
    offers the fastest larger chunk that fits, a faster step; a 7B model's chunks of 4096 are offered nothing of
    the kind."""
    small = plan("smollm2-135m", 65536, chunk_size=4096, **H200)
    assert small.time.launch_s > 0.3 * small.time.predicted_s
    offered = [s for s in small.suggestions if s.change.startswith("larger chunks")]
    assert len(offered) == 1 and offered[0].goal == "time" and offered[0].plan.fits
    assert offered[0].plan.config.chunk_size > 4096 and offered[0].cli == f"--chunk {offered[0].plan.config.chunk_size}"
    assert offered[0].plan.time.predicted_s <= 0.9 * small.time.predicted_s
    big = plan("qwen2.5-7b", 131072, chunk_size=4096, **H200)
    assert big.time.launch_s == 0 and not [s for s in big.suggestions if s.change.startswith("larger chunks")]
