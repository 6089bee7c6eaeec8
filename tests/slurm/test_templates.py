"""Every sbatch template of the course, rendered for every site, runs on the Slurm test cluster.

What CI submits is exactly what ``python scripts/render_sbatch.py --all-sites OUT chapters labs``
writes: one script per template and site, every one submitted. Each template **trains for real on
one site** (generic, or the first site that can run it: the A100 and V100 benchmarks): tiny (``HPC_DL_LABS_TINY=1``),
it must end COMPLETED with exit 0 and leave a valid result record written by that very job (its
Slurm job id is in the record) in the folder its ``RESULTS_DIR`` names. The 2-node DDP jobs must
reach both nodes with every rank and end with identical parameters on all ranks.

The **renderings for the other sites** differ from that one in their ``#SBATCH`` lines (partition,
GPU type, account, reservation, cores) and module lines, not in the Python they run: they are
submitted too and must be accepted, get their allocation, run the job header and launch every step
with the right tasks, but ``python``, ``torchrun`` and ``kernprof`` are a stand-in there that prints
how it was started (task, step size, node, arguments) and exits. Training the same tiny run once per
site cost most of CI's time (each Python process imports torch: seconds of CPU on a 2-core machine).

A request no site can satisfy is refused by the renderer before a job exists, and by sbatch when it
gets that far. The jobs run a few at a time (:meth:`SlurmTestCluster.run_all`), in the background
from the moment the cluster is up (tests/slurm/template_jobs.py).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import template_jobs as template_jobs_module
from common.results import load_records
from template_jobs import (LAUNCHED, PAIRS, REPO_ROOT, SITES, STAND_IN_LINE, TRAINED, RenderedJob, render_sbatch,
                           training_site)
from testbed import SbatchRejected

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def template_jobs(slurm_cluster, tmp_path_factory) -> dict[str, RenderedJob]:
    """Every template rendered for every site (--all-sites) and submitted: {"site/script": RenderedJob}.
    The jobs started in the background with the cluster (tests/slurm/template_jobs.py)."""
    return template_jobs_module.results(slurm_cluster, tmp_path_factory)


def job_log(slurm_cluster, job: RenderedJob) -> str:
    return slurm_cluster.output(job.result.job_id) if job.result.job_id else job.result.reason


def test_every_template_is_rendered_for_every_site_that_can_run_it():
    templates = {Path(script).name for _, script in PAIRS}
    assert {"single_gpu.sbatch", "multi_gpu.sbatch", "baseline_1gpu.sbatch", "dp_4gpu.sbatch",
            "ddp_torchrun_4gpu.sbatch", "ddp_srun_2node.sbatch", "ddp_torchrun_2node.sbatch"} <= templates
    for site in SITES:  # every site runs at least the single-GPU and the 2-node jobs
        assert (site, "chapters/ch04_deep_learning/sbatch/single_gpu.sbatch") in PAIRS
        assert (site, "labs/lab01_dp_vs_ddp/sbatch/ddp_srun_2node.sbatch") in PAIRS


def assert_completed_on_its_partition(slurm_cluster, job: RenderedJob) -> str:
    log = job_log(slurm_cluster, job)
    assert job.result.ok, (f"{job.site}/{job.script.name}: job {job.result.job_id} ended {job.result.state} "
                           f"exit {job.result.exit_code}\n{log[-4000:]}")
    assert f"SLURM_JOB_PARTITION={job.job['partition']}" in log
    # The test cluster's GPUs are not real (HPC_DL_LABS_FAKE_GPUS=1): every job ran on the CPU.
    assert "DEVICE=cpu" in log
    if job.job["gpus_per_node"]:  # the header saw Slurm's GPU allocation: on a real cluster it would ask for cuda
        assert "== note: HPC_DL_LABS_FAKE_GPUS=1 (the test cluster): the allocated GPU(s) are not real" in log
    return log


@pytest.mark.parametrize("script", TRAINED, ids=[f"{training_site(s)}:{Path(s).name}" for s in TRAINED])
def test_template_trains_on_one_site_and_leaves_its_record(slurm_cluster, template_jobs, script):
    job = template_jobs[f"{training_site(script)}/{script}"]
    log = assert_completed_on_its_partition(slurm_cluster, job)
    assert "STAND-IN" not in log
    loaded = load_records(job.results_dir)
    assert not loaded.errors, loaded.errors
    assert loaded.records, f"{job.site}/{script}: no result record in {job.results_dir}\n{log[-3000:]}"
    for record in loaded.records:  # written by this job (or by a task of this job array)
        slurm = record["provenance"]["slurm"]
        assert slurm.get("SLURM_ARRAY_JOB_ID", slurm["SLURM_JOB_ID"]) == str(job.result.job_id)
    # Lab-03 records a precision the CPU cannot run as "skipped", with the reason; nothing failed.
    assert {record["status"] for record in loaded.records} <= {"ok", "skipped"}
    assert any(record["status"] == "ok" for record in loaded.records)


@pytest.mark.parametrize(("site", "script"), LAUNCHED, ids=[f"{site}:{Path(script).name}" for site, script in LAUNCHED])
def test_rendering_for_every_other_site_is_accepted_and_launches_its_steps(slurm_cluster, template_jobs, site,
                                                                           script):
    """Each step started its tool once per task: srun's tasks run python (or kernprof), and
    torchrun once per node (it would start the GPUs' workers), in every task of a job array (its
    log holds every array task's); a tool the batch script runs itself, outside any step (Lab-05's
    scaling study, which starts its own srun steps), once per batch script; every script it names exists."""
    job = template_jobs[f"{site}/{script}"]
    log = assert_completed_on_its_partition(slurm_cluster, job)
    steps: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for tool, task, tasks, args in STAND_IN_LINE.findall(log):
        launched = next((arg for arg in args.split() if arg.endswith(".py")), None)
        if launched is not None:  # python -c ... in a module line is not a step of the job
            assert (REPO_ROOT / launched).is_file(), f"{site}/{script} starts {launched}, which does not exist"
            steps.setdefault((tool, launched), []).append((task, tasks))
    assert steps, f"{site}/{script}: no step was launched\n{log[-3000:]}"
    # A job array's log is every array task's that Slurm still lists, each opened by the job header's line.
    is_array = "#SBATCH --array=" in job.script.read_text()
    copies = len(re.findall(r"^== job \d+_\d+ \(job id \d+\) ", log, re.M)) if is_array else 1
    assert copies >= 1, log[-3000:]
    for (tool, launched), tasks in steps.items():
        if all(of == "none" for _, of in tasks):  # the batch script's own call: no step, so no step size
            assert len(tasks) == copies, (tool, launched, log[-3000:])
            continue
        size = job.job["nodes"] if tool == "torchrun" else job.job["ntasks"]
        assert sorted(tasks) == sorted([(str(rank), str(size)) for rank in range(size)] * copies), (
            tool, launched, log[-3000:])


def _generic(template_jobs, script: str) -> tuple[RenderedJob, dict]:
    job = template_jobs[f"generic/{script}"]
    assert job.result.ok, job.result
    records = load_records(job.results_dir).records
    assert len(records) == 1
    return job, records[0]


def _digests(record: dict) -> list:
    """Each rank's parameter digest, in rank order."""
    return [entry["parameters"] for entry in record["metrics"]["replica_digests"]]


