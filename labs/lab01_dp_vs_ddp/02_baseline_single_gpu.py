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

``03_dataparallel_training.py`` is this script with DataParallel: its ``train()`` and ``test()``
are the same code, only the lines marked ``# >>> dp`` there are new. Data order and initial weights
come from the seed alone (``lab01_shared.GlobalBatchSampler``), so with ``--model plain_cnn`` the
three scripts print the same losses step by step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere without installing
from common.cli import add_common_args, apply_dry_run, config_dict
from common.data import get_dataset, make_loader
from common.device import configure_threads, describe, resolve_device, seed_everything
from common.errors import run_main
from common.results import make_record, provenance, write_record
from common.timing import StepTimer, peak_memory, reset_peak_memory
from common.units import format_bytes
from labs.lab01_dp_vs_ddp.lab01_shared import LAB, add_lab_args, build_lab_model, make_train_loader

SCRIPT = "labs/lab01_dp_vs_ddp/02_baseline_single_gpu.py"


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
    add_common_args(parser, epochs=5, batch_size=64)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv))
    threads = configure_threads()
    device = resolve_device(args.device)
    splits = get_dataset(args.dataset, args.data_dir, image_size=args.image_size,
                         synthetic_size=args.synthetic_size, seed=args.seed)
    seed_everything(args.seed)  # right before the build: 02, 03 and 04 start from the same weights
    model = build_lab_model(args.model, splits.num_classes, splits.input_shape[0]).to(device)
    train_loader, sampler = make_train_loader(splits.train, args.batch_size, seed=args.seed,
                                              num_workers=args.num_workers, pin_memory=device.type == "cuda")
    test_loader, _ = make_loader(splits.test, args.batch_size, shuffle=False, num_workers=args.num_workers)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    timer = StepTimer(device, warmup_steps=args.warmup_steps)
    print(f"baseline: device {describe(device)} | model {args.model} | data {args.dataset} "
          f"{tuple(splits.input_shape)} train={len(splits.train)} | global batch {args.batch_size} | "
          f"threads {threads}", flush=True)

    reset_peak_memory(device)
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
    memory = peak_memory(device)
    metrics = {
        "train_loss": train_losses, "final_loss": train_losses[-1], "loss_at_step": loss_at_step,
        "test_loss": test_loss, "test_accuracy": accuracy, "epochs": args.epochs, "steps": timer.seen,
        "global_batch_size": args.batch_size, "world_size": 1, "devices": 1,
        "epoch_time_s": epoch_times, "time_per_epoch_s": statistics.median(epoch_times),
        "samples_per_s": step_time["samples_per_s"], "step_time": step_time, "memory": [memory],
    }
    config = config_dict(args, resolved_device=str(device), global_batch_size=args.batch_size, **splits.describe())
    record = make_record(lab=LAB, script=SCRIPT, method="baseline", config=config, metrics=metrics,
                         provenance=provenance(device))
    path = write_record(record, args.results_dir)
    print(f"final: train loss {train_losses[-1]:.4f} | {step_time['samples_per_s'] or 0:.1f} samples/s | "
          f"median step {1000 * (step_time['median_s'] or 0):.1f} ms | peak memory "
          f"{format_bytes(memory['peak_bytes'])} ({memory['source']})")
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
