#!/usr/bin/env python3
"""Benchmark Lab-02's data pipelines against each other and against pure compute, in one process.

Usage:
    python bench/data_pipeline.py                                  # digits, batch 64, 5 rounds
    python bench/data_pipeline.py --threads 1 --rounds 7              # on a busy shared machine
    python bench/data_pipeline.py --dataset synthetic --synthetic-size 60000 --device cuda
    sbatch --gres=gpu:1 --cpus-per-task=2 --wrap "python bench/data_pipeline.py --dataset mnist --data-dir ~/data"
    (one process, one device: there is no torchrun form)

Three ways to train the same MnistNet for one epoch, on the same machine, with the same batch size,
precision and memory layout, so only the data side differs:

  (a) the USC lab's pipeline: per-sample PIL -> ToTensor -> Normalize through a DataLoader with 1 worker
      (started afresh every epoch, as the USC lab's loader is);
  (b) this lab's best pipeline: the data set resident on the device, each batch sliced there
      (``--pipeline device`` of mnist_classify.py);
  (c) pure compute: the epoch's batches already built and in place on the device; only the
      training steps run.

It prints the ratios of throughput b/a (what the pipeline buys) and b/c (how close the best pipeline
gets to the model's own speed; 1.0 means loading costs nothing). Each round runs a, b and c once, one
epoch each, back to back, starting with a different one each round so no variant always goes first;
the first round is a warm-up and is dropped. Two estimates are printed: the ratio of the median
throughputs, and the median over rounds of the ratio within a round. On a quiet machine they agree;
on a shared one the second is the one to trust, because the three epochs of a round see nearly the
same machine while separate rounds do not. The 1-minute load average is printed and recorded with
them. One record per variant is written to ``--results-dir``.

On a machine shared with other jobs, PyTorch's default of one thread per core is fragile: every
operator waits for its slowest thread, and a thread that loses its core to someone else stalls the
step, so epoch times jump by several times from one round to the next. ``--threads 1`` keeps the
comparison stable (and leaves a core for the USC lab's worker process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from common.train import amp
from common.data import pipelines
from common.cli import add_common_args, add_dataset_args, add_precision_arg, config_dict, positive_int, script_parser
from common.runtime.device import configure_threads, describe, resolve_device, seed_everything, synchronize
from common.measure.energy import EnergyMeter
from common.errors import UserError, run_main
from common.models import MnistNet
from common.results import make_record, provenance, write_record

SCRIPT = "bench/data_pipeline.py"
VARIANTS = {
    "a": ("bench-a-seed-pipeline", "per-sample PIL + ToTensor/Normalize, DataLoader with 1 worker"),
    "b": ("bench-b-best-pipeline", "data set resident on the device, batches sliced there"),
    "c": ("bench-c-compute-only", "batches already in place on the device: training steps only"),
}


def train_epoch(model, optimizer, batches: Iterable, device, args) -> int:
    """One epoch of ordinary training steps; returns the samples seen. Identical for a, b and c."""
    model.train()
    seen = 0
    for step, (data, target) in enumerate(batches):
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        if args.channels_last:
            data = data.contiguous(memory_format=torch.channels_last)
        optimizer.zero_grad(set_to_none=True)
        with amp.autocast(device, args.precision):
            loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        seen += len(data)
        if args.max_steps is not None and step + 1 >= args.max_steps:
            break
    return seen


def timed(fn: Callable[[], int], device) -> tuple[float, int]:
    synchronize(device)
    start = time.perf_counter()
    seen = fn()
    synchronize(device)
    return time.perf_counter() - start, seen


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_dataset_args(parser)
    parser.add_argument("--rounds", type=positive_int, default=5,
                        help="rounds of a, b, c (one epoch each); the first is a warm-up (default: %(default)s)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="intra-op threads for all three; 1 leaves the other cores to the worker and to other "
                             "users of a shared machine (default: SLURM_CPUS_PER_TASK, else PyTorch's)")
    parser.add_argument("--channels-last", action="store_true", help="NHWC layout for all three (default: off)")
    add_precision_arg(parser, "--amp", help="precision of all three: fp32, bf16, fp16 (GPU) (default: %(default)s)")
    # one epoch per variant and round; (a) is the USC lab's loader with its 1 worker: no --epochs, no --num-workers
    add_common_args(parser, epochs=None, batch_size=64, results_dir="results", workers=False,
                    dry_run="two rounds (the first a warm-up) of two steps per variant: checks that everything runs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 2:
        raise UserError("--rounds must be at least 2: the first round is a warm-up and is not counted")
    if args.dry_run:
        args.rounds, args.max_steps = 2, min(args.max_steps or 2, 2)
    seed_everything(args.seed)
    threads = configure_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        threads = args.threads
    device = resolve_device(args.device)
    args.precision = amp.check_precision(args.precision, device)
    train_data, _ = pipelines.load_uint8(args.dataset, args.data_dir, seed=args.seed,
                                         synthetic_size=args.synthetic_size)

    # (a) the USC lab's loader: 1 worker, restarted every epoch, pinned only where there is a GPU
    usc_loader = pipelines.make_loader("pil", train_data, args.batch_size, shuffle=True, device=device,
                                        num_workers=1, pin_memory=device.type == "cuda", seed=args.seed)
    # (b) the lab's best
    device_batches = pipelines.make_loader("device", train_data, args.batch_size, shuffle=True, device=device,
                                           seed=args.seed, channels_last=args.channels_last)
    # (c) the same epoch's batches, built once and left in place
    ready_batches = [(data.clone(), target.clone()) for data, target in device_batches]

    model = MnistNet().to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    sources = {"a": usc_loader, "b": device_batches, "c": ready_batches}
    load_start = os.getloadavg()[0]
    print(f"device {describe(device)} | data {args.dataset} train={len(train_data)} | batch {args.batch_size} | "
          f"precision {args.precision} | threads {threads} | {args.rounds} rounds (first dropped) | "
          f"load average {load_start:.2f} on {os.cpu_count()} CPUs", flush=True)

    keys = list(VARIANTS)
    times: dict[str, list[float]] = {key: [] for key in keys}
    samples: dict[str, int] = {}
    meters = {key: EnergyMeter(device) for key in keys}  # each adds up its own variant's epochs
    for round_index in range(args.rounds):
        order = keys[round_index % 3:] + keys[:round_index % 3]  # a b c, b c a, c a b, ...
        for key in order:
            with meters[key]:
                elapsed, seen = timed(lambda: train_epoch(model, optimizer, sources[key], device, args), device)
            samples[key] = seen
            if round_index > 0:
                times[key].append(elapsed)
            print(f"round {round_index + 1}{' (warm-up)' if round_index == 0 else ''} {key}: {elapsed:.3f} s "
                  f"({seen / elapsed:.0f} samples/s)", flush=True)
    load_end = os.getloadavg()[0]

    rate = {key: samples[key] / statistics.median(times[key]) for key in keys}
    ratios = {}
    for pair, other in (("b/a", "a"), ("b/c", "c")):
        within = [(samples["b"] / time_b) / (samples[other] / time_other)  # throughput ratio in one round
                  for time_b, time_other in zip(times["b"], times[other])]
        ratios[pair] = {"median_within_round": statistics.median(within), "per_round": within,
                        "of_medians": rate["b"] / rate[other]}
    print("\nvariant                         median epoch   samples/s   spread (min - max s)")
    for key, (name, what) in VARIANTS.items():
        print(f"({key}) {name:<27} {statistics.median(times[key]):10.3f} s {rate[key]:11.0f}   "
              f"{min(times[key]):.3f} - {max(times[key]):.3f}   {what}")
    for pair, meaning in (("b/a", "the best pipeline over the USC lab's"),
                          ("b/c", "the best pipeline over pure compute; 1.0 = loading is free")):
        values = ", ".join(f"{value:.3f}" for value in ratios[pair]["per_round"])
        print(f"\n{pair} = {ratios[pair]['median_within_round']:.3f}  ({meaning})\n"
              f"      median of the within-round ratios [{values}]; "
              f"ratio of the medians {ratios[pair]['of_medians']:.3f}")
    print(f"load average (1 min): {load_start:.2f} at the start, {load_end:.2f} at the end, {os.cpu_count()} CPUs")

    bench_id = uuid.uuid4().hex[:8]
    method_text = ("time.perf_counter around each epoch, device synchronised before each read; rounds of a, b, c "
                   "back to back in rotating order, first round dropped; ratios: median over rounds of the "
                   "within-round ratio")
    for key, (name, what) in VARIANTS.items():
        metrics = {
            "epoch_time_s": times[key], "time_per_epoch_s": statistics.median(times[key]),
            "samples_per_s": rate[key], "samples_per_epoch": samples[key], "global_batch_size": args.batch_size,
            "world_size": 1, "b_over_a": ratios["b/a"]["median_within_round"],
            "b_over_c": ratios["b/c"]["median_within_round"], "ratios": ratios, "load_average_start": load_start,
            "load_average_end": load_end, "timing_method": method_text,
        }
        config = config_dict(args, resolved_device=str(device), model="mnist_cnn", threads=threads,
                             bench={"bench_id": bench_id, "variant": key, "what": what})
        energy = meters[key].result(samples=samples[key] * args.rounds)
        record = make_record(lab="lab02", script=SCRIPT, method=name, config=config, metrics=metrics,
                             provenance=provenance(device), energy=energy)
        print(f"record: {write_record(record, args.results_dir)}")
    return 0


if __name__ == "__main__":
    run_main(main)
