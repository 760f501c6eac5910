"""kernels.linear: the weight gradient added into .grad by the matmul equals autograd's accumulated one."""

import torch
import torch.nn.functional as F

from lightning_oomb.kernels.linear import _adds_in_place, accumulating_linear


def _two_backwards(linear, x, w, b, douts):
    for dout in douts:
        xi = x.clone().requires_grad_()
        linear(xi, w, b).backward(dout)
    return xi.grad, w.grad.clone(), b.grad.clone()


def test_gradients_accumulate_like_autograd():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    douts = [torch.randn(2, 5, 3, dtype=torch.float64) for _ in range(3)]
    got_w, want_w = (torch.randn(3, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    with torch.no_grad():
        want_w.copy_(got_w)
    got_b, want_b = (torch.zeros(3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    got = _two_backwards(accumulating_linear, x, got_w, got_b, douts)
    assert _adds_in_place(got_w)  # after the first backward created .grad, later ones add in place
    want = _two_backwards(F.linear, x, want_w, want_b, douts)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_weights_with_hooks_get_their_gradient_through_autograd():
    w = torch.randn(3, 8, requires_grad=True)
    calls = []
    w.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    for _ in range(2):
        accumulating_linear(torch.randn(4, 8), w).sum().backward()
    assert len(calls) == 2 and not _adds_in_place(w)


def test_adds_in_place_inside_a_layer_checkpoint(monkeypatch):
    """torch.utils.checkpoint hands backward detached aliases of the saved tensors (no .grad): the matmul
    must still find the parameter's .grad and add into it, as it does without the checkpoint."""
    from torch.utils.checkpoint import checkpoint

    from lightning_oomb.kernels import linear

    returned = []
    weight_gradient = linear._weight_gradient
    monkeypatch.setattr(linear, "_weight_gradient", lambda *a: returned.append(weight_gradient(*a)) or returned[-1])
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    douts = [torch.randn(2, 5, 3, dtype=torch.float64) for _ in range(3)]
    got_w = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    want_w = got_w.detach().clone().requires_grad_()
    for dout in douts:
        checkpoint(accumulating_linear, x, got_w, use_reentrant=False).backward(dout)
        F.linear(x, want_w).backward(dout)
    assert returned[0] is not None and all(r is None for r in returned[1:])  # the first creates .grad
    torch.testing.assert_close(got_w.grad, want_w.grad, rtol=1e-12, atol=1e-12)
