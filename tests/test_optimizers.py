"""The optimizer choices: each builds, the state each creates is what placement and planner count, the Kahan
step tracks float32, bad choices are refused in one line, and a bf16-true run with the recommended choice
learns like a 32-true run (the learning-quality benchmark, CPU)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from lightning_oomb.core.errors import SetupError
from lightning_oomb.core.optimizers import OPTIMIZERS, OptimizerSpec, pending_state, plan_state_bytes
from tiny_models import tiny_model

pytest.importorskip("torchao")


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's state holds, 8-bit tensors by their codes and scales ("step" counters left out)."""
    total = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if key == "step":
                continue
            inner = [value.codes, value.scale] if hasattr(value, "codes") else [value]
            total += sum(t.numel() * t.element_size() for t in inner)
    return total


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_choice_builds_and_creates_the_state_it_is_counted_for(name):
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    model.model.embed_tokens.weight.data = torch.randn(128, 64, dtype=torch.bfloat16)  # one 8-bit-sized tensor
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = OptimizerSpec.parse(name).build(params, lr=1e-3, weight_decay=0.0)
    planned, pending, host = pending_state([optimizer])
    assert host == 0  # CPU tensors: torchao's step is compiled, but nothing is placed against the host
    assert planned == name
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in params]
    optimizer.step()
    assert state_bytes(optimizer) == pending
    assert pending_state([optimizer]) == (name, 0, 0)
    assert any(not torch.equal(a, p) for a, p in zip(before, params))
    moments = optimizer.state[model.model.embed_tokens.weight].get("exp_avg")
    assert (type(moments).__name__ == "OptimState8bit") == OPTIMIZERS[name].eight_bit


def test_planner_rates_per_parameter():
    assert plan_state_bytes("adamw", 2) == 4 and plan_state_bytes("adamw", 4) == 8
    assert plan_state_bytes("adamw8bit", 2) == pytest.approx(2 * (1 + 4 / 256))
    assert plan_state_bytes("adamw8bit-kahan", 2) == pytest.approx(2 * (1 + 4 / 256) + 2)
    assert plan_state_bytes("adamw8bit-kahan", 4) == pytest.approx(2 * (1 + 4 / 256))  # float32: no compensation
    assert plan_state_bytes("adamw-kahan", 2) == 6 and plan_state_bytes("sgd", 2) == 2
    assert plan_state_bytes("none", 2) == 0


def weight_change_error(name: str, steps: int = 100, device: str = "cpu") -> float:
    """||d - d_fp32|| / ||d_fp32|| of a bf16 weight (std 0.02) stepped by ``name`` at lr 1e-5 on random
    gradients, d its change as the next update sees it (with the Kahan compensation), against float32 AdamW."""
    torch.manual_seed(0)
    start = (torch.randn(256, 256) * 0.02).bfloat16().float().to(device)
    grads = [torch.randn(256, 256).to(device) for _ in range(steps)]
    reference = torch.nn.Parameter(start.clone())
    fp32 = torch.optim.AdamW([reference], lr=1e-5, weight_decay=0.01)
    p = torch.nn.Parameter(start.bfloat16())
    optimizer = OptimizerSpec.parse(name).build([p], lr=1e-5, weight_decay=0.01)
    for g in grads:
        reference.grad, p.grad = g, g.bfloat16()
        fp32.step()
        optimizer.step()
    got = p.detach().float() + optimizer.state[p].get("compensation", torch.zeros((), device=device)).float()
    want = reference.detach() - start
    return float((got - start - want).norm() / want.norm())


def test_kahan_steps_track_float32():
    """The compensated weights follow float32 AdamW: their error is the moments' (bf16 or 8-bit) rounding and
    the compensation's 16 bits, against 0.9 of the change lost by plain bf16 AdamW."""
    assert weight_change_error("adamw") > 0.5
    assert weight_change_error("adamw-kahan") < 0.02
    assert weight_change_error("adamw8bit-kahan") < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kahan_steps_track_float32_on_the_gpu():
    """On CUDA the compensated step is the compiled (fused) kernel; it tracks float32 as the eager one does."""
    assert weight_change_error("adamw", device="cuda") > 0.5
    assert weight_change_error("adamw-kahan", device="cuda") < 0.02
    assert weight_change_error("adamw8bit-kahan", device="cuda") < 0.05


