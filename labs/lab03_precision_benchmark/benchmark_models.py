#!/usr/bin/env python3
"""Lab-03: how fast the ResNet family trains and infers at each precision, and whether it still learns.

Usage:
    python labs/lab03_precision_benchmark/benchmark_models.py --folder a100 -w 10 -n 5 -b 12 -g 1  # the seed's
    python labs/lab03_precision_benchmark/benchmark_models.py --device cpu --models resnet18 --image-size 64 -b 4
    python labs/lab03_precision_benchmark/benchmark_models.py -g 2 --models resnet50   # DDP, 2 processes it spawns
    torchrun --standalone --nproc_per_node=4 labs/lab03_precision_benchmark/benchmark_models.py --models resnet50
    sbatch a100.sbatch   # rendered from sbatch/a100.sbatch.j2 (also dgx2, container): see the README

What it teaches: the same model at fp64, fp32, tf32, half, amp-fp16 and amp-bf16, timed honestly
(the GPU synchronised before each clock read, warm-up iterations dropped, median and spread of the
per-iteration times), set against the device's peak TFLOP/s, and checked for correctness: a few
training steps from the same weights on the same batch must end near fp32's loss, or the precision
is flagged. Speed without that check can hide a model that no longer learns.

Differences from the seed's ``benchmark_models.py``: a training iteration includes the optimiser step
(SGD with momentum); the batch stays on the device (this times the model, not host-to-device copies);
``-g N`` runs DDP with one process per GPU and ``-b`` per process, not DataParallel; precisions the
device cannot run are skipped with the reason, in the summary CSV and in the records.

Output: in ``--folder``, the seed's CSV layout (one file per mode and precision, a column per model,
a row per timed iteration, milliseconds per batch) plus ``<tag>_summary.csv``; in ``--results-dir``,
one result record per model, mode and precision (lab ``lab03``, method ``<mode>-<precision>``).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import re
import sys
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere without installing
from common import amp
from common.atomic import write_text_atomic
from common.cli import (accept_launcher_local_rank, config_dict, non_negative_int, output_dir, positive_float,
                        positive_int)
from common.device import configure_threads, describe, resolve_device, seed_everything
from common.distributed import DistContext, init_distributed, print0, teardown_distributed
from common.errors import UserError, run_main
from common.launch import detect_launch, free_port
from common.models import build_model, zoo_models
from common.precision_names import MODES, PRECISIONS
from common.results import fp32_math_info, make_record, provenance, write_record
from common.timing import StepTimer, peak_memory, reset_peak_memory, scaled
from labs.lab03_precision_benchmark.lab03_shared import (
    DEFAULT_LOSS_TOLERANCE, LAB, NUM_CLASSES, SCRIPT, SEED_MODELS, compare_losses, csv_name,
    device_tag, iterations_csv, parse_list, peak_tflops, summary_csv, unsupported_reason,
)

#: Precisions that cast the whole model; the others keep float32 weights.
WEIGHT_DTYPES = {"fp64": torch.float64, "half": torch.float16}
#: Precisions that autocast, by their name in common.amp.
AUTOCAST = {"amp-fp16": "fp16", "amp-bf16": "bf16"}
MOMENTUM = 0.9
#: How dynamo names giving up on a function after too many recompilations (older releases: cache_size_limit).
RECOMPILE_LIMIT_HIT = re.compile(r"(recompile|cache.size).{0,3}limit", re.IGNORECASE)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    seed_flags = parser.add_argument_group("the seed's flags")
    seed_flags.add_argument("--folder", type=output_dir, default="results/lab03_csv",
                            help="folder for the CSV files (default: %(default)s)")
    seed_flags.add_argument("-w", "--warmup", type=non_negative_int, default=10,
                            help="iterations run but not timed: cuDNN autotuning, allocator growth, "
                                 "torch.compile (default: %(default)s)")
    seed_flags.add_argument("-n", "--num-iters", type=positive_int, default=20,
                            help="timed iterations per model, mode and precision (default: %(default)s)")
    seed_flags.add_argument("-b", "--batch-size", type=positive_int, default=12,
                            help="images per iteration on each process (default: %(default)s)")
    seed_flags.add_argument("-g", "--num-gpus", type=positive_int, default=1,
                            help="processes, one per GPU; above 1 the model is trained with DDP (on a CPU: "
                                 "Gloo processes sharing the cores) (default: %(default)s)")
    what = parser.add_argument_group("what to measure")
    what.add_argument("--models", default=",".join(SEED_MODELS),
                      help="comma-separated torchvision classification models (default: the seed's nine)")
    what.add_argument("--modes", default=",".join(MODES), help="train, inference or both (default: %(default)s)")
    what.add_argument("--precisions", default=",".join(PRECISIONS),
                      help=f"comma-separated, from: {', '.join(PRECISIONS)} (default: all)")
    what.add_argument("--image-size", type=positive_int, default=224,
                      help="side of the square input images; tiny runs use 32-64 (default: %(default)s)")
    what.add_argument("--channels-last", action="store_true",
                      help="NHWC memory format, which tensor-core convolutions prefer (default: off)")
    what.add_argument("--compile", action="store_true",
                      help="torch.compile the model; compilation happens in the warm-up iterations (default: off)")
    check = parser.add_argument_group("correctness check against fp32")
    check.add_argument("--check-steps", type=positive_int, default=3,
                       help="training steps from the same weights on the same batch (default: %(default)s)")
    check.add_argument("--loss-tolerance", type=positive_float, default=DEFAULT_LOSS_TOLERANCE,
                       help="flag a precision whose loss after the check steps is off fp32's by more than this "
                            "fraction of the initial loss (default: %(default)s)")
    check.add_argument("--lr", type=positive_float, default=0.01,
                       help=f"SGD learning rate (momentum {MOMENTUM}) for the check and the timed training "
                            "(default: %(default)s)")
    common = parser.add_argument_group("common options (same in every script)")
    common.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to run: auto picks cuda when a GPU is visible (default: %(default)s)")
    common.add_argument("--seed", type=int, default=1, help="random seed of weights and batch (default: %(default)s)")
    common.add_argument("--results-dir", type=output_dir, default="results",
                        help="folder where the result records are written (default: %(default)s)")
    common.add_argument("--dry-run", action="store_true",
                        help="-w 1 -n 2 --check-steps 2: checks that everything runs (default: off)")
    accept_launcher_local_rank(parser)  # python -m torch.distributed.launch passes --local-rank
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        args.warmup, args.num_iters, args.check_steps = 1, 2, 2
    args.models = parse_list(args.models, zoo_models(), "models")
    args.modes = parse_list(args.modes, MODES, "modes")
    args.precisions = parse_list(args.precisions, tuple(PRECISIONS), "precisions")
    return args


# --------------------------------------------------------------------------------------------
# What a precision changes: the weights' dtype, TF32 on or off, and the autocast context


def set_tf32(enabled: bool) -> None:
    """Let cuDNN convolutions and cuBLAS matmuls use TF32 tensor cores (Ampere and newer), or not.

    PyTorch turns TF32 on for convolutions by default, so "float32" on an A100 is TF32 unless it is
    switched off: the fp32 rows of this benchmark switch it off, the tf32 rows on.
    """
    amp.set_fp32_math("tf32" if enabled else "ieee")


def forward_context(precision: str, device: torch.device) -> AbstractContextManager:
    """Autocast for amp-fp16/amp-bf16; nothing for the others (their dtype is in the weights)."""
    return amp.autocast(device, AUTOCAST.get(precision, "fp32"))


def make_model(base: torch.nn.Module, precision: str, device: torch.device, channels_last: bool) -> torch.nn.Module:
    """A copy of ``base`` (the same initial weights for every precision) cast and placed for ``precision``."""
    model = copy.deepcopy(base).to(device=device, dtype=WEIGHT_DTYPES.get(precision, torch.float32))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def make_inputs(images: torch.Tensor, precision: str, channels_last: bool) -> torch.Tensor:
    images = images.to(WEIGHT_DTYPES.get(precision, torch.float32))
    return images.contiguous(memory_format=torch.channels_last) if channels_last else images


def logits(output: Any) -> torch.Tensor:
    """The class scores (GoogLeNet and Inception return extra auxiliary outputs while training)."""
    return output.logits if hasattr(output, "logits") else output


# --------------------------------------------------------------------------------------------
# One training step and one inference step: what is timed


def train_step(model, images, labels, optimizer, scaler, precision, device) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    with forward_context(precision, device):
        loss = F.cross_entropy(logits(model(images)), labels)
    scaler.scale(loss).backward()  # scaled only for amp-fp16; otherwise a pass-through
    scaler.step(optimizer)         # amp-fp16: skipped when the gradients hold inf/NaN
    scaler.update()
    return loss.detach()


def make_optimizer(model: torch.nn.Module, precision: str, device: torch.device, args: argparse.Namespace):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM)
    return optimizer, amp.grad_scaler(device, "fp16" if precision == "amp-fp16" else "fp32")


def time_training(model, images, labels, precision, device, args) -> StepTimer:
    model.train()
    optimizer, scaler = make_optimizer(model, precision, device, args)
    timer = StepTimer(device, warmup_steps=args.warmup)
    for _ in range(args.warmup + args.num_iters):
        with timer.step(samples=len(images)):
            train_step(model, images, labels, optimizer, scaler, precision, device)
    return timer


@torch.inference_mode()
def time_inference(model, images, precision, device, args) -> StepTimer:
    model.eval()
    timer = StepTimer(device, warmup_steps=args.warmup)
    for _ in range(args.warmup + args.num_iters):
        with timer.step(samples=len(images)), forward_context(precision, device):
            model(images)
    return timer


def check_losses(base, images, labels, precision, device, args) -> tuple[list[float], int]:
    """The loss at each of ``--check-steps`` training steps from ``base``'s weights on one batch.

    The same for every precision: same initial weights, same batch, same optimiser. Run apart from
    the timing, on the plain model (no DDP, no compile), so only the precision differs. Also returns
    how many steps amp-fp16's GradScaler skipped (inf/NaN gradients at its scale: the weights stay
    put for that step, which alone moves the loss away from fp32's).
    """
    model = make_model(base, precision, device, args.channels_last).train()
    optimizer, scaler = make_optimizer(model, precision, device, args)
    inputs = make_inputs(images, precision, args.channels_last)
    losses, skipped = [], 0
    for _ in range(args.check_steps):
        scale = scaler.get_scale()
        losses.append(float(train_step(model, inputs, labels, optimizer, scaler, precision, device)))
        skipped += scaler.get_scale() < scale  # the scaler halves its scale when it skips a step
    return losses, skipped


def count_flops(model_name: str, batch_size: int, image_size: int) -> dict[str, int]:
    """FLOPs of one batch per mode, counted once per model and shape.

    On the ``meta`` device: tensors with shapes but no data, so nothing is computed or allocated
    and a wide_resnet101_2 is counted in a blink. FlopCounterMode counts the matrix maths
    (convolutions, matmuls: 2 FLOPs per multiply-add), not element-wise work such as BatchNorm or
    ReLU, so the achieved TFLOP/s compares with the tensor-core peaks. A shape the model cannot
    take fails here, before anything is timed.
    """
    from torch.utils.flop_counter import FlopCounterMode  # PyTorch >= 2.1: imported after common's version check

    try:
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
    except (RuntimeError, AssertionError, ValueError) as err:
        raise UserError(f"{model_name} cannot run on {image_size}x{image_size} images: "
                        f"{str(err).splitlines()[0]} (try --image-size 224)") from None
    return {"train": train.get_total_flops(), "inference": inference.get_total_flops()}


# --------------------------------------------------------------------------------------------
# The benchmark on one process (rank)


def compile_fresh(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile(model)`` after resetting dynamo, so this configuration gets its own compile budget.

    The ResNet family shares ``ResNet.forward``: without a reset, the models x precisions x modes of
    one run are all recompilations of that one function, and past dynamo's recompile limit (8) the
    rest silently run eager while labelled compiled (``TORCH_LOGS=recompiles`` shows it).
    """
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return torch.compile(model)


