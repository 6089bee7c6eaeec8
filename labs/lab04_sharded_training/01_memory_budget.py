#!/usr/bin/env python3
"""Lab-04 step 1: the memory budget of one rank, predicted from a formula and measured from tensors.

Usage:
    torchrun --standalone --nproc_per_node=4 labs/lab04_sharded_training/01_memory_budget.py
    torchrun --standalone --nproc_per_node=2 labs/lab04_sharded_training/01_memory_budget.py --device cpu \\
        --layers 4 --width 64 --context 64
    python labs/lab04_sharded_training/01_memory_budget.py --world-size 64 --layers 48 --width 4096  # formula only
    python labs/lab04_sharded_training/01_memory_budget.py --device cpu          # one rank, still measured
    LAB04_STEP=memory sbatch sharded_torchrun_4gpu.sbatch  # rendered from sbatch/sharded_torchrun_4gpu.sbatch.j2

What it teaches: where a rank's memory goes when it trains a transformer with AdamW in fp32, and
what each step of sharding takes away. For P parameters on N ranks:

==============  ==========  ==========  ===============  ==========================================
variant         parameters  gradients   AdamW state      activations (saved for backward)
==============  ==========  ==========  ===============  ==========================================
``ddp``         4 P         4 P         8 P              every block's, in fp32
``fsdp``        4 P / N     4 P / N     8 P / N          every block's, in fp32
``fsdp+ac``     4 P / N     4 P / N     8 P / N          each block's input only (recomputed later)
``fsdp+bf16``   4 P / N     4 P / N     8 P / N          every block's, in bf16 (half)
==============  ==========  ==========  ===============  ==========================================

(ZeRO's names: DDP keeps everything replicated; FSDP2 with its default ``reshard_after_forward``
is ZeRO stage 3, everything sharded. AdamW's state is two fp32 moments per parameter, plus one
step counter per parameter tensor.) Activations per token of a block of width d with h heads:
16 d values (the inputs of the norms, the linear layers and GELU, q/k/v and the attention output)
plus 4 normalisation statistics and h attention log-sum-exps; outside the blocks, the final norm
and head inputs (2 d) and the log-softmax of the vocabulary (V, in fp32).

Then it measures the same four numbers on every rank: one real training step per variant, the
local shards of the parameters, gradients and optimizer state summed from the tensors, the bytes
autograd saved for backward counted by saved-tensor hooks, and the peak of the CUDA allocator on
a GPU (on CPU: the process's resident memory, which also holds Python and PyTorch). Predicted and
measured are printed side by side and written as one record (lab ``lab04``, method ``memory``).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from common.cli import add_common_args, apply_dry_run, config_dict, positive_int, script_parser
from common.runtime.device import configure_threads, seed_everything
from common.runtime.distributed import gather_objects, init_distributed, print0, teardown_distributed
from common.errors import run_main
from common.models import TransformerShape, transformer_parameter_count
from common.results import make_record, provenance, write_record
from common.units import format_bytes
from labs.lab04_sharded_training.lab04_shared import (
    LAB, VARIANTS, add_model_args, check_strategy, measure_step, shape_from_args,
)

SCRIPT = "labs/lab04_sharded_training/01_memory_budget.py"
PARTS = ("parameters", "gradients", "optimizer", "activations")


def parameter_tensors(shape: TransformerShape) -> int:
    """How many parameter tensors: 11 per block (6 weights, 5 biases), 2 embeddings, the final norm's 2, the head."""
    return 11 * shape.layers + 5


def predict(shape: TransformerShape, variant: str, world_size: int, batch_size: int) -> dict[str, int]:
    """Bytes per rank from the formula in the docstring (one micro-batch of ``batch_size`` sequences)."""
    strategy, precision, checkpointed = VARIANTS[variant]
    params = transformer_parameter_count(shape)
    shards = world_size if strategy == "fsdp" else 1
    d, h, vocab, layers = shape.width, shape.heads, shape.vocab_size, shape.layers
    compute = 2 if precision == "bf16" else 4  # bytes per value of the activations
    if checkpointed:
        per_block = d * compute  # only the block's input survives the forward pass
    else:
        per_block = 16 * d * compute + 4 * compute + 4 * h  # log-sum-exp stays fp32
    per_token = layers * per_block + (2 * d + 2) * compute + 4 * vocab + 16  # + input and target ids (int64)
    tokens = batch_size * shape.context
    return {
        "parameters": 4 * params // shards,
        "gradients": 4 * params // shards,
        "optimizer": 8 * params // shards + 4 * parameter_tensors(shape),
        "activations": per_token * tokens + 8 * shape.context,  # + the position ids, shared by the batch
    }


