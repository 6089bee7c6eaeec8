#!/usr/bin/env python3
"""The chapter's torch.profiler example on any device: top operators printed, a trace exported.

Usage:
    python profiling.py                                       # GPU when visible; ResNet-18, 32 x 3x224x224
    python profiling.py --device cpu --batch-size 8 --image-size 64     # a quick CPU run
    sbatch --gres=gpu:1 --wrap "python profiling.py --with-stack"
    (one process, one device: there is no torchrun form)

What it teaches: ``torch.profiler.profile`` records every operator the model runs; the table says
which ones took the time, and the exported Chrome trace (open it at https://ui.perfetto.dev or
chrome://tracing) shows them on a timeline. Changes from the Chapter 16 notes' example, and why:

- CUDA activity is recorded only when a GPU is there (the notes' list fails on a CPU-only node), and
  the table is sorted by self time (an operator's own, not its callees'), on the device on a GPU and on
  the CPU otherwise, and the record keeps the same top operators;
- the input is created on the device once, before profiling (the notes' ``.cuda()`` inside the loop
  puts a host-to-device copy into every iteration of what it measures);
- one warm-up iteration runs before the profiler starts, so lazy initialisation (cuDNN, the
  allocator) is not in the trace;
- ``with_stack`` is a flag: Python stacks make the trace much larger and the run slower;
- the trace is written to a temporary file and renamed, so an interrupted run leaves no half trace.
"""

from __future__ import annotations

import argparse
from typing import Sequence

import torch

from common.cli import add_common_args, add_former_names, apply_dry_run, config_dict, positive_int, script_parser
from common.runtime.device import configure_threads, describe, resolve_device, seed_everything, synchronize
from common.measure.energy import EnergyMeter
from common.errors import run_main
from common.models import add_image_model_args, build_model, input_shape
from common.measure.profiling import add_trace_args, self_time_key, top_operators, trace_path, write_trace
from common.measure.timing import Heartbeat
from common.results import make_record, new_run_id, provenance, write_record

SCRIPT = "chapters/ch16_gpu_distributed/profiling.py"


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_image_model_args(parser, model="resnet18", image_size=224)
    add_former_names(parser, parser.add_argument("--repeats", type=positive_int, default=10,
                                                 help="timed forward+backward passes, all recorded by the profiler "
                                                      "(default: %(default)s)"),
                     "--iterations")
    parser.add_argument("--with-stack", action="store_true",
                        help="record Python stacks (larger trace, slower) (default: off)")
    add_trace_args(parser, row_limit=10, trace="ch16_profile_RUNID_trace.json")
    add_common_args(parser, batch_size=32, epochs_and_steps=False, data=False)  # random images, --repeats steps
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from torch.profiler import ProfilerActivity, profile, record_function

    args = apply_dry_run(build_parser().parse_args(argv), repeats=2)
    seed_everything(args.seed)
    threads = configure_threads()
    device = resolve_device(args.device)
    channels, size = input_shape(args.model, args.image_size)  # MnistNet's classifier is sized for 28x28
    model = build_model(args.model, num_classes=10, in_channels=channels).to(device)
    data = torch.randn(args.batch_size, channels, size, size, device=device)
    run_id = new_run_id()
    trace = trace_path(args.trace, args.results_dir, "ch16_profile", run_id)
    print(f"device {describe(device)} | model {args.model} | input {args.batch_size}x{channels}x{size}x{size} | "
          f"{args.repeats} iterations | threads {threads}", flush=True)

    model(data).sum().backward()  # warm-up: lazy initialisation stays out of the trace
    synchronize(device)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with EnergyMeter(device) as meter, \
            profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=args.with_stack) as prof:
        heartbeat = Heartbeat("iterations profiled", args.repeats)  # a line every 10 s on a slow device
        with record_function("model_training"):
            for iteration in range(args.repeats):
                output = model(data)
                loss = output.sum()
                loss.backward()
                heartbeat(iteration + 1)
        synchronize(device)

    sort_by = self_time_key(device)  # an operator's own time: the same ranking as the record's top_operators
    print(prof.key_averages().table(sort_by=sort_by, row_limit=args.row_limit))
    events = write_trace(trace, prof.export_chrome_trace)  # the trace appears whole or not at all
    print(f"trace: {trace} ({events:,} events; open it at https://ui.perfetto.dev or chrome://tracing)")

    metrics = {"trace_file": str(trace), "trace_events": events, "iterations": args.repeats, "sorted_by": sort_by,
               "top_operators": top_operators(prof.key_averages(), device, args.row_limit), "world_size": 1}
    record = make_record(lab="ch16", script=SCRIPT, method="torch-profiler",
                         config=config_dict(args, resolved_device=str(device), threads=threads),
                         metrics=metrics, provenance=provenance(device),
                         energy=meter.result(samples=args.repeats * args.batch_size), run_id=run_id)
    print(f"record: {write_record(record, args.results_dir)}")
    return 0


if __name__ == "__main__":
    run_main(main)
