"""A token cache on disk: a corpus tokenized once, by worker processes, into memory-mapped Arrow files.

It is kept in Hugging Face ``datasets`` Arrow files: ``Dataset.map(num_proc=...)`` gives the worker processes,
order-keeping contiguous shards and a progress bar, and its Arrow files are read memory-mapped and zero-copy,
from a library this package's users already have beside transformers (litdata's optimized chunks would add a
dependency for streaming from object stores, which a local random-access reader does not need).

One cache is a folder ``<cache_dir>/<key>/``: ``meta.json`` and the Arrow shards the workers wrote, whose
column ``ids`` (large_list<int32>) holds the token stream in order, a file's stream cut into rows of at most
``ROW_TOKENS`` tokens. An encoder that also gives a per-token mask and its documents' lengths (conversations:
which tokens are labels, where each conversation ends) adds the columns ``mask`` (large_list<uint8>, cut as
``ids``) and ``lengths`` (large_list<int64>, a file's on its first row). The key is a SHA-256 of everything
that changes the tokens: each file's path, size and modification time, the tokenizer's content, and the
reading options. A cache is written in a temporary folder
beside it and renamed to its key only when whole, so a folder named by a key is always complete and what a
killed tokenization left (``.tmp-*``) is never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from ..core.errors import SetupError

FORMAT = 1  # the layout of a cache folder; part of the key
ROW_TOKENS = 1 << 20  # tokens per Arrow row: a file's stream is cut into rows of at most this many
WRITER_ROWS = 64  # rows a worker buffers before writing them (64 rows of 4 MiB)
META = "meta.json"
TMP_PREFIX = ".tmp-"
ENV_CACHE = "LIGHTNING_OOMB_CACHE"

# One file's token stream: int32 arrays in order, and the documents it ended; optionally also uint8 arrays of a
# per-token mask aligned with them, and the documents' lengths in tokens (int64, summing to the stream's).
Encoder = Callable[[str], "tuple[list[np.ndarray], int] | tuple[list[np.ndarray], int, list[np.ndarray], np.ndarray]"]


class TokenCacheError(SetupError):
    """The token cache cannot be written or read: the message names the folder and what to do."""


def _datasets():
    try:
        import datasets
        import pyarrow  # noqa: F401
    except ImportError:
        raise TokenCacheError(
            "the token cache needs Hugging Face datasets and pyarrow: pip install 'lightning_oomb[data]' (or set "
            "data.init_args.token_cache false to tokenize in memory at every start)"
        ) from None
    return datasets


def token_cache_available() -> bool:
    """Whether the libraries the token cache needs (datasets, pyarrow) are installed."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("datasets", "pyarrow"))


def default_cache_dir() -> Path:
    """``$LIGHTNING_OOMB_CACHE`` if set, else ``$XDG_CACHE_HOME/lightning_oomb/tokens`` (``~/.cache/...``)."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "lightning_oomb" / "tokens"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A SHA-256 of what decides the tokenizer's ids: its class, its whole serialized pipeline (a fast tokenizer)
    or vocabulary (a slow one), and its special tokens."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    special = {"eos": tokenizer.eos_token_id, "bos": tokenizer.bos_token_id,
               "map": {k: str(v) for k, v in tokenizer.special_tokens_map.items()}}
    h.update(json.dumps(special, sort_keys=True).encode())
    return h.hexdigest()


def file_identity(files: Iterable[Path]) -> list[tuple[str, int, int]]:
    """(absolute path, size in bytes, modification time in ns) of each file, in order; a folder (a ``datasets``
    ``save_to_disk`` folder read whole) by each file in it, sorted."""
    out = []
    for f in files:
        for g in sorted(p for p in f.rglob("*") if p.is_file()) if f.is_dir() else [f]:
            stat = g.stat()
            out.append((str(g.resolve()), stat.st_size, stat.st_mtime_ns))
    return out


def files_bytes(files: Iterable[Path]) -> int:
    """The bytes of ``files`` (a folder's: of the files in it)."""
    return sum(size for _, size, _ in file_identity(files))


def cache_key(files: list[Path], tokenizer: Any, options: dict[str, Any]) -> str:
    """The cache's name: a SHA-256 (hex, 32 characters kept) of the files, the tokenizer and ``options`` (the
    reading options that change the tokens)."""
    described = {"format": FORMAT, "files": file_identity(files), "tokenizer": tokenizer_fingerprint(tokenizer),
                 "options": options}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


class TokenStream:
    """The cached token stream (or its mask: ``column`` "mask", uint8), memory-mapped: ``len(stream)`` tokens;
    ``stream[a:b]`` is an int32 (uint8) tensor of shape (b - a,) copied out of the mapped pages, which stay page
    cache the kernel may reclaim (resident: the index of the Arrow record batches, a few numbers each)."""

    def __init__(self, folder: Path, shards: list[str], column: str = "ids"):
        Dataset = _datasets().Dataset
        self.folder, self.shards, self.column = folder, list(shards), column
        self.dtype = np.uint8 if column == "mask" else np.int32
        segments: list[np.ndarray] = []
        for name in self.shards:
            table = Dataset.from_file(str(folder / name), in_memory=False).data.table
            for chunk in table.column(column).chunks:
                values = chunk.flatten().to_numpy(zero_copy_only=True)  # a view of the mapped file
                if len(values):
                    segments.append(values)
        self._segments = segments
        self._starts = np.cumsum([0] + [len(s) for s in segments], dtype=np.int64)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, key: slice) -> torch.Tensor:
        if not isinstance(key, slice):
            raise TypeError("a TokenStream is read in slices: stream[a:b]")
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("a TokenStream is read in contiguous slices")
        out = np.empty(max(0, stop - start), dtype=self.dtype)
        i, at = int(np.searchsorted(self._starts, start, side="right")) - 1, start
        while at < stop:
            seg, first = self._segments[i], int(self._starts[i])
            end = min(first + len(seg), stop)
            out[at - start : end - start] = seg[at - first : end - first]
            at, i = end, i + 1
        return torch.from_numpy(out)

    def __getstate__(self) -> dict[str, Any]:  # a loader worker maps the files itself
        return {"folder": self.folder, "shards": self.shards, "column": self.column}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["folder"], state["shards"], state.get("column", "ids"))


