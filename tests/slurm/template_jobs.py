"""The template jobs of tests/slurm/test_templates.py: every template rendered for every site and
submitted to the Slurm test cluster (see that file for what is checked).

They are started in the background as soon as the session's cluster is up (tests/slurm/conftest.py),
when the session will run test_templates.py: about 140 s of jobs that keep both cores busy, while the
Slurm tests that run before it spend half their time waiting on timers (a collective timeout, a
requeued job's hold, a signal). test_templates.py then takes the results, waiting for what is left.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from pathlib import Path
from typing import NamedTuple

from common.slurm.rendering import find_templates, renderings
from common.slurm.sites import load_sites, site_names
from helpers import load_script
from testbed import Submission

REPO_ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_FOLDERS = [REPO_ROOT / "chapters", REPO_ROOT / "labs"]
#: The most processes (each importing torch, ~1 GB) running at once; a heavier job runs alone.
MAX_PROCESSES = 8
#: Seconds one tiny job may take from submission, on a loaded 2-core machine.
JOB_TIMEOUT = 420

render_sbatch = load_script("scripts/render_sbatch.py")
SITES = site_names()


def site_template_pairs() -> list[tuple[str, str]]:
    """(site, rendered script path) for every template and every site that can run it, as --all-sites does."""
    pairs, profiles = [], load_sites()
    for template, relative in find_templates(TEMPLATE_FOLDERS):
        rendered, _ = renderings(render_sbatch.read_template(template), profiles)
        pairs += [(site, str(relative)) for site in rendered]
    return pairs


PAIRS = site_template_pairs()


def training_site(script: str) -> str:
    """The site whose rendering of ``script`` trains for real: generic, else the first site that can run it."""
    sites = [site for site, rendered in PAIRS if rendered == script]
    return "generic" if "generic" in sites else sorted(sites)[0]


TRAINED = sorted({script for _, script in PAIRS})
LAUNCHED = [(site, script) for site, script in PAIRS if site != training_site(script)]

#: python, torchrun and kernprof in the jobs that do not train: say how they were started, exit 0.
STAND_IN = """#!/usr/bin/env bash
echo "STAND-IN $(basename "$0") task ${SLURM_PROCID:-none} of ${SLURM_STEP_NUM_TASKS:-none}" \\
    "on ${SLURMD_NODENAME:-none}: $*"
"""
STAND_IN_LINE = re.compile(r"^STAND-IN (\S+) task (\S+) of (\S+) on \S+: (.*)$", re.M)


def processes_of(job: dict, text: str) -> int:
    """How many Python processes a job runs at once: one per task, or torchrun plus one per GPU;
    a job array's tasks run side by side, each with the job's processes plus the batch script's."""
    processes = job["nodes"] * (1 + job["gpus_per_node"]) if "torchrun " in text else job["ntasks"]
    array = re.search(r"^#SBATCH --array=(\d+)-(\d+)", text, re.M)
    return processes if array is None else (int(array[2]) - int(array[1]) + 1) * (processes + 1)


def stand_in_data(data_dir: Path) -> None:
    """What a stand-in python cannot write: Lab-08's shards (one small file and its checksum), so that the
    job's real shell steps (stage_shards.sh copies and checks them on every node) have something to stage."""
    shards = data_dir / "lab08" / "shards"
    shards.mkdir(parents=True)
    (shards / "shard-000000.tar").write_bytes(b"stand-in shard\n")
    digest = hashlib.sha256(b"stand-in shard\n").hexdigest()
    (shards / "SHA256SUMS").write_text(f"{digest}  shard-000000.tar\n")


class RenderedJob(NamedTuple):
    site: str
    script: Path
    job: dict
    results_dir: Path
    result: object  # JobResult


_started: dict[str, object] = {}
_lock = threading.Lock()


def start(slurm_cluster, tmp_path_factory) -> None:
    """Submit every template job from a background thread (once per session)."""
    with _lock:
        if "thread" in _started:
            return

        folders = [tmp_path_factory.mktemp(name) for name in ("rendered", "runs", "stand-in")]

        def run() -> None:
            try:
                _started["jobs"] = run_template_jobs(slurm_cluster, *folders)
            except BaseException as err:  # handed to the test that asks for the results
                _started["error"] = err

        _started["thread"] = threading.Thread(target=run, name="template-jobs", daemon=True)
        _started["thread"].start()


def results(slurm_cluster, tmp_path_factory) -> dict[str, RenderedJob]:
    """Every template job's result, {"site/script": RenderedJob}: started here unless it already was."""
    start(slurm_cluster, tmp_path_factory)
    _started["thread"].join()
    if "error" in _started:
        raise _started["error"]
    return _started["jobs"]


def run_template_jobs(slurm_cluster, out_dir: Path, runs: Path, stand_in: Path) -> dict[str, RenderedJob]:
    """Render every template for every site (--all-sites) into ``out_dir``, submit them all, with their
    results under ``runs`` and the stand-in tools in ``stand_in``: {"site/script": RenderedJob}."""
    for name in ("python", "torchrun", "kernprof"):
        (stand_in / name).write_text(STAND_IN)
        (stand_in / name).chmod(0o755)
    assert render_sbatch.main(["--all-sites", str(out_dir), *map(str, TEMPLATE_FOLDERS)]) == 0
    manifest = json.loads((out_dir / "manifest.json").read_text())
    submissions, jobs = [], {}
    for entry in manifest:
        key = entry["script"]  # <site>/<path of the template without .j2>
        script, relative = out_dir / key, key.split("/", 1)[1]
        results_dir = runs / key / "results"
        env = {"RESULTS_DIR": str(results_dir), "CHECKPOINT_DIR": str(runs / key / "checkpoints"),
               "DATA_DIR": str(runs / key / "data")}  # what a job writes as data (Lab-08's) stays in the test's folder
        weight = processes_of(entry["job"], script.read_text())
        if entry["site"] != training_site(relative):
            env["PATH"] = f"{stand_in}:{slurm_cluster.job_env['PATH']}"
            weight = 0  # a shell and Slurm's launcher: nothing to hold back
            stand_in_data(runs / key / "data")
        submissions.append(Submission(key=key, script=script, env=env, weight=weight))
        jobs[key] = (entry, script, results_dir)
    submissions.sort(key=lambda sub: -sub.weight)  # the heavy jobs first: no long one left at the end
    began = time.perf_counter()
    results = slurm_cluster.run_all(submissions, timeout=JOB_TIMEOUT, max_weight=MAX_PROCESSES)
    slurm_cluster.timings[f"all {len(submissions)} template jobs"] = time.perf_counter() - began
    return {key: RenderedJob(entry["site"], script, entry["job"], results_dir, results[key])
            for key, (entry, script, results_dir) in jobs.items()}


