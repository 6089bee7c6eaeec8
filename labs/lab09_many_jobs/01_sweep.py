#!/usr/bin/env python3
"""Run a sweep (a grid and/or random choices over a training script's flags) as ONE Slurm job array, or here.

Usage:
    python labs/lab09_many_jobs/01_sweep.py labs/lab09_many_jobs/sweeps/tiny.toml --plan    # the runs, nothing else
    python labs/lab09_many_jobs/01_sweep.py labs/lab09_many_jobs/sweeps/tiny.toml --local   # one after another, here
    python labs/lab09_many_jobs/01_sweep.py labs/lab09_many_jobs/sweeps/tiny.toml --parallel 2 --site lanta
    python labs/lab09_many_jobs/02_status.py --sweep-dir results/lab09/tiny                # then: how is it going?
    (the array's tasks run `01_sweep.py SWEEP --task $SLURM_ARRAY_TASK_ID`: sbatch/sweep_array.sbatch.j2)

What it teaches: a sweep of N runs is one ``sbatch --array=0-(N-1)%K`` submission, not N jobs: one
line in the queue, at most K tasks running at once, and each task finds its configuration from
``SLURM_ARRAY_TASK_ID``. The sweep file is expanded into tasks in a fixed order (so an index always
means the same run) and every task's command line is checked by the training script's own parser
before anything is submitted. Each task writes only into its own folder (record, checkpoint,
TensorBoard curves), so tasks never collide, and a task that is run again resumes from its checkpoint.

Bad input is one ``error:`` line and exit status 2, before anything is written or submitted: an
unknown flag or a bad value (the script's parser says which), an empty grid, more tasks than the
cluster's ``MaxArraySize`` (``scontrol show config``), a sweep folder that holds another sweep.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from common.cli import input_file, non_negative_int, output_dir, positive_int, script_parser
from common.errors import UserError, run_main
from common.slurm.rendering import read_template, render, write_script
from common.slurm.sites import find_site
from labs.lab09_many_jobs.lab09_shared import (ARRAY_TEMPLATE, check_task, check_with_script, display, max_array_size,
                                               prepare_folder, refuse_second_submission, refuse_task_flags, run_task,
                                               sbatch_job, slurm_time, write_plan)


def build_parser():
    parser = script_parser(__doc__)
    parser.add_argument("sweep_file", type=input_file, help="the sweep: .toml or .yaml (see sweeps/tiny.toml)")
    parser.add_argument("--sweep-dir", type=output_dir, default=None,
                        help="the sweep's folder: plan, logs, one folder per task "
                             "(default: results/lab09/<sweep name>)")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--plan", action="store_true", help="print the runs and the sbatch command; submit nothing "
                     "(default: submit)")
    how.add_argument("--local", action="store_true", help="run the tasks here, one after another (default: submit)")
    how.add_argument("--task", type=non_negative_int, default=None, metavar="INDEX",
                     help="run one task of the sweep (what each array task does, with $SLURM_ARRAY_TASK_ID)")
    slurm_flags = parser.add_argument_group("the job array (Slurm)")
    slurm_flags.add_argument("--parallel", type=positive_int, default=None,  # None: not given (--local refuses it)
                             help="at most this many tasks run at once: --array=0-N%%K (default: 4)")
    slurm_flags.add_argument("--site", default=None,
                             help="the site profile the array job is rendered for (slurm/sites/) (default: generic)")
    slurm_flags.add_argument("--time", type=slurm_time, default=None,
                             help="each task's time limit, e.g. 00:10:00 or 1 (minutes) (default: the template's)")
    slurm_flags.add_argument("--hold", action="store_true",
                             help="submit the array held: nothing starts until `scontrol release JOBID` (default: off)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,  # None: not given
                        help="--local: where every run trains (default: auto)")
    parser.add_argument("--dry-run", action="store_true",
                        help="every run trains one epoch of two steps (its own --dry-run) (default: off)")
    parser.epilog = "Flags after -- are added to every run (an array task adds its job's --device and --num-workers)."
    return parser


def submit_array(plan, args) -> str:
    """The lesson: the whole sweep as one job array, at most --parallel tasks at once."""
    site = find_site(args.site)
    text, _job = render(read_template(ARRAY_TEMPLATE), site)
    script = write_script(plan.folder / "sweep_array.sbatch", text)
    last = len(plan.tasks) - 1
    command = ["sbatch", "--parsable", f"--array=0-{last}%{args.parallel}",   # one job, N tasks, K at a time
               f"--job-name=sweep-{plan.sweep_id}", f"--output={plan.folder}/logs/%A_%a.out",
               *(["--time", args.time] if args.time else []), *(["--hold"] if args.hold else []),
               str(script), *run_flags(args)]
    began = time.perf_counter()
    job_id = sbatch_job(command, {"SWEEP_DIR": str(plan.folder), "SWEEP_FILE": str(plan.copy)},
                        "the sweep as array job",
                        lambda job_id: plan.add_submission("sbatch-array", job_id, range(len(plan.tasks)),
                                                           seconds=time.perf_counter() - began, command=command))
    print(f"submitted the sweep as array job {job_id}: {len(plan.tasks)} tasks, at most {args.parallel} at once "
          f"({time.perf_counter() - began:.2f} s){' HELD: scontrol release ' + job_id if args.hold else ''}")
    print(f"follow it: python labs/lab09_many_jobs/02_status.py --sweep-dir {plan.folder}")
    return job_id


def run_flags(args) -> list[str]:
    return [*(["--dry-run"] if args.dry_run else []), *args.extra]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:cut])
    args.extra = argv[cut + 1:]
    given = [flag for flag in ("parallel", "site", "time", "hold") if getattr(args, flag)]
    if args.local and given:  # the job array's settings: a run here is one task after another, no limit, no hold
        raise UserError(f"--{given[0]} is a setting of the job array: --local ignores it")
    if args.device is not None and not args.local:  # an array task trains on its job's device, not this flag's
        raise UserError(f"--device is where --local runs train; a submitted task trains on its job's device (cuda "
                        "where Slurm gave it GPUs; HPC_DL_LABS_DEVICE=cpu|cuda chooses): leave --device "
                        f"{args.device} out, or run here with --local")
    args.parallel, args.site, args.device = args.parallel or 4, args.site or "generic", args.device or "auto"
    folder = (args.sweep_dir or Path("results") / "lab09" / args.sweep_file.stem).resolve()  # tasks run elsewhere
    if args.task is not None:  # inside an array task: planned at submission (submitted by hand: planned here)
        plan = prepare_folder(folder, args.sweep_file, planning_now=True)
        check_task(plan, args.task)  # before the folder is made
        write_plan(plan)  # the same text from every task, each file written whole
        return run_task(plan, args.task, run_flags(args), replace_process=True)

    plan = prepare_folder(folder, args.sweep_file)
    if not args.local:
        # A site that is not in slurm/sites/ is one line now, --plan too, not after the plan is written.
        find_site(args.site)
    if not (args.plan or args.local):
        refuse_second_submission(plan)
        limit = max_array_size()  # array indices run from 0 to MaxArraySize - 1
        if len(plan.tasks) > limit:
            raise UserError(f"the sweep has {len(plan.tasks)} tasks, more than this cluster's MaxArraySize of {limit} "
                            "(scontrol show config): split it into several sweep files")
    if args.local and plan.sweep.get("faults", {}).get("stall"):  # nothing here would ever end the stalled task
        raise UserError(f"{args.sweep_file}: [faults] stall waits for a Slurm time limit, and --local has none (it "
                        "would wait for ever): submit it with --time 1, or leave stall out to run it here")
    if args.local and args.device == "cuda":  # every task would fail in turn: say it once, before anything is written
        from common.runtime.device import resolve_device

        resolve_device("cuda", start=False)  # the tasks use the GPU: this process holds no context on it
    refuse_task_flags(plan, args.extra)  # its seed, its folder, what the sweep varies: each task's own
    seconds = check_with_script(plan, run_flags(args))  # its own parser, before anything is written
    print(f"{len(plan.tasks)} task(s) of {display(plan.script)}, flags checked by its parser in {seconds:.1f} s:")
    shown = len(plan.tasks) if args.plan else 10  # --plan writes no plan.yaml: show every task
    for task in plan.tasks[:shown]:
        print(f"  {task.index:>3}: {' '.join(task.argv())}")
    if len(plan.tasks) > shown:
        print(f"  ... and {len(plan.tasks) - shown} more (all in {folder}/plan.yaml)")
    if run_flags(args):
        print(f"  every task adds: {' '.join(run_flags(args))}")
    if args.plan:
        print(f"would submit: sbatch --array=0-{len(plan.tasks) - 1}%{args.parallel} (site {args.site})")
        return 0
    if args.local:
        write_plan(plan)
        plan.add_submission("local", "local", range(len(plan.tasks)))
        failed = [task.index for task in plan.tasks
                  if run_task(plan, task.index, ["--device", args.device, *run_flags(args)]) != 0]
        print(f"ran {len(plan.tasks)} task(s) here; failed: {failed or 'none'}")
        return 1 if failed else 0
    write_plan(plan)
    submit_array(plan, args)
    return 0


if __name__ == "__main__":
    run_main(main)
