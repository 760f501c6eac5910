"""The token cache (lightning_oomb.data.token_cache) under TextCorpusDataModule: the same samples as the stream
tokenized in memory, a second start that tokenizes nothing, keys that follow the files, the tokenizer and the
options, atomic writing, one-line refusals, and a run killed with SIGKILL that resumes at its sample."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from lightning_oomb.data import token_cache
from lightning_oomb.lightning import corpus
from lightning_oomb.lightning.corpus import CorpusError, TextCorpusDataModule
from test_corpus import make_tokenizer, module, setup_error, write_corpus


def items(dataset) -> list[dict[str, torch.Tensor]]:
    return [dataset[i] for i in range(len(dataset))]


def assert_same_samples(got: TextCorpusDataModule, want: TextCorpusDataModule) -> None:
    assert (got.num_tokens, got.num_documents, got.document_length) == (want.num_tokens, want.num_documents,
                                                                          want.document_length)
    assert (got.val_set is None) == (want.val_set is None)
    for a, b in ((got.train_set, want.train_set), (got.val_set, want.val_set)):
        if a is None:
            continue
        assert len(a) == len(b)
        for x, y in zip(items(a), items(b)):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def no_tokenizing(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("tokenized although the cache was there")

    monkeypatch.setattr(corpus, "_encode_pieces", refuse)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(path)
    return path


def test_cached_samples_equal_the_in_memory_ones_and_a_second_start_tokenizes_nothing(tmp_path, tokenizer_dir,
                                                                                      monkeypatch, caplog):
    folder = write_corpus(tmp_path / "corpus", docs=50)
    cache = tmp_path / "cache"
    options = dict(val_fraction=0.1, document_masking=True)
    in_memory = module([folder], tokenizer_dir, token_cache=False, **options)
    in_memory.setup("fit")
    first = module([folder], tokenizer_dir, cache_dir=str(cache), **options)
    first.setup("fit")
    assert first.cache_folder.parent == cache and isinstance(first.train_set.tokens, token_cache.TokenStream)
    assert_same_samples(first, in_memory)

    no_tokenizing(monkeypatch)
    with caplog.at_level(logging.INFO):
        second = module([folder], tokenizer_dir, cache_dir=str(cache), **options)
        second.setup("fit")
    assert f"read from {first.cache_folder} (memory-mapped; nothing tokenized)" in caplog.text
    assert second.cache_folder == first.cache_folder
    assert_same_samples(second, in_memory)
    # document_masking does not change the tokens: the same cache
    plain = module([folder], tokenizer_dir, cache_dir=str(cache), val_fraction=0.1)
    plain.setup("fit")
    assert plain.cache_folder == first.cache_folder


def test_worker_processes_give_the_same_stream_and_their_errors_name_the_line(tmp_path, tokenizer_dir):
    folder = write_corpus(tmp_path / "corpus", docs=60)
    in_memory = module([folder], tokenizer_dir, token_cache=False, val_fraction=0.0)
    in_memory.setup("fit")
    parallel = module([folder], tokenizer_dir, cache_dir=str(tmp_path / "cache"), tokenize_workers=2,
                      val_fraction=0.0)
    parallel.setup("fit")
    assert_same_samples(parallel, in_memory)
    (folder / "z.jsonl").write_text('{"text": "the cat"}\n{"text": \n')
    msg = setup_error(module([folder], tokenizer_dir, cache_dir=str(tmp_path / "cache"), tokenize_workers=2))
    assert f"{folder / 'z.jsonl'}, line 2: not valid JSON" in msg
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp-")]  # cleaned up


def test_key_follows_files_tokenizer_and_options(tmp_path, tokenizer_dir):
    folder = write_corpus(tmp_path / "corpus", docs=40)
    cache = str(tmp_path / "cache")

    def folder_of(tok=tokenizer_dir, **kwargs) -> Path:
        dm = module([folder], tok, cache_dir=cache, val_fraction=0.0, **kwargs)
        dm.setup("fit")
        return dm.cache_folder

    base = folder_of()
    assert folder_of() == base
    stat = (folder / "a.txt").stat()
    os.utime(folder / "a.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    touched = folder_of()
    assert touched != base
    other_tok = tmp_path / "other-tokenizer"
    make_tokenizer(other_tok)
    data = json.loads((other_tok / "tokenizer.json").read_text())
    data["model"]["vocab"]["zebra"] = len(data["model"]["vocab"])
    (other_tok / "tokenizer.json").write_text(json.dumps(data))
    assert folder_of(other_tok) not in (base, touched)
    key = token_cache.cache_key
    files, tok = corpus.find_files([str(folder)]), corpus.load_tokenizer(str(tokenizer_dir))
    assert key(files, tok, {"text_field": "text", "add_bos": False}) != key(files, tok, {"text_field": "text",
                                                                                         "add_bos": True})
    assert key(files, tok, {"text_field": "text"}) != key(files, tok, {"text_field": "body"})


def test_a_leftover_temporary_folder_is_never_read(tmp_path, tokenizer_dir, monkeypatch):
    folder = write_corpus(tmp_path / "corpus", docs=40)
    cache = tmp_path / "cache"
    first = module([folder], tokenizer_dir, cache_dir=str(cache), val_fraction=0.0)
    first.setup("fit")
    # What a tokenization killed before its rename leaves: a temporary folder of the same key, here damaged.
    leftover = cache / f"{token_cache.TMP_PREFIX}{first.cache_folder.name}-1-dead"
    shutil.copytree(first.cache_folder, leftover)
    for shard in leftover.glob("*.arrow"):
        shard.write_bytes(shard.read_bytes()[:100])
    shutil.rmtree(first.cache_folder)
    again = module([folder], tokenizer_dir, cache_dir=str(cache), val_fraction=0.0)
    again.setup("fit")  # tokenizes again into its own temporary folder, and renames it
    assert again.cache_folder == first.cache_folder and leftover.is_dir()
    in_memory = module([folder], tokenizer_dir, token_cache=False, val_fraction=0.0)
    in_memory.setup("fit")
    assert_same_samples(again, in_memory)


def test_bad_cache_folder_and_damaged_cache_are_one_line(tmp_path, tokenizer_dir, monkeypatch):
    folder = write_corpus(tmp_path / "corpus", docs=40)
    (tmp_path / "a-file").write_text("")
    msg = setup_error(module([folder], tokenizer_dir, cache_dir=str(tmp_path / "a-file" / "cache")))
    assert msg.startswith("data.init_args.cache_dir: cannot create the token cache folder") and "\n" not in msg
    read_only = module([folder], tokenizer_dir, cache_dir=str(tmp_path / "ro"))
    with monkeypatch.context() as patch:  # (the tests run as root, whom permissions do not stop)
        patch.setattr(token_cache.os, "access", lambda path, mode: False)
        msg = setup_error(read_only)
    assert f"the token cache folder {tmp_path / 'ro'} is not writable" in msg

    dm = module([folder], tokenizer_dir, cache_dir=str(tmp_path / "cache"))
    dm.setup("fit")
    shard = next(dm.cache_folder.glob("*.arrow"))
    shard.write_bytes(shard.read_bytes()[:-64])
    msg = setup_error(module([folder], tokenizer_dir, cache_dir=str(tmp_path / "cache")))
    assert f"the token cache {dm.cache_folder} is damaged" in msg and "delete that folder" in msg
    (dm.cache_folder / "meta.json").write_text("{")
    assert "is damaged (meta.json" in setup_error(module([folder], tokenizer_dir, cache_dir=str(tmp_path / "cache")))


def test_killed_run_resumes_at_its_sample_from_the_cache(tmp_path, caplog, capsys):
    """SIGKILL right after the step-4 checkpoint (a subprocess, which writes the cache), then ``--ckpt_path
    last`` reads the cache without tokenizing and ends where the run that was never stopped ends, bit for bit
    (the same samples in the same order); then a damaged cache is one line, exit 2."""
    from test_corpus import make_model_dir
    from test_training_cli import (EVERY, assert_same_training_state, fit, fit_subprocess, killer, load, run_dir,
                                   write_config)

    assets = {"model": make_model_dir(tmp_path / "model"), "corpus": write_corpus(tmp_path / "corpus", docs=60)}
    cache = tmp_path / "cache"
    options = ("--data.init_args.cache_dir", str(cache))
    whole = write_config(tmp_path / "whole", assets)
    assert fit(whole, "--data.init_args.token_cache", "false") is None
    want = load(run_dir(tmp_path / "whole") / "checkpoints" / "last.ckpt")

    config = write_config(tmp_path / "killed", assets)
    killed = fit_subprocess(config, *options, killer(kill_after_save=2))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "token cache: tokenizing" in killed.stderr
    last = run_dir(tmp_path / "killed") / "checkpoints" / "last.ckpt"
    assert load(last)["global_step"] == 2 * EVERY
    with caplog.at_level(logging.INFO):
        assert fit(config, *options, "--ckpt_path", "last") is None
    assert "nothing tokenized" in caplog.text and "token cache: tokenizing" not in caplog.text
    assert_same_training_state(load(last), want)

    (folder,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    (folder / "meta.json").write_text("not json")
    capsys.readouterr()
    assert fit(config, *options, "--ckpt_path", "last", "--trainer.max_steps", "12") == 2
    err = capsys.readouterr().err
    assert f"lightning-oomb: error: the token cache {folder} is damaged" in err


def test_token_stream_reads_across_rows_and_pickles(tmp_path, tokenizer_dir, monkeypatch):
    monkeypatch.setattr(token_cache, "ROW_TOKENS", 7)  # many rows: slices cross their borders
    folder = write_corpus(tmp_path / "corpus", docs=40)
    in_memory, _ = corpus.tokenize_corpus(corpus.find_files([str(folder)]), corpus.load_tokenizer(str(tokenizer_dir)))
    dm = module([folder], tokenizer_dir, cache_dir=str(tmp_path / "cache"), val_fraction=0.0)
    dm.setup("fit")
    stream = dm.train_set.tokens
    assert len(stream) == len(in_memory) and torch.equal(stream[0 : len(stream)], in_memory)
    assert torch.equal(stream[5:23], in_memory[5:23]) and len(stream[3:3]) == 0
    import pickle

    assert torch.equal(pickle.loads(pickle.dumps(stream))[2:30], in_memory[2:30])


def test_without_datasets_the_default_tokenizes_in_memory(tmp_path, tokenizer_dir, monkeypatch, caplog):
    monkeypatch.setattr(corpus, "token_cache_available", lambda: False)
    with caplog.at_level(logging.INFO):
        dm = module([write_corpus(tmp_path / "corpus", docs=30)], tokenizer_dir, cache_dir=str(tmp_path / "cache"))
    assert "pip install 'lightning_oomb[data]'" in caplog.text
    dm.setup("fit")
    assert isinstance(dm.train_set.tokens, torch.Tensor) and dm.cache_folder is None
    assert not (tmp_path / "cache").exists()


def test_truncation_saved_in_a_tokenizer_does_not_cut_documents(tokenizer_dir):
    tok = corpus.load_tokenizer(str(tokenizer_dir))
    tok.backend_tokenizer.enable_truncation(3)  # as a tokenizer.json may carry it; transformers' call turns it off
    text = "the cat sat on the mat"
    got = corpus._encode_pieces([(text, True, True)], tok, add_bos=False)
    assert got.tolist() == tok([text], add_special_tokens=False)["input_ids"][0] + [tok.eos_token_id]
