#!/usr/bin/env python3
"""A sweep as a pipeline of dependent jobs: train (the job array) -> evaluate -> report, submitted at once.

Usage:
    python labs/lab09_many_jobs/04_pipeline.py labs/lab09_many_jobs/sweeps/tiny.toml --sweep-dir results/lab09/pipe
    python labs/lab09_many_jobs/04_pipeline.py --sweep-dir results/lab09/pipe --failed    # which tasks failed
    (on a login node: all three jobs are in the queue at once; Slurm starts each when its dependency is met)

What it teaches: Slurm's dependencies. The evaluate job waits with ``--dependency=afterany:<array>``,
so it runs once every task has ended, whatever each ended in: a sweep with a failed task still gets
evaluated, and says which failed. The report job waits with ``--dependency=afterok:<evaluate>``:
only a successful evaluation is worth a report. (``afterok`` on the array itself would never start
once one task failed: Slurm would leave it pending with the reason ``DependencyNeverSatisfied``.)
"""

from __future__ import annotations

import sys
from pathlib import Path

from common.cli import input_file, output_dir, positive_int, script_parser
from common.errors import Terminated, UserError, run_attached, run_main, sigterm_deferred, sigterm_raises
from common.results import load_records
from common.slurm.rendering import read_template, render, write_script
from common.slurm.sites import find_site
from labs.lab09_many_jobs.lab09_shared import LAB_DIR, read_plan, slurm, slurm_time, submitted_job_id

STAGE_TEMPLATE = LAB_DIR / "sbatch" / "pipeline_stage.sbatch.j2"


def build_parser():
    parser = script_parser(__doc__)
    parser.add_argument("sweep_file", type=input_file, nargs="?", help="the sweep to train (see sweeps/tiny.toml)")
    parser.add_argument("--sweep-dir", type=output_dir, required=True, help="the sweep's folder")
    parser.add_argument("--parallel", type=positive_int, default=4, help="tasks at once (default: %(default)s)")
    parser.add_argument("--site", default="generic", help="the site the jobs are rendered for (default: %(default)s)")
    parser.add_argument("--time", type=slurm_time, default=None,
                        help="each training task's time limit (default: the template's)")
    parser.add_argument("--failed", action="store_true",
                        help="say which tasks failed, from the sweep's record (what the report job prints last) "
                             "(default: off)")
    parser.epilog = "Flags after -- go to every training run."
    return parser


def which_failed(folder: Path) -> int:
    """One line from the newest sweep record in ``folder``: every task completed, or which did not."""
    if not (folder / "plan.yaml").is_file():  # not there, or a folder of something else (results/, a typo's parent)
        raise UserError(f"{folder} is not a sweep folder (no plan.yaml): give the --sweep-dir the pipeline was "
                        "started with")
    records = sorted((r for r in load_records(folder, recursive=False).records if r["lab"] == "lab09"),
                     key=lambda r: r["created"])
    if not records:
        raise UserError(f"{folder} holds no sweep record yet: the evaluate stage writes it (02_status.py --record)")
    tasks = records[-1]["metrics"]["tasks"]
    failed = [f"{t['index']} ({t['state']})" for t in tasks if t["state"] != "COMPLETED"]
    report = folder / "report.html"  # the report job's: a sweep run here (--local) has none
    print((f"report: {report}; " if report.is_file() else "") +
          (f"tasks that did not complete: {', '.join(failed)}" if failed else f"all {len(tasks)} tasks completed"))
    return 0


def say_stopped(submitted: dict[str, str], cause: str = "SIGTERM") -> None:
    """One line: which stages a kill (or Ctrl-C) left in the queue, and how to cancel them. SIGTERM waits for an
    sbatch under way; Ctrl-C reaches that sbatch too, which may or may not have submitted its job."""
    left = [stage for stage in ("train", "evaluate", "report") if stage not in submitted]
    maybe = (f"; Ctrl-C may have stopped sbatch after it submitted {left[0]}: see squeue --me"
             if cause == "Ctrl-C" and left else "")
    if not submitted:
        print(f"pipeline stopped by {cause} before it submitted anything{maybe}", flush=True)
        return
    jobs = ", ".join(f"{stage} = {'array ' if stage == 'train' else ''}job {job}" for stage, job in submitted.items())
    print(f"pipeline stopped by {cause}: submitted {jobs}" + (f" (not {', '.join(left)})" if left else "") +
          f"; cancel them: scancel {' '.join(submitted.values())}{maybe}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:cut])
    folder = args.sweep_dir.resolve()
    if args.failed:
        return which_failed(folder)
    if args.sweep_file is None:
        raise UserError("give the sweep file to submit (or --failed to read a finished pipeline)")
    # Stage 1, train: 01_sweep.py checks and submits the array (as a student would run it).
    sweep = [sys.executable, str(LAB_DIR / "01_sweep.py"), str(args.sweep_file), "--sweep-dir", str(folder),
             "--parallel", str(args.parallel), "--site", args.site, *(["--time", args.time] if args.time else []),
             "--", *argv[cut + 1:]]
    before = len(read_plan(folder).submissions()) if (folder / "plan.yaml").is_file() else 0
    submitted: dict[str, str] = {}  # stage -> job id: what a kill between the submissions leaves in the queue
    try:
        with sigterm_raises():  # kill (SIGTERM) stops the sweep's submission too, rather than let it submit alone
            if run_attached(sweep) != 0:
                return 2  # its error line is printed
            submitted["train"] = read_plan(folder).submissions()[-1]["job_id"]

            stage = write_script(folder / "pipeline_stage.sbatch",
                                 render(read_template(STAGE_TEMPLATE), find_site(args.site))[0])
            env = {"SWEEP_DIR": str(folder)}
            logs = f"--output={folder}/logs/%x-%j.out"
            with sigterm_deferred():  # a kill waits for sbatch: then the job is known, and named below
                submitted["evaluate"] = submitted_job_id(slurm(
                    "sbatch", "--parsable", f"--dependency=afterany:{submitted['train']}",  # after every task
                    "--job-name=evaluate", logs, str(stage), "evaluate", env=env))
            with sigterm_deferred():
                submitted["report"] = submitted_job_id(slurm(
                    "sbatch", "--parsable", f"--dependency=afterok:{submitted['evaluate']}",  # after a good evaluation
                    "--job-name=report", logs, str(stage), "report", env=env))
    except (Terminated, KeyboardInterrupt) as stop:
        if "train" not in submitted and (folder / "plan.yaml").is_file():  # the sweep, stopped with the pipeline,
            # waits for an sbatch under way and records the array it submitted: that one is in the queue too
            submitted.update(("train", s["job_id"]) for s in read_plan(folder).submissions()[before:])
        say_stopped(submitted, "SIGTERM" if isinstance(stop, Terminated) else "Ctrl-C")
        raise
    print(f"pipeline: train = array job {submitted['train']} -> evaluate = job {submitted['evaluate']} (afterany) -> "
          f"report = job {submitted['report']} (afterok); the report: {folder / 'report.html'}")
    return 0


if __name__ == "__main__":
    run_main(main)
