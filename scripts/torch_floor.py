#!/usr/bin/env python3
"""Every lesson script's shortest run, with the PyTorch of this interpreter: the proof of the course's floor.

Usage:
    bash scripts/torch_floor.sh                         # makes .venv-floor/ at the floor, then runs this there
    python scripts/torch_floor.py                       # every lesson with this environment's PyTorch
    python scripts/torch_floor.py --only lab07-01_tensor_parallel ch04-mnist_training --keep runs/floor

It ends with ``torch X.Y.Z: N of N lesson runs ok`` (exit 0), or names each run that failed with its
error lines (exit 1). Each run is a lesson's ``main`` with the smallest arguments that still do its
work: a dry run or one or two steps on tiny data, on the CPU. ``import torch`` (and torchvision) costs
5-12 s of CPU per process, so the runs share processes: the single-process lessons run one after
another in this process, and the distributed ones in one job of two Gloo ranks started by torchrun,
whose group every one of them joins (``common.runtime.distributed`` never starts a second). Each run
gets a folder of its own (its working directory, its records, its ``log.txt``). A run a lesson starts
by itself (Lab-02's sweep under kernprof, Lab-05's study of 04_ddp_training.py) is a real process.
"""

from __future__ import annotations

import common  # noqa: F401  - first: below the floor this is one error line and exit 2

import argparse
import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from common.cli import input_dir, output_dir, script_parser
from common.errors import fail, run_main

REPO = Path(__file__).resolve().parents[1]
CPU = ("--device", "cpu")
TINY = (*CPU, "--dry-run", "--num-workers", "0")
SYNTHETIC = ("--model", "plain_cnn", "--dataset", "synthetic", "--synthetic-size", "32", "--batch-size", "8")
TRANSFORMER = ("--layers", "2", "--width", "32", "--heads", "4", "--context", "16")
#: Seconds a collective of the distributed job may wait before it fails (a lesson broken on one rank
#: must not hang the others until the job's time runs out).
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class LessonRun:
    """One lesson's shortest run: its script, its arguments (``--results-dir`` is added), how it runs."""

    script: str
    args: tuple[str, ...] = ()
    distributed: bool = False   # in the job of two Gloo ranks; else in this process
    folder: str = ""            # share the folder of this run (one that reads what another wrote runs after it)
    results: bool = True        # the script takes --results-dir


