"""Pre-emption on a real scheduler: signalled mid-epoch, requeued, resumed, same parameters.

Chapter 4's multi_gpu.sbatch (2 ranks via srun, rendered for the generic site) runs twice with the
same seed and settings: job A gets SIGUSR1 mid-epoch the way ``#SBATCH --signal=B:USR1@120``
delivers it (to the batch shell only: ``scancel --signal=USR1 --batch``); the script forwards it
to the training, which saves its checkpoint atomically and exits 0, and the script requeues the
job. Slurm holds a requeued job back for the credential lifetime (``cred_expire``: 120 s by
default, 15 s on the test cluster) and then starts it again by itself; nothing here releases it
early (a node refuses a requeued job while it still holds the job's revoked credential). The second
run of A resumes mid-epoch (``--resume``) and must end with parameters bitwise equal (on the CPU)
to job B's, which ran without interruption.

``scancel --batch`` is used rather than a short ``--time`` with ``--signal=B:USR1@N``: Slurm checks
its timers about once a minute, so that signal can come up to 60 s early, and a test cannot place
it inside an epoch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.results import load_records
from helpers import render_two_tasks, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = REPO_ROOT / "chapters" / "ch04_deep_learning" / "sbatch" / "multi_gpu.sbatch.j2"
#: One epoch of many small steps: the digits' 1438 training samples, 4 per rank per step (180
#: steps), every step logged, so the test can see training under way and signal inside the epoch.
STEPS = 180
TRAIN_ARGS = ("--dataset", "digits", "--epochs", "1", "--batch-size", "4", "--log-interval", "1",
              "--num-workers", "0", "--seed", "7")
STEP_LINE = re.compile(r"epoch 1 step (\d+)/")

pytestmark = pytest.mark.slurm




def two_rank_script(tmp_path: Path) -> Path:
    """multi_gpu.sbatch for the generic site with 2 GPUs: 2 tasks on one node (helpers.render_two_tasks)."""
    return render_two_tasks(TEMPLATE, tmp_path / "multi_gpu_2.sbatch")


def test_signalled_mid_epoch_then_requeued_resumes_to_the_same_parameters(slurm_cluster, tmp_path):
    script = two_rank_script(tmp_path)
    runs = {name: {"RESULTS_DIR": str(tmp_path / name / "results"), "CHECKPOINT_DIR": str(tmp_path / name / "ckpt"),
                   "HPC_DL_LABS_TINY": "0"} for name in ("preempted", "reference")}
    preempted = slurm_cluster.submit(script, script_args=TRAIN_ARGS, env=runs["preempted"])
    reference = slurm_cluster.submit(script, script_args=TRAIN_ARGS, env=runs["reference"])

    def steps_logged() -> int:
        return len(STEP_LINE.findall(slurm_cluster.output(preempted)))

    wait_for(lambda: steps_logged() >= 3, 240, "job A to train a few steps")
    signalled = slurm_cluster.command("scancel", "--signal=USR1", "--batch", str(preempted))
    assert signalled.returncode == 0, signalled.stderr

    def requeued() -> bool:
        # Back in the queue with a restart counted, held until its begin time (Reason=BeginTime).
        info = slurm_cluster.job_info(preempted)
        return (info.get("JobState") == "PENDING" and int(info.get("Restarts", "0")) >= 1
                and info.get("Reason") == "BeginTime")

    wait_for(requeued, 120, "job A to requeue itself", poll=0.25)
    result = slurm_cluster.wait(preempted, timeout=300)
    log = slurm_cluster.output(preempted)
    assert result.ok, (f"{result}\n{log[-3000:]}\n"
                       f"== the daemons about job {preempted}:\n{slurm_cluster.daemon_log(preempted)}")
    reference_result = slurm_cluster.wait(reference, timeout=300)
    assert reference_result.ok, slurm_cluster.output(reference)[-4000:]

    checkpoint = Path(runs["preempted"]["CHECKPOINT_DIR"]) / f"multi_gpu-{preempted}.pt"
    saved = re.search(rf"received SIGUSR1: saved {re.escape(str(checkpoint))} at epoch 1 step (\d+)", log)
    assert saved, log[-4000:]
    step = int(saved[1])
    assert 0 < step < STEPS, f"signalled at step {step}: not inside the epoch (steps 0-{STEPS - 1})"
    assert f"checkpoint saved; requeueing job {preempted}" in log
    assert f"resumed from {checkpoint}: epoch 1, step {step}" in log  # the requeued run, mid-epoch
    assert "SLURM_RESTART_COUNT=1" in log  # --open-mode=append kept both runs in one log
    assert "parameters identical on all 2 rank(s): yes" in log

    # Atomic checkpoint: the final file and nothing else (no .multi_gpu-N.pt.tmp left behind).
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == [checkpoint.name]

    (resumed,) = load_records(runs["preempted"]["RESULTS_DIR"]).records
    (uninterrupted,) = load_records(runs["reference"]["RESULTS_DIR"]).records
    assert resumed["metrics"]["replica_digests"] == uninterrupted["metrics"]["replica_digests"]
    assert resumed["metrics"]["parameters_identical"] is True
    assert resumed["metrics"]["train_loss"] == uninterrupted["metrics"]["train_loss"]


def test_scancel_stops_a_preemptible_job_for_good(slurm_cluster, tmp_path):
    """SIGTERM (scancel) is not a pre-emption: the job must end CANCELLED, not requeue itself."""
    script = two_rank_script(tmp_path)
    env = {"RESULTS_DIR": str(tmp_path / "results"), "CHECKPOINT_DIR": str(tmp_path / "ckpt"), "HPC_DL_LABS_TINY": "0"}
    job_id = slurm_cluster.submit(script, script_args=TRAIN_ARGS, env=env)
    wait_for(lambda: STEP_LINE.search(slurm_cluster.output(job_id)), 240, "the job to train")
    assert slurm_cluster.command("scancel", str(job_id)).returncode == 0
    # wait() returns once the job's state is final: Slurm shows COMPLETING until the batch script and
    # its steps have ended, so whatever the script did about the signal (a `scontrol requeue` runs to
    # its end before the script goes on) is done and counted by then; no sleep, no race with the scheduler.
    result = slurm_cluster.wait(job_id, timeout=60)
    assert result.state == "CANCELLED", result
    info = slurm_cluster.job_info(job_id)
    assert (info.get("JobState"), info.get("Restarts")) == ("CANCELLED", "0"), info
    assert "requeueing" not in slurm_cluster.output(job_id)
