"""The Lightning CLI of ``lightning-oomb fit|validate|test`` (lightning_oomb/cli.py dispatches to :func:`run`):
YAML configs for CausalLMModule and any DataModule, with atomic checkpoints, the plan printed before the first
step, and the trained model exported in Hugging Face format."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import json
import os
import re
import shutil
import signal
import sys
from argparse import ArgumentError
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningDataModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from ..core.config import ChunkConfig
from ..core.errors import SetupError
from ..core.plan import PlanError
from .callback import PagedKVCallback
from .checkpoint import AtomicCheckpointIO, SigtermCheckpoint, damage, remove_partial_writes
from .guard import NonFiniteError, NonFiniteGuard
from .module import CausalLMModule
from .progress import run_progress_bar
from .strategy import OOMBStrategy, OOMBStrategyMixin

# Arguments of from_pretrained that transformers keeps in a tokenizer's saved config.
LOAD_ONLY_FLAGS = ("local_files_only", "cache_dir", "force_download", "token", "revision")


class Interrupted(Exception):
    """A signal ended the command after its line was printed; it exits with 128 + the signal's number, as a
    shell reports a process a signal ended (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.status = 128 + signum


class OOMBCLI(LightningCLI):
    """LightningCLI for CausalLMModule (or a subclass named by ``model.class_path``, such as
    SparseCausalLMModule; without one, CausalLMModule) and any DataModule.

    Around ``fit``: checkpoints are written atomically (``AtomicCheckpointIO``, unless the config names
    another CheckpointIO plugin), steps whose loss or gradients are not finite are skipped or stop the run
    (``NonFiniteGuard``, unless the config names one), the plan of a step as placed is printed before the first one, and
    afterwards the model (or LoRA adapter) is exported in Hugging Face format with its tokenizer and the
    held-out result is reported.
    """

    @override
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--export_dir", type=Optional[str], default=None,
            help="fit: where the trained model (or LoRA adapter) and tokenizer are saved in Hugging Face format "
                 "(default: <log_dir>/hf_export, next to the checkpoints folder)",
        )
        parser.add_argument("--export", type=bool, default=True, help="fit: export the trained model at the end")
        parser.add_argument("--start_over", type=bool, default=False,
                            help="fit: train from step 0 in a run folder that holds a last checkpoint, replacing it "
                                 "(without it such a start is refused: resume with --ckpt_path last)")
        parser.add_argument("--plan", type=bool, default=True,
                            help="fit: print the plan of a step as placed (memory against the GPU and host budget)")
        parser.set_defaults({"model": {"class_path": "lightning_oomb.CausalLMModule"}})

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        # predict would need a forward that returns logits for a whole sequence, which the chunked engine does
        # not give (its served forward computes the loss chunk by chunk): not offered.
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name != "predict"}

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        # The progress bar Lightning would add, with the counts of a run that max_steps ends (progress.py); a bar
        # the config names stays, and none is added where the config turns it off.
        config = self._get(self.config_init, "trainer", default={})
        callbacks = config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            kwargs.setdefault("callbacks", [*callbacks, run_progress_bar()])
        return super().instantiate_trainer(**kwargs)

    @override
    def _parse_ckpt_path(self) -> None:
        # LightningCLI torch.loads a --ckpt_path file here, before any hook, for its hyperparameters: check it first.
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path not in (None, "last", "best", "hpc", "registry"):
            check_checkpoint_file(ckpt_path)
        super()._parse_ckpt_path()

    @override
    def _run_subcommand(self, subcommand: str) -> None:
        # Lightning ends a run on SIGTERM with SIGTERMException after the step in progress, and after Ctrl-C with
        # sys.exit(1) once torn down: both SystemExit, whose statuses (0 and 1) would tell a scheduler or an
        # `&&` chain nothing of the signal.
        try:
            super()._run_subcommand(subcommand)
        except SIGTERMException:
            self._interrupted(subcommand, signal.SIGTERM)
        except SystemExit as e:
            if not isinstance(e.__context__, KeyboardInterrupt):
                raise
            self._interrupted(subcommand, signal.SIGINT)
        except KeyboardInterrupt:  # outside the Trainer's handling (before or after fit)
            self._interrupted(subcommand, signal.SIGINT)

    def _interrupted(self, subcommand: str, signum: int) -> None:
        trainer = getattr(self, "trainer", None)
        if trainer is None or trainer.is_global_zero:
            name = signal.Signals(signum).name
            if subcommand == "fit" and trainer is not None:
                print(f"\n{interrupted_line(trainer, name)}", file=sys.stderr, flush=True)
            else:
                print(f"\n{subcommand} was interrupted by {name}: no result", file=sys.stderr, flush=True)
        raise Interrupted(signum) from None

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config.get(str(self.subcommand), self.config)
        precision = str(config.get("trainer", {}).get("precision"))
        # Lightning turns 16-mixed into bf16-mixed on a CPU with only a warning: refuse it on every device.
        if precision in ("16", "16-mixed", "16-true", "half"):
            raise SetupError(
                f"trainer.precision {precision} (float16) is not supported: it needs a gradient scaler that "
                "lightning_oomb does not replay exactly; use bf16-true, bf16-mixed or 32-true"
            )
        accumulate = config.get("trainer", {}).get("accumulate_grad_batches")
        if accumulate is not None and (isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1):
            raise SetupError(f"trainer.accumulate_grad_batches must be an integer >= 1, got {accumulate!r}")
        # jsonargparse would report a bad strategy option as a failed Union match, many lines away from its cause.
        strategy = config.get("trainer", {}).get("strategy")
        class_path = str(getattr(strategy, "class_path", ""))
        oomb_strategies = ("OOMBStrategy", "OOMBDDPStrategy", "OOMBModelParallelStrategy")
        if class_path.endswith(oomb_strategies) and strategy.get("init_args"):
            names = {f.name for f in dataclasses.fields(ChunkConfig)}
            # A nested option (sparse) is still a jsonargparse Namespace here: the strategy takes its dict.
            options = {k: v.as_dict() if hasattr(v, "as_dict") else v
                       for k, v in vars(strategy.init_args).items() if k in names}
            try:
                OOMBStrategy(**options)  # checks its options; allocates nothing
            except SetupError as e:
                raise SetupError(f"trainer.strategy.init_args: {e}") from None
        # TextCorpusDataModule without a tokenizer takes the model's directory: write it into the config so
        # that the saved config.yaml says which tokenizer was used.
        data, model = config.get("data"), config.get("model")
        if data is None or model is None or not str(getattr(data, "class_path", "")).endswith("TextCorpusDataModule"):
            return
        pretrained = model.init_args.get("pretrained")
        if data.init_args.get("tokenizer") is None and pretrained and Path(pretrained).expanduser().is_dir():
            data.init_args.tokenizer = pretrained  # (a missing directory is reported as model.pretrained)

    # -- fit -------------------------------------------------------------------------------------------
    @override
    def before_fit(self) -> None:
        ckpt_path = self._get(self.config, "ckpt_path")
        if self.trainer.global_rank == 0:  # first, so that a second run at once is told that, whatever it asks
            for folder in checkpoint_folders(self.trainer):
                HELD_LOCKS.append(lock_run_folder(folder))
                for leftover in remove_partial_writes(folder):
                    print(f"checkpoint: removed {leftover}, the rest of a write that was interrupted", flush=True)
        if ckpt_path == "last":
            require_last_checkpoint(self.trainer)
            # Lightning would restore the newest last checkpoint whatever its state: the path checked instead.
            self.config_init[self.subcommand]["ckpt_path"] = resolve_last_checkpoint(self.trainer)
        elif ckpt_path is None and not self._get(self.config, "start_over", False):
            refuse_going_back(self.trainer)
        elif ckpt_path is None and self.trainer.global_rank == 0:
            for path in _last_checkpoints(self.trainer):  # start over: its checkpoint is last.ckpt, not last-v1.ckpt
                Path(path).unlink()
        self.fit_record = FitRecord()
        self.trainer.callbacks += [self.fit_record, DiskRoomCheck()]
        if not any(isinstance(cb, SigtermCheckpoint) for cb in self.trainer.callbacks):
            self.trainer.callbacks.append(SigtermCheckpoint())
        # A step that is not finite is skipped, and steps in a row stop the run (NonFiniteGuard); a guard the
        # config names (trainer.callbacks) keeps its own options.
        if not any(isinstance(cb, NonFiniteGuard) for cb in self.trainer.callbacks):
            self.trainer.callbacks.append(NonFiniteGuard())
        strategy = self.trainer.strategy
        if type(strategy.checkpoint_io) is TorchCheckpointIO:
            strategy.checkpoint_io = AtomicCheckpointIO()
        if isinstance(strategy, OOMBStrategyMixin):
            # The plan of the step as placed is printed by the callback that places it, at fit start.
            callback = next((cb for cb in self.trainer.callbacks if isinstance(cb, PagedKVCallback)), None)
            if callback is None:
                callback = PagedKVCallback()
                self.trainer.callbacks.append(callback)
            callback.print_plan = self._get(self.config, "plan", True)

    @override
    def after_fit(self) -> None:
        # Every rank of a run on several devices comes here: the export and the validation gather from all.
        trainer, module = self.trainer, self.model
        if trainer.interrupted:
            if trainer.is_global_zero:
                print(f"\n{interrupted_line(trainer)}")
            return
        record = getattr(self, "fit_record", None)
        if record is not None and record.started_at is None and self._get(self.config, "ckpt_path") is not None:
            if trainer.is_global_zero:
                print(f"\nthe run in the checkpoint had already finished (step {trainer.global_step:,}, "
                      f"trainer.max_steps {trainer.max_steps:,}, epoch {trainer.current_epoch}): nothing trained, "
                      "exported or validated again; raise --trainer.max_steps (or max_epochs) to train on")
            return
        if self._get(self.config, "export", True):
            export_hf(trainer, module, self.datamodule,
                      self._get(self.config, "export_dir") or default_export_dir(trainer))
        self.report_held_out()

    def report_held_out(self) -> None:
        trainer, module = self.trainer, self.model
        if self.datamodule is not None and not _has_val_data(self.datamodule):
            return
        record = getattr(self, "fit_record", None)
        if record is not None and record.validated_at == trainer.global_step and record.metrics:
            merged = record.metrics  # fit validated after its last step (val_check_interval): not run twice
        else:
            results = trainer.validate(module, datamodule=self.datamodule, verbose=False)
            merged = {k: v for result in results for k, v in result.items()}  # one dict per validation loader
        if not merged or not trainer.is_global_zero:
            return
        print("\nheld-out:", ", ".join(f"{k} {v:.4f}" for k, v in sorted(merged.items())))
        examples = getattr(module, "val_examples", {})
        if not examples:
            return
        length = max(examples)
        answer, key = examples[length]
        tokenizer = getattr(self.datamodule, "tokenizer", None)
        if tokenizer is not None:
            answer, key = repr(tokenizer.decode(answer)), repr(tokenizer.decode(key))
        print(f"example: {length} tokens, passkey {key} stated near the start; the model answers {answer}")


