"""Checkpoint files that are either the old one or the new one, whenever the process dies."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO

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
    ends with a copy rather than a rename; this class streams to the target folder instead. Paths with a
    remote protocol (s3://, ...) go to Lightning's implementation.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = partial_path(path)
        with open(partial, "wb") as f:
            self._write(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
        _fsync_dir(path.parent)

    def _write(self, checkpoint: dict[str, Any], f) -> None:
        torch.save(checkpoint, f)


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
