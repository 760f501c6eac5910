"""The planner's predicted peak GPU memory against the peaks measured on the H200 (docs/benchmarks.md)."""

import csv
from pathlib import Path

import pytest

from lightning_oomb.core.plan import CUDA_CONTEXT_BYTES, plan

BENCH = Path(__file__).parents[1] / "docs" / "bench"
# (file, measured with the fused Triton RMSNorm/RoPE/SwiGLU): h200-qwen2.5-7b-dense.csv ran transformers' own
# ops and kept no attention outputs; the others record the chunks they kept (outputs, and in some also graphs,
# whose output-layer gradient goes into the step's one float32 sum).
MEASURED = (
    ("h200-qwen2.5-7b-dense.csv", False),
    ("h200-qwen2.5-7b-dense-kept-fused.csv", True),
    ("h200-qwen2.5-7b-dense-32k.csv", True),
    ("h200-qwen2.5-7b-dense-788c4a1.csv", True),
    ("h200-qwen2.5-7b-dense-d49b5f5.csv", True),
)


def product_bytes(context: int, chunks: int) -> int:
    """What the measured steps kept and the plan does not count, since they ran without
    kernels.linear.swiglu_linear: the SwiGLU product of every layer, (chunk tokens, intermediate) in bf16, per
    chunk of activations held."""
    return chunks * 28 * min(context, 4096) * 18944 * 2


def oomb_rows():
    rows = []
    for name, fused in MEASURED:
        with open(BENCH / name) as f:
            rows += [
                pytest.param(name, fused, r, id=f"{name}:{r['context']}")
                for r in csv.DictReader(f) if r["mode"] == "oomb" and r["status"] == "ok"
            ]
    return rows


@pytest.mark.parametrize("name,fused,row", oomb_rows())
def test_predicted_peak_within_10_percent(name, fused, row):
    graphs = int(row.get("graph_chunks") or 0)
    step = plan(
        "qwen2.5-7b", int(row["context"]), chunk_size=int(row["chunk_size"]), batch=int(row["batch"]),
        optimizer="none", precision="bf16-true", checkpoint_layers=False, gpu_memory=141e9, host_memory=128e9,
        kept_chunks=int(row.get("kept_chunks") or 0), graph_chunks=graphs, fused_ops=fused,
    )
    predicted = step.peak_gpu_bytes - CUDA_CONTEXT_BYTES  # the measurement is torch's allocated peak, without the context
    if graphs > 1:
        # The bench's steps start without parameter gradients; with more than one kept graph their peak comes
        # at the end of stage 1, before the gradients exist (the plan counts them: see docs/planner.md).
        predicted -= next(v for k, v in step.gpu_lines.items() if k.startswith("gradients"))
    if fused:  # a kept graph holds a chunk's activations; without kept graphs stage 2 holds one chunk's
        predicted += product_bytes(int(row["context"]), max(graphs, 1))
    measured = int(row["peak_gpu_bytes"])
    assert abs(predicted - measured) / measured <= 0.10, (predicted / 2**30, measured / 2**30)


def sparse_rows():
    with open(BENCH / "h200-qwen2.5-7b-sparse-1m-staged.csv") as f:
        return [pytest.param(r, id=f"sparse:{r['context']}") for r in csv.DictReader(f)
                if r["status"] == "ok" and int(r["host_grad_layers"])]


@pytest.mark.parametrize("row", sparse_rows())
def test_predicted_sparse_peaks_with_host_gradient_layers(row):
    """The 1M-token sparse step (16 layers' bf16 gradient pages pinned on the host, float32 staging on the GPU)."""
    import torch

    from lightning_oomb.core.config import SparseConfig

    predicted = plan(
        "qwen2.5-7b", int(row["context"]), chunk_size=int(row["chunk_size"]), batch=int(row["batch"]),
        optimizer="none", precision="bf16-true", checkpoint_layers=False, gpu_memory=141e9, host_memory=128e9,
        grad_dtype=getattr(torch, row["grad_dtype"]), sparse=SparseConfig(budget_pages=64),
        host_grad_layers=int(row["host_grad_layers"]), fused_ops=True,
    )
    measured_gpu, measured_host = int(row["peak_gpu_bytes"]), int(row["peak_host_bytes"])
    gpu = predicted.peak_gpu_bytes - CUDA_CONTEXT_BYTES + product_bytes(int(row["context"]), 1)
    assert abs(gpu - measured_gpu) / measured_gpu <= 0.03, (gpu / 2**30, measured_gpu / 2**30)
    assert abs(predicted.peak_host_bytes - measured_host) / measured_host <= 0.10


