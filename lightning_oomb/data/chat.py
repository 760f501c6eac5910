"""Conversations for supervised fine-tuning: read from JSON Lines or Parquet rows holding ``messages``,
rendered with the tokenizer's chat template, labelled on the assistant's turns, and packed into sequences.

Which tokens a turn trains is taken from the template, never guessed: from its generation markers
(``{% generation %}``, transformers' ``return_assistant_tokens_mask``) where it has them, otherwise by
rendering the conversation turn by turn and comparing token prefixes. A template for which that does not
find each assistant turn exactly is refused (``ChatDataError``, one line).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from ..core.documents import IGNORE_INDEX, document_loss_weights
from ..core.errors import SetupError

CHAT_SUFFIXES = (".jsonl", ".parquet")
TRAIN_ON = ("assistant", "last_assistant", "all")
# How the training loss averages: over the batch's labelled tokens (transformers' default), or over its
# conversations, each its own tokens' mean.
LOSS_REDUCTIONS = ("token", "sequence")
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatDataError(SetupError):
    """Bad conversations or a template whose assistant turns cannot be found: the message names the file, the row
    or the option, and the fix."""


# == reading ===============================================================================================


def find_chat_files(paths: list[str]) -> list[Path]:
    """The conversation files: each path a .jsonl/.parquet file, a folder ``datasets``' ``save_to_disk`` wrote
    (taken whole), or a folder searched recursively for .jsonl/.parquet files, sorted."""
    if not paths:
        raise ChatDataError("data.init_args.paths is empty: give one or more .jsonl or .parquet files or folders")
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise ChatDataError(f"data.init_args.paths: {raw} does not exist; check the path (relative paths are "
                                f"taken from the current directory, {os.getcwd()})")
        if (path / "dataset_dict.json").is_file():
            splits = ", ".join(sorted(p.name for p in path.iterdir() if (p / "state.json").is_file()))
            raise ChatDataError(f"data.init_args.paths: {raw} is a saved DatasetDict; give one split's folder "
                                f"({splits})")
        if (path / "state.json").is_file():
            files.append(path)  # a datasets save_to_disk folder: its .arrow files are one table
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in CHAT_SUFFIXES)
            if not found:
                raise ChatDataError(f"data.init_args.paths: the folder {raw} holds no .jsonl or .parquet files (nor "
                                    "is it a datasets save_to_disk folder)")
            files += found
        elif path.suffix.lower() in CHAT_SUFFIXES:
            files.append(path)
        else:
            raise ChatDataError(f"data.init_args.paths: {raw} is not a .jsonl or .parquet file of conversations")
    return files


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """``messages`` as a list of {role, content} string pairs, or a one-line refusal naming ``where``."""
    fix = 'each row needs "messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]'
    if not isinstance(messages, list):
        raise ChatDataError(f"{where}: 'messages' is a {type(messages).__name__}, not a list; {fix}")
    if not messages:
        raise ChatDataError(f"{where}: the conversation is empty (no messages); remove the row")
    out = []
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
            raise ChatDataError(f"{where}: message {k} has no role string; {fix}")
        if not isinstance(message.get("content"), str):
            got = type(message.get("content")).__name__
            raise ChatDataError(f"{where}: message {k} (role {message['role']!r}) has content of type {got}, not a "
                                "string; give every message its text as 'content'")
        out.append({"role": message["role"], "content": message["content"]})
    return out


def _missing(record: Any, where: str) -> ChatDataError:
    keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
    return ChatDataError(f"{where}: no 'messages' field (found: {keys}); every row needs a 'messages' list of "
                         "{role, content} messages")


def read_conversations(file: Path) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """(where, messages) of each row of a .jsonl (blank lines skipped) or .parquet file or a save_to_disk
    folder; where names the file and the line (JSONL, from 1) or row (Parquet and saved datasets, from 0)."""
    if file.is_dir():
        yield from _read_saved_dataset(file)
        return
    if file.suffix.lower() == ".parquet":
        yield from _read_parquet(file)
        return
    try:
        handle = open(file, "rb")
    except OSError as e:
        raise ChatDataError(f"{file}: cannot be read ({e.strerror or e})") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            where = f"{file}, line {number}"
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise ChatDataError(f"{where}: not valid UTF-8 ({e.reason}); re-encode the file as UTF-8") from None
            except json.JSONDecodeError as e:
                raise ChatDataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); every line of a .jsonl "
                                    "file must be one JSON object") from None
            if not isinstance(record, dict) or "messages" not in record:
                raise _missing(record, where)
            yield where, check_messages(record["messages"], where)


def _read_parquet(file: Path) -> Iterator[tuple[str, list[dict[str, str]]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ChatDataError("reading .parquet files needs pyarrow: pip install 'lightning_oomb[data]'") from None
    try:
        pf = pq.ParquetFile(file)
    except Exception as e:  # pyarrow raises its own error types for a damaged file
        raise ChatDataError(f"{file}: not a readable Parquet file ({e})") from None
    if "messages" not in pf.schema_arrow.names:
        raise _missing(dict.fromkeys(pf.schema_arrow.names), str(file))
    row = 0
    for group in range(pf.num_row_groups):
        for messages in pf.read_row_group(group, columns=["messages"]).column(0).to_pylist():
            where = f"{file}, row {row}"
            yield where, check_messages(messages, where)
            row += 1


def _read_saved_dataset(folder: Path) -> Iterator[tuple[str, list[dict[str, str]]]]:
    # save_to_disk writes Arrow IPC streams named in state.json, which pyarrow reads without ``datasets``.
    import pyarrow as pa

    try:
        names = [f["filename"] for f in json.loads((folder / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ChatDataError(f"{folder}: state.json does not list the dataset's files ({e}); save it again with "
                            "save_to_disk") from None
    if any(not isinstance(n, str) or Path(n).name != n for n in names):
        raise ChatDataError(f"{folder}: state.json names files outside the folder ({names}); save it again with "
                            "save_to_disk")
    row = 0
    for name in names:
        try:
            table = pa.ipc.open_stream(pa.memory_map(str(folder / name))).read_all()
        except (OSError, pa.ArrowInvalid) as e:
            raise ChatDataError(f"{folder / name}: not a readable Arrow file ({e})") from None
        if "messages" not in table.column_names:
            raise _missing(dict.fromkeys(table.column_names), str(folder))
        for messages in table.column("messages").to_pylist():
            where = f"{folder}, row {row}"
            yield where, check_messages(messages, where)
            row += 1


# == rendering and labelling ===============================================================================


@dataclass
class Conversation:
    """One rendered conversation: ``ids`` (n,) token ids and ``trained`` (n,) bools, True where the token is a
    label (an assistant turn's content and the end-of-turn token after it, or as ``train_on`` says)."""

    ids: list[int]
    trained: list[bool]


class ChatRenderer:
    """Renders conversations with ``tokenizer``'s chat template (or ``chat_template``) and finds the tokens
    ``train_on`` labels: ``assistant`` (every assistant turn), ``last_assistant`` (the last one) or ``all``."""

    def __init__(self, tokenizer, train_on: str = "assistant", chat_template: str | None = None):
        if train_on not in TRAIN_ON:
            raise ChatDataError(f"data.init_args.train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        if not isinstance(self.template, str) or not self.template:
            raise ChatDataError("the tokenizer has no chat template; use a tokenizer that has one (an instruct "
                                "model's) or set data.init_args.chat_template")
        self.tokenizer, self.train_on = tokenizer, train_on
        # transformers maps the markers to tokens through character offsets, which only fast tokenizers give.
        self.markers = bool(GENERATION_MARKER.search(self.template)) and getattr(tokenizer, "is_fast", False)
        self.special = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)}
        # The special tokens' texts, longest first (as tokenizers match them): where PrefixTokens cuts a text.
        texts = sorted({tokenizer.convert_ids_to_tokens(i) for i in self.special} - {None, ""}, key=len, reverse=True)
        self.special_text = re.compile("|".join(map(re.escape, texts))) if texts else None

    def _text(self, messages: list[dict[str, str]], where: str, prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=prompt)
        except Exception as e:  # the template's own raise_exception, or jinja's errors
            roles = ", ".join(sorted({m["role"] for m in messages}))
            raise ChatDataError(f"{where}: the chat template refuses this conversation (roles {roles}): "
                                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}; fix the row's roles "
                                "or order for this template") from None

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def render(self, messages: list[dict[str, str]], where: str) -> Conversation:
        """The conversation's tokens and which of them are labels; refuses, naming ``where``, a conversation
        the template does not render whole or whose assistant turns cannot be found exactly."""
        text = self._text(messages, where)
        self._check_rendered(messages, text, where)
        assistants = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if self.train_on == "all":
            ids = self._ids(text)
            return Conversation(ids, [True] * len(ids))
        if not assistants:
            raise ChatDataError(f"{where}: the conversation has no assistant message, so train_on "
                                f"{self.train_on!r} trains nothing in it; remove the row or set train_on: all")
        spans = self._marked_spans(messages, where, len(assistants)) if self.markers else None
        if spans is None:
            ids, spans = self._prefix_spans(messages, text, assistants, where)
        else:
            ids, spans = spans
        if self.train_on == "last_assistant":
            spans = spans[-1:]
        trained = [False] * len(ids)
        for start, end in spans:
            trained[start:end] = [True] * (end - start)
        return Conversation(ids, trained)

    def _check_rendered(self, messages: list[dict[str, str]], text: str, where: str) -> None:
        # A template may skip a role it does not know without a word: every message's text must appear, in order.
        cursor = 0
        for k, m in enumerate(messages):
            content = m["content"].strip()
            found = text.find(content, cursor)
            if found < 0:
                raise ChatDataError(f"{where}: the chat template does not render message {k} (role {m['role']!r}) "
                                    "as given: a role it does not know, or text it rewrites; use the roles the "
                                    "template renders (system, user, assistant)")
            cursor = found + len(content)

    def _marked_spans(self, messages, where: str, n_assistant: int):
        out = self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=True,
                                                 return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        spans, start = [], None
        for t, m in enumerate(mask + [0]):
            if m and start is None:
                start = t
            elif not m and start is not None:
                spans.append((start, t))
                start = None
        if len(spans) != n_assistant:
            raise ChatDataError(f"{where}: the chat template's generation markers mark {len(spans)} spans for "
                                f"{n_assistant} assistant messages; the template cannot be used to find the "
                                "assistant turns (fix its {% generation %} blocks)")
        return ids, spans

    def _prefix_spans(self, messages, text: str, assistants: list[int], where: str):
        """Turn by turn: the tokens of the conversation up to assistant turn k's header (the generation prompt)
        and through the turn must both be prefixes of the whole; the turn's labels run from the header's end
        through the first special token after it (the end-of-turn token)."""
        ids = self._ids(text)
        prefix = PrefixTokens(self, text, ids)
        spans = []
        for k in assistants:
            head = prefix.count(self._text(messages[:k], where, prompt=True))
            through = prefix.count(self._text(messages[: k + 1], where))
            if head is None or through is None or head > through:
                raise ChatDataError(
                    f"{where}: the chat template does not render assistant turns as a prefix of the conversation "
                    f"(message {k}), so which tokens are the assistant's cannot be found exactly; use a template "
                    "with {% generation %} markers (data.init_args.chat_template) or train_on: all")
            end = next((t + 1 for t in range(head, through) if ids[t] in self.special), None)
            if end is None:
                raise ChatDataError(
                    f"{where}: the chat template ends assistant turn {k} with no special token, so where the turn "
                    "ends cannot be found exactly; use a template with {% generation %} markers "
                    "(data.init_args.chat_template) or train_on: all")
            spans.append((head, end))
        return ids, spans


