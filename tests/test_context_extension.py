"""Context extension of a pretrained model: GGUF loading, config overrides (RoPE scaling), the English passkey
task, held-out accuracy at several lengths, and the summary of such runs."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from transformers import AutoConfig, AutoModelForCausalLM

import lightning_oomb
from lightning_oomb.core.errors import SetupError
from lightning_oomb.lightning.corpus import CorpusError
from lightning_oomb.lightning.passkey_text import PasskeyTextDataModule, PasskeyTextDataset
from tiny_models import assert_grads_close, full_sequence_grads, grads_of, rel_err

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = str(ROOT / "examples" / "byte_tokenizer")  # one token per byte: " 12345" is 6 tokens
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 128}


def tiny_llama():
    config = AutoConfig.for_model("llama", vocab_size=300, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def write_gguf(model, folder: Path, name: str = "tiny.gguf") -> Path:
    """``model`` (llama) as llama.cpp writes it: float32 tensors under GGUF names, q/k rows permuted."""
    gguf = pytest.importorskip("gguf")
    c = model.config
    writer = gguf.GGUFWriter(str(folder / name), "llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_vocab_size(c.vocab_size)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}

    def permute(w, heads):  # llama.cpp's rotary layout, which transformers undoes on loading
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        for ours, theirs in names.items():
            w = state[f"model.layers.{i}.{ours}.weight"]
            if theirs in ("attn_q", "attn_k"):
                w = permute(w, c.num_attention_heads if theirs == "attn_q" else c.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{theirs}.weight", np.ascontiguousarray(w))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return folder / name


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    source = tiny_llama()
    write_gguf(source, folder)
    return folder, source


def test_gguf_file_loads_the_model_it_holds(gguf_dir):
    folder, source = gguf_dir
    module = lightning_oomb.CausalLMModule(pretrained=str(folder), gguf_file="tiny.gguf")
    module.materialize("cpu")
    got, want = module.model.state_dict(), source.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_a_model_loaded_from_gguf_exports_as_a_plain_model(gguf_dir, tmp_path):
    """Its weights are unpacked: nothing of the GGUF loader stays attached, so the export (save_pretrained)
    writes an ordinary directory holding the same weights."""
    folder, source = gguf_dir
    module = lightning_oomb.CausalLMModule(pretrained=str(folder), gguf_file="tiny.gguf")
    module.materialize("cpu")
    assert getattr(module.model, "hf_quantizer", None) is None
    assert all(type(m).__name__ in ("Linear", "Embedding") or not hasattr(m, "weight") or type(m).__name__.endswith(
        "RMSNorm") for m in module.model.modules())
    module.model.save_pretrained(tmp_path)
    again = lightning_oomb.CausalLMModule(pretrained=str(tmp_path))
    again.materialize("cpu")
    for name, want in source.state_dict().items():
        torch.testing.assert_close(again.model.state_dict()[name], want, rtol=0, atol=0)


def test_config_overrides_set_rope_scaling(gguf_dir):
    folder, _ = gguf_dir
    module = lightning_oomb.CausalLMModule(pretrained=str(folder), gguf_file="tiny.gguf", config_overrides={
        "rope_parameters": YARN, "max_position_embeddings": 512})
    module.materialize("cpu")
    rotary = module.model.model.rotary_emb
    assert module.model.config.max_position_embeddings == 512 and rotary.rope_type == "yarn"
    assert rotary.attention_scaling > 1.0  # YaRN's temperature, which the chunked RoPE must apply as well


def test_yarn_scaled_model_matches_full_sequence():
    """The chunked step of a RoPE-scaled model (YaRN: other frequencies and a cos/sin scale) against transformers'
    full-sequence loss and gradients, float32."""
    torch.manual_seed(0)
    config = tiny_llama().config
    config.rope_parameters = dict(YARN)
    config.max_position_embeddings = 512
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, 300, (1, 300))
    want_loss, want = full_sequence_grads(model, ids)
    loss = lightning_oomb.train_step(model, ids, chunk_size=64, page_size=16, attention="reference")
    assert rel_err(loss, want_loss) <= 1e-5
    assert_grads_close(grads_of(model), want, 1e-5)


@pytest.mark.parametrize("kwargs,message", [
    ({"gguf_file": "nope.gguf"}, "model.gguf_file: {dir} has no file nope.gguf; it holds tiny.gguf"),
    ({"gguf_file": "tiny.gguf", "config_overrides": {"rope_scailing": {}}}, "config has no field 'rope_scailing'"),
    ({}, "set model.gguf_file: tiny.gguf"),
])
def test_bad_pretrained_options_are_one_line(gguf_dir, kwargs, message):
    folder, _ = gguf_dir
    with pytest.raises(SetupError, match=None) as info:
        lightning_oomb.CausalLMModule(pretrained=str(folder), **kwargs)
    assert message.format(dir=folder) in str(info.value) and "\n" not in str(info.value)


def test_gguf_options_need_pretrained_and_the_package(gguf_dir, monkeypatch):
    folder, _ = gguf_dir
    with pytest.raises(SetupError, match="model.gguf_file applies to model.pretrained"):
        lightning_oomb.CausalLMModule(config={"model_type": "llama"}, gguf_file="tiny.gguf")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(SetupError, match=r"needs the gguf package: pip install 'lightning-oomb\[gguf\]'"):
        lightning_oomb.CausalLMModule(pretrained=str(folder), gguf_file="tiny.gguf")


# == the English passkey task ==============================================================================


def test_passkey_text_layout():
    from lightning_oomb.lightning.corpus import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER)
    data = PasskeyTextDataset(tokenizer, size=20, seq_len=900, key_window=300, key_digits=5, seed=3)
    assert data.answer_tokens == 6
    for i in range(20):
        item = data[i]
        ids, labels = item["input_ids"], item["labels"]
        assert ids.shape == labels.shape == (900,)
        text = tokenizer.decode(ids)
        key = tokenizer.decode(ids[-5:])
        assert key.isdigit() and len(key) == 5 and key[0] != "0"
        assert (labels[:-6] == -100).all() and torch.equal(labels[-6:], ids[-6:])
        statement = f"The pass key is {key}. Remember it. {key} is the pass key."
        assert text.count(key) == 3 and text.index(statement) + len(statement) <= 300
        assert text.endswith(f"What is the pass key? The pass key is {key}")
    assert torch.equal(data[4]["input_ids"], data[4]["input_ids"])  # item i is drawn from its own seed


def test_passkey_text_refusals():
    with pytest.raises(CorpusError, match="model.answer_tokens is 5 .* set model.init_args.answer_tokens: 6"):
        data = PasskeyTextDataModule(seq_len=600, tokenizer=TOKENIZER, key_window=300)

        class Module:
            hparams = {"answer_tokens": 5}

        class FakeTrainer:
            lightning_module = Module()

        data.trainer = FakeTrainer()
        data.setup("fit")
    with pytest.raises(CorpusError, match="key_window 20 cannot hold the intro and the statement"):
        PasskeyTextDataModule(seq_len=600, tokenizer=TOKENIZER, key_window=20).setup("fit")


def test_held_out_accuracy_by_length_through_a_trainer(gguf_dir, tmp_path):
    """A fit with validation at two lengths logs val/retrieval_acc_<length> for each (the callback sizes its
    page pool for the longest), and the summary reads them back from TensorBoard."""
    from lightning_oomb.bench.context_extension import main as summarize

    folder, _ = gguf_dir
    module = lightning_oomb.CausalLMModule(pretrained=str(folder), gguf_file="tiny.gguf", answer_tokens=6,
                                           learning_rate=1e-3, config_overrides={"rope_parameters": YARN,
                                                                                 "max_position_embeddings": 512})
    data = PasskeyTextDataModule(seq_len=320, val_lengths=[320, 640], tokenizer=TOKENIZER, key_window=240,
                                 val_size=2, train_size=8)
    logger = TensorBoardLogger(tmp_path / "runs", name="exact-0")
    trainer = Trainer(accelerator="cpu", max_steps=2, val_check_interval=2, num_sanity_val_steps=0, logger=logger,
                      log_every_n_steps=1,
                      strategy=lightning_oomb.OOMBStrategy(chunk_size=64, page_size=16), enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=data)
    logged = trainer.callback_metrics
    for length in ("320", "640"):
        assert 0.0 <= float(logged[f"val/retrieval_acc_{length}"]) <= 1.0
        assert float(logged[f"val/loss_{length}"]) > 0
    # the example the CLI prints after fit is each loader's first sequence, recorded during validation
    for held_out in data.val_sets:
        answer, key = module.val_examples[held_out.seq_len]
        assert len(answer) == 6 and key == held_out[0]["input_ids"][-6:].tolist()
    assert summarize([str(tmp_path / "runs"), "--out", str(tmp_path / "summary"), "--train-length", "320"]) == 0
    summary = json.loads((tmp_path / "summary" / "summary.json").read_text())
    accuracy = summary["exact-0"]["acc"]
    assert sorted(accuracy) == ["320", "640"] and summary["exact-0"]["steps"] == 2
    assert accuracy["640"][-1][1] == pytest.approx(float(logged["val/retrieval_acc_640"]))
    assert "| exact-0 | 2 |" in (tmp_path / "summary" / "summary.md").read_text()
