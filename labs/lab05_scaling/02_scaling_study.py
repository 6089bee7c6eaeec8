#!/usr/bin/env python3
"""Lab-05 step 2: the scaling curve — one training configuration at 1, 2, 4, … processes, in strong
and in weak scaling, with throughput, efficiency and time to a target validation accuracy.

Usage:
    python labs/lab05_scaling/02_scaling_study.py --processes 1,2,4 --device cuda      # one GPU node
    python labs/lab05_scaling/02_scaling_study.py --device cpu --processes 1,2 --epochs 2 --max-steps 10
    python labs/lab05_scaling/02_scaling_study.py --processes 1,2 -- --lr 0.1 --warmup-steps 1  # flags for the training
    sbatch scaling_array.sbatch    # rendered from sbatch/scaling_array.sbatch.j2: one array task per point

What it teaches: the training is Lab-01's ``04_ddp_training.py``, unchanged and started as its own
job for every point (``torchrun --standalone`` here, plain ``python`` for one process; one ``srun``
step inside a Slurm allocation, spread over as many nodes as the point needs). Two ways to add
processes:

- **strong scaling**: the *global* batch stays ``--global-batch-size``; each of n processes gets
  1/n of it. The same optimisation up to rounding, done faster: ideal throughput grows n-fold, while
  each process's share of work shrinks until communication and overheads dominate.
- **weak scaling**: each process keeps ``--batch-size``; the global batch grows n-fold. Ideal
  throughput also grows n-fold and the step time stays flat, but a larger global batch takes fewer,
  different optimiser steps per epoch: whether it reaches the target accuracy sooner is the
  question the time-to-target column answers.

With the default ``--global-batch-size`` (= ``--batch-size``) the 1-process run is the same in both
modes: it runs once and starts both curves. Every point writes a record (lab ``lab05``, method
``strong-scaling`` or ``weak-scaling``) holding the training's throughput, its validation accuracy
over time and the time it took to first reach ``--target-accuracy``; the report draws the curves
against ideal. A point larger than the allocation (Slurm's tasks and nodes, else this machine's GPUs,
or its cores on the CPU) stops the study before anything runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Sequence

from common.cli import apply_dry_run, command_flags, script_parser
from common.errors import FlagError, UserError, run_echoing, run_main, sigterm_raises
from common.results import read_only_record, write_record
from labs.lab05_scaling.lab05_shared import (REPO, STUDY_SETS, TRAINING, TRAINING_MODULE, Allocation, add_study_args,
                                             check_points, check_training_input, current_allocation, nodes_for,
                                             parse_modes, parse_points, per_process_batch, point_record,
                                             refuse_study_flags)


def allocation_for(args: argparse.Namespace) -> Allocation:
    gpus = 0
    if args.device != "cpu":
        import torch  # only to count GPUs (about 3 s)

        gpus = torch.cuda.device_count()
        if args.device == "cuda" and gpus == 0:
            raise UserError("--device cuda was requested but PyTorch sees no CUDA GPU; use --device cpu")
        args.device = "cuda" if gpus else "cpu"
    return current_allocation(args.device, gpus=gpus)


def launcher(args: argparse.Namespace, processes: int, nodes: int, allocation: Allocation) -> list[str]:
    """How one point starts: an srun step inside a Slurm job, else torchrun on this machine
    (one process needs no launcher: 04_ddp_training.py then makes a one-process group itself)."""
    if args.launcher == "srun" or (args.launcher == "auto" and os.environ.get("SLURM_JOB_ID")):
        per_node = min(processes, allocation.per_node)
        return ["srun", "--kill-on-bad-exit=1", f"--nodes={nodes}", f"--ntasks={processes}",
                f"--ntasks-per-node={per_node}", sys.executable]
    if processes == 1 and args.launcher == "auto":
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]


def training_flags(args: argparse.Namespace, batch_size: int, records: Path, checkpoint: Path) -> list[str]:
    """The command line of one point's training, written from the training script's own parser (a flag it
    no longer has is an error before anything runs), then the study's pass-through ``training_args``."""
    shared = {name: getattr(args, name) for name in STUDY_SETS}
    flags = command_flags(importlib.import_module(TRAINING_MODULE).build_parser(),
                          {**shared, "batch_size": batch_size, "results_dir": records, "checkpoint": checkpoint})
    return [*flags, *args.training_args]


def run_point(command: list[str], tag: str, env: dict[str, str]) -> tuple[int, list[str]]:
    """Run one point, echoing its output with a tag; return its exit status and last lines."""
    print(f"\n== {tag}\n$ {shlex.join(command)}", flush=True)
    return run_echoing(command, tag, env=env, cwd=REPO)  # Ctrl-C or SIGTERM stops the point too


