"""Drive the throwaway Slurm test cluster from Python tests: start it, submit jobs, wait, stop.

    from testbed import SlurmTestCluster
    with SlurmTestCluster(nodes=2) as cluster:      # start() ... stop()
        job_id = cluster.submit("job.sbatch", "--nodes=2", env={"HPC_DL_LABS_TINY": "1"})
        result = cluster.wait(job_id, timeout=60)
        assert result.ok, cluster.output(job_id)

The cluster is real Slurm (slurmctld, one slurmd per emulated node, munge; see
:mod:`testbed.daemons`), so a script that runs here runs the same way under ``sbatch`` on a cluster.
Jobs are polled with ``scontrol show job`` every half second (``sbatch --wait`` backs off to 32 s).
The cluster belongs to the process that starts it: if that process dies without stopping it, the
next start stops it. Needs root; never imports torch.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from testbed import resources as node_resources
from testbed.daemons import ClusterError, RunningCluster, Testbed

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Job states after which a job never runs again (REQUEUED and PREEMPTED+requeue come back).
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


class SbatchRejected(RuntimeError):
    """sbatch refused the job (bad resources, unknown partition ...); ``stderr`` says why."""

    def __init__(self, stderr: str) -> None:
        super().__init__(stderr.strip())
        self.stderr = stderr


@dataclass(frozen=True)
class JobResult:
    job_id: int
    state: str          # COMPLETED, FAILED, CANCELLED, TIMEOUT ...
    exit_code: int      # the batch script's exit status
    signal: int         # the signal that ended it, 0 if none
    stdout_path: Path | None
    seconds: float      # from submit() (or wait(), if the job was not submitted here) to its end

    reason: str = ""    # why sbatch refused it (state REJECTED), else empty

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED" and self.exit_code == 0


@dataclass(frozen=True)
class Submission:
    """One job for :meth:`SlurmTestCluster.run_all`: ``key`` names its result."""

    key: str
    script: Path
    sbatch_args: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None
    script_args: tuple[str, ...] = ()
    weight: int = 1     # processes it starts: run_all keeps the sum of running jobs' weights bounded


def parse_scontrol_record(text: str) -> dict[str, str]:
    """``Key=Value Key2=Value with spaces ...`` (one ``scontrol -o`` line) as a dict."""
    return {match[1]: match[2].strip() for match in re.finditer(r"(\w+)=(.*?)(?=\s\w+=|$)", text.strip())}


class SlurmTestCluster:
    """A running test cluster: ``start()``, ``submit()``, ``wait()``, ``output()``, ``stop()``."""

    def __init__(self, directory: Path | None = None, nodes: int = 2,
                 resources: node_resources.NodeResources | None = None,
                 job_env: Mapping[str, str] | None = None, log_dir: Path | None = None,
                 accounting: bool = True) -> None:
        """``resources``: what the nodes claim (default: enough for every site profile); ``job_env``
        is added to every submission's environment (sbatch exports it to the job); ``log_dir``
        receives job logs unless a submission names its own ``--output``; ``accounting``: slurmdbd and
        MariaDB, so that ``sacct`` answers (see :mod:`testbed.daemons`)."""
        self.directory = directory or Path(tempfile.mkdtemp(prefix="hpc-dl-labs-slurm-"))
        self.nodes = nodes
        self.resources = resources
        self.job_env = dict(job_env or {})
        self.log_dir = log_dir or self.directory.with_name(self.directory.name + "-logs")
        self.testbed = Testbed(self.directory, nodes, accounting=accounting)
        self.left_behind: list[RunningCluster] = []  # clusters of ended runs that start() stopped
        self.start_seconds: float | None = None
        self.stop_seconds: float | None = None
        self.job_seconds: dict[int, float] = {}
        self.job_names: dict[int, str] = {}
        self.timings: dict[str, float] = {}  # what tests want reported, e.g. a batch of jobs
        self._submitted_at: dict[int, float] = {}
        self._stdout: dict[int, Path] = {}
        self._running = False

    # -- the cluster ---------------------------------------------------------------------------

    def start(self) -> float:
        """Start the cluster (owned by this process) and wait until its nodes are idle; return the
        seconds it took. Raises :class:`ClusterError` with the reason when it cannot."""
        began = time.perf_counter()
        try:
            self.left_behind = self.testbed.start(self.resources or node_resources.for_sites(), owner=os.getpid())
        except ClusterError:
            if self.directory.is_dir() and not any(self.directory.iterdir()):
                self.directory.rmdir()  # the empty directory made above
            raise
        self._running = True
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_seconds = time.perf_counter() - began
        return self.start_seconds

    def stop(self) -> float:
        """Cancel every job and stop every daemon; return the seconds it took."""
        began = time.perf_counter()
        self._running = False
        self.testbed.stop()
        self.stop_seconds = time.perf_counter() - began
        return self.stop_seconds

    def __enter__(self) -> SlurmTestCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._running:
            self.stop()

    @property
    def slurm_conf(self) -> Path:
        return self.directory / "slurm.conf"

    def environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for Slurm's client commands (and, through sbatch, for jobs)."""
        return {**os.environ, **self.job_env, **(extra or {}), "SLURM_CONF": str(self.slurm_conf)}

    def command(self, *args: str, env: Mapping[str, str] | None = None,
                cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client (``scontrol``, ``squeue``, ``sinfo`` ...) against this cluster."""
        return subprocess.run(list(args), capture_output=True, text=True, check=False,
                              env=self.environment(env), cwd=cwd or REPO_ROOT)

    # -- jobs ----------------------------------------------------------------------------------

    def submit(self, script: str | Path, *sbatch_args: str, env: Mapping[str, str] | None = None,
               cwd: Path | None = None, script_args: Sequence[str] = ()) -> int:
        """``sbatch [sbatch_args] script [script_args]`` from ``cwd`` (default: the repository root).

        Returns the job id; raises :class:`SbatchRejected` when sbatch refuses the job.
        ``script_args`` reach the batch script as ``"$@"`` (the course's templates pass them on to
        the training).
        """
        args = list(sbatch_args)
        if not any(arg.startswith(("--output", "-o")) for arg in args):
            args.append(f"--output={self.log_dir}/%x-%j.out")
        submitted_at = time.perf_counter()
        done = self.command("sbatch", "--parsable", *args, str(script), *script_args, env=env, cwd=cwd)
        if done.returncode != 0:
            raise SbatchRejected(done.stderr or done.stdout)
        job_id = int(done.stdout.strip().split(";")[0])
        self._submitted_at[job_id] = submitted_at
        return job_id

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (empty once Slurm has forgotten the job).

        A job array (``#SBATCH --array``) is one line per task: its ``JobState`` is final only when
        every task's is (the first task that did not complete names it), its ``ExitCode`` is the
        largest, and ``StdOut`` lists every task's log, separated by ``:``.
        """
        done = self.command("scontrol", "--oneliner", "show", "job", str(job_id))
        if done.returncode != 0 or not done.stdout.strip():
            return {}
        tasks = [parse_scontrol_record(line) for line in done.stdout.splitlines() if line.strip()]
        if len(tasks) == 1:
            return tasks[0]
        states = [task.get("JobState", "UNKNOWN") for task in tasks]
        running = [state for state in states if state not in FINAL_STATES]
        failed = [state for state in states if state != "COMPLETED"]
        codes = [task.get("ExitCode", "0:0") for task in tasks]
        return {**tasks[0], "JobState": (running or failed or ["COMPLETED"])[0],
                "ExitCode": max(codes, key=lambda code: tuple(int(part or 0) for part in code.split(":"))),
                "StdOut": ":".join(task["StdOut"] for task in tasks if task.get("StdOut"))}

    def wait(self, job_id: int, timeout: float = 60.0, poll: float = 0.5) -> JobResult:
        """Poll until the job has ended; return its state and exit code.

        Raises ``TimeoutError`` (after cancelling the job) when it has not ended in ``timeout`` s.
        """
        began = self._submitted_at.get(job_id, time.perf_counter())
        deadline = time.perf_counter() + timeout
        info: dict[str, str] = {}
        while True:
            info = self.job_info(job_id) or info
            if info.get("StdOut"):
                self._stdout[job_id] = Path(info["StdOut"])
            state = info.get("JobState", "UNKNOWN")
            if state in FINAL_STATES:
                break
            if time.perf_counter() > deadline:
                self.command("scancel", str(job_id))
                tail = self.output(job_id)[-2000:]
                raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s; output so far:\n{tail}")
            time.sleep(poll)
        seconds = time.perf_counter() - began
        self.job_seconds[job_id] = seconds
        self.job_names[job_id] = info.get("JobName", "")
        exit_code, _, signal = info.get("ExitCode", "0:0").partition(":")
        return JobResult(job_id=job_id, state=state, exit_code=int(exit_code), signal=int(signal or 0),
                         stdout_path=self._stdout.get(job_id), seconds=seconds)

    def run(self, script: str | Path, *sbatch_args: str, env: Mapping[str, str] | None = None,
            timeout: float = 60.0, cwd: Path | None = None) -> JobResult:
        """``submit`` then ``wait``."""
        return self.wait(self.submit(script, *sbatch_args, env=env, cwd=cwd), timeout=timeout)

    def run_all(self, submissions: Sequence[Submission], timeout: float = 300.0, max_weight: int = 6,
                poll: float = 0.5) -> dict[str, JobResult]:
        """Run many jobs, at most ``max_weight`` processes' worth at a time; results by key.

        The test cluster's nodes claim far more cores than the machine has, so Slurm would start
        every job at once; each Python process of a job costs about a second of CPU and 1 GB to
        start (``import torch``), so we hold jobs back here instead. A job heavier than
        ``max_weight`` still runs, alone. ``timeout`` is for each job from its start. A job that
        sbatch refuses ends as state ``REJECTED``, one that outlives ``timeout`` is cancelled and
        ends as ``TEST_TIMEOUT``; ``reason`` says more.
        """
        waiting = list(submissions)
        running: dict[int, tuple[Submission, float]] = {}
        results: dict[str, JobResult] = {}
        while waiting or running:
            load = sum(sub.weight for sub, _ in running.values())
            while waiting and (not running or load + waiting[0].weight <= max_weight):
                sub = waiting.pop(0)
                try:
                    job_id = self.submit(sub.script, *sub.sbatch_args, env=sub.env, script_args=sub.script_args)
                except SbatchRejected as err:
                    results[sub.key] = JobResult(job_id=0, state="REJECTED", exit_code=1, signal=0,
                                                 stdout_path=None, seconds=0.0, reason=err.stderr.strip())
                    continue
                running[job_id] = (sub, time.perf_counter())
                load += sub.weight
            for job_id, (sub, started) in list(running.items()):
                remaining = timeout - (time.perf_counter() - started)
                info = self.job_info(job_id)
                if info.get("JobState") in FINAL_STATES or remaining <= 0:
                    try:
                        results[sub.key] = self.wait(job_id, timeout=max(remaining, 0.0), poll=poll)
                    except TimeoutError as err:  # cancelled by wait(); the others go on
                        results[sub.key] = JobResult(job_id=job_id, state="TEST_TIMEOUT", exit_code=1, signal=0,
                                                     stdout_path=self._stdout.get(job_id),
                                                     seconds=time.perf_counter() - started, reason=str(err))
                    del running[job_id]
            if running:
                time.sleep(poll)
        return results

    def daemon_log(self, job_id: int, limit: int = 60) -> str:
        """What slurmctld and the slurmds logged about the job (its last ``limit`` lines), for
        failure messages: why a job failed before its script wrote anything is only there."""
        pattern = re.compile(rf"(JobId={job_id}\b|job[ _]?{job_id}\b|StepId={job_id}\.|"
                             rf"\b{job_id}\.(batch|\d+)\b)", re.I)
        lines = []
        for log in sorted((self.directory / "log").glob("slurm*.log")):
            text = log.read_text(encoding="utf-8", errors="replace")
            lines += [f"{log.name}: {line}" for line in text.splitlines() if pattern.search(line)]
        return "\n".join(lines[-limit:]) or "(the daemons logged nothing about this job)"

    def output(self, job_id: int) -> str:
        """The job's log (stdout and stderr unless the script split them); '' before it exists."""
        path = self._stdout.get(job_id)
        if path is None:
            info = self.job_info(job_id)
            path = Path(info["StdOut"]) if info.get("StdOut") else None
        if path is None:
            return ""
        # A job array's tasks each have their own log (job_info joins their paths with ":").
        logs = [Path(part) for part in str(path).split(":")]
        return "".join(log.read_text(encoding="utf-8", errors="replace") for log in logs if log.is_file())
