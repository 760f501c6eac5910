"""TextCorpusDataModule: reading .txt/.jsonl/.parquet, packing with EOS, the held-out split, resumable order,
and the messages bad input gets. Also the helpers (tiny tokenizer, tiny model directory, corpus) that
test_training_cli uses."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_oomb.lightning.corpus import (
    CorpusError,
    ResumableBatchSampler,
    TextCorpusDataModule,
    find_files,
    load_tokenizer,
    planning_document_length,
    tokenize_corpus,
)

WORDS = ("the cat sat on a mat with its hat and the dog ran to red barn in one big hop while birds sang "
         "over green hills near old river").split()
EOS = "</s>"


# == helpers (also used by test_training_cli) ==============================================================


def make_tokenizer(path: Path):
    """A word-level tokenizer over WORDS with an EOS token, saved with save_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, EOS: 1}
    for w in sorted(set(WORDS)):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token="[UNK]")
    fast.save_pretrained(path)
    return fast


def make_model_dir(path: Path, model_type: str = "qwen2", tokenizer: bool = True, **overrides) -> Path:
    """A tiny random causal LM written with save_pretrained (and the tiny tokenizer next to it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = len(set(WORDS)) + 2
    config = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    if model_type == "gpt2":
        config = dict(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=1024)
    config.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    model.save_pretrained(path)
    if tokenizer:
        make_tokenizer(path)
    return path


def sentence(rng: random.Random, words: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def write_corpus(folder: Path, docs: int = 40, words: int = 12, seed: int = 0) -> Path:
    """``docs`` documents split over a .txt file (one document), a .jsonl file and a nested .parquet file
    (or a second .jsonl without pyarrow)."""
    rng = random.Random(seed)
    texts = [sentence(rng, words) for _ in range(docs)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text(texts[0] + "\n")
    third = (docs - 1) // 2
    with open(folder / "b.jsonl", "w") as f:
        for t in texts[1 : 1 + third]:
            f.write(json.dumps({"text": t, "id": 1}) + "\n")
    rest = texts[1 + third :]
    (folder / "sub").mkdir(exist_ok=True)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": rest}), folder / "sub" / "c.parquet", row_group_size=7)
    except ImportError:
        with open(folder / "sub" / "c.jsonl", "w") as f:
            for t in rest:
                f.write(json.dumps({"text": t}) + "\n")
    return folder


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(path)
    return path


def module(paths, tokenizer_dir, **kwargs) -> TextCorpusDataModule:
    kwargs.setdefault("seq_len", 16)
    kwargs.setdefault("batch_size", 2)
    return TextCorpusDataModule(paths=[str(p) for p in paths], tokenizer=str(tokenizer_dir), **kwargs)


def setup_error(dm, trainer=None) -> str:
    if trainer is not None:
        dm.trainer = trainer
    with pytest.raises(CorpusError) as info:
        dm.setup("fit")
    return str(info.value)


# == reading and packing ===================================================================================


def test_three_formats_packed_with_eos(tmp_path, tokenizer_dir):
    corpus = write_corpus(tmp_path / "corpus", docs=41, words=12)
    files = find_files([str(corpus)])
    assert [f.name for f in files] == ["a.txt", "b.jsonl", "c.parquet" if files[-1].suffix == ".parquet" else "c.jsonl"]
    tok = load_tokenizer(str(tokenizer_dir))
    stream, docs = tokenize_corpus(files, tok)
    assert docs == 41 and len(stream) == 41 * 13  # 12 words + EOS each
    assert (stream.view(41, 13)[:, -1] == tok.eos_token_id).all()
    rng = random.Random(0)
    assert tok.decode(stream[:12].tolist()) == sentence(rng, 12)

    dm = module([corpus], tokenizer_dir, seq_len=16, val_fraction=0.1, seed=3)
    dm.setup("fit")
    n = 41 * 13 // 16
    assert len(dm.train_set) + len(dm.val_set) == n and len(dm.val_set) == round(n * 0.1)
    rows = set(dm.train_set.rows.tolist())
    assert rows.isdisjoint(dm.val_set.rows.tolist())
    item = dm.val_set[0]
    start = int(dm.val_set.rows[0]) * 16
    assert torch.equal(item["input_ids"], stream[start : start + 16].long())
    assert torch.equal(item["labels"], item["input_ids"])
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (2, 16) and batch["input_ids"].dtype == torch.long
    assert "attention crosses document borders" in dm.describe()


def test_document_masking_restarts_positions_after_eos(tmp_path, tokenizer_dir):
    """document_masking=True: position_ids restart at 0 after every EOS and at each sequence start; the
    default collate stacks them into the batch, and the packed step takes them (test_documents.py checks it
    against each document run on its own)."""
    corpus = write_corpus(tmp_path / "corpus", docs=41, words=12)  # 13 tokens per document with its EOS
    dm = module([corpus], tokenizer_dir, seq_len=16, val_fraction=0.1, seed=3, document_masking=True)
    dm.setup("fit")
    eos = dm.tokenizer.eos_token_id
    for item in (dm.train_set[i] for i in range(len(dm.train_set))):
        ids, pos = item["input_ids"], item["position_ids"]
        assert pos[0] == 0 and torch.equal(pos[1:] == 0, ids[:-1] == eos)
        assert ((pos[1:] == pos[:-1] + 1) | (pos[1:] == 0)).all()
    batch = next(iter(dm.train_dataloader()))
    assert batch["position_ids"].shape == batch["input_ids"].shape == (2, 16)
    assert "each document attends within itself" in dm.describe()


def test_planning_document_length_weighs_pieces_by_their_length():
    """Pieces of 2, 6 and 8 tokens in one sequence of 16 (the last document cut by the sequence end, its rest
    of 4 opening the next): sum(L^2) / sum(L) = (4 + 36 + 64 + 16) / 20 = 6."""
    eos = 9
    tokens = torch.tensor([1, eos, 1, 1, 1, 1, 1, eos] + [1] * 12)
    assert planning_document_length(tokens, 16, eos) == 6
    assert planning_document_length(torch.tensor([1, 1, 1, eos] * 4), 16, eos) == 4


def test_text_field_and_large_text_pieces(tmp_path, tokenizer_dir, monkeypatch):
    import lightning_oomb.lightning.corpus as corpus

    rng = random.Random(1)
    lines = [sentence(rng, 5) for _ in range(30)]
    (tmp_path / "big.txt").write_text("\n".join(lines))
    with open(tmp_path / "c.jsonl", "w") as f:
        f.write(json.dumps({"body": "the cat"}) + "\n\n" + json.dumps({"body": ""}) + "\n")
    tok = load_tokenizer(str(tokenizer_dir))
    whole, _ = tokenize_corpus([tmp_path / "big.txt"], tok)
    monkeypatch.setattr(corpus, "TEXT_PIECE_CHARS", 50)  # cut into pieces after newlines: same tokens
    pieces, docs = tokenize_corpus([tmp_path / "big.txt"], tok)
    assert docs == 1 and torch.equal(whole, pieces) and int((pieces == tok.eos_token_id).sum()) == 1
    stream, docs = tokenize_corpus([tmp_path / "c.jsonl"], tok, text_field="body")
    assert docs == 1 and tok.decode(stream.tolist()) == "the cat " + EOS


def test_resumable_sampler_order():
    """Each pass that draws its last batch makes the next one the next epoch's permutation; a pass left early (a run
    that stops mid-epoch) is drawn again. A resume skips the consumed batches once; one at an epoch's last batch
    continues with the next epoch."""
    s = ResumableBatchSampler(11, 3, seed=5)
    epoch0 = list(s)
    assert s.epoch == 0 and len(s) == 4 and sorted(sum(epoch0, [])) == list(range(11))
    epoch1 = list(s)
    assert s.epoch == 1 and epoch1 != epoch0
    again = iter(s)
    assert next(again) == list(s)[0]  # the earlier pass stopped after one batch: epoch 2 both times
    assert s.epoch == 2
    s.resume(1, 2)
    assert len(s) == 4 and list(s) == epoch1[2:]
    assert s.epoch == 1 and list(s) != epoch1  # the skip applies once; then epoch 2
    s.resume(0, 4)  # the checkpoint saw epoch 0's last batch
    assert list(s) == epoch1 and s.epoch == 1


def test_resumable_sampler_gives_each_rank_its_share_of_the_global_batch():
    """Data parallel: at each step the ranks' batches are the consecutive pieces of one global batch of the same
    permutation, the ranks run equally many steps (trailing items that make no whole global batch wait for the
    next epoch's permutation), and a resume skips the same global batches on every rank."""
    world, batch = 3, 2
    ranks = [ResumableBatchSampler(20, batch, seed=5, rank=r, world_size=world) for r in range(world)]
    one = ResumableBatchSampler(20, batch * world, seed=5)
    assert [len(s) for s in ranks] == [3, 3, 3]
    per_rank, whole = [list(s) for s in ranks], list(one)
    for step in range(3):
        assert sum((per_rank[r][step] for r in range(world)), []) == whole[step]
    for s in ranks:
        s.resume(0, 1)
    assert [list(s) for s in ranks] == [b[1:] for b in per_rank]
    with pytest.raises(ValueError, match="one batch of 2 for each of 3 ranks"):
        ResumableBatchSampler(5, batch, seed=5, rank=0, world_size=world)


def test_data_position_state(tmp_path, tokenizer_dir):
    corpus = write_corpus(tmp_path / "corpus", docs=30)
    dm = module([corpus], tokenizer_dir, val_fraction=0.0)
    dm.setup("fit")
    trainer = SimpleNamespace(training=True, current_epoch=0)
    dm.trainer = trainer
    full = [b["input_ids"] for b in dm.train_dataloader()]
    for b in full[:3]:
        dm.on_before_batch_transfer(b, 0)
    state = dm.state_dict()
    assert (state["epoch"], state["batches_consumed"]) == (0, 3)

    resumed = module([corpus], tokenizer_dir, val_fraction=0.0)
    resumed.setup("fit")
    resumed.load_state_dict(state)
    rest = [b["input_ids"] for b in resumed.train_dataloader()]
    assert len(rest) == len(full) - 3 and all(torch.equal(a, b) for a, b in zip(rest, full[3:]))

    other = module([corpus], tokenizer_dir, val_fraction=0.0, seed=1)
    other.setup("fit")
    with pytest.raises(CorpusError, match="other data.*seed 0 -> 1"):
        other.load_state_dict(state)


# == bad input =============================================================================================


def test_missing_and_unsupported_paths(tmp_path, tokenizer_dir):
    with pytest.raises(CorpusError, match=r"paths: .*nope\.txt does not exist"):
        module([tmp_path / "nope.txt"], tokenizer_dir)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(CorpusError, match=r"x\.csv is not a supported file type"):
        module([tmp_path / "x.csv"], tokenizer_dir)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match=r"folder .*empty holds no"):
        module([tmp_path / "empty"], tokenizer_dir)
    with pytest.raises(CorpusError, match="paths is empty"):
        module([], tokenizer_dir)


