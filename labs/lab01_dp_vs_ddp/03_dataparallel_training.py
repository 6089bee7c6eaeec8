#!/usr/bin/env python3
"""Lab-01 step 3: the baseline's training on several GPUs of one node with ``nn.DataParallel``.

Usage:
    python labs/lab01_dp_vs_ddp/03_dataparallel_training.py --model resnet50 --batch-size 256 --epochs 5 --gpus 0,1,2,3
    python labs/lab01_dp_vs_ddp/03_dataparallel_training.py --device cpu --model resnet18 --epochs 2 --max-steps 4
    sbatch dp_4gpu.sbatch           # rendered from sbatch/dp_4gpu.sbatch.j2, see the README

What it teaches: DataParallel is one line (``nn.DataParallel(model, device_ids=gpus)``) and one
process. Every step it copies the model from the first GPU to the others, splits the batch between
them, runs the replicas in threads of one Python process, gathers all outputs back onto the first
GPU for the loss, and sums the gradients there. The first GPU therefore holds more than the others:
the record keeps the peak memory of every GPU so that imbalance is measured, not asserted.

``--batch-size`` is the global batch (DataParallel splits it), so ``--batch-size 256`` on 4 GPUs is
64 per GPU, the same work per step as ``04_ddp_training.py --batch-size 64`` under 4 processes.
``train()`` and the evaluation are those of ``02_baseline_single_gpu.py`` unchanged: diff the two
files to see all that DataParallel adds. Two pitfalls are in those lines: DataParallel does not make the
first listed GPU the current device (``torch.cuda.set_device`` does; without it CUDA's context and
scratch memory land on GPU 0 even with ``--gpus 2,3``), and the wrapped model's state dict has
``module.`` before every key, so ``--save-model`` saves ``model.module.state_dict()``, which loads
into a plain model.

On a machine without a GPU, DataParallel has nothing to split across: the model is not wrapped,
this is the baseline run under another name, and the record says so in its notes. ``--gpus`` naming
GPUs that do not exist stops with one error line.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from common.cli import add_common_args, script_parser
from common.data.datasets import make_global_batch_loader, make_loader
from common.runtime.device import seed_everything
from common.errors import UserError, run_main
from common.train.evaluation import evaluate
from common.models import build_model
from common.train.run import TrainingRun
from labs.lab01_dp_vs_ddp.lab01_shared import LAB, add_lab_args, check_gpu_ids, lab_data, parse_gpu_ids

SCRIPT = "labs/lab01_dp_vs_ddp/03_dataparallel_training.py"


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
    parser.add_argument("--gpus", type=parse_gpu_ids, default=None,
                        help="GPUs to use, e.g. 0,1,2,3; the first one gathers outputs and gradients "
                             "(default: every visible GPU)")
    parser.add_argument("--save-model", action="store_true",
                        help="save the trained weights (model.module's) next to the record (default: off)")
    add_common_args(parser, epochs=5, batch_size=256)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.gpus is not None and args.device == "cpu":
        raise UserError("--gpus picks GPUs for DataParallel; it cannot be combined with --device cpu")
    with TrainingRun(args, lab=LAB, script=SCRIPT, method="dp") as run:
        device = run.device
        # Which GPUs; the first of them is the "primary" that holds the model between steps.
        visible = torch.cuda.device_count() if device.type == "cuda" else 0
        if args.gpus is not None:
            check_gpu_ids(args.gpus, visible)
        gpus = args.gpus or list(range(visible))
        if gpus:
            torch.cuda.set_device(gpus[0])  # DataParallel does not: CUDA's context would land on GPU 0
            run.use_devices([torch.device("cuda", gpu) for gpu in gpus])  # time on the primary, memory of each
            device = run.device
        splits = lab_data(args)
        seed_everything(args.seed)  # right before the build: 02, 03 and 04 start from the same weights
        model = build_model(args.model, splits.num_classes, splits.input_shape[0]).to(device)
        if gpus:  # the one line; without a GPU there is nothing to split over, so the model runs as it is
            model = nn.DataParallel(model, device_ids=gpus)
        train_loader = make_global_batch_loader(splits.train, args.batch_size, seed=args.seed,
                                                num_workers=args.num_workers, pin_memory=device.type == "cuda")
        test_loader, _ = make_loader(splits.test, args.batch_size, shuffle=False, num_workers=args.num_workers)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                    weight_decay=args.weight_decay)
        where = f"DataParallel over GPUs {gpus}, primary cuda:{gpus[0]}" if gpus else "not wrapped (no GPU)"
        run.print(f"dp: {run.describe()} | {where} | model {args.model} | data {args.dataset} "
                  f"{tuple(splits.input_shape)} train={len(splits.train)} | global batch {args.batch_size}")

        run.track(model=model, optimizer=optimizer)
        for epoch in run.epochs():
            train_loader.batch_sampler.set_epoch(epoch)  # the epoch's order: the same in 02, 03 and 04, on every rank
            train(model, device, train_loader, optimizer, run)
            run.evaluated(*evaluate(model, test_loader, device, max_batches=args.max_steps))
        notes = [] if gpus else ["DataParallel on CPU is the degenerate one-device case: no GPU to split the batch "
                                 "over, so the model was not wrapped and this run is the baseline's computation"]
        record = run.finish(config={**splits.describe(), "dp_device_ids": gpus}, notes=notes,
                            metrics={"devices": max(1, len(gpus))})
        if args.save_model:  # model.module: the wrapped model, whose keys have no "module." prefix
            torch.save((model.module if gpus else model).state_dict(), record.with_suffix(".pt"))
    return 0


if __name__ == "__main__":
    run_main(main)
