"""QLoRA (``CausalLMModule(quantization="nf4", lora_rank=...)``): base weights in 4 bits through bitsandbytes,
LoRA adapters through peft, trained by the chunked engine with the quantised model's full-sequence gradient.

On the CPU bitsandbytes computes its 4-bit layers in float32, so the comparison with transformers is within
1e-5 as everywhere else; on a GPU in bf16, within twice transformers' own bf16 error.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_oomb
from lightning_oomb import CausalLMModule, OOMBStrategy
from lightning_oomb.lightning import SetupError
from test_training_cli import assets  # noqa: F401 (the tiny local model and corpus, a fixture)
from tiny_models import BACKENDS, VOCAB, assert_grads_close, full_sequence_grads, grads_of, rel_err, tiny_model

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

TOL = 1e-5
TINY = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LORA = dict(lora_rank=4, lora_alpha=8.0)


def model_dir(path, dtype: torch.dtype = torch.float32):
    """tiny_model's Qwen2 (widened init, q/k/v biases) saved with save_pretrained."""
    tiny_model("qwen2").to(dtype).save_pretrained(path)
    return str(path)


def quantized(module: CausalLMModule, device: str = "cpu", seed: int = 1) -> nn.Module:
    """The module's model materialised, with LoRA's B drawn at random (it starts at zero) so that the
    adapters change the forward and every adapter gets a gradient."""
    module.materialize(device)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return module.model


def four_bit_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The packed 4-bit weights (uint8) by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if getattr(p, "quant_state", None) is not None}


def batch_with_ignored_labels(batch: int = 2, seq_len: int = 37, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=g)
    labels = ids.clone()
    labels[0, :11] = -100
    labels[-1, 30:] = -100
    return ids, labels


CASES = [pytest.param("nf4", "reference", id="nf4"),
         pytest.param({"quant_type": "fp4", "double_quant": True}, "reference", id="fp4-double-quant")]
if "triton" in BACKENDS:  # the fused ops too (Triton's interpreter on the CPU)
    CASES.append(pytest.param("nf4", "triton", id="nf4-triton"))


@pytest.mark.parametrize("quantization,attention", CASES)
def test_lora_gradient_is_the_quantized_models_full_sequence_gradient(quantization, attention, tmp_path):
    """5 chunks of 8 (the last of 5), two sequences with ignored labels: the loss and every adapter's gradient
    against transformers' full-sequence backward of the same 4-bit model (measured: 5e-7 to 7e-7). With the
    fused ops the MLP's 4-bit down projection runs its own forward."""
    from bitsandbytes.nn import Linear4bit

    model = quantized(CausalLMModule(pretrained=model_dir(tmp_path), quantization=quantization, **LORA))
    decoder = model.get_base_model().get_decoder()
    base_layers = [m for m in decoder.modules() if isinstance(m, Linear4bit)]
    assert len(base_layers) == 2 * 7  # q, k, v, o, gate, up, down in 2 layers
    assert all(m.weight.dtype == torch.uint8 and not m.weight.requires_grad for m in base_layers)
    # The engine swaps only plain nn.Linear for its accumulating linears: here the adapters' A and B alone.
    assert all("lora_" in n for n, m in decoder.named_modules() if type(m) is nn.Linear)

    ids, labels = batch_with_ignored_labels()
    want_loss, want = full_sequence_grads(model, ids, labels)
    assert want and all("lora_" in n for n in want) and len(want) == 2 * 4 * 2  # A and B of q, k, v, o
    loss = lightning_oomb.train_step(model, ids, labels, chunk_size=8, page_size=4, attention=attention)
    assert rel_err(loss, want_loss) <= TOL, (loss.item(), want_loss.item())
    assert_grads_close(grads_of(model), want, TOL)


