"""`lightning-oomb fit --config ...` on a tiny local model and corpus: what the user sees (plan, TensorBoard,
Hugging Face export), checkpoints that resume bitwise after SIGKILL, and bad input refused before training.

The CLI runs in-process through lightning_oomb.cli.main (on several ranks: in processes started as torchrun starts
them); only the runs that get killed are subprocesses.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback
from transformers import AutoConfig

from lightning_oomb.cli import main
from lightning_oomb.core.host_memory import machine_host_memory
from lightning_oomb.core.optimizers import OPTIMIZERS
from lightning_oomb.lightning.checkpoint import AtomicCheckpointIO, partial_path
from test_corpus import make_model_dir, write_corpus
from tiny_models import as_torchrun_rank, spawn_ranks

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 8, 2  # 11 training sequences in batches of 2: 6 batches per epoch, so step 8 is in epoch 1


class KillingCheckpointIO(AtomicCheckpointIO):
    """Atomic saving that SIGKILLs its own process right after save number ``kill_after_save`` completed,
    or halfway through writing save number ``kill_during_save``."""

    def __init__(self, kill_after_save: int = 0, kill_during_save: int = 0):
        super().__init__()
        self.kill_after_save, self.kill_during_save, self.saves = kill_after_save, kill_during_save, 0

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.saves += 1
        super().save_checkpoint(checkpoint, path, storage_options)
        if self.saves == self.kill_after_save:
            self.wait()  # the write runs on a background thread
            # The whole job, as a scheduler's preemption does: every rank of a data-parallel run is in this
            # process group (fit_subprocess starts each run in a session of its own).
            os.killpg(os.getpgid(0), signal.SIGKILL)

    def _write(self, checkpoint, f):
        if self.saves == self.kill_during_save:
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            data = buffer.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        super()._write(checkpoint, f)


class FullDiskCheckpointIO(AtomicCheckpointIO):
    """Atomic saving whose disk fills up halfway through save number ``full_at`` (ENOSPC, as write(2) says)."""

    def __init__(self, full_at: int = 2):
        super().__init__(asynchronous=False)
        self.full_at, self.saves = full_at, 0

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.saves += 1
        super().save_checkpoint(checkpoint, path, storage_options)

    def _write(self, checkpoint, f):
        if self.saves == self.full_at:
            f.write(b"x" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
        super()._write(checkpoint, f)


class KillAtStep(Callback):
    """SIGKILLs the whole job (every rank: fit_subprocess starts each run in a session of its own) as step
    ``step`` + 1 begins, i.e. after the checkpoint of step ``step`` (ModelCheckpoint saves at a step's end; a
    one-file checkpoint written in the background is waited for)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            getattr(trainer.strategy.checkpoint_io, "wait", lambda: None)()
            trainer.strategy.barrier()  # every rank has finished the save
            os.killpg(os.getpgid(0), signal.SIGKILL)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return {
        "model": make_model_dir(root / "model"),
        "corpus": write_corpus(root / "corpus", docs=60, words=12),  # 780 tokens: 12 sequences of 64
    }


def write_config(folder: Path, assets: dict, **model) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "precision": "32-true",
            "max_steps": STEPS,
            "log_every_n_steps": 1,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "strategy": {"class_path": "lightning_oomb.OOMBStrategy", "init_args": {"chunk_size": 16, "page_size": 8}},
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": str(folder / "runs"), "name": "tiny", "version": "main"},
            },
            "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"save_last": True, "save_top_k": 0, "every_n_train_steps": EVERY}},
                {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor",
                 "init_args": {"logging_interval": "step"}},
            ],
        },
        "model": {"pretrained": str(assets["model"]), "learning_rate": 1e-2, "warmup_steps": 2, **model},
        "data": {
            "class_path": "lightning_oomb.TextCorpusDataModule",
            "init_args": {"paths": [str(assets["corpus"])], "seq_len": 64, "batch_size": 2, "val_fraction": 0.1},
        },
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_dir(folder: Path) -> Path:
    return folder / "runs" / "tiny" / "main"


def fit(config: Path, *extra: str):
    return main(["fit", "--config", str(config), *extra])


def fit_subprocess(config: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-m", "lightning_oomb.cli", "fit", "--config", str(config), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, start_new_session=True,
    )


def _fit_rank(rank: int, world: int, port: int, argv: list[str]) -> None:
    as_torchrun_rank(rank, world, port)
    assert main(argv) is None


def fit_ranks(world: int, config: Path, *extra: str) -> None:
    """``fit`` on ``world`` ranks, each in a process started as torchrun starts it (which Lightning does not launch
    again): the distributed runs that are not killed."""
    spawn_ranks(_fit_rank, world, ["fit", "--config", str(config), *extra])


def killer(**init_args) -> str:
    return "--trainer.plugins=" + json.dumps({"class_path": "test_training_cli.KillingCheckpointIO", "init_args": init_args})


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)  # checkpoints hold no pickled objects


def assert_same_training_state(got: dict, want: dict):
    assert got["global_step"] == want["global_step"] == STEPS
    assert got["state_dict"].keys() == want["state_dict"].keys()
    for name, tensor in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], tensor), f"{name} differs"
    for (i, a), (j, b) in zip(got["optimizer_states"][0]["state"].items(), want["optimizer_states"][0]["state"].items()):
        for key in b:
            assert torch.equal(a[key], b[key]), f"optimizer state {key} of parameter {i} differs"
    assert got["lr_schedulers"] == want["lr_schedulers"]


