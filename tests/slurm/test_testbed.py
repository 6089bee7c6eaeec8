"""The Slurm test cluster really schedules the course's rendered templates.

Every site's rendering of slurm/examples/hello.sbatch.j2 is submitted to a real 2-node Slurm and
must end COMPLETED with exit 0; the 2-node allocation must reach both nodes with a MASTER_ADDR that
resolves; sbatch itself must refuse GPU models, features and GPU counts that no node has, the way a
real cluster does; two multi-process jobs share a node without sharing a port; and a cluster left
behind by a killed run is stopped by the next start.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from common.runtime import launch
from common.slurm.sites import site_names
from helpers import load_script, wait_for
from testbed import SlurmTestCluster
from testbed.daemons import running_clusters
from testbed.resources import NodeResources

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTBED = [sys.executable, str(REPO_ROOT / "tests" / "testbed")]  # python tests/testbed COMMAND
HELLO = REPO_ROOT / "slurm" / "examples" / "hello.sbatch.j2"
#: A 1-node cluster that claims little: quick to start, for the tests that start clusters of their own.
SMALL = NodeResources(partitions=("cpu",), gpus=(("a100", 1),), cpus=4, mem_mb=4000)

pytestmark = pytest.mark.slurm




render_sbatch = load_script("scripts/render_sbatch.py")


@pytest.fixture(scope="module")
def hello_jobs(slurm_cluster, tmp_path_factory):
    """hello rendered for every site, all submitted at once, each waited for: {site: (id, result)}."""
    out_dir = tmp_path_factory.mktemp("rendered")
    assert render_sbatch.main(["--all-sites", str(out_dir), str(HELLO)]) == 0
    manifest = json.loads((out_dir / "manifest.json").read_text())
    submitted = {entry["site"]: slurm_cluster.submit(out_dir / entry["script"]) for entry in manifest}
    return {site: (job_id, slurm_cluster.wait(job_id, timeout=60)) for site, job_id in submitted.items()}


def test_every_site_rendering_completes(slurm_cluster, hello_jobs):
    assert set(hello_jobs) == set(site_names())
    for site, (job_id, result) in hello_jobs.items():
        log = slurm_cluster.output(job_id)
        assert result.ok, f"{site}: job {job_id} ended {result.state} exit {result.exit_code}\n{log}"
        assert "hello done: 2 node(s), device cpu" in log, f"{site}:\n{log}"
        sites_partition = render_sbatch.find_site(site).default_partitions["gpu"]
        assert f"SLURM_JOB_PARTITION={sites_partition}" in log


def test_two_node_job_reaches_both_nodes_and_resolves_master_addr(slurm_cluster, hello_jobs):
    job_id, result = hello_jobs["generic"]
    log = slurm_cluster.output(job_id)
    assert result.ok, log
    assert "SLURM_JOB_NODELIST=n[1-2]" in log
    hosts = slurm_cluster.command("scontrol", "show", "hostnames", "n[1-2]").stdout.split()
    assert hosts == ["n1", "n2"]
    tasks = re.findall(r"task (\d) of 2 on node (n\d): MASTER_ADDR=(\S+) resolves to (\S+)", log)
    assert sorted(tasks) == [("0", "n1", "n1", "127.0.0.1"), ("1", "n2", "n1", "127.0.0.1")], log
    port = int(re.search(r"MASTER_PORT=(\d+)", log)[1])
    assert port == launch.port_from_job(job_id)  # the job header and common/runtime/launch.py agree


def test_reservation_and_account_reach_the_job(slurm_cluster, hello_jobs):
    job_id, result = hello_jobs["carc-discovery"]
    log = slurm_cluster.output(job_id)
    assert result.ok, log
    site = render_sbatch.find_site("carc-discovery")
    assert f"SLURM_JOB_RESERVATION={site.reservation}" in log
    assert f"SLURM_JOB_ACCOUNT={site.account}" in log


def _site_with_gpu(model: str, count: int, features: tuple[str, ...] = ()):
    """generic's profile, but its gpu partition claims GPUs no test-cluster node has."""
    site = render_sbatch.find_site("generic")
    gpu = dataclasses.replace(site.partitions["gpu"], gpu_types=(model,), typed_gres=True,
                              gpus_per_node=count, cpus_per_gpu=1, features=features)
    return dataclasses.replace(site, partitions={**site.partitions, "gpu": gpu})


