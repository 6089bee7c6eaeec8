#!/usr/bin/env python3
"""Lab-05 step 3: how much of DDP's communication hides behind the backward pass, for a few bucket sizes.

Usage:
    torchrun --standalone --nproc_per_node=4 labs/lab05_scaling/03_overlap.py --model resnet50 --batch-size 64
    torchrun --standalone --nproc_per_node=2 labs/lab05_scaling/03_overlap.py --device cpu --model resnet18 \\
        --batch-size 8 --image-size 32 --repeats 6
    srun --kill-on-bad-exit=1 python labs/lab05_scaling/03_overlap.py --model resnet50   # one task per GPU
    # sbatch: no template of its own; in sbatch/bandwidth_1node.sbatch.j2 put this script in the srun line

What it teaches: DDP starts all-reducing a bucket of gradients (``bucket_cap_mb`` MiB) as soon as
backward has produced all of them, while backward goes on computing the next ones. For each bucket
size the script times training steps twice, alternating: a normal step, and a step under
``model.no_sync()`` (forward and backward without any all-reduce: the compute alone). Their
difference is the **exposed** communication, the part backward did not hide. Beside it, the same
gradients all-reduced with nothing to overlap (bucket by bucket, one after the other) give the
communication's full cost, so ``hidden = 1 - exposed / full cost``. An exposed time within the steps'
own run-to-run spread is called noise, and ``hidden`` is kept within 0-100%, with the reason when a
measurement falls outside (a step with sync no slower than without; on a CPU, an all-reduce that
slows backward down by more than it costs alone). On one rank there is nothing to all-reduce, so
nothing to overlap: the script says so and times nothing. One huge bucket cannot start
before backward ends (nothing hides); tiny buckets pay a latency each; the default 25 MiB is
usually in between. Steps use one fixed batch on the device (no data loading: compute and
communication only). One record with every bucket size; whatever it shows on a CPU is reported.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.cli import script_parser
from common.runtime.device import configure_threads, seed_everything, synchronize
from common.runtime.distributed import all_reduce_max, init_distributed, print0, teardown_distributed
from common.measure.energy import EnergyMeter
from common.errors import run_main
from common.models import build_model, input_shape
from common.runtime.placement import record_placement
from common.units import format_bytes
from labs.lab05_scaling.lab05_shared import (OVERLAP_HEADER, add_overlap_args, nothing_to_overlap, overlap_row,
                                             parse_buckets, read_overlap_args, write_overlap_record)


def slowest_rank(times: list[float], device: torch.device) -> list[float]:
    """Per step, the slowest rank's time: a step ends when the last rank ends."""
    return all_reduce_max(times, device)


def spread_of(times: list[float]) -> float:
    """The interquartile range of the step times: how much a step varies from one run of it to the next."""
    if len(times) < 2:
        return 0.0
    low, _, high = statistics.quantiles(times, n=4, method="inclusive")
    return high - low


def overlap_figures(synced: list[float], local: list[float], alone: float) -> dict:
    """Exposed communication, whether it is noise, and the hidden fraction kept within 0-100% (with why)."""
    exposed = statistics.median(synced) - statistics.median(local)
    spread = max(spread_of(synced), spread_of(local))
    raw = 1 - exposed / alone if alone > 0 else None
    hidden, clamped = raw, None
    if raw is not None and raw > 1:
        hidden, clamped = 1.0, ("the step with sync was no slower than without it (exposed time below 0: timing "
                                "noise); all of the communication hid")
    elif raw is not None and raw < 0:
        hidden, clamped = 0.0, ("the step with sync lost more time than the communication costs alone (on a CPU "
                                "the all-reduce competes with backward for the same cores); none of it hid")
    return {"exposed_comm_s": exposed, "timing_spread_s": spread, "exposed_is_noise": exposed <= spread,
            "hidden_fraction": hidden, "hidden_fraction_unclamped": raw, "hidden_clamped_because": clamped}


def train_step(model, optimizer, images, labels, sync: bool) -> None:
    optimizer.zero_grad(set_to_none=True)
    # no_sync(): gradients stay local, no all-reduce at all; what is left is the step's compute.
    with nullcontext() if sync else model.no_sync():
        F.cross_entropy(model(images), labels).backward()
    optimizer.step()


