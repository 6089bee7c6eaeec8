#!/usr/bin/env python3
"""Lab-04 step 2: train the transformer with DDP or with FSDP2, and checkpoint it with DCP.

Usage:
    torchrun --standalone --nproc_per_node=4 labs/lab04_sharded_training/02_sharded_training.py --strategy fsdp
    torchrun --standalone --nproc_per_node=4 labs/lab04_sharded_training/02_sharded_training.py --strategy ddp
    torchrun --standalone --nproc_per_node=4 labs/lab04_sharded_training/02_sharded_training.py \\
        --activation-checkpointing --precision bf16 --async-checkpoint
    torchrun --standalone --nproc_per_node=2 labs/lab04_sharded_training/02_sharded_training.py --resume  # 4 -> 2
    torchrun --standalone --nproc_per_node=2 labs/lab04_sharded_training/02_sharded_training.py --device cpu \\
        --layers 4 --width 64 --context 64 --global-batch-size 16 --max-steps 10
    srun --kill-on-bad-exit=1 python labs/lab04_sharded_training/02_sharded_training.py --strategy fsdp
    sbatch sharded_torchrun_4gpu.sbatch  # rendered from sbatch/sharded_torchrun_4gpu.sbatch.j2, see the README

What it teaches: the same training loop under two data-parallel strategies. ``--strategy ddp``
keeps a full replica on every rank and all-reduces gradients; ``--strategy fsdp`` (FSDP2,
``fully_shard`` on each transformer block, then on the root: :func:`wrap` below) keeps 1/N of every
parameter, gradient and AdamW moment per rank, all-gathers a block just before it computes and
reduce-scatters its gradients right after. The loop below is the same for both:
with the same seed and global batch, the losses agree step by step (in fp32, to rounding).

``--global-batch-size`` is the number of sequences per optimiser step over all ranks, whatever the
number of ranks: each rank takes its share of every global batch and runs it in micro-batches of
``--batch-size`` (gradient accumulation; gradients are reduced across ranks only after the last
micro-batch). So 4 ranks and 1 rank take the same optimiser steps, which is what lets a run saved
on 4 ranks continue on 2. ``--activation-checkpointing`` keeps only each block's input during the
forward pass and recomputes the rest in backward; ``--precision bf16`` computes in bf16
(FSDP2's ``MixedPrecisionPolicy``) while AdamW updates fp32 shards.

Checkpoints use PyTorch Distributed Checkpoint (``common.checkpoint.sharded``): after every epoch
and on the pre-emption signal (SIGUSR1 from ``#SBATCH --signal=B:USR1@120``, or SIGTERM) every rank
writes its own shards into ``--checkpoint-dir``; ``--resume`` reads them back with any number of
ranks (DCP reshards). ``--async-checkpoint`` (``dcp.async_save``) lets training continue while a
background thread writes; the record keeps how long each save stalled the loop.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
from torch.utils.data import DataLoader

from common.cli import (add_common_args, add_lr_arg, add_precision_arg, apply_dry_run, non_negative_float, positive_int,
                        script_parser)
from common.data.datasets import GlobalBatchSampler, load_stdlib_text, worker_ignores_sigterm
from common.runtime.distributed import gather_objects
from common.errors import UserError, run_main
from common.train.evaluation import evaluate
from common.models import DecoderOnlyTransformer, transformer_parameter_count
from common.train.flags import add_distributed_checkpoint_args, add_training_args
from common.train.run import TrainingRun
from common.checkpoint.sharded import DistributedCheckpointer
from labs.lab04_sharded_training.lab04_shared import (LAB, PRECISIONS, STRATEGIES, add_model_args, check_strategy,
                                                      describe_held, describe_throughput, language_model_loss,
                                                      shape_from_args, tensor_bytes, throughput, variant_name)

# After common's imports: common stops an older PyTorch in one line, before these would fail.
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

SCRIPT = "labs/lab04_sharded_training/02_sharded_training.py"


def train(model, loader, optimizer, args, run) -> None:
    """One epoch; each step accumulates this rank's share of the global batch in micro-batches."""
    model.train()
    for tokens, targets in run.steps(loader):
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=run.device)
        micro_batches = list(zip(tokens.chunk(args.accumulation_steps), targets.chunk(args.accumulation_steps)))
        for micro, (x, y) in enumerate(micro_batches):
            last = micro == len(micro_batches) - 1
            # Reduce gradients across ranks once per step, in the last micro-batch's backward.
            with gradient_sync(model, last):
                # Divided by K: K backward passes then add up to the gradient of the mean.
                loss = language_model_loss(model, x.to(run.device), y.to(run.device)) / len(micro_batches)
                loss.backward()
            step_loss += loss.detach()
        optimizer.step()
        run.log_loss(step_loss)