@dataclass
class TokenCache:
    """One cache folder, opened: its stream and what was counted while it was written."""

    folder: Path
    stream: TokenStream
    documents: int
    max_id: int  # the largest token id in the stream (-1 when empty)
    built: bool  # this process tokenized it (False: read from an earlier start)
    mask: TokenStream | None = None  # the per-token mask, where the encoder gave one
    lengths: np.ndarray | None = None  # (documents,) int64 lengths in tokens, where the encoder gave them

    def memo(self, name: str, compute: Callable[[], Any]) -> Any:
        """A small value derived from the stream, kept beside it in ``name``.json (written atomically)."""
        path = self.folder / f"{name}.json"
        try:
            return json.loads(path.read_text())["value"]
        except (OSError, ValueError, KeyError):
            pass
        value = compute()
        tmp = self.folder / f".{name}.{uuid.uuid4().hex}.tmp"
        try:
            tmp.write_text(json.dumps({"value": value}))
            os.replace(tmp, path)
        except OSError:  # a read-only cache still reads; the value is then computed at every start
            tmp.unlink(missing_ok=True)
        return value


def _encode_files(batch: Any, encode: Encoder) -> Any:
    """Datasets' map function (Arrow in, Arrow out): the files of ``batch`` as rows of their token streams."""
    import pyarrow as pa

    def joined(arrays: list[np.ndarray], dtype) -> np.ndarray:
        return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)

    values, masks, offsets, documents, max_ids, lengths = [], [], [0], [], [], []
    for path in batch.column("file").to_pylist():
        pieces, docs, *extra = encode(path)
        tokens = joined(pieces, np.int32)
        mask = joined(extra[0], np.uint8) if extra else None
        cuts = list(range(0, len(tokens), ROW_TOKENS)) or [0]
        for i, cut in enumerate(cuts):
            row = tokens[cut : cut + ROW_TOKENS]
            values.append(row)
            offsets.append(offsets[-1] + len(row))
            documents.append(docs if i == 0 else 0)  # a file's documents are counted on its first row
            max_ids.append(int(row.max()) if len(row) else -1)
            if extra:
                masks.append(mask[cut : cut + ROW_TOKENS])
                lengths.append(np.asarray(extra[1], np.int64) if i == 0 else np.zeros(0, np.int64))
    offsets = pa.array(offsets, pa.int64())
    columns = {"ids": pa.LargeListArray.from_arrays(offsets, pa.array(np.concatenate(values), pa.int32())),
               "documents": pa.array(documents, pa.int64()), "max_id": pa.array(max_ids, pa.int64())}
    if masks:
        columns["mask"] = pa.LargeListArray.from_arrays(offsets, pa.array(np.concatenate(masks), pa.uint8()))
        length_offsets = np.cumsum([0] + [len(x) for x in lengths], dtype=np.int64)
        columns["lengths"] = pa.LargeListArray.from_arrays(pa.array(length_offsets),
                                                           pa.array(np.concatenate(lengths), pa.int64()))
    return pa.table(columns)


def _writable(root: Path, option: str) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TokenCacheError(f"{option}: cannot create the token cache folder {root} ({e.strerror or e}); set "
                              f"{option} to a writable folder") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise TokenCacheError(f"{option}: the token cache folder {root} is not writable; set {option} to a writable "
                              "folder")


