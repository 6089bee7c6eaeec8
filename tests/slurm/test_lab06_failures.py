"""Lab-06 on a real scheduler: a hang diagnosed through ``srun --overlap``, and a crashed rank whose job
requeues itself and resumes to the uninterrupted run's final loss.

Both use ``labs/lab06_failures/sbatch/inject.sbatch.j2`` rendered for the generic site with 2 tasks of
one core each on one node (the test cluster does not confine tasks; see test_preemption.py). The jobs
of both tests are submitted together, so the hang's wait and the requeue's hold pass at the same time.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.results import load_records
from helpers import render_two_tasks, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = REPO_ROOT / "labs" / "lab06_failures" / "sbatch" / "inject.sbatch.j2"
DOCTOR = REPO_ROOT / "labs" / "lab06_failures" / "02_diagnose.py"
TINY = ("--steps", "6", "--checkpoint-every", "2", "--log-interval", "1", "--batch-size", "8", "--num-workers", "0")
DEADLINE_S = 90

pytestmark = pytest.mark.slurm
def two_task_script(tmp_path: Path) -> Path:
    return render_two_tasks(TEMPLATE, tmp_path / "inject.sbatch")


#: The collective timeout leaves the doctor 30 s (it answers in under a second on a quiet machine):
#: the template jobs keep both cores busy meanwhile (tests/slurm/template_jobs.py).
HANG_ARGS = (*TINY, "--fault", "skip-collective", "--rank", "1", "--step", "3", "--collective-timeout", "30")
CRASH_ARGS = (*TINY, "--fault", "crash-rank", "--rank", "1", "--step", "4")


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory) -> dict[str, tuple[int, dict[str, str]]]:
    """The three jobs of this file, submitted together: the hang, the crashed run and its uninterrupted
    reference. The hang waits out its collective timeout while the crashed job is held back before it
    requeues: both waits at once. Returns {name: (job id, the job's folders)}."""
    root = tmp_path_factory.mktemp("lab06-slurm")
    script = two_task_script(root)
    submitted = {}
    for name, args, extra in (("hang", HANG_ARGS, {"MAX_REQUEUES": "0"}), ("crashed", CRASH_ARGS, {}),
                              ("reference", TINY, {})):
        env = {"RESULTS_DIR": str(root / name / "results"), "RUN_DIR": str(root / name / "run"),
               "HPC_DL_LABS_TINY": "0", **extra}
        submitted[name] = (slurm_cluster.submit(script, script_args=args, env=env), env)
    return submitted


def test_a_hang_under_srun_is_named_by_the_doctor_through_srun_overlap(slurm_cluster, jobs, tmp_path):
    job_id, env = jobs["hang"]
    run_dir = Path(env["RUN_DIR"])
    ledger = run_dir / "ledger" / "rank1.json"
    wait_for(lambda: ledger.exists() and "barrier(end of run)" in ledger.read_text(), 240, "the hang")
    doctor = subprocess.run([sys.executable, str(DOCTOR), "--job", str(job_id), "--run-dir", str(run_dir),
                             "--results-dir", str(tmp_path / "doctor")], capture_output=True, text=True, timeout=120,
                            env=slurm_cluster.environment())
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "looked at 2 rank(s)" in doctor.stdout, doctor.stdout
    assert ("verdict: rank(s) 1 skipped the all_reduce(gradients) of step 3 and left the loop; the others wait in it"
            in doctor.stdout), doctor.stdout
    result = slurm_cluster.wait(job_id, timeout=DEADLINE_S + 60)
    log = slurm_cluster.output(job_id)
    assert result.state == "FAILED", log[-3000:]
    assert len(re.findall(r"diagnosis: rank\(s\) 1 skipped the all_reduce\(gradients\) of step 3", log)) == 1, \
        log[-3000:]


def test_a_crashed_rank_requeues_the_job_which_resumes_to_the_uninterrupted_loss(slurm_cluster, jobs):
    (crashed, runs_crashed), (reference, runs_reference) = jobs["crashed"], jobs["reference"]
    result = slurm_cluster.wait(crashed, timeout=400)  # requeued jobs are held back ~15 s on the test cluster
    log = slurm_cluster.output(crashed)
    assert result.ok, f"{result}\n{log[-3000:]}"
    assert "crash-rank: exiting at step 4" in log and f"requeueing job {crashed}" in log, log[-3000:]
    assert "at step 2 (restart 1)" in log and "SLURM_RESTART_COUNT=1" in log, log[-3000:]
    assert slurm_cluster.wait(reference, timeout=300).ok
    (resumed,) = [r for r in load_records(runs_crashed["RESULTS_DIR"]).records if r["status"] == "ok"]
    (uninterrupted,) = load_records(runs_reference["RESULTS_DIR"]).records
    assert resumed["metrics"]["final_loss"] == uninterrupted["metrics"]["final_loss"]
    assert resumed["metrics"]["restarts"] == 1