def test_torchao_choices_step_under_one_kernel_configuration():
    """Every torchao choice is built as a class whose CUDA steps run under one_config_inductor: Inductor's
    deterministic mode and pointwise autotuning off while the step compiles, put back afterwards."""
    import torch._inductor.config as inductor

    from lightning_oomb.core.optimizers import choice_of
    from lightning_oomb.core.torchao_optim import OneConfigStep, one_config_inductor

    for name, choice in OPTIMIZERS.items():
        optimizer = OptimizerSpec.parse(name).build([torch.nn.Parameter(torch.zeros(4))], lr=1e-3, weight_decay=0.0)
        assert isinstance(optimizer, OneConfigStep) == (choice.package == "torchao"), name
        assert choice_of(optimizer) is choice
    before = (inductor.deterministic, inductor.triton.autotune_pointwise)
    with one_config_inductor():
        assert (inductor.deterministic, inductor.triton.autotune_pointwise) == (True, False)
    assert (inductor.deterministic, inductor.triton.autotune_pointwise) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["adamw8bit", "adamw8bit-kahan"])
def test_first_compiled_step_on_a_full_gpu_pins_no_host_memory(name, tmp_path, monkeypatch):
    """The first (compiling) step of an embedding-sized bf16 weight with the GPU full, as a long-context step
    leaves it: torch's pinned allocator holds nothing afterwards (with Inductor trying each kernel's
    configurations it held 8 and 13 GiB of copies of the weight and moments, for the life of the process)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # no configuration chosen by an earlier run
    p = torch.nn.Parameter(torch.randn(32768, 4096, device="cuda", dtype=torch.bfloat16) * 0.02)
    p.grad = torch.randn_like(p) * 1e-3
    optimizer = OptimizerSpec.parse(name).build([p], lr=1e-5, weight_decay=0.0)
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(max(0, free - (2 << 30)), dtype=torch.uint8, device="cuda")  # noqa: F841
    optimizer.step()
    torch.cuda.synchronize()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) < (64 << 20)


def test_compiled_kahan_step_keeps_the_compensation():
    """The fused (torch.compile) step computes what the eager one does: Inductor must not fold the
    float32 -> bf16 -> float32 round trip that defines the compensation. Compiled here on the CPU, so with the
    compile caches keyed by CPU vector ISA as the optimizers key them (core/optimizers.py)."""
    from lightning_oomb.core import kahan
    from lightning_oomb.core.optimizers import key_compile_caches_by_cpu_isa

    key_compile_caches_by_cpu_isa()
    torch.manual_seed(0)
    p = (torch.randn(64, 64) * 0.02).bfloat16()
    args = dict(step=torch.tensor(1.0), lr=torch.tensor(1e-5), beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
                is_adamw=True, max_exp_avg_sq=None)
    grad = torch.randn(64, 64).bfloat16()
    results = []
    for step in (kahan.compensated_adam_step, kahan._compiled_step):
        weight, compensation = p.clone(), torch.zeros_like(p)
        exp_avg, exp_avg_sq = torch.zeros_like(p), torch.zeros_like(p)
        step(torch.empty(64, 64), weight, compensation, grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, **args)
        results.append(weight.float() + compensation.float())
        assert compensation.abs().max() > 0
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-9)


# One adamw8bit step over CPU tensors built as a run builds it, compared bit for bit with torchao's step run eagerly
# from the same state; prints the values that differ.
COMPILED_STEP = """
import torch
from torchao.optim.adam import single_param_adam
from torchao.optim.subclass_8bit import OptimState8bit
from lightning_oomb.core.optimizers import OptimizerSpec

torch.manual_seed(0)
p = torch.nn.Parameter((torch.randn(64, 64) * 0.02).bfloat16())
p.grad = torch.randn(64, 64).bfloat16()
optimizer = OptimizerSpec.parse("adamw8bit").build([p], lr=1e-3, weight_decay=0.01)
group, weight = optimizer.param_groups[0], p.detach().clone()
moments = [OptimState8bit.zeros(p.shape, signed, 256, dtype=p.dtype) for signed in (True, False)]
single_param_adam(weight, p.grad, torch.tensor(1.0), *moments, None, group["lr"], *group["betas"],
                  group["weight_decay"], group["eps"], True, False)
