"""The planner's predicted peak GPU memory against the peaks measured on the H200 (docs/benchmarks.md)."""

import csv
from pathlib import Path

import pytest

from lightning_oomb.core.planner import CUDA_CONTEXT_BYTES, plan

MEASURED = Path(__file__).parents[1] / "docs" / "bench" / "h200-qwen2.5-7b-dense.csv"


def oomb_rows():
    with open(MEASURED) as f:
        return [r for r in csv.DictReader(f) if r["mode"] == "oomb" and r["status"] == "ok"]


@pytest.mark.parametrize("row", oomb_rows(), ids=lambda r: r["context"])
def test_predicted_peak_within_10_percent(row):
    predicted = plan(
        "qwen2.5-7b", int(row["context"]), chunk_size=int(row["chunk_size"]), batch=int(row["batch"]),
        optimizer="none", precision="bf16-true", checkpoint_layers=False, gpu_memory=141e9, host_memory=128e9,
    ).peak_gpu_bytes - CUDA_CONTEXT_BYTES  # the measurement is torch's allocated peak, without the context
    measured = int(row["peak_gpu_bytes"])
    assert abs(predicted - measured) / measured <= 0.10, (predicted / 2**30, measured / 2**30)
