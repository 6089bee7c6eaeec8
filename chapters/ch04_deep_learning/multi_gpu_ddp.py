#!/usr/bin/env python3
"""The MNIST training of ``mnist_training.py`` under DistributedDataParallel (DDP).

Usage:
    torchrun --standalone --nproc_per_node=2 multi_gpu_ddp.py --device cpu --epochs 2   # 2 CPU processes (Gloo)
    torchrun --standalone --nproc_per_node=4 multi_gpu_ddp.py --dataset mnist --data-dir ~/data  # 4 GPUs (NCCL)
    srun --kill-on-bad-exit=1 python multi_gpu_ddp.py ...                                # one task per GPU
    python multi_gpu_ddp.py --device cpu                                                 # 1 process, still DDP
    sbatch sbatch/multi_gpu.sbatch

What it teaches: one process per device; each process builds the same model, DDP averages the
gradients in the backward pass so every replica takes the same step; a ``DistributedSampler``
gives each rank its own shard and must be told the epoch (``set_epoch``) or every epoch repeats the
same order; only rank 0 prints, writes the record and saves the checkpoint.

This file is ``mnist_training.py`` plus the lines that make it DDP: ``diff mnist_training.py
multi_gpu_ddp.py`` shows them all (``tests/test_ch04.py`` keeps that diff small, so the pair stays
in step). ``train()`` is the same function: the ranks agreeing to stop at the same step is done by
``common.train.run.TrainingRun``, which also keeps the checkpoints and writes the record; the evaluation
adds up the slices the ranks scored (``across_ranks=True``). The flags are ``ch04_shared.py``'s.

Pre-emption: on SIGUSR1 (``#SBATCH --signal=B:USR1@120``) or SIGTERM, all ranks agree to stop at the
next step, rank 0 saves ``--checkpoint`` atomically, and the job exits 0; run it again (or let
``--requeue`` do it) with ``--resume`` and it continues from that step, giving the same parameters
as a run that was never interrupted. Without ``--checkpoint`` it is kept in
``RESULTS_DIR/checkpoints/multi_gpu_ddp.pt``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, Subset

from common.train import amp
from common.cli import add_common_args, script_parser
from common.data.datasets import get_dataset, loader_line, make_loader, resident_device
from common.runtime.device import seed_everything
from common.errors import run_main
from common.train.evaluation import evaluate
from common.models import build_model
from common.checkpoint.single_file import save_checkpoint
from common.train.flags import add_checkpoint_args
from common.train.run import TrainingRun
from chapters.ch04_deep_learning.ch04_shared import RESUME_SETTINGS, add_mnist_args

SCRIPT = "chapters/ch04_deep_learning/multi_gpu_ddp.py"


def train(model, device, loader, optimizer, args, scaler, run) -> None:
    """One epoch: every batch ``run.steps`` hands out (timed; it stops early on a pre-emption signal)."""
    model.train()
    for data, target in run.steps(loader):
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with amp.autocast(device, args.precision):
            output = model(data)
            loss = F.nll_loss(output, target)
        scaler.scale(loss).backward()  # DDP all-reduces (averages) the gradients during backward()
        if args.clip_grad_norm:
            scaler.unscale_(optimizer)  # clip the real gradients, not the loss-scaled ones
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        run.log_loss(loss)


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_mnist_args(parser)
    add_checkpoint_args(parser, always=True)
    add_common_args(parser, epochs=3, batch_size=64)  # --num-workers from the allocation
    return parser


def main(argv: list[str] | None = None) -> int:
    train_and_record(build_parser().parse_args(argv))
    return 0


def train_and_record(args: argparse.Namespace) -> Path | None:
    """The whole run for parsed ``args``: returns the record's path (on rank 0)."""
    with TrainingRun(args, lab="ch04", script=SCRIPT, method="ddp", resume_settings=RESUME_SETTINGS,
                     distributed=True) as run:  # one process per device: torchrun, srun or plain python
        device = run.device
        args.precision = amp.check_precision(args.precision, device)
        seed_everything(args.seed)  # the same seed on every rank: every replica starts from the same weights
        splits = get_dataset(args.dataset, args.data_dir, image_size=28, channels=1, seed=args.seed)  # MNIST-shaped
        model = build_model(args.model, num_classes=splits.num_classes, in_channels=splits.input_shape[0]).to(device)
        resident = resident_device(args.data_on_device, [splits.train, splits.test], device)  # whole set on the GPU?
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        seed_everything(args.seed + run.rank)  # now each rank draws its own dropout masks
        # Each rank takes its own shard of every epoch; the test set is split between ranks too.
        sampler = DistributedSampler(splits.train, num_replicas=run.world_size, rank=run.rank, shuffle=True,
                                     seed=args.seed)
        train_loader, _ = make_loader(splits.train, args.batch_size, shuffle=True, sampler=sampler,
                                      num_workers=args.num_workers, pin_memory=device.type == "cuda", seed=args.seed,
                                      resident_on=resident)
        test_slice = Subset(splits.test, range(run.rank, len(splits.test), run.world_size))
        test_loader, _ = make_loader(test_slice, args.test_batch_size, shuffle=False, num_workers=args.num_workers,
                                     resident_on=resident)
        optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
        scaler = amp.grad_scaler(device, args.precision)
        run.print(f"DDP: {run.describe()} | data {args.dataset} {splits.input_shape} "
                  f"train={len(splits.train)} test={len(splits.test)} | precision {args.precision} | "
                  f"global batch {args.batch_size * run.world_size}")
        run.print(f"batches: {loader_line(train_loader)}")

        run.track(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
        for epoch in run.epochs():
            sampler.set_epoch(epoch)  # a new order each epoch, from the seed and the epoch alone (on every rank)
            train(model, device, train_loader, optimizer, args, scaler, run)
            run.evaluated(*evaluate(model, test_loader, device, loss=F.nll_loss, precision=args.precision,
                                    across_ranks=True))  # each rank scored its slice: sums added over ranks
            scheduler.step()
            state = run.checkpoint_state()  # model.module's weights, ...; every rank's random state (collective)
            if run.is_main:  # the replicas are identical: rank 0 alone writes the one file
                save_checkpoint(state, args.checkpoint)
        return run.finish(config=splits.describe())  # every rank's memory and parameter hash; rank 0 writes
    return None  # stopped by a signal: the checkpoint holds the run, --resume finishes it


if __name__ == "__main__":
    run_main(main)