def test_config_model_is_quantized_as_a_saved_one_would_be(tmp_path):
    """With ``model.config`` the 4-bit weights are those of the same random model (same seed) saved and
    loaded through BitsAndBytesConfig; its other weights are that model's, bit for bit."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    plain = CausalLMModule(config=TINY, seed=3)
    plain.materialize()
    module = CausalLMModule(config=TINY, seed=3, quantization="nf4", **LORA)
    module.materialize()
    plain.model.save_pretrained(tmp_path)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    want = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=bnb, device_map={"": "cpu"})
    got = module.model.get_base_model().state_dict()
    want_state = want.state_dict()
    names = [n.replace(".base_layer", "") for n in got if "lora_" not in n]
    assert sorted(names) == sorted(want_state) and any(n.endswith(".weight.absmax") for n in names)
    for name, tensor in got.items():
        if "lora_" not in name:
            assert torch.equal(tensor, want_state[name.replace(".base_layer", "")]), name
    assert torch.equal(got["model.embed_tokens.weight"], plain.model.model.embed_tokens.weight)


def test_bf16_true_trainer_keeps_the_4bit_weights(capsys):
    """Lightning's bf16-true converts the module to bf16 (``module.to(dtype)``): the packed 4-bit weights and
    their quantisation state stay as they are (uint8, float32 scales), the layers compute in bf16, the other
    frozen weights are bf16 and the adapters train in float32 (``lora_dtype``); with a validation loop (eval
    mode, no gradients) between steps."""
    from bitsandbytes.nn import Linear4bit

    module = CausalLMModule(config=TINY, quantization="nf4", learning_rate=1e-2, **LORA)
    trainer = fit(module, precision="bf16-true", max_steps=3, val_check_interval=2, limit_val_batches=1)
    assert "linear layers in nf4; LoRA rank 4" in capsys.readouterr().out
    layers = [m for m in module.model.modules() if isinstance(m, Linear4bit)]
    assert layers and all(m.weight.dtype == torch.uint8 and m.compute_dtype == torch.bfloat16 for m in layers)
    assert all(m.weight.quant_state.absmax.dtype == torch.float32 for m in layers)
    trained = {n: p for n, p in module.model.named_parameters() if p.requires_grad}
    assert trained and all(p.dtype == torch.float32 for p in trained.values())
    assert all(p.dtype in (torch.bfloat16, torch.uint8) for p in module.model.parameters() if not p.requires_grad)
    assert any(p.abs().sum() > 0 for n, p in trained.items() if "lora_B" in n)  # B starts at 0: trained
    assert trainer.global_step == 3 and torch.isfinite(trainer.callback_metrics["val/loss"])

    # The same 4-bit weights as a fresh build: training and the bf16 conversion left them as quantised.
    fresh = CausalLMModule(config=TINY, quantization="nf4", **LORA)
    with torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)  # as Lightning's bf16-true builds in configure_model
        try:
            fresh.materialize()
        finally:
            torch.set_default_dtype(torch.float32)
    want = four_bit_weights(fresh.model)
    assert want and all(torch.equal(w, want[n]) for n, w in four_bit_weights(module.model).items())


# == checkpoints =================================================================================================


def batches(n: int = 2, seq_len: int = 27, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (2, seq_len), generator=g)
        labels = ids.clone()
        labels[0, :5] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def fit(module, ckpt_path=None, callbacks=(), **trainer_kwargs):
    """``module`` trained by OOMBStrategy (chunks of 8: 27 tokens are 4 chunks, the last of 3) on the CPU."""
    from lightning.pytorch import Trainer

    kwargs = dict(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=bool(callbacks),
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  limit_val_batches=0, strategy=OOMBStrategy(chunk_size=8, page_size=4), callbacks=list(callbacks))
    kwargs.update(trainer_kwargs)
    trainer = Trainer(**kwargs)
    val = DataLoader(batches(1, seed=9), batch_size=None)
    trainer.fit(module, DataLoader(batches(), batch_size=None), val, ckpt_path=ckpt_path)
    return trainer


def test_config_checkpoint_holds_the_4bit_weights_and_resumes_bitwise(tmp_path):
    """With ``model.config`` the checkpoint holds every weight, the 4-bit ones with their quantisation state
    (nothing else could give them back); 2 steps, a stop, 2 more from the checkpoint give the weights and
    AdamW state of 4 steps run through, and loading the checkpoint into a module of another seed restores the
    checkpoint's 4-bit weights."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(folder, steps, ckpt_path=None):
        module = CausalLMModule(config=TINY, quantization="nf4", learning_rate=1e-2, schedule_steps=4, **LORA)
        checkpoint = ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0, every_n_train_steps=2)
        fit(module, ckpt_path=ckpt_path, callbacks=[checkpoint], max_steps=steps)
        return torch.load(folder / "last.ckpt", map_location="cpu", weights_only=True)

    want = run(tmp_path / "whole", 4)
    state = want["state_dict"]
    assert "frozen_weights" not in want and any(k.endswith(".weight.quant_state.bitsandbytes__nf4") for k in state)
    run(tmp_path / "halves", 2)
    got = run(tmp_path / "halves", 4, ckpt_path=tmp_path / "halves" / "last.ckpt")
    assert got["global_step"] == want["global_step"] == 4 and got["state_dict"].keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(got["state_dict"][name], tensor), name
    for a, b in zip(got["optimizer_states"][0]["state"].values(), want["optimizer_states"][0]["state"].values()):
        assert all(torch.equal(a[key], b[key]) for key in b)

    other = CausalLMModule.load_from_checkpoint(tmp_path / "whole" / "last.ckpt", seed=7)
    loaded = other.state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())
    ids, labels = batch_with_ignored_labels()
    want_loss, want_grads = full_sequence_grads(other.model, ids, labels)  # restored quantisation states compute
    loss = lightning_oomb.train_step(other.model, ids, labels, chunk_size=8, page_size=4)
    assert rel_err(loss, want_loss) <= TOL
    assert_grads_close(grads_of(other.model), want_grads, TOL)


