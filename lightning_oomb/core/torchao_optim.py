"""torchao's AdamW classes as ``model.optimizer`` builds them: their compiled step made with one fixed kernel
configuration on CUDA.

Inductor tries several configurations of a Triton kernel at its first launch. Before it does so for a kernel
that writes into its inputs (an optimizer step writes the weights and the moments), it copies those inputs,
and where the GPU has no room for the copies (a long-context step leaves none) it copies them to pinned host
memory, which torch's pinned allocator rounds up to powers of two and keeps for the life of the process:
13 GiB for a Qwen2.5-7B update with adamw8bit-kahan and 8 GiB with adamw8bit, measured on an H100, enough to
get a run killed that its plan said would fit (docs/optimizers.md). With one configuration per kernel
(Inductor's deterministic mode, pointwise autotuning off) nothing is tried and nothing copied; the measured
step time is the same. The moments' reductions are maxima, so the configuration does not change the result.
"""

from __future__ import annotations

import contextlib

from torchao.optim import AdamW8bit as _TorchaoAdamW8bit
from torchao.optim import _AdamW as _TorchaoAdamW

# Inductor settings under which a compiled optimizer step is built; keys an older torch lacks are left out
# (without ``deterministic`` its reductions are still tried, and copied, at their first launch).
ONE_CONFIG_INDUCTOR = {"triton.autotune_pointwise": False, "deterministic": True}


def one_config_inductor() -> contextlib.AbstractContextManager:
    """A context in which ``torch.compile`` builds each Triton kernel at one configuration (ONE_CONFIG_INDUCTOR,
    the keys this torch has)."""
    import torch._inductor.config as inductor

    settings = {}
    for key, value in ONE_CONFIG_INDUCTOR.items():
        owner, _, name = key.rpartition(".")
        if hasattr(getattr(inductor, owner) if owner else inductor, name):
            settings[key] = value
    return inductor.patch(settings)


class OneConfigStep:
    """Mixed in front of a torchao optimizer: its steps on CUDA run under ``one_config_inductor`` (on the CPU,
    where Inductor writes C++ and tries nothing, as they are)."""

    def step(self, closure=None):
        on_cuda = any(p.is_cuda for group in self.param_groups for p in group["params"])
        with one_config_inductor() if on_cuda else contextlib.nullcontext():
            return super().step(closure)


class AdamW8bit(OneConfigStep, _TorchaoAdamW8bit):
    """torchao's AdamW8bit (8-bit moments)."""


class AdamW(OneConfigStep, _TorchaoAdamW):
    """torchao's AdamW (moments in the weights' dtype; ``bf16_stochastic_round`` for adamw-sr)."""

