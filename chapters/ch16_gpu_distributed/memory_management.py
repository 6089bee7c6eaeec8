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
measured cold it would be counted as the forward pass's activations. A CPU has no such counter, and the
process's resident set (RSS) moves in coarse steps and includes Python and PyTorch themselves, so on a
CPU this script runs
the step under ``torch.profiler`` with ``profile_memory=True``: the profiler logs every tensor
allocation and free, and the running sum of those bytes is the CPU's "allocated", whose maximum is
its "peak". The process's peak RSS (``common.measure.timing``) is printed next to it for scale. A second,
independent view of part 2 counts the bytes autograd saves for the backward pass
(``torch.autograd.graph.saved_tensors_hooks``), which is exactly what checkpointing trades away.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from common.cli import script_parser
from common.runtime.device import configure_threads, resolve_device, seed_everything, synchronize
from common.measure.energy import EnergyMeter
from common.errors import run_main
from common.measure.timing import peak_memory
from chapters.ch16_gpu_distributed.ch16_shared import (
    add_memory_args, compare, cpu_memory_by_phase, cpu_peak_bytes, parse_memory_args, print_accumulation,
    print_checkpointing, print_header, print_phases, saved_for_backward_bytes, time_alternately, write_memory_record,
)


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


# --- 1. where memory goes -------------------------------------------------------------------------

def memory_by_phase(model: nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor,
                    target: torch.Tensor, device: torch.device) -> list[dict[str, Any]]:
    """Allocated and peak memory after forward, backward, optimiser step and zero_grad."""
    state: dict[str, torch.Tensor] = {}
    steps = [("forward", lambda: state.update(loss=F.cross_entropy(model(data), target))),
             ("backward", lambda: state.pop("loss").backward()),
             ("optimizer.step", optimizer.step),
             ("zero_grad", lambda: optimizer.zero_grad(set_to_none=True))]
    if device.type != "cuda":  # no allocator counter on a CPU: the profiler's allocation events stand in
        return cpu_memory_by_phase(steps)
    rows = []
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


def forward_backward(model: nn.Module, data: torch.Tensor, target: torch.Tensor) -> None:
    F.cross_entropy(model(data), target).backward()


# --- 2. gradient checkpointing --------------------------------------------------------------------

def peak_above_start(model: nn.Module, data: torch.Tensor, target: torch.Tensor, device: torch.device) -> int:
    """Most memory allocated at any moment of one forward+backward, above what was allocated before it."""
    if device.type != "cuda":
        return cpu_peak_bytes(lambda: forward_backward(model, data, target))
    synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    forward_backward(model, data, target)
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - start


def checkpointing_comparison(model: DeepNet, data: torch.Tensor, target: torch.Tensor, device: torch.device,
                             repeats: int) -> dict[str, Any]:
    """Peak memory, saved bytes and time of forward+backward, without and with checkpointing.

    Each variant runs once, unmeasured, before its peak is taken: its first pass allocates what is
    allocated once per process (on a GPU, checkpointing's recompute runs on autograd's own thread,
    whose first matmul allocates a cuBLAS workspace of its own, a MiB that is not an activation).
    """
    results: dict[str, Any] = {}
    model.train()
    for label, enabled in (("plain", False), ("checkpointed", True)):
        model.checkpoint_blocks = enabled
        forward_backward(model, data, target)  # the warm-up; gradients now exist: the peak is activations only
        model.zero_grad(set_to_none=False)
        results[f"{label}_peak_bytes"] = peak_above_start(model, data, target, device)
        model.zero_grad(set_to_none=False)
        results[f"{label}_saved_bytes"] = saved_for_backward_bytes(model, data, target)

    def one_pass(enabled: bool) -> None:
        model.checkpoint_blocks = enabled
        model.zero_grad(set_to_none=False)
        forward_backward(model, data, target)

    timed = time_alternately(one_pass, device, repeats)  # each block's forward runs twice: what does it cost?
    model.checkpoint_blocks = False
    results["peak_saving"] = 1 - results["checkpointed_peak_bytes"] / results["plain_peak_bytes"]
    return {**results, **timed}


# --- 3. gradient accumulation ---------------------------------------------------------------------

def gradients(model: nn.Module, pieces: Sequence[tuple[torch.Tensor, torch.Tensor, float]]) -> list[torch.Tensor]:
    """Sum of ``weight * loss(piece)`` gradients over the pieces, as a list of tensors."""
    model.zero_grad(set_to_none=True)
    for data, target, weight in pieces:
        (F.cross_entropy(model(data), target) * weight).backward()  # .backward() adds into .grad
    return [p.grad.detach().clone() for p in model.parameters()]


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
    return add_memory_args(script_parser(__doc__))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_memory_args(build_parser(), argv)  # --dry-run: the smallest sizes
    seed_everything(args.seed)
    threads = configure_threads()
    device = resolve_device(args.device)
    model = DeepNet(args.width, args.depth).to(device)
    data = torch.randn(args.batch_size, args.width, device=device)
    target = torch.randint(0, 10, (args.batch_size,), device=device)
    where = print_header(args, device, model, threads)  # says where the memory figures come from

    meter = EnergyMeter(device).start()  # over the three measurements
    # 1. forward, backward, step, after one unmeasured pass with its gradients dropped: on a GPU the first matmul
    # allocates cuBLAS's workspace through the caching allocator, and measured it would look like activations
    forward_backward(model, data, target)
    model.zero_grad(set_to_none=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    phases = memory_by_phase(model, optimizer, data, target, device)
    print_phases(phases, device)

    # 2. gradient checkpointing
    ckpt = checkpointing_comparison(model, data, target, device, args.repeats)
    print_checkpointing(ckpt)

    # 3. gradient accumulation: part 1's batch cut to k equal micro-batches, then a batch one to k-1 samples larger
    width, k = min(args.width, 128), args.accumulation_steps
    accumulation_model = DeepNet(width, min(args.depth, 4)).to(device)
    even_size = args.batch_size - args.batch_size % k
    even = accumulation_check(accumulation_model, data[:even_size, :width], target[:even_size], k)
    uneven_size = even_size + min(k // 2 + 1, k - 1)  # micro-batch sizes then differ by one
    uneven = accumulation_check(accumulation_model, torch.randn(uneven_size, width, device=device),
                                torch.randint(0, 10, (uneven_size,), device=device), k)
    print_accumulation(even, uneven, k)

    energy = meter.stop().result()
    # The caching allocator's own report: live and cached memory, allocation counts, fragmentation.
    if device.type == "cuda":
        print("\ntorch.cuda.memory_summary(abbreviated=True), the caching allocator's own report:")
        print(torch.cuda.memory_summary(device, abbreviated=True))
    else:
        print("\ntorch.cuda.memory_summary() prints the CUDA caching allocator's report (live and cached "
              "memory, allocation counts); a CPU has no such allocator, so a CPU run has none to show")
    path = write_memory_record(args, device, threads, where, phases, ckpt, even, uneven, peak_memory(device), energy)
    print(f"\nrecord: {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
