"""Every ``model.optimizer`` choice through ``lightning-oomb fit``: it checkpoints, resumes bit for bit and
exports, on a model whose tensors are large enough for torchao's 8-bit state (at least 4096 values: q, k, v and
o_proj, 64 x 64, are quantised in blocks of 256; gate, up and down, 64 x 90, hold 5,760 values, which 256 does not
divide, so they keep plain moments). Under bf16-true, so that the Kahan choices keep their compensation buffers.

The run is killed with SIGKILL right after a checkpoint for the YAMLs' own choice (adamw8bit-kahan: quantised
moments and compensation buffers) and QLoRA's 8-bit state; what SIGKILL tests, a whole file on disk whatever
the moment, does not depend on the optimizer (plain AdamW: test_training_cli.py), so the other choices stop at
the checkpoint's step and resume in-process, which restores the same file the same way.
"""

from __future__ import annotations

import signal

import pytest
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lightning_oomb.core.optimizers import MIN_QUANTIZED_8BIT, OPTIMIZERS
from lightning_oomb.lightning.checkpoint import AtomicCheckpointIO, copy_to_host, tensor_bytes
from test_corpus import make_model_dir, write_corpus
from test_training_cli import fit, fit_subprocess, killer, load, run_dir, write_config

STEPS, EVERY = 4, 2
# q, k, v and o_proj: 4096 values (quantised); the MLP: 5760 (not). One shape for the four projections, so that
# torchao compiles its step (on the CPU too) for few shapes.
WIDE = dict(hidden_size=64, intermediate_size=90, num_key_value_heads=4)
QUICK = ("--data.init_args.val_fraction", "0")  # no held-out pass: the state is what is compared


@pytest.fixture(scope="module")
def wide_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    return {"model": make_model_dir(root / "model", **WIDE), "corpus": write_corpus(root / "corpus", docs=40, words=12)}


def plain_parts(value) -> list[torch.Tensor]:
    """A state value as the plain tensors that hold it (torchao's 8-bit state: its codes, scales and map)."""
    if is_traceable_wrapper_subclass(value):
        names, _ = value.__tensor_flatten__()
        return [t for name in names for t in plain_parts(getattr(value, name))]
    return [value]


def assert_same_state(got: dict, want: dict) -> None:
    assert got["global_step"] == want["global_step"] == STEPS
    for name, tensor in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], tensor), f"{name} differs"
    got_state, want_state = got["optimizer_states"][0]["state"], want["optimizer_states"][0]["state"]
    assert got_state.keys() == want_state.keys()
    for i, values in want_state.items():
        assert got_state[i].keys() == values.keys()
        for key, value in values.items():
            assert type(got_state[i][key]) is type(value), f"state {key} of parameter {i}"
            for a, b in zip(plain_parts(got_state[i][key]), plain_parts(value), strict=True):
                assert torch.equal(a, b), f"optimizer state {key} of parameter {i} differs"
    assert got["lr_schedulers"] == want["lr_schedulers"]


def kill_and_resume(config, options: tuple[str, ...], want: dict, folder) -> None:
    """SIGKILL a run right after its step-2 checkpoint, resume it with ``--ckpt_path last`` to step STEPS, and
    compare its last checkpoint with ``want`` bit for bit."""
    killed = fit_subprocess(config, *options, "--export", "false", killer(kill_after_save=1))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert load(run_dir(folder) / "checkpoints" / "last.ckpt")["global_step"] == EVERY
    assert fit(config, *options, "--export", "false", "--ckpt_path", "last") is None
    assert_same_state(load(run_dir(folder) / "checkpoints" / "last.ckpt"), want)


def assert_8bit_state(states: list[dict]) -> None:
    """torchao's quantised moments beside plain ones, the quantised ones for tensors of 4096 values or more."""
    from torchao.optim.subclass_8bit import OptimState8bit

    assert {type(s["exp_avg"]) for s in states} == {OptimState8bit, torch.Tensor}
    assert all(s["exp_avg"].numel() >= MIN_QUANTIZED_8BIT for s in states if type(s["exp_avg"]) is OptimState8bit)


def resume_in_halves(config, options: tuple[str, ...], want: dict, folder) -> None:
    """Train to the step-2 checkpoint, resume with ``--ckpt_path last`` to step STEPS, and compare its last
    checkpoint with ``want`` bit for bit."""
    assert fit(config, *options, "--export", "false", "--trainer.max_steps", str(EVERY)) is None
    assert fit(config, *options, "--export", "false", "--ckpt_path", "last") is None
    assert_same_state(load(run_dir(folder) / "checkpoints" / "last.ckpt"), want)


