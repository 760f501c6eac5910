"""The bench command on CPU at tiny shapes: outputs, columns, finite times, OOM points recorded."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch

from lightning_oomb.bench.config import BenchConfig
from lightning_oomb.bench.modes import MODES, BenchMode, register_mode
from lightning_oomb.bench.report import write_outputs
from lightning_oomb.bench.results import CSV_COLUMNS, PointResult
from lightning_oomb.bench.sweep import build_model, progress_line, run
from lightning_oomb.core.model_shape import ModelShape
from lightning_oomb.core.plan.timing import step_time
from lightning_oomb.kernels import host_pages
from lightning_oomb.cli import main as cli_main

TINY_QWEN2 = {
    "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 101, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "use_sliding_window": False,
}


def tiny_config(tmp_path):
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY_QWEN2))
    return path


def read_rows(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_bench_writes_csv_markdown_and_plot(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["bench", "--model", str(tiny_config(tmp_path)), "--lengths", "64,128", "--modes",
            "baseline,oomb,offload", "--repeats", "1", "--chunk", "32", "--out", str(out)]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "[6/6] offload" in printed and "| mode | context |" in printed
    for name in ("results.csv", "results.md", "results.png"):
        assert (out / name).stat().st_size > 0, name
    columns, rows = read_rows(out / "results.csv")
    assert tuple(columns) == CSV_COLUMNS
    assert [(r["mode"], int(r["context"])) for r in rows] == [
        ("baseline", 64), ("baseline", 128), ("oomb", 64), ("oomb", 128), ("offload", 64), ("offload", 128)]
    for r in rows:
        assert r["status"] == "ok"
        for column in ("step_time_s", "tokens_per_s", "floor_s", "floor_fraction", "loss"):
            assert math.isfinite(float(r[column])) and float(r[column]) > 0, column
        assert int(r["peak_host_bytes"]) > 0
    # Same model, same tokens: the two modes compute the same loss.
    losses = {(r["mode"], r["context"]): float(r["loss"]) for r in rows}
    for n in ("64", "128"):
        assert math.isclose(losses["baseline", n], losses["oomb", n], rel_tol=1e-5)
        assert math.isclose(losses["baseline", n], losses["offload", n], rel_tol=1e-5)
    assert rows[2]["planned_step_s"] and not rows[0]["planned_step_s"]  # the planner models oomb only
    # Offload rows: the segment the step streamed (on CPU one chunk, at least a page of 128) and its traffic.
    for r in rows[4:]:
        assert int(r["segment_tokens"]) == 128 and int(r["h2d_bytes"]) > 0 and int(r["d2h_bytes"]) > 0
        assert float(r["planned_host_gib"]) > 0
    md = (out / "results.md").read_text()
    assert "- machine:" in md and "- date:" in md and "lightning-oomb bench --model" in md
    assert md.count("\n| ") == 7  # header + 6 points


def test_sparse_offload_mode_moves_every_layer_to_the_host(tmp_path):
    out = tmp_path / "out"
    argv = ["bench", "--model", str(tiny_config(tmp_path)), "--lengths", "256", "--modes", "sparse,sparse-offload",
            "--repeats", "1", "--warmup", "0", "--chunk", "64", "--page-size", "16", "--budget-pages", "6",
            "--add-launch", "4x8x2", "--gather-programs", "2", "--out", str(out)]
    # The same step with its pages on the GPU and in host memory: one selection per query tile in both.
    assert cli_main([*argv, "--selection", "tile"]) == 0
    _, rows = read_rows(out / "results.csv")
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert host_pages.ADD_LAUNCH == host_pages.AddLaunch()  # the sweep's launch was for its points only
    assert [r["host_grad_layers"] for r in rows] == ["0", str(TINY_QWEN2["num_hidden_layers"])]
    assert rows[1]["host_kv_layers"] == str(TINY_QWEN2["num_hidden_layers"]) and int(rows[1]["kv_pages_gathered"]) > 0
    assert rows[1]["host_grads_moved_at"] == ""  # no K/V page on the GPU: no dead page to move gradients into
    assert math.isclose(float(rows[0]["loss"]), float(rows[1]["loss"]), rel_tol=1e-6)
    assert float(rows[1]["planned_host_gib"]) > 0
    assert [float(r["pin_s"]) for r in rows] == [0, 0]  # the pool was made in the timed step, but nothing pins on a CPU
    # One selection per chunk: a chunk's calls gather at most budget pages per KV head.
    assert cli_main([*argv[:6], "sparse-offload", *argv[7:-1], str(tmp_path / "chunk"), "--selection", "chunk"]) == 0
    _, (per_chunk,) = read_rows(tmp_path / "chunk" / "results.csv")
    assert 0 < int(per_chunk["kv_pages_gathered"]) <= int(rows[1]["kv_pages_gathered"])
    assert "6 pages per chunk" in (tmp_path / "chunk" / "results.md").read_text()
    # --selection auto (the default): per chunk where the pages live in host memory.
    assert cli_main([*argv[:6], "sparse-offload", *argv[7:-1], str(tmp_path / "auto")]) == 0
    _, (auto,) = read_rows(tmp_path / "auto" / "results.csv")
    assert auto["kv_pages_gathered"] == per_chunk["kv_pages_gathered"] and auto["loss"] == per_chunk["loss"]
    # Warm-up steps' gathers are not counted: the count is per timed step.
    warm = [*argv[:6], "sparse-offload", *argv[7:-1], str(tmp_path / "warm"), "--selection", "chunk"]
    warm[warm.index("--repeats") + 1], warm[warm.index("--warmup") + 1] = "2", "1"
    assert cli_main(warm) == 0
    _, (warm_row,) = read_rows(tmp_path / "warm" / "results.csv")
    assert warm_row["kv_pages_gathered"] == per_chunk["kv_pages_gathered"]
    # No programs is refused, not taken for the default.
    none = list(argv)
    none[none.index("--gather-programs") + 1] = "0"
    with pytest.raises(SystemExit) as refused:
        cli_main(none)
    assert refused.value.code == 2


def test_bad_step_options_are_one_line_before_a_model_is_built(tmp_path, capsys):
    """A sparse budget its sink and local pages overflow: SparseConfig's message, one line, exit 2."""
    with pytest.raises(SystemExit) as refused:
        cli_main(["bench", "--model", str(tiny_config(tmp_path)), "--modes", "sparse", "--budget-pages", "4",
                  "--out", str(tmp_path / "out")])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sink_pages + local_pages (1 + 4) must not exceed budget_pages (4)" in err
    assert not (tmp_path / "out").exists()