def time_steps(model, optimizer, images, labels, args, device) -> tuple[list[float], list[float]]:
    """Step times with and without gradient synchronisation, alternating so drift hits both alike."""
    # DDP's first step all-reduces everything in one bucket and notes the order the gradients arrive
    # in; the next synchronised step rebuilds the buckets of bucket_cap_mb in that order.
    for _ in range(2):
        train_step(model, optimizer, images, labels, sync=True)
    for _ in range(args.warmup_steps):
        train_step(model, optimizer, images, labels, sync=True)
        train_step(model, optimizer, images, labels, sync=False)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for sync in (True, False):
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            train_step(model, optimizer, images, labels, sync)
            synchronize(device)
            times[sync].append(time.perf_counter() - start)
    return slowest_rank(times[True], device), slowest_rank(times[False], device)


def bucket_sizes(model: DDP) -> list[int]:
    """The gradient buckets DDP uses (bytes), as its logging data reports them once rebuilt.

    A bucket holds whole parameters: one larger than ``bucket_cap_mb`` gets a bucket of its own.
    """
    data = model._get_ddp_logging_data()
    sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", ""))
    return [int(size) for size in sizes.replace(" ", "").split(",") if size]


def communication_alone(buckets: list[int], device: torch.device, args) -> float:
    """The same bytes all-reduced bucket by bucket with nothing to overlap: communication's full cost."""
    flats = [torch.ones(max(1, size // 4), device=device) for size in buckets]
    for flat in flats[: args.warmup_steps]:
        dist.all_reduce(flat)
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        for flat in flats:
            dist.all_reduce(flat)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(slowest_rank(times, device))


def build_parser() -> argparse.ArgumentParser:
    return add_overlap_args(script_parser(__doc__))


def main(argv: list[str] | None = None) -> int:
    args = read_overlap_args(build_parser(), argv)  # --dry-run: small images, a small batch, two steps
    buckets_mb = parse_buckets(args.bucket_cap_mb)
    threads = configure_threads()
    ctx = init_distributed(args.device, force_process_group=True)
    try:
        device, ranks = ctx.device, ctx.world_size
        placement = record_placement(device, 0)  # no DataLoader here: the batch is made on the device
        seed_everything(args.seed)
        channels, size = input_shape(args.model, args.image_size)
        base = build_model(args.model, num_classes=10, in_channels=channels)
        parameter_bytes = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
        generator = torch.Generator().manual_seed(args.seed + ctx.rank)
        images = torch.randn(args.batch_size, channels, size, size, generator=generator).to(device)
        labels = torch.randint(0, 10, (args.batch_size,), generator=generator).to(device)
        if ranks == 1:
            return nothing_to_overlap(args, ctx, placement, parameter_bytes, buckets_mb, threads)
        print0(f"overlap: {ranks} rank(s), backend {ctx.backend} | {args.model}, {format_bytes(parameter_bytes)} of "
               f"gradients | batch {args.batch_size} per rank, {size}px | {args.repeats} timed steps "
               f"per setting | threads {threads}")
        print0(OVERLAP_HEADER)
        rows = []
        with EnergyMeter(device) as meter:
            for cap in buckets_mb:
                replica = copy.deepcopy(base).to(device)
                model = DDP(replica, device_ids=[device.index] if device.type == "cuda" else None,
                            bucket_cap_mb=cap, gradient_as_bucket_view=True)
                optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
                synced, local = time_steps(model, optimizer, images, labels, args, device)
                buckets = bucket_sizes(model)
                alone = communication_alone(buckets or [parameter_bytes], device, args)
                row = {"bucket_cap_mb": cap, "buckets": len(buckets), "bucket_bytes": buckets,
                       "step_s": statistics.median(synced), "no_sync_step_s": statistics.median(local),
                       "comm_alone_s": alone, **overlap_figures(synced, local, alone)}
                rows.append(row)
                print0(overlap_row(row))
                del model, optimizer, replica
        steps_run = len(buckets_mb) * (2 + 2 * (args.repeats + args.warmup_steps))
        energy = meter.result(samples=steps_run * args.batch_size * ranks)
        if ctx.is_main:
            write_overlap_record(args, ctx, rows, parameter_bytes=parameter_bytes, buckets_mb=buckets_mb,
                                 threads=threads, placement=placement, energy=energy)
        return 0
    finally:
        teardown_distributed(ctx)


if __name__ == "__main__":
    run_main(main)