def test_unreadable_file(tmp_path, tokenizer_dir, monkeypatch):
    import lightning_oomb.lightning.corpus as corpus

    f = tmp_path / "locked.txt"
    f.write_text("the cat")
    # Tests run as root, who reads anything: pretend the permission check fails.
    monkeypatch.setattr(corpus.os, "access", lambda path, mode: Path(path) != f)
    with pytest.raises(CorpusError, match=r"locked\.txt: the file cannot be read"):
        module([f], tokenizer_dir)


def test_empty_corpus(tmp_path, tokenizer_dir):
    (tmp_path / "e.jsonl").write_text(json.dumps({"text": ""}) + "\n\n")
    (tmp_path / "e.txt").write_text("")
    msg = setup_error(module([tmp_path / "e.jsonl", tmp_path / "e.txt"], tokenizer_dir))
    assert "holds no text" in msg


def test_jsonl_errors_name_file_and_line(tmp_path, tokenizer_dir):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"text": "the cat"}) + "\n" + '{"text": "the dog"\n')
    msg = setup_error(module([f], tokenizer_dir))
    assert f"{f}, line 2: not valid JSON" in msg
    f.write_text(json.dumps({"text": "the cat"}) + "\n\n" + json.dumps({"content": "x"}) + "\n")
    msg = setup_error(module([f], tokenizer_dir))
    assert f"{f}, line 3: no 'text' field (found: content)" in msg and "data.init_args.text_field" in msg
    f.write_text(json.dumps({"text": 5}) + "\n")
    assert "is a int, not a string" in setup_error(module([f], tokenizer_dir))


