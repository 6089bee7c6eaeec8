"""What ``benchmark_models.py`` leans on and does not teach: its flags and launch, the FLOP count, the
rules and tables of its results, and what it writes.

The benchmark script shows the measuring: what a precision changes (weights, TF32, autocast), the
timed training and inference loops, the loss check against fp32, DDP. Here:

- :func:`add_benchmark_args`, :func:`read_args`, :func:`check_request` and :func:`run_under_torchrun`: the flags
  (the SJTU page's among them), their checks, and ``-g N`` run as ``torchrun --nproc_per_node=N``.
- :func:`unsupported_reason`, which says why a precision of :data:`common.cli.BENCHMARK_PRECISIONS`
  cannot run on a device (the reason goes into the CSV summary and the record).
- :func:`count_flops`: a model's FLOPs per batch, counted on the ``meta`` device, for the MFU.
- :func:`launch_bound_line`, which says when the runs are far below the GPU's datasheet peak
  (``common.precision``, where every lab gets its peaks and MFU).
- :func:`compare_losses`: the correctness check of a precision against fp32, its threshold, and how
  many skipped GradScaler steps it waits through.
- :func:`compile_fresh` and :func:`compile_outcome`: ``--compile`` with a compile budget of its own
  per configuration, and whether it really compiled.
- :func:`csv_name`, :func:`iterations_csv`, :func:`summary_csv`: the CSV layout of the SJTU page's
  ``benchmark_models.py`` (one file per mode and precision, a column per model, a row per
  iteration, milliseconds per batch), plus one summary file that also lists what was skipped.
- :class:`Output`: what a run writes and prints from what it measured (a record per result, those
  CSVs, a line per result and the SJTU page's table at the end), on rank 0 only.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import re
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F

from common import precision as precisions
from common.atomic import write_text_atomic
from common.cli import (BENCHMARK_MODES as MODES, BENCHMARK_PRECISIONS as PRECISIONS, add_former_names, add_run_args,
                        config_dict, non_negative_int, output_dir, positive_float, positive_int, unknown_names)
from common.errors import UserError, run_attached, sigterm_raises
from common.models import build_model, check_image_input, logits, zoo_models
from common.runtime.device import describe, resolve_device
from common.runtime.machine import cpu_description
from common.train.amp import announce_bf16_emulation
from common.results import cpu_model_name, fp32_math_info, make_record, provenance, write_record
from common.units import format_bytes
from common.runtime.compat import RECOMPILE_LIMIT_HIT

LAB = "lab03"
SCRIPT = "labs/lab03_precision_benchmark/benchmark_models.py"

#: The models of the SJTU page's table, in its order.
SJTU_MODELS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d",
               "resnext101_32x8d", "wide_resnet50_2", "wide_resnet101_2")
#: ImageNet's classes, as the SJTU page's models had.
NUM_CLASSES = 1000
#: The optimiser's momentum, for the check and the timed training (SGD, as the SJTU page's training).
MOMENTUM = 0.9


#: A precision is flagged when its loss after the check steps is off fp32's by more than this
#: fraction of the initial loss (or is NaN/inf). Why 5%: bfloat16 keeps 8 significant bits (a
#: rounding error of up to 0.4% per operation) and float16 11; on ResNets at 224x224 the healthy
#: precisions land within about 1% of fp32 after three SGD steps (lab README, "Correctness").
#: A precision that breaks training is much further off: gradients that underflow to zero leave the
#: loss at its start, overflow gives inf or NaN. The initial loss (about ln 1000 = 6.9 at random
#: initialisation) is the scale, not the final loss: that one tends to zero as the steps fit the one
#: batch, and a ratio to a number near zero makes harmless rounding look large.
DEFAULT_LOSS_TOLERANCE = 0.05
#: How many skipped steps the check waits through. amp-fp16's GradScaler starts at a scale of 2**16
#: and halves it at every step whose scaled gradients overflow float16 (the step is skipped and the
#: weights stay put): after 16 skips it scales by 1, not at all, and gradients that still overflow do
#: so in float16 itself, which more attempts cannot mend. On an H100 ResNet-50 at batch 12 skipped 4.
MAX_SKIPPED_CHECK_STEPS = 16
#: Below this share of the GPU's peak a run is launch-bound: its kernels are too small to fill the
#: GPU, which spends the step waiting on one launch after another (on an H100, ResNet-50 at batch 12
#: reaches 1-3% of the tensor-core peak; a matmul of 8192x8192 matrices reaches about 75%).
LAUNCH_BOUND_FRACTION = 0.05
#: The largest image a --dry-run measures: every model and precision runs, as a check of the paths, not a figure.
#: On a 2-core CPU (AMD EPYC VM, 2026-11-28) a dry run at 224x224 had measured two of the nine models after 12
#: minutes; at 64x64 it took 14 (fp64 and emulated half cost most), no precision flagged. At 32x32, or at a batch of
#: 2, a few SGD steps are chaotic: the loss check flagged even fp64.
DRY_RUN_IMAGE_SIZE = 64


# --------------------------------------------------------------------------------------------
# Flags and the launch


def add_benchmark_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The SJTU page's flags, what to measure, the correctness check, then ``common.cli.add_run_args``."""
    sjtu_flags = parser.add_argument_group("the SJTU page's flags")
    sjtu_flags.add_argument("--folder", type=output_dir, default=argparse.SUPPRESS,  # read_args fills it in
                            help="folder for the CSV files (default: RESULTS_DIR/lab03_csv, beside the records)")
    sjtu_flags.add_argument("-w", "--warmup", type=non_negative_int, default=10,
                            help="iterations run but not timed: cuDNN autotuning, allocator growth, torch.compile")
    add_former_names(sjtu_flags, sjtu_flags.add_argument("-n", "--repeats", type=positive_int, default=20,
                                                         help="timed iterations per model, mode and precision"),
                     "--num-iters")
    sjtu_flags.add_argument("-b", "--batch-size", type=positive_int, default=12,
                            help="images per iteration on each process")
    sjtu_flags.add_argument("-g", "--num-gpus", type=positive_int, default=1,
                            help="processes, one per GPU, training with DDP: above 1 this command runs under torchrun "
                                 "--nproc_per_node=N (on a CPU: Gloo processes); under torchrun or srun leave it out")
    what = parser.add_argument_group("what to measure")
    what.add_argument("--models", default=", ".join(SJTU_MODELS),
                      help="comma-separated torchvision classification models; the default is the SJTU page's nine")
    what.add_argument("--modes", default=", ".join(MODES), help="train, inference or both")
    add_former_names(what, what.add_argument("--precision", default=", ".join(PRECISIONS),
                                             help="comma-separated, any of the default's"), "--precisions")
    what.add_argument("--image-size", type=positive_int, default=224,
                      help="side of the square input images; tiny runs use 32-64")
    what.add_argument("--channels-last", action="store_true", help="NHWC memory format (tensor cores prefer it)")
    what.add_argument("--compile", action="store_true", help="torch.compile the model; it compiles in the warm-up")
    check = parser.add_argument_group("correctness check against fp32")
    check.add_argument("--check-steps", type=positive_int, default=3,
                       help="training steps from the same weights on the same batch")
    check.add_argument("--loss-tolerance", type=positive_float, default=DEFAULT_LOSS_TOLERANCE,
                       help="flag a precision whose loss after the check steps is off fp32's by more than this "
                            "fraction of the initial loss")
    check.add_argument("--lr", type=positive_float, default=0.01,
                       help=f"SGD learning rate (momentum {MOMENTUM}) for the check and the timed training")
    side = DRY_RUN_IMAGE_SIZE
    add_run_args(parser, dry_run=f"-w 1 -n 2 --check-steps 2, images at most {side}x{side}: checks that every "
                                 "model and precision runs (a 2-core CPU takes about 14 min for the nine models, fp64 "
                                 "and half most of it; --models resnet18 checks one)")
    return parser


