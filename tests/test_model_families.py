"""The general path (integrations/support.py): families beyond llama/qwen/mistral train exactly (sliding windows,
attention sinks, experts and their load-balancing loss included), the fused ops fall back where a family's
modules compute something else, and what cannot be exact is refused in one line.
Float32 on CPU, against transformers' own full-sequence training of the same tiny random model."""

import itertools
import re
import warnings

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import lightning_oomb
from lightning_oomb.core import schedule
from lightning_oomb.core.errors import SetupError
from lightning_oomb.integrations import fused_ops, support
from tiny_models import (BACKENDS, COMMON, CONFIGS, FAMILIES, VOCAB, assert_grads_close, assert_served_matches,
                         full_sequence_grads, grads_of, rel_err, separate_documents_grads, tiny_model)

TOL = 1e-5
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def check_against_full(model, ids, labels=None, **kwargs):
    want_loss, want = full_sequence_grads(model, ids, labels)
    loss = lightning_oomb.train_step(model, ids, labels, **kwargs)
    assert rel_err(loss, want_loss) <= TOL, (loss.item(), want_loss.item())
    assert_grads_close(grads_of(model), want, TOL)


def check_against_separate_documents(model, lengths, **kwargs):
    """One sequence of documents of ``lengths`` tokens packed by position_ids, against each trained alone; returns
    its ids (1, sum(lengths))."""
    ids = torch.randint(0, VOCAB, (1, sum(lengths)))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    want_loss, want = separate_documents_grads(model, ids, position_ids)
    loss = lightning_oomb.train_step(model, ids, position_ids=position_ids, **kwargs)
    assert rel_err(loss, want_loss) <= TOL
    assert_grads_close(grads_of(model), want, TOL)
    return ids


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_full_sequence(family, backend):
    """Uneven last chunk, pages that cut chunks, -100 labels."""
    model = tiny_model(family)
    ids = torch.randint(0, VOCAB, (1, 37))
    labels = ids.clone()
    labels[0, :9] = -100
    check_against_full(model, ids, labels, chunk_size=8, page_size=3, attention=backend)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_with_layer_checkpoints(family):
    model = tiny_model(family)
    check_against_full(model, torch.randint(0, VOCAB, (2, 21)), chunk_size=8, page_size=4, checkpoint_layers=True)


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_moe", "phi3"])
def test_family_with_lora(family):
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings():
        # peft's own weight conversion for qwen3_moe's fused experts adds rank and alpha patterns for gate_up_proj,
        # which "all-linear" does not target, and warns that they matched nothing (peft's to reconcile).
        unmatched = re.escape(str([r".*\.gate_up_proj"]))
        warnings.filterwarnings("ignore", rf"The following (rank|alpha)_pattern keys did not match any targeted "
                                          rf"module and were ignored: {unmatched}", RuntimeWarning)
        model = peft.get_peft_model(tiny_model(family), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():  # LoRA's B starts at zero; make the adapters matter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    check_against_full(model, torch.randint(0, VOCAB, (1, 30)), chunk_size=8, page_size=4)


EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def with_expert_lora(family):
    """tiny_model(family) with its load-balancing loss, under peft LoRA on q, v and the fused 3-D expert weights
    (target_parameters: peft adds B @ A to each stacked weight for the experts' forward); B not zero."""
    peft = pytest.importorskip("peft")
    model = tiny_model(family, output_router_logits=True, router_aux_loss_coef=0.5)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_PARAMETERS)
    model = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sum(".experts." in n for n in trained) == 4 * model.config.num_hidden_layers  # A, B of both stacks
    return model


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_lora_on_experts_matches_full_sequence(family, backend):
    """LoRA on the experts' stacked weights (CausalLMModule's lora_target_parameters), with the load-balancing
    loss: the loss and every adapter's gradient, uneven last chunk, pages that cut chunks, with and without
    layer checkpoints, and through the served forward OOMBStrategy runs."""
    from lightning_oomb.core.config import ChunkConfig

    model = with_expert_lora(family)
    ids = torch.randint(0, VOCAB, (1, 37))
    labels = ids.clone()
    labels[0, :9] = -100
    check_against_full(model, ids, labels, chunk_size=8, page_size=3, attention=backend)
    if backend != "reference":  # the interpreter is slow; the reference covers the rest
        return
    model.zero_grad(set_to_none=True)
    check_against_full(model, ids, labels, chunk_size=8, page_size=3, checkpoint_layers=True)
    model.zero_grad(set_to_none=True)
    want_loss, want = full_sequence_grads(model, ids, labels)
    assert_served_matches(model, ChunkConfig(chunk_size=8, page_size=3), want_loss, want, TOL, input_ids=ids,
                          labels=labels)


def test_packed_documents_of_a_family_match_separate_documents():
    check_against_separate_documents(tiny_model("olmo2"), (13, 17), chunk_size=8, page_size=4)


@pytest.mark.skipif(not BACKENDS[1:], reason="the fused ops run in Triton steps (the interpreter on CPU)")
def test_fused_ops_swap_in_only_where_they_compute_the_same():
    """Llama-style RMSNorm, SwiGLU and RoPE are swapped; Gemma's x(1 + w) norm and GELU MLP, Phi-3's partial
    RoPE and StarCoder2's LayerNorm keep the model's own code."""
    def swapped(family):
        model = tiny_model(family)
        lm = model
        with fused_ops.fused_ops(lm):
            names = {type(m).__name__ for m in lm.modules() if "forward" in m.__dict__}
        return names

    assert {"Olmo2RMSNorm", "Olmo2MLP"} <= swapped("olmo2")
    assert not swapped("gemma3_text") and not swapped("starcoder2")
    assert "Phi3RMSNorm" in swapped("phi3") and "Phi3MLP" not in swapped("phi3")  # fused gate_up projection


