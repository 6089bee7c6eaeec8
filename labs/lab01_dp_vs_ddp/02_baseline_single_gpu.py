#!/usr/bin/env python3
"""Lab-01 step 2: the single-device baseline that DataParallel and DDP are measured against.

Usage:
    python labs/lab01_dp_vs_ddp/02_baseline_single_gpu.py --model resnet50 --batch-size 64 --epochs 5
    python labs/lab01_dp_vs_ddp/02_baseline_single_gpu.py --device cpu --model resnet18 --epochs 2 --max-steps 4
    sbatch baseline_1gpu.sbatch     # rendered from sbatch/baseline_1gpu.sbatch.j2, see the README

What it teaches: the plain training loop on one device, timed honestly (warm-up steps dropped, the
GPU synchronised before the clock is read), with its throughput and peak memory written to a result
record. ``--batch-size`` is the global batch: compare this run with ``03`` and ``04`` at the same
global batch (the README's commands do), or the scaling efficiency means nothing.

``03_dataparallel_training.py`` is this script with DataParallel: diff the two files and the
difference is the lesson (``train()`` is the same code). Data order and initial weights come from
the seed alone (``common.data.datasets.GlobalBatchSampler``), so with ``--model plain_cnn`` the three
scripts print the same losses step by step. ``common.train.run.TrainingRun`` times the steps and writes
the record, and ``common.train.evaluation.evaluate`` scores the held-out split, so what you read below is
the training.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common.cli import add_common_args, script_parser
from common.data.datasets import make_global_batch_loader, make_loader
from common.runtime.device import seed_everything
from common.errors import run_main
from common.train.evaluation import evaluate
from common.models import build_model
from common.train.run import TrainingRun
from labs.lab01_dp_vs_ddp.lab01_shared import LAB, add_lab_args, lab_data

SCRIPT = "labs/lab01_dp_vs_ddp/02_baseline_single_gpu.py"


def train(model, device, loader, optimizer, run) -> None:
    """One epoch: every batch ``run.steps`` hands out, each one timed."""
    model.train()
    for data, target in run.steps(loader):
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()
        run.log_loss(loss)


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_lab_args(parser)
    parser.add_argument("--save-model", action="store_true",
                        help="save the trained weights next to the record (default: off)")
    add_common_args(parser, epochs=5, batch_size=64)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with TrainingRun(args, lab=LAB, script=SCRIPT, method="baseline") as run:
        device = run.device
        splits = lab_data(args)
        seed_everything(args.seed)  # right before the build: 02, 03 and 04 start from the same weights
        model = build_model(args.model, splits.num_classes, splits.input_shape[0]).to(device)
        train_loader = make_global_batch_loader(splits.train, args.batch_size, seed=args.seed,
                                                num_workers=args.num_workers, pin_memory=device.type == "cuda")
        test_loader, _ = make_loader(splits.test, args.batch_size, shuffle=False, num_workers=args.num_workers)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                    weight_decay=args.weight_decay)
        run.print(f"baseline: {run.describe()} | model {args.model} | data {args.dataset} "
                  f"{tuple(splits.input_shape)} train={len(splits.train)} | global batch {args.batch_size}")

        run.track(model=model, optimizer=optimizer)
        for epoch in run.epochs():
            train_loader.batch_sampler.set_epoch(epoch)  # the epoch's order: the same in 02, 03 and 04, on every rank
            train(model, device, train_loader, optimizer, run)
            run.evaluated(*evaluate(model, test_loader, device, max_batches=args.max_steps))
        record = run.finish(config=splits.describe())
        if args.save_model:
            torch.save(model.state_dict(), record.with_suffix(".pt"))
    return 0


if __name__ == "__main__":
    run_main(main)
