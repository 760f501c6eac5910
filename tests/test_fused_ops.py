"""Fused RMSNorm, SwiGLU product and RoPE against transformers' own formulas (CPU: Triton interpreter).

fp32 cases compare with the HF formula in fp32 at rtol 1e-5. fp16 cases compare both the fused op and the
HF formula run in fp16 (forward, and backward through autograd) with the same formula in fp64 on the same
inputs: the fused op must be no worse than twice the HF formula's own error, plus a tiny absolute term.
bf16 runs only on a GPU: Triton's interpreter truncates fp32 -> bf16 casts instead of rounding them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

from lightning_oomb.kernels.rms_norm import rms_norm
from lightning_oomb.kernels.rope import apply_rope
from lightning_oomb.kernels.swiglu import silu_mul

# On a GPU box the same cases run compiled on the GPU; otherwise in the interpreter (tests/conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16: Triton's interpreter truncates casts")


def max_abs(t: torch.Tensor) -> float:
    return float(t.detach().double().abs().max()) if t.numel() else 0.0


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype, got.shape, want.shape)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * max_abs(want), msg=lambda m: f"{name}: {m}")


def assert_no_worse(got: torch.Tensor, hf: torch.Tensor, exact: torch.Tensor, name: str) -> tuple[float, float]:
    """The fused result's max error against the fp64 formula is at most 2x the HF formula's (same dtype)."""
    assert got.dtype == hf.dtype and got.shape == hf.shape, (name, got.dtype, hf.dtype, got.shape, hf.shape)
    err, hf_err = max_abs(got.double() - exact), max_abs(hf.double() - exact)
    assert err <= 2 * hf_err + 1e-6 * max_abs(exact), f"{name}: fused error {err:.3g}, HF formula's {hf_err:.3g}"
    return err, hf_err


def run(fn, inputs: list[torch.Tensor], douts: tuple) -> tuple:
    """Outputs of fn(*inputs) and the grads of <outputs, douts> w.r.t. inputs."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs, inputs, [d.to(o.dtype) for o, d in zip(outs, douts, strict=True)])
    return tuple(o.detach() for o in outs), grads


def compare(fused, hf, inputs: list[torch.Tensor], dout, names: list[str]) -> None:
    """fused and hf on copies of inputs (same dtypes and strides) made leaves here; outside fp32 also hf on
    the inputs in fp64, the reference both are measured against."""
    douts = dout if isinstance(dout, tuple) else (dout,)

    def leaves(dtype=None):
        return [x.detach().to(dtype or x.dtype, copy=True).requires_grad_() for x in inputs]

    got, want = run(fused, leaves(), douts), run(hf, leaves(), douts)
    results, refs = [t for pair in got for t in pair], [t for pair in want for t in pair]
    if inputs[0].dtype == torch.float32:
        for name, g, w in zip(names, results, refs, strict=True):
            assert_fp32_close(g, w, name)
    else:
        exact = run(hf, leaves(torch.float64), tuple(d.double() for d in douts))
        for name, g, w, e in zip(names, results, refs, [t for pair in exact for t in pair], strict=True):
            assert_no_worse(g, w, e, name)


# --------------------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------------------


def hf_rms_norm(eps: float):
    """transformers' Qwen2RMSNorm forward, with the weight given as an input (so grads reach it)."""
    def f(x, weight):
        norm = Qwen2RMSNorm(weight.shape[0], eps=eps).to(device=weight.device, dtype=weight.dtype)
        return torch.func.functional_call(norm, {"weight": weight}, (x,))

    return f


def rms_inputs(shape, n, dtype, seed=0):
    torch.manual_seed(seed)
    x = (torch.randn(*shape, n, device=DEVICE) * 3 + 0.5).to(dtype)
    w = (1 + 0.3 * torch.randn(n, device=DEVICE)).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape, n",
    [
        ((2, 7), 48),  # fewer rows than one tile holds
        ((130,), 48),  # several tiles, the last partly masked
        ((300,), 100),  # backward programs loop over several tiles each: dweight partials over many rows
        ((1,), 100),
        ((2, 5, 3), 128),  # Qwen3's q/k norm over the head dim of (B, T, H, D)
        ((3,), 3584),  # Qwen2-7B's hidden size, one row per program
    ],
)
def test_rms_norm(shape, n, dtype):
    x, w = rms_inputs(shape, n, dtype)
    dout = torch.randn(*shape, n, device=DEVICE)
    compare(lambda a, b: rms_norm(a, b, 1e-6), hf_rms_norm(1e-6), [x, w], dout, ["y", "dx", "dweight"])


