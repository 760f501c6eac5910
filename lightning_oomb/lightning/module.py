"""CausalLMModule: a ready LightningModule for transformers causal LMs."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from lightning.pytorch import LightningModule
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassExactMatch
from transformers import AutoConfig, AutoModelForCausalLM


class CausalLMModule(LightningModule):
    """Trains ``self.model``, a transformers causal LM, with next-token cross-entropy.

    Args:
        pretrained: a local Hugging Face model directory (config and weights); or
        config: a transformers config as a dict (with ``model_type``) for a randomly initialised model.
        lora_rank: > 0 trains LoRA adapters of that rank through peft instead of all weights.
        lora_alpha, lora_target_modules: the adapters' scale and the modules that get them.
        learning_rate, weight_decay: AdamW settings. warmup_steps: linear warm-up, then cosine decay to 0.
        answer_tokens: > 0 also reports ``val/retrieval_acc``, the teacher-forced exact match of the last
            ``answer_tokens`` tokens of each validation sequence (the passkey task).
        seed: seeds the random initialisation.

    Batches are dicts with ``input_ids`` and ``labels`` (batch, seq_len). Logged: ``train/loss``,
    ``val/loss`` (token-weighted mean), ``val/ppl`` and, if asked, ``val/retrieval_acc``.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        config: dict | None = None,
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
            raise ValueError("give exactly one of `pretrained` (a local model directory) or `config` (a dict)")
        if pretrained is not None:
            if not Path(pretrained).is_dir():
                raise FileNotFoundError(f"pretrained model directory {pretrained!r} does not exist")
            self.model = AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True)
        else:
            config = dict(config)
            model_type = config.pop("model_type", None)
            if model_type is None:
                raise ValueError("`config` needs a `model_type` (e.g. qwen2, llama)")
            torch.manual_seed(seed)
            self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
        if lora_rank > 0:
            import peft

            targets = lora_target_modules or ["q_proj", "k_proj", "v_proj", "o_proj"]
            lora = peft.LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=targets)
            self.model = peft.get_peft_model(self.model, lora)
        self.val_loss = MeanMetric()
        self.val_acc = MulticlassExactMatch(num_classes=self.model.config.vocab_size) if answer_tokens else None

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
