"""What ``PlanConfig`` refuses, in ``plan()`` and on the command line, each naming its way out."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_oomb.cli import main as cli_main
from lightning_oomb.core.model_shape import ModelShape
from lightning_oomb.core.plan import plan

H200 = dict(gpu_memory=141e9, host_memory=128e9)


def test_sharding_refused_without_ranks_and_when_unknown(capsys):
    with pytest.raises(ValueError, match=r"sharding='zero2' shards the decoder layers .* give devices >= 2"):
        plan("qwen2.5-7b", 4096, sharding="zero2", **H200)
    with pytest.raises(ValueError, match="sharding must be one of none, zero1, zero2, zero3, got 'fsdp'"):
        plan("qwen2.5-7b", 4096, devices=2, sharding="fsdp", **H200)
    for args, message in ((["--sharding", "zero3"], "give devices >= 2 (--devices N)"),
                          (["--devices", "2", "--sharding", "zero4"], "invalid choice: 'zero4'")):
        with pytest.raises(SystemExit) as exit_:
            cli_main(["plan", "--model", "qwen2.5-7b", "--context", "4K", "--gpu-memory", "140GiB", *args])
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_.value.code == 2 and last.startswith("lightning-oomb plan: error: ") and message in last


def test_tensor_parallel_refuses_what_the_strategy_refuses_naming_the_way_out(capsys):
    """What the strategy refuses, before any work, each naming its way out: T not dividing the KV heads (so
    none beyond them), attention heads or MLP width; LoRA; data-parallel ranks without a sharding (oomb_ddp
    has no tensor parallel)."""
    wide = dataclasses.replace(ModelShape.from_name("qwen2.5-7b"), intermediate=18945)
    for model, kwargs, message in (
        ("qwen2.5-7b", dict(tensor_parallel=3), "tensor_parallel=3 does not divide num_key_value_heads=4 of "
                                                "qwen2.5-7b; use a divisor of num_key_value_heads=4"),
        ("qwen2.5-7b", dict(tensor_parallel=8), "tensor_parallel=8 does not divide num_key_value_heads=4"),
        (wide, dict(tensor_parallel=2), "tensor_parallel=2 does not divide intermediate_size=18945"),
        ("qwen2.5-7b", dict(tensor_parallel=2, lora_rank=16), "with LoRA (lora_rank=16) is not built"),
        ("qwen2.5-7b", dict(tensor_parallel=2, devices=2), "runs in oomb_model_parallel, which shards the split "
                                                           "layers over them: give sharding 'zero1', 'zero2' or 'zero3'"),
        ("qwen2.5-7b", dict(tensor_parallel=0), "tensor_parallel must be an integer >= 1, got 0"),
    ):
        with pytest.raises(ValueError) as error:
            plan(model, 4096, **kwargs, **H200)
        assert message in str(error.value) and "\n" not in str(error.value)
    for args, message in ((["--tensor-parallel", "3"], "does not divide num_key_value_heads=4"),
                          (["--tensor-parallel", "2", "--lora-rank", "16"], "(--tensor-parallel 1)"),
                          (["--tensor-parallel", "2", "--devices", "2"], "(--sharding)"),
                          (["--tensor-parallel", "2", "--lora-rank", "8", "--max-context"], "with LoRA")):
        with pytest.raises(SystemExit) as exit_:
            cli_main(["plan", "--model", "qwen2.5-7b", *(["--context", "4K"] if "--max-context" not in args else []),
                      "--gpu-memory", "140GiB", *args])
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_.value.code == 2 and last.startswith("lightning-oomb plan: error: ") and message in last
