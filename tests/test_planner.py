"""The planner: model shapes, the activation formula against counted saved tensors, plans, the CLI."""

from __future__ import annotations

import dataclasses

import json
import os

import peft
import pytest
import torch
from tiny_models import tiny_model
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from lightning_oomb.cli import main as cli_main
from lightning_oomb.core.config import ChunkConfig, SparseConfig
from lightning_oomb.core.model_shape import LORA_TARGETS, ModelShape, builtin_names, load_config_dict, transformers_config
from lightning_oomb.core.plan import PlanError, plan, step_time
from lightning_oomb.core.plan.activations import activation_bytes, layer_activation_bytes, model_activation_bytes
from lightning_oomb.core.ranks import Ranks
from lightning_oomb.core.schedule import ChunkedSequence
from lightning_oomb.core.units import parse_bytes, parse_tokens
from lightning_oomb.integrations.transformers import bind
from lightning_oomb.kernels.page_table import StoreSpec

H200 = dict(gpu_memory=141e9, host_memory=128e9)


# -- shapes ----------------------------------------------------------------------------------------------


def test_builtin_shapes_load_and_count_like_the_real_models():
    assert set(builtin_names()) >= {"qwen2.5-0.5b", "qwen2.5-7b", "qwen3-8b", "llama-3.1-8b"}
    for name in builtin_names():
        shape = ModelShape.from_name(name)
        with torch.device("meta"):  # the real module tree, no memory
            model = AutoModelForCausalLM.from_config(transformers_config(load_config_dict(name)))
        assert shape.total_params == sum(p.numel() for p in model.parameters()), name
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert shape.matmul_params == linear, name


def test_qwen2_5_7b_numbers_of_the_design():
    shape = ModelShape.from_name("qwen2.5-7b")
    assert shape.matmul_params == pytest.approx(7.07e9, rel=0.01)
    assert (shape.n_layers, shape.q_width) == (28, 3584)
    assert shape.kv_bytes_per_token(torch.bfloat16) == 57_344
    assert shape.kv_bytes_per_token(torch.float32) == 114_688
    spec = StoreSpec(n_layers=28, n_kv_heads=4, head_dim=128, dtype=torch.bfloat16)
    assert spec.bytes_per_token() == 57_344 + 114_688  # the engine's own count agrees


def test_shape_from_config_dir_model_and_peft(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(load_config_dict("qwen2.5-0.5b")))
    from_dir = ModelShape.resolve(tmp_path)
    assert ModelShape.resolve(tmp_path / "config.json") == from_dir
    assert from_dir.matmul_params == ModelShape.from_name("qwen2.5-0.5b").matmul_params
    model = tiny_model("qwen2")
    shape = ModelShape.resolve(model)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=list(LORA_TARGETS)))
    assert ModelShape.resolve(lora) == shape
    assert shape.lora_params(4) == sum(p.numel() for p in lora.parameters() if p.requires_grad)
    with pytest.raises(FileNotFoundError, match="built-in"):
        ModelShape.resolve("no-such-model")


# -- activations -----------------------------------------------------------------------------------------


def saved_bytes_of_one_chunk(model, chunk: int, precision: str, fused_ops: bool = False, ranks: Ranks = Ranks()) -> int:
    """Bytes of the tensors stage 2 saves for backward in the last chunk's forward (parameters excluded),
    deduplicated by storage (each storage counted at the largest tensor seen on it). fused_ops: with the
    fused Triton RMSNorm/RoPE/SwiGLU (in Triton's interpreter on CPU) around the reference attention.
    ranks: those of a tensor-parallel model (its DTensors counted by their local part)."""
    model = model.to(torch.bfloat16 if precision == "bf16-true" else torch.float32)
    ids = torch.randint(0, 100, (1, 2 * chunk), generator=torch.Generator().manual_seed(0))
    seq = ChunkedSequence(model, ids, config=ChunkConfig(chunk_size=chunk, page_size=16, attention="reference"),
                          ranks=ranks)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t._local_tensor if isinstance(t, DTensor) else t  # not to_local(): no autograd op inside a hook

    params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        part = local(t)
        ptr = part.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), part.numel() * part.element_size())
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        seq.fill()
        start, end = seq.chunks[-1]  # a chunk with a past in the store, as in stage 2
        try:
            with torch.enable_grad(), bind(model, seq, fused_ops=fused_ops), \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                seq._chunk_hidden(start, end)
        finally:
            seq.release()
    return sum(seen.values())


FUSED = [False] + ([True] if os.environ.get("TRITON_INTERPRET") == "1" else [])  # CPU tensors: the interpreter


@pytest.mark.parametrize("fused_ops", FUSED, ids=["hf-ops", "fused-ops"][: len(FUSED)])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("chunk", [32, 96])
@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_activation_formula_matches_saved_tensors(family, chunk, precision, fused_ops):
    model = tiny_model(family)
    shape = ModelShape.resolve(model)
    counted = saved_bytes_of_one_chunk(model, chunk, precision, fused_ops)
    assert activation_bytes(shape, chunk, precision, fused_ops=fused_ops) == pytest.approx(counted, rel=0.10)


@pytest.mark.parametrize("fused_ops", FUSED, ids=["hf-ops", "fused-ops"][: len(FUSED)])
@pytest.mark.parametrize(
    "family,lora_rank,precision",
    [("qwen3", 0, "32-true"), ("qwen2", 4, "32-true"), ("llama", 4, "bf16-true"), ("qwen2", 0, "bf16-mixed")],
)
def test_activation_formula_qk_norm_lora_and_autocast(family, lora_rank, precision, fused_ops):
    model = tiny_model(family)
    shape = ModelShape.resolve(model)
    if lora_rank:
        model = peft.get_peft_model(model, peft.LoraConfig(r=lora_rank, target_modules=list(LORA_TARGETS)))
    counted = saved_bytes_of_one_chunk(model, 64, precision, fused_ops)
    expected = activation_bytes(shape, 64, precision, lora_rank=lora_rank, fused_ops=fused_ops)
    if precision == "bf16-mixed":  # the layers' bf16 weight casts are saved too (a separate line of the plan)
        expected += 2 * shape.n_layers * shape.layer_matmul_params
    assert expected == pytest.approx(counted, rel=0.10)