#: Every lesson script (``chapters/*/*.py`` and ``labs/*/*.py`` with a ``__main__``; tests/test_compat.py
#: checks that none is missing), in the order they run: a run that reads another's folder comes after it.
RUNS: dict[str, LessonRun] = {
    "ch04-pytorch_basics": LessonRun("chapters/ch04_deep_learning/pytorch_basics.py", (*CPU, "--size", "64")),
    "ch04-gpu_check": LessonRun("chapters/ch04_deep_learning/gpu_check.py", ("--json",), results=False),
    "ch04-mnist_training": LessonRun("chapters/ch04_deep_learning/mnist_training.py", TINY),
    "ch04-amp_training": LessonRun("chapters/ch04_deep_learning/amp_training.py", TINY),
    "ch04-multi_gpu_ddp": LessonRun("chapters/ch04_deep_learning/multi_gpu_ddp.py", TINY, distributed=True),
    "ch16-benchmark_cpu_vs_gpu": LessonRun("chapters/ch16_gpu_distributed/benchmark_cpu_vs_gpu.py", ("--dry-run",)),
    "ch16-efficient_loading": LessonRun("chapters/ch16_gpu_distributed/efficient_loading.py", (*CPU, "--dry-run")),
    "ch16-memory_management": LessonRun("chapters/ch16_gpu_distributed/memory_management.py", (*CPU, "--dry-run")),
    "ch16-profiling": LessonRun("chapters/ch16_gpu_distributed/profiling.py",
                                (*CPU, "--dry-run", "--model", "plain_cnn", "--image-size", "16", "--batch-size", "4")),
    "lab01-01_environment_check": LessonRun("labs/lab01_dp_vs_ddp/01_environment_check.py", ("--json",)),
    "lab01-02_baseline": LessonRun("labs/lab01_dp_vs_ddp/02_baseline_single_gpu.py", (*TINY, *SYNTHETIC)),
    "lab01-03_dataparallel": LessonRun("labs/lab01_dp_vs_ddp/03_dataparallel_training.py", (*TINY, *SYNTHETIC),
                                       folder="lab01-02_baseline"),
    "lab01-04_ddp": LessonRun("labs/lab01_dp_vs_ddp/04_ddp_training.py", (*TINY, *SYNTHETIC), distributed=True),
    "lab01-05_comparison": LessonRun("labs/lab01_dp_vs_ddp/05_performance_comparison.py",
                                     folder="lab01-02_baseline"),
    "lab02-mnist_classify": LessonRun("labs/lab02_profiling/mnist_classify.py", TINY),
    "lab02-profile_trace": LessonRun("labs/lab02_profiling/profile_trace.py",
                                     (*CPU, "--num-workers", "0", "--wait", "0", "--warmup", "1", "--active", "1")),
    "lab02-sweep": LessonRun("labs/lab02_profiling/sweep.py", (*TINY, "--steps", "baseline")),
    "lab03-benchmark_models": LessonRun("labs/lab03_precision_benchmark/benchmark_models.py",
                                        (*CPU, "--dry-run", "--models", "resnet18", "--image-size", "32", "-b", "2",
                                         "--precisions", "fp32", "--folder", "csv")),
    "lab04-01_memory_budget": LessonRun("labs/lab04_sharded_training/01_memory_budget.py",
                                        (*CPU, "--dry-run", *TRANSFORMER, "--batch-size", "2"), distributed=True),
    "lab04-02_sharded_training": LessonRun("labs/lab04_sharded_training/02_sharded_training.py",
                                           (*TINY, *TRANSFORMER, "--global-batch-size", "8", "--batch-size", "4",
                                            "--eval-steps", "1", "--async-checkpoint"), distributed=True),
    "lab04-03_largest_model": LessonRun("labs/lab04_sharded_training/03_largest_model.py",
                                        (*CPU, *TRANSFORMER, "--budget", "2MiB", "--max-doublings", "1"),
                                        distributed=True),
    "lab05-01_allreduce_bench": LessonRun("labs/lab05_scaling/01_allreduce_bench.py",
                                          (*CPU, "--min-bytes", "1K", "--max-bytes", "4K", "--iters", "2",
                                           "--warmup", "1", "--memcpy-repeats", "1"), distributed=True),
    "lab05-02_scaling_study": LessonRun("labs/lab05_scaling/02_scaling_study.py",
                                        (*CPU, "--dry-run", "--processes", "1", "--modes", "strong")),
    "lab05-03_overlap": LessonRun("labs/lab05_scaling/03_overlap.py",
                                  (*CPU, "--model", "resnet18", "--image-size", "16", "--batch-size", "2",
                                   "--bucket-cap-mb", "1", "--steps", "2", "--warmup-steps", "1"), distributed=True),
    "lab06-01_inject": LessonRun("labs/lab06_failures/01_inject.py",
                                 (*CPU, "--steps", "2", "--checkpoint-every", "1", "--num-workers", "0",
                                  "--run-dir", "run"), distributed=True),
    "lab06-02_diagnose": LessonRun("labs/lab06_failures/02_diagnose.py", ("--run-dir", "run"),
                                   folder="lab06-01_inject"),
    "lab06-04_preflight": LessonRun("labs/lab06_failures/04_preflight.py", CPU, distributed=True),
    "lab07-01_tensor_parallel": LessonRun("labs/lab07_model_parallel/01_tensor_parallel.py",
                                          (*CPU, "--dry-run", *TRANSFORMER, "--batch-size", "4"), distributed=True),
    "lab07-02_pipeline_parallel": LessonRun("labs/lab07_model_parallel/02_pipeline_parallel.py",
                                            (*CPU, "--dry-run", "--layers", "4", "--width", "32", "--heads", "4",
                                             "--context", "16", "--batch-size", "4"), distributed=True),
    "lab07-03_2d_parallel": LessonRun("labs/lab07_model_parallel/03_2d_parallel.py",
                                      (*CPU, "--dry-run", *TRANSFORMER, "--batch-size", "4", "--mesh", "1x2"),
                                      distributed=True),
    "lab08-01_make_dataset": LessonRun("labs/lab08_data_at_scale/01_make_dataset.py",
                                       (*CPU, "--dry-run", "--data-dir", "data")),
    "lab08-02_read_formats": LessonRun("labs/lab08_data_at_scale/02_read_formats.py",
                                       (*TINY, "--format", "webdataset", "--data-dir", "data"),
                                       folder="lab08-01_make_dataset"),
    # The job's ranks wait for the data set the single-process run above writes (distributed_worker).
    "lab08-03_shards_exactly_once": LessonRun("labs/lab08_data_at_scale/03_shards_exactly_once.py",
                                              (*TINY, "--data-dir", "data"), distributed=True,
                                              folder="lab08-01_make_dataset"),
    # Lab-09 drives Slurm, which the floor's run has not: the sweep's plan (each run's flags checked by the
    # training's own parser), a chain of links here (Chapter 4's training, resumed), the others' flags.
    "lab09-01_sweep": LessonRun("labs/lab09_many_jobs/01_sweep.py",
                                (str(REPO / "labs/lab09_many_jobs/sweeps/tiny.toml"), "--plan"), results=False),
    "lab09-02_status": LessonRun("labs/lab09_many_jobs/02_status.py", ("--help",), results=False),
    "lab09-03_chain": LessonRun("labs/lab09_many_jobs/03_chain.py",
                                ("--run-dir", "chain", "--local", "--device", "cpu", "--", "--dataset", "digits",
                                 "--dry-run", "--num-workers", "0"), results=False),
    "lab09-04_pipeline": LessonRun("labs/lab09_many_jobs/04_pipeline.py", ("--help",), results=False),
    "lab09-05_submitit": LessonRun("labs/lab09_many_jobs/05_submitit.py", ("--help",), results=False),
}