class FitRecord(Callback):
    """What the CLI reports after ``fit`` needs to know of it: the step training started from (None: no step ran,
    as when a finished run is resumed) and the step and metrics of its last validation."""

    def __init__(self) -> None:
        self.started_at: int | None = None
        self.validated_at: int | None = None
        self.metrics: dict[str, float] = {}

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self.started_at = trainer.global_step

    @override
    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        self.validated_at = trainer.global_step
        self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")}


class DiskRoomCheck(Callback):
    """Before the first step: each checkpoint folder of the run has room for two of its checkpoints (its weights
    as saved, its optimizer state and the state the first update creates)."""

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        from ..core.optimizers import pending_state
        from .checkpoint import check_disk_room, tensor_bytes

        frozen_left_out = getattr(pl_module.hparams, "get", lambda *_: None)("pretrained") is not None
        weights = sum(p.numel() * p.element_size() for p in pl_module.parameters()
                      if p.requires_grad or not frozen_left_out)
        state = sum(tensor_bytes(o.state_dict()["state"]) for o in trainer.optimizers)
        size = weights + state + pending_state(trainer.optimizers)[1]
        for folder in checkpoint_folders(trainer):
            check_disk_room(folder, size)


def checkpoint_folders(trainer) -> list[Path]:
    """The folders the run's ModelCheckpoint callbacks write to (resolved as they will resolve them)."""
    folders = []
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            logger = trainer.loggers[0] if trainer.loggers else None
            folder = callback.dirpath or (Path(logger.log_dir) / "checkpoints" if logger else trainer.default_root_dir)
            folders.append(Path(folder).resolve())
    return folders


