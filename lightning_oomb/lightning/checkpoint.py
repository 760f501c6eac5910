"""Checkpoints that are either the old one or the new one, whenever the process dies: files written while the
next step computes, and sharded folders; and a last checkpoint when SIGTERM ends a run."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from typing_extensions import override

from ..core.errors import SetupError

PARTIAL_SUFFIX = ".partial"


class CheckpointError(SetupError):
    """A checkpoint that cannot be written (no room on its disk): told in one line, the last whole one kept."""


def check_disk_room(folder: Path, checkpoint_bytes: int) -> None:
    """Refuse, in one line, a run whose checkpoint folder cannot hold two checkpoints of ``checkpoint_bytes``:
    an atomic write keeps the previous one until the new one is whole. Checkpoints already there count as room,
    since the run's own replace them."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    held = sum(p.stat().st_size for p in folder.glob("*.ckpt") if p.is_file())
    if free + held < 2 * checkpoint_bytes:
        raise CheckpointError(
            f"the checkpoints of this run ({checkpoint_bytes / 1e9:.2f} GB each) need room for two in {folder} "
            f"(an atomic write keeps the last one until the next is whole), and its disk has {free / 1e9:.2f} GB "
            "free: free space there, or set ModelCheckpoint's dirpath to a disk that has it"
        )


def partial_path(path: str | os.PathLike) -> Path:
    """Where a checkpoint is written before it replaces ``path``: a hidden file in the same folder."""
    path = Path(path)
    return path.with_name(f".{path.name}{PARTIAL_SUFFIX}")


