"""TextCorpusDataModule: local text, JSONL and Parquet files, tokenized, joined with EOS and packed.

Every problem with the input is reported before the first training step, as a ``CorpusError`` that names
the file (with line number or byte offset) or the option to change. Where Hugging Face datasets is installed
the tokens are kept in a token cache on disk (``lightning_oomb.data.token_cache``), tokenized by worker
processes once and read memory-mapped at every later start.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, Sampler
from typing_extensions import override

from ..core.errors import SetupError
from ..data.token_cache import (Encoder, TokenCache, TokenCacheError, TokenStream, files_bytes, open_token_cache,
                                token_cache_available)

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Large plain-text files are tokenized in pieces of about this many characters, cut after a newline.
TEXT_PIECE_CHARS = 1 << 20
# Documents per call of the tokenizer, and characters at most (beyond the first document): a call holds
# every token's id and offsets, tens of bytes each, until it returns.
TOKENIZE_BATCH = 256
TOKENIZE_CHARS = 1 << 22
# A corpus smaller than this is tokenized in the process itself: starting workers would take longer.
PARALLEL_MIN_BYTES = 32 << 20
# Tokens per block when the cached stream is scanned (for EOS): bounds the memory of the scan.
SCAN_TOKENS = 1 << 24


class CorpusError(SetupError):
    """Bad training input: the message names the file or the option and what to do."""


# == reading ===============================================================================================


def find_files(paths: list[str]) -> list[Path]:
    """The corpus files: each path is a file or a folder searched recursively, in sorted order."""
    if not paths:
        raise CorpusError("data.init_args.paths is empty: give one or more .txt/.md, .jsonl or .parquet files or folders")
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise CorpusError(f"data.init_args.paths: {raw} does not exist; check the path (relative paths are "
                              f"taken from the current directory, {os.getcwd()})")
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES)
            if not found:
                raise CorpusError(f"data.init_args.paths: the folder {raw} holds no {', '.join(SUFFIXES)} files")
            files += found
        elif path.suffix.lower() in SUFFIXES:
            files.append(path)
        else:
            raise CorpusError(f"data.init_args.paths: {raw} is not a supported file type; use {', '.join(SUFFIXES)}")
    for f in files:
        if not os.access(f, os.R_OK):
            raise CorpusError(f"{f}: the file cannot be read (permission denied); fix its permissions")
    return files


def _decode(data: bytes, file: Path, base_offset: int = 0, line: int | None = None) -> str:
    try:
        text = data.decode("utf-8")
        return text.removeprefix("\ufeff") if base_offset == 0 else text  # a UTF-8 byte-order mark is no text
    except UnicodeDecodeError as e:
        where = f", line {line}" if line is not None else ""
        raise CorpusError(
            f"{file}: not valid UTF-8 at byte offset {base_offset + e.start}{where} ({e.reason}); "
            "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) or remove it from data.init_args.paths"
        ) from None


def _read_bytes(file: Path) -> bytes:
    try:
        return file.read_bytes()
    except OSError as e:
        raise CorpusError(f"{file}: cannot be read ({e.strerror or e})") from None


def read_text_file(file: Path) -> Iterator[str]:
    """A plain-text file is one document, yielded in pieces of about TEXT_PIECE_CHARS cut after newlines."""
    text = _decode(_read_bytes(file), file)
    start = 0
    while start < len(text):
        end = start + TEXT_PIECE_CHARS
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        yield text[start:end]
        start = end


def read_jsonl_file(file: Path, text_field: str) -> Iterator[str]:
    """One document per line: the ``text_field`` string of each JSON object; blank lines are skipped."""
    offset = 0
    with _open(file) as f:
        for number, raw in enumerate(f, start=1):
            line_offset, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            line = _decode(raw, file, line_offset, number)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(
                    f"{file}, line {number}: not valid JSON ({e.msg} at column {e.colno}); every line of a .jsonl "
                    "file must be one JSON object"
                ) from None
            if not isinstance(record, dict) or text_field not in record:
                keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                raise CorpusError(
                    f"{file}, line {number}: no {text_field!r} field (found: {keys}); set data.init_args.text_field "
                    "to the field that holds the text"
                )
            value = record[text_field]
            if not isinstance(value, str):
                raise CorpusError(
                    f"{file}, line {number}: the {text_field!r} field is a {type(value).__name__}, not a string"
                )
            yield value


def _open(file: Path):
    try:
        return open(file, "rb")
    except OSError as e:
        raise CorpusError(f"{file}: cannot be read ({e.strerror or e})") from None


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CorpusError(
            "reading .parquet files needs pyarrow: pip install 'lightning_oomb[data]' (or pip install pyarrow)"
        ) from None
    return pq


def read_parquet_file(file: Path, text_field: str) -> Iterator[str]:
    """One document per row: the ``text_field`` column, read a row group at a time."""
    pq = _pyarrow_parquet()
    try:
        pf = pq.ParquetFile(file)
    except Exception as e:  # pyarrow raises its own error types for a damaged file
        raise CorpusError(f"{file}: not a readable Parquet file ({e})") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise CorpusError(
            f"{file}: no {text_field!r} column (found: {', '.join(names)}); set data.init_args.text_field to the "
            "column that holds the text"
        )
    kind = pf.schema_arrow.field(text_field).type
    import pyarrow as pa

    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise CorpusError(f"{file}: the {text_field!r} column holds {kind}, not strings")
    for group in range(pf.num_row_groups):
        for value in pf.read_row_group(group, columns=[text_field]).column(0).to_pylist():
            if value is not None:
                yield value


def read_documents(file: Path, text_field: str) -> Iterator[tuple[str, bool, bool]]:
    """(text, starts a document, ends a document) pieces of one file; empty documents are skipped."""
    suffix = file.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        pieces = [p for p in read_text_file(file) if p]
        for i, piece in enumerate(pieces):
            yield piece, i == 0, i == len(pieces) - 1
        return
    docs = read_jsonl_file(file, text_field) if suffix in JSONL_SUFFIXES else read_parquet_file(file, text_field)
    for doc in docs:
        if doc:
            yield doc, True, True


# == tokenizing and packing ================================================================================


def load_tokenizer(path: str, option: str = "data.init_args.tokenizer", gguf_file: str | None = None):
    """A local tokenizer directory (no network), or the tokenizer inside the GGUF file ``gguf_file`` there,
    with an EOS token."""
    from transformers import AutoTokenizer

    where = Path(path).expanduser()
    if not where.is_dir():
        raise CorpusError(f"{option}: the tokenizer directory {path} does not exist")
    if gguf_file is not None:
        if not (where / gguf_file).is_file():
            raise CorpusError(f"{option}: {path} has no GGUF file {gguf_file}")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(where), gguf_file=gguf_file, local_files_only=True)
        except Exception as e:
            raise CorpusError(f"{option}: the tokenizer in {path}/{gguf_file} could not be loaded "
                              f"({type(e).__name__}: {e})") from None
        return _with_eos(tokenizer, f"{path}/{gguf_file}")
    if not any((where / name).exists() for name in TOKENIZER_FILES):
        raise CorpusError(
            f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)} missing); set {option} to a directory that has "
            "one, or save the model's tokenizer there (tokenizer.save_pretrained)"
        )
    try:
        if _generic_fast_tokenizer(where):
            # AutoTokenizer would swap a generic tokenizer.json for the class of the model family named in a
            # config.json beside it (e.g. Qwen2Tokenizer), which tokenizes differently: load what the file says.
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(where), local_files_only=True)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
    except Exception as e:
        raise CorpusError(f"{option}: the tokenizer in {path} could not be loaded ({type(e).__name__}: {e})") from None
    return _with_eos(tokenizer, path)


# Embedding rows past a tokenizer's last id that still count as padding: models round their vocabulary up for
# fast matmuls (Qwen2.5 by 271-399 rows, DeepSeek-V3 by 465, Phi-3 by 53), by well under 1% of it.
PADDING_ROWS = 128


def check_tokenizer_matches(tokenizer, vocab_size: int, source: str | None) -> None:
    """Refuse, in one line, a tokenizer that is not the model's: more tokens than the embeddings have rows, or
    fewer by more than padding (``PADDING_ROWS`` or 1% of the rows, whichever is larger)."""
    tokens = len(tokenizer)
    if tokens <= vocab_size and vocab_size - tokens <= max(PADDING_ROWS, vocab_size // 100):
        return
    raise CorpusError(
        f"the tokenizer ({source}) has {tokens:,} tokens but the model's embeddings have {vocab_size:,} rows: it is "
        "not this model's tokenizer; set data.init_args.tokenizer to the model's own tokenizer directory (null takes "
        "model.pretrained's)"
    )


def _with_eos(tokenizer, where: str):
    if tokenizer.eos_token_id is None:
        raise CorpusError(
            f"the tokenizer in {where} has no EOS token, which joins the documents; set eos_token in its "
            "tokenizer_config.json"
        )
    return tokenizer


def _generic_fast_tokenizer(folder: Path) -> bool:
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    generic = config.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast")
    return generic and (folder / "tokenizer.json").is_file()


def _check_bos(tokenizer, add_bos: bool) -> None:
    if add_bos and tokenizer.bos_token_id is None:
        raise CorpusError("data.init_args.add_bos is true but the tokenizer has no BOS token; set add_bos: false")


def _encode_pieces(pieces: list[tuple[str, bool, bool]], tokenizer, add_bos: bool) -> np.ndarray:
    """(text, starts a document, ends a document) pieces as one int32 stream: BOS before a document's first
    piece (with ``add_bos``), EOS after its last."""
    eos, bos = np.array([tokenizer.eos_token_id], np.int32), np.array([tokenizer.bos_token_id or 0], np.int32)
    texts = [text for text, _, _ in pieces]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The Rust tokenizer a fast tokenizer calls, without the Python lists of masks and offsets that the
        # call through transformers builds (3-4 times the time): the same ids. Truncation or padding saved in
        # a tokenizer.json is off, as that call (truncation=False) turns it off.
        if backend.truncation is not None or backend.padding is not None:
            backend.no_truncation()
            backend.no_padding()
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        ids = [e.ids for e in encode(texts, add_special_tokens=False)]
    else:
        ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    stream: list[np.ndarray] = []
    for (_, starts, ends), piece in zip(pieces, ids):
        if starts and add_bos:
            stream.append(bos)
        stream.append(np.asarray(piece, dtype=np.int32))
        if ends:
            stream.append(eos)
    return np.concatenate(stream) if stream else np.zeros(0, np.int32)


def _batches(files: list[Path], text_field: str) -> Iterator[list[tuple[str, bool, bool]]]:
    pending: list[tuple[str, bool, bool]] = []
    chars = 0
    for file in files:
        for piece in read_documents(file, text_field):
            if pending and chars + len(piece[0]) > TOKENIZE_CHARS:
                yield pending
                pending, chars = [], 0
            pending.append(piece)
            chars += len(piece[0])
            if len(pending) >= TOKENIZE_BATCH:
                yield pending
                pending, chars = [], 0
    if pending:
        yield pending


def encode_file(path: str, tokenizer, text_field: str = "text", add_bos: bool = False) -> tuple[list[np.ndarray], int]:
    """One file's token stream (int32 arrays, in order; each document followed by EOS) and its document count:
    what a worker of the token cache runs, the same tokens ``tokenize_corpus`` gives that file."""
    parts, documents = [], 0
    for pieces in _batches([Path(path)], text_field):
        parts.append(_encode_pieces(pieces, tokenizer, add_bos))
        documents += sum(ends for _, _, ends in pieces)
    return parts, documents


def tokenize_corpus(files: list[Path], tokenizer, text_field: str = "text", add_bos: bool = False) -> tuple[torch.Tensor, int]:
    """All documents as one int32 token stream, each document followed by EOS; and the document count (in this
    process, held in memory: the data module's ``token_cache: false``)."""
    _check_bos(tokenizer, add_bos)
    parts: list[torch.Tensor] = []
    documents = 0
    for pieces in _batches(files, text_field):
        parts.append(torch.from_numpy(_encode_pieces(pieces, tokenizer, add_bos)))
        documents += sum(ends for _, _, ends in pieces)
    stream = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)
    return stream, documents


