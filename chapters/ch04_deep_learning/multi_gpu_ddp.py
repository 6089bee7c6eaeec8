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

This file is ``mnist_training.py`` with the blocks marked ``# >>> ddp`` ... ``# <<< ddp`` in place of
those marked ``# >>> single`` there; ``tests/test_ch04.py`` checks that ``train()`` and ``test()``
differ in nothing else, so the pair stays in step.

Pre-emption: on SIGUSR1 (``#SBATCH --signal=B:USR1@120``) or SIGTERM, all ranks agree to stop at the
next step, rank 0 saves ``--checkpoint`` atomically, and the job exits 0; run it again (or let
``--requeue`` do it) with ``--resume`` and it continues from that step, giving the same parameters
as a run that was never interrupted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere without installing
from common import amp
from common.checkpoint import (Preempted, StopSignal, check_same_settings, load_checkpoint, restore_training_state,
                               save_checkpoint, training_state)
from common.cli import add_common_args, apply_dry_run, config_dict, positive_float
from common.data import DATASETS, get_dataset, make_loader
from common.device import configure_threads, describe, seed_everything
from common.distributed import (all_reduce_sum, any_rank, gather_objects, init_distributed, print0,
                                teardown_distributed)
from common.errors import run_main
from common.models import build_model, parameter_digest
from common.results import make_record, provenance, write_record
from common.timing import StepTimer, peak_memory, reset_peak_memory
from common.units import format_bytes

SCRIPT = "chapters/ch04_deep_learning/multi_gpu_ddp.py"


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
        # >>> ddp: the signal reaches the ranks at different moments, but they must all stop at the
        # same step (or the others wait forever in the next all-reduce): agree first.
        if any_rank(stop.requested is not None, device):
            raise Preempted(batch_idx, total_loss, batches)
        # <<< ddp
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
            # >>> ddp: only rank 0 prints; the loss shown is rank 0's own batch
            print0(f"Train Epoch: {epoch} [{batch_idx * len(data) * args.world_size}/{len(loader.dataset)}] "
                   f"loss {loss.item():.6f}")
            # <<< ddp
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
    # >>> ddp: each rank evaluated its own slice of the test set; add the slices up
    loss_sum, correct, seen = (all_reduce_sum(v, device) for v in (loss_sum, correct, seen))
    # <<< ddp
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
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoints/multi_gpu_ddp.pt"),
                        help="rank 0 saves here after every epoch and on pre-emption (default: %(default)s)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from --checkpoint when it exists (default: start fresh)")
    add_common_args(parser, epochs=3, batch_size=64, num_workers=0)
    return parser


#: What the checkpoint holds besides the training state (common.checkpoint.training_state).
PROGRESS = ("epoch", "step", "loss_sum", "batches", "train_losses", "epoch_times", "test_loss", "accuracy")
#: Settings a resumed run must share with the run that wrote the checkpoint (more --epochs is fine).
RESUME_SETTINGS = ("dataset", "model", "batch_size", "seed", "amp", "max_steps", "world_size")


