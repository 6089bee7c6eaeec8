#!/usr/bin/env python3
"""Mixed precision against full precision: the same training in fp32 and in bf16/fp16, compared.

Usage:
    python amp_training.py --device cpu                       # fp32 vs bf16 on the bundled digits
    python amp_training.py --dataset mnist --data-dir ~/data  # GPU node: fp32 vs fp16 vs bf16
    python amp_training.py --precision fp32,fp16             # choose the precisions yourself
    srun --gres=gpu:1 python amp_training.py --dataset mnist --data-dir ~/data
    sbatch sbatch/single_gpu.sbatch                           # the chapter's GPU job
    (one process on one device: no torchrun form; multi_gpu_ddp.py is the torchrun lesson)

What it teaches: automatic mixed precision (AMP) runs the forward pass in a 16-bit type under
``torch.autocast`` and keeps the weights and the optimiser in fp32; with fp16 a
``torch.amp.GradScaler`` scales the loss so small gradients do not underflow to zero, and gradients
are clipped only after ``scaler.unscale_()``. Whether it pays depends on the hardware: on a GPU with
tensor cores AMP is faster at nearly the same accuracy; on a CPU without native bf16 instructions
(this course's CI machine, most x86 before Sapphire Rapids / Zen 4) bf16 is emulated and much slower.

This script does not have a training loop of its own: it calls ``mnist_training.train_and_record()``
once per precision with the same seed and settings (the loop you read there is the loop measured
here), reads the result record each run wrote, prints a comparison table and writes a comparison
record (method ``amp-comparison``) that names the runs it compared.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from common.precision import TRAINING, gpu_support
from common.train import amp
from common.cli import add_common_args, add_former_names, apply_dry_run, config_dict, script_parser
from common.runtime.device import describe, resolve_device
from common.measure.energy import not_measured
from common.errors import UserError, run_main
from common.results import make_record, provenance, write_record
from common.measure.timing import format_rate, format_speedup
from common.units import format_bytes
from common.train.flags import add_training_args
from chapters.ch04_deep_learning import mnist_training
from chapters.ch04_deep_learning.ch04_shared import add_data_args, precision_list

SCRIPT = "chapters/ch04_deep_learning/amp_training.py"
BASELINE = "fp32"


def precisions_for(device: torch.device, requested: list[str]) -> list[str]:
    """fp32 first (the baseline), then the requested AMP precisions, each checked against ``device``."""
    if requested == ["auto"]:
        if device.type == "cuda":
            # bf16 is native from compute capability 8.0 (A100); a V100 only emulates it, slowly.
            native_bf16 = gpu_support("bf16", torch.cuda.get_device_capability(device)) == "native"
            requested = ["fp16", "bf16"] if native_bf16 else ["fp16"]
        else:
            requested = ["bf16"]  # CPU autocast supports bf16 only
    precisions = [BASELINE] + [p for p in requested if p != BASELINE]
    if "fp16" in precisions and device.type != "cuda":
        raise UserError("fp16 autocast needs a CUDA GPU; on CPU compare --precision fp32,bf16")
    return [amp.check_precision(p, device) for p in precisions]


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_former_names(parser, parser.add_argument("--precision", type=precision_list(TRAINING), default=["auto"],
                        help="comma-separated precisions to compare with fp32; auto = fp16,bf16 on a GPU "
                             "(fp16 only before compute capability 8.0), bf16 on CPU (default: auto)"), "--precisions")
    add_data_args(parser)  # passed on to mnist_training.py
    add_training_args(parser)  # passed on too
    # Small defaults on purpose: bf16 on a CPU without native bf16 is about ten times slower than fp32.
    add_common_args(parser, epochs=2, batch_size=64)  # --num-workers from the allocation, passed on
    return parser


def run_one(precision: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train once in ``precision``: mnist_training's run with its defaults, and this script's settings where
    both scripts have the flag; returns the record it wrote."""
    run_args = mnist_training.build_parser().parse_args([])
    vars(run_args).update({name: value for name, value in vars(args).items() if name in vars(run_args)})
    run_args.precision = precision
    path = mnist_training.train_and_record(run_args)
    record = json.loads(path.read_text(encoding="utf-8"))
    record["_path"] = str(path)
    return record


def main(argv: list[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv))
    device = resolve_device(args.device)
    precisions = precisions_for(device, args.precision)  # all checked before the first run starts
    print(f"comparing {', '.join(precisions)} on {describe(device)}: {args.dataset}, {args.epochs} epoch(s), "
          f"batch {args.batch_size}, seed {args.seed}", flush=True)

    records = {}
    for number, precision in enumerate(precisions, 1):
        print(f"\n=== run {number}/{len(precisions)}: {precision} ===", flush=True)
        records[precision] = run_one(precision, args)

    base = records[BASELINE]["metrics"]
    rows = []
    for precision, record in records.items():
        m = record["metrics"]
        speedup = (m["samples_per_s"] / base["samples_per_s"]) if m["samples_per_s"] and base["samples_per_s"] else None
        rows.append({
            "precision": precision, "run_id": record["run_id"], "record": Path(record["_path"]).name,
            "test_accuracy": m["test_accuracy"], "final_loss": m["final_loss"], "samples_per_s": m["samples_per_s"],
            "median_step_s": m["step_time"]["median_s"], "peak_memory_bytes": m["memory"][0]["peak_bytes"],
            "speedup_vs_fp32": speedup,
            "accuracy_diff_points": 100 * (m["test_accuracy"] - base["test_accuracy"]),
        })

    print(f"\n{'precision':<10} {'accuracy':>9} {'final loss':>11} {'samples/s':>10} {'speed-up':>9} "
          f"{'Δ acc (pts)':>12}" + (f" {'peak memory':>12}" if device.type == "cuda" else ""))
    for row in rows:
        line = (f"{row['precision']:<10} {100 * row['test_accuracy']:>8.2f}% {row['final_loss']:>11.4f} "
                f"{format_rate(row['samples_per_s']):>10} {format_speedup(row['speedup_vs_fp32']):>9} "
                f"{row['accuracy_diff_points']:>+12.2f}")
        if device.type == "cuda":  # on CPU the figure is the process's peak RSS, shared by all runs
            line += f" {format_bytes(row['peak_memory_bytes']):>12}"
        print(line)
    print("speed-up = samples/s of the precision / samples/s of fp32 (timed steps after warm-up); "
          "Δ acc = test accuracy minus fp32's, in percentage points")
    if device.type == "cuda":  # is the baseline real fp32, or half TF32? (common.runtime.device.resolve_device decides)
        print("fp32 baseline maths: {matmul} matmuls, {cudnn_conv} convolutions (ieee: real fp32; tf32: tensor "
              "cores)".format(**records[BASELINE]["provenance"].get("fp32_math", {"matmul": "?", "cudnn_conv": "?"})))

    record = make_record(
        lab="ch04", script=SCRIPT, method="amp-comparison",
        config=config_dict(args, precisions=precisions, resolved_device=str(device), baseline=BASELINE),
        metrics={"baseline": BASELINE, "runs": rows},
        provenance=provenance(device),
        notes=[f"compares the records {', '.join(row['record'] for row in rows)}, written by mnist_training.py "
               "with the same seed and settings"],
        energy=not_measured("a comparison: each run it compares carries the energy of its own training steps"),
    )
    print(f"record: {write_record(record, args.results_dir)}")
    return 0


if __name__ == "__main__":
    run_main(main)
