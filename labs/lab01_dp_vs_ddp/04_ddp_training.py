#!/usr/bin/env python3
"""Lab-01 step 4: the baseline's training with DistributedDataParallel (DDP), one process per device.

Usage:
    torchrun --standalone --nproc_per_node=4 labs/lab01_dp_vs_ddp/04_ddp_training.py --model resnet50 --batch-size 64
    torchrun --standalone --nproc_per_node=2 labs/lab01_dp_vs_ddp/04_ddp_training.py --device cpu --max-steps 4
    srun --kill-on-bad-exit=1 python labs/lab01_dp_vs_ddp/04_ddp_training.py --model resnet50 --batch-size 64
    python labs/lab01_dp_vs_ddp/04_ddp_training.py --device cpu       # one process, still DDP
    sbatch ddp_torchrun_4gpu.sbatch  # rendered from sbatch/ddp_torchrun_4gpu.sbatch.j2, see the README

What it teaches: every process builds the same model on its own device and takes its own slice of
each global batch; DDP all-reduces the gradients in buckets *during* ``backward()``, overlapping
communication with computation, so every replica takes the same optimiser step and no device is a
"primary". Only rank 0 prints and writes the record; every rank reports its peak memory and a hash
of its parameters, so the record shows that the replicas ended identical.

``--batch-size`` is per process, as in the seed: ``--batch-size 64`` under 4 processes is a global
batch of 256, the same as ``03_dataparallel_training.py --batch-size 256 --gpus 0,1,2,3``. With
``--accumulation-steps K`` each process runs K micro-batches of ``--batch-size`` per optimiser step
(global batch = batch size x processes x K); the first K-1 backward passes run under
``model.no_sync()``, so gradients are all-reduced once per step instead of K times. The record's
``global_batch_size`` always holds the product.

The seed's DDP options are flags: ``--gradient-as-bucket-view`` (gradients live inside the
communication buckets: one copy less), ``--bucket-cap-mb`` (bucket size: fewer, larger all-reduces
against earlier overlap), ``--broadcast-buffers`` (copy rank 0's BatchNorm statistics to every rank
before each forward) and ``--find-unused-parameters`` (needed only when some parameters get no
gradient; costs a graph traversal per step). ``--amp bf16|fp16`` runs the forward pass in mixed
precision (``common.amp``).

Pre-emption, as in Chapter 4's ``multi_gpu_ddp.py``: on SIGUSR1 (``#SBATCH --signal=B:USR1@120``)
or SIGTERM all ranks agree to stop at the next step, rank 0 saves ``--checkpoint`` atomically, and
the job exits 0; ``--resume`` continues from that step with the same data order.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere without installing
from common import amp
from common.checkpoint import StopSignal, capture_rng_state, load_checkpoint, restore_rng_state, save_checkpoint
from common.cli import add_common_args, apply_dry_run, config_dict, positive_float, positive_int
from common.data import get_dataset, make_loader
from common.device import configure_threads, describe, seed_everything
from common.distributed import (all_reduce_sum, any_rank, gather_objects, init_distributed, print0, print_rank,
                                teardown_distributed)
from common.errors import UserError, run_main
from common.results import make_record, provenance, write_record
from common.timing import StepTimer, peak_memory, reset_peak_memory
from common.units import format_bytes
from labs.lab01_dp_vs_ddp.lab01_shared import (LAB, add_lab_args, build_lab_model, has_batchnorm, make_train_loader,
                                               replica_digests)

SCRIPT = "labs/lab01_dp_vs_ddp/04_ddp_training.py"


class Preempted(Exception):
    """Raised inside the epoch when every rank has agreed to stop; carries where and what was done."""

    def __init__(self, step: int, losses: list[float]) -> None:
        super().__init__(f"stopped at step {step}")
        self.step, self.losses = step, losses


def train(model, device, loader, optimizer, epoch, args, scaler, timer, stop, start_step=0) -> list[float]:
    """One epoch (from ``start_step`` when resuming); returns this rank's loss of every step it ran."""
    model.train()
    losses = []
    steps = min(loader.batch_sampler.steps_per_epoch, args.max_steps or loader.batch_sampler.steps_per_epoch)
    for step, (data, target) in enumerate(loader, start=start_step):
        if step >= steps:
            break
        # Ranks must stop together: one that left alone would leave the others waiting in all-reduce.
        if any_rank(stop.requested is not None, device):
            raise Preempted(step, losses)
        with timer.step(samples=args.global_batch_size):
            optimizer.zero_grad(set_to_none=True)
            step_loss = torch.zeros((), device=device)
            # This rank's share of the global batch, in K micro-batches of --batch-size.
            for micro, (x, y) in enumerate(zip(data.chunk(args.accumulation_steps),
                                               target.chunk(args.accumulation_steps))):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                # DDP all-reduces gradients during backward(). Under no_sync() (forward *and* backward)
                # it only adds them up locally; the last micro-batch's backward all-reduces the sum.
                last = micro == args.accumulation_steps - 1
                with nullcontext() if last else model.no_sync():
                    with amp.autocast(device, args.amp):
                        # Divided by K: K backward passes then add up to the gradient of the mean.
                        loss = F.cross_entropy(model(x), y) / args.accumulation_steps
                    scaler.scale(loss).backward()
                step_loss += loss.detach().float()
            scaler.step(optimizer)
            scaler.update()
        losses.append(step_loss.item())
        if step % args.log_interval == 0 or step == steps - 1:
            print0(f"epoch {epoch} step {step + 1}/{steps}: loss {losses[-1]:.4f} (rank 0's share)")
    return losses


