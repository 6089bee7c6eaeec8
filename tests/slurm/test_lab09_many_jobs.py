"""Lab-09 on the Slurm test cluster, with accounting (sacct) as on a real cluster.

``run_lab.sh`` runs in the background from the moment the session's cluster is up (the fixture
``run_lab``, tests/slurm/conftest.py; it waits on a 2-minute time limit most of its time): the faults
sweep as a pipeline (train array -> evaluate afterany -> report afterok), the tiny sweep through
submitit, a 3-link chain and the same run unbroken, then the resubmission of only the failed tasks.
The tests in between use the cluster meanwhile: sacct's answers, the bad input that is refused before
anything is submitted, a 100-task sweep submitted held and listed, a chain broken at its second link.
The tests that read what run_lab.sh left run after every other Slurm test (tests/slurm/conftest.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from common.results import load_records
from helpers import PYTHON, REPO, load_script, wait_for

pytestmark = pytest.mark.slurm

LAB = REPO / "labs" / "lab09_many_jobs"
RUN_LAB_TIMEOUT = 600
shared = load_script("labs/lab09_many_jobs/lab09_shared.py")
render_sbatch = load_script("scripts/render_sbatch.py")


def finished(run_lab) -> tuple[Path, str]:
    process, results, log = run_lab
    try:
        process.wait(timeout=RUN_LAB_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"run_lab.sh did not end in {RUN_LAB_TIMEOUT} s:\n{log.read_text()[-4000:]}")
    text = log.read_text()
    assert process.returncode == 0, text[-6000:]
    return results, text


def lab09(slurm_cluster, script: str, *args: str, tiny: str = "0") -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, str(LAB / script), *args], capture_output=True, text=True, cwd=REPO,
                          env=slurm_cluster.environment({"HPC_DL_LABS_TINY": tiny}))


def test_run_lab_starts(run_lab):
    assert run_lab[0].poll() in (None, 0)  # the module's background run is under way


def test_sacct_answers_with_state_elapsed_time_and_gpus(slurm_cluster, tmp_path):
    script = tmp_path / "gpu.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1 --time=1\nsleep 1\nexit 3\n")
    job = slurm_cluster.submit(script)
    assert slurm_cluster.wait(job, timeout=60).state == "FAILED"
    rows = []

    def recorded() -> bool:  # slurmctld hands the job's end to slurmdbd within a moment
        rows[:] = slurm_cluster.command("sacct", "-X", "-n", "-P", "-j", str(job),
                                        "--format=JobID,State,ExitCode,ElapsedRaw,AllocTRES").stdout.split("\n")[0:1]
        return rows[0].startswith(f"{job}|FAILED")

    wait_for(recorded, 30, "sacct to know the job's end")
    job_id, state, exit_code, elapsed, tres = rows[0].split("|")
    assert (state, exit_code) == ("FAILED", "3:0") and int(elapsed) >= 1
    assert "gres/gpu=1" in tres and "cpu=" in tres


def test_more_tasks_than_max_array_size_is_refused_before_submission(slurm_cluster, tmp_path):
    limit = int(re.search(r"MaxArraySize\s*=\s*(\d+)", slurm_cluster.command("scontrol", "show", "config").stdout)[1])
    sweep = tmp_path / "big.toml"
    sweep.write_text('script = "chapters/ch04_deep_learning/mnist_training.py"\n'
                     f"[grid]\nlr = [{', '.join(str(0.001 * (i + 1)) for i in range(limit + 1))}]\n")
    done = lab09(slurm_cluster, "01_sweep.py", str(sweep), "--sweep-dir", str(tmp_path / "big"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (f"error: the sweep has {limit + 1} tasks, more than this cluster's MaxArraySize of {limit} "
                           "(scontrol show config): split it into several sweep files\n")
    assert not (tmp_path / "big").exists()
    name = f"sweep-{shared.sweep_id(shared.read_sweep_file(sweep))}"  # the array's job name, had it been submitted
    assert slurm_cluster.command("sacct", "-n", "-X", f"--name={name}", "-o", "JobID").stdout.strip() == ""
    assert slurm_cluster.command("squeue", "-h", f"--name={name}", "-o", "%i").stdout.strip() == ""


def test_a_100_task_sweep_held_is_accepted_and_listed_within_5_s_then_cancelled(slurm_cluster, tmp_path):
    sweep = tmp_path / "hundred.toml"
    sweep.write_text((LAB / "sweeps" / "tiny.toml").read_text().replace(
        "lr = [0.3, 1.0]", f"lr = [{', '.join(f'{0.01 * (i + 1):.2f}' for i in range(100))}]"))
    folder = tmp_path / "hundred"
    submitted = lab09(slurm_cluster, "01_sweep.py", str(sweep), "--sweep-dir", str(folder), "--hold", "--parallel", "4")
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    match = re.search(r"submitted the sweep as array job (\d+): 100 tasks, at most 4 at once \(([\d.]+) s\) HELD",
                      submitted.stdout)
    assert match, submitted.stdout
    job, sbatch_s = match[1], float(match[2])
    began = time.perf_counter()
    listed = lab09(slurm_cluster, "02_status.py", "--sweep-dir", str(folder))
    status_wall_s = time.perf_counter() - began
    slurm_cluster.command("scancel", job)
    assert listed.returncode == 0, listed.stderr
    assert "100 task(s): 100 PENDING" in listed.stdout, listed.stdout
    assert len(re.findall(rf"^\s+\d+  PENDING\s+{job}_\d+ ", listed.stdout, re.M)) == 100
    listing_s = float(re.search(r"read in ([\d.]+) s", listed.stdout)[1])  # sacct/squeue and the folders
    slurm_cluster.timings["lab09 100 held tasks: sbatch"] = sbatch_s
    slurm_cluster.timings["lab09 100 held tasks: status (with Python's start)"] = status_wall_s
    # The target (<= 5 s) is Slurm accepting the array and the status command's reading of it; the
    # interpreter's start-up is left out: on this shared 2-core machine it alone varied from 0.3 to 8 s.
    assert sbatch_s + listing_s <= 5, (sbatch_s, listing_s, status_wall_s)


def test_a_broken_link_stops_the_chain_with_one_line(slurm_cluster, tmp_path):
    run_dir = tmp_path / "broken"
    started = lab09(slurm_cluster, "03_chain.py", "--run-dir", str(run_dir), "--", "--dataset", "digits",
                    "--epochs", "1", "--max-steps", "6", "--batch-size", "32", "--num-workers", "0",
                    "--step-budget", "3")
    assert started.returncode == 0, started.stdout + started.stderr
    first = int(re.search(r"link 1 of the chain is job (\d+)", started.stdout)[1])
    name = f"chain-{run_dir.name}"
    second = []

    def next_link_queued() -> bool:  # link 1 submits link 2 as it ends; hold it before it can start
        ids = [int(i) for i in slurm_cluster.command("squeue", "-h", f"--name={name}", "-o", "%i").stdout.split()]
        second[:] = [i for i in ids if i != first]
        return bool(second)

    wait_for(next_link_queued, 240, "link 1 to submit link 2", poll=0.25)
    assert slurm_cluster.command("scontrol", "hold", str(second[0])).returncode == 0
    assert slurm_cluster.wait(first, timeout=120).ok
    (run_dir / "checkpoint.pt").write_bytes(b"not a checkpoint")  # what a full disk or a killed copy leaves
    assert slurm_cluster.command("scontrol", "release", str(second[0])).returncode == 0
    result = slurm_cluster.wait(second[0], timeout=240)
    log = slurm_cluster.output(second[0])
    assert result.state == "FAILED" and result.exit_code == 2, log[-3000:]
    broken = [line for line in log.splitlines() if line.startswith("== chain broken")]
    assert broken == [f"== chain broken at link 2 (job {second[0]}): the training exited with status 2; no link "
                      f"follows (fix it, then: CHAIN_LINK=3 RUN_DIR={run_dir} sbatch ... to go on from the last "
                      "checkpoint)"], log[-3000:]
    assert "cannot be read as a checkpoint" in log
    time.sleep(2)
    assert slurm_cluster.command("squeue", "-h", f"--name={name}", "-o", "%i").stdout.strip() == ""  # no link 3


def test_a_misspelt_pipeline_stage_fails_with_one_line_and_runs_nothing(slurm_cluster, tmp_path):
    template = LAB / "sbatch" / "pipeline_stage.sbatch.j2"
    script = tmp_path / "pipeline_stage.sbatch"
    rendered, _ = render_sbatch.render(render_sbatch.read_template(template), render_sbatch.find_site("generic"))
    script.write_text(rendered)
    sweep = tmp_path / "sweep"
    job = slurm_cluster.submit(script, env={"SWEEP_DIR": str(sweep), "RESULTS_DIR": str(tmp_path / "results")},
                               script_args=["evalute"])
    result = slurm_cluster.wait(job, timeout=60)
    log = slurm_cluster.output(job)
    assert result.state == "FAILED" and result.exit_code == 2, log[-3000:]
    assert "error: unknown pipeline stage 'evalute': evaluate, report or all (nothing ran)" in log
    assert "== pipeline stage" not in log and not sweep.exists()


def test_run_lab_ends_with_the_report(run_lab):
    results, text = finished(run_lab)
    assert text.rstrip().splitlines()[-1] == f"report: {results}/lab09_comparison_report.html"
    assert (results / "lab09_comparison_report.html").is_file()


def sweep_records(folder: Path) -> list[dict]:
    return sorted((r for r in load_records(folder, recursive=False).records if r["lab"] == "lab09"),
                  key=lambda r: r["created"])


def test_pipeline_report_ran_after_failures_and_resubmission_resumed_only_those(run_lab, slurm_cluster):
    results, text = finished(run_lab)
    folder = results / "faults"
    evaluated, final = sweep_records(folder)  # the pipeline's evaluate job, then after the resubmission
    first = {t["index"]: t for t in evaluated["metrics"]["tasks"]}
    assert first[1]["state"] == "FAILED" and first[1]["last_step"] == 3  # failed on purpose after 3 steps
    assert first[2]["state"] == "TIMEOUT" and first[2]["last_step"] == 3  # stalled into its time limit
    assert first[0]["state"] in ("COMPLETED", "TIMEOUT")  # a very busy machine may not finish it in its limit
    not_done = sorted(i for i, t in first.items() if t["state"] != "COMPLETED")
    assert evaluated["metrics"]["failed"] == not_done
    assert evaluated["provenance"]["slurm"]["SLURM_JOB_NAME"] == "evaluate"  # written by the evaluate job
    # The report job ran after the failures (afterok on the evaluation) and said which tasks failed.
    report_logs = list((folder / "logs").glob("report-*.out"))
    assert len(report_logs) == 1
    named = ", ".join(f"{i} ({first[i]['state']})" for i in not_done)
    assert f"tasks that did not complete: {named}" in report_logs[0].read_text()
    assert (folder / "report.html").is_file()
    # Only those were resubmitted, as one array of just their indices; each resumed from its checkpoint.
    submissions = [json.loads(line) for line in (folder / "submissions.jsonl").read_text().splitlines()]
    assert [s["how"] for s in submissions] == ["sbatch-array", "resubmit"]
    # The fault's own line, no traceback.
    failed_log = (folder / "logs" / f"{submissions[0]['job_id']}_1.out").read_text()
    assert "demonstration fault: failing after 3 step(s)" in failed_log and "Traceback" not in failed_log, failed_log
    assert submissions[1]["indices"] == not_done
    assert f"--array={','.join(map(str, not_done))}" in submissions[1]["command"]
    logs = "".join(p.read_text() for p in (folder / "logs").glob(f"{submissions[1]['job_id']}_*.out"))
    for index in (1, 2):
        assert f"resumed from {folder}/tasks/{index:03d}/checkpoint.pt: epoch 1, step 3" in logs
    last = {t["index"]: t for t in final["metrics"]["tasks"]}
    assert [last[i]["state"] for i in range(3)] == ["COMPLETED"] * 3 and final["metrics"]["failed"] == []
    for index in not_done:  # every attempt costs: the resubmitted tasks cost more than their last attempt
        assert last[index]["attempts"] == 2
        assert last[index]["core_hours"] > last[index]["elapsed_s"] * 1 / 3600
    assert all(t["gpu_hours"] > 0 for t in last.values())  # the array asked for a GPU per task (sacct AllocTRES)
    assert final["metrics"]["core_hours"] == pytest.approx(sum(t["core_hours"] for t in last.values()))


def test_submitit_ran_the_same_runs_as_the_job_array(run_lab):
    results, _ = finished(run_lab)
    (through_submitit,) = sweep_records(results / "tiny-submitit")
    assert through_submitit["method"] == "sweep-submitit"
    tasks = {t["index"]: t for t in through_submitit["metrics"]["tasks"]}
    assert [tasks[i]["state"] for i in (0, 1)] == ["COMPLETED", "COMPLETED"]
    # tiny's tasks 0 and 1 are the faults sweep's tasks 0 and 1 (same flags, same seed): the same accuracy,
    # whichever way they were submitted (and task 1 of the faults sweep failed once and resumed).
    array = {t["index"]: t for t in sweep_records(results / "faults")[-1]["metrics"]["tasks"]}
    for index in (0, 1):
        assert tasks[index]["flags"] == array[index]["flags"]
        assert tasks[index]["best_accuracy"] == array[index]["best_accuracy"]
    assert through_submitit["metrics"]["submissions"][0]["how"] == "submitit"
    assert (results / "tiny-submitit" / "submitit").is_dir()


def test_three_links_end_with_the_weights_of_the_unbroken_run(run_lab):
    results, _ = finished(run_lab)
    import torch

    links = sorted((results / "chain").glob("chain-chain-*.out"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    logs = "".join(p.read_text() for p in links)
    assert re.findall(r"== chain link (\d) ", logs) == ["1", "2", "3"]
    assert "== chain done: link 3 finished the run" in logs
    assert re.findall(r"resumed from \S+: epoch 1, step (\d+)", logs) == ["3", "6"]
    assert re.findall(r"; link (\d) of the chain resumes from it", logs) == ["2", "3"]  # each link's training says so
    (chained,) = (results / "chain" / "results").glob("*.pt")
    (unbroken,) = (results / "unbroken" / "results").glob("*.pt")
    a, b = torch.load(chained), torch.load(unbroken)
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    unbroken_logs = "".join(p.read_text() for p in (results / "unbroken").glob("*.out"))
    assert "== chain done: link 1 finished the run" in unbroken_logs


def test_a_link_of_a_finished_chain_trains_nothing_and_says_how_to_train_again(run_lab, slurm_cluster, tmp_path):
    """A chain started again on a finished run's folder: its link passes --resume itself, so the training's advice for
    a lone job ('leave out --resume') is not the student's to follow; the link names the chain's own way."""
    results, _ = finished(run_lab)
    run_dir, records = results / "chain", results / "chain" / "results"
    before = sorted(records.iterdir())
    script = tmp_path / "chain_link.sbatch"
    template = LAB / "sbatch" / "chain_link.sbatch.j2"
    rendered, _ = render_sbatch.render(render_sbatch.read_template(template), render_sbatch.find_site("generic"))
    script.write_text(rendered)
    chain = ["--dataset", "digits", "--epochs", "1", "--max-steps", "9", "--batch-size", "32", "--num-workers", "0",
             "--step-budget", "3"]  # run_lab.sh's chain
    job = slurm_cluster.submit(script, env={"RUN_DIR": str(run_dir), "RESULTS_DIR": str(records), "CHAIN_LINK": "4",
                                            "HPC_DL_LABS_TINY": "0"}, script_args=chain)
    result = slurm_cluster.wait(job, timeout=180)
    log = slurm_cluster.output(job)
    assert result.ok, log[-3000:]
    assert "give 03_chain.py another --run-dir (RUN_DIR) to train again" in log and "leave out --resume" not in log
    assert f"== chain done: link 4 trained nothing, the run in {run_dir} had finished already" in log, log[-3000:]
    assert sorted(records.iterdir()) == before
