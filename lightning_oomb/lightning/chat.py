"""ChatDataModule: conversations (JSON Lines or Parquet rows of ``messages``) rendered with the tokenizer's chat
template, trained on the assistant's turns, packed whole into sequences with document masking.

It keeps TextCorpusDataModule's loaders, data position and checks (the rank-aware resumable sampler, the
chunking and tokenizer checks); what it reads and how it packs are its own (``data/chat.py``).
"""

from __future__ import annotations

import os

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from ..data.chat import TRAIN_ON, ChatDataError, ChatRenderer, PackedConversations, best_fit, find_chat_files, read_conversations
from .corpus import TextCorpusDataModule, check_tokenizer_matches, epoch_generator, load_tokenizer


class ChatDataModule(TextCorpusDataModule):
    """Conversations for supervised fine-tuning, packed into sequences of ``seq_len`` tokens.

    Each batch holds ``input_ids``, ``labels`` and ``position_ids``, each (batch_size, seq_len) int64: labels
    are -100 except on the tokens ``train_on`` trains (the model shifts them), and the positions restart at 0
    at every conversation (and at the padding that ends a sequence), so that each conversation attends only
    within itself. Conversations are packed whole, best fit decreasing; the waste (padding) is logged at set-up
    with the count of labelled tokens.

    Args:
        paths: ``.jsonl`` (one conversation per line) and ``.parquet`` (one per row) files, or folders of them;
            each row's ``messages`` is a list of ``{"role", "content"}``.
        tokenizer: a local tokenizer directory with a chat template; None takes the model's ``pretrained``
            (the tokenizer inside its ``gguf_file`` when the model is loaded from one).
        seq_len: tokens per training sequence.
        batch_size: sequences per batch.
        train_on: ``assistant`` (every assistant turn: its content and the end-of-turn token after it, not
            its role header), ``last_assistant`` (the last turn only) or ``all`` (every token).
        chat_template: a Jinja chat template to use instead of the tokenizer's.
        truncate: cut conversations longer than ``seq_len`` to ``seq_len`` tokens; False refuses them.
        val_fraction: the share of conversations held out for validation (at least one when > 0).
        seed: the split and the shuffling of each epoch.
    """

    def __init__(
        self,
        paths: list[str] | str,
        tokenizer: str | None = None,
        seq_len: int = 4096,
        batch_size: int = 1,
        train_on: str = "assistant",
        chat_template: str | None = None,
        truncate: bool = False,
        val_fraction: float = 0.0,
        seed: int = 0,
    ):
        LightningDataModule.__init__(self)
        self.save_hyperparameters()
        self.paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ChatDataError(f"data.init_args.{name} must be an integer >= 1, got {value!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise ChatDataError(f"data.init_args.val_fraction must be in [0, 1), got {val_fraction}")
        self.files = find_chat_files(self.paths)
        self.tokenizer_path = tokenizer
        self.seq_len, self.batch_size, self.train_on = seq_len, batch_size, train_on
        self.chat_template, self.truncate = chat_template, truncate
        self.val_fraction, self.seed = val_fraction, seed
        self.document_masking = True
        self.tokenizer = load_tokenizer(tokenizer) if tokenizer is not None else None
        if train_on not in TRAIN_ON:
            raise ChatDataError(f"data.init_args.train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
        if self.tokenizer is not None:
            ChatRenderer(self.tokenizer, train_on, chat_template)  # a tokenizer without a template fails now
        self.train_set = self.val_set = None
        self.num_tokens = self.num_documents = self.num_labels = 0
        self.document_length: int | None = None
        self.waste = 0.0
        self._epoch, self._consumed = 0, 0
        self._resume_from = None
        self._sampler = None

    @override
    def prepare_data(self) -> None:
        """Nothing: conversations are rendered and tokenized in memory by ``setup`` (no token cache)."""

    @override
    def setup(self, stage: str | None = None) -> None:
        trainer = self._trainer_or_none()
        if trainer is not None:
            self._check_chunking(trainer)
            self._check_sampler(trainer)
        if self.train_set is not None:
            return
        pretrained, vocab_size = self._model_pretrained(trainer)
        source = self.tokenizer_path or pretrained
        if self.tokenizer is None:
            if source is None:
                raise ChatDataError("ChatDataModule needs a tokenizer: set data.init_args.tokenizer to a local "
                                    "tokenizer directory with a chat template (or train a model from model.pretrained)")
            # A GGUF model directory may hold no tokenizer files: the tokenizer, chat template included, is in the file.
            gguf_file = None if self.tokenizer_path else self._model_gguf_file(trainer)
            self.tokenizer = load_tokenizer(source, "model.pretrained", gguf_file=gguf_file)
        if vocab_size is not None:
            check_tokenizer_matches(self.tokenizer, vocab_size, source)
        renderer = ChatRenderer(self.tokenizer, self.train_on, self.chat_template)
        conversations, too_long, first_long = [], 0, None
        for file in self.files:
            for where, messages in read_conversations(file):
                conv = renderer.render(messages, where)
                if len(conv.ids) > self.seq_len:
                    if not self.truncate:
                        too_long += 1
                        first_long = first_long or f"{where}: {len(conv.ids):,} tokens"
                        continue
                    conv.ids, conv.trained = conv.ids[: self.seq_len], conv.trained[: self.seq_len]
                conversations.append(conv)
        listing = ", ".join(map(str, self.paths))
        if too_long:
            raise ChatDataError(f"{too_long} conversations are longer than data.init_args.seq_len {self.seq_len} "
                                f"(the first: {first_long}); raise seq_len, remove them, or set truncate: true")
        if not conversations:
            raise ChatDataError(f"the files ({listing}) hold no conversations; check data.init_args.paths")
        if vocab_size is not None:
            top = max(max(c.ids) for c in conversations)
            if top >= vocab_size:
                raise ChatDataError(f"the tokenizer ({source}) produces token id {top} but the model's vocabulary has "
                                    f"{vocab_size} entries; use the model's own tokenizer")
        self.num_documents = len(conversations)
        self.num_tokens = sum(len(c.ids) for c in conversations)
        self.num_labels = sum(sum(c.trained) for c in conversations)
        n_val = max(1, round(len(conversations) * self.val_fraction)) if self.val_fraction > 0 else 0
        if len(conversations) <= n_val:
            raise ChatDataError(f"{len(conversations)} conversations leave none for training after {n_val} held out "
                                "for validation; add conversations or lower data.init_args.val_fraction")
        order = torch.randperm(len(conversations), generator=epoch_generator(self.seed, -1)).tolist()
        val = [conversations[i] for i in sorted(order[:n_val])]
        train = [conversations[i] for i in sorted(order[n_val:])]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.train_set = self._pack(train, pad)
        self.val_set = self._pack(val, pad) if val else None
        packed = len(self.train_set) + (len(self.val_set) if self.val_set is not None else 0)
        self.waste = 1.0 - self.num_tokens / (packed * self.seq_len)
        lengths = torch.tensor([len(c.ids) for c in conversations], dtype=torch.float64)
        self.document_length = max(1, round(float((lengths * lengths).sum() / lengths.sum())))
        rank_zero_info(self.describe())

    @staticmethod
    def _model_gguf_file(trainer) -> str | None:
        module = getattr(trainer, "lightning_module", None) if trainer is not None else None
        return getattr(getattr(module, "hparams", {}), "get", lambda *_: None)("gguf_file")

    def _pack(self, conversations, pad: int) -> PackedConversations:
        bins = best_fit([len(c.ids) for c in conversations], self.seq_len)
        return PackedConversations(conversations, bins, self.seq_len, pad)

    @override
    def describe(self) -> str:
        if self.train_set is None:
            return "conversations not read yet"
        val = len(self.val_set) if self.val_set is not None else 0
        return (
            f"chat: {len(self.files)} files, {self.num_documents:,} conversations, {self.num_tokens:,} tokens, "
            f"{self.num_labels:,} labelled (train_on {self.train_on}) -> {len(self.train_set):,} training and "
            f"{val:,} validation sequences of {self.seq_len:,} tokens, {self.waste:.1%} padding (each "
            "conversation attends within itself)"
        )
