#!/usr/bin/env python3
"""Lab-07 step 2: pipeline parallel — each rank holds a few consecutive blocks; micro-batches fill the pipe.

Usage:
    python labs/lab07_model_parallel/02_pipeline_parallel.py --device cpu --layers 4 --width 32 --heads 4 \\
        --context 16 --batch-size 8                                                   # the reference
    torchrun --standalone --nproc_per_node=2 labs/lab07_model_parallel/02_pipeline_parallel.py --device cpu \\
        --layers 4 --width 32 --heads 4 --context 16 --batch-size 8 --schedule 1f1b --microbatches 4
    torchrun --standalone --nproc_per_node=4 labs/lab07_model_parallel/02_pipeline_parallel.py --schedule interleaved
    srun --kill-on-bad-exit=1 python labs/lab07_model_parallel/02_pipeline_parallel.py --schedule 1f1b
    LAB07_STEP=pp sbatch model_parallel_4gpu.sbatch  # from sbatch/model_parallel_4gpu.sbatch.j2, see the README

What it teaches: the transformer cut into stages of consecutive blocks (``torch.distributed.pipelining``),
one stage per rank (``--schedule interleaved``: two, looped, so rank r holds stages r and r + p).
Each step splits the batch into ``--microbatches`` M pieces; a stage passes each piece's
activations to the next stage and, in backward, the gradients back. GPipe runs every forward, then
every backward; 1F1B alternates them once the pipe is full, so at most p micro-batches are in
flight (less memory, the same idle time). Either way a rank waits while the pipe fills and drains:
the bubble, ``(p - 1) / (M + p - 1)`` of the step for p stages (``(p - 1) / (v M + p - 1)`` with v
stages per rank). The script times how long each stage computes and reports the rest of the wall
time as its measured bubble, beside the formula. One process trains the same model without a
pipeline: the reference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from common.cli import add_run_args, positive_int, script_parser
from common.errors import FlagError, run_main
from common.measure.memory import local_bytes
from common.runtime.device import configure_threads, synchronize
from common.runtime.distributed import all_reduce_sum, gather_objects, init_distributed, print0, teardown_distributed
from common.runtime.launch import detect_launch
from labs.lab07_model_parallel.lab07_shared import (
    DRY_RUN, SCHEDULES, add_model_args, add_training_flags, apply_dry_run, batch_for_step, bubble_formula, build_model,
    language_model_loss, pipeline_stage_module, shape_from_args, stage_layers, timed_stage_class,
    training_text, write_lab_record,
)

SCRIPT = "labs/lab07_model_parallel/02_pipeline_parallel.py"


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_model_args(parser)
    group = add_training_flags(parser, batch="sequences per step, cut into --microbatches pieces")
    group.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                       help="gpipe: all forwards then all backwards; 1f1b: alternate; interleaved: 1F1B over two "
                            "stages per rank (default: %(default)s)")
    group.add_argument("--microbatches", type=positive_int, default=4,
                       help="pieces of each batch in the pipe at once; must divide --batch-size (default: %(default)s)")
    add_run_args(parser, dry_run=DRY_RUN)
    return parser


def make_schedule(model, args, rank: int, ranks: int, device: torch.device):
    """This rank's stage(s) of the model and the schedule that runs them."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    per_rank = 2 if args.schedule == "interleaved" else 1
    stages = [timed_stage_class()(pipeline_stage_module(model, index, ranks * per_rank), index, ranks * per_rank,
                                  device) for index in range(rank, ranks * per_rank, ranks)]
    if args.schedule == "interleaved":
        return stages, ScheduleInterleaved1F1B(stages, args.microbatches, loss_fn=language_model_loss)
    kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    return stages, kind(stages[0], args.microbatches, loss_fn=language_model_loss)


