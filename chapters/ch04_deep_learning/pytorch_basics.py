#!/usr/bin/env python3
"""PyTorch basics on CPU or GPU: tensors, moving them between devices, and how fast a matmul runs.

Usage:
    python pytorch_basics.py                                  # auto: the GPU when there is one
    python pytorch_basics.py --device cpu --size 512          # a quick run on a laptop
    python pytorch_basics.py --precision fp32,tf32,bf16,fp16     # a GPU's precisions side by side
    srun --gres=gpu:1 python pytorch_basics.py                # inside a Slurm allocation
    sbatch sbatch/single_gpu.sbatch                           # the chapter's GPU job
    (one process on one device: no torchrun form; multi_gpu_ddp.py is the torchrun lesson)

What it teaches: a tensor lives on one device and work runs where its tensors are; ``.to(device)``
copies (pinned host memory makes that copy faster and lets it overlap with compute); GPU work is
asynchronous, so a timing must synchronise before reading the clock. The matmul timing prints the
achieved TFLOP/s (``2 n^3 / t``) per precision next to the device's peak from NVIDIA's data sheets,
and writes a result record (``--results-dir``).

Reading the table: fp32 on a GPU uses the ordinary CUDA cores unless TF32 is switched on (``tf32``
row: tensor cores, fp32 range, 10-bit mantissa); bf16 and fp16 use the tensor cores. CPUs have no
entry in the peak table (their peak depends on the model, core count and clock), so they print
"unknown". A CPU without native bf16 instructions (most x86 before Sapphire Rapids / Zen 4)
emulates bf16, which is much *slower* than fp32 there.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from common.cli import (add_former_names, add_timing_args, config_dict, output_dir, positive_int, script_parser,
                        seed_int)
from common.runtime.device import configure_threads, describe, resolve_device, seed_everything
from common.measure.energy import EnergyMeter
from common.errors import UserError, run_main
from common.precision import gpu_peaks, gpu_support
from common.results import make_record, provenance, write_record
from common.measure.timing import time_function
from chapters.ch04_deep_learning.ch04_shared import precision_list

SCRIPT = "chapters/ch04_deep_learning/pytorch_basics.py"
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "tf32": torch.float32,
          "bf16": torch.bfloat16, "fp16": torch.float16}
# Big enough to keep a GPU's tensor cores busy; small enough that a CPU emulating bf16 (tens of
# times slower than its fp32) still finishes in seconds.
DEFAULT_SIZE = {"cuda": 8192, "cpu": 512}


def peak_for(device_name: str) -> tuple[str | None, dict[str, float]]:
    """The datasheet peaks of a GPU (``common.precision``, where every lab reads them): a label and
    ``{precision: dense TFLOP/s}``; ``(None, {})`` for CPUs and GPUs the table does not know."""
    gpu, peaks = gpu_peaks(device_name)
    return (f"NVIDIA {gpu} (data sheet, dense)", peaks) if gpu else (None, {})


def default_dtypes(device: torch.device) -> list[str]:
    """The precisions worth comparing on ``device``: those it runs natively."""
    if device.type == "cuda":
        native_bf16 = gpu_support("bf16", torch.cuda.get_device_capability(device)) == "native"  # from Ampere
        return ["fp32", "tf32", "bf16", "fp16"] if native_bf16 else ["fp32", "fp16"]
    return ["fp32", "bf16"]


@contextmanager
def matmul_precision(dtype_name: str) -> Iterator[None]:
    """Switch TF32 on for the ``tf32`` row only; fp32 means true fp32 (PyTorch's default on CUDA)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dtype_name == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def tensor_tour(device: torch.device) -> None:
    """A short tour of tensors and device moves, printed step by step."""
    print("== tensors")
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)  # created on the CPU
    print(f"x = torch.arange(6).reshape(2, 3): shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}")
    print(f"x * 2 + 1 -> {(x * 2 + 1).tolist()}   (element-wise, a new tensor)")
    print(f"x.sum(dim=0) -> {x.sum(dim=0).tolist()}   x.mean() -> {x.mean().item():.2f}   (.item(): a Python number)")
    print(f"x @ x.T -> {(x @ x.T).tolist()}   (matrix product, 2x3 @ 3x2)")
    print(f"x + torch.tensor([10., 20., 30.]) -> {(x + torch.tensor([10.0, 20.0, 30.0])).tolist()}   (broadcasting)")
    print(f"x.view(3, 2) shares x's memory: {x.view(3, 2).data_ptr() == x.data_ptr()}; "
          f"x.T.contiguous() is a copy: {x.T.contiguous().data_ptr() != x.data_ptr()}")
    print(f"x.to(torch.bfloat16) -> {x.to(torch.bfloat16).dtype}: half the bytes, fp32's range, 8 bits of precision")

    print(f"== device moves ({describe(device)})")
    y = x.to(device)  # a copy on the device (or x itself when it is already there)
    print(f"y = x.to(device): y.device = {y.device}; operations on y run on {y.device.type}")
    z = (y @ y.T).cpu()  # .cpu() waits for the GPU: the result must exist before it is copied back
    print(f"(y @ y.T).cpu(): back on {z.device} for printing/NumPy: {z.tolist()}")
    if device.type == "cuda":
        copy_bandwidth(device)
    else:
        print("pinned memory: only matters with a GPU. DataLoader(pin_memory=True) puts batches in page-locked "
              "host memory so .to('cuda', non_blocking=True) copies by DMA and can overlap with compute.")


