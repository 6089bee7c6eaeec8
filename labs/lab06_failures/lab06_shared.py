"""What Lab-06's scripts share: the faults, the rule that a fault fires once, the per-rank ledger of
collectives, and the verdict that names the rank that is behind or called something else.

The lessons stay in the scripts (``01_inject.py`` trains and misbehaves, ``02_diagnose.py`` looks at a
stuck job, ``04_preflight.py`` checks an allocation); this module holds the bookkeeping, so that each
piece is unit-tested on its own (``tests/test_lab06.py``). Nothing here imports torch at import time.

The ledger is a poor man's flight recorder: before every collective, each rank writes one small
file, ``RUN_DIR/ledger/rank<R>.json``, saying which collective it is about to enter, at which step,
with how many elements. PyTorch's flight recorder (``common.runtime.compat``) keeps the same
facts inside the process; the ledger keeps them on disk, so they survive a rank that died and can be
read by another program while the ranks hang.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import shutil
import signal
import socket
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, TextIO

from common.cli import (add_collective_timeout_arg, add_log_interval_arg, add_lr_arg, add_run_args, add_steps_arg,
                        non_negative_int, output_dir, positive_int, worker_count)
from common.errors import UserError

LAB = "lab06"

#: Every fault ``01_inject.py`` can inject, with what rank R does at step S.
FAULTS: dict[str, str] = {
    "none": "nothing: the uninterrupted run the others are compared with",
    "skip-collective": "R skips the gradient all-reduce and leaves the loop (as a rank whose data ran out): a hang",
    "shape-mismatch": "R all-reduces one element more than the others: a desync",
    "slow-rank": "R sleeps longer than the collective timeout before its all-reduce",
    "crash-rank": "R exits with an error (status 1) before its all-reduce",
    "nan-loss": "R's loss becomes NaN",
    "stuck-loader": "R's DataLoader worker blocks while making the batch of step S",
    "oom": "R allocates more GPU memory than there is (CUDA only)",
}
#: What the ledger calls the collectives of ``01_inject.py``, in the order a step reaches them.
GRADIENTS = "all_reduce(gradients)"
END_OF_RUN = "barrier(end of run)"
#: The marker a fault leaves in the run folder when it fires: a restarted run finds it and goes on.
FIRED_MARKER = "fault-fired"
#: Written by rank 0 at the start: what the doctor needs to know about the run.
RUN_META = "run.json"
#: 01's checkpoint in the run folder (model, optimiser, step), written by rank 0 every --checkpoint-every steps.
CHECKPOINT = "checkpoint.pt"
#: Where 01 keeps checkpoint, marker and ledger unless told (with the checkpoints, out of the results folder).
DEFAULT_RUN_DIR = Path("checkpoints/lab06_run")


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times this job was restarted: torchrun's ``--max-restarts`` or Slurm's requeue."""
    env = os.environ if env is None else env
    counts = [env.get("TORCHELASTIC_RESTART_COUNT", "0"), env.get("SLURM_RESTART_COUNT", "0")]
    return max(int(c) if c.isdigit() else 0 for c in counts)