def test_two_node_ddp_via_srun_runs_one_rank_per_gpu_on_both_nodes(slurm_cluster, template_jobs):
    job, record = _generic(template_jobs, "labs/lab01_dp_vs_ddp/sbatch/ddp_srun_2node.sbatch")
    log = slurm_cluster.output(job.result.job_id)
    placement = sorted(re.findall(r"task (\d) of 4: node (n\d), local rank (\d)", log))
    assert placement == [("0", "n1", "0"), ("1", "n1", "1"), ("2", "n2", "0"), ("3", "n2", "1")], log
    assert "ddp: 4 process(es), backend gloo, launcher slurm" in log
    assert sorted(re.findall(r"\[[^\]:]+:(\d)\] device cpu", log)) == ["0", "1", "2", "3"], log
    assert "parameters identical on all 4 rank(s): yes" in log
    assert record["provenance"]["world_size"] == 4
    assert record["provenance"]["distributed"]["launcher"] == "slurm"
    digests = _digests(record)
    assert len(digests) == 4 and len(set(digests)) == 1


def test_two_node_ddp_via_torchrun_per_node(slurm_cluster, template_jobs):
    job, record = _generic(template_jobs, "labs/lab01_dp_vs_ddp/sbatch/ddp_torchrun_2node.sbatch")
    log = slurm_cluster.output(job.result.job_id)
    assert "SLURM_JOB_NODELIST=n[1-2]" in log and "SLURM_NNODES=2" in log
    assert "ddp: 4 process(es), backend gloo, launcher torchrun" in log
    assert sorted(re.findall(r"\[[^\]:]+:(\d)\] device cpu", log)) == ["0", "1", "2", "3"], log
    assert "parameters identical on all 4 rank(s): yes" in log
    assert record["provenance"]["world_size"] == 4
    digests = _digests(record)
    assert len(digests) == 4 and len(set(digests)) == 1


