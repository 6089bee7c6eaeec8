#!/usr/bin/env python3
"""Lab-05 step 1: how fast the network moves a gradient — bus bandwidth of all-reduce, all-gather and
reduce-scatter against the link's peak.

Usage:
    torchrun --standalone --nproc_per_node=4 labs/lab05_scaling/01_allreduce_bench.py --site lanta
    torchrun --standalone --nproc_per_node=2 labs/lab05_scaling/01_allreduce_bench.py --device cpu --max-bytes 4M
    srun --kill-on-bad-exit=1 python labs/lab05_scaling/01_allreduce_bench.py --site lanta   # one task per GPU
    sbatch bandwidth_2node.sbatch   # rendered from sbatch/bandwidth_2node.sbatch.j2, see the README

What it teaches: for every message size from 1 KiB up, each collective runs a few untimed warm-up
times, then ``--repeats`` timed times (the ranks meet at a barrier before each, the device is
synchronised before the clock is read, and the slowest rank's time counts); the median gives the
algorithm bandwidth ``algbw = S / t`` and the bus bandwidth ``busbw = algbw x 2(n-1)/n`` for
all-reduce, ``x (n-1)/n`` for all-gather and reduce-scatter (nccl-tests' conventions, so the numbers
compare with theirs). busbw does not depend on the number of ranks: it is what one link carried,
and it is compared with that link's peak from the site profile (NVLink per GPU within a node, the
node's network across nodes; ``--site``, or ``--peak-gbps``). On the CPU (Gloo) the reference is
this machine's measured memory-copy bandwidth. Small messages measure latency, large ones bandwidth.

On a GPU the script asks NCCL what it used (``NCCL_DEBUG=INFO`` into a file per process, unless you
set ``NCCL_DEBUG_FILE`` yourself) and prints it: NVLink or PCIe peer-to-peer, shared memory,
InfiniBand, or TCP sockets, which across nodes is a warning. One record per collective (sizes,
times, algbw, busbw, the reference, the transport, the placement of every rank, and energy). On one
rank there is no link: the script says so in one line and times nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common.cli import script_parser
from common.runtime.device import configure_threads, device_type as device_kind, synchronize
from common.runtime.distributed import all_reduce_max, gather_objects, init_distributed, print0, teardown_distributed
from common.measure.energy import EnergyMeter
from common.errors import run_main
from common.runtime.placement import record_placement
from common.units import format_bytes
from labs.lab05_scaling.lab05_shared import (
    ELEMENT_BYTES, TABLE_HEADER, Reference, add_bandwidth_args, bandwidths, bus_factor, check_gpu_memory,
    checked_sizes, describe_transport, link_reference, measure_memcpy, nccl_debug_environment, nccl_found,
    parse_collectives, site_links, table_row, write_bandwidth_record,
)


def make_operation(collective: str, size_bytes: int, ranks: int, rank: int, device: torch.device):
    """Buffers for one collective of ``size_bytes`` (nccl-tests' S), a call that runs it, and a check.

    Every rank's input holds ``rank + 1``: the sum over ranks is ``n(n+1)/2``; a gather puts rank i's
    ``i + 1`` in slot i. Inputs are refilled before every call (an all-reduce works in place).
    """
    per_rank = max(1, size_bytes // ELEMENT_BYTES // ranks)  # S must split evenly into n chunks
    count = per_rank * ranks
    total = ranks * (ranks + 1) / 2
    if collective == "all_reduce":
        data = torch.empty(count, device=device)
        run = lambda: dist.all_reduce(data)  # noqa: E731
        expected = torch.full((count,), total, device=device)
        inputs, output = [data], data
    elif collective == "all_gather":
        data, output = torch.empty(per_rank, device=device), torch.empty(count, device=device)
        run = lambda: dist.all_gather_into_tensor(output, data)  # noqa: E731
        expected = torch.arange(1, ranks + 1, device=device, dtype=torch.float32).repeat_interleave(per_rank)
        inputs = [data]
    else:  # reduce_scatter
        data, output = torch.empty(count, device=device), torch.empty(per_rank, device=device)
        run = lambda: dist.reduce_scatter_tensor(output, data)  # noqa: E731
        expected = torch.full((per_rank,), total, device=device)
        inputs = [data]

    def refill() -> None:
        for tensor in inputs:
            tensor.fill_(rank + 1)

    def correct() -> bool:
        return bool(torch.equal(output, expected))

    return count * ELEMENT_BYTES, refill, run, correct


def time_collective(collective: str, size_bytes: int, args, ctx) -> dict:
    """Warm up, check the result once, then time ``args.repeats`` calls; the slowest rank's time counts."""
    device = ctx.device
    actual, refill, run, correct = make_operation(collective, size_bytes, ctx.world_size, ctx.rank, device)
    for _ in range(args.warmup):
        refill()
        run()
    refill()
    run()
    synchronize(device)
    ok = correct()
    times = []
    for _ in range(args.repeats):
        refill()
        dist.barrier()                 # the ranks start together; a late rank's wait is not the link's time
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    # Per call, the slowest rank: a collective is done when the last rank is done.
    seconds = all_reduce_max(times, device)
    every_rank_ok = all(gather_objects(ok))
    median = statistics.median(seconds)
    algbw, busbw = bandwidths(collective, actual, median, ctx.world_size)
    return {"bytes": actual, "elements": actual // ELEMENT_BYTES, "time_s": median, "time_min_s": min(seconds),
            "time_max_s": max(seconds), "algbw_gbps": algbw, "busbw_gbps": busbw, "correct": every_rank_ok}


def reference_for(args, ctx, nodes: int):
    """The peak busbw is compared with: the link's (GPU) or the measured memory copy (CPU)."""
    if args.peak_gbps is not None:
        return Reference("link", "given with --peak-gbps", args.peak_gbps, args.peak_source)
    if ctx.device.type == "cuda":
        if args.site is None:
            return None
        return link_reference(site_links(args.site, args.partition), nodes, args.site)
    if args.site is not None:  # its links are GPUs' and the network's: Gloo on a CPU moves bytes through memory
        print0(f"note: on a CPU the reference is this machine's memory copy, not --site {args.site}'s links")
    # Rank 0 measures alone: the other ranks would compete for the same memory bus.
    reference = measure_memcpy(repeats=args.memcpy_repeats) if ctx.is_main else None
    return gather_objects(reference)[0]


def build_parser() -> argparse.ArgumentParser:
    return add_bandwidth_args(script_parser(__doc__))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    collectives = parse_collectives(args.collectives)
    # The kind only, starting nothing: init_distributed below picks this rank's GPU (also under srun
    # --gpus-per-task, where every task sees its own GPU as cuda:0) and says in one line when there is none.
    device_type = device_kind(args.device)
    sizes = checked_sizes(args, device_type)  # also --site and --partition, from the job when not given
    threads = configure_threads()
    with tempfile.TemporaryDirectory(prefix="lab05_nccl_") as nccl_dir:
        if device_type == "cuda":  # NCCL reads these when it starts, at the first collective
            os.environ.update(nccl_debug_environment(Path(nccl_dir)))
        ctx = init_distributed(args.device, force_process_group=True)
        try:
            return benchmark(args, ctx, collectives, sizes, threads)
        finally:
            teardown_distributed(ctx)


def benchmark(args, ctx, collectives: list[str], sizes: list[int], threads: int) -> int:
    device, ranks = ctx.device, ctx.world_size
    check_gpu_memory(sizes[-1], device)  # the largest message, its result and NCCL's buffers must fit
    placement = record_placement(device, 0)  # no DataLoader: the messages are made on the device
    if ranks == 1:  # the same on a CPU and a GPU: a collective on one rank copies within the device, if at all
        print0(f"bandwidth: 1 rank, backend {ctx.backend}: there is no link to measure (one rank sends nothing to "
               "any other, so bus bandwidth would be 0 and no transport is chosen); nothing was timed and no record "
               "written; start two or more ranks (torchrun --nproc_per_node=2, srun)")
        return 0
    hosts = [entry["node"] for entry in placement]
    nodes = len(set(hosts))
    reference = reference_for(args, ctx, nodes)
    print0(f"bandwidth: {ranks} rank(s) on {nodes} node(s), backend {ctx.backend}, {len(sizes)} sizes "
           f"{format_bytes(sizes[0])}..{format_bytes(sizes[-1])}, "
           f"{args.warmup} warm-up + {args.repeats} timed calls each")
    if reference is None:
        print0("reference: none (no link peak: pass --site or --peak-gbps); busbw is shown without a percentage")
    else:
        print0(f"reference: {reference.name}: {reference.gb_per_s:.2f} GB/s ({reference.source})")
    for collective in collectives:
        factor = bus_factor(collective, ranks)
        print0(f"\n{collective} (busbw = algbw x {factor:.3f})")
        print0(TABLE_HEADER)
        results = []
        with EnergyMeter(device) as meter:
            for size in sizes:
                row = time_collective(collective, size, args, ctx)
                row["busbw_pct_of_reference"] = (100 * row["busbw_gbps"] / reference.gb_per_s
                                                 if reference is not None and reference.gb_per_s else None)
                results.append(row)
                print0(table_row(row))
        energy = meter.result()
        found = gather_objects(nccl_found()) if ctx.backend == "nccl" else []  # what NCCL says each rank used
        transport = describe_transport(ctx.backend, hosts, found)
        if ctx.is_main:
            write_bandwidth_record(args, ctx, collective, results, reference=reference, transport=transport,
                                   energy=energy, placement=placement, collectives=collectives, threads=threads)
    if ctx.is_main:
        print0(f"\nreport: python scripts/compare_results.py --results-dir {args.results_dir}")
    return 0


if __name__ == "__main__":
    run_main(main)
