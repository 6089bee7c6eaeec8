"""What ``memory_management.py`` leans on and does not teach: the CPU's stand-in for the allocator's
counters, the alternating timer, the gradient comparison, its flags, its tables and its record.

The lesson stays in the script: the CUDA allocator's counters around each phase of a step,
``torch.utils.checkpoint`` and its measured trade, gradient accumulation with each micro-batch
weighted by its share. Here is the plumbing around it:

- :class:`CpuAllocations`, :func:`cpu_memory_by_phase`, :func:`cpu_peak_bytes`: a CPU has no
  allocator counter, so the profiler's log of every tensor allocation stands in for it (the README,
  "Measuring memory on a CPU").
- :func:`time_alternately`: the time checkpointing costs, plain and checkpointed alternated.
- :func:`compare`: do two sets of gradients match (within :data:`GRAD_RTOL`, :data:`GRAD_ATOL`)?
- :func:`add_memory_args`, the ``print_*`` tables and :func:`write_memory_record`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from common.cli import add_common_args, apply_dry_run, config_dict, positive_int
from common.measure.timing import process_peak_rss_bytes
from common.results import make_record, provenance, write_record
from common.runtime.device import describe, synchronize
from common.units import format_bytes

SCRIPT = "chapters/ch16_gpu_distributed/memory_management.py"
#: Gradients summed in a different order differ in the last bits; this is far below any real mistake.
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


# --------------------------------------------------------------------------------------------
# Memory on a CPU, from the profiler's allocation events


class CpuAllocations:
    """Tensor memory on the CPU during a ``with`` block, from the profiler's allocation events.

    ``with CpuAllocations() as mem: with mem.phase("forward"): ...`` then ``mem.phases["forward"]``
    gives ``change`` (bytes still allocated at the end of the phase, relative to the start of the
    block) and ``peak`` (the most allocated at any moment of the phase, same reference).
    """

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, int]] = {}
        self._names: list[str] = []

    def __enter__(self) -> "CpuAllocations":
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()
        return self

    def phase(self, name: str) -> Any:
        from torch.profiler import record_function

        self._names.append(name)
        return record_function(f"phase:{name}")

    def __exit__(self, *exc: Any) -> None:
        self._profiler.__exit__(*exc)
        if exc[0] is not None:
            return
        with tempfile.TemporaryDirectory() as folder:  # the profiler's public output is a Chrome trace
            trace = Path(folder) / "trace.json"
            self._profiler.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text())["traceEvents"]
        allocations = sorted((e["ts"], e["args"]["Bytes"]) for e in events
                             if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
        spans = {e["name"][len("phase:"):]: (e["ts"], e["ts"] + e["dur"]) for e in events
                 if str(e.get("name", "")).startswith("phase:") and "dur" in e}
        running, timeline = 0, []
        for ts, nbytes in allocations:
            running += nbytes
            timeline.append((ts, running))
        for name in self._names:
            start, end = spans[name]
            before = [total for ts, total in timeline if ts < start]
            inside = [total for ts, total in timeline if start <= ts <= end]
            at_start = before[-1] if before else 0
            self.phases[name] = {"change": inside[-1] if inside else at_start,
                                 "peak": max([at_start, *inside])}


def cpu_memory_by_phase(steps: Sequence[tuple[str, Callable[[], Any]]]) -> list[dict[str, Any]]:
    """Run ``steps`` (``(name, call)``) under the profiler: each one's allocated change and peak, and
    the process's peak RSS after it, for scale."""
    with CpuAllocations() as memory:
        rss = {}
        for name, run in steps:
            with memory.phase(name):
                run()
            rss[name] = process_peak_rss_bytes()
    return [{"phase": name, "allocated_change_bytes": memory.phases[name]["change"],
             "peak_above_start_bytes": memory.phases[name]["peak"], "process_peak_rss_bytes": rss[name],
             "source": "torch.profiler profile_memory (CPU allocations)"} for name, _ in steps]


def cpu_peak_bytes(run: Callable[[], Any]) -> int:
    """The most CPU tensor memory allocated at any moment of ``run()``, above what was allocated before it."""
    with CpuAllocations() as memory:
        with memory.phase("forward+backward"):
            run()
    return memory.phases["forward+backward"]["peak"]