@pytest.fixture(scope="module")
def uninterrupted(assets, tmp_path_factory):
    """The reference: STEPS steps without interruption, in-process."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    config = write_config(folder, assets)
    assert fit(config) is None
    return {"config": config, "dir": run_dir(folder), "last": load(run_dir(folder) / "checkpoints" / "last.ckpt")}


# == what the user sees ====================================================================================


def test_fit_logs_plan_tensorboard_and_export(uninterrupted, assets):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    events = EventAccumulator(str(uninterrupted["dir"]))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/loss", "train/tokens_per_s", "lr-AdamW", "val/loss", "val/ppl", "memory/pool_gib",
                "memory/pages_in_use"):
        assert tag in tags, (tag, sorted(tags))
    lrs = [e.value for e in events.Scalars("lr-AdamW")]
    assert lrs[0] < lrs[1] and lrs[-1] < max(lrs)  # warm-up, then cosine decay
    assert all(e.value > 0 for e in events.Scalars("train/tokens_per_s"))

    last = uninterrupted["last"]
    assert last["global_step"] == STEPS and "rng_states" in last
    assert last["TextCorpusDataModule"]["epoch"] == 1 and last["TextCorpusDataModule"]["batches_consumed"] == 2
    assert all(t.dtype == torch.float32 for s in last["optimizer_states"][0]["state"].values() for t in s.values())

    export = uninterrupted["dir"] / "hf_export"
    model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    trained = {k.removeprefix("model."): v for k, v in last["state_dict"].items()}
    for name, p in model.state_dict().items():
        assert torch.equal(p, trained[name]), name
    start = AutoModelForCausalLM.from_pretrained(assets["model"])
    assert not torch.equal(start.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)
    # A generic tokenizer.json: AutoTokenizer would substitute Qwen2Tokenizer (config.json says qwen2).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(export, local_files_only=True)
    assert tokenizer.eos_token == "</s>" and tokenizer("the cat")["input_ids"] == [26, 7]
    assert "local_files_only" not in json.loads((export / "tokenizer_config.json").read_text())
    # The EOS the corpus ended its documents with: generate stops there (forced at the third new token).
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tokenizer.eos_token_id

    def eos_at_third(input_ids, scores):
        forced = tokenizer.eos_token_id if input_ids.shape[1] == 4 else 26  # "the", "the", then EOS
        scores[:] = -float("inf")
        scores[:, forced] = 0.0
        return scores

    out = model.generate(torch.tensor([[26, 7]]), max_new_tokens=10, do_sample=False, logits_processor=[eos_at_third])
    assert out.shape[1] == 5 and out[0, -1] == tokenizer.eos_token_id, out
    saved = yaml.safe_load((uninterrupted["dir"] / "config.yaml").read_text())
    assert saved["data"]["init_args"]["tokenizer"] == str(assets["model"])  # taken from model.pretrained


class CountValidations(Callback):
    """Counts validation epochs (in the class: the CLI builds the instance)."""

    runs = 0

    def on_validation_epoch_end(self, trainer, pl_module):
        CountValidations.runs += 1


def test_held_out_validated_once_when_fit_validated_after_its_last_step(assets, tmp_path, capsys):
    """val_check_interval = max_steps (the demo's): fit validates after its last step, and the held-out line
    reports that validation instead of running it again."""
    config = write_config(tmp_path, assets)
    CountValidations.runs = 0
    counter = "--trainer.callbacks+=test_training_cli.CountValidations"
    assert fit(config, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", counter, "--export", "false") is None
    assert "held-out: val/loss" in capsys.readouterr().out
    assert CountValidations.runs == 1


def test_resuming_a_finished_run_says_so_and_touches_nothing(resumable, assets, capsys):
    """``--ckpt_path last`` on a run that reached max_steps: one line says it had finished; nothing is trained,
    exported or validated again (the export keeps its files and times)."""
    folder, last, before = resumable
    export = run_dir(folder) / "hf_export"
    stamps = {f.name: f.stat().st_mtime_ns for f in export.iterdir()}
    assert fit(write_config(folder, assets), "--ckpt_path", "last") is None
    out = capsys.readouterr().out
    assert f"the run in the checkpoint had already finished (step {STEPS}, trainer.max_steps {STEPS}" in out
    assert "held-out:" not in out and "exported the trained model" not in out
    assert {f.name: f.stat().st_mtime_ns for f in export.iterdir()} == stamps and digest(last) == before


def test_plan_and_corpus_printed(assets, tmp_path, capsys):
    config = write_config(tmp_path, assets)
    assert fit(config, "--trainer.max_steps", "1", "--export", "false", "--trainer.limit_val_batches", "0") is None
    out = capsys.readouterr().out
    assert f"Plan: {assets['model']}, context 64 tokens x batch 2, chunk 16, page 8; full training, optimizer adamw" in out
    assert "no CUDA device: the step's memory is this machine's RAM too" in out
    assert "TFLOP/s" not in out and "CUDA context" not in out  # no GPU-only lines on a CPU
    assert "process when the step was placed (measured resident set)" in out
    assert not (run_dir(tmp_path) / "hf_export").exists()


def test_plan_of_packed_documents_counts_attention_within_them(assets, tmp_path, capsys, caplog):
    """document_masking: the printed plan's time counts attention within documents of the corpus's
    length-weighted mean length (the data module's document_length), which the corpus line names too."""
    config = write_config(tmp_path, assets)
    with caplog.at_level("INFO"):
        assert fit(config, "--trainer.max_steps", "1", "--export", "false", "--trainer.limit_val_batches", "0",
                   "--data.init_args.document_masking", "true") is None
    out = capsys.readouterr().out
    length = int(re.search(r"attention as in documents of ([\d,]+) tokens", caplog.text).group(1).replace(",", ""))
    assert 1 < length < 64
    head = next(line for line in out.splitlines() if line.startswith("Plan: "))
    assert f"; packed from documents of {length:,} tokens" in head


class BarRecorder(Callback):
    """What the progress bar shows as each training epoch ends: its description, count and total, and the
    version among its metrics (in ``BarRecorder.seen``)."""

    seen: list[tuple[str, float, float, dict]] = []

    def on_train_epoch_end(self, trainer, pl_module):
        bar = trainer.progress_bar_callback
        task = next(t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id)
        metrics = bar.get_metrics(trainer, pl_module)
        BarRecorder.seen.append((task.description.strip(), task.completed, task.total,
                                 {k: metrics.get(k) for k in ("version", "v_num")}))


def test_progress_bar_counts_after_a_resume(assets, tmp_path):
    """A run that max_steps ends, resumed mid-epoch: the bar counts the epoch's batches against a total that
    includes those taken before the resume (Lightning's own showed 6/4), the epoch out of the last one the run
    reaches (Lightning's: 0/-2), and the logger's version whole (Lightning's: its last 4 characters)."""
    pytest.importorskip("rich")
    config = write_config(tmp_path, assets)
    args = ("--trainer.enable_progress_bar", "true", "--trainer.logger.init_args.version", "resumed-run",
            "--trainer.callbacks+=test_training_cli.BarRecorder", "--trainer.limit_val_batches", "0",
            "--export", "false")
    BarRecorder.seen.clear()
    assert fit(config, *args, "--trainer.max_steps", "4") is None  # checkpointed at step 4, batch 4 of 6
    assert fit(config, *args, "--trainer.max_steps", "8", "--ckpt_path", "last") is None
    version = {"version": "resumed-run", "v_num": None}
    assert BarRecorder.seen == [("Epoch 0/0", 4, 4, version),
                                ("Epoch 0/1", 6, 6, version), ("Epoch 1/1", 2, 2, version)]


def test_print_config_shows_every_option(uninterrupted, capsys):
    with pytest.raises(SystemExit) as info:
        fit(uninterrupted["config"], "--data.init_args.seq_len", "32", "--print_config")
    assert info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["init_args"]["seq_len"] == 32 and printed["data"]["init_args"]["text_field"] == "text"
    assert printed["trainer"]["strategy"]["init_args"]["chunk_size"] == 16
    assert printed["model"]["class_path"] == "lightning_oomb.CausalLMModule"
    assert printed["model"]["init_args"]["lora_rank"] == 0 and printed["model"]["init_args"]["dtype"] == "float32"
    assert printed["export"] is True and "export_dir" in printed


def test_lora_exports_adapter(assets, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    config = write_config(tmp_path, assets, lora_rank=4, lora_target_modules=["q_proj", "v_proj"])
    assert fit(config, "--trainer.max_steps", str(2 * EVERY)) is None  # the last step is checkpointed
    export = run_dir(tmp_path) / "hf_export"
    assert (export / "adapter_config.json").exists() and (export / "tokenizer.json").exists()
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(assets["model"]), export)
    trained = load(run_dir(tmp_path) / "checkpoints" / "last.ckpt")["state_dict"]
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(lora) == 2 * 2 * 2  # A and B of q and v in 2 layers
    for name, p in lora.items():
        assert torch.equal(p, trained["model." + name]), name
    assert any(p.abs().sum() > 0 for n, p in lora.items() if "lora_B" in n)  # B starts at 0: trained


def test_own_model_on_the_cpu_example_as_documented(assets, tmp_path, caplog, monkeypatch):
    """docs/guide.md's own-model route: examples/corpus_cpu.yaml with --model.config null, --model.pretrained,
    --data.init_args.tokenizer null and your text trains the model directory's model on its own tokenizer and
    exports that tokenizer; a tokenizer named beside model.pretrained is said before the plan."""
    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository
    guide = (ROOT / "docs" / "guide.md").read_text()
    documented = ("--config examples/corpus_cpu.yaml --model.config null --model.pretrained /models/my-model \\\n"
                  "    --data.init_args.tokenizer null --data.init_args.paths '[/data/my-text]'")
    assert documented in guide
    route = ["--config", str(ROOT / "examples" / "corpus_cpu.yaml"), "--model.config", "null", "--model.pretrained",
             str(assets["model"]), "--data.init_args.paths", f"[{assets['corpus']}]", "--data.init_args.seq_len", "64",
             "--trainer.max_steps", "2", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
             "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    assert main(["fit", *route, "--data.init_args.tokenizer", "null"]) is None
    export = tmp_path / "runs" / "corpus_cpu" / "main" / "hf_export"
    assert json.loads((export / "tokenizer.json").read_text()) == json.loads((assets["model"] / "tokenizer.json").read_text())
    assert "not the one in model.pretrained's directory" not in caplog.text

    shutil.rmtree(tmp_path / "runs")
    tokenizer_copy = tmp_path / "tokenizer"
    tokenizer_copy.mkdir()
    for f in assets["model"].glob("tokenizer*"):
        shutil.copy(f, tokenizer_copy)
    assert main(["fit", *route, "--data.init_args.tokenizer", str(tokenizer_copy), "--export", "false"]) is None
    said = f"tokenizer: {tokenizer_copy} (data.init_args.tokenizer), not the one in model.pretrained's directory"
    assert said in caplog.text  # on the line after corpus:, which set-up logs before the plan is placed


# == checkpoints that resume exactly ========================================================================


def test_lora_checkpoint_holds_the_adapters_and_resumes_bitwise(assets, tmp_path):
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    lora = dict(lora_rank=4, lora_target_modules=["q_proj", "v_proj"])
    whole = write_config(tmp_path / "whole", assets, **lora)
    assert fit(whole, "--trainer.max_steps", str(2 * EVERY)) is None
    want = load(run_dir(tmp_path / "whole") / "checkpoints" / "last.ckpt")
    assert want["state_dict"] and all("lora_" in name for name in want["state_dict"])  # the frozen weights stay out
    base = AutoModelForCausalLM.from_pretrained(assets["model"])
    assert want["frozen_weights"] == {"pretrained": str(assets["model"]), "tensors": len(base.state_dict())}

    halves = write_config(tmp_path / "halves", assets, **lora)
    assert fit(halves, "--trainer.max_steps", str(EVERY)) is None
    assert fit(halves, "--trainer.max_steps", str(2 * EVERY), "--ckpt_path", "last") is None
    got = load(run_dir(tmp_path / "halves") / "checkpoints" / "last.ckpt")
    assert got["global_step"] == want["global_step"] == 2 * EVERY
    for name, tensor in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], tensor), name
    for a, b in zip(got["optimizer_states"][0]["state"].values(), want["optimizer_states"][0]["state"].values()):
        assert all(torch.equal(a[key], b[key]) for key in b)

    # Outside a Trainer too: the adapters from the checkpoint, the frozen weights from model.pretrained.
    from lightning_oomb import CausalLMModule

    loaded = CausalLMModule.load_from_checkpoint(run_dir(tmp_path / "whole") / "checkpoints" / "last.ckpt")
    state = loaded.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in want["state_dict"].items())
    assert torch.equal(state["model.base_model.model.lm_head.weight"], base.lm_head.weight)


