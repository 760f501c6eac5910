"""LongContextEvalCallback on the CPU: a tiny random model trained by a real Trainer under OOMBStrategy, its RULER
grid run at the steps asked and logged to TensorBoard (a scalar per task and length, the grid as an image),
through the code of ``lightning-oomb evaluate`` (the same predictions), with train mode and gradients given
back; bad input refused in one line before any training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from lightning_oomb import CausalLMModule, LongContextEvalCallback, OOMBStrategy
from lightning_oomb.cli import main
from lightning_oomb.core.errors import SetupError
from lightning_oomb.lightning import eval_callback
from tiny_models import save_byte_level_llama

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = str(ROOT / "examples" / "byte_tokenizer")  # one token per byte
GRID = dict(tasks="vt,fwe", lengths=[640, 768], samples=1)  # the shortest lengths these tasks' prompts fit


@pytest.fixture(autouse=True)
def one_thread():
    # A model this small gains nothing from more threads, and its token-by-token decoding slows many times over
    # when they wait on each other on a CPU that other work shares.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_byte_level_llama(tmp_path_factory.mktemp("evalcb") / "model", TOKENIZER)


def batches(n: int = 4, seq_len: int = 64) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 257, (1, seq_len), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


class Probe(Callback):
    """Records, at the start of each training step, the modules' modes and whether autograd is on."""

    def __init__(self):
        self.seen: list[tuple[int, bool, bool]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        modes = {m.training for m in pl_module.modules()}
        self.seen.append((trainer.global_step, modes == {True}, torch.is_grad_enabled()))


def _fit(module, callbacks, tmp_path=None, max_steps=4, val=False, **trainer_kwargs):
    logger = TensorBoardLogger(tmp_path, name="run") if tmp_path is not None else False
    kwargs = dict(max_steps=max_steps, accelerator="cpu", logger=logger, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  limit_val_batches=1 if val else 0, log_every_n_steps=1, callbacks=callbacks,
                  strategy=OOMBStrategy(chunk_size=256, page_size=64))
    trainer = Trainer(**{**kwargs, **trainer_kwargs})
    trainer.fit(module, DataLoader(batches(), batch_size=None), DataLoader(batches(1), batch_size=None) if val else None)
    return trainer, logger


def test_grid_logged_at_its_steps_as_evaluate_scores_it(model_dir, tmp_path, monkeypatch, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    during: list[tuple[bool, bool]] = []
    run_grid = eval_callback.run_grid

    def watched(model, *args, **kwargs):
        during.append((torch.is_grad_enabled(), model.training))
        return run_grid(model, *args, **kwargs)

    monkeypatch.setattr(eval_callback, "run_grid", watched)
    callback, probe = LongContextEvalCallback(**GRID, every_n_steps=2, at_start=True), Probe()
    _, logger = _fit(CausalLMModule(pretrained=str(model_dir), learning_rate=1e-2), [callback, probe], tmp_path,
                     max_steps=3)

    # at the start (step 0), then after optimizer step 2 (not 1 or 3); in eval mode without gradients, then given back
    assert sorted(callback.results) == [0, 2]
    assert during == [(False, False)] * 2
    assert probe.seen == [(step, True, True) for step in range(3)]
    err = capsys.readouterr().err
    assert "LongContextEvalCallback at step 2: [4/4] fwe at 768" in err

    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    tags = events.Tags()
    cells = [f"eval/{t}/{n}" for t in ("vt", "fwe") for n in (640, 768)]
    for tag in cells + ["eval/mean/640", "eval/mean/768"]:
        values = events.Scalars(tag)
        assert [e.step for e in values] == [0, 2], tag
        assert all(0.0 <= e.value <= 1.0 for e in values), tag
    for step, results in callback.results.items():
        for tag in cells:
            _, task, n = tag.split("/")
            logged = next(e.value for e in events.Scalars(tag) if e.step == step)
            assert logged == pytest.approx(results[task][int(n)]["score"] / 100)
    assert "eval/grid" in tags["images"]
    assert [e.step for e in events.Images("eval/grid")] == [0, 2]
    assert events.Images("eval/grid")[0].encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"

    # Step 0 ran on the saved weights: lightning-oomb evaluate on that directory decodes the same answers.
    out = tmp_path / "cli"
    assert main(["evaluate", "--model", str(model_dir), "--tasks", GRID["tasks"], "--lengths", "640,768",
                 "--samples", "1", "--chunk", "256", "--page-size", "64", "--out", str(out)]) == 0
    cli = json.loads((out / "results.json").read_text())

    def answers(samples: list[dict]) -> list[dict]:  # each prompt's record but its time
        return [{k: v for k, v in s.items() if k != "seconds"} for s in samples]

    for task in ("vt", "fwe"):
        for n in (640, 768):
            ours = callback.results[0][task][n]
            assert ours["score"] == cli["scores"][task][str(n)]
            assert answers(ours["samples"]) == answers(cli["details"][task][str(n)])
    # training moved the weights, and the grid followed them: some answer changed by step 2
    assert any(answers(callback.results[2][t][n]["samples"]) != answers(callback.results[0][t][n]["samples"])
               for t in ("vt", "fwe") for n in (640, 768))


@pytest.mark.parametrize("schedule,trainer_kwargs,steps", [
    # after optimizer steps only: not after the first micro-batch, at global step 0
    (dict(every_n_steps=1), dict(accumulate_grad_batches=2, max_steps=2), [1, 2]),
    # at the validation of step 2, not at the sanity check before training
    (dict(at_validation=True), dict(val=True, num_sanity_val_steps=1, val_check_interval=2, max_steps=3), [2]),
])
def test_when_it_runs(model_dir, schedule, trainer_kwargs, steps):
    callback = LongContextEvalCallback(tasks="vt", lengths=[640], samples=1, **schedule)
    _fit(CausalLMModule(pretrained=str(model_dir)), [callback], **trainer_kwargs)
    assert sorted(callback.results) == steps


@pytest.mark.parametrize("kwargs,match", [
    (dict(tasks="vt,niah_single_9"), "unknown task 'niah_single_9' (did you mean"),
    (dict(lengths=[1024, 0]), "lengths must be positive token counts"),
    (dict(lengths="1K,huge"), "lengths: cannot read a token count 'huge'"),
    (dict(every_n_steps=0), "every_n_steps must be >= 1"),
    (dict(every_n_steps=None), "nothing to run"),
])
def test_bad_arguments_are_one_line(kwargs, match):
    with pytest.raises(SetupError) as refused:
        LongContextEvalCallback(**{**dict(tasks="vt", lengths="1K", every_n_steps=1), **kwargs})
    assert match in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("model,kwargs,match", [
    ("config", {}, "LongContextEvalCallback needs a tokenizer"),
    ("pretrained", dict(lengths="1K,8K"), "lengths 8K beyond the model's max_position_embeddings 4,096"),
    ("pretrained", dict(lengths=[400]), "lengths: vt at 400 tokens: its prompt alone takes"),
    ("pretrained", dict(tokenizer="no/such/dir"), "the tokenizer directory no/such/dir does not exist"),
    ("pretrained", dict(chat_template=True), "chat_template: the tokenizer has no chat template"),
])
def test_set_up_refusals_come_before_any_step(model_dir, model, kwargs, match):
    if model == "config":
        module = CausalLMModule(config=dict(model_type="llama", vocab_size=300, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    else:
        module = CausalLMModule(pretrained=str(model_dir))
    probe = Probe()
    with pytest.raises(SetupError) as refused:
        _fit(module, [LongContextEvalCallback(**{**dict(tasks="vt", lengths="1K", every_n_steps=1), **kwargs}), probe])
    assert match in str(refused.value) and "\n" not in str(refused.value)
    assert probe.seen == [] and not module.is_materialized  # before the weights were made


def test_without_matplotlib_the_scalars_alone(model_dir, tmp_path, monkeypatch):
    import importlib.util

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    callback = LongContextEvalCallback(tasks="vt", lengths=[640], samples=1, every_n_steps=1)
    with pytest.warns(UserWarning, match="matplotlib is not installed, so the grid is logged as scalars only") as said:
        _, logger = _fit(CausalLMModule(pretrained=str(model_dir)), [callback], tmp_path, max_steps=2)
    assert sum("matplotlib" in str(w.message) for w in said) == 1  # once, at set-up, not at every evaluation
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    assert [e.step for e in events.Scalars("eval/vt/640")] == [1, 2] and events.Tags()["images"] == []
