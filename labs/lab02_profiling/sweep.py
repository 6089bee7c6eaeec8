#!/usr/bin/env python3
"""Run Lab-02's optimisation path step by step under kernprof and record every step.

Usage:
    python sweep.py                                   # the whole path on digits, 3 epochs per step
    python sweep.py --dataset mnist --data-dir ~/data --include-compile
    python sweep.py --stages baseline,tensor,device --epochs 1 --max-steps 5    # a quick look
    sbatch --gres=gpu:1 --cpus-per-task=8 --wrap "python sweep.py --dataset mnist --data-dir ~/data"
    (each step is one process on one device: there is no torchrun form)

What it teaches: each optimisation on its own, in order, and how much it bought. Step N runs
``mnist_classify.py`` with the flags of steps 1..N, so every step adds one change to the previous
one. Every step runs under ``kernprof -l`` exactly as ``job.slurm`` does; its ``.lprof`` is kept
(read it with ``python -m line_profiler -rmt FILE``) and the share of ``train()``'s time spent on
the data-loading line (the USC lab's 84.5 %) is stored in the step's result record next to its time
per epoch, samples/s and speed-up over the USC lab's starting point. ``compare_results.py`` draws the
progression from those records.

Every step is a fresh process, as a student would run it. Before the first one starts, the sweep reads each
step's flags with the training script's parser and checks its device and precision (the one time it imports
torch): a setting no step could run is one line, with nothing written. Ctrl-C or SIGTERM (``scancel``, a time
limit) stops the step that runs and removes its profile and the sweep's scratch folder; SIGTERM's line says what
was kept.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from common.cli import apply_dry_run, command_flags, from_here, script_parser
from common.errors import EXIT_TERMINATED, Terminated, UserError, run_echoing, run_main, sigterm_raises
from common.results import make_record, provenance, read_only_record, write_record
from labs.lab02_profiling.lab02_shared import (TRAIN_SCRIPT, add_sweep_args, add_train_args, data_loading_share,
                                               markdown_table)

LAB_DIR = Path(__file__).resolve().parent
TRAIN_PATH = LAB_DIR / "mnist_classify.py"
SCRIPT = "labs/lab02_profiling/sweep.py"
REPORT_SCRIPT = LAB_DIR.parents[1] / "scripts" / "compare_results.py"


@dataclass(frozen=True)
class Step:
    """One change on the path: ``settings`` are ``(option, value)`` pairs of ``mnist_classify.py``'s
    parser (its destinations: ``pin_memory``, ``True``), written as flags by :func:`command_line`."""

    name: str
    change: str
    settings: tuple[tuple[str, Any], ...]


def command_line(settings: dict[str, Any]) -> list[str]:
    """``{"pipeline": "tensor", "pin_memory": True}`` -> ``["--pipeline", "tensor", "--pin-memory"]``,
    from ``mnist_classify.py``'s own flags (a flag it does not have is an error here)."""
    return command_flags(add_train_args(script_parser(None)), settings)


def optimisation_path(args: argparse.Namespace) -> list[Step]:
    """The steps in order; each one's flags are added to all earlier ones'."""
    steps = [
        Step("baseline", "the seed: per-sample PIL transforms, 1 DataLoader worker, batch 64",
             (("pipeline", "pil"), ("num_workers", 1), ("batch_size", args.batch_size))),
        Step("workers", f"{args.num_workers} DataLoader workers (from the allocation)",
             (("num_workers", args.num_workers),)),
        Step("pin-memory", "page-locked batches for the host-to-GPU copy (no effect on CPU)",
             (("pin_memory", True),)),
        Step("persistent-workers", f"workers kept between epochs, {args.prefetch_factor} batches prefetched each",
             (("persistent_workers", True), ("prefetch_factor", args.prefetch_factor))),
        Step("tensor", "images converted to tensors once; one indexing op per batch", (("pipeline", "tensor"),)),
        Step("device", "whole data set resident on the device; batches sliced there, no DataLoader",
             (("pipeline", "device"),)),
        Step("graph", "the whole training step captured once as a CUDA graph, replayed in one launch (GPU only)",
             (("cuda_graph", True),)),
        Step("large-batch", f"batch {args.large_batch_size}", (("batch_size", args.large_batch_size),)),
        Step("channels-last", "NHWC memory layout for model and images", (("channels_last", True),)),
        Step("amp", f"mixed precision ({args.precision})", (("precision", args.precision),)),
    ]
    if args.include_compile:
        steps.append(Step("compile", "torch.compile (compile time recorded separately)", (("compile", True),)))
    return steps


def forwarded_flags(args: argparse.Namespace) -> list[str]:
    """The flags every step shares: data, device, length of the run."""
    return command_line({name: getattr(args, name) for name in (
        "device", "seed", "epochs", "dataset", "data_dir", "synthetic_size", "log_interval", "max_steps")})


def run_step(step: Step, flags: list[str], lprof: Path, records_dir: Path) -> tuple[int, list[str]]:
    """Run one step under kernprof, echoing its output; return its exit status and last lines."""
    command = [sys.executable, "-m", "kernprof", "-l", "-o", str(lprof), str(TRAIN_PATH), *flags,
               *command_line({"method": step.name, "results_dir": records_dir})]
    print(f"\n== {step.name}: {step.change}\n$ {' '.join(command)}", flush=True)
    return run_echoing(command, step.name)


