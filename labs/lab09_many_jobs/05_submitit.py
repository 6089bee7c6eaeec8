#!/usr/bin/env python3
"""The same sweep submitted from Python with submitit (AutoExecutor, map_array): one job array, results back in Python.

Usage:
    python labs/lab09_many_jobs/05_submitit.py labs/lab09_many_jobs/sweeps/tiny.toml \\
        --sweep-dir results/lab09/tiny-submitit
    python labs/lab09_many_jobs/05_submitit.py ... --partition gpu --gpus-per-node 1 --timeout-min 30 --parallel 8
    (on a login node; it waits for the tasks and writes the sweep's record, as 02_status.py --record does)

What it teaches: what many practitioners use instead of an sbatch template. ``AutoExecutor`` writes
the sbatch script itself; ``map_array(train_one, ...)`` submits one job array with one task per
argument, and each task runs the pickled Python function; ``job.result()`` waits for the task and
returns what the function returned, or raises the task's own error with its traceback. submitit
watches the jobs through Slurm's accounting (``sacct``). The tasks, their folders and their records
are the same as with ``01_sweep.py``, so ``02_status.py`` and the report read both; the lab's README
compares the two ways.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from common.cli import input_file, non_negative_int, output_dir, positive_int, script_parser
from common.errors import UserError, run_main, sigterm_deferred
from labs.lab09_many_jobs.lab09_shared import (ENDED, check_with_script, prepare_folder, read_plan,
                                               refuse_second_submission, refuse_task_flags, run_task, status_table,
                                               say_queued_despite_sigterm, sweep_status, write_plan,
                                               write_sweep_record)

SCRIPT = "labs/lab09_many_jobs/05_submitit.py"


def train_one(folder: str, index: int, extra: list[str]) -> int:
    """What each array task runs (submitit pickles it): the sweep's task ``index``; its exit status."""
    status = run_task(read_plan(Path(folder)), index, extra)
    if status != 0:
        raise RuntimeError(f"task {index}: the training exited with status {status}")
    return status


def build_parser():
    parser = script_parser(__doc__)
    parser.add_argument("sweep_file", type=input_file, help="the sweep (see sweeps/tiny.toml)")
    parser.add_argument("--sweep-dir", type=output_dir, required=True, help="the sweep's folder")
    parser.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's default)")
    parser.add_argument("--gpus-per-node", type=non_negative_int, default=0,
                        help="GPUs per task (default: %(default)s)")
    parser.add_argument("--cpus-per-task", type=positive_int, default=1, help="cores per task (default: %(default)s)")
    parser.add_argument("--timeout-min", type=positive_int, default=30,
                        help="each task's time limit (default: %(default)s)")
    parser.add_argument("--parallel", type=positive_int, default=4, help="tasks at once (default: %(default)s)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where every run trains (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="every run trains two steps (default: off)")
    parser.epilog = "Flags after -- go to every training run."
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:cut])
    if shutil.which("sbatch") is None:  # submitit would run the tasks here, one after another, then find no sacct
        raise UserError("sbatch is not on PATH: submitit submits to Slurm, run this on a cluster's login node "
                        "(01_sweep.py --local runs a sweep on this machine)")
    extra = ["--device", args.device, *(["--dry-run"] if args.dry_run else []), *argv[cut + 1:]]
    plan = prepare_folder(args.sweep_dir.resolve(), args.sweep_file)
    refuse_second_submission(plan)  # as 01_sweep.py: submitting again would train every task again
    refuse_task_flags(plan, argv[cut + 1:])
    check_with_script(plan, extra)
    write_plan(plan)

    import submitit  # only here: the rest of the lab runs without it

    executor = submitit.AutoExecutor(folder=plan.folder / "submitit" / "%j")  # its scripts, pickles and logs
    executor.update_parameters(name=f"submitit-{plan.sweep_id}", timeout_min=args.timeout_min,
                               cpus_per_task=args.cpus_per_task, gpus_per_node=args.gpus_per_node,
                               slurm_array_parallelism=args.parallel,
                               **({"slurm_partition": args.partition} if args.partition else {}))
    began = time.perf_counter()
    with sigterm_deferred() as terminated:  # a kill waits for sbatch and the record: no array left unrecorded
        try:
            jobs = executor.map_array(train_one, [str(plan.folder)] * len(plan.tasks), [t.index for t in plan.tasks],
                                      [extra] * len(plan.tasks))  # one sbatch --array, one task per argument
        except submitit.core.utils.FailedJobError as err:  # submitit has printed sbatch's own words; no traceback
            status = getattr(err.__cause__, "returncode", "?")
            raise UserError(f"sbatch refused the array (exit status {status}; its words above), nothing was submitted: "
                            f"the plan in {plan.folder} stays, run this again once `sinfo` answers") from None
        submitted = time.perf_counter() - began
        array_id = jobs[0].job_id.split("_")[0]
        plan.add_submission("submitit", array_id, [t.index for t in plan.tasks], seconds=submitted)
        if terminated:
            say_queued_despite_sigterm("the sweep as array job", array_id)
    print(f"submitted {len(jobs)} task(s) as array job {array_id} with submitit in {submitted:.2f} s; waiting")
    for task, job in zip(plan.tasks, jobs):
        try:
            job.result()  # waits; a failed task raises its error here, with the task's traceback
            print(f"task {task.index}: done (job {job.job_id})")
        except Exception as err:  # noqa: BLE001 - one failed task must not hide the others
            print(f"task {task.index}: {type(err).__name__} (job {job.job_id}): {str(err).strip().splitlines()[-1]}")
    statuses, _ = sweep_status(plan)
    deadline = time.perf_counter() + 60  # a result may be back before sacct has the task's end
    while any(s.state not in ENDED for s in statuses) and time.perf_counter() < deadline:
        time.sleep(1)
        statuses, _ = sweep_status(plan)
    print(status_table(plan, statuses))
    print(f"record: {write_sweep_record(plan, statuses, SCRIPT)}")
    return 0


if __name__ == "__main__":
    run_main(main)