def test_non_utf8_names_byte_offset(tmp_path, tokenizer_dir):
    f = tmp_path / "latin.txt"
    f.write_bytes("the cat sat on a mat".encode() + b" caf\xe9 " + b"the dog")
    msg = setup_error(module([f], tokenizer_dir))
    assert f"{f}: not valid UTF-8 at byte offset 24" in msg and "iconv" in msg
    g = tmp_path / "latin.jsonl"
    first = json.dumps({"text": "the cat"}).encode() + b"\n"
    g.write_bytes(first + b'{"text": "caf\xe9"}\n')
    msg = setup_error(module([g], tokenizer_dir))
    assert f"{g}: not valid UTF-8 at byte offset {len(first) + 13}, line 2" in msg


def test_corpus_shorter_than_one_sequence(tmp_path, tokenizer_dir):
    f = tmp_path / "short.txt"
    f.write_text("the cat sat on the mat")  # 6 words + EOS = 7 tokens
    msg = setup_error(module([f], tokenizer_dir, seq_len=16, val_fraction=0.0))
    assert "has 7 tokens" in msg and "one sequence of data.init_args.seq_len 16 need 16" in msg
    f.write_text(" ".join(["the cat"] * 10))  # 21 tokens: one sequence, none left to hold out
    msg = setup_error(module([f], tokenizer_dir, seq_len=16, val_fraction=0.1))
    assert "has 21 tokens" in msg and "2 sequences (1 held out for validation)" in msg and "need 32" in msg