def compile_outcome() -> dict[str, Any]:
    """Did the configuration just timed really run compiled? Graphs dynamo captured, recompile-limit hits."""
    from torch._dynamo.utils import counters

    graphs = int(counters["stats"]["unique_graphs"])
    limit_hits = sum(count for reason, count in counters["unimplemented"].items() if RECOMPILE_LIMIT_HIT.search(reason))
    return {"compiled": graphs > 0 and limit_hits == 0, "graphs": graphs, "recompile_limit_hits": limit_hits}


def time_mode(mode, base, images, labels, precision, device, args,
              distributed) -> tuple[StepTimer, dict[str, Any], dict[str, Any] | None]:
    """Time ``mode`` on a fresh copy of ``base``; returns the timer, the peak memory and (with
    ``--compile``) whether compilation really happened."""
    model = make_model(base, precision, device, args.channels_last)
    inputs = make_inputs(images, precision, args.channels_last)
    reset_peak_memory(device)
    if mode == "train":
        if distributed:
            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        timer = time_training(compile_fresh(model) if args.compile else model, inputs, labels, precision, device, args)
    else:  # no gradients, so no DDP: each process infers on its own
        timer = time_inference(compile_fresh(model) if args.compile else model, inputs, precision, device, args)
    memory = peak_memory(device)
    compilation = compile_outcome() if args.compile else None
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next precision starts from an empty allocator
    return timer, memory, compilation


