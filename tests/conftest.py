import dataclasses
import multiprocessing
import os
import sys

import pytest
import torch

# The data modules' token cache goes to a folder of this test session, not the user's ~/.cache (the CLI runs the
# tests start as subprocesses inherit it).
if not os.environ.get("LIGHTNING_OOMB_CACHE"):
    import atexit
    import shutil
    import tempfile

    os.environ["LIGHTNING_OOMB_CACHE"] = tempfile.mkdtemp(prefix="lightning-oomb-token-cache-")
    atexit.register(shutil.rmtree, os.environ["LIGHTNING_OOMB_CACHE"], ignore_errors=True)

# Under pytest-xdist (`-n 2`) the workers share the machine's cores: each takes its share for torch's threads and
# for the programs it starts, instead of every worker using every core.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

# Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be chosen before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The interpreter checks every int32 add, sub and mul for overflow (Triton's sanitize_overflow; compiled kernels
    # check only with debug=True): about a quarter of interpreted time, for test shapes far below 2**31.
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    if builder is not None and dataclasses.is_dataclass(builder.options):  # else left as it is: slower, not wrong
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)

    # The processes the distributed tests start themselves (tiny_models.START_METHOD) fork from one server that
    # imported these once, instead of each being a fresh interpreter importing them again (~8 s of CPU each).
    # "conftest" brings the settings above into the server.
    multiprocessing.set_forkserver_preload(["conftest", "lightning_oomb.cli", "lightning_oomb.lightning.cli"])


@pytest.fixture(autouse=True, scope="session")
def _no_command_line():
    """The tests run the CLI in-process as a Python program does, ``main([...])``: pytest's own arguments are not
    that command's line (LightningCLI warns when it is given ``args`` beside a command line). Session-wide, so that
    module fixtures that train see it too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", sys.argv[:1])
        yield