def test_seq_len_not_multiple_of_chunk(tmp_path, tokenizer_dir):
    corpus = write_corpus(tmp_path / "corpus", docs=20)
    trainer = SimpleNamespace(strategy=SimpleNamespace(chunk_config=SimpleNamespace(chunk_size=16)))
    msg = setup_error(module([corpus], tokenizer_dir, seq_len=40), trainer)
    assert "data.init_args.seq_len 40 is not a multiple of trainer.strategy.init_args.chunk_size 16" in msg
    assert "seq_len 32 or 48" in msg
    module([corpus], tokenizer_dir, seq_len=8).trainer = trainer  # shorter than a chunk: one chunk, fine


def test_several_ranks_need_lightning_to_leave_the_sampler(tmp_path, tokenizer_dir):
    from lightning.pytorch import Trainer

    from lightning_oomb import OOMBDDPStrategy

    corpus = write_corpus(tmp_path / "corpus", docs=20)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=OOMBDDPStrategy(chunk_size=16, page_size=8), logger=False)
    msg = setup_error(module([corpus], tokenizer_dir, seq_len=16), trainer)
    assert "set trainer.use_distributed_sampler false" in msg and "\n" not in msg


def test_tokenizer_problems(tmp_path, tokenizer_dir):
    corpus = write_corpus(tmp_path / "corpus", docs=10)
    no_tok = tmp_path / "model"
    no_tok.mkdir()
    (no_tok / "config.json").write_text("{}")
    with pytest.raises(CorpusError) as info:
        module([corpus], no_tok)  # at construction: before any model is loaded
    assert f"{no_tok} has no tokenizer" in str(info.value) and "data.init_args.tokenizer" in str(info.value)
    dm = TextCorpusDataModule(paths=[str(corpus)], seq_len=16)  # the model's directory, found at set-up
    model_dir = SimpleNamespace(lightning_module=SimpleNamespace(hparams={"pretrained": str(no_tok)}))
    msg = setup_error(dm, model_dir)
    assert f"{no_tok} has no tokenizer" in msg
    msg = setup_error(TextCorpusDataModule(paths=[str(corpus)], seq_len=16))
    assert "needs a tokenizer" in msg
    small_vocab = SimpleNamespace(
        lightning_module=SimpleNamespace(hparams={"pretrained": None}, model=SimpleNamespace(config=SimpleNamespace(vocab_size=4)))
    )
    msg = setup_error(module([corpus], tokenizer_dir), small_vocab)
    assert "has 30 tokens but the model's embeddings have 4 rows: it is not this model's tokenizer" in msg


def test_parquet_errors(tmp_path, tokenizer_dir, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    f = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["the cat"]}), f)
    msg = setup_error(module([f], tokenizer_dir))
    assert f"{f}: no 'text' column (found: body)" in msg
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    assert "not a readable Parquet file" in setup_error(module([tmp_path / "broken.parquet"], tokenizer_dir))

    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError("no pyarrow")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    assert "pip install 'lightning_oomb[data]'" in setup_error(module([f], tokenizer_dir))
