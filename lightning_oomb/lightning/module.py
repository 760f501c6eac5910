"""CausalLMModule: a ready LightningModule for transformers causal LMs."""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch
from lightning.pytorch import LightningModule
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassExactMatch
from transformers import AutoConfig, AutoModelForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": "auto"}


class SetupError(ValueError):
    """A configuration that cannot train, found before the first step: the message names the option or file."""


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
        dtype: the dtype the weights are created in: "float32" (default), "bfloat16" (halves host memory while
            loading; use with ``precision: bf16-true``) or "auto" (the checkpoint's). The Trainer's precision
            still decides the training dtype: bf16-true converts the weights to bfloat16.
        lora_rank: > 0 trains LoRA adapters of that rank through peft instead of all weights.
        lora_alpha, lora_target_modules: the adapters' scale and the modules that get them.
        learning_rate, weight_decay: AdamW settings. warmup_steps: linear warm-up, then cosine decay to 0.
        answer_tokens: > 0 also reports ``val/retrieval_acc``, the teacher-forced exact match of the last
            ``answer_tokens`` tokens of each validation sequence (the passkey task).
        seed: seeds the random initialisation.

    Batches are dicts with ``input_ids`` and ``labels`` (batch, seq_len). Logged: ``train/loss``,
    ``train/tokens_per_s`` (input tokens over the wall time of the step, forward to optimizer step),
    ``val/loss`` (token-weighted mean), ``val/ppl`` and, if asked, ``val/retrieval_acc``.

    AdamW keeps its state (``exp_avg``, ``exp_avg_sq``) in each parameter's dtype: float32 under
    ``32-true`` and ``bf16-mixed``, bfloat16 under ``bf16-true``. Checkpoints also carry the RNG states.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        config: dict | None = None,
        dtype: str = "float32",
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_target_modules: list[str] | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        answer_tokens: int = 0,
        seed: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        if (pretrained is None) == (config is None):
            raise SetupError("give exactly one of model.pretrained (a local model directory) or model.config (a dict)")
        if dtype not in DTYPES:
            raise SetupError(f"model.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if pretrained is not None:
            self.model = load_pretrained(pretrained, DTYPES[dtype])
        else:
            config = dict(config)
            model_type = config.pop("model_type", None)
            if model_type is None:
                raise SetupError("model.config needs a `model_type` (e.g. qwen2, llama)")
            torch.manual_seed(seed)
            self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
            if dtype != "auto":
                self.model.to(DTYPES[dtype])
        if lora_rank > 0:
            import peft

            targets = lora_target_modules or ["q_proj", "k_proj", "v_proj", "o_proj"]
            lora = peft.LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=targets)
            self.model = peft.get_peft_model(self.model, lora)
        self.model.train()  # from_pretrained returns eval mode, which Lightning keeps
        self.val_loss = MeanMetric()
        self.val_acc = MulticlassExactMatch(num_classes=self.model.config.vocab_size) if answer_tokens else None

    def setup(self, stage: str) -> None:
        """Under OOMBStrategy, refuse a model the engine would not train exactly, before any step."""
        from ..integrations.transformers import causal_lm, check_supported
        from .strategy import OOMBStrategy

        if not isinstance(self.trainer.strategy, OOMBStrategy):
            return
        lm = causal_lm(self.model)
        seq_len = getattr(self.trainer.datamodule, "seq_len", None) or getattr(lm.config, "max_position_embeddings", 1)
        was_training = lm.training
        lm.train(stage == "fit")  # the attention-dropout check applies to training
        try:
            check_supported(lm, seq_len)
        except NotImplementedError as e:
            source = self.hparams.pretrained or "model.config"
            raise SetupError(f"{source}: this model cannot be trained by lightning_oomb: {e}") from None
        finally:
            lm.train(was_training)

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        self._step_started = time.perf_counter()

    def on_train_batch_end(self, outputs, batch: dict, batch_idx: int) -> None:
        started = getattr(self, "_step_started", None)
        if started is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = max(time.perf_counter() - started, 1e-9)
        self.log("train/tokens_per_s", batch["input_ids"].numel() / seconds, prog_bar=True, on_step=True, on_epoch=False)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["rng_states"] = collect_rng_states()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "rng_states" in checkpoint:
            restore_rng_states(checkpoint["rng_states"])

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        ids, labels = batch["input_ids"], batch["labels"]
        n = self.hparams.answer_tokens
        out = self.model(input_ids=ids, labels=labels, logits_to_keep=n + 1 if n else 0)
        valid = (labels[:, 1:] != -100).sum()
        self.val_loss.update(out.loss.detach(), weight=valid)
        if n:
            self.val_acc.update(out.logits[:, :-1].argmax(-1), ids[:, -n:])

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.log_dict({"val/loss": loss, "val/ppl": torch.exp(loss)}, prog_bar=True)
        self.val_loss.reset()
        if self.val_acc is not None:
            self.log("val/retrieval_acc", self.val_acc.compute(), prog_bar=True)
            self.val_acc.reset()

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        fused = all(p.is_cuda for p in params)
        optimizer = torch.optim.AdamW(
            params, lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay, fused=fused or None
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = self.hparams.warmup_steps

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def load_pretrained(path: str, dtype) -> torch.nn.Module:
    """A causal LM from a local Hugging Face directory (never downloads), with errors that name the directory."""
    where = Path(path).expanduser()
    if not where.is_dir():
        raise SetupError(f"model.pretrained: the model directory {path} does not exist")
    if not (where / "config.json").is_file():
        raise SetupError(
            f"model.pretrained: {path} has no config.json; give a directory written by save_pretrained "
            "(config.json and *.safetensors)"
        )
    try:
        return AutoModelForCausalLM.from_pretrained(str(where), local_files_only=True, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise SetupError(f"model.pretrained: the model in {path} could not be loaded ({type(e).__name__}: {e})") from None
