#!/usr/bin/env python3
"""Lab-06 step 1: break a distributed training run on purpose, once, and see what it looks like.

Usage:
    torchrun --standalone --nproc_per_node=2 labs/lab06_failures/01_inject.py --device cpu   # no fault
    torchrun --standalone --nproc_per_node=2 labs/lab06_failures/01_inject.py --device cpu \\
        --fault skip-collective --rank 1 --step 3 --collective-timeout 5
    torchrun --standalone --nproc_per_node=2 --max-restarts=1 labs/lab06_failures/01_inject.py --device cpu \\
        --fault crash-rank --rank 1 --step 7            # restarted by torchrun, resumes from the checkpoint
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc_per_node=2 labs/lab06_failures/01_inject.py \\
        --fault shape-mismatch --rank 1 --step 3        # the desync named at once instead of an abort
    srun --kill-on-bad-exit=1 python labs/lab06_failures/01_inject.py --fault crash-rank --rank 1 --step 7
    sbatch inject.sbatch         # rendered from sbatch/inject.sbatch.j2, see the README

What it teaches: a data-parallel run (a small CNN of ``common.models`` on synthetic images) whose
step is visible: forward, backward, then ONE all-reduce that carries the gradients, the loss and a
"my loss is not finite" flag per rank, then the optimiser step. Rank ``--rank`` misbehaves once at
``--step`` (``--fault``, listed in ``--help``); a restarted or requeued run finds the marker the fault
left in ``--run-dir`` and goes on without it, resuming from the last checkpoint (rank 0 writes one
every ``--checkpoint-every`` steps). A hang becomes an error after ``--collective-timeout`` seconds
(30 by default); the rank that gets it reads every rank's ledger (the collective each rank entered
last, written before entering it) and prints one line naming the rank that is behind or called
something else, the step, and the timeout that fired. A NaN on any rank reaches every rank in the
same all-reduce, so all stop at the same step (none is left waiting) and the last good checkpoint
is the one on disk.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from common.checkpoint.single_file import load_checkpoint, save_checkpoint
from common.cli import (
    add_collective_timeout_arg, add_run_args, config_dict, non_negative_int, output_dir, positive_int, script_parser,
)
from common.errors import run_main
from common.models import PlainCNN
from common.runtime.compat import enable_flight_recorder
from common.runtime.device import device_type
from common.runtime.distributed import open_process, print0, print_rank, teardown_distributed
from common.runtime.launch import detect_launch
from labs.lab06_failures.lab06_shared import (
    DEFAULT_RUN_DIR, END_OF_RUN, FAULTS, FIRED_MARKER, GRADIENTS, RUN_META, FaultPlan, Ledger,
    block_until_parent_dies, diagnose, dump_flight_recorder, read_history, read_ledger, restart_count,
    timeout_fired, write_inject_record,
)

SCRIPT = "labs/lab06_failures/01_inject.py"
IMAGE_SIZE, CLASSES = 8, 4
#: Every fault here ends, diagnosed, within a minute and a half (not the group's usual 600 s), with time
#: to look at a live hang (02_diagnose.py); it starts once every rank is in (common.runtime.distributed).
COLLECTIVE_TIMEOUT_S = 30.0


class SyntheticSteps(Dataset):
    """Item ``i`` is the whole batch of step ``i + 1`` for this rank: the same numbers in every run
    (seeded by step and rank), so a resumed run sees what the uninterrupted one saw."""

    def __init__(self, steps: int, batch_size: int, seed: int, rank: int, plan: FaultPlan) -> None:
        self.steps, self.batch_size, self.seed, self.rank, self.plan = steps, batch_size, seed, rank, plan

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.plan.fires(self.rank, index + 1, "stuck-loader"):
            block_until_parent_dies()  # a worker stuck on a file system, a lock, a dead NFS server ...
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + 1_000 * (index + 1) + self.rank)
        images = torch.randn(self.batch_size, 1, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
        return images, (images.mean(dim=(1, 2, 3)) > 0).long() + 2 * (images[:, 0, 0, 0] > 0).long()


def reduce_step(model, loss: torch.Tensor, ctx, plan: FaultPlan, ledger: Ledger, step: int,
                slow_s: float) -> tuple[float, list[int]]:
    """The one all-reduce of a step: every gradient, the loss, and one not-finite flag per rank.
    Returns the mean loss and the ranks whose loss was not finite; gradients become the mean."""
    grads = [p.grad.reshape(-1) for p in model.parameters()]
    flags = torch.zeros(ctx.world_size, device=loss.device)  # beside the gradients: one buffer, one device
    flags[ctx.rank] = (~torch.isfinite(loss.detach())).float()
    buffer = torch.cat([*grads, loss.detach().reshape(1), flags])
    if plan.fires(ctx.rank, step, "shape-mismatch"):
        buffer = torch.cat([buffer, buffer.new_zeros(1)])  # one element more than every other rank
    if plan.fires(ctx.rank, step, "slow-rank"):
        time.sleep(slow_s)  # longer than the collective timeout: the others give up first
    ledger.enter(GRADIENTS, step, buffer.numel())
    dist.all_reduce(buffer)
    buffer /= ctx.world_size
    offset = 0
    for p, g in zip(model.parameters(), grads):
        p.grad.copy_(buffer[offset:offset + g.numel()].view_as(p.grad))
        offset += g.numel()
    loss_value, *flags = buffer[offset:].tolist()  # the loss and the flags: one copy to the host
    return loss_value, [r for r in range(ctx.world_size) if flags[r] > 0]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.steps = min(args.steps, 4) if args.dry_run else args.steps
    launch = detect_launch()
    plan = FaultPlan(args.fault, args.rank, args.step, args.run_dir)
    plan.check(launch.world_size, args.steps, cuda=device_type(args.device) == "cuda")  # one error line, nothing yet
    # The flight recorder keeps each rank's last 64 collectives; NCCL's watchdog dumps it on a timeout.
    enable_flight_recorder(64, dump_prefix=args.run_dir / "ledger" / "nccl-watchdog-rank")
    ctx = open_process(args.device, distributed=True, collective_timeout_s=args.collective_timeout)
    try:
        return train(args, ctx, plan)
    finally:
        teardown_distributed(ctx)


def train(args, ctx, plan: FaultPlan) -> int:
    resuming = args.resume or restart_count() > 0
    checkpoint_path = args.run_dir / "checkpoint.pt"
    if ctx.rank == 0 and not resuming:  # a fresh run: no stale marker, ledger or checkpoint
        shutil.rmtree(args.run_dir / "ledger", ignore_errors=True)
        for name in (FIRED_MARKER, RUN_META, checkpoint_path.name):
            (args.run_dir / name).unlink(missing_ok=True)
    dist.barrier()
    ledger = Ledger(args.run_dir, ctx.rank)
    stacks = open(args.run_dir / "ledger" / f"stack-rank{ctx.rank}.txt", "w")
    faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True)  # the doctor's fallback (02)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = PlainCNN(num_classes=CLASSES, in_channels=1, width=args.width).to(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    numel = sum(p.numel() for p in model.parameters()) + 1 + ctx.world_size
    start = 0
    state = load_checkpoint(checkpoint_path) if resuming else None
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        print0(f"resumed from {checkpoint_path} at step {start} (restart {restart_count()})")
    if ctx.rank == 0:
        meta = {"world_size": ctx.world_size, "steps": args.steps, "gradient_numel": numel, "fault": args.fault,
                "rank": args.rank, "step": args.step, "collective_timeout": args.collective_timeout}
        (args.run_dir / RUN_META).write_text(json.dumps(meta))
    fault = "no fault" if args.fault == "none" else f"fault {args.fault} on rank {args.rank} at step {args.step}"
    print0(f"{ctx.line(distributed=True)} | {fault} | {numel} elements all-reduced per step | "
           f"run folder {args.run_dir}")
    print0(f"a collective that waits {args.collective_timeout:g} s for the other ranks fails (--collective-timeout)")

    dataset = SyntheticSteps(args.steps, args.batch_size, args.seed, ctx.rank, plan)
    loader = DataLoader(dataset, batch_size=None, num_workers=args.num_workers,
                        sampler=range(start, args.steps))  # a resumed run starts at its next step
    step, loss_value, began, stopped = start, float("nan"), time.perf_counter(), None
    try:
        for step, (images, labels) in enumerate(loader, start=start + 1):
            if plan.fires(ctx.rank, step, "crash-rank"):
                print_rank(f"crash-rank: exiting at step {step}")
                os._exit(1)  # as a segfault or the kernel's OOM killer would: no cleanup, no goodbye
            if plan.fires(ctx.rank, step, "skip-collective"):
                break  # this rank thinks it is done; the others are about to enter the all-reduce
            if plan.fires(ctx.rank, step, "oom"):
                torch.empty(1 << 50, device=ctx.device)  # 1 PiB: torch.OutOfMemoryError on rank R
            optimizer.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(images.to(ctx.device)), labels.to(ctx.device))
            if plan.fires(ctx.rank, step, "nan-loss"):
                loss = loss * float("nan")
            loss.backward()
            loss_value, not_finite = reduce_step(model, loss, ctx, plan, ledger, step,
                                                 slow_s=args.collective_timeout + 2.0)
            if not_finite:  # every rank learns it from the same all-reduce: all stop here, together
                stopped = {"step": step, "ranks": not_finite, "checkpoint_step": last_checkpoint(args, step)}
                print0(f"step {step}: loss not finite on rank(s) {not_finite}; every rank stops at this step; "
                       f"last good checkpoint: step {stopped['checkpoint_step']}")
                break
            optimizer.step()
            if step % args.log_interval == 0:
                print0(f"step {step}/{args.steps} loss {loss_value:.6f}")
            if step % args.checkpoint_every == 0 and ctx.rank == 0:
                save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                                 "config": config_dict(args)}, checkpoint_path)
        ledger.enter(END_OF_RUN, step, 1)
        dist.barrier()  # a rank that left the loop early waits here, and the others in the all-reduce: a hang
    except RuntimeError as error:  # Gloo's timeout, a peer that closed its connection, a desync
        return report_failure(args, ctx, error, step, stacks)
    wall = time.perf_counter() - began
    if stopped:
        write(args, ctx, "failed", step, loss_value, wall, {"nan_stop": stopped})
        return 1  # non-zero: torchrun --max-restarts or a requeue restarts from the last good checkpoint
    print0(f"final loss {loss_value!r} at step {step} ({wall:.1f} s, restart {restart_count()})")
    write(args, ctx, "ok", step, loss_value, wall, {})
    return 0


def last_checkpoint(args, step: int) -> int:
    return (step - 1) // args.checkpoint_every * args.checkpoint_every


def report_failure(args, ctx, error: RuntimeError, step: int, stacks) -> int:
    """One line from one rank: the lowest rank that waited for the others, after reading the ledger."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, torch.OutOfMemoryError):  # this rank's own failure, not a peer's: it says so itself
        print_rank(f"diagnosis: rank(s) {ctx.rank} ran out of GPU memory at step {step} "
                   f"({type(error).__name__}: {message[:120]})")
        write(args, ctx, "failed", step, float("nan"), None, {"diagnosis": f"rank {ctx.rank} out of memory",
                                                               "culprits": [ctx.rank], "culprit_step": step})
        return 1
    meta = json.loads((args.run_dir / RUN_META).read_text())
    ledger = read_ledger(args.run_dir)
    verdict = diagnose(ledger, ctx.world_size, meta["steps"], meta["gradient_numel"],
                       history=read_history(args.run_dir))
    waiting = [r for r in range(ctx.world_size) if r not in verdict.ranks]
    waited, fired, why = timeout_fired(ledger.get(ctx.rank), message, args.collective_timeout)
    print_rank(f"error at step {step}: {message[:160]}", file=sys.stderr)
    dump_flight_recorder(args.run_dir, ctx.rank, ctx.backend)  # what 02_diagnose.py shows after the fact
    if waiting and ctx.rank == min(waiting):
        print_rank(f"diagnosis: {verdict.line}{why}")
        write(args, ctx, "failed", step, float("nan"), None,
              {"diagnosis": verdict.line, "culprits": verdict.ranks, "culprit_step": verdict.step, "error": message,
               "timeout_fired_s": args.collective_timeout if fired else None, "waited_s": waited},
              ledger=verdict.rows)
    stacks.close()
    return 1


