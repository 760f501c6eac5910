"""Tiny random transformers models of the supported families, and gradient comparisons."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

VOCAB = 101

# Triton kernels run on CPU tensors only in Triton's interpreter (CPU machines; tests/conftest.py). On a GPU
# machine those cases are skipped: the GPU tests run the kernels compiled.
TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
needs_interpreter = pytest.mark.skipif(not TRITON_ON_CPU, reason="Triton on CPU tensors: the interpreter only")
BACKENDS = ["reference"] + (["triton"] if TRITON_ON_CPU else [])
# How the distributed tests start their own processes: from the fork server tests/conftest.py preloads on a CPU
# machine; spawned where CUDA is, which a child forked after the parent touched the driver cannot use.
START_METHOD = "spawn" if torch.cuda.is_available() else "forkserver"


def spawn_ranks(ranks, world: int, *args) -> None:
    """Start ``world`` processes running ``ranks(rank, world, port, *args)``, on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(ranks, args=(world, port, *args), nprocs=world, join=True,
                                          start_method=START_METHOD)


def as_torchrun_rank(rank: int, world: int, port: int) -> None:
    """The environment torchrun gives a process, which Lightning's strategies read (they then start none)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096,
)

CONFIGS = {
    "llama": lambda: LlamaConfig(
        **COMMON,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    ),
    "qwen2": lambda: Qwen2Config(**COMMON),  # q/k/v bias
    "qwen2-tied": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**{**COMMON, "num_attention_heads": 6, "num_key_value_heads": 3}, head_dim=8),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
}
# The families the general path accepts (integrations/support.py), each at its own config's defaults but for
# the sizes; special token ids inside the tiny vocabulary. starcoder2 stands for the model types not named in
# lightning_oomb anywhere: LayerNorm, a GELU MLP and biases, so no fused op fits and the model's own run.
FAMILIES = {
    "gemma3_text": dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=4096),  # x(1 + w) norms, GELU
    "qwen3_moe": dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "phi3": dict(partial_rotary_factor=0.5),  # fused qkv and gate_up projections, RoPE on half the head
    "olmo2": dict(),  # q/k norms over all heads
    "starcoder2": dict(sliding_window=None),
    # attention sinks, sliding and full layers alternating (a window of 9 cuts every chunk), experts with biases
    "gpt_oss": dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=9),
}
EAGER_ONLY = ("gpt_oss",)  # transformers runs their attention in its eager code only
for _family, _extra in FAMILIES.items():
    CONFIGS[_family] = (lambda family, extra: lambda: AutoConfig.for_model(
        family, **COMMON, **extra, pad_token_id=0, bos_token_id=1, eos_token_id=2))(_family, _extra)


def tiny_model(family: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    torch.manual_seed(seed)
    config = CONFIGS[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    attention = "eager" if family in EAGER_ONLY else "sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).to(dtype)
    # Random init of transformers is small; widen it so attention is far from uniform and errors show.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for m in model.modules():  # sink logits comparable to the attention logits: the sinks weigh in
            if isinstance(getattr(m, "sinks", None), torch.Tensor):
                m.sinks.normal_(0, 1)
    return model.train()


def probed(model):
    """``model`` after the probe that runs before its first step (core.schedule.check_chunked_forward), for tests
    that count what a step runs."""
    from lightning_oomb.core.schedule import check_chunked_forward

    check_chunked_forward(model)
    return model


def full_sequence_grads(model, input_ids, labels=None):
    """Loss and parameter grads of plain transformers full-sequence training."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids if labels is None else labels).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def separate_documents_grads(model, ids, position_ids, labels=None, per_document=False):
    """Loss and gradients of each document on its own through transformers, normalised by the batch's
    label count (the first token of a document is no label of the one before); ``per_document``: each
    document's own mean, averaged over the documents that have labels."""
    labels = ids if labels is None else labels
    docs = []
    for b in range(ids.shape[0]):
        starts = (position_ids[b] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        docs += [(ids[b, s:e], labels[b, s:e]) for s, e in zip(starts[:-1], starts[1:])]
    n_labels = sum(int((lab[1:] != -100).sum()) for _, lab in docs)
    labelled = [(doc, lab) for doc, lab in docs if bool((lab[1:] != -100).any())]
    model.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for doc, lab in labelled if per_document else docs:
        if per_document:
            loss = model(input_ids=doc[None], labels=lab[None]).loss / len(labelled)
        else:
            loss = model(input_ids=doc[None], labels=lab[None], num_items_in_batch=n_labels).loss
        loss.backward()
        total += loss.detach()
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    return total, grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error ||a - b|| / ||b||, in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_grads_close(got: dict, want: dict, tol: float):
    assert got.keys() == want.keys(), set(got) ^ set(want)
    worst = max(((rel_err(got[n], want[n]), n) for n in want), default=(0.0, ""))
    assert worst[0] <= tol, f"gradient of {worst[1]} off by {worst[0]:.2e} (tolerance {tol:.0e})"


def assert_served_matches(model, config, want_loss: torch.Tensor, want: dict, tol: float, **inputs) -> None:
    """The served forward (``core.served.serve``, what OOMBStrategy runs) of ``model(**inputs)`` under the step
    options ``config`` and its backward: the loss and every gradient against ``want_loss`` and ``want``."""
    from lightning_oomb.core.served import serve

    with serve(model, config):
        served = model(**inputs).loss
    served.backward()
    assert rel_err(served.detach(), want_loss) <= tol
    assert_grads_close(grads_of(model), want, tol)


def assert_adamw_updates_close(got: dict, want: dict, start: dict, tol: float = 1e-5):
    """Weights after AdamW steps against the reference run's, compared as updates from ``start`` (norm-wise,
    per parameter) within ``tol``; k_proj.bias within 1e-3. Under RoPE that bias's gradient is small, not zero:
    of tiny_model's Qwen2 some elements are ~5e-8, near AdamW's eps, whose last bits change with the order of a
    sum (the CPU's vector width, a rank's share) and which AdamW, dividing each element by its own magnitude,
    turns into update differences of ~1e-4, where every other parameter agrees to ~1e-6."""
    assert got.keys() == want.keys(), set(got) ^ set(want)
    for n in want:
        err = rel_err(got[n] - start[n], want[n] - start[n])
        bound = 1e-3 if n.endswith("k_proj.bias") else tol
        assert err <= bound, f"update of {n} differs by {err:.2e} (tolerance {bound:.0e})"


def save_byte_level_llama(where, tokenizer: str):
    """A random 2-layer Llama of 300-token vocabulary (4096 positions) saved to ``where`` with the tokenizer
    directory ``tokenizer`` beside it: a local model directory as ``lightning-oomb evaluate`` and the evaluation
    callback read one. Returns ``where``."""
    from transformers import AutoTokenizer

    config = AutoConfig.for_model("llama", vocab_size=300, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(where)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(where)
    return where


def delta_rule_spread(model, input_ids, labels, want: dict) -> dict:
    """Per parameter, how far transformers' own full-sequence gradient ``want`` moves (norm-wise relative) when
    the model's chunked gated delta rule (linear attention: Qwen3-Next) runs at another of its internal chunk
    sizes (8, 16, 32 tokens for its 64): the same arithmetic in another float32 order. The decay parameters
    (A_log, dt_bias) sum many terms that cancel, so for them this is above 1e-5; a chunked run is held to
    twice it there. Zero for every parameter of a model without that rule."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    modeling = sys.modules[type(base).__module__]
    spread = dict.fromkeys(want, 0.0)
    rule = getattr(modeling, "torch_chunk_gated_delta_rule", None)
    if rule is None:  # no gated delta rule: nothing moves
        return spread
    try:
        for size in (8, 16, 32):
            modeling.torch_chunk_gated_delta_rule = lambda *args, _size=size, **kwargs: rule(*args, chunk_size=_size,
                                                                                             **kwargs)
            _, grads = full_sequence_grads(model, input_ids, labels)
            for name in want:
                spread[name] = max(spread[name], rel_err(grads[name], want[name]))
    finally:
        modeling.torch_chunk_gated_delta_rule = rule
    return spread