def read_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; ``--dry-run`` shortens the run; the comma lists become checked lists."""
    args = parser.parse_args(argv)
    args.folder = getattr(args, "folder", None) or args.results_dir / "lab03_csv"  # wherever the command is typed
    if args.dry_run:
        args.warmup, args.repeats, args.check_steps = 1, 2, 2
        args.image_size = min(args.image_size, DRY_RUN_IMAGE_SIZE)
    args.models = parse_list(args.models, zoo_models(), "models")
    args.modes = parse_list(args.modes, MODES, "modes")
    args.precision = parse_list(args.precision, tuple(PRECISIONS), "precisions")
    return args


def check_request(args: argparse.Namespace, launch: Any) -> bool:
    """What ends in one line, said before the FLOP count (seconds for the default models): ``-g`` against the
    launcher (``launch``: ``common.runtime.launch.detect_launch()``), or from a plain ``python`` against the GPUs
    or the memory; on a CPU, that a precision asked for runs there. Starts nothing on a GPU. True: ``-g N`` from a
    plain ``python``, for :func:`run_under_torchrun`."""
    check_num_gpus(args, launch)
    relaunch = launch.world_size == 1 and args.num_gpus > 1
    device = resolve_device(args.device, local_world_size=args.num_gpus if relaunch else None, start=False)
    if device.type == "cpu":
        if args.device == "auto" and args.image_size > DRY_RUN_IMAGE_SIZE and launch.rank == 0:  # a GPU command
            print(f"note: no GPU visible: this benchmarks the CPU, {len(args.models)} model(s) at {args.image_size}x"
                  f"{args.image_size} (hours for the nine at 224); --dry-run checks every path in minutes", flush=True)
        if relaunch:
            check_processes_fit(args.num_gpus)
        runnable_precisions(args.precision, "cpu", cpu_model_name(), None)
    return relaunch


def run_under_torchrun(args: argparse.Namespace, argv: list[str], script_file: str) -> int:
    """The SJTU page's ``-g N`` from a plain ``python`` (checked by :func:`check_request`): torchrun starts the N
    processes, as for every distributed script of the course, and the command is printed, so it can be typed
    directly next time. This process starts nothing on a GPU: it only waits for torchrun."""
    script = sys.argv[0] if Path(sys.argv[0]).resolve() == Path(script_file).resolve() else script_file  # as typed
    torchrun = ["--standalone", f"--nproc_per_node={args.num_gpus}", script, *argv]
    print(f"-g {args.num_gpus}: running torchrun {shlex.join(torchrun)}", flush=True)
    # Share this process's threads (OMP_NUM_THREADS, the Slurm allocation) out among the N processes.
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, torch.get_num_threads() // args.num_gpus))}
    # python -m torch.distributed.run is torchrun, from this Python's environment. kill (SIGTERM) stops torchrun
    # too, which stops its processes, rather than leave them benchmarking on alone.
    with sigterm_raises():
        return run_attached([sys.executable, "-m", "torch.distributed.run", *torchrun], env=env)


def check_processes_fit(processes: int, available: int | None = None, each: int | None = None) -> None:
    """``-g N`` on a CPU: N processes, each at least as large as this one is now (PyTorch imported), must fit in the
    memory the machine has available (``MemAvailable``), or the run would end in the kernel's OOM killer (or a
    laptop swapping for minutes). Linux only: where either number cannot be read, nothing is checked."""
    from common.measure.timing import process_rss_bytes

    if available is None:
        try:
            available = 1024 * int(re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)[1])
        except (OSError, TypeError):
            return
    each = process_rss_bytes() if each is None else each
    if each and processes * each > available:
        raise UserError(f"-g {processes} on the CPU: {processes} processes of at least {format_bytes(each)} each "
                        f"(PyTorch alone) need {format_bytes(processes * each)}, and this machine has "
                        f"{format_bytes(available)} available: at most {max(1, available // each)} fit")


def check_num_gpus(args: argparse.Namespace, launch: Any) -> None:
    """Under a launcher (``launch``: ``common.runtime.launch.detect_launch()``), ``-g`` is left out or agrees
    with it."""
    if launch.world_size > 1 and args.num_gpus not in (1, launch.world_size):
        raise UserError(f"-g {args.num_gpus} but {launch.launcher} started {launch.world_size} processes; "
                        "under a launcher leave -g out")


def fixed_batch(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of random images and ImageNet labels from ``--seed``: the same for every model and precision."""
    generator = torch.Generator().manual_seed(args.seed)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator).to(device)
    labels = torch.randint(0, NUM_CLASSES, (args.batch_size,), generator=generator).to(device)
    return images, labels


