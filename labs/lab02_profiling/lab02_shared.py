"""What Lab-02's scripts lean on and do not teach: their flags, the checks of flag combinations, the
epochs' bookkeeping and the record of a training run; and, for ``sweep.py``, the reading of a line profile and the
table at the end.

The lessons stay in the scripts: ``mnist_classify.py``'s ``train()`` (the loop kernprof profiles),
``test()``, the data pipeline, the CUDA graph and the floors; ``sweep.py``'s optimisation path and
the kernprof run of every step. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import linecache
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn

from common.cli import (PIPELINES, add_common_args, add_dataset_args, add_former_names, add_log_interval_arg,
                        add_precision_arg, config_dict, output_dir, positive_int)
from common.errors import EXIT_USER_ERROR, UserError, run_main
from common.train.flags import add_adadelta_args
from common.results import make_record, provenance, write_record
from common.units import format_bytes

LAB = "lab02"
TRAIN_SCRIPT = "labs/lab02_profiling/mnist_classify.py"
#: The floors' numbers that are metrics of their own in the record (the rest stay under ``floors``).
FLOOR_METRICS = ("flop_floor_s", "launch_floor_s", "step_time_s", "regime", "kernels_per_step", "achieved_tflops",
                 "mfu")
#: The USC lab's starting point: what ``--method`` defaults to naming "baseline".
USC_CONFIGURATION = {"pipeline": "pil", "num_workers": 1, "batch_size": 64, "pin_memory": False,
                      "persistent_workers": False, "prefetch_factor": None, "channels_last": False,
                      "precision": "fp32", "compile": False, "cuda_graph": False}
#: The line of ``mnist_classify.py``'s ``train()`` that waits for the next batch: the USC lab's 84.5 %.
DATA_LOADING_LINE = "for batch_idx, (data, target) in enumerate(train_loader):"


# --------------------------------------------------------------------------------------------
# mnist_classify.py


def add_train_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every flag of ``mnist_classify.py``: the USC lab's, the optimisation path's (``sweep.py`` turns them
    on one after another), then those every script shares."""
    add_dataset_args(parser)
    parser.add_argument("--test-batch-size", type=positive_int, default=1000,
                        help="evaluation batch (default: %(default)s)")
    add_adadelta_args(parser)
    add_log_interval_arg(parser, unit="batches")
    tuning = parser.add_argument_group("the optimisation path (sweep.py turns these on one after another)")
    tuning.add_argument("--pipeline", choices=PIPELINES, default="pil",
                        help="pil: the USC lab's per-sample PIL transforms; tensor: converted once, one indexing op "
                             "per batch; device: whole set on the device, no DataLoader (default: %(default)s)")
    tuning.add_argument("--pin-memory", action="store_true",
                        help="page-locked host batches for faster, asynchronous copies to the GPU (default: off)")
    tuning.add_argument("--persistent-workers", action="store_true",
                        help="keep DataLoader workers alive between epochs instead of restarting them (default: off)")
    tuning.add_argument("--prefetch-factor", type=positive_int, default=None,
                        help="batches each worker prepares ahead (default: PyTorch's, 2)")
    tuning.add_argument("--channels-last", action="store_true",
                        help="NHWC memory layout for the model and the images (default: off)")
    add_precision_arg(tuning, "--amp")
    tuning.add_argument("--compile", action="store_true",
                        help="torch.compile the model; compile time is measured and recorded separately (default: off)")
    tuning.add_argument("--cuda-graph", action="store_true",
                        help="capture the whole training step once as a CUDA graph and replay it for every full "
                             "batch; on a CPU (or with fp16, --compile) the step runs eagerly and says why "
                             "(default: off)")
    parser.add_argument("--launch-blocking", action="store_true",
                        help="CUDA_LAUNCH_BLOCKING=1: every CUDA call waits for its kernels, so a line profile on a "
                             "GPU shows each line's own GPU time; slower overall (default: off)")
    parser.add_argument("--method", default=None,
                        help="name of this run in its result record (default: 'baseline' for the USC lab's "
                             "configuration, 'workers' for it with more than one worker, else 'custom')")
    add_common_args(parser, epochs=3, batch_size=64, min_workers=1)  # one core: the USC lab's one worker
    return parser


def run_main_profiled(main: Callable[[Any], int | None]) -> NoReturn:
    """``common.errors.run_main(main)``, but under kernprof a refused input (exit status 2) ends the process at
    once, its one line flushed: kernprof writes its ``.lprof`` in a ``finally`` however the script ends, and a bad
    flag value left a profile of nothing (refused input writes nothing)."""
    from line_profiler import profile

    try:
        run_main(main)
    except SystemExit as stop:
        if stop.code == EXIT_USER_ERROR and profile.enabled:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_USER_ERROR)  # past kernprof's finally: no .lprof
        raise


