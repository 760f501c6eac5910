"""The experts' load-balancing loss of a mixture-of-experts model (``output_router_logits=True``), exact under
chunking.

transformers adds ``router_aux_loss_coef * aux`` to the loss, with, over the R = layers x tokens rows of router
logits of the whole sequence (``load_balancing_loss_func``)::

    aux = E * sum_e (n_e / R) * (P_e / R)

n_e the top-k selections of expert e, P_e the sum of its softmax probabilities. The counts n_e carry no gradient,
so d aux / d p[row, e] = E * n_e / R^2 for every row: a constant vector once every row is counted. Stage 1
counts every (chunk, layer) it runs (the last chunk's last layer, which stage 1 may skip, is counted when stage 2
runs it, before its backward); each router's backward then adds the softmax's Jacobian times that vector to its
logits' gradient. The injection rides on the router's scores, the output that reaches the loss.
"""

from __future__ import annotations

import torch
from torch import nn

from .decoder import decoder_of


def router_class(lm: nn.Module) -> type | str | None:
    """The router module class (or class-name suffix) whose output ``router_logits`` records, None if none."""
    recorders = getattr(lm, "_can_record_outputs", None) or getattr(decoder_of(lm), "_can_record_outputs", None)
    recorder = (recorders or {}).get("router_logits")
    if recorder is None:
        return None
    return getattr(recorder, "target_class", None) or getattr(recorder, "class_name", None)


def _is_router(m: nn.Module, cls: type | str) -> bool:
    return isinstance(m, cls) if isinstance(cls, type) else type(m).__name__.endswith(cls)


class _AddBalanceGrad(torch.autograd.Function):
    """scores -> scores; the backward also adds the load-balancing loss's gradient into the logits."""

    @staticmethod
    def forward(ctx, scores, logits, balance):
        ctx.save_for_backward(logits)
        ctx.balance = balance
        return scores.clone()

    @staticmethod
    def backward(ctx, grad_scores):
        (logits,) = ctx.saved_tensors
        return grad_scores, ctx.balance.logits_grad(logits).to(logits.dtype), None


class RouterBalance:
    """Counts of one step's router rows and the load-balancing loss and gradient from them (module docstring).
    ``hooks()`` is a context for each stage's forward; ``grad_scale`` is the step's incoming gradient scale."""

    def __init__(self, lm: nn.Module):
        cfg = lm.config
        cls = router_class(lm)
        if cls is None:
            raise NotImplementedError(
                f"{type(lm).__name__} has output_router_logits=True but records no router logits that lightning_oomb "
                "can find: set config.output_router_logits=False"
            )
        self.routers = [m for m in lm.modules() if _is_router(m, cls)]
        self.n_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
        self.top_k = cfg.num_experts_per_tok
        self.coef = float(cfg.router_aux_loss_coef)
        self.counts = torch.zeros(self.n_experts, dtype=torch.float32)
        self.prob_sums = torch.zeros(self.n_experts, dtype=torch.float32)
        self.rows = 0
        self.counted: set[tuple[int, int]] = set()
        self.chunk = 0
        self.grad_scale: torch.Tensor | float = 1.0

    def _count(self, layer: int, logits: torch.Tensor) -> None:
        if (self.chunk, layer) in self.counted:  # a recomputation (stage 2, layer checkpoints)
            return
        self.counted.add((self.chunk, layer))
        with torch.no_grad():
            probs = torch.softmax(logits.detach(), dim=-1)
            chosen = torch.topk(probs, self.top_k, dim=-1).indices.reshape(-1)
            if self.counts.device != logits.device:
                self.counts, self.prob_sums = self.counts.to(logits.device), self.prob_sums.to(logits.device)
            self.counts += torch.bincount(chosen, minlength=self.n_experts).float()
            self.prob_sums += probs.float().sum(0)
            self.rows += probs.shape[0]

    def loss(self) -> torch.Tensor:
        """``router_aux_loss_coef * aux`` over the rows counted (float32 scalar)."""
        return self.coef * self.n_experts * (self.counts / self.rows * self.prob_sums / self.rows).sum()

    def logits_grad(self, logits: torch.Tensor) -> torch.Tensor:
        """d(grad_scale * coef * aux)/d logits for these rows (rows, E), in float32."""
        c = self.coef * self.n_experts * self.counts / self.rows**2
        p = torch.softmax(logits.detach(), dim=-1).float()
        return self.grad_scale * p * (c - (p * c).sum(-1, keepdim=True))

    def hooks(self):
        """Forward hooks on every router for one stage: count the rows, and where autograd records, route the
        loss's gradient into the logits through the scores."""
        handles = []
        for layer, router in enumerate(self.routers):
            def hook(module, args, output, layer=layer):
                logits, scores = output[0], output[1]
                self._count(layer, logits)
                if torch.is_grad_enabled() and logits.requires_grad:
                    return (logits, _AddBalanceGrad.apply(scores, logits, self), *output[2:])
                return None
            handles.append(router.register_forward_hook(hook))
        return _Handles(handles)


class _Handles:
    def __init__(self, handles):
        self.handles = handles

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False