def refuses(model, match, **kwargs):
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NotImplementedError, match=match):
        lightning_oomb.train_step(model, torch.randint(0, VOCAB, (1, 20)), chunk_size=8, **kwargs)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def build(model_type, **config):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **SPECIAL, **config})
    return AutoModelForCausalLM.from_config(cfg).train()


@pytest.mark.parametrize("model_type,config,match", [
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    ("kimi_linear", dict(), "layers of kind linear_attention"),  # its delta-rule layers are not carried
    ("bloom", dict(n_layer=1, n_head=2), r"BloomForCausalLM \(model_type 'bloom'\) adds ALiBi position biases"),
    ("mpt", dict(n_layers=1, n_heads=2, d_model=32), r"model_type 'mpt'\) adds ALiBi position biases"),
    ("falcon", dict(alibi=True), r"model_type 'falcon'\) adds ALiBi position biases"),
    ("phi3", dict(resid_pdrop=0.1), r"dropout in training mode \(model.layers.0.resid_attn_dropout, p=0.1\)"),
])
def test_what_cannot_be_exact_is_refused(model_type, config, match):
    refuses(build(model_type, **config), match)


def test_attention_in_the_models_own_code_is_refused():
    """MPT without ALiBi (learned positions) still computes its attention itself."""
    model = build("mpt", n_layers=1, n_heads=2, d_model=32, attn_config=dict(alibi=False))
    refuses(model, r"MptForCausalLM \(model_type 'mpt'\) computes attention in its own code, not through "
                   "transformers' AttentionInterface")


def test_a_loss_other_than_cross_entropy_of_the_head_is_refused(monkeypatch):
    """What no config field names is found by the probe: here a scale the engine is told to leave out."""
    from lightning_oomb.integrations.transformers import LogitHead

    monkeypatch.setattr(support, "logit_head", lambda lm: LogitHead())
    refuses(build("granite", logits_scaling=2.0), "logits differ from the cross-entropy of lm_head")


def test_attention_called_twice_per_layer_is_refused():
    """DiffLlama calls attention twice per layer, with the same keys and each half of its values (each as wide as
    the keys): pages that hold one value per layer and token would give both calls the second half's past."""
    refuses(build("diffllama"), r"DiffLlamaForCausalLM \(model_type 'diffllama'\) calls attention twice per layer, "
            r"with the same keys and each half of its values .*: not supported")


def test_a_chunked_forward_other_than_the_whole_is_refused(monkeypatch):
    """What no refusal names is found by the probe of the chunked forward against the whole-sequence one: here
    DiffLlama with its refusal by name taken away, whose chunked forward is another model. In one line, every
    time it is asked."""
    monkeypatch.setattr(support, "REPEATED_ATTENTION", {})
    model = build("diffllama")
    refuses(model, r"DiffLlamaForCausalLM \(model_type 'diffllama'\): its forward in chunks of 6 tokens over "
            r"lightning_oomb's K/V pages differs from its whole-sequence forward on 16 tokens: decoder layer 0's "
            r"output at position \d+, by up to .*; lightning_oomb would train it wrongly, not supported")
    with pytest.raises(NotImplementedError) as refused:
        schedule.check_chunked_forward(model)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_chunked_forward_probe_passes_the_trained_families(family):
    schedule.check_chunked_forward(tiny_model(family))


def test_the_chunked_forward_probe_runs_once_and_leaves_no_trace():
    """Once per model; the random number generators, the model's mode and gradients as they were; no pages."""
    model = tiny_model("qwen2")
    support.check_supported(model)
    calls = []
    model.model.layers[0].register_forward_hook(lambda *args: calls.append(1))
    rng = torch.get_rng_state()
    schedule.check_chunked_forward(model)
    assert calls and torch.equal(torch.get_rng_state(), rng)
    assert model.training and all(p.grad is None for p in model.parameters())
    assert schedule.cached_pool(model) is None
    calls.clear()
    schedule.check_chunked_forward(model.eval())
    assert not calls


# Causal LM families beyond FAMILIES, each at a tiny size of its own config fields, dropout off: trained exactly,
# or refused in one line (the expected message), never an error from inside the engine. GPT-SW3's checkpoints are
# gpt2's; GPT-BigCode's (StarCoder 1, SantaCoder) have one K/V head; JetMoE repeats its K/V heads for each of its
# attention experts. GPT-2, GPT-BigCode and OPT add learned absolute position embeddings of each chunk's positions.
# StableLM and Falcon call the AttentionInterface without their classes saying so (integrations/support.py,
# INTERFACE_WITHOUT_FLAG): StableLM here with its per-head q/k LayerNorms, parallel residual and RoPE on a quarter
# of the head; Falcon as Falcon-7B (one K/V head, parallel attention and MLP).
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
OTHER_FAMILIES = {
    "gpt2": (dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, **NO_DROPOUT), None),  # n_inner None: 4 x 32
    "gpt_bigcode": (dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, n_inner=48, **NO_DROPOUT), None),
    "opt": (dict(hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                 word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0), None),
    "ctrl": (dict(n_embd=32, dff=48, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0), None),
    "moshi": (dict(hidden_size=32, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=64, audio_vocab_size=32,
                   depth_decoder_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32)),
              None),
    "jetmoe": (dict(hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8, intermediate_size=48,
                    num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64), None),
    "diffllama": (COMMON, "calls attention twice per layer, with the same keys and each half of its values"),
    "stablelm": (dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, qk_layernorm=True, use_parallel_residual=True,
                      partial_rotary_factor=0.25, hidden_dropout=0.0, attention_dropout=0.0), None),
    "falcon": (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, hidden_dropout=0.0,
                    attention_dropout=0.0), None),
}