def test_sigkill_after_checkpoint_then_resume_is_bitwise(uninterrupted, assets, tmp_path):
    config = write_config(tmp_path, assets)
    killed = fit_subprocess(config, killer(kill_after_save=2))  # right after the step-4 checkpoint
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # What a run prints, less Lightning's advertisement, the pytree deprecations inside Lightning and torchao, and
    # torchao's CUDA extensions a CPU torch cannot load (lightning_oomb/_noise.py); the same logger's other lines
    # still show.
    for noise in ("Tip: For seamless cloud", "LeafSpec", "is an Enum subclass", "Failed to load"):
        assert noise not in killed.stderr, killed.stderr[-3000:]
    assert "GPU available: False" in killed.stderr
    last = run_dir(tmp_path) / "checkpoints" / "last.ckpt"
    assert load(last)["global_step"] == 2 * EVERY
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fit(config, "--ckpt_path", "last") is None
    assert not [w for w in caught if "not resumable" in str(w.message)]  # Lightning sees the loader's position
    assert_same_training_state(load(last), uninterrupted["last"])


def test_data_parallel_job_killed_after_a_checkpoint_resumes_bitwise(assets, tmp_path):
    """oomb_ddp through the CLI on 2 gloo processes (Lightning launches the second): every rank killed with
    SIGKILL right after the step-2 checkpoint, then `--ckpt_path last` (``fit_ranks``) takes steps 3 and 4 to the
    weights, optimizer state and data position of the run that was never stopped."""
    def ddp_config(folder: Path) -> Path:
        path = write_config(folder, assets)
        config = yaml.safe_load(path.read_text())
        config["trainer"].update(devices=2, max_steps=2 * EVERY, limit_val_batches=0, use_distributed_sampler=False)
        config["trainer"]["strategy"]["class_path"] = "lightning_oomb.OOMBDDPStrategy"
        path.write_text(yaml.safe_dump(config))
        return path

    fit_ranks(2, ddp_config(tmp_path / "whole"), "--export", "false")
    want = load(run_dir(tmp_path / "whole") / "checkpoints" / "last.ckpt")
    config = ddp_config(tmp_path / "killed")
    killed = fit_subprocess(config, "--export", "false", killer(kill_after_save=1))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    last = run_dir(tmp_path / "killed") / "checkpoints" / "last.ckpt"
    assert load(last)["global_step"] == EVERY
    fit_ranks(2, config, "--export", "false", "--ckpt_path", "last")
    got = load(last)
    assert got["global_step"] == want["global_step"] == 2 * EVERY
    assert got["TextCorpusDataModule"] == want["TextCorpusDataModule"]  # killed at an epoch's end: 2 batches each
    for name, tensor in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], tensor), f"{name} differs"
    for a, b in zip(got["optimizer_states"][0]["state"].values(), want["optimizer_states"][0]["state"].values()):
        assert all(torch.equal(a[key], b[key]) for key in b)


