"""tanh in Triton, for soft-capped scores and logits (cap * tanh(x / cap)).

libdevice's tanh does not run in Triton's interpreter, where the kernels are tested on CPU, so one formula
serves both: an odd Taylor polynomial near 0, where 1 - exp(-2|x|) would cancel, and (1 - e) / (1 + e) with
e = exp(-2|x|) elsewhere (e <= 1: no overflow). Within 2.5e-7 of tanh relatively in float32 (torch.tanh: 6e-8).
"""

from __future__ import annotations

import triton
import triton.language as tl

# |x| below this takes the polynomial (its first left-out term, 1382/155925 x^11, is 1e-8 of tanh x there);
# above it 1 - e >= 0.39, so e's rounding moves tanh by at most about 1.5e-7 of itself.
_SMALL: tl.constexpr = tl.constexpr(0.25)
_MINUS_2_LOG2E: tl.constexpr = tl.constexpr(-2.8853900817779268)


@triton.jit
def tanh(x):
    """tanh of a float32 tensor, element-wise."""
    a = tl.abs(x)
    e = tl.math.exp2(a * _MINUS_2_LOG2E)
    large = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (-0.05396825396825397
                                                                                       + x2 * 0.021869488536155203))))
    return tl.where(a < _SMALL, small, tl.where(x < 0, -large, large))
