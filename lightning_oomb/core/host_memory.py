"""Host memory: what the machine has, what this process holds, the run's budget, and pinned allocation.

A run has one host memory budget (docs/planner.md, "Host memory"): the bytes the training process may hold
in host memory in all, resident set and pinned pages together. By default it is what the process holds when
the step is placed plus what the kernel could still give it (MemAvailable, and no more than its cgroup's
memory limit leaves), less a headroom for the rest of the machine: max(HOST_HEADROOM_MIN_BYTES,
HOST_HEADROOM_SHARE of the machine's RAM), but at most half of what is available, so that on a small or busy
machine a run may still take half of what is free; a user sets it with ``host_memory=`` (bytes). The
placement (``placement.place_step``) decides every pinned block of a step against it before any is made, and
every pinned block is made here, by ``pinned_empty``, which counts it in a ``HostLedger`` and refuses one that
the placement did not leave room for.
"""

from __future__ import annotations

import os
import resource
import sys
import time
import weakref
from dataclasses import dataclass, field

import torch

GIB = 1 << 30
CGROUP_ROOT = "/sys/fs/cgroup"  # where the kernel's cgroup files are (a container sees its own group there)
HOST_HEADROOM_MIN_BYTES = 8 * GIB
HOST_HEADROOM_SHARE = 0.10


class HostMemoryError(RuntimeError):
    """A pinned block would take the run past its host memory budget; nothing was allocated for it."""


