#!/usr/bin/env python3
"""Time the comparison report over many synthetic result records (default 1,000).

Usage:
    python bench/report_1000_records.py                   # 1,000 records, plots on
    python bench/report_1000_records.py --records 100 --no-plots --keep /tmp/report-bench

The records imitate a busy results folder: several labs, three machines, baseline/DP/DDP on 1-8
devices, repeats, a few failed runs. They are written with ``common.results.make_record`` and
``write_record`` like a real script's, then :func:`common.report.build_report` reads and renders them.
The time printed (wall clock, and this process's CPU time) covers reading, tables, plots
(importing matplotlib included), rendering and writing; importing pandas and jinja2 is printed on
its own line.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Sequence

_start_imports = time.perf_counter()
from common.cli import one_line_errors, output_dir, positive_int, seed_int
from common.errors import run_main
from common.report import build_report
from common.results import make_record, write_record

_IMPORT_S = time.perf_counter() - _start_imports

MACHINES = [("gpu-node-01", "cuda", "NVIDIA A100-SXM4-40GB"), ("gpu-node-02", "cuda", "NVIDIA RTX 4090"),
            ("laptop", "cpu", "x86_64")]
LABS = {"lab01": ["baseline", "dp", "ddp"], "lab03": ["fp32", "amp-bf16", "amp-fp16"], "ch04": ["fp32", "bf16"]}
MODELS = ["resnet18", "resnet50"]


def synthetic_record(rng: random.Random) -> dict:
    """One plausible record: throughput scales sub-linearly with devices, DP's first GPU is fuller."""
    lab = rng.choice(list(LABS))
    method = rng.choice(LABS[lab])
    host, device_type, device_name = rng.choice(MACHINES)
    # DataParallel on a CPU is the one-device case; DDP on a CPU runs several Gloo processes.
    single_device = method == "baseline" or lab != "lab01" or (method == "dp" and device_type == "cpu")
    devices = 1 if single_device else rng.choice([2, 4, 8])
    world_size = 1 if method == "dp" else devices
    model = rng.choice(MODELS)
    single = {"resnet18": 1200.0, "resnet50": 425.0}[model]
    efficiency = {"dp": 0.7, "ddp": 0.93}.get(method, 1.0) * rng.uniform(0.9, 1.05)
    samples_per_s = single * devices * efficiency
    peak = rng.uniform(3.0, 3.5) * 1024**3
    memory = [{"device": f"{device_type}:{i}" if device_type == "cuda" else "cpu",
               "peak_bytes": int(peak * (1.9 if method == "dp" and i == 0 else 1.0)),
               "source": "cuda_max_memory_allocated" if device_type == "cuda" else "process_max_rss"}
              for i in range(devices if device_type == "cuda" else 1)]
    batch = 64 * devices
    epoch_times = [50000 / samples_per_s * rng.uniform(0.97, 1.03) for _ in range(3)]
    metrics = {"samples_per_s": samples_per_s, "time_per_epoch_s": sorted(epoch_times)[1], "epoch_time_s": epoch_times,
               "global_batch_size": batch, "world_size": world_size, "memory": memory,
               "final_loss": rng.uniform(1.0, 1.1), "test_accuracy": rng.uniform(0.6, 0.7), "steps": 200,
               "step_time": {"median_s": batch / samples_per_s, "steps_timed": 190, "method": "synchronize"}}
    provenance = {"hostname": host, "world_size": world_size, "command": ["python", f"{lab}/train.py"],
                  "device": {"type": device_type, "name": device_name},
                  "versions": {"python": "3.11.7", "torch": "2.5.1", "cuda": "12.4"},
                  "git": {"commit": f"{rng.getrandbits(160):040x}", "dirty": False},
                  "slurm": {"SLURM_JOB_ID": str(rng.randint(10000, 99999))} if host.startswith("gpu") else {}}
    status = "failed" if rng.random() < 0.01 else "ok"
    return make_record(lab=lab, script=f"{lab}/train.py", method=method, config={"model": model},
                       metrics=metrics, provenance=provenance, status=status,
                       notes=["synthetic failure"] if status != "ok" else [])


def build_parser() -> argparse.ArgumentParser:
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--records", type=positive_int, default=1000, help="records to generate (default: %(default)s)")
    parser.add_argument("--seed", type=seed_int, default=0,
                        help="random seed of the synthetic data (default: %(default)s)")
    parser.add_argument("--no-plots", dest="plots", action="store_false", help="time without plots (default: plots on)")
    parser.add_argument("--keep", type=output_dir, default=None,
                        help="write records and report into this (empty) folder and keep them (default: a temp folder)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="report-bench-") as tmp:
        folder = args.keep or Path(tmp)
        for _ in range(args.records):
            write_record(synthetic_record(rng), folder / "records")
        start, start_cpu = time.perf_counter(), time.process_time()
        outcome = build_report(folder / "records", folder / "report.html", plots=args.plots)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
        size_mb = outcome.report_path.stat().st_size / 1e6
    print(f"imports (pandas, jinja2, common): {_IMPORT_S:.2f} s")
    print(f"report over {outcome.runs} records ({'with' if args.plots else 'without'} plots, "
          f"{size_mb:.1f} MB of HTML): {seconds:.2f} s, {cpu_seconds:.2f} s CPU")
    return 0


if __name__ == "__main__":
    run_main(main)