optimizer.step()
state = optimizer.state[p]
differ = int((weight != p.detach()).sum())
for m, key in zip(moments, ("exp_avg", "exp_avg_sq")):
    differ += int((m.codes != state[key].codes).sum()) + int((m.scale != state[key].scale).sum())
print(differ)
"""


@pytest.mark.skipif(not torch.cpu._is_avx512_supported(),
                    reason="needs a CPU with AVX-512, a vector ISA wider than ATEN_CPU_CAPABILITY=avx2's")
@pytest.mark.parametrize("first", ["default", "avx2"])
def test_compiled_cpu_step_is_right_after_another_isa_filled_the_compile_cache(first):
    """torchao compiles its step with Inductor on the CPU too, and Inductor's on-disk caches leave out the vector
    ISA its C++ was written for: two processes sharing one cache, under the default capability and under
    ATEN_CPU_CAPABILITY=avx2 (in either order), each step as eager torchao does, bit for bit. A cache key tag of
    this test's own leaves no earlier entry for these graphs, while Inductor's checks of the compiler stay cached."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env.update(TORCH_COMPILE_CACHE_KEY_TAG=f"test-{uuid.uuid4().hex}", PYTHONPATH=str(root))
    for capability in (first, "avx2" if first == "default" else "default"):
        child = {**env, "ATEN_CPU_CAPABILITY": capability} if capability == "avx2" else env
        done = subprocess.run([sys.executable, "-c", COMPILED_STEP], cwd=root, env=child, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, f"{capability}: {done.stderr[-3000:]}"
        assert done.stdout.split()[-1] == "0", f"{capability}: values that differ from eager torchao: {done.stdout}"


def test_bad_choices_are_refused_in_one_line(monkeypatch):
    from lightning_oomb import CausalLMModule

    config = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    cases = [
        ("adamw9", None, "unknown optimizer 'adamw9'; choose one of adamw, adamw-sr"),
        ("torch.optim.Missing", None, "torch.optim.Missing is not a torch.optim.Optimizer class"),
        ("nowhere.Optimizer", None, "cannot import nowhere"),
        ("adamw8bit", {"momentum": 0.9}, "adamw8bit takes no argument 'momentum'"),
        ("adamw", {"lr": 0.1}, "set lr as model.learning_rate"),
    ]
    for optimizer, args, message in cases:
        with pytest.raises(SetupError, match=message):
            CausalLMModule(config=config, optimizer=optimizer, optimizer_args=args)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(SetupError, match=r"adamw8bit-kahan needs torchao, which is not installed: pip install "
                                         r"'lightning_oomb\[optim\]'"):
        CausalLMModule(config=config, optimizer="adamw8bit-kahan")
    CausalLMModule(config=config, optimizer="torch.optim.NAdam", optimizer_args={"betas": [0.9, 0.99]})


def test_lora_adapters_train_in_float32_under_bf16_true():
    pytest.importorskip("peft")
    from lightning.pytorch import Callback, Trainer

    from lightning_oomb import CausalLMModule, OOMBStrategy, PasskeyDataModule

    class StateKeys(Callback):  # the state as the last step left it (the strategy's teardown drops it)
        def on_train_end(self, trainer, pl_module):
            self.keys = [set(trainer.optimizers[0].state[p]) for p in pl_module.parameters() if p.requires_grad]

    config = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    for lora_dtype, want in (("float32", torch.float32), ("weights", torch.bfloat16)):
        module = CausalLMModule(config=config, lora_rank=4, lora_dtype=lora_dtype, optimizer="adamw8bit-kahan")
        keys = StateKeys()
        trainer = Trainer(accelerator="cpu", precision="bf16-true", max_steps=2, logger=False, callbacks=[keys],
                          strategy=OOMBStrategy(chunk_size=32, page_size=16), enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
        trainer.fit(module, datamodule=PasskeyDataModule(seq_len=64, batch_size=1, vocab_size=64, num_keys=4,
                                                         key_window=16, val_size=2))
        trained = [p for p in module.parameters() if p.requires_grad]
        assert trained and all(p.dtype == want for p in trained)
        assert all(p.dtype == torch.bfloat16 for p in module.parameters() if not p.requires_grad)
        assert all(("compensation" in k) == (want == torch.bfloat16) and "exp_avg" in k for k in keys.keys)


def test_bf16_true_learns_like_float32_with_the_recommended_choice():
    """The learning-quality benchmark's targets (tiny Qwen2, 100 steps at lr 1e-5 from a briefly trained state):
    adamw8bit-kahan under bf16-true moves the weights like 32-true (cosine >= 0.9, norm ratio 0.85-1.15) and
    lowers the held-out loss within 10% as much; plain torch AdamW under bf16-true does not."""
    from lightning_oomb.bench.learning import Setup, compare

    reference, runs = compare(Setup(hidden=64, warm_steps=60), ("adamw", "adamw8bit-kahan"))
    plain, kahan = (r.metrics for r in runs)
    assert reference.eval_before - reference.eval_after > 0.005  # the float32 run does learn in these steps
    assert kahan["cosine"] >= 0.9 and 0.85 <= kahan["norm_ratio"] <= 1.15, kahan
    assert abs(kahan["loss_decrease_ratio"] - 1) <= 0.1, kahan
    assert plain["cosine"] < 0.6 and plain["loss_decrease_ratio"] < 0.5, plain


CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA_ONLY])])
@pytest.mark.parametrize("name", ["adamw8bit", "adamw8bit-kahan", "adamw-kahan"])
def test_large_parameters_step_in_slices_bit_for_bit(name, device, monkeypatch):
    """A parameter larger than SLICE_ELEMENTS is updated in row slices that fill whole 8-bit blocks (rows of 96
    elements: 8 rows a block multiple) with the weights, moments and compensation of the whole-tensor update, bit
    for bit, over three steps; a slice's float32 working set, not the parameter's, is what a step adds. On CUDA
    every update is compiled (on the CPU the Kahan ones run eagerly)."""
    from lightning_oomb.core import optimizer_slices

    torch.manual_seed(0)
    start = (torch.randn(512, 96) * 0.02).bfloat16().to(device)
    grads = [torch.randn(512, 96).bfloat16().to(device) for _ in range(3)]
    results = []
    for elements in (1 << 26, 4000):
        monkeypatch.setattr(optimizer_slices, "SLICE_ELEMENTS", elements)
        assert len(optimizer_slices.row_slices(start, 256)) == (1 if elements > start.numel() else 13)
        p = torch.nn.Parameter(start.clone())
        optimizer = OptimizerSpec.parse(name).build([p], lr=1e-3, weight_decay=0.01)
        for g in grads:
            p.grad = g.clone()
            optimizer.step()
        state = optimizer.state[p]
        tensors = [p.detach()] + [state[k].dequantize() if hasattr(state[k], "dequantize") else state[k]
                                  for k in ("exp_avg", "exp_avg_sq", "compensation") if k in state]
        results.append(tensors)
    for whole, sliced in zip(*results):
        assert torch.equal(whole, sliced)


def test_plan_counts_one_slices_float32_working_set():
    """The plan's GPU lines hold the update's float32 working set: per element of one slice, 12 bytes for
    adamw8bit-kahan, 8 for adamw8bit, 4 for adamw-kahan, none for plain AdamW; Qwen2.5-7B's embedding (545M
    elements) is updated SLICE_ELEMENTS at a time."""
    from lightning_oomb.core.optimizer_slices import SLICE_ELEMENTS
    from lightning_oomb.core.plan import plan

    for name, rate in [("adamw8bit-kahan", 12), ("adamw8bit", 8), ("adamw-kahan", 4), ("adamw", 0)]:
        lines = plan("qwen2.5-7b", 32768, optimizer=name, gpu_memory=140 << 30).gpu_lines
        got = [v for k, v in lines.items() if k.startswith("optimizer step: float32 working set")]
        assert got == ([rate * SLICE_ELEMENTS] if rate else []), name