def machine_host_memory() -> int:
    """Bytes of RAM of this machine, or the memory limit of this process's cgroup where that is less."""
    try:
        ram = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        import psutil

        ram = int(psutil.virtual_memory().total)
    limit = cgroup_memory()
    return ram if limit is None else min(ram, limit[0])


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _stat_field(path: str, name: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == name:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_memory() -> tuple[int, int] | None:
    """(the memory limit of this process's cgroup, what the cgroup holds that the kernel cannot reclaim: its
    usage less its inactive file pages), in bytes; None without a limit. Reads the cgroup v2 files of the
    process's own group (/sys/fs/cgroup as a container sees it), else cgroup v1's memory controller."""
    group = ""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    group = line[3:].strip().rstrip("/")
    except OSError:
        pass
    for folder in dict.fromkeys([f"{CGROUP_ROOT}{group}", CGROUP_ROOT]):
        limit = _read_int(f"{folder}/memory.max")
        if limit is not None:
            used = _read_int(f"{folder}/memory.current") or 0
            return limit, used - _stat_field(f"{folder}/memory.stat", "inactive_file")
    folder = f"{CGROUP_ROOT}/memory"
    limit = _read_int(f"{folder}/memory.limit_in_bytes")
    if limit is None or limit >= 1 << 60:  # v1 writes no limit as the largest page-aligned number
        return None
    used = _read_int(f"{folder}/memory.usage_in_bytes") or 0
    return limit, used - _stat_field(f"{folder}/memory.stat", "total_inactive_file")


def proc_field_bytes(path: str, field: str) -> int | None:
    """Bytes of a ``field: N kB`` line of a /proc file (Linux: /proc/meminfo, /proc/PID/status), else None."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_host_memory() -> int:
    """Bytes of host memory the kernel could give this process now: MemAvailable (else all the RAM), and no
    more than what its cgroup's limit leaves (a container's or a job's: past it the process is killed)."""
    available = proc_field_bytes("/proc/meminfo", "MemAvailable")
    available = machine_host_memory() if available is None else available
    limit = cgroup_memory()
    return available if limit is None else max(0, min(available, limit[0] - limit[1]))


def process_host_bytes() -> int:
    """Host memory this process holds now that the kernel cannot take back: its anonymous and shared resident
    pages (Linux: pinned pages included). Pages of files it maps (a checkpoint loaded memory-mapped, a
    safetensors file) are clean page cache, which ``available_host_memory`` counts as available: counted here
    too they would be counted twice. Elsewhere: the peak resident set."""
    anonymous = proc_field_bytes("/proc/self/status", "RssAnon")
    shared = proc_field_bytes("/proc/self/status", "RssShmem")
    if anonymous is not None and shared is not None:
        return anonymous + shared
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_process_host_bytes()


def peak_process_host_bytes() -> int:
    """The largest resident set this process has had since ``reset_peak_process_host_bytes`` (Linux's VmHWM),
    else since it started (ru_maxrss)."""
    peak = proc_field_bytes("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak_process_host_bytes() -> None:
    """Start a new high-water mark of this process's resident set (Linux); elsewhere the peak stays the
    whole process's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def host_headroom(total: int | None = None, available: int | None = None) -> int:
    """Bytes of host memory a default budget leaves to the rest of the machine: max(8 GiB, 10% of its RAM
    (``total``)), but at most half of what is ``available`` (default: now), so that a small or busy machine
    gives a run half of what it has free rather than nothing."""
    total = machine_host_memory() if total is None else total
    available = available_host_memory() if available is None else available
    return min(max(HOST_HEADROOM_MIN_BYTES, int(HOST_HEADROOM_SHARE * total)), available // 2)


def host_budget(host_memory: int | None = None) -> int:
    """The run's host memory budget in bytes: ``host_memory`` if given, else what this process holds now plus
    what is available, less ``host_headroom()`` (at least the process and half of what is available)."""
    if host_memory is not None:
        return int(host_memory)
    available = available_host_memory()
    return process_host_bytes() + available - host_headroom(available=available)


@dataclass
class HostLedger:
    """Pinned host bytes a page pool holds, by what holds them; ``limit`` (None: no limit) is what the
    placement left for them. ``pinned_empty`` adds to it and refuses a block past the limit, and adds the wall
    seconds it spent page-locking to ``pin_seconds`` (faulting in tens of GiB takes tens of seconds)."""

    limit: int | None = None
    held: dict[str, int] = field(default_factory=dict)
    pin_seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.held.values())

    def add(self, what: str, nbytes: int) -> None:
        if self.limit is not None and self.total + nbytes > self.limit:
            raise HostMemoryError(
                f"pinning {nbytes / GIB:.2f} GiB for {what} would hold {(self.total + nbytes) / GIB:.2f} GiB of "
                f"host memory, past the {self.limit / GIB:.2f} GiB the step was placed with; nothing was "
                "allocated for it. Raise host_memory, or shorten the context"
            )
        self.held[what] = self.held.get(what, 0) + nbytes

    def remove(self, what: str, nbytes: int) -> None:
        left = self.held.get(what, 0) - nbytes
        if left > 0:
            self.held[what] = left
        else:
            self.held.pop(what, None)


def touch_pages(t: torch.Tensor, page_bytes: int = 4096) -> None:
    """Write a byte of every ``page_bytes`` page of the contiguous host tensor ``t``, on torch's intra-op
    threads: the kernel then maps its pages in parallel, where cudaHostRegister would fault them in one by one
    (torch's own cudaHostRegister path maps pages on several threads first for the same reason)."""
    t.view(-1).view(torch.uint8)[::page_bytes].zero_()


def pinned_empty(
    shape: tuple[int, ...], dtype: torch.dtype, pin: bool, ledger: HostLedger | None = None, what: str = "pages"
) -> torch.Tensor:
    """An uninitialised host tensor, counted in ``ledger`` under ``what`` while it lives; with ``pin``,
    page-locked in one registration of its exact size (torch's pinned allocator rounds each block up to a
    power of two: up to twice the memory for a pool)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if ledger is not None:
        ledger.add(what, nbytes)  # refused before any memory is taken
    try:
        t = torch.empty(shape, dtype=dtype)
    except RuntimeError:
        if ledger is not None:
            ledger.remove(what, nbytes)
        raise
    if ledger is not None:
        weakref.finalize(t, ledger.remove, what, nbytes)
    if pin and t.numel():
        cudart = torch.cuda.cudart()
        start = time.perf_counter()
        touch_pages(t)
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if ledger is not None:
            ledger.pin_seconds += time.perf_counter() - start
        if int(err) != 0:
            raise HostMemoryError(
                f"could not pin {t.numel() * t.element_size() / GIB:.1f} GiB of host memory (CUDA error "
                f"{int(err)}); the machine may not have that much lockable memory: shorten the context, use "
                "grad_dtype='bfloat16', or lower host_memory"
            )
        weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t