def run(args: argparse.Namespace, flops: dict[str, dict[str, int]], launcher: str) -> int:
    ctx = init_distributed(args.device)
    try:
        return benchmark(args, flops, ctx, launcher)
    finally:
        teardown_distributed(ctx)


def benchmark(args: argparse.Namespace, flops: dict[str, dict[str, int]], ctx: DistContext, launcher: str) -> int:
    device, distributed = ctx.device, ctx.world_size > 1
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # cuDNN tries its algorithms per shape, in the warm-up
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    out = Output(args, ctx, launcher)
    skipped = {p: r for p in args.precisions if (r := unsupported_reason(p, device.type, out.device_name, capability))}
    runnable = [p for p in args.precisions if p not in skipped]
    print0(f"lab03 precision benchmark | {describe(device)} | {ctx.world_size} process(es)"
           f"{' with DDP' if distributed else ''} | batch {args.batch_size} per process, "
           f"{args.image_size}x{args.image_size} | warm-up {args.warmup}, timed {args.num_iters}")
    for precision, reason in skipped.items():
        print0(f"skipping {precision}: {reason}")
        for mode in args.modes:
            out.skipped(mode, precision, reason)

    for model_name in args.models:
        seed_everything(args.seed)  # the same initial weights and batch for every precision
        base = build_model(model_name, num_classes=NUM_CLASSES)
        generator = torch.Generator().manual_seed(args.seed)
        images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator).to(device)
        labels = torch.randint(0, NUM_CLASSES, (args.batch_size,), generator=generator).to(device)
        set_tf32(False)
        reference, _ = check_losses(base, images, labels, "fp32", device, args)
        for precision in runnable:
            set_tf32(precision == "tf32")
            done: list[str] = []
            try:
                losses, skipped_steps = ((reference, 0) if precision == "fp32"
                                         else check_losses(base, images, labels, precision, device, args))
                check = {**compare_losses(losses, reference, args.loss_tolerance),
                         "scaler_skipped_steps": skipped_steps}
                for mode in args.modes:
                    timer, memory, compilation = time_mode(mode, base, images, labels, precision, device, args,
                                                           distributed)
                    out.measured(model_name, mode, precision, timer, memory, check, flops[model_name][mode],
                                 compilation)
                    done.append(mode)
            except RuntimeError as err:  # out of memory, or an operator without a kernel for this dtype
                if distributed:
                    raise  # the other ranks would wait for this one forever: let the launcher stop them all
                for mode in args.modes:
                    if mode not in done:
                        out.failed(model_name, mode, precision, f"{type(err).__name__}: {str(err).splitlines()[0]}")
        out.write_csvs()  # after every model, so a job that runs out of time keeps what it measured
    set_tf32(False)
    return out.finish()