def wrap(model, args, device):
    """The strategy. DDP: a full replica per rank, gradients all-reduced in buckets during backward.
    FSDP2: ``fully_shard`` each block (gather its rows before its forward, and again before its
    backward unless ``--no-reshard-after-forward`` keeps it; reduce-scatter its gradients after),
    then the root (embeddings, final norm, head). ``MixedPrecisionPolicy``: gather and compute in
    bf16, reduce gradients in fp32; AdamW updates the fp32 shards."""
    if args.compile:  # each block on its own, before wrapping (torchtitan's order): one graph for all
        for block in model.blocks:
            block.compile()
    if args.strategy == "ddp":
        return DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if args.precision == "bf16" else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=args.reshard_after_forward)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def gradient_sync(model, enabled: bool):
    """DDP: ``no_sync()`` skips the all-reduce. FSDP2: ``set_requires_gradient_sync(False)`` skips the
    reduce-scatter (each block keeps its whole gradient until the last micro-batch), and
    ``set_reshard_after_backward(False)`` keeps each block gathered after its backward, so the next
    micro-batch does not all-gather it again: fewer collectives for the memory of the gathered model
    during the accumulation (ZeRO-2 for those micro-batches). The last micro-batch restores both."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
        model.set_reshard_after_backward(enabled)
        return nullcontext()
    return nullcontext() if enabled else model.no_sync()


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_model_args(parser)
    group = parser.add_argument_group("strategy and training")
    group.add_argument("--strategy", choices=STRATEGIES, default="fsdp",
                       help="ddp: a full replica per rank; fsdp: FSDP2, every tensor sharded (default: %(default)s)")
    group.add_argument("--activation-checkpointing", action="store_true",
                       help="keep only each block's input in the forward pass, recompute in backward (default: off)")
    add_precision_arg(group, "--mixed-precision", choices=PRECISIONS,
                      help="bf16: FSDP2 computes in bf16, AdamW updates fp32 shards (default: %(default)s)")
    group.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                       help="FSDP2 frees each gathered block after its forward and gathers it again for backward "
                            "(ZeRO-3); --no-reshard-after-forward keeps it until backward: one all-gather "
                            "fewer per block, more memory (ZeRO-2) (default: on)")
    group.add_argument("--compile", action="store_true",
                       help="torch.compile each transformer block (fuses its small kernels; the first steps "
                            "compile, so raise --warmup-steps) (default: off)")
    group.add_argument("--global-batch-size", type=positive_int, default=64,
                       help="sequences per optimiser step over all ranks, whatever their number (default: %(default)s)")
    add_lr_arg(group, default=1e-3, optimizer="AdamW")
    group.add_argument("--weight-decay", type=non_negative_float, default=0.1,
                       help="AdamW weight decay (default: %(default)s)")
    group.add_argument("--window-stride", type=positive_int, default=None,
                       help="characters between the starts of two training sequences; below --context they "
                            "overlap, so a long context still gets enough steps per epoch from the small "
                            "corpus (default: --context, side by side)")
    group.add_argument("--eval-steps", type=positive_int, default=20,
                       help="validation global batches after every epoch (default: %(default)s)")
    add_training_args(parser)
    add_distributed_checkpoint_args(parser, default_dir="RESULTS_DIR/checkpoints/02_sharded_training")
    add_common_args(parser, epochs=2, batch_size=8, num_workers=0, data_dir=None)  # the text ships with Python
    return parser


def main(argv: list[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv), eval_steps=2)
    shape = shape_from_args(args)
    args.checkpoint_dir = args.checkpoint_dir or args.results_dir / "checkpoints" / "02_sharded_training"
    checkpointer = DistributedCheckpointer(args.checkpoint_dir, async_save=args.async_checkpoint)
    method = variant_name(args.strategy, args.precision, args.activation_checkpointing)
    with TrainingRun(args, lab=LAB, script=SCRIPT, method=method, distributed=True, checkpointer=checkpointer,
                     resume_settings=("layers", "width", "heads", "context", "global_batch_size", "seed", "lr",
                                      "weight_decay")) as run:
        device = run.device
        check_strategy(args.strategy, args.precision, device, world_size=run.world_size, layers=shape.layers)
        per_rank, remainder = divmod(args.global_batch_size, run.world_size * args.batch_size)
        if remainder or per_rank == 0:
            raise UserError(f"--global-batch-size {args.global_batch_size} must be a multiple of {run.world_size} "
                            f"rank(s) x --batch-size {args.batch_size}")
        args.accumulation_steps = per_rank
        splits = load_stdlib_text(shape.context, stride=args.window_stride)
        torch.manual_seed(args.seed)  # every rank, strategy and world size start from the same weights
        model = DecoderOnlyTransformer(shape)
        model.activation_checkpointing = args.activation_checkpointing  # keep only each block's input
        model = wrap(model, args, device)
        # The same global batches whatever the number of ranks; this rank takes every world_size-th sequence.
        sampler = GlobalBatchSampler(len(splits.train), args.global_batch_size, rank=run.rank,
                                     world_size=run.world_size, seed=args.seed)
        train_loader = DataLoader(splits.train, batch_sampler=sampler, num_workers=args.num_workers,
                                  pin_memory=device.type == "cuda", worker_init_fn=worker_ignores_sigterm)
        validation = GlobalBatchSampler(len(splits.test), min(args.global_batch_size, len(splits.test)),
                                        rank=run.rank, world_size=run.world_size, shuffle=False)
        validation_loader = DataLoader(splits.test, batch_sampler=validation)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        run.print(f"{method}: {run.describe()} | {transformer_parameter_count(shape) / 1e6:.2f} M parameters "
                  f"({shape.layers} layers x {shape.width}, {shape.heads} heads, context {shape.context}) | "
                  f"global batch {args.global_batch_size} = {args.batch_size} x {run.world_size} rank(s) x "
                  f"{args.accumulation_steps} micro-batch(es) | {splits.name}: {len(splits.train)} sequences | "
                  f"checkpoints {'async' if args.async_checkpoint else 'sync'} in {args.checkpoint_dir}")

        run.track(model=model, optimizer=optimizer)
        resumed_at_step = run.progress.steps or None  # optimiser steps the checkpoint had taken (None: fresh)
        for epoch in run.epochs():
            sampler.set_epoch(epoch)  # the same global batches whatever the number of ranks
            train(model, train_loader, optimizer, args, run)
            # Next-character loss and accuracy; every rank runs --eval-steps batches (FSDP2's forward is collective).
            run.evaluated(*evaluate(model, validation_loader, device, max_batches=args.eval_steps, across_ranks=True))
            run.save_checkpoint()  # DCP: every rank writes its shards
        checkpointer.wait()  # an asynchronous save may still be writing: its timing belongs in the record
        held = gather_objects({**tensor_bytes(model, optimizer), "rank": run.rank})
        for entry in held:
            run.print(describe_held(entry))
        # How far from the hardware: the model's FLOPs per second against the GPU's dense peak.
        rate = run.meter.timer.summary()["samples_per_s"]
        speed = throughput(shape, rate, device, args.precision, run.world_size)
        run.print(describe_throughput(speed))
        run.finish(config={**splits.describe(), **shape.describe(), "accumulation_steps": args.accumulation_steps},
                   metrics={"tensor_bytes": held, "checkpoint_saves": checkpointer.timings,
                            "parameters": transformer_parameter_count(shape), "resumed_at_step": resumed_at_step,
                            **speed})
    return 0


if __name__ == "__main__":
    run_main(main)
