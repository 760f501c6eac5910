"""LongContextEvalCallback: a RULER task x length grid on the model being trained, logged as scalars and an image."""

from __future__ import annotations

import difflib
import importlib.util
import sys
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from ..core.errors import SetupError
from ..core.units import human_tokens, parse_tokens
from ..evaluation.grid import format_table, grid_figure, run_grid
from ..evaluation.ruler import TASKS, has_chat_template, make_sample
from ..integrations.transformers import find_causal_lm
from .corpus import CorpusError, check_tokenizer_matches, load_tokenizer
from .model_parallel import OOMBModelParallelStrategy

NAME = "LongContextEvalCallback"


class LongContextEvalCallback(Callback):
    """Runs RULER's offline tasks (``lightning_oomb.evaluation.ruler``) at a list of context lengths on the model
    being trained, through the code of ``lightning-oomb evaluate`` (``evaluation.grid.run_grid``: each prompt
    stored chunk by chunk in K/V pages, then greedy decoding over them; no whole-sequence forward), with the
    strategy's ``ChunkConfig`` (chunk size, page size, offload, sparse) under the Trainer's precision, without
    gradients and in eval mode; each module's train/eval mode is restored after.

    Logged at the step it ran (``trainer.global_step``) to every logger: ``<prefix>/<task>/<length>``, the score
    as a fraction in [0, 1] (RULER's percent / 100; length as ``lightning-oomb evaluate`` prints it, e.g. 64K), and
    ``<prefix>/mean/<length>``, the tasks' mean there; to a TensorBoardLogger also ``<prefix>/grid``, the heatmap
    ``lightning-oomb evaluate`` draws (skipped, with one warning, where matplotlib is not installed). One progress
    line per task and length and the table go to stderr.

    Args:
        tasks: task names of ``evaluation.ruler.TASKS`` (a list, or one comma-separated string).
        lengths: context lengths in tokens of the model's tokenizer (ints or "4K", "1M"), each prompt and the
            tokens its task generates together.
        samples: prompts per task and length. seed: the prompts' seed (the same prompts at every evaluation).
        every_n_steps: evaluate after every this many optimizer steps (None: not by steps).
        at_validation: evaluate at the end of each validation (not the sanity check), under ``validate`` too.
        at_start: evaluate once before the first training step (the grid the training starts from).
        tokenizer: a local tokenizer directory (None: the DataModule's ``tokenizer``, else ``model.pretrained``'s).
        gguf_file: the GGUF file in ``tokenizer`` that holds the tokenizer.
        chat_template: the prompts as RULER gives them to chat models, in the tokenizer's chat template (the
            task as the user's turn, the answer prefix opening the assistant's); False: base-model prompts.
        prefix: the logged names' first part.

    Refused in one line at set-up, before the weights load: an unknown task, a length not positive, beyond the
    model's ``max_position_embeddings`` or too short for a task's prompt, ``every_n_steps`` < 1, no
    tokenizer, a tokenizer larger than the model's vocabulary, ``chat_template`` with a tokenizer that has none.
    Memory: an evaluation holds the K/V pages of one prompt (no gradient pages: 2 x layers x KV heads x head_dim x
    dtype bytes per token) beside the training's page pool, which stays allocated.

    Several processes: under oomb_ddp every rank holds the whole model, so global rank 0 alone evaluates and
    logs while the others wait at a barrier (an evaluation longer than the process group's timeout ends the
    run: keep the grid small or raise the timeout). Under oomb_model_parallel no rank holds the whole model,
    so the callback is refused there: evaluate the exported model with ``lightning-oomb evaluate``.
    """

    def __init__(
        self,
        tasks: list[str] | str = "niah_single_1,niah_multikey_2,vt,fwe",
        lengths: list[int | str] | str = "4K",
        samples: int = 4,
        seed: int = 0,
        every_n_steps: int | None = None,
        at_validation: bool = False,
        at_start: bool = False,
        tokenizer: str | None = None,
        gguf_file: str | None = None,
        chat_template: bool = False,
        prefix: str = "eval",
    ):
        names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
        for name in names:
            if name not in TASKS:
                close = difflib.get_close_matches(name, TASKS, n=1)
                raise SetupError(f"{NAME}: unknown task {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                                 + f"; the tasks: {', '.join(TASKS)}")
        if not names:
            raise SetupError(f"{NAME}: tasks is empty; the tasks: {', '.join(TASKS)}")
        items = [t.strip() for t in lengths.split(",")] if isinstance(lengths, str) else list(lengths)
        try:
            counts = [parse_tokens(n) for n in items]
        except ValueError as e:
            raise SetupError(f"{NAME}: lengths: {e}") from None
        if not counts or any(isinstance(n, bool) or n < 1 for n in counts):
            raise SetupError(f"{NAME}: lengths must be positive token counts (e.g. [4096, 16K]), got {list(items)!r}")
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or every_n_steps < 1):
            raise SetupError(f"{NAME}: every_n_steps must be >= 1 (or null: not by steps), got {every_n_steps!r}")
        if samples < 1:
            raise SetupError(f"{NAME}: samples must be >= 1, got {samples!r}")
        if every_n_steps is None and not at_validation and not at_start:
            raise SetupError(f"{NAME}: nothing to run: set every_n_steps, at_validation or at_start")
        self.tasks = list(dict.fromkeys(names))
        self.lengths = sorted(set(counts))
        self.samples, self.seed = samples, seed
        self.every_n_steps, self.at_validation, self.at_start = every_n_steps, at_validation, at_start
        self.tokenizer_path, self.gguf_file, self.prefix = tokenizer, gguf_file, prefix
        self.chat_template = chat_template
        self.tokenizer: Any = None
        # {step: run_grid's results}: each task's score (0-100) and samples (prompt tokens, references, prediction)
        # by length, of every evaluation of this run
        self.results: dict[int, dict] = {}
        self._last_step: int | None = None
        self._step_before = -1
        self._image = True

    # -- set-up: every refusal before the weights load -------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if getattr(trainer.strategy, "chunk_config", None) is None:
            raise SetupError(f"{NAME} evaluates through OOMBStrategy's chunked forward: use it with OOMBStrategy "
                             "or oomb_ddp")
        if isinstance(trainer.strategy, OOMBModelParallelStrategy):
            raise SetupError(f"{NAME}: under oomb_model_parallel no process holds the whole model to evaluate; "
                             "evaluate the exported model with lightning-oomb evaluate")
        self.tokenizer = self._find_tokenizer(trainer, pl_module)
        config = find_causal_lm(pl_module).config  # the structure exists before the weights do
        try:
            check_tokenizer_matches(self.tokenizer, config.vocab_size, self.tokenizer_path or "the run's tokenizer")
        except CorpusError as e:
            raise SetupError(f"{NAME}: {e}") from None
        positions = getattr(config, "max_position_embeddings", None)
        too_long = [n for n in self.lengths if positions is not None and n > positions]
        if too_long:
            raise SetupError(f"{NAME}: lengths {', '.join(human_tokens(n) for n in too_long)} beyond the model's "
                             f"max_position_embeddings {positions:,}")
        if self.chat_template and not has_chat_template(self.tokenizer):
            raise SetupError(f"{NAME}: chat_template: the tokenizer has no chat template; set chat_template false "
                             "(base-model prompts) or give a tokenizer that has one")
        for task in self.tasks:  # the shortest length holds each task's prompt in this tokenizer, or is refused
            try:
                make_sample(task, self.lengths[0], self.tokenizer, 0, self.seed, self.chat_template)
            except ValueError as e:
                raise SetupError(f"{NAME}: lengths: {e}") from None
        if importlib.util.find_spec("matplotlib") is None:
            self._image = False
            rank_zero_warn(f"{NAME}: matplotlib is not installed, so the grid is logged as scalars only, without "
                           "its image (pip install matplotlib)")

    def _find_tokenizer(self, trainer: Trainer, pl_module: LightningModule) -> Any:
        try:
            if self.tokenizer_path is not None:
                return load_tokenizer(self.tokenizer_path, "tokenizer", self.gguf_file)
            found = getattr(trainer.datamodule, "tokenizer", None)  # set by the DataModule's setup, which runs first
            if found is not None:
                return found
            hparams = getattr(pl_module, "hparams", {})
            if hparams.get("pretrained"):
                return load_tokenizer(hparams["pretrained"], "model.pretrained", hparams.get("gguf_file"))
        except CorpusError as e:
            raise SetupError(f"{NAME}: {e}") from None
        raise SetupError(f"{NAME} needs a tokenizer: set its tokenizer to a local tokenizer directory (neither the "
                         "DataModule nor model.pretrained has one)")

    # -- when it runs ---------------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.at_start:
            self._evaluate(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self._step_before = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        # Only after a batch that ended with an optimizer step: under gradient accumulation the micro-batches before
        # it leave global_step (which counts optimizer steps) as it was, at 0 on the first ones, or at a resumed step.
        step = trainer.global_step
        if self.every_n_steps is not None and step != self._step_before and step % self.every_n_steps == 0:
            self._evaluate(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.at_validation and not trainer.sanity_checking:
            self._evaluate(trainer, pl_module)

    # -- the evaluation ----------------------------------------------------------------------------------------
    def _evaluate(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = trainer.global_step
        if step == self._last_step:  # every_n_steps and validation at one step, or micro-batches of one step
            return
        self._last_step = step
        if trainer.is_global_zero:
            self._run_and_log(trainer, pl_module, step)
        trainer.strategy.barrier(f"{NAME}.evaluate")

    def _run_and_log(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        modes = {m: m.training for m in pl_module.modules()}  # some modules may be kept in eval mode (frozen)
        pl_module.eval()
        labels = [human_tokens(n) for n in self.lengths]
        try:
            with torch.no_grad(), trainer.precision_plugin.forward_context():
                results = run_grid(find_causal_lm(pl_module), self.tokenizer, self.tasks, self.lengths,
                                   self.samples, self.seed, {"config": trainer.strategy.chunk_config},
                                   trainer.strategy.root_device,
                                   progress=lambda line: print(f"{NAME} at step {step}: {line}", file=sys.stderr,
                                                               flush=True), chat=self.chat_template)
        finally:
            for module, training in modes.items():
                module.train(training)
        self.results[step] = results
        scores = {t: {label: results[t][n]["score"] for n, label in zip(self.lengths, labels)} for t in self.tasks}
        print(format_table(scores, self.tasks, labels), file=sys.stderr, flush=True)
        metrics = {f"{self.prefix}/{t}/{label}": scores[t][label] / 100 for t in self.tasks for label in labels}
        metrics.update({f"{self.prefix}/mean/{label}": sum(scores[t][label] for t in self.tasks) / len(self.tasks) / 100
                        for label in labels})
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            if self._image and isinstance(logger, TensorBoardLogger):
                figure = grid_figure(scores, self.tasks, labels, f"step {step}")
                logger.experiment.add_figure(f"{self.prefix}/grid", figure, global_step=step)  # closes the figure
