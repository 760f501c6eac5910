"""OOMBStrategy in a real Lightning Trainer gives the weights plain full-sequence training gives."""

import copy

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_oomb import OOMBStrategy, PagedKVCallback
from tiny_models import BACKENDS, COMMON, FAMILIES, VOCAB, rel_err, tiny_model


class UserModule(LightningModule):
    """What a user already has: self.model(input_ids=..., labels=...).loss, logged and returned."""

    def __init__(self, model, lr=0.5, optimizer="sgd"):
        super().__init__()
        self.model, self.lr, self.optimizer = model, lr, optimizer

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=self.lr)
        return torch.optim.SGD(params, lr=self.lr)


class ValidatedModule(UserModule):
    """UserModule with a validation step (Lightning warns of one defined where no validation data is given)."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss)


def batches(n=4, batch=2, seq_len=27, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, seq_len), generator=g)
        labels = ids.clone()
        labels[0, :5] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def fit(module, strategy=None, data=None, val=None, **trainer_kwargs):
    kwargs = dict(
        max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0 if val is None else 2,
    )
    kwargs.update(trainer_kwargs)
    if strategy is not None:
        kwargs["strategy"] = strategy
    trainer = Trainer(**kwargs)
    trainer.fit(module, DataLoader(data or batches(), batch_size=None), val and DataLoader(val, batch_size=None))
    return trainer


def weights(module):
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


# Gradients agree to 1e-5 (test_engine); several optimizer steps compound that float32 rounding.
STEPS_TOL = 3e-5


def compare(make_module, tol, strategy_kwargs=None, **trainer_kwargs):
    plain, served = make_module(), make_module()
    start = weights(plain)
    fit(plain, **trainer_kwargs)
    fit(served, OOMBStrategy(chunk_size=8, page_size=4, **(strategy_kwargs or {})), **trainer_kwargs)
    want, got = weights(plain), weights(served)
    assert any(not torch.equal(want[n], start[n]) for n in want), "training did not move the weights"
    worst = max((rel_err(got[n] - start[n], want[n] - start[n]), n) for n in want if not torch.equal(want[n], start[n]))
    assert worst[0] <= tol, f"update of {worst[1]} differs by {worst[0]:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_weights_as_plain_training(backend):
    # The interpreter's steps are slow: one step of the Triton kernels through the Trainer, three of the reference.
    steps = {"max_steps": 1} if backend == "triton" else {}
    compare(lambda: UserModule(tiny_model("qwen2")), STEPS_TOL, {"attention": backend}, **steps)


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_sliding_window_model_with_the_page_pool_callback(family):
    """PagedKVCallback builds the pool before the first step from a two-token probe; the sliding-window layers'
    gradient ring is sized by the run's chunks and pages, as every step's spec sizes it (a probe with its own
    chunking made a pool that no step could use). Every layer windowed (Mistral) and one in two (Gemma 3), windows
    of 5 in chunks of 8: those layers keep K/V pages only where the next chunk's window reaches."""
    types = {} if family == "mistral" else {"layer_types": ["sliding_attention", "full_attention"]}
    plain, served = (UserModule(tiny_model(family, sliding_window=5, **types)) for _ in range(2))
    start = weights(plain)
    fit(plain)
    fit(served, OOMBStrategy(chunk_size=8, page_size=4), callbacks=[PagedKVCallback(max_seq_len=27, max_batch_size=2)])
    want, got = weights(plain), weights(served)
    worst = max((rel_err(got[n] - start[n], want[n] - start[n]), n) for n in want if not torch.equal(want[n], start[n]))
    assert worst[0] <= STEPS_TOL, f"update of {worst[1]} differs by {worst[0]:.2e}"


