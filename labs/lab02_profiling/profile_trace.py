#!/usr/bin/env python3
"""Profile a few MNIST training steps with torch.profiler: a timeline trace and the top operators.

Usage:
    python profile_trace.py                                    # the USC lab's pipeline, 5 profiled steps
    python profile_trace.py --pipeline device --batch-size 256 # after the optimisations
    sbatch job.slurm   # with the kernprof line replaced by: python profile_trace.py
    (one process, one device: there is no torchrun form)

What it teaches: line_profiler (``mnist_classify.py`` under kernprof) says which *line* of
``train()`` takes the time; torch.profiler says what happens *inside* it: every PyTorch operator,
on the CPU and, when there is a GPU, on the GPU, on one timeline. Open the trace at
https://ui.perfetto.dev (or chrome://tracing): the labelled regions ``data loading``, ``forward``,
``backward`` and ``optimizer step`` show where each step goes; with the USC lab's pipeline the GPU row
is mostly empty while the CPU waits for the next batch.

The profiler follows a schedule: ``--wait`` steps ignored, ``--warmup`` steps traced but thrown
away (the profiler's own start-up), then ``--active`` steps recorded.
"""

from __future__ import annotations

import argparse
from typing import Sequence

import torch
import torch.nn.functional as F

from common.data import pipelines
from common.cli import (PIPELINES, add_common_args, add_dataset_args, config_dict, non_negative_int, positive_int,
                        script_parser)
from common.runtime.device import configure_threads, describe, resolve_device, seed_everything, synchronize
from common.measure.energy import EnergyMeter
from common.errors import run_main
from common.models import MnistNet
from common.measure.profiling import add_trace_args, self_time_key, top_operators, trace_path, write_trace
from common.results import make_record, new_run_id, provenance, write_record
from labs.lab02_profiling.lab02_shared import batch_maker, batch_used, flag_notes

SCRIPT = "labs/lab02_profiling/profile_trace.py"
REGIONS = ("data loading", "copy to device", "forward", "backward", "optimizer step")


def endless(loader):
    """Batches forever: a new epoch starts when one ends, so any number of steps can be profiled."""
    while True:
        yield from loader


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_dataset_args(parser)
    parser.add_argument("--pipeline", choices=PIPELINES, default="pil",
                        help="how batches are made, as in mnist_classify.py (default: %(default)s)")
    parser.add_argument("--pin-memory", action="store_true", help="pinned host batches (GPU only) (default: off)")
    parser.add_argument("--wait", type=non_negative_int, default=1, help="steps before tracing (default: %(default)s)")
    parser.add_argument("--warmup", type=non_negative_int, default=1,
                        help="steps traced and discarded (default: %(default)s)")
    parser.add_argument("--active", type=positive_int, default=5, help="steps recorded (default: %(default)s)")
    add_trace_args(parser, row_limit=15, trace="lab02_PIPELINE_RUNID_trace.json")
    add_common_args(parser, batch_size=64, num_workers=1, epochs_and_steps=False)  # --wait, --warmup, --active
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    args = build_parser().parse_args(argv)
    if args.dry_run:
        args.wait, args.warmup, args.active = 0, 1, 1
    seed_everything(args.seed)
    threads = configure_threads()
    device = resolve_device(args.device)
    train_data, _ = pipelines.load_uint8(args.dataset, args.data_dir, seed=args.seed,
                                         synthetic_size=args.synthetic_size)
    notes = flag_notes(args, device, len(train_data), default_workers=build_parser().get_default("num_workers"))
    batch = batch_used(args.batch_size, len(train_data))  # the whole set where --batch-size is larger
    loader = pipelines.make_loader(args.pipeline, train_data, args.batch_size, shuffle=True, device=device,
                                   num_workers=args.num_workers, pin_memory=args.pin_memory and device.type == "cuda",
                                   seed=args.seed)
    model = MnistNet().to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    run_id = new_run_id()
    trace = trace_path(args.trace, args.results_dir, f"lab02_{args.pipeline}", run_id)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    print(f"device {describe(device)} | pipeline {args.pipeline} | {batch_maker(args)} | "
          f"batch {batch} | profiling steps {args.wait + 1}..{args.wait + args.warmup + args.active}, "
          f"recording the last {args.active}", flush=True)

    recorded = {}

    def on_trace_ready(prof) -> None:
        """Called when the active steps are done: keep the table and write the trace before the profiler resets."""
        recorded["averages"] = prof.key_averages()
        recorded["events"] = write_trace(trace, prof.export_chrome_trace)  # whole or not at all

    batches = endless(loader)
    model.train()
    steps = schedule(wait=args.wait, warmup=args.warmup, active=args.active, repeat=1)
    drawn = 0  # samples trained on, for the energy per sample: an epoch's last batch (or a small data set) is short
    with EnergyMeter(device) as meter, \
            profile(activities=activities, schedule=steps, on_trace_ready=on_trace_ready) as prof:
        for _ in range(args.wait + args.warmup + args.active):
            with record_function("data loading"):
                data, target = next(batches)
            drawn += len(target)
            with record_function("copy to device"):
                data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with record_function("forward"):
                loss = F.nll_loss(model(data), target)
            with record_function("backward"):
                loss.backward()
            with record_function("optimizer step"):
                optimizer.step()
            synchronize(device)
            prof.step()
    events = recorded["events"]

    averages = recorded["averages"]
    sort_by = self_time_key(device)  # an operator's own time, as the record's top_operators
    print(averages.table(sort_by=sort_by, row_limit=args.row_limit))
    region_us = {event.key: event.cpu_time_total for event in averages if event.key in REGIONS}
    total_us = sum(region_us.values())
    gpu_hint = " (on a GPU, kernels run after the CPU queues them: read the GPU rows of the trace)"
    print(f"CPU time of the labelled regions over {args.active} step(s){gpu_hint if device.type == 'cuda' else ''}:")
    for name in REGIONS:
        print(f"  {name:<15} {region_us.get(name, 0) / 1000:9.1f} ms  {region_us.get(name, 0) / max(total_us, 1):6.1%}")
    print(f"trace: {trace} ({events:,} events; open it at https://ui.perfetto.dev or chrome://tracing)")

    metrics = {"trace_file": str(trace), "trace_events": events, "profiled_steps": args.active,
               "region_cpu_time_us": region_us,
               "data_loading_cpu_share": region_us.get("data loading", 0) / total_us if total_us else None,
               "top_operators": top_operators(averages, device, args.row_limit),
               "world_size": 1, "global_batch_size": batch}
    record = make_record(lab="lab02", script=SCRIPT, method=f"torch-profiler-{args.pipeline}",
                         config=config_dict(args, resolved_device=str(device), model="mnist_cnn", threads=threads),
                         metrics=metrics, provenance=provenance(device), notes=notes,
                         energy=meter.result(samples=drawn),
                         run_id=run_id)
    print(f"record: {write_record(record, args.results_dir)}")
    return 0


if __name__ == "__main__":
    run_main(main)
