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

from common.cli import add_common_args, add_timing_args, config_dict, positive_float, positive_int, script_parser
from common.runtime.device import configure_threads, resolve_device, synchronize
from common.runtime.distributed import all_reduce_max, gather_objects, init_distributed, print0, teardown_distributed
from common.measure.energy import EnergyMeter
from common.errors import UserError, run_main
from common.runtime.launch import detect_launch
from common.runtime.placement import record_placement
from common.results import make_record, provenance, write_record
from common.units import format_bytes
from labs.lab05_scaling.lab05_shared import (ELEMENT_BYTES, LAB, Reference, bandwidths, bus_factor, describe_gloo,
                                             describe_nccl, link_reference, measure_memcpy,
                                             message_sizes, nccl_debug_environment, nccl_log_files,
                                             parse_collectives, parse_nccl_log, parse_size, site_links)

SCRIPT = "labs/lab05_scaling/01_allreduce_bench.py"


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
    # Rank 0 measures alone: the other ranks would compete for the same memory bus.
    reference = measure_memcpy(repeats=args.memcpy_repeats) if ctx.is_main else None
    return gather_objects(reference)[0]


def transport_of(ctx, hosts: list[str]) -> dict:
    nodes = len(set(hosts))
    if ctx.backend != "nccl":
        return {"backend": ctx.backend, "summary": describe_gloo(hosts), "warning": None, "nccl": None}
    lines = [line for path in nccl_log_files() for line in path.read_text(errors="replace").splitlines()]
    found = parse_nccl_log(lines)
    merged: dict = {"via": set(), "networks": set(), "paths": set()}
    for rank_found in gather_objects(found):
        for key in merged:
            merged[key].update(rank_found[key])
    merged = {key: sorted(values) for key, values in merged.items()}
    summary, warning = describe_nccl(merged, nodes)
    return {"backend": ctx.backend, "summary": summary, "warning": warning, "nccl": merged}


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    group = parser.add_argument_group("what to measure")
    group.add_argument("--collectives", default="all_reduce,all_gather,reduce_scatter",
                       help="comma-separated: all_reduce, all_gather, reduce_scatter (default: %(default)s)")
    group.add_argument("--min-bytes", type=size_arg, default="1K",
                       help="smallest message (S, the whole array), e.g. 1K (default: %(default)s)")
    group.add_argument("--max-bytes", type=size_arg, default=None,
                       help="largest message, e.g. 1G; at most 64M on CPU, 16G on GPU (default: 1G on GPU, "
                            "64M on CPU)")
    group.add_argument("--step-factor", type=positive_int, default=2,
                       help="each size is the previous one times this (default: %(default)s)")
    add_timing_args(group, warmup=5, repeats=20, what="calls per message size", former=("--iters",))
    group = parser.add_argument_group("what to compare with")
    group.add_argument("--site", default=None,
                       help="site profile (slurm/sites/NAME.yaml) whose link peaks busbw is compared with; "
                            "from HPC_DL_LABS_SITE in rendered jobs (default: none)")
    group.add_argument("--partition", default=None,
                       help="partition of --site (default: SLURM_JOB_PARTITION, else the site's GPU partition)")
    group.add_argument("--peak-gbps", type=positive_float, default=None,
                       help="compare with this peak instead, in GB/s one direction (default: from --site)")
    group.add_argument("--peak-source", default="given on the command line",
                       help="where the --peak-gbps figure comes from (default: %(default)s)")
    group.add_argument("--memcpy-repeats", type=positive_int, default=5,
                       help="copies timed for the CPU reference (default: %(default)s)")
    # --device, --results-dir, --num-workers (the placement check compares it with the cores) and
    # --dry-run (three sizes up to 16 KiB, three timed calls) apply here; the training flags do not.
    add_common_args(parser, batch_size=1)
    return parser


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    collectives = parse_collectives(args.collectives)
    device_type = resolve_device(args.device, local_rank=detect_launch().local_rank).type
    max_bytes = args.max_bytes or (1024**3 if device_type == "cuda" else 64 * 1024**2)
    if args.dry_run:  # seconds: three small sizes, one warm-up and three timed calls each
        max_bytes, args.repeats, args.warmup = min(max_bytes, 16 * 1024), min(args.repeats, 3), 1
        args.min_bytes = min(args.min_bytes, max_bytes)
    sizes = message_sizes(args.min_bytes, max_bytes, args.step_factor, device_type)
    args.site = args.site or os.environ.get("HPC_DL_LABS_SITE") or None
    args.partition = args.partition or os.environ.get("SLURM_JOB_PARTITION") or None
    if args.site is not None:
        site_links(args.site, args.partition)  # an unknown site or partition: one line, before any work
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
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if 2.5 * sizes[-1] > free:  # the input, the output (all-gather: S), the expected result, NCCL's buffers
            raise UserError(f"--max-bytes {format_bytes(sizes[-1])} needs about {format_bytes(2.5 * sizes[-1])} of GPU "
                            f"memory; {format_bytes(free)} is free on {device}")
    placement = record_placement(device, args.num_workers)
    if ranks == 1:  # the same on a CPU and a GPU: a collective on one rank copies within the device, if at all
        print0(f"bandwidth: 1 rank, backend {ctx.backend}: there is no link to measure (one rank sends nothing to "
               "any other, so bus bandwidth would be 0 and no transport is chosen); nothing was timed and no record "
               "written; start two or more ranks (torchrun --nproc_per_node=2, srun)")
        return 0
    hosts = [entry["node"] for entry in placement]
    nodes = len(set(hosts))
    reference = reference_for(args, ctx, nodes)
    print0(f"bandwidth: {ranks} rank(s) on {nodes} node(s), backend {ctx.backend}, {len(sizes)} sizes "
           f"{format_bytes(sizes[0])}..{format_bytes(sizes[-1])}, {args.warmup} warm-up + {args.repeats} timed calls each")
    if reference is None:
        print0("reference: none (no link peak: pass --site or --peak-gbps); busbw is shown without a percentage")
    else:
        print0(f"reference: {reference.name}: {reference.gb_per_s:.2f} GB/s ({reference.source})")
    timing = ("time.perf_counter around each call, device synchronised before each clock read, ranks at a "
              "barrier before each call; per call the slowest rank's time; median over the timed calls")
    written = []
    for collective in collectives:
        factor = bus_factor(collective, ranks)
        print0(f"\n{collective} (busbw = algbw x {factor:.3f})")
        print0(f"{'size':>10} {'time (us)':>11} {'algbw GB/s':>11} {'busbw GB/s':>11} {'% ref':>7} {'ok':>3}")
        results = []
        with EnergyMeter(device) as meter:
            for size in sizes:
                row = time_collective(collective, size, args, ctx)
                row["busbw_pct_of_reference"] = (100 * row["busbw_gbps"] / reference.gb_per_s
                                                 if reference is not None and reference.gb_per_s else None)
                results.append(row)
                pct = row["busbw_pct_of_reference"]
                print0(f"{format_bytes(row['bytes']):>10} {1e6 * row['time_s']:>11.1f} {row['algbw_gbps']:>11.3f} "
                       f"{row['busbw_gbps']:>11.3f} {'' if pct is None else f'{pct:.1f}':>7} "
                       f"{'yes' if row['correct'] else 'NO':>3}")
        energy = meter.result()
        transport = transport_of(ctx, hosts)
        if ctx.is_main:
            print0(f"transport: {transport['summary']}")
            if transport["warning"]:
                print0(f"WARNING: {transport['warning']}")
            best = max(results, key=lambda r: r["busbw_gbps"])
            notes = [] if all(r["correct"] for r in results) else ["some sizes gave a wrong result (correct: false)"]
            if transport["warning"]:
                notes.append(transport["warning"])
            metrics = {
                "collective": collective, "world_size": ranks, "nodes": nodes, "bus_factor": factor,
                "sizes": results, "peak_busbw_gbps": best["busbw_gbps"], "peak_busbw_bytes": best["bytes"],
                "reference": None if reference is None else reference.as_dict(), "transport": transport,
                "timing_method": timing,
            }
            config = config_dict(args, resolved_device=str(device), collectives=collectives,
                                 sizes=[r["bytes"] for r in results], dtype="float32", threads=threads)
            record = make_record(lab=LAB, script=SCRIPT, method=collective, config=config, metrics=metrics,
                                 notes=notes, energy=energy,
                                 provenance=provenance(device, ranks, {"distributed": ctx.describe(),
                                                                       "placement": placement}))
            written.append(write_record(record, args.results_dir))
            print0(f"record: {written[-1]}")
    if ctx.is_main:
        print0(f"\nreport: python scripts/compare_results.py --results-dir {args.results_dir}")
    return 0


if __name__ == "__main__":
    run_main(main)
