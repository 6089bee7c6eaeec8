#!/usr/bin/env python3
"""Train the classic MNIST CNN on one device: CPU or GPU, full precision or mixed precision.

Usage:
    python mnist_training.py --device cpu --dataset digits --epochs 3      # laptop / CI, offline
    python mnist_training.py --dataset mnist --data-dir ~/data --epochs 5  # GPU node (auto-detects)
    python mnist_training.py --amp bf16                                    # mixed precision
    sbatch sbatch/single_gpu.sbatch                                        # on a cluster

What it teaches: the device-agnostic training loop (move the model once, move every batch,
``model.train()``/``model.eval()``), how to time it honestly, and mixed precision with autocast and
a GradScaler. Every run writes a result record (``--results-dir``) that the report tool reads.

``--amp`` chooses the precision of the forward pass: ``fp32`` (off), ``bf16`` (CPU and recent GPUs)
or ``fp16`` (GPU; uses a GradScaler). Gradients are clipped after ``scaler.unscale_()`` so the clip
threshold applies to the true gradients, not the scaled ones. ``amp_training.py`` runs fp32 and AMP
side by side and compares their speed and accuracy. ``multi_gpu_ddp.py`` is this script under DDP:
the lines marked ``# >>> single`` are the ones it replaces.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere without installing
from common import amp
from common.cli import add_common_args, apply_dry_run, config_dict, positive_float
from common.data import DATASETS, get_dataset, make_loader
from common.device import configure_threads, describe, resolve_device, seed_everything
from common.errors import run_main
from common.models import build_model
from common.results import make_record, provenance, write_record
from common.timing import StepTimer, format_bytes, peak_memory, reset_peak_memory

SCRIPT = "chapters/ch04_deep_learning/mnist_training.py"


# >>> single
def train(model, device, loader, optimizer, epoch, args, scaler, timer) -> float:
# <<< single
    """One epoch; returns the mean training loss."""
    model.train()
    # >>> single
    total_loss, batches = 0.0, 0
    # <<< single
    for batch_idx, (data, target) in enumerate(loader):
        if args.max_steps is not None and batch_idx >= args.max_steps:
            break
        with timer.step(samples=len(data)):
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with amp.autocast(device, args.amp):
                output = model(data)
                loss = F.nll_loss(output, target)
            scaler.scale(loss).backward()
            if args.clip_grad_norm:
                scaler.unscale_(optimizer)  # clip the real gradients, not the loss-scaled ones
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            scaler.step(optimizer)
            scaler.update()
        total_loss += loss.item()
        batches += 1
        if batch_idx % args.log_interval == 0:
            # >>> single
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(loader.dataset)}] loss {loss.item():.6f}",
                  flush=True)
            # <<< single
    return total_loss / max(batches, 1)


@torch.no_grad()
def test(model, device, loader, args) -> tuple[float, float]:
    """Mean loss and accuracy on the held-out split."""
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    for data, target in loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with amp.autocast(device, args.amp):
            output = model(data)
        loss_sum += F.nll_loss(output.float(), target, reduction="sum").item()
        correct += (output.argmax(dim=1) == target).sum().item()
        seen += len(target)
    return loss_sum / max(seen, 1), correct / max(seen, 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=DATASETS, default="digits",
                        help="digits is bundled (offline); mnist needs --data-dir (default: %(default)s)")
    parser.add_argument("--model", default="mnist_cnn", help="model name (default: %(default)s)")
    parser.add_argument("--lr", type=positive_float, default=1.0, help="Adadelta learning rate (default: %(default)s)")
    parser.add_argument("--gamma", type=positive_float, default=0.7,
                        help="learning-rate decay per epoch (default: %(default)s)")
    parser.add_argument("--amp", choices=amp.PRECISIONS, default="fp32",
                        help="forward-pass precision: fp32 (off), bf16, fp16 (GPU only) (default: %(default)s)")
    parser.add_argument("--clip-grad-norm", type=float, default=1.0,
                        help="clip gradients to this norm after unscaling; 0 turns it off (default: %(default)s)")
    parser.add_argument("--test-batch-size", type=int, default=1000, help="evaluation batch (default: %(default)s)")
    parser.add_argument("--log-interval", type=int, default=10, help="steps between loss lines (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps left out of timing (default: %(default)s)")
    parser.add_argument("--save-model", action="store_true", help="save the trained weights next to the record")
    add_common_args(parser, epochs=3, batch_size=64, num_workers=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv))
    seed_everything(args.seed)
    threads = configure_threads()
    device = resolve_device(args.device)
    args.amp = amp.check_precision(args.amp, device)
    splits = get_dataset(args.dataset, args.data_dir, seed=args.seed)
    model = build_model(args.model, num_classes=splits.num_classes, in_channels=splits.input_shape[0]).to(device)
    train_loader, _ = make_loader(splits.train, args.batch_size, shuffle=True, num_workers=args.num_workers,
                                  pin_memory=device.type == "cuda", seed=args.seed)
    test_loader, _ = make_loader(splits.test, args.test_batch_size, shuffle=False, num_workers=args.num_workers)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    scaler = amp.grad_scaler(device, args.amp)
    timer = StepTimer(device, warmup_steps=args.warmup_steps)
    print(f"device {describe(device)} | data {args.dataset} {splits.input_shape} train={len(splits.train)} "
          f"test={len(splits.test)} | precision {args.amp} | threads {threads}", flush=True)

    reset_peak_memory(device)
    train_losses, epoch_times, test_loss, accuracy = [], [], float("nan"), 0.0
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        train_losses.append(train(model, device, train_loader, optimizer, epoch, args, scaler, timer))
        epoch_times.append(time.perf_counter() - start)
        test_loss, accuracy = test(model, device, test_loader, args)
        scheduler.step()
        throughput = timer.summary()["samples_per_s"]
        print(f"epoch {epoch}: train loss {train_losses[-1]:.4f} | test loss {test_loss:.4f} | "
              f"accuracy {100 * accuracy:.2f}% | {epoch_times[-1]:.2f} s | "
              f"{throughput or 0:.0f} samples/s", flush=True)

    step_time = timer.summary()
    memory = peak_memory(device)
    metrics = {
        "train_loss": train_losses, "final_loss": train_losses[-1], "test_loss": test_loss,
        "test_accuracy": accuracy, "epochs": args.epochs, "steps": timer.seen,
        "global_batch_size": args.batch_size, "world_size": 1, "epoch_time_s": epoch_times,
        "time_per_epoch_s": sorted(epoch_times)[len(epoch_times) // 2],
        "samples_per_s": step_time["samples_per_s"], "step_time": step_time, "memory": [memory],
    }
    record = make_record(lab="ch04", script=SCRIPT, method=args.amp,
                         config=config_dict(args, resolved_device=str(device), **splits.describe()),
                         metrics=metrics, provenance=provenance(device))
    path = write_record(record, args.results_dir)
    if args.save_model:
        from common.checkpoint import save_checkpoint

        save_checkpoint({"model": model.state_dict()}, path.with_suffix(".pt"))
    print(f"final: accuracy {100 * accuracy:.2f}% | final train loss {train_losses[-1]:.6f} | "
          f"median step {1000 * (step_time['median_s'] or 0):.2f} ms | peak memory {format_bytes(memory['peak_bytes'])} "
          f"({memory['source']})")
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