def _last_checkpoints(trainer) -> list[str]:
    return sorted(path for callback in trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)
                  for path in callback._find_last_checkpoints(trainer))


def refuse_going_back(trainer) -> None:
    """A run started without ``--ckpt_path`` where its ModelCheckpoint already holds a last checkpoint would train
    from step 0 beside it (into last-v1.ckpt) and export over the trained model: a resume forgotten. Refuse,
    naming the way on and the way to start over."""
    found = _last_checkpoints(trainer)
    if found:
        raise SetupError(
            f"{found[0]} holds this run's last checkpoint: resume it with --ckpt_path last, or train from step 0 "
            "with --start_over true (replacing it), or give the new run its own "
            "--trainer.logger.init_args.version"
        )


# Run-folder locks held by this process (lock_run_folder), released when the command returns.
HELD_LOCKS: list = []


def lock_run_folder(folder: Path):
    """An exclusive lock on ``folder``'s ``.lock`` file, held until released or the process dies (an flock):
    a second run writing checkpoints into the same folder at once is refused in one line."""
    import fcntl
    import os

    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise SetupError(f"{folder} is in use by another run ({holder}): wait for it to end, or give this run its "
                         "own --trainer.logger.init_args.version") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    return handle


def release_run_folders() -> None:
    while HELD_LOCKS:
        HELD_LOCKS.pop().close()  # closing the file releases its flock