def test_model_parallel_job_killed_after_a_checkpoint_resumes_bitwise(assets, tmp_path):
    """oomb_model_parallel (zero2) through the CLI on 2 gloo processes, with sharded checkpoint folders: every rank
    killed with SIGKILL after the step-2 checkpoint was written, then `--ckpt_path last` (``fit_ranks``) takes steps
    3 and 4 to the weights, optimizer state and data position of the run never stopped (the folders read back whole
    with torch.distributed.checkpoint's converter). One file gathered on rank 0 resumes in
    tests/test_model_parallel_2d.py (with the sharded folders of a 2-D mesh)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def sharded_config(folder: Path, kill_at: int | None = None) -> Path:
        path = write_config(folder, assets)
        config = yaml.safe_load(path.read_text())
        config["trainer"].update(devices=2, max_steps=2 * EVERY, limit_val_batches=0, use_distributed_sampler=False)
        config["trainer"]["strategy"]["class_path"] = "lightning_oomb.OOMBModelParallelStrategy"
        config["trainer"]["strategy"]["init_args"]["save_distributed_checkpoint"] = True
        if kill_at is not None:
            config["trainer"]["callbacks"].append({"class_path": "test_training_cli.KillAtStep",
                                                   "init_args": {"step": kill_at}})
        path.write_text(yaml.safe_dump(config))
        return path

    def read(path: Path) -> dict:
        whole = tmp_path / "read.pt"
        dcp_to_torch_save(path, whole)
        return {**torch.load(path / "meta.pt", weights_only=False), **torch.load(whole, weights_only=False)}

    def tensors(tree):
        if isinstance(tree, dict):
            return {f"{k}/{n}": t for k, v in tree.items() for n, t in tensors(v).items()}
        return {"": tree} if isinstance(tree, torch.Tensor) else {}

    fit_ranks(2, sharded_config(tmp_path / "whole"), "--export", "false")
    want = read(run_dir(tmp_path / "whole") / "checkpoints" / "last.ckpt")
    killed = fit_subprocess(sharded_config(tmp_path / "killed", kill_at=EVERY), "--export", "false")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    last = run_dir(tmp_path / "killed") / "checkpoints" / "last.ckpt"
    assert last.is_dir() and read(last)["global_step"] == EVERY
    fit_ranks(2, sharded_config(tmp_path / "killed"), "--export", "false", "--ckpt_path", "last")
    got = read(last)
    assert got["global_step"] == want["global_step"] == 2 * EVERY
    assert got["TextCorpusDataModule"] == want["TextCorpusDataModule"]
    got_tensors, want_tensors = (tensors({k: d[k] for k in ("state_dict", "optimizer_0")}) for d in (got, want))
    assert got_tensors.keys() == want_tensors.keys() and len(want_tensors) > 10
    for name, tensor in want_tensors.items():
        assert torch.equal(got_tensors[name], tensor), f"{name} differs"


@pytest.mark.parametrize("optimizer", [name for name in OPTIMIZERS if name != "adamw"])
def test_sigkill_then_resume_is_bitwise_for_each_optimizer(optimizer, assets, tmp_path):
    """Under bf16-true, where the choices differ (8-bit moments, Kahan compensation, stochastic rounding from the
    RNG): a job SIGKILLed right after a checkpoint resumes to the uninterrupted run's weights and state, bit for
    bit."""
    pytest.importorskip("torchao")
    options = ("--trainer.precision", "bf16-true", "--model.optimizer", optimizer, "--model.learning_rate", "1e-3")
    reference = write_config(tmp_path / "whole", assets)
    assert fit(reference, *options) is None
    want = load(run_dir(tmp_path / "whole") / "checkpoints" / "last.ckpt")
    config = write_config(tmp_path / "killed", assets)
    killed = fit_subprocess(config, *options, killer(kill_after_save=2))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    last = run_dir(tmp_path / "killed") / "checkpoints" / "last.ckpt"
    assert fit(config, *options, "--ckpt_path", "last") is None
    got = load(last)
    assert_same_training_state(got, want)
    state = got["optimizer_states"][0]["state"]
    if OPTIMIZERS[optimizer].kahan:
        assert all("compensation" in s for s in state.values())


def test_sigkill_during_checkpoint_save_keeps_previous(uninterrupted, assets, tmp_path):
    config = write_config(tmp_path, assets)
    killed = fit_subprocess(config, killer(kill_during_save=2))  # halfway through writing the step-4 checkpoint
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    last = run_dir(tmp_path) / "checkpoints" / "last.ckpt"
    partial = partial_path(last)
    assert partial.exists() and partial.stat().st_size > 0  # the kill came while writing
    with pytest.raises(Exception):
        load(partial)
    assert load(last)["global_step"] == EVERY  # the previous checkpoint, intact
    assert fit(config, "--ckpt_path", "last") is None  # resume in-process from it
    assert not partial.exists()
    assert_same_training_state(load(last), uninterrupted["last"])


def test_atomic_io_is_the_default(tmp_path):
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    io_ = AtomicCheckpointIO()
    target = tmp_path / "sub" / "x.ckpt"
    io_.save_checkpoint({"a": torch.arange(3)}, target)
    io_.wait()  # written on a background thread
    assert torch.equal(torch.load(target)["a"], torch.arange(3)) and not partial_path(target).exists()
    assert isinstance(io_, TorchCheckpointIO)
    loaded = io_.load_checkpoint(target)  # on the CPU, memory-mapped: read when the state is loaded
    assert loaded["a"].device.type == "cpu" and torch.equal(loaded["a"], torch.arange(3))
    assert str(target) in Path("/proc/self/maps").read_text()


# == bad input: refused before training, the checkpoint untouched ==========================================


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def resumable(uninterrupted, tmp_path):
    """A copy of the finished run, which every bad invocation below tries to resume."""
    folder = tmp_path / "run"
    shutil.copytree(uninterrupted["dir"], run_dir(folder))
    last = run_dir(folder) / "checkpoints" / "last.ckpt"
    return folder, last, digest(last)


def bad_inputs(assets: dict, tmp: Path) -> dict[str, tuple[list[str], str]]:
    no_tokenizer = tmp / "no_tokenizer"
    shutil.copytree(assets["model"], no_tokenizer)
    for f in no_tokenizer.glob("tokenizer*"):
        f.unlink()
    gpt2 = make_model_dir(tmp / "gpt2", model_type="gpt2")
    junk = tmp / "junk.ckpt"
    junk.write_bytes(bytes(range(256)) * 4)
    bad_jsonl = tmp / "bad.jsonl"
    bad_jsonl.write_text(json.dumps({"text": "the cat"}) + "\n{oops}\n")
    vocab = AutoConfig.from_pretrained(assets["model"]).vocab_size
    wide_vocab = make_model_dir(tmp / "wide_vocab", vocab_size=600, tokenizer=False)
    return {
        "another model's tokenizer (more tokens)": (
            ["--data.init_args.tokenizer", str(ROOT / "examples" / "byte_tokenizer")],
            f"has 257 tokens but the model's embeddings have {vocab} rows: it is not this model's tokenizer"),
        "another model's tokenizer (fewer tokens)": (
            ["--model.pretrained", str(wide_vocab), "--data.init_args.tokenizer", str(assets["model"])],
            f"has {vocab} tokens but the model's embeddings have 600 rows: it is not this model's tokenizer"),
        "a model of another size": (["--model.pretrained", str(make_model_dir(tmp / "wider", intermediate_size=64))],
                                    "this model's (64, 32): resume with the model it was trained from"),
        "another optimizer": (["--model.optimizer", "sgd"],
                              "the checkpoint was trained with model.optimizer adamw, this run asks for sgd"),
        "another precision": (["--trainer.precision", "bf16-true"],
                              "the checkpoint was trained with trainer.precision 32-true, this run asks for bf16-true"),
        "accumulate_grad_batches 0": (["--trainer.accumulate_grad_batches", "0"],
                                      "trainer.accumulate_grad_batches must be an integer >= 1, got 0"),
        "model.config beside model.pretrained": (
            ["--model.config", '{"model_type": "qwen2"}'], "add --model.config null beside --model.pretrained"),
        "missing path": (["--data.init_args.paths", f"[{tmp / 'absent'}]"], f"{tmp / 'absent'} does not exist"),
        "seq_len vs chunk": (["--data.init_args.seq_len", "40"],
                             "seq_len 40 is not a multiple of trainer.strategy.init_args.chunk_size 16"),
        "short corpus": (["--data.init_args.seq_len", "4096"], "has 780 tokens"),
        "no tokenizer": (["--model.pretrained", str(no_tokenizer)], f"{no_tokenizer} has no tokenizer"),
        "unsupported model": (["--model.pretrained", str(gpt2)],
                              "cannot be trained by lightning_oomb: GPT2LMHeadModel (model_type 'gpt2') has dropout"),
        "bad jsonl": (["--data.init_args.paths", f"[{bad_jsonl}]"], f"{bad_jsonl}, line 2: not valid JSON"),
        "other data than the checkpoint": (["--data.init_args.seed", "1"], "trained on other data"),
        "missing model": (["--model.pretrained", str(tmp / "nowhere")],
                          f"model.pretrained: the model directory {tmp / 'nowhere'} does not exist"),
        "chunk size 0": (["--trainer.strategy.init_args.chunk_size", "0"],
                         "trainer.strategy.init_args: chunk_size must be an integer >= 1, got 0"),
        "host budget without unit": (["--trainer.strategy.init_args.host_memory", "12"], "12 is less than 1 GiB"),
        "host budget above the RAM": (["--trainer.strategy.init_args.host_memory", "5TiB"],
                                      "host_memory 5TiB is more than this machine's "
                                      f"{machine_host_memory() / 2**30:.1f} GiB of RAM; give at most that"),
        "negative learning rate": (["--model.learning_rate", "-1"], "model.learning_rate must be > 0, got -1.0"),
        "16-mixed": (["--trainer.precision", "16-mixed"], "trainer.precision 16-mixed (float16) is not supported"),
        "16-true": (["--trainer.precision", "16-true"], "trainer.precision 16-true (float16) is not supported"),
        "missing checkpoint": (["--ckpt_path", str(tmp / "nope.ckpt")], f"--ckpt_path {tmp / 'nope.ckpt'}: no such file"),
        "junk checkpoint": (["--ckpt_path", str(junk)],
                            "is not a checkpoint that can be restored: not a whole torch.save archive"),
        "max_steps": (["--trainer.max_steps", "-3"], "trainer: `max_steps` must be a non-negative integer"),
        **({} if torch.cuda.is_available() else {
            "no GPU": (["--trainer.accelerator", "gpu"], "trainer: No supported gpu backend found!")}),
        "one selection per chunk over packed documents": (
            ["--trainer.strategy.init_args.sparse", '{"budget_pages": 8}', "--trainer.strategy.init_args.offload", "host",
             "--data.init_args.document_masking", "true"],
            "(the default with offload='host') selects one page set per chunk, which packed documents cannot share"),
        "unknown optimizer": (["--model.optimizer", "adamw9"], "model.optimizer: unknown optimizer 'adamw9'"),
        "optimizer argument": (["--model.optimizer", "adamw8bit", "--model.optimizer_args", '{"momentum": 0.9}'],
                               "model.optimizer: adamw8bit takes no argument 'momentum'"),
    }


def test_bad_input_refused_before_training(assets, resumable, tmp_path, capsys):
    folder, last, before = resumable
    config = write_config(folder, assets)
    for name, (args, message) in bad_inputs(assets, tmp_path).items():
        assert fit(config, "--ckpt_path", "last", *args) == 2, name
        err = capsys.readouterr().err
        assert "lightning-oomb: error:" in err and message in err, (name, err[-2000:])
        assert digest(last) == before, name


def test_a_new_start_over_a_checkpoint_is_refused_unless_asked(assets, resumable, capsys):
    """The command of a finished run again without --ckpt_path would train from step 0 beside its checkpoint
    and export over its model: one line says how to resume or start over; --start_over true trains from step 0
    into last.ckpt (not last-v1.ckpt)."""
    folder, last, before = resumable
    config = write_config(folder, assets)
    assert fit(config) == 2
    err = capsys.readouterr().err
    assert f"lightning-oomb: error: {last} holds this run's last checkpoint: resume it with --ckpt_path last" in err
    assert digest(last) == before
    assert fit(config, "--start_over", "true", "--trainer.max_steps", "1", "--export", "false") is None
    assert load(last)["global_step"] == 1 and sorted(p.name for p in last.parent.glob("*.ckpt")) == ["last.ckpt"]


def zeroed(path: Path, at: float, length: int) -> None:
    """Write ``length`` zero bytes into ``path`` at the fraction ``at`` of its size, as a disk or copy might."""
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    data[start:start + length] = bytes(length)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("length", [4096, 100_000])
def test_a_damaged_checkpoint_is_refused_in_one_line_by_path_and_as_last(length, assets, resumable, capsys):
    """Zeros written into the middle of last.ckpt: the CRC-32 of a record fails, and both --ckpt_path last and
    the file's path say so in one line before anything is restored (Lightning restored it, and trained on NaN)."""
    folder, last, before = resumable
    zeroed(last, 0.5, length)
    damaged = digest(last)
    config = write_config(folder, assets)
    for ckpt_path in ("last", str(last)):
        assert fit(config, "--ckpt_path", ckpt_path) == 2
        told = [line for line in capsys.readouterr().err.splitlines() if "lightning-oomb: error:" in line]
        assert len(told) == 1 and "is not a checkpoint that can be restored: its record" in told[0], told
        assert "is damaged" in told[0] and str(last) in told[0]
    assert digest(last) == damaged


