#!/usr/bin/env python3
"""The chapter's "performance optimisation" settings, each measured: threads, cudnn.benchmark, loader options.

Usage:
    python efficient_loading.py                          # GPU when visible, else CPU
    python efficient_loading.py --device cpu --repeats 5
    sbatch --gres=gpu:1 --cpus-per-task=8 --wrap "python efficient_loading.py"
    (one process, one device: there is no torchrun form)

What it teaches: the Chapter 16 notes set ``torch.set_num_threads(8)``, ``cudnn.benchmark = True`` and five
DataLoader options in one block. Here each is measured on its own:

1. ``torch.set_num_threads(n)``: CPU training-step time for n = 1 .. the CPUs of this task. On a
   cluster use the allocation (``SLURM_CPUS_PER_TASK``, what ``common.runtime.device.configure_threads``
   does), never a number typed in: 8 threads on a 4-CPU allocation run slower than 4.
2. ``torch.backends.cudnn.benchmark``: on a GPU, the first step with it on tries several convolution
   algorithms (slow), later steps use the fastest. Only for fixed input shapes. Skipped on a CPU,
   where there is no cuDNN. One untimed step runs first: the first convolution of a process also
   creates cuDNN's and cuBLAS's handles and workspaces, and without the warm-up that cost would land
   on whichever setting is timed first ("off"), making "on" look better than it is.
3. DataLoader options on the USC lab's per-sample PIL pipeline (Lab-02's, in ``common/data/pipelines.py``):
   how fast one epoch of batches arrives with 0, 1 and more workers, and with ``persistent_workers``
   in the second epoch. ``pin_memory`` only matters with a GPU. Lab-02's ``sweep.py`` measures the same
   options inside real training, together with the pipelines that make most of them unnecessary.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F

from common.data import pipelines
from common.cli import add_common_args, add_former_names, apply_dry_run, config_dict, positive_int, script_parser
from common.runtime.device import configure_threads, describe, resolve_device, seed_everything
from common.measure.energy import EnergyMeter
from common.errors import FlagError, run_main
from common.models import MnistNet
from common.results import make_record, provenance, write_record
from common.measure.timing import time_function

SCRIPT = "chapters/ch16_gpu_distributed/efficient_loading.py"


def training_step(model: torch.nn.Module, data: torch.Tensor, target: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    F.nll_loss(model(data), target).backward()


def training_step_ce(model: torch.nn.Module, data: torch.Tensor, target: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(data), target).backward()


def thread_scaling(batch_size: int, steps: int, max_threads: int) -> list[dict[str, Any]]:
    """Median CPU step time of MnistNet for 1 .. ``max_threads`` intra-op threads."""
    cpu = torch.device("cpu")
    model = MnistNet()
    data, target = torch.randn(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))
    before = torch.get_num_threads()
    counts = sorted({1, *range(2, max_threads + 1, 2), max_threads})
    rows = []
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            timing = time_function(lambda: training_step(model, data, target), cpu, repeats=steps, warmup=1)
            rows.append({"threads": threads, "median_s": timing["median_s"], "method": timing["method"]})
    finally:
        torch.set_num_threads(before)
    return rows


def cudnn_benchmark(device: torch.device, batch_size: int, steps: int) -> list[dict[str, Any]]:
    """First-step and median step time of a small convnet with cudnn.benchmark off and on."""
    from common.models import build_model

    rows = []
    data = torch.randn(batch_size, 3, 64, 64, device=device)
    target = torch.randint(0, 10, (batch_size,), device=device)
    # Warm-up, untimed and with benchmark off (no algorithm search is cached): the process's first
    # convolution creates the cuDNN/cuBLAS handles and workspaces, a cost neither setting should carry.
    torch.backends.cudnn.benchmark = False
    training_step_ce(build_model("resnet18", num_classes=10).to(device), data, target)
    torch.cuda.synchronize(device)
    for enabled in (False, True):
        torch.backends.cudnn.benchmark = enabled
        model = build_model("resnet18", num_classes=10).to(device)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        training_step_ce(model, data, target)
        torch.cuda.synchronize(device)
        first = time.perf_counter() - start
        timing = time_function(lambda: training_step_ce(model, data, target), device, repeats=steps, warmup=1)
        rows.append({"cudnn_benchmark": enabled, "first_step_s": first, "median_s": timing["median_s"]})
    torch.backends.cudnn.benchmark = False
    return rows


def loader_options(train: pipelines.Uint8Images, device: torch.device, batch_size: int,
                   max_workers: int) -> Iterator[dict[str, Any]]:
    """Seconds to draw every batch of ``train``, twice (two epochs), with several loader settings: a row per setting,
    each as soon as it is measured."""
    settings = [{"num_workers": 0}, {"num_workers": 1}]
    if max_workers > 1:
        settings.append({"num_workers": max_workers})
    if max_workers >= 1:
        settings.append({"num_workers": max_workers, "persistent_workers": True, "prefetch_factor": 4})
    if device.type == "cuda" and max_workers >= 1:
        settings.append({"num_workers": max_workers, "persistent_workers": True, "prefetch_factor": 4,
                         "pin_memory": True})
    for options in settings:
        loader = pipelines.make_loader("pil", train, batch_size, shuffle=True, device=device, **options)
        epochs = []
        for _ in range(2):
            start = time.perf_counter()
            for data, _target in loader:
                data.to(device, non_blocking=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            epochs.append(time.perf_counter() - start)
        del loader  # persistent workers end with their loader
        yield {**options, "epoch1_s": epochs[0], "epoch2_s": epochs[1], "samples_per_s_epoch2": len(train) / epochs[1]}


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_former_names(parser, parser.add_argument("--repeats", type=positive_int, default=10,
                                                 help="timed steps per setting (default: %(default)s)"), "--steps")
    add_common_args(parser, batch_size=64, epochs_and_steps=False, data_dir=None)  # --repeats steps; digits ships
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv), repeats=1)
    train, _ = pipelines.load_uint8("digits", ".")  # bundled: no folder is read
    if args.batch_size > len(train):  # parts 1 and 2 make batches of it too: 100000 took tens of GiB in part 1
        raise FlagError(f"--batch-size {args.batch_size} is larger than the digits training set that part 3 loads "
                        f"({len(train)} samples); every part takes the same batch: give at most {len(train)}")
    seed_everything(args.seed)
    threads = configure_threads()  # SLURM_CPUS_PER_TASK when set, else PyTorch's default
    device = resolve_device(args.device)
    print(f"device {describe(device)} | {os.cpu_count()} CPUs visible | intra-op threads {threads}", flush=True)

    meter = EnergyMeter(device).start()  # over all three measurements
    print("\n1. torch.set_num_threads: MnistNet training step on the CPU")
    scaling = thread_scaling(args.batch_size, args.repeats, max(threads, 1))
    for row in scaling:
        print(f"  {row['threads']:3d} thread(s): {1000 * row['median_s']:8.1f} ms per step (median of {args.repeats})")

    print("\n2. torch.backends.cudnn.benchmark")
    cudnn = []
    if device.type == "cuda":
        cudnn = cudnn_benchmark(device, args.batch_size, args.repeats)
        for row in cudnn:
            print(f"  benchmark={str(row['cudnn_benchmark']):5}: first step {1000 * row['first_step_s']:8.1f} ms, "
                  f"then {1000 * row['median_s']:.2f} ms per step")
    else:
        print("  skipped: cuDNN is NVIDIA's GPU library; a CPU run has nothing to tune")

    print(f"\n3. DataLoader options, the USC lab's per-sample PIL pipeline on digits (batch {args.batch_size})",
          flush=True)
    loading = []
    for row in loader_options(train, device, args.batch_size, args.num_workers):  # a line per setting as it is measured
        loading.append(row)
        options = ", ".join(f"{key}={value}" for key, value in row.items() if not key.startswith(("epoch", "samples")))
        print(f"  {options:<75} epoch 1 {row['epoch1_s']:6.2f} s, epoch 2 {row['epoch2_s']:6.2f} s "
              f"({row['samples_per_s_epoch2']:,.0f} samples/s in epoch 2)", flush=True)
    if any(row.get("persistent_workers") for row in loading):
        print("  (workers start again every epoch unless persistent_workers=True: compare the epoch-2 column)")
    else:  # --num-workers 0: the rows stop at one worker
        print("  (no persistent_workers row: it needs workers of its own; give --num-workers 2 or more)")
    energy = meter.stop().result()

    metrics = {"thread_scaling": scaling, "cudnn_benchmark": cudnn, "loader_options": loading, "world_size": 1}
    record = make_record(lab="ch16", script=SCRIPT, method="efficient-loading",
                         config=config_dict(args, resolved_device=str(device), threads=threads),
                         metrics=metrics, provenance=provenance(device), energy=energy)
    print(f"\nrecord: {write_record(record, args.results_dir)}")
    return 0


if __name__ == "__main__":
    run_main(main)
