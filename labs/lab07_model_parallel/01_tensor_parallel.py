#!/usr/bin/env python3
"""Lab-07 step 1: tensor parallel — every rank holds a slice of every layer (DTensor), and sequence parallel.

Usage:
    python labs/lab07_model_parallel/01_tensor_parallel.py --device cpu --layers 2 --width 32 --heads 4 \\
        --context 16 --batch-size 8                                                   # the reference
    torchrun --standalone --nproc_per_node=2 labs/lab07_model_parallel/01_tensor_parallel.py --device cpu \\
        --layers 2 --width 32 --heads 4 --context 16 --batch-size 8
    torchrun --standalone --nproc_per_node=4 labs/lab07_model_parallel/01_tensor_parallel.py --sequence-parallel
    srun --kill-on-bad-exit=1 python labs/lab07_model_parallel/01_tensor_parallel.py
    sbatch model_parallel_4gpu.sbatch  # rendered from sbatch/model_parallel_4gpu.sbatch.j2, see the README

What it teaches: Lab-04's transformer cut across the ranks of a 1-D ``DeviceMesh`` with
``parallelize_module`` (:func:`apply_tensor_parallel` below): in attention each rank computes
its own heads, in the MLP its own slice of the hidden layer, and one all-reduce per sub-layer adds
the partial results. Every rank sees the whole batch; parameters and most activations shrink by the
degree, and the price is traffic on every layer, forward and backward. ``--sequence-parallel`` also
cuts the norms along the sequence. The script prints, per rank, the parameter and activation bytes
it holds and the bytes it sent in one step's collectives, beside what the plan predicts. Run as one
process, the same model trains without any parallelism: that run is the reference the losses of a
parallel run match step by step.
"""

from __future__ import annotations

import argparse

import torch

from common.cli import add_run_args, script_parser
from common.errors import run_main
from common.measure.memory import SavedActivations, local_bytes
from common.measure.timing import StepTimer
from common.runtime.device import configure_threads
from common.runtime.distributed import gather_objects, init_distributed, print0, teardown_distributed
from common.runtime.launch import detect_launch
from common.units import format_bytes
from labs.lab07_model_parallel.lab07_shared import (
    DRY_RUN, CollectiveTally, add_model_args, add_training_flags, apply_dry_run, batch_for_step, build_model,
    check_tensor_parallel, language_model_loss, predicted_tensor_parallel_traffic, shape_from_args, training_text,
    write_lab_record,
)

# After common's imports: common stops an older PyTorch in one line, before these would fail.
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel, parallelize_module,
)

SCRIPT = "labs/lab07_model_parallel/01_tensor_parallel.py"