def test_last_falls_back_to_the_newest_whole_checkpoint(assets, resumable, capsys):
    """With last.ckpt damaged and an earlier whole checkpoint beside it, --ckpt_path last resumes from that one,
    saying so; the leftover of an interrupted write is removed at the start, saying so."""
    folder, last, before = resumable
    earlier = last.with_name("step=8.ckpt")
    shutil.copy(last, earlier)
    os.utime(earlier, (1, 1))  # older than last.ckpt
    zeroed(last, 0.5, 4096)
    partial_path(last).write_bytes(b"half a checkpoint")
    assert fit(write_config(folder, assets), "--ckpt_path", "last") is None
    out = capsys.readouterr().out
    assert f"checkpoint: removed {partial_path(last)}, the rest of a write that was interrupted" in out
    assert f"checkpoint: {last} is not one that can be restored (its record" in out
    assert f"resuming from {earlier}, the newest that is" in out
    assert not partial_path(last).exists()


def test_a_full_disk_mid_write_is_one_line_and_keeps_the_last_checkpoint(assets, tmp_path, capsys):
    config = write_config(tmp_path, assets)
    plugin = "--trainer.plugins=" + json.dumps({"class_path": "test_training_cli.FullDiskCheckpointIO"})
    assert fit(config, plugin, "--export", "false") == 2
    told = [line for line in capsys.readouterr().err.splitlines() if "lightning-oomb: error:" in line]
    assert len(told) == 1 and "checkpoint: the disk of" in told[0] and "filled up while last.ckpt was written" in told[0]
    last = run_dir(tmp_path) / "checkpoints" / "last.ckpt"
    assert load(last)["global_step"] == EVERY and not partial_path(last).exists()


