import dataclasses
import multiprocessing
import os

import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be chosen before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The interpreter checks every int32 add, sub and mul for overflow (Triton's sanitize_overflow; compiled kernels
    # check only with debug=True): about a quarter of interpreted time, for test shapes far below 2**31.
    from triton.runtime import interpreter

    if dataclasses.is_dataclass(getattr(interpreter, "interpreter_builder", None) and interpreter.interpreter_builder.options):
        interpreter.interpreter_builder.options = dataclasses.replace(interpreter.interpreter_builder.options,
                                                                      sanitize_overflow=False)

# The distributed tests' processes start from one fork server that imported these once (fork before any thread pool
# or CUDA context exists), instead of each being a fresh interpreter that imports them again (~8 s of CPU each).
# "conftest" brings the settings above into the server.
multiprocessing.set_forkserver_preload(["conftest", "lightning_oomb.cli"])