@dataclass(frozen=True)
class FaultPlan:
    """Rank ``rank`` misbehaves with ``fault`` at step ``step``, once per run folder."""

    fault: str
    rank: int
    step: int
    run_dir: Path

    def check(self, world_size: int, steps: int, cuda: bool, num_workers: int = 1) -> None:
        """One error line for a plan that cannot happen (before anything is written), or whose hang nothing would
        end: a stuck loader on one process (no other rank times out) or without a worker (the rank itself blocks)."""
        if self.fault not in FAULTS:
            raise UserError(f"unknown fault {self.fault!r}; faults: {', '.join(FAULTS)}")
        if self.fault == "none":  # --rank and --step mean nothing without a fault
            return
        if self.rank >= world_size:
            raise UserError(f"--rank {self.rank} does not exist: the run has {world_size} rank(s), 0 to "
                            f"{world_size - 1}")
        if self.step > steps:
            raise UserError(f"--step {self.step} is past the run: it takes {steps} step(s)")
        if self.fault == "stuck-loader" and (world_size < 2 or num_workers < 1):
            raise UserError("--fault stuck-loader needs --num-workers 1 or more (the worker is what blocks) and two "
                            "or more processes (the others time out and end the run): here it would hang for ever")
        if self.fault == "oom" and not cuda:
            raise UserError("--fault oom needs a GPU: on a CPU running out of memory means the kernel's OOM "
                            "killer, not an error PyTorch can report")

    def fires(self, rank: int, step: int, fault: str) -> bool:
        """True once: the first time rank and step match in a run that was never restarted.

        The marker is created with ``O_EXCL``: if two processes ask (a DataLoader worker and its
        parent), one of them gets it.
        """
        if fault != self.fault or rank != self.rank or step != self.step or restart_count() > 0:
            return False
        try:
            os.close(os.open(self.run_dir / FIRED_MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True


def block_until_parent_dies() -> None:
    """The stuck DataLoader worker: blocks, but ends when the rank that started it is gone, so a
    stopped job leaves no orphan behind (a worker blocked in a plain ``sleep`` would outlive it)."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)


# --------------------------------------------------------------------------------------------
# The ledger

class Ledger:
    """This rank's last collective, one small JSON file per rank, replaced before each collective."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.folder = Path(run_dir) / "ledger"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / f"rank{rank}.json"
        self.rank = rank
        self.sequence = 0

    def enter(self, op: str, step: int, numel: int, *, left_early: bool = False) -> None:
        """``left_early``: the end-of-run barrier of a rank that left the loop before step ``step``'s
        all-reduce (at the last step its step alone cannot tell it from a rank that finished)."""
        self.sequence += 1
        entry = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "op": op, "step": step,
                 "numel": numel,
                 "sequence": self.sequence, "time": time.time()}
        if left_early:
            entry["left_early"] = True
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, self.path)  # a reader never sees half a file
        with open(self.path.with_suffix(".jsonl"), "a") as history:  # every entry: a desync may be steps back
            history.write(json.dumps(entry) + "\n")

    def dump_stacks_on_sigusr2(self) -> TextIO:
        """On SIGUSR2, write every thread's stack into ``stack-rank<R>.txt`` beside the ledger (``faulthandler``):
        what the doctor reads where ptrace, and so py-spy, is not allowed. Returns the open file."""
        stacks = open(self.folder / f"stack-rank{self.rank}.txt", "w")
        faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True)
        return stacks


def timeout_fired(ledger: Mapping[int, Mapping[str, Any]], rank: int, message: str,
                  timeout_s: float, verdict: Verdict | None = None) -> tuple[dict[str, Any], str]:
    """Did the collective timeout end the run? ``ledger`` holds each rank's last entry, written just before
    it entered its last collective; ``rank`` is this rank. The ranks ``verdict`` finds behind (at a step before
    its step: slow, or stuck in their loader) are not counted as waiting: their last entry is a collective they
    left long ago (a rank that skipped a collective does wait, in the end-of-run barrier). The timeout fired
    when the error says so, or when some rank has waited as long as the timeout: the first rank to time out
    closes its connections, and a peer still waiting sees only "Connection closed by peer", a moment before its
    own timeout would have fired. Returns the record's fields (``timeout_fired_s``: the timeout when it fired,
    else None; ``waited_s``: this rank's wait) and what the diagnosis line adds when it fired."""
    now = time.time()
    culprits, step = (verdict.ranks, verdict.step or 0) if verdict else ([], 0)
    behind = [r for r in culprits if r in ledger and int(ledger[r]["step"]) < step]
    waits = {r: now - entry["time"] for r, entry in ledger.items() if "time" in entry and r not in behind}
    longest = max(waits, key=waits.get, default=rank)
    fired = "timed out" in message.lower() or waits.get(longest, 0.0) >= timeout_s
    why = (f" [the {timeout_s:g} s collective timeout fired: rank {longest} waited {waits.get(longest, 0.0):.1f} s; "
           "--collective-timeout SECONDS changes it]") if fired else ""
    return {"timeout_fired_s": timeout_s if fired else None, "waited_s": waits.get(rank, 0.0)}, why


