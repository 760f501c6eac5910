"""CausalLMModule: a ready LightningModule for transformers causal LMs."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import random
import re
import tempfile
import time
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_only
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassExactMatch
from transformers import AutoConfig, AutoModelForCausalLM
from typing_extensions import override

from ..core.errors import SetupError
from ..core.model_shape import LORA_TARGETS
from ..core.optimizers import OptimizerSpec
from ..core.pretrained import config_dtype, load_pretrained, pretrained_config
from ..core.pretrained import one_line as _one_line
from ..core.quantization import Quantization
from ..core.units import human_count, human_tokens
from .quantization import check_installed, keep_trainable_on_cpu, parameter_count, restore_quant_states

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": "auto"}
LORA_DTYPES = {"float32": torch.float32, "weights": None}
# The key of a checkpoint that says what a resume must share with the run that wrote it (_run_identity).
RUN_KEY = "oomb_run"
# Options whose values a resume takes from the checkpoint (the optimizer's param groups, the schedule's base
# learning rate), not from the command line.
RESTORED_BY_CHECKPOINT = ("learning_rate", "weight_decay", "optimizer_args")


def collect_rng_states() -> dict:
    """The RNG states a step may draw from: torch (CPU and every CUDA device), Python's random, numpy's.

    Only tensors and plain Python values, so that checkpoints load with ``torch.load(weights_only=True)``.
    """
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
        states["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    except ImportError:
        pass
    return states


def restore_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        try:
            import numpy

            kind, keys, pos, has_gauss, gauss = states["numpy"]
            numpy.random.set_state((kind, keys.numpy().astype(numpy.uint32), pos, has_gauss, gauss))
        except ImportError:
            pass


class CausalLMModule(LightningModule):
    """Trains ``self.model``, a transformers causal LM, with next-token cross-entropy.

    Args:
        pretrained: a local Hugging Face model directory (config and weights; nothing is downloaded); or
        config: a transformers config as a dict (with ``model_type``) for a randomly initialised model.
        gguf_file: with ``pretrained``, the GGUF file in that directory to load instead of config.json and
            safetensors (llama.cpp's format, as ``from_pretrained(pretrained, gguf_file=...)``: quantised tensors
            are dequantised to ``dtype``; needs the ``gguf`` package, the ``[gguf]`` extra).
        config_overrides: with ``pretrained``, fields set on its config before the model is built, as
            ``from_pretrained(pretrained, **config_overrides)`` sets them: e.g. RoPE scaling to extend the
            context, ``{"rope_parameters": {"rope_type": "yarn", "factor": 8.0, ...},
            "max_position_embeddings": 65536}``. A field the config does not have is refused.
        dtype: the dtype the weights are created in: "float32" (default), "bfloat16" or "auto" (the
            checkpoint's or config's). The Trainer's precision still decides the training dtype: under bf16-true
            the weights are created in bfloat16 whatever this says.
        lora_rank: > 0 trains LoRA adapters of that rank through peft instead of all weights.
        lora_alpha, lora_target_modules: the adapters' scale and the modules that get them (None: the
            attention projections the model has, q_proj, k_proj, v_proj and o_proj, or Phi-3's qkv_proj and o_proj).
        lora_target_parameters: parameters adapted directly (peft's ``target_parameters``, peft >= 0.17): the
            fused 3-D expert weights of mixtures of experts, e.g. ``["mlp.experts.gate_up_proj",
            "mlp.experts.down_proj"]``, next to ``lora_target_modules`` (``[]`` there: the experts alone).
        lora_dtype: "float32" (default): the adapters train in float32 whatever the precision (under
            ``bf16-true`` too: they are small, and bf16 would round their updates away); "weights": in the
            weights' dtype.
        quantization: QLoRA: "nf4" (or "fp4", or a dict ``{"quant_type": "nf4", "double_quant": true}``)
            loads the base model's linear layers in 4 bits through bitsandbytes (transformers'
            ``BitsAndBytesConfig``, computing in the weights' dtype), frozen under the LoRA adapters, which
            ``lora_rank`` must ask for. With ``config`` the random model is built, saved to a temporary
            directory and loaded from there as ``pretrained`` would be. Needs the ``[qlora]`` extra.
        optimizer: a name ("adamw", "adamw-sr", "adamw8bit", "adamw-kahan", "adamw8bit-kahan", "sgd") or a
            class path ("torch.optim.NAdam"); docs/optimizers.md says what each costs and how close to float32
            each trains under ``bf16-true`` (there: "adamw8bit-kahan", at the memory of plain "adamw").
        optimizer_args: further keyword arguments of the optimizer (``{"betas": [0.9, 0.95]}``).
        learning_rate, weight_decay: the optimizer's. warmup_steps: linear warm-up, then cosine decay to 0 at
            ``schedule_steps`` (None: the Trainer's ``max_steps``; resuming with a larger ``max_steps`` then
            stretches the cosine from the resumed step on, so the learning rate jumps up: set ``schedule_steps``
            to keep one schedule over runs that extend each other).
        answer_tokens: > 0 also reports ``val/retrieval_acc``, the teacher-forced exact match of the last
            ``answer_tokens`` tokens of each validation sequence (the passkey task).
        seed: seeds the random initialisation (see ``materialize``).
        new_token_ids: token ids the model has not learned yet (as tokens added to a vocabulary): their input
            embedding rows start at the mean of the other rows, as ``resize_token_embeddings`` initialises added
            tokens, so that the model starts unable to tell them apart. The CPU passkey demo states its passkeys
            so: only gradients that reach the chunk stating them can teach the model which is which.

    Construction builds only the model's structure, on the meta device: a 7B model in seconds, no memory.
    ``configure_model`` (called by the Trainer) builds the weights on the strategy's device, or loads them
    there, and prints how long that took; outside a Trainer call ``materialize()`` before using ``self.model``.

    Batches are dicts with ``input_ids`` and ``labels`` (batch, seq_len), optionally ``position_ids`` (packed
    documents) and ``loss_weights`` (a weight per label: the training loss is their weighted mean, as
    ``train_step`` takes them). Logged: ``train/loss``, ``train/tokens_per_s`` (input tokens over the wall time
    of the step, forward to optimizer step), ``val/loss`` (token-weighted mean, whatever the weights),
    ``val/ppl`` and, if asked, ``val/retrieval_acc``.

    Checkpoints carry the optimizer's whole state (8-bit moments and Kahan compensation too) and the RNG states; with
    ``pretrained`` they leave out the weights that do not train (under LoRA all but the adapters), which
    resuming takes from ``pretrained`` again; with ``config`` they hold every weight (4-bit ones with their
    quantisation state).
    """

    def __init__(
        self,
        pretrained: str | None = None,
        config: dict | None = None,
        gguf_file: str | None = None,
        config_overrides: dict | None = None,
        dtype: str = "float32",
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_target_modules: list[str] | None = None,
        lora_target_parameters: list[str] | None = None,
        lora_dtype: str = "float32",
        quantization: str | dict | None = None,
        optimizer: str = "adamw",
        optimizer_args: dict | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        schedule_steps: int | None = None,
        answer_tokens: int = 0,
        seed: int = 0,
        new_token_ids: list[int] | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        if pretrained is None and config is None:
            raise SetupError("give one of model.pretrained (a local model directory) or model.config (a dict)")
        if pretrained is not None and config is not None:
            raise SetupError("give one of model.pretrained (a local model directory) or model.config (a dict), not "
                             "both: with a YAML that sets model.config, add --model.config null beside "
                             "--model.pretrained")
        if dtype not in DTYPES:
            raise SetupError(f"model.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if lora_dtype not in LORA_DTYPES:
            raise SetupError(f"model.lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {lora_dtype!r}")
        self.optimizer_spec = OptimizerSpec.parse(optimizer, optimizer_args)  # before any model is read
        for name, value, low in (("learning_rate", learning_rate, 0.0), ("weight_decay", weight_decay, 0.0),
                                 ("warmup_steps", warmup_steps, 0), ("lora_rank", lora_rank, 0),
                                 ("schedule_steps", 1 if schedule_steps is None else schedule_steps, 1),
                                 ("answer_tokens", answer_tokens, 0)):
            if value < low or (name == "learning_rate" and value == 0):
                bound = "> 0" if name == "learning_rate" else f">= {low}"
                raise SetupError(f"model.{name} must be {bound}, got {value!r}")
        if lora_target_parameters is not None:
            check_target_parameters_option(lora_target_parameters, lora_rank)
        self.quantization = Quantization.parse(quantization, "model.quantization")
        if self.quantization is not None:
            if lora_rank == 0:
                raise SetupError("model.quantization freezes the base weights in 4 bits for LoRA adapters to train: "
                                 "set model.lora_rank > 0 (e.g. 16)")
            if gguf_file is not None:
                raise SetupError("model.quantization quantises safetensors weights; model.gguf_file loads a GGUF "
                                 "file dequantised: use one of them")
            check_installed()
        if pretrained is None and (gguf_file is not None or config_overrides):
            option = "gguf_file" if gguf_file is not None else "config_overrides"
            raise SetupError(f"model.{option} applies to model.pretrained; with model.config write the fields there")
        if pretrained is not None:
            hf_config = pretrained_config(pretrained, gguf_file, config_overrides)
            self._pretrained_config = hf_config  # materialize builds the model from it
        else:
            hf_config = config_from_dict(config)
        vocab = hf_config.vocab_size
        if new_token_ids is not None and not (0 < len(set(new_token_ids)) < vocab
                                              and all(0 <= i < vocab for i in new_token_ids)):
            raise SetupError(f"model.new_token_ids must be ids in [0, {vocab}) (the vocabulary) leaving some "
                             f"others, got {new_token_ids!r}")
        # Only the structure, on the meta device (no memory, no RNG draws, seconds for 7B): config, module
        # names, LoRA wrapping and the set-up checks work on it; configure_model builds the weights.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(hf_config)
            if dtype != "auto":
                skeleton.to(DTYPES[dtype])
            self.model = self._with_lora(skeleton)
        self.model.train()
        # One set of held-out metrics per validation loader (a DataModule may hold out several lengths).
        self.val_metrics = torch.nn.ModuleList()
        self._val_lengths: list[int] = []
        # {held-out length: (answer predicted, pass key)} of each loader's first sequence, as token ids: the CLI
        # prints the longest's after fit (a forward then would run on the CPU, where Lightning leaves the model).
        self.val_examples: dict[int, tuple[list[int], list[int]]] = {}

    # -- the model's weights ------------------------------------------------------------------------------
    @property
    def is_materialized(self) -> bool:
        """Whether ``self.model`` holds real tensors (False from construction until ``materialize``)."""
        return not any(t.is_meta for t in itertools.chain(self.model.parameters(), self.model.buffers()))

    @override
    def configure_model(self) -> None:
        """Build the weights where they will train.

        Lightning calls this hook inside ``strategy.tensor_init_context()`` (the strategy's device, and under
        ``bf16-true`` bfloat16 as default dtype) before it moves the model, builds the optimizer or restores a
        checkpoint; ``load_from_checkpoint`` calls it too. It runs again for every ``fit``/``validate``/``test``
        of the same module: a model already built is kept.
        """
        self.materialize()

    def materialize(self, device: torch.device | str | None = None) -> None:
        """Replace the meta-device skeleton of ``__init__`` by the real model on ``device``; a no-op once done.

        ``device``: None is the device of the current ``torch.device`` context (Lightning's, inside
        ``configure_model``), else the CPU. Call it to use ``self.model`` outside a Trainer.

        With ``config``: built by ``from_config`` on ``device`` under ``torch.manual_seed(seed)``, exactly as a
        model constructed there (non-persistent buffers such as RoPE's ``inv_freq`` included). The same seed on
        the same device gives the same weights; the values come from that device's RNG (a CUDA build differs
        from a CPU one) and, as before, the global RNGs are left seeded from ``seed``.
        With ``pretrained``: ``from_pretrained`` straight onto ``device``.
        With ``quantization``: ``from_pretrained`` with transformers' ``BitsAndBytesConfig`` (the ``config``
        model after a round trip through a temporary directory), computing in the weights' dtype.

        The weights are created in ``model.dtype``, except where the default dtype is not float32 (Lightning's
        ``bf16-true`` inside ``configure_model``): the precision would convert them to it anyway, so they are
        built in it, without a float32 copy. LoRA adapters are then added by peft, initialised as peft does.
        Prints one line with the time taken (global rank zero only).
        """
        if self.is_materialized:
            return
        device = torch.device(device) if device is not None else torch.empty(0).device
        if device.type == "meta":
            raise ValueError("materialize() builds real weights: give a device other than meta")
        dtype = self._weights_dtype()
        started = time.perf_counter()
        quantization = self.quantization
        if self.hparams.pretrained is not None:
            hparams = self.hparams
            bnb = None if quantization is None else quantization.hf_config(
                dtype or config_dtype(self._pretrained_config))
            base = load_pretrained(hparams.pretrained, dtype or "auto", device, hparams.gguf_file,
                                   self._pretrained_config, quantization_config=bnb)
            what = f"loaded {hparams.pretrained}" + (f"/{hparams.gguf_file}" if hparams.gguf_file else "")
            where = "onto"
        else:
            torch.manual_seed(self.hparams.seed)
            with torch.device(device):
                base = AutoModelForCausalLM.from_config(config_from_dict(self.hparams.config))
            if dtype is not None:
                base.to(dtype)
            if quantization is not None:
                base = quantized_copy(base, device, quantization.hf_config(next(base.parameters()).dtype))
            what = f"built {base.config.model_type} from model.config"
            where = "on"
        if self.hparams.get("new_token_ids"):
            start_as_new_tokens(base, self.hparams.new_token_ids)
        params, built_dtype = parameter_count(base), next(base.parameters()).dtype
        if quantization is not None:
            keep_trainable_on_cpu(base)
        with torch.device(device):
            model = self._with_lora(base)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the init kernels are asynchronous: time them
        seconds = time.perf_counter() - started
        self.model = model.train()  # from_pretrained returns eval mode, which Lightning keeps
        detail = f"{human_count(params)} params, {str(built_dtype).removeprefix('torch.')}"
        if quantization is not None:
            detail += f", linear layers in {quantization.describe()}"
        if self.hparams.lora_rank > 0:
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            detail += f"; LoRA rank {self.hparams.lora_rank}, {human_count(trainable)} trainable"
        seed = "" if self.hparams.pretrained is not None else f", seed {self.hparams.seed}"
        took = f"{seconds:.2f} s" if seconds < 1 else f"{seconds:.1f} s"
        _print_rank_zero(f"model: {what} ({detail}) {where} {device} in {took}{seed}")

    def _weights_dtype(self) -> torch.dtype | None:
        """The dtype to build the weights in; None keeps the config's (or checkpoint's)."""
        default = torch.get_default_dtype()
        if default != torch.float32:  # a "-true" precision converts the weights to it after configure_model
            return default
        return None if self.hparams.dtype == "auto" else DTYPES[self.hparams.dtype]

    def _with_lora(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` with peft LoRA adapters if ``lora_rank`` > 0 (created on the current device)."""
        if self.hparams.lora_rank <= 0:
            return model
        import peft

        hparams = self.hparams
        parameters = hparams.lora_target_parameters
        if parameters is not None:
            check_target_parameters_match(model, parameters)
        return peft.get_peft_model(model, lora_config(hparams.lora_rank, hparams.lora_alpha,
                                                      hparams.lora_target_modules, parameters, model))

    @override
    def setup(self, stage: str) -> None:
        """Under OOMBStrategy or OOMBDDPStrategy, refuse a model the engine would not train exactly, before any step."""
        from ..integrations.support import check_supported
        from ..integrations.transformers import causal_lm
        from .strategy import OOMBStrategyMixin

        if not isinstance(self.trainer.strategy, OOMBStrategyMixin):
            return
        choice = self.optimizer_spec.choice
        if stage == "fit" and choice is not None and choice.kahan and self.trainer.strategy.strategy_name == (
                "oomb_model_parallel"):
            raise SetupError(f"model.optimizer {choice.name} steps whole tensors, not oomb_model_parallel's shards: "
                             f"use {choice.name.removesuffix('-kahan')} or adamw-sr there")
        if self.quantization is not None and self.trainer.strategy.strategy_name == "oomb_model_parallel":
            raise SetupError("model.quantization: oomb_model_parallel does not shard 4-bit weights; "
                             "use OOMBStrategy or oomb_ddp")
        lm = causal_lm(self.model)
        was_training = lm.training
        lm.train(stage == "fit")  # the attention-dropout check applies to training
        try:
            check_supported(lm)
        except NotImplementedError as e:
            source = self.hparams.pretrained or "model.config"
            raise SetupError(f"{source}: this model cannot be trained by lightning_oomb: {e}") from None
        finally:
            lm.train(was_training)

    @override
    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        self._step_started = time.perf_counter()

    @override
    def on_train_batch_end(self, outputs, batch: dict, batch_idx: int) -> None:
        started = getattr(self, "_step_started", None)
        if started is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = max(time.perf_counter() - started, 1e-9)
        self.log("train/tokens_per_s", batch["input_ids"].numel() / seconds, prog_bar=True, on_step=True, on_epoch=False)

    @override
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Adds the RNG states. With ``pretrained``, leaves out the frozen weights (all but the adapters under
        LoRA: 15 GB of a 7B model that ``model.pretrained`` holds already; a 4-bit weight with its quantisation
        state), which loading takes from there."""
        checkpoint["rng_states"] = collect_rng_states()
        checkpoint[RUN_KEY] = self._run_identity()
        state = checkpoint["state_dict"]
        frozen = self._frozen_names()
        if self.hparams.pretrained is not None and frozen:
            names, quant_states = set(frozen), tuple(f"{name}." for name in frozen)  # <weight>.absmax, ...
            left_out = [key for key in state if key in names or key.startswith(quant_states)]
            for key in left_out:
                del state[key]
            checkpoint["frozen_weights"] = {"pretrained": str(self.hparams.pretrained), "tensors": len(left_out)}

    @override
    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Restores the RNG states, the 4-bit weights a checkpoint holds (with ``config``: their quantisation
        state, which ``load_state_dict`` does not take), and the frozen weights a checkpoint left out from the
        model as loaded from ``model.pretrained``."""
        self._check_resumable(checkpoint)
        if "rng_states" in checkpoint:
            restore_rng_states(checkpoint["rng_states"])
        if self.quantization is not None:
            restore_quant_states(self, checkpoint["state_dict"])
        left_out = checkpoint.get("frozen_weights")
        if left_out is None:
            return
        if self.hparams.pretrained is None:
            raise SetupError(
                f"this checkpoint holds only the trained weights; the frozen ones come from "
                f"{left_out['pretrained']}: set model.pretrained to that directory"
            )
        if str(self.hparams.pretrained) != left_out["pretrained"]:
            _print_rank_zero(f"checkpoint: the frozen weights come from model.pretrained={self.hparams.pretrained} "
                             f"(the checkpoint was trained on {left_out['pretrained']})")
        state, current = checkpoint["state_dict"], self.state_dict()
        for name in self._frozen_names():  # a 4-bit weight's quantisation state stays as loaded
            state.setdefault(name, current[name])

    def _run_identity(self) -> dict[str, str]:
        """What a resume must share with the run that wrote a checkpoint: its optimizer and its precision."""
        identity = {"optimizer": self.optimizer_spec.class_path}
        if self._trainer is not None:
            identity["precision"] = str(self.trainer.precision)
        return identity

    def _check_resumable(self, checkpoint: dict) -> None:
        """Refuse, in one line, a checkpoint that this module would restore into something else: weights of other
        names or shapes (another model or size), another optimizer (its state would not be this one's), another
        precision (the weights would be cast without a word); report the options the checkpoint's optimizer and
        schedule state override."""
        current = self.state_dict()
        unknown = [name for name in checkpoint.get("state_dict", {}) if name not in current]
        if unknown:
            raise SetupError(f"the checkpoint holds weights this model does not have ({unknown[0]}, "
                             f"{len(unknown)} in all): resume with the model it was trained from, or start over")
        for name, tensor in checkpoint.get("state_dict", {}).items():
            if tuple(tensor.shape) != tuple(current[name].shape):
                raise SetupError(f"the checkpoint's {name} is {tuple(tensor.shape)}, this model's "
                                 f"{tuple(current[name].shape)}: resume with the model it was trained from, or "
                                 "start over")
        saved, now = checkpoint.get(RUN_KEY, {}), self._run_identity()
        for key, option in (("optimizer", "model.optimizer"), ("precision", "trainer.precision")):
            if key in saved and key in now and saved[key] != now[key]:
                raise SetupError(f"the checkpoint was trained with {option} {saved[key]}, this run asks for "
                                 f"{now[key]}: resume with {saved[key]}, or start over")
        if self._trainer is None or "optimizer_states" not in checkpoint:
            return
        before = checkpoint.get("hyper_parameters", {})
        overridden = [f"model.{name} {self.hparams[name]!r} (the checkpoint's: {before[name]!r})"
                      for name in RESTORED_BY_CHECKPOINT if name in before and before[name] != self.hparams.get(name)]
        if overridden:
            _print_rank_zero("resume: the optimizer and schedule state come from the checkpoint, which overrides "
                             f"{', '.join(overridden)}; start over to train with them")

    def _adapters_to_lora_dtype(self) -> None:
        """Cast the LoRA adapters to ``lora_dtype`` where the precision plugin converted them with the model
        (``bf16-true``); called when the optimizer is built, after that conversion and before a checkpoint
        is restored into them."""
        dtype = LORA_DTYPES[self.hparams.lora_dtype]
        if self.hparams.lora_rank <= 0 or dtype is None:
            return
        for name, p in self.model.named_parameters():
            if p.requires_grad and "lora_" in name and p.dtype != dtype:
                p.data = p.data.to(dtype)

    def _frozen_names(self) -> list[str]:
        """State-dict names of the parameters that do not train (every name of a tied weight)."""
        return [name for name, p in self.named_parameters(remove_duplicate=False) if not p.requires_grad]

    @override
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        # loss_weights (a data module's loss_reduction: sequence) only where given: a plain forward has no such input
        weights = {"loss_weights": batch["loss_weights"]} if batch.get("loss_weights") is not None else {}
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"],
                          position_ids=batch.get("position_ids"), **weights).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        ids, labels = batch["input_ids"], batch["labels"]
        n = self.hparams.answer_tokens
        position_ids = batch.get("position_ids")
        out = self.model(input_ids=ids, labels=labels, position_ids=position_ids, logits_to_keep=n + 1 if n else 0)
        valid = (labels[:, 1:] != -100).sum()
        if position_ids is not None:  # a document's last token predicts nothing (core/documents.py)
            valid -= (position_ids[:, 1:] == 0).logical_and(labels[:, 1:] != -100).sum()
        metrics = self._val_metrics(dataloader_idx, ids.shape[1])
        metrics["loss"].update(out.loss.detach(), weight=valid)
        if n:
            answer = out.logits[:, :-1].argmax(-1)
            metrics["retrieval_acc"].update(answer, ids[:, -n:])
            if batch_idx == 0:
                self.val_examples[ids.shape[1]] = (answer[0].tolist(), ids[0, -n:].tolist())

    def _val_metrics(self, dataloader_idx: int, seq_len: int) -> torch.nn.ModuleDict:
        while len(self.val_metrics) <= dataloader_idx:
            metrics = {"loss": MeanMetric()}
            if self.hparams.answer_tokens:
                metrics["retrieval_acc"] = MulticlassExactMatch(num_classes=self.model.config.vocab_size)
            self.val_metrics.append(torch.nn.ModuleDict(metrics).to(self.device))
            self._val_lengths.append(seq_len)
        self._val_lengths[dataloader_idx] = seq_len
        return self.val_metrics[dataloader_idx]

    @override
    def on_validation_epoch_end(self) -> None:
        """Logs ``val/loss``, ``val/ppl`` and ``val/retrieval_acc``; with several validation loaders each name
        ends in its sequence length (``val/retrieval_acc_64K``)."""
        several = len(self.val_metrics) > 1
        for metrics, seq_len in zip(self.val_metrics, self._val_lengths):
            if metrics["loss"].update_count == 0:
                continue
            suffix = f"_{human_tokens(seq_len)}" if several else ""
            loss = metrics["loss"].compute()
            values = {f"val/loss{suffix}": loss, f"val/ppl{suffix}": torch.exp(loss)}
            if "retrieval_acc" in metrics:
                values[f"val/retrieval_acc{suffix}"] = metrics["retrieval_acc"].compute()
            self.log_dict(values, prog_bar=not several, add_dataloader_idx=False)
            if several and "retrieval_acc" in metrics:
                self.log(f"acc_{human_tokens(seq_len)}", values[f"val/retrieval_acc{suffix}"], prog_bar=True,
                         logger=False, add_dataloader_idx=False)
            for metric in metrics.values():
                metric.reset()

    @override
    def configure_optimizers(self):
        self._adapters_to_lora_dtype()
        params = [p for p in self.parameters() if p.requires_grad]
        clipped_mixed = bool(self.trainer.gradient_clip_val) and "mixed" in str(self.trainer.precision)
        optimizer = self.optimizer_spec.build(params, self.hparams.learning_rate, self.hparams.weight_decay,
                                              fused=not clipped_mixed)
        choice = self.optimizer_spec.choice
        if choice is not None and not choice.kahan and choice.name != "adamw-sr" and any(
                p.dtype == torch.bfloat16 for p in params):
            _print_rank_zero(f"optimizer: {choice.name} rounds each update to the bf16 weights, which loses most "
                             "updates below ~1e-4 of a weight; model.optimizer: adamw8bit-kahan keeps them at the "
                             "same memory (docs/optimizers.md)")
        total = self.hparams.schedule_steps or max(1, int(self.trainer.estimated_stepping_batches))
        warmup = self.hparams.warmup_steps

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def config_from_dict(config: dict):
    """A transformers config from ``model.config`` (a dict with ``model_type``); the family's defaults apply."""
    # A field set on the command line (--model.config.hidden_size 128) arrives as text: read it as YAML would.
    fields = {k: _scalar(v) if isinstance(v, str) else v for k, v in dict(config).items()}
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise SetupError("model.config needs a `model_type` (e.g. qwen2, llama)")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError) as e:
        raise SetupError(f"model.config: {_one_line(e)}") from None


