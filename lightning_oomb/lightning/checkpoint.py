"""Checkpoint files that are either the old one or the new one, whenever the process dies, written while the
next step computes."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

PARTIAL_SUFFIX = ".partial"


def partial_path(path: str | os.PathLike) -> Path:
    """Where a checkpoint is written before it replaces ``path``: a hidden file in the same folder."""
    path = Path(path)
    return path.with_name(f".{path.name}{PARTIAL_SUFFIX}")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a hidden ``.<name>.partial`` file in the same folder, flushes it to disk,
    then ``os.replace``-s it over the target.

    A process killed at any moment (SIGKILL, out of memory, power cut after the flush) leaves the previous
    checkpoint intact and at most a partial file, which the next save overwrites. Lightning's own
    ``TorchCheckpointIO`` serialises the whole checkpoint into memory first (twice the host memory of the
    checkpoint) and stages it in the system temporary folder, which for a folder on another file system
    ends with a copy rather than a rename; this class streams to the target folder instead, one tensor at a
    time (host memory: the largest tensor). Paths with a remote protocol (s3://, ...) go to Lightning's
    implementation.

    asynchronous: write on a background thread while training goes on (a 7B model with AdamW is 46 GB: a
    minute or more of disk). The checkpoint holds the live weights and optimizer state, not copies (a copy
    would not fit next to a long-context step), so the next optimizer update waits for the write:
    ``OOMBStrategy.backward`` calls ``wait()`` once the step's gradients are computed, before the update;
    so do the next save, loading, and the end of the run.
    ``last_save_s``: seconds the last completed write took, ``last_size``: its bytes.
    """

    def __init__(self, asynchronous: bool = True):
        super().__init__()
        self.asynchronous = asynchronous
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self.last_save_s: float | None = None
        self.last_size: int | None = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            self.wait()
            return super().save_checkpoint(checkpoint, path, storage_options)
        self.wait()
        if not self.asynchronous:
            return self._save_now(checkpoint, Path(path))
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending = self._executor.submit(self._save_now, checkpoint, Path(path))

    def _save_now(self, checkpoint: dict[str, Any], path: Path) -> None:
        started = time.perf_counter()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = partial_path(path)
        with open(partial, "wb") as f:
            self._write(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
        _fsync_dir(path.parent)
        self.last_save_s, self.last_size = time.perf_counter() - started, path.stat().st_size
        print(f"checkpoint: {path} written, {self.last_size / 1e9:.2f} GB in {self.last_save_s:.1f} s"
              + (" (while training went on)" if self.asynchronous else ""), flush=True)

    def _write(self, checkpoint: dict[str, Any], f) -> None:
        torch.save(checkpoint, f)

    def wait(self) -> None:
        """Block until the checkpoint being written is on disk; raise what its write raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @override
    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None):
        """The checkpoint with its tensors memory-mapped from the file on the CPU (``map_location`` None), not
        restored to the GPU they were saved from as Lightning's default does: a 46 GB checkpoint would
        otherwise sit on the GPU while the first step is placed (and push its pages to the host), and be read
        whole before anything starts. Loading the state into the model and optimizer then reads each tensor
        once, straight into place."""
        self.wait()
        if not _is_local_file_protocol(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if not Path(path).exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return torch.load(path, map_location="cpu" if map_location is None else map_location,
                          weights_only=weights_only, mmap=True)

    @override
    def remove_checkpoint(self, path) -> None:
        self.wait()
        super().remove_checkpoint(path)

    @override
    def teardown(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        super().teardown()


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
