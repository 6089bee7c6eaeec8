"""The Slurm test cluster for tests under tests/slurm/.

Tests ask for the session fixture ``slurm_cluster`` (a started 2-node
:class:`testbed.SlurmTestCluster`, see tests/testbed/) and carry ``@pytest.mark.slurm``; a test
here that has one of the two gets the other, so ``-m "not slurm"`` deselects all of them.

Without root, or when Slurm cannot be installed or started, these tests are skipped with the
reason, except when ``HPC_DL_LABS_REQUIRE_SLURM=1`` (CI sets it): then they fail, so a CI machine
that silently lost its Slurm cannot pass.

When the session will run tests/slurm/test_templates.py, the fixture also starts its jobs, in the
background (tests/slurm/template_jobs.py): the Slurm tests before it wait on timers half of the time.

Every job the fixture submits sees ``HPC_DL_LABS_TINY=1`` (tiny runs), ``HPC_DL_LABS_SKIP_MODULES=1``
(the sites' module lines cannot run here), ``HPC_DL_LABS_FAKE_GPUS=1`` (the nodes' GPUs are device
files with nothing behind them: the job header runs such jobs on the CPU, where a real cluster's job
with GPUs asks for cuda) and this Python's environment first on ``PATH``.

The test cluster does not confine tasks to their cores (no cgroups): the ranks of a job share
this machine's 2 cores, and OpenMP threads that spin while they wait (the default) take them from
the other ranks, which then wait in every all-reduce. ``OMP_WAIT_POLICY=PASSIVE`` lets waiting
threads sleep: a tiny 4-rank DDP job took 16-18 s instead of 26-30 s. It changes how fast the jobs
run here, not what they do. (Every job imports torch: the environment's bytecode is compiled at
install, ``compile-bytecode`` in pyproject.toml, which halves the cost of that import where
``PYTHONDONTWRITEBYTECODE`` is set, as on this machine.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed import ClusterError, SlurmTestCluster

REQUIRE_VARIABLE = "HPC_DL_LABS_REQUIRE_SLURM"
TIMINGS: dict[str, float] = {}


def slurm_unavailable(reason: str) -> None:
    """Skip with ``reason``; fail instead when HPC_DL_LABS_REQUIRE_SLURM=1."""
    if os.environ.get(REQUIRE_VARIABLE) == "1":
        pytest.fail(f"{reason} ({REQUIRE_VARIABLE}=1 makes this a failure instead of a skip)", pytrace=False)
    pytest.skip(reason)


def job_environment() -> dict[str, str]:
    """What every test job sees on top of the caller's environment."""
    python_bin = str(Path(sys.executable).parent)
    return {
        "PATH": f"{python_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        "HPC_DL_LABS_TINY": "1",
        "HPC_DL_LABS_SKIP_MODULES": "1",
        "HPC_DL_LABS_FAKE_GPUS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "PYTHONFAULTHANDLER": "1",  # a rank that crashes (SIGSEGV, SIGABRT) prints where it was
    }


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A started 2-node Slurm test cluster, stopped at the end of the session."""
    if sys.platform != "linux":
        slurm_unavailable(f"the Slurm test cluster needs Linux, not {sys.platform}")
    if os.geteuid() != 0:
        slurm_unavailable("the Slurm test cluster needs root (it installs Slurm and runs slurmd as root)")
    cluster = SlurmTestCluster(nodes=2, job_env=job_environment(), log_dir=tmp_path_factory.mktemp("slurm-job-logs"))
    try:
        TIMINGS["start"] = cluster.start()
    except ClusterError as err:
        slurm_unavailable(f"the Slurm test cluster did not start: {err}")
    def uses(fixture: str) -> bool:
        return any(fixture in getattr(item, "fixturenames", ()) for item in request.session.items)

    if uses("run_lab"):  # Lab-09's run_lab.sh starts now too: it waits out a 2-minute time limit
        start_lab09_run(cluster, tmp_path_factory)
    if uses("template_jobs"):
        import template_jobs  # the template jobs start now, in the background (see that module)

        template_jobs.start(cluster, tmp_path_factory)
    yield cluster
    process = LAB09_RUN.get("process")
    if process is not None and process.poll() is None:
        process.kill()
    TIMINGS["stop"] = cluster.stop()
    TIMINGS.update(cluster.timings)
    TIMINGS.update({f"job {job_id} {cluster.job_names.get(job_id, '')}": seconds
                    for job_id, seconds in cluster.job_seconds.items()})


LAB09_RUN: dict[str, object] = {}


def start_lab09_run(cluster, tmp_path_factory) -> None:
    """``labs/lab09_many_jobs/run_lab.sh`` on the cluster, in the background, once per session: most of its
    time is the faults sweep waiting for its time limit, which the other Slurm tests use meanwhile.

    That limit is 2 minutes here, not the lab's 1: the run starts beside the template jobs and the other
    Slurm tests, on 2 cores, and a task that should fail after its third step ran out of a minute before
    it got there (22 s when the Lab-09 tests ran alone)."""
    if LAB09_RUN:
        return
    repo = Path(__file__).resolve().parents[2]
    results = tmp_path_factory.mktemp("lab09-run")
    log = results.parent / "lab09-run_lab.log"
    env = cluster.environment({"HPC_DL_LABS_TINY": "0", "PYTHON": sys.executable, "LAB09_FAULTS_TIME": "2"})
    with open(log, "w") as out:
        LAB09_RUN["process"] = subprocess.Popen(["bash", str(repo / "labs/lab09_many_jobs/run_lab.sh"), str(results)],
                                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=repo)
    LAB09_RUN.update(results=results, log=log)


@pytest.fixture(scope="session")
def run_lab(slurm_cluster, tmp_path_factory):
    """Lab-09's run_lab.sh on the test cluster, started with the cluster (:func:`start_lab09_run`):
    (process, results folder, log)."""
    start_lab09_run(slurm_cluster, tmp_path_factory)
    return LAB09_RUN["process"], LAB09_RUN["results"], LAB09_RUN["log"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks (above), and the tests that read what Lab-09's ``run_lab.sh`` left move after every other
    Slurm test: the run started with the cluster, and by then it has ended (its faults sweep waits out
    a time limit; read earlier, the session would wait for it)."""
    here = Path(__file__).parent
    ours, readers = [], []
    for item in items:
        if here not in Path(str(item.fspath)).parents:
            continue
        ours.append(item)
        uses_cluster = "slurm_cluster" in getattr(item, "fixturenames", ())
        if uses_cluster and item.get_closest_marker("slurm") is None:
            item.add_marker(pytest.mark.slurm)
        if item.get_closest_marker("slurm") is not None and not uses_cluster:
            item.fixturenames.append("slurm_cluster")
        if "run_lab" in getattr(item, "fixturenames", ()) and item.name != "test_run_lab_starts":
            readers.append(item)
    others = [item for item in ours if item not in readers]
    if readers and others:
        for item in readers:
            items.remove(item)
        at = items.index(others[-1]) + 1
        items[at:at] = readers


def pytest_terminal_summary(terminalreporter) -> None:
    if not TIMINGS:
        return
    jobs = [seconds for name, seconds in TIMINGS.items() if name.startswith("job ")]
    parts = [f"{name} {TIMINGS[name]:.1f} s" for name in ("start", "stop") if name in TIMINGS]
    if jobs:
        parts.append(f"{len(jobs)} job(s) submit-to-end {min(jobs):.1f}-{max(jobs):.1f} s")
    parts += [f"{name} {TIMINGS[name]:.0f} s" for name in TIMINGS if not name.startswith(("job ", "start", "stop"))]
    terminalreporter.write_line("slurm test cluster: " + ", ".join(parts))
    slowest = sorted((name for name in TIMINGS if name.startswith("job ")), key=TIMINGS.get, reverse=True)[:5]
    if slowest:
        terminalreporter.write_line("slowest jobs: "
                                    + ", ".join(f"{name[4:]} {TIMINGS[name]:.1f} s" for name in slowest))