def _build(root: Path, key: str, files: list[Path], encode: Encoder, workers: int) -> None:
    Dataset = _datasets().Dataset
    import pyarrow.compute as pc

    tmp = root / f"{TMP_PREFIX}{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tasks = Dataset.from_dict({"file": [str(f) for f in files]}).with_format("arrow")
        done = tasks.map(
            _encode_files, batched=True, batch_size=1, num_proc=workers if workers > 1 else None,
            fn_kwargs={"encode": encode}, remove_columns=["file"], cache_file_name=str(tmp / "tokens.arrow"),
            writer_batch_size=WRITER_ROWS, load_from_cache_file=False, new_fingerprint=key,
            desc=f"tokenizing {len(files)} files into the token cache",  # datasets adds the processes
        )
        shards = [Path(c["filename"]).name for c in done.cache_files]
        table = done.data.table
        meta = {
            "format": FORMAT, "key": key, "shards": shards,
            "shard_bytes": [(tmp / s).stat().st_size for s in shards],
            "tokens": int(pc.sum(pc.list_value_length(table.column("ids"))).as_py() or 0),
            "documents": int(pc.sum(table.column("documents")).as_py() or 0),
            "max_id": int(pc.max(table.column("max_id")).as_py() if len(table) else -1),
            "files": [name for name, _, _ in file_identity(files)],
            "mask": "mask" in table.column_names,
        }
        del done, table, tasks
        (tmp / META).write_text(json.dumps(meta))
        try:
            os.rename(tmp, root / key)
        except OSError:
            if not (root / key / META).is_file():  # else another process wrote the same cache first: use it
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _open(folder: Path, built: bool) -> TokenCache:
    broken = (f"the token cache {folder} is damaged ({{}}); delete that folder, and the next start tokenizes the "
              "corpus again")
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError) as e:
        raise TokenCacheError(broken.format(f"{META}: {e}")) from None
    if meta.get("format") != FORMAT or not isinstance(meta.get("shards"), list):
        raise TokenCacheError(broken.format(f"{META} is not of format {FORMAT}"))
    for name, size in zip(meta["shards"], meta.get("shard_bytes", [])):
        shard = folder / name
        if not shard.is_file() or shard.stat().st_size != size:
            raise TokenCacheError(broken.format(f"{name} is missing or not {size:,} bytes"))
    try:
        stream = TokenStream(folder, meta["shards"])
    except Exception as e:  # pyarrow's own error types for a damaged file
        raise TokenCacheError(broken.format(f"{type(e).__name__}: {e}")) from None
    if len(stream) != meta["tokens"]:
        raise TokenCacheError(broken.format(f"{len(stream):,} tokens where {meta['tokens']:,} were written"))
    mask = lengths = None
    if meta.get("mask"):
        try:
            mask = TokenStream(folder, meta["shards"], "mask")
            lengths = _lengths(folder, meta["shards"])
        except Exception as e:
            raise TokenCacheError(broken.format(f"{type(e).__name__}: {e}")) from None
        if len(mask) != len(stream) or int(lengths.sum()) != len(stream) or len(lengths) != meta["documents"]:
            raise TokenCacheError(broken.format("its mask or lengths do not match its tokens"))
    return TokenCache(folder, stream, int(meta["documents"]), int(meta["max_id"]), built, mask, lengths)


def _lengths(folder: Path, shards: list[str]) -> np.ndarray:
    """The ``lengths`` column of a cache's shards, in order (8 bytes a document, in memory)."""
    Dataset = _datasets().Dataset
    parts = [np.zeros(0, np.int64)]
    for name in shards:
        column = Dataset.from_file(str(folder / name), in_memory=False).data.table.column("lengths")
        parts += [chunk.flatten().to_numpy(zero_copy_only=False) for chunk in column.chunks]
    return np.concatenate(parts).astype(np.int64, copy=False)


def open_token_cache(
    files: list[Path],
    tokenizer: Any,
    options: dict[str, Any],
    encode: Encoder,
    cache_dir: str | os.PathLike | None = None,
    workers: int = 1,
    option: str = "data.init_args.cache_dir",
    log: Callable[[str], None] = print,
) -> TokenCache:
    """The token stream of ``files``: read from ``cache_dir`` (default ``default_cache_dir()``) when a cache of
    the same key is there, else tokenized first by ``workers`` processes (each runs ``encode`` on whole files,
    in order) and written there. ``log`` gets one line saying which. An error ``encode`` raises (a bad row)
    stops the build, and nothing is written under the key."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    key = cache_key(files, tokenizer, options)
    folder = root / key
    if (folder / META).is_file():
        cache = _open(folder, built=False)
        log(f"token cache: {len(cache.stream):,} tokens read from {folder} (memory-mapped; nothing tokenized)")
        return cache
    _writable(root, option)
    size = files_bytes(files)
    log(f"token cache: tokenizing {len(files)} files ({size / (1 << 20):,.1f} MiB) with {workers} "
        f"process{'es' * (workers > 1)} into {folder}")
    began = time.perf_counter()
    _build(root, key, files, encode, workers)
    cache = _open(folder, built=True)
    seconds = time.perf_counter() - began
    log(f"token cache: {len(cache.stream):,} tokens written in {seconds:.1f} s "
        f"({len(cache.stream) / max(seconds, 1e-9):,.0f} tokens/s)")
    return cache