def test_layer_checkpointing_keeps_layer_inputs_attention_outputs_and_one_layer():
    shape = ModelShape.from_name("qwen2.5-7b")
    full = activation_bytes(shape, 4096, "bf16-true")
    ckpt = activation_bytes(shape, 4096, "bf16-true", checkpoint_layers=True)
    # each layer's input, attention output (bf16) and log-sum-exp (fp32 per head), then one whole layer
    kept = 28 * 4096 * (3584 * 2 + 3584 * 2 + 28 * 4)
    one_layer = layer_activation_bytes(shape, 4096, "bf16-true")
    assert ckpt == kept + one_layer + model_activation_bytes(shape, 4096, "bf16-true")
    assert ckpt < full / 5
    assert 13e9 < full < 17e9  # "a 7B model at 4096 tokens holds about 15 GB of activations" (README)


# -- plans -----------------------------------------------------------------------------------------------


def test_plan_that_fits_says_so():
    p = plan("qwen2.5-0.5b", parse_tokens("32K"), **H200)
    assert p.fits and p.check() is p
    assert not p.config.checkpoint_layers and p.checkpoint_auto  # auto: off, because it fits without
    assert not [s for s in p.suggestions if s.goal == "memory"]
    text = str(p)
    assert "FITS on GPU 141.00 GB" in text and "host 128.00 GB" in text
    assert "K/V pages" in text and "KV-gradient pages (float32)" in text
    assert p.peak_gpu_bytes == sum(p.gpu_lines.values())


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
    auto = plan("qwen2.5-7b", parse_tokens("32K"), lora_rank=16, **tight)
    assert auto.fits and not auto.config.checkpoint_layers
    forced = plan("qwen2.5-7b", parse_tokens("32K"), lora_rank=16, checkpoint_layers=True, **tight)
    assert forced.config.checkpoint_layers and not forced.checkpoint_auto
    assert forced.time.recompute_flops > 0
    full = plan("qwen2.5-7b", parse_tokens("32K"), **tight)  # full training: needs checkpointing on 80 GB
    assert full.config.checkpoint_layers and full.fits


def test_step_time_reproduces_the_design_floors():
    shape = ModelShape.from_name("qwen2.5-7b")
    for context, seconds in ((32 << 10, 3.6), (64 << 10, 9.6), (128 << 10, 29.0), (1 << 20, 22 * 60)):
        t = step_time(shape, context, matmul_tflops=790.0)
        assert t.floor_s == pytest.approx(seconds, rel=0.03), context
        assert t.predicted_s > t.floor_s
    lora = step_time(shape, 32 << 10, lora_rank=16)
    assert lora.linear_flops < step_time(shape, 32 << 10).linear_flops


@pytest.mark.parametrize("context, chunk, document, attended", [
    (200, 16, 37, 10**9), (200, 16, 16, 10**9), (200, 16, 5, 10**9), (200, 16, 1, 10**9), (200, 16, 200, 10**9),
    (200, 16, 37, 20), (203, 32, 50, 24),
])
def test_packed_attention_pairs_count_each_query_within_its_document(context, chunk, document, attended):
    """The planner's (query, key) pairs of packed documents against a count query by query: a query sees its
    document's keys before the chunk (at most ``attended`` of them) and, causally, its document's keys of the
    chunk (the diagonal counted as half a pair, as the unpacked formula does)."""
    from lightning_oomb.core.plan.timing import _chunk_pairs

    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        doc = [t - t % document for t in range(start, start + n)]
        counted = sum(min(max(0, start - d), attended) + t - max(start, d) + 0.5
                      for t, d in zip(range(start, start + n), doc))
        assert _chunk_pairs(start, n, attended, document) == pytest.approx(counted, rel=1e-12), start


def test_packed_step_costs_its_documents_attention():
    """1M tokens packed from 32K documents: the attention of 32 separate 32K steps, the linear layers of 1M
    tokens; one document as long as the sequence is the unpacked step exactly. The plan and its CLI say it."""
    shape = ModelShape.from_name("qwen2.5-7b")
    packed = step_time(shape, 1 << 20, document_length=32 << 10)
    one = step_time(shape, 32 << 10)
    assert packed.attention_flops == pytest.approx(32 * one.attention_flops, rel=1e-12)
    assert packed.linear_flops == pytest.approx(32 * one.linear_flops, rel=1e-12)
    for sparse in (None, SparseConfig(budget_pages=64)):
        unpacked = step_time(shape, 300_000, chunk_size=3000, sparse=sparse, page_size=100)
        assert step_time(shape, 300_000, chunk_size=3000, sparse=sparse, page_size=100,
                         document_length=300_000) == unpacked
    assert plan(shape, 1 << 20, document_length=32 << 10, **H200).time.attention_flops == packed.attention_flops
    with pytest.raises(ValueError, match="document_length"):
        plan(shape, 1 << 20, document_length=0, **H200)


def test_packed_chunks_in_the_portable_kernels_are_counted_at_their_rate():
    """Dense packed chunks holding a document border, or of a document that starts mid-page, count at
    PORTABLE_ATTENTION_EFFICIENCY (docs/planner.md); those of documents starting on a page, sparse steps and
    unpacked ones at ATTENTION_EFFICIENCY."""
    from lightning_oomb.core.plan.timing import _chunk_pairs, _runs_portable

    shape = ModelShape.from_name("qwen2.5-7b")
    assert step_time(shape, 1 << 20, document_length=32 << 10).portable_attention_flops == 0
    assert step_time(shape, 1 << 20, document_length=30000, sparse=SparseConfig()).portable_attention_flops == 0
    # 30,000-token documents, chunks of 4096, pages of 128: chunk 7 holds the first border, chunks 8-13 belong
    # to the document starting at 30,000 (mid-page), chunks 0-6 to the one at 0.
    assert [_runs_portable(i * 4096, 4096, 30000, 128) for i in range(15)] == [False] * 7 + [True] * 8
    per_pair = 4 * shape.q_width * shape.n_layers  # forward FLOPs of one (query, key) pair, all layers
    for checkpoint_layers in (False, True):
        # 64K tokens: chunks 7-15 portable (chunk 15's document starts at 60,000, mid-page); 0-2 kept on the host.
        t = step_time(shape, 1 << 16, document_length=30000, checkpoint_layers=checkpoint_layers, host_kept_chunks=3)
        pairs = sum(_chunk_pairs(i * 4096, 4096, 1 << 16, 30000) for i in range(7, 16))
        assert t.portable_attention_flops == pytest.approx(per_pair * pairs * 4.5, rel=1e-12)  # no recompute
        assert t.predicted_s > dataclasses.replace(t, portable_attention_flops=0).predicted_s


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


