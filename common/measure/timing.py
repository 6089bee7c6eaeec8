"""Honest timing (docs/conventions.md, convention 8) and peak memory.

- The device is synchronised before every clock read: CUDA kernels run asynchronously, so without
  it a "step time" measures only how fast Python queued the work.
- The first ``warmup_steps`` are dropped (cuDNN autotuning, allocator growth, lazy init).
- Summaries give the median and the spread (std, p10/p90, min/max), not a single mean, and carry a
  ``method`` string that says how the numbers were taken.
- Peak memory: the CUDA caching allocator's peak on a GPU, the process's peak resident set on CPU.
  On a GPU the record also holds what the *device* has in use (NVML's figure for this process, or
  ``cudaMemGetInfo`` for the whole GPU): the allocator does not see the CUDA context, cuBLAS/cuDNN
  workspaces or NCCL's buffers, so a DDP run looks leaner by the allocator's count than it is.
- A run no longer than its warm-up has no timed step: its throughput is ``None`` and prints as
  ``n/a`` (:func:`format_rate`), never as ``0 samples/s``.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from common.runtime.device import pci_bus_id, synchronize

#: Printed instead of a throughput or a speed-up that was not measured (no step after the warm-up).
NOT_MEASURED = "n/a"


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    position = (len(sorted_values) - 1) * q
    low, high = int(position), min(int(position) + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def summarize(times_s: list[float], samples_per_step: list[int] | None = None, *, warmup_steps: int = 0,
              method: str = "") -> dict[str, Any]:
    """Median, mean, spread and throughput of a list of step times (seconds)."""
    ordered = sorted(times_s)
    total = sum(times_s)
    samples = sum(samples_per_step) if samples_per_step else None
    summary = {
        "steps_timed": len(times_s),
        "warmup_steps": warmup_steps,
        "median_s": statistics.median(times_s) if times_s else None,
        "mean_s": statistics.fmean(times_s) if times_s else None,
        "std_s": statistics.stdev(times_s) if len(times_s) > 1 else 0.0 if times_s else None,
        "min_s": ordered[0] if ordered else None,
        "max_s": ordered[-1] if ordered else None,
        "p10_s": _percentile(ordered, 0.10) if ordered else None,
        "p90_s": _percentile(ordered, 0.90) if ordered else None,
        "total_s": total,
        "samples_per_s": (samples / total) if samples and total > 0 else None,
        "method": method,
    }
    if not times_s:
        summary["not_timed"] = "no step was timed: the run was no longer than its warm-up, so throughput is n/a"
    return summary


class Heartbeat:
    """A line now and then from a long loop that prints nothing else, so that a student sees it is alive:
    ``heartbeat(done)`` prints ``  WHAT: DONE of TOTAL (S s)`` when ``every_s`` seconds have passed since
    the last line (or the start). Reads the clock only: no device sync, nothing added to a timed step."""

    EVERY_S = 10.0

    def __init__(self, what: str, total: int, every_s: float | None = None) -> None:
        self.what, self.total = what, total
        self.every_s = self.EVERY_S if every_s is None else every_s
        self.started = self.last = time.perf_counter()

    def __call__(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            print(f"  {self.what}: {done} of {self.total} ({now - self.started:.0f} s)", flush=True)
            self.last = now


def format_rate(value: float | None, digits: int = 1) -> str:
    """A throughput for a progress line: ``1234.5``, or ``n/a`` when nothing was timed."""
    return NOT_MEASURED if value is None else f"{value:.{digits}f}"


def format_speedup(value: float | None) -> str:
    """A ratio of two throughputs: ``1.87x``, or ``n/a`` when either side was not measured."""
    return NOT_MEASURED if value is None else f"{value:.2f}x"


def scaled(value: float | None, factor: float) -> float | None:
    """``value * factor`` (one rank's throughput times the world size), ``None`` stays ``None``."""
    return None if value is None else value * factor


class StepTimer:
    """Times training steps: ``with timer.step(batch_size): ...``.

    Steps before ``warmup_steps`` are run but not recorded. ``samples`` is what this step processed
    (multiply by the world size for a job's throughput, or pass the global batch). ``waited_s``: how
    long the step waited for its batch before the ``with`` block, counted as part of the step, so
    that a starved device shows in the step times and the throughput.
    """

    def __init__(self, device: torch.device, warmup_steps: int = 2) -> None:
        self.device = device
        self.warmup_steps = warmup_steps
        self.seen = 0
        self.times: list[float] = []
        self.samples: list[int] = []
        self.waits_included = False

    @contextmanager
    def step(self, samples: int, waited_s: float | None = None) -> Iterator[None]:
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        elapsed = time.perf_counter() - start + (waited_s or 0.0)
        self.waits_included |= waited_s is not None
        self.seen += 1
        if self.seen > self.warmup_steps:
            self.times.append(elapsed)
            self.samples.append(int(samples))

    @property
    def method(self) -> str:
        sync = "torch.cuda.synchronize() before each clock read" if self.device.type == "cuda" else "CPU (synchronous)"
        wait = ", waiting for the batch included" if self.waits_included else ""
        return f"time.perf_counter per step{wait}, {sync}, first {self.warmup_steps} step(s) dropped"

    def summary(self) -> dict[str, Any]:
        return summarize(self.times, self.samples, warmup_steps=min(self.seen, self.warmup_steps), method=self.method)


def time_function(fn: Callable[[], Any], device: torch.device, *, repeats: int = 10, warmup: int = 2) -> dict[str, Any]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed; return :func:`summarize`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    sync = "torch.cuda.synchronize() around each call" if device.type == "cuda" else "CPU (synchronous)"
    return summarize(times, warmup_steps=warmup, method=f"time.perf_counter, {sync}, {warmup} warm-up call(s) dropped")


NOT_STARTED = "not measured: CUDA was not started in this process"


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (CUDA only; a process's peak RSS cannot be reset).

    Before CUDA has started there is no allocator to reset (PyTorch raises "Invalid device
    argument"); then nothing was allocated either, and :func:`peak_memory` says "not measured".
    """
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats(device)


def process_rss_bytes() -> int | None:
    """This process's resident memory now (Linux ``/proc/self/statm``; ``None`` elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def process_peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_memory(device: torch.device) -> dict[str, Any]:
    """Peak memory of this process on ``device``, with the source of each number.

    ``peak_bytes`` (``source``) is the caching allocator's peak on a GPU, the peak RSS on CPU. On a
    GPU, ``device_used_bytes`` (``device_used_source``) is what the device has in use now, as
    :func:`device_memory_used` reads it. Before CUDA has started in this process the allocator's
    counters read 0, which would pass for a measurement: then ``peak_bytes`` is ``None`` and
    ``source`` says why (a record keeps the gap, the report shows n/a).
    """
    if device.type == "cuda" and not torch.cuda.is_initialized():
        return {"device": str(device), "peak_bytes": None, "peak_reserved_bytes": None, "source": NOT_STARTED}
    if device.type == "cuda":
        return {"device": str(device), "peak_bytes": int(torch.cuda.max_memory_allocated(device)),
                "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
                "source": "cuda_max_memory_allocated", **device_memory_used(device)}
    return {"device": "cpu", "peak_bytes": process_peak_rss_bytes(), "source": "process_max_rss"}


def _nvml_process_used(index: int) -> int | None:
    """This process's memory on GPU ``index`` according to NVML (``None`` without pynvml or a match).

    NVML numbers GPUs its own way, so the GPU is found by its PCI bus id, not by the CUDA index. In
    a container with its own PID namespace the driver's PIDs are not ours: then there is no match.
    """
    try:
        import pynvml  # nvidia-ml-py, optional
    except ImportError:
        return None
    bus_id = pci_bus_id(index)
    if bus_id is None:
        return None
    try:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == os.getpid() and process.usedGpuMemory is not None:
                    return int(process.usedGpuMemory)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    return None


def device_memory_used(device: torch.device) -> dict[str, Any]:
    """GPU memory in use as the driver sees it, which the caching allocator's counters leave out.

    NVML's figure for this process when ``pynvml`` is installed (context, workspaces, NCCL buffers,
    the allocator's cache), else ``torch.cuda.mem_get_info``: total minus free on the whole GPU,
    which also counts any other process on it. Read when called (at the end of a run), not a peak.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    used = _nvml_process_used(index)
    if used is not None:
        return {"device_used_bytes": used, "device_used_source": "nvml_process_used"}
    free, total = torch.cuda.mem_get_info(index)
    return {"device_used_bytes": int(total - free), "device_total_bytes": int(total),
            "device_used_source": "cuda_mem_get_info"}