def test_gradient_accumulation_and_clipping():
    # Clipping scales every update by the total gradient norm, so rounding anywhere reaches every entry: here
    # plain float32 training itself lands 7e-4 from the same training in float64, and the served run 3.6e-5
    # from plain with transformers 5.24 (within STEPS_TOL with older releases). Hence 1e-4.
    compare(lambda: UserModule(tiny_model("llama")), 1e-4, accumulate_grad_batches=2, gradient_clip_val=0.05, max_steps=2)


def test_adamw_and_validation_loop():
    # AdamW divides by sqrt(v): entries with tiny gradients magnify rounding, hence 1e-4 on the update.
    compare(lambda: ValidatedModule(tiny_model("qwen3"), lr=1e-2, optimizer="adamw"), 1e-4, val=batches(2, seed=5))


def test_lora_module():
    peft = pytest.importorskip("peft")

    def make():
        model = tiny_model("qwen2")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        torch.manual_seed(3)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
        return UserModule(model)

    compare(make, STEPS_TOL)


def test_lora_on_experts_through_causal_lm_module():
    """CausalLMModule's lora_target_parameters (LoRA on qwen3_moe's stacked expert weights, with the load-balancing
    loss) under OOMBStrategy: the updates plain training gives."""
    pytest.importorskip("peft")
    from lightning_oomb import CausalLMModule

    config = dict(model_type="qwen3_moe", **COMMON, **FAMILIES["qwen3_moe"], output_router_logits=True)
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

    def make():
        module = CausalLMModule(config=config, lora_rank=4, lora_target_parameters=experts, optimizer="sgd",
                                learning_rate=0.5)
        module.materialize()  # the weights compare() starts from
        return module

    compare(make, STEPS_TOL, val=batches(2, seed=5))


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_bf16_within_plain_bf16_error(precision):
    """bf16 runs are compared with how far the plain bf16 run of the same precision is from fp32."""
    base = tiny_model("qwen2")
    ref32, plain16, served16 = (UserModule(copy.deepcopy(base)) for _ in range(3))
    start = weights(ref32)
    fit(ref32)
    fit(plain16, precision=precision)
    fit(served16, OOMBStrategy(chunk_size=8, page_size=4), precision=precision)
    w32, wp, ws = weights(ref32), weights(plain16), weights(served16)
    for n in w32:
        delta = w32[n] - start[n]
        plain_err = rel_err(wp[n].float() - start[n], delta)
        served_err = rel_err(ws[n].float() - start[n], delta)
        assert served_err <= 2 * plain_err + 1e-3, (n, served_err, plain_err)


