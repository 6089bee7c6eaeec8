#!/usr/bin/env python3
"""Lab-04 step 3: the largest model each strategy can train, on the same ranks, within the same memory.

Usage:
    torchrun --standalone --nproc_per_node=4 labs/lab04_sharded_training/03_largest_model.py    # GPUs: their memory
    torchrun --standalone --nproc_per_node=4 labs/lab04_sharded_training/03_largest_model.py --budget 20GiB
    torchrun --standalone --nproc_per_node=4 labs/lab04_sharded_training/03_largest_model.py --device cpu \\
        --budget 64MiB --layers 4 --width 128 --context 64
    LAB04_STEP=largest sbatch sharded_torchrun_4gpu.sbatch  # rendered from sbatch/sharded_torchrun_4gpu.sbatch.j2

What it teaches: the headline of sharding. Starting from the model the flags describe, each
strategy doubles the model (its depth with ``--grow depth``, its width with ``--grow width``) and
trains one real AdamW step, until the step no longer fits in ``--budget`` bytes per rank; the last
model that fitted is the strategy's largest. DDP's largest is limited by the 16 bytes per parameter
every rank holds; FSDP2 divides those by the number of ranks; activation checkpointing then removes
most of the activations. The ratio of the largest models is the answer to "how much larger a model
can sharding train here".

What "fits" means:

- On a GPU: the step ran without running out of memory and the CUDA allocator's peak (everything,
  including the gathered block of FSDP2 and the optimizer's temporaries) stayed within ``--budget``
  (default: the GPU's memory). All ranks run the same shapes, so they run out of memory together.
- On CPU there is no allocator to ask: the bytes this rank holds after the step (parameters,
  gradients and AdamW state from the tensors, plus the activations autograd saved) must stay within
  ``--budget``. That leaves out FSDP2's transient gathered block, so on CPU the numbers flatter
  FSDP2 a little; the GPU's allocator peak does not.

Models are built on the ``meta`` device and sharded before they get memory, as a model larger
than one device must be. Result: one record (lab ``lab04``, method ``largest-model``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from common.cli import add_common_args, apply_dry_run, config_dict, positive_int, script_parser
from common.runtime.device import configure_threads
from common.runtime.distributed import any_rank, init_distributed, print0, teardown_distributed
from common.errors import run_main
from common.models import TransformerShape, transformer_parameter_count
from common.results import make_record, provenance, write_record
from common.units import format_bytes
from labs.lab04_sharded_training.lab04_shared import (
    LAB, VARIANTS, add_model_args, byte_size, check_strategy, measure_step, shape_from_args,
)

SCRIPT = "labs/lab04_sharded_training/03_largest_model.py"


def grow(shape: TransformerShape, how: str) -> TransformerShape:
    """Twice the blocks, or twice the width (the heads stay, each head gets twice the features)."""
    if how == "depth":
        return dataclasses.replace(shape, layers=2 * shape.layers)
    return dataclasses.replace(shape, width=2 * shape.width)


def try_step(shape: TransformerShape, variant: str, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """Train one step of ``shape``; return whether it fitted on every rank, and what it used here."""
    strategy, precision, checkpointed = VARIANTS[variant]
    used, out_of_memory = None, False
    try:
        measured = measure_step(shape, strategy, device, batch_size=args.batch_size, precision=precision,
                                activation_checkpointing=checkpointed, seed=args.seed, on_meta=True)
        if device.type == "cuda":
            used = measured["peak"]["peak_bytes"]  # the allocator saw everything, transients included
        else:
            used = sum(measured[part] for part in ("parameters", "gradients", "optimizer", "activations"))
    except torch.OutOfMemoryError:
        out_of_memory = True
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    fits = not any_rank(out_of_memory or used > args.budget, device)  # every rank must fit
    return {"layers": shape.layers, "width": shape.width, "parameters": transformer_parameter_count(shape),
            "bytes": used, "out_of_memory": out_of_memory, "fits": fits}


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_model_args(parser, layers=4)
    group = parser.add_argument_group("the search")
    group.add_argument("--budget", type=byte_size, default=None,
                       help="memory per rank a step may use, e.g. 512MiB or 20GiB; required on CPU "
                            "(default on a GPU: its memory)")
    group.add_argument("--grow", choices=("depth", "width"), default="depth",
                       help="double the blocks or the width at each try (default: %(default)s)")
    group.add_argument("--max-doublings", type=positive_int, default=8,
                       help="stop after this many doublings even if the step still fits (default: %(default)s)")
    group.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=["ddp", "fsdp", "fsdp+ac"],
                       help="strategies to compare (default: %(default)s)")
    add_common_args(parser, batch_size=8, epochs_and_steps=False, data=False)  # one step per size, random tokens
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = apply_dry_run(parser.parse_args(argv))
    base = shape_from_args(args)
    configure_threads()
    ctx = init_distributed(args.device, force_process_group=True)
    try:
        device = ctx.device
        if args.budget is None:
            if device.type != "cuda":
                parser.error("--budget is required on CPU (there is no device memory to fill), e.g. --budget 64MiB")
            args.budget = torch.cuda.get_device_properties(device).total_memory
        for variant in args.variants:
            check_strategy(VARIANTS[variant][0], VARIANTS[variant][1], device, world_size=ctx.world_size,
                           layers=base.layers, say_overhead=False)
        what = "the CUDA allocator's peak" if device.type == "cuda" else "bytes held (tensors + saved activations)"
        print0(f"largest model: {ctx.world_size} rank(s) | budget {format_bytes(args.budget)} per rank, by {what} | "
               f"doubling the {args.grow} from {base.layers} layers x {base.width} wide | micro-batch "
               f"{args.batch_size} x {base.context} characters")
        rows = []
        for variant in args.variants:
            shape, tries = base, []
            for _ in range(args.max_doublings + 1):
                tried = try_step(shape, variant, device, args)
                tries.append(tried)
                print0(f"  {variant:<13} {shape.layers:>4} layers x {shape.width:>5}: "
                       f"{tried['parameters'] / 1e6:9.2f} M parameters, "
                       f"{format_bytes(tried['bytes']) if tried['bytes'] is not None else 'out of memory':>10} "
                       f"on rank 0 -> {'fits' if tried['fits'] else 'does not fit'}")
                if not tried["fits"]:
                    break
                shape = grow(shape, args.grow)
            fitted = [t for t in tries if t["fits"]]
            rows.append({"variant": variant, "largest": fitted[-1] if fitted else None, "tries": tries,
                         "limited_by_doublings": tries[-1]["fits"]})
        summarise(rows, ctx, args, device)
        return 0
    finally:
        teardown_distributed(ctx)


def summarise(rows: list[dict[str, Any]], ctx: Any, args: argparse.Namespace, device: torch.device) -> None:
    """Print the table and the headline ratios; rank 0 writes the record."""
    baseline = next((r["largest"] for r in rows if r["variant"] == "ddp" and r["largest"]), None)
    for row in rows:
        largest = row["largest"]
        row["times_ddp"] = (largest["parameters"] / baseline["parameters"]) if largest and baseline else None
    if not ctx.is_main:
        return
    print(f"{'variant':<13} {'largest model that fits':>30} {'parameters':>12} {'x DDP':>7}")
    for row in rows:
        largest = row["largest"]
        shape = f"{largest['layers']} layers x {largest['width']}" if largest else "none (the first try did not fit)"
        more = "+" if row["limited_by_doublings"] else ""  # still fitted at the last doubling allowed
        ratio = f"{row['times_ddp']:.1f}{more}" if row["times_ddp"] else "-"
        print(f"{row['variant']:<13} {shape:>30} {(largest['parameters'] / 1e6 if largest else 0):>10.2f} M {ratio:>7}")
    notes = [f"{row['variant']} still fitted after --max-doublings {args.max_doublings}: its largest is a lower bound"
             for row in rows if row["limited_by_doublings"]]
    metrics = {"largest": rows, "budget_bytes": args.budget, "world_size": ctx.world_size,
               "measured_by": ("cuda_max_memory_allocated" if device.type == "cuda"
                               else "tensor_bytes_and_saved_activations")}
    config = config_dict(args, resolved_device=str(device), model=f"{shape_from_args(args).name} (start)")
    record = make_record(lab=LAB, script=SCRIPT, method="largest-model", config=config, metrics=metrics, notes=notes,
                         provenance=provenance(device, ctx.world_size, {"distributed": ctx.describe()}))
    for note in notes:
        print(f"note: {note}")
    print(f"record: {write_record(record, args.results_dir)}")


if __name__ == "__main__":
    run_main(main)
