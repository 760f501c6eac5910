"""The token cache on the CPU: first start (tokenizing into the cache), second start (reading it), resident memory.

``python -m lightning_oomb.bench.token_cache --corpus /tmp/tokcache-corpus --gib 2 --out result.json`` writes a
corpus of plain-text files of random words (the byte tokenizer of examples/byte_tokenizer makes one token of each
byte, so 2 GiB of text are 2.1B tokens), then in one fresh process per start sets up ``TextCorpusDataModule`` over
it with an empty cache folder, and again with the cache the first start wrote, and reads samples from it; it
prints one JSON object per start and writes them all to ``--out``. docs/benchmarks.md, "Token cache", has the
numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
BYTE_TOKENIZER = ROOT / "examples" / "byte_tokenizer"
WORDS = ("the of and to in is was for that with as on by at from his her which an are were this be it not but had "
         "long context model token memory page chunk attention layer step train data file corpus cache disk").split()


def make_corpus(folder: Path, total_bytes: int, files: int, seed: int = 0) -> list[Path]:
    """``files`` text files of random words, ``total_bytes`` in all: each file one 1 MiB block of its own lines,
    written again and again (what is tokenized costs the same whatever the text says). Files already there with
    the right size are kept."""
    folder.mkdir(parents=True, exist_ok=True)
    per_file = total_bytes // files
    written = []
    for index in range(files):
        path = folder / f"part-{index:04d}.txt"
        written.append(path)
        if path.is_file() and path.stat().st_size == per_file:
            continue
        rng = random.Random(seed * 100_003 + index)
        lines, size = [], 0
        while size < MIB:
            line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) + ".\n"
            lines.append(line)
            size += len(line)
        block = "".join(lines).encode()
        with open(path, "wb") as f:
            left = per_file
            while left > 0:
                f.write(block[:left])
                left -= min(left, len(block))
    return written


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def memory() -> dict[str, float]:
    """This process's resident set (VmRSS), its peak (VmHWM), and the part of it that is anonymous (what the
    strategy's host budget counts) and file-backed (mapped cache pages the kernel may reclaim), in MiB."""
    return {name: round(status_bytes(field) / MIB, 1)
            for name, field in (("rss_mib", "VmRSS"), ("peak_mib", "VmHWM"), ("anon_mib", "RssAnon"),
                                ("file_mib", "RssFile"))}


def one_start(corpus: Path, cache_dir: Path, seq_len: int, samples: int, workers: int | None) -> dict:
    """Set up the data module over ``corpus`` (this process's first), then read ``samples`` training batches."""
    from lightning_oomb.core.host_memory import reset_peak_process_host_bytes
    from lightning_oomb.lightning.corpus import TextCorpusDataModule

    began = time.perf_counter()
    before = memory()
    reset_peak_process_host_bytes()
    dm = TextCorpusDataModule([str(corpus)], tokenizer=str(BYTE_TOKENIZER), seq_len=seq_len, batch_size=1,
                              val_fraction=0.001, cache_dir=str(cache_dir), tokenize_workers=workers)
    dm.setup("fit")
    setup_s = time.perf_counter() - began
    after_setup = memory()
    began = time.perf_counter()
    loader, seen = dm.train_dataloader(), 0
    for i, batch in enumerate(loader):
        seen += batch["input_ids"].numel()
        if i + 1 == samples:
            break
    read_s = time.perf_counter() - began
    return {"tokens": dm.num_tokens, "files": len(dm.files), "setup_s": round(setup_s, 1),
            "tokens_per_s_setup": round(dm.num_tokens / setup_s), "memory_before": before,
            "memory_after_setup": after_setup, "samples_read": samples, "sample_tokens": seen,
            "read_s": round(read_s, 2), "memory_after_samples": memory()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, default=Path("/tmp/tokcache-corpus"))
    parser.add_argument("--cache_dir", type=Path, default=Path("/tmp/tokcache-cache"))
    parser.add_argument("--gib", type=float, default=2.0, help="corpus size in GiB of text (= GiB of tokens)")
    parser.add_argument("--files", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=65536)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one_start", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_start:
        print(json.dumps(one_start(args.corpus, args.cache_dir, args.seq_len, args.samples, args.workers)))
        return
    began = time.perf_counter()
    make_corpus(args.corpus, int(args.gib * (1 << 30)), args.files)
    print(json.dumps({"corpus": str(args.corpus), "gib": args.gib, "files": args.files,
                      "generate_s": round(time.perf_counter() - began, 1)}), flush=True)
    shutil.rmtree(args.cache_dir, ignore_errors=True)
    results = []
    for start in ("first", "second"):
        command = [sys.executable, "-m", "lightning_oomb.bench.token_cache", "--one_start", "--corpus",
                   str(args.corpus), "--cache_dir", str(args.cache_dir), "--seq_len", str(args.seq_len),
                   "--samples", str(args.samples)] + (["--workers", str(args.workers)] if args.workers else [])
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        sys.stderr.write(done.stderr[-2000:])
        result = {"start": start, **json.loads(done.stdout.strip().splitlines()[-1])}
        print(json.dumps(result), flush=True)
        results.append(result)
    disk = sum(p.stat().st_size for p in args.cache_dir.rglob("*") if p.is_file())
    summary = {"cache_disk_bytes": disk, "corpus_bytes": sum(p.stat().st_size for p in args.corpus.glob("*.txt"))}
    print(json.dumps(summary), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"starts": results, **summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