def parse_list(text: str, valid: Sequence[str], what: str) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``, each checked against ``valid`` (order kept, repeats dropped)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise UserError(f"no {what} given; choose from: {', '.join(valid)}")
    unknown = [name for name in names if name not in valid]
    if unknown:  # "fp16" is two rows here: half or amp-fp16
        raise UserError(unknown_names(what, unknown, list(valid), same=precisions.normalise))
    return list(dict.fromkeys(names))


# --------------------------------------------------------------------------------------------
# What a precision can run, and how many FLOPs a model does


def runnable_precisions(asked: Sequence[str], device_type: str, device_name: str,
                        capability: tuple[int, int] | None) -> dict[str, str | None]:
    """:func:`unsupported_reason` of each precision ``asked``; one error line when none of them runs here."""
    reasons = {precision: unsupported_reason(precision, device_type, device_name, capability) for precision in asked}
    if all(reasons.values()):  # nothing would be measured: say so before a file is written
        raise UserError(f"no precision asked for runs on {device_name}: "
                        + "; ".join(f"{precision}: {reason}" for precision, reason in reasons.items())
                        + " (--precision fp32 runs everywhere)")
    return reasons


def unsupported_reason(precision: str, device_type: str, device_name: str = "",
                       capability: tuple[int, int] | None = None) -> str | None:
    """Why ``precision`` cannot run on this device, or ``None`` when it can.

    ``capability`` is the CUDA compute capability (``(8, 0)`` for an A100). Float16 on a CPU does
    run (recent PyTorch has CPU kernels for it), but a CPU without float16 arithmetic converts to
    float32 inside each kernel, so it is measured and expected to be slower than fp32.
    """
    if precision not in PRECISIONS:
        raise UserError(f"unknown precision {precision!r}; valid precisions: {', '.join(PRECISIONS)}")
    if device_type == "cpu":
        if precision == "tf32":
            return "TF32 is a tensor-core format of NVIDIA GPUs from Ampere (sm_80) on; CPUs have no TF32 mode"
        if precision == "amp-fp16":
            return ("amp-fp16 (float16 autocast + GradScaler) is the CUDA recipe; common.train.amp runs fp16 autocast "
                    "on CUDA only. On a CPU use amp-bf16, which needs no scaler")
        return None
    if device_type == "cuda" and precisions.gpu_support("bf16", capability) == "emulated":
        arch = f"sm_{capability[0]}{capability[1]}"
        name = f"{device_name} ({arch})" if device_name else arch
        if precision == "tf32":
            return f"TF32 tensor cores arrived with Ampere (sm_80); on {name} tf32 would be plain fp32"
        if precision == "amp-bf16":
            return f"{name} has no bfloat16 tensor cores (Ampere, sm_80, added them); PyTorch would emulate bf16 slowly"
    return None