class PrefixTokens:
    """Whether a prefix of ``text``, tokenized alone, gives a prefix of ``ids`` (``text``'s tokens), and how
    many tokens: what turn-by-turn rendering compares, without tokenizing each of a conversation's growing
    prefixes whole (a 200-turn conversation of 33K tokens would tokenize 10M).

    Tokenizers split special tokens out before anything else, so the text between them tokenizes on its own.
    Where ``ids`` is exactly its pieces tokenized apart (checked here, for this text), a prefix's tokens are the
    pieces before the one it ends in and that piece's cut tokenized alone; otherwise every prefix is tokenized
    whole."""

    def __init__(self, renderer: ChatRenderer, text: str, ids: list[int]):
        self.renderer, self.text, self.ids = renderer, text, ids
        pattern = renderer.special_text
        inner = [b for m in pattern.finditer(text) for b in m.span()] if pattern is not None else []
        cuts = [0, *inner, len(text)]
        self.starts: list[int] | None = []  # character offsets of the pieces; None: tokenize prefixes whole
        self.token_starts: list[int] = []  # where each piece's tokens start in ids
        pieces = [text[a:b] for a, b in zip(cuts, cuts[1:])]
        counted = 0
        for a, piece, piece_ids in zip(cuts, pieces, self._piece_ids(pieces)):
            if not piece:
                continue
            if piece_ids != ids[counted: counted + len(piece_ids)]:
                self.starts = None  # pieces do not tokenize apart here: every prefix is tokenized whole
                return
            self.starts.append(a)
            self.token_starts.append(counted)
            counted += len(piece_ids)
        if counted != len(ids):
            self.starts = None

    def _piece_ids(self, pieces: list[str]) -> list[list[int]]:
        nonempty = [p for p in pieces if p]
        out = iter(self.renderer.tokenizer(nonempty, add_special_tokens=False)["input_ids"] if nonempty else [])
        return [next(out) if p else [] for p in pieces]

    def count(self, prefix: str) -> int | None:
        """How many of ``ids`` ``prefix``'s tokens are, or None where they are not a prefix of ``ids``."""
        if not self.text.startswith(prefix):
            return None
        if not self.starts:
            tokens = self.renderer._ids(prefix)
            return len(tokens) if tokens == self.ids[: len(tokens)] else None
        piece = bisect.bisect_right(self.starts, len(prefix)) - 1
        first = self.token_starts[piece]
        tail = self.renderer._ids(prefix[self.starts[piece]:]) if len(prefix) > self.starts[piece] else []
        return first + len(tail) if tail == self.ids[first: first + len(tail)] else None