def copy_bandwidth(device: torch.device, megabytes: int = 256) -> dict[str, float]:
    """Host-to-GPU copy speed from pageable and from pinned (page-locked) memory, in GB/s."""
    pageable = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32)
    pinned = pageable.pin_memory()
    result = {}
    for name, host in (("pageable", pageable), ("pinned", pinned)):
        timing = time_function(lambda: host.to(device, non_blocking=True), device, repeats=5)
        result[name] = host.numel() * 4 / timing["median_s"] / 1e9
    print(f"host -> {device} copy of {megabytes} MiB: pageable {result['pageable']:.1f} GB/s, "
          f"pinned {result['pinned']:.1f} GB/s (pinned memory is what DataLoader(pin_memory=True) gives you)")
    return result


def time_matmul(device: torch.device, dtype_name: str, n: int, repeats: int, warmup: int) -> dict[str, Any]:
    """Median time of an ``n x n`` matmul in one precision, its TFLOP/s, and its error against fp64."""
    dtype = DTYPES[dtype_name]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    with matmul_precision(dtype_name):
        timing = time_function(lambda: a @ b, device, repeats=repeats, warmup=warmup)
        corner = (a[:64] @ b[:, :64]).double()  # the same product on a corner, to measure rounding error
    exact = a[:64].double() @ b[:, :64].double()
    rel_error = ((corner - exact).norm() / exact.norm()).item()
    flops = 2 * n**3  # n^2 outputs, each n multiplies and n adds
    return {
        "dtype": dtype_name, "size": n, "flops": flops,
        "median_s": timing["median_s"], "min_s": timing["min_s"],
        "tflops": flops / timing["median_s"] / 1e12,
        "tflops_best": flops / timing["min_s"] / 1e12,
        "rel_error_vs_fp64": rel_error,
        "timing": timing,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("--size", type=positive_int, default=None,
                        help="matrix size n of the n x n matmul (default: 8192 on a GPU, 512 on CPU)")
    add_timing_args(parser, warmup=2, repeats=10, what="matmuls per precision")
    add_former_names(parser, parser.add_argument("--precision", type=precision_list(DTYPES), default=["auto"],
                        help=f"comma-separated precisions from {', '.join(DTYPES)}; auto = fp32,tf32,bf16,fp16 on "
                             "an Ampere-or-newer GPU, fp32,fp16 on older GPUs, fp32,bf16 on CPU "
                             "(default: auto)"), "--dtypes")
    parser.add_argument("--skip-tour", action="store_true", help="only run the matmul timing (default: off)")
    # The shared flags that apply here (common.cli.add_common_args would add training flags too).
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to run: auto picks cuda when a GPU is visible (default: %(default)s)")
    parser.add_argument("--seed", type=seed_int, default=1, help="random seed (default: %(default)s)")
    parser.add_argument("--results-dir", type=output_dir, default="results",
                        help="folder where the result record is written (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    seed_everything(args.seed)
    threads = configure_threads()
    device = resolve_device(args.device)
    dtypes = default_dtypes(device) if args.precision == ["auto"] else args.precision
    if "tf32" in dtypes and device.type != "cuda":
        raise UserError("tf32 is a mode of NVIDIA tensor cores; on CPU use --precision fp32,bf16")
    size = args.size or DEFAULT_SIZE[device.type]

    if not args.skip_tour:
        tensor_tour(device)

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else describe(device)
    peak_label, peaks = peak_for(device_name) if device.type == "cuda" else (None, {})
    print(f"== matmul {size} x {size} on {describe(device)}, {threads} CPU thread(s), "
          f"median of {args.repeats} after {args.warmup} warm-up")
    print(f"peak figures: {peak_label or 'unknown for this device'}")
    print(f"{'dtype':<6} {'median ms':>10} {'TFLOP/s':>9} {'best':>9} {'peak':>8} {'% peak':>7} {'rel. error':>11}")
    rows = []
    meter = EnergyMeter(device).start()  # over the timed matmuls
    for name in dtypes:
        row = time_matmul(device, name, size, args.repeats, args.warmup)
        row["peak_tflops"] = peaks.get(name)
        row["mfu"] = row["tflops"] / row["peak_tflops"] if row["peak_tflops"] else None
        rows.append(row)
        peak = f"{row['peak_tflops']:.1f}" if row["peak_tflops"] else "unknown"
        share = f"{100 * row['mfu']:.0f}%" if row["mfu"] else "-"
        print(f"{name:<6} {1000 * row['median_s']:>10.3f} {row['tflops']:>9.4g} {row['tflops_best']:>9.4g} "
              f"{peak:>8} {share:>7} {row['rel_error_vs_fp64']:>11.1e}", flush=True)
    energy = meter.stop().result()
    print("TFLOP/s = 2 n^3 / median time; 'best' uses the fastest repeat; rel. error = |C - C_fp64| / |C_fp64| "
          "on a 64 x 64 corner")

    record = make_record(
        lab="ch04", script=SCRIPT, method="matmul",
        config=config_dict(args, precision=dtypes, size=size, resolved_device=str(device)),
        metrics={"matmul": rows, "peak_source": peak_label, "threads": threads},
        provenance=provenance(device), energy=energy,
        notes=[f"peak TFLOP/s from {peak_label}" if peak_label else "no peak figure known for this device"],
    )
    print(f"record: {write_record(record, args.results_dir)}")
    return 0


if __name__ == "__main__":
    run_main(main)