def test_out_of_memory_point_is_recorded_and_the_sweep_goes_on(tmp_path):
    def step(model, input_ids, config):
        if input_ids.shape[1] > 64:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return MODES["oomb"].step(model, input_ids, config)

    register_mode(BenchMode("oom-above-64", "oomb that runs out of memory above 64 tokens", step))
    try:
        config = BenchConfig(model=str(tiny_config(tmp_path)), lengths=(64, 128, 64),
                             modes=("oom-above-64",), chunk_size=32, repeats=1, warmup=0, out=tmp_path / "o")
        results = run(config, log=lambda line: None)
        write_outputs(results, config, "test", "cpu")
        # A sweep whose only point failed still writes its files (no memory to draw on a log scale).
        write_outputs(results[1:2], dataclasses.replace(config, out=tmp_path / "p"), "test", "cpu")
    finally:
        del MODES["oom-above-64"]
    assert [r.status for r in results] == ["ok", "OOM", "ok"]
    _, rows = read_rows(tmp_path / "o" / "results.csv")
    assert rows[1]["status"] == "OOM" and rows[1]["step_time_s"] == ""
    assert (tmp_path / "o" / "results.png").exists() and (tmp_path / "p" / "results.png").exists()


def test_sparse_fidelity_report(tmp_path):
    """The fidelity bench end to end at a tiny size: a budget covering every past page is dense."""
    import yaml

    from lightning_oomb.bench import sparse_fidelity

    config = yaml.safe_load(open("examples/passkey_cpu.yaml"))
    config["trainer"]["max_steps"] = 2
    config["trainer"]["strategy"]["init_args"]["chunk_size"] = 64
    config["data"]["init_args"].update(seq_len=256, key_window=64, val_size=2)
    config["model"]["config"].update(max_position_embeddings=256, num_attention_heads=2)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "fidelity.md"
    sparse_fidelity.main(["--config", str(path), "--page-size", "16", "--budget-pages", "8,16", "--sequences", "1",
                          "--train-budget-pages", "8", "--kv-heads", "2", "--out", str(out)])
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| 16 ")]
    assert len(rows) == 6  # two scores x three selections
    for row in rows:  # the past has at most 12 pages: budget 16 attends to all of them, which each call gathers
        assert float(row[5]) < 1e-5 and float(row[3]) > 1 - 1e-9
        assert 0 < float(row[8]) <= 12
    assert "Held-out retrieval accuracy" in out.read_text()