def test_cli_exports_the_adapter_and_resumes_bitwise(assets, tmp_path, capsys):
    """``lightning-oomb fit`` with ``model.quantization`` (a dict in the YAML) on a local model directory: the
    checkpoint holds the adapters alone (neither the 4-bit weights nor their quantisation state, which resuming
    takes from ``model.pretrained`` again) and resumes bit for bit; the export is the adapter alone (the 4-bit
    base is neither saved nor merged), which peft loads onto the base quantised again."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from test_training_cli import EVERY, load, run_dir, write_config
    from test_training_cli import fit as cli_fit

    qlora = dict(lora_rank=4, lora_target_modules=["q_proj", "v_proj"], quantization={"quant_type": "nf4"})
    whole = write_config(tmp_path / "whole", assets, **qlora)
    assert cli_fit(whole, "--trainer.max_steps", str(2 * EVERY)) is None
    printed = capsys.readouterr().out
    want = load(run_dir(tmp_path / "whole") / "checkpoints" / "last.ckpt")
    assert want["state_dict"] and all("lora_" in name for name in want["state_dict"])
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(assets["model"], quantization_config=bnb, device_map={"": "cpu"})
    assert want["frozen_weights"] == {"pretrained": str(assets["model"]), "tensors": len(base.state_dict())}

    export = run_dir(tmp_path / "whole") / "hf_export"
    assert sorted(p.name for p in export.glob("*.safetensors")) == ["adapter_model.safetensors"]
    assert "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')" in printed
    model = PeftModel.from_pretrained(base, export)
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(lora) == 2 * 2 * 2  # A and B of q and v in 2 layers
    for name, p in lora.items():
        assert torch.equal(p, want["state_dict"]["model." + name]), name
    assert any(p.abs().sum() > 0 for n, p in lora.items() if "lora_B" in n)  # B starts at 0: trained

    halves = write_config(tmp_path / "halves", assets, **qlora)
    assert cli_fit(halves, "--trainer.max_steps", str(EVERY)) is None
    assert cli_fit(halves, "--trainer.max_steps", str(2 * EVERY), "--ckpt_path", "last") is None
    got = load(run_dir(tmp_path / "halves") / "checkpoints" / "last.ckpt")
    assert got["global_step"] == want["global_step"] == 2 * EVERY
    assert got["state_dict"].keys() == want["state_dict"].keys()
    for name, tensor in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], tensor), name
    for a, b in zip(got["optimizer_states"][0]["state"].values(), want["optimizer_states"][0]["state"].values()):
        assert all(torch.equal(a[key], b[key]) for key in b)


# == what the planner counts ======================================================================================


def tiny_moe():
    """A random Qwen2-MoE: in its first layer 4 experts of width 16 and a shared expert of 24 (with its gate), in
    its second a dense MLP (``mlp_only_layers``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**TINY, "model_type": "qwen2_moe"}, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=16, shared_expert_intermediate_size=24, mlp_only_layers=[1])
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
@pytest.mark.parametrize("quantization", ["nf4", {"quant_type": "fp4", "double_quant": True}])
def test_planner_counts_the_weight_bytes_bitsandbytes_holds(quantization, family, tmp_path):
    """`plan(..., quantization=...)`'s weight lines against what bitsandbytes allocated for a random
    llama-shaped model quantised on the CPU (an MLP width of 49 leaves each MLP matrix's last absmax block half
    full) and a mixture of experts with a dense layer, whose experts and routers (nn.Parameters, no nn.Linear)
    stay float32: the 4-bit line is every Params4bit's packed codes and its quant_state's tensors (absmax and the
    type's map; with double quantisation the 8-bit absmax, the nested absmax, offset and map), the other line
    every other parameter (embeddings, lm_head, norms, experts, routers, LoRA's float32 adapters). Within 0.1%
    (today: to the byte)."""
    from lightning_oomb.core.plan import plan

    (tiny_model("llama", intermediate_size=49) if family == "llama" else tiny_moe()).save_pretrained(tmp_path)
    model = quantized(CausalLMModule(pretrained=str(tmp_path), quantization=quantization, **LORA))
    four_bit = other = 0
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        if state is None:
            other += p.numel() * p.element_size()
            continue
        nested = [state.offset, state.state2.absmax, state.state2.code] if state.nested else []
        four_bit += sum(t.numel() * t.element_size() for t in [p.data, state.absmax, state.code, *nested])
    step = plan(model, 64, lora_rank=LORA["lora_rank"], quantization=quantization, precision="32-true",
                gpu_memory=2**40, host_memory=2**40)
    planned_4 = next(v for k, v in step.gpu_lines.items() if k.startswith("weights (4-bit"))
    planned_other = next(v for k, v in step.gpu_lines.items() if k.startswith("weights (fp32"))
    assert planned_4 == pytest.approx(four_bit, rel=1e-3) and planned_other == pytest.approx(other, rel=1e-3)
    # The plan a step makes of the model itself (fit start, every step: core.placement.place_step) reads its
    # quantisation from the model's config: the same lines.
    from lightning_oomb.core.config import ChunkConfig
    from lightning_oomb.core.placement import place_step

    placed = place_step(model, 1, 64, ChunkConfig(chunk_size=32, page_size=16), torch.device("cpu")).plan
    assert {k: v for k, v in placed.gpu_lines.items() if k.startswith("weights")} == {
        k: v for k, v in step.gpu_lines.items() if k.startswith("weights")}


