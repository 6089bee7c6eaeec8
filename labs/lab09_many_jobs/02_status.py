#!/usr/bin/env python3
"""A sweep's tasks: state, elapsed time, last step, best accuracy and cost; resubmit only what failed.

Usage:
    python labs/lab09_many_jobs/02_status.py --sweep-dir results/lab09/tiny              # the table
    python labs/lab09_many_jobs/02_status.py --sweep-dir results/lab09/tiny --resubmit   # the failed tasks, again
    python labs/lab09_many_jobs/02_status.py --sweep-dir results/lab09/tiny --record     # the sweep's record
    (on a cluster's login node; the pipeline's evaluate job runs --record: sbatch/pipeline_stage.sbatch.j2)

What it teaches: where a sweep's truth lives. Slurm's accounting (``sacct``) knows each task's state
(PENDING, RUNNING, COMPLETED, FAILED, TIMEOUT ...), its elapsed time and what it held (cores, GPUs);
the task's own folder knows how far it trained (its TensorBoard curves, read while it runs) and,
once it finished, its record. Resubmitting only the tasks that failed or ran out of time is one
``sbatch --array=1,2`` of the same script: each of them finds its checkpoint in its folder and
resumes. What a sweep cost is the sum over every attempt (failed and timed-out ones too):
core-hours = elapsed x cores, GPU-hours = elapsed x GPUs, from sacct; energy where it was measured.
``--record`` writes all of it as one record, which the report ranks by accuracy and by cost.
"""

from __future__ import annotations

import time

from common.cli import input_dir, non_negative_float, script_parser
from common.errors import UserError, run_main
from labs.lab09_many_jobs.lab09_shared import (ENDED, NOT_RUN, RETRY, read_plan, sbatch_job, status_table,
                                               sweep_status, write_sweep_record)

SCRIPT = "labs/lab09_many_jobs/02_status.py"


def build_parser():
    parser = script_parser(__doc__)
    parser.add_argument("--sweep-dir", type=input_dir, required=True, help="the sweep's folder (from 01_sweep.py)")
    parser.add_argument("--resubmit", action="store_true",
                        help="submit the failed and timed-out tasks again, as one array of just those (default: off)")
    parser.add_argument("--record", action="store_true",
                        help="write the sweep's record (states, accuracy, cost) into the sweep folder (default: off)")
    parser.add_argument("--wait", type=non_negative_float, default=0, metavar="SECONDS",
                        help="first wait until every task has ended, at most this long (default: no wait)")
    return parser


def resubmit(plan, statuses) -> str | None:
    """The lesson: one array of just the failed or timed-out tasks, same script; each resumes from its checkpoint."""
    again = [s.index for s in statuses if s.state in RETRY]
    if not again:
        print("nothing to resubmit: no task failed, timed out or was cancelled")
        return None
    array = ",".join(map(str, again))
    command = ["sbatch", "--parsable", f"--array={array}", f"--job-name=sweep-{plan.sweep_id}",
               f"--output={plan.folder}/logs/%A_%a.out", str(plan.folder / "sweep_array.sbatch")]
    job_id = sbatch_job(command, {"SWEEP_DIR": str(plan.folder), "SWEEP_FILE": str(plan.copy)},
                        "the tasks as array job",
                        lambda job_id: plan.add_submission("resubmit", job_id, again, command=command))
    print(f"resubmitted task(s) {array} as array job {job_id}; each resumes from its checkpoint")
    return job_id


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = read_plan(args.sweep_dir.resolve())
    began = time.perf_counter()
    statuses, problem = sweep_status(plan)
    deadline = began + args.wait
    while args.wait and any(s.state not in ENDED for s in statuses) and time.perf_counter() < deadline:
        time.sleep(2)
        statuses, problem = sweep_status(plan)
    print(status_table(plan, statuses))
    states = {}
    for s in statuses:
        states[s.state] = states.get(s.state, 0) + 1
    print(f"{len(statuses)} task(s): " + ", ".join(f"{count} {state}" for state, count in sorted(states.items())) +
          f" | {sum(s.core_hours for s in statuses):.4f} core-h, {sum(s.gpu_hours for s in statuses):.4f} GPU-h "
          f"(every attempt) | read in {time.perf_counter() - began:.2f} s")
    if problem:
        print(f"note: {problem}; states from squeue (queued and running jobs only)")
    local = bool(plan.submissions()) and plan.submissions()[-1]["how"] == "local"
    retry = [str(s.index) for s in statuses if s.state in RETRY]
    waiting = [str(s.index) for s in statuses if local and s.state == NOT_RUN]  # the same command runs them
    if (retry or waiting) and not args.resubmit:  # what to do next, said where the student reads the states
        said = [f"task(s) {', '.join(retry)} did not complete"] if retry else []
        said += [f"task(s) {', '.join(waiting)} have not run"] if waiting else []
        print(" and ".join(said) + ": " + ("01_sweep.py --local with the same sweep goes on (from their checkpoints)"
              if local else "--resubmit runs just those again, each from its checkpoint"))
    if args.resubmit:
        if not plan.submissions():  # planned, then sbatch refused the array: nothing ran, nothing to resubmit
            raise UserError(f"{plan.folder} holds no submission (did sbatch refuse it?): submit the whole sweep with "
                            f"01_sweep.py {plan.sweep_file} --sweep-dir {plan.folder}, or run it here with --local")
        if plan.submissions()[-1]["how"] == "local":
            raise UserError(f"{plan.folder} was not submitted to Slurm: run 01_sweep.py --local again to retry here")
        resubmit(plan, statuses)
    if args.record:
        print(f"record: {write_sweep_record(plan, statuses, SCRIPT)}")
    return 0


if __name__ == "__main__":
    run_main(main)