@pytest.mark.parametrize(
    ("settings", "site", "message"),
    [
        ({"gpu_type": "h100"}, _site_with_gpu("h100", 8), "Requested node configuration is not available"),
        ({"gpu_type": "a100", "gpus_per_node": 5}, _site_with_gpu("a100", 8),
         "Requested node configuration is not available"),
        ({"constraint": "h100"}, _site_with_gpu("a100", 1, ("h100",)), "Invalid feature specification"),
    ],
    ids=["gpu-model-no-node-has", "more-gpus-than-a-node-has", "unknown-feature"],
)
def test_sbatch_refuses_what_no_node_has(slurm_cluster, tmp_path, settings, site, message):
    text, _ = render_sbatch.render(render_sbatch.read_template(HELLO), site, settings)
    script = tmp_path / "impossible.sbatch"
    script.write_text(text)
    with pytest.raises(Exception) as raised:
        slurm_cluster.submit(script)
    assert type(raised.value).__name__ == "SbatchRejected"
    assert message in raised.value.stderr


def test_a_failing_task_fails_the_job_quickly(slurm_cluster, tmp_path):
    script = tmp_path / "one_task_fails.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=2 --ntasks-per-node=1 --time=00:02:00\n"
        "set -euo pipefail\n"
        "source slurm/lib/job_header.sh\n"
        "# task 1 fails at once; --kill-on-bad-exit=1 must stop task 0's long sleep\n"
        "srun --kill-on-bad-exit=1 bash -c '[[ $SLURM_PROCID == 1 ]] && exit 3; sleep 60'\n"
    )
    result = slurm_cluster.run(script, timeout=45)
    log = slurm_cluster.output(result.job_id)
    assert result.state == "FAILED", log
    assert result.exit_code != 0
    assert "task 1: Exited with exit code 3" in log
    assert result.seconds < 30  # not the 60 s sleep of the surviving task


def test_testbed_status_env_and_refusal_to_start_twice(slurm_cluster):
    directory = str(slurm_cluster.directory)
    status = subprocess.run([*TESTBED, "status", "--dir", directory], capture_output=True, text=True)
    assert status.returncode == 0, status.stdout + status.stderr
    assert re.search(r"slurmd-n2\s+pid \d+\s+running", status.stdout)
    assert f"a test cluster runs in {directory} (run {os.getpid()} running;" in status.stdout
    env = subprocess.run([*TESTBED, "env", "--dir", directory], capture_output=True, text=True)
    assert env.stdout.strip() == f"export SLURM_CONF={directory}/slurm.conf"
    again = subprocess.run([*TESTBED, "start", "--dir", directory], capture_output=True, text=True)
    assert again.returncode == 1
    assert again.stderr.startswith("testbed: error: a test cluster is already running in")


#: Both jobs hold their process group until the other one has its own: rendezvous at the same time.
RENDEZVOUS_PROBE = """
import os, pathlib, sys, time
from common.runtime.distributed import all_reduce_sum, init_distributed, teardown_distributed
ctx = init_distributed("cpu")
total = all_reduce_sum(ctx.rank + 1)  # 1 + 2 with two ranks of this job, whatever the other job does
meeting = pathlib.Path(sys.argv[1])
if ctx.is_main:
    (meeting / os.environ["SLURM_JOB_ID"]).touch()
deadline = time.monotonic() + 120
while len(list(meeting.iterdir())) < 2 and time.monotonic() < deadline:
    time.sleep(0.2)
both = len(list(meeting.iterdir())) == 2
teardown_distributed(ctx)
print(f"rank {ctx.rank}: world {ctx.world_size}, port {ctx.launch.master_port}, sum {total:.0f},"
      f" other job seen {both}", flush=True)
sys.exit(0 if both and total == 3 else 1)
"""