def test_chapter4_multi_gpu_runs_one_rank_per_gpu(slurm_cluster, template_jobs):
    job, record = _generic(template_jobs, "chapters/ch04_deep_learning/sbatch/multi_gpu.sbatch")
    log = slurm_cluster.output(job.result.job_id)
    assert "DDP: 4 process(es), backend gloo, launcher slurm" in log
    assert "parameters identical on all 4 rank(s): yes" in log
    digests = _digests(record)
    assert len(digests) == 4 and len(set(digests)) == 1
    assert (job.results_dir.parent / "checkpoints" / f"multi_gpu-{job.result.job_id}.pt").is_file()


def test_lab05_bandwidth_across_two_nodes_records_every_size_with_busbw(slurm_cluster, template_jobs):
    job = template_jobs["generic/labs/lab05_scaling/sbatch/bandwidth_2node.sbatch"]
    log = job_log(slurm_cluster, job)
    assert job.result.ok, log
    assert sorted(re.findall(r"task (\d) of 2: node (n\d)", log)) == [("0", "n1"), ("1", "n2")], log
    records = {record["method"]: record for record in load_records(job.results_dir).records}
    assert sorted(records) == ["all_gather", "all_reduce", "reduce_scatter"]
    for record in records.values():
        metrics = record["metrics"]
        assert (metrics["world_size"], metrics["nodes"]) == (2, 2)
        assert [row["bytes"] for row in metrics["sizes"]] == [1024, 2048, 4096, 8192, 16384]  # --dry-run
        assert all(row["correct"] and row["busbw_gbps"] > 0 for row in metrics["sizes"])
        assert metrics["reference"]["kind"] == "memcpy" and metrics["reference"]["gb_per_s"] > 0
        assert metrics["transport"]["summary"].startswith("Gloo: TCP between 2 hosts")
        assert record["energy"]["sources"]["slurm"]["status"] == "unavailable"  # the test cluster gathers none
        assert {entry["node"] for entry in record["provenance"]["placement"]} == {"n1", "n2"}


def test_lab05_scaling_array_runs_one_point_per_task(slurm_cluster, template_jobs):
    job = template_jobs["generic/labs/lab05_scaling/sbatch/scaling_array.sbatch"]
    log = job_log(slurm_cluster, job)
    assert job.result.ok, log
    records = load_records(job.results_dir).records
    points = sorted((r["config"]["mode"], r["metrics"]["world_size"], r["metrics"]["nodes"]) for r in records)
    assert points == [("strong", 1, 1), ("strong", 2, 1), ("strong", 4, 2),
                      ("weak", 1, 1), ("weak", 2, 1), ("weak", 4, 2)], log
    tasks = {r["provenance"]["slurm"]["SLURM_ARRAY_TASK_ID"] for r in records}
    assert tasks == {"0", "1", "2"}
    assert "launcher slurm" in log and "srun --kill-on-bad-exit=1 --nodes=2 --ntasks=4" in log