# --------------------------------------------------------------------------------------------
# A second view of checkpointing, timing and comparing


def saved_for_backward_bytes(model: nn.Module, data: torch.Tensor, target: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps from forward to backward, parameters not counted.

    Several operations often save the same tensor (one layer's output is the next one's input), so
    storages are counted once.
    """
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = F.cross_entropy(model(data), target)
    loss.backward()
    return sum(saved.values())




def time_alternately(run: Callable[[bool], Any], device: torch.device, repeats: int) -> dict[str, Any]:
    """``run(False)`` (plain) and ``run(True)`` (checkpointed) timed alternately, one warm-up pair dropped,
    so a change in the machine's load hits both alike: their median times and the median of the pairs' ratios."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(1 + repeats):
        for enabled in (False, True):
            synchronize(device)
            start = time.perf_counter()
            run(enabled)
            synchronize(device)
            times[enabled].append(time.perf_counter() - start)
    plain, checkpointed = times[False][1:], times[True][1:]
    return {"plain_time_s": statistics.median(plain), "checkpointed_time_s": statistics.median(checkpointed),
            "time_ratio": statistics.median(c / p for p, c in zip(plain, checkpointed)),
            "timing_method": (f"time.perf_counter around forward+backward, device synchronised; plain and "
                              f"checkpointed alternated {repeats} times after one warm-up pair; medians, and "
                              "the median of the per-pair ratios")}


def compare(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict[str, Any]:
    """The largest difference between two lists of gradients, and whether they match (``allclose``)."""
    max_abs = max((a - b).abs().max().item() for a, b in zip(reference, other))
    scale = max(a.abs().max().item() for a in reference)
    match = all(torch.allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL) for a, b in zip(reference, other))
    return {"max_abs_diff": max_abs, "max_rel_diff": max_abs / scale if scale else 0.0, "match": match}


# --------------------------------------------------------------------------------------------
# Flags, tables, record


def add_memory_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The model's size, the accumulation and the repeats, then the flags every script shares."""
    parser.add_argument("--width", type=positive_int, default=512, help="features per layer (default: %(default)s)")
    parser.add_argument("--depth", type=positive_int, default=16,
                        help="blocks of Linear-LayerNorm-GELU (default: %(default)s)")
    parser.add_argument("--accumulation-steps", type=positive_int, default=4,
                        help="micro-batches the batch is split into in part 3, from 2 to the batch size "
                             "(default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed forward+backward pairs (plain, checkpointed) in part 2 (default: %(default)s)")
    add_common_args(parser, batch_size=256, epochs_and_steps=False, data=False)  # random inputs
    return parser


def parse_memory_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags, ``--dry-run``'s smaller sizes applied, and one ``error:`` line (exit 2) when part 3 cannot split
    the batch: it needs at least two micro-batches, and no more than the batch has samples (an empty one is none)."""
    args = parser.parse_args(argv)
    if not 2 <= args.accumulation_steps <= args.batch_size:
        parser.error(f"--accumulation-steps {args.accumulation_steps}: part 3 splits the batch into 2 .. "
                     f"--batch-size ({args.batch_size}) micro-batches")
    return apply_dry_run(args, width=64, depth=4, batch_size=32, repeats=1, accumulation_steps=4)


def print_header(args: argparse.Namespace, device: torch.device, model: nn.Module, threads: int) -> str:
    """The run's first lines: the device, the model and the batch; and where the memory figures come from (returned)."""
    where = ("the CUDA caching allocator" if device.type == "cuda" else
             "torch.profiler's record of CPU tensor allocations (a CPU has no allocator counter; RSS is too coarse)")
    print(f"device {describe(device)} | model {args.depth} x Linear({args.width}) blocks, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters | batch {args.batch_size} | threads {threads}")
    print(f"memory figures come from {where}")
    return where


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    print(f"\n{title}")
    for row in (header, *rows):
        print("  " + "  ".join(str(cell).rjust(width) for cell, width in zip(row, widths)))


def print_phases(phases: Sequence[dict[str, Any]], device: torch.device) -> None:
    """Part 1's table: the CUDA allocator's allocated and reserved, or the process's peak RSS on a CPU."""
    cuda = device.type == "cuda"
    header = ["phase", "allocated (change)", "peak during phase"]
    header += ["allocated", "reserved"] if cuda else ["process peak RSS"]
    rows = []
    for row in phases:
        cells = [row["phase"], format_bytes(row["allocated_change_bytes"]), format_bytes(row["peak_above_start_bytes"])]
        cells += ([format_bytes(row["allocated_bytes"]), format_bytes(row["reserved_bytes"])]
                  if cuda else [format_bytes(row["process_peak_rss_bytes"])])
        rows.append(cells)
    print_table("1. Memory around one training step (change and peak relative to before the forward pass)",
                header, rows)
    if not cuda:
        print("  (process peak RSS includes Python, PyTorch and its libraries: it barely moves for a step)")


def print_checkpointing(ckpt: dict[str, Any]) -> None:
    print_table("2. Gradient checkpointing, one forward+backward (gradients already allocated)",
                ["", "peak above start", "saved for backward", "median time"],
                [[label, format_bytes(ckpt[f"{label}_peak_bytes"]), format_bytes(ckpt[f"{label}_saved_bytes"]),
                  f"{1000 * ckpt[f'{label}_time_s']:.1f} ms"] for label in ("plain", "checkpointed")])
    saving = ckpt["peak_saving"]
    effect = (f"saves {saving:.0%} of the peak" if saving >= 0 else  # a model too small: its bookkeeping outweighs
              f"raises the peak {1 - saving:.2f}x (this model has fewer activations to drop than checkpointing keeps)")
    # The ratio is the median of each alternated pair's ratio, not the medians' ratio above: on a machine whose load
    # changes during the run the two can disagree, even in direction, and the pairs' ratio is the one load hits alike.
    print(f"  checkpointing {effect} and costs {ckpt['time_ratio']:.2f}x the time (median of the alternated pairs' "
          "ratios; each block's forward runs twice)")


def print_accumulation(even: dict[str, Any], uneven: dict[str, Any], steps: int) -> None:
    rows = []
    for label, result in (("equal micro-batches", even), ("unequal micro-batches", uneven)):
        for rule in ("weighted", "seed_loss_over_k"):
            check = result[rule]
            rows.append([label, "/".join(map(str, result["micro_batches"])),
                         "loss x len(micro)/len(batch)" if rule == "weighted" else "loss / k (the Chapter 16 notes)",
                         f"{check['max_abs_diff']:.2e}", f"{check['max_rel_diff']:.2e}",
                         "yes" if check["match"] else "NO"])
    print_table(f"3. Gradient accumulation: {steps} micro-batches vs one batch "
                f"(match: allclose rtol={GRAD_RTOL}, atol={GRAD_ATOL})",
                ["batch split", "sizes", "loss scaling", "max |diff|", "relative", "match"], rows)


def write_memory_record(args: argparse.Namespace, device: torch.device, threads: int, where: str,
                        phases: list[dict[str, Any]], ckpt: dict[str, Any], even: dict[str, Any],
                        uneven: dict[str, Any], memory: dict[str, Any], energy: dict[str, Any]) -> Path:
    """The run's one record (lab ``ch16``, method ``memory-management``): the three parts' measurements."""
    metrics = {"phases": phases, "checkpointing": ckpt, "accumulation": {"equal": even, "unequal": uneven},
               "accumulation_match": even["weighted"]["match"] and uneven["weighted"]["match"],
               "checkpoint_peak_saving": ckpt["peak_saving"], "checkpoint_time_ratio": ckpt["time_ratio"],
               "memory": [memory], "world_size": 1, "global_batch_size": args.batch_size,
               "memory_method": where}
    config = config_dict(args, resolved_device=str(device), model=f"deepnet-{args.depth}x{args.width}",
                         threads=threads, cpu_count=os.cpu_count())
    record = make_record(lab="ch16", script=SCRIPT, method="memory-management", config=config,
                         metrics=metrics, provenance=provenance(device), energy=energy)
    return write_record(record, args.results_dir)
