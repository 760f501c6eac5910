"""The route a user takes, measured: ``lightning-oomb fit`` on an example YAML, from a local model directory,
with the optimizer, watching GPU and host memory; then the same step through ``train_step`` plus the
optimizer in the same process lease, for the ratio.

    python -m lightning_oomb.bench.cli_route --config examples/qwen2.5-7b-128k.yaml --model-dir /dev/shm/qwen \\
        --make-model qwen2.5-7b --steps 3 --out runs/cli-route [--checkpoint-every 2] [--resume] [--baseline]

Writes ``memory.csv`` (sampled every second) and ``summary.json`` (times, peaks, the plan's totals,
checkpoint writes); docs/benchmarks.md, "The measurement scripts", says what each holds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from ..core.host_memory import proc_field_bytes
from .scalars import Scalar, read_scalars

GIB = 1 << 30
BYTE_TOKENIZER = Path(__file__).resolve().parents[2] / "examples" / "byte_tokenizer"
WORDS = ("the of and to in is was for on that with as by at from his her an which were are this be had not "
         "but they one all have their has more also who been into time other its first after two new").split()


def make_model(shape: str, target: Path) -> float:
    """Random bf16 weights of a built-in shape, built on the GPU, saved to ``target``; seconds it took."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..core.model_shape import load_config_dict, transformers_config

    started = time.perf_counter()
    config = transformers_config(load_config_dict(shape))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target)
    del model
    torch.cuda.empty_cache()
    return time.perf_counter() - started