@pytest.mark.parametrize("model_type", list(OTHER_FAMILIES))
def test_other_families_train_exactly_or_are_refused_in_one_line(model_type):
    config, refusal = OTHER_FAMILIES[model_type]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{"vocab_size": VOCAB, **config,
                                                                                 **SPECIAL})).train()
    with torch.no_grad():  # as tiny_model: attention far from uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(0, VOCAB, (1, 40))
    want_loss, want = full_sequence_grads(model, ids)
    try:
        loss = lightning_oomb.train_step(model, ids, chunk_size=8, page_size=3)
    except (NotImplementedError, SetupError) as e:
        assert refusal is not None and refusal in str(e) and "\n" not in str(e), str(e)
        return
    assert refusal is None, f"trained, where {refusal!r} was expected"
    assert rel_err(loss, want_loss) <= TOL, (loss.item(), want_loss.item())
    # A key's bias without RoPE moves every score of a query alike, which the softmax does not see: its gradient
    # is zero but for rounding, on both sides, and is compared by its size.
    largest = max(g.norm() for g in want.values())
    zero = {n for n, g in want.items() if g.norm() <= 1e-7 * largest}
    got = grads_of(model)
    assert all(got[n].norm() <= 1e-6 * largest for n in zero)
    assert_grads_close({n: got[n] for n in got if n not in zero}, {n: want[n] for n in want if n not in zero}, TOL)


# Families whose head changes the logits (Cohere's logit_scale, Granite's logits_scaling, a final soft cap) or whose
# attention soft-caps its scores (Gemma 2, VaultGemma: cap * tanh(score / cap)), at tiny sizes with dropout off.
# The caps are small enough to bend these random models' logits, and their scores once the q and k projections
# are 8 times wider (Gemma 2's own caps of 50 and 30 would not move them); the sliding windows of 11 tokens cut
# the chunks of 8.
SOFT_CAPPED = dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=11, attn_logit_softcapping=2.0,
                   final_logit_softcapping=0.5)
HEAD_FAMILIES = {
    "cohere": dict(),  # logit_scale 0.0625
    "cohere2": dict(sliding_window=11, layer_types=["sliding_attention", "full_attention"]),
    "granite": dict(logits_scaling=4.0),
    "hyperclovax": dict(logits_scaling=4.0),  # multiplies where Granite divides
    "nanochat": dict(final_logit_softcapping=0.5),
    "gemma2": SOFT_CAPPED,
    "vaultgemma": SOFT_CAPPED,
}


def noisy(model_type: str, **config):
    """build(model_type, **config), its weights widened as tiny_model's so that attention is far from uniform."""
    model = build(model_type, **config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def attention_caps(model, caps: list | None = None) -> list:
    """The attention modules' attn_logit_softcapping, replaced by ``caps`` where given (a list, one per module)."""
    modules = [m for m in model.modules() if hasattr(m, "attn_logit_softcapping")]
    before = [m.attn_logit_softcapping for m in modules]
    for m, cap in zip(modules, caps or []):
        m.attn_logit_softcapping = cap
    return before


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", list(HEAD_FAMILIES))
def test_logit_scales_and_soft_caps_match_full_sequence(model_type, backend):
    """transformers' own loss and every parameter gradient of the full sequence against train_step in chunks of 8
    over 40 tokens, pages of 3, within 1e-5 (the logit scale or cap and the attention cap, forward and backward,
    where the fused loss kernel and the Triton attention kernels take them too); with the reference, also the
    loss of eval_loss and the served forward's last logits. Each scale and cap changes the loss, by 1e-4 at least
    (from about 4.6, a uniform guess's)."""
    from lightning_oomb.core.config import ChunkConfig
    from lightning_oomb.core.served import serve
    from lightning_oomb.integrations.transformers import logit_head

    model = noisy(model_type, **HEAD_FAMILIES[model_type])
    capped = "attn_logit_softcapping" in HEAD_FAMILIES[model_type]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if capped and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)
    ids = torch.randint(0, VOCAB, (1, 40))
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
        plain = torch.nn.functional.cross_entropy(model.get_output_embeddings()(hidden)[0, :-1], ids[0, 1:])
        assert not logit_head(model).identity and rel_err(plain, loss) > 1e-4
        caps = attention_caps(model)
        if any(cap is not None for cap in caps):
            attention_caps(model, [None] * len(caps))
            assert rel_err(model(input_ids=ids, labels=ids).loss, loss) > 1e-4
            attention_caps(model, caps)
    check_against_full(model, ids, chunk_size=8, page_size=3, attention=backend)
    if backend != "reference":  # the interpreter is slow; the reference covers the rest
        return
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids)
        with serve(model, ChunkConfig(chunk_size=8, page_size=3)):
            served = model(input_ids=ids, labels=ids, logits_to_keep=5)
    assert rel_err(lightning_oomb.eval_loss(model, ids, chunk_size=8, page_size=3), want.loss) <= TOL
    assert rel_err(served.loss, want.loss) <= TOL and rel_err(served.logits, want.logits[:, -5:]) <= TOL