# == bad input ===================================================================================================


def test_refused_before_the_model_loads(monkeypatch, tmp_path):
    cases = [
        (dict(quantization="nf4"), r"set model.lora_rank > 0"),
        (dict(quantization="int4", **LORA), r"quant_type must be one of nf4, fp4.*'int4'"),
        (dict(quantization={"quant_type": "nf4", "bits": 4}, **LORA), r"takes a 4-bit type .* got bits"),
        (dict(quantization={"double_quant": "yes"}, **LORA), r"double_quant must be true or false"),
        (dict(quantization="nf4", gguf_file="m.gguf", pretrained=str(tmp_path), config=None, **LORA),
         r"model.gguf_file loads a GGUF file dequantised"),
    ]
    for kwargs, message in cases:
        with pytest.raises(SetupError, match=message):
            CausalLMModule(**{"config": TINY, **kwargs})
    from lightning.pytorch import Trainer

    module = CausalLMModule(config=TINY, quantization="nf4", **LORA)
    module.trainer = Trainer(accelerator="cpu", devices=2, strategy="oomb_model_parallel", logger=False)
    with pytest.raises(SetupError, match="oomb_model_parallel does not shard 4-bit weights"):
        module.setup("fit")  # Lightning's setup hook, before configure_model loads the weights
    assert not module.is_materialized
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(SetupError, match=r"needs bitsandbytes, not installed here: pip install "
                                         r"'lightning-oomb\[qlora\]'"):
        CausalLMModule(config=TINY, quantization="nf4", **LORA)


# == on a GPU ====================================================================================================


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_qlora_within_full_sequence_bf16_error(tmp_path):
    """bf16 QLoRA on the GPU (Triton attention and fused ops; the fused MLP falls back to the 4-bit down
    projection's own forward), against transformers' full-sequence bf16 run of the same 4-bit model: each
    adapter's gradient within twice that run's error, both measured against the float32-compute run of the
    same 4-bit weights."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path)  # one set of 4-bit weights
    model32 = quantized(CausalLMModule(pretrained=str(tmp_path), dtype="float32", quantization="nf4", lora_rank=16),
                        "cuda")
    model16 = quantized(CausalLMModule(pretrained=str(tmp_path), dtype="bfloat16", quantization="nf4", lora_rank=16),
                        "cuda")
    assert all(torch.equal(w, four_bit_weights(model32)[n]) for n, w in four_bit_weights(model16).items())
    adapters = {n: p for n, p in model16.named_parameters() if p.requires_grad}
    assert all(p.dtype == torch.float32 for p in adapters.values())  # as lora_dtype "float32" trains them
    with torch.no_grad():  # the same adapters in both (peft draws A from the global RNG)
        for name, p in model32.named_parameters():
            if p.requires_grad:
                adapters[name].copy_(p)
    ids = torch.randint(0, config.vocab_size, (1, 3000), device="cuda")

    _, truth = full_sequence_grads(model32, ids)
    _, plain = full_sequence_grads(model16, ids)
    for checkpoint in (False, True):
        model16.zero_grad(set_to_none=True)
        lightning_oomb.train_step(model16, ids, chunk_size=512, page_size=128, checkpoint_layers=checkpoint)
        ours = grads_of(model16)
        assert ours.keys() == truth.keys() == adapters.keys()
        for name in truth:
            plain_err, our_err = rel_err(plain[name], truth[name]), rel_err(ours[name], truth[name])
            assert our_err <= 2 * plain_err + 2e-3, (checkpoint, name, our_err, plain_err)