# Measured steps for the time model, each with what its placement kept (the bench CSVs record it; for the CLI
# runs it is the plan printed at fit start, docs/bench/h200-cli-route-*-summary.json and the fit logs):
# (what, measured seconds, plan options).
SPARSE64 = {"budget_pages": 64}
TIMED = (
    ("h200-qwen2.5-7b-dense-d49b5f5.csv", "oomb", 32768, {}),
    ("h200-qwen2.5-7b-dense-d49b5f5.csv", "oomb", 65536, {}),
    ("h200-qwen2.5-7b-dense-d49b5f5.csv", "oomb", 131072, {}),
    ("h200-qwen2.5-7b-sparse-128k-d49b5f5.csv", "sparse", 131072, {"sparse": SPARSE64}),
    ("h200-qwen2.5-7b-sparse-1m-warm-e88a23c.csv", "sparse", 1 << 20, {"sparse": SPARSE64, "grad_dtype": "bfloat16"}),
    ("h200-qwen2.5-7b-packed-lora16-32k-3ca4960.csv", "oomb", 32768,
     {"lora_rank": 16, "checkpoint_layers": True, "grad_dtype": "bfloat16"}),
    # Packed documents: one cold step each (the pinning subtracted). Dense: documents starting on a page (their
    # chunks in the warp-specialised kernels), and mid-page (at PORTABLE_ATTENTION_EFFICIENCY, which a step
    # of 32K-token documents whose chunks all ran the portable kernels fitted).
    ("h200-qwen2.5-7b-packed-lora16-1m-gluon-a34339c.csv", "oomb", 1 << 20,
     {"lora_rank": 16, "checkpoint_layers": True, "grad_dtype": "bfloat16", "document_length": 32768}),
    ("h200-qwen2.5-7b-packed30000-lora16-1m-a34339c.csv", "oomb", 1 << 20,
     {"lora_rank": 16, "checkpoint_layers": True, "grad_dtype": "bfloat16", "document_length": 30000}),
    ("h200-qwen2.5-7b-packed-sparse-1m-3ca4960.csv", "sparse", 1 << 20,
     {"sparse": SPARSE64, "grad_dtype": "bfloat16", "document_length": 32768}),
)
CLI_TIMED = (  # lightning-oomb fit on the example YAMLs, AdamW, on the H200: a steady step, the placement it printed
    ("128K YAML", 38.7, 131072, dict(kept_chunks=24, graph_chunks=2)),
    ("128K YAML, 32K-token documents", 19.11, 131072, dict(kept_chunks=24, graph_chunks=2, document_length=32768)),
    ("LoRA YAML", 3.63, 32768, dict(lora_rank=16, kept_chunks=2, graph_chunks=6)),
    ("1M sparse YAML", 179.0, 1 << 20, dict(sparse=SPARSE64, grad_dtype="bfloat16", checkpoint_layers=True,
                                             host_grad_layers=21, host_kept_chunks=76)),
)


def timed_rows():
    rows = []
    for name, mode, context, options in TIMED:
        with open(BENCH / name) as f:
            row = next(r for r in csv.DictReader(f) if r["mode"] == mode and int(r["context"]) == context)
        kept = {k: int(row[k] or 0) for k in ("kept_chunks", "graph_chunks", "host_kept_chunks") if k in row}
        placed = dict(options, optimizer="none", host_grad_layers=int(row["host_grad_layers"] or 0), **kept)
        step = float(row["step_time_s"]) - float(row.get("pin_s") or 0)  # page-locking: once per run
        rows.append(pytest.param(step, context, placed, id=f"{name}:{context}"))
    for what, seconds, context, options in CLI_TIMED:
        rows.append(pytest.param(seconds, context, dict(options, optimizer="adamw"), id=what))
    return rows


@pytest.mark.parametrize("measured,context,options", timed_rows())
def test_step_time_within_ten_percent(measured, context, options):
    """The time model counts what a step executes (kept chunks skip stage-2 work) at a linear and an attention
    efficiency fitted to these steps; each is predicted within 10% (all within 5% when fitted)."""
    import torch

    options = dict(options)
    if "grad_dtype" in options:
        options["grad_dtype"] = getattr(torch, options["grad_dtype"])
    predicted = plan("qwen2.5-7b", context, gpu_memory=10**15, host_memory=10**15, **options).time.predicted_s
    assert predicted == pytest.approx(measured, rel=0.10), f"predicted {predicted:.2f} s, measured {measured:.2f} s"


SMALL_MODEL = "h100-smollm2-64k-285d581"  # SmolLM2-135M's shape at 64K, bench on an H100, bf16, no optimizer


@pytest.mark.parametrize("csv_name", ["chunk4096.csv", "chunk16384.csv"])
def test_small_model_step_within_a_quarter(csv_name):
    """A small model's step: heads of 64 at their own attention efficiency, and the GPU waiting for the host's
    kernel launches where a chunk's compute is shorter than them (most of the step in chunks of 4096, little
    in chunks of 16384). The planner's time within 25% of each measured step."""
    with open(BENCH / SMALL_MODEL / csv_name) as f:
        row = next(r for r in csv.DictReader(f) if r["mode"] == "oomb")
    kept = {k: int(row[k] or 0) for k in ("kept_chunks", "graph_chunks", "host_kept_chunks")}
    step = plan("smollm2-135m", int(row["context"]), chunk_size=int(row["chunk_size"]), optimizer="none",
                precision="bf16-true", checkpoint_layers=False, gpu_memory=10**15, host_memory=10**15, **kept)
    measured = float(row["step_time_s"])
    assert step.time.predicted_s == pytest.approx(measured, rel=0.25), (step.time.predicted_s, measured)
    if row["chunk_size"] == "4096":
        assert step.time.launch_s > 0.3 * step.time.predicted_s  # launch-bound
