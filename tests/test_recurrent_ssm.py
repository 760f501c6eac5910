"""Models with no attention layer at all: Mamba, Falcon-Mamba (Mamba-1 mixers, lightning_oomb.recurrent.mamba1)
and Mamba-2 (lightning_oomb.recurrent.mamba2), every layer's state carried across the chunk borders and no K/V
page anywhere, against transformers' own model over the whole sequence, float32 on the CPU (its torch scans):
the loss and every gradient, generation, LoRA, and the plan."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.mamba2.modeling_mamba2")

from test_recurrent import assert_trains_as_full_sequence  # noqa: E402

FAMILIES = ("mamba", "falcon_mamba", "mamba2")


def ssm_config(family: str):
    """Two layers, hidden 32, the mixers 64 wide, SSM state 8, convolution window 4. Mamba-2: 4 heads of 16 in 2
    groups, scan chunks of 16 tokens, time steps clamped to [1e-3, 0.5]."""
    from transformers import FalconMambaConfig, Mamba2Config, MambaConfig

    shared = dict(hidden_size=32, state_size=8, num_hidden_layers=2, vocab_size=101, conv_kernel=4)
    if family == "mamba2":
        return Mamba2Config(**shared, num_heads=4, head_dim=16, expand=2, n_groups=2, chunk_size=16,
                            time_step_limit=(1e-3, 0.5))
    config_class = MambaConfig if family == "mamba" else FalconMambaConfig
    return config_class(**shared, intermediate_size=64, time_step_rank=4, use_mambapy=False)


def tiny_ssm(family: str, seed: int = 0):
    """A tiny ``family`` model (``ssm_config``), float32, weights widened so the scan's gates matter."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(ssm_config(family)).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("chunk", [8, 5])
@pytest.mark.parametrize("family", FAMILIES)
def test_state_space_models_train_step_equals_full_sequence_training(family, chunk):
    """Every layer's state (the convolution's last inputs and the SSM state) carried across chunks of 8 (dividing
    40 tokens) and 5 (not dividing; Mamba-2's scan chunks are 16), batch of two with masked labels: the loss and
    every gradient of transformers' full-sequence training within 1e-5."""
    torch.manual_seed(2)
    ids = torch.randint(3, 101, (2, 40))
    labels = ids.clone()
    labels[0, :7] = -100
    labels[1, 34:] = -100
    assert_trains_as_full_sequence(tiny_ssm(family), ids, labels, chunk_size=chunk, page_size=4)


def test_mamba_chunks_shorter_than_the_convolution_window():
    """Chunks of 2 tokens (shorter than the 3 inputs before a token the convolution reads) over 21: the same."""
    torch.manual_seed(3)
    ids = torch.randint(3, 101, (1, 21))
    assert_trains_as_full_sequence(tiny_ssm("mamba"), ids, None, chunk_size=2, page_size=4)


def test_mamba_in_bfloat16_reads_its_float32_residual_stream_as_the_head_does():
    """bf16 weights, the residual stream in float32 (residual_in_fp32), cast to bf16 before lm_head: each
    gradient of train_step within twice the error of transformers' own bf16 run against float32, plus 2e-3."""
    from tiny_models import rel_err

    from lightning_oomb import train_step

    model32 = tiny_ssm("mamba")
    ids = torch.randint(3, 101, (1, 24))
    model32(input_ids=ids, labels=ids).loss.backward()
    model16 = tiny_ssm("mamba").to(torch.bfloat16)
    model16(input_ids=ids, labels=ids).loss.backward()
    plain = {n: p.grad.float() for n, p in model16.named_parameters()}
    model16.zero_grad(set_to_none=True)
    train_step(model16.train(), ids, chunk_size=8, page_size=4)
    for (name, p), p32 in zip(model16.named_parameters(), model32.parameters()):
        assert rel_err(p.grad.float(), p32.grad) <= 2 * rel_err(plain[name], p32.grad) + 2e-3, name


def test_a_model_without_attention_takes_no_page():
    """A Mamba-2 step's pool holds no layer and no byte: nothing attends."""
    from lightning_oomb import ChunkConfig
    from lightning_oomb.core.schedule import ChunkedSequence

    seq = ChunkedSequence(tiny_ssm("mamba2").train(), torch.randint(3, 101, (1, 16)),
                          config=ChunkConfig(chunk_size=8, page_size=4))
    seq.fill()
    assert seq.kv_slots == {} and seq.pool.spec.n_layers == 0 and seq.pool.nbytes == 0
    seq.backward()


def test_falcon_mamba_lora_on_the_mixers_projections():
    """LoRA adapters (peft) on the mixers' in, x and dt projections (peft refuses out_proj on Mamba models): every
    adapter's gradient as in transformers' full-sequence training, within 1e-5."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_ssm("falcon_mamba"), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=["in_proj", "x_proj", "dt_proj"]))
    assert any("x_proj.lora_A" in n for n, p in model.named_parameters() if p.requires_grad)
    torch.manual_seed(4)
    ids = torch.randint(3, 101, (1, 33))
    assert_trains_as_full_sequence(model, ids, None, chunk_size=8, page_size=4)


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_generate_equals_transformers_greedy_search(family):
    """lightning_oomb.generate over carried states alone (the prompt in chunks of 8, then one token at a time):
    the tokens of transformers' own greedy search with its cache, batch of two."""
    from lightning_oomb import generate

    model = tiny_ssm(family).eval()
    torch.manual_seed(3)
    ids = torch.randint(3, 101, (2, 29))
    want = model.generate(ids, do_sample=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=0)
    assert torch.equal(generate(model, ids, max_new_tokens=10, eos_token_id=-1, chunk_size=8, page_size=4), want)


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_plan_of_a_model_without_attention_has_no_pages(family, tmp_path, capsys):
    """lightning-oomb plan on a Mamba or Mamba-2 directory (Mamba-2's config.json holds time_step_limit's
    infinity as transformers writes it): no K/V or KV-gradient pages, the border states a bf16 step keeps (what
    border_state_bytes counts on the bf16 model), and every parameter of the model counted."""
    from lightning_oomb.cli import main
    from lightning_oomb.core.model_shape import ModelShape
    from lightning_oomb.recurrent import border_state_bytes

    config = ssm_config(family)
    if family == "mamba2":
        config.time_step_limit = (0.0, float("inf"))
    config.save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--context", "4K", "--gpu-memory", "79GiB"]) in (0, None)
    out = capsys.readouterr().out
    assert not [line for line in out.splitlines() if line.strip().startswith(("K/V pages", "KV-gradient pages"))]
    out = " ".join(out.split())
    assert f"Note: every layer carries a state across chunk borders ({family}): no layer attends" in out
    shape = ModelShape.from_path(tmp_path)
    model = tiny_ssm(family).to(torch.bfloat16)
    assert (shape.kv_layers, shape.n_heads, shape.kv_bytes_per_token(torch.bfloat16)) == (0, 0, 0)
    assert shape.carried_state_bytes == border_state_bytes(model, batch=1, chunks=1)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
