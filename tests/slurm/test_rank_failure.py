"""One rank of a 2-process DDP run dies: the whole run must fail within a minute, not hang.

The survivor is blocked in an all-reduce that will never complete. Two things can end it: the
launcher (torchrun notices a dead worker and stops the rest; ``srun --kill-on-bad-exit=1`` does the
same for a step's tasks), and Gloo itself (the peer's socket closes). Without either, it would wait
for the process group's timeout (HPC_DL_LABS_DIST_TIMEOUT, 600 s by default). Both launchers are
tested with Chapter 4's multi_gpu_ddp.py: under torchrun directly (no Slurm needed), and under
srun on the test cluster through multi_gpu.sbatch.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import load_script, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "chapters" / "ch04_deep_learning" / "multi_gpu_ddp.py"
TEMPLATE = REPO_ROOT / "chapters" / "ch04_deep_learning" / "sbatch" / "multi_gpu.sbatch.j2"
#: Long enough that nothing ends by itself before the kill: 3 epochs of 360 logged steps.
TRAIN_ARGS = ("--dataset", "digits", "--epochs", "3", "--batch-size", "2", "--log-interval", "1",
              "--num-workers", "0")
DEADLINE_S = 60


def processes_with(variables: dict[str, str], command_part: str) -> list[int]:
    """PIDs whose environment holds ``variables`` and whose command line contains ``command_part``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = dict(item.split("=", 1) for item in
                           (proc / "environ").read_bytes().decode(errors="replace").split("\0") if "=" in item)
        except (OSError, ValueError):
            continue  # gone, or not ours to read
        if command_part in cmdline and all(environ.get(k) == v for k, v in variables.items()):
            found.append(int(proc.name))
    return found


@pytest.mark.slow
def test_torchrun_stops_the_run_when_one_worker_is_killed(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    output: list[str] = []
    proc = subprocess.Popen(
        [str(torchrun), "--standalone", "--nproc_per_node=2", str(SCRIPT), "--device", "cpu", *TRAIN_ARGS,
         "--checkpoint", str(tmp_path / "ckpt.pt"), "--results-dir", str(tmp_path / "results")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={**os.environ, "HPC_DL_LABS_TEST_MARK": str(tmp_path)}, start_new_session=True)
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("epoch 1 step " in line for line in output), 180, "training to start")
        (victim,) = processes_with({"HPC_DL_LABS_TEST_MARK": str(tmp_path), "LOCAL_RANK": "1"}, "multi_gpu_ddp.py")
        killed_at = time.perf_counter()
        os.kill(victim, signal.SIGKILL)
        returncode = proc.wait(timeout=DEADLINE_S + 30)
        seconds = time.perf_counter() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the session started above: torchrun and its workers
            proc.wait()
    reader.join(timeout=5)
    log = "".join(output)
    print(f"torchrun: rank 1 killed, the run exited {returncode} after {seconds:.1f} s")
    assert returncode != 0, log[-3000:]
    assert seconds < DEADLINE_S, f"the run took {seconds:.0f} s to fail after rank 1 was killed"
    assert re.search(r"exitcode\s*:\s*-9", log) or "Signal 9 (SIGKILL)" in log, log[-3000:]
    assert not processes_with({"HPC_DL_LABS_TEST_MARK": str(tmp_path)}, "multi_gpu_ddp.py")  # rank 0 is gone too




@pytest.mark.slurm
def test_srun_kill_on_bad_exit_stops_the_job_when_one_rank_is_killed(slurm_cluster, tmp_path):
    render_sbatch = load_script("scripts/render_sbatch.py")
    text, _ = render_sbatch.render(render_sbatch.read_template(TEMPLATE), render_sbatch.find_site("generic"),
                                   {"gpus_per_node": 2, "cpus_per_task": 1})
    script = tmp_path / "multi_gpu_2.sbatch"
    script.write_text(text)
    env = {"RESULTS_DIR": str(tmp_path / "results"), "CHECKPOINT_DIR": str(tmp_path / "ckpt"), "HPC_DL_LABS_TINY": "0"}
    job_id = slurm_cluster.submit(script, script_args=TRAIN_ARGS, env=env)
    wait_for(lambda: "epoch 1 step " in slurm_cluster.output(job_id), 240, "training to start")
    (victim,) = processes_with({"SLURM_JOB_ID": str(job_id), "SLURM_PROCID": "1"}, "multi_gpu_ddp.py")
    killed_at = time.perf_counter()
    os.kill(victim, signal.SIGKILL)
    result = slurm_cluster.wait(job_id, timeout=DEADLINE_S + 30)
    seconds = time.perf_counter() - killed_at
    log = slurm_cluster.output(job_id)
    slurm_cluster.timings["srun: rank 1 killed, job failed after"] = seconds
    assert result.state == "FAILED" and result.exit_code != 0, log[-3000:]
    assert seconds < DEADLINE_S, f"the job took {seconds:.0f} s to fail after rank 1 was killed"
    assert re.search(r"task 1: (Killed|Exited with exit code)", log), log[-3000:]
    assert not processes_with({"SLURM_JOB_ID": str(job_id)}, "multi_gpu_ddp.py")