@pytest.mark.parametrize("model_type,config", [
    ("qwen3_moe", dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)),
    ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
])
def test_the_planner_holds_every_expert_and_times_a_tokens(model_type, config):
    """Memory counts every expert's weights (the model's own parameter count); time counts the weights a token
    goes through: its two experts of eight and the router."""
    from lightning_oomb.core.model_shape import ModelShape

    sizes = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, **SPECIAL)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes, **config))
    shape = ModelShape.resolve(model)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    width = config.get("moe_intermediate_size", 512)
    attention = 2 * 256 * shape.q_width + 2 * 256 * shape.kv_width
    assert shape.active_matmul_params == 2 * (attention + 3 * 256 * 2 * width + 256 * 8) + 1000 * 256
    with pytest.raises(ValueError, match="tensor parallelism of mixture-of-experts layers is not built"):
        shape.tensor_parallel_part(2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_load_balancing_loss_and_its_gradient_match_the_whole_sequence(family, backend):
    """output_router_logits=True: the experts' load-balancing loss over every layer and token of the sequence,
    and its gradient, through train_step, layer checkpoints, eval_loss and the served forward. The loss is
    gathered from the routers apart from attention: the Triton kernels run train_step only (interpreted, the
    other routes would repeat the reference backend's checks at ten times the time)."""
    from lightning_oomb.core.config import ChunkConfig

    model = tiny_model(family, output_router_logits=True, router_aux_loss_coef=0.5)
    ids = torch.randint(0, VOCAB, (2, 29))
    want_loss, want = full_sequence_grads(model, ids)
    with torch.no_grad():
        without = model(input_ids=ids, labels=ids, output_router_logits=False).loss
    assert want_loss - without > 1e-2  # the auxiliary loss weighs in
    for options in (dict(), dict(checkpoint_layers=True)):
        loss = lightning_oomb.train_step(model, ids, chunk_size=8, page_size=4, attention=backend, **options)
        assert rel_err(loss, want_loss) <= TOL
        assert_grads_close(grads_of(model), want, TOL)
        model.zero_grad(set_to_none=True)
        if backend == "triton":
            return
    config = ChunkConfig(chunk_size=8, page_size=4, attention=backend)
    assert_served_matches(model, config, want_loss, want, TOL, input_ids=ids, labels=ids)
    model.eval()
    with torch.no_grad():
        reference = model(input_ids=ids, labels=ids).loss
    assert rel_err(lightning_oomb.eval_loss(model, ids, chunk_size=8, page_size=4), reference) <= TOL


# Values of another width than the keys: DeepSeek's multi-head latent attention, keys qk_nope + qk_rope = 12 wide,
# values 16, a K/V head per query head expanded from the latent (transformers' own attention needs
# num_key_value_heads = num_attention_heads); V2 with a full-rank query projection, V3 with a low-rank one and
# interleaved RoPE; experts in layer 1.
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=16, n_routed_experts=4,
           num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
           topk_group=1, num_key_value_heads=4)
VALUE_WIDTH_FAMILIES = {"deepseek_v2": dict(MLA, q_lora_rank=None), "deepseek_v3": dict(MLA, q_lora_rank=16)}
EVERY_PAGE = {"budget_pages": 64, "sink_pages": 1, "local_pages": 1}  # 40 tokens are 14 pages of 3: sparse is dense


def value_width_model(family: str):
    """A tiny random model of ``family`` (VALUE_WIDTH_FAMILIES), widened as tiny_model's."""
    model = build(family, **VALUE_WIDTH_FAMILIES[family])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _pages(pool) -> list[torch.Tensor]:
    """The K and V pages of every layer, wherever the pool keeps them."""
    return [t for t in (pool.k, pool.v, pool.host_k, pool.host_v) if t is not None and t.shape[0]]


# The Triton kernels in the interpreter take 15-45 s a step: V3 only (V2 differs before attention, in its RoPE).
@pytest.mark.parametrize("offload", ["gpu", "host"])
@pytest.mark.parametrize("sparse", [None, EVERY_PAGE], ids=["dense", "sparse-every-page"])
@pytest.mark.parametrize("family, backend", [(family, backend) for family in VALUE_WIDTH_FAMILIES
                                             for backend in BACKENDS if backend == "reference" or family == "deepseek_v3"])
def test_values_of_another_width_match_full_sequence(family, backend, sparse, offload):
    """DeepSeek V2/V3 through train_step: chunks of 8 on 40 tokens, pages of 3 that cut them; the pages on the
    device, or in host memory (dense: streamed; sparse: every layer's K/V and gradient pages there); the loss
    and every parameter's gradient within 1e-5 of transformers' full-sequence training."""
    from lightning_oomb.core.schedule import cached_pool

    model = value_width_model(family)
    ids = torch.randint(0, VOCAB, (1, 40))
    check_against_full(model, ids, chunk_size=8, page_size=3, attention=backend, offload=offload, sparse=sparse,
                       segment_tokens=12)
    pool = cached_pool(model)
    where = "host" if offload == "host" and sparse is None else "gpu"
    assert pool.placement == where and (pool.host_kv_layers == 2) == (offload == "host" and sparse is not None)
    keys, values = _pages(pool)
    assert keys.shape[-2:] == (4, 12) and values.shape[-2:] == (4, 16)  # a K/V head per query head