def default_method(args) -> str:
    """``baseline`` for the USC lab's configuration; ``workers`` for it with more DataLoader workers (the
    script's default off a cluster, and the sweep's second step); ``custom`` for anything else."""
    current = {key: getattr(args, key) for key in USC_CONFIGURATION}
    if current == USC_CONFIGURATION:
        return "baseline"
    return "workers" if current == {**USC_CONFIGURATION, "num_workers": current["num_workers"]} and \
        current["num_workers"] > 1 else "custom"


def batch_note(batch_size: int, train_size: int) -> str | None:
    """The note for a batch larger than the training set (a run used to say nothing of its one short step), or
    ``None``. Not refused: it is full-batch training, and a small ``--synthetic-size`` may well ask for it."""
    if batch_size <= train_size:
        return None
    return f"--batch-size {batch_size} is larger than the training set ({train_size} samples): every step trains on " \
           f"those {train_size}, one step per epoch"


def batch_used(batch_size: int, train_size: int) -> int:
    """The samples a step really trains on: ``--batch-size``, or the whole training set where that is smaller
    (:func:`batch_note`). The header prints it and the record keeps it as ``global_batch_size`` (both said
    ``--batch-size``, 4096 for steps of the 1,438 digits)."""
    return min(batch_size, train_size)


def flag_notes(args: argparse.Namespace, device: Any, train_size: int | None = None,
               default_workers: int | None = None) -> list[str]:
    """The flags that change nothing on this device or with these other flags (or, given ``train_size``, do less than
    they say: :func:`batch_note`), each printed as one note. ``default_workers`` is the script's own --num-workers
    default (None: mnist_classify.py's); a flag the script does not offer (profile_trace.py has no
    --launch-blocking or --persistent-workers) is one not given."""
    launch_blocking, persistent, prefetch = (getattr(args, name, None) for name in
                                             ("launch_blocking", "persistent_workers", "prefetch_factor"))
    notes = []
    if train_size is not None and (too_large := batch_note(args.batch_size, train_size)):
        notes.append(too_large)
    if launch_blocking and device.type != "cuda":
        notes.append("--launch-blocking changes nothing on a CPU: CPU operators already run synchronously")
    if args.pin_memory and device.type != "cuda":
        notes.append("--pin-memory ignored: pinning only speeds up copies to a GPU")
    if default_workers is None:
        default_workers = add_train_args(argparse.ArgumentParser()).get_default("num_workers")
    if args.pipeline == "device" and (args.num_workers != default_workers or args.pin_memory or persistent):
        notes.append("--pipeline device has no DataLoader: worker and pinning flags have no effect")
    if args.num_workers == 0 and (persistent or prefetch):
        notes.append("--persistent-workers/--prefetch-factor need --num-workers >= 1: ignored")
    for note in notes:
        print(f"note: {note}", flush=True)
    return notes


def batch_maker(args: argparse.Namespace) -> str:
    """How batches are made, for a run's header: the DataLoader's workers, or ``no DataLoader`` for ``--pipeline
    device`` (its header said "workers 2", the allocation's default, which nothing used)."""
    return "no DataLoader" if args.pipeline == "device" else f"workers {args.num_workers}"


def print_header(args: argparse.Namespace, device: Any, threads: int, sizes: tuple[int, int], *,
                 line_profiler: bool) -> None:
    from common.runtime.device import describe  # imports torch

    print(f"device {describe(device)} | data {args.dataset} train={sizes[0]} test={sizes[1]} | "
          f"pipeline {args.pipeline} | {batch_maker(args)} | batch {batch_used(args.batch_size, sizes[0])} | "
          f"precision {args.precision} | threads {threads} | line profiler {'on' if line_profiler else 'off'}",
          flush=True)


def time_first_call(model: Any, device: Any, args: argparse.Namespace) -> float:
    """Seconds of one forward/backward of a ``torch.compile``d model on a batch of zeros: the compilation.

    Compilation happens at the first call, not at ``torch.compile()``; without this warm-up the
    first epoch would carry it and look slow. The gradients of the warm-up are thrown away. A last,
    smaller batch still triggers one recompilation (dynamic batch size) inside the first epoch.
    """
    import torch
    import torch.nn.functional as F

    from common.runtime.device import synchronize
    from common.train import amp

    data = torch.zeros(args.batch_size, 1, 28, 28, device=device)
    if args.channels_last:
        data = data.contiguous(memory_format=torch.channels_last)
    target = torch.zeros(args.batch_size, dtype=torch.long, device=device)
    synchronize(device)
    start = time.perf_counter()
    with amp.autocast(device, args.precision):
        loss = F.nll_loss(model(data), target)
    loss.backward()
    synchronize(device)
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def measure_floors(args: argparse.Namespace, device: Any, model: Any, step: Callable[[Any], Any], *,
                   in_graph: bool, step_time_s: float) -> dict[str, Any]:
    """The FLOP floor, launch floor and regime of ``step(model)``, printed (``common.measure.floors``); run
    after the last evaluation (the steps it runs change nothing that is reported)."""
    from common.measure import floors

    eager_model = getattr(model, "_orig_mod", model)  # FLOPs of a compiled model: count on the module it wraps
    step_floors = floors.measure_floors(
        lambda: step(model), device, precision=args.precision, step_time_s=step_time_s, in_graph=in_graph,
        flop_step=(lambda: step(eager_model)) if args.compile else None,
        kernels_note="--compile on a CPU: its generated code calls no PyTorch operators to count"
        if args.compile and device.type == "cpu" else "")
    for line in floors.floors_lines(step_floors):
        print(line, flush=True)
    return step_floors


