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

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from common.checkpoint.single_file import load_checkpoint, save_checkpoint
from common.cli import config_dict, script_parser
from common.errors import run_main
from common.models import PlainCNN
from common.runtime.compat import enable_flight_recorder
from common.runtime.device import device_type
from common.runtime.distributed import open_process, print0, print_rank, teardown_distributed
from common.runtime.launch import detect_launch
from labs.lab06_failures.lab06_shared import (CHECKPOINT, END_OF_RUN, GRADIENTS, RUN_META, FaultPlan, Ledger,
                                              add_inject_args, block_until_parent_dies, check_resumable, diagnose,
                                              dump_flight_recorder, nan_stop, read_history, read_ledger, restart_count,
                                              start_afresh, timeout_fired, write_inject_record, write_run_meta)

IMAGE_SIZE, CLASSES = 8, 4


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
    plan.check(launch.world_size, args.steps, device_type(args.device) == "cuda", args.num_workers)  # or one line
    # The flight recorder keeps each rank's last 64 collectives; NCCL's watchdog dumps it on a timeout.
    enable_flight_recorder(64, dump_prefix=args.run_dir / "ledger" / "nccl-watchdog-rank")
    ctx = open_process(args.device, distributed=True, collective_timeout_s=args.collective_timeout)
    try:
        return train(args, ctx, plan)
    finally:
        teardown_distributed(ctx)


def train(args, ctx, plan: FaultPlan) -> int:
    resuming = args.resume or restart_count() > 0
    checkpoint_path = args.run_dir / CHECKPOINT
    if ctx.rank == 0 and not resuming:
        start_afresh(args.run_dir)  # no stale marker, ledger or checkpoint
    dist.barrier()
    ledger = Ledger(args.run_dir, ctx.rank)
    stacks = ledger.dump_stacks_on_sigusr2()  # the doctor's fallback (02) where py-spy may not look

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = PlainCNN(num_classes=CLASSES, in_channels=1, width=args.width).to(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    numel = sum(p.numel() for p in model.parameters()) + 1 + ctx.world_size
    start = 0
    state = check_resumable(load_checkpoint(checkpoint_path), args, checkpoint_path) if resuming else None
    if state is not None:  # the same model and data, with steps left to train (else one line, not a traceback)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        print0(f"resumed from {checkpoint_path} at step {start} (restart {restart_count()})")
    write_run_meta(args, ctx, numel)  # rank 0: what the doctor (02) needs to know about the run; then its first line

    dataset = SyntheticSteps(args.steps, args.batch_size, args.seed, ctx.rank, plan)
    loader = DataLoader(dataset, batch_size=None, num_workers=args.num_workers,
                        sampler=range(start, args.steps))  # a resumed run starts at its next step
    step, loss_value, began, stopped, left_early = start, float("nan"), time.perf_counter(), None, False
    where = None  # where a failure found this rank: at its step, unless it got to the end-of-run barrier
    try:
        for step, (images, labels) in enumerate(loader, start=start + 1):
            if plan.fires(ctx.rank, step, "crash-rank"):
                print_rank(f"crash-rank: exiting at step {step}")
                os._exit(1)  # as a segfault or the kernel's OOM killer would: no cleanup, no goodbye
            if left_early := plan.fires(ctx.rank, step, "skip-collective"):
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
                stopped, line = nan_stop(step, not_finite, start, args.checkpoint_every)
                print0(line)
                break
            optimizer.step()
            if step % args.log_interval == 0:
                print0(f"step {step}/{args.steps} loss {loss_value:.6f}")
            if step % args.checkpoint_every == 0 and ctx.rank == 0:
                save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                                 "config": config_dict(args)}, checkpoint_path)
        ledger.enter(END_OF_RUN, step, 1, left_early=left_early)
        where = f"in {END_OF_RUN}, having left the loop at step {step}" if left_early else f"in {END_OF_RUN}"
        dist.barrier()  # a rank that left the loop early waits here, and the others in the all-reduce: a hang
    except RuntimeError as error:  # Gloo's timeout, a peer that closed its connection, a desync
        return report_failure(args, ctx, error, step, stacks, where)
    wall = time.perf_counter() - began
    if stopped:
        write_inject_record(args, ctx, "failed", step, loss_value, wall, {"nan_stop": stopped})
        return 1  # non-zero: torchrun --max-restarts or a requeue restarts from the last good checkpoint
    print0(f"final loss {loss_value!r} at step {step} ({wall:.1f} s, restart {restart_count()})")
    write_inject_record(args, ctx, "ok", step, loss_value, wall, {})
    return 0


def report_failure(args, ctx, error: RuntimeError, step: int, stacks, where: str | None = None) -> int:
    """One line from one rank: the lowest rank that waited for the others, after reading the ledger."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, torch.OutOfMemoryError):  # this rank's own failure, not a peer's: it says so itself
        print_rank(f"diagnosis: rank(s) {ctx.rank} ran out of GPU memory at step {step} "
                   f"({type(error).__name__}: {message[:120]})")
        write_inject_record(args, ctx, "failed", step, float("nan"), None, {
            "diagnosis": f"rank {ctx.rank} out of memory", "culprits": [ctx.rank], "culprit_step": step})
        return 1
    ledger, meta = read_ledger(args.run_dir), json.loads((args.run_dir / RUN_META).read_text())
    verdict = diagnose(ledger, ctx.world_size, meta["steps"], meta["gradient_numel"],
                       history=read_history(args.run_dir))
    waiting = [r for r in range(ctx.world_size) if r not in verdict.ranks]
    timeout, why = timeout_fired(ledger, ctx.rank, message, args.collective_timeout, verdict)
    print_rank(f"error {where or 'at step ' + str(step)}: {message[:160]}", file=sys.stderr)
    dump_flight_recorder(args.run_dir, ctx.rank, ctx.backend)  # what 02_diagnose.py shows after the fact
    if waiting and ctx.rank == min(waiting):
        print_rank(f"diagnosis: {verdict.line}{why}")
        write_inject_record(args, ctx, "failed", step, float("nan"), None, {
            "diagnosis": verdict.line, "culprits": verdict.ranks, "culprit_step": verdict.step, "error": message,
            **timeout}, ledger=verdict.rows)
    stacks.close()
    return 1


def build_parser():  # the flags: lab06_shared.add_inject_args
    return add_inject_args(script_parser(__doc__))


if __name__ == "__main__":
    run_main(main)