def dump_flight_recorder(run_dir: Path, rank: int, backend: str | None) -> Path | None:
    """Write this rank's flight recorder (its last collectives, kept by PyTorch when the recorder was
    enabled before the group started: ``common.runtime.compat.enable_flight_recorder``) beside the
    ledger; ``None`` where this PyTorch has no recorder for ``backend``."""
    from common.runtime.compat import dump_flight_recorder as dump  # imports torch: only where a rank dumps

    dumped = dump(backend)
    if dumped is None:
        return None
    path = Path(run_dir) / "ledger" / f"fr-rank{rank}.json"
    path.write_bytes(dumped[0])
    return path


def after_the_end(ledger: dict[int, dict[str, Any]], world_size: int, line: str) -> str:
    """The verdict when no rank is alive: the run has ended, and its ledger says only where each rank last was."""
    if len(ledger) == world_size and all(entry.get("op") == END_OF_RUN for entry in ledger.values()):
        return f"no rank is alive, and all {world_size} reached the end of the run: it finished; nothing hangs"
    return f"no rank is alive: the run has ended; where its ledger left the ranks: {line}"


def read_ledger(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Every rank's last ledger entry, by rank (ranks that never entered a collective are absent)."""
    entries = {}
    for path in sorted((Path(run_dir) / "ledger").glob("rank*.json")):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        entries[int(entry["rank"])] = entry
    return entries


def read_history(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Every ledger entry of every rank, oldest first."""
    history: dict[int, list[dict[str, Any]]] = {}
    for path in sorted((Path(run_dir) / "ledger").glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:  # a line cut short by a crash
                continue
            history.setdefault(int(entry["rank"]), []).append(entry)
    return history


def read_meta(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / RUN_META
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# Finding a job's ranks on this node (02_diagnose.py), from /proc

def ranks_of_job(pid: int) -> dict[int, int]:
    """Rank -> pid for the processes under ``pid`` (a torchrun agent, or a rank itself) that carry ``RANK``."""
    found, todo = {}, [pid]
    while todo:
        current = todo.pop()
        env = _environ(current)
        if "RANK" in env and "WORLD_SIZE" in env and "python" in _cmdline(current):
            found.setdefault(int(env["RANK"]), current)
            continue  # its children are DataLoader workers, not ranks
        todo += _children(current)
    return found


def run_dir_of(pid: int) -> Path:
    """The ``--run-dir`` a rank was started with (relative to its working folder), or the default."""
    argv = _cmdline(pid).split()
    given = argv[argv.index("--run-dir") + 1] if "--run-dir" in argv[:-1] else DEFAULT_RUN_DIR
    return Path(f"/proc/{pid}/cwd").resolve() / given


def ranks_from_ledger(run_dir: Path) -> dict[int, int]:
    """Rank -> pid from the ledger, for the ranks that run on this host and are still alive."""
    host = socket.gethostname()
    return {rank: int(entry["pid"]) for rank, entry in read_ledger(run_dir).items()
            if entry.get("host", host) == host and Path(f"/proc/{entry['pid']}").exists()}


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return children


# --------------------------------------------------------------------------------------------
# The verdict

@dataclass
class Verdict:
    """One line that names the rank(s) at fault, and the table it was decided from."""

    line: str
    ranks: list[int]
    step: int | None
    rows: list[dict[str, Any]]


def _position(entry: Mapping[str, Any]) -> tuple[int, int]:
    """How far a rank got: its step, then where in the step (the end-of-run barrier comes last)."""
    return int(entry["step"]), 1 if entry["op"] == END_OF_RUN else 0


def diagnose(entries: Mapping[int, Mapping[str, Any]], world_size: int, steps: int, gradient_numel: int,
             stacks: Mapping[int, str] | None = None,
             history: Mapping[int, list[Mapping[str, Any]]] | None = None) -> Verdict:
    """Name the rank(s) that are behind or called something different, from the ledger alone.

    Deterministic, so the same hang gives the same verdict every time:

    1. a rank with no entry never reached a collective;
    2. a rank at the end-of-run barrier before the last step (or marked ``left_early``) left the loop
       early, skipping the all-reduce the others wait in;
    3. a rank whose step is lower than the furthest rank's has not reached that collective yet (slow,
       stuck in its data loader, or dead: the stacks say which);
    4. ranks in the same collective with another element count than the gradients' are a desync.

    ``stacks``: what each rank's main thread was doing (from ``py-spy``), shown in the table.
    ``history``: every rank's earlier entries; a gradient all-reduce of another size found there comes
    first (a mismatched all-reduce can complete on one rank, which then moves on and looks ahead).
    """
    stacks = stacks or {}
    rows = []
    for rank in range(world_size):
        entry = entries.get(rank)
        rows.append({"rank": rank, "step": entry["step"] if entry else None,
                     "collective": entry["op"] if entry else None,
                     "elements": entry["numel"] if entry else None, "where": stacks.get(rank, "")})
    earlier = [e for past in (history or {}).values() for e in past
               if e["op"] == GRADIENTS and int(e["numel"]) != gradient_numel]
    if earlier:
        step = min(int(e["step"]) for e in earlier)
        odd = sorted({int(e["rank"]) for e in earlier if int(e["step"]) == step})
        sizes = ", ".join(f"rank {e['rank']}: {e['numel']}" for e in earlier if int(e["step"]) == step)
        return Verdict(f"rank(s) {_names(odd)} called {GRADIENTS} at step {step} with another shape ({sizes} "
                       f"elements, the gradients have {gradient_numel}): a desync", odd, step, rows)
    missing = [rank for rank in range(world_size) if rank not in entries]
    if missing:
        return Verdict(f"rank(s) {_names(missing)} never entered a collective: they died or hang before the first "
                       "step", missing, None, rows)
    early = [r for r, e in entries.items()
             if e["op"] == END_OF_RUN and (int(e["step"]) < steps or e.get("left_early"))]
    if early:
        step = min(int(entries[r]["step"]) for r in early)
        return Verdict(f"rank(s) {_names(early)} skipped the {GRADIENTS} of step {step} and left the loop; "
                       f"the others wait in it", early, step, rows)
    furthest = max(_position(e) for e in entries.values())
    behind = sorted(r for r, e in entries.items() if _position(e) < furthest)
    if behind:
        step = furthest[0]
        waited_in = END_OF_RUN if furthest[1] else GRADIENTS  # the others finished: they wait at the end
        last = ", ".join(f"rank {r} at step {entries[r]['step']}" for r in behind)
        return Verdict(f"rank(s) {_names(behind)} behind: not yet in the {waited_in} of step {step} that the "
                       f"others wait in (last collective: {last})", behind, step, rows)
    odd = sorted(r for r, e in entries.items() if e["op"] == GRADIENTS and int(e["numel"]) != gradient_numel)
    if odd:
        step = int(entries[odd[0]]["step"])
        sizes = ", ".join(f"rank {r}: {entries[r]['numel']}" for r in odd)
        return Verdict(f"rank(s) {_names(odd)} called {GRADIENTS} at step {step} with another shape ({sizes} "
                       f"elements, the gradients have {gradient_numel}): a desync", odd, step, rows)
    ops = Counter((e["op"], int(e["step"])) for e in entries.values())
    (op, step), _ = ops.most_common(1)[0]
    return Verdict(f"no rank is behind: all {world_size} wait in {op} at step {step}; look outside the program "
                   "(network, a node, the collective timeout)", [], step, rows)


def _names(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def table(rows: list[dict[str, Any]]) -> str:
    """The verdict's table as aligned text."""
    header = list(rows[0]) if rows else ["rank"]
    cells = [header] + [["-" if row[k] is None else str(row[k]) for k in header] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in cells)


# --------------------------------------------------------------------------------------------
# 01_inject.py's flags, its run folder and its record

INJECT_SCRIPT = "labs/lab06_failures/01_inject.py"
#: Every fault here ends, diagnosed, within a minute and a half (not the group's usual 600 s), with time
#: to look at a live hang (02_diagnose.py); it starts once every rank is in (common.runtime.distributed).
COLLECTIVE_TIMEOUT_S = 30.0


def add_inject_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``01_inject.py``: the fault, the run, then ``common.cli.add_run_args``."""
    group = parser.add_argument_group("the fault")
    group.add_argument("--fault", choices=FAULTS, default="none",
                       help="; ".join(f"{name}: {what}" for name, what in FAULTS.items()) + " (default: %(default)s)")
    group.add_argument("--rank", type=non_negative_int, default=1,
                       help="the rank that misbehaves (default: %(default)s)")
    group.add_argument("--step", type=positive_int, default=3, help="the step at which it does (default: %(default)s)")
    add_collective_timeout_arg(group, default=COLLECTIVE_TIMEOUT_S)
    group = parser.add_argument_group("the run")
    add_steps_arg(group, default=10)
    group.add_argument("--batch-size", type=positive_int, default=16,
                       help="images per rank and step (default: %(default)s)")
    group.add_argument("--width", type=positive_int, default=4,
                       help="channels of the CNN's first layer (default: %(default)s)")
    add_lr_arg(group, default=0.05, optimizer="SGD (momentum 0.9)")
    group.add_argument("--num-workers", type=worker_count, default=1,
                       help="DataLoader worker processes; stuck-loader needs one (default: %(default)s)")
    add_log_interval_arg(group, default=5)
    group.add_argument("--checkpoint-every", type=positive_int, default=5,
                       help="rank 0 saves model and optimiser every this many steps (default: %(default)s)")
    group.add_argument("--run-dir", type=output_dir, default=DEFAULT_RUN_DIR,
                       help="checkpoint, fault marker and ledger; a restarted run resumes from it "
                            "(default: %(default)s)")
    group.add_argument("--resume", action="store_true",
                       help="resume from --run-dir even when not restarted by torchrun or Slurm (default: off)")
    add_run_args(parser, dry_run="at most four steps: checks that everything runs")
    return parser


def start_afresh(run_dir: Path) -> None:
    """A fresh run (not a restart, not ``--resume``): no stale fault marker, ledger, run facts or checkpoint."""
    shutil.rmtree(Path(run_dir) / "ledger", ignore_errors=True)
    for name in (FIRED_MARKER, RUN_META, CHECKPOINT):
        (Path(run_dir) / name).unlink(missing_ok=True)


def check_resumable(state: dict[str, Any] | None, args: argparse.Namespace, path: Path) -> dict[str, Any] | None:
    """``state`` (``None``: no checkpoint yet) if 01_inject.py can resume from it: the same model and data (else
    load_state_dict's traceback, or another run silently), and steps left before ``--steps`` (else a run that
    trains nothing); one line if not."""
    from common.checkpoint.single_file import check_same_settings, check_steps_left  # torch: not for the doctor

    if state is None:
        return None
    check_same_settings(state, {key: getattr(args, key) for key in ("width", "batch_size", "lr", "seed")}, path)
    check_steps_left(state["step"], args.steps, path)
    return state


def nan_stop(step: int, ranks: list[int], start: int, checkpoint_every: int) -> tuple[dict[str, Any], str]:
    """Where a run that met a not-finite loss at ``step`` stands: the record's ``nan_stop`` and rank 0's line. The last
    good checkpoint is the newest save before ``step`` (rank 0 saves every ``checkpoint_every`` steps), or the one
    this run resumed from (``start``); 0: none yet, and a restart starts from step 1."""
    good = max(start, (step - 1) // checkpoint_every * checkpoint_every)
    line = (f"step {step}: loss not finite on rank(s) {ranks}; every rank stops at this step; "
            + (f"last good checkpoint: step {good}" if good else "no checkpoint yet: a restart starts from step 1"))
    return {"step": step, "ranks": ranks, "checkpoint_step": good}, line


def write_run_meta(args: argparse.Namespace, ctx: Any, gradient_numel: int) -> None:
    """Rank 0 writes what the doctor (and a rank that times out) needs to know about the run (:data:`RUN_META`);
    then the run's first line (rank 0)."""
    if ctx.rank == 0:
        meta = {"world_size": ctx.world_size, "steps": args.steps, "gradient_numel": gradient_numel,
                "fault": args.fault, "rank": args.rank, "step": args.step,
                "collective_timeout": args.collective_timeout}
        (Path(args.run_dir) / RUN_META).write_text(json.dumps(meta))
        fault = "no fault" if args.fault == "none" else f"fault {args.fault} on rank {args.rank} at step {args.step}"
        # A restarted run, or one resumed after the fault fired, trains on without it (FaultPlan.fires).
        spent = (f"this is restart {restart_count()}" if restart_count() else
                 "it fired already in this run folder" if (Path(args.run_dir) / FIRED_MARKER).exists() else "")
        fault += f" (not again: {spent})" if spent and args.fault != "none" else ""
        print(f"{ctx.line(distributed=True)} | {fault} | {gradient_numel} elements all-reduced per step | "
              f"run folder {args.run_dir}", flush=True)
        print(f"a collective that waits {args.collective_timeout:g} s for the other ranks fails (--collective-timeout)",
              flush=True)


def write_inject_record(args: argparse.Namespace, ctx: Any, status: str, step: int, loss: float, wall: float | None,
                        extra: dict[str, Any], ledger: list[dict[str, Any]] | None = None) -> None:
    """One record of a run of ``01_inject.py`` (method ``uninterrupted`` or the fault's name), written by rank 0,
    or by the rank that diagnosed a failure (``"diagnosis"`` in ``extra``); the others write nothing."""
    if ctx.rank != 0 and "diagnosis" not in extra:
        return
    from common.cli import config_dict
    from common.results import make_record, provenance, write_record

    metrics = {"final_loss": loss, "steps_done": step, "restarts": restart_count(), "wall_s": wall,
               **extra, **({"ledger": ledger} if ledger is not None else {})}
    method = "uninterrupted" if args.fault == "none" else args.fault
    record = make_record(lab=LAB, script=INJECT_SCRIPT, method=method, config=config_dict(args), metrics=metrics,
                         status=status, provenance=provenance(ctx.device, ctx.world_size,
                                                              {"distributed": ctx.describe()}))
    write_record(record, args.results_dir)


# --------------------------------------------------------------------------------------------
# Preflight (04_preflight.py)

def check_ids(reports: list[dict[str, Any]], launcher: str) -> list[str]:
    """What is wrong with the tasks' identities: Slurm's ids against the launch's, and the nodes'
    local ranks (one task per local rank on every host; one node id per host)."""
    problems = []
    seen = [r for r in reports if not r.get("unreached")]
    for r in seen:
        slurm = r.get("slurm") or {}
        if launcher == "slurm":
            expected = {"PROCID": r["rank"], "LOCALID": r["local_rank"], "NODEID": r["node"]}
            wrong = [f"SLURM_{k}={slurm.get(k)} (launch: {v})" for k, v in expected.items() if slurm.get(k) != str(v)]
            if wrong:
                problems.append(f"rank {r['rank']} on {r['host']}: {', '.join(wrong)}")
    by_host: dict[str, list[dict[str, Any]]] = {}
    for r in seen:
        by_host.setdefault(r["host"], []).append(r)
    for host, tasks in sorted(by_host.items()):
        locals_ = sorted(t["local_rank"] for t in tasks)
        if locals_ != list(range(len(tasks))):
            problems.append(f"{host}: local ranks {locals_}, expected 0 to {len(tasks) - 1}")
        if len({t["node"] for t in tasks}) > 1:
            problems.append(f"{host}: tasks disagree on the node id ({sorted({t['node'] for t in tasks})})")
    return problems


NCCL_VIA = re.compile(r"via (P2P/\S+|SHM\S*|NET/\S+|CollNet\S*)")


def transports_in(nccl_log: str) -> list[str]:
    """The transports NCCL names in ``NCCL_DEBUG=INFO`` lines (``... via P2P/CUMEM``, ``via NET/IB/0``)."""
    return sorted(set(NCCL_VIA.findall(nccl_log)))


def nccl_transport(device: str, world_size: int) -> str:
    """Which transport NCCL picks between this job's tasks: one all-reduce with ``NCCL_DEBUG=INFO``
    written to a file per process, read back. Every task must call it (it is a collective)."""
    import tempfile

    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return "not applicable: Gloo on CPU"
    if world_size == 1:
        return "not applicable: one task, nothing to connect"
    from common.runtime.distributed import init_distributed, teardown_distributed

    folder = Path(tempfile.mkdtemp(prefix="nccl-"))
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,GRAPH,NET", NCCL_DEBUG_FILE=str(folder / "nccl.%p"))
    ctx = init_distributed("cuda")
    try:
        value = torch.ones(1, device=ctx.device)
        torch.distributed.all_reduce(value)
        torch.cuda.synchronize()
    finally:
        teardown_distributed(ctx)
    found = transports_in("".join(p.read_text(errors="replace") for p in folder.glob("nccl.*")))
    return ", ".join(found) or "not reported (NCCL printed no 'via' line)"