def interrupted_line(trainer, signal_name: str | None = None) -> str:
    """The line a fit that was interrupted ends with: at which step, and where ``--ckpt_path last`` resumes."""
    how = f" by {signal_name}" if signal_name else ""
    last = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.save_last
            and cb.last_model_path and Path(cb.last_model_path).exists()]
    if last:
        step = last[0]._last_global_step_saved  # 0: none saved by this process (a resumed run's is older)
        resume = f"resume with --ckpt_path last ({last[0].last_model_path}" + (f", step {step:,})" if step else ")")
    else:
        resume = "no last checkpoint was written, so a new run starts from the beginning"
    return f"training was interrupted{how} after step {trainer.global_step:,}: nothing exported; {resume}"


def require_last_checkpoint(trainer) -> None:
    """``--ckpt_path last`` resumes; with no last checkpoint where the run's ModelCheckpoint writes, Lightning
    would warn and train from scratch: refuse instead, saying where it looked."""
    folders = [str(folder) for folder in checkpoint_folders(trainer)]
    found = bool(_last_checkpoints(trainer))
    if not found:
        where = " or ".join(folders) or "nowhere (the run has no ModelCheckpoint with save_last: true)"
        raise SetupError(
            f"--ckpt_path last: no last checkpoint in {where}. Run without --ckpt_path to start training, give "
            "the path of a checkpoint file, or run from the folder (and with the logger version) of the run to "
            "continue"
        )


