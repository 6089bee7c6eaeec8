#!/usr/bin/env python3
"""Start a training run that is longer than the partition's time limit as a chain of jobs (or here, link by link).

Usage:
    python labs/lab09_many_jobs/03_chain.py --run-dir checkpoints/long-run -- --epochs 50        # on a login node
    python labs/lab09_many_jobs/03_chain.py --run-dir checkpoints/demo --local -- --dataset digits \\
        --epochs 1 --max-steps 9 --step-budget 3                                                   # 3 links, here
    sbatch --job-name=long-run chain_link.sbatch ...   (what it submits: sbatch/chain_link.sbatch.j2, rendered)

What it teaches: a run that needs 30 hours on a partition that allows 24 is a chain of jobs, each one
resuming from the checkpoint the one before saved. The link (``sbatch/chain_link.sbatch.j2``) trains
until SIGUSR1 warns it of its time limit, saves, and submits the next link with
``--dependency=afterany:$SLURM_JOB_ID``, so the next one waits until this one has ended. The chain ends
when a link finishes the run, and a link whose training fails stops it with one line. ``--local`` runs
the same links one after another on this machine, each ended by ``--step-budget`` instead of a time
limit: every link is a fresh process, as under Slurm, and the run ends with the weights of an
unbroken one. The flags after ``--`` are read by the training's own parser before link 1 (a typo is one
line, not a broken link); the chain sets ``--checkpoint``, ``--resume`` and ``--results-dir`` itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from common.cli import output_dir, positive_int, script_parser
from common.errors import UserError, run_main
from common.results import load_records
from common.slurm.rendering import read_template, render, write_script
from common.slurm.sites import find_site
from labs.lab09_many_jobs.lab09_shared import (LAB_DIR, REPO_ROOT, check_training_flags, run_passing_signals_on,
                                               sbatch_job, slurm_time)

LINK_TEMPLATE = LAB_DIR / "sbatch" / "chain_link.sbatch.j2"
TRAIN_SCRIPT = REPO_ROOT / "chapters" / "ch04_deep_learning" / "mnist_training.py"


def build_parser():
    parser = script_parser(__doc__)
    parser.add_argument("--run-dir", type=output_dir, required=True,
                        help="the run's folder: its checkpoint, the rendered link, the links' logs")
    parser.add_argument("--results-dir", type=output_dir, default=None,
                        help="where the finished run's record goes (default: RUN_DIR/results)")
    parser.add_argument("--local", action="store_true", help="run the links here, one after another (default: submit)")
    parser.add_argument("--max-links", type=positive_int, default=20,
                        help="stop the chain after this many links (default: %(default)s)")
    parser.add_argument("--site", default=None, help="the site the link is rendered for (default: generic)")
    parser.add_argument("--time", type=slurm_time, default=None,
                        help="each link's time limit (default: the template's)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="--local: where the links train (default: %(default)s)")
    parser.epilog = "Flags after -- go to the training (mnist_training.py) in every link."
    return parser


def submit_chain(args, train_flags: list[str]) -> str:
    """The first link; each link submits the next itself (see the template)."""
    script = write_script(args.run_dir / "chain_link.sbatch",
                          render(read_template(LINK_TEMPLATE), find_site(args.site))[0])
    name = f"chain-{args.run_dir.name}"
    command = ["sbatch", "--parsable", f"--job-name={name}", f"--output={args.run_dir}/%x-%j.out",
               *(["--time", args.time] if args.time else []), str(script), *train_flags]
    env = {"RUN_DIR": str(args.run_dir), "RESULTS_DIR": str(args.results_dir), "CHAIN_MAX_LINKS": str(args.max_links),
           "CHAIN_LINK": "1"}
    job_id = sbatch_job(command, env, "link 1 of the chain as job")
    print(f"link 1 of the chain is job {job_id} ({name}); follow it: squeue --name={name}; "
          f"sacct --name={name} --format=JobID,State,Elapsed")
    return job_id


def link_flags(args) -> list[str]:
    """What the chain gives the training in every link, before the flags after --."""
    return ["--device", args.device, "--results-dir", str(args.results_dir),
            "--checkpoint", str(args.run_dir / "checkpoint.pt"), "--resume", "--save-model"]


def run_links_here(args, train_flags: list[str]) -> int:
    """The chain on this machine: link after link until one writes the record, or fails."""
    command = [sys.executable, str(TRAIN_SCRIPT), *link_flags(args), *train_flags]
    checkpoint = args.run_dir / "checkpoint.pt"
    for link in range(1, args.max_links + 1):
        before, saved = len(load_records(args.results_dir).records), saved_at(checkpoint)
        print(f"== chain link {link}: {' '.join(command[1:])}", flush=True)
        # What the link says when it stops: its --step-budget hands over to the next link; a signal (kill, a job's
        # end: SIGTERM, SIGUSR1) reaches the link too, which saves and stops, and so does the chain.
        stopped = f"the chain stops here, link {link + 1} is not started; the same 03_chain.py command goes on from it"
        env = {**os.environ, "HPC_DL_LABS_TRAIN_AGAIN": "give 03_chain.py another --run-dir to train again",
               "HPC_DL_LABS_ON_STOP": (f"link {link + 1} of the chain resumes from it" if link < args.max_links
                                       else f"this is the chain's last link (--max-links {args.max_links})"),
               "HPC_DL_LABS_ON_SIGTERM": stopped, "HPC_DL_LABS_ON_SIGUSR1": stopped}
        status, stopped_by = run_passing_signals_on(command, env)
        if stopped_by == "SIGINT":
            raise KeyboardInterrupt  # Ctrl-C: the link has saved and stopped
        if stopped_by:  # the link saved (its line says where), or was stopped before it could: no link follows
            print(f"== chain stopped at link {link} by {stopped_by}: link {link + 1} is not started; the same "
                  f"03_chain.py command goes on from {checkpoint}", flush=True)
            return status if status >= 0 else 128 - status  # as a shell reports a process a signal ended
        if status != 0:
            print(f"== chain broken at link {link}: the training exited with status {status}; no link follows")
            return status
        if len(load_records(args.results_dir).records) > before:
            print(f"== chain done: link {link} finished the run (its record is in {args.results_dir})")
            return 0
        if saved_at(checkpoint) == saved:  # no record, no save: the run had finished before (a chain run twice)
            print(f"== chain done: link {link} trained nothing, the run in {args.run_dir} had finished already (its "
                  f"record is in {args.results_dir}); give another --run-dir to train again")
            return 0
    print(f"== chain stopped: {args.max_links} links and the run is not finished")
    return 1


def saved_at(path: Path) -> int | None:
    """When ``path`` was last written (None: not yet)."""
    return path.stat().st_mtime_ns if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:cut])
    train_flags = argv[cut + 1:]
    if args.local and (args.time or args.site):  # a link here has no time limit (--step-budget ends it), no site
        raise UserError(f"{'--time' if args.time else '--site'} is a setting of the chain's jobs: --local ignores it "
                        "(--step-budget N ends a link)")
    args.site = args.site or "generic"
    args.run_dir = args.run_dir.resolve()
    args.results_dir = (args.results_dir or args.run_dir / "results").resolve()
    # The training's own parser reads its flags now: a typo is one line here, not a broken link 1.
    if check_training_flags(TRAIN_SCRIPT, train_flags, before=link_flags(args),
                            owned=("--checkpoint", "--resume", "--results-dir")):  # --checkpoint X or --checkpoint=X
        raise UserError("the chain sets --checkpoint, --resume and --results-dir itself: leave them out after --")
    if not args.local:
        find_site(args.site)  # a misspelt --site is one line before the run's folders are made
    args.results_dir.mkdir(parents=True, exist_ok=True)
    if args.local:
        return run_links_here(args, train_flags)
    submit_chain(args, train_flags)
    return 0


if __name__ == "__main__":
    run_main(main)