@pytest.mark.parametrize("family", list(VALUE_WIDTH_FAMILIES))
def test_values_of_another_width_with_documents_checkpoints_and_moved_gradient_pages(family):
    """Packed documents under layer checkpoints, and a sparse step whose gradient pages of one layer live on the
    host and move in stage 2 into the dead K (dK) and V (dV) pages of their own widths: the same gradients."""
    from lightning_oomb.core.config import ChunkConfig, SparseConfig
    from lightning_oomb.core.placement import Placement
    from lightning_oomb.core.schedule import ChunkedSequence, new_pool

    model = value_width_model(family)
    ids = check_against_separate_documents(model, (11, 17, 12), chunk_size=8, page_size=3, checkpoint_layers=True)

    want_loss, want = full_sequence_grads(model, ids)
    config = ChunkConfig(chunk_size=6, page_size=3, attention="reference",
                         sparse=SparseConfig(per_query_tile=True, **EVERY_PAGE))
    pools = {}

    def provide(spec, pages, with_grads, placement):
        if "pool" not in pools:
            pools["pool"] = new_pool(spec, pages + 5, 3, torch.device("cpu"), with_grads, Placement("gpu", 8, 1, 1))
        return pools["pool"]

    seq = ChunkedSequence(model, ids, config=config, pools=provide)
    seq.fill()
    loss = seq.backward()
    pool = pools["pool"]
    assert pool.host_dk.shape[-1] == 12 and pool.host_dv.shape[-1] == 16 and pool.host_grads_moved
    assert rel_err(loss, want_loss) <= TOL
    assert_grads_close(grads_of(model), want, TOL)


def test_the_planner_counts_values_of_their_own_width():
    """The planner's K/V and KV-gradient page lines are the bytes a pool of DeepSeek's pages holds: keys 12
    wide, values 16, a head per query head."""
    from lightning_oomb.core.model_shape import ModelShape
    from lightning_oomb.core.plan import plan
    from lightning_oomb.core.schedule import cached_pool

    model = value_width_model("deepseek_v3")
    shape = ModelShape.resolve(model)
    assert (shape.n_kv_heads, shape.head_dim, shape.value_dim) == (4, 12, 16)
    assert shape.kv_bytes_per_token(torch.float32) == 2 * 4 * (12 + 16) * 4
    ids = torch.randint(0, VOCAB, (2, 40))
    lightning_oomb.train_step(model, ids, chunk_size=8, page_size=4, offload="gpu")
    pool = cached_pool(model)
    step = plan(model, 40, batch=2, chunk_size=8, page_size=4, optimizer="none", precision="32-true",
                gpu_memory=1 << 40, host_memory=1 << 40, offload="gpu")
    lines = step.gpu_lines
    kv = sum(v for k, v in lines.items() if k.startswith("K/V pages"))
    grads = sum(v for k, v in lines.items() if k.startswith("KV-gradient pages"))
    assert kv == sum(t.numel() * t.element_size() for t in (pool.k, pool.v))
    assert grads == sum(t.numel() * t.element_size() for t in (pool.dk, pool.dv))


def check_bf16_within_full_sequence_error(model32, family: str, **options) -> None:
    """On the GPU: ``train_step`` of ``model32``'s bf16 copy on 2000 random tokens (chunks of 512, pages of 128,
    the Triton kernels, ``options``): each gradient within twice the error of transformers' own bf16
    full-sequence run against ``model32``'s float32 one, plus 2e-3."""
    import copy

    ids = torch.randint(0, 4096, (1, 2000), device="cuda")
    model32(input_ids=ids, labels=ids).loss.backward()
    truth = {n: p.grad.float() for n, p in model32.named_parameters() if p.grad is not None}
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    model16.zero_grad(set_to_none=True)
    model16(input_ids=ids, labels=ids).loss.backward()
    plain = {n: p.grad.float() for n, p in model16.named_parameters() if p.grad is not None}
    model16.zero_grad(set_to_none=True)
    lightning_oomb.train_step(model16, ids, chunk_size=512, page_size=128, attention="triton", **options)
    for name, p in model16.named_parameters():
        if name in truth:
            plain_err, our_err = rel_err(plain[name], truth[name]), rel_err(p.grad.float(), truth[name])
            assert our_err <= 2 * plain_err + 2e-3, (family, name, our_err, plain_err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_family_within_full_sequence_bf16_error(family):
    """On the GPU, Triton kernels and the fused ops where they fit: each family's bf16 gradient within twice
    the error of transformers' own bf16 full-sequence run against float32 (tests/test_gpu_end_to_end.py)."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192, **SPECIAL)
    extra = {**FAMILIES[family], **({"head_dim": 64} if "head_dim" in FAMILIES[family] else {}),
             **({"query_pre_attn_scalar": 64} if family == "gemma3_text" else {})}
    config = AutoConfig.for_model(family, **{**sizes, **extra})
    attention = "eager" if family == "gpt_oss" else "sdpa"
    model32 = AutoModelForCausalLM.from_config(config, attn_implementation=attention).cuda().float().train()
    check_bf16_within_full_sequence_error(model32, family)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sparse, offload", [(None, "gpu"), (None, "host"), (EVERY_PAGE, "gpu"), (EVERY_PAGE, "host")],
                         ids=["dense", "dense-host-pages", "sparse-every-page", "sparse-every-page-host-pages"])
@pytest.mark.parametrize("family", list(VALUE_WIDTH_FAMILIES))
def test_bf16_values_of_another_width_within_full_sequence_bf16_error(family, sparse, offload):
    """DeepSeek V2/V3 at their own head widths (keys 128 + 64 = 192, on kernel tiles padded to 256; values 128), on
    the GPU with the Triton kernels, pages on the device or in host memory (dense: streamed; sparse: every layer's
    K/V and gradient pages there, gathered and added into from the GPU), sparse with every page: each bf16
    gradient within twice the error of transformers' own bf16 full-sequence run against float32, as
    test_bf16_family_within_full_sequence_bf16_error."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=8, max_position_embeddings=8192, **SPECIAL)
    mla = dict(VALUE_WIDTH_FAMILIES[family], kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128, n_routed_experts=8, moe_intermediate_size=256, num_key_value_heads=8)
    if mla["q_lora_rank"] is not None:
        mla["q_lora_rank"] = 384
    config = AutoConfig.for_model(family, **{**sizes, **mla})
    model32 = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda().float().train()
    check_bf16_within_full_sequence_error(model32, family, sparse=sparse, offload=offload)


# The families of HEAD_FAMILIES and those that call the AttentionInterface unannounced, at the bf16 test's sizes with
# their own scales and caps.
GPU_MORE_FAMILIES = {
    "cohere": dict(),
    "cohere2": dict(sliding_window=512, layer_types=["sliding_attention", "full_attention"]),
    "granite": dict(logits_scaling=4.0),
    "nanochat": dict(),
    "gemma2": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=512),
    "vaultgemma": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=512),
    "stablelm": dict(qk_layernorm=True, use_parallel_residual=True, partial_rotary_factor=0.25),
    "falcon": dict(),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", list(GPU_MORE_FAMILIES))