def check_checkpoint_file(path: str) -> None:
    """``--ckpt_path FILE``: a whole file that ``torch.save`` wrote (every record's CRC-32 checked), before the
    model loads; a folder (a distributed checkpoint) is left to the strategy."""
    where = Path(path).expanduser()
    if where.is_dir():
        return
    if not where.exists():
        raise SetupError(f"--ckpt_path {path}: no such file; give a checkpoint this run's ModelCheckpoint wrote "
                         "(its checkpoints folder), or --ckpt_path last")
    wrong = damage(where)
    if wrong is not None:
        raise SetupError(f"--ckpt_path {path} is not a checkpoint that can be restored: {wrong}")


def resolve_last_checkpoint(trainer) -> str:
    """The checkpoint ``--ckpt_path last`` resumes from: the newest last checkpoint of the run's folders if it
    is whole, else the newest ``.ckpt`` file there that is (said in one line); none whole is refused in one
    line naming the newest and what is wrong with it."""
    newest_last = max(_last_checkpoints(trainer), key=os.path.getmtime)
    wrong = damage(newest_last)
    if wrong is None:
        return newest_last
    others = sorted((p for folder in checkpoint_folders(trainer) for p in folder.glob("*.ckpt")
                     if str(p) != newest_last), key=os.path.getmtime, reverse=True)
    fallback = next((str(p) for p in others if damage(p) is None), None)
    if fallback is None:
        raise SetupError(f"--ckpt_path last: {newest_last} is not a checkpoint that can be restored: {wrong}; "
                         "no other checkpoint in its folder is whole. Start over with --start_over true")
    if trainer.is_global_zero:
        print(f"checkpoint: {newest_last} is not one that can be restored ({wrong}); resuming from {fallback}, "
              "the newest that is", flush=True)
    return fallback


def _has_val_data(datamodule) -> bool:
    if hasattr(datamodule, "val_set"):
        return datamodule.val_set is not None
    return True


def _save_tokenizer(tokenizer, folder: Path) -> None:
    """The tokenizer's files, without the flags it was loaded with (``local_files_only``): they are how this
    machine read it, not part of the tokenizer, and would follow it to every machine that loads the export."""
    tokenizer.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        for flag in LOAD_ONLY_FLAGS:
            config.pop(flag, None)
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _set_eos(folder: Path, eos_token_id: int | None) -> None:
    """The EOS token the training data ended its documents with, in the exported config and generation config
    where they have none (a randomly initialised config has none: generate would never stop)."""
    if eos_token_id is None:
        return
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        config = json.loads(path.read_text())
        if config.get("eos_token_id") is None:
            config["eos_token_id"] = eos_token_id
            path.write_text(json.dumps(config, indent=2) + "\n")


def default_export_dir(trainer) -> Path:
    return Path(trainer.log_dir or trainer.default_root_dir) / "hf_export"