def argv_of(run: LessonRun) -> list[str]:
    return [*run.args, *(("--results-dir", "results") if run.results else ())]


def run_lesson(name: str, root: Path, rank: int = 0) -> int:
    """Run one lesson's ``main`` in this process, in its folder, its output into the folder's log; its exit status."""
    run = RUNS[name]
    folder = root / (run.folder or name)
    folder.mkdir(parents=True, exist_ok=True)
    path = REPO / run.script
    module_name = f"lesson_{name.replace('-', '_')}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    log = folder / (f"{name}.log" if rank == 0 else f"{name}.rank{rank}.log")
    cwd = os.getcwd()
    began = time.perf_counter()
    with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            os.chdir(folder)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module  # as an import does: dataclasses look their module up
            spec.loader.exec_module(module)
            run_main(module.main, argv_of(run))
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except BaseException:  # noqa: BLE001 - a lesson's crash is its result, not this runner's
            import traceback

            traceback.print_exc()
            status = 1
        finally:
            os.chdir(cwd)
    (folder / f"{name}.status{'' if rank == 0 else f'.rank{rank}'}").write_text(
        f"{status} {time.perf_counter() - began:.1f}\n")
    return status


def distributed_worker(root: Path, names: Sequence[str]) -> int:
    """One rank of the distributed job: join the group once, run every distributed lesson in it."""
    import torch.distributed as dist

    from common.runtime.distributed import init_distributed, teardown_distributed

    ctx = init_distributed("cpu", force_process_group=True)  # timeout: HPC_DL_LABS_DIST_TIMEOUT, set by main
    try:
        for name in names:
            before = RUNS[name].folder
            if before and not RUNS[before].distributed:  # a single-process run writes what this one reads
                folder, deadline = root / before, time.monotonic() + 600
                while not (folder / f"{before}.status").exists() and time.monotonic() < deadline:
                    time.sleep(0.5)
            run_lesson(name, root, ctx.rank)
            dist.barrier()  # the next lesson starts together on both ranks
    finally:
        teardown_distributed(ctx)
    return 0


