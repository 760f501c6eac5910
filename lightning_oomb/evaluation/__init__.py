"""Long-context evaluation on the engine: greedy generation over the K/V pages (``generate``) and lm-eval's
scoring requests (``loglikelihood``, ``loglikelihood_rolling``), each through the chunked forward without
gradients. Imports the engine (core/), never the Lightning layer."""

from .generate import GenerateOutput, generate
from .scoring import loglikelihood, loglikelihood_rolling

__all__ = ["GenerateOutput", "generate", "loglikelihood", "loglikelihood_rolling"]