def export_hf(trainer, module, datamodule, target) -> Path:
    """Save the trained model (a LoRA adapter for peft models, QLoRA's too: never the 4-bit base) and its
    tokenizer with save_pretrained, from global rank 0; every rank calls it (sharded weights are gathered whole
    from all of them first).

    The files are written to ``<target>.partial`` and moved into place when complete.
    """
    from torch.distributed.tensor import DTensor

    target = Path(target)
    model = module.model
    state = None
    if any(isinstance(p, DTensor) for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not trainer.is_global_zero:
        return target
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    if state is None:
        model.save_pretrained(partial)
    else:
        model.save_pretrained(partial, state_dict=state)
    tokenizer = getattr(datamodule, "tokenizer", None)
    pretrained = module.hparams.get("pretrained") if hasattr(module, "hparams") else None
    if tokenizer is None and pretrained:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(pretrained, local_files_only=True)
        except Exception:
            tokenizer = None
    if tokenizer is not None:
        _save_tokenizer(tokenizer, partial)
        _set_eos(partial, tokenizer.eos_token_id)
    if target.exists():
        shutil.rmtree(target)
    partial.rename(target)
    is_adapter = hasattr(model, "peft_config")
    # QLoRA exports the adapter alone, as LoRA does: the 4-bit base is neither saved nor merged into it, and the
    # adapter was trained on the base quantised as this BitsAndBytesConfig quantises it.
    quantization = getattr(module, "quantization", None)
    bnb = "" if quantization is None else ", quantization_config=BitsAndBytesConfig(" + ", ".join(
        ["load_in_4bit=True", f"bnb_4bit_quant_type={quantization.quant_type!r}"]
        + (["bnb_4bit_use_double_quant=True"] if quantization.double_quant else [])) + ")"
    how = (
        f"peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({pretrained!r}{bnb}), {str(target)!r})"
        if is_adapter
        else f"AutoModelForCausalLM.from_pretrained({str(target)!r})"
    )
    print(f"\nexported the trained {'LoRA adapter' if is_adapter else 'model'}"
          f"{' and tokenizer' if tokenizer is not None else ''} to {target}; load it with {how}")
    return target


def run(args: list[str] | None = None) -> int | None:
    """``lightning-oomb fit|validate|test ARGS`` (None: the command line's, which LightningCLI then reads
    itself; given both, it warns): None when the command ran, 2 after bad input, 1 when training stopped on a
    loss, gradient or weights that are not finite, 128 + the signal's number when SIGINT or SIGTERM ended it
    (each told in one line on stderr; a step that does not fit, 2, with its plan after the line)."""
    try:
        OOMBCLI(
            CausalLMModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            # Errors come back here as exceptions, to be told in one line rather than after the whole usage.
            parser_kwargs={"exit_on_error": False, **{c: {"exit_on_error": False} for c in ("fit", "validate", "test")}},
            args=args,
        )
    except ArgumentError as e:
        print(f"lightning-oomb: error: {argument_error_line(e)}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"\nlightning-oomb: error: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        return e.status
    except PlanError as e:  # a step that does not fit: its first line says why, the plan follows
        print(f"lightning-oomb: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        # Bad input is reported as one message (jsonargparse wraps errors raised while instantiating classes).
        cause = _setup_error(e)
        if cause is None:
            raise
        print(f"lightning-oomb: error: {cause}", file=sys.stderr)
        return 2
    finally:
        release_run_folders()
    return None


def argument_error_line(error: ArgumentError) -> str:
    """jsonargparse's report of a bad option, in one line: an option a class does not accept is named with the
    closest one it does; anything else is its first lines joined."""
    text = str(error)
    option = re.search(r"Option '([^']+)' is not accepted", text)
    class_path = re.search(r"given class_path '([^']+)'", text)
    key = re.search(r'Parser key "([^"]+)"', text)
    if option and class_path:
        module, _, name = class_path.group(1).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
            # A strategy's options are spread over the classes it is built from (OOMBStrategyMixin, Lightning's).
            inits = [c.__init__ for c in cls.__mro__ if "__init__" in vars(c)]
            accepted = [p for init in inits for p in inspect.signature(init).parameters]
        except (ImportError, AttributeError, ValueError):
            accepted = []
        close = difflib.get_close_matches(option.group(1), accepted, n=1)
        where = f"{key.group(1)}.init_args" if key else class_path.group(1)
        return (f"{where}: {class_path.group(1)} has no option {option.group(1)!r}"
                + (f"; did you mean {close[0]!r}?" if close else "")
                + " (`lightning-oomb fit --print_config` shows every option with its value)")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines[:3]) + (" (`lightning-oomb fit --help` lists the options)" if lines else "")


def _setup_error(e: BaseException | None) -> SetupError | None:
    """The SetupError behind ``e``; Lightning's own refusal of a Trainer option (MisconfigurationException) is
    one too, named as a trainer option."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, SetupError):
            return e
        if isinstance(e, MisconfigurationException):
            return SetupError(f"trainer: {' '.join(str(e).split())} (`lightning-oomb fit --help` lists the options)")
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None
