"""Chat data (lightning_oomb.data.chat, ChatDataModule): which tokens of a conversation are labels, against
masks written out by hand, for a template with generation markers, a ChatML template without them and
SmolLM2's template; refused templates and rows; packing, and the packed step against the conversations trained
separately. The tokenizer is the byte-level one of examples/byte_tokenizer (one token per byte, so that labels
read back as text) with ChatML's special tokens added: built offline, in milliseconds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from lightning_oomb.core.errors import SetupError
from lightning_oomb.data.chat import ChatDataError, ChatRenderer, best_fit, read_conversations

BYTE_TOKENIZER = Path(__file__).resolve().parents[1] / "examples" / "byte_tokenizer" / "tokenizer.json"

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# ChatML with transformers' generation markers around what an assistant turn trains.
MARKED = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}"
          "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
          "{% else %}{{ m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# SmolLM2-135M-Instruct's template as its tokenizer_config.json ships it (ChatML, a default system prompt).
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
           "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

TALK = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And Italy?"},
    {"role": "assistant", "content": "Rome."},
]
# By hand: each assistant turn's content and its <|im_end|>; not its '<|im_start|>assistant\n' header, not the
# newline after <|im_end|>, nothing of the system or user turns.
ASSISTANT = ["Paris.<|im_end|>", "Rome.<|im_end|>"]
RENDERED = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
            "<|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>user\nAnd Italy?<|im_end|>\n"
            "<|im_start|>assistant\nRome.<|im_end|>\n")


def make_tokenizer(template: str | None = CHATML):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(BYTE_TOKENIZER), eos_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template
    return tok


def save_tokenizer(path: Path, template: str | None = CHATML) -> Path:
    make_tokenizer(template).save_pretrained(path)
    return path


def labelled(tok, conv) -> list[str]:
    """The runs of labelled tokens, as text."""
    runs, run = [], []
    for t, keep in zip(conv.ids + [None], conv.trained + [False]):
        if keep:
            run.append(t)
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs


@pytest.mark.parametrize("template", [MARKED, CHATML], ids=["generation-markers", "chatml-prefixes"])
def test_assistant_turns_are_labelled_as_written_by_hand(template):
    tok = make_tokenizer(template)
    renderer = ChatRenderer(tok, "assistant")
    assert renderer.markers == (template is MARKED)
    conv = renderer.render(TALK, "row")
    assert tok.decode(conv.ids) == RENDERED
    assert labelled(tok, conv) == ASSISTANT
    assert sum(conv.trained) == sum(len(s.encode()) - len("<|im_end|>") + 1 for s in ASSISTANT)
    last = ChatRenderer(tok, "last_assistant").render(TALK, "row")
    assert labelled(tok, last) == ["Rome.<|im_end|>"]
    everything = ChatRenderer(tok, "all").render(TALK, "row")
    assert everything.ids == conv.ids and all(everything.trained)


def test_smollm2_template_labels_the_assistant_not_its_default_system_prompt():
    # SmolLM2's template on the byte tokenizer with SmolLM2's special tokens: its own BPE tokenizer is not
    # available offline (the GGUF of examples/smollm2-passkey-64k.yaml is downloaded by hand).
    tok = make_tokenizer(SMOLLM2)
    conv = ChatRenderer(tok, "assistant").render(TALK[1:], "row")
    assert tok.decode(conv.ids).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert labelled(tok, conv) == ASSISTANT
    assert labelled(tok, ChatRenderer(tok, "assistant").render(TALK, "row")) == ASSISTANT


@pytest.mark.parametrize("template, match", [
    # Assistant turns end without a special token: where a turn ends is not found.
    ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
     "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}", "no special token"),
    # Earlier turns rendered differently once later ones follow (as templates that drop past reasoning do).
    ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}{% if loop.last %}{{ '!' }}"
     "{% endif %}{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
     "{% endif %}", "not render assistant turns as a prefix"),
    # Generation markers that wrap one span for two assistant turns.
    ("{% generation %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' }}"
     "{% endfor %}{% endgeneration %}", "mark 1 spans for 2 assistant messages"),
], ids=["no-end-of-turn-token", "not-prefix-stable", "markers-miscount"])
def test_templates_whose_turns_cannot_be_found_are_refused(template, match):
    with pytest.raises(ChatDataError, match=match) as e:
        ChatRenderer(make_tokenizer(template), "assistant").render(TALK, "f.jsonl, line 3")
    assert str(e.value).startswith("f.jsonl, line 3: ") and "\n" not in str(e.value)


def bpe_tokenizer(end_of_turn_eats_newline: bool = False):
    """A byte-level BPE tokenizer trained here on words and newlines, with ChatML's special tokens; merges make
    how a piece of text tokenizes depend on what follows it, which the byte tokenizer's never does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = "the river stone bright secret letter keep later ok sure what was it\n".split(" ")
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(40)) for i in range(200)]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", AddedToken("<|im_end|>", rstrip=end_of_turn_eats_newline, special=True)]})
    tok.chat_template = CHATML
    return tok


