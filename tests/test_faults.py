"""What `lightning-oomb fit` does when training goes wrong: a loss or gradient that is not finite, a loss that
diverges, a signal that ends the run, a machine with little memory free. Each case runs the tiny model and
corpus of test_training_cli on the CPU, in-process."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
from pathlib import Path

import torch
from lightning.pytorch import Callback

from lightning_oomb.core.host_memory import GIB
from test_host_memory import free_memory
from test_training_cli import assets, fit, load, run_dir, write_config  # noqa: F401 (a fixture)


class PoisonGrads(Callback):
    """Makes every gradient nan from step ``first`` (1-based) on, and records what a skipped step must leave as it
    was: the weights, the optimizer state and last.ckpt, in ``PoisonGrads.seen``."""

    seen: dict = {}

    def __init__(self, first: int):
        self.first = first

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step + 1 == self.first:
            trainer.strategy.checkpoint_io.wait()  # the checkpoint of the step before is written
            last = Path(trainer.checkpoint_callback.last_model_path)
            PoisonGrads.seen.update(weights=_weights(pl_module), state=_state(trainer), last=last,
                                    last_digest=hashlib.sha256(last.read_bytes()).hexdigest())

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step + 1 >= self.first:
            for p in pl_module.parameters():
                p.grad.fill_(float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.first:
            PoisonGrads.seen.setdefault("after", []).append((trainer.global_step, _weights(pl_module), _state(trainer)))


def _weights(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _state(trainer) -> dict:
    return {(i, k): v.clone() for i, s in trainer.optimizers[0].state.items() for k, v in s.items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _finite(path: Path) -> bool:
    return all(torch.isfinite(t).all() for t in load(path)["state_dict"].values())


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("lightning-oomb: error:")]


def guard(**init_args) -> str:
    return "--trainer.callbacks+=" + json.dumps({"class_path": "lightning_oomb.NonFiniteGuard", "init_args": init_args})


# == non-finite loss and gradients ==========================================================================


def test_huge_learning_rate_stops_with_one_line_and_exports_nothing(assets, tmp_path, capsys):
    """The issue's case: learning rate 1e30 without warm-up. The first update is finite but huge, every later
    loss is not: the run stops with status 1 and one line, no checkpoint holds non-finite weights, nothing is
    exported."""
    config = write_config(tmp_path, assets, learning_rate=1e30, warmup_steps=0)
    assert fit(config) == 1
    err = capsys.readouterr().err
    lines = _error_lines(err)
    assert len(lines) == 1, err[-3000:]
    assert "training stopped at step 4" in lines[0] and "the 3rd step in a row" in lines[0], lines[0]
    assert re.search(r"at learning rate \d\.\d+e\+29", lines[0]) and "model.learning_rate" in lines[0]
    assert err.count("its update was skipped") == 2
    folder = run_dir(tmp_path)
    assert not (folder / "hf_export").exists()
    checkpoints = list((folder / "checkpoints").glob("*.ckpt"))
    assert all(_finite(path) for path in checkpoints)


def test_nonfinite_steps_are_skipped_then_stop_keeps_the_last_checkpoint(assets, tmp_path, capsys):
    """Gradients nan from step 3 on (checkpoints every 2 steps): steps 3 and 4 change neither the weights nor
    the optimizer state, step 5 stops the run before its update, and last.ckpt stays the file step 4 wrote."""
    PoisonGrads.seen.clear()
    config = write_config(tmp_path, assets)
    poison = "--trainer.callbacks+=" + json.dumps({"class_path": "test_faults.PoisonGrads", "init_args": {"first": 3}})
    assert fit(config, poison) == 1
    err = capsys.readouterr().err
    lines = _error_lines(err)
    assert len(lines) == 1 and "training stopped at step 5: a gradient is nan" in lines[0], err[-3000:]
    assert "last.ckpt holds the last finite weights" in lines[0]
    seen = PoisonGrads.seen
    assert [step for step, _, _ in seen["after"]] == [3, 4]
    for _, weights, state in seen["after"]:
        assert _same(weights, seen["weights"]) and _same(state, seen["state"])
    last = seen["last"]
    assert load(last)["global_step"] == 4 and _finite(last)
    assert hashlib.sha256(last.read_bytes()).hexdigest() != seen["last_digest"]  # step 4's replaced step 2's
    assert not (run_dir(tmp_path) / "hf_export").exists()


def test_stop_at_the_first_keeps_last_checkpoint_byte_identical(assets, tmp_path, capsys):
    PoisonGrads.seen.clear()
    config = write_config(tmp_path, assets)
    poison = "--trainer.callbacks+=" + json.dumps({"class_path": "test_faults.PoisonGrads", "init_args": {"first": 3}})
    assert fit(config, poison, guard(stop_after=1)) == 1
    err = capsys.readouterr().err
    assert "training stopped at step 3" in _error_lines(err)[0] and "skipped" not in err
    last = PoisonGrads.seen["last"]
    assert hashlib.sha256(last.read_bytes()).hexdigest() == PoisonGrads.seen["last_digest"]


def test_diverging_loss_is_warned_once(assets, tmp_path, capsys):
    """Learning rate 100: the loss of step 2 is about 30,000 times step 1's; one warning says so, and the run
    (finite all along) goes on."""
    config = write_config(tmp_path, assets, learning_rate=1e2, warmup_steps=0)
    assert fit(config, "--trainer.max_steps", "3", "--export", "false") is None
    err = capsys.readouterr().err
    assert err.count("training is diverging") == 1, err[-3000:]
    assert re.search(r"warning: step 2: the loss \S+ is [\d,]+ times the run's lowest \(\S+ at step 1\)", err)


# == signals ================================================================================================


class SignalAtStep(Callback):
    """Sends this process ``signum`` as step ``step`` (1-based) begins: the signal arrives mid-step."""

    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), self.signum)


def signal_at(step: int, signum: int) -> str:
    return "--trainer.callbacks+=" + json.dumps({"class_path": "test_faults.SignalAtStep",
                                                 "init_args": {"step": step, "signum": int(signum)}})


def test_sigterm_ends_the_step_with_a_checkpoint_and_status_143(assets, tmp_path, capsys):
    """A scheduler's SIGTERM during step 3 (checkpoints every 2 steps): the step ends, last.ckpt is written at
    step 3, the tool's line says so, and the command's status is 143 (128 + SIGTERM) rather than 0 (main's
    return value is the process's exit status)."""
    config = write_config(tmp_path, assets)
    assert fit(config, signal_at(3, signal.SIGTERM)) == 128 + signal.SIGTERM
    last = run_dir(tmp_path) / "checkpoints" / "last.ckpt"
    assert load(last)["global_step"] == 3
    err = capsys.readouterr().err
    assert f"training was interrupted by SIGTERM after step 3: nothing exported; resume with --ckpt_path last " \
           f"({last}, step 3)" in err, err[-3000:]
    assert not (run_dir(tmp_path) / "hf_export").exists()


def test_ctrl_c_prints_the_interrupted_line_and_status_130(assets, tmp_path, capsys):
    config = write_config(tmp_path, assets)
    # Ctrl-C as a terminal delivers it, also where the suite was started in the background (SIGINT ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert fit(config, signal_at(3, signal.SIGINT)) == 128 + signal.SIGINT
    finally:
        signal.signal(signal.SIGINT, previous)  # Lightning ignores a second Ctrl-C from then on
    last = run_dir(tmp_path) / "checkpoints" / "last.ckpt"
    assert f"training was interrupted by SIGINT after step 2: nothing exported; resume with --ckpt_path last " \
           f"({last}, step 2)" in capsys.readouterr().err


# == a small or busy machine ================================================================================


def test_too_little_free_memory_is_one_line_and_host_memory_is_honoured(assets, tmp_path, capsys, monkeypatch):
    """1 GiB free: fit is refused at its start with one line saying what is free and what the run needs (it was
    a negative budget refused as bad input, whatever host_memory said); given host_memory, the run trains."""
    free_memory(monkeypatch, GIB)
    config = write_config(tmp_path, assets)
    assert fit(config) == 2
    lines = _error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and re.match(r"lightning-oomb: error: this CPU run needs \d+\.\d\d GiB of host memory .* "
                                        r"but this machine has 1\.00 GiB free", lines[0]), lines
    assert fit(config, "--trainer.strategy.init_args.host_memory", "3GiB", "--trainer.max_steps", "1",
               "--export", "false") is None
