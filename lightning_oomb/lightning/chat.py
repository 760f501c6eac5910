"""ChatDataModule: conversations (JSON Lines or Parquet rows of ``messages``) rendered with the tokenizer's chat
template, trained on the assistant's turns, packed whole into sequences with document masking.

It keeps TextCorpusDataModule's loaders, data position, checks (the rank-aware resumable sampler, the
chunking and tokenizer checks) and token cache (its options, ``prepare_data`` on local rank 0); what it reads
and how it packs are its own (``data/chat.py``).
"""

from __future__ import annotations

import functools
import itertools
import os

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from tqdm import tqdm
from typing_extensions import override

from ..data.chat import (LOSS_REDUCTIONS, TRAIN_ON, ChatDataError, ChatRenderer, Conversations, PackedConversations,
                         best_fit, cache_options, encode_conversations, find_chat_files, read_conversations)
from ..data.token_cache import TokenCache
from .corpus import SCAN_TOKENS, TextCorpusDataModule, check_tokenizer_matches, epoch_generator, load_tokenizer


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
        loss_reduction: ``token`` (the training loss is the mean over the batch's labelled tokens, as
            transformers computes it) or ``sequence`` (the mean over the batch's conversations of each one's
            mean token loss: training batches then also hold ``loss_weights``, which OOMBStrategy's engine
            takes exactly under chunking). ``val/loss`` is the token mean either way.
        val_fraction: the share of conversations held out for validation (at least one when > 0).
        seed: the split and the shuffling of each epoch.
        token_cache, cache_dir, tokenize_workers: as TextCorpusDataModule's: the rendered conversations (token
            ids, which are labels, lengths) kept in the token cache on disk, keyed by the files, the tokenizer,
            the template and ``train_on``; a later start packs them from it without rendering or tokenizing.
            ``seq_len`` and ``truncate`` are applied when the cache is read (one cache serves them all).
    """

    error = ChatDataError

    def __init__(
        self,
        paths: list[str] | str,
        tokenizer: str | None = None,
        seq_len: int = 4096,
        batch_size: int = 1,
        train_on: str = "assistant",
        chat_template: str | None = None,
        truncate: bool = False,
        loss_reduction: str = "token",
        val_fraction: float = 0.0,
        seed: int = 0,
        token_cache: bool | None = None,
        cache_dir: str | None = None,
        tokenize_workers: int | None = None,
    ):
        LightningDataModule.__init__(self)
        self.save_hyperparameters()
        self.paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        self._check_sizes(seq_len, batch_size, val_fraction)
        self.files = find_chat_files(self.paths)
        self.tokenizer_path = tokenizer
        self.seq_len, self.batch_size, self.train_on = seq_len, batch_size, train_on
        self.chat_template, self.truncate = chat_template, truncate
        self.val_fraction, self.seed = val_fraction, seed
        self.document_masking = True
        self._token_cache_options(token_cache, cache_dir, tokenize_workers)
        self.tokenizer = load_tokenizer(tokenizer) if tokenizer is not None else None
        if train_on not in TRAIN_ON:
            raise ChatDataError(f"data.init_args.train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ChatDataError(f"data.init_args.loss_reduction must be one of {', '.join(LOSS_REDUCTIONS)}, got "
                                f"{loss_reduction!r}")
        self.loss_reduction = loss_reduction
        if self.tokenizer is not None:
            ChatRenderer(self.tokenizer, train_on, chat_template)  # a tokenizer without a template fails now
        self.train_set = self.val_set = None
        self.num_tokens = self.num_documents = self.num_labels = 0
        self.document_length: int | None = None
        self.waste = 0.0
        self._epoch, self._consumed = 0, 0
        self._resume_from = None
        self._sampler = None

    def _resolve_tokenizer(self, trainer) -> tuple[str | None, int | None]:
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
        return source, vocab_size

    def _open_cache(self) -> TokenCache:
        """The token cache of these conversations (rendering them first where no start has)."""
        renderer = ChatRenderer(self.tokenizer, self.train_on, self.chat_template)
        encode = functools.partial(encode_conversations, renderer=renderer)
        return self._open_token_cache(cache_options(renderer), encode)

    def _render(self) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Without the token cache: every conversation rendered in this process, as one int32 token stream, its
        uint8 label mask and the conversations' lengths."""
        renderer = ChatRenderer(self.tokenizer, self.train_on, self.chat_template)
        ids, mask, lengths = [np.zeros(0, np.int32)], [np.zeros(0, np.uint8)], [np.zeros(0, np.int64)]
        # Shown only where rendering outlasts a few seconds (long, many-turn conversations), on rank zero.
        with tqdm(desc="rendering conversations", unit=" tokens", unit_scale=True, delay=3,
                  disable=rank_zero_only.rank != 0) as bar:
            for file in self.files:
                pieces, _, trained, counts = encode_conversations(str(file), renderer, rendered=bar.update)
                ids += pieces
                mask += trained
                lengths.append(counts)
        return torch.from_numpy(np.concatenate(ids)), torch.from_numpy(np.concatenate(mask)), np.concatenate(lengths)

    @override
    def setup(self, stage: str | None = None) -> None:
        trainer = self._checked_trainer()
        if self.train_set is not None:
            return
        source, vocab_size = self._resolve_tokenizer(trainer)
        if self.token_cache:
            cache, self._cache = self._cache or self._open_cache(), None
            tokens, mask, lengths, max_id = cache.stream, cache.mask, cache.lengths, cache.max_id
            self.cache_folder = cache.folder
            labels = cache.memo("labels", lambda: count_labels(mask, 0, len(mask)))
        else:
            tokens, mask, lengths = self._render()
            max_id = int(tokens.max()) if len(tokens) else -1
            labels = int(mask.sum())
        starts = np.cumsum(lengths) - lengths
        long = np.flatnonzero(lengths > self.seq_len)
        listing = ", ".join(map(str, self.paths))
        if len(long) and not self.truncate:
            first = int(long[0])
            where = next(itertools.islice((w for f in self.files for w, _ in read_conversations(f)), first, None))
            raise ChatDataError(f"{len(long)} conversations are longer than data.init_args.seq_len {self.seq_len} "
                                f"(the first: {where}: {int(lengths[first]):,} tokens); raise seq_len, remove them, "
                                "or set truncate: true")
        if not len(lengths):
            raise ChatDataError(f"the files ({listing}) hold no conversations; check data.init_args.paths")
        if vocab_size is not None and max_id >= vocab_size:
            raise ChatDataError(f"the tokenizer ({source}) produces token id {max_id} but the model's vocabulary has "
                                f"{vocab_size} entries; use the model's own tokenizer")
        kept = np.minimum(lengths, self.seq_len)  # truncate: the first seq_len tokens of a longer conversation
        labels -= sum(count_labels(mask, int(starts[k] + self.seq_len), int(starts[k] + lengths[k])) for k in long)
        self.num_documents = len(lengths)
        self.num_tokens = int(kept.sum())
        self.num_labels = int(labels)
        n_val = max(1, round(len(lengths) * self.val_fraction)) if self.val_fraction > 0 else 0
        if len(lengths) <= n_val:
            raise ChatDataError(f"{len(lengths)} conversations leave none for training after {n_val} held out "
                                "for validation; add conversations or lower data.init_args.val_fraction")
        order = torch.randperm(len(lengths), generator=epoch_generator(self.seed, -1))
        val, train = order[:n_val].sort().values.numpy(), order[n_val:].sort().values.numpy()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.train_set = self._pack(Conversations(tokens, mask, starts[train], kept[train]), pad,
                                    loss_weights=self.loss_reduction == "sequence")
        self.val_set = self._pack(Conversations(tokens, mask, starts[val], kept[val]), pad) if n_val else None
        packed = len(self.train_set) + (len(self.val_set) if self.val_set is not None else 0)
        self.waste = 1.0 - self.num_tokens / (packed * self.seq_len)
        weights = kept.astype(np.float64)
        self.document_length = max(1, round(float((weights * weights).sum() / weights.sum())))
        rank_zero_info(self.describe())

    @staticmethod
    def _model_gguf_file(trainer) -> str | None:
        module = getattr(trainer, "lightning_module", None) if trainer is not None else None
        return getattr(getattr(module, "hparams", {}), "get", lambda *_: None)("gguf_file")

    def _pack(self, conversations: Conversations, pad: int, loss_weights: bool = False) -> PackedConversations:
        bins = best_fit(conversations.lengths.tolist(), self.seq_len)
        return PackedConversations(conversations, bins, self.seq_len, pad, loss_weights)

    @override
    def describe(self) -> str:
        if self.train_set is None:
            return "conversations not read yet"
        val = len(self.val_set) if self.val_set is not None else 0
        return (
            f"chat: {len(self.files)} files, {self.num_documents:,} conversations, {self.num_tokens:,} tokens, "
            f"{self.num_labels:,} labelled (train_on {self.train_on}) -> {len(self.train_set):,} training and "
            f"{val:,} validation sequences of {self.seq_len:,} tokens, {self.waste:.1%} padding (each "
            "conversation attends within itself"
            + ("; the training loss averages conversations)" if self.loss_reduction == "sequence" else ")")
        )


def count_labels(mask, start: int, stop: int) -> int:
    """The labelled tokens of ``mask[start:stop]``, read in blocks of ``SCAN_TOKENS``."""
    return sum(int(mask[a : min(a + SCAN_TOKENS, stop)].sum()) for a in range(start, stop, SCAN_TOKENS))
