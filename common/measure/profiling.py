"""What the two torch.profiler scripts share: their output flags and the top operators for the record.

Chapter 16's ``profiling.py`` and Lab-02's ``profile_trace.py`` both print torch.profiler's table,
export a Chrome/Perfetto trace and keep the operators with the most self time in their record. The
profiling itself (what is recorded, the schedule, the labelled regions) is their lesson and stays
in them.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from common.atomic import atomic_path
from common.cli import output_file, positive_int

__all__ = ["add_trace_args", "self_time_key", "top_operators", "trace_path", "write_trace"]


def add_trace_args(parser: argparse.ArgumentParser, *, row_limit: int, trace: str) -> None:
    """``--row-limit`` (operators in the table and the record) and ``--trace`` (default ``RESULTS_DIR/trace``, the
    name :func:`trace_path` gives)."""
    parser.add_argument("--row-limit", type=positive_int, default=row_limit,
                        help="operators in the table and in the record (default: %(default)s)")
    parser.add_argument("--trace", type=output_file, default=None,
                        help=f"Chrome/Perfetto trace to write (default: RESULTS_DIR/{trace})")


def trace_path(chosen: Path | None, results_dir: Path, stem: str, run_id: str) -> Path:
    """The trace a run writes, its folder made: ``chosen`` (``--trace``), else
    ``RESULTS_DIR/<stem>_<run_id>_trace.json``, ``run_id`` the one its record will carry.

    The run's own id in the name: students profile twice into one folder and compare, and a fixed name let the
    second run replace the trace that the first run's record names. The ``trace.json`` ending keeps record readers
    (``common.results.load_records``) off it."""
    trace = chosen or results_dir / f"{stem}_{run_id}_trace.json"
    trace.parent.mkdir(parents=True, exist_ok=True)
    return trace


def self_time_key(device: torch.device) -> str:
    """The key the table is sorted by and the record ranks by: an operator's own time (not its callees'), on the GPU
    when ``device`` is one, else on the CPU."""
    return "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"


def write_trace(trace: Path, export: Callable[[str], None]) -> int:
    """Write ``trace`` with ``export`` (the script's ``prof.export_chrome_trace``) whole or not at all, and return
    its number of events. A ``.gz`` name is gzip-compressed, as torch does for such a name: the temporary file's
    name, which ``export`` gets, does not end in ``.gz``."""
    with atomic_path(trace) as partial:
        export(str(partial))
        events = len(json.loads(partial.read_text())["traceEvents"])
        if trace.suffix == ".gz":
            partial.write_bytes(gzip.compress(partial.read_bytes()))
    return events


def top_operators(averages: Iterable[Any], device: torch.device, limit: int) -> list[dict[str, Any]]:
    """The ``limit`` operators of ``prof.key_averages()`` with the most self time (:func:`self_time_key`), as plain
    numbers for the record."""
    key = self_time_key(device)
    top = sorted(averages, key=lambda event: getattr(event, key), reverse=True)[:limit]
    return [{"name": event.key, "calls": event.count, "self_cpu_time_us": event.self_cpu_time_total,
             "self_device_time_us": getattr(event, "self_device_time_total", 0.0)} for event in top]
