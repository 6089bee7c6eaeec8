"""What Lab-09's scripts share: the sweep file and its tasks, the sweep folder, one task's run, and what
Slurm (``sacct``, ``squeue``, ``scontrol``) and the records say about each task and what it cost.

No torch here: the status command answers in a second, and the array tasks start the training as a
fresh process (each task's training imports torch itself).

The sweep folder (``--sweep-dir``) holds everything of one sweep, and each task writes only into its
own ``tasks/NNN/`` (its record, checkpoint, TensorBoard curves, attempts), so no two tasks collide::

    plan.yaml            the sweep file as read, its id, and every task's flags (written once)
    sweep.toml|yaml      a copy of the sweep file: what the array's tasks read
    submissions.jsonl    one line per submission: how (sbatch-array, resubmit, submitit, local), job id, tasks
    sweep_array.sbatch   the rendered array job (resubmissions submit it again)
    logs/                the jobs' logs (%A_%a.out)
    tasks/003/           task 3: its record, checkpoint.pt, tensorboard/, attempts.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NoReturn, Sequence

import yaml

from common.atomic import write_text_atomic
from common.cli import flags_given
from common.errors import Stopped, UserError, sigterm_deferred
from common.results import load_records, make_record, provenance, write_record
from common.slurm.jobs import PLACEHOLDER
from common.slurm.sites import time_to_seconds

REPO_ROOT = Path(__file__).resolve().parents[2]
LAB_DIR = Path(__file__).resolve().parent
ARRAY_TEMPLATE = LAB_DIR / "sbatch" / "sweep_array.sbatch.j2"
#: The keys a sweep file may have (see sweeps/tiny.toml for each one's meaning).
SWEEP_KEYS = {"script", "seed", "seeds", "fixed", "grid", "random", "faults"}
#: Flags each task sets itself, into its own folder: a sweep file must leave them out.
TASK_FLAGS = {"results-dir", "checkpoint", "resume", "tensorboard", "seed"}
#: States after which a Slurm job never runs again on its own (resubmission may run its task again).
ENDED = {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}
#: A task whose job COMPLETED without writing its record: stopped by a signal after saving its checkpoint.
UNFINISHED = "UNFINISHED"
ENDED.add(UNFINISHED)
#: The ended states that resubmission retries (a COMPLETED task is done).
RETRY = ENDED - {"COMPLETED"}
#: A task of a sweep run here (--local) that has not started: the same command runs it.
NOT_RUN = "NOT RUN"


# ---------------------------------------------------------------------------------------------
# The sweep file and its tasks

def slurm_time(text: str) -> str:
    """argparse type of ``--time``: one of Slurm's formats (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS),
    checked as the flag is parsed: sbatch would refuse anything else only at the submission."""
    try:
        time_to_seconds(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a Slurm time: {text!r}; give minutes, MM:SS, HH:MM:SS, D-HH, "
                                         "D-HH:MM or D-HH:MM:SS (e.g. 30, 00:30:00, 1-12:00:00)") from None
    return text.strip()


def read_sweep_file(path: Path) -> dict[str, Any]:
    """A sweep file: YAML (``.yaml``/``.yml``) or TOML (``.toml``; ``tomli`` before Python 3.11)."""
    if not path.is_file():
        raise UserError(f"{path}: no such sweep file")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix in (".yaml", ".yml"):
            sweep = yaml.safe_load(text)
        elif path.suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - Python 3.10
                import tomli as tomllib
            sweep = tomllib.loads(text)
        else:
            raise UserError(f"{path}: a sweep file is .toml, .yaml or .yml, not {path.suffix or 'no suffix'}")
    except (yaml.YAMLError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{path}: not valid {path.suffix[1:].upper()}: {first}") from None
    if not isinstance(sweep, dict):
        raise UserError(f"{path}: a sweep file is a table of settings (script, grid, ...), not {type(sweep).__name__}")
    unknown = sorted(set(sweep) - SWEEP_KEYS)
    if unknown:
        raise UserError(f"{path}: unknown key(s) {', '.join(unknown)} "
                        f"(a sweep file has {', '.join(sorted(SWEEP_KEYS))})")
    if not isinstance(sweep.get("script"), str):
        raise UserError(f"{path}: 'script' must name the training script, "
                        "e.g. chapters/ch04_deep_learning/mnist_training.py")
    for key in ("fixed", "grid", "random", "faults"):
        if not isinstance(sweep.get(key, {}), dict):
            raise UserError(f"{path}: '{key}' must be a table of flag = value(s)")
    return sweep


@dataclass(frozen=True)
class Task:
    """One run of the sweep: its index (the array task id), its flags and its seed."""

    index: int
    flags: dict[str, Any]
    seed: int

    def argv(self) -> list[str]:
        """The training script's command line for this task (before the task's own folder flags)."""
        argv = []
        for name, value in self.flags.items():
            if value is True:
                argv.append(f"--{name}")
            elif value is not False and value is not None:
                argv += [f"--{name}", str(value)]
        return [*argv, "--seed", str(self.seed)]


def _draw(rng: random.Random, name: str, spec: Any, where: Path) -> Any:
    """One random value of ``spec``: a list (one of its values), ``{uniform = [lo, hi]}`` or
    ``{log-uniform = [lo, hi]}``."""
    if isinstance(spec, list) and spec:
        return rng.choice(spec)
    if isinstance(spec, dict) and len(spec) == 1:
        (kind, bounds), = spec.items()
        if kind in ("uniform", "log-uniform") and isinstance(bounds, list) and len(bounds) == 2 \
                and all(isinstance(b, (int, float)) and b > 0 for b in bounds) and bounds[0] < bounds[1]:
            low, high = bounds
            value = (rng.uniform(low, high) if kind == "uniform"
                     else math.exp(rng.uniform(math.log(low), math.log(high))))
            return float(f"{value:.4g}")
    raise UserError(f"{where}: random '{name}' must be a non-empty list, {{uniform = [low, high]}} or "
                    f"{{log-uniform = [low, high]}} with 0 < low < high, got {spec!r}")


def expand(sweep: Mapping[str, Any], where: Path) -> list[Task]:
    """Every task of the sweep, in a fixed order: each grid point (the product of the grid's lists, in
    the file's order) x each random draw (``samples`` of them, seeded) x each seed, over ``fixed``."""
    fixed, grid, randoms = dict(sweep.get("fixed", {})), dict(sweep.get("grid", {})), dict(sweep.get("random", {}))
    samples = randoms.pop("samples", 1 if randoms else 0)
    for section, names in (("fixed", fixed), ("grid", grid), ("random", randoms)):
        owned = sorted(TASK_FLAGS & set(names))
        if owned:
            raise UserError(f"{where}: [{section}] sets {', '.join(owned)}, which each task sets itself "
                            "(its own folder; seeds come from 'seeds')")
    for name, values in grid.items():
        if not isinstance(values, list) or not values:
            raise UserError(f"{where}: the grid's '{name}' has no values (give a list): the sweep would have no run")
        again = [value for at, value in enumerate(values) if value in values[:at]]
        if again:
            raise UserError(f"{where}: the grid's '{name}' lists {again[0]!r} more than once: those tasks would be "
                            "the same run twice")
    if not grid and not randoms:
        raise UserError(f"{where}: the grid is empty and there is no [random] table: the sweep would have no run")
    if not isinstance(samples, int) or samples < (1 if randoms else 0):
        raise UserError(f"{where}: random 'samples' must be a whole number of at least 1, got {samples!r}")
    if samples and not randoms:  # no flag to draw: `samples` copies of each grid point, every one alike
        raise UserError(f"{where}: [random] has samples = {samples} but no flag to draw: add one "
                        "(e.g. lr = {log-uniform = [0.1, 2.0]}) or leave out [random]")
    seed = sweep.get("seed", 1)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UserError(f"{where}: 'seed' must be a whole number, got {seed!r}")
    seeds = sweep.get("seeds", [seed])
    if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
        raise UserError(f"{where}: 'seeds' must be a non-empty list of whole numbers, got {seeds!r}")
    if len(set(seeds)) < len(seeds):
        raise UserError(f"{where}: 'seeds' lists a seed more than once ({seeds!r}): those tasks would be the same run "
                        "twice")
    rng = random.Random(seed)
    draws = [{name: _draw(rng, name, spec, where) for name, spec in randoms.items()} for _ in range(samples)] or [{}]
    points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    configs = [{**fixed, **point, **draw} for point in points for draw in draws]
    return [Task(index, config, run_seed) for index, (config, run_seed)
            in enumerate((config, run_seed) for config in configs for run_seed in seeds)]


def training_parser(script: Path, refuse: Callable[[str], NoReturn]) -> argparse.ArgumentParser:
    """The training script's own parser (its ``build_parser()``, the script loaded in this process: its ``main()``
    does not run, but it imports torch), whose errors go to ``refuse`` instead of exiting."""
    try:
        spec = importlib.util.spec_from_file_location("training_flags_check", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # __name__ is not "__main__"
        parser = module.build_parser()
    except Exception as error:  # any script a sweep file names: its failure is one line
        raise UserError(f"{display(script)} could not check the flags (does it have build_parser()?): "
                        f"{type(error).__name__}: {error}") from None
    parser.error = refuse  # type: ignore[method-assign]
    return parser


def check_with_script(plan: Plan, extra: Sequence[str] = ()) -> float:
    """Parse every task's command line as it will run (:func:`task_command`: its flags, the folders the sweep gives
    it, then the ``extra`` flags every run gets, those after ``--``) with the training script's own parser
    (:func:`training_parser`), so an unknown flag or a bad value is an error now, before anything is submitted,
    and not a failed task later. Returns the seconds it took."""
    began = time.perf_counter()

    class Refused(Exception):
        pass

    def refuse(message: str) -> NoReturn:
        raise Refused(message)

    parser = training_parser(plan.script, refuse)
    for task in plan.tasks:
        try:  # the flags the sweep adds too: a default they replace (results/ in a read-only copy) is not checked
            parser.parse_args(task_command(plan, task.index, extra)[2:])
        except Refused as refused:
            argv = " ".join([*task.argv(), *extra])
            raise UserError(f"task {task.index} ({argv}): {display(plan.script)} says: {refused}") from None
    return time.perf_counter() - began


def refuse_task_flags(plan: Plan, extra: Sequence[str]) -> None:
    """One line if the flags after ``--`` set what each task sets itself (its folder, its seed) or a value the sweep
    varies: every task would train alike, or write into one folder. A flag the sweep fixes for all may change."""
    varied = {name for task in plan.tasks for name in task.flags
              if len({repr(other.flags.get(name)) for other in plan.tasks}) > 1}
    overridden = check_training_flags(plan.script, extra, owned=[f"--{n}" for n in sorted(TASK_FLAGS | varied)])
    if overridden:
        raise UserError(f"each task sets {', '.join(overridden)} itself (its folder, its seed, the values the sweep "
                        "varies): leave them out after --")


def check_training_flags(script: Path, flags: Sequence[str], *, before: Sequence[str] = (),
                         owned: Sequence[str] = ()) -> list[str]:
    """The flags after ``--`` (``flags``), after those the caller adds itself (``before``), parsed by the training
    script's own parser (:func:`training_parser`), as :func:`check_with_script` does for a sweep: an unknown flag
    or a bad value is one line now, before anything is written or started. Returns those of ``owned`` (e.g.
    ``--checkpoint``: the caller sets them) that ``flags`` sets, in any spelling the parser takes
    (``--checkpoint X``, ``--checkpoint=X``, a prefix such as ``--check X``)."""
    def refuse(message: str) -> NoReturn:
        raise UserError(f"the flags after -- ({' '.join(flags)}): {display(script)} says: {message}")

    parser = training_parser(script, refuse)
    parser.parse_args([*before, *flags])
    known = parser._option_string_actions
    return list(flags_given(parser, flags, {known[flag].dest for flag in owned if flag in known}).values())


def display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------------------
# The sweep folder

@dataclass
class Plan:
    """A sweep folder's plan: the sweep, its id, its tasks."""

    folder: Path
    sweep: dict[str, Any]
    sweep_id: str
    sweep_file: str
    tasks: list[Task]

    @property
    def script(self) -> Path:
        return REPO_ROOT / self.sweep["script"]

    @property
    def copy(self) -> Path:
        """The sweep file's copy in the folder (what the array's tasks read)."""
        return self.folder / f"sweep{Path(self.sweep_file).suffix}"

    def task_dir(self, index: int) -> Path:
        return self.folder / "tasks" / f"{index:03d}"

    def submissions(self) -> list[dict[str, Any]]:
        path = self.folder / "submissions.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def add_submission(self, how: str, job_id: str, indices: Sequence[int], **more: Any) -> None:
        """One line per submission, appended (a line is written whole: one small write)."""
        line = json.dumps({"how": how, "job_id": str(job_id), "indices": list(indices), "time": time.time(), **more})
        with open(self.folder / "submissions.jsonl", "a", encoding="utf-8") as out:
            out.write(line + "\n")


def sweep_id(sweep: Mapping[str, Any]) -> str:
    """The sweep's identity: a hash of its settings (not of the file's layout or comments)."""
    return hashlib.sha256(json.dumps(sweep, sort_keys=True, default=str).encode()).hexdigest()[:12]


def refuse_second_submission(plan: Plan) -> None:
    """A sweep's folder is submitted once (01_sweep.py or 05_submitit.py): a second submission would train every task
    again beside the first; what failed is resubmitted by 02_status.py, a new sweep gets a new folder."""
    if plan.submissions():
        raise UserError(f"{plan.folder} was submitted already (job {plan.submissions()[-1]['job_id']}): follow it or "
                        f"resubmit what failed with 02_status.py --sweep-dir {plan.folder} [--resubmit], or give a new "
                        "--sweep-dir to start again")


def prepare_folder(folder: Path, sweep_file: Path, *, planning_now: bool = False) -> Plan:
    """Read the sweep file and the folder: a new folder gets the plan; a folder holding this very sweep
    is reused; one holding another sweep, or other files, is refused (nothing is written then).
    ``planning_now``: the tasks of an array submitted by hand plan the folder themselves, all at once
    (one may find it half made by another)."""
    sweep = read_sweep_file(sweep_file)
    tasks = expand(sweep, sweep_file)
    script = REPO_ROOT / sweep["script"]
    if not script.is_file():
        raise UserError(f"{sweep_file}: script {sweep['script']} does not exist (a path from the repository root)")
    ident = sweep_id(sweep)
    existing = read_plan(folder) if (folder / "plan.yaml").is_file() else None
    if existing is not None:
        if existing.sweep_id != ident:
            raise UserError(f"{folder} holds another sweep ({existing.sweep_id}, from {existing.sweep_file}); "
                            f"this one is {ident}: choose another --sweep-dir")
        return existing
    if folder.exists() and (not folder.is_dir() or (any(folder.iterdir()) and not planning_now)):
        raise UserError(f"{folder} exists and is not a sweep folder (no plan.yaml): choose another --sweep-dir")
    return Plan(folder, sweep, ident, str(sweep_file), tasks)


def write_plan(plan: Plan) -> None:
    """The plan and the sweep file's copy, each written whole; every task's folder."""
    plan.folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(Path(plan.sweep_file).read_text(encoding="utf-8"), plan.copy)
    text = yaml.safe_dump({"sweep_id": plan.sweep_id, "sweep_file": plan.sweep_file, "sweep": plan.sweep,
                           "tasks": [{"index": t.index, "flags": t.flags, "seed": t.seed} for t in plan.tasks]},
                          sort_keys=False)
    write_text_atomic(text, plan.folder / "plan.yaml")  # several array tasks may write it at once: the same text
    for task in plan.tasks:
        plan.task_dir(task.index).mkdir(parents=True, exist_ok=True)
    (plan.folder / "logs").mkdir(exist_ok=True)


def read_plan(folder: Path) -> Plan:
    path = folder / "plan.yaml"
    if not path.is_file():
        raise UserError(f"{folder} is not a sweep folder (no plan.yaml): give the --sweep-dir of a sweep")
    saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    tasks = [Task(t["index"], dict(t["flags"]), t["seed"]) for t in saved["tasks"]]
    return Plan(folder, saved["sweep"], saved["sweep_id"], saved["sweep_file"], tasks)


# ---------------------------------------------------------------------------------------------
# One task's run

def task_command(plan: Plan, index: int, extra: Sequence[str] = ()) -> list[str]:
    """The training's command line for task ``index``: its flags, its own folder, then ``extra``
    (the job's ``--device``, ``--num-workers``; the last value of a flag wins)."""
    folder = plan.task_dir(index)
    return [sys.executable, str(plan.script), *plan.tasks[index].argv(), "--results-dir", str(folder),
            "--checkpoint", str(folder / "checkpoint.pt"), "--resume", "--tensorboard", str(folder / "tensorboard"),
            *extra]


def fault_for(plan: Plan, index: int, attempt: int) -> tuple[str, int] | None:
    """The demonstration's fault for this task, on its first attempt only: ("fail" or "stall", after steps)."""
    faults = plan.sweep.get("faults", {})
    if attempt != 1:
        return None
    for kind in ("fail", "stall"):
        if index in faults.get(kind, []):
            return kind, int(faults.get("after-steps", 2))
    return None


def check_task(plan: Plan, index: int) -> None:
    if not 0 <= index < len(plan.tasks):
        raise UserError(f"task {index} does not exist: this sweep has tasks 0-{len(plan.tasks) - 1}")


def run_task(plan: Plan, index: int, extra: Sequence[str] = (), *, replace_process: bool = False) -> int:
    """Run task ``index`` (record an attempt first); returns the training's exit status.

    ``replace_process``: become the training (``os.execv``), so that Slurm's signals (the time limit's
    SIGTERM, ``--signal``'s SIGUSR1) reach it directly; an array task does that. A fault of the
    demonstration (``[faults]`` in the sweep file, first attempt only) trains ``after-steps`` steps and
    saves (``--step-budget``), then fails (exit 3) or stalls until the time limit ends the task.
    """
    check_task(plan, index)
    folder = plan.task_dir(index)
    folder.mkdir(parents=True, exist_ok=True)
    attempts = folder / "attempts.jsonl"
    attempt = 1 + sum(1 for a in local_attempts(folder) if "started" in a)  # each attempt writes two lines
    job = os.environ.get("SLURM_JOB_ID", "local")
    with open(attempts, "a", encoding="utf-8") as out:
        out.write(json.dumps({"attempt": attempt, "job": job, "started": time.time(),
                              "host": os.uname().nodename}) + "\n")
    command = task_command(plan, index, extra)
    fault = fault_for(plan, index, attempt)
    print(f"task {index} attempt {attempt} (job {job}): {' '.join(command[1:])}", flush=True)
    # A task run again after it finished trains nothing (--resume): what the training then says to train again.
    env = {**os.environ, "HPC_DL_LABS_TRAIN_AGAIN": "to train the sweep again, give 01_sweep.py a new --sweep-dir"}
    if fault is None and replace_process:
        sys.stdout.flush()
        os.execve(command[0], command, env)
    stopped_by = None  # the signal that stopped the training, if one did
    # what the training says when it stops: how this sweep goes on (an array job's script has said it already)
    env = {"HPC_DL_LABS_ON_STOP": "the sweep resumes this task from it when the same 01_sweep.py command runs again",
           **env}
    if fault is not None:
        kind, steps = fault
        status = subprocess.run([*command, "--step-budget", str(steps)], check=False, env=env).returncode
        if kind == "fail":
            print(f"task {index}: demonstration fault: failing after {steps} step(s) (attempt 1 only)", flush=True)
            status = 3
        else:
            print(f"task {index}: demonstration fault: stalled after {steps} step(s) until the time limit "
                  "(attempt 1 only)", flush=True)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # only the time limit ends it
            while True:
                time.sleep(60)
    else:
        status, stopped_by = run_passing_signals_on(command, env)
    with open(attempts, "a", encoding="utf-8") as out:
        out.write(json.dumps({"attempt": attempt, "job": job, "ended": time.time(), "exit": status,
                              **({"stopped_by": stopped_by} if stopped_by else {})}) + "\n")
    if stopped_by == "SIGINT":
        raise KeyboardInterrupt
    if stopped_by:  # the training saved what it had (its own line says so); the tasks after it wait for the next run
        print(f"task {index}: stopped by {stopped_by}; run the same command again to go on from here", flush=True)
        raise Stopped
    return status


def run_passing_signals_on(command: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[int, str | None]:
    """Run ``command`` and wait for it; SIGTERM and SIGUSR1 sent to this process (``kill``, a job's end) go on
    to it, so it saves and stops rather than train on alone; Ctrl-C reaches it from the terminal. Its exit
    status, and the signal that stopped it, if any."""
    child, received = subprocess.Popen(command, env=env), []

    def pass_on(sig: int, _frame: object) -> None:
        received.append(signal.Signals(sig).name)
        child.send_signal(sig)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        status = child.wait()
    except KeyboardInterrupt:  # the terminal sent SIGINT to both: the training stops by itself
        status, received = child.wait(), ["SIGINT"]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status, received[0] if received else None


# ---------------------------------------------------------------------------------------------
# Slurm

def slurm(*command: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A Slurm client command (``env``: added to this environment, which sbatch passes on to the job);
    a missing command is one line."""
    if shutil.which(command[0]) is None:
        raise UserError(f"{command[0]} is not on PATH: run this on a cluster's login node (or use --local)")
    return subprocess.run(list(command), capture_output=True, text=True, check=False,
                          env={**os.environ, **(env or {})})


def sbatch_job(command: Sequence[str], env: Mapping[str, str], what: str,
              record: Callable[[str], object] = lambda job_id: None) -> str:
    """``sbatch`` ``command``, then ``record(job_id)``; the job id. A kill (SIGTERM) meanwhile waits for both, so that
    a job in the queue is never one the script forgot: one line then names it (``what``: "the sweep as array job") and
    how to cancel it, and :class:`~common.errors.Terminated` stops the script (exit 143)."""
    with sigterm_deferred() as terminated:
        job_id = submitted_job_id(slurm(*command, env=env))
        record(job_id)
        if terminated:
            say_queued_despite_sigterm(what, job_id)
    return job_id


def say_queued_despite_sigterm(what: str, job_id: str) -> None:
    print(f"SIGTERM came while sbatch submitted {what} {job_id}: waited for it, it is in the queue; cancel it: "
          f"scancel {job_id}", flush=True)


def max_array_size() -> int:
    """The cluster's ``MaxArraySize`` (``scontrol show config``): array indices must stay below it."""
    done = slurm("scontrol", "show", "config")
    match = re.search(r"^MaxArraySize\s*=\s*(\d+)", done.stdout, re.M)
    if done.returncode != 0 or match is None:
        said = " | ".join(line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip())
        raise UserError(f"scontrol show config did not give MaxArraySize (does a Slurm controller answer here?): "
                        f"{said[:300]}")
    return int(match[1])


def submitted_job_id(done: subprocess.CompletedProcess[str]) -> str:
    """The job id ``sbatch --parsable`` printed, or its refusal as one line (naming the site profile's placeholder
    account when the script still holds it: the likely reason, on a site that needs one)."""
    if done.returncode != 0:
        script = Path(str(done.args[-1])) if done.args else None
        placeholder = script is not None and script.is_file() and f"--account={PLACEHOLDER}" in script.read_text()
        raise UserError(f"sbatch refused the job: {' '.join(done.stderr.split())}" + (
            f"; its account is the site profile's placeholder {PLACEHOLDER!r}: set account: in that profile "
            "(slurm/sites/<site>.yaml)" if placeholder else ""))
    return done.stdout.strip().split(";")[0]


def compress(indices: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8" (sbatch's --array syntax)."""
    parts, run = [], []
    for index in sorted(set(indices)):
        if run and index == run[-1] + 1:
            run.append(index)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [index]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def expand_indices(text: str) -> list[int]:
    """sbatch's "0-2,5,7-9%4" (or "[...]") -> [0, 1, 2, 5, 7, 8, 9]; a step too: "0-6:3" -> [0, 3, 6]."""
    indices = []
    for part in text.strip("[]").split("%")[0].split(","):
        span, _, step = part.partition(":")
        low, _, high = span.partition("-")
        if low.isdigit():
            indices += list(range(int(low), int(high or low) + 1, int(step) if step.isdigit() and int(step) else 1))
    return indices


@dataclass
class SlurmTask:
    """One array task as ``sacct`` sees it (one line of ``sacct -X``)."""

    job_id: str
    index: int
    state: str
    elapsed_s: float = 0.0
    cpus: int = 0
    gpus: int = 0
    energy_j: float | None = None
    exit_code: str = ""
    submit: str = ""
    start: str = ""
    end: str = ""


SACCT_FIELDS = "JobID,State,ElapsedRaw,AllocCPUS,AllocTRES,ExitCode,Submit,Start,End,ConsumedEnergyRaw"


def gpus_in(tres: str) -> int:
    """GPUs in an AllocTRES string ("billing=1,cpu=1,gres/gpu=2,node=1")."""
    match = re.search(r"gres/gpu=(\d+)", tres)
    return int(match[1]) if match else 0


def sacct_tasks(job_ids: Sequence[str]) -> tuple[list[SlurmTask], str | None]:
    """Every array task of ``job_ids`` (pending ones too), from ``sacct -X``; and why not, when sacct
    cannot answer (no accounting on this cluster): then ``squeue`` gives the jobs still queued or running."""
    if not job_ids:
        return [], None
    done = slurm("sacct", "-X", "-n", "-P", f"--format={SACCT_FIELDS}", "-j", ",".join(job_ids))
    if done.returncode != 0:
        why = " ".join(done.stderr.split()) or f"exit status {done.returncode}"
        return squeue_tasks(job_ids), f"sacct: {why}"
    tasks = []
    for line in done.stdout.splitlines():
        fields = line.split("|")
        if len(fields) != 10:
            continue
        job_field, state, elapsed, cpus, tres, exit_code, submit, start, end, energy = fields
        job, _, index = job_field.partition("_")
        state = state.split()[0]  # "CANCELLED by 0" -> CANCELLED
        for number in expand_indices(index) if index.startswith("[") else ([int(index)] if index.isdigit() else []):
            joules = float(energy) if energy.replace(".", "", 1).isdigit() and float(energy) > 0 else None
            tasks.append(SlurmTask(job, number, state, float(elapsed or 0), int(cpus or 0), gpus_in(tres), joules,
                                   exit_code, submit, start, end))
    # A job submitted a moment ago may not be in the accounting database yet: the queue knows it.
    unseen = [job for job in job_ids if job not in {task.job_id for task in tasks}]
    return tasks + (squeue_tasks(unseen) if unseen else []), None


def squeue_tasks(job_ids: Sequence[str]) -> list[SlurmTask]:
    done = slurm("squeue", "-h", "-r", "-j", ",".join(job_ids), "-o", "%i|%T")
    tasks = []
    for line in done.stdout.splitlines():
        job_field, _, state = line.partition("|")
        job, _, index = job_field.partition("_")
        if index.isdigit():
            tasks.append(SlurmTask(job, int(index), state))
    return tasks


# ---------------------------------------------------------------------------------------------
# What each task did: state, progress, metric, cost

@dataclass
class TaskStatus:
    """One task of the sweep: its latest state, its progress and metric, and the cost of every attempt."""

    index: int
    flags: dict[str, Any]
    seed: int
    state: str = "NOT SUBMITTED"
    job: str = ""                   # the latest job (array id_index) that ran it
    elapsed_s: float = 0.0          # of the latest attempt
    attempts: int = 0
    last_step: int | None = None
    best_accuracy: float | None = None
    final_loss: float | None = None
    record: str | None = None       # the training's record (run id), when it finished
    core_hours: float = 0.0         # every attempt's, the failed ones too
    gpu_hours: float = 0.0
    energy_j: float | None = None
    energy_source: str = ""
    cost_source: str = ""
    training_s: float | None = None  # the record's training time (for the per-task overhead)
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, test accuracy)


def read_curves(folder: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """A task's TensorBoard curves: (step, train loss) and (step, test accuracy); empty without events.

    Read with TensorBoard's own reader (imported only when there are event files: ~1 s)."""
    if not folder.is_dir() or not any(folder.glob("events.out.tfevents.*")):
        return [], []
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags().get("scalars", [])
    read = (lambda tag: [(e.step, e.value) for e in events.Scalars(tag)] if tag in tags else [])
    return read("train/loss"), read("test/accuracy")


def local_attempts(folder: Path) -> list[dict[str, Any]]:
    path = folder / "attempts.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def sweep_status(plan: Plan) -> tuple[list[TaskStatus], str | None]:
    """Every task's status: Slurm's word (sacct, else squeue) on its jobs, the task's record and curves
    for its progress and metric, and the cost of all its attempts. Also why sacct could not answer."""
    statuses = [TaskStatus(t.index, t.flags, t.seed) for t in plan.tasks]
    submissions = plan.submissions()
    slurm_jobs = [s["job_id"] for s in submissions if s["how"] != "local"]
    rows, sacct_problem = sacct_tasks(slurm_jobs) if slurm_jobs else ([], None)
    order = {job: n for n, job in enumerate(slurm_jobs)}  # later submissions come later
    for row in sorted(rows, key=lambda r: order.get(r.job_id, -1)):
        if row.index >= len(statuses):
            continue
        status = statuses[row.index]
        status.state, status.job, status.elapsed_s = row.state, f"{row.job_id}_{row.index}", row.elapsed_s
        if row.state != "PENDING":
            status.attempts += 1
            status.core_hours += row.elapsed_s * row.cpus / 3600
            status.gpu_hours += row.elapsed_s * row.gpus / 3600
            status.cost_source = "sacct"
            if row.energy_j is not None:
                status.energy_j, status.energy_source = (status.energy_j or 0) + row.energy_j, "slurm"
    records = {}
    for record in load_records(plan.folder / "tasks").records:
        index = int(Path(record["_path"]).parent.name)
        records[index] = record
    for status in statuses:
        folder = plan.task_dir(status.index)
        if not slurm_jobs:  # a local sweep (or a task run by hand with --task): the attempts the runner wrote
            status.state = NOT_RUN if submissions else status.state  # --local: the same command runs it
            ended = [a for a in local_attempts(folder) if "ended" in a]
            started = {a["attempt"]: a["started"] for a in local_attempts(folder) if "started" in a}
            status.attempts = len(started)
            for attempt in ended:
                seconds = attempt["ended"] - started.get(attempt["attempt"], attempt["ended"])
                status.core_hours += seconds * len(os.sched_getaffinity(0)) / 3600
                status.elapsed_s = seconds
            if ended:
                last = ended[-1]  # exit 0 without a record is UNFINISHED (below): stopped by a signal, saved
                status.state = "COMPLETED" if last["exit"] == 0 else "CANCELLED" if "stopped_by" in last else "FAILED"
                status.cost_source = "local wall time x this machine's usable cores"
            elif started:  # begun, no end written: running now, or its runner was killed
                status.state = UNFINISHED
        losses, accuracy = read_curves(folder / "tensorboard")
        if losses:
            status.last_step = losses[-1][0]
        status.history = accuracy
        if accuracy:
            status.best_accuracy = max(value for _, value in accuracy)
        record = records.get(status.index)
        if record is None and status.state == "COMPLETED":
            status.state = UNFINISHED
        if record is not None:
            metrics = record["metrics"]
            status.record = record["run_id"]
            status.final_loss = metrics.get("final_loss")
            status.training_s = sum(metrics.get("epoch_time_s") or []) or None
            history = [h["test_accuracy"] for h in metrics.get("eval_history") or []
                       if h.get("test_accuracy") is not None]
            if history:
                status.best_accuracy = max(history)
            status.last_step = status.last_step or metrics.get("steps")
            if not slurm_jobs and record["provenance"]["device"].get("type") == "cuda":
                status.gpu_hours = status.core_hours / max(1, len(os.sched_getaffinity(0)))
            energy = record.get("energy", {})
            if status.energy_j is None and energy.get("status") == "ok":
                status.energy_j, status.energy_source = energy["joules"], energy.get("source", "")
    return statuses, sacct_problem


def fmt_flags(flags: Mapping[str, Any], varied: Iterable[str]) -> str:
    return " ".join(f"{name}={flags[name]}" for name in varied if name in flags)


def varied_flags(plan: Plan) -> list[str]:
    """The flags that differ between tasks (the table shows those), in the sweep file's order."""
    names = list(dict.fromkeys(name for task in plan.tasks for name in task.flags))
    return [name for name in names if len({repr(task.flags.get(name)) for task in plan.tasks}) > 1]


def status_table(plan: Plan, statuses: Sequence[TaskStatus]) -> str:
    """The status command's table: one line per task."""
    varied = varied_flags(plan)
    lines = [f"{'task':>4}  {'state':<13} {'job':<12} {'elapsed':>8} {'tries':>5} {'step':>5} {'best acc':>8} "
             f"{'core-h':>7} {'GPU-h':>7}  flags"]
    for s in statuses:
        best = f"{100 * s.best_accuracy:.1f}%" if s.best_accuracy is not None else "-"
        lines.append(f"{s.index:>4}  {s.state:<13} {s.job or '-':<12} {s.elapsed_s:>7.0f}s {s.attempts:>5} "
                     f"{s.last_step if s.last_step is not None else '-':>5} {best:>8} {s.core_hours:>7.4f} "
                     f"{s.gpu_hours:>7.4f}  {fmt_flags(s.flags, varied)} seed={s.seed}")
    return "\n".join(lines)


def sweep_record_metrics(plan: Plan, statuses: Sequence[TaskStatus]) -> dict[str, Any]:
    """The sweep record's metrics: every task, the totals, the failures, the submissions' timing."""
    tasks = [{"index": s.index, "flags": s.flags, "seed": s.seed, "state": s.state, "job": s.job,
              "attempts": s.attempts, "elapsed_s": s.elapsed_s, "last_step": s.last_step,
              "best_accuracy": s.best_accuracy, "final_loss": s.final_loss, "record": s.record,
              "core_hours": s.core_hours, "gpu_hours": s.gpu_hours, "energy_j": s.energy_j,
              "energy_source": s.energy_source, "cost_source": s.cost_source, "training_s": s.training_s,
              "accuracy_history": s.history}
             for s in statuses]
    done = [s for s in statuses if s.state == "COMPLETED" and s.best_accuracy is not None]
    best = max(done, key=lambda s: s.best_accuracy, default=None)
    return {
        "tasks": tasks,
        "varied_flags": varied_flags(plan),
        "failed": [s.index for s in statuses if s.state in {*RETRY, "NOT SUBMITTED", NOT_RUN}],
        "states": {state: sum(1 for s in statuses if s.state == state)
                   for state in sorted({s.state for s in statuses})},
        "core_hours": sum(s.core_hours for s in statuses),
        "gpu_hours": sum(s.gpu_hours for s in statuses),
        "energy_j": sum(s.energy_j for s in statuses if s.energy_j is not None) if any(
            s.energy_j is not None for s in statuses) else None,
        "best_task": None if best is None else best.index,
        "best_accuracy": None if best is None else best.best_accuracy,
        "submissions": plan.submissions(),
    }


def write_sweep_record(plan: Plan, statuses: Sequence[TaskStatus], script: str) -> Path:
    """The sweep's record (lab09, method ``sweep-<how it was submitted>``) into the sweep folder."""
    how = plan.submissions()[0]["how"] if plan.submissions() else "not-submitted"
    metrics = sweep_record_metrics(plan, statuses)
    note = f"tasks that did not complete: {metrics['failed']}" if metrics["failed"] else "every task completed"
    record = make_record(lab="lab09", script=script, method=f"sweep-{how}",
                         config={"sweep_id": plan.sweep_id, "sweep_file": plan.sweep_file, "sweep": plan.sweep,
                                 "how": how, "tasks": len(plan.tasks)},
                         metrics=metrics, provenance=provenance(), notes=[note])
    return write_record(record, plan.folder)