def test_bf16_more_families_within_full_sequence_bf16_error(family):
    """test_bf16_family_within_full_sequence_bf16_error for the families above: the fused loss kernel through the
    logit scale or cap, the Triton attention kernels with Gemma 2's soft cap."""
    import copy

    torch.manual_seed(0)
    sizes = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192, **SPECIAL)
    if family == "falcon":  # Falcon-7B's one K/V head comes from multi_query, its MLP width from ffn_hidden_size
        sizes.pop("num_key_value_heads")
        sizes["ffn_hidden_size"] = sizes.pop("intermediate_size")
    config = AutoConfig.for_model(family, **{**sizes, **GPU_MORE_FAMILIES[family]})
    attention = "eager" if family in ("gemma2", "vaultgemma") else "sdpa"  # SDPA takes no soft cap
    model32 = AutoModelForCausalLM.from_config(config, attn_implementation=attention).cuda().float().train()
    if not support._calls_attention_interface(model32):  # Falcon before transformers routed its attention
        model16 = copy.deepcopy(model32).to(torch.bfloat16)
        ids = torch.randint(0, 4096, (1, 2000), device="cuda")
        with pytest.raises(NotImplementedError, match="computes attention in its own code"):
            lightning_oomb.train_step(model16, ids, chunk_size=512, page_size=128, attention="triton")
        return
    check_bf16_within_full_sequence_error(model32, family)