@dataclass
class Epochs:
    """What each epoch of ``train()`` gave: its time, samples, optimiser steps, mean loss and printed losses."""

    times: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)
    logged_losses: list[list[float]] = field(default_factory=list)

    def add(self, seconds: float, samples: int, steps: int, mean_loss: float, logged: list[float]) -> None:
        for values, value in zip((self.times, self.samples, self.steps, self.train_losses, self.logged_losses),
                                 (seconds, samples, steps, mean_loss, logged)):
            values.append(value)

    @property
    def timed(self) -> slice:
        """The first epoch pays for starting workers, allocator growth and (with --compile) one
        recompilation; with more than one epoch it is left out of the throughput."""
        return slice(1, None) if len(self.times) > 1 else slice(None)

    @property
    def step_time_s(self) -> float:
        return sum(self.times[self.timed]) / sum(self.steps[self.timed])


def write_train_record(args: argparse.Namespace, device: Any, threads: int, epochs: Epochs, *, test_loss: float,
                       accuracy: float, memory: dict[str, Any], step_floors: dict[str, Any], graph: Any,
                       blocker: str | None, compile_s: float | None, pin_memory: bool, line_profiler: bool,
                       sizes: tuple[int, int], notes: list[str], energy: dict[str, Any]) -> Path:
    """The run's record (method ``--method``, else ``baseline``/``custom``), then its last two lines."""
    samples_per_s = sum(epochs.samples[epochs.timed]) / sum(epochs.times[epochs.timed])
    headline = {key: step_floors.pop(key) for key in FLOOR_METRICS}  # the rest stays under "floors"
    full_batches = sizes[0] // args.batch_size
    graph_record = {"requested": args.cuda_graph, "captured": graph is not None,
                    "reason": None if graph or not args.cuda_graph else blocker,
                    "capture_s": graph.capture_s if graph else None,
                    "eager_steps": sum(max(0, steps - full_batches) for steps in epochs.steps) if graph else None}
    metrics = {
        "train_loss": epochs.train_losses, "final_loss": epochs.train_losses[-1], "test_loss": test_loss,
        "test_accuracy": accuracy, "epochs": args.epochs, "steps": sum(epochs.steps),
        "logged_loss": epochs.logged_losses, "global_batch_size": batch_used(args.batch_size, sizes[0]),
        "world_size": 1,
        "epoch_time_s": epochs.times, "time_per_epoch_s": statistics.median(epochs.times),
        "samples_per_s": samples_per_s, "compile_s": compile_s, "memory": [memory],
        "cuda_graph": graph_record, **headline, "floors": step_floors,
        "timing_method": "time.perf_counter around train(), device synchronised before each read; the epoch "
                         "includes waiting for the loader; samples/s and step_time_s over epochs 2.. (all when "
                         "only one)",
    }
    config = config_dict(args, resolved_device=str(device), model="mnist_cnn", threads=threads,
                         pin_memory_effective=pin_memory, line_profiler=line_profiler,
                         train_size=sizes[0], test_size=sizes[1])
    record = make_record(lab=LAB, script=TRAIN_SCRIPT, method=args.method or default_method(args), config=config,
                         metrics=metrics, provenance=provenance(device), notes=notes, energy=energy)
    path = write_record(record, args.results_dir)
    print(f"final: accuracy {100 * accuracy:.2f}% | time per epoch {metrics['time_per_epoch_s']:.2f} s | "
          f"{samples_per_s:.0f} samples/s | peak memory {format_bytes(memory['peak_bytes'])} ({memory['source']})")
    print(f"record: {path}")
    return path


# --------------------------------------------------------------------------------------------
# sweep.py


def add_sweep_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every flag of ``sweep.py``: which stages, what the later stages use, where the profiles go."""
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
    add_log_interval_arg(parser, unit="batches")
    parser.add_argument("--profile-dir", type=output_dir, default=None,
                        help="where the .lprof of every step is kept (default: RESULTS_DIR/lab02_lprof)")
    add_common_args(parser, epochs=3, batch_size=64, min_workers=1)  # the workers step: never fewer than baseline's
    return parser


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
        total = sum(spent for _lineno, _hits, spent in lines)
        for lineno, _hits, spent in lines:
            if linecache.getline(filename, lineno).strip() == DATA_LOADING_LINE:
                return spent / total if total else 0.0
        raise UserError(f"{lprof_path}: {function}() has no line '{DATA_LOADING_LINE}' (was {filename} edited?)")
    raise UserError(f"{lprof_path} holds no timings for a function named {function}(); "
                    "was it made with kernprof -l and the @profile decorator in place?")


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