def write_byte_tokenizer(target: Path, vocab_size: int) -> None:
    """The byte tokenizer (examples/byte_tokenizer: one token a byte, EOS at id 256) written to ``target`` with
    unused placeholder entries up to ``vocab_size`` tokens, so that it is as long as the random model's embeddings
    and ``fit`` takes it from ``model.pretrained`` as a user's model directory gives it. With no merges, no text
    ever tokenizes to a placeholder."""
    spec = json.loads((BYTE_TOKENIZER / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    taken = len(vocab) + sum(t["id"] >= len(vocab) for t in spec["added_tokens"])
    vocab.update({f"<|unused_{i}|>": i for i in range(taken, vocab_size)})
    target.mkdir(parents=True, exist_ok=True)
    (target / "tokenizer.json").write_text(json.dumps(spec))
    (target / "tokenizer_config.json").write_text((BYTE_TOKENIZER / "tokenizer_config.json").read_text())


def make_corpus(path: Path, tokens: int, document_tokens: int | None = None, seed: int = 0) -> Path:
    """Generated English-like text of at least ``tokens`` bytes (the byte tokenizer: one token a byte): one
    text file, one document; or with ``document_tokens``, ``path`` with suffix .jsonl holding documents of
    that many tokens each, its EOS included. Returns the file written."""
    rng = random.Random(seed)

    def text(length: int) -> str:
        words: list[str] = []
        while sum(map(len, words)) + len(words) - 1 < length:  # the words and the spaces between them
            words.append(rng.choice(WORDS))
        return " ".join(words)[:length]

    if document_tokens is None:
        with open(path, "w") as f:
            written = 0
            while written < tokens:
                line = " ".join(rng.choice(WORDS) for _ in range(200)) + ".\n"
                f.write(line)
                written += len(line)
        return path
    path = path.with_suffix(".jsonl")
    with open(path, "w") as f:
        for _ in range(-(-tokens // document_tokens)):
            f.write(json.dumps({"text": text(document_tokens - 1)}) + "\n")
    return path


def derived_config(config: Path, out: Path, checkpoint_every: int | None, seq_len: int | None = None,
                   lora_rank: int | None = None, optimizer: str | None = None, trace_step: int | None = None) -> Path:
    """The example YAML with its checkpoint interval set (None: no ModelCheckpoint) and its logs under ``out``.
    Each checkpoint gets its own file and no last.ckpt is written at the end, so that a 46 GB checkpoint is
    written once and never next to the partial file of its replacement (the GPU machine's disk is 64 GiB).
    ``seq_len`` replaces the sequence length (tokens) and the PagedKVCallback's ``max_seq_len`` with it;
    ``lora_rank`` the model's ``lora_rank`` (its adapters on the module's default targets); ``optimizer`` the
    model's ``optimizer`` (a name of ``core.optimizers.OPTIMIZERS``); ``trace_step`` the PagedKVCallback's
    ``trace_step`` (0: the first step, whose trace a run killed in its second step still logs)."""
    data = yaml.safe_load(config.read_text())
    if seq_len is not None:
        data["data"]["init_args"]["seq_len"] = seq_len
    if lora_rank is not None:
        data["model"].get("init_args", data["model"])["lora_rank"] = lora_rank
    if optimizer is not None:
        data["model"].get("init_args", data["model"])["optimizer"] = optimizer
    callbacks = data["trainer"].get("callbacks", [])
    kept = []
    for cb in callbacks:
        if cb["class_path"].endswith("PagedKVCallback"):
            if seq_len is not None:
                cb["init_args"]["max_seq_len"] = seq_len
            if trace_step is not None:
                cb["init_args"]["trace_step"] = trace_step
        if cb["class_path"].endswith("ModelCheckpoint"):
            if checkpoint_every is None:
                continue
            cb["init_args"].update(every_n_train_steps=checkpoint_every, save_last=False, save_top_k=-1)
        kept.append(cb)
    data["trainer"]["callbacks"] = kept
    if checkpoint_every is None:
        data["trainer"]["enable_checkpointing"] = False
    data["trainer"]["logger"]["init_args"]["save_dir"] = str(out / "runs")
    target = out / f"{config.stem}.yaml"
    target.write_text(yaml.safe_dump(data, sort_keys=False))
    return target


class Sampler(threading.Thread):
    """Every ``period`` seconds: the child's resident set, the machine's used and available memory, GPU used.
    While the child's resident set grows by ``growth_bytes`` or more within three samples, the child is sent
    SIGUSR1 (at most ``max_dumps`` times, ten samples apart), which ``lightning-oomb`` answers with every thread's
    Python stack in its log: where an unplanned growth of host memory comes from."""

    def __init__(self, pid: int, path: Path, period: float = 1.0, growth_bytes: int = 2 * GIB, max_dumps: int = 6):
        super().__init__(daemon=True)
        self.pid, self.path, self.period = pid, path, period
        self.growth_bytes, self.dumps_left = growth_bytes, max_dumps
        self.stopped = threading.Event()
        self.peak_rss = 0
        self.peak_used = 0
        self.recent: list[int] = []
        self.quiet = 0

    def run(self) -> None:
        started = time.time()
        with open(self.path, "w") as f:
            f.write("t_s,rss_gib,used_gib,available_gib,gpu_used_gib\n")
            while not self.stopped.wait(self.period):
                rss = _rss(self.pid)
                total, available = _meminfo()
                gpu = _gpu_used()
                self.peak_rss = max(self.peak_rss, rss)
                self._dump_stacks_if_growing(rss)
                self.peak_used = max(self.peak_used, total - available)
                f.write(f"{time.time() - started:.1f},{rss / GIB:.2f},{(total - available) / GIB:.2f},"
                        f"{available / GIB:.2f},{gpu / GIB:.2f}\n")
                f.flush()

    def _dump_stacks_if_growing(self, rss: int) -> None:
        self.recent = [*self.recent[-2:], rss]
        self.quiet = max(0, self.quiet - 1)
        if self.dumps_left and not self.quiet and rss - self.recent[0] >= self.growth_bytes:
            try:
                os.kill(self.pid, signal.SIGUSR1)
            except OSError:
                return
            self.dumps_left -= 1
            self.quiet = 10


def _rss(pid: int) -> int:
    return proc_field_bytes(f"/proc/{pid}/status", "VmRSS") or 0


def _meminfo() -> tuple[int, int]:
    return proc_field_bytes("/proc/meminfo", "MemTotal") or 0, proc_field_bytes("/proc/meminfo", "MemAvailable") or 0


def _gpu_used() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return int(out.split()[0]) * 2**20
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


def plan_totals(log: str) -> dict[str, float]:
    """The GPU and host totals (GiB) of the last plan printed in ``log``."""
    totals = re.findall(r"^  total\s+([\d.]+)$", log, flags=re.M)
    return {"plan_gpu_gib": float(totals[-2]), "plan_host_gib": float(totals[-1])} if len(totals) >= 2 else {}


def step_series(scalars: dict[str, list[Scalar]], tokens: int, since: float) -> dict[str, list[float]]:
    """Per step logged after ``since`` (a run resumed into the same folder adds to it), from ``read_scalars``:
    seconds (tokens / train/tokens_per_s), the event's wall time, GPU and host peaks (GiB), the loss."""
    def after(tag: str) -> list[Scalar]:
        return [e for e in scalars[tag] if e.wall_time >= since]

    speed = after("train/tokens_per_s")
    series = {"step_s": [tokens / e.value for e in speed], "wall": [e.wall_time for e in speed]}
    for tag, name in (("memory/gpu_peak_gib", "gpu_peak_gib"), ("memory/host_peak_gib", "host_peak_gib"),
                      ("memory/host_budget_gib", "host_budget_gib"), ("train/loss", "loss")):
        if tag in scalars:
            series[name] = [e.value for e in after(tag)]
    return series


def plot_trace(scalars: dict[str, list[Scalar]], title: str, path: Path, since: float) -> bool:
    """The per-chunk memory trace PagedKVCallback(trace_step=N) logged (``memory_trace/*``) as a picture (GPU
    memory allocated and the process's host memory after each chunk, stage 1's chunks then stage 2's) and as a
    CSV beside it. False when the run logged none."""
    if "memory_trace/allocated_gib" not in scalars:
        return False

    def series(tag: str) -> list[float]:
        return [e.value for e in scalars.get(tag, []) if e.wall_time >= since]

    gib, stage, host = series("memory_trace/allocated_gib"), series("memory_trace/stage"), series("memory_trace/host_gib")
    if not gib:
        return False
    with open(path.with_suffix(".csv"), "w") as f:
        f.write("position,stage,gpu_allocated_gib,host_gib\n")
        for i, (g, st) in enumerate(zip(gib, stage)):
            f.write(f"{i},{int(st)},{g:.3f},{host[i] if i < len(host) else float('nan'):.3f}\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(gib, "GPU allocated after the chunk (GiB)")] + ([(host, "host, process resident (GiB)")] if host else [])
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3.5 * len(panels)), sharex=True, squeeze=False)
    for ax, (values, label) in zip(axes[:, 0], panels):
        for s, color in ((1, "tab:blue"), (2, "tab:orange")):
            points = [(i, g) for i, (g, st) in enumerate(zip(values, stage)) if st == s]
            if points:
                ax.plot(*zip(*points), ".-", color=color, markersize=3, label=f"stage {s}")
        ax.set_ylabel(label)
        ax.set_ylim(0, max(values) * 1.1)
        ax.legend()
    axes[-1, 0].set_xlabel("chunk (stage 1 first to last, then stage 2 last to first)")
    axes[0, 0].set_title(f"{title}: memory after every chunk of one step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run_fit(args, config: Path, corpus: Path, out: Path, steps: int, name: str, extra: list[str]) -> dict:
    """One ``lightning-oomb fit`` child process, sampled; its summary."""
    command = [sys.executable, "-m", "lightning_oomb.cli", "fit", "--config", str(config),
               "--model.pretrained", str(args.model_dir), "--data.init_args.paths", f"[{corpus}]",
               "--trainer.max_steps", str(steps),
               "--trainer.limit_val_batches", "0", "--export", "false", *extra]
    if args.document_length:
        command += ["--data.init_args.document_masking", "true"]
    log_path = out / f"{name}.log"
    started = time.time()
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        sampler = Sampler(child.pid, out / f"{name}-memory.csv")
        sampler.start()
        code = child.wait()
        sampler.stopped.set()
        sampler.join()
    ended = time.time()
    log = log_path.read_text()
    data = yaml.safe_load(config.read_text())
    logger = data["trainer"]["logger"]["init_args"]
    run_dir = Path(logger["save_dir"]) / logger["name"] / logger["version"]
    tokens = data["data"]["init_args"]["seq_len"] * data["data"]["init_args"].get("batch_size", 1)
    summary = {"name": name, "returncode": code, "wall_s": round(ended - started, 1),
               "host_peak_rss_gib": round(sampler.peak_rss / GIB, 2),
               "machine_used_peak_gib": round(sampler.peak_used / GIB, 2), **plan_totals(log)}
    try:
        scalars = read_scalars(run_dir)
        series = step_series(scalars, tokens, started)
        trace = out / f"{name}-trace.png"
        summary["trace_png"] = str(trace) if plot_trace(scalars, run_dir.parent.name, trace, started) else None
    except (KeyError, ValueError):
        series = {}
    if series.get("step_s"):
        first_end = series["wall"][0]
        summary["to_first_step_s"] = round(first_end - series["step_s"][0] - started, 1)
        summary.update({k: [round(v, 3) for v in vals] for k, vals in series.items() if k != "wall"})
    saves = re.findall(r"checkpoint: (\S+) written, ([\d.]+) GB in ([\d.]+) s(?: while training went on(?:, copied to host "
                       r"memory in ([\d.]+) s)?)?",
                       log)
    summary["checkpoints"] = [{"path": p, "gb": float(gb), "s": float(s), "copied_to_host_s": float(c) if c else None}
                              for p, gb, s, c in saves]
    pinned = re.findall(r"pinned ([\d.]+) GiB of host memory for the page pool in ([\d.]+) s", log)
    if pinned:
        summary["pinned_gib"], summary["pin_s"] = float(pinned[-1][0]), float(pinned[-1][1])
    loaded = re.findall(r"^model: .*", log, flags=re.M)
    if loaded:
        summary["model_line"] = loaded[-1]
    return summary


def baseline(args, config: Path, steps: int) -> dict:
    """The steady step of train_step + the YAML's optimizer (fused AdamW) with the YAML's strategy options, in
    this process, on the same model directory: what the Lightning route must not exceed by more than 3%."""
    import torch
    from transformers import AutoModelForCausalLM

    import lightning_oomb

    from ..core.optimizers import OptimizerSpec
    from .modes import packed_position_ids

    data = yaml.safe_load(config.read_text())
    strategy = dict(data["trainer"]["strategy"].get("init_args") or {})
    model_args = data["model"].get("init_args", data["model"])
    sparse = None
    if model_args.get("budget_pages"):
        sparse = {k: model_args[k] for k in ("budget_pages", "sink_pages", "local_pages") if k in model_args}
        sparse.update(score=model_args.get("sparse_score", "mean"), per_kv_head=model_args.get("per_kv_head", True))
    seq_len = data["data"]["init_args"]["seq_len"]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16, device_map={"": "cuda"})
    if model_args.get("lora_rank"):
        import peft

        from ..lightning.module import lora_config

        model = peft.get_peft_model(model, lora_config(
            model_args["lora_rank"], model_args.get("lora_alpha", 16), model_args.get("lora_target_modules"),
            model_args.get("lora_target_parameters"), model))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = OptimizerSpec.parse(model_args.get("optimizer", "adamw")).build(
        params, model_args.get("learning_rate", 1e-5), model_args.get("weight_decay", 0.0))
    ids = torch.randint(0, 256, (1, seq_len), device="cuda")
    positions = packed_position_ids(ids, args.document_length)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        lightning_oomb.train_step(model, ids, sparse=sparse, optimizer=optimizer, position_ids=positions, **strategy)
        torch.nn.utils.clip_grad_norm_(params, data["trainer"].get("gradient_clip_val") or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return {"baseline_step_s": [round(t, 3) for t in times],
            "baseline_gpu_peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="an example YAML (examples/*.yaml)")
    parser.add_argument("--model-dir", type=Path, required=True, help="a local model directory")
    parser.add_argument("--make-model", default=None, help="write random weights of this built-in shape first")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="ModelCheckpoint's every_n_train_steps (default: the YAML's; 0: no checkpoints)")
    parser.add_argument("--resume", action="store_true", help="then continue from the last checkpoint to the same last step")
    parser.add_argument("--delete-checkpoints", action="store_true", help="remove the checkpoints at the end (disk)")
    parser.add_argument("--baseline", action="store_true", help="then time train_step + the optimizer in this process")
    parser.add_argument("--baseline-steps", type=int, default=None,
                        help="steps of the baseline (default: --steps; 2 gives a steady step at 1M in less time)")
    parser.add_argument("--document-length", type=int, default=None,
                        help="the corpus as documents of this many tokens, trained with document masking")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence instead of the YAML's (its PagedKVCallback's max_seq_len too), "
                             "e.g. the planner's longest context")
    parser.add_argument("--lora-rank", type=int, default=None,
                        help="train LoRA adapters of this rank instead of the YAML's training (0: every weight)")
    parser.add_argument("--optimizer", default=None, help="the model's optimizer instead of the YAML's (a name)")
    parser.add_argument("--gpu-memory", default=None,
                        help="the strategy's GPU memory budget (e.g. 24GiB: a smaller card's memory on this GPU)")
    parser.add_argument("--trace-step", type=int, default=None,
                        help="the step whose GPU and host memory after every chunk is traced (default: the YAML's)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"config": str(args.config), "argv": sys.argv}
    if args.make_model and not (args.model_dir / "config.json").exists():
        results["make_model_s"] = round(make_model(args.make_model, args.model_dir), 1)
        print(f"random {args.make_model} weights written to {args.model_dir} in {results['make_model_s']} s", flush=True)
    if not (args.model_dir / "tokenizer.json").exists():
        config = json.loads((args.model_dir / "config.json").read_text())
        write_byte_tokenizer(args.model_dir, config.get("text_config", config)["vocab_size"])
    data = yaml.safe_load(args.config.read_text())
    seq_len = args.seq_len or data["data"]["init_args"]["seq_len"]
    # two sequences: one to train on, one held out
    corpus = make_corpus(args.out / "corpus.txt", int(seq_len * 2.2), args.document_length)
    every = args.checkpoint_every
    if every is None:
        every = next((cb["init_args"]["every_n_train_steps"] for cb in data["trainer"]["callbacks"]
                      if cb["class_path"].endswith("ModelCheckpoint")), None)
    config = derived_config(args.config, args.out, every or None, args.seq_len, args.lora_rank, args.optimizer,
                            args.trace_step)
    budget = ["--trainer.strategy.init_args.gpu_memory", args.gpu_memory] if args.gpu_memory else []
    results["fit"] = run_fit(args, config, corpus, args.out, args.steps, "fit", budget)
    print(json.dumps(results["fit"]), flush=True)
    saved = sorted(args.out.glob("runs/*/*/checkpoints/*.ckpt"), key=lambda p: p.stat().st_mtime)
    if args.resume and results["fit"]["returncode"] == 0 and saved:
        # up to the same last step: the steps after the checkpoint run again and no second checkpoint is
        # written beside the first (the GPU machine's disk holds one 46 GB checkpoint and the model)
        results["resume"] = run_fit(args, config, corpus, args.out, args.steps, "resume",
                                    [*budget, "--ckpt_path", str(saved[-1])])
        print(json.dumps(results["resume"]), flush=True)
    if args.delete_checkpoints:
        for path in args.out.glob("runs/*/*/checkpoints/*.ckpt"):
            path.unlink()
    if args.baseline:
        results["baseline"] = baseline(args, config, args.baseline_steps or args.steps)
        print(json.dumps(results["baseline"]), flush=True)
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
