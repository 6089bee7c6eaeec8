#!/usr/bin/env python3
"""Check what this process can use: versions, GPUs, CPUs, and whether they match the Slurm allocation.

Usage:
    python gpu_check.py                      # on a login node, a laptop or inside a job
    python gpu_check.py --json               # one JSON object, for scripts and the report tool
    srun --gres=gpu:1 python gpu_check.py    # what a compute node's job really sees
    python gpu_check.py --strict             # exit 1 when a problem was found (a job's first line)
    sbatch sbatch/single_gpu.sbatch          # the chapter's job scripts run it before training
    (no torchrun form: it starts no process group; srun shows what each task of a job sees)

What it teaches: "the job has GPUs" and "PyTorch can use them" are two different facts. It prints
the Python, PyTorch, torchvision, CUDA, cuDNN and NCCL versions; whether CUDA, cuDNN, NCCL and Gloo
are there; each GPU's name, memory and compute capability (after a tiny computation on it); and the
allocation Slurm describes (``SLURM_CPUS_PER_TASK``, ``SLURM_GPUS_ON_NODE``/``SLURM_JOB_GPUS``,
``CUDA_VISIBLE_DEVICES``), with a warning for every place where the two disagree, e.g. Slurm
allocated 4 GPUs and PyTorch sees none. The logic lives in ``common/runtime/envcheck.py`` so Lab-01's
environment check can extend it.
"""

from __future__ import annotations

import argparse
import json

from common.cli import script_parser
from common.runtime.envcheck import add_check_args, allocation_agreement, collect_environment, format_environment
from common.errors import run_main


def build_parser() -> argparse.ArgumentParser:
    return add_check_args(script_parser(__doc__))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    info = collect_environment(smoke_test=args.smoke_test)
    warnings = allocation_agreement(info)
    if args.json:
        print(json.dumps({**info, "warnings": warnings}, indent=2, sort_keys=True))
    else:
        print(format_environment(info, warnings))
    return 1 if (args.strict and warnings) else 0


if __name__ == "__main__":
    run_main(main)
