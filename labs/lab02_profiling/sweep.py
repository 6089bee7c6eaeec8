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

The sweep itself does not import torch: every step is a fresh process, as a student would run it.
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import subprocess
import sys
import tempfile
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from common.cli import (add_common_args, add_dataset_args, add_former_names, add_precision_arg, apply_dry_run,
                        command_flags, output_dir, positive_int, script_parser)
from common.errors import UserError, run_main
from common.results import make_record, provenance, write_record
from labs.lab02_profiling import mnist_classify

LAB_DIR = Path(__file__).resolve().parent
TRAIN_SCRIPT = LAB_DIR / "mnist_classify.py"
SCRIPT = "labs/lab02_profiling/sweep.py"
REPORT_SCRIPT = LAB_DIR.parents[1] / "scripts" / "compare_results.py"
#: The line of ``train()`` that waits for the next batch: the USC lab's 84.5 %.
DATA_LOADING_LINE = "for batch_idx, (data, target) in enumerate(train_loader):"


@dataclass(frozen=True)
class Step:
    """One change on the path: ``settings`` are ``(option, value)`` pairs of ``mnist_classify.py``'s
    parser (its destinations: ``pin_memory``, ``True``), written as flags by :func:`command_line`."""

    name: str
    change: str
    settings: tuple[tuple[str, Any], ...]


def command_line(settings: dict[str, Any]) -> list[str]:
    """``{"pipeline": "tensor", "pin_memory": True}`` -> ``["--pipeline", "tensor", "--pin-memory"]``,
    from ``mnist_classify.py``'s own parser (a flag it does not have is an error here)."""
    return command_flags(mnist_classify.build_parser(), settings)


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


def from_here(path: Path) -> str:
    """``path`` as the user can type it where they are: relative to the working folder, else absolute."""
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return str(path)


def data_loading_share(lprof_path: str | Path, function: str = "train") -> float:
    """Fraction of ``function``'s profiled time spent on the data-loading line, from a kernprof ``.lprof``.

    Same arithmetic as the "% Time" column of ``python -m line_profiler``: a line's time divided by
    the sum over the function's lines.
    """
    import line_profiler

    stats = line_profiler.load_stats(str(lprof_path))
    for (filename, _first_line, name), lines in stats.timings.items():
        if name != function:
            continue
        total = sum(time for _lineno, _hits, time in lines)
        for lineno, _hits, time in lines:
            if linecache.getline(filename, lineno).strip() == DATA_LOADING_LINE:
                return time / total if total else 0.0
        raise UserError(f"{lprof_path}: {function}() has no line '{DATA_LOADING_LINE}' (was {filename} edited?)")
    raise UserError(f"{lprof_path} holds no timings for a function named {function}(); "
                    "was it made with kernprof -l and the @profile decorator in place?")


def forwarded_flags(args: argparse.Namespace) -> list[str]:
    """The flags every step shares: data, device, length of the run."""
    return command_line({name: getattr(args, name) for name in (
        "device", "seed", "epochs", "dataset", "data_dir", "synthetic_size", "log_interval", "max_steps")})


def run_step(step: Step, flags: list[str], lprof: Path, records_dir: Path) -> tuple[int, list[str]]:
    """Run one step under kernprof, echoing its output; return its exit status and last lines."""
    command = [sys.executable, "-m", "kernprof", "-l", "-o", str(lprof), str(TRAIN_SCRIPT), *flags,
               *command_line({"method": step.name, "results_dir": records_dir})]
    print(f"\n== {step.name}: {step.change}\n$ {' '.join(command)}", flush=True)
    tail: deque[str] = deque(maxlen=15)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        assert process.stdout is not None
        for line in process.stdout:
            print(f"[{step.name}] {line}", end="", flush=True)
            tail.append(line.rstrip())
    return process.returncode, list(tail)


def read_only_record(folder: Path) -> dict[str, Any]:
    files = sorted(folder.glob("*.json"))
    if len(files) != 1:
        raise RuntimeError(f"expected one record in {folder}, found {len(files)}")
    return json.loads(files[0].read_text(encoding="utf-8"))


