"""Lab-08's staging job on the Slurm test cluster: the shards copied once per node to node-local storage under
a folder of the job's own, every copy checked, training from the copies on both nodes, the copies gone at the
end; and a node-local file system too small for the shards stops the job at once with one line.

The job itself runs with the other template jobs (tests/slurm/template_jobs.py, generic site); the too-small case
is submitted here, with NODE_LOCAL on a 256 KiB tmpfs mounted for the test (the test cluster runs as root).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import template_jobs as template_jobs_module
from common.results import load_records
from template_jobs import REPO_ROOT, render_sbatch

pytestmark = pytest.mark.slurm
SCRIPT = "labs/lab08_data_at_scale/sbatch/stage_and_train_2node.sbatch"


@pytest.fixture(scope="module")
def staged(slurm_cluster, tmp_path_factory):
    job = template_jobs_module.results(slurm_cluster, tmp_path_factory)[f"generic/{SCRIPT}"]
    return job, slurm_cluster.output(job.result.job_id) if job.result.job_id else job.result.reason


def test_shards_are_staged_once_per_node_checked_trained_from_and_removed(staged):
    job, log = staged
    assert job.result.ok, log[-4000:]
    root = re.search(r"staged per node under (\S+)", log)[1]
    assert root.endswith(f"hpc-dl-labs-lab08-{job.result.job_id}")  # a folder of this job's own
    copies = re.findall(r"^(n\d): staged (\d+) shard\(s\), \d+ bytes, to (\S+) in [\d.]+ s; checksums OK", log, re.M)
    staged = sorted((node, path) for node, _, path in copies)
    assert staged == [("n1", f"{root}/n1/shards"), ("n2", f"{root}/n2/shards")]
    assert sorted(re.findall(r"^(n\d): removed the staged copy", log, re.M)) == ["n1", "n2"]
    assert not Path(root).exists()  # cleaned up at the job's end
    records = {r["method"]: r for r in load_records(job.results_dir).records}
    training = records["shards-pad"]
    assert training["provenance"]["world_size"] == 2
    assert {entry["node"] for entry in training["provenance"]["placement"]} == {"n1", "n2"}
    assert training["metrics"]["exactly_once"] is True and training["config"]["shard_dir"].startswith(root)


def test_too_little_node_local_space_stops_the_job_at_start_with_one_line(slurm_cluster, staged, tmp_path):
    job, _ = staged
    small = tmp_path / "node-local"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], check=True)
    try:
        script = tmp_path / "stage.sbatch"
        template = render_sbatch.read_template(REPO_ROOT / f"{SCRIPT}.j2")
        script.write_text(render_sbatch.render(template, render_sbatch.find_site("generic"))[0])
        data = job.results_dir.parent / "data" / "lab08"  # the data set the template job made
        result = slurm_cluster.run(script, env={"NODE_LOCAL": str(small), "LAB08_DATA": str(data),
                                                "RESULTS_DIR": str(tmp_path / "results")}, timeout=120)
        log = slurm_cluster.output(result.job_id)
        assert result.state == "FAILED" and result.exit_code == 2, log[-3000:]
        # One line from each node that lacks the space (a node whose task srun stopped first may say nothing).
        errors = [line for line in log.splitlines() if line.startswith("error: ")]
        assert 1 <= len(errors) == len({line.split(":")[1] for line in errors}) <= 2, log[-3000:]
        for line in errors:
            assert re.fullmatch(rf"error: n\d: node-local storage {small} has \d+ bytes free; staging needs \d+ "
                                r"\(\d+ bytes of shards \+ 10%\): set NODE_LOCAL to a larger node-local folder", line)
        assert not (tmp_path / "results").exists() and list(small.iterdir()) == []  # nothing trained, nothing left
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_a_data_folder_without_shards_stops_the_job_at_start_with_one_line(slurm_cluster, tmp_path):
    """A plain sbatch after the README's step 1 read $DATA_DIR/lab08, where step 1 had written nothing: every node's
    copy failed in turn. One line now names the folder and the two ways out, before any step starts."""
    script = tmp_path / "stage.sbatch"
    template = render_sbatch.read_template(REPO_ROOT / f"{SCRIPT}.j2")
    script.write_text(render_sbatch.render(template, render_sbatch.find_site("generic"))[0])
    empty = tmp_path / "lab08"
    empty.mkdir()
    result = slurm_cluster.run(script, env={"LAB08_DATA": str(empty), "RESULTS_DIR": str(tmp_path / "results"),
                                            "HPC_DL_LABS_TINY": "0"}, timeout=120)
    log = slurm_cluster.output(result.job_id)
    assert result.state == "FAILED" and result.exit_code == 2, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: no shards in {empty}: set LAB08_DATA to the data set's folder (01_make_dataset.py "
                      "writes data/lab08 by default), or write one there: python "
                      f"labs/lab08_data_at_scale/01_make_dataset.py --data-dir {empty}"], log[-3000:]
    assert "checksums OK" not in log and not (tmp_path / "results").exists()  # no copy, no training
