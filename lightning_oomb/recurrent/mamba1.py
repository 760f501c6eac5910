"""Mamba-1 mixers (Jamba's, Mamba's, Falcon-Mamba's) run one chunk at a time, from the state the chunk before left.

The mixer's input projection gives the convolution's inputs and the gate; the short convolution continues from
its last ``kernel - 1`` inputs before the chunk; x_proj, the norms of dt, B and C where the mixer has them
(Jamba's RMS norms, Falcon-Mamba's weightless ones; Mamba's mixer has none) and dt_proj give the selective scan's
inputs, and the scan starts from the SSM state the chunk before left. transformers' scan
(``mamba_selective_scan``) always starts from zeros, so the scan is written here: its torch reference path
(``selective_scan``), token after token, with transformers' dtypes. mamba-ssm's fused kernel, which transformers
calls where it is installed, takes no initial state either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .carried_state import CarriedState, causal_conv_from


def initial_state(layer: nn.Module, batch: int) -> CarriedState:
    """Zeros before a sequence's first token. conv (B, intermediate_size, kernel - 1) in the layer's dtype: the
    convolution's inputs of the last kernel - 1 tokens; recurrent (B, intermediate_size, ssm_state_size) float32:
    the SSM state (float32 in transformers' scan from its first token on)."""
    return CarriedState.zeros(layer.conv1d, batch, (layer.intermediate_size, layer.ssm_state_size))


def _scan_inputs(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scan's time step before its bias (B, intermediate, T), B and C (B, T, ssm_state_size) from the
    convolution's output ``x`` (B, T, intermediate), as the mixer computes them: normed where it has the norms."""
    time_step, b, c = torch.split(layer.x_proj(x), [layer.time_step_rank, layer.ssm_state_size,
                                                     layer.ssm_state_size], dim=-1)
    if hasattr(layer, "dt_layernorm"):
        time_step = layer.dt_layernorm(time_step)
        b = layer.b_layernorm(b)
        c = layer.c_layernorm(c)
    if hasattr(layer.config, "_is_quantized"):  # transformers calls a quantized dt_proj as a module
        return (layer.dt_proj(time_step) - layer.dt_proj.bias).transpose(1, 2), b, c
    return layer.dt_proj.weight @ time_step.transpose(1, 2), b, c


def selective_scan(x: torch.Tensor, time_step: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   D: torch.Tensor, gate: torch.Tensor, dt_bias: torch.Tensor | None,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan of a chunk from the SSM state ``state`` (B, I, N) float32: the reference path, one token
    after the other, in the operations and dtypes of transformers' torch path (``mamba_selective_scan``).

    x, gate: (B, I, T) in the layer's dtype; time_step: (B, I, T), before ``dt_bias`` (I,) and softplus; A: (I, N)
    float32; b, c: (B, T, N); D: (I,) float32. Returns the gated output with the D skip (B, I, T) and the state
    after the last token (B, I, N) float32."""
    dtype = x.dtype
    if dt_bias is not None:
        time_step = time_step + dt_bias.to(time_step.dtype)[..., None]
    dt = F.softplus(time_step)
    decay = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # (B, I, T, N)
    update = dt[:, :, :, None] * b[:, None, :, :].float() * x[:, :, :, None].float()
    outputs = []
    for t in range(x.shape[2]):
        state = decay[:, :, t] * state + update[:, :, t]
        outputs.append(torch.matmul(state.to(dtype), c[:, t, :].unsqueeze(-1))[:, :, 0])
    out = torch.stack(outputs, dim=-1) + x * D[None, :, None]
    return out * F.silu(gate), state


def mamba1_chunk(layer: nn.Module, hidden: torch.Tensor, state: CarriedState) -> tuple[torch.Tensor, CarriedState]:
    """One chunk of a Mamba-1 ``layer`` (``JambaMambaMixer``, ``MambaMixer``, ``FalconMambaMixer``) from ``state``.

    hidden: (B, T, hidden_size), the chunk's input to the mixer. Returns the mixer's output (B, T, hidden_size)
    and the state after the chunk's last token."""
    inputs, gate = layer.in_proj(hidden).transpose(1, 2).chunk(2, dim=1)
    x, tail = causal_conv_from(state.conv, inputs, layer.conv1d, layer.activation)
    time_step, b, c = _scan_inputs(layer, x)
    bias = layer.dt_proj.bias.float() if layer.dt_proj.bias is not None else None
    out, recurrent = selective_scan(x.transpose(1, 2), time_step, -torch.exp(layer.A_log.float()), b, c,
                                    layer.D.float(), gate, bias, state.recurrent)
    return layer.out_proj(out.transpose(1, 2).to(hidden.dtype)), CarriedState(conv=tail, recurrent=recurrent)
