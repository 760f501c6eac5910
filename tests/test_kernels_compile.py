"""The attention (Triton and Gluon), host-page and loss kernels build for Hopper (sm_90) on a machine without a GPU
(see compile_kernels_sm90.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_kernels_compile_for_sm90():
    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(here / "compile_kernels_sm90.py")], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-6000:]
    # descriptors, pointers, values of another width, the warp-specialised Gluon kernels, host pages, soft caps
    assert run.stdout.count("compiled for sm_90") == 6
