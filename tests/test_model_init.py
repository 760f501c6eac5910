"""Fast start: CausalLMModule builds only the model's structure, on the meta device, at construction, and its
weights in ``configure_model`` on the strategy's device (random init from ``seed``, or the checkpoint's).

The reference is the model as CausalLMModule built it before, eagerly on the CPU: the materialised one must
have the same parameters, dtypes and buffers (RoPE's non-persistent ``inv_freq`` included), on the CPU the
same weights bit for bit (so the demo's numbers stay), and with the same weights the same logits.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_oomb import CausalLMModule
from lightning_oomb.core.model_shape import ModelShape
from lightning_oomb.lightning.module import SetupError
from lightning_oomb.integrations.transformers import find_causal_lm
from test_corpus import make_model_dir

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA = dict(TINY, model_type="llama", rope_theta=5e5, tie_word_embeddings=True)


def eager(config: dict, seed: int = 0, dtype: torch.dtype = torch.float32, lora_rank: int = 0) -> torch.nn.Module:
    """The model as CausalLMModule built it before configure_model existed: eagerly, on the CPU."""
    fields = dict(config)
    model_type = fields.pop("model_type")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))
    model.to(dtype)
    if lora_rank:
        import peft

        targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
        model = peft.get_peft_model(model, peft.LoraConfig(r=lora_rank, lora_alpha=16.0, target_modules=targets))
    return model.train()


def non_persistent_buffers(model: torch.nn.Module) -> set[str]:
    return {f"{name}.{b}" if name else b for name, m in model.named_modules() for b in m._non_persistent_buffers_set}


def assert_same_structure(got: torch.nn.Module, want: torch.nn.Module) -> None:
    """Same parameters (names, shapes, dtypes, requires_grad) and the same buffers, bit for bit."""
    got_p, want_p = dict(got.named_parameters()), dict(want.named_parameters())
    assert got_p.keys() == want_p.keys()
    for name, p in want_p.items():
        q = got_p[name]
        assert (q.shape, q.dtype, q.requires_grad) == (p.shape, p.dtype, p.requires_grad), name
    got_b, want_b = dict(got.named_buffers()), dict(want.named_buffers())
    assert got_b.keys() == want_b.keys() and non_persistent_buffers(got) == non_persistent_buffers(want)
    assert any(name.endswith("inv_freq") for name in non_persistent_buffers(want))  # the case that matters
    for name, b in want_b.items():
        assert got_b[name].dtype == b.dtype and torch.equal(got_b[name], b), name


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, TINY["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("model_type, adapted", [("qwen2", {"q_proj", "k_proj", "v_proj", "o_proj"}),
                                                  ("phi3", {"qkv_proj", "o_proj"})])
def test_lora_adapts_the_attention_projections_the_model_has(model_type, adapted):
    """Without lora_target_modules, LoRA goes on every attention projection by the model's own names: Phi-3's
    fused qkv_proj too, not o_proj alone."""
    module = CausalLMModule(config=dict(TINY, model_type=model_type, pad_token_id=0), lora_rank=4)
    names = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in module.model.named_parameters() if "lora_A" in n}
    assert names == adapted
    adapters = sum(p.numel() for n, p in module.model.named_parameters() if "lora_" in n)
    assert ModelShape.resolve(module.model).lora_params(4) == adapters  # what the planner counts


def test_construction_builds_only_the_structure():
    rng = torch.get_rng_state()
    module = CausalLMModule(config=TINY, lora_rank=4)
    assert torch.equal(torch.get_rng_state(), rng)  # no random draws at construction
    assert not module.is_materialized
    assert all(t.is_meta for t in [*module.parameters(), *module.buffers()])
    # What runs before fit works on the structure: the config, module names, LoRA wrapping.
    assert find_causal_lm(module).config.vocab_size == TINY["vocab_size"]
    assert dict(module.model.named_parameters()).keys() == dict(eager(TINY, lora_rank=4).named_parameters()).keys()
    assert {n for n, p in module.model.named_parameters() if p.requires_grad} == {
        n for n, p in module.model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("config", [TINY, LLAMA], ids=["qwen2", "llama-tied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_materialized_model_is_the_eager_one(config, dtype, capsys):
    want = eager(config, seed=3, dtype=getattr(torch, dtype))
    rng_after_eager = torch.get_rng_state()
    torch.manual_seed(123)  # the module's seed decides, not the global state
    module = CausalLMModule(config=config, dtype=dtype, seed=3)
    module.materialize()
    assert module.is_materialized
    got = module.model
    assert_same_structure(got, want)
    for name, p in want.state_dict().items():
        assert torch.equal(got.state_dict()[name], p), name  # CPU: the same weights as before, bit for bit
    assert torch.equal(torch.get_rng_state(), rng_after_eager)  # and the global RNG where it was left before
    if config.get("tie_word_embeddings"):
        assert got.lm_head.weight is got.model.embed_tokens.weight
    assert got.training
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"model: built {config['model_type']} from model.config (") and line.endswith(", seed 3")
    assert f" params, {dtype}) on cpu in " in line

    # The forward depends on the buffers too: with the eager weights copied in, identical logits.
    eager_weights = eager(config, seed=99, dtype=getattr(torch, dtype))
    got.load_state_dict(eager_weights.state_dict())
    assert torch.equal(logits(got), logits(eager_weights))


def test_seed_decides_the_weights():
    def weights(seed):
        module = CausalLMModule(config=TINY, seed=seed)
        module.materialize("cpu")
        return module.model.state_dict()

    a, b, c = weights(0), weights(0), weights(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])


def test_lora_adapters_initialised_by_peft():
    pytest.importorskip("peft")
    want = eager(TINY, seed=0, lora_rank=4)
    module = CausalLMModule(config=TINY, lora_rank=4)
    module.materialize()
    got = module.model
    assert type(got) is type(want)
    assert_same_structure(got, want)
    lora = {n: p for n, p in got.named_parameters() if "lora_" in n}
    assert len(lora) == 2 * 4 * 2  # A and B of q, k, v, o in 2 layers
    for name, p in lora.items():
        if "lora_B" in name:
            assert not p.any(), name  # B starts at 0: the adapted model is the base model
        else:
            assert p.abs().sum() > 0, name
    for name, p in want.state_dict().items():
        assert torch.equal(got.state_dict()[name], p), name


MOE = dict(TINY, model_type="qwen3_moe", head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def adapted(module: CausalLMModule) -> set[str]:
    """What carries trainable adapters in the first decoder layer: module paths below it."""
    names = (n.split("layers.0.")[1] for n, p in module.model.named_parameters() if p.requires_grad and "layers.0." in n)
    return {n.split(".lora_")[0].replace(".base_layer", "") for n in names}


def test_lora_on_expert_parameters():
    """lora_target_parameters adapts the fused 3-D expert weights through peft, next to the attention
    projections (or alone, with lora_target_modules: []); the model starts as the base model."""
    pytest.importorskip("peft")
    module = CausalLMModule(config=MOE, lora_rank=4, lora_target_parameters=EXPERTS)
    assert adapted(module) == {"mlp.experts", *(f"self_attn.{p}_proj" for p in "qkvo")}
    module = CausalLMModule(config=MOE, lora_rank=4, lora_target_modules=[], lora_target_parameters=EXPERTS)
    assert adapted(module) == {"mlp.experts"}
    module.materialize()
    base = eager(MOE)
    assert torch.equal(logits(module.model), logits(base))  # peft's B starts at 0
    experts = module.model.base_model.model.model.layers[0].mlp.experts
    # one adapter pair per stacked weight: A (rank x experts, in), B (out, rank x experts)
    shapes = {n: tuple(p.shape) for n, p in experts.named_parameters() if "lora_" in n}
    assert sorted(shapes.values()) == sorted([(16, 32), (32, 16), (16, 16), (32, 16)])


@pytest.mark.parametrize("options,match", [
    (dict(lora_target_parameters=["mlp.experts.gate_proj"]),
     "'mlp.experts.gate_proj' names no parameter of the model; its stacked expert weights are "
     "mlp.experts.down_proj, mlp.experts.gate_up_proj"),
    (dict(lora_target_parameters=["self_attn.q_norm.weight"]), "a 1-D parameter"),
    (dict(lora_target_parameters="mlp.experts.down_proj"), "must be a non-empty list of parameter names"),
    (dict(lora_rank=0, lora_target_parameters=EXPERTS), r"set model.lora_rank > 0"),
    (dict(config=TINY, lora_target_parameters=EXPERTS), "has no stacked expert weights"),
])
def test_lora_target_parameters_refused_in_one_line(options, match):
    pytest.importorskip("peft")
    with pytest.raises(SetupError, match=match) as info:
        CausalLMModule(**{"config": MOE, "lora_rank": 4, **options})
    assert "\n" not in str(info.value)


def test_lora_target_parameters_needs_a_peft_that_has_them(monkeypatch):
    """An older peft (LoraConfig without target_parameters): refused at construction, naming the version."""
    import dataclasses
    import importlib.machinery
    import sys
    import types

    old = types.ModuleType("peft")
    old.__spec__ = importlib.machinery.ModuleSpec("peft", None)
    old.__version__ = "0.16.0"
    old.LoraConfig = dataclasses.make_dataclass("LoraConfig", [("r", int, 8), ("target_modules", list, None)])
    monkeypatch.setitem(sys.modules, "peft", old)
    with pytest.raises(SetupError, match=r"needs peft >= 0.17.*installed: peft 0.16.0: pip install -U 'peft>=0.17'"):
        CausalLMModule(config=MOE, lora_rank=4, lora_target_parameters=EXPERTS)


def test_precision_dtype_is_the_build_dtype():
    """Under bf16-true Lightning sets bfloat16 as default dtype around configure_model: the weights are built
    in it, never as a float32 copy first."""
    module = CausalLMModule(config=TINY)  # model.dtype float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        module.configure_model()
    finally:
        torch.set_default_dtype(default)
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    want = eager(TINY, dtype=torch.bfloat16)  # what bf16-true made of the float32 model before
    assert_same_structure(module.model, want)


def test_trainer_configures_the_model_once(tmp_path, capsys):
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from lightning_oomb import OOMBStrategy

    module = CausalLMModule(config=TINY, learning_rate=1e-2)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, TINY["vocab_size"], (1, 16), generator=g)), "labels": ids}
            for _ in range(2)]
    trainer = Trainer(max_steps=2, accelerator="cpu", strategy=OOMBStrategy(chunk_size=8, page_size=4, device="cpu"),
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(data, batch_size=None), DataLoader(data, batch_size=None))
    model = module.model
    trainer.validate(module, DataLoader(data, batch_size=None), verbose=False)
    assert module.model is model  # validate kept the trained model
    out = capsys.readouterr().out
    assert out.count("model: built qwen2 from model.config") == 1, out

    # load_from_checkpoint calls configure_model, then loads the trained weights into the built model.
    restored = CausalLMModule.load_from_checkpoint(next(tmp_path.rglob("*.ckpt")))
    assert restored.is_materialized
    for name, p in model.state_dict().items():
        assert torch.equal(restored.model.state_dict()[name], p), name


def test_pretrained_loads_in_configure_model(tmp_path, capsys):
    directory = make_model_dir(tmp_path / "model")
    module = CausalLMModule(pretrained=str(directory))
    assert not module.is_materialized and find_causal_lm(module).config.hidden_size == 32
    capsys.readouterr()
    module.materialize()
    want = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    assert_same_structure(module.model, want)
    for name, p in want.state_dict().items():
        assert torch.equal(module.model.state_dict()[name], p), name
    assert module.model.training
    out = capsys.readouterr().out
    assert f"model: loaded {directory} (" in out and " params, float32) onto cpu in " in out


def test_pretrained_errors_are_one_line(tmp_path):
    directory = make_model_dir(tmp_path / "model")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(directory, no_weights)
    (no_weights / "model.safetensors").unlink()
    no_config = tmp_path / "no_config"
    shutil.copytree(directory, no_config)
    (no_config / "config.json").unlink()
    for path, message in [(tmp_path / "absent", "does not exist"), (no_config, "has no config.json"),
                          (no_weights, "has no weights")]:
        with pytest.raises(SetupError, match=message):  # at construction, before any data is prepared
            CausalLMModule(pretrained=str(path))

    corrupt = tmp_path / "corrupt"
    shutil.copytree(directory, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    module = CausalLMModule(pretrained=str(corrupt))
    with pytest.raises(SetupError, match=f"the model in {corrupt} could not be loaded") as info:
        module.materialize()
    assert "\n" not in str(info.value)


def test_7b_structure_in_seconds():
    config = json.loads((ROOT / "lightning_oomb" / "model_shapes" / "qwen2.5-7b.json").read_text())
    config.pop("architectures")
    started = time.perf_counter()
    module = CausalLMModule(config=config, dtype="bfloat16")
    seconds = time.perf_counter() - started
    assert sum(p.numel() for p in module.parameters()) == 7_615_616_512 and not module.is_materialized
    assert seconds < 30, seconds  # an eager CPU build took minutes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_materialized_on_cuda_is_a_model_built_there():
    def built():
        module = CausalLMModule(config=TINY, seed=5)
        with torch.device("cuda"):  # what Lightning's tensor_init_context sets around configure_model
            module.configure_model()
        return module.model

    a, b = built(), built()
    assert {p.device.type for p in [*a.parameters(), *a.buffers()]} == {"cuda"}
    assert all(torch.equal(p, b.state_dict()[n]) for n, p in a.state_dict().items())  # same seed, same device
    torch.manual_seed(5)
    with torch.device("cuda"):
        want = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY))
    assert_same_structure(a, want)
    assert all(torch.equal(p, want.state_dict()[n]) for n, p in a.state_dict().items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_7b_materializes_on_cuda_in_seconds():
    """A random-init Qwen2.5-7B under bf16-true, which takes minutes to build on the CPU (5 min 25 s)."""
    config = json.loads((ROOT / "lightning_oomb" / "model_shapes" / "qwen2.5-7b.json").read_text())
    config.pop("architectures")
    module = CausalLMModule(config=config)
    torch.cuda.synchronize()
    started = time.perf_counter()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as Lightning's bf16-true around configure_model
    try:
        with torch.device("cuda"):
            module.configure_model()
    finally:
        torch.set_default_dtype(default)
    seconds = time.perf_counter() - started
    assert {(p.device.type, p.dtype) for p in module.parameters()} == {("cuda", torch.bfloat16)}
    assert seconds < 60, seconds
    del module
    torch.cuda.empty_cache()


def test_schedule_steps_fixes_the_cosine_length():
    """model.schedule_steps: the cosine reaches 0 there, whatever the Trainer's max_steps (extending a run with a
    larger max_steps keeps the learning rate on the same curve)."""
    from lightning.pytorch import Trainer

    module = CausalLMModule(config=TINY, learning_rate=1.0, warmup_steps=2, schedule_steps=10)
    module.materialize()
    module.trainer = Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False)
    scheduler = module.configure_optimizers()["lr_scheduler"]["scheduler"]
    factors = [scheduler.lr_lambdas[0](step) for step in (0, 1, 6, 10, 12)]
    assert factors == pytest.approx([0.5, 1.0, 0.5, 0.0, 0.0])
    with pytest.raises(ValueError, match="model.schedule_steps must be >= 1"):
        CausalLMModule(config=TINY, schedule_steps=0)


def test_new_token_ids_start_at_the_mean_of_the_other_embedding_rows():
    """As resize_token_embeddings initialises added tokens: the rows of ``new_token_ids`` equal, at the mean of
    the other rows, which keep the seed's values."""
    plain, new = CausalLMModule(config=TINY, seed=3), CausalLMModule(config=TINY, seed=3, new_token_ids=[3, 4, 5])
    plain.materialize("cpu")
    new.materialize("cpu")
    before, after = (m.model.get_input_embeddings().weight.detach() for m in (plain, new))
    others = torch.ones(TINY["vocab_size"], dtype=torch.bool)
    others[3:6] = False
    assert torch.equal(after[others], before[others])
    torch.testing.assert_close(after[3:6], before[others].mean(0, keepdim=True).expand(3, -1), rtol=0, atol=1e-7)
    for bad in ([], [64], [-1], list(range(64))):
        with pytest.raises(SetupError, match="model.new_token_ids must be ids in"):
            CausalLMModule(config=TINY, new_token_ids=bad)


def test_config_fields_given_as_text_are_read_as_yaml_would():
    """--model.config.hidden_size 128 reaches model.config as the text '128' (jsonargparse cannot know the type
    of a dict's value): numbers, booleans and 1e-5 are read as what they spell."""
    from lightning_oomb.lightning.module import config_from_dict

    config = config_from_dict({"model_type": "qwen2", "hidden_size": "128", "rms_norm_eps": "1e-5",
                               "tie_word_embeddings": "false", "num_attention_heads": 4})
    assert (config.hidden_size, config.rms_norm_eps, config.tie_word_embeddings) == (128, 1e-5, False)