def apply_tensor_parallel(model, mesh, *, sequence_parallel: bool = False) -> None:
    """Cut every block over the 1-D ``mesh`` (Megatron-LM's plan, written as DTensor styles).

    Attention: ``q``, ``k``, ``v`` column-wise (each rank: its heads), ``proj`` row-wise (each rank's
    partial sum, added up by one all-reduce). MLP: the first layer column-wise, the second row-wise:
    one all-reduce. So forward costs two all-reduces per block, and backward two more (the gradient
    of each replicated input). The embeddings, the final norm and the head stay whole on every rank.

    ``sequence_parallel``: between the blocks' matrix multiplies, the norms (and the residual
    stream) are cut along the sequence instead of repeated on every rank: each all-reduce becomes a
    reduce-scatter (into sequence shards) and an all-gather (before the next column-wise layer),
    the same bytes on the wire, and the norms' activations shrink by the degree.
    """
    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream: cut along the sequence, or whole
    for block in model.blocks:
        plan = {
            # x arrives once as a DTensor: q, k and v share it, so their input gradients are summed before one reduce.
            "attention": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                                            use_local_output=False),
            "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(), "attention.v": ColwiseParallel(),
            "attention.proj": RowwiseParallel(output_layouts=between),
            "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                                      use_local_output=False),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel(output_layouts=between),
        }
        if sequence_parallel:
            plan |= {"norm1": SequenceParallel(), "norm2": SequenceParallel()}
        parallelize_module(block, mesh, plan)
    if sequence_parallel:
        # Enter the blocks cut along the sequence (a local slice, no traffic); leave them whole for the head.
        parallelize_module(model, mesh, {
            "blocks.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                           use_local_output=True),
            f"blocks.{len(model.blocks) - 1}": PrepareModuleOutput(output_layouts=(Shard(1),),
                                                                   desired_output_layouts=(Replicate(),)),
        })


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_model_args(parser)
    group = add_training_flags(parser, batch="sequences per step; every rank sees all of them")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="cut the norms and the residual stream along the sequence too (default: off)")
    add_run_args(parser, dry_run=DRY_RUN)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv))
    shape = shape_from_args(args)
    degree = detect_launch().world_size  # a 1-D mesh: every process holds one slice
    check_tensor_parallel(shape, degree, sequence_parallel=args.sequence_parallel)
    ctx = init_distributed(args.device)
    try:
        device, threads = ctx.device, configure_threads()
        data = training_text(shape.context)
        model = build_model(shape, args.seed, device)
        if ctx.world_size > 1:
            apply_tensor_parallel(model, init_device_mesh(device.type, (ctx.world_size,)),
                                  sequence_parallel=args.sequence_parallel)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        method = "reference" if ctx.world_size == 1 else "tp+sp" if args.sequence_parallel else "tp"
        print0(f"{method}: {ctx.world_size} rank(s), {device}, {threads} thread(s) | {shape.name}, "
               f"{shape.heads} heads, context {shape.context}, batch {args.batch_size}")

        timer, losses = StepTimer(device, warmup_steps=args.warmup_steps), []
        tally, saved = CollectiveTally(ctx.world_size), SavedActivations()
        for step in range(args.steps):
            tokens, targets = (t.to(device) for t in batch_for_step(data, step, args.batch_size, args.seed))
            measured = step == 0  # the traffic is the same every step: count it once, time the others
            with timer.step(args.batch_size):
                optimizer.zero_grad(set_to_none=True)
                if measured:
                    with tally, saved:
                        loss = language_model_loss(model(tokens), targets)
                        loss.backward()
                else:
                    loss = language_model_loss(model(tokens), targets)
                    loss.backward()
                optimizer.step()
            losses.append(loss.item())
            print0(f"step {step:3d} | loss {losses[-1]:.6f}")

        predicted = predicted_tensor_parallel_traffic(shape, args.batch_size, ctx.world_size,
                                                      sequence_parallel=args.sequence_parallel)
        mine = {"rank": ctx.rank, "parameter_bytes": local_bytes(model.parameters()), "activation_bytes": saved.bytes,
                "comm_bytes": tally.total_bytes, "comm_by_collective": tally.by_collective}
        per_rank = gather_objects(mine)
        for entry in per_rank:
            print0(f"rank {entry['rank']}: parameters {format_bytes(entry['parameter_bytes'])}, activations "
                   f"{format_bytes(entry['activation_bytes'])}, sent per step {format_bytes(entry['comm_bytes'])} "
                   f"counted / {format_bytes(predicted['total_bytes'])} predicted")
        timing = timer.summary()
        tokens_per_s = timing["samples_per_s"] * shape.context if timing["samples_per_s"] else None
        if ctx.is_main:
            write_lab_record(args, script=SCRIPT, method=method, device=device, world_size=ctx.world_size,
                                    ctx=ctx, config={**shape.describe(), "threads": threads,
                                                     "tensor_parallel": ctx.world_size},
                                    metrics={"loss_at_step": losses, "final_loss": losses[-1], "per_rank": per_rank,
                                             "comm_predicted": predicted, "comm_measured_bytes": mine["comm_bytes"],
                                             "step_time": timing, "tokens_per_s": tokens_per_s})
        return 0
    finally:
        teardown_distributed(ctx)


if __name__ == "__main__":
    run_main(main)