def prefix_spans_tokenizing_each_prefix_whole(renderer, messages):
    """The definition turn-by-turn rendering follows, at its quadratic cost: each assistant turn's header and
    turn rendered and tokenized whole, both prefixes of the conversation's tokens."""
    ids = renderer._ids(renderer._text(messages, "row"))
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = renderer._ids(renderer._text(messages[:k], "row", prompt=True))
        through = renderer._ids(renderer._text(messages[: k + 1], "row"))
        if through != ids[: len(through)] or head != through[: len(head)]:
            return ids, None
        end = next(t + 1 for t in range(len(head), len(through)) if through[t] in renderer.special)
        spans.append((len(head), end))
    return ids, spans


@pytest.mark.parametrize("eats_newline", [False, True], ids=["pieces-apart", "end-of-turn-eats-newline"])
def test_turn_by_turn_spans_equal_each_prefix_tokenized_whole(eats_newline):
    # A long many-turn conversation: the spans found from the pieces between special tokens equal those of
    # tokenizing every growing prefix whole; where the end-of-turn token swallows the newline after it (the
    # pieces do not tokenize apart), every prefix is tokenized whole.
    tok = bpe_tokenizer(eats_newline)
    words = "the river stone bright secret letter keep later".split()
    talk = [{"role": "system", "content": "keep the secret letter."}]
    for turn in range(30):
        talk.append({"role": "user", "content": " ".join(words[(turn + j) % 8] for j in range(3 + turn % 5))})
        talk.append({"role": "assistant", "content": ["ok.", "sure", "the river\n\nstone", "what"][turn % 4]})
    renderer = ChatRenderer(tok, "assistant")
    ids, spans = prefix_spans_tokenizing_each_prefix_whole(renderer, talk)
    assert spans is not None and len(spans) == 30
    conv = renderer.render(talk, "row")
    assert conv.ids == ids
    assert conv.trained == [any(a <= t < b for a, b in spans) for t in range(len(ids))]
    assert labelled(tok, conv)[:3] == ["ok.<|im_end|>", "sure<|im_end|>", "the river\n\nstone<|im_end|>"]


def test_tokenizer_without_template_is_refused():
    with pytest.raises(ChatDataError, match="no chat template"):
        ChatRenderer(make_tokenizer(None))


def test_bad_rows_name_the_file_the_row_and_the_fix(tmp_path):
    good = json.dumps({"messages": TALK})
    cases = {
        "missing": ('{"text": "hi"}', "line 2: no 'messages' field (found: text)"),
        "empty": ('{"messages": []}', "line 2: the conversation is empty"),
        "json": ('{"messages": [', "line 2: not valid JSON"),
        "content": ('{"messages": [{"role": "user"}]}', "message 0 (role 'user') has content of type NoneType"),
    }
    for name, (row, match) in cases.items():
        f = tmp_path / f"{name}.jsonl"
        f.write_text(good + "\n" + row + "\n")
        with pytest.raises(ChatDataError, match=re.escape(match)) as e:
            list(read_conversations(f))
        assert str(f) in str(e.value) and isinstance(e.value, SetupError)  # SetupError: the CLI exits 2
    # A role the template does not know: refused by the template, or left out of its rendering.
    strict = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
              "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}{{ '<|im_start|>' + m['role'] + '\n' + "
              "m['content'] + '<|im_end|>\n' }}{% endfor %}")
    odd = TALK[:2] + [{"role": "narrator", "content": "Meanwhile."}] + TALK[2:]
    with pytest.raises(ChatDataError, match="row 7: the chat template refuses .*Unknown role: narrator"):
        ChatRenderer(make_tokenizer(strict)).render(odd, "row 7")
    silent = CHATML.replace("{{ '<|im_start|>'", "{% if m['role'] != 'narrator' %}{{ '<|im_start|>'").replace(
        "<|im_end|>\n' }}{% endfor %}", "<|im_end|>\n' }}{% endif %}{% endfor %}")
    with pytest.raises(ChatDataError, match="row 7: the chat template does not render message 2 .role 'narrator'"):
        ChatRenderer(make_tokenizer(silent)).render(odd, "row 7")
    with pytest.raises(ChatDataError, match="no assistant message"):
        ChatRenderer(make_tokenizer()).render(TALK[:2], "row 1")


