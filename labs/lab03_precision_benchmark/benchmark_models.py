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
it; precisions the device cannot run are skipped with the reason, in the summary CSV and the records
(none that can: one line, exit 2).

Output (``lab03_shared.Output``): in ``--folder``, the SJTU page's CSV layout (one file per mode and
precision, a column per model, a row per timed iteration, milliseconds per batch) plus
``<tag>_summary.csv``; in ``--results-dir``, one result record per model, mode and precision (lab
``lab03``, method ``<mode>-<precision>``).
"""

from __future__ import annotations

import argparse
import copy
import sys
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.precision import set_fp32_math
from common.train import amp
from common.cli import DefaultsHelpFormatter, script_parser
from common.runtime.device import configure_threads, seed_everything
from common.runtime.distributed import DistContext, init_distributed, teardown_distributed
from common.measure.energy import EnergyMeter
from common.errors import run_main
from common.runtime.launch import detect_launch
from common.models import build_model, logits
from common.measure.timing import StepTimer, peak_memory, reset_peak_memory
from labs.lab03_precision_benchmark.lab03_shared import (
    MAX_SKIPPED_CHECK_STEPS, MOMENTUM, NUM_CLASSES, Output, add_benchmark_args, check_request, compare_losses,
    compile_fresh, compile_outcome, count_flops, fixed_batch, read_args, run_under_torchrun,
)

#: Precisions that cast the whole model; the others keep float32 weights.
WEIGHT_DTYPES = {"fp64": torch.float64, "half": torch.float16}
#: Precisions that autocast, by their name in common.train.amp.
AUTOCAST = {"amp-fp16": "fp16", "amp-bf16": "bf16"}


# --- What a precision changes: the weights' dtype, TF32 on or off (see benchmark), and the autocast context ---


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


# --- One training step and one inference step: what is timed ---------------------------------------------


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


# --- The benchmark on one process (rank) -----------------------------------------------------------------


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
    with Output(args, ctx) as out:  # every 30 s without a line, it says what it is still measuring
        runnable = out.start()  # prints what runs; a precision this device cannot run is skipped, saying why

        for model_name in args.models:
            seed_everything(args.seed)  # the same initial weights and batch for every precision
            base = build_model(model_name, num_classes=NUM_CLASSES)
            images, labels = fixed_batch(args, device)
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
                    check = compare_losses(losses, reference, args.loss_tolerance, attempts=attempts,
                                           skipped_steps=skipped)
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


def build_parser() -> argparse.ArgumentParser:  # --help shows the defaults without "(default: ...)" in each help
    return add_benchmark_args(script_parser(__doc__, formatter_class=DefaultsHelpFormatter))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = read_args(build_parser(), argv)
    configure_threads()
    relaunch = check_request(args, detect_launch())  # -g, the device, a precision that runs: before the FLOPs
    # Every model must take the image size before anything is timed (and the FLOPs are counted once).
    flops = {name: count_flops(name, args.batch_size, args.image_size) for name in args.models}
    if relaunch:
        return run_under_torchrun(args, argv, __file__)
    ctx = init_distributed(args.device)
    try:
        return benchmark(args, flops, ctx)
    finally:
        teardown_distributed(ctx)


if __name__ == "__main__":
    run_main(main)