def _scalar(text: str) -> Any:
    """``text`` as the number, boolean or null it spells (YAML's reading, and 1e-5 as a float), else itself."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return text
    return value


# The attention projections LoRA adapts by default, as the families name them (Phi-3 fuses q, k, v: qkv_proj).
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")


def default_lora_targets(model: torch.nn.Module | None) -> list[str]:
    """The attention projections ``model`` holds as linear layers (its own names: Phi-3's qkv_proj and o_proj),
    or LORA_TARGETS (q, k, v, o) where it holds none of them or is not given."""
    if model is None:
        return list(LORA_TARGETS)
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return [n for n in ATTENTION_PROJECTIONS if n in names] or list(LORA_TARGETS)


def lora_config(rank: int, alpha: float, target_modules: list[str] | None = None,
                target_parameters: list[str] | None = None, model: torch.nn.Module | None = None):
    """peft's ``LoraConfig`` for CausalLMModule's LoRA options. Without ``target_parameters``, an empty or
    missing ``target_modules`` means the attention projections (``default_lora_targets(model)``); with them,
    ``[]`` adapts the parameters alone and None keeps the attention projections next to them."""
    import peft

    if target_parameters is None:
        return peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules or default_lora_targets(model))
    modules = default_lora_targets(model) if target_modules is None else target_modules
    return peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, target_parameters=list(target_parameters))


EXPERT_PARAMETERS_EXAMPLE = "[mlp.experts.gate_up_proj, mlp.experts.down_proj]"


def check_target_parameters_option(names: object, lora_rank: int) -> None:
    """A SetupError, before any model is read, where ``model.lora_target_parameters`` cannot apply: no LoRA
    rank, not a list of names, or a peft without ``target_parameters`` (added in peft 0.17)."""
    if lora_rank == 0:
        raise SetupError("model.lora_target_parameters names parameters for LoRA adapters: set model.lora_rank > 0 "
                         "(e.g. 16)")
    if isinstance(names, str) or not isinstance(names, (list, tuple)) or not names or not all(
            isinstance(n, str) and n for n in names):
        raise SetupError(f"model.lora_target_parameters must be a non-empty list of parameter names, e.g. "
                         f"{EXPERT_PARAMETERS_EXAMPLE}; got {names!r}")
    if importlib.util.find_spec("peft") is None:
        raise SetupError("model.lora_target_parameters needs peft >= 0.17, not installed here: "
                         "pip install 'peft>=0.17'")
    import peft

    if not any(f.name == "target_parameters" for f in dataclasses.fields(peft.LoraConfig)):
        raise SetupError(f"model.lora_target_parameters needs peft >= 0.17, which adapts parameters; installed: "
                         f"peft {peft.__version__}: pip install -U 'peft>=0.17'")


def check_target_parameters_match(model: torch.nn.Module, names: list[str]) -> None:
    """A SetupError where a name of ``model.lora_target_parameters`` matches no parameter of ``model`` (matched
    as peft matches: the whole name, or its last dot-separated parts) or one LoRA cannot adapt: peft adapts a
    2-D matrix (out, in) or a 3-D stack of expert matrices (experts, out, in), or (experts, in, out) where the
    experts' module says ``is_transposed``. Runs on the meta-device structure, before any weight is built."""
    params = dict(model.named_parameters())
    for target in names:
        found = [n for n in params if n == target or n.endswith(f".{target}")]
        if not found:
            raise SetupError(f"model.lora_target_parameters: {target!r} names no parameter of the model; "
                             f"{_stacked_parameters_hint(params)}")
        odd = next((n for n in found if params[n].dim() not in (2, 3)), None)
        if odd is not None:
            raise SetupError(f"model.lora_target_parameters: {target!r} names {odd}, a {params[odd].dim()}-D "
                             "parameter; LoRA adapts matrices (2-D) and stacks of expert matrices (3-D)")


def _stacked_parameters_hint(params: dict[str, torch.nn.Parameter]) -> str:
    """What the model's 3-D parameters (mixture-of-experts stacks) are called within a layer, for an error."""
    stacks = sorted({re.sub(r"^.*?\.\d+\.", "", n) for n, p in params.items() if p.dim() == 3})
    if not stacks:
        return ("it has no stacked expert weights (3-D parameters): adapt its linear layers with "
                "model.lora_target_modules")
    return f"its stacked expert weights are {', '.join(stacks)}"


def quantized_copy(model: torch.nn.Module, device: torch.device, quantization_config) -> torch.nn.Module:
    """``model`` with its linear layers quantised as ``from_pretrained`` quantises a checkpoint's: saved to a
    temporary directory and loaded back through ``quantization_config``, so that a ``model.config`` model gets
    the 4-bit weights it would get saved and loaded as ``model.pretrained`` (transformers quantises while
    loading; it has no public call that quantises a built model)."""
    with tempfile.TemporaryDirectory(prefix="lightning_oomb-") as folder:
        model.save_pretrained(folder)
        quantized = load_pretrained(folder, "auto", device, quantization_config=quantization_config)
    quantized.config.name_or_path = model.config.name_or_path  # not the temporary directory's (plans name it)
    return quantized


def start_as_new_tokens(model: torch.nn.Module, token_ids: list[int]) -> None:
    """Set the input embedding rows of ``token_ids`` to the mean of the other rows (in place)."""
    weight = model.get_input_embeddings().weight
    rows = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
    rows[list(token_ids)] = True
    with torch.no_grad():
        weight[rows] = weight[~rows].float().mean(0, keepdim=True).to(weight.dtype)


@rank_zero_only
def _print_rank_zero(line: str) -> None:
    print(line, flush=True)