def test_cpu_accelerator_on_a_gpu_machine_trains_on_the_cpu(monkeypatch):
    """OOMBStrategy() made where CUDA is present defaults to cuda:0, and Trainer(accelerator="cpu") moves it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    strategy = OOMBStrategy(chunk_size=8)
    monkeypatch.undo()
    assert strategy.root_device == torch.device("cuda", 0)
    fit(UserModule(tiny_model("qwen2")), strategy, max_steps=1)
    assert strategy.root_device == torch.device("cpu")


def test_a_gpu_memory_budget_holds_the_allocator_to_it(monkeypatch):
    """gpu_memory: the process's share of its device (torch.cuda.set_per_process_memory_fraction); more than
    the device has is one line."""
    from types import SimpleNamespace

    from lightning_oomb.core.errors import SetupError

    fractions = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 << 30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: fractions.append((f, device)))
    OOMBStrategy(device="cuda:0", gpu_memory="24GiB")._hold_to_gpu_budget()
    assert fractions == [(0.3, torch.device("cuda", 0))]
    with pytest.raises(SetupError, match=r"gpu_memory 96.0 GiB is more than cuda:0's 80.0 GiB"):
        OOMBStrategy(device="cuda:0", gpu_memory="96GiB")._hold_to_gpu_budget()
    OOMBStrategy(device="cpu", gpu_memory="24GiB")._hold_to_gpu_budget()  # a CPU run has no GPU to hold
    assert len(fractions) == 1


def test_16_mixed_refused():
    from lightning.pytorch.plugins import MixedPrecision

    with pytest.raises(ValueError, match="16-mixed"):
        fit(UserModule(tiny_model("qwen2")), OOMBStrategy(chunk_size=8), plugins=[MixedPrecision("16-mixed", "cpu")])


class AsksLogits(UserModule):
    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch["input_ids"], labels=batch["labels"])
        return out.loss + 0 * out.logits.sum()


class CallsTwice(UserModule):
    def training_step(self, batch, batch_idx):
        a = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        return a + self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


class NoLabels(UserModule):
    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"]).logits
        return logits.float().logsumexp(-1).mean()


class IgnoresServedLoss(UserModule):
    def training_step(self, batch, batch_idx):
        self.model(input_ids=batch["input_ids"], labels=batch["labels"])
        return sum(p.sum() for p in self.model.parameters())


@pytest.mark.parametrize(
    "module_cls,match",
    [
        (AsksLogits, "without materialising logits"),
        (CallsTwice, "called more than once"),
        (NoLabels, "needs labels"),
        (IgnoresServedLoss, "does not depend on the model's served loss"),
    ],
)
def test_unservable_training_step(module_cls, match):
    with pytest.raises(Exception, match=match):
        fit(module_cls(tiny_model("qwen2")), OOMBStrategy(chunk_size=8), max_steps=1)


@pytest.mark.parametrize("model,match", [
    (lambda: tiny_model("qwen2", attention_dropout=0.1), "attention_dropout=0.1 in training mode"),
    (lambda: AutoModelForCausalLM.from_config(AutoConfig.for_model("diffllama", **COMMON)).train(),
     "DiffLlamaForCausalLM .* its forward in chunks of 6 tokens over lightning_oomb's K/V pages differs"),
])
def test_unsupported_model_is_refused_at_fit_start(model, match, monkeypatch):
    """Before any step, with the weights made: what check_supported refuses by name, and what the probe of the
    chunked forward finds (core.schedule.check_chunked_forward), in one line. DiffLlama's refusal by name is
    taken away so that the probe is what refuses it."""
    from lightning_oomb.core.errors import SetupError
    from lightning_oomb.integrations import support

    monkeypatch.setattr(support, "REPEATED_ATTENTION", {})

    with pytest.raises(SetupError, match=f"this model cannot be trained by lightning_oomb: .*{match}") as refused:
        fit(UserModule(model()), OOMBStrategy(chunk_size=8), max_steps=1)
    assert "\n" not in str(refused.value)


def test_memory_series_in_tensorboard(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="run")
    fit(UserModule(tiny_model("qwen2")), OOMBStrategy(chunk_size=8, page_size=4), logger=logger, log_every_n_steps=1,
        callbacks=[PagedKVCallback(max_seq_len=27, max_batch_size=2, trace_step=1)])
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in ("memory/pool_gib", "memory/pages_in_use", "memory/pages_total", "memory/host_peak_gib", "train_loss"):
        assert tag in tags, (tag, tags)
    pages = [e.value for e in events.Scalars("memory/pages_in_use")]
    assert len(pages) == 3 and all(p == 2 * 7 for p in pages)  # 2 sequences x ceil(27 / 4) pages
    # The per-chunk trace of step 1: stage 1's 4 chunks of 8 tokens (27 = 8 + 8 + 8 + 3), then stage 2's.
    stages = [e.value for e in events.Scalars("memory_trace/stage")]
    assert stages == [1] * 4 + [2] * 4
    assert len(events.Scalars("memory_trace/allocated_gib")) == 8
    host = [e.value for e in events.Scalars("memory_trace/host_gib")]
    assert len(host) == 8 and all(h > 0 for h in host)


def test_host_pages_same_weights_as_plain_training():
    """offload="host": the pages live in host memory and stream through in segments; weights unchanged. (The
    Triton kernels over streamed pages are checked against full-sequence gradients in test_offload.py; in
    the interpreter they would cost this test minutes.)"""
    compare(lambda: UserModule(tiny_model("qwen2")), STEPS_TOL,
            {"attention": "reference", "offload": "host", "segment_tokens": 8}, accumulate_grad_batches=2, max_steps=2)


def test_offload_traffic_in_tensorboard(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="run")
    fit(UserModule(tiny_model("qwen2")), OOMBStrategy(chunk_size=8, page_size=4, offload="host"), logger=logger,
        log_every_n_steps=1, callbacks=[PagedKVCallback(max_seq_len=27, max_batch_size=2)])
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in ("offload/h2d_gib", "offload/d2h_gib", "offload/h2d_s", "offload/d2h_s", "memory/pool_host_gib"):
        assert tag in tags, (tag, tags)
    assert all(e.value > 0 for e in events.Scalars("offload/h2d_gib"))
    assert all(e.value > 0 for e in events.Scalars("memory/pool_host_gib"))


@pytest.mark.parametrize("host_has_room", [True, False])
def test_asynchronous_checkpoint_holds_the_weights_of_its_step(tmp_path, monkeypatch, host_has_room):
    """Checkpoints are copied and written on a background thread while training goes on. Where the host memory
    budget holds a copy, the thread copies the tensors to host memory and the write reads the copies: the next
    update waits for the copy, not for the write; where it does not, the write reads the live weights and the
    next update waits for it (OOMBStrategy.backward). Either way the checkpoint holds the weights of the step it
    was taken at.

    The thread's copy (or write, without room) is held until step 3's gradients are computed, so that step 3's
    update would come before it unless the update waits; with room the write is held until step 3's update has
    happened, which it can only if the update does not wait for it. What each thread did is recorded in order."""
    import threading
    import time

    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from lightning_oomb.lightning import checkpoint as checkpoint_module
    from lightning_oomb.lightning.checkpoint import AtomicCheckpointIO

    caller = threading.current_thread()
    order: list[tuple[str, bool]] = []  # (what happened, on the training thread)

    def record(what: str) -> None:
        order.append((what, threading.current_thread() is caller))

    step_3_backward, step_3_updated = threading.Event(), threading.Event()

    def wait_for(event: threading.Event) -> None:
        # Only an order that is wrong (each thread waiting for the other) lets this run out: fail, not hang.
        assert event.wait(timeout=120), "the checkpoint thread and the training step waited for each other"
        # An update that did not wait would come first within this pause; one that waits comes after it however
        # long it is, so the recorded order does not depend on the machine's speed.
        time.sleep(0.5)

    copy_to_host = checkpoint_module.copy_to_host

    def held_copy_to_host(tree):
        wait_for(step_3_backward)
        copied = copy_to_host(tree)
        record("copied to host memory")
        return copied

    monkeypatch.setattr(checkpoint_module, "copy_to_host", held_copy_to_host)

    class HeldCheckpointIO(AtomicCheckpointIO):
        def _write(self, checkpoint, f):
            wait_for(step_3_updated if host_has_room else step_3_backward)
            super()._write(checkpoint, f)
            record("written")

    class NoRoomCheckpointIO(HeldCheckpointIO):
        host_room = property(lambda self: (lambda: -1), lambda self, value: None)

    class Record(Callback):
        def on_after_backward(self, trainer, pl_module):
            if trainer.global_step == 2:
                record("step 3 gradients")
                step_3_backward.set()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 2:
                record("step 3 update")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                self.weights = {n: p.detach().clone() for n, p in pl_module.state_dict().items()}
            if trainer.global_step == 3:
                step_3_updated.set()

    recorder, io = Record(), HeldCheckpointIO() if host_has_room else NoRoomCheckpointIO()
    module = UserModule(tiny_model("qwen2"))
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_last=False)
    fit(module, OOMBStrategy(chunk_size=8, page_size=4, checkpoint_io=io), enable_checkpointing=True,
        callbacks=[recorder, checkpoint])
    if host_has_room:  # the update waited for the copy only; the write went on past it
        assert order == [("step 3 gradients", True), ("copied to host memory", False), ("step 3 update", True),
                         ("written", False)]
        assert io.last_staged_s is not None
    else:  # the write read the live weights: the update waited for it
        assert order == [("step 3 gradients", True), ("written", False), ("step 3 update", True)]
        assert io.last_staged_s is None
    saved = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=True)["state_dict"]
    assert saved.keys() == recorder.weights.keys()
    assert all(torch.equal(saved[n], recorder.weights[n]) for n in saved)
    assert not torch.equal(saved["model.lm_head.weight"], module.model.lm_head.weight.detach())  # step 3 moved them
    assert io.last_size == (tmp_path / "epoch=0-step=2.ckpt").stat().st_size


def test_checkpoint_copy_keeps_shared_tensors_shared():
    from lightning_oomb.lightning.checkpoint import copy_to_host, tensor_bytes

    weight = torch.randn(4, 3)
    tree = {"state_dict": {"a": weight, "b": weight, "c": weight[1]}, "step": 3, "list": [torch.ones(2)]}
    assert tensor_bytes(tree) == 4 * 3 * 4 + 3 * 4 + 2 * 4
    copied = copy_to_host(tree)
    assert copied["state_dict"]["a"] is copied["state_dict"]["b"] and copied["state_dict"]["a"] is not weight
    assert torch.equal(copied["state_dict"]["c"], weight[1]) and copied["step"] == 3
    assert copied["list"][0].data_ptr() != tree["list"][0].data_ptr()


def test_pool_given_back_before_lightning_moves_the_model_to_the_cpu():
    """Lightning's strategy teardown moves the model to host memory; the pinned pool must be gone by then (a
    1M-token run's host memory cannot hold both), and the optimizer state and gradients are not copied along
    (43 GiB for a 7B model with AdamW)."""
    seen = []

    class Module(UserModule):
        def cpu(self):
            callback = next(cb for cb in self.trainer.callbacks if isinstance(cb, PagedKVCallback))
            optimizer = self.trainer.optimizers[0]
            seen.append((callback.pool is None, len(optimizer.state), any(p.grad is not None for p in self.parameters())))
            return super().cpu()

    module = Module(tiny_model("qwen2"), optimizer="adamw")
    fit(module, OOMBStrategy(chunk_size=8, page_size=4), callbacks=[PagedKVCallback(max_seq_len=27, max_batch_size=2)])
    assert seen == [(True, 0, False)]


def test_pool_given_back_before_the_move_when_the_update_fails():
    """An update that raises after the backward (a CUDA out-of-memory in the optimizer's step) leaves the loss
    referenced from the exception's frames: its graph node no longer holds the step's sequence, so the pinned
    pool is gone when Lightning's teardown moves the model to host memory."""
    import gc
    import weakref

    seen = {}

    class FailingUpdate(torch.optim.AdamW):
        def step(self, closure=None):
            closure()
            callback = next(cb for cb in module.trainer.callbacks if isinstance(cb, PagedKVCallback))
            seen["pool"] = weakref.ref(callback.pool)
            raise torch.OutOfMemoryError("the update ran out of memory")

    class Module(UserModule):
        def configure_optimizers(self):
            return FailingUpdate(self.parameters(), lr=1e-3)

        def cpu(self):
            gc.collect()
            seen["pool at the move"] = seen["pool"]()
            return super().cpu()

    module = Module(tiny_model("qwen2"))
    with pytest.raises(torch.OutOfMemoryError, match="the update ran out of memory"):
        fit(module, OOMBStrategy(chunk_size=8, page_size=4), callbacks=[PagedKVCallback(max_seq_len=27, max_batch_size=2)])
    assert seen["pool at the move"] is None


def test_weights_the_host_has_no_room_for_stay_where_they_are(monkeypatch, capsys):
    """Teardown moves the weights to the CPU only where the host takes them with HOST_GROWTH_BYTES to spare (a
    step that failed may still hold its pinned pages): otherwise one line says so and they stay on their device.
    The weights here are on the CPU, so what counts as off it is set."""
    from lightning_oomb.lightning import strategy as strategy_module
    from lightning_oomb.lightning.strategy import bytes_off_the_cpu, host_takes

    assert bytes_off_the_cpu(torch.nn.Linear(4, 3)) == 0
    assert host_takes(1, strategy_module.HOST_GROWTH_BYTES + 1) and not host_takes(2, strategy_module.HOST_GROWTH_BYTES + 1)
    moved = []

    class Module(UserModule):
        def cpu(self):
            moved.append(True)
            return super().cpu()

    monkeypatch.setattr(strategy_module, "bytes_off_the_cpu", lambda module: 14 << 30)
    monkeypatch.setattr(strategy_module, "available_host_memory", lambda: 3 << 30)
    module = Module(tiny_model("qwen2"), optimizer="adamw")
    fit(module, OOMBStrategy(chunk_size=8, page_size=4), callbacks=[PagedKVCallback(max_seq_len=27, max_batch_size=2)])
    assert moved == [] and "cpu" not in vars(module)
    assert "the model's weights stay on cpu after the run: the host has 3.00 GiB available for their 14.00 GiB" \
        in capsys.readouterr().out


def test_sharded_checkpoint_folder_replaces_what_was_there(tmp_path):
    """A finished folder takes the target's place whether nothing, a file or a folder of an earlier save is
    there, and removes what a killed save left (the .old of an interrupted replacement)."""
    import shutil

    from lightning_oomb.lightning.checkpoint import partial_path, replace_folder

    target = tmp_path / "last.ckpt"
    for earlier in (None, "file", "folder"):
        if earlier == "file":  # a checkpoint of one file where the first iteration left a folder
            shutil.rmtree(target)
            target.write_bytes(b"one file")
        elif earlier == "folder":  # the folder the previous iteration put there
            (tmp_path / ".last.ckpt.old").mkdir()  # left by a save killed between its two renames
        finished = partial_path(target)
        finished.mkdir()
        (finished / "shard").write_text(str(earlier))
        replace_folder(finished, target)
        assert (target / "shard").read_text() == str(earlier)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_torch_threads_sets_the_runs_threads_and_refuses_nonsense():
    import lightning as L

    from lightning_oomb import TorchThreads
    from lightning_oomb.core.errors import SetupError

    before = torch.get_num_threads()
    try:
        TorchThreads(1).setup(L.Trainer(accelerator="cpu", logger=False), None, "fit")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(SetupError, match="num_threads must be an integer >= 1, got 0"):
        TorchThreads(0)


@pytest.mark.parametrize("summary", ["ModelSummary", "RichModelSummary"])
def test_model_summary_without_uncounted_flops(summary, capsys, caplog):
    # Lightning counts FLOPs only by running example_input_array: without one its summary printed a FLOPs
    # column of zeros and "Total FLOPs: 0". The strategy's summary leaves them out and keeps the rest.
    import logging

    from lightning.pytorch import callbacks

    if summary == "RichModelSummary":
        pytest.importorskip("rich")
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.callbacks.model_summary"):
        fit(UserModule(tiny_model("qwen2")), OOMBStrategy(chunk_size=8, page_size=4), max_steps=1,
            callbacks=[getattr(callbacks, summary)(max_depth=2)])
    printed = capsys.readouterr().out + caplog.text
    assert "Total params" in printed and "model.model" in printed  # max_depth=2 kept
    assert "FLOPs" not in printed and "Flops" not in printed