def test_rms_norm_forward_bits():
    """In half precision the forward reproduces HF's rounding order: equal to Qwen2RMSNorm to within one ulp
    (the fp32 statistics may differ in the last bit: another summation order), nearly everywhere equal."""
    dtype = torch.float16
    x, w = rms_inputs((4, 9), 100, dtype)
    got, want = rms_norm(x, w, 1e-5), hf_rms_norm(1e-5)(x, w)
    ulp = torch.finfo(dtype).eps * want.abs().float().clamp_min(torch.finfo(dtype).tiny)
    assert ((got.float() - want.float()).abs() <= ulp).all()
    assert (got != want).float().mean() < 0.01


def test_rms_norm_mixed_dtypes():
    """fp32 weight on fp16 x: HF's product promotes to fp32, so does the fused op; both grads keep their dtype."""
    x, _ = rms_inputs((2, 6), 48, torch.float16)
    _, w = rms_inputs((2, 6), 48, torch.float32, seed=1)
    x.requires_grad_()
    w.requires_grad_()
    got = rms_norm(x, w, 1e-6)
    want = hf_rms_norm(1e-6)(x, w)
    assert got.dtype == want.dtype == torch.float32
    assert_fp32_close(got, want, "y")
    dx, dw = torch.autograd.grad(got, [x, w], torch.ones_like(got))
    assert dx.dtype == torch.float16 and dw.dtype == torch.float32


def test_rms_norm_strided_rows_and_frozen_weight():
    """Rows read with their stride (a column slice), rows that need a copy (a transposed batch), and a
    weight without grad (LoRA: dweight is skipped)."""
    torch.manual_seed(0)
    wide = torch.randn(9, 64, device=DEVICE)
    w = 1 + 0.3 * torch.randn(48, device=DEVICE)
    for x in (wide[:, :48], torch.randn(7, 2, 48, device=DEVICE).transpose(0, 1)):
        x = x.requires_grad_() if x.is_leaf else x.detach().requires_grad_()
        got = rms_norm(x, w, 1e-6)
        want = hf_rms_norm(1e-6)(x, w)
        assert_fp32_close(got, want, "y")
        dout = torch.randn_like(want)
        assert_fp32_close(torch.autograd.grad(got, x, dout)[0], torch.autograd.grad(want, x, dout)[0], "dx")


# --------------------------------------------------------------------------------------------------------
# SwiGLU product
# --------------------------------------------------------------------------------------------------------


def hf_silu_mul(gate, up):
    return F.silu(gate) * up  # Qwen2MLP: act_fn(gate_proj(x)) * up_proj(x), act_fn = nn.SiLU


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 48), (2, 3, 700), (1, 1, 1)])  # 2 x 3 x 700 = 4200: two blocks, masked
def test_silu_mul(shape, dtype):
    torch.manual_seed(0)
    gate = (torch.randn(*shape, device=DEVICE) * 4).to(dtype)
    up = torch.randn(*shape, device=DEVICE).to(dtype)
    dout = torch.randn(*shape, device=DEVICE)
    compare(silu_mul, hf_silu_mul, [gate, up], dout, ["out", "dgate", "dup"])