def count_flops(model_name: str, batch_size: int, image_size: int) -> dict[str, int]:
    """FLOPs of one batch per mode, counted once per model and shape, on the ``meta`` device.

    Meta tensors have shapes but no data: nothing is computed or allocated. FlopCounterMode counts
    the matrix maths (convolutions, matmuls: 2 FLOPs per multiply-add), not element-wise work such
    as BatchNorm or ReLU, so the achieved TFLOP/s compares with the tensor-core peaks. A shape the
    model cannot take is one line first (``common.models.check_image_input``, as Chapter 16's benchmark checks it),
    before anything is timed.
    """
    from torch.utils.flop_counter import FlopCounterMode  # PyTorch >= 2.1: imported after common's version check

    check_image_input(model_name, batch_size, 3, image_size, NUM_CLASSES)
    with torch.device("meta"):
        model = build_model(model_name, num_classes=NUM_CLASSES)
        images = torch.empty(batch_size, 3, image_size, image_size)
        labels = torch.zeros(batch_size, dtype=torch.long)
    train = FlopCounterMode(display=False)
    with train:
        F.cross_entropy(logits(model.train()(images)), labels).backward()
    inference = FlopCounterMode(display=False)
    with inference, torch.no_grad():
        model.eval()(images)
    return {"train": train.get_total_flops(), "inference": inference.get_total_flops()}


def launch_bound_line(rows: Sequence[Mapping[str, Any]], batch_size: int) -> str | None:
    """One line naming the results below :data:`LAUNCH_BOUND_FRACTION` of the GPU's peak, and the remedy.

    ``rows`` are the summary rows; one without an ``mfu`` (a CPU, a GPU not in the table) says
    nothing: there is no peak to be far from.
    """
    known = [row for row in rows if row.get("mfu") is not None]
    low = sorted((row for row in known if row["mfu"] < LAUNCH_BOUND_FRACTION), key=lambda row: row["mfu"])
    if not low:
        return None
    worst = low[0]
    return (f"launch-bound: {len(low)} of {len(known)} results below {LAUNCH_BOUND_FRACTION:.0%} of the GPU's peak "
            f"(lowest: {worst['model']} {worst['mode']} {worst['precision']}, {worst['mfu']:.1%}); at "
            f"batch {batch_size} the GPU waits on many small kernel launches: raise -b (256 fills an H100 with "
            "ResNet-50), or cut the launches: --compile fuses kernels, and CUDA graphs (torch.compile "
            "mode='reduce-overhead') replay a whole step as one launch")


# --------------------------------------------------------------------------------------------
# Correctness against fp32


def compare_losses(losses: Sequence[float], reference: Sequence[float], tolerance: float = DEFAULT_LOSS_TOLERANCE,
                   *, attempts: int | None = None, skipped_steps: int = 0) -> dict[str, Any]:
    """Compare a precision's loss with fp32's after the same number of *applied* optimiser steps.

    ``losses[k]`` and ``reference[k]`` are the losses on the check batch after k steps that updated
    the weights (same initial weights, same batch). fp32 applies every step; amp-fp16's GradScaler
    skips a step whose scaled gradients overflow, leaving the weights as they were, so comparing after
    the same number of *attempted* steps would set an untrained model against a trained one.
    ``attempts`` and ``skipped_steps`` say how the check got there; ``losses`` is shorter than
    ``reference`` when it gave up after :data:`MAX_SKIPPED_CHECK_STEPS` skips.

    ``verdict``: ``diverged`` when a loss is NaN/inf or ``relative_diff`` (``|loss - fp32 loss| /
    fp32's first loss``; :data:`DEFAULT_LOSS_TOLERANCE` says why the first) exceeds ``tolerance``;
    ``inconclusive`` when no step was applied though more were asked (the weights never moved: there
    is no training to compare); else ``agrees``. ``diverged`` is true for the first only; ``reason`` says why.
    """
    steps = len(losses) - 1  # applied optimiser steps before the compared loss
    attempts = len(losses) if attempts is None else attempts
    loss, ref_loss, scale = losses[-1], reference[steps], abs(reference[0]) or 1.0
    result: dict[str, Any] = {"check_steps": len(reference), "attempts": attempts,
                              "applied_steps": attempts - skipped_steps, "skipped_steps": skipped_steps,
                              "compared_after_steps": steps, "losses": list(losses), "fp32_losses": list(reference),
                              "loss": loss, "fp32_loss": ref_loss, "tolerance": tolerance, "abs_diff": None,
                              "relative_diff": None, "verdict": "agrees", "diverged": False, "reason": ""}
    if not all(math.isfinite(v) for v in losses):
        result.update(verdict="diverged", diverged=True, reason="loss became NaN or inf")
        return result
    if steps == 0 and len(reference) > 1:
        result.update(verdict="inconclusive", reason=(f"GradScaler skipped all {attempts} attempted steps: the weights "
                                                      "never moved, so there is no training to compare with fp32's"))
        return result
    result["abs_diff"] = abs(loss - ref_loss)
    result["relative_diff"] = result["abs_diff"] / scale
    if result["relative_diff"] > tolerance:
        result.update(verdict="diverged", diverged=True,
                      reason=(f"loss after {steps} applied steps is {loss:.4g}, fp32's is {ref_loss:.4g}: "
                              f"{result['relative_diff']:.1%} of the initial loss, over the {tolerance:.0%} tolerance"))
    return result


