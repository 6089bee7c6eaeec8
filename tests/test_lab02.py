"""Lab-02 (profiling and the data pipeline): real runs on CPU with tiny settings.

kernprof and the sweep run as real processes (the profiler wrapping a fresh interpreter is the
point); everything else calls ``main(argv)`` in this process so torch is imported once.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, load_script, run_main, script_env

LAB = "labs/lab02_profiling"
TRAIN = f"{LAB}/mnist_classify.py"
KERNPROF = Path(sys.executable).with_name("kernprof")
TINY = ["--device", "cpu", "--epochs", "1", "--max-steps", "2"]


def records(folder: Path, pattern: str = "*.json") -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob(pattern))]


def test_kernprof_writes_a_profile_whose_table_names_the_lines_of_train(tmp_path):
    lprof = tmp_path / "job.lprof"
    done = subprocess.run([str(KERNPROF), "-l", "-o", str(lprof), str(REPO / TRAIN), *TINY, "--num-workers", "0",
                           "--results-dir", str(tmp_path / "results")],
                          cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "line profiler on" in done.stdout
    table = subprocess.run([sys.executable, "-m", "line_profiler", "-rmt", str(lprof)],
                           capture_output=True, text=True, timeout=120, env=script_env())
    assert table.returncode == 0, table.stderr
    assert "Function: train at line" in table.stdout
    for line in ("for batch_idx, (data, target) in enumerate(train_loader):", "output = model(data)",
                 "scaler.scale(loss).backward()", "optimizer.zero_grad(set_to_none=True)"):
        assert line in table.stdout
    # The sweep's share of the data-loading line is the table's "% Time" of that line.
    sweep = load_script(f"{LAB}/sweep.py")
    share = sweep.data_loading_share(lprof)
    row = next(r for r in table.stdout.splitlines() if sweep.DATA_LOADING_LINE in r)
    percent = float(re.split(r"\s+", row.strip())[4])  # Line #, Hits, Time, Per Hit, % Time
    assert share * 100 == pytest.approx(percent, abs=0.051)
    (record,) = records(tmp_path / "results")
    assert record["config"]["line_profiler"] is True and record["method"] == "custom"


@pytest.mark.parametrize("pipeline,workers", [("pil", "1"), ("tensor", "0"), ("device", "0")])
def test_runs_under_plain_python_with_each_pipeline(tmp_path, capsys, pipeline, workers):
    status = run_main(TRAIN, [*TINY, "--epochs", "2", "--pipeline", pipeline, "--num-workers", workers,
                              "--results-dir", str(tmp_path)])
    assert status == 0
    out = capsys.readouterr().out
    assert "line profiler off" in out and "Train Epoch: 2" in out
    (record,) = records(tmp_path)
    metrics = record["metrics"]
    assert record["lab"] == "lab02" and record["config"]["pipeline"] == pipeline
    assert record["config"]["line_profiler"] is False
    assert metrics["steps"] == 4 and len(metrics["epoch_time_s"]) == 2
    assert metrics["samples_per_s"] > 0 and 0 <= metrics["test_accuracy"] <= 1
    assert record["method"] == ("baseline" if pipeline == "pil" else "custom")


def test_the_three_pipelines_give_the_same_numbers():
    import torch

    from common import pipelines

    train, _ = pipelines.load_uint8("digits", REPO / "data")
    assert train.images.dtype == torch.uint8 and train.images.shape[1:] == (28, 28)
    pil = pipelines.PilImages(train)
    tensor = pipelines.TensorBatches(train)
    device = pipelines.DeviceBatches(train, 16, shuffle=False, device=torch.device("cpu"))
    first_batch, first_labels = next(iter(device))
    for index in (0, 5, 15):
        image, label = pil[index]
        batch, labels = tensor[[index]]
        assert torch.allclose(image, batch[0], atol=1e-6) and torch.allclose(image, first_batch[index], atol=1e-6)
        assert label == int(labels[0]) == int(first_labels[index])
    assert len(device) == -(-len(train) // 16)


def test_sweep_records_each_step_and_the_report_shows_the_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO / LAB)  # where the README runs it
    status = run_main(f"{LAB}/sweep.py", ["--steps", "baseline,device", *TINY, "--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    # The report command it ends with can be typed where the sweep ran.
    report_command = next(line for line in out.splitlines() if line.startswith("report: ")).split()
    assert report_command[1] == "python" and Path(report_command[2]).resolve() == REPO / "scripts/compare_results.py"
    assert Path(report_command[2]).is_file() and report_command[3:] == ["--results-dir", str(tmp_path)]
    found = {r["method"]: r for r in records(tmp_path)}
    assert set(found) == {"baseline", "device"}
    baseline, device = found["baseline"], found["device"]
    assert baseline["metrics"]["speedup_vs_seed"] == pytest.approx(1.0)
    assert device["metrics"]["speedup_vs_seed"] == pytest.approx(
        device["metrics"]["samples_per_s"] / baseline["metrics"]["samples_per_s"])
    for record in found.values():
        assert 0 < record["metrics"]["data_loading_share"] < 1
        assert Path(record["config"]["sweep"]["lprof"]).is_file()
    # The device step carries every earlier step's flags, and the later value of a flag wins.
    assert device["config"]["pipeline"] == "device" and device["config"]["persistent_workers"] is True
    assert device["config"]["sweep"]["flags"].count("--pipeline") == 1
    assert "| device |" in out

    from common.report import build_report

    outcome = build_report(tmp_path, tmp_path / "report.html", tmp_path / "report.csv", plots=True)
    html = outcome.report_path.read_text()
    assert "Lab 02: the optimisation path" in html and "data-loading line" in html
    section = html[html.index('<section id="lab-02-the-optimisation-path">'):]
    assert section.index(">baseline<") < section.index(">device<")
    assert "data:image/png;base64," in section


def test_sweep_rejects_an_unknown_step(capsys):
    assert run_main(f"{LAB}/sweep.py", ["--steps", "baseline,warp-drive"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown step(s) warp-drive") and len(err.strip().splitlines()) == 1


def test_profile_trace_writes_a_valid_trace_with_labelled_regions(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    status = run_main(f"{LAB}/profile_trace.py", ["--device", "cpu", "--pipeline", "tensor", "--num-workers", "0",
                                                  "--wait", "0", "--warmup", "1", "--active", "2",
                                                  "--trace", str(trace), "--results-dir", str(tmp_path)])
    assert status == 0
    events = json.loads(trace.read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert {"data loading", "forward", "backward", "optimizer step"} <= names
    assert any(str(name).startswith("aten::") for name in names)
    assert "aten::" in capsys.readouterr().out
    (record,) = records(tmp_path, "lab02_*.json")
    assert record["metrics"]["trace_events"] == len(events)


def test_data_pipeline_benchmark_dry_run_writes_three_records(tmp_path, capsys):
    assert run_main("bench/data_pipeline.py", ["--device", "cpu", "--dry-run", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "b/a = " in out and "b/c = " in out
    found = {r["method"]: r for r in records(tmp_path)}
    assert set(found) == {"bench-a-seed-pipeline", "bench-b-best-pipeline", "bench-c-compute-only"}
    times = {r["config"]["bench"]["variant"]: r["metrics"]["epoch_time_s"] for r in found.values()}
    assert all(len(values) == 1 for values in times.values())  # two rounds, the first a warm-up
    metrics = found["bench-b-best-pipeline"]["metrics"]
    # Every variant saw the same samples, so the throughput ratio is the inverse time ratio.
    assert metrics["b_over_c"] == pytest.approx(times["c"][0] / times["b"][0])
    assert metrics["b_over_a"] == pytest.approx(times["a"][0] / times["b"][0])
    assert metrics["ratios"]["b/c"]["per_round"] == [pytest.approx(metrics["b_over_c"])]


@pytest.mark.parametrize("job_id", ["88", None])
def test_job_script_names_its_profile_after_the_job_or_local_outside_slurm(tmp_path, job_id):
    """In a job the profile is <jobid>.lprof as in the USC lab; run outside Slurm it is local.lprof,
    never the hidden ".lprof" that `line_profiler -rmt *.lprof` would skip."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "kernprof").write_text('#!/bin/sh\necho "KERNPROF $*"\n')
    (tools / "python").write_text("#!/bin/sh\nexit 0\n")  # pytorch.sh asks: is torch importable? yes
    for tool in tools.iterdir():
        tool.chmod(0o755)
    env = {key: value for key, value in script_env().items()
           if not key.startswith(("SLURM_", "HPC_DL_LABS_", "CONDA", "VIRTUAL_ENV"))}
    env.update(PATH=f"{tools}:/usr/bin:/bin", **({"SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id} if job_id else {}))
    done = subprocess.run(["bash", str(REPO / LAB / "job.slurm")], cwd=REPO / LAB, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    profile = f"{job_id or 'local'}.lprof"
    assert f"KERNPROF -o {profile} -l mnist_classify.py --epochs=3" in done.stdout.splitlines()
    assert f"line profile: {profile}  (python -m line_profiler -rmt {profile})" in done.stdout


def test_job_script_is_the_seeds_job_and_shellcheck_clean():
    job = REPO / LAB / "job.slurm"
    text = job.read_text()
    assert "set -euo pipefail" in text
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            assert "#" in line[1:], f"uncommented directive: {line}"
    shellcheck = Path(sys.executable).with_name("shellcheck")
    if not shellcheck.exists():
        pytest.skip("shellcheck is not installed in this environment (uv sync installs it)")
    done = subprocess.run([str(shellcheck), str(job)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout
