#!/usr/bin/env python3
"""Time the same training steps on the CPU and on the GPU and print the speed-up.

Usage:
    python benchmark_cpu_vs_gpu.py                               # CPU, then the GPU when one is visible
    python benchmark_cpu_vs_gpu.py --model resnet18 --image-size 64 --repeats 30
    sbatch --gres=gpu:1 --cpus-per-task=8 --wrap "python benchmark_cpu_vs_gpu.py"
    (one process: there is no torchrun form)

What it teaches: a fair speed comparison. It is the chapter's ``benchmark_training`` with the
pitfalls removed: both devices run the same model from the same initial weights on the same
batches; warm-up steps are run and dropped (the first steps pay for cuDNN autotuning and the
allocator); the GPU is synchronised before every clock read, or the clock would stop while kernels
are still queued (the Chapter 16 notes call ``torch.cuda.synchronize()`` unconditionally, which fails on a
machine without a GPU); every step is timed, and the median and spread are printed, not one mean;
gradients are zeroed in the warm-up too.

``--device auto`` (the default) times the CPU and, when a GPU is visible, the GPU. On a CPU-only
machine there is nothing to compare: the script says so, keeps the CPU timing and exits 0.
``--device cpu`` times the CPU only; ``--device cuda`` insists on a GPU (an error without one).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from common.cli import add_common_args, add_timing_args, apply_dry_run, config_dict, script_parser
from common.runtime.device import configure_threads, describe, device_type, resolve_device, seed_everything
from common.measure.energy import EnergyMeter
from common.errors import run_main
from common.models import add_image_model_args, build_model, check_image_input, input_shape, logits
from common.results import make_record, provenance, write_record
from common.measure.timing import Heartbeat, StepTimer

SCRIPT = "chapters/ch16_gpu_distributed/benchmark_cpu_vs_gpu.py"


def benchmark_training(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                       device: torch.device, iterations: int, warmup: int) -> dict[str, Any]:
    """Train ``model`` on ``device`` for ``warmup + iterations`` steps; return the timing summary."""
    model = model.to(device)
    model.train()
    optimizer = torch.optim.Adam(model.parameters())
    timer = StepTimer(device, warmup_steps=warmup)
    heartbeat = Heartbeat(f"{device.type} steps", warmup + iterations)  # a line every 10 s on a slow device
    for step in range(warmup + iterations):
        data, target = batches[step % len(batches)]
        with timer.step(samples=len(data)):
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(logits(model(data)), target)  # googlenet, inception_v3: auxiliary outputs too
            loss.backward()
            optimizer.step()
        heartbeat(step + 1)
    summary = timer.summary()
    summary["iterations_per_s"] = 1 / summary["median_s"]
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_image_model_args(parser, model="mnist_cnn", image_size=32)
    add_timing_args(parser, warmup=10, repeats=100, what="training steps per device", former=("--iterations",))
    add_common_args(parser, batch_size=64, epochs_and_steps=False, data=False)  # random inputs, --repeats steps
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv), repeats=2, warmup=1)
    seed_everything(args.seed)
    threads = configure_threads()
    # The GPU side when --device asks for one (auto: when there is one); --device cuda without one: a clear error.
    gpu = resolve_device(args.device) if device_type(args.device) == "cuda" else None
    channels, size = input_shape(args.model, args.image_size)
    check_image_input(args.model, args.batch_size, channels, size)  # a size the model cannot take: one line, now
    reference = build_model(args.model, num_classes=10, in_channels=channels)
    generator = torch.Generator().manual_seed(args.seed)
    batches = [(torch.randn(args.batch_size, channels, size, size, generator=generator),
                torch.randint(0, 10, (args.batch_size,), generator=generator)) for _ in range(4)]
    print(f"model {args.model} | batch {args.batch_size}x{channels}x{size}x{size} | {args.warmup} warm-up + "
          f"{args.repeats} timed steps per device", flush=True)

    devices = [torch.device("cpu")] + ([gpu] if gpu is not None else [])
    results: dict[str, dict[str, Any]] = {}
    energy: dict[str, dict[str, Any]] = {}
    for device in devices:
        with EnergyMeter(device) as meter:
            summary = benchmark_training(copy.deepcopy(reference), batches, device, args.repeats, args.warmup)
        energy[device.type] = meter.result(samples=(args.warmup + args.repeats) * args.batch_size)
        results[device.type] = summary
        print(f"{describe(device):<40} median step {1000 * summary['median_s']:8.2f} ms "
              f"(p10 {1000 * summary['p10_s']:.2f}, p90 {1000 * summary['p90_s']:.2f}) | "
              f"{summary['iterations_per_s']:8.2f} iter/s | {summary['samples_per_s']:9.0f} samples/s", flush=True)

    speedup = None
    if "cpu" in results and "cuda" in results:
        speedup = results["cuda"]["samples_per_s"] / results["cpu"]["samples_per_s"]
        print(f"speed-up of the GPU over the CPU: {speedup:.2f}x")
    elif args.device == "cpu":  # asked for the CPU only: a GPU may well be visible
        print("--device cpu: the CPU only, nothing to compare it with (--device auto adds the GPU when one is visible)")
    else:
        print("no CUDA GPU visible: nothing to compare the CPU with (run this on a GPU node for the speed-up)")

    for device in devices:
        summary = results[device.type]
        metrics = {"step_time": summary, "samples_per_s": summary["samples_per_s"],
                   "global_batch_size": args.batch_size, "world_size": 1, "gpu_over_cpu_speedup": speedup}
        record = make_record(lab="ch16", script=SCRIPT, method=f"train-{device.type}",
                             config=config_dict(args, resolved_device=str(device), threads=threads),
                             metrics=metrics, provenance=provenance(device), energy=energy[device.type])
        print(f"record: {write_record(record, args.results_dir)}")
    return 0


if __name__ == "__main__":
    run_main(main)