def main(argv: list[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv))
    shape = shape_from_args(args)
    ranks = detect_launch().world_size
    if ranks > 1:
        stage_layers(shape.layers, ranks * (2 if args.schedule == "interleaved" else 1))  # refuses too many stages
    if args.batch_size % args.microbatches:
        raise FlagError(f"--microbatches {args.microbatches} does not divide --batch-size {args.batch_size}: "
                        "every micro-batch must hold the same number of sequences")
    if ranks > 1 and args.schedule != "gpipe" and args.microbatches < ranks:
        raise FlagError(f"--schedule {args.schedule} on {ranks} stages needs at least {ranks} micro-batches (it keeps "
                        f"one in flight per stage), got --microbatches {args.microbatches}; use --schedule gpipe")
    if ranks > 1 and args.schedule == "interleaved" and args.microbatches % ranks:
        raise FlagError(f"--schedule interleaved runs the micro-batches in rounds of one per process: "
                        f"--microbatches {args.microbatches} must be a multiple of the {ranks} processes")
    ctx = init_distributed(args.device)
    try:
        device, threads = ctx.device, configure_threads()
        data = training_text(shape.context)
        model = build_model(shape, args.seed, device)
        pipelined = ctx.world_size > 1
        if pipelined:
            stages, schedule = make_schedule(model, args, ctx.rank, ctx.world_size, device)
            holds_first, holds_last = stages[0].is_first, stages[-1].is_last
            parameters = [p for stage in stages for p in stage.submod.parameters()]
        else:
            parameters = list(model.parameters())
        optimizer = torch.optim.AdamW(parameters, lr=args.lr, weight_decay=0.0)
        method = f"pp-{args.schedule}" if pipelined else "reference"
        print0(f"{method}: {ctx.world_size} rank(s), {device}, {threads} thread(s) | {shape.name}, batch "
               f"{args.batch_size} in {args.microbatches} micro-batch(es)")

        losses, walls, computes = [], [], []  # per timed step: its wall time, and this rank's compute in it
        for step in range(args.steps):
            tokens, targets = (t.to(device) for t in batch_for_step(data, step, args.batch_size, args.seed))
            optimizer.zero_grad(set_to_none=True)
            if pipelined:
                computed_before = sum(stage.compute_s for stage in stages)
                dist.barrier()  # every stage starts the step together: the wait for the first activation counts
                began = time.perf_counter()
                pieces: list[torch.Tensor] = []
                schedule.step(*([tokens] if holds_first else []),
                              **({"target": targets, "losses": pieces} if holds_last else {}))
                synchronize(device)
                dist.barrier()  # and ends it together: the last stage idles while the first runs its last backward
                if step >= args.warmup_steps:
                    walls.append(time.perf_counter() - began)
                    computes.append(sum(stage.compute_s for stage in stages) - computed_before)
                # The mean of equal micro-batches' means is the batch's mean; the last stage has them.
                loss = all_reduce_sum(torch.stack(pieces).mean().item() if holds_last else 0.0, device)
            else:
                began = time.perf_counter()
                step_loss = language_model_loss(model(tokens), targets)
                step_loss.backward()
                loss = step_loss.item()  # waits for the device: the clock below reads a finished step
                if step >= args.warmup_steps:
                    walls.append(time.perf_counter() - began)
            optimizer.step()
            losses.append(loss)
            print0(f"step {step:3d} | loss {loss:.6f}")

        step_s = sorted(walls)[len(walls) // 2] if walls else None
        metrics = {"loss_at_step": losses, "final_loss": losses[-1], "steps_timed": len(walls), "step_s": step_s,
                   "tokens_per_s": args.batch_size * shape.context / step_s if step_s else None}
        if pipelined:
            # Each step's idle fraction; the median step's, so that one step the machine disturbed does not count.
            idle = sorted(1 - compute / wall for compute, wall in zip(computes, walls))
            mine = {"rank": ctx.rank, "stages": [stage.stage_index for stage in stages],
                    "parameter_bytes": local_bytes(parameters), "compute_s": sum(computes), "wall_s": sum(walls),
                    "bubble_per_step": idle, "bubble": statistics.median(idle) if idle else None}
            per_rank = gather_objects(mine)
            expected = bubble_formula(ctx.world_size, args.microbatches, len(stages))
            measured = [entry["bubble"] for entry in per_rank]
            for entry in per_rank:
                print0(f"rank {entry['rank']} (stage {', '.join(map(str, entry['stages']))}): computed "
                       f"{entry['compute_s']:.3f} s of {entry['wall_s']:.3f} s: bubble "
                       + (f"{entry['bubble']:.1%}" if entry["bubble"] is not None else "n/a")
                       + f" (formula {expected:.1%})")
            metrics |= {"per_rank": per_rank, "bubble_formula": expected,
                        "bubble_measured": sum(measured) / len(measured) if walls else None,
                        "stages_per_rank": len(stages),
                        "bubble_method": "1 - (time in the stage's forward_one_chunk and backward_one_chunk, device "
                                         "synchronised) / (wall time of schedule.step between two barriers) per step, "
                                         f"the median over the steps after the first {args.warmup_steps}, then the "
                                         "mean over ranks"}
        else:
            metrics["per_rank"] = [{"rank": 0, "parameter_bytes": local_bytes(parameters)}]
        if ctx.is_main:
            write_lab_record(args, script=SCRIPT, method=method, device=device, world_size=ctx.world_size,
                                    ctx=ctx, metrics=metrics,
                                    config={**shape.describe(), "threads": threads,
                                            "pipeline_stages": len(stages) * ctx.world_size if pipelined else 1})
        return 0
    finally:
        teardown_distributed(ctx)


if __name__ == "__main__":
    run_main(main)