def replace_folder(finished: Path, path: Path) -> None:
    """Put the folder ``finished`` (a sharded checkpoint every rank has written) where ``path`` is: nothing, or
    the file or folder of an earlier save. A folder cannot be renamed over a non-empty one, so an earlier one
    is renamed aside to ``.<name>.old`` first and removed after: a kill at any moment leaves a whole
    checkpoint, at ``path`` except between the two renames, when it is the ``.old`` one."""
    old = path.with_name(f".{path.name}.old")
    _remove(old)  # a kill's leftover
    if path.exists():
        path.rename(old)
    finished.rename(path)
    _fsync_dir(path.parent)
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a hidden ``.<name>.partial`` file in the same folder, one tensor at a time,
    flushes it to disk and ``os.replace``-s it over the target: a kill at any moment leaves the previous one.

    asynchronous: write on a background thread while training goes on; ``OOMBStrategy.backward`` then calls
        ``wait_until_weights_free()`` before the next update changes what is being read (docs/architecture.md,
        "Checkpoints").
    ``last_save_s``: seconds the last completed write took (its copy included), ``last_size``: its bytes,
    ``last_staged_s``: the seconds its copy to host memory took (None: it read the live tensors).
    """

    def __init__(self, asynchronous: bool = True):
        super().__init__()
        self.asynchronous = asynchronous
        self.host_room: Callable[[], int] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._weights_free: threading.Event | None = None
        self._side_stream: torch.cuda.Stream | None = None
        self.last_save_s: float | None = None
        self.last_size: int | None = None
        self.last_staged_s: float | None = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            self.wait()
            return super().save_checkpoint(checkpoint, path, storage_options)
        self.wait()
        if not self.asynchronous:
            return self._save_now(checkpoint, Path(path))
        stage = self.host_room is not None and tensor_bytes(checkpoint) <= self.host_room()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self.last_staged_s = None
        self._weights_free = threading.Event()
        self._pending = self._executor.submit(self._copy_and_save, checkpoint, Path(path), stage,
                                              self._after_current_gpu_work(checkpoint))

    def _after_current_gpu_work(self, checkpoint: dict[str, Any]) -> tuple[torch.cuda.Stream, torch.cuda.Event] | None:
        """A side stream of the current GPU and an event on its current stream after the last update: the
        thread's copies wait for that update, not for the kernels queued after it. None: no GPU tensors."""
        on_gpu: list[bool] = []
        apply_to_collection(checkpoint, torch.Tensor, lambda t: on_gpu.append(t.is_cuda))
        if not any(on_gpu):
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        return self._side_stream, torch.cuda.current_stream(self._side_stream.device).record_event()

    def _copy_and_save(self, checkpoint: dict[str, Any], path: Path, stage: bool,
                       gpu: tuple[torch.cuda.Stream, torch.cuda.Event] | None) -> None:
        started = time.perf_counter()
        try:
            with contextlib.ExitStack() as on_stream:
                if gpu is not None:
                    stream, ready = gpu
                    on_stream.enter_context(torch.cuda.stream(stream))
                    stream.wait_event(ready)
                if stage:
                    checkpoint = copy_to_host(checkpoint)
                    if gpu is not None:
                        gpu[0].synchronize()
                    self.last_staged_s = time.perf_counter() - started
                    self._weights_free.set()
                self._save_now(checkpoint, path, started)
        finally:
            self._weights_free.set()

    def _save_now(self, checkpoint: dict[str, Any], path: Path, started: float | None = None) -> None:
        started = time.perf_counter() if started is None else started
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = partial_path(path)
        try:
            with open(partial, "wb") as f:
                self._write(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            written = partial.stat().st_size if partial.exists() else 0
            _remove(partial)  # a half-written file would keep the disk full
            if e.errno != errno.ENOSPC:
                raise
            raise CheckpointError(
                f"checkpoint: the disk of {path.parent} filled up while {path.name} was written ({written / 1e9:.2f} "
                f"of {tensor_bytes(checkpoint) / 1e9:.2f} GB); the previous {path.name} is whole and kept. Free "
                "room for two checkpoints there, or set ModelCheckpoint's dirpath to a disk that has it, and "
                "resume with --ckpt_path last"
            ) from None
        os.replace(partial, path)
        _fsync_dir(path.parent)
        self.last_save_s, self.last_size = time.perf_counter() - started, path.stat().st_size
        how = ""
        if self.asynchronous:
            how = (" while training went on" if self.last_staged_s is None else
                   f" while training went on, copied to host memory in {self.last_staged_s:.1f} s first")
        print(f"checkpoint: {path} written, {self.last_size / 1e9:.2f} GB in {self.last_save_s:.1f} s{how}", flush=True)

    def _write(self, checkpoint: dict[str, Any], f) -> None:
        torch.save(checkpoint, f)

    def wait(self) -> None:
        """Block until the checkpoint being written is on disk; raise what its write raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def wait_until_weights_free(self) -> None:
        """Block until no checkpoint reads the live weights and optimizer state (a write of host copies goes
        on); raise what the copy or write raised."""
        if self._weights_free is None or self._pending is None:
            return
        self._weights_free.wait()
        if self._pending.done():
            self.wait()

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


def tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors in a checkpoint (nested collections); a tensor reached twice (tied weights) once. A
    tensor subclass that wraps others (torchao's 8-bit optimizer state: uint8 codes and float32 scales) counts
    the tensors it holds."""
    sizes: dict[tuple, int] = {}

    def count(t: torch.Tensor) -> None:
        if isinstance(t, DTensor):  # the whole tensor, as the shards of every rank save it
            sizes.setdefault(("dtensor", id(t)), t.numel() * t.element_size())
            return
        for inner in _plain_tensors(t):
            sizes.setdefault(_identity(inner), inner.numel() * inner.element_size())

    apply_to_collection(tree, torch.Tensor, count)
    return sum(sizes.values())


def copy_to_host(tree: Any) -> Any:
    """The checkpoint with every tensor copied into new host memory; a tensor reached twice stays one copy. A
    wrapper subclass (torchao's 8-bit state) keeps its kind, with copies of the tensors it holds."""
    copies: dict[tuple, torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            key = ("dtensor", id(t))
            if key not in copies:
                copies[key] = t.detach().to("cpu", copy=True)
            return copies[key]
        if is_traceable_wrapper_subclass(t):
            # Rebuilt from copies of the tensors it holds: a subclass's own ``to`` may hand back those same
            # tensors where the device does not change (torchao's 8-bit state does), which the next update
            # would then change under the write.
            names, meta = t.__tensor_flatten__()
            inner = {name: copy(getattr(t, name)) for name in names}
            return type(t).__tensor_unflatten__(inner, meta, t.shape, t.stride())
        key = _identity(t)
        if key not in copies:
            copies[key] = t.detach().to("cpu", copy=True)
        return copies[key]

    return apply_to_collection(tree, torch.Tensor, copy)


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` itself, or the plain tensors a wrapper subclass holds (``__tensor_flatten__``), recursively: a
    wrapper has no storage whose address could be read."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = [getattr(t, name) for name in names]
    return [plain for i in inner if isinstance(i, torch.Tensor) for plain in _plain_tensors(i)]


def _identity(t: torch.Tensor) -> tuple:
    """What makes two plain tensor objects the same tensor: storage, offset, shape, strides, dtype."""
    return (t.untyped_storage().data_ptr(), t.device, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


# Bytes read at a time when a checkpoint's CRC-32s are checked, and the entries checked at once (zlib's CRC-32
# releases the GIL, so threads read and check several tensors' records in parallel).
VERIFY_BLOCK_BYTES = 64 << 20
VERIFY_THREADS = 8


def damage(path: str | os.PathLike) -> str | None:
    """What is wrong with the checkpoint file ``path``, in a few words, or None if it is whole: a file that
    ``torch.save`` wrote is a zip archive whose every record carries the CRC-32 of its bytes, so a truncated,
    zeroed or otherwise changed file shows here before anything is restored from it. Reads the whole file
    (about a second per GB on one core; records are checked on several threads). A folder is not checked."""
    import zipfile
    from concurrent.futures import ThreadPoolExecutor

    path = Path(path)
    if path.is_dir():
        return None  # a sharded checkpoint (torch.distributed.checkpoint), which its strategy reads and checks
    if path.stat().st_size == 0:
        return "an empty file"
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile) as e:
        return f"not a whole torch.save archive ({type(e).__name__}: {' '.join(str(e).split())})"
    if not any(name.endswith("data.pkl") for name in names):
        return "a zip archive without torch.save's data.pkl"

    def check(batch: list[str]) -> str | None:
        with zipfile.ZipFile(path) as archive:
            for name in batch:
                try:
                    with archive.open(name) as record:
                        while record.read(VERIFY_BLOCK_BYTES):
                            pass
                except (OSError, zipfile.BadZipFile, EOFError) as e:
                    return f"its record {name} is damaged ({' '.join(str(e).split())})"
        return None

    threads = max(1, min(VERIFY_THREADS, os.cpu_count() or 1, len(names)))
    batches = [names[i::threads] for i in range(threads)]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return next((found for found in pool.map(check, batches) if found is not None), None)


def remove_partial_writes(folder: Path) -> list[Path]:
    """Delete the ``.<name>.partial`` files an interrupted write left in ``folder`` (only a run that holds the
    folder's lock may: no write of its own is under way then); returns them."""
    leftovers = sorted(folder.glob(f".*{PARTIAL_SUFFIX}")) if folder.is_dir() else []
    for leftover in leftovers:
        _remove(leftover)
    return leftovers


class SigtermCheckpoint(Callback):
    """On SIGTERM (a scheduler preempting the job, ``kill``), the step in progress ends with a last checkpoint
    where the run's ModelCheckpoint writes its own (``save_last``), unless it saved one at that step already;
    Lightning then stops the run (``SIGTERMException``), and ``--ckpt_path last`` resumes from that step instead
    of the last periodic checkpoint. The checkpoint is saved where ModelCheckpoint saves its own, at the step's
    end, so that it resumes as theirs do. Every rank takes part (one all-reduce of a flag per step on several)."""

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # The signal may reach one rank before the others: a save is collective, so all agree first.
        if not trainer.strategy.reduce_boolean_decision(trainer.received_sigterm, all=False):
            return
        for callback in trainer.checkpoint_callbacks:
            if (isinstance(callback, ModelCheckpoint) and callback.save_last
                    and callback._last_global_step_saved != trainer.global_step):
                callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))
        # Lightning's own check at the step's end is of this rank's flag: a rank the signal did not reach stops too.
        trainer._signal_connector.received_sigterm = True
