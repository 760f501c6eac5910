"""DataModules: the synthetic passkey task, generated on the fly."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

IGNORE_INDEX = -100
KEY_MARKER, QUERY_MARKER, FIRST_KEY = 1, 2, 3


class PasskeyDataset(Dataset):
    """A passkey stated near the start of a long filler text and asked for as the very last token (docs/guide.md,
    "Passkey tasks"). Ids: 1 marks the key, 2 the question, ``3 .. 3 + num_keys - 1`` are the passkeys, those
    above filler::

        position  0 .. at-1      at .. at+2r-1              ...             seq_len-2  seq_len-1
                  filler         KEY X KEY X ... (r times)  filler          QUERY      X

    Only X, the last token, is labelled. Item i is drawn from its own seed: the same data on every run.
    """

    def __init__(
        self,
        size: int,
        seq_len: int,
        vocab_size: int,
        num_keys: int,
        key_window: int,
        filler_len: int,
        seed: int,
        key_repeats: int = 2,
    ):
        if key_repeats < 1 or filler_len < 1 or num_keys < 1:
            raise ValueError("key_repeats, filler_len and num_keys must be >= 1")
        if key_window < 2 * key_repeats:
            raise ValueError(f"key_window {key_window} cannot hold {key_repeats} statements of 2 tokens")
        if seq_len < key_window + 4:
            raise ValueError(f"seq_len {seq_len} must exceed key_window + 4 = {key_window + 4}")
        if vocab_size <= FIRST_KEY + num_keys:
            raise ValueError(f"vocab_size {vocab_size} leaves no filler tokens beside {num_keys} passkeys")
        self.size, self.seq_len, self.vocab_size = size, seq_len, vocab_size
        self.num_keys, self.key_window, self.key_repeats, self.seed = num_keys, key_window, key_repeats, seed
        g = torch.Generator().manual_seed(0)  # the same sentence for training and held-out data
        self.sentence = torch.randint(FIRST_KEY + num_keys, vocab_size, (filler_len,), generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        phase = int(torch.randint(len(self.sentence), (1,), generator=g))
        ids = self.sentence.roll(-phase).repeat(self.seq_len // len(self.sentence) + 1)[: self.seq_len].clone()
        key = FIRST_KEY + int(torch.randint(self.num_keys, (1,), generator=g))
        span = 2 * self.key_repeats
        at = int(torch.randint(0, self.key_window - span + 1, (1,), generator=g))
        ids[at : at + span : 2] = KEY_MARKER
        ids[at + 1 : at + span : 2] = key
        ids[-2], ids[-1] = QUERY_MARKER, key
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[-1] = key
        return {"input_ids": ids, "labels": labels}


class PasskeyDataModule(LightningDataModule):
    """The passkey retrieval task (``PasskeyDataset``): can the model recall a token it saw ``seq_len`` tokens earlier?

    Args:
        seq_len: tokens per sequence. batch_size: sequences per batch.
        vocab_size: the model's vocabulary. num_keys: how many distinct passkeys (chance is 1 / num_keys).
        key_window: the statement lies within the first ``key_window`` tokens (keep it <= the chunk size).
        filler_len: tokens of the repeated filler sentence (1: one filler token repeated).
        key_repeats: how many times ``KEY X`` is stated.
        train_size, val_size: sequences per epoch; validation sequences are held out (another seed).
    """

    answer_tokens = 1

    def __init__(
        self,
        seq_len: int = 4096,
        batch_size: int = 1,
        vocab_size: int = 256,
        num_keys: int = 10,
        key_window: int = 512,
        filler_len: int = 1,
        train_size: int = 4096,
        val_size: int = 100,
        seed: int = 0,
        key_repeats: int = 2,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.seq_len, self.batch_size = seq_len, batch_size
        common = dict(
            seq_len=seq_len, vocab_size=vocab_size, num_keys=num_keys, key_window=key_window,
            filler_len=filler_len, key_repeats=key_repeats,
        )
        self.train_set = PasskeyDataset(train_size, seed=seed, **common)
        self.val_set = PasskeyDataset(val_size, seed=seed + 1, **common)

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)
