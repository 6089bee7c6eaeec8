#!/usr/bin/env python3
"""Lab-07 step 3: both at once — FSDP2 across one axis of a 2-D mesh, tensor parallel along the other.

Usage:
    python labs/lab07_model_parallel/03_2d_parallel.py --device cpu --layers 2 --width 32 --heads 4 \\
        --context 16 --batch-size 8                                                   # the reference
    torchrun --standalone --nproc_per_node=4 labs/lab07_model_parallel/03_2d_parallel.py --device cpu \\
        --layers 2 --width 32 --heads 4 --context 16 --batch-size 8 --mesh 2x2 --checkpoint-every 10
    torchrun --standalone --nproc_per_node=4 labs/lab07_model_parallel/03_2d_parallel.py --mesh 4x1 --resume
    srun --kill-on-bad-exit=1 python labs/lab07_model_parallel/03_2d_parallel.py --mesh 2x4
    sbatch two_d_parallel_2node.sbatch  # rendered from sbatch/two_d_parallel_2node.sbatch.j2, see the README

What it teaches: a ``DeviceMesh`` of DP x TP processes (``--mesh 2x2``: 4 processes in 2 rows of
2). Along a row, tensor parallel cuts every block (step 1); down a column, FSDP2 shards what each
row holds and splits the batch (Lab-04). Tensor parallel's traffic is on every layer, so it stays
inside a node, on the fast links (a row = consecutive ranks = one node); FSDP2's traffic is one
gather and one reduce per block, which a slower network between nodes can carry. The checkpoint
(DCP, ``common.checkpoint.sharded``) stores every tensor with its global shape, so a run saved on
2 x 2 continues on 4 x 1, or on one process, with the same losses. One process trains the same
model without any parallelism: the reference.
"""

from __future__ import annotations

import argparse
import importlib

import torch

from common.checkpoint.sharded import DistributedCheckpointer
from common.checkpoint.single_file import check_same_settings, check_steps_left
from common.cli import add_run_args, output_dir, positive_int, script_parser
from common.errors import FlagError, UserError, run_main
from common.measure.memory import local_bytes
from common.measure.timing import StepTimer
from common.runtime.device import configure_threads
from common.runtime.distributed import all_reduce_mean, gather_objects, init_distributed, print0, teardown_distributed
from common.runtime.launch import detect_launch
from common.train.preemption import note_fresh_start
from common.units import format_bytes
from labs.lab07_model_parallel.lab07_shared import (DRY_RUN, RESUME_SETTINGS, add_model_args, add_training_flags,
                                                    apply_dry_run, batch_for_step, build_model, check_mesh,
                                                    check_tensor_parallel, language_model_loss, parse_mesh,
                                                    shape_from_args, training_text, write_lab_record)

SCRIPT = "labs/lab07_model_parallel/03_2d_parallel.py"


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_model_args(parser)
    group = add_training_flags(parser, batch="sequences per step over all processes; each mesh row takes 1/DP "
                                             "of them")
    group.add_argument("--mesh", type=parse_mesh, default=None,
                       help="DPxTP, e.g. 2x2: FSDP2 over DP rows, tensor parallel over TP columns; the sizes "
                            "multiply to the number of processes (default: TP 2 when the number is even, else 1)")
    group.add_argument("--checkpoint-dir", type=output_dir, default=None,
                       help="DCP checkpoints, written by every process "
                            "(default: RESULTS_DIR/checkpoints/03_2d_parallel)")
    group.add_argument("--checkpoint-every", type=positive_int, default=None,
                       help="save after every this many steps, and after the last (default: after the last only)")
    group.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint, on any mesh (default: start fresh)")
    add_run_args(parser, dry_run=DRY_RUN)
    return parser