def test_a_disk_without_room_for_two_checkpoints_is_refused_before_the_first_step(assets, tmp_path, capsys,
                                                                                 monkeypatch):
    from lightning_oomb.lightning import checkpoint

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    assert fit(write_config(tmp_path, assets), "--export", "false") == 2
    told = [line for line in capsys.readouterr().err.splitlines() if "lightning-oomb: error:" in line]
    assert len(told) == 1 and "need room for two in" in told[0] and "its disk has 0.00 GB free" in told[0]
    assert not list((run_dir(tmp_path) / "checkpoints").glob("*.ckpt"))


def test_two_runs_into_one_folder_are_refused(assets, resumable, capsys):
    """While a run holds its checkpoint folder (another process: here this one's lock), a second is refused."""
    from lightning_oomb.lightning.cli import lock_run_folder

    folder, last, before = resumable
    held = lock_run_folder(last.parent)
    try:
        assert fit(write_config(folder, assets), "--ckpt_path", "last") == 2
    finally:
        held.close()
    assert f"{last.parent} is in use by another run (pid {os.getpid()})" in capsys.readouterr().err
    assert digest(last) == before


def test_options_the_checkpoint_overrides_are_reported(assets, resumable, capsys):
    folder, last, before = resumable
    assert fit(write_config(folder, assets), "--ckpt_path", "last", "--model.learning_rate", "1e30") is None
    assert ("resume: the optimizer and schedule state come from the checkpoint, which overrides "
            "model.learning_rate 1e+30 (the checkpoint's: 0.01)") in capsys.readouterr().out


def test_resume_without_a_checkpoint_is_refused(assets, tmp_path, capsys):
    """--ckpt_path last where no run wrote one (another version, another working directory) would train from
    scratch behind a warning: it stops with one line saying where it looked."""
    config = write_config(tmp_path, assets)
    assert fit(config, "--ckpt_path", "last", "--trainer.logger.init_args.version", "other") == 2
    err = capsys.readouterr().err
    assert "lightning-oomb: error: --ckpt_path last: no last checkpoint in" in err
    assert str(run_dir(tmp_path).parent / "other" / "checkpoints") in err, err[-2000:]


