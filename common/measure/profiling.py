"""What the two torch.profiler scripts share: their output flags and the top operators for the record.

Chapter 16's ``profiling.py`` and Lab-02's ``profile_trace.py`` both print torch.profiler's table,
export a Chrome/Perfetto trace and keep the operators with the most self time in their record. The
profiling itself (what is recorded, the schedule, the labelled regions) is their lesson and stays
in them.
"""

from __future__ import annotations

import argparse
from typing import Any, Iterable

import torch

from common.cli import output_file, positive_int

__all__ = ["add_trace_args", "top_operators"]


def add_trace_args(parser: argparse.ArgumentParser, *, row_limit: int, trace: str) -> None:
    """``--row-limit`` (operators in the table and the record) and ``--trace`` (default ``RESULTS_DIR/trace``)."""
    parser.add_argument("--row-limit", type=positive_int, default=row_limit,
                        help="operators in the table and in the record (default: %(default)s)")
    parser.add_argument("--trace", type=output_file, default=None,
                        help=f"Chrome/Perfetto trace to write (default: RESULTS_DIR/{trace})")


def top_operators(averages: Iterable[Any], device: torch.device, limit: int) -> list[dict[str, Any]]:
    """The ``limit`` operators of ``prof.key_averages()`` with the most self time (on the GPU when
    ``device`` is one, else on the CPU), as plain numbers for the record."""
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    top = sorted(averages, key=lambda event: getattr(event, key), reverse=True)[:limit]
    return [{"name": event.key, "calls": event.count, "self_cpu_time_us": event.self_cpu_time_total,
             "self_device_time_us": getattr(event, "self_device_time_total", 0.0)} for event in top]