@torch.no_grad()
def test(model, device, loader, args) -> tuple[float, float]:
    """Mean loss and accuracy on the held-out split (each rank evaluates its own slice).

    With ``--max-steps`` only that many batches are evaluated: tiny runs stay tiny.
    """
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    for batch, (data, target) in enumerate(loader):
        if args.max_steps is not None and batch >= args.max_steps:
            break
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with amp.autocast(device, args.amp):
            output = model(data)
        loss_sum += F.cross_entropy(output.float(), target, reduction="sum").item()
        correct += (output.argmax(dim=1) == target).sum().item()
        seen += len(target)
    loss_sum, correct, seen = (all_reduce_sum(v, device) for v in (loss_sum, correct, seen))
    return loss_sum / max(seen, 1), correct / max(seen, 1)


def mean_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Element-wise mean of a list of numbers over all ranks, in one all-reduce.

    Each rank's loss is the mean over its slice; the slices are equal in size, so the mean of the
    ranks' losses is the loss over the global batch, the number the baseline prints.
    """
    if not values or not dist.is_initialized():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)  # Gloo has no AVG: sum, then divide
    return (tensor / dist.get_world_size()).tolist()


def buffer_sync_option(enabled: bool) -> dict[str, bool]:
    """``--broadcast-buffers`` as the keyword this PyTorch takes.

    Recent PyTorch renamed DDP's ``broadcast_buffers`` to ``forward_sync_buffers`` (same meaning:
    copy rank 0's buffers to every rank before each forward) and warns about the old name; older
    releases know only the old one. The replicas start with equal buffers here either way (same seed).
    """
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": enabled}
    return {"broadcast_buffers": enabled}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_lab_args(parser)
    group = parser.add_argument_group("DDP options (the seed's 'optimised DDP' settings are the defaults)")
    group.add_argument("--gradient-as-bucket-view", action=argparse.BooleanOptionalAction, default=True,
                       help="gradients are views into the all-reduce buckets, saving a copy; PyTorch's own "
                            "default is off (default: %(default)s)")
    group.add_argument("--bucket-cap-mb", type=positive_float, default=25.0,
                       help="size of one gradient bucket (one all-reduce) in MiB (default: %(default)s)")
    group.add_argument("--broadcast-buffers", action=argparse.BooleanOptionalAction, default=False,
                       help="copy rank 0's buffers (BatchNorm running statistics) to all ranks before every "
                            "forward; PyTorch's own default is on (default: %(default)s)")
    group.add_argument("--find-unused-parameters", action="store_true",
                       help="look for parameters that got no gradient every step; only for models that "
                            "skip layers (default: off)")
    group.add_argument("--amp", choices=amp.PRECISIONS, default="fp32",
                       help="forward-pass precision: fp32 (off), bf16, fp16 (GPU only) (default: %(default)s)")
    group.add_argument("--accumulation-steps", type=positive_int, default=1,
                       help="micro-batches of --batch-size per optimiser step; gradients are all-reduced "
                            "once per step (default: %(default)s)")
    group.add_argument("--checkpoint", type=Path, default=Path("checkpoints/lab01_ddp.pt"),
                       help="rank 0 saves here after every epoch and on pre-emption (default: %(default)s)")
    group.add_argument("--resume", action="store_true",
                       help="continue from --checkpoint when it exists (default: start fresh)")
    add_common_args(parser, epochs=5, batch_size=64)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv))
    threads = configure_threads()
    ctx = init_distributed(args.device, force_process_group=True)
    stop = StopSignal().install()
    try:
        device, world_size = ctx.device, ctx.world_size
        args.amp = amp.check_precision(args.amp, device)
        args.global_batch_size = args.batch_size * world_size * args.accumulation_steps
        splits = get_dataset(args.dataset, args.data_dir, image_size=args.image_size,
                             synthetic_size=args.synthetic_size, seed=args.seed)
        seed_everything(args.seed)  # right before the build: every rank, and 02 and 03, start from the same weights
        model = build_lab_model(args.model, splits.num_classes, splits.input_shape[0]).to(device)
        # DDP also broadcasts rank 0's parameters here, so the replicas start identical in any case.
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=args.gradient_as_bucket_view, bucket_cap_mb=args.bucket_cap_mb,
                    find_unused_parameters=args.find_unused_parameters, **buffer_sync_option(args.broadcast_buffers))
        train_loader, sampler = make_train_loader(splits.train, args.global_batch_size, rank=ctx.rank,
                                                  world_size=world_size, seed=args.seed, num_workers=args.num_workers,
                                                  pin_memory=device.type == "cuda")
        test_slice = Subset(splits.test, range(ctx.rank, len(splits.test), world_size))
        test_loader, _ = make_loader(test_slice, args.batch_size, shuffle=False, num_workers=args.num_workers)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                    weight_decay=args.weight_decay)
        scaler = amp.grad_scaler(device, args.amp)
        timer = StepTimer(device, warmup_steps=args.warmup_steps)
        print0(f"ddp: {world_size} process(es), backend {ctx.backend}, launcher {ctx.launch.launcher} | "
               f"model {args.model} | data {args.dataset} {tuple(splits.input_shape)} train={len(splits.train)} | "
               f"global batch {args.global_batch_size} = {args.batch_size} x {world_size} process(es) x "
               f"{args.accumulation_steps} micro-batch(es) | precision {args.amp} | threads {threads}")
        print_rank(f"device {describe(device)}")

        first_epoch, start_step = 1, 0
        train_losses, loss_at_step, epoch_losses, epoch_times = [], [], [], []
        state = load_checkpoint(args.checkpoint) if args.resume else None
        if state is not None:
            if state["global_batch_size"] != args.global_batch_size:
                raise UserError(f"{args.checkpoint} was written with a global batch of {state['global_batch_size']}, "
                                f"this run has {args.global_batch_size}; resume with the same batch settings")
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scaler.load_state_dict(state["scaler"])
            restore_rng_state(state["rng"])
            first_epoch, start_step = state["epoch"], state["step"]
            train_losses, loss_at_step = state["train_losses"], state["loss_at_step"]
            epoch_losses, epoch_times = state["epoch_losses"], state["epoch_times"]
            print0(f"resumed from {args.checkpoint}: epoch {first_epoch}, step {start_step}")

        def checkpoint(epoch: int, step: int) -> None:
            if ctx.is_main:
                save_checkpoint({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                 "scaler": scaler.state_dict(), "rng": capture_rng_state(), "epoch": epoch,
                                 "step": step, "global_batch_size": args.global_batch_size,
                                 "train_losses": train_losses, "loss_at_step": loss_at_step,
                                 "epoch_losses": epoch_losses, "epoch_times": epoch_times,
                                 "config": config_dict(args)}, args.checkpoint)

        def keep(losses: list[float]) -> None:
            """Record the global losses of the steps just run (one all-reduce for all of them)."""
            losses = mean_over_ranks(losses, device)
            epoch_losses.extend(losses)
            loss_at_step.extend(losses[:max(0, args.record_steps - len(loss_at_step))])

        reset_peak_memory(device)
        for epoch in range(first_epoch, args.epochs + 1):
            sampler.set_epoch(epoch, start_step)  # the same order on every rank, a new one each epoch
            start = time.perf_counter()
            try:
                losses = train(model, device, train_loader, optimizer, epoch, args, scaler, timer, stop, start_step)
            except Preempted as where:
                keep(where.losses)
                checkpoint(epoch, where.step)
                print0(f"received {stop.name}: saved {args.checkpoint} at epoch {epoch} step {where.step}; "
                       "exiting so the job can be requeued (resume with --resume)")
                return 0
            epoch_times.append(time.perf_counter() - start)
            keep(losses)
            train_losses.append(statistics.fmean(epoch_losses) if epoch_losses else float("nan"))
            start_step, epoch_losses = 0, []
            checkpoint(epoch + 1, 0)
            print0(f"epoch {epoch}: train loss {train_losses[-1]:.4f} | {epoch_times[-1]:.2f} s | "
                   f"{timer.summary()['samples_per_s'] or 0:.1f} samples/s (job)")

        test_loss, accuracy = test(model, device, test_loader, args)
        print0(f"test: loss {test_loss:.4f} | accuracy {100 * accuracy:.2f}%")

        step_time = timer.summary()
        # Every rank reports its own peak memory and a hash of its replica; rank 0 writes them all.
        memory = gather_objects({**peak_memory(device), "rank": ctx.rank})
        digests = gather_objects(replica_digests(model.module))
        params_identical = len({d["parameters"] for d in digests}) == 1
        buffers_identical = len({d["buffers"] for d in digests}) == 1
        print0(f"parameters identical on all {world_size} rank(s): {'yes' if params_identical else 'NO'}")
        if ctx.is_main:
            notes = []
            if not params_identical:
                notes.append("parameters differ between ranks: the replicas drifted apart (this is a bug)")
            if not buffers_identical and has_batchnorm(model.module):
                notes.append("BatchNorm running statistics differ between ranks: --no-broadcast-buffers keeps each "
                             "rank's own; the checkpoint holds rank 0's")
            metrics = {
                "train_loss": train_losses, "final_loss": train_losses[-1] if train_losses else None,
                "loss_at_step": loss_at_step, "test_loss": test_loss, "test_accuracy": accuracy,
                "epochs": args.epochs, "steps": timer.seen, "global_batch_size": args.global_batch_size,
                "world_size": world_size, "devices": world_size, "epoch_time_s": epoch_times,
                "time_per_epoch_s": statistics.median(epoch_times) if epoch_times else None,
                "samples_per_s": step_time["samples_per_s"], "step_time": step_time, "memory": memory,
                "replica_digests": digests, "parameters_identical": params_identical,
                "buffers_identical": buffers_identical,
            }
            config = config_dict(args, resolved_device=str(device), per_process_batch_size=args.batch_size,
                                 **splits.describe())
            method = "ddp" if args.amp == "fp32" else f"ddp-{args.amp}"
            record = make_record(lab=LAB, script=SCRIPT, method=method, config=config, metrics=metrics, notes=notes,
                                 provenance=provenance(device, world_size, {"distributed": ctx.describe()}))
            path = write_record(record, args.results_dir)
            print0(f"final: train loss {metrics['final_loss']:.4f} | {step_time['samples_per_s'] or 0:.1f} samples/s "
                   f"(job) | median step {1000 * (step_time['median_s'] or 0):.1f} ms (rank 0)")
            for entry in memory:
                print0(f"peak memory rank {entry['rank']} {entry['device']}: {format_bytes(entry['peak_bytes'])} "
                       f"({entry['source']})")
            for note in notes:
                print0(f"note: {note}")
            print0(f"checkpoint: {args.checkpoint}")
            print0(f"record: {path}")
        return 0
    finally:
        stop.restore()
        teardown_distributed(ctx)


if __name__ == "__main__":
    run_main(main)