def test_host_gradient_layers_time_reproduces_the_steps_it_was_fitted_to():
    """Every layer's gradient pages on the host cost whole H200 steps +3.7 s at 256K and +15.6 s at 512K
    (docs/benchmarks.md, measured before stage 2 moved host layers to the GPU: here kept graphs of every chunk
    stop the moves); the planner adds that to its prediction, and nothing without host layers."""
    from lightning_oomb.core.plan.config import PlanConfig
    from lightning_oomb.core.plan.timing import expected_selected_pages
    from lightning_oomb.core.plan.host_transfers import host_add_seconds

    shape = ModelShape.from_name("qwen2.5-7b")
    sparse = SparseConfig()
    for context, seconds in ((256 << 10, 3.74), (512 << 10, 15.61)):
        c = PlanConfig(context, optimizer="none", grad_dtype=torch.bfloat16, sparse=sparse, host_grad_layers=28,
                       graph_chunks=context // 4096)
        assert host_add_seconds(shape, c) == pytest.approx(seconds, rel=0.02), context
    assert host_add_seconds(shape, PlanConfig(1 << 20, sparse=sparse)) == 0.0
    unmoved = dict(grad_dtype=torch.bfloat16, sparse=sparse, graph_chunks=256)
    one = host_add_seconds(shape, PlanConfig(1 << 20, host_grad_layers=1, **unmoved))
    assert host_add_seconds(shape, PlanConfig(1 << 20, host_grad_layers=16, **unmoved)) == pytest.approx(16 * one)
    # Expected distinct pages: all of a short past; a long past's sink, local window and random picks.
    assert expected_selected_pages(40, sparse, 32) == 40
    assert 5 + 59 < expected_selected_pages(8192, sparse, 32) < 5 + 32 * 59
    sixteen = PlanConfig(1 << 20, grad_dtype=torch.bfloat16, sparse=sparse, host_grad_layers=16)
    p = plan("qwen2.5-7b", 1 << 20, optimizer="none", grad_dtype=torch.bfloat16, sparse=sparse, host_grad_layers=16,
             gpu_memory=1 << 62, host_memory=1 << 62)
    without = dataclasses.replace(p.time, host_add_s=0.0)
    assert p.time.predicted_s == pytest.approx(without.predicted_s + host_add_seconds(shape, sixteen))
    assert "for the host gradient layers" in str(p)


def test_host_layers_move_to_the_gpu_as_stage_2_frees_pages():
    """1M tokens, 16 host layers of 28: none moves while the past is long, all have moved before stage 2 is
    halfway, and only the chunks before that pay for them; moves need batch 1 and bf16 gradient pages."""
    from lightning_oomb.core.plan.config import PlanConfig
    from lightning_oomb.core.plan.host_transfers import host_add_seconds, host_layers_left

    shape = ModelShape.from_name("qwen2.5-7b")
    c = PlanConfig(1 << 20, grad_dtype=torch.bfloat16, sparse=SparseConfig(), host_grad_layers=16)
    left = host_layers_left(shape, c)
    assert left[-1] == 16 and left[0] == 0 and left == sorted(left)
    assert 128 < left.index(16) < 256 and left.index(1) > 128  # stage 2 runs chunks 255..0: all moved before 128
    unmoved = host_add_seconds(shape, dataclasses.replace(c, graph_chunks=256))
    assert 0 < host_add_seconds(shape, c) < unmoved / 2
    for kept in (dict(grad_dtype=torch.float32), dict(batch=2, context=1 << 19)):
        assert set(host_layers_left(shape, dataclasses.replace(c, **kept))) == {16}


def test_plan_without_gpu_memory_on_a_cpu_machine_asks_for_the_flag():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ValueError, match="--gpu-memory"):
        plan("qwen2.5-7b", 32768)


def test_bf16_kv_grads_in_the_plan():
    p = plan("qwen2.5-7b", 32768, grad_dtype=torch.bfloat16, **H200)
    grads = next(v for k, v in p.gpu_lines.items() if k.startswith("KV-gradient pages"))
    assert grads == 57_344 * 32768


def test_all_changes_together_when_none_fits_alone():
    """At 4M tokens no single change fits: the last memory suggestion takes every one of them at once."""
    p = plan("qwen2.5-7b", parse_tokens("4M"), **H200)
    memory = [s for s in p.suggestions if s.goal == "memory"]
    together = memory[-1]
    assert together.change == "all of the above together" and not any(s.plan.fits for s in memory[:-1])
    assert together.cli == " ".join(s.cli for s in memory[:-1])
    c = together.plan.config
    assert c.lora_rank == 16 and c.grad_dtype == torch.bfloat16 and c.offload and c.chunk_size < 4096


# -- command line ----------------------------------------------------------------------------------------