def test_silu_mul_saves_inputs_only():
    """Backward keeps gate and up alive, nothing else of activation size."""
    gate = torch.randn(4, 64, device=DEVICE, requires_grad=True)
    up = torch.randn(4, 64, device=DEVICE, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        silu_mul(gate, up)
    assert len(saved) == 2 and {t.data_ptr() for t in saved} == {gate.data_ptr(), up.data_ptr()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_backward_and_product_gives_both_passes_bits(dtype):
    """One pass gives silu_mul_backward's (dgate, dup) and silu_mul_forward's product bit for bit, dgate in
    the memory of dout; a dout it cannot take over is refused."""
    from lightning_oomb.kernels.swiglu import silu_mul_backward, silu_mul_backward_and_product, silu_mul_forward

    torch.manual_seed(0)
    gate, up, dout = ((torch.randn(2, 3, 700, device=DEVICE) * 4).to(dtype) for _ in range(3))
    expected = (*silu_mul_backward(dout, gate, up), silu_mul_forward(gate, up))
    consumed = dout.clone()
    got = silu_mul_backward_and_product(consumed, gate, up)
    for name, a, b in zip(("dgate", "dup", "product"), got, expected):
        assert torch.equal(a, b), name
    assert got[0].data_ptr() == consumed.data_ptr()
    with pytest.raises(ValueError, match="dout must be contiguous"):
        silu_mul_backward_and_product(dout.transpose(0, 1), gate.transpose(0, 1), up.transpose(0, 1))


@pytest.mark.parametrize("grad_exists", [False, True], ids=["new-grad", "grad-in-place"])
def test_swiglu_linear_is_the_down_projection_of_silu_mul_bitwise(grad_exists):
    """swiglu_linear gives F.linear(silu_mul(gate, up)) and its gradients bit for bit (the product recomputed
    in backward by the SwiGLU backward's pass; dW added into an existing .grad in place), and keeps gate, up
    and the weight for backward, not the product."""
    from lightning_oomb.kernels.linear import swiglu_linear

    torch.manual_seed(0)
    gate, up = (torch.randn(2, 5, 48, device=DEVICE) for _ in range(2))
    weight = torch.randn(16, 48, device=DEVICE)
    bias = torch.randn(16, device=DEVICE)
    dy = torch.randn(2, 5, 16, device=DEVICE)
    results = []
    for fused in (False, True):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        if grad_exists:
            w.grad = torch.ones_like(w)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = swiglu_linear(g, u, w, b) if fused else F.linear(silu_mul(g, u), w, b)
        y.backward(dy)
        results.append((y, g.grad, u.grad, w.grad, b.grad))
        if fused:
            assert {t.data_ptr() for t in saved} == {g.data_ptr(), u.data_ptr(), w.data_ptr()}
    for name, a, b in zip(("out", "dgate", "dup", "dweight", "dbias"), *results):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------------------


def hf_rope(q, k, cos, sin):
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)


def rope_tables(batch: int, t: int, d: int, dtype, random: bool = False):
    """cos, sin (batch, t, d) as transformers' rotary embedding makes them (cat(freqs, freqs), per-sequence
    positions), or with unrelated random halves to pin down the exact formula."""
    if random:
        return tuple(torch.randn(batch, t, d, device=DEVICE).to(dtype) for _ in range(2))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, device=DEVICE).float() / d)
    pos = torch.arange(t, device=DEVICE).float() + 1000 * torch.arange(batch, device=DEVICE).float()[:, None]
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def model_views(batch: int, h: int, t: int, d: int, dtype):
    """(B, H, T, D) as a transformers attention layer hands it over: proj(x).view(B, T, H, D).transpose(1, 2)."""
    return torch.randn(batch, t, h * d, device=DEVICE).to(dtype).view(batch, t, h, d).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "batch, h_q, h_kv, t, d, cos_batch, random",
    [
        (2, 7, 1, 5, 64, 2, False),  # GQA 7:1, per-sequence positions
        (2, 4, 2, 3, 16, 1, False),  # cos/sin (1, T, D) broadcast over the batch
        (1, 4, 2, 6, 128, 1, False),
        (2, 3, 3, 4, 16, 2, True),  # cos/sin halves unrelated: the exact formula, not only true rotations
    ],
)
def test_rope(batch, h_q, h_kv, t, d, cos_batch, random, dtype):
    torch.manual_seed(0)
    q, k = model_views(batch, h_q, t, d, dtype), model_views(batch, h_kv, t, d, dtype)
    assert not q.is_contiguous() and (h_kv == 1 or not k.is_contiguous())
    cos, sin = rope_tables(cos_batch, t, d, dtype, random)
    dq, dk = torch.randn(batch, h_q, t, d, device=DEVICE), torch.randn(batch, t, h_kv, d, device=DEVICE).transpose(1, 2)

    def fused(q_, k_):
        q_embed, k_embed = apply_rope(q_, k_, cos, sin)
        assert q_embed.stride() == q_.stride() and k_embed.stride() == k_.stride()  # laid out like the inputs
        return q_embed, k_embed

    def hf(q_, k_):
        return hf_rope(q_, k_, cos.to(q_.dtype), sin.to(q_.dtype))

    compare(fused, hf, [q, k], (dq, dk), ["q_embed", "k_embed", "dq", "dk"])