def test_profile_groups_our_kernels_by_exact_name():
    """The step profile's groups: the dense, sparse and Hopper (Gluon) attention kernels of each direction by
    name, the fused elementwise kernels (whose names also end in _fwd_kernel) not among them."""
    from lightning_oomb.bench.profile_step import _group

    assert _group("_past_forward_kernel") == _group("_fwd_kernel") == "attention forward"
    assert _group("_page_dkdv_kernel") == _group("_past_dkdv_kernel") == "attention dK/dV"
    assert _group("_past_dq_kernel") == _group("_sparse_dq_kernel") == "attention dQ"
    assert _group("_silu_mul_fwd_kernel") == _group("_rms_norm_fwd_kernel") == "other"
    assert _group("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "matmul (cuBLAS)"


def test_profile_stream_overlap_counts_side_work_under_compute():
    """The streams report: busy time per stream from overlapping kernel spans, the compute stream the busiest,
    a side stream's hidden share the part of its busy time inside the compute stream's."""
    from lightning_oomb.bench.profile_step import merged, stream_overlap

    assert merged([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]
    compute = [(7, 0, 4), (7, 6, 10)]
    gathers = [(20, 3, 5), (20, 9, 12)]  # 1 + 1 of 2 + 3 under the compute
    additions = [(30, 0, 1), (30, 0.5, 2)]  # 2 of 2
    assert stream_overlap(gathers + compute + additions) == [(7, 8, 8), (20, 5, 2), (30, 2, 2)]


def test_profile_idle_gaps_of_a_stream_longest_first():
    """A stream's idle gaps lie between the end of the spans so far and the next start, named by the kernels
    on either side; spans that overlap leave none."""
    from lightning_oomb.bench.profile_step import idle_gaps

    spans = [(0, 4, "a"), (1, 2, "b"), (6, 7, "c"), (7, 8, "d"), (18, 20, "e")]
    assert idle_gaps(spans) == [(10, "d", "e"), (2, "a", "c")]


def test_profile_gap_causes_split_the_host_and_the_device():
    """A gap before a kernel launched after the stream went idle is the host's up to the launch; the rest of it,
    and a gap before a kernel launched long before, is queued work waiting; the host spans overlapping the
    host's part are named."""
    from lightning_oomb.bench.profile_step import gap_causes

    kernels = [(0, 10, 1), (30, 40, 2), (100, 110, 3), (111, 120, 4)]
    launched = {1: -5, 2: 25, 3: 5, 4: 50}  # kernel 2 launched 15 into its 20 gap, kernel 3 long before
    host = [(12, 20, "cudaStreamSynchronize"), (20, 26, "aten::copy_")]
    host_s, device_s, unknown_s, ops = gap_causes(kernels, launched, host, min_gap=5)
    assert (host_s, device_s, unknown_s) == (15, 65, 0)
    assert ops == {"cudaStreamSynchronize": 8, "aten::copy_": 5}


def test_profile_chunk_ranges_and_timeline():
    """--chunks parses to sorted, non-overlapping ranges inside the step; the timeline's chunk times are the
    differences between consecutive marks, stage 2 listed last chunk first."""
    from lightning_oomb.bench.profile_step import chunk_seconds, parse_chunk_ranges, timeline_lines

    assert parse_chunk_ranges("6:8, 0:2", 8) == [(0, 2), (6, 8)]
    assert parse_chunk_ranges("", 8) == []
    for bad in ("3:3", "0:9", "a:b", "0:4,3:5"):
        with pytest.raises(ValueError):
            parse_chunk_ranges(bad, 8)
    marks = [(1, 0), (1, 1), (2, 1), (2, 0)]
    seconds = chunk_seconds(marks, [100.0, 300.0, 600.0, 1000.0])
    assert seconds == {(1, 0): 0.1, (1, 1): 0.2, (2, 1): 0.3, (2, 0): 0.4}
    lines = timeline_lines(seconds, 2, 1)
    assert lines[0] == "stage 1: 0.30 s" and lines[3].startswith("stage 2: 0.70 s")
    assert "chunks    1..1" in lines[4] and "300.0 ms" in lines[4]


def test_progress_line_names_what_stage_1_kept_and_where():
    r = PointResult("sparse", 1 << 20, 1, 4096, 0, "bfloat16", step_time_s=148.4, tokens_per_s=7065.0,
                    loss=12.65, peak_host_bytes=1 << 30, graph_chunks=1, kept_chunks=0, host_kept_chunks=104)
    line = progress_line(2, 2, r, 369.0)
    kept = "graphs of the last 1, attention outputs of the first 104 on the host"
    assert f"(kept from stage 1, in chunks: {kept})" in line
    assert "on the GPU" not in line
    nothing_kept = dataclasses.replace(r, graph_chunks=0, host_kept_chunks=0)
    assert "kept from stage 1" not in progress_line(1, 2, nothing_kept, 1.0)


def test_packed_documents_option(tmp_path, capsys):
    """--document-length 32: position ids restart every 32 tokens in the oomb modes' steps (the loss is that of
    the documents taken separately), recorded in the CSV; the floor counts attention within documents only.
    The baseline, which cannot take them, is refused in one line."""
    out = tmp_path / "out"
    model_path = str(tiny_config(tmp_path))
    argv = ["bench", "--model", model_path, "--lengths", "128", "--modes", "oomb,offload", "--repeats", "1",
            "--warmup", "0", "--chunk", "32", "--page-size", "8", "--document-length", "32", "--out", str(out)]
    assert cli_main(argv) == 0
    _, rows = read_rows(out / "results.csv")
    assert [(r["mode"], r["status"], r["document_length"]) for r in rows] == [("oomb", "ok", "32"), ("offload", "ok", "32")]
    assert "documents of 32 tokens" in (out / "results.md").read_text()

    config = BenchConfig(model=model_path, seed=0)
    model = build_model(config, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(config.seed + 128)
    ids = torch.randint(0, TINY_QWEN2["vocab_size"], (1, 128), generator=generator)
    with torch.no_grad():  # four documents of 32 tokens, 31 labels each
        separate = sum(model(input_ids=doc[None], labels=doc[None]).loss for doc in ids[0].split(32)) / 4
    for r in rows:
        assert math.isclose(float(r["loss"]), separate.item(), rel_tol=1e-5)
    shape = ModelShape.resolve(model_path)
    unpacked = step_time(shape, 128, chunk_size=32).attention_flops
    assert step_time(shape, 128, chunk_size=32, document_length=32).attention_flops == unpacked / 4
    assert math.isclose(float(rows[0]["floor_s"]), step_time(shape, 128, chunk_size=32, document_length=32).floor_s,
                        rel_tol=1e-5)

    with pytest.raises(SystemExit) as refused:
        cli_main(argv[:6] + ["baseline,oomb"] + argv[7:])
    assert refused.value.code == 2
    assert "would attend across their borders" in capsys.readouterr().err


def test_cli_route_corpus_of_documents_restarts_positions_per_document(tmp_path):
    """bench.cli_route --document-length 64: the generated corpus holds documents of 64 tokens each (EOS
    included, byte tokenizer), so that the data module's position ids restart every 64 tokens."""
    from lightning_oomb import TextCorpusDataModule
    from lightning_oomb.bench.cli_route import BYTE_TOKENIZER, make_corpus

    corpus = make_corpus(tmp_path / "corpus.txt", 2 * 256, document_tokens=64)
    assert corpus.suffix == ".jsonl"
    data = TextCorpusDataModule(paths=[str(corpus)], tokenizer=str(BYTE_TOKENIZER), seq_len=256, batch_size=1,
                                val_fraction=0.5, document_masking=True)
    data.setup("fit")
    assert torch.equal(data.train_set[0]["position_ids"], torch.arange(256) % 64)


def test_cli_route_model_directory_gets_a_tokenizer_as_long_as_its_embeddings(tmp_path):
    """bench.cli_route writes the byte tokenizer into a random model's directory padded to the model's vocabulary,
    so that fit takes the model directory's own tokenizer (its length check passes) and tokenizes bytes as
    examples/byte_tokenizer does."""
    from lightning_oomb.bench.cli_route import BYTE_TOKENIZER, write_byte_tokenizer
    from lightning_oomb.lightning.corpus import check_tokenizer_matches, load_tokenizer

    write_byte_tokenizer(tmp_path, 1000)
    padded, byte = load_tokenizer(str(tmp_path)), load_tokenizer(str(BYTE_TOKENIZER))
    assert len(padded) == 1000 and padded.eos_token_id == byte.eos_token_id == 256
    text = "the long context, é and 日本.\n"
    assert padded(text)["input_ids"] == byte(text)["input_ids"]
    check_tokenizer_matches(padded, 1000, str(tmp_path))


def test_cli_route_seq_len_sets_the_sequence_and_the_pool(tmp_path):
    """bench.cli_route --seq-len N [--lora-rank R] [--trace-step S]: the derived YAML trains N-token sequences
    (LoRA adapters of rank R; step S traced) and sizes the page pool for N, so that the longest context the planner names runs through the
    user's YAML unchanged otherwise."""
    import yaml

    from lightning_oomb.bench.cli_route import derived_config

    example = Path(__file__).resolve().parents[1] / "examples" / "qwen2.5-7b-1m-sparse.yaml"
    data = yaml.safe_load(derived_config(example, tmp_path, None, seq_len=1_617_920, lora_rank=16,
                                         trace_step=0).read_text())
    assert data["data"]["init_args"]["seq_len"] == 1_617_920
    assert data["model"]["init_args"]["lora_rank"] == 16
    pools = [(cb["init_args"]["max_seq_len"], cb["init_args"]["trace_step"]) for cb in data["trainer"]["callbacks"]
             if cb["class_path"].endswith("PagedKVCallback")]
    assert pools == [(1_617_920, 0)]
    assert data["trainer"]["enable_checkpointing"] is False


def test_generate_check_passes_on_a_saved_model_and_writes_its_results(tmp_path):
    """bench.generate_check on a tiny random model saved with a padded byte tokenizer: the engine's greedy tokens
    equal transformers' for every option set, within the bound, and the JSON says so."""
    import json

    from lightning_oomb.bench.cli_route import write_byte_tokenizer
    from lightning_oomb.bench.generate_check import OPTION_SETS, main
    from tiny_models import tiny_model

    model = tiny_model("llama", vocab_size=300, eos_token_id=256, pad_token_id=256, bos_token_id=256)
    model.save_pretrained(tmp_path)
    write_byte_tokenizer(tmp_path, 300)
    out = tmp_path / "check.json"
    assert main(["--model", str(tmp_path), "--prompt-tokens", "40", "--new-tokens", "5", "--chunk-size", "16",
                 "--page-size", "4", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["sets"]) == set(OPTION_SETS) and results["new_tokens"] == 5
    assert all(s["tokens_equal"] and s["max_logprob_diff"] <= results["bound"] for s in results["sets"].values())


def test_cli_route_trace_picture_and_csv_hold_gpu_and_host_memory(tmp_path):
    """bench.cli_route's trace: the memory_trace/* scalars PagedKVCallback logs become a picture and a CSV with
    the GPU and host memory after every chunk, stage by stage."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_oomb.bench.cli_route import plot_trace
    from lightning_oomb.bench.scalars import read_scalars

    logger = TensorBoardLogger(tmp_path, name="run")
    for i, (stage, gpu, host) in enumerate([(1, 2.0, 5.0), (1, 2.5, 5.5), (2, 2.5, 6.0), (2, 2.0, 6.0)]):
        logger.log_metrics({"memory_trace/allocated_gib": gpu, "memory_trace/host_gib": host,
                            "memory_trace/stage": stage}, step=i)
    logger.finalize("success")
    assert plot_trace(read_scalars(logger.log_dir), "run", tmp_path / "fit-trace.png", since=0.0)
    assert (tmp_path / "fit-trace.png").stat().st_size > 0
    rows = (tmp_path / "fit-trace.csv").read_text().splitlines()
    assert rows == ["position,stage,gpu_allocated_gib,host_gib", "0,1,2.000,5.000", "1,1,2.500,5.500",
                    "2,2,2.500,6.000", "3,2,2.000,6.000"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_optimizer_host_memory_refuses_a_machine_without_cuda_in_one_line(capsys):
    from lightning_oomb.bench.optimizer_host_memory import main

    assert main(["--optimizer", "adamw8bit"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "optimizer_host_memory: needs a CUDA device"


def test_cli_route_sampler_asks_for_the_stacks_while_host_memory_grows(tmp_path):
    """bench.cli_route's sampler sends SIGUSR1 when the child's resident set grows by growth_bytes within three
    samples, then waits ten samples and stops after max_dumps (fed resident sets here, signals to this process)."""
    import signal

    from lightning_oomb.bench.cli_route import GIB, Sampler

    got = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: got.append(len(fed)))
    try:
        sampler = Sampler(os.getpid(), tmp_path / "memory.csv", max_dumps=2)
        fed = []
        for rss in [1, 1, 2, 3, 4, 5, 6, *range(7, 30), 30, 30]:
            fed.append(rss)
            sampler._dump_stacks_if_growing(rss * GIB)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert got == [4, 14]  # at 1 -> 3 GiB, then ten samples later


def test_generate_speed_writes_times_plans_and_transformers_tokens(tmp_path, capsys):
    """The prefill and decoding bench on a tiny model on the CPU: every point timed, the plan beside it, and
    transformers' own cached greedy decoding giving the engine's tokens (float32)."""
    from lightning_oomb.bench.generate_speed import main as speed_main

    out = tmp_path / "speed"
    argv = ["--model", str(tiny_config(tmp_path)), "--lengths", "96,160", "--new-tokens", "4", "--modes",
            "dense,sparse", "--budget-pages", "6", "--chunk", "32", "--page-size", "16", "--transformers",
            "--out", str(out)]
    assert speed_main(argv) == 0
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["runner"], r["mode"], r["context"]) for r in rows] == [
        ("lightning_oomb", "dense", "96"), ("lightning_oomb", "sparse", "96"), ("transformers", "dense", "96"),
        ("lightning_oomb", "dense", "160"), ("lightning_oomb", "sparse", "160"), ("transformers", "dense", "160")]
    for r in rows:
        assert r["status"] == "ok" and float(r["prefill_s"]) > 0 and float(r["decode_s_per_token"]) > 0
        assert (r["planned_prefill_s"] != "") == (r["runner"] == "lightning_oomb")
    assert [r["same_tokens"] for r in rows if r["runner"] == "transformers"] == ["4/4", "4/4"]
    assert "| runner | mode | context |" in (out / "results.md").read_text()


def test_generate_speed_refuses_bad_options_in_one_line(tmp_path, capsys):
    from lightning_oomb.bench.generate_speed import main as speed_main

    with pytest.raises(SystemExit) as e:
        speed_main(["--model", "qwen2.5-7b", "--lengths", "1K", "--modes", "dense,fast", "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown fast" in err
    with pytest.raises(SystemExit) as e:
        speed_main(["--model", "qwen2.5-7b", "--lengths", "1K", "--modes", "sparse", "--budget-pages", "2",
                    "--out", str(tmp_path)])
    assert e.value.code == 2 and "budget_pages" in capsys.readouterr().err


def test_scalars_of_a_resumed_run_read_in_order_and_cut_at_its_start(tmp_path):
    """bench.scalars.read_scalars: a run resumed into the same folder writes a second event file; its points
    follow the first's in wall-time order, and cli_route.step_series keeps the steps logged after a time."""
    from torch.utils.tensorboard import SummaryWriter

    from lightning_oomb.bench.cli_route import step_series
    from lightning_oomb.bench.scalars import read_scalars

    run = tmp_path / "run" / "version_0"
    for first, wall in ((0, 1000.0), (2, 2000.0)):  # two sessions, the second resumed at step 2
        writer = SummaryWriter(str(run), filename_suffix=f".{first}")
        for step in range(first, first + 2):
            writer.add_scalar("train/tokens_per_s", 100.0 * (step + 1), step, walltime=wall + step)
            writer.add_scalar("train/loss", 5.0 - step, step, walltime=wall + step)
        writer.close()
    scalars = read_scalars(tmp_path / "run")  # a folder above the version folder reads the same
    assert [p.step for p in scalars["train/tokens_per_s"]] == [0, 1, 2, 3]
    assert [p.value for p in scalars["train/loss"]] == [5.0, 4.0, 3.0, 2.0]
    series = step_series(scalars, tokens=1200, since=1500.0)
    assert series["step_s"] == [1200 / 300.0, 1200 / 400.0] and series["loss"] == [3.0, 2.0]
    assert "gpu_peak_gib" not in series
