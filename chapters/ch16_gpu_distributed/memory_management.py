#!/usr/bin/env python3
"""Where training memory goes, and two ways to need less of it: checkpointing and accumulation.

Usage:
    python memory_management.py                        # GPU when visible, else CPU
    python memory_management.py --device cpu --depth 8 --width 256 --batch-size 128
    sbatch --gres=gpu:1 --wrap "python memory_management.py --depth 32 --width 2048"
    (one process, one device: there is no torchrun form)

What it teaches, in three parts, each printed and written into one result record:

1. Memory around forward, backward and the optimiser step: activations appear in the forward pass
   and are freed by the backward pass, gradients appear in the backward pass, Adam's two state
   tensors per parameter appear at the first step.
2. Gradient checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``) on a deep model:
   keep only each block's input and recompute the inside during backward. Measured: the peak memory
   of a forward+backward with and without it, and the time it costs.
3. Gradient accumulation: k micro-batches give the same gradients as one big batch, checked here
   within a tolerance, when each micro-batch's loss is weighted by its share of the batch.

How memory is measured. On a GPU, the CUDA caching allocator counts every tensor:
``memory_allocated`` (live tensors), ``memory_reserved`` (held by the cache) and
``max_memory_allocated`` (the peak); at the end the script prints the allocator's own report,
``torch.cuda.memory_summary()``. One forward and backward pass runs before anything is measured:
the first matmul on a GPU allocates cuBLAS's workspace (megabytes) through the same allocator, and
measured cold it would be counted as the forward pass's activations. A CPU has no such counter, and the process's resident set
(RSS) moves in coarse steps and includes Python and PyTorch themselves, so on a CPU this script runs
the step under ``torch.profiler`` with ``profile_memory=True``: the profiler logs every tensor
allocation and free, and the running sum of those bytes is the CPU's "allocated", whose maximum is
its "peak". The process's peak RSS (``common.measure.timing``) is printed next to it for scale. A second,
independent view of part 2 counts the bytes autograd saves for the backward pass
(``torch.autograd.graph.saved_tensors_hooks``), which is exactly what checkpointing trades away.
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
from torch.utils.checkpoint import checkpoint

from common.cli import add_common_args, apply_dry_run, config_dict, positive_int, script_parser
from common.runtime.device import configure_threads, describe, resolve_device, seed_everything, synchronize
from common.measure.energy import EnergyMeter
from common.errors import run_main
from common.results import make_record, provenance, write_record
from common.measure.timing import peak_memory, process_peak_rss_bytes
from common.units import format_bytes

SCRIPT = "chapters/ch16_gpu_distributed/memory_management.py"
#: Gradients summed in a different order differ in the last bits; this is far below any real mistake.
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


class DeepNet(nn.Module):
    """``depth`` blocks of Linear -> LayerNorm -> GELU and a classifier; each block can be checkpointed.

    No dropout and no BatchNorm, on purpose: both make a micro-batch's gradient depend on what else
    is in the batch (random masks, batch statistics), and part 3 would then not match exactly.
    """

    def __init__(self, width: int = 512, depth: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, num_classes)
        self.checkpoint_blocks = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpoint_blocks and self.training:
                # use_reentrant=False is the variant PyTorch recommends (and will make the default):
                # it works with inputs that do not require grad and with torch.autograd.grad.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x)


# --- measuring memory -----------------------------------------------------------------------------

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


def memory_by_phase(model: nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor,
                    target: torch.Tensor, device: torch.device) -> list[dict[str, Any]]:
    """Allocated and peak memory after forward, backward, optimiser step and zero_grad."""
    steps: list[tuple[str, Callable[[], Any]]] = []
    state: dict[str, torch.Tensor] = {}
    steps.append(("forward", lambda: state.update(loss=F.cross_entropy(model(data), target))))
    steps.append(("backward", lambda: state.pop("loss").backward()))
    steps.append(("optimizer.step", optimizer.step))
    steps.append(("zero_grad", lambda: optimizer.zero_grad(set_to_none=True)))
    rows = []
    if device.type == "cuda":
        synchronize(device)
        start = torch.cuda.memory_allocated(device)
        for name, run in steps:
            torch.cuda.reset_peak_memory_stats(device)
            run()
            synchronize(device)
            rows.append({"phase": name, "allocated_change_bytes": torch.cuda.memory_allocated(device) - start,
                         "peak_above_start_bytes": torch.cuda.max_memory_allocated(device) - start,
                         "allocated_bytes": torch.cuda.memory_allocated(device),
                         "reserved_bytes": torch.cuda.memory_reserved(device),
                         "source": "cuda_memory_allocated"})
        return rows
    with CpuAllocations() as memory:
        rss = {}
        for name, run in steps:
            with memory.phase(name):
                run()
            rss[name] = process_peak_rss_bytes()
    for name, _ in steps:
        rows.append({"phase": name, "allocated_change_bytes": memory.phases[name]["change"],
                     "peak_above_start_bytes": memory.phases[name]["peak"], "process_peak_rss_bytes": rss[name],
                     "source": "torch.profiler profile_memory (CPU allocations)"})
    return rows


def forward_backward(model: nn.Module, data: torch.Tensor, target: torch.Tensor) -> None:
    F.cross_entropy(model(data), target).backward()


def warm_up(model: nn.Module, data: torch.Tensor, target: torch.Tensor, device: torch.device) -> None:
    """One forward and backward, gradients dropped: what is allocated once per process is allocated now.

    On a GPU that is cuBLAS's workspace (allocated at the first matmul, through the caching allocator,
    and kept) and cuDNN's handles; measured in part 1 it would look like activations.
    """
    forward_backward(model, data, target)
    model.zero_grad(set_to_none=True)
    synchronize(device)


def peak_above_start(model: nn.Module, data: torch.Tensor, target: torch.Tensor, device: torch.device) -> int:
    """Most memory allocated at any moment of one forward+backward, above what was allocated before it."""
    if device.type == "cuda":
        synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        forward_backward(model, data, target)
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    with CpuAllocations() as memory:
        with memory.phase("forward+backward"):
            forward_backward(model, data, target)
    return memory.phases["forward+backward"]["peak"]


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


def checkpointing_comparison(model: DeepNet, data: torch.Tensor, target: torch.Tensor, device: torch.device,
                             repeats: int) -> dict[str, Any]:
    """Peak memory, saved bytes and time of forward+backward, without and with checkpointing.

    Each variant runs once, unmeasured, before its peak is taken: its first pass allocates what is
    allocated once per process (on a GPU, checkpointing's recompute runs on autograd's own thread,
    whose first matmul allocates a cuBLAS workspace of its own, a MiB that is not an activation).
    The two are timed alternately (plain, checkpointed, plain, ...), one warm-up pair dropped, so a
    change in the machine's load hits both alike; the time cost is the median of the pairs' ratios.
    """
    variants = (("plain", False), ("checkpointed", True))
    results: dict[str, Any] = {}
    model.train()
    for label, enabled in variants:
        model.checkpoint_blocks = enabled
        forward_backward(model, data, target)  # the warm-up; gradients now exist: the peak is activations only
        model.zero_grad(set_to_none=False)
        results[f"{label}_peak_bytes"] = peak_above_start(model, data, target, device)
        model.zero_grad(set_to_none=False)
        results[f"{label}_saved_bytes"] = saved_for_backward_bytes(model, data, target)
    times: dict[str, list[float]] = {label: [] for label, _ in variants}
    for _ in range(1 + repeats):
        for label, enabled in variants:
            model.checkpoint_blocks = enabled
            model.zero_grad(set_to_none=False)
            synchronize(device)
            start = time.perf_counter()
            forward_backward(model, data, target)
            synchronize(device)
            times[label].append(time.perf_counter() - start)
    model.checkpoint_blocks = False
    for label, _ in variants:
        results[f"{label}_time_s"] = statistics.median(times[label][1:])
    results["peak_saving"] = 1 - results["checkpointed_peak_bytes"] / results["plain_peak_bytes"]
    results["time_ratio"] = statistics.median(
        checkpointed / plain for plain, checkpointed in zip(times["plain"][1:], times["checkpointed"][1:]))
    results["timing_method"] = (f"time.perf_counter around forward+backward, device synchronised; plain and "
                                f"checkpointed alternated {repeats} times after one warm-up pair; medians, and "
                                "the median of the per-pair ratios")
    return results


# --- gradient accumulation ------------------------------------------------------------------------

def gradients(model: nn.Module, pieces: Sequence[tuple[torch.Tensor, torch.Tensor, float]]) -> list[torch.Tensor]:
    """Sum of ``weight * loss(piece)`` gradients over the pieces, as a list of tensors."""
    model.zero_grad(set_to_none=True)
    for data, target, weight in pieces:
        (F.cross_entropy(model(data), target) * weight).backward()  # .backward() adds into .grad
    return [p.grad.detach().clone() for p in model.parameters()]


def compare(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict[str, Any]:
    max_abs = max((a - b).abs().max().item() for a, b in zip(reference, other))
    scale = max(a.abs().max().item() for a in reference)
    match = all(torch.allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL) for a, b in zip(reference, other))
    return {"max_abs_diff": max_abs, "max_rel_diff": max_abs / scale if scale else 0.0, "match": match}


def accumulation_check(model: nn.Module, data: torch.Tensor, target: torch.Tensor, steps: int) -> dict[str, Any]:
    """One batch vs ``steps`` micro-batches, weighting each by its share; and the Chapter 16 notes'
    ``loss / steps``."""
    batch = len(data)
    full = gradients(model, [(data, target, 1.0)])
    micro = list(zip(torch.tensor_split(data, steps), torch.tensor_split(target, steps)))
    weighted = gradients(model, [(x, y, len(x) / batch) for x, y in micro])
    notes_style = gradients(model, [(x, y, 1.0 / steps) for x, y in micro])
    return {"batch": batch, "micro_batches": [len(x) for x, _ in micro],
            "weighted": compare(full, weighted), "seed_loss_over_k": compare(full, notes_style)}


# --- the script -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("--width", type=positive_int, default=512, help="features per layer (default: %(default)s)")
    parser.add_argument("--depth", type=positive_int, default=16,
                        help="blocks of Linear-LayerNorm-GELU (default: %(default)s)")
    parser.add_argument("--accumulation-steps", type=positive_int, default=4,
                        help="micro-batches the batch is split into in part 3 (default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed forward+backward pairs (plain, checkpointed) in part 2 (default: %(default)s)")
    add_common_args(parser, batch_size=256)
    return parser


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    print(f"\n{title}")
    for row in (header, *rows):
        print("  " + "  ".join(str(cell).rjust(width) for cell, width in zip(row, widths)))


def main(argv: Sequence[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv), width=64, depth=4, batch_size=32, repeats=1)
    seed_everything(args.seed)
    threads = configure_threads()
    device = resolve_device(args.device)
    model = DeepNet(args.width, args.depth).to(device)
    data = torch.randn(args.batch_size, args.width, device=device)
    target = torch.randint(0, 10, (args.batch_size,), device=device)
    where = ("the CUDA caching allocator" if device.type == "cuda" else
             "torch.profiler's record of CPU tensor allocations (a CPU has no allocator counter; RSS is too coarse)")
    print(f"device {describe(device)} | model {args.depth} x Linear({args.width}) blocks, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters | batch {args.batch_size} | threads {threads}")
    print(f"memory figures come from {where}")

    meter = EnergyMeter(device).start()  # over the three measurements
    # 1. forward, backward, step (after one unmeasured pass: see warm_up)
    warm_up(model, data, target, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    phases = memory_by_phase(model, optimizer, data, target, device)
    header = ["phase", "allocated (change)", "peak during phase"]
    header += ["allocated", "reserved"] if device.type == "cuda" else ["process peak RSS"]
    rows = []
    for row in phases:
        cells = [row["phase"], format_bytes(row["allocated_change_bytes"]), format_bytes(row["peak_above_start_bytes"])]
        cells += ([format_bytes(row["allocated_bytes"]), format_bytes(row["reserved_bytes"])]
                  if device.type == "cuda" else [format_bytes(row["process_peak_rss_bytes"])])
        rows.append(cells)
    print_table("1. Memory around one training step (change and peak relative to before the forward pass)",
                header, rows)
    if device.type != "cuda":
        print("  (process peak RSS includes Python, PyTorch and its libraries: it barely moves for a step)")

    # 2. gradient checkpointing
    ckpt = checkpointing_comparison(model, data, target, device, args.repeats)
    print_table("2. Gradient checkpointing, one forward+backward (gradients already allocated)",
                ["", "peak above start", "saved for backward", "median time"],
                [[label, format_bytes(ckpt[f"{label}_peak_bytes"]), format_bytes(ckpt[f"{label}_saved_bytes"]),
                  f"{1000 * ckpt[f'{label}_time_s']:.1f} ms"] for label in ("plain", "checkpointed")])
    print(f"  checkpointing saves {ckpt['peak_saving']:.0%} of the peak and costs {ckpt['time_ratio']:.2f}x the time "
          "(each block's forward runs twice)")

    # 3. gradient accumulation
    accumulation_model = DeepNet(min(args.width, 128), min(args.depth, 4)).to(device)
    even = accumulation_check(accumulation_model, data[:, :min(args.width, 128)], target, args.accumulation_steps)
    uneven_size = args.batch_size - args.batch_size % args.accumulation_steps + args.accumulation_steps // 2 + 1
    uneven_data = torch.randn(uneven_size, min(args.width, 128), device=device)
    uneven_target = torch.randint(0, 10, (uneven_size,), device=device)
    uneven = accumulation_check(accumulation_model, uneven_data, uneven_target, args.accumulation_steps)
    rows = []
    for label, result in (("equal micro-batches", even), ("unequal micro-batches", uneven)):
        for rule in ("weighted", "seed_loss_over_k"):
            check = result[rule]
            rows.append([label, "/".join(map(str, result["micro_batches"])),
                         "loss x len(micro)/len(batch)" if rule == "weighted" else "loss / k (the Chapter 16 notes)",
                         f"{check['max_abs_diff']:.2e}", f"{check['max_rel_diff']:.2e}",
                         "yes" if check["match"] else "NO"])
    print_table(f"3. Gradient accumulation: {args.accumulation_steps} micro-batches vs one batch "
                f"(match: allclose rtol={GRAD_RTOL}, atol={GRAD_ATOL})",
                ["batch split", "sizes", "loss scaling", "max |diff|", "relative", "match"], rows)

    energy = meter.stop().result()
    # The caching allocator's own report: live and cached memory, allocation counts, fragmentation.
    if device.type == "cuda":
        print("\ntorch.cuda.memory_summary(abbreviated=True), the caching allocator's own report:")
        print(torch.cuda.memory_summary(device, abbreviated=True))
    else:
        print("\ntorch.cuda.memory_summary() prints the CUDA caching allocator's report (live and cached "
              "memory, allocation counts); a CPU has no such allocator, so a CPU run has none to show")

    memory = peak_memory(device)
    metrics = {"phases": phases, "checkpointing": ckpt, "accumulation": {"equal": even, "unequal": uneven},
               "accumulation_match": even["weighted"]["match"] and uneven["weighted"]["match"],
               "checkpoint_peak_saving": ckpt["peak_saving"], "checkpoint_time_ratio": ckpt["time_ratio"],
               "memory": [memory], "world_size": 1, "global_batch_size": args.batch_size,
               "memory_method": where}
    config = config_dict(args, resolved_device=str(device), model=f"deepnet-{args.depth}x{args.width}",
                         threads=threads, cpu_count=os.cpu_count())
    record = make_record(lab="ch16", script=SCRIPT, method="memory-management", config=config,
                         metrics=metrics, provenance=provenance(device), energy=energy)
    print(f"\nrecord: {write_record(record, args.results_dir)}")
    return 0


if __name__ == "__main__":
    run_main(main)