class Output:
    """What a run writes (on rank 0 only): a record per result, the seed's CSVs, the summary CSV."""

    def __init__(self, args: argparse.Namespace, ctx: DistContext, launcher: str) -> None:
        self.args, self.ctx = args, ctx
        self.device = ctx.device
        self.device_name = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                            else platform.processor() or platform.machine())
        self.tag = device_tag(self.device.type, self.device_name, ctx.world_size)
        distributed = {"distributed": {**ctx.describe(), "launcher": launcher}} if ctx.world_size > 1 else None
        self.provenance = provenance(self.device, ctx.world_size, distributed)
        self.ms_by_run: dict[tuple[str, str], dict[str, list[float]]] = {}
        self.rows: list[dict[str, Any]] = []
        self.records = self.failures = 0

    def _record(self, mode: str, precision: str, model: str | None, metrics: dict[str, Any], *,
                status: str = "ok", notes: list[str]) -> None:
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
                                 provenance={**self.provenance, "fp32_math": fp32_math_info(self.device)}),
                     args.results_dir)
        self.records += 1

    def skipped(self, mode: str, precision: str, reason: str) -> None:
        """One record per mode and precision: the reason is the device's, not a model's."""
        self._record(mode, precision, None, {"skip_reason": reason}, status="skipped", notes=[reason])
        self.rows += [{"mode": mode, "precision": precision, "model": model, "status": "skipped", "reason": reason}
                      for model in self.args.models]

    def failed(self, model: str, mode: str, precision: str, reason: str) -> None:
        self.failures += 1
        print0(f"{model:<18} {mode:<9} {precision:<9} FAILED: {reason}")
        self._record(mode, precision, model, {}, status="failed", notes=[reason])
        self.rows.append({"mode": mode, "precision": precision, "model": model, "status": "failed", "reason": reason})

    def measured(self, model: str, mode: str, precision: str, timer: StepTimer, memory: dict[str, Any],
                 check: dict[str, Any], flops: int, compilation: dict[str, Any] | None = None) -> None:
        world = self.ctx.world_size
        step_time = timer.summary()
        ms = {key: step_time[f"{key}_s"] * 1000 for key in ("median", "mean", "std", "min", "max")}
        achieved = flops / (step_time["median_s"] * 1e12)  # per device: each process ran its own batch
        peak, peak_source = peak_tflops(self.device.type, self.device_name, precision)
        metrics = {
            "ms_per_batch": ms,
            "ms_per_batch_samples": [t * 1000 for t in timer.times],
            "samples_per_s": scaled(step_time["samples_per_s"], world),
            "global_batch_size": self.args.batch_size * world,
            "step_time": step_time,
            "flops_per_batch": flops,
            "achieved_tflops": achieved,
            "peak_tflops": peak,
            "peak_tflops_source": peak_source,
            "fraction_of_peak": achieved / peak if peak else None,
            "loss_check": check,
            "loss_diff_vs_fp32": check["abs_diff"],
            "loss_relative_diff_vs_fp32": check["relative_diff"],
            "diverged": check["diverged"],
            "memory": [memory],
            "compile": compilation,
        }
        # How the clock was read is in metrics.step_time.method; notes are for what needs attention.
        notes = [f"{world} DDP processes: the times are rank 0's"] if world > 1 else []
        if check["diverged"]:
            notes.append(f"DIVERGED: {check['reason']}")
        if compilation is not None and not compilation["compiled"]:
            notes.append(f"NOT COMPILED: --compile was given but dynamo captured {compilation['graphs']} graph(s) and "
                         f"hit its recompile limit {compilation['recompile_limit_hits']} time(s): these times are eager")
        if check["scaler_skipped_steps"]:
            notes.append(f"GradScaler skipped {check['scaler_skipped_steps']} of the {check['steps']} check steps "
                         "(inf/NaN gradients), leaving the weights unchanged for them")
        if precision == "half" and self.device.type == "cpu":
            notes.append("float16 on a CPU without float16 arithmetic is converted to float32 inside each kernel: "
                         "expect it slower than fp32")
        self._record(mode, precision, model, metrics, notes=notes)
        self.ms_by_run.setdefault((mode, precision), {})[model] = metrics["ms_per_batch_samples"]
        self.rows.append({"mode": mode, "precision": precision, "model": model, "status": "ok",
                          "ms_per_batch_median": ms["median"], "ms_per_batch_mean": ms["mean"],
                          "ms_per_batch_std": ms["std"], "samples_per_s": metrics["samples_per_s"],
                          "achieved_tflops": achieved, "peak_tflops": peak, "check_loss": check["loss"],
                          "fp32_check_loss": check["fp32_loss"], "loss_relative_diff": check["relative_diff"],
                          "diverged": check["diverged"], "reason": check["reason"]})
        relative = "—" if check["relative_diff"] is None else f"{check['relative_diff']:.2%}"
        share = f" = {achieved / peak:.0%} of {peak:g}" if peak else ""
        print0(f"{model:<18} {mode:<9} {precision:<9} {ms['median']:9.2f} ms/batch (mean {ms['mean']:.2f} "
               f"± {ms['std']:.2f}) | {metrics['samples_per_s']:8.1f} img/s | {achieved:7.3f} TFLOP/s{share} | "
               f"loss {check['loss']:.4f}, fp32 {check['fp32_loss']:.4f} ({relative})"
               f"{'  DIVERGED' if check['diverged'] else ''}"
               f"{'  NOT COMPILED (eager)' if compilation is not None and not compilation['compiled'] else ''}")

    def write_csvs(self) -> None:
        if not self.ctx.is_main:
            return
        folder = self.args.folder
        for (mode, precision), ms_by_model in self.ms_by_run.items():
            write_text_atomic(iterations_csv(ms_by_model), folder / csv_name(self.tag, precision, mode))
        write_text_atomic(summary_csv(self.rows), folder / f"{self.tag}_summary.csv")

    def finish(self) -> int:
        """Write the CSVs, print the seed-style table; exit status 1 when something failed."""
        self.write_csvs()
        if self.ctx.is_main:
            print_table(self.rows, self.args.modes, self.args.precisions)
            print(f"csv: {self.args.folder}/{self.tag}_*.csv | {self.records} record(s) in {self.args.results_dir}",
                  flush=True)
            if self.failures:
                print(f"{self.failures} result(s) failed; their records say why", flush=True)
        return 1 if self.failures else 0