def main(argv: list[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv))
    seed_everything(args.seed)  # same seed on every rank: every replica starts from the same weights
    threads = configure_threads()
    ctx = init_distributed(args.device, force_process_group=True)
    stop = StopSignal().install()
    try:
        device, args.world_size = ctx.device, ctx.world_size
        args.amp = amp.check_precision(args.amp, device)
        splits = get_dataset(args.dataset, args.data_dir, seed=args.seed)
        model = build_model(args.model, num_classes=splits.num_classes, in_channels=splits.input_shape[0]).to(device)
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        train_loader, sampler = make_loader(splits.train, args.batch_size, shuffle=True, distributed=True,
                                            num_workers=args.num_workers, pin_memory=device.type == "cuda",
                                            seed=args.seed)
        test_slice = Subset(splits.test, range(ctx.rank, len(splits.test), ctx.world_size))
        test_loader, _ = make_loader(test_slice, args.test_batch_size, shuffle=False, num_workers=args.num_workers)
        optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
        scaler = amp.grad_scaler(device, args.amp)
        timer = StepTimer(device, warmup_steps=args.warmup_steps)
        print0(f"DDP: {ctx.world_size} process(es), backend {ctx.backend}, launcher {ctx.launch.launcher} | "
               f"device {describe(device)} | data {args.dataset} train={len(splits.train)} | "
               f"global batch {args.batch_size * ctx.world_size} | threads {threads}")

        first_epoch, start_step, loss_sum, batches = 1, 0, 0.0, 0
        train_losses, epoch_times, test_loss, accuracy = [], [], float("nan"), 0.0
        state = load_checkpoint(args.checkpoint) if args.resume else None
        if state is not None:  # every rank loads the same file: the replicas start equal again
            check_same_settings(state, {key: getattr(args, key) for key in RESUME_SETTINGS}, args.checkpoint)
            done = restore_training_state(state, model.module, optimizer, scheduler, scaler, needs=PROGRESS,
                                          path=args.checkpoint)
            first_epoch, start_step, loss_sum, batches = done["epoch"], done["step"], done["loss_sum"], done["batches"]
            train_losses, epoch_times, test_loss, accuracy = (done["train_losses"], done["epoch_times"],
                                                              done["test_loss"], done["accuracy"])
            print0(f"resumed from {args.checkpoint}: epoch {first_epoch}, step {start_step}")

        def checkpoint(epoch: int, step: int, loss_sum: float, batches: int) -> None:
            if ctx.is_main:
                save_checkpoint(training_state(model.module, optimizer, scheduler, scaler, epoch=epoch, step=step,
                                               loss_sum=loss_sum, batches=batches, train_losses=train_losses,
                                               epoch_times=epoch_times, test_loss=test_loss, accuracy=accuracy,
                                               config=config_dict(args)), args.checkpoint)

        reset_peak_memory(device)
        for epoch in range(first_epoch, args.epochs + 1):
            sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
            start = time.perf_counter()
            try:
                train_losses.append(train(model, device, train_loader, optimizer, epoch, args, scaler, timer, stop,
                                          start_step, loss_sum, batches))
            except Preempted as where:
                checkpoint(epoch, where.step, where.loss_sum, where.batches)
                print0(f"received {stop.name}: saved {args.checkpoint} at epoch {epoch} step {where.step}; "
                       "exiting so the job can be requeued (resume with --resume)")
                return 0
            start_step, loss_sum, batches = 0, 0.0, 0
            epoch_times.append(time.perf_counter() - start)
            test_loss, accuracy = test(model, device, test_loader, args)
            scheduler.step()
            checkpoint(epoch + 1, 0, 0.0, 0)
            throughput = (timer.summary()["samples_per_s"] or 0) * ctx.world_size
            print0(f"epoch {epoch}: train loss {train_losses[-1]:.4f} (rank 0) | test loss {test_loss:.4f} | "
                   f"accuracy {100 * accuracy:.2f}% | {epoch_times[-1]:.2f} s | {throughput:.0f} samples/s (job)")

        step_time = timer.summary()
        memory = peak_memory(device)
        # Every rank hashes its own replica; DDP is correct only if all the hashes agree.
        digests = gather_objects(parameter_digest(model.module))
        print0(f"parameters identical on all {len(digests)} ranks: {'yes' if len(set(digests)) == 1 else 'NO'}")
        if ctx.is_main:
            metrics = {
                "train_loss": train_losses, "final_loss": train_losses[-1] if train_losses else None,
                "test_loss": test_loss, "test_accuracy": accuracy, "epochs": args.epochs, "steps": timer.seen,
                "global_batch_size": args.batch_size * ctx.world_size, "world_size": ctx.world_size,
                "epoch_time_s": epoch_times,
                "time_per_epoch_s": sorted(epoch_times)[len(epoch_times) // 2] if epoch_times else None,
                "samples_per_s": (step_time["samples_per_s"] or 0) * ctx.world_size,
                "step_time": step_time, "memory": [memory], "param_digest_per_rank": digests,
            }
            record = make_record(lab="ch04", script=SCRIPT, method="ddp",
                                 config=config_dict(args, resolved_device=str(device), **splits.describe()),
                                 metrics=metrics, provenance=provenance(device, ctx.world_size,
                                                                        {"distributed": ctx.describe()}))
            path = write_record(record, args.results_dir)
            print0(f"final: accuracy {100 * accuracy:.2f}% | final train loss {metrics['final_loss']:.6f} | "
                   f"peak memory rank 0 {format_bytes(memory['peak_bytes'])} ({memory['source']})")
            print0(f"checkpoint: {args.checkpoint}")
            print0(f"record: {path}")
        return 0
    finally:
        stop.restore()
        teardown_distributed(ctx)


if __name__ == "__main__":
    run_main(main)