def test_cli_prints_a_plan(capsys):
    code = cli_main(["plan", "--model", "qwen2.5-7b", "--context", "128k", "--chunk", "4096", "--lora", "16",
                     "--gpu-memory", "141GB", "--host-memory", "128GB"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Plan: qwen2.5-7b, context 131,072 tokens" in out and "LoRA rank 16" in out and "FITS" in out
    code = cli_main(["plan", "--model", "qwen2.5-7b", "--context", "1M", "--gpu-memory", "80GiB",
                     "--host-memory", "128GB", "--checkpoint-layers", "off"])
    out = capsys.readouterr().out
    assert code == 1 and "DOES NOT FIT on GPU 85.90 GB (80.00 GiB)" in out and "layer checkpointing (" in out


def test_cli_rejects_bad_sizes(capsys):
    with pytest.raises(SystemExit):
        cli_main(["plan", "--model", "qwen2.5-7b", "--context", "12q", "--gpu-memory", "80GB"])
    assert "token count" in capsys.readouterr().err


def test_cli_says_first_what_it_assumed(capsys):
    """The first lines name the GPU memory, the host budget (given, this machine's, or more than this
    machine has: another machine's) and the matmul rate the times assume."""
    cli_main(["plan", "--model", "qwen2.5-7b", "--context", "64K", "--gpu-memory", "80GiB"])
    first = " ".join(capsys.readouterr().out.split("\n\n")[0].split())
    assert first.startswith("Assumed: GPU 80.00 GiB (--gpu-memory); host budget")
    assert "(this machine's: available memory less" in first and "matmul peak 790 TFLOP/s (an H200's" in first
    cli_main(["plan", "--model", "qwen2.5-7b", "--context", "64K", "--gpu-memory", "80GiB", "--host-memory", "512TiB",
              "--matmul-tflops", "165"])
    first = " ".join(capsys.readouterr().out.split("\n\n")[0].split())
    assert "host budget 524288.00 GiB (--host-memory; more than this machine's" in first
    assert "planning for another machine" in first and "matmul peak 165 TFLOP/s (--matmul-tflops)" in first


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
    assert code == 0 and "FITS" in out and "still does not fit" not in out and "--sparse-budget" not in out
    code = cli_main(["plan", "--model", "qwen3-8b", "--context", "256K", "--gpu-memory", "140GiB", "--host-memory",
                     "500GiB"])
    out = capsys.readouterr().out
    assert code == 0 and "What would make it faster:" in out and "--sparse-budget 64): GPU" in out


def test_size_parsing():
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


def test_offload_plan_is_flat_on_the_gpu_and_holds_the_pages_on_the_host():
    plans = {n: plan("qwen2.5-7b", parse_tokens(n), offload=True, segment_tokens=65536, **H200) for n in ("64K", "256K")}
    assert plans["64K"].peak_gpu_bytes == plans["256K"].peak_gpu_bytes  # nothing on the GPU grows with L
    for n, p in plans.items():
        assert not any(k.startswith(("K/V pages", "KV-gradient pages")) for k in p.gpu_lines)
        pinned = sum(v for k, v in p.host_lines.items() if k.startswith("pinned"))
        assert pinned == parse_tokens(n) * (57_344 + 114_688)
        assert "offloaded to pinned host memory" in str(p)
    staging = next(v for k, v in plans["64K"].gpu_lines.items() if k.startswith("offload staging: 2 segments"))
    assert staging == 2 * 65536 * (57_344 + 114_688) // 28  # K, V, dK, dV of one layer, two halves


def test_cli_plan_auto_offloads_what_does_not_fit(capsys):
    code = cli_main(["plan", "--model", "qwen2.5-7b", "--context", "512k", "--gpu-memory", "141GB",
                     "--host-memory", "256GB", "--checkpoint-layers", "on"])
    out = capsys.readouterr().out
    assert code == 0 and "offloaded to pinned host memory" in out and "offload='auto' puts them" in out
    code = cli_main(["plan", "--model", "qwen2.5-7b", "--context", "32k", "--gpu-memory", "141GB",
                     "--host-memory", "128GB", "--offload", "gpu"])
    assert code == 0 and "offloaded" not in capsys.readouterr().out


def test_attention_outputs_kept_on_the_host_in_the_plan():
    """host_kept_chunks: a pinned host line of the GPU-kept outputs' size per chunk, no GPU memory; by default
    the whole chunks stage 2 would recompute that fit in what the host memory budget leaves, none when
    keep_attention is given."""
    from lightning_oomb.core.plan.placement import host_kept_for_stage_2
    from lightning_oomb.core.plan.memory import kept_chunk_bytes

    base = plan("qwen2.5-7b", parse_tokens("1M"), optimizer="none", sparse={"budget_pages": 64}, **H200)
    kept = plan("qwen2.5-7b", parse_tokens("1M"), optimizer="none", sparse={"budget_pages": 64},
                host_kept_chunks=90, **H200)
    line = next(k for k in kept.host_lines if k.startswith("pinned attention outputs kept"))
    per_chunk = kept_chunk_bytes(kept.shape, 4096, torch.bfloat16)
    assert "90 of 256 chunks" in line and kept.host_lines[line] == 90 * per_chunk == 90 * 28 * 4096 * (3584 * 2 + 4 * 28)
    assert kept.peak_gpu_bytes == base.peak_gpu_bytes
    assert host_kept_for_stage_2(base, 10.5 * per_chunk, 0, 0) == 10
    assert host_kept_for_stage_2(base, 1000 * per_chunk, 0, 0) == 256
    assert host_kept_for_stage_2(base, 1000 * per_chunk, 6, 1) == 249  # the chunks kept on the GPU need none
    assert host_kept_for_stage_2(base, 1000 * per_chunk, 0, 0, keep_attention=0) == 0
    short = plan("qwen2.5-7b", parse_tokens("1M") - 100, optimizer="none", sparse={"budget_pages": 64}, **H200)
    assert host_kept_for_stage_2(short, 1000 * per_chunk, 0, 0) == 255  # whole chunks only


def test_kept_attention_outputs_in_the_plan_and_the_placement():
    """keep_attention: a plan line of n_layers x tokens x (q_width bf16 + fp32 lse) per chunk; place_step
    keeps what is asked on a CPU device (nothing by default), and refuses it when pages go to the host."""
    from lightning_oomb.core.placement import place_step

    base = plan("qwen2.5-7b", parse_tokens("32K"), optimizer="none", **H200)
    kept = plan("qwen2.5-7b", parse_tokens("32K"), optimizer="none", kept_chunks=3, **H200)
    line = next(k for k in kept.gpu_lines if k.startswith("attention outputs kept"))
    assert "3 of 8 chunks" in line
    assert kept.gpu_lines[line] == 3 * 28 * 4096 * (3584 * 2 + 4 * 28)
    assert kept.peak_gpu_bytes - base.peak_gpu_bytes == kept.gpu_lines[line]
    model = tiny_model("qwen2")
    cpu = torch.device("cpu")
    assert place_step(model, 1, 32, ChunkConfig(chunk_size=8), cpu).kept_chunks == 0
    assert place_step(model, 1, 32, ChunkConfig(chunk_size=8, keep_attention=3), cpu).kept_chunks == 3
    # At most the chunks before those whose graphs stage 1 keeps (the last one's by default).
    assert place_step(model, 1, 32, ChunkConfig(chunk_size=8, keep_attention=9), cpu).kept_chunks == 3
    assert place_step(model, 1, 32, ChunkConfig(chunk_size=8, keep_attention=9, keep_graphs=0), cpu).kept_chunks == 4
    with pytest.raises(PlanError, match="keep_attention=2 keeps stage 1's results on the GPU"):
        place_step(model, 1, 32, ChunkConfig(chunk_size=8, keep_attention=2, offload="host"), cpu)
    with pytest.raises(ValueError, match="keep_attention must be None or an integer >= 0"):
        ChunkConfig(keep_attention=-1)


def test_kept_graphs_in_the_plan_and_the_placement():
    """keep_graphs: the last chunk's graph is free; each other one costs a chunk's activations plus what the
    loss computes ahead, and replaces that chunk's kept attention outputs. place_step keeps the last chunk's
    by default, none with layer checkpointing or host pages."""
    from lightning_oomb.core.placement import place_step
    from lightning_oomb.core.plan.memory import graph_chunk_bytes

    base = plan("qwen2.5-7b", parse_tokens("32K"), optimizer="none", kept_chunks=8, **H200)
    one = plan("qwen2.5-7b", parse_tokens("32K"), optimizer="none", kept_chunks=8, graph_chunks=1, **H200)
    three = plan("qwen2.5-7b", parse_tokens("32K"), optimizer="none", kept_chunks=8, graph_chunks=3, **H200)
    per_output = 28 * 4096 * (3584 * 2 + 4 * 28)
    per_graph = graph_chunk_bytes(three.shape, three.config)
    activations = next(v for k, v in three.gpu_lines.items() if k.startswith("activations"))
    assert per_graph == activations + 4096 * 3584 * 2
    assert one.peak_gpu_bytes == base.peak_gpu_bytes - per_output
    assert three.peak_gpu_bytes == base.peak_gpu_bytes - 3 * per_output + 2 * per_graph
    assert "3 of 8 chunks, one counted above" in " ".join(three.gpu_lines)
    model = tiny_model("qwen2")
    cpu = torch.device("cpu")
    assert place_step(model, 1, 32, ChunkConfig(chunk_size=8), cpu).graph_chunks == 1
    assert place_step(model, 1, 32, ChunkConfig(chunk_size=8, keep_graphs=9), cpu).graph_chunks == 4
    assert place_step(model, 1, 32, ChunkConfig(chunk_size=8, checkpoint_layers=True), cpu).graph_chunks == 0
    assert place_step(model, 1, 32, ChunkConfig(chunk_size=8, offload="host"), cpu).graph_chunks == 0
    with pytest.raises(PlanError, match="keep_graphs=2 keeps stage 1's results on the GPU"):
        place_step(model, 1, 32, ChunkConfig(chunk_size=8, keep_graphs=2, offload="host"), cpu)
    with pytest.raises(ValueError, match="keep_graphs keeps whole chunks' activations"):
        ChunkConfig(keep_graphs=2, checkpoint_layers=True)


def test_placed_plan_says_how_many_graphs_and_attention_outputs_a_step_keeps():
    from lightning_oomb.core.plan.search import plan_placed

    roomy = plan_placed("qwen2.5-7b", parse_tokens("32K"), optimizer="none", **H200)
    # As place_step chose on the H200 at 32K (docs/benchmarks.md: 3 graphs, then 5 chunks' outputs), and one
    # graph more since the down projection recomputes its input (kernels.linear.swiglu_linear).
    assert any("autograd graphs of the last 4 and the attention outputs of 4 more of 8 chunks" in n
               for n in roomy.notes), roomy.notes
    offloaded = plan_placed("qwen2.5-7b", parse_tokens("32K"), offload="host", optimizer="none", **H200)
    assert not any("attention outputs" in n for n in offloaded.notes)


def test_a_cpu_runs_plan_prints_only_lines_that_hold_something():
    """A CPU run's plan (printed at fit start) leaves out lines of nothing and counts a small step in MiB."""
    from lightning_oomb.core.placement import place_step

    model = tiny_model("qwen2")
    text = str(place_step(model, 1, 64, ChunkConfig(chunk_size=16), torch.device("cpu"), stage_1_loss=True,
                          optimizer="adamw").plan)
    assert "Step memory (this CPU run: host RAM)" in text and "MiB" in text and "GiB" not in text.split("Note:")[0]
    assert not any(line.rstrip().endswith(" 0.00") for line in text.splitlines())


def test_served_loss_gradients_in_the_placement():
    """A served step keeps every chunk's dL/dh for stage 2 (pinned: one block of the pool, its exact size). On a
    CPU device they stay where the step runs."""
    from lightning_oomb.core.model_shape import ModelShape
    from lightning_oomb.core.placement import place_step
    from lightning_oomb.core.plan.memory import loss_grad_bytes

    shape = ModelShape.from_name("qwen2.5-7b")
    assert loss_grad_bytes(shape, 4096, 256, "bf16-true") == 256 * 4096 * 3584 * 2  # 7 GiB at 1M
    assert loss_grad_bytes(shape, 4096, 1, "32-true") == 4096 * 3584 * 4
    model = tiny_model("qwen2")
    placement = place_step(model, 1, 32, ChunkConfig(chunk_size=8), torch.device("cpu"), stage_1_loss=True)
    assert placement.loss_grads == "gpu"


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


def test_served_steps_recompute_dlh_only_where_keeping_it_fits_nowhere():
    """A served step keeps every chunk's dL/dh where it fits (here pinned on the host, with the pages of some
    layers); past the context where it fits nowhere, stage 2 computes it again, which lets 8-bit AdamW's
    smaller state hold more than 10% more tokens than plain AdamW's kept-dL/dh limit of 1,490,944."""
    from lightning_oomb.core.plan.search import max_context, plan_placed

    sparse = dict(sparse=SparseConfig(budget_pages=64), grad_dtype=torch.bfloat16, stage_1_loss=True,
                  gpu_memory=140 * 2**30, host_memory=112 * 2**30)  # as `plan --max-context` in docs/optimizers.md
    kept = plan_placed("qwen2.5-7b", 1_490_944, **sparse)
    assert kept.fits and kept.config.loss_grads == "host"
    assert any(k.startswith("pinned loss: dL/dh of every chunk") for k in kept.host_lines)
    limit = max_context("qwen2.5-7b", optimizer="adamw8bit", **sparse)
    assert limit.context >= 1.1 * 1_490_944 and limit.plan.config.loss_grads == "recomputed"
    assert not any("dL/dh of every chunk" in k for k in [*limit.plan.gpu_lines, *limit.plan.host_lines])
    assert "dL/dh computed again in stage 2" in str(limit.plan)
    assert not plan_placed("qwen2.5-7b", limit.context, loss_grads="host", optimizer="adamw8bit", **sparse).fits


@pytest.mark.parametrize("gpu_gib", [24, 40, 48, 80, 140])
def test_max_context_never_exceeds_the_machine_limit(gpu_gib):
    """Over the built-in shapes, 16 and 64 GiB hosts, dense and sparse: the longest context that fits is at
    most what the machine holds in all (GPU and host budget over the bytes a token stores)."""
    from lightning_oomb.core.model_shape import builtin_names
    from lightning_oomb.core.plan.search import max_context

    for name in builtin_names():
        for host_gib in (16, 64):
            for case in (dict(), dict(sparse=SparseConfig(budget_pages=64), lora_rank=16)):
                limit = max_context(name, gpu_memory=gpu_gib * 2**30, host_memory=host_gib * 2**30,
                                    stage_1_loss=True, **case)
                assert limit.context <= limit.physical_tokens, (name, host_gib, case, limit.context,
                                                                limit.physical_tokens)


def test_max_context_when_nothing_fits():
    from lightning_oomb.core.plan.search import max_context

    limit = max_context("qwen2.5-7b", gpu_memory=16e9, host_memory=128e9)  # AdamW state alone is 28 GiB
    assert limit.context == 0 and not limit.plan.fits and "not even one chunk" in str(limit)


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
                     "112GiB", "--sparse-budget", "64", "--grad-dtype", "bfloat16"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 1
    assert "What 4,194,304 tokens would take" in out and "the longest context that fits here is 1,597,440 tokens" in out  # K/V of some layers on the host
    assert "4,194,304 tokens store 448.00 GiB" in out


def test_cli_plans_one_selection_per_chunk(capsys):
    """--selection chunk (as the bench's): a host K/V layer then gathers at most budget pages per KV head (a host
    large enough for the fit's step, whose kept dL/dh take 12 GiB at 1.75M, with K/V pages of 4-5 layers)."""
    args = ["plan", "--model", "qwen2.5-7b", "--context", "1835008", "--gpu-memory", "140GiB", "--host-memory",
            "140GiB", "--sparse-budget", "64", "--grad-dtype", "bfloat16", "--optimizer", "none"]
    gathered = {}
    for selection in ("tile", "chunk"):
        assert cli_main([*args, "--selection", selection]) == 0
        out = " ".join(capsys.readouterr().out.split())
        gathered[selection] = float(out.split("layers' selected pages (")[1].split(" GB")[0])
    assert gathered["chunk"] < gathered["tile"] / 10


def test_data_parallel_plan_is_one_rank_with_its_bucket_share_and_all_reduce():
    """plan(devices=N) (oomb_ddp): each rank's GPU memory is the one-GPU step's plus the float32 bucket its
    gradients are averaged through; its host budget is the machine's divided among the ranks; the step adds a
    ring all-reduce of the float32 gradients at COLLECTIVE_GBPS."""
    from lightning_oomb.core.plan.assumptions import COLLECTIVE_GBPS
    from lightning_oomb.core.ranks import GRADIENT_BUCKET_BYTES
    from lightning_oomb.core.units import GIB

    kwargs = dict(chunk_size=4096, gpu_memory=140 * GIB, host_memory=500 * GIB, checkpoint_layers=False)
    one = plan("qwen2.5-7b", 131072, **kwargs)
    four = plan("qwen2.5-7b", 131072, devices=4, **kwargs)
    assert four.peak_gpu_bytes - one.peak_gpu_bytes == GRADIENT_BUCKET_BYTES
    assert four.host_memory == 500 * GIB // 4 and one.host_memory == 500 * GIB
    trainable = four.shape.total_params
    want = 2 * 3 / 4 * 4 * trainable / (COLLECTIVE_GBPS * 1e9)
    assert four.time.all_reduce_s == pytest.approx(want) and one.time.all_reduce_s == 0
    assert four.time.predicted_s - one.time.predicted_s == pytest.approx(want)
    assert "4 data-parallel ranks (oomb_ddp), memory per GPU" in str(four)
    with pytest.raises(ValueError, match="devices must be an integer >= 1"):
        plan("qwen2.5-7b", 131072, devices=0, **kwargs)


# -- sharded data parallel (oomb_model_parallel) -----------------------------------------------------------

# Qwen2.5-7B by hand: a decoder layer holds q, o (3584 x 3584), k, v (3584 x 512), the q/k/v biases, the MLP
# (3 x 3584 x 18944) and two norms; the root the embedding and the untied output layer (152064 x 3584 each)
# and the final norm.
QWEN_LAYER = 2 * 3584 * 3584 + 2 * 3584 * 512 + (3584 + 2 * 512) + 3 * 3584 * 18944 + 2 * 3584
QWEN_LAYERS = 28 * QWEN_LAYER
QWEN_ROOT = 2 * 152064 * 3584 + 3584


def _line(p, prefix: str) -> int:
    (value,) = [v for k, v in p.gpu_lines.items() if k.startswith(prefix)]
    return value


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("sharding", ["zero1", "zero2", "zero3"])
def test_sharded_plan_is_one_rank_of_oomb_model_parallel(devices, sharding):
    """Per GPU, bf16-true AdamW: the root (embeddings, final norm, output layer) whole with its float32 bucket;
    the decoder layers' weights as 1/N shards plus what is gathered (zero1/zero2: all of them for the step,
    zero3: two layers), their gradients 1/N in bf16 (zero1: whole, float32) plus one layer's reduce-scatter in
    flight (bf16 and float32), their AdamW state 1/N. Every other line is the one-GPU step's."""
    from lightning_oomb.core.plan.assumptions import COLLECTIVE_GBPS
    from lightning_oomb.core.ranks import GRADIENT_BUCKET_BYTES
    from lightning_oomb.core.units import GIB

    assert QWEN_LAYERS + QWEN_ROOT == 7_615_616_512
    kwargs = dict(chunk_size=4096, gpu_memory=140 * GIB, host_memory=500 * GIB, checkpoint_layers=False)
    one = plan("qwen2.5-7b", 131072, **kwargs)
    rank = plan("qwen2.5-7b", 131072, devices=devices, sharding=sharding, **kwargs)
    n, bf16, fp32 = devices, 2, 4
    want = {
        "weights: root": bf16 * QWEN_ROOT,
        "weights: decoder layers": bf16 * QWEN_LAYERS // n,
        "gathered weights": bf16 * (2 * QWEN_LAYER if sharding == "zero3" else QWEN_LAYERS),
        "gradients: root": bf16 * QWEN_ROOT,
        "gradients: decoder layers": fp32 * QWEN_LAYERS if sharding == "zero1" else bf16 * QWEN_LAYERS // n,
        "reduce-scatter in flight": (bf16 + fp32) * QWEN_LAYER,
        "optimizer state: root": 2 * bf16 * QWEN_ROOT,
        "optimizer state: decoder layers": 2 * bf16 * QWEN_LAYERS // n,
        "gradient all-reduce bucket": GRADIENT_BUCKET_BYTES,
    }
    assert {prefix: _line(rank, prefix) for prefix in want} == want
    whole = sum(_line(one, prefix) for prefix in ("weights", "gradients", "optimizer state"))
    assert whole == (bf16 + bf16 + 2 * bf16) * (QWEN_LAYERS + QWEN_ROOT)  # weights, gradients, AdamW state
    assert rank.peak_gpu_bytes == one.peak_gpu_bytes - whole + sum(want.values())
    assert rank.host_memory == 500 * GIB // n
    # Collectives (ring: (N-1)/N of the buffer per rank for a gather or reduce-scatter), none hidden.
    chunks, share = 32, (n - 1) / n
    gathers = {"zero1": 1, "zero2": 1, "zero3": 3 * chunks}[sharding]
    reductions = 1 if sharding == "zero1" else chunks
    layers_s = (gathers * share * bf16 * QWEN_LAYERS + reductions * share * fp32 * QWEN_LAYERS) / (COLLECTIVE_GBPS * 1e9)
    assert rank.time.sharding_s == pytest.approx(layers_s)
    assert rank.time.all_reduce_s == pytest.approx(2 * share * fp32 * QWEN_ROOT / (COLLECTIVE_GBPS * 1e9))
    assert rank.time.predicted_s - one.time.predicted_s == pytest.approx(layers_s + rank.time.all_reduce_s)
    text = str(rank)
    assert f"{n} data-parallel ranks (oomb_model_parallel, sharding {sharding}" in text
    assert f"{COLLECTIVE_GBPS:g} GB/s bus bandwidth assumed, none hidden behind the compute" in text
    assert f"reduce-scatter of the decoder layers' gradients (float32): {reductions} x" in text


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


# -- tensor parallel (oomb_model_parallel split by KV heads) -----------------------------------------------

# One of 2 tensor-parallel ranks of Qwen2.5-7B's decoder layer by hand: half of each matrix and of the q/k/v
# biases, both norms whole.
QWEN_LAYER_TP2 = (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944) // 2 + (3584 + 2 * 512) // 2 + 2 * 3584


def test_tensor_parallel_plan_is_one_rank():
    """plan(tensor_parallel=2), bf16-true AdamW, 128K, per GPU: the K/V and KV-gradient pages half the one-GPU
    step's; the decoder layers' weights, gradients and AdamW state those of half of each layer, norms whole;
    the root whole, with the float32 bucket the strategy averages the whole weights' gradients through; the
    activations' attention and MLP parts halved, the hidden-size parts whole (by hand); the host budget
    halved. Every other line is the one-GPU step's."""
    from lightning_oomb.core.ranks import GRADIENT_BUCKET_BYTES
    from lightning_oomb.core.units import GIB

    kwargs = dict(chunk_size=4096, gpu_memory=140 * GIB, host_memory=500 * GIB, checkpoint_layers=False)
    one = plan("qwen2.5-7b", 131072, **kwargs)
    rank = plan("qwen2.5-7b", 131072, tensor_parallel=2, **kwargs)
    for prefix in ("K/V pages", "KV-gradient pages"):
        assert 2 * _line(rank, prefix) == _line(one, prefix)
    bf16 = 2
    want = {
        "weights: root": bf16 * QWEN_ROOT,
        "weights: decoder layers": bf16 * 28 * QWEN_LAYER_TP2,
        "gradients: root": bf16 * QWEN_ROOT,
        "gradients: decoder layers": bf16 * 28 * QWEN_LAYER_TP2,
        "optimizer state: root": 2 * bf16 * QWEN_ROOT,
        "optimizer state: decoder layers": 2 * bf16 * 28 * QWEN_LAYER_TP2,
        "gradient all-reduce bucket": GRADIENT_BUCKET_BYTES,
    }
    assert {prefix: _line(rank, prefix) for prefix in want} == want
    # Saved per token and layer (fused ops): the norms' inputs and rstd, 2(2h + 4); 14 query and 2 KV heads' q,
    # k, v, output, lse and o_proj's input; gate, up and down_proj's input, which a DTensor shard saves (1/2 of
    # I = 18944 each); the norms' outputs 2·2h. Per token once: ids, RoPE cos/sin, the final norm.
    attention = 2 * (1792 + 256) + 2 * 256 + 2 * 1792 + 4 * 14 + 2 * 1792
    layer = 2 * (2 * 3584 + 4) + attention + 3 * 2 * 9472 + 2 * 2 * 3584
    assert _line(rank, "activations") == 4096 * (28 * layer + 8 + 2 * 128 * 2 + 2 * 3584 + 4)
    assert _line(rank, "backward working set") == 4096 * layer
    changed = ("weights", "gradients", "optimizer state", "gradient all-reduce", "activations", "backward",
               "K/V pages", "KV-gradient pages")
    assert {k: v for k, v in one.gpu_lines.items() if not k.startswith(changed)} == {
        k: v for k, v in rank.gpu_lines.items() if not k.startswith(changed)}
    assert rank.host_memory == 250 * GIB and rank.shape.n_kv_heads == 2


@pytest.mark.parametrize("checkpoint_layers", [False, True])
def test_tensor_parallel_collectives_by_hand(checkpoint_layers):
    """4 ranks, Qwen2.5-7B, 10,000 tokens in chunks of 4096 (the last of 1808), its graph kept. Without layer
    checkpointing stage 1 runs 27 layers of the first two chunks (it ends at the last layer's K/V store) and 28
    of the last, stage 2 28 of the first two: 2 x 55 all-reduces of o_proj's and down_proj's outputs for each of
    those, 2 x 28 for the last. With it no graph is kept: stage 1 27 layers of each chunk, stage 2 28, the
    recompute 28, of which only o_proj's all-reduces (it stops once down_proj saved its input). The backward
    all-reduces the input gradients of q, k, v, gate and up in every layer and chunk; the whole weights'
    gradients (the root and both norms of each layer) once, in float32. A ring all-reduce over 4 ranks moves
    1.5 x its buffer, (chunk tokens x 3584) in bf16."""
    from lightning_oomb.core.plan.assumptions import COLLECTIVE_GBPS
    from lightning_oomb.core.plan.collectives import step_collectives
    from lightning_oomb.core.units import GIB

    rank = plan("qwen2.5-7b", 10000, chunk_size=4096, tensor_parallel=4, checkpoint_layers=checkpoint_layers,
                graph_chunks=1, gpu_memory=140 * GIB, host_memory=500 * GIB)
    forward, backward, gradients = step_collectives(rank.shape, rank.config)
    if checkpoint_layers:
        calls, tokens = 3 * (2 * 55 + 28), (2 * 55 + 28) * 10000
    else:
        calls, tokens = 2 * 2 * 55 + 2 * 28, 2 * 55 * 2 * 4096 + 2 * 28 * 1808
    assert forward.calls == calls and forward.calls * forward.bus_bytes == pytest.approx(1.5 * tokens * 3584 * 2)
    assert backward.calls == 5 * 28 * 3
    assert backward.calls * backward.bus_bytes == pytest.approx(1.5 * 5 * 28 * 10000 * 3584 * 2)
    assert (gradients.calls, gradients.bus_bytes) == (1, 1.5 * 4 * (QWEN_ROOT + 28 * 2 * 3584))
    t = rank.time
    assert t.tensor_parallel_s == pytest.approx((forward.calls * forward.bus_bytes + backward.calls * backward.bus_bytes)
                                                / (COLLECTIVE_GBPS * 1e9))
    assert t.all_reduce_s == pytest.approx(gradients.bus_bytes / (COLLECTIVE_GBPS * 1e9)) and t.sharding_s == 0
    assert t.predicted_s == pytest.approx(t.compute_s + t.tensor_parallel_s + t.all_reduce_s)


def test_tensor_parallel_refusals(capsys):
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
                          (["--tensor-parallel", "2", "--lora", "16"], "(--tensor-parallel 1)"),
                          (["--tensor-parallel", "2", "--devices", "2"], "(--sharding)"),
                          (["--tensor-parallel", "2", "--lora", "8", "--max-context"], "with LoRA")):
        with pytest.raises(SystemExit) as exit_:
            cli_main(["plan", "--model", "qwen2.5-7b", *(["--context", "4K"] if "--max-context" not in args else []),
                      "--gpu-memory", "140GiB", *args])
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_.value.code == 2 and last.startswith("lightning-oomb plan: error: ") and message in last


def test_cli_plans_a_tensor_parallel_rank(capsys):
    args = ["plan", "--model", "qwen2.5-7b", "--gpu-memory", "140GiB", "--host-memory", "112GiB", "--grad-dtype",
            "bfloat16", "--tensor-parallel", "2"]
    assert cli_main([*args, "--context", "1M", "--sparse-budget", "64"]) == 0
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


def test_tensor_parallel_inside_sharded_data_parallel():
    """2-D (oomb_model_parallel with data_parallel_size D and tensor_parallel_size T): each rank's part of the
    decoder layers (1/T by KV heads) sharded 1/D by FSDP, pages of H_kv/T heads, the root whole; collectives:
    the tensor-parallel all-reduces of the T-rank plan, FSDP's gathers and reduce-scatters of the D-rank plan
    of that part, the root's gradients averaged over all D x T ranks; the host budget shared by all."""
    from lightning_oomb.core.plan.collectives import step_collectives
    from lightning_oomb.core.units import GIB

    common = dict(chunk_size=4096, gpu_memory=140 * GIB, host_memory=448 * GIB, optimizer="adamw")
    tp = plan("qwen2.5-7b", 256 << 10, tensor_parallel=2, **common)
    both = plan("qwen2.5-7b", 256 << 10, tensor_parallel=2, devices=2, sharding="zero2", **common)
    fsdp = plan("qwen2.5-7b", 256 << 10, devices=2, sharding="zero2", **common)

    def line(p, prefix):
        return next(v for k, v in p.gpu_lines.items() if k.startswith(prefix))

    assert line(both, "K/V pages") == line(tp, "K/V pages") == line(fsdp, "K/V pages") // 2
    layers = line(tp, "weights: decoder layers")  # this rank's part, whole
    assert line(both, "weights: decoder layers, 1/2 shard of this rank's 1/2 by KV heads") == layers // 2
    assert line(both, "gathered weights: decoder layers") == layers
    assert line(both, "weights: root") == line(tp, "weights: root") == line(fsdp, "weights: root")
    assert "; 2 data-parallel ranks (oomb_model_parallel, sharding zero2: " in str(both)
    assert "; 2 tensor-parallel ranks each (oomb_model_parallel, split by KV heads), memory per GPU" in str(both)
    forward, backward, gather, scatter, root = step_collectives(both.shape, both.config)
    assert (forward, backward) == tuple(step_collectives(tp.shape, tp.config)[:2])
    assert gather.bus_bytes == 0.5 * layers and scatter.calls == both.config.n_chunks
    assert root.bus_bytes == 2 * 3 / 4 * 4 * both.shape.root_params  # a ring over 4 ranks
    assert both.host_memory == 112 * GIB  # 448 GiB shared by the 4 processes of the machine
