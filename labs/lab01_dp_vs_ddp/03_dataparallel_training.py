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
``train()`` and ``test()`` are those of ``02_baseline_single_gpu.py`` unchanged; the lines marked
``# >>> dp`` are all that DataParallel adds.

On a machine without a GPU, DataParallel has nothing to split across: the model is not wrapped,
this is the baseline run under another name, and the record says so in its notes. ``--gpus`` naming
GPUs that do not exist stops with one error line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere without installing
from common.cli import add_common_args, apply_dry_run, config_dict
from common.data import get_dataset, make_loader
from common.device import configure_threads, describe, resolve_device, seed_everything
from common.errors import UserError, run_main
from common.results import make_record, provenance, write_record
from common.timing import StepTimer, peak_memory, reset_peak_memory
from common.units import format_bytes
from labs.lab01_dp_vs_ddp.lab01_shared import (LAB, add_lab_args, build_lab_model, check_gpu_ids, make_train_loader,
                                               parse_gpu_ids)

SCRIPT = "labs/lab01_dp_vs_ddp/03_dataparallel_training.py"


def train(model, device, loader, optimizer, epoch, args, timer) -> list[float]:
    """One epoch; returns the training loss of every step."""
    model.train()
    losses = []
    steps = min(len(loader), args.max_steps or len(loader))
    for step, (data, target) in enumerate(loader):
        if step >= steps:
            break
        with timer.step(samples=len(data)):
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            output = model(data)
            loss = F.cross_entropy(output, target)
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
        if step % args.log_interval == 0 or step == steps - 1:
            print(f"epoch {epoch} step {step + 1}/{steps}: loss {losses[-1]:.4f}", flush=True)
    return losses


@torch.no_grad()
def test(model, device, loader, args) -> tuple[float, float]:
    """Mean loss and accuracy on the held-out split.

    With ``--max-steps`` only that many batches are evaluated: tiny runs stay tiny.
    """
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    for batch, (data, target) in enumerate(loader):
        if args.max_steps is not None and batch >= args.max_steps:
            break
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        output = model(data)
        loss_sum += F.cross_entropy(output, target, reduction="sum").item()
        correct += (output.argmax(dim=1) == target).sum().item()
        seen += len(target)
    return loss_sum / max(seen, 1), correct / max(seen, 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_lab_args(parser)
    # >>> dp
    parser.add_argument("--gpus", type=parse_gpu_ids, default=None,
                        help="GPUs to use, e.g. 0,1,2,3; the first one gathers outputs and gradients "
                             "(default: every visible GPU)")
    # <<< dp
    add_common_args(parser, epochs=5, batch_size=256)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv))
    threads = configure_threads()
    device = resolve_device(args.device)
    # >>> dp: which GPUs; the first of them is the "primary" that holds the model between steps
    if args.gpus is not None and args.device == "cpu":
        raise UserError("--gpus picks GPUs for DataParallel; it cannot be combined with --device cpu")
    visible = torch.cuda.device_count() if device.type == "cuda" else 0
    if args.gpus is not None:
        check_gpu_ids(args.gpus, visible)
    gpus = (args.gpus or list(range(visible))) if device.type == "cuda" else []
    if gpus:
        device = torch.device("cuda", gpus[0])
    # <<< dp
    splits = get_dataset(args.dataset, args.data_dir, image_size=args.image_size,
                         synthetic_size=args.synthetic_size, seed=args.seed)
    seed_everything(args.seed)  # right before the build: 02, 03 and 04 start from the same weights
    model = build_lab_model(args.model, splits.num_classes, splits.input_shape[0]).to(device)
    # >>> dp: the one line; without a GPU there is nothing to split over, so the model runs as it is
    if gpus:
        model = nn.DataParallel(model, device_ids=gpus)
    # <<< dp
    train_loader, sampler = make_train_loader(splits.train, args.batch_size, seed=args.seed,
                                              num_workers=args.num_workers, pin_memory=device.type == "cuda")
    test_loader, _ = make_loader(splits.test, args.batch_size, shuffle=False, num_workers=args.num_workers)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    timer = StepTimer(device, warmup_steps=args.warmup_steps)
    # >>> dp
    where = f"DataParallel over GPUs {gpus}, primary {describe(device)}" if gpus else f"{describe(device)}, not wrapped"
    # <<< dp
    print(f"dp: {where} | model {args.model} | data {args.dataset} "
          f"{tuple(splits.input_shape)} train={len(splits.train)} | global batch {args.batch_size} | "
          f"threads {threads}", flush=True)

    reset_peak_memory(device)
    # >>> dp: a new peak-memory window on the other GPUs too. (The timer synchronises only the
    # primary GPU; that is enough, because each step ends there: the gradients are summed onto it.)
    for gpu in gpus[1:]:
        reset_peak_memory(torch.device("cuda", gpu))
    # <<< dp
    train_losses, loss_at_step, epoch_times = [], [], []
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        losses = train(model, device, train_loader, optimizer, epoch, args, timer)
        epoch_times.append(time.perf_counter() - start)
        train_losses.append(statistics.fmean(losses))
        loss_at_step.extend(losses[:max(0, args.record_steps - len(loss_at_step))])
        print(f"epoch {epoch}: train loss {train_losses[-1]:.4f} | {epoch_times[-1]:.2f} s | "
              f"{timer.summary()['samples_per_s'] or 0:.1f} samples/s", flush=True)

    test_loss, accuracy = test(model, device, test_loader, args)
    print(f"test: loss {test_loss:.4f} | accuracy {100 * accuracy:.2f}%", flush=True)

    step_time = timer.summary()
    # >>> dp: one memory entry per GPU, the primary first
    memory = [peak_memory(torch.device("cuda", gpu)) for gpu in gpus] if gpus else [peak_memory(device)]
    notes = [] if gpus else ["DataParallel on CPU is the degenerate one-device case: no GPU to split the batch "
                             "over, so the model was not wrapped and this run is the baseline's computation"]
    # <<< dp
    metrics = {
        "train_loss": train_losses, "final_loss": train_losses[-1], "loss_at_step": loss_at_step,
        "test_loss": test_loss, "test_accuracy": accuracy, "epochs": args.epochs, "steps": timer.seen,
        "global_batch_size": args.batch_size, "world_size": 1, "devices": max(1, len(gpus)),
        "epoch_time_s": epoch_times, "time_per_epoch_s": statistics.median(epoch_times),
        "samples_per_s": step_time["samples_per_s"], "step_time": step_time, "memory": memory,
    }
    config = config_dict(args, resolved_device=str(device), global_batch_size=args.batch_size, dp_device_ids=gpus,
                         **splits.describe())
    record = make_record(lab=LAB, script=SCRIPT, method="dp", config=config, metrics=metrics, notes=notes,
                         provenance=provenance(device, extra={"dataparallel": {"device_ids": gpus}}))
    path = write_record(record, args.results_dir)
    print(f"final: train loss {train_losses[-1]:.4f} | {step_time['samples_per_s'] or 0:.1f} samples/s | "
          f"median step {1000 * (step_time['median_s'] or 0):.1f} ms")
    for entry in memory:
        print(f"peak memory {entry['device']}: {format_bytes(entry['peak_bytes'])} ({entry['source']})")
    for note in notes:
        print(f"note: {note}")
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