def parallelize(model, shape, mesh_shape: tuple[int, int], device: torch.device):
    """Tensor parallel along the mesh's ``tp`` axis, then FSDP2 along ``dp``: each block, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=("dp", "tp"))
    if mesh_shape[1] > 1:  # step 1's tensor-parallel plan, on the mesh's tp axis
        importlib.import_module("labs.lab07_model_parallel.01_tensor_parallel").apply_tensor_parallel(model, mesh["tp"])
    if mesh_shape[0] > 1:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return mesh["dp"].get_local_rank()


def main(argv: list[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv))
    shape = shape_from_args(args)
    world = detect_launch().world_size
    dp, tp = args.mesh or ((world // 2, 2) if world % 2 == 0 else (world, 1))
    check_mesh((dp, tp), world)
    check_tensor_parallel(shape, tp)
    if args.batch_size % dp:
        raise FlagError(f"--batch-size {args.batch_size} is not divisible by the {dp} data-parallel rows of "
                        f"--mesh {dp}x{tp}: each row takes an equal share of every batch")
    checkpoint_dir = args.checkpoint_dir or args.results_dir / "checkpoints" / "03_2d_parallel"
    ctx = init_distributed(args.device)
    try:
        device, threads = ctx.device, configure_threads()
        data = training_text(shape.context)
        model = build_model(shape, args.seed, device)
        row = parallelize(model, shape, (dp, tp), device) if world > 1 else 0
        # foreach=False: the blocks' tensors live on the 2-D mesh, the embeddings' on the DP axis alone,
        # and one fused update cannot mix tensors of two meshes.
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, foreach=False)
        checkpointer = DistributedCheckpointer(checkpoint_dir)
        # What a resumed run must share with the saved one (the mesh may differ: DCP reshards on load).
        settings = {key: getattr(args, key) for key in RESUME_SETTINGS}
        first = 0
        note_fresh_start(checkpoint_dir, resume=args.resume)  # the same command again: the earlier run is replaced
        if args.resume:
            saved = checkpointer.read()
            if saved is None:
                raise UserError(f"--resume: no complete checkpoint in {checkpoint_dir}")
            check_same_settings(saved, settings, checkpoint_dir)
            check_steps_left(int(saved["step"]), args.steps, checkpoint_dir)
            checkpointer.restore({"model": model, "optimizer": optimizer})
            first = int(saved["step"])
            print0(f"resumed from {saved['checkpoint_folder']} after step {first} "
                   f"(saved on mesh {saved.get('mesh', '?')})")
        method = "reference" if world == 1 else f"2d-{dp}x{tp}"
        print0(f"{method}: mesh {dp} (FSDP2) x {tp} (tensor parallel) = {world} process(es), {device} | "
               f"{shape.name}, batch {args.batch_size} = {dp} row(s) x {args.batch_size // dp}")

        timer, losses = StepTimer(device, warmup_steps=args.warmup_steps), []
        for step in range(first, args.steps):
            tokens, targets = batch_for_step(data, step, args.batch_size, args.seed)
            tokens, targets = tokens.chunk(dp)[row].to(device), targets.chunk(dp)[row].to(device)
            with timer.step(args.batch_size):
                optimizer.zero_grad(set_to_none=True)
                loss = language_model_loss(model(tokens), targets)
                loss.backward()
                optimizer.step()
            losses.append(all_reduce_mean(loss.detach()))  # each row's mean over an equal share: the batch's mean
            print0(f"step {step:3d} | loss {losses[-1]:.6f}")
            if step + 1 == args.steps or (args.checkpoint_every and (step + 1) % args.checkpoint_every == 0):
                checkpointer.save({"epoch": 1, "step": step + 1, "mesh": f"{dp}x{tp}", "config": settings},
                                  {"model": model, "optimizer": optimizer})
        checkpointer.close()

        per_rank = gather_objects({"rank": ctx.rank, "parameter_bytes": local_bytes(model.parameters())})
        print0("parameters held per rank: " + ", ".join(format_bytes(entry["parameter_bytes"]) for entry in per_rank))
        timing = timer.summary()
        if ctx.is_main:
            write_lab_record(args, script=SCRIPT, method=method, device=device, world_size=world, ctx=ctx,
                                    config={**shape.describe(), "threads": threads, "data_parallel": dp,
                                            "tensor_parallel": tp, "mesh": f"{dp}x{tp}"},
                                    metrics={"loss_at_step": losses, "first_step": first,
                                             "final_loss": losses[-1] if losses else None, "per_rank": per_rank,
                                             "step_time": timing,
                                             "tokens_per_s": timing["samples_per_s"] * shape.context
                                             if timing["samples_per_s"] else None})
        return 0
    finally:
        teardown_distributed(ctx)


if __name__ == "__main__":
    run_main(main)