def preflight(steps: list[tuple[Step, list[str]]]) -> None:
    """Each step's flags as the training script reads them, its device and precision checked on this machine, and
    the data set they share found: :class:`UserError` for the first that cannot run (a GPU that is not there, fp16
    on a CPU, MNIST not downloaded), before any step starts."""
    from common.data.datasets import get_dataset
    from common.runtime.device import resolve_device
    from common.train.amp import check_precision

    parser = add_train_args(script_parser(None))  # mnist_classify.py's flags
    for number, (step, flags) in enumerate(steps):
        args = parser.parse_args(flags)
        if number == 0:  # every step reads the same data set
            get_dataset(args.dataset, args.data_dir, synthetic_size=args.synthetic_size)
        device = resolve_device(args.device, start=False)  # this process only waits for the steps: no CUDA context
        try:
            check_precision(args.precision, device)
        except UserError as err:
            raise UserError(f"step {step.name}: {err}") from None


def build_parser() -> argparse.ArgumentParser:
    return add_sweep_args(script_parser(__doc__))


def main(argv: Sequence[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv))
    path = optimisation_path(args)
    names = [step.name for step in path]
    wanted = names if args.stages is None else [name.strip() for name in args.stages.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in names]
    if unknown or not wanted:
        hint = " (add --include-compile for the compile step)" if "compile" in unknown else ""
        raise UserError(f"unknown step(s) {', '.join(unknown) or '(none given)'}; "
                        f"the path is: {', '.join(names)}{hint}")
    shared = forwarded_flags(args)
    planned, settings = [], {}
    for step in path:  # a later step's value of a flag replaces an earlier one's
        settings.update(step.settings)
        if step.name in wanted:
            planned.append((step, [*shared, *command_line(settings)]))
    preflight(planned)
    profile_dir = args.profile_dir or args.results_dir / "lab02_lprof"
    profile_dir.mkdir(parents=True, exist_ok=True)
    sweep_id = uuid.uuid4().hex[:8]

    rows: list[dict[str, Any]] = []
    baseline_rate = None
    failures = 0
    try:
        with sigterm_raises(), tempfile.TemporaryDirectory(prefix="lab02_sweep_") as scratch:
            for step, flags in planned:
                index = path.index(step)
                lprof = profile_dir / f"{sweep_id}_{index:02d}_{step.name}.lprof"
                records_dir = Path(scratch) / step.name
                try:
                    status, tail = run_step(step, flags, lprof, records_dir)
                except BaseException:  # Ctrl-C, SIGTERM: kernprof wrote the profile of a step that did not finish
                    lprof.unlink(missing_ok=True)
                    raise
                sweep_info = {"sweep_id": sweep_id, "index": index, "step": step.name, "change": step.change,
                              "step_flags": command_line(dict(step.settings)), "flags": flags[len(shared):],
                              "lprof": str(lprof), "script": SCRIPT}
                if status == 2:  # the step refused its input in one line (above): so would every later step
                    lprof.unlink(missing_ok=True)  # a profile of nothing
                    raise UserError(f"step {step.name} stopped at its input (exit status 2); the steps after it "
                                    "were not started")
                if status != 0:
                    failures += 1
                    print(f"step {step.name} failed with exit status {status}", file=sys.stderr, flush=True)
                    record = make_record(lab="lab02", script=TRAIN_SCRIPT, method=step.name,
                                         config={"sweep": sweep_info, "model": "mnist_cnn", "flags": flags},
                                         metrics={}, provenance=provenance(), status="failed",
                                         notes=[f"exit status {status}", *tail])
                    write_record(record, args.results_dir)
                    continue
                record = read_only_record(records_dir)
                metrics = record["metrics"]
                share = data_loading_share(lprof)
                if step.name == "baseline":
                    baseline_rate = metrics["samples_per_s"]
                speedup = metrics["samples_per_s"] / baseline_rate if baseline_rate else None
                metrics.update({"data_loading_share": share, "speedup_vs_seed": speedup})
                record["config"]["sweep"] = sweep_info  # config.line_profiler true: every step pays its overhead
                written = write_record(record, args.results_dir)
                rows.append({"step": step.name, "change": step.change, "speedup": speedup, "share": share,
                             **{key: metrics.get(key) for key in ("time_per_epoch_s", "samples_per_s", "regime",
                                                                  "test_accuracy")}})
                print(f"== {step.name}: {metrics['time_per_epoch_s']:.2f} s/epoch, {metrics['samples_per_s']:.0f} "
                      f"samples/s, data-loading line {share:.1%} of train() | record {written}", flush=True)
    except Terminated:  # the step was stopped, its profile and the scratch folder removed
        done = ", ".join(before.name for before, _ in planned[:planned.index((step, flags))]) or "none"
        print(f"sweep {sweep_id}: stopped by SIGTERM during step {step.name} (removed); kept the records in "
              f"{args.results_dir} and line profiles {profile_dir}/{sweep_id}_*.lprof of the steps before it: {done}",
              file=sys.stderr, flush=True)
        return EXIT_TERMINATED

    print(f"\nsweep {sweep_id} ({args.dataset}, {args.epochs} epoch(s) per step; provisional on a shared machine)")
    print(markdown_table(rows))
    print(f"line profiles: {profile_dir}/{sweep_id}_*.lprof (python -m line_profiler -rmt FILE)")
    print(f"report: python {from_here(REPORT_SCRIPT)} --results-dir {args.results_dir}")
    return 1 if failures else 0


if __name__ == "__main__":
    run_main(main)
