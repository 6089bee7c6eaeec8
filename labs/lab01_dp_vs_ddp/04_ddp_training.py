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

``--batch-size`` is per process, as in the Lab-01 handout: ``--batch-size 64`` under 4 processes is a
global batch of 256, the same as ``03_dataparallel_training.py --batch-size 256 --gpus 0,1,2,3``. With
``--accumulation-steps K`` each process runs K micro-batches of ``--batch-size`` per optimiser step
(global batch = batch size x processes x K); the first K-1 backward passes run under
``model.no_sync()``, so gradients are all-reduced once per step instead of K times. The record's
``global_batch_size`` always holds the product.

The Lab-01 handout's DDP options are flags: ``--gradient-as-bucket-view`` (gradients live inside the
communication buckets: one copy less), ``--bucket-cap-mb`` (bucket size: fewer, larger all-reduces
against earlier overlap), ``--broadcast-buffers`` (copy rank 0's BatchNorm statistics to every rank
before each forward) and ``--find-unused-parameters`` (needed only when some parameters get no
gradient; costs a graph traversal per step). ``--precision bf16|fp16`` runs the forward pass in mixed
precision (``common.train.amp``).

Pre-emption, as in Chapter 4's ``multi_gpu_ddp.py`` (``common.train.run.TrainingRun`` does it for both):
on SIGUSR1 (``#SBATCH --signal=B:USR1@120``) or SIGTERM all ranks agree to stop at the next step,
rank 0 saves ``--checkpoint`` (default ``RESULTS_DIR/checkpoints/04_ddp_training.pt``) atomically,
and the job exits 0; ``--resume`` continues from that step with the same data order. Diff this file
against ``03_dataparallel_training.py``: the difference is DDP, and what DDP makes possible beside it
(``--accumulation-steps`` under ``no_sync()``, ``--amp``, the checkpoint and ``--resume``).
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

from common.train import amp
from common.cli import add_common_args, add_precision_arg, positive_float, positive_int, script_parser
from common.data.datasets import GlobalBatchSampler, make_loader, worker_ignores_sigterm
from common.runtime.device import seed_everything
from common.runtime.compat import ddp_buffer_sync
from common.errors import run_main
from common.train.evaluation import evaluate
from common.models import build_model
from common.checkpoint.single_file import save_checkpoint
from common.train.flags import add_checkpoint_args
from common.train.run import TrainingRun
from labs.lab01_dp_vs_ddp.lab01_shared import DDP_BUCKET_CAP_MB, LAB, add_lab_args, ddp_method, lab_data

SCRIPT = "labs/lab01_dp_vs_ddp/04_ddp_training.py"


def train(model, device, loader, optimizer, args, scaler, run) -> None:
    """One epoch: every batch ``run.steps`` hands out, each one timed (all ranks stop together on a signal)."""
    model.train()
    for data, target in run.steps(loader):
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=device)
        # This rank's share of the global batch, in K micro-batches of --batch-size.
        for micro, (x, y) in enumerate(zip(data.chunk(args.accumulation_steps), target.chunk(args.accumulation_steps))):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # DDP all-reduces gradients during backward(). Under no_sync() (forward *and* backward) it
            # only adds them up locally; the last micro-batch's backward all-reduces the sum.
            last = micro == args.accumulation_steps - 1
            with nullcontext() if last else model.no_sync():
                with amp.autocast(device, args.precision):
                    # Divided by K: K backward passes then add up to the gradient of the mean.
                    loss = F.cross_entropy(model(x), y) / args.accumulation_steps
                scaler.scale(loss).backward()
            step_loss += loss.detach().float()
        scaler.step(optimizer)
        scaler.update()
        run.log_loss(step_loss)


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_lab_args(parser)
    group = parser.add_argument_group(
        "DDP options (the Lab-01 handout's 'optimised DDP' settings are the defaults)")
    group.add_argument("--gradient-as-bucket-view", action=argparse.BooleanOptionalAction, default=True,
                       help="gradients are views into the all-reduce buckets, saving a copy; PyTorch's own "
                            "default is off (default: on)")
    group.add_argument("--bucket-cap-mb", type=positive_float, default=DDP_BUCKET_CAP_MB,
                       help="size of one gradient bucket (one all-reduce) in MiB (default: %(default)s)")
    group.add_argument("--broadcast-buffers", action=argparse.BooleanOptionalAction, default=False,
                       help="copy rank 0's buffers (BatchNorm running statistics) to all ranks before every "
                            "forward; PyTorch's own default is on (default: off)")
    group.add_argument("--find-unused-parameters", action="store_true",
                       help="look for parameters that got no gradient every step; only for models that "
                            "skip layers (default: off)")
    add_precision_arg(group, "--amp")
    group.add_argument("--accumulation-steps", type=positive_int, default=1,
                       help="micro-batches of --batch-size per optimiser step; gradients are all-reduced "
                            "once per step (default: %(default)s)")
    add_checkpoint_args(parser, always=True)
    add_common_args(parser, epochs=5, batch_size=64)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with TrainingRun(args, lab=LAB, script=SCRIPT, method=ddp_method(args), distributed=True,
                     resume_settings=("model", "dataset", "seed", "batch_size", "accumulation_steps")) as run:
        device = run.device
        args.precision = amp.check_precision(args.precision, device)
        global_batch = args.batch_size * run.world_size * args.accumulation_steps
        splits = lab_data(args)
        seed_everything(args.seed)  # right before the build: every rank, and 02 and 03, start from the same weights
        model = build_model(args.model, splits.num_classes, splits.input_shape[0]).to(device)
        # DDP also broadcasts rank 0's parameters here, so the replicas start identical in any case.
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=args.gradient_as_bucket_view, bucket_cap_mb=args.bucket_cap_mb,
                    find_unused_parameters=args.find_unused_parameters, **ddp_buffer_sync(args.broadcast_buffers))
        # The distributed sampler: the same global batches as 02 and 03 (a DistributedSampler that shuffles
        # whole global batches), this rank taking every world_size-th sample of each.
        sampler = GlobalBatchSampler(len(splits.train), global_batch, rank=run.rank, world_size=run.world_size,
                                     seed=args.seed)
        train_loader = DataLoader(splits.train, batch_sampler=sampler, num_workers=args.num_workers,
                                  pin_memory=device.type == "cuda", persistent_workers=args.num_workers > 0,
                                  worker_init_fn=worker_ignores_sigterm)  # scancel's SIGTERM: this process saves
        test_slice = Subset(splits.test, range(run.rank, len(splits.test), run.world_size))
        test_loader, _ = make_loader(test_slice, args.batch_size, shuffle=False, num_workers=args.num_workers)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                    weight_decay=args.weight_decay)
        scaler = amp.grad_scaler(device, args.precision)
        run.print(f"ddp: {run.describe()} | model {args.model} | data {args.dataset} {tuple(splits.input_shape)} "
                  f"train={len(splits.train)} | global batch {global_batch} = {args.batch_size} x {run.world_size} "
                  f"process(es) x {args.accumulation_steps} micro-batch(es) | precision {args.precision}")

        run.track(model=model, optimizer=optimizer, scaler=scaler)
        for epoch in run.epochs():
            sampler.set_epoch(epoch)  # the epoch's order: the same in 02, 03 and 04, on every rank
            train(model, device, train_loader, optimizer, args, scaler, run)
            run.evaluated(*evaluate(model, test_loader, device, precision=args.precision, max_batches=args.max_steps,
                                    across_ranks=True))  # each rank scored its slice: sums added over ranks
            state = run.checkpoint_state()  # model.module's weights, ...; every rank's random state (collective)
            if run.is_main:  # the replicas are identical: rank 0 alone writes the one file
                save_checkpoint(state, args.checkpoint)
        run.finish(config={**splits.describe(), "per_process_batch_size": args.batch_size})
    return 0


if __name__ == "__main__":
    run_main(main)