def print_table(rows: list[dict[str, Any]], modes: list[str], precisions: list[str]) -> None:
    """Median ms/batch, model by precision, and the mean over the models as the seed's table gives it."""
    for mode in modes:
        ok = {(r["model"], r["precision"]): r["ms_per_batch_median"] for r in rows
              if r["mode"] == mode and r["status"] == "ok"}
        models = list(dict.fromkeys(r["model"] for r in rows if r["mode"] == mode))
        print(f"\n{mode}: median ms/batch")
        print(f"{'model':<18}" + "".join(f"{p:>10}" for p in precisions))
        for model in models:
            print(f"{model:<18}" + "".join(f"{ok[(model, p)]:10.2f}" if (model, p) in ok else f"{'—':>10}"
                                           for p in precisions))
        means = []
        for p in precisions:
            values = [ok[(m, p)] for m in models if (m, p) in ok]
            means.append(f"{sum(values) / len(values):10.2f}" if len(values) == len(models) else f"{'—':>10}")
        print(f"{'mean of models':<18}" + "".join(means), flush=True)


# --------------------------------------------------------------------------------------------
# Launching: plain python, one spawned process per GPU (-g N), or torchrun/srun


def _spawned_worker(rank: int, args: argparse.Namespace, flops: dict[str, dict[str, int]], port: int,
                    threads: int) -> None:
    """One of the ``-g N`` processes: torchrun's variables, then the same code as under torchrun."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.num_gpus),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    status = run(args, flops, launcher="torch.multiprocessing.spawn")
    if status:
        sys.exit(status)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_threads()
    # Every model must take the image size before anything is timed (and the FLOPs are counted once).
    flops = {name: count_flops(name, args.batch_size, args.image_size) for name in args.models}
    launch = detect_launch()
    if launch.world_size > 1:  # torchrun or srun started the processes
        if args.num_gpus not in (1, launch.world_size):
            raise UserError(f"-g {args.num_gpus} but {launch.launcher} started {launch.world_size} processes; "
                            "under a launcher leave -g out")
        return run(args, flops, launcher=launch.launcher)
    if args.num_gpus == 1:
        return run(args, flops, launcher="single")

    device = resolve_device(args.device)
    if device.type == "cuda" and torch.cuda.device_count() < args.num_gpus:
        raise UserError(f"-g {args.num_gpus} but only {torch.cuda.device_count()} GPU(s) are visible")
    # On a CPU the processes share the cores: split them, or every process starts one thread per core.
    threads = torch.get_num_threads() if device.type == "cuda" else max(1, torch.get_num_threads() // args.num_gpus)
    how = "one per GPU" if device.type == "cuda" else f"Gloo on the CPU, {threads} thread(s) each"
    print(f"spawning {args.num_gpus} processes ({how})", flush=True)
    try:
        mp.spawn(_spawned_worker, args=(args, flops, free_port(), threads), nprocs=args.num_gpus, join=True)
    except mp.ProcessExitedException as err:
        return err.exit_code if err.exit_code and err.exit_code > 0 else 1
    return 0


if __name__ == "__main__":
    run_main(main)