def test_unknown_yaml_key_is_named(assets, resumable, capsys):
    folder, last, before = resumable
    config = write_config(folder, assets, lora_rnk=4)
    assert fit(config, "--ckpt_path", "last") == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(
        "lightning-oomb: error: model.init_args: lightning_oomb.CausalLMModule has no option 'lora_rnk'; did you "
        "mean 'lora_rank'?"), err[-2000:]
    assert len(err.strip().splitlines()) <= 3, err  # one line, not the whole usage
    assert digest(last) == before
    assert fit(write_config(folder, assets), "--trainer.strategy.init_args.chunksize", "8") == 2
    assert "OOMBStrategy has no option 'chunksize'; did you mean 'chunk_size'?" in capsys.readouterr().err


# == the example configs ===================================================================================


# The several-GPU examples: (strategy, its sharding, the one-GPU YAML it is otherwise) on 2 devices; the
# tensor-parallel one trains sequences twice as long as its one-GPU YAML.
SEVERAL_GPUS = {
    "qwen2.5-7b-128k-ddp": ("lightning_oomb.OOMBDDPStrategy", None, "qwen2.5-7b-128k"),
    "qwen2.5-7b-128k-zero2": ("lightning_oomb.OOMBModelParallelStrategy", "zero2", "qwen2.5-7b-128k"),
    "qwen2.5-7b-2m-sparse-tp2": ("lightning_oomb.OOMBModelParallelStrategy", "zero2", "qwen2.5-7b-1m-sparse"),
}


@pytest.mark.parametrize("name,data", [("smollm2-passkey-64k", "lightning_oomb.PasskeyTextDataModule"),
                                       ("smollm2-chat-64k", "lightning_oomb.ChatDataModule")])
def test_smollm2_configs_parse(name, data, capsys):
    """The real-model YAMLs go through the Lightning CLI's parser too (--print_config: no model loads); the
    passkey YAML's RULER grid prompts the instruction-tuned model in its chat template."""
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(ROOT / "examples" / f"{name}.yaml"), "--print_config"])
    assert info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["class_path"] == data and printed["data"]["init_args"]["seq_len"] == 65536
    grids = [c for c in printed["trainer"].get("callbacks") or []
             if c["class_path"] == "lightning_oomb.LongContextEvalCallback"]
    assert [g["init_args"]["chat_template"] for g in grids] == ([True] if name == "smollm2-passkey-64k" else [])


@pytest.mark.parametrize("name", ["qwen2.5-7b-128k", "qwen2.5-7b-1m-sparse", "lora", "corpus_cpu", "qlora-24gb",
                                  "qwen2.5-7b-h100", *SEVERAL_GPUS])
def test_example_configs_parse(name, capsys):
    """Each example goes through the Lightning CLI's parser and its classes' signatures (--print_config: nothing
    is instantiated, no fit runs)."""
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(ROOT / "examples" / f"{name}.yaml"), "--print_config"])
    assert info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["class_path"] == "lightning_oomb.TextCorpusDataModule"
    chunk = printed["trainer"]["strategy"]["init_args"]["chunk_size"]
    assert printed["data"]["init_args"]["seq_len"] % chunk == 0
    if name in SEVERAL_GPUS:
        strategy, sharding, one_gpu = SEVERAL_GPUS[name]
        assert printed["trainer"]["strategy"]["class_path"] == strategy and printed["trainer"]["devices"] == 2
        assert printed["trainer"]["strategy"]["init_args"].get("sharding") == sharding
        # The strategy built as the CLI builds the Trainer's (its constructor, with its refusals, needs no process
        # group), from every option the CLI resolved and passes, defaults included.
        from typing import Union

        from lightning.pytorch.cli import LightningArgumentParser
        from lightning.pytorch.strategies import Strategy

        parser = LightningArgumentParser()
        parser.add_argument("--strategy", type=Union[str, Strategy])
        namespace = parser.parse_object({"strategy": printed["trainer"]["strategy"]})
        built = (getattr(parser, "instantiate", None) or parser.instantiate_classes)(namespace).strategy
        assert type(built).__name__ == strategy.rsplit(".", 1)[1] and getattr(built, "sharding", None) == sharding
        one, several = (yaml.safe_load((ROOT / "examples" / f"{n}.yaml").read_text()) for n in (one_gpu, name))
        assert several["trainer"].pop("use_distributed_sampler") is False  # the corpus splits the ranks' data
        # the Kahan choices step whole tensors: the sharded examples take adamw-sr instead
        optimizers = [c["model"].get("init_args", c["model"]).pop("optimizer") for c in (one, several)]
        assert optimizers == ["adamw8bit-kahan", "adamw-sr" if sharding else "adamw8bit-kahan"]
        for config in (one, several):
            config["trainer"].pop("devices")
            config["trainer"]["strategy"].pop("class_path")
            for option in ("sharding", "tensor_parallel_size", "data_parallel_size"):
                config["trainer"]["strategy"]["init_args"].pop(option, None)
            config["trainer"]["logger"]["init_args"].pop("name")
            config["data"]["init_args"].pop("seq_len")
            for callback in config["trainer"]["callbacks"]:
                callback.get("init_args", {}).pop("max_seq_len", None)
        assert several == one


def test_cpu_corpus_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # its paths are relative to the repository
    args = ["--trainer.max_steps", "2", "--trainer.logger.init_args.save_dir", str(tmp_path),
            "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "1",
            "--data.init_args.seq_len", "128", "--data.init_args.batch_size", "2"]  # smaller steps for CI
    assert main(["fit", "--config", "examples/corpus_cpu.yaml", *args]) is None
    assert (tmp_path / "corpus_cpu" / "main" / "hf_export" / "model.safetensors").exists()
    assert (tmp_path / "corpus_cpu" / "main" / "checkpoints" / "last.ckpt").exists()


@pytest.mark.parametrize("name", ["chat_cpu", "smollm2-chat-64k"])
def test_chat_example_configs_parse(name, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(ROOT / "examples" / f"{name}.yaml"), "--print_config"])
    assert info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["class_path"] == "lightning_oomb.ChatDataModule"
    assert printed["data"]["init_args"]["train_on"] == "assistant"
    assert printed["data"]["init_args"]["seq_len"] % printed["trainer"]["strategy"]["init_args"]["chunk_size"] == 0