def test_two_multi_process_jobs_on_one_node_at_once_both_finish(slurm_cluster, tmp_path):
    """Two 2-rank jobs on node n1, each holding its process group until the other has its own: both
    complete, each on the port its job id gives (which tests/test_master_port.py checks over the
    whole range: the old formula, 20000 + (job id x 16) mod 10000, gave jobs 625 ids apart one port)."""
    probe = tmp_path / "rendezvous.py"
    probe.write_text(RENDEZVOUS_PROBE)
    meeting = tmp_path / "meeting"
    meeting.mkdir()
    script = tmp_path / "rendezvous.sbatch"
    script.write_text("#!/bin/bash\n"
                      "#SBATCH --nodes=1 --ntasks=2 --nodelist=n1 --time=00:05:00\n"
                      "set -euo pipefail\n"
                      "source slurm/lib/job_header.sh\n"
                      f"srun --kill-on-bad-exit=1 python {probe} {meeting}\n")
    env = {"PYTHONPATH": str(REPO_ROOT), "HPC_DL_LABS_DIST_TIMEOUT": "60"}
    jobs = [slurm_cluster.submit(script, env=env) for _ in range(2)]
    results = [slurm_cluster.wait(job_id, timeout=240) for job_id in jobs]
    logs = [slurm_cluster.output(job_id) for job_id in jobs]
    for result, log in zip(results, logs):
        assert result.ok, f"{result}\n{log[-3000:]}"
        assert sorted(re.findall(r"rank (\d): world 2, port \d+, sum 3, other job seen True", log)) == ["0", "1"], log
    ports = [int(re.search(r"MASTER_PORT=(\d+)", log)[1]) for log in logs]
    assert ports == [launch.port_from_job(job_id) for job_id in jobs] and ports[0] != ports[1]


#: A test run, as far as its cluster goes: start one (owned by this process), put a job on it, wait.
RUN_WITH_A_CLUSTER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from testbed import SlurmTestCluster
from testbed.resources import NodeResources
directory, script = Path(sys.argv[2]), Path(sys.argv[3])
cluster = SlurmTestCluster(directory=directory, nodes=1, resources=NodeResources(**eval(sys.argv[4])),
                           log_dir=script.parent / "left-behind-logs")
cluster.start()
job = cluster.submit(script, env={"HPC_DL_LABS_LEFT_BEHIND": str(directory)})
while cluster.job_info(job).get("JobState") != "RUNNING":
    time.sleep(0.2)
print("cluster up, job running", flush=True)
time.sleep(600)
"""


def processes_marked(directory: Path) -> list[int]:
    """The processes of the left-behind run's job (its environment carries the run's directory)."""
    found, mark = [], f"HPC_DL_LABS_LEFT_BEHIND={directory}".encode()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_a_cluster_left_behind_by_a_killed_run_is_stopped_by_the_next_start(slurm_cluster, tmp_path):
    """A run that is killed (here SIGKILL: no clean-up at all) leaves its cluster and its job running;
    the next start finds them (the owner recorded in the daemons' environment is gone) and stops
    them, and leaves alone the cluster of a run that is still alive (this session's)."""
    # Not under tmp_path: munged wants every directory above its socket open to all (pytest's are 0700).
    left, job = Path(tempfile.mkdtemp(prefix="hpc-dl-labs-slurm-left-")), tmp_path / "sleep.sbatch"
    job.write_text("#!/bin/bash\n#SBATCH --time=00:10:00\nsleep 300\n")
    claims = repr(dataclasses.asdict(SMALL))
    log = tmp_path / "run.log"
    with open(log, "w") as output:
        run = subprocess.Popen([sys.executable, "-c", RUN_WITH_A_CLUSTER, str(REPO_ROOT / "tests"), str(left),
                                str(job), claims], stdout=output, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wait_for(lambda: "cluster up, job running" in log.read_text() or run.poll() is not None, 120,
                 "the run to start its cluster and job")
        assert run.poll() is None, log.read_text()
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
    finally:
        if run.poll() is None:
            run.kill()
    assert running_clusters()[left].left_behind  # its daemons run on, their owner is gone
    assert processes_marked(left)  # and so does its job

    following = SlurmTestCluster(nodes=1, resources=SMALL, log_dir=tmp_path / "next-logs")
    following.start()
    try:
        assert [cluster.directory for cluster in following.left_behind] == [left]
        assert left not in running_clusters() and not left.exists()
        wait_for(lambda: not processes_marked(left), 10, "the left-behind job's processes to end")
        assert slurm_cluster.testbed.running()  # this session's cluster: its run is alive
    finally:
        following.stop()