class PackedSequences(Dataset):
    """Sequences ``rows`` of ``seq_len`` tokens cut from one token stream (an int32 tensor, or the memory-mapped
    ``TokenStream`` of the token cache, read per sequence); labels are the inputs (the model shifts them).
    With ``eos`` (document masking), also ``position_ids`` that restart at 0 after every EOS token (and at
    the sequence start): each document then attends only within itself (docs/architecture.md, "Packed
    documents")."""

    def __init__(self, tokens: torch.Tensor | TokenStream, seq_len: int, rows: torch.Tensor, eos: int | None = None):
        self.tokens, self.seq_len, self.rows, self.eos = tokens, seq_len, rows, eos

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = int(self.rows[i]) * self.seq_len
        ids = self.tokens[start : start + self.seq_len].long()
        item = {"input_ids": ids, "labels": ids.clone()}
        if self.eos is not None:
            token = torch.arange(len(ids))
            starts = torch.zeros(len(ids), dtype=torch.bool)
            starts[0] = True
            starts[1:] = ids[:-1] == self.eos
            item["position_ids"] = token - torch.where(starts, token, 0).cummax(0).values
        return item


def planning_document_length(tokens: torch.Tensor | TokenStream, seq_len: int, eos: int, length: int | None = None) -> int:
    """The document length whose uniform packing costs the attention of ``tokens`` (its first ``length``
    tokens, default all: a stream cut into sequences of ``seq_len``, documents ending in ``eos``): a piece of
    L tokens (a document, or its part in one sequence) has about L^2 / 2 query-key pairs, so the
    length-weighted mean sum(L^2) / sum(L)."""
    n = len(tokens) if length is None else length
    # Piece starts: each sequence's first token and each token after an EOS (memory of the documents' count,
    # not of the stream's length: the stream is read in blocks).
    after_eos = [(tokens[a : min(a + SCAN_TOKENS, n - 1)] == eos).nonzero().flatten() + a + 1
                 for a in range(0, max(n - 1, 0), SCAN_TOKENS)]
    starts = torch.unique(torch.cat([torch.arange(0, n, seq_len), *after_eos]))
    lengths = torch.diff(starts, append=torch.tensor([n])).double()
    return max(1, round(float((lengths * lengths).sum() / lengths.sum())))


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch * 7919) % (2**63))