def test_best_fit_puts_each_item_in_the_fullest_bin_it_fits():
    # Decreasing: 6 opens a bin, 5 another, 4 a third; 3 goes with 5 (room 3, the fullest that fits), 2 with 6
    # (room 2), 1 with 4 (rooms left: 0, 0, 4 -> only 4's bin fits).
    bins = best_fit([5, 3, 4, 2, 6, 1], 8)
    assert sorted(sorted(b) for b in bins) == [[0, 1], [2, 5], [3, 4]]


def conversations(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Question {i}?" + " more" * (i % 4)},
                          {"role": "assistant", "content": f"Answer {i}." + " yes" * (i % 3)}]} for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_datamodule_packs_whole_conversations_with_document_masking(tmp_path):
    import lightning_oomb

    tok_dir = save_tokenizer(tmp_path / "tok")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = conversations(12)
    write_jsonl(tmp_path / "chats" / "a.jsonl", rows[:4])
    pq.write_table(pa.Table.from_pylist(rows[4:8]), tmp_path / "chats" / "b.parquet")
    # A folder as datasets' save_to_disk writes it: Arrow IPC streams named in state.json.
    saved = tmp_path / "saved"
    saved.mkdir()
    with pa.ipc.new_stream(str(saved / "data-00000-of-00001.arrow"), pa.Table.from_pylist(rows[8:]).schema) as w:
        w.write_table(pa.Table.from_pylist(rows[8:]))
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    dm = lightning_oomb.ChatDataModule([str(tmp_path / "chats"), str(saved)], tokenizer=str(tok_dir), seq_len=128,
                                       batch_size=2)
    dm.setup("fit")
    renderer = ChatRenderer(dm.tokenizer)
    convs = [renderer.render(r["messages"], "") for r in rows]
    assert dm.num_documents == 12 and dm.num_labels == sum(sum(c.trained) for c in convs)
    assert f"{dm.num_labels:,} labelled" in dm.describe() and "padding" in dm.describe()
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["input_ids"].shape == (2, 128)
    seen = []
    for ids, labels, pos in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
        starts = (pos == 0).nonzero().flatten().tolist() + [128]
        for s, e in zip(starts[:-1], starts[1:]):
            assert pos[s:e].tolist() == list(range(e - s))
            seen.append((ids[s:e].tolist(), (labels[s:e] != -100).tolist()))
    by_ids = {tuple(c.ids): c.trained for c in convs}
    packed = [(i, t) for i, t in seen if tuple(i) in by_ids]
    assert packed and all(by_ids[tuple(i)] == t for i, t in packed)  # whole conversations, their labels intact
    # Every conversation in exactly one sequence.
    every = [tuple(dm.train_set.conversations[c].ids) for b in dm.train_set.bins for c in b]
    assert sorted(every) == sorted(by_ids)
    # val_fraction holds out whole conversations.
    held = lightning_oomb.ChatDataModule([str(tmp_path / "chats"), str(saved)], tokenizer=str(tok_dir), seq_len=128,
                                         val_fraction=0.25)
    held.setup("fit")
    parts = [[tuple(d.conversations[c].ids) for b in d.bins for c in b] for d in (held.train_set, held.val_set)]
    assert len(parts[1]) == 3 and sorted(parts[0] + parts[1]) == sorted(by_ids)


def test_conversations_longer_than_seq_len_are_counted_and_refused_or_truncated(tmp_path):
    import lightning_oomb

    tok_dir = save_tokenizer(tmp_path / "tok")
    rows = conversations(5)
    f = write_jsonl(tmp_path / "c.jsonl", rows)
    lengths = [len(ChatRenderer(make_tokenizer()).render(r["messages"], "").ids) for r in rows]
    seq_len = sorted(lengths)[2]
    over = sum(n > seq_len for n in lengths)
    first = 1 + next(i for i, n in enumerate(lengths) if n > seq_len)
    dm = lightning_oomb.ChatDataModule([str(f)], tokenizer=str(tok_dir), seq_len=seq_len)
    with pytest.raises(ChatDataError, match=rf"^{over} conversations are longer than data.init_args.seq_len {seq_len} "
                                            rf"\(the first: .*c.jsonl, line {first}: "):
        dm.setup("fit")
    dm = lightning_oomb.ChatDataModule([str(f)], tokenizer=str(tok_dir), seq_len=seq_len, truncate=True)
    dm.setup("fit")
    assert dm.num_documents == 5 and all(len(c.ids) <= seq_len for c in dm.train_set.conversations)


