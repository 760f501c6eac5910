import os

import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be chosen before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


@pytest.fixture(params=["atomic-dq", "deterministic"])
def dq_mode(request):
    """Run a kernel test both ways the backward computes dQ: fp32 atomics inside the dK/dV kernel (the
    default), and the separate bit-reproducible dQ kernel that torch.use_deterministic_algorithms selects."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(request.param == "deterministic", warn_only=True)
    yield request.param
    torch.use_deterministic_algorithms(before)