def data_parallel_rank(trainer: Any) -> tuple[int, int]:
    """(rank, size) of the data-parallel group ``trainer``'s process draws its batches as: the ranks of a tensor-
    parallel group run the same batch (the strategy's ``distributed_sampler_kwargs``, as Lightning's own
    DistributedSampler gets them); the global rank and world without such a strategy (or without a trainer)."""
    kwargs = getattr(getattr(trainer, "strategy", None), "distributed_sampler_kwargs", None)
    if kwargs:
        return kwargs["rank"], kwargs["num_replicas"]
    return getattr(trainer, "global_rank", 0), getattr(trainer, "world_size", 1)


class ResumableBatchSampler(Sampler[list[int]]):
    """Batches of a permutation drawn from ``seed`` and the epoch; ``resume(epoch, batches)`` skips the batches
    a checkpoint had consumed. ``len`` is always the whole epoch, as Lightning's progress counters expect.

    It counts its epochs itself, ``epoch`` being the one drawn last: Lightning sets the epoch of a loader's
    sampler, not of its batch sampler, and would count twice an epoch whose last batch a checkpoint saw. Data
    parallel: every rank draws the same permutation and takes its ``batch_size`` of each global batch; an epoch is
    whole global batches only, so that no rank waits in a collective for a batch another rank lacks."""

    def __init__(self, num_items: int, batch_size: int, seed: int, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if world_size > 1 and num_items < world_size * batch_size:
            raise ValueError(f"{num_items} sequences do not make one batch of {batch_size} for each of {world_size} "
                             "ranks: use more data, a shorter seq_len or a smaller batch_size")
        self.num_items, self.batch_size, self.seed, self.shuffle = num_items, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self._skip = 0
        self._finished = False  # the last pass drew its last batch: the next one draws the next epoch

    def resume(self, epoch: int, batches: int) -> None:
        """Continue from a checkpoint that had consumed ``batches`` batches of ``epoch``."""
        if batches >= len(self):  # the checkpoint saw the epoch's last batch
            epoch, batches = epoch + 1, 0
        self.epoch, self._skip, self._finished = epoch, batches, False

    def __len__(self) -> int:
        if self.world_size == 1:
            return math.ceil(self.num_items / self.batch_size)
        return self.num_items // (self.world_size * self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        if self._finished:
            self.epoch += 1
        self._finished = False
        skip, self._skip = self._skip, 0
        order = (
            torch.randperm(self.num_items, generator=epoch_generator(self.seed, self.epoch))
            if self.shuffle
            else torch.arange(self.num_items)
        )
        for b in range(skip, len(self)):
            # Lightning stops after ``len`` batches without asking for more: the last one ends the pass.
            self._finished = b == len(self) - 1
            start = (b * self.world_size + self.rank) * self.batch_size
            yield order[start : start + self.batch_size].tolist()


class PositionedLoader(DataLoader):
    """The training loader, resumable as Lightning sees it (``state_dict``/``load_state_dict``): its state is the
    data position, (epoch, batches consumed) as ``position()`` reports it, which ``load_state_dict`` hands to
    the sampler. The DataModule's own state restores the same position (and refuses other data)."""

    def __init__(self, dataset: Dataset, batch_sampler: ResumableBatchSampler, position):
        # Its own generator: starting an iterator then draws no number from the global RNG, whose stream the
        # training step's own draws (stochastic rounding, dropout) must find where a resumed run left it.
        super().__init__(dataset, batch_sampler=batch_sampler, generator=torch.Generator().manual_seed(0))
        self._position = position

    def state_dict(self) -> dict[str, int]:
        epoch, consumed = self._position()
        return {"epoch": epoch, "batches_consumed": consumed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.batch_sampler.resume(int(state_dict["epoch"]), int(state_dict["batches_consumed"]))


# == the DataModule ========================================================================================


class TextCorpusDataModule(LightningDataModule):
    """Local documents, tokenized, joined with EOS and packed into sequences of ``seq_len`` tokens (the tail
    shorter than one sequence is dropped); its data position is part of Lightning's checkpoints.

    Args:
        paths: files or folders (searched recursively) of plain text (``.txt``, ``.md``: one document per
            file), JSON Lines (``.jsonl``: one document per line, its ``text_field``) and Parquet
            (``.parquet``: one document per row, column ``text_field``; needs pyarrow).
        tokenizer: a local tokenizer directory; None takes the model's ``pretrained`` directory.
        seq_len: tokens per training sequence (the context). A ``seq_len`` longer than the strategy's
            ``chunk_size`` must be a multiple of it.
        batch_size: sequences per batch.
        text_field: the JSONL field / Parquet column with the text.
        val_fraction: the share of sequences held out for validation (at least one when > 0).
        seed: the split and the shuffling of each epoch (the order of epoch e is drawn from seed and e).
        add_bos: also start each document with the tokenizer's BOS token.
        document_masking: each batch also holds ``position_ids`` that restart at 0 after every EOS, so that
            each document attends only within itself and is not predicted from the one before (the
            convention of transformers' DataCollatorWithFlattening; docs/architecture.md, "Packed documents").
            False: attention crosses document borders inside a sequence.
        token_cache: keep the tokens in a token cache on disk (``lightning_oomb.data.token_cache``; needs
            ``pip install 'lightning_oomb[data]'``; None, the default: when that is installed): the first
            start tokenizes the files in worker processes into memory-mapped Arrow files, later starts with the
            same files (paths, sizes, modification times), tokenizer, ``text_field`` and ``add_bos`` read them
            without tokenizing, and sequences are read from the mapped files one at a time (the resident host
            memory does not grow with the corpus). False: tokenize in this process at every start and hold the
            stream in memory (4 bytes a token).
        cache_dir: the token cache's folder; None: ``$LIGHTNING_OOMB_CACHE``, else
            ``~/.cache/lightning_oomb/tokens`` (``$XDG_CACHE_HOME`` if set).
        tokenize_workers: processes that tokenize (each takes whole files); None: one per CPU core, no more
            than the files, and none beside this process for a corpus under 32 MiB.
    """

    def __init__(
        self,
        paths: list[str] | str,
        tokenizer: str | None = None,
        seq_len: int = 4096,
        batch_size: int = 1,
        text_field: str = "text",
        val_fraction: float = 0.01,
        seed: int = 0,
        add_bos: bool = False,
        document_masking: bool = False,
        token_cache: bool | None = None,
        cache_dir: str | None = None,
        tokenize_workers: int | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        self._check_sizes(seq_len, batch_size, val_fraction)
        self.files = find_files(self.paths)  # missing paths fail here, before the model trains
        self.tokenizer_path = tokenizer
        self.seq_len, self.batch_size, self.text_field = seq_len, batch_size, text_field
        self.val_fraction, self.seed, self.add_bos = val_fraction, seed, add_bos
        self.document_masking = document_masking
        self._token_cache_options(token_cache, cache_dir, tokenize_workers)
        # A tokenizer given here is loaded now, so that a directory without one fails before any model loads.
        self.tokenizer = load_tokenizer(tokenizer) if tokenizer is not None else None
        self.train_set: PackedSequences | None = None
        self.val_set: PackedSequences | None = None
        self.num_tokens = self.num_documents = 0
        self.document_length: int | None = None  # with document_masking, set by setup (planning_document_length)
        self._epoch, self._consumed = 0, 0  # the data position: epoch and training batches taken from it
        self._resume_from: dict[str, Any] | None = None
        self._sampler: ResumableBatchSampler | None = None

    # -- options and the token cache (shared with ChatDataModule) --------------------------------------
    error = CorpusError  # what the shared checks and the token cache raise: this data module's own error type

    def _check_sizes(self, seq_len: int, batch_size: int, val_fraction: float) -> None:
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise self.error(f"data.init_args.{name} must be an integer >= 1, got {value!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise self.error(f"data.init_args.val_fraction must be in [0, 1), got {val_fraction}")

    def _token_cache_options(self, token_cache: bool | None, cache_dir: str | None,
                             tokenize_workers: int | None) -> None:
        """Check and keep the options ``token_cache``, ``cache_dir`` and ``tokenize_workers``."""
        if tokenize_workers is not None and (isinstance(tokenize_workers, bool) or tokenize_workers < 1):
            raise self.error("data.init_args.tokenize_workers must be an integer >= 1 or null, got "
                             f"{tokenize_workers!r}")
        if token_cache is None:
            token_cache = token_cache_available()
            if not token_cache:
                rank_zero_info(f"{type(self).__name__}: tokenized in memory at every start; pip install "
                               "'lightning_oomb[data]' (Hugging Face datasets) keeps the tokens in a token cache "
                               "on disk")
        self.token_cache, self.cache_dir, self.tokenize_workers = token_cache, cache_dir, tokenize_workers
        self.cache_folder: Path | None = None  # the token cache read by setup
        self._cache: TokenCache | None = None  # the token cache prepare_data opened, for setup

    def _open_token_cache(self, options: dict[str, Any], encode: Encoder) -> TokenCache:
        """The token cache of ``self.files`` keyed also by ``options``, tokenized first by ``encode`` in
        ``tokenize_workers`` processes where no start has (None: one per CPU core, no more than the files, and
        none beside this process under ``PARALLEL_MIN_BYTES``)."""
        workers = self.tokenize_workers
        if workers is None:
            small = files_bytes(self.files) < PARALLEL_MIN_BYTES
            workers = 1 if small else max(1, min(os.cpu_count() or 1, len(self.files)))
        try:
            return open_token_cache(self.files, self.tokenizer, options, encode, self.cache_dir, workers,
                                    log=rank_zero_info)
        except TokenCacheError as e:  # the data module's errors are its own type, whichever room found them
            raise self.error(str(e)) from None

    # -- set-up ----------------------------------------------------------------------------------------
    def _trainer_or_none(self):
        try:
            return self.trainer
        except RuntimeError:
            return None

    def _checked_trainer(self):
        """The attached Trainer (None outside one), its strategy's chunking and its sampler checked against this
        module's sequences: what ``setup`` checks on every call, before the data is built or found built."""
        trainer = self._trainer_or_none()
        if trainer is not None:
            self._check_chunking(trainer)
            self._check_sampler(trainer)
        return trainer

    def _check_chunking(self, trainer) -> None:
        config = getattr(getattr(trainer, "strategy", None), "chunk_config", None)
        if config is None:
            return
        chunk = config.chunk_size
        if self.seq_len > chunk and self.seq_len % chunk:
            lower, upper = self.seq_len // chunk * chunk, -(-self.seq_len // chunk) * chunk
            raise CorpusError(
                f"data.init_args.seq_len {self.seq_len} is not a multiple of trainer.strategy.init_args.chunk_size "
                f"{chunk}; change one of these two options (e.g. seq_len {lower} or {upper}, or a chunk_size that "
                f"divides {self.seq_len})"
            )

    @classmethod
    def _check_sampler(cls, trainer) -> None:
        # Lightning would put its DistributedSampler under the rank-aware batch sampler, and fail in a way that
        # does not say which option to change.
        connector = getattr(trainer, "_accelerator_connector", None)
        if getattr(trainer, "world_size", 1) > 1 and getattr(connector, "use_distributed_sampler", False):
            raise CorpusError(
                f"{cls.__name__} gives each of the {trainer.world_size} ranks its own sequences itself (and "
                "resumes their position): set trainer.use_distributed_sampler false (Trainer(use_distributed_sampler"
                "=False), or `use_distributed_sampler: false` under `trainer:` in the YAML)"
            )

    def _model_pretrained(self, trainer) -> tuple[str | None, int | None]:
        module = getattr(trainer, "lightning_module", None) if trainer is not None else None
        if module is None:
            return None, None
        pretrained = getattr(getattr(module, "hparams", {}), "get", lambda *_: None)("pretrained")
        vocab = None
        model = getattr(module, "model", None)
        config = getattr(model, "config", None)
        if config is not None:
            vocab = getattr(config, "vocab_size", None)
        return pretrained, vocab

    def _resolve_tokenizer(self, trainer) -> tuple[str | None, int | None]:
        """Load the tokenizer (the model's where none is named) and check it against the model's vocabulary:
        (where it came from, the model's vocabulary size or None)."""
        pretrained, vocab_size = self._model_pretrained(trainer)
        source = self.tokenizer_path or pretrained
        if self.tokenizer is None:
            if source is None:
                raise CorpusError(
                    "TextCorpusDataModule needs a tokenizer: set data.init_args.tokenizer to a local tokenizer "
                    "directory (or train a model from model.pretrained, whose tokenizer is then used)"
                )
            self.tokenizer = load_tokenizer(source, "model.pretrained")
        if vocab_size is not None:
            check_tokenizer_matches(self.tokenizer, vocab_size, source)
        # A tokenizer named in the config beside model.pretrained is said with the corpus, before the plan: a
        # YAML written for another model would otherwise lend it its tokenizer without a word.
        self._other_tokenizer = self.tokenizer_path if (
            self.tokenizer_path is not None and pretrained is not None
            and Path(self.tokenizer_path).expanduser().resolve() != Path(pretrained).expanduser().resolve()) else None
        return source, vocab_size

    @override
    def prepare_data(self) -> None:
        """Tokenize into the token cache where no start has: Lightning calls this on one process of each
        machine (local rank 0) before every rank's ``setup``, which then reads the cache, so that the ranks of
        a machine do not each tokenize the corpus."""
        if self.token_cache and self.train_set is None and self._cache is None:
            self._resolve_tokenizer(self._trainer_or_none())
            self._cache = self._open_cache()

    @override
    def setup(self, stage: str | None = None) -> None:
        trainer = self._checked_trainer()
        if self.train_set is not None:
            return
        source, vocab_size = self._resolve_tokenizer(trainer)
        cache = None
        if self.token_cache:
            cache, self._cache = self._cache or self._open_cache(), None
            tokens, self.num_documents, max_id = cache.stream, cache.documents, cache.max_id
            self.cache_folder = cache.folder
        else:
            tokens, self.num_documents = tokenize_corpus(self.files, self.tokenizer, self.text_field, self.add_bos)
            max_id = int(tokens.max()) if len(tokens) else -1
        self.num_tokens = len(tokens)
        listing = ", ".join(map(str, self.paths))
        if self.num_documents == 0:
            raise CorpusError(f"the corpus ({listing}) holds no text; check data.init_args.paths and text_field")
        if vocab_size is not None and max_id >= vocab_size:
            raise CorpusError(
                f"the tokenizer ({source}) produces token id {max_id} but the model's vocabulary has "
                f"{vocab_size} entries; use the model's own tokenizer (data.init_args.tokenizer) or a model with "
                "a larger vocab_size"
            )
        sequences = self.num_tokens // self.seq_len
        n_val = max(1, round(sequences * self.val_fraction)) if self.val_fraction > 0 else 0
        needed = n_val + 1
        if sequences < needed:
            what = f"{needed} sequences ({needed - 1} held out for validation)" if n_val else "one sequence"
            raise CorpusError(
                f"the corpus ({listing}) has {self.num_tokens:,} tokens ({self.num_documents} documents, with EOS "
                f"separators) but {what} of data.init_args.seq_len {self.seq_len} need {needed * self.seq_len:,}; "
                "add text, lower data.init_args.seq_len"
                + (" or data.init_args.val_fraction" if n_val else "")
            )
        if cache is None:
            tokens = tokens[: sequences * self.seq_len]  # the cached stream stays as it is: the rows bound it
        order = torch.randperm(sequences, generator=epoch_generator(self.seed, -1))
        val_rows, train_rows = order[:n_val].sort().values, order[n_val:].sort().values
        eos = self.tokenizer.eos_token_id if self.document_masking else None
        if eos is not None:
            length = sequences * self.seq_len
            compute = lambda: planning_document_length(tokens, self.seq_len, eos, length)  # noqa: E731
            # A scan of the whole stream: the cache keeps its result for this seq_len.
            self.document_length = cache.memo(f"document-length-{self.seq_len}", compute) if cache else compute()
        self.train_set = PackedSequences(tokens, self.seq_len, train_rows, eos)
        self.val_set = PackedSequences(tokens, self.seq_len, val_rows, eos) if n_val else None
        rank_zero_info(self.describe())

    def _open_cache(self):
        """The token cache of this corpus (tokenizing it first where no start has)."""
        _check_bos(self.tokenizer, self.add_bos)
        # What changes the tokens (document_masking does not: it reads the same stream).
        options = {"text_field": self.text_field, "add_bos": self.add_bos, "piece_chars": TEXT_PIECE_CHARS}
        encode = functools.partial(encode_file, tokenizer=self.tokenizer, text_field=self.text_field,
                                   add_bos=self.add_bos)
        return self._open_token_cache(options, encode)

    def describe(self) -> str:
        if self.train_set is None:
            return "corpus not read yet"
        val = len(self.val_set) if self.val_set is not None else 0
        tokenizer = getattr(self, "_other_tokenizer", None)
        return (
            f"corpus: {len(self.files)} files, {self.num_documents:,} documents, {self.num_tokens:,} tokens -> "
            f"{len(self.train_set):,} training and {val:,} validation sequences of {self.seq_len:,} tokens "
            + (f"(each document attends within itself; attention as in documents of {self.document_length:,} "
               "tokens, the length-weighted mean of the pieces the sequences hold)" if self.document_masking
               else "(attention crosses document borders inside a sequence)")
            + (f"\ntokenizer: {tokenizer} (data.init_args.tokenizer), not the one in model.pretrained's directory; "
               "set data.init_args.tokenizer null to use the model's own" if tokenizer else "")
        )

    # -- loaders ---------------------------------------------------------------------------------------
    @override
    def train_dataloader(self) -> DataLoader:
        trainer = self._trainer_or_none()
        rank, world = data_parallel_rank(trainer)
        self._sampler = ResumableBatchSampler(len(self.train_set), self.batch_size, self.seed, rank=rank,
                                              world_size=world)
        state = self._resume_from
        if state is not None:
            self._epoch, self._consumed = state["epoch"], state["batches_consumed"]
            self._sampler.resume(self._epoch, self._consumed)
            self._resume_from = None
        return PositionedLoader(self.train_set, self._sampler, lambda: (self._epoch, self._consumed))

    @override
    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=self.batch_size, generator=torch.Generator().manual_seed(0))

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = self._trainer_or_none()
        if trainer is not None and trainer.training:
            epoch = self._sampler.epoch  # the epoch drawn (not trainer.current_epoch: see the sampler)
            if epoch != self._epoch:
                self._epoch, self._consumed = epoch, 0
            self._consumed += 1
        return batch

    # -- checkpoint state: the data position -----------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "batches_consumed": self._consumed,
            "seed": self.seed,
            "train_sequences": len(self.train_set) if self.train_set is not None else None,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        now = {"seed": self.seed, "seq_len": self.seq_len, "batch_size": self.batch_size}
        if self.train_set is not None:
            now["train_sequences"] = len(self.train_set)
        changed = [f"{k} {state_dict.get(k)} -> {v}" for k, v in now.items() if state_dict.get(k) != v]
        if changed:
            raise CorpusError(
                "the checkpoint was trained on other data than this run would train on (" + "; ".join(changed) + "): "
                "resume with the same corpus, seq_len, batch_size and seed, or start a new run without --ckpt_path"
            )
        self._resume_from = {"epoch": int(state_dict["epoch"]), "batches_consumed": int(state_dict["batches_consumed"])}