def markdown_table(rows: list[dict[str, Any]]) -> str:
    def fmt(value: Any, spec: str) -> str:
        return "—" if value is None else format(value, spec)

    lines = ["| step | change | time / epoch (s) | samples/s | speed-up | data-loading line | regime | test accuracy |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for row in rows:
        lines.append(f"| {row['step']} | {row['change']} | {fmt(row['time_per_epoch_s'], '.2f')} | "
                     f"{fmt(row['samples_per_s'], ',.0f')} | {fmt(row['speedup'], '.2f')}× | "
                     f"{fmt(row['share'], '.1%')} | {row['regime'] or '—'} | {fmt(row['test_accuracy'], '.1%')} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_former_names(parser, parser.add_argument(
        "--stages", default=None, help="comma-separated stages of the path to run (baseline, pin-memory, ...); each "
                                       "still gets the flags of every earlier stage (default: all)"), "--steps")
    parser.add_argument("--include-compile", action="store_true",
                        help="add the torch.compile step at the end; slow to compile on CPU (default: off)")
    add_dataset_args(parser)  # the data set of every step
    parser.add_argument("--large-batch-size", type=positive_int, default=256,
                        help="batch of the large-batch step (default: %(default)s)")
    parser.add_argument("--prefetch-factor", type=positive_int, default=4,
                        help="prefetch of the persistent-workers step (default: %(default)s)")
    add_precision_arg(parser, "--amp", choices=("bf16", "fp16"), default="bf16",
                      help="precision of the amp step; fp16 needs a GPU (default: %(default)s)")
    parser.add_argument("--log-interval", type=positive_int, default=10,
                        help="batches between loss lines (default: %(default)s)")
    parser.add_argument("--profile-dir", type=output_dir, default=None,
                        help="where the .lprof of every step is kept (default: RESULTS_DIR/lab02_lprof)")
    add_common_args(parser, epochs=3, batch_size=64)
    return parser


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
    profile_dir = args.profile_dir or args.results_dir / "lab02_lprof"
    profile_dir.mkdir(parents=True, exist_ok=True)
    sweep_id = uuid.uuid4().hex[:8]
    shared = forwarded_flags(args)

    rows: list[dict[str, Any]] = []
    baseline_rate = None
    failures = 0
    with tempfile.TemporaryDirectory(prefix="lab02_sweep_") as scratch:
        settings: dict[str, Any] = {}  # a later step's value of a flag replaces an earlier one's
        for index, step in enumerate(path):
            settings.update(step.settings)
            if step.name not in wanted:
                continue
            lprof = profile_dir / f"{sweep_id}_{index:02d}_{step.name}.lprof"
            records_dir = Path(scratch) / step.name
            flags = [*shared, *command_line(settings)]
            status, tail = run_step(step, flags, lprof, records_dir)
            sweep_info = {"sweep_id": sweep_id, "index": index, "step": step.name, "change": step.change,
                          "step_flags": command_line(dict(step.settings)), "flags": command_line(settings),
                          "lprof": str(lprof), "script": SCRIPT}
            if status != 0:
                failures += 1
                print(f"step {step.name} failed with exit status {status}", file=sys.stderr, flush=True)
                record = make_record(lab="lab02", script="labs/lab02_profiling/mnist_classify.py", method=step.name,
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
            record["config"]["sweep"] = sweep_info  # config.line_profiler is true: all steps pay its overhead
            written = write_record(record, args.results_dir)
            rows.append({"step": step.name, "change": step.change, "time_per_epoch_s": metrics["time_per_epoch_s"],
                         "samples_per_s": metrics["samples_per_s"], "speedup": speedup, "share": share,
                         "regime": metrics.get("regime"), "test_accuracy": metrics.get("test_accuracy")})
            print(f"== {step.name}: {metrics['time_per_epoch_s']:.2f} s/epoch, {metrics['samples_per_s']:.0f} "
                  f"samples/s, data-loading line {share:.1%} of train() | record {written}", flush=True)

    print(f"\nsweep {sweep_id} ({args.dataset}, {args.epochs} epoch(s) per step; provisional on a shared machine)")
    print(markdown_table(rows))
    print(f"line profiles: {profile_dir}/{sweep_id}_*.lprof (python -m line_profiler -rmt FILE)")
    print(f"report: python {from_here(REPORT_SCRIPT)} --results-dir {args.results_dir}")
    return 1 if failures else 0


if __name__ == "__main__":
    run_main(main)
