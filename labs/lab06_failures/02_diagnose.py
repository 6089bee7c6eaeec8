#!/usr/bin/env python3
"""Lab-06 step 2: the hang doctor — every rank's stack and last collective, and one verdict line.

Usage:
    python labs/lab06_failures/02_diagnose.py --run-dir checkpoints/lab06_run       # the ranks on this node
    python labs/lab06_failures/02_diagnose.py --pid 12345    # a torchrun (or any process of the job)
    python labs/lab06_failures/02_diagnose.py --job 4242 --run-dir checkpoints/lab06_run   # every node of a job
    srun --overlap --jobid 4242 --ntasks-per-node=1 python labs/lab06_failures/02_diagnose.py --run-dir DIR --json

What it teaches: a hung job is diagnosed from outside, without stopping it. For every rank the
doctor asks ``py-spy dump`` where the main thread is (py-spy reads the process's memory through
ptrace; where ptrace is not allowed it falls back to the ``faulthandler`` dump that ``01_inject.py``
writes on SIGUSR2), and reads the rank's last collective from the run's ledger (and, after a
timeout, the flight recorder's dump, which ``01_inject.py`` turns on for NCCL and Gloo through
``common.runtime.compat``). The verdict comes from the ledger, which every rank
writes before entering a collective, so the same hang gives the same verdict every time; the
stacks say why a rank is behind (asleep, in its data loader, dead). With ``--job`` the doctor runs
itself on every node of a Slurm job through ``srun --overlap`` and merges what they saw.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from common.cli import add_run_args, config_dict, input_dir, positive_int, script_parser
from common.errors import UserError, run_main
from common.results import make_record, provenance, write_record
from labs.lab06_failures.lab06_shared import (
    LAB, after_the_end, diagnose, ranks_from_ledger, ranks_of_job, read_history, read_ledger, read_meta,
    run_dir_of, table)

SCRIPT = "labs/lab06_failures/02_diagnose.py"
#: Frames that mean "inside a collective" (torch.distributed's Python functions).
COLLECTIVE_FRAMES = re.compile(r"^\s*(all_reduce|all_gather\w*|reduce_scatter\w*|broadcast|barrier|monitored_barrier|"
                               r"send|recv|wait) \(.*torch/distributed/")


def stack_of(pid: int, rank: int, run_dir: Path | None) -> tuple[str, str]:
    """(main thread's frames, innermost first; how they were read): py-spy, else faulthandler on SIGUSR2."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    why = "py-spy failed"
    for _ in range(3):  # a dump now and then shows the main thread without frames: look again
        try:
            result = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as error:
            why = str(error)
            break
        if result.returncode != 0:
            why = (result.stderr.strip().splitlines() or [why])[-1]
            break
        frames = main_thread(result.stdout)
        if frames:
            return frames, "py-spy"
        why = "no frames for the main thread in " + " | ".join(result.stdout.strip().splitlines()[-3:])[:200]
        time.sleep(0.2)
    if run_dir is None:
        return "", f"no stack ({why})"
    dump = run_dir / "ledger" / f"stack-rank{rank}.txt"
    before = dump.stat().st_size if dump.exists() else 0
    os.kill(pid, signal.SIGUSR2)  # 01_inject.py registered faulthandler for it
    for _ in range(50):
        time.sleep(0.1)
        if dump.exists() and dump.stat().st_size > before:
            text = dump.read_text(errors="replace")[before:]
            frames = [line.strip() for line in text.split("Current thread")[-1].splitlines()[1:] if line.strip()]
            return "\n".join(frames), f"faulthandler (py-spy: {why})"
    return "", f"no stack (py-spy: {why}; no faulthandler dump)"


def main_thread(dump: str) -> str:
    """The frames of the main thread in ``py-spy dump``'s output."""
    block = re.split(r"\nThread \d+ ", dump)
    main = next((b for b in block if '"MainThread"' in b.splitlines()[0]), block[-1] if block else "")
    return "\n".join(line.strip() for line in main.splitlines()[1:] if line.strip())


def where(frames: str) -> str:
    """A few words for the table: the collective the rank waits in, its DataLoader, or the line of the
    script it is on (py-spy names a script's own frames, and the top-level modules of the standard
    library, by file name alone; packages by their path)."""
    lines = frames.splitlines()
    files = [line.rsplit(" (", 1)[-1].split(":")[0] for line in lines]
    own = [line for line, file in zip(lines, files)
           if "/" not in file and file.removesuffix(".py") not in sys.stdlib_module_names]
    caller = own[0].split(" (")[0] if own else "?"
    for line in lines:
        match = COLLECTIVE_FRAMES.match(line)
        if match:
            return f"in {match.group(1)} <- {caller}"
    if any("torch/utils/data/" in line for line in lines):
        return f"waiting for its DataLoader <- {caller}"
    return f"at {own[0]}" if own else (lines[0] if lines else "?")


def flight_recorder(run_dir: Path | None) -> dict[int, str]:
    """Each rank's last collectives from the flight recorder's dumps (written by 01 after an error)."""
    last = {}
    for path in sorted(run_dir.glob("ledger/fr-rank*.json")) if run_dir else []:
        entries = json.loads(path.read_text()).get("entries", [])[-3:]
        last[int(path.stem.removeprefix("fr-rank"))] = ", ".join(
            f"#{e['collective_seq_id']} {e['profiling_name']} {e['input_sizes']} {e['state']}" for e in entries)
    for path in sorted(run_dir.glob("ledger/nccl-watchdog-rank[0-9]*")) if run_dir else []:  # NCCL's, on a timeout
        last.setdefault(int(path.name[18:]), f"NCCL's watchdog dump {path.name} ({path.stat().st_size} B, pickled)")
    return last


def look(args) -> dict:
    """What this node sees: every local rank's stack and ledger entry."""
    pids = ranks_of_job(args.pid) if args.pid else ranks_from_ledger(args.run_dir)
    stacks, how = {}, {}
    for rank, pid in sorted(pids.items()):
        frames, how[rank] = stack_of(pid, rank, args.run_dir)
        stacks[rank] = where(frames)
    return {"host": socket.gethostname(), "pids": pids, "stacks": stacks, "how": how}


def on_every_node(args) -> list[dict]:
    """Run this script with ``--json`` on every node of the job, beside its tasks (``srun --overlap``)."""
    if not shutil.which("srun"):
        raise UserError("--job needs Slurm's srun on this machine")
    command = ["srun", "--overlap", f"--jobid={args.job}", "--ntasks-per-node=1", sys.executable,
               str(Path(__file__).resolve()), "--json", "--run-dir", str(args.run_dir)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    views = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    if not views:
        said = [line.strip() for line in result.stderr.splitlines() if line.strip()][-2:]  # srun's last words, one line
        raise UserError(f"srun --overlap --jobid={args.job} gave nothing back: {' | '.join(said) or 'no output'}")
    return views


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.run_dir is None and args.pid is None:
        raise UserError("say which job: --run-dir (the run's folder), --pid (its torchrun) or --job with --run-dir")
    if args.run_dir is None and args.pid is not None:  # the run folder of the ranks under that process
        ranks = ranks_of_job(args.pid)
        if not ranks:
            raise UserError(f"no rank of a torchrun or srun job under process {args.pid}")
        args.run_dir = run_dir_of(min(ranks.values()))
    if args.run_dir is not None and not (args.run_dir / "ledger").is_dir():
        raise UserError(f"{args.run_dir} has no ledger: is it the --run-dir of 01_inject.py?")
    if args.json:  # one node's view, for the node that asked (--job)
        print(json.dumps(look(args)))
        return 0
    views = on_every_node(args) if args.job else [look(args)]
    stacks = {int(r): s for view in views for r, s in view["stacks"].items()}
    how = {int(r): h for view in views for r, h in view["how"].items()}
    meta = read_meta(args.run_dir) if args.run_dir else None
    if meta is None:
        raise UserError("no run.json in the run folder: the verdict needs the run's world size and steps")
    ledger = {rank: entry for rank, entry in read_ledger(args.run_dir).items()  # not a wider run's leftovers
              if rank < meta["world_size"]}
    verdict = diagnose(ledger, meta["world_size"], meta["steps"], meta["gradient_numel"], stacks,
                       read_history(args.run_dir))
    line = verdict.line if stacks else after_the_end(ledger, meta["world_size"], verdict.line)
    recorder = flight_recorder(args.run_dir)
    for row in verdict.rows:
        row["flight recorder"] = recorder.get(row["rank"], "")
    print(f"looked at {len(stacks)} rank(s) on {', '.join(v['host'] for v in views)}: "
          f"{', '.join(sorted(set(how.values()))) or 'no live rank'}")
    print(table(verdict.rows))
    print(f"verdict: {line}")
    record = make_record(lab=LAB, script=SCRIPT, method="diagnosis", config=config_dict(args),
                         metrics={"verdict": line, "culprits": verdict.ranks, "step": verdict.step,
                                  "ranks": verdict.rows, "stack_source": how, "run": meta},
                         provenance=provenance(None, meta["world_size"]))
    write_record(record, args.results_dir)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    group = parser.add_argument_group("which job")
    group.add_argument("--run-dir", type=input_dir, default=None,
                       help="the --run-dir of 01_inject.py: its ledger and run.json (default: none)")
    group.add_argument("--pid", type=positive_int, default=None,
                       help="a process of the job on this node, e.g. its torchrun (default: from the ledger)")
    group.add_argument("--job", type=positive_int, default=None,
                       help="a Slurm job id: look on every node through srun --overlap (default: this node)")
    group.add_argument("--json", action="store_true", help="print this node's view as JSON, for --job (default: off)")
    add_run_args(parser, seed=None, dry_run=None, device=False)  # it reads files and stacks
    return parser


if __name__ == "__main__":
    run_main(main)