def point_environment() -> dict[str, str]:
    """The training's environment.

    Every process of every point gets the same CPU threads: ``OMP_NUM_THREADS`` as you (or the job
    header, from ``--cpus-per-task``) set it, else 1, which is what torchrun gives each of several
    processes; without it the 1-process point would use every core and the curve would compare
    unlike things. Inside Slurm, each srun step finds its own rendezvous (the first node of *its*
    node list, a port from its step id), so the job's ``MASTER_ADDR``/``MASTER_PORT`` are dropped.
    """
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if env.get("SLURM_JOB_ID"):
        env.pop("MASTER_ADDR", None)
        env.pop("MASTER_PORT", None)
    return env


def build_parser() -> argparse.ArgumentParser:
    return add_study_args(script_parser(__doc__))


def main(argv: Sequence[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv))
    args.training_args = [a for a in args.training_args if a != "--"] if args.training_args else []
    points = parse_points(args.processes)
    modes = parse_modes(args.modes)
    if args.global_batch_size is not None and "strong" not in modes:  # weak scaling keeps --batch-size per process
        raise FlagError(f"--global-batch-size {args.global_batch_size}: only with strong scaling (--modes strong or "
                        "both); weak scaling keeps --batch-size per process")
    args.global_batch_size = args.global_batch_size or args.batch_size
    if args.point is not None:
        if args.point >= len(points):
            raise UserError(f"--point {args.point} but --processes {args.processes} has {len(points)} point(s) "
                            f"(0..{len(points) - 1})")
        points = [points[args.point]]
    allocation = allocation_for(args)
    check_points(points, allocation)
    if args.launcher == "srun" and not shutil.which("srun"):
        raise UserError("--launcher srun: there is no srun here (not a Slurm node); use --launcher auto or torchrun")
    module = importlib.import_module(TRAINING_MODULE)
    training = module.build_parser()

    def refused(message: str) -> None:  # the flags after -- are the training's: say so, in one line
        raise UserError(f"the training ({TRAINING}) refuses its flags: {message}")

    training.error = refused
    refuse_study_flags(training, args.training_args)  # one the study sets itself would win over the study's value
    scratch = Path(tempfile.gettempdir())  # where the points will write (nothing is created to check)
    for processes in points:  # every batch split and every point's training flags are checked before anything runs
        for mode in modes:
            batch = per_process_batch(mode, processes, args.batch_size, args.global_batch_size)
            flags = training.parse_args(training_flags(args, batch, scratch / "records", scratch / "checkpoint.pt"))
    check_training_input(module, flags)  # a wrong model or a missing data set: one line, not a failed record per point

    study = {"id": uuid.uuid4().hex[:8], "processes": parse_points(args.processes), "modes": modes,
             "allocation": allocation.what}
    print(f"scaling study {study['id']}: points {points}, modes {', '.join(modes)}, {allocation.what}; "
          f"strong: global batch {args.global_batch_size}, weak: {args.batch_size} per process", flush=True)
    failures, written = 0, []
    with sigterm_raises(), tempfile.TemporaryDirectory(prefix="lab05_scaling_") as scratch:  # SIGTERM: both go too
        for processes in points:
            nodes = nodes_for(processes, allocation)
            batches = {mode: per_process_batch(mode, processes, args.batch_size, args.global_batch_size)
                       for mode in modes}
            runs: dict[int, list[str]] = {}  # one run per distinct batch: at 1 process strong == weak
            for mode, batch in batches.items():
                runs.setdefault(batch, []).append(mode)
            for batch, shared in runs.items():
                tag = f"{processes}p {'+'.join(shared)}"
                folder = Path(scratch) / f"{processes}-{batch}"
                command = [*launcher(args, processes, nodes, allocation), str(REPO / TRAINING),
                           *training_flags(args, batch, folder / "records", folder / "checkpoint.pt")]
                status, tail = run_point(command, tag, point_environment())
                training, notes = None, []
                if status != 0:
                    failures += 1
                    notes = [f"the training exited with status {status}", *tail]
                    print(f"point {tag} failed with exit status {status}", file=sys.stderr, flush=True)
                else:
                    training = read_only_record(folder / "records")
                if len(shared) > 1:
                    notes.append(f"one run at {processes} process(es) serves as the point of both "
                                 f"{' and '.join(shared)} scaling (the same per-process and global batch)")
                for mode in shared:
                    record = point_record(mode, processes, nodes, batch, training, command, args, study, notes,
                                          status="ok" if training else "failed")
                    written.append(write_record(record, args.results_dir))
                    metrics = record["metrics"]
                    rate, reached = metrics.get("samples_per_s"), metrics["time_to_target_s"]
                    print(f"== {mode} scaling, {processes} process(es) on {nodes} node(s), batch {batch} per "
                          f"process: {'n/a' if rate is None else f'{rate:.1f}'} samples/s, "
                          f"{args.target_accuracy:.0%} accuracy "
                          f"{'not reached' if reached is None else f'after {reached:.1f} s'} | record {written[-1]}",
                          flush=True)
    print(f"\n{len(written)} record(s) in {args.results_dir}; report: "
          f"python scripts/compare_results.py --results-dir {args.results_dir}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    run_main(main)
