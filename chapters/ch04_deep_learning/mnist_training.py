#!/usr/bin/env python3
"""Train the classic MNIST CNN on one device: CPU or GPU, full precision or mixed precision.

Usage:
    python mnist_training.py --device cpu --dataset digits --epochs 3      # laptop / CI, offline
    python mnist_training.py --dataset mnist --data-dir ~/data --epochs 5  # GPU node (auto-detects)
    python mnist_training.py --precision bf16                                    # mixed precision
    sbatch sbatch/single_gpu.sbatch                                        # on a cluster

What it teaches: the device-agnostic training loop (move the model once, move every batch,
``model.train()``/``model.eval()``), how to time it honestly, and mixed precision with autocast and
a GradScaler. Every run writes a result record (``--results-dir``) that the report tool reads.

Feeding the device: MNIST is decoded once into one normalised tensor, and with
``--data-on-device auto`` the whole set is copied to the GPU once when it fits; each step cuts its
batch there (``batches:`` at the start says so). Otherwise a DataLoader with ``--num-workers``
processes (from ``SLURM_CPUS_PER_TASK``) and pinned memory feeds it. Samples/s include any wait for
data, so they agree with the epoch's wall time.

``--precision`` chooses the precision of the forward pass: ``fp32`` (off), ``bf16`` (CPU and recent GPUs)
or ``fp16`` (GPU; uses a GradScaler). Gradients are clipped after ``scaler.unscale_()`` so the clip
threshold applies to the true gradients, not the scaled ones. ``amp_training.py`` runs fp32 and AMP
side by side and compares their speed and accuracy. ``multi_gpu_ddp.py`` is this script under DDP:
diff the two files to see everything DDP changes.

Pre-emption (``sbatch/single_gpu.sbatch``): with ``--checkpoint PATH`` the run saves there after
every epoch, and on SIGUSR1 (``#SBATCH --signal=B:USR1@120``) or SIGTERM it stops at the next step,
saves atomically and exits 0. Run it again with ``--resume`` and it continues from that step, ending
with the same weights as a run that was never stopped. Without ``--checkpoint`` nothing is saved
and a signal ends the run as usual. ``common.train.run.TrainingRun`` does this bookkeeping (and the
timing and the result record) and ``common.train.evaluation.evaluate`` scores the held-out split, so that
what you read below is the training itself. The flags, shared with ``multi_gpu_ddp.py``, are in
``ch04_shared.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from common.train import amp
from common.cli import add_common_args, script_parser
from common.data.datasets import get_dataset, loader_line, make_loader, resident_device
from common.runtime.device import seed_everything
from common.errors import run_main
from common.train.evaluation import evaluate
from common.models import build_model
from common.train.flags import add_checkpoint_args
from common.train.run import TrainingRun
from chapters.ch04_deep_learning.ch04_shared import RESUME_SETTINGS, add_mnist_args

SCRIPT = "chapters/ch04_deep_learning/mnist_training.py"


def train(model, device, loader, optimizer, args, scaler, run) -> None:
    """One epoch: every batch ``run.steps`` hands out (timed; it stops early on a pre-emption signal)."""
    model.train()
    for data, target in run.steps(loader):
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with amp.autocast(device, args.precision):
            output = model(data)
            loss = F.nll_loss(output, target)
        scaler.scale(loss).backward()
        if args.clip_grad_norm:
            scaler.unscale_(optimizer)  # clip the real gradients, not the loss-scaled ones
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        run.log_loss(loss)


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_mnist_args(parser)
    parser.add_argument("--save-model", action="store_true",
                        help="save the trained weights next to the record (default: off)")
    add_checkpoint_args(parser)
    add_common_args(parser, epochs=3, batch_size=64)  # --num-workers from the allocation
    return parser


def main(argv: list[str] | None = None) -> int:
    train_and_record(build_parser().parse_args(argv))
    return 0


def train_and_record(args: argparse.Namespace) -> Path | None:
    """The whole run for parsed ``args``: returns the record's path (on rank 0)."""
    with TrainingRun(args, lab="ch04", script=SCRIPT, method=args.precision, resume_settings=RESUME_SETTINGS) as run:
        device = run.device
        args.precision = amp.check_precision(args.precision, device)
        seed_everything(args.seed)
        splits = get_dataset(args.dataset, args.data_dir, image_size=28, channels=1, seed=args.seed)  # MNIST-shaped
        model = build_model(args.model, num_classes=splits.num_classes, in_channels=splits.input_shape[0]).to(device)
        resident = resident_device(args.data_on_device, [splits.train, splits.test], device)  # whole set on the GPU?
        train_loader, sampler = make_loader(splits.train, args.batch_size, shuffle=True, num_workers=args.num_workers,
                                      pin_memory=device.type == "cuda", seed=args.seed, resident_on=resident)
        test_loader, _ = make_loader(splits.test, args.test_batch_size, shuffle=False, num_workers=args.num_workers,
                                     resident_on=resident)
        optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
        scaler = amp.grad_scaler(device, args.precision)
        run.print(f"{run.describe()} | data {args.dataset} {splits.input_shape} train={len(splits.train)} "
                  f"test={len(splits.test)} | precision {args.precision}")
        run.print(f"batches: {loader_line(train_loader)}")

        run.track(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
        for epoch in run.epochs():
            sampler.set_epoch(epoch)  # a new order each epoch, from the seed and the epoch alone (on every rank)
            train(model, device, train_loader, optimizer, args, scaler, run)
            run.evaluated(*evaluate(model, test_loader, device, loss=F.nll_loss, precision=args.precision))
            scheduler.step()
            run.save_checkpoint()  # with --checkpoint: after every epoch (and on SIGUSR1/SIGTERM)
        record = run.finish(config=splits.describe())
        if args.save_model:
            torch.save(model.state_dict(), record.with_suffix(".pt"))
        return record
    return None  # stopped by a signal: the checkpoint holds the run, --resume finishes it


if __name__ == "__main__":
    run_main(main)