def add_totals(parts: dict[str, int]) -> dict[str, int]:
    return {**parts, "states": parts["parameters"] + parts["gradients"] + parts["optimizer"],
            "total": sum(parts[part] for part in PARTS)}


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_model_args(parser)
    group = parser.add_argument_group("the budget")
    group.add_argument("--world-size", type=positive_int, default=None,
                       help="ranks to predict for; measuring needs that many processes "
                            "(default: the processes of this launch)")
    group.add_argument("--variants", nargs="+", choices=tuple(VARIANTS),
                       default=["ddp", "fsdp", "fsdp+ac", "fsdp+bf16"],
                       help="which strategies to predict and measure (default: %(default)s)")
    add_common_args(parser, batch_size=8, epochs_and_steps=False, data=False)  # one measured step, random tokens
    return parser


def main(argv: list[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv))
    shape = shape_from_args(args)
    configure_threads()
    ctx = init_distributed(args.device, force_process_group=True)
    try:
        device, launched = ctx.device, ctx.world_size
        world_size = args.world_size or launched
        measured_here = world_size == launched
        for variant in args.variants:
            strategy, precision, _ = VARIANTS[variant]
            check_strategy(strategy, precision, device, world_size=world_size, layers=shape.layers,
                           say_overhead=False)
        params = transformer_parameter_count(shape)
        print0(f"memory per rank: {world_size} rank(s) | {params / 1e6:.2f} M parameters ({shape.layers} layers x "
               f"{shape.width} wide, {shape.heads} heads) | micro-batch {args.batch_size} x {shape.context} "
               f"characters | AdamW, fp32 master weights")
        if not measured_here:
            print0(f"note: predicted for {world_size} ranks; this launch has {launched} process(es), so nothing "
                   f"is measured (start it with torchrun --nproc_per_node={world_size} to measure)")
        seed_everything(args.seed)
        rows = []
        for variant in args.variants:
            strategy, precision, checkpointed = VARIANTS[variant]
            row: dict[str, Any] = {"variant": variant, "world_size": world_size,
                                   "predicted": add_totals(predict(shape, variant, world_size, args.batch_size))}
            if measured_here:
                measured = measure_step(shape, strategy, device, batch_size=args.batch_size, precision=precision,
                                        activation_checkpointing=checkpointed, seed=args.seed)
                per_rank = gather_objects({**measured, "rank": ctx.rank})
                row["measured_per_rank"] = per_rank
                row["measured"] = add_totals({part: max(rank[part] for rank in per_rank) for part in PARTS})
            rows.append(row)
        if ctx.is_main:
            print_table(rows, device)
            metrics = {"budget": rows, "parameters": params, "world_size": world_size, "measured": measured_here,
                       "memory": peak_per_rank(rows)}
            config = config_dict(args, resolved_device=str(device), world_size=world_size, **shape.describe())
            record = make_record(lab=LAB, script=SCRIPT, method="memory", config=config, metrics=metrics,
                                 provenance=provenance(device, launched, {"distributed": ctx.describe()}))
            print0(f"record: {write_record(record, args.results_dir)}")
        return 0
    finally:
        teardown_distributed(ctx)


def peak_per_rank(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's highest peak over the variants, in the schema's ``metrics.memory`` form."""
    ranks: dict[int, dict[str, Any]] = {}
    for row in rows:
        for measured in row.get("measured_per_rank", []):
            peak = {**measured["peak"], "rank": measured["rank"]}
            if peak["peak_bytes"] > ranks.get(measured["rank"], {"peak_bytes": -1})["peak_bytes"]:
                ranks[measured["rank"]] = peak
    return [ranks[rank] for rank in sorted(ranks)]


def print_table(rows: list[dict[str, Any]], device: torch.device) -> None:
    """One line predicted, one measured (the largest over the ranks) per variant."""
    header = f"{'variant':<13} {'':<9}" + "".join(f"{part:>13}" for part in (*PARTS, "total"))
    print(header)
    for row in rows:
        for kind in ("predicted", "measured"):
            if kind not in row:
                continue
            values = row[kind]
            cells = "".join(f"{format_bytes(values[p]):>13}" for p in (*PARTS, "total"))
            line = f"{row['variant']:<13} {kind:<9}" + cells
            if kind == "measured":
                peak = max(rank["peak"]["peak_bytes"] for rank in row["measured_per_rank"])
                source = "allocator peak" if device.type == "cuda" else "process peak RSS, includes PyTorch itself"
                line += f"   {format_bytes(peak)} ({source})"
            print(line)
    print("(measured: the largest value over the ranks; parameters, gradients and optimizer state are this rank's "
          "local shards; activations are what autograd saved for backward)")


if __name__ == "__main__":
    run_main(main)
