"""The LANTA chapter's commands (docs/course-material.md), typed literally, submitted to the Slurm
test cluster. From the chapter folder::

    source ../../slurm/module-loads/pytorch.sh
    sbatch sbatch/single_gpu.sbatch
    sbatch sbatch/multi_gpu.sbatch

They run in a copy of the repository without ``.venv``, as a student whose PyTorch comes from a
cluster module (here: the test run's Python on ``PATH``, and a ``module`` shell function) has it,
with the site's setup lines on (``HPC_DL_LABS_SKIP_MODULES=0``). The jobs must run in the
environment the submitting shell had, and the single-GPU job must read MNIST from the folder the
README downloads it to (``~/data``; a tiny MNIST in torchvision's format is written there).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from common.results import load_records
from helpers import write_tiny_mnist

REPO_ROOT = Path(__file__).resolve().parents[2]
#: What the two jobs read: the shared package, the chapter, the job header and pytorch.sh.
COPIED = ("common", "chapters/ch04_deep_learning", "slurm/lib", "slurm/module-loads")
JOB_TIMEOUT = 420


def repository_copy(root: Path) -> Path:
    for relative in COPIED:
        shutil.copytree(REPO_ROOT / relative, root / relative,
                        ignore=shutil.ignore_patterns("__pycache__", "results", "checkpoints"))
    return root


def test_the_lanta_chapters_commands_as_typed_run_in_the_submitting_shells_environment(slurm_cluster, tmp_path):
    root = repository_copy(tmp_path / "repo")
    assert not (root / ".venv").exists()
    home = tmp_path / "home"
    write_tiny_mnist(home / "data", train=64, test=16)  # where `download_data.py mnist` puts it
    calls = tmp_path / "module-calls.log"
    chapter = root / "chapters" / "ch04_deep_learning"
    typed = f"""
set -euo pipefail
module() {{ echo "module $*" >> {calls}; }}   # the site's module command (Lmod's is a shell function too)
cd {chapter}
source ../../slurm/module-loads/pytorch.sh
sbatch --parsable --output={slurm_cluster.log_dir}/%x-%j.out sbatch/single_gpu.sbatch --dataset mnist
sbatch --parsable --output={slurm_cluster.log_dir}/%x-%j.out sbatch/multi_gpu.sbatch
"""
    env = {"HOME": str(home), "HPC_DL_LABS_SKIP_MODULES": "0", "HPC_DL_LABS_MODULES": "pytorch/2.4"}
    submitted = slurm_cluster.command("bash", "-c", typed, env=env)
    assert submitted.returncode == 0, submitted.stderr
    single, multi = (int(line.split(";")[0]) for line in submitted.stdout.split())
    assert calls.read_text().splitlines() == ["module load pytorch/2.4"]

    python = Path(sys.executable).parent / "python"  # the submitting shell's (the "module's") python
    for job_id in (single, multi):
        result = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT)
        log = slurm_cluster.output(job_id)
        assert result.ok, f"job {job_id} ended {result.state} exit {result.exit_code}\n{log[-4000:]}"
        assert f"pytorch.sh: python {python} " in log, log[-4000:]
        assert f"DATA_DIR={home / 'data'}" in log

    records = {record["script"]: record for record in load_records(root / "results").records}
    mnist = records["chapters/ch04_deep_learning/mnist_training.py"]
    assert mnist["status"] == "ok" and mnist["provenance"]["slurm"]["SLURM_JOB_ID"] == str(single)
    assert mnist["config"]["dataset"] == "mnist" and mnist["config"]["data_dir"] == str(home / "data")
    ddp = records["chapters/ch04_deep_learning/multi_gpu_ddp.py"]
    assert ddp["status"] == "ok" and ddp["provenance"]["world_size"] == 4
