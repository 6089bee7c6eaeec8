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

Pre-emption (``sbatch/single_gpu.sbatch``): with ``--checkpoint PATH`` the run saves there after
every epoch, and on SIGUSR1 (``#SBATCH --signal=B:USR1@120``) or SIGTERM it stops at the next step,
saves atomically and exits 0. Run it again with ``--resume`` and it continues from that step, ending
with the same weights as a run that was never stopped. Without ``--checkpoint`` nothing is saved
and a signal ends the run as usual.
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
from common.checkpoint import (Preempted, StopSignal, check_same_settings, load_checkpoint, restore_training_state,
                               save_checkpoint, training_state)
from common.cli import add_common_args, apply_dry_run, config_dict, positive_float
from common.data import DATASETS, get_dataset, make_loader
from common.device import configure_threads, describe, resolve_device, seed_everything
from common.errors import UserError, run_main
from common.models import build_model
from common.results import make_record, provenance, write_record
from common.timing import StepTimer, peak_memory, reset_peak_memory
from common.units import format_bytes

SCRIPT = "chapters/ch04_deep_learning/mnist_training.py"


def train(model, device, loader, optimizer, epoch, args, scaler, timer, stop, start_step=0, loss_sum=0.0,
          batches=0) -> float:
    """One epoch from ``start_step`` (0, or where a resumed run stopped); returns the mean training loss."""
    model.train()
    total_loss = loss_sum
    for batch_idx, (data, target) in enumerate(loader):
        if args.max_steps is not None and batch_idx >= args.max_steps:
            break
        # Resume mid-epoch: the loader gives this epoch's order again, so skip what was done.
        if batch_idx < start_step:
            continue
        # >>> single: SIGUSR1 or SIGTERM arrived (only with --checkpoint): stop here, main() saves
        if stop.requested is not None:
            raise Preempted(batch_idx, total_loss, batches)
        # <<< single
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
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="save here after every epoch and on SIGUSR1/SIGTERM, then exit 0 (default: no checkpoint)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from --checkpoint when it exists (default: start fresh)")
    add_common_args(parser, epochs=3, batch_size=64, num_workers=0)
    return parser


#: What the checkpoint holds besides the training state (common.checkpoint.training_state).
PROGRESS = ("epoch", "step", "loss_sum", "batches", "train_losses", "epoch_times", "test_loss", "accuracy")
#: Settings a resumed run must share with the run that wrote the checkpoint (more --epochs is fine).
RESUME_SETTINGS = ("dataset", "model", "batch_size", "seed", "amp", "max_steps")


def main(argv: list[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv))
    if args.resume and args.checkpoint is None:
        raise UserError("--resume needs --checkpoint PATH (the file to continue from)")
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

    first_epoch, start_step, loss_sum, batches = 1, 0, 0.0, 0
    train_losses, epoch_times, test_loss, accuracy = [], [], float("nan"), 0.0
    state = load_checkpoint(args.checkpoint) if args.resume else None
    if state is not None:
        check_same_settings(state, {key: getattr(args, key) for key in RESUME_SETTINGS}, args.checkpoint)
        done = restore_training_state(state, model, optimizer, scheduler, scaler, needs=PROGRESS,
                                      path=args.checkpoint)
        first_epoch, start_step, loss_sum, batches = done["epoch"], done["step"], done["loss_sum"], done["batches"]
        train_losses, epoch_times, test_loss, accuracy = (done["train_losses"], done["epoch_times"],
                                                          done["test_loss"], done["accuracy"])
        print(f"resumed from {args.checkpoint}: epoch {first_epoch}, step {start_step}", flush=True)

    def checkpoint(epoch: int, step: int, loss_sum: float, batches: int) -> None:
        if args.checkpoint is not None:
            save_checkpoint(training_state(model, optimizer, scheduler, scaler, epoch=epoch, step=step,
                                           loss_sum=loss_sum, batches=batches, train_losses=train_losses,
                                           epoch_times=epoch_times, test_loss=test_loss, accuracy=accuracy,
                                           config=config_dict(args)), args.checkpoint)

    stop = StopSignal()
    if args.checkpoint is not None:  # without a checkpoint there is nothing to save: signals act as usual
        stop.install()
    try:
        reset_peak_memory(device)
        for epoch in range(first_epoch, args.epochs + 1):
            # This epoch's shuffle from its number alone (what sampler.set_epoch does under DDP): a
            # resumed run sees the same order as the run it continues.
            train_loader.generator.manual_seed(args.seed + epoch)
            start = time.perf_counter()
            try:
                train_losses.append(train(model, device, train_loader, optimizer, epoch, args, scaler, timer, stop,
                                          start_step, loss_sum, batches))
            except Preempted as where:
                checkpoint(epoch, where.step, where.loss_sum, where.batches)
                print(f"received {stop.name}: saved {args.checkpoint} at epoch {epoch} step {where.step}; "
                      "exiting so the job can be requeued (resume with --resume)", flush=True)
                return 0
            start_step, loss_sum, batches = 0, 0.0, 0
            epoch_times.append(time.perf_counter() - start)
            test_loss, accuracy = test(model, device, test_loader, args)
            scheduler.step()
            checkpoint(epoch + 1, 0, 0.0, 0)
            throughput = timer.summary()["samples_per_s"]
            print(f"epoch {epoch}: train loss {train_losses[-1]:.4f} | test loss {test_loss:.4f} | "
                  f"accuracy {100 * accuracy:.2f}% | {epoch_times[-1]:.2f} s | "
                  f"{throughput or 0:.0f} samples/s", flush=True)
    finally:
        stop.restore()

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
        save_checkpoint({"model": model.state_dict()}, path.with_suffix(".pt"))
    print(f"final: accuracy {100 * accuracy:.2f}% | final train loss {train_losses[-1]:.6f} | "
          f"median step {1000 * (step_time['median_s'] or 0):.2f} ms | peak memory {format_bytes(memory['peak_bytes'])} "
          f"({memory['source']})")
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