@pytest.mark.parametrize("loss_reduction", ["token", "sequence"])
def test_packed_step_equals_the_conversations_trained_separately(tmp_path, loss_reduction):
    """token: the mean over the batch's labelled tokens; sequence: each conversation's own mean (transformers'
    loss of it alone), averaged over the conversations."""
    import lightning_oomb
    from tiny_models import assert_grads_close, grads_of, rel_err, tiny_model

    tok_dir = save_tokenizer(tmp_path / "tok")
    rows = conversations(7)
    f = write_jsonl(tmp_path / "c.jsonl", rows)
    dm = lightning_oomb.ChatDataModule([str(f)], tokenizer=str(tok_dir), seq_len=128, batch_size=len(rows),
                                       loss_reduction=loss_reduction)
    dm.setup("fit")
    assert len(dm.train_set) < len(rows)  # some sequences hold several conversations, starting mid-chunk
    batch = next(iter(dm.train_dataloader()))
    assert ("loss_weights" in batch) == (loss_reduction == "sequence")
    model = tiny_model("qwen2", vocab_size=len(dm.tokenizer))
    loss = lightning_oomb.train_step(model, batch["input_ids"], batch["labels"], position_ids=batch["position_ids"],
                                     loss_weights=batch.get("loss_weights"), chunk_size=16, page_size=8,
                                     attention="reference")
    got = grads_of(model)
    # The oracle: each conversation alone through transformers, its labels straight from the renderer.
    renderer = ChatRenderer(dm.tokenizer)
    convs = [renderer.render(r["messages"], "") for r in rows]
    examples = [(torch.tensor([c.ids]), torch.tensor([[t if k else -100 for t, k in zip(c.ids, c.trained)]]))
                for c in convs]
    n_labels = sum(int((lab[:, 1:] != -100).sum()) for _, lab in examples)
    model.zero_grad(set_to_none=True)
    want_loss = torch.zeros(())
    for ids, lab in examples:
        if loss_reduction == "sequence":
            out = model(input_ids=ids, labels=lab).loss / len(examples)
        else:
            out = model(input_ids=ids, labels=lab, num_items_in_batch=n_labels).loss
        out.backward()
        want_loss += out.detach()
    assert rel_err(loss, want_loss) <= 1e-5, (loss.item(), want_loss.item())
    assert_grads_close(got, grads_of(model), 1e-5)


@pytest.mark.parametrize("loss_reduction", ["token", "sequence"])
def test_one_cli_step_on_packed_conversations_is_the_step_of_the_conversations_alone(tmp_path, loss_reduction):
    """`lightning-oomb fit` as a user runs it (a model directory, ChatDataModule, OOMBStrategy, SGD at 64, one
    step of one batch holding every packed sequence, export): the exported weights moved by 64 x transformers'
    gradient of the conversations trained alone, each labelled by the renderer (fp32, 1e-5)."""
    import yaml
    from safetensors.torch import load_file

    import lightning_oomb
    from lightning_oomb.cli import main
    from tiny_models import assert_grads_close, grads_of, tiny_model

    tok_dir = save_tokenizer(tmp_path / "tok")
    rows = conversations(7)
    f = write_jsonl(tmp_path / "c.jsonl", rows)
    dm = lightning_oomb.ChatDataModule([str(f)], tokenizer=str(tok_dir), seq_len=128)
    dm.setup("fit")
    model = tiny_model("qwen2", vocab_size=len(dm.tokenizer))
    model.save_pretrained(tmp_path / "model")
    dm.tokenizer.save_pretrained(tmp_path / "model")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "precision": "32-true", "max_steps": 1, "logger": False,
                    "default_root_dir": str(tmp_path), "enable_checkpointing": False, "enable_progress_bar": False,
                    "enable_model_summary": False, "num_sanity_val_steps": 0,
                    "strategy": {"class_path": "lightning_oomb.OOMBStrategy",
                                 "init_args": {"chunk_size": 16, "page_size": 8, "attention": "reference"}}},
        "model": {"pretrained": str(tmp_path / "model"), "optimizer": "sgd", "learning_rate": 64.0,
                  "weight_decay": 0.0, "warmup_steps": 0},
        "data": {"class_path": "lightning_oomb.ChatDataModule",
                 "init_args": {"paths": [str(f)], "seq_len": 128, "batch_size": len(dm.train_set),
                               "loss_reduction": loss_reduction, "token_cache": False}},
    }
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(path), "--export_dir", str(tmp_path / "export")]) in (None, 0)
    after = load_file(str(tmp_path / "export" / "model.safetensors"))
    moved = {n: (start[n] - after[n]) / 64 for n in start if n in after}  # a large step: little lost to rounding

    renderer = ChatRenderer(dm.tokenizer)
    examples = []
    for r in rows:
        c = renderer.render(r["messages"], "")
        examples.append((torch.tensor([c.ids]), torch.tensor([[t if k else -100 for t, k in zip(c.ids, c.trained)]])))
    n_labels = sum(int((lab[:, 1:] != -100).sum()) for _, lab in examples)
    for ids, lab in examples:
        if loss_reduction == "sequence":
            (model(input_ids=ids, labels=lab).loss / len(examples)).backward()
        else:
            model(input_ids=ids, labels=lab, num_items_in_batch=n_labels).loss.backward()
    want = grads_of(model)
    assert_grads_close({n: moved[n] for n in want}, want, 1e-5)


