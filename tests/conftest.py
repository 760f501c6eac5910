import os

import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be chosen before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