# --------------------------------------------------------------------------------------------
# --compile: did it really compile?

def compile_fresh(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile(model)`` after resetting dynamo, so this configuration gets its own compile budget.

    The ResNet family shares ``ResNet.forward``: without a reset, the models x precisions x modes of
    one run are all recompilations of that one function, and past dynamo's recompile limit (8) the rest
    silently run eager while labelled compiled (``TORCH_LOGS=recompiles`` shows it, and ``compile_outcome``).
    """
    from torch._dynamo.utils import counters  # PyTorch >= 2.0: imported after common's version check

    torch._dynamo.reset()
    counters.clear()
    return torch.compile(model)


def compile_outcome(counters: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    """Did the configuration just timed run compiled? From dynamo's counters (``torch._dynamo.utils.counters``,
    cleared before it compiled): the graphs dynamo captured, and how often it hit its recompile limit."""
    graphs = int(counters["stats"]["unique_graphs"])
    limit_hits = sum(count for reason, count in counters["unimplemented"].items() if RECOMPILE_LIMIT_HIT.search(reason))
    return {"compiled": graphs > 0 and limit_hits == 0, "graphs": graphs, "recompile_limit_hits": limit_hits}


# --------------------------------------------------------------------------------------------
# CSV output


def device_tag(device_type: str, device_name: str, world_size: int) -> str:
    """The SJTU page's file-name prefix, ``<device name>_<N>_gpus`` (``cpu_<N>_procs`` on a CPU)."""
    if device_type != "cuda":
        return f"cpu_{world_size}_procs"
    slug = re.sub(r"[^A-Za-z0-9.-]+", "-", device_name).strip("-") or "cuda"
    return f"{slug}_{world_size}_gpus"


def csv_name(tag: str, precision: str, mode: str) -> str:
    """``<tag>_<precision>_model_<mode>_benchmark.csv``, as the SJTU page names its files."""
    return f"{tag}_{precision}_model_{mode}_benchmark.csv"


def iterations_csv(ms_by_model: Mapping[str, Sequence[float]]) -> str:
    """The SJTU page's layout: one column per model, one row per timed iteration, ms per batch."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    models = list(ms_by_model)
    writer.writerow(models)
    rows = max((len(v) for v in ms_by_model.values()), default=0)
    for i in range(rows):
        writer.writerow([f"{ms_by_model[m][i]:.4f}" if i < len(ms_by_model[m]) else "" for m in models])
    return out.getvalue()


SUMMARY_COLUMNS = ("mode", "precision", "model", "status", "ms_per_batch_median", "ms_per_batch_mean",
                   "ms_per_batch_std", "samples_per_s", "achieved_tflops", "peak_tflops", "mfu",
                   "check_loss", "fp32_check_loss", "loss_relative_diff", "check_applied_steps",
                   "check_skipped_steps", "check_verdict", "diverged", "reason")


def summary_csv(rows: Iterable[Mapping[str, Any]]) -> str:
    """One row per model, mode and precision that was asked for, with the skipped ones and why."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=SUMMARY_COLUMNS, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: _cell(row.get(key)) for key in SUMMARY_COLUMNS})
    return out.getvalue()


Times = dict[tuple[str, str], dict[str, list[float]]]  # (mode, precision) -> model -> ms per timed iteration


def earlier_results(folder: Path, tag: str) -> tuple[list[dict[str, str]], Times]:
    """What an earlier run left in ``folder`` under ``tag``: its summary rows and its per-iteration times. A run
    adds its models to these files instead of overwriting them (one job per model into one folder is the usual
    way past a time limit); a file it cannot read back is one error line, before anything is written."""
    summary, path = folder / f"{tag}_summary.csv", None
    times: Times = {}
    try:
        rows = list(csv.DictReader(io.StringIO(summary.read_text(encoding="utf-8")))) if summary.is_file() else []
        for mode, precision in {(row["mode"], row["precision"]) for row in rows}:
            path = folder / csv_name(tag, precision, mode)
            if path.is_file():
                columns = list(csv.reader(io.StringIO(path.read_text(encoding="utf-8"))))
                times[(mode, precision)] = {model: [float(r[i]) for r in columns[1:] if i < len(r) and r[i]]
                                            for i, model in enumerate(columns[0] if columns else [])}
    except (KeyError, ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{path or summary} is not a CSV this script wrote ({type(err).__name__}: {err}): move it "
                        "away or give another --folder") from None
    return rows, times


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


