#!/usr/bin/env python3
"""Lab-03: how fast the ResNet family trains and infers at each precision, and whether it still learns.

Usage:
    python labs/lab03_precision_benchmark/benchmark_models.py --folder a100 -w 10 -n 5 -b 12 -g 1  # the SJTU page's
    python labs/lab03_precision_benchmark/benchmark_models.py --device cpu --models resnet18 --image-size 64 -b 4
    torchrun --standalone --nproc_per_node=4 labs/lab03_precision_benchmark/benchmark_models.py --models resnet50
    python labs/lab03_precision_benchmark/benchmark_models.py -g 4 --models resnet50   # the same: runs that torchrun
    sbatch a100.sbatch   # rendered from sbatch/a100.sbatch.j2 (also dgx2, container): see the README

What it teaches: the same model at fp64, fp32, tf32, half, amp-fp16 and amp-bf16, timed honestly
(the GPU synchronised before each clock read, warm-up iterations dropped, median and spread of the
per-iteration times), set against the device's peak TFLOP/s, and checked for correctness: a few
training steps from the same weights on the same batch must end near fp32's loss, or the precision
is flagged. Speed without that check can hide a model that no longer learns.

Differences from the SJTU page's ``benchmark_models.py``: a training iteration includes the optimiser step
(SGD with momentum); the batch stays on the device (this times the model, not host-to-device copies);
several GPUs run DDP with one process per GPU and ``-b`` per process, not DataParallel: under
``torchrun`` or ``srun``, or with the SJTU page's ``-g N``, which prints the ``torchrun`` command and runs
it; precisions the device cannot run are skipped with the reason, in the summary CSV and the records.

Output (``lab03_shared.Output``): in ``--folder``, the SJTU page's CSV layout (one file per mode and
precision, a column per model, a row per timed iteration, milliseconds per batch) plus
``<tag>_summary.csv``; in ``--results-dir``, one result record per model, mode and precision (lab
``lab03``, method ``<mode>-<precision>``).
"""

from __future__ import annotations

import argparse
import copy
import os
import shlex
import subprocess
import sys
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.precision import set_fp32_math
from common.train import amp
from common.cli import (add_former_names, add_run_args, BENCHMARK_MODES as MODES, BENCHMARK_PRECISIONS as PRECISIONS,
                        non_negative_int, output_dir, positive_float, positive_int, script_parser)
from common.runtime.device import configure_threads, describe, resolve_device, seed_everything
from common.runtime.distributed import DistContext, init_distributed, print0, teardown_distributed
from common.measure.energy import EnergyMeter
from common.errors import UserError, run_main
from common.runtime.launch import detect_launch
from common.models import build_model, zoo_models
from common.measure.timing import StepTimer, peak_memory, reset_peak_memory
from labs.lab03_precision_benchmark.lab03_shared import (
    DEFAULT_LOSS_TOLERANCE, MAX_SKIPPED_CHECK_STEPS, MOMENTUM, NUM_CLASSES, SJTU_MODELS, Output, compare_losses,
    compile_outcome, parse_list,
)

#: Precisions that cast the whole model; the others keep float32 weights.
WEIGHT_DTYPES = {"fp64": torch.float64, "half": torch.float16}
#: Precisions that autocast, by their name in common.train.amp.
AUTOCAST = {"amp-fp16": "fp16", "amp-bf16": "bf16"}


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # --help shows defaults
    sjtu_flags = parser.add_argument_group("the SJTU page's flags")
    sjtu_flags.add_argument("--folder", type=output_dir, default="results/lab03_csv", help="folder for the CSV files")
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
    add_run_args(parser, dry_run="-w 1 -n 2 --check-steps 2: checks that everything runs")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        args.warmup, args.repeats, args.check_steps = 1, 2, 2
    args.models = parse_list(args.models, zoo_models(), "models")
    args.modes = parse_list(args.modes, MODES, "modes")
    args.precision = parse_list(args.precision, tuple(PRECISIONS), "precisions")
    return args


# --------------------------------------------------------------------------------------------
# What a precision changes: the weights' dtype, TF32 on or off (see benchmark), and the autocast context


