"""common/runtime/launch.py on a real Slurm: a batch script is one process, an srun step is N ranks.

A batch script has SLURM_PROCID=0 and SLURM_NTASKS=N of its allocation, but it is one process:
``detect_launch`` must call it "single". Inside ``srun`` every task has SLURM_STEP_ID and
SLURM_STEP_NUM_TASKS, and must see its own rank, the step's world size and the first node as
MASTER_ADDR. ``common.runtime.launch`` imports no torch, so this costs no more than the scheduling.
"""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.slurm

PROBE = ("import json; from common.runtime.launch import detect_launch; "
         "print('LAUNCH', json.dumps(detect_launch().as_dict()), flush=True)")


def test_batch_script_is_single_and_srun_tasks_are_ranks(slurm_cluster, tmp_path):
    script = tmp_path / "launch.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=2 --ntasks-per-node=2 --time=00:02:00\n"
        "set -euo pipefail\n"
        'echo "BATCH STEP_ID=${SLURM_STEP_ID-unset} STEP_NUM_TASKS=${SLURM_STEP_NUM_TASKS-unset}'
        ' PROCID=${SLURM_PROCID-unset} NTASKS=${SLURM_NTASKS-unset}"\n'
        f'python -c "{PROBE}"\n'
        "# MASTER_ADDR is not exported here, so each task falls back to the step's first node\n"
        f'srun --kill-on-bad-exit=1 python -c "{PROBE}"\n'
        "srun --kill-on-bad-exit=1 bash -c 'echo \"STEP STEP_ID=$SLURM_STEP_ID"
        " STEP_NUM_TASKS=$SLURM_STEP_NUM_TASKS PROCID=$SLURM_PROCID\"'\n")
    result = slurm_cluster.run(script, timeout=120)  # from the repository root: `python -c` imports common
    log = slurm_cluster.output(result.job_id)
    assert result.ok, log

    assert "BATCH STEP_ID=unset STEP_NUM_TASKS=unset PROCID=0 NTASKS=4" in log
    launches = [json.loads(line.split(" ", 1)[1]) for line in log.splitlines() if line.startswith("LAUNCH ")]
    batch, tasks = launches[0], sorted(launches[1:], key=lambda info: info["rank"])
    assert batch["launcher"] == "single" and batch["world_size"] == 1
    assert [(t["launcher"], t["rank"], t["local_rank"], t["node_rank"], t["world_size"]) for t in tasks] == [
        ("slurm", 0, 0, 0, 4), ("slurm", 1, 1, 0, 4), ("slurm", 2, 0, 1, 4), ("slurm", 3, 1, 1, 4)]
    assert {t["master_addr"] for t in tasks} == {"n1"}
    assert len({t["master_port"] for t in tasks}) == 1  # every task computes the same port
    steps = re.findall(r"STEP STEP_ID=(\d+) STEP_NUM_TASKS=(\d+) PROCID=(\d)", log)
    assert sorted(steps) == [("1", "4", "0"), ("1", "4", "1"), ("1", "4", "2"), ("1", "4", "3")]