def test_rope_reads_views_in_place():
    """Rotating a (B, T, H, D) buffer's transposed view writes nothing into it and matches the contiguous copy."""
    torch.manual_seed(0)
    q, k = model_views(2, 4, 5, 16, torch.float32), model_views(2, 2, 5, 16, torch.float32)
    before = q.clone(), k.clone()
    cos, sin = rope_tables(2, 5, 16, torch.float32)
    got = apply_rope(q, k, cos, sin)
    want = apply_rope(q.contiguous(), k.contiguous(), cos, sin)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_fused_rope_returns_the_dtype_of_the_models_own():
    """OLMo 2's RoPE computes in float32 and casts back to q's dtype; Llama's promotes to cos's float32. The
    fused op swapped in returns what each model's own does (else a half-precision OLMo 2 step would store
    float32 K): fp16 q, k (the interpreter rounds bf16 wrongly; the rule is the same) and float32 cos, sin."""
    import sys

    from tiny_models import tiny_model

    from lightning_oomb.integrations.fused_ops import fused_ops

    torch.manual_seed(0)
    half = dict(dtype=torch.float16, device=DEVICE)
    q, k = torch.randn(1, 4, 6, 8, **half), torch.randn(1, 2, 6, 8, **half)
    for family, want_dtype in (("olmo2", torch.float16), ("llama", torch.float32)):
        lm = tiny_model(family).to(DEVICE)
        modeling = sys.modules[type(lm.model.layers[0]).__module__]
        cos, sin = lm.model.rotary_emb(torch.zeros(1, 6, 8, device=DEVICE), torch.arange(6, device=DEVICE)[None])
        original = modeling.apply_rotary_pos_emb
        want = original(q, k, cos, sin)
        with fused_ops(lm):
            assert modeling.apply_rotary_pos_emb is not original  # swapped for the fused op
            got = modeling.apply_rotary_pos_emb(q, k, cos, sin)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype == want_dtype, family
            torch.testing.assert_close(g.float(), w.float(), rtol=2e-3, atol=2e-3)


# --------------------------------------------------------------------------------------------------------
# Cross-entropy (the loss of a piece of logits and, in their place, its gradient)
# --------------------------------------------------------------------------------------------------------