def forward_context(precision: str, device: torch.device) -> AbstractContextManager:
    """Autocast for amp-fp16/amp-bf16; nothing for the others (their dtype is in the weights)."""
    return amp.autocast(device, AUTOCAST.get(precision, "fp32"))


def make_model(base: torch.nn.Module, precision: str, device: torch.device, channels_last: bool) -> torch.nn.Module:
    """A copy of ``base`` (the same initial weights for every precision) cast and placed for ``precision``."""
    model = copy.deepcopy(base).to(device=device, dtype=WEIGHT_DTYPES.get(precision, torch.float32))
    if precision == "half":  # BatchNorm stays float32, as in float16 training: cuDNN's batch norm takes float16
        # activations with float32 weights only; float16 ones send it to PyTorch's slower kernels.
        model.apply(lambda m: m.float() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) else None)
    return model.to(memory_format=torch.channels_last) if channels_last else model


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
    return optimizer, amp.grad_scaler(device, AUTOCAST.get(precision, "fp32"))  # a scaler for fp16 only


def time_training(model, images, labels, precision, device, args) -> StepTimer:
    model.train()
    optimizer, scaler = make_optimizer(model, precision, device, args)
    timer = StepTimer(device, warmup_steps=args.warmup)
    for _ in range(args.warmup + args.repeats):
        with timer.step(samples=len(images)):
            train_step(model, images, labels, optimizer, scaler, precision, device)
    return timer


@torch.inference_mode()
def time_inference(model, images, precision, device, args) -> StepTimer:
    model.eval()
    timer = StepTimer(device, warmup_steps=args.warmup)
    for _ in range(args.warmup + args.repeats):
        with timer.step(samples=len(images)), forward_context(precision, device):
            model(images)
    return timer


def check_losses(base, images, labels, precision, device, args) -> tuple[list[float], int, int]:
    """The losses after 0, 1, ... applied training steps from ``base``'s weights on one batch (the same for
    every precision, plain model: only the precision differs), the attempts and the skips: amp-fp16's
    GradScaler skips a step whose gradients overflow at its scale (the weights stay put; tried again)."""
    model = make_model(base, precision, device, args.channels_last).train()
    optimizer, scaler = make_optimizer(model, precision, device, args)
    inputs = make_inputs(images, precision, args.channels_last)
    losses, attempts, skipped = [], 0, 0
    while len(losses) < args.check_steps and skipped < MAX_SKIPPED_CHECK_STEPS:
        scale = scaler.get_scale()
        loss = float(train_step(model, inputs, labels, optimizer, scaler, precision, device))
        if attempts - skipped == len(losses):  # the first loss after this many applied steps
            losses.append(loss)
        attempts, skipped = attempts + 1, skipped + (scaler.get_scale() < scale)  # a skip halves the scale
    return losses, attempts, skipped


def count_flops(model_name: str, batch_size: int, image_size: int) -> dict[str, int]:
    """FLOPs of one batch per mode, counted once per model and shape, on the ``meta`` device.

    Meta tensors have shapes but no data: nothing is computed or allocated. FlopCounterMode counts
    the matrix maths (convolutions, matmuls: 2 FLOPs per multiply-add), not element-wise work such
    as BatchNorm or ReLU, so the achieved TFLOP/s compares with the tensor-core peaks. A shape the
    model cannot take fails here, before anything is timed.
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
    one run are all recompilations of that one function, and past dynamo's recompile limit (8) the rest
    silently run eager while labelled compiled (``TORCH_LOGS=recompiles`` shows it, and ``compile_outcome``).
    """
    from torch._dynamo.utils import counters  # PyTorch >= 2.0: imported after common's version check

    torch._dynamo.reset()
    counters.clear()
    return torch.compile(model)


def time_mode(mode, base, images, labels, precision, device, args, distributed) -> tuple[StepTimer, dict, dict | None]:
    """Time ``mode`` on a fresh copy of ``base``: the timer, the peak memory, with --compile whether it compiled."""
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
    compilation = compile_outcome(torch._dynamo.utils.counters) if args.compile else None
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next precision starts from an empty allocator
    return timer, memory, compilation