def encode_conversations(path: str, renderer: ChatRenderer, rendered: Callable[[int], Any] | None = None
                         ) -> tuple[list[np.ndarray], int, list[np.ndarray], np.ndarray]:
    """One file's conversations rendered: their token ids (int32 arrays, in order), their count, which tokens
    are labels (uint8 arrays aligned with the ids) and their lengths (int64): what a worker of the token cache
    runs, and what the data module renders in memory without one. ``rendered(tokens)`` is called after each
    conversation (a progress bar)."""
    ids, trained, lengths = [], [], []
    for where, messages in read_conversations(Path(path)):
        conv = renderer.render(messages, where)
        ids.append(np.asarray(conv.ids, np.int32))
        trained.append(np.asarray(conv.trained, np.uint8))
        lengths.append(len(conv.ids))
        if rendered is not None:
            rendered(len(conv.ids))
    return ids, len(lengths), trained, np.asarray(lengths, np.int64)


def cache_options(renderer: ChatRenderer) -> dict[str, Any]:
    """What changes the rendered tokens and labels beyond the files and the tokenizer: the token cache's key
    options. ``seq_len`` and ``truncate`` do not: the cache holds whole conversations, cut on reading."""
    return {"chat": 1, "train_on": renderer.train_on, "markers": renderer.markers,
            "template": hashlib.sha256(renderer.template.encode()).hexdigest()}