def write(args, ctx, status: str, step: int, loss: float, wall: float | None, extra: dict, ledger=None) -> None:
    if ctx.rank == 0 or "diagnosis" in extra:  # rank 0's result, or the record of the rank that diagnosed
        write_inject_record(args, SCRIPT, ctx.device, ctx.world_size, ctx.describe(), status,
                         {"final_loss": loss, "steps_done": step, "restarts": restart_count(), "wall_s": wall,
                          **extra, **({"ledger": ledger} if ledger is not None else {})})


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    group = parser.add_argument_group("the fault")
    group.add_argument("--fault", choices=FAULTS, default="none",
                       help="; ".join(f"{name}: {what}" for name, what in FAULTS.items()) + " (default: %(default)s)")
    group.add_argument("--rank", type=non_negative_int, default=1,
                       help="the rank that misbehaves (default: %(default)s)")
    group.add_argument("--step", type=positive_int, default=3, help="the step at which it does (default: %(default)s)")
    add_collective_timeout_arg(group, default=COLLECTIVE_TIMEOUT_S)
    group = parser.add_argument_group("the run")
    group.add_argument("--steps", type=positive_int, default=10, help="optimiser steps (default: %(default)s)")
    group.add_argument("--batch-size", type=positive_int, default=16,
                       help="images per rank and step (default: %(default)s)")
    group.add_argument("--width", type=positive_int, default=4,
                       help="channels of the CNN's first layer (default: %(default)s)")
    group.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9 (default: %(default)s)")
    group.add_argument("--num-workers", type=non_negative_int, default=1,
                       help="DataLoader worker processes; stuck-loader needs one (default: %(default)s)")
    group.add_argument("--log-interval", type=positive_int, default=5,
                       help="steps between loss lines (default: %(default)s)")
    group.add_argument("--checkpoint-every", type=positive_int, default=5,
                       help="rank 0 saves model and optimiser every this many steps (default: %(default)s)")
    group.add_argument("--run-dir", type=output_dir, default=DEFAULT_RUN_DIR,
                       help="checkpoint, fault marker and ledger; a restarted run resumes from it "
                            "(default: %(default)s)")
    group.add_argument("--resume", action="store_true",
                       help="resume from --run-dir even when not restarted by torchrun or Slurm (default: off)")
    add_run_args(parser, dry_run="at most four steps: checks that everything runs")
    return parser


if __name__ == "__main__":
    run_main(main)