def test_cpu_chat_example_runs_on_its_shipped_data(tmp_path, monkeypatch):
    import importlib.util

    monkeypatch.chdir(ROOT)  # its paths are relative to the repository
    args = ["--trainer.max_steps", "2", "--trainer.logger.init_args.save_dir", str(tmp_path),
            "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "1", "--export", "false"]
    assert main(["fit", "--config", "examples/chat_cpu.yaml", *args]) is None
    # The shipped conversations are what examples/make_chat_set.py writes, and its tokenizer reads them alike.
    spec = importlib.util.spec_from_file_location("make_chat_set", ROOT / "examples" / "make_chat_set.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.write(tmp_path)
    assert (tmp_path / script.CHAT_SET).read_bytes() == (ROOT / "examples" / script.CHAT_SET).read_bytes()
    from lightning_oomb.lightning.corpus import load_tokenizer

    line = (ROOT / "examples" / script.CHAT_SET).read_text().splitlines()[0]
    texts = [load_tokenizer(str(d)).apply_chat_template(json.loads(line)["messages"], tokenize=True)
             for d in (tmp_path / script.TOKENIZER_DIR, ROOT / "examples" / script.TOKENIZER_DIR)]
    assert texts[0] == texts[1]


def test_long_chat_set_renders_within_its_token_range_and_packs(tmp_path):
    """examples/make_chat_set.py --long (the data of docs/bench/smollm2-chat-64k-h200.sh): each conversation,
    rendered with the tokenizer's template, within the range drawn for it; the secret asked for last; the
    ChatDataModule packs them whole into sequences of the range's top, which they all fit."""
    import importlib.util

    import lightning_oomb
    from lightning_oomb.lightning.corpus import load_tokenizer

    spec = importlib.util.spec_from_file_location("make_chat_set", ROOT / "examples" / "make_chat_set.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    tokenizer_dir = ROOT / "examples" / script.TOKENIZER_DIR
    path = tmp_path / script.LONG_CHATS
    counts = script.write_long(path, load_tokenizer(str(tokenizer_dir)), 4, 8000, 12000)
    assert all(8000 - 4500 <= n <= 12000 for n in counts)  # a turn is at most 16 x 45 words: ~4,300 byte tokens
    rows = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
    for messages in rows:
        secret = messages[1]["content"].split("my secret letter is ")[1][0]
        assert messages[-1] == {"role": "assistant", "content": f"{secret}."}
        assert "".join(c for m in messages for c in m["content"] if c.isupper()) == secret * (
            1 + sum(m["role"] == "assistant" and m["content"] == f"{secret}." for m in messages))
    dm = lightning_oomb.ChatDataModule([str(path)], tokenizer=str(tokenizer_dir), seq_len=12288)
    dm.setup("fit")
    assert dm.num_documents == 4 and sorted(len(c.ids) for c in dm.train_set.conversations) == sorted(counts)


def test_rng_states_round_trip_through_weights_only_load(tmp_path):
    import random

    import numpy

    from lightning_oomb.lightning.module import collect_rng_states, restore_rng_states

    torch.save({"rng": collect_rng_states()}, tmp_path / "rng.pt")
    want = (torch.rand(3), random.random(), numpy.random.rand())
    restore_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"])
    got = (torch.rand(3), random.random(), numpy.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


def test_top_level_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("fit", "validate", "test", "plan", "bench", "evaluate", "lm-eval"):
        assert f"\n  {command} " in out, out


def test_unknown_command_is_one_line(capsys):
    """A mistyped command names the closest one and the list (plan and bench included); predict, which the
    chunked engine does not serve, is not offered."""
    assert main(["fitt"]) == 2
    assert capsys.readouterr().err.strip() == (
        "lightning-oomb: error: unknown command 'fitt'; did you mean 'fit'? "
        "(commands: fit, validate, test, plan, bench, evaluate, lm-eval)")
    assert main(["predict", "--config", "x.yaml"]) == 2
    assert "unknown command 'predict'" in capsys.readouterr().err


def test_sigusr1_prints_the_stacks_and_the_run_goes_on():
    """What fit, validate and test register before Lightning starts: SIGUSR1 writes every thread's Python stack to
    stderr and the process carries on (the CLI benchmark sends it when host memory grows unplanned), also after
    a Trainer has set up and torn down its own signal handlers."""
    code = ("import os, signal\nfrom lightning_oomb.cli import dump_stacks_on_sigusr1\n"
            "def where_it_was():\n    os.kill(os.getpid(), signal.SIGUSR1)\n"
            "dump_stacks_on_sigusr1()\n"
            "from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector\n"
            "from lightning.pytorch import Trainer\n"
            "connector = _SignalConnector(Trainer(accelerator='cpu', logger=False, enable_progress_bar=False))\n"
            "connector.register_signal_handlers()\nconnector.teardown()\n"
            "where_it_was()\nprint('went on')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == "went on\n"
    assert "in where_it_was" in done.stderr, done.stderr
    # Under SLURM the signal is left to Lightning's auto-requeue: unhandled, it ends the process.
    slurm = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "SLURM_JOB_ID": "1"})
    assert slurm.returncode == -signal.SIGUSR1 and slurm.stdout == ""


@pytest.mark.parametrize("name,gpu,host", [("qlora-24gb", "24GiB", "64GiB"), ("qwen2.5-7b-h100", "79GiB", "112GiB")])
def test_the_card_examples_fit_their_cards(name, gpu, host):
    """The planner, given the example's step (its strategy's, model's and data's options), fits it on the card
    and host its comment names."""
    from lightning_oomb.core.config import ChunkConfig, SparseConfig
    from lightning_oomb.core.plan import PlanConfig, plan_placed

    data = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    strategy, model = data["trainer"]["strategy"]["init_args"], data["model"]["init_args"]
    sparse = SparseConfig(**{k: model[k] for k in ("budget_pages", "sink_pages", "local_pages", "per_query_tile")})
    chunk = ChunkConfig(**strategy, sparse=sparse, gpu_memory=gpu, host_memory=host)
    step = plan_placed("qwen2.5-7b", PlanConfig(
        data["data"]["init_args"]["seq_len"], chunk, lora_rank=model.get("lora_rank", 0),
        optimizer=model.get("optimizer", "adamw"), quantization=model.get("quantization")))
    assert step.fits, str(step)