# == packing ===============================================================================================


def best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each bin's lengths summing to at most ``capacity``: longest items first, each into
    the fullest bin it fits (best-fit decreasing). Items longer than ``capacity`` are the caller's to refuse."""
    import bisect

    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, bin index), sorted: the fullest fitting bin is the first >= length
    for i in order:
        at = bisect.bisect_left(room, (lengths[i], -1))
        if at == len(room):
            bins.append([i])
            left, b = capacity - lengths[i], len(bins) - 1
        else:
            left, b = room.pop(at)
            bins[b].append(i)
            left -= lengths[i]
        bisect.insort(room, (left, b))
    return bins


class Conversations(Sequence):
    """Conversations read out of a token stream and its mask (in-memory tensors, or the token cache's
    memory-mapped streams; sliced ``[a:b]``): conversation ``k`` is the ``lengths[k]`` tokens from
    ``starts[k]``, as a ``Conversation``."""

    def __init__(self, tokens, mask, starts: np.ndarray, lengths: np.ndarray):
        self.tokens, self.mask, self.starts, self.lengths = tokens, mask, starts, lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def tensors(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = int(self.starts[k])
        b = a + int(self.lengths[k])
        return self.tokens[a:b], self.mask[a:b]

    def __getitem__(self, k: int) -> Conversation:
        ids, mask = self.tensors(k)
        return Conversation(ids.tolist(), mask.bool().tolist())


class PackedConversations(Dataset):
    """Rows of ``seq_len`` tokens, each holding whole conversations (``bins`` of indices into
    ``conversations``), padded with ``pad`` at the end. An item is ``input_ids``, ``labels`` (-100 where not
    trained; the model shifts them) and ``position_ids`` (seq_len,) int64, the positions restarting at 0 at
    every conversation and at the padding, so that each conversation attends only within itself
    (docs/architecture.md, "Packed documents"). With ``loss_weights`` also ``loss_weights`` (seq_len,)
    float32: 1 / (its labels) on each predicted label of a conversation (``core.documents.document_loss_weights``),
    which makes the engine's loss the mean over the batch's conversations."""

    def __init__(self, conversations: Conversations, bins: list[list[int]], seq_len: int, pad: int,
                 loss_weights: bool = False):
        self.conversations, self.bins, self.seq_len, self.pad = conversations, bins, seq_len, pad
        self.loss_weights = loss_weights

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels, positions = [], [], []
        for c in self.bins[i]:
            tokens, mask = self.conversations.tensors(c)
            tokens = tokens.long()
            ids.append(tokens)
            labels.append(torch.where(mask.bool(), tokens, IGNORE_INDEX))
            positions.append(torch.arange(len(tokens)))
        fill = self.seq_len - sum(len(t) for t in ids)
        ids.append(torch.full((fill,), self.pad, dtype=torch.long))
        labels.append(torch.full((fill,), IGNORE_INDEX, dtype=torch.long))
        positions.append(torch.arange(fill))
        item = {"input_ids": torch.cat(ids), "labels": torch.cat(labels), "position_ids": torch.cat(positions)}
        if self.loss_weights:
            item["loss_weights"] = document_loss_weights(item["labels"][None], item["position_ids"][None])[0]
        return item