def benchmark(args: argparse.Namespace, flops: dict[str, dict[str, int]], ctx: DistContext) -> int:
    device, distributed = ctx.device, ctx.world_size > 1
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # cuDNN tries its algorithms per shape, in the warm-up
    out = Output(args, ctx)
    print0(f"lab03 precision benchmark | {describe(device)} | {ctx.world_size} process(es)"
           f"{' with DDP' if distributed else ''} | batch {args.batch_size} per process, "
           f"{args.image_size}x{args.image_size} | warm-up {args.warmup}, timed {args.repeats}")
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    runnable = out.runnable(capability)  # a precision this device cannot run is skipped, saying why

    for model_name in args.models:
        seed_everything(args.seed)  # the same initial weights and batch for every precision
        base = build_model(model_name, num_classes=NUM_CLASSES)
        generator = torch.Generator().manual_seed(args.seed)
        images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator).to(device)
        labels = torch.randint(0, NUM_CLASSES, (args.batch_size,), generator=generator).to(device)
        set_fp32_math("ieee")
        reference, _, _ = check_losses(base, images, labels, "fp32", device, args)
        for precision in runnable:
            # PyTorch runs cuDNN convolutions on TF32 tensor cores (Ampere and newer) by default, so
            # "float32" on an A100 is TF32 unless switched off: the fp32 rows switch it off, tf32 rows on.
            set_fp32_math("tf32" if precision == "tf32" else "ieee")
            done: list[str] = []
            try:
                losses, attempts, skipped = ((reference, len(reference), 0) if precision == "fp32"
                                             else check_losses(base, images, labels, precision, device, args))
                check = compare_losses(losses, reference, args.loss_tolerance, attempts=attempts, skipped_steps=skipped)
                for mode in args.modes:
                    with EnergyMeter(device) as meter:
                        timer, memory, compilation = time_mode(mode, base, images, labels, precision, device, args,
                                                               distributed)
                    energy = meter.result(samples=(args.warmup + args.repeats) * args.batch_size * ctx.world_size)
                    out.measured(model_name, mode, precision, timer, memory, check, flops[model_name][mode],
                                 compilation, energy=energy)
                    done.append(mode)
            except RuntimeError as err:  # out of memory, or an operator without a kernel for this dtype
                if distributed:
                    raise  # the other ranks would wait for this one forever: let the launcher stop them all
                out.failed(model_name, [mode for mode in args.modes if mode not in done], precision, err)
        out.write_csvs()  # after every model, so a job that runs out of time keeps what it measured
    set_fp32_math("ieee")
    return out.finish()


def run_under_torchrun(args: argparse.Namespace, argv: list[str]) -> int:
    """The SJTU page's ``-g N`` from a plain ``python``: torchrun starts the N processes, as for every distributed
    script of the course, and the command is printed, so it can be typed directly next time."""
    resolve_device(args.device, local_world_size=args.num_gpus)  # more processes than GPUs: one error line, now
    script = sys.argv[0] if Path(sys.argv[0]).resolve() == Path(__file__).resolve() else __file__  # as typed
    torchrun = ["--standalone", f"--nproc_per_node={args.num_gpus}", script, *argv]
    print(f"-g {args.num_gpus}: running torchrun {shlex.join(torchrun)}", flush=True)
    # Share this process's threads (OMP_NUM_THREADS, the Slurm allocation) out among the N processes.
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, torch.get_num_threads() // args.num_gpus))}
    # python -m torch.distributed.run is torchrun, from this Python's environment.
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *torchrun], env=env).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    configure_threads()
    # Every model must take the image size before anything is timed (and the FLOPs are counted once).
    flops = {name: count_flops(name, args.batch_size, args.image_size) for name in args.models}
    launch = detect_launch()
    if launch.world_size == 1 and args.num_gpus > 1:
        return run_under_torchrun(args, argv)
    if launch.world_size > 1 and args.num_gpus not in (1, launch.world_size):
        raise UserError(f"-g {args.num_gpus} but {launch.launcher} started {launch.world_size} processes; "
                        "under a launcher leave -g out")
    ctx = init_distributed(args.device)
    try:
        return benchmark(args, flops, ctx)
    finally:
        teardown_distributed(ctx)


if __name__ == "__main__":
    run_main(main)