@pytest.mark.parametrize("optimizer", [name for name in OPTIMIZERS if name != "adamw"])  # adamw: test_training_cli
def test_each_optimizer_checkpoints_resumes_bitwise_and_exports(optimizer, wide_assets, tmp_path):
    if OPTIMIZERS[optimizer].package:
        pytest.importorskip(OPTIMIZERS[optimizer].package)
    options = ("--model.optimizer", optimizer, "--trainer.precision", "bf16-true", "--trainer.max_steps", str(STEPS),
               *QUICK)
    assert fit(write_config(tmp_path / "whole", wide_assets), *options) is None
    want = load(run_dir(tmp_path / "whole") / "checkpoints" / "last.ckpt")
    states = list(want["optimizer_states"][0]["state"].values())
    if OPTIMIZERS[optimizer].eight_bit:
        assert_8bit_state(states)
    if OPTIMIZERS[optimizer].kahan:
        assert all("compensation" in s for s in states)
    from safetensors.torch import load_file

    exported = load_file(run_dir(tmp_path / "whole") / "hf_export" / "model.safetensors")
    assert all(torch.equal(tensor, want["state_dict"]["model." + name]) for name, tensor in exported.items())

    resume = kill_and_resume if optimizer == "adamw8bit-kahan" else resume_in_halves
    resume(write_config(tmp_path / "stopped", wide_assets), options, want, tmp_path / "stopped")


def test_qlora_with_8bit_state_checkpoints_resumes_bitwise_after_sigkill_and_exports(wide_assets, tmp_path):
    """QLoRA (4-bit base weights from model.pretrained, adapters trained) with adamw8bit: rank-64 adapters on
    q_proj (A and B: 64 x 64, quantised state) and down_proj (A: 64 x 90, plain state)."""
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("torchao")
    options = ("--model.optimizer", "adamw8bit", "--model.lora_rank", "64", "--model.lora_target_modules",
               "[q_proj, down_proj]", "--model.quantization", "{quant_type: nf4}", "--trainer.max_steps", str(STEPS),
               *QUICK)
    assert fit(write_config(tmp_path / "whole", wide_assets), *options) is None
    want = load(run_dir(tmp_path / "whole") / "checkpoints" / "last.ckpt")
    assert want["state_dict"] and all("lora_" in name for name in want["state_dict"])
    assert_8bit_state(list(want["optimizer_states"][0]["state"].values()))
    assert (run_dir(tmp_path / "whole") / "hf_export" / "adapter_model.safetensors").is_file()

    kill_and_resume(write_config(tmp_path / "killed", wide_assets), options, want, tmp_path / "killed")


def test_8bit_state_is_counted_and_copied_as_the_tensors_it_holds():
    """The checkpoint writer's size of a tree and its host copy see through torchao's wrapper: its codes (one
    byte a value), scales and map are counted, and the copy keeps the kind and the values."""
    pytest.importorskip("torchao")
    from torchao.optim.subclass_8bit import OptimState8bit

    state = OptimState8bit.zeros((64, 64), signed=True, block_size=256)
    state.copy_(torch.randn(64, 64))
    tree = {"exp_avg": state, "step": torch.tensor(3.0)}
    assert tensor_bytes(tree) == 64 * 64 + 4 * (64 * 64 // 256) + 4 * 256 + 4
    copied = copy_to_host(tree)
    assert type(copied["exp_avg"]) is OptimState8bit
    assert torch.equal(copied["exp_avg"].codes, state.codes) and torch.equal(copied["exp_avg"].scale, state.scale)
    assert copied["exp_avg"].codes.data_ptr() != state.codes.data_ptr()


def test_8bit_state_survives_the_atomic_writer(tmp_path):
    """torchao's 8-bit state written by AtomicCheckpointIO and read back as a checkpoint is (weights_only)."""
    pytest.importorskip("torchao")
    from torchao.optim.subclass_8bit import OptimState8bit

    state = OptimState8bit.zeros((32, 256), signed=False, block_size=256)
    state.copy_(torch.rand(32, 256))
    io = AtomicCheckpointIO(asynchronous=False)
    io.save_checkpoint({"state": {0: {"exp_avg_sq": state}}}, tmp_path / "last.ckpt")
    back = io.load_checkpoint(tmp_path / "last.ckpt", weights_only=True)["state"][0]["exp_avg_sq"]
    assert type(back) is OptimState8bit and torch.equal(back.dequantize(), state.dequantize())