def ce_reference(logits: torch.Tensor, targets: torch.Tensor, normalizer: float):
    """core.loss's unfused formula: per-row loss (float32) and (softmax - onehot) / normalizer in logits' dtype."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    g = logp.exp()
    g[torch.arange(len(targets), device=g.device), targets] -= 1.0
    return -logp.gather(1, targets[:, None])[:, 0], (g / normalizer).to(logits.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=[pytest.mark.gpu, needs_cuda])])
@pytest.mark.parametrize("rows, vocab", [(3, 100), (5, 8192 + 700)])  # one block (masked); two blocks
def test_cross_entropy_rows(rows, vocab, dtype):
    from lightning_oomb.kernels.cross_entropy import cross_entropy_rows

    torch.manual_seed(0)
    logits = (torch.randn(rows, vocab, device=DEVICE) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), device=DEVICE)
    targets[0] = vocab - 1  # the last column, in the masked tail
    want_loss, want_grad = ce_reference(logits, targets, 7.0)
    got = logits.clone()
    loss = cross_entropy_rows(got, targets, 7.0, grad=True)
    assert torch.equal(cross_entropy_rows(logits.clone(), targets, 7.0, grad=False), loss)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want_grad, rtol=1e-5, atol=1e-7)
    else:  # both round the same float32 gradient once: at most one unit in the last place apart
        ulp = torch.finfo(dtype).eps * want_grad.abs().float().clamp_min(torch.finfo(dtype).tiny)
        assert ((got.float() - want_grad.float()).abs() <= ulp).all()


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_fused_linear_cross_entropy_matches_the_unfused_one(weighted):
    """core.loss with the kernel: the same loss, output-layer gradients and dL/dh as with torch's ops; with
    per-row weights, both are the weighted sum's (checked against autograd of sum(w x CE) / normalizer)."""
    from torch import nn

    from lightning_oomb.core.loss import HeadGradients, linear_cross_entropy

    torch.manual_seed(0)
    head = nn.Linear(16, 300, bias=True, device=DEVICE)
    hidden, targets = torch.randn(37, 16, device=DEVICE), torch.randint(0, 300, (37,), device=DEVICE)
    weights = torch.rand(37, device=DEVICE) if weighted else None
    results = []
    for fused in (False, True):
        grads = HeadGradients(head)
        loss, grad_h = linear_cross_entropy(hidden, head.weight, head.bias, targets, 40.0, grads, True, fused=fused,
                                            weights=weights)
        results.append((loss, grad_h, grads.weight, grads.bias))
    for got, want, name in zip(results[1], results[0], ["loss", "dh", "dweight", "dbias"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    if weighted:
        h = hidden.clone().requires_grad_()
        ce = torch.nn.functional.cross_entropy(head(h), targets, reduction="none")
        want_loss = (ce * weights).sum() / 40.0
        want_loss.backward()
        torch.testing.assert_close(results[0][0], want_loss.detach(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(results[0][1], h.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(results[0][2], head.weight.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("multiplier, softcap", [(0.25, None), (None, 3.0), (2.0, 3.0)])
def test_cross_entropy_rows_through_the_models_head(multiplier, softcap, dtype):
    """The logits as a family's head makes them (times a scale, then soft-capped) and the gradient back through
    both: against autograd of the same float32 formula. The padding of the masked last block stays out of it."""
    from lightning_oomb.kernels.cross_entropy import cross_entropy_rows

    torch.manual_seed(0)
    rows, vocab = 5, 8192 + 700
    logits = (torch.randn(rows, vocab, device=DEVICE) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), device=DEVICE)
    targets[0] = vocab - 1
    x = logits.float().requires_grad_()
    z = x * multiplier if multiplier is not None else x
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    want_loss = F.cross_entropy(z, targets, reduction="none")
    (want_loss.sum() / 7.0).backward()
    got = logits.clone()
    loss = cross_entropy_rows(got, targets, 7.0, grad=True, multiplier=multiplier, softcap=softcap)
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(got, x.grad, rtol=1e-5, atol=1e-7)
    else:  # one rounding of a float32 gradient that agrees to about 1e-6 of itself (below 2^-14: fp16's subnormals)
        err = (got.float() - x.grad).abs()
        assert (err <= 2 * torch.finfo(dtype).eps * x.grad.abs() + 2.0**-24).all()


def test_fused_linear_cross_entropy_through_the_models_head_matches_the_unfused_one():
    """core.loss with a LogitHead (a divisor and a soft cap), kernel and torch: the same loss and gradients, and
    torch's as autograd of the model's own formula."""
    from torch import nn

    from lightning_oomb.core.loss import HeadGradients, linear_cross_entropy
    from lightning_oomb.integrations.transformers import LogitHead

    torch.manual_seed(0)
    head = nn.Linear(16, 300, bias=True, device=DEVICE)
    with torch.no_grad():
        head.weight.mul_(8)
    hidden, targets = torch.randn(37, 16, device=DEVICE), torch.randint(0, 300, (37,), device=DEVICE)
    logit_head = LogitHead(divisor=0.5, softcap=2.0)
    results = []
    for fused in (False, True):
        grads = HeadGradients(head)
        loss, grad_h = linear_cross_entropy(hidden, head.weight, head.bias, targets, 40.0, grads, True, fused=fused,
                                            head=logit_head)
        results.append((loss, grad_h, grads.weight, grads.bias))
    h = hidden.clone().requires_grad_()
    want = F.cross_entropy(logit_head.apply(head(h)), targets, reduction="sum") / 40.0
    want.backward()
    autograd = (want.detach(), h.grad, head.weight.grad, head.bias.grad)
    for got, torch_ops, exact, name in zip(results[1], results[0], autograd, ["loss", "dh", "dweight", "dbias"],
                                           strict=True):
        torch.testing.assert_close(torch_ops, exact, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}, torch: {m}")
        torch.testing.assert_close(got, torch_ops, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}, kernel: {m}")
    assert not torch.allclose(want, F.cross_entropy(head(hidden), targets, reduction="sum") / 40.0, rtol=1e-2)


def test_cross_entropy_rows_refuses_other_layouts():
    from lightning_oomb.kernels.cross_entropy import cross_entropy_rows

    logits = torch.randn(4, 10, device=DEVICE)
    with pytest.raises(ValueError, match="unit column stride"):
        cross_entropy_rows(logits.t(), torch.zeros(10, dtype=torch.long, device=DEVICE), 1.0, grad=True)


# --------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------


def _bad_calls():
    f32 = {"device": DEVICE}
    x, w = torch.randn(3, 8, **f32), torch.ones(8, **f32)
    q, k = torch.randn(1, 2, 4, 8, **f32), torch.randn(1, 1, 4, 8, **f32)
    cos, sin = torch.randn(1, 4, 8, **f32), torch.randn(1, 4, 8, **f32)
    return [
        (lambda: rms_norm(x, torch.ones(7, **f32), 1e-6), "N = weight"),
        (lambda: rms_norm(x, torch.ones(2, 8, **f32), 1e-6), "1-D"),
        (lambda: rms_norm(x.long(), w, 1e-6), "floating-point"),
        (lambda: rms_norm(x, w.to("meta"), 1e-6), "one device"),
        (lambda: silu_mul(x, torch.randn(3, 9, **f32)), "one shape"),
        (lambda: silu_mul(x, x.half()), "one dtype"),
        (lambda: silu_mul(x.int(), x.int()), "floating-point"),
        (lambda: silu_mul(x, x.to("meta")), "one device"),
        (lambda: apply_rope(q[0], k, cos, sin), r"\(B, H, T, D\)"),
        (lambda: apply_rope(q, torch.randn(1, 1, 3, 8, **f32), cos, sin), "matching q"),
        (lambda: apply_rope(q, k.half(), cos, sin), "one dtype"),
        (lambda: apply_rope(q[..., :7], k[..., :7], cos[..., :7], sin[..., :7]), "even"),
        (lambda: apply_rope(q, k, cos[:, :3], sin[:, :3]), "cos and sin must be"),
        (lambda: apply_rope(q, k, cos.expand(3, 4, 8), sin.expand(3, 4, 8)), "cos and sin must be"),
        (lambda: apply_rope(q, k, cos, sin[:, :, :4]), "one shape"),
        (lambda: apply_rope(q, k, cos.requires_grad_(), sin), "no gradient"),
        (lambda: apply_rope(q, k, cos.int(), sin), "floating-point"),
        (lambda: apply_rope(q, k.to("meta"), cos, sin), "one device"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_input(case):
    call, match = _bad_calls()[case]
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------------------------------------
# bf16 (GPU only)
# --------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_bf16_against_fp32_formulas():
    torch.manual_seed(0)
    dt = torch.bfloat16
    x, w = rms_inputs((4, 333), 3584, dt)
    compare(lambda a, b: rms_norm(a, b, 1e-6), hf_rms_norm(1e-6), [x, w], torch.randn_like(x, dtype=torch.float32),
            ["y", "dx", "dweight"])
    got, want = rms_norm(x, w, 1e-6), hf_rms_norm(1e-6)(x, w)
    ulp = torch.finfo(dt).eps * want.abs().float().clamp_min(torch.finfo(dt).tiny)
    assert ((got.float() - want.float()).abs() <= ulp).all()

    gate, up = torch.randn(2, 257, 2368, device="cuda").to(dt) * 4, torch.randn(2, 257, 2368, device="cuda").to(dt)
    compare(silu_mul, hf_silu_mul, [gate, up], torch.randn_like(gate, dtype=torch.float32), ["out", "dgate", "dup"])

    q, k = model_views(2, 28, 300, 128, dt), model_views(2, 4, 300, 128, dt)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    cos, sin = rope_tables(2, 300, 128, dt)
    compare(lambda a, b: apply_rope(a, b, cos, sin), lambda a, b: hf_rope(a, b, cos.to(a.dtype), sin.to(a.dtype)),
            [q, k], (torch.randn(2, 28, 300, 128, device="cuda"), torch.randn(2, 4, 300, 128, device="cuda")),
            ["q_embed", "k_embed", "dq", "dk"])
