"""The ``lightning-oomb`` command: Lightning CLI subcommands (fit, validate, test) with YAML configs."""

from __future__ import annotations

import sys

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI

from .core.served import serve
from .lightning import CausalLMModule
from .lightning.strategy import OOMBStrategy, find_causal_lm


class OOMBCLI(LightningCLI):
    """LightningCLI for CausalLMModule and any DataModule; after ``fit`` it reports the held-out result."""

    def after_fit(self) -> None:
        trainer, module = self.trainer, self.model
        if not trainer.is_global_zero:
            return
        metrics = trainer.validate(module, datamodule=self.datamodule, verbose=False)[0]
        print("\nheld-out:", ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())))
        example = getattr(self.datamodule, "val_set", None)
        n = module.hparams.answer_tokens
        if example is None or not n:
            return
        item = example[0]
        ids = item["input_ids"][None].to(module.device)
        config = trainer.strategy.chunk_config if isinstance(trainer.strategy, OOMBStrategy) else None
        model = find_causal_lm(module)
        with torch.no_grad(), serve(model, config) if config else _plain():
            logits = model(input_ids=ids, labels=item["labels"][None].to(module.device), logits_to_keep=n + 1).logits
        answer = logits[0, :-1].argmax(-1).tolist()
        print(f"example: {ids.shape[1]} tokens, passkey {ids[0, -n:].tolist()} stated near the start; "
              f"the model answers {answer}")


class _plain:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main(args: list[str] | None = None) -> int | None:
    args = list(args if args is not None else sys.argv[1:])
    # `plan` and `bench` are plain argparse commands, not Lightning CLI subcommands.
    if args and args[0] == "plan":
        from .planner_cli import main as plan_main

        return plan_main(args[1:])
    if args and args[0] == "bench":
        from .bench.run import main as bench_main

        return bench_main(args[1:])
    OOMBCLI(
        CausalLMModule,
        LightningDataModule,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )
    return None


if __name__ == "__main__":
    sys.exit(main())