def test_cli_fits_on_conversations_and_exits_2_on_a_bad_row(tmp_path, capsys, caplog):
    import yaml

    from lightning_oomb.cli import main

    tok_dir = save_tokenizer(tmp_path / "tok")
    f = write_jsonl(tmp_path / "c.jsonl", conversations(8))
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "precision": "32-true", "max_steps": 2, "logger": False,
                    "default_root_dir": str(tmp_path),
                    "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
                    "num_sanity_val_steps": 0,
                    "strategy": {"class_path": "lightning_oomb.OOMBStrategy",
                                 "init_args": {"chunk_size": 32, "page_size": 16}}},
        "model": {"config": {"model_type": "qwen2", "vocab_size": 259, "hidden_size": 32, "intermediate_size": 48,
                             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2},
                  "learning_rate": 1e-3},
        "data": {"class_path": "lightning_oomb.ChatDataModule",
                 "init_args": {"paths": [str(f)], "tokenizer": str(tok_dir), "seq_len": 128, "batch_size": 2}},
    }
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(path), "--export", "false"]) in (None, 0)
    capsys.readouterr()
    assert main(["fit", "--config", str(path), "--export", "false",
                 "--data.init_args.loss_reduction", "sequence"]) in (None, 0)
    assert "the training loss averages conversations" in caplog.text
    capsys.readouterr()
    assert main(["fit", "--config", str(path), "--export", "false", "--data.init_args.loss_reduction", "mean"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.splitlines()[-1] == (
        "lightning-oomb: error: data.init_args.loss_reduction must be one of token, sequence, got 'mean'")
    with f.open("a") as out:
        out.write('{"messages": [\n')
    capsys.readouterr()
    assert main(["fit", "--config", str(path), "--export", "false"]) == 2
    assert f"{f}, line 9: not valid JSON" in capsys.readouterr().err


def test_tokenizer_of_a_gguf_model_comes_from_its_file(tmp_path, monkeypatch):
    # A GGUF model's directory may hold only the .gguf file (examples/smollm2-chat-64k.yaml): without
    # data.init_args.tokenizer the tokenizer, chat template included, is read from model.gguf_file there.
    from types import SimpleNamespace

    import lightning_oomb
    import lightning_oomb.lightning.chat as chat

    f = write_jsonl(tmp_path / "c.jsonl", conversations(3))
    asked = []
    monkeypatch.setattr(chat, "load_tokenizer", lambda *a, **k: asked.append((a, k)) or make_tokenizer())
    module = SimpleNamespace(hparams={"pretrained": str(tmp_path), "gguf_file": "m.gguf"},
                             model=SimpleNamespace(config=SimpleNamespace(vocab_size=259)))
    dm = lightning_oomb.ChatDataModule([str(f)], seq_len=128)
    monkeypatch.setattr(dm, "_trainer_or_none", lambda: SimpleNamespace(lightning_module=module))
    dm.setup("fit")
    assert asked == [((str(tmp_path), "model.pretrained"), {"gguf_file": "m.gguf"})] and dm.num_documents == 3
    # A tokenizer directory named in the data options is read as it is, whatever the model was loaded from.
    asked.clear()
    dm = lightning_oomb.ChatDataModule([str(f)], tokenizer=str(tmp_path), seq_len=128)
    monkeypatch.setattr(dm, "_trainer_or_none", lambda: SimpleNamespace(lightning_module=module))
    dm.setup("fit")
    assert [a for a, _ in asked] == [(str(tmp_path),)]
