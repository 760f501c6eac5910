"""ChatDataModule's token cache (lightning_oomb.data.token_cache): the rendered conversations cached once, a
second start that neither renders nor tokenizes, the same batches as rendering in memory, keys that follow
train_on, the template and the files, and bad rows refused in one line with nothing written."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import lightning_oomb
from lightning_oomb.data import chat as chat_data
from lightning_oomb.data.chat import ChatDataError
from test_chat import MARKED, conversations, save_tokenizer, write_jsonl


def module(paths, tok_dir, **kwargs) -> lightning_oomb.ChatDataModule:
    kwargs.setdefault("seq_len", 128)
    kwargs.setdefault("batch_size", 2)
    return lightning_oomb.ChatDataModule([str(p) for p in paths], tokenizer=str(tok_dir), **kwargs)


def batches(dm) -> list[dict[str, torch.Tensor]]:
    out = [dm.train_set[i] for i in range(len(dm.train_set))]
    return out + ([dm.val_set[i] for i in range(len(dm.val_set))] if dm.val_set is not None else [])


def assert_same(got, want) -> None:
    assert (got.num_documents, got.num_tokens, got.num_labels, got.document_length, got.waste) == (
        want.num_documents, want.num_tokens, want.num_labels, want.document_length, want.waste)
    a, b = batches(got), batches(want)
    assert len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))
    assert [x["input_ids"].dtype for x in a[:1]] == [torch.int64]


def no_rendering(monkeypatch) -> None:
    from transformers import PreTrainedTokenizerBase

    def refuse(*args, **kwargs):
        raise AssertionError("rendered or tokenized although the cache was there")

    monkeypatch.setattr(chat_data.ChatRenderer, "render", refuse)
    monkeypatch.setattr(PreTrainedTokenizerBase, "apply_chat_template", refuse)
    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", refuse)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


@pytest.mark.parametrize("truncate", [False, True])
def test_second_start_reads_the_cache_and_gives_the_same_batches(tmp_path, tok_dir, monkeypatch, caplog, truncate):
    rows = conversations(20)
    f = write_jsonl(tmp_path / "chats" / "a.jsonl", rows[:12])
    g = write_jsonl(tmp_path / "chats" / "b.jsonl", rows[12:])
    options = dict(val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    if truncate:  # some conversations cut to seq_len on reading: the cache holds them whole
        options.update(seq_len=40, truncate=True)
    in_memory = module([f, g], tok_dir, **{**options, "token_cache": False})
    in_memory.setup("fit")
    assert in_memory.cache_folder is None and not (tmp_path / "cache").exists()
    first = module([f, g], tok_dir, **options)
    first.setup("fit")
    assert first.cache_folder.parent == tmp_path / "cache"
    assert_same(first, in_memory)

    no_rendering(monkeypatch)
    with caplog.at_level(logging.INFO):
        second = module([f, g], tok_dir, **options)
        second.setup("fit")
    assert f"read from {first.cache_folder} (memory-mapped; nothing tokenized)" in caplog.text
    assert second.cache_folder == first.cache_folder
    assert_same(second, in_memory)
    assert [x.tolist() for x in next(iter(second.train_dataloader())).values()] == [
        x.tolist() for x in next(iter(in_memory.train_dataloader())).values()]
    if truncate:
        assert any(len(c.ids) == 40 for c in second.train_set.conversations)
        # seq_len is applied on reading: another seq_len reads the same cache
        other = module([f, g], tok_dir, **{**options, "seq_len": 128, "truncate": False})
        other.setup("fit")
        assert other.cache_folder == first.cache_folder


def test_key_follows_train_on_template_and_files(tmp_path, tok_dir):
    f = write_jsonl(tmp_path / "a.jsonl", conversations(6))
    cache = str(tmp_path / "cache")

    def folder(**kwargs):
        dm = module([f], kwargs.pop("tok", tok_dir), cache_dir=cache, **kwargs)
        dm.setup("fit")
        return dm.cache_folder

    base = folder()
    assert folder() == base and folder(batch_size=1, seq_len=256) == base
    last = folder(train_on="last_assistant")
    everything = folder(train_on="all")
    marked = folder(chat_template=MARKED)  # the same labels, another template: another key
    assert len({base, last, everything, marked}) == 4
    stat = f.stat()
    os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    touched = folder()
    assert touched not in (base, last, everything, marked)
    with f.open("a") as out:
        out.write(json.dumps(conversations(7)[-1]) + "\n")
    grown = folder()
    assert grown not in (base, touched)


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_rows_are_one_line_and_leave_no_cache(tmp_path, tok_dir, workers):
    long = {"messages": [{"role": "user", "content": "Tell a long story."},
                         {"role": "assistant", "content": "Once " * 30}]}
    f = write_jsonl(tmp_path / "chats" / "a.jsonl", conversations(4) + [long])
    g = write_jsonl(tmp_path / "chats" / "b.jsonl", conversations(3))
    with g.open("a") as out:
        out.write('{"messages": []}\n')
    cache = tmp_path / "cache"
    with pytest.raises(ChatDataError) as e:
        module([f, g], tok_dir, cache_dir=str(cache), tokenize_workers=workers).setup("fit")
    msg = str(e.value)
    assert msg.startswith(f"{g}, line 4: the conversation is empty") and "\n" not in msg
    assert not cache.exists() or not list(cache.iterdir())  # no cache, no temporary folder left
    # A conversation too long for seq_len is found from the cached lengths, with its file and line.
    g.write_text("".join(json.dumps(r) + "\n" for r in conversations(3)))
    lengths = module([f, g], tok_dir, seq_len=1024, token_cache=False)
    lengths.setup("fit")
    longest = max(len(c.ids) for c in lengths.train_set.conversations)
    dm = module([f, g], tok_dir, cache_dir=str(cache), seq_len=longest - 1)
    with pytest.raises(ChatDataError, match=rf"^1 conversations are longer .* \(the first: {f}, line 5: {longest} "):
        dm.setup("fit")
    assert dm.cache_folder is not None  # the conversations were cached; only seq_len is refused