def test_lab07_2d_mesh_across_two_nodes_keeps_tensor_parallel_rows_inside_a_node(slurm_cluster, template_jobs):
    job = template_jobs["generic/labs/lab07_model_parallel/sbatch/two_d_parallel_2node.sbatch"]
    log = job_log(slurm_cluster, job)
    assert job.result.ok, log
    (record,) = load_records(job.results_dir).records
    assert record["method"] == "2d-2x2" and record["metrics"]["world_size"] == 4, log
    assert record["provenance"]["distributed"]["launcher"] == "slurm"
    assert record["provenance"]["slurm"]["SLURM_JOB_ID"] == str(job.result.job_id)
    assert len(record["metrics"]["loss_at_step"]) == 2  # --dry-run: two steps


def test_lab07_one_node_template_trains_tensor_parallel_after_its_reference(slurm_cluster, template_jobs):
    job = template_jobs["generic/labs/lab07_model_parallel/sbatch/model_parallel_4gpu.sbatch"]
    log = job_log(slurm_cluster, job)
    assert job.result.ok, log
    methods = sorted(record["method"] for record in load_records(job.results_dir).records)
    assert methods == ["reference", "tp"], log


def test_container_template_says_loudly_that_it_ran_without_a_container(slurm_cluster, template_jobs):
    job = template_jobs["generic/labs/lab03_precision_benchmark/sbatch/container.sbatch"]
    log = job_log(slurm_cluster, job)
    assert job.result.ok, log
    assert "WARNING: tiny run (HPC_DL_LABS_TINY=1): running the benchmark directly, WITHOUT a container" in log


def test_container_template_refuses_to_run_without_a_container_outside_tiny_runs(slurm_cluster, tmp_path):
    script = tmp_path / "container.sbatch"
    template = REPO_ROOT / "labs/lab03_precision_benchmark/sbatch/container.sbatch.j2"
    rendered = render_sbatch.render(render_sbatch.read_template(template), render_sbatch.find_site("generic"))
    script.write_text(rendered[0])
    result = slurm_cluster.run(script, env={"HPC_DL_LABS_TINY": "0", "RESULTS_DIR": str(tmp_path / "results")},
                               timeout=60)
    log = slurm_cluster.output(result.job_id)
    assert result.state == "FAILED" and result.exit_code == 2, log
    assert "error: neither apptainer nor singularity is on PATH" in log
    assert not (tmp_path / "results").exists()


# -- requests that no site can satisfy ------------------------------------------------------------

@pytest.mark.parametrize("script", ["labs/lab01_dp_vs_ddp/sbatch/dp_4gpu.sbatch.j2",
                                    "chapters/ch04_deep_learning/sbatch/multi_gpu.sbatch.j2"])
def test_the_renderer_refuses_more_gpus_than_any_site_has(script):
    template = render_sbatch.read_template(REPO_ROOT / script)
    most = max(part.gpus_per_node for site in render_sbatch.load_sites().values() for part in site.partitions.values())
    for site in render_sbatch.load_sites().values():
        with pytest.raises(render_sbatch.UserError, match=r"GPU\(s\) per node but site"):
            render_sbatch.render(template, site, {"gpus_per_node": most + 1})


def test_sbatch_refuses_a_rendered_template_asking_for_a_gpu_model_no_node_has(slurm_cluster, tmp_path):
    """A site profile that promises H100s (none of the real ones does): the renderer cannot know,
    the scheduler refuses the job at submission, before it waits in the queue."""
    site = render_sbatch.find_site("generic")
    h100 = dataclasses.replace(site.partitions["gpu"], gpu_types=("h100",), typed_gres=True)
    site = dataclasses.replace(site, partitions={**site.partitions, "gpu": h100})
    template = render_sbatch.read_template(REPO_ROOT / "labs/lab01_dp_vs_ddp/sbatch/dp_4gpu.sbatch.j2")
    text, job = render_sbatch.render(template, site, {"gpu_type": "h100"})
    assert "#SBATCH --gres=gpu:h100:4 " in text
    script = tmp_path / "dp_4gpu.sbatch"
    script.write_text(text)
    with pytest.raises(SbatchRejected) as raised:
        slurm_cluster.submit(script)
    assert "Requested node configuration is not available" in raised.value.stderr