# --------------------------------------------------------------------------------------------
# What a run writes and prints


class Output:
    """What a run writes, on rank 0 only: a record per result, the SJTU page's CSVs, the summary CSV, the table.

    ``ctx`` is the run's ``common.runtime.distributed.DistContext``, each ``timer`` a
    ``common.measure.timing.StepTimer`` that has timed one model, mode and precision. The device's name comes
    from the records' provenance.
    """

    def __init__(self, args: argparse.Namespace, ctx: Any) -> None:
        self.args, self.ctx, self.device = args, ctx, ctx.device
        distributed = {"distributed": ctx.describe()} if ctx.world_size > 1 else None
        self.provenance = provenance(self.device, ctx.world_size, distributed)
        self.device_name = self.provenance["device"]["name"]
        self.tag = device_tag(self.device.type, self.device_name, ctx.world_size)
        self.ms_by_run: dict[tuple[str, str], dict[str, list[float]]] = {}
        self.rows: list[dict[str, Any]] = []
        self.records = self.failures = self.results = 0
        self.plan: list[tuple[str, str]] = []  # (model, precision) in the order they run, set by start()
        self.in_csvs: set[str] = set()  # the models of this run whose results the CSVs hold
        self._said = time.monotonic()  # when the last line was printed
        # What an earlier run wrote into --folder: kept, but for the models this run measures again.
        self.earlier_rows, self.earlier_ms = earlier_results(args.folder, self.tag) if ctx.is_main else ([], {})

    #: Seconds without a printed line after which rank 0 says what it is still measuring (half precision on a CPU
    #: without float16 arithmetic takes seconds per iteration: a tiny run would otherwise sit silent for a minute).
    QUIET_S = 30.0

    def __enter__(self) -> "Output":
        self._said, self._done = time.monotonic(), threading.Event()
        self._thread = threading.Thread(target=self._still_measuring, name="lab03-progress", daemon=True)
        if self.ctx.is_main:
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, *_exc: Any) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        if kind is KeyboardInterrupt and self.ctx.is_main:  # what a stopped run kept, and how to measure the rest
            kept = [model for model in self.args.models if model in self.in_csvs]
            rest = [model for model in self.args.models if model not in self.in_csvs]
            self.print(f"stopped: {self.records} record(s) in {self.args.results_dir}; the CSVs in {self.args.folder} "
                       f"hold {', '.join(kept) or 'none of this run'}; to measure the rest: --models {','.join(rest)}")

    def _still_measuring(self) -> None:
        while not self._done.wait(min(self.QUIET_S / 3, 5.0)):
            quiet = time.monotonic() - self._said
            if quiet >= self.QUIET_S and self.plan:
                model, precision = self.plan[min(self.results // len(self.args.modes), len(self.plan) - 1)]
                self.print(f"  ... still measuring {model} at {precision}: {quiet:.0f} s since the last line")

    def print(self, line: str) -> None:
        self._said = time.monotonic()
        if self.ctx.is_main:
            print(line, flush=True)

    def _record(self, mode: str, precision: str, model: str | None, metrics: dict[str, Any], *,
                status: str = "ok", notes: list[str], energy: dict[str, Any] | None = None) -> None:
        if not self.ctx.is_main:
            return
        args, world = self.args, self.ctx.world_size
        config = config_dict(args, model=model, mode=mode, precision=precision, precision_meaning=PRECISIONS[precision],
                             resolved_device=str(self.device), parallel="ddp" if world > 1 else "none",
                             world_size=world, global_batch_size=args.batch_size * world,
                             image_shape=[3, args.image_size, args.image_size], num_classes=NUM_CLASSES,
                             optimizer=f"SGD(lr={args.lr}, momentum={MOMENTUM})")
        # The fp32 maths changes with the precision (TF32 on for the tf32 rows only): read it per record.
        write_record(make_record(lab=LAB, script=SCRIPT, method=f"{mode}-{precision}", status=status, notes=notes,
                                 config=config, metrics={"world_size": world, **metrics},
                                 provenance={**self.provenance, "fp32_math": fp32_math_info(self.device)},
                                 energy=energy), args.results_dir)
        self.records += 1

    def start(self) -> list[str]:
        """Say what runs; return the precisions this device can run (:meth:`runnable`)."""
        args, world = self.args, self.ctx.world_size
        self.print(f"lab03 precision benchmark | {describe(self.device)} | {world} process(es)"
                   f"{' with DDP' if world > 1 else ''} | batch {args.batch_size} per process, "
                   f"{args.image_size}x{args.image_size} | warm-up {args.warmup}, timed {args.repeats}")
        capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        return self.runnable(capability)

    def runnable(self, capability: tuple[int, int] | None) -> list[str]:
        """The precisions asked for that this device can run (``capability``: CUDA's, else ``None``).

        Each of the others is printed with the reason and written as one ``skipped`` record per mode
        (the reason is the device's, not a model's) and as rows of the summary CSV.
        """
        reasons = runnable_precisions(self.args.precision, self.device.type, self.device_name, capability)
        runnable = [precision for precision, reason in reasons.items() if reason is None]
        self.plan = [(model, precision) for model in self.args.models for precision in runnable]
        for precision, reason in reasons.items():
            if reason is None:
                announce_bf16_emulation(precision, self.device)  # one line where the CPU has no bf16 units
                if precision == "half" and self.device.type == "cpu" and cpu_description()["fp16"] != "native":
                    self.print("half on this CPU: it has no float16 arithmetic, so every kernel converts to float32 "
                               "and back; expect seconds per training iteration (leave half out of --precision to "
                               "skip it)")
                continue
            self.print(f"skipping {precision}: {reason}")
            for mode in self.args.modes:
                self._record(mode, precision, None, {"skip_reason": reason}, status="skipped", notes=[reason])
                self.rows += [{"mode": mode, "precision": precision, "model": model, "status": "skipped",
                               "reason": reason} for model in self.args.models]
        return runnable

    def failed(self, model: str, modes: Sequence[str], precision: str, err: Exception) -> None:
        """``model`` at ``precision`` raised ``err`` (out of memory, no kernel for a dtype) before ``modes`` ran."""
        reason = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        for mode in modes:
            self.failures, self.results = self.failures + 1, self.results + 1
            self.print(f"{model:<18} {mode:<9} {precision:<9} FAILED: {reason}")
            self._record(mode, precision, model, {}, status="failed", notes=[reason])
            self.rows.append({"mode": mode, "precision": precision, "model": model, "status": "failed",
                              "reason": reason})

    def measured(self, model: str, mode: str, precision: str, timer: Any, memory: dict[str, Any],
                 check: dict[str, Any], flops: int, compilation: dict[str, Any] | None = None, *,
                 energy: dict[str, Any] | None = None) -> None:
        """One result: ``energy`` is ``common.measure.energy.EnergyMeter.result()`` over its warm-up and timed
        iterations."""
        world, self.results = self.ctx.world_size, self.results + 1
        step_time = timer.summary()
        ms = {key: step_time[f"{key}_s"] * 1000 for key in ("median", "mean", "std", "min", "max")}
        # Per device: each process ran its own batch. No MFU where no peak is known: mfu_reason says why.
        speed = precisions.utilisation(flops / step_time["median_s"], self.device, precision)
        achieved, peak, fraction = speed["achieved_tflops"], speed["peak_tflops"], speed["mfu"]
        metrics = {
            "ms_per_batch": ms,
            "ms_per_batch_samples": [t * 1000 for t in timer.times],
            "samples_per_s": step_time["samples_per_s"] * world,  # rank 0's rate; every rank ran a batch
            "global_batch_size": self.args.batch_size * world,
            "step_time": step_time,
            "flops_per_batch": flops,
            **speed,
            "launch_bound": None if fraction is None else fraction < LAUNCH_BOUND_FRACTION,
            "loss_check": check,
            "loss_diff_vs_fp32": check["abs_diff"],
            "loss_relative_diff_vs_fp32": check["relative_diff"],
            "diverged": check["diverged"],
            "memory": [memory],
            "compile": compilation,
        }
        eager = compilation is not None and not compilation["compiled"]
        # How the clock was read is in metrics.step_time.method; notes are for what needs attention.
        notes = [f"{world} DDP processes: the times are rank 0's"] if world > 1 else []
        if check["verdict"] != "agrees":
            notes.append(f"{check['verdict'].upper()}: {check['reason']}")
        if eager:
            notes.append(f"NOT COMPILED: --compile was given but dynamo captured {compilation['graphs']} graph(s) "
                         f"and hit its recompile limit {compilation['recompile_limit_hits']} time(s): these times are "
                         "eager")
        if check["skipped_steps"] and check["verdict"] != "inconclusive":
            notes.append(f"GradScaler skipped {check['skipped_steps']} of the {check['attempts']} attempted check "
                         "steps (inf/NaN gradients at its scale, which it then halved): the loss is compared with "
                         f"fp32's after the same number of applied steps ({check['compared_after_steps']})")
        if metrics["launch_bound"]:
            notes.append(f"launch-bound: {fraction:.1%} of the {peak:g} TFLOP/s peak, below "
                         f"{LAUNCH_BOUND_FRACTION:.0%}: raise -b, or cut the kernel launches (--compile, CUDA graphs)")
        if precision == "half" and self.device.type == "cpu" and cpu_description()["fp16"] != "native":
            notes.append("float16 on a CPU without float16 arithmetic is converted to float32 inside each kernel: "
                         "expect it slower than fp32")
        self._record(mode, precision, model, metrics, notes=notes, energy=energy)
        self.ms_by_run.setdefault((mode, precision), {})[model] = metrics["ms_per_batch_samples"]
        self.rows.append({"mode": mode, "precision": precision, "model": model, "status": "ok",
                          "ms_per_batch_median": ms["median"], "ms_per_batch_mean": ms["mean"],
                          "ms_per_batch_std": ms["std"], "samples_per_s": metrics["samples_per_s"],
                          "achieved_tflops": achieved, "peak_tflops": peak, "mfu": fraction,
                          "check_loss": check["loss"], "fp32_check_loss": check["fp32_loss"],
                          "loss_relative_diff": check["relative_diff"], "check_applied_steps": check["applied_steps"],
                          "check_skipped_steps": check["skipped_steps"], "check_verdict": check["verdict"],
                          "diverged": check["diverged"], "reason": check["reason"]})
        relative = "—" if check["relative_diff"] is None else f"{check['relative_diff']:.2%}"
        share = f" = {fraction:.0%} of {peak:g}" if peak else ""
        skipped = f", {check['skipped_steps']} step(s) skipped" if check["skipped_steps"] else ""
        verdict = f"  {check['verdict'].upper()}" if check["verdict"] != "agrees" else ""
        self.print(f"{model:<18} {mode:<9} {precision:<9} {ms['median']:9.2f} ms/batch (mean {ms['mean']:.2f} "
                   f"± {ms['std']:.2f}) | {metrics['samples_per_s']:8.1f} img/s | {achieved:7.3f} TFLOP/s{share} | "
                   f"loss {check['loss']:.4f}, fp32 {check['fp32_loss']:.4f} ({relative}{skipped})"
                   f"{verdict}{'  NOT COMPILED (eager)' if eager else ''}")

    def write_csvs(self) -> None:
        if not self.ctx.is_main:
            return
        # An earlier run's rows stay until this run has measured the same model (a stopped run keeps them); the
        # skipped precisions' rows are there from the start, and with nothing to run every model is done at once.
        folder = self.args.folder
        now = {row["model"] for row in self.rows if row["status"] != "skipped" or not self.plan}
        self.in_csvs = now
        for (mode, precision), ms_by_model in self.ms_by_run.items():
            earlier = {model: ms for model, ms in self.earlier_ms.get((mode, precision), {}).items()
                       if model not in now}
            write_text_atomic(iterations_csv({**earlier, **ms_by_model}), folder / csv_name(self.tag, precision, mode))
        kept = [row for row in self.earlier_rows if row.get("model") not in now]
        write_text_atomic(summary_csv([*kept, *self.rows]), folder / f"{self.tag}_summary.csv")

    def finish(self) -> int:
        """Write the CSVs, print the SJTU page's table; exit status 1 when something failed."""
        self.write_csvs()
        if self.ctx.is_main:
            print(sjtu_table(self.rows, self.args.modes, self.args.precision), flush=True)
            launch_bound = launch_bound_line(self.rows, self.args.batch_size)
            if launch_bound:
                print(launch_bound, flush=True)
        kept = sorted({row["model"] for row in self.earlier_rows} - set(self.args.models))
        earlier = f" (with an earlier run's {', '.join(kept)})" if kept else ""
        self.print(f"csv: {self.args.folder}/{self.tag}_*.csv{earlier} | {self.records} record(s) in "
                   f"{self.args.results_dir}")
        if self.failures:
            self.print(f"{self.failures} result(s) failed; their records say why")
        return 1 if self.failures else 0


def sjtu_table(rows: Sequence[Mapping[str, Any]], modes: Sequence[str], precisions: Sequence[str]) -> str:
    """Median ms/batch, model by precision, and the mean over the models as the SJTU page's table gives it."""
    lines = []
    for mode in modes:
        ok = {(r["model"], r["precision"]): r["ms_per_batch_median"] for r in rows
              if r["mode"] == mode and r["status"] == "ok"}
        models = list(dict.fromkeys(r["model"] for r in rows if r["mode"] == mode))
        lines += ["", f"{mode}: median ms/batch", f"{'model':<18}" + "".join(f"{p:>10}" for p in precisions)]
        for model in models:
            lines.append(f"{model:<18}" + "".join(f"{ok[(model, p)]:10.2f}" if (model, p) in ok else f"{'—':>10}"
                                                  for p in precisions))
        means = []
        for p in precisions:
            values = [ok[(m, p)] for m in models if (m, p) in ok]
            means.append(f"{sum(values) / len(values):10.2f}" if len(values) == len(models) else f"{'—':>10}")
        lines.append(f"{'mean of models':<18}" + "".join(means))
    return "\n".join(lines)