def outcome(name: str, root: Path) -> tuple[bool, str]:
    """Did the run succeed on every rank, and the lines that say why not."""
    folder = root / (RUNS[name].folder or name)
    statuses = sorted(folder.glob(f"{name}.status*"))
    ranks = 2 if RUNS[name].distributed else 1
    codes = [int(p.read_text().split()[0]) for p in statuses]
    seconds = max((float(p.read_text().split()[1]) for p in statuses), default=0.0)
    if len(codes) == ranks and not any(codes):
        return True, f"{seconds:.1f} s"
    lines = []
    for log in sorted(folder.glob(f"{name}*.log")):
        text = log.read_text(errors="replace").splitlines()
        errors = [line for line in text if "Error" in line or line.startswith("error:")]
        lines += [f"{log.name}: {line.strip()}" for line in dict.fromkeys(errors[-3:] or text[-5:])]
    what = f"exit {codes}" if len(codes) == ranks else f"{len(codes)} of {ranks} rank(s) finished"
    return False, "; ".join([what, *lines])


def build_parser():
    parser = script_parser(__doc__)
    parser.add_argument("--only", nargs="+", default=None, metavar="RUN",
                        help=f"run only these (default: all {len(RUNS)}: {', '.join(RUNS)})")
    parser.add_argument("--keep", type=output_dir, default=None,
                        help="leave each run's folder (records, logs) here (default: a temporary folder, removed)")
    # Internal: a rank of the distributed job, running in this folder.
    parser.add_argument("--worker-of", type=input_dir, default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = list(args.only or RUNS)
    unknown = [name for name in names if name not in RUNS]
    if unknown:
        fail(f"unknown run(s) {', '.join(unknown)}; the runs are {', '.join(RUNS)}")
    distributed = [name for name in names if RUNS[name].distributed]
    if args.worker_of is not None:
        return distributed_worker(args.worker_of, distributed)

    import torch

    with contextlib.ExitStack() as stack:
        root = args.keep.resolve() if args.keep else Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="torch-floor-")))
        root.mkdir(parents=True, exist_ok=True)
        job = None
        if distributed:  # the Gloo job runs beside this process's own runs
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))}
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       str(Path(__file__).resolve()), "--worker-of", str(root), "--only", *distributed]
            env.update(OMP_NUM_THREADS="1", HPC_DL_LABS_DIST_TIMEOUT=str(COLLECTIVE_TIMEOUT_S))
            job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        # The runs that read a distributed run's folder wait for the whole job: they come last, so that the
        # job's runs that read a single-process run's folder (distributed_worker waits for those) get it first.
        waiting = sorted((name for name in names if not RUNS[name].distributed),
                         key=lambda name: RUNS[name].folder in distributed)
        while waiting:
            name = waiting.pop(0)
            after = RUNS[name].folder
            if after in distributed and job is not None and job.poll() is None:
                job_output = job.communicate()[0]
                (root / "distributed-job.log").write_text(job_output)
            run_lesson(name, root)
        if job is not None and job.returncode is None:
            (root / "distributed-job.log").write_text(job.communicate()[0])

        ok = 0
        for name in names:
            passed, detail = outcome(name, root)
            ok += passed
            print(f"{'ok' if passed else 'FAILED':6} {name}: {detail}")
        if job is not None and job.returncode != 0:
            print(f"the distributed job exited {job.returncode}: {root / 'distributed-job.log'}")
        print(f"torch {torch.__version__}: {ok} of {len(names)} lesson runs ok", flush=True)
    return 0 if ok == len(names) else 1


if __name__ == "__main__":
    run_main(main)
