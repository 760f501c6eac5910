"""``lightning-oomb plan``: its output, its errors, and sizes as people write them."""

from __future__ import annotations

import pytest

from lightning_oomb.cli import main as cli_main
from lightning_oomb.core.units import parse_bytes, parse_tokens


def test_cli_plans_a_packed_step(capsys):
    common = ["plan", "--model", "qwen2.5-7b", "--context", "1M", "--gpu-memory", "140GiB", "--host-memory", "500GiB",
              "--checkpoint-layers", "on"]
    assert cli_main(common) == 0
    dense = capsys.readouterr().out
    assert cli_main(common + ["--document-length", "32K"]) == 0
    packed = capsys.readouterr().out
    assert "packed from documents of 32,768 tokens" in packed and "packed" not in dense
    assert "portable" not in packed  # every 32K document starts on a page
    assert cli_main(common + ["--document-length", "30000"]) == 0
    assert "of it at 38%: packed chunks that hold a document border or whose document starts mid-page" in (
        capsys.readouterr().out)
    flops = [out.split("Step FLOPs ")[1].split()[0] for out in (dense, packed)]
    assert float(flops[1]) < float(flops[0])


def test_cli_prints_a_plan(capsys):
    code = cli_main(["plan", "--model", "qwen2.5-7b", "--context", "128k", "--chunk", "4096", "--lora-rank", "16",
                     "--gpu-memory", "141GB", "--host-memory", "128GB"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Plan: qwen2.5-7b, context 131,072 tokens" in out and "LoRA rank 16" in out and "FITS" in out
    code = cli_main(["plan", "--model", "qwen2.5-7b", "--context", "1M", "--gpu-memory", "80GiB",
                     "--host-memory", "128GB", "--checkpoint-layers", "off"])
    out = capsys.readouterr().out
    assert code == 1 and "DOES NOT FIT on GPU 85.90 GB (80.00 GiB)" in out and "layer checkpointing (" in out


def test_cli_plans_lora_on_experts(tmp_path, capsys):
    """--lora-experts: the adapters of a mixture of experts' stacked expert weights trained too."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8)))
    common = ["plan", "--model", str(tmp_path), "--context", "128K", "--chunk", "8K", "--lora-rank", "16",
              "--gpu-memory", "140GiB", "--host-memory", "128GiB", "--checkpoint-layers", "on"]
    outs = []
    for extra in ([], ["--lora-experts"]):
        assert cli_main(common + extra) == 0
        outs.append(capsys.readouterr().out)
    assert "LoRA rank 16 (experts too)" in outs[1] and "experts too" not in outs[0]
    # r x E x (3 I_e + 2h) per layer on top of q, k, v, o's 13.4M
    assert "gradients (fp32, 13.4M trainable)" in outs[0] and "gradients (fp32, 643M trainable)" in outs[1]


def test_cli_rejects_bad_sizes(capsys):
    with pytest.raises(SystemExit):
        cli_main(["plan", "--model", "qwen2.5-7b", "--context", "12q", "--gpu-memory", "80GB"])
    assert "token count" in capsys.readouterr().err


def test_cli_says_first_what_it_assumed(capsys):
    """The first lines name the GPU the times assume (an H200's matmul rate unless --matmul-tflops), its
    memory, and the host budget (given, this machine's, or more than this machine has: another machine's)."""
    cli_main(["plan", "--model", "qwen2.5-7b", "--context", "64K", "--gpu-memory", "80GiB"])
    first = " ".join(capsys.readouterr().out.split("\n\n")[0].split())
    assert first.startswith("Assumed: an H200's matmul rate, 790 TFLOP/s dense bf16 (--matmul-tflops sets another "
                            "GPU's), with 80.00 GiB of GPU memory (--gpu-memory); host budget")
    assert "(this machine's: available memory less" in first
    cli_main(["plan", "--model", "qwen2.5-7b", "--context", "64K", "--gpu-memory", "80GiB", "--host-memory", "512TiB",
              "--matmul-tflops", "165"])
    first = " ".join(capsys.readouterr().out.split("\n\n")[0].split())
    assert "host budget 524288.00 GiB (--host-memory; more than this machine's" in first
    assert "planning for another machine" in first and "H200" not in first
    assert first.startswith("Assumed: a GPU of 165 TFLOP/s dense bf16 (--matmul-tflops), with 80.00 GiB")


@pytest.mark.parametrize("args, message", [
    (["--context", "1M", "--max-context"], "--context and --max-context exclude each other"),
    (["--context", "1M", "--gpu-memory", "-80GiB"], "argument --gpu-memory: cannot read a memory size '-80GiB'"),
    (["--max-context", "--gpu-memory", "80GiB", "--batch", "0"], "batch must be an integer >= 1"),
])
def test_cli_errors_are_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["plan", "--model", "qwen2.5-7b", *args])
    captured = capsys.readouterr()
    assert exit_.value.code == 2 and not captured.out
    assert captured.err.count("\n") == 1 and message in captured.err and "usage" not in captured.err


def test_cli_names_a_config_json_it_cannot_read(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(SystemExit) as exit_:
        cli_main(["plan", "--model", str(tmp_path), "--context", "8K", "--gpu-memory", "80GiB"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert f"{tmp_path / 'config.json'} is not a readable config.json (JSONDecodeError" in err


def test_faster_suggestions_are_only_those_that_fit(capsys):
    """A step that fits (here dense, its pages streamed from a large host) is offered sparse attention only
    where the sparse step fits too (at 1M on 80 GiB its host layers' staging does not)."""
    code = cli_main(["plan", "--model", "qwen3-8b", "--context", "1M", "--gpu-memory", "80GiB", "--host-memory",
                     "500GiB"])
    out = capsys.readouterr().out
    assert code == 0 and "FITS" in out and "still does not fit" not in out and "--budget-pages" not in out
    code = cli_main(["plan", "--model", "qwen3-8b", "--context", "256K", "--gpu-memory", "140GiB", "--host-memory",
                     "500GiB"])
    out = capsys.readouterr().out
    assert code == 0 and "What would make it faster:" in out and "--budget-pages 64): GPU" in out


def test_sizes_need_their_unit_and_parse_as_people_write_them():
    assert parse_tokens("4096") == 4096
    assert parse_tokens("32K") == parse_tokens("32k") == 32768
    assert parse_tokens("1M") == 1 << 20 and parse_tokens("1.5M") == 3 << 19
    assert parse_bytes("141GB") == 141 * 10**9 and parse_bytes("141gb") == 141 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("512MiB") == 2**29
    assert parse_bytes("1TB") == 10**12 and parse_bytes("1000B") == 1000 and parse_bytes(1000) == 1000
    for bare in ("141", "1000"):  # a number alone: 141 bytes is never what was meant
        with pytest.raises(ValueError, match="give its unit"):
            parse_bytes(bare)
    for bad in ("", "M", "1.5", "12q", "-3K"):
        with pytest.raises(ValueError):
            parse_tokens(bad)
    with pytest.raises(ValueError):
        parse_bytes("80 gigs")


def test_cli_plan_auto_offloads_what_does_not_fit(capsys):
    code = cli_main(["plan", "--model", "qwen2.5-7b", "--context", "512k", "--gpu-memory", "141GB",
                     "--host-memory", "256GB", "--checkpoint-layers", "on"])
    out = capsys.readouterr().out
    assert code == 0 and "offloaded to pinned host memory" in out and "offload='auto' puts them" in out
    code = cli_main(["plan", "--model", "qwen2.5-7b", "--context", "32k", "--gpu-memory", "141GB",
                     "--host-memory", "128GB", "--offload", "gpu"])
    assert code == 0 and "offloaded" not in capsys.readouterr().out


def test_cli_max_context_table(capsys):
    code = cli_main(["plan", "--model", "qwen2.5-7b", "--max-context", "--gpu-memory", "140GiB",
                     "--host-memory", "112GiB", "--grad-dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith(("full training", "LoRA"))]
    assert len(rows) == 4 and "machine limit" in out
    with pytest.raises(SystemExit) as exit_:
        cli_main(["plan", "--model", "qwen2.5-7b", "--gpu-memory", "140GiB"])
    assert exit_.value.code == 2 and "--max-context" in capsys.readouterr().err


def test_cli_says_what_a_context_that_fits_nowhere_would_take(capsys):
    code = cli_main(["plan", "--model", "qwen2.5-7b", "--context", "4M", "--gpu-memory", "140GiB", "--host-memory",
                     "112GiB", "--budget-pages", "64", "--grad-dtype", "bfloat16"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 1
    assert "What 4,194,304 tokens would take" in out and "the longest context that fits here is 1,597,440 tokens" in out  # K/V of some layers on the host
    assert "4,194,304 tokens store 448.00 GiB" in out


def test_cli_plans_one_selection_per_chunk(capsys):
    """--selection chunk (as the bench's): a host K/V layer then gathers at most budget pages per KV head (a host
    large enough for the fit's step, whose kept dL/dh take 12 GiB at 1.75M, with K/V pages of 4-5 layers)."""
    args = ["plan", "--model", "qwen2.5-7b", "--context", "1835008", "--gpu-memory", "140GiB", "--host-memory",
            "140GiB", "--budget-pages", "64", "--grad-dtype", "bfloat16", "--optimizer", "none"]
    gathered = {}
    for selection in ("tile", "chunk"):
        assert cli_main([*args, "--selection", selection]) == 0
        out = " ".join(capsys.readouterr().out.split())
        gathered[selection] = float(out.split("layers' selected pages (")[1].split(" GB")[0])
    assert gathered["chunk"] < gathered["tile"] / 10


def test_cli_plans_a_sharded_rank_and_suggests_sharding(capsys):
    code = cli_main(["plan", "--model", "qwen2.5-7b", "--context", "128K", "--gpu-memory", "140GiB",
                     "--host-memory", "500GiB", "--devices", "2", "--sharding", "zero2"])
    out = capsys.readouterr().out
    assert code == 0 and "2 data-parallel ranks (oomb_model_parallel, sharding zero2" in out
    assert "gathered weights: decoder layers, whole for the step (bf16)" in out
    # oomb_ddp on 80 GiB GPUs does not fit at 128K; sharding over 4 ranks does, and the plan says how to ask.
    code = cli_main(["plan", "--model", "qwen2.5-7b", "--context", "128K", "--gpu-memory", "80GiB",
                     "--host-memory", "500GiB", "--devices", "4", "--checkpoint-layers", "off", "--offload", "gpu"])
    out = capsys.readouterr().out
    assert code == 1 and "(--sharding zero2): GPU" in out


def test_cli_plans_a_tensor_parallel_rank(capsys):
    args = ["plan", "--model", "qwen2.5-7b", "--gpu-memory", "140GiB", "--host-memory", "112GiB", "--grad-dtype",
            "bfloat16", "--tensor-parallel", "2"]
    assert cli_main([*args, "--context", "1M", "--budget-pages", "64"]) == 0
    out = capsys.readouterr().out
    assert "; 2 tensor-parallel ranks (oomb_model_parallel, split by KV heads), memory per GPU" in out
    assert "weights: decoder layers, 1/2 by KV heads (bf16, 3.26B params)" in out
    assert "host 60.13 GB (56.00 GiB)" in out  # each of the 2 processes' share of the budget
    kv = next(line for line in out.splitlines() if line.strip().startswith("K/V pages"))
    assert kv.split()[-1] == "28.00"  # 2 of the 4 KV heads
    assert "for the decoder layers' tensor-parallel all-reduces" in out
    assert "all-reduce of o_proj's and down_proj's outputs (bf16), every layer forward: " in out
    assert "all-reduce of the input gradients of q/k/v_proj and gate/up_proj (bf16), every layer backward: 35840 x" in out
    # --max-context plans the same rank; LoRA is left out (not built under tensor parallel)
    assert cli_main([*args, "--max-context"]) == 0
    out = capsys.readouterr().out
    assert "per GPU of 2 tensor-parallel ranks" in out and "host budget 56.00 GiB" in out
    rows = [line for line in out.splitlines() if line.startswith(("full training", "LoRA"))]
    assert [row.split(",")[0] for row in rows] == ["full training"] * 2
