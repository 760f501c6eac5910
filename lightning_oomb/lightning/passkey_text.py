"""PasskeyTextDataModule: passkey retrieval in English, in a pretrained model's own tokenizer.

The long-context test of a pretrained model (as in the context-extension literature): a number stated once
near the start of a long filler text, asked for at the end. Generated on the fly; nothing to download.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from ..core.units import human_tokens
from .corpus import CorpusError, load_tokenizer
from .data import IGNORE_INDEX

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about it at the end.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
STATEMENT = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}"
# The held-out sequences are drawn from their own seed, the same whatever data.init_args.seed says, so that
# runs with different seeds are compared on one set (training items use seeds below 2**31 * 1_000_003).
HELD_OUT_SEED = 2**31


class PasskeyTextDataset(Dataset):
    """Sequences of exactly ``seq_len`` tokens, laid out as::

        INTRO  filler ...  STATEMENT(key)  filler ... (to the end)  QUESTION  ANSWER(key)

    with ``key`` a number of ``key_digits`` digits, the statement starting at a uniform position within the
    first ``key_window`` tokens, and only the answer's ``answer_tokens`` tokens labelled (docs/guide.md,
    "Passkey tasks"). Item i is drawn from its own seed: the same data on every run and worker.
    """

    def __init__(self, tokenizer, size: int, seq_len: int, key_window: int, key_digits: int, seed: int):
        self.tokenizer, self.size, self.seq_len = tokenizer, size, seq_len
        self.key_window, self.key_digits, self.seed = key_window, key_digits, seed
        self.intro = tokenizer(INTRO).input_ids  # with the tokenizer's BOS, if it adds one
        sentence = self._encode(FILLER)
        self.filler = torch.tensor(sentence * (seq_len // max(1, len(sentence)) + 2))
        self.period = len(sentence)
        self.question = self._encode(QUESTION)
        lengths = {len(self._encode(ANSWER.format(key=self._key(g)))) for g in range(32)}
        if len(lengths) != 1:
            raise CorpusError(f"the tokenizer splits {key_digits}-digit numbers into {sorted(lengths)} tokens; "
                              "data.init_args.key_digits needs one count (try fewer digits)")
        self.answer_tokens = lengths.pop()
        statement = len(self._encode(STATEMENT.format(key="1" * key_digits)))
        fixed = len(self.intro) + statement + len(self.question) + self.answer_tokens
        if key_window < len(self.intro) + statement:
            raise CorpusError(f"data.init_args.key_window {key_window} cannot hold the intro and the statement "
                              f"({len(self.intro) + statement} tokens): raise it")
        if seq_len < max(fixed, key_window) + 16:
            raise CorpusError(f"data.init_args.seq_len {seq_len} leaves no room for filler after the first "
                              f"{max(fixed, key_window)} tokens: raise it or lower key_window")

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _key(self, g: torch.Generator | int) -> str:
        if isinstance(g, int):
            g = torch.Generator().manual_seed(g)
        digits = torch.randint(10, (self.key_digits,), generator=g).tolist()
        digits[0] = digits[0] % 9 + 1  # no leading zero
        return "".join(map(str, digits))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        key = self._key(g)
        statement = self._encode(STATEMENT.format(key=key))
        answer = self._encode(ANSWER.format(key=key))
        filler = self.seq_len - len(self.intro) - len(statement) - len(self.question) - len(answer)
        before = int(torch.randint(0, self.key_window - len(self.intro) - len(statement) + 1, (1,), generator=g))
        phase = int(torch.randint(self.period, (1,), generator=g))
        stream = self.filler[phase: phase + filler].tolist()
        ids = self.intro + stream[:before] + statement + stream[before:] + self.question + answer
        ids = torch.tensor(ids)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[-len(answer):] = ids[-len(answer):]
        return {"input_ids": ids, "labels": labels}


class PasskeyTextDataModule(LightningDataModule):
    """Passkey retrieval in English for a pretrained model (``PasskeyTextDataset`` has the layout).

    Args:
        seq_len: tokens per training sequence. batch_size: sequences per batch.
        val_lengths: the held-out lengths (None: ``seq_len`` alone); each is its own validation loader, and
            ``CausalLMModule`` then logs ``val/retrieval_acc_8K``, ``..._64K``.
        tokenizer: a local tokenizer directory (None: ``model.pretrained``'s, with its ``gguf_file``).
        gguf_file: the GGUF file in ``tokenizer`` that holds the tokenizer (None: ``model.gguf_file`` when the
            tokenizer is the model's).
        key_window: the statement starts within the first ``key_window`` tokens.
        key_digits: digits of the pass key; ``model.answer_tokens`` must equal the tokens its answer takes
            (checked at set-up, with the number to set).
        train_size, val_size: sequences per epoch and per held-out length.
        seed: draws the training sequences; the held-out ones are the same for every seed.
    """

    def __init__(
        self,
        seq_len: int = 65536,
        batch_size: int = 1,
        val_lengths: list[int] | None = None,
        tokenizer: str | None = None,
        gguf_file: str | None = None,
        key_window: int = 1024,
        key_digits: int = 5,
        train_size: int = 100_000,
        val_size: int = 50,
        seed: int = 0,
    ):
        super().__init__()
        # Not save_hyperparameters: Lightning's logger would refuse a run whose model has another `seed` or
        # `gguf_file` (the module's hyperparameters and the DataModule's are merged by name).
        self.options = dict(tokenizer=tokenizer, gguf_file=gguf_file, key_window=key_window, key_digits=key_digits,
                            train_size=train_size, val_size=val_size, seed=seed)
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("key_digits", key_digits),
                            ("train_size", train_size), ("val_size", val_size),
                            *(("val_lengths", n) for n in (val_lengths or []))):
            if value < 1:
                raise CorpusError(f"data.init_args.{name} must be >= 1, got {value}")
        self.seq_len, self.batch_size = seq_len, batch_size
        self.val_lengths = list(val_lengths or [seq_len])
        self.tokenizer = None
        self.train_set: PasskeyTextDataset | None = None
        self.val_sets: list[PasskeyTextDataset] = []

    @property
    def val_set(self) -> PasskeyTextDataset | None:
        """The longest held-out set (the CLI prints one of its examples)."""
        return max(self.val_sets, key=lambda s: s.seq_len) if self.val_sets else None

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        module = getattr(getattr(self, "trainer", None), "lightning_module", None)
        hparams = getattr(module, "hparams", {}) if module is not None else {}
        o = self.options
        path, gguf_file = o["tokenizer"], o["gguf_file"]
        if path is None:
            path = hparams.get("pretrained")
            gguf_file = gguf_file or hparams.get("gguf_file")
        if path is None:
            raise CorpusError("PasskeyTextDataModule needs a tokenizer: set data.init_args.tokenizer to a local "
                              "tokenizer directory, or train a model from model.pretrained")
        self.tokenizer = load_tokenizer(path, "data.init_args.tokenizer", gguf_file=gguf_file)
        common = dict(key_window=o["key_window"], key_digits=o["key_digits"])
        self.train_set = PasskeyTextDataset(self.tokenizer, o["train_size"], self.seq_len, seed=o["seed"], **common)
        self.val_sets = [PasskeyTextDataset(self.tokenizer, o["val_size"], n, seed=HELD_OUT_SEED, **common)
                         for n in self.val_lengths]
        answer = self.train_set.answer_tokens
        wanted = hparams.get("answer_tokens")
        if wanted is not None and wanted != answer:
            raise CorpusError(f"model.answer_tokens is {wanted} but this tokenizer writes a {o['key_digits']}-digit "
                              f"answer in {answer} tokens: set model.init_args.answer_tokens: {answer}")
        vocab = getattr(getattr(getattr(module, "model", None), "config", None), "vocab_size", None)
        if vocab is not None and len(self.tokenizer) > vocab:
            raise CorpusError(f"the tokenizer ({path}) has {len(self.tokenizer)} tokens but the model's vocabulary "
                              f"{vocab}: use the model's own tokenizer")
        rank_zero_info(f"passkey: training sequences of {human_tokens(self.seq_len)} tokens, held out "
                       f"{o['val_size']} per length at {', '.join(map(human_tokens, self.val_lengths))}; "
                       f"the answer is {answer} tokens")

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size)  # each item is drawn from its own seed

    @override
    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(s, batch_size=self.batch_size) for s in self.val_sets]