# Windows that cut chunks and pages every way: 37 tokens in chunks of 8, pages of 3.
WINDOWED = {
    "mistral": dict(sliding_window=11),  # every layer, from config.sliding_window
    "gemma3_text": dict(sliding_window=11),  # local layers only (layer_types), each layer's own attribute
    "phi3": dict(sliding_window=13),
    "starcoder2": dict(sliding_window=7),
    "qwen2": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=10, use_sliding_window=True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", list(WINDOWED))
def test_sliding_windows_match_full_sequence(family, backend):
    model = tiny_model(family, **WINDOWED[family])
    ids = torch.randint(0, VOCAB, (2, 37))
    labels = ids.clone()
    labels[1, 30:] = -100
    check_against_full(model, ids, labels, chunk_size=8, page_size=3, attention=backend)


def test_window_pages_hold_every_key_a_later_query_reads():
    """window_page_slots against a simulated store: tokens written chunk by chunk (or, as decoding writes them,
    in pieces cut at chunk borders: a prompt, then one token at a time), each query reading the keys of its
    window before its piece. Every key read is the one written there; where the window is shorter than a chunk
    the sequence takes fewer slots than pages."""
    from lightning_oomb.core.pages import window_page_slots

    def check(length, chunk, page, window, pieces):
        slots, per_sequence = window_page_slots(length, chunk, page, window)
        assert slots.shape == (-(-length // page),) and 0 <= slots.min() and slots.max() < per_sequence
        store = np.full(per_sequence * page, -1)
        for a, b in pieces:
            for t in range(a, b):
                store[slots[t // page] * page + t % page] = t
            for t in range(a, b):
                keys = np.arange(max(0, t - window + 1), a)
                assert np.array_equal(store[slots[keys // page] * page + keys % page], keys), (a, b, t)
        return per_sequence

    saved = 0
    for length, chunk, page, window in itertools.product([1, 16, 37, 61], [1, 4, 7, 16], [1, 3, 4, 16], [1, 5, 9, 17]):
        chunks = [(s, min(s + chunk, length)) for s in range(0, length, chunk)]
        per_sequence = check(length, chunk, page, window, chunks)
        cut = length // 3
        check(length, chunk, page, window, [(s, min((s // chunk + 1) * chunk, cut)) for s in range(0, cut, chunk)]
              + [(t, t + 1) for t in range(cut, length)])
        saved += per_sequence < -(-length // page)
        if window - 1 >= chunk:  # every token is in some later chunk's window
            assert per_sequence == -(-length // page)
    assert saved >= 40


# Windows shorter than a chunk: a window layer keeps the pages within 4 tokens of the next chunk's start and one
# chunk's scratch. Pages of 3 straddle chunk borders, pages of 8 do not; batch 2 with masked labels.
@pytest.mark.parametrize("sparse", [None, EVERY_PAGE], ids=["dense", "sparse-every-page"])
@pytest.mark.parametrize("page", [3, 8])
@pytest.mark.parametrize("family", ["mistral", "gemma3_text", "gpt_oss"])
def test_windows_shorter_than_chunks_keep_only_the_pages_later_chunks_reach(family, page, sparse):
    from lightning_oomb.core.pages import window_page_slots
    from lightning_oomb.core.schedule import cached_pool

    types = ["sliding_attention", "full_attention"]
    model = tiny_model(family, sliding_window=5, **({} if family == "mistral" else {"layer_types": types}))
    ids = torch.randint(0, VOCAB, (2, 61))
    labels = ids.clone()
    labels[1, 40:] = -100
    check_against_full(model, ids, labels, chunk_size=16, page_size=page, sparse=sparse)
    pool = cached_pool(model)
    per_sequence = window_page_slots(61, 16, page, 5)[1]
    assert per_sequence < -(-61 // page)
    assert pool.window_layers == ([0, 1] if family == "mistral" else [0])
    assert pool.window_k.shape[:2] == (len(pool.window_layers), 2 * per_sequence)
    assert pool.k.shape[0] == 2 - len(pool.window_layers)
    if sparse is None:  # the planner counts what the pool holds
        from lightning_oomb.core.plan import plan

        step = plan(model, 61, batch=2, chunk_size=16, page_size=page, optimizer="none", precision="32-true",
                    gpu_memory=1 << 40, host_memory=1 << 40)
        planned = sum(v for k, v in step.gpu_lines.items() if k.startswith("K/V pages"))
        assert planned == sum(t.numel() * t.element_size() for t in (pool.k, pool.v, pool.window_k, pool.window_v))


@pytest.mark.parametrize("per_query_tile", [True, False])
def test_windows_shorter_than_chunks_under_a_cut_sparse_budget(per_query_tile, monkeypatch):
    """A budget of 4 pages of 2 cuts the windows of 13 in chunks of 16: the selection scores every past page's
    summary, the scratch pages' stale ones included, and must pick what it picks with every page kept (the
    same loss and gradients, bit for bit)."""
    from lightning_oomb.core import pages
    from lightning_oomb.core.schedule import release_cached_pool

    sparse = {"budget_pages": 4, "sink_pages": 1, "local_pages": 1, "per_query_tile": per_query_tile}
    ids = torch.randint(0, VOCAB, (1, 70))
    runs = []
    for every_page in (False, True):
        if every_page:
            monkeypatch.setattr(pages, "window_page_slots", lambda n, c, p, w: (np.arange(-(-n // p)), -(-n // p)))
        model = tiny_model("gemma3_text", sliding_window=13, layer_types=["sliding_attention", "full_attention"])
        loss = lightning_oomb.train_step(model, ids, chunk_size=16, page_size=2, sparse=sparse)
        runs.append((loss, grads_of(model)))
        release_cached_pool(model)
    (loss, grads), (want_loss, want) = runs
    assert torch.equal(loss, want_loss) and all(torch.equal(grads[n], want[n]) for n in want)


@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize("sparse", [None, EVERY_PAGE], ids=["dense", "sparse-every-page"])
def test_windows_shorter_than_chunks_in_the_triton_kernels(backend, sparse):
    """The window layers' own page table through the dense and sparse Triton kernels (Triton's interpreter)."""
    model = tiny_model("gemma3_text", sliding_window=5, layer_types=["sliding_attention", "full_attention"])
    check_against_full(model, torch.randint(0, VOCAB, (1, 45)), chunk_size=16, page_size=4, attention=backend,
                       sparse=sparse)


def test_windows_shorter_than_chunks_with_packed_documents_and_layer_checkpoints():
    model = tiny_model("gemma3_text", sliding_window=5, layer_types=["sliding_attention", "full_attention"])
    check_against_separate_documents(model, (21, 29), chunk_size=16, page_size=3, checkpoint_layers=True)


def test_sliding_window_with_layer_checkpoints_and_streamed_host_pages():
    model = tiny_model("gemma3_text", **WINDOWED["gemma3_text"])
    ids = torch.randint(0, VOCAB, (1, 37))
    check_against_full(model, ids, chunk_size=8, page_size=3, checkpoint_layers=True)
    model.zero_grad(set_to_none=True)
    check_against_full(model, ids, chunk_size=8, page_size=4, offload="host", segment_tokens=12)


@pytest.mark.parametrize("sparse", [None, {"budget_pages": 5, "sink_pages": 1, "local_pages": 1}],
                         ids=["dense", "sparse-covering-the-window"])
def test_sliding_window_within_packed_documents(sparse):
    """Each query sees the later of its document's start and its window's; sparse attention whose budget covers
    the window (6 tokens: at most 4 pages of 2) selects exactly those keys."""
    check_against_separate_documents(tiny_model("mistral", sliding_window=6), (13, 17), chunk_size=8, page_size=2,
                                     sparse=sparse)


@pytest.mark.parametrize("backend", BACKENDS)
def test_streamed_pages_leave_window_layers_on_the_device(backend):
    """Gemma 3's local layer (a window of 5) and its global one, offload='host' in segments of 12, batch 2 over
    chunks of 8 and pages of 3: only the global layer's pages are in host memory and stream; the local layer
    keeps its own K/V pages and gradient ring on the device. Loss and gradients within 1e-5 of transformers;
    the planner's page lines, host and GPU, are the pool's bytes."""
    from lightning_oomb.core.plan import plan
    from lightning_oomb.core.plan.config import Pages
    from lightning_oomb.core.schedule import cached_pool

    model = tiny_model("gemma3_text", sliding_window=5, layer_types=["sliding_attention", "full_attention"])
    ids = torch.randint(0, VOCAB, (2, 45))
    check_against_full(model, ids, chunk_size=8, page_size=3, offload="host", segment_tokens=12, attention=backend)
    pool = cached_pool(model)
    assert pool.on_host and pool.window_layers == pool.ring_layers == [0] and pool.k.shape[0] == pool.dk.shape[0] == 1
    assert pool.streamer.layers == [1]
    step = plan(model, 45, batch=2, chunk_size=8, page_size=3, optimizer="none", precision="32-true",
                offload="host", segment_tokens=12, pages=Pages(streamed=True), gpu_memory=1 << 40,
                host_memory=1 << 40)
    pinned = sum(v for k, v in step.host_lines.items() if k.startswith(("pinned K/V pages", "pinned KV-gradient")))
    n_pages = 2 * -(-45 // 3)  # the step's pages of every layer the host holds (the pool has spare ones)
    assert pinned == sum(t.shape[0] * n_pages * t[0, 0].numel() * t.element_size()
                         for t in (pool.k, pool.v, pool.dk, pool.dv))
    apart = sum(v for k, v in step.gpu_lines.items() if "sliding-window layers" in k)
    assert apart == sum(t.numel() * t.element_size() for t in (pool.window_k, pool.window_v, pool.ring_dk, pool.ring_dv))


def test_the_planner_times_sliding_window_layers_by_their_window():
    """Gemma 3's five local layers of six attend to 1024 tokens each: at 128K their attention FLOPs are the
    window's, the global layer's the whole context's."""
    import dataclasses

    from lightning_oomb.core.model_shape import ModelShape
    from lightning_oomb.core.plan.timing import step_time

    config = AutoConfig.for_model("gemma3_text", vocab_size=1000, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                                  sliding_window=1024)
    shape = ModelShape.from_config(config)
    assert (shape.window, shape.window_layers) == (1024, 5)
    full = dataclasses.replace(shape, window=0, window_layers=0)
    context = 128 * 1024
    windowed, dense = (step_time(s, context).attention_flops for s in (shape, full))
    # per layer: about context * window pairs against context^2 / 2
    expected = (1 + 5 * (1024 - 0.5) * context / (context * context / 2)) / 6
    assert windowed / dense == pytest.approx(expected, rel=0.02)


def test_sliding_window_layers_keep_their_gradient_pages_in_a_ring():
    """Gemma 3's local layer (a window of 5, chunks of 4, pages of 2) keeps its gradient pages in a ring of
    gradient_ring_pages pages a sequence, zeroed as stage 2 reads them; the gradient is transformers' own,
    with cross-chunk gradients off too, and the planner counts what the pool holds."""
    from lightning_oomb.core.pages import gradient_ring_pages
    from lightning_oomb.core.plan import plan
    from lightning_oomb.core.schedule import cached_pool

    model = tiny_model("gemma3_text", sliding_window=5, layer_types=["sliding_attention", "full_attention"])
    ids = torch.randint(0, VOCAB, (2, 61))
    check_against_full(model, ids, chunk_size=4, page_size=2)
    pool = cached_pool(model)
    ring = gradient_ring_pages(5, 4, 2)
    assert pool.ring_layers == [0] and pool.ring_dk.shape[:2] == (1, 2 * ring) and pool.dk.shape[:2] == (1, 62)
    step = plan(model, 61, batch=2, chunk_size=4, page_size=2, optimizer="none", precision="32-true",
                gpu_memory=1 << 40, host_memory=1 << 40)
    lines = {k: v for k, v in step.gpu_lines.items() if k.startswith("KV-gradient pages")}
    assert sum(lines.values()) == sum(t.numel() * t.element_size() for t in (pool.dk, pool.dv, pool.ring_dk, pool.ring_dv))
    model.zero_grad(set_to_none=True)
    want = lightning_oomb.train_step(model, ids, chunk_size=4, page_size=2, cross_chunk_gradients=False)
    want_grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    from lightning_oomb.core.schedule import release_cached_pool

    release_cached_pool(model)
    pool_free = lightning_oomb.train_step(model, ids, chunk_size=4, page_size=2, cross_chunk_gradients=False,
                                          offload="host")  # the ring beside streamed pages
    assert rel_err(pool_free, want) <= TOL
    assert_grads_close(grads_of(model), want_grads, TOL)
