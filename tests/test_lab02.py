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
from types import SimpleNamespace

import pytest

from helpers import REPO, load_script, run_main, script_env, terminate_when

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
    from labs.lab02_profiling.lab02_shared import DATA_LOADING_LINE, data_loading_share

    share = data_loading_share(lprof)
    row = next(r for r in table.stdout.splitlines() if DATA_LOADING_LINE in r)
    percent = float(re.split(r"\s+", row.strip())[4])  # Line #, Hits, Time, Per Hit, % Time
    assert share * 100 == pytest.approx(percent, abs=0.051)
    (record,) = records(tmp_path / "results")
    assert record["config"]["line_profiler"] is True and record["method"] == "custom"


@pytest.mark.parametrize("refused", [["--batch-size", "0"], ["--dataset", "mnist", "--data-dir", "absent"]])
def test_kernprof_on_refused_input_writes_no_profile(tmp_path, refused):
    """kernprof writes its .lprof however the script ends: a bad flag value (argparse's refusal, or one found after
    parsing, a data set not there) left an empty profile beside the one error line."""
    lprof = tmp_path / "run.lprof"
    done = subprocess.run([str(KERNPROF), "-l", "-o", str(lprof), str(REPO / TRAIN), "--device", "cpu", *refused,
                           "--results-dir", str(tmp_path / "results")],
                          cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")
    assert sorted(path.name for path in tmp_path.iterdir()) == []


@pytest.mark.parametrize("pipeline,workers", [("pil", "1"), ("tensor", "0"), ("device", "0")])
def test_runs_under_plain_python_with_each_pipeline(tmp_path, capsys, monkeypatch, pipeline, workers):
    script, modes = load_script(TRAIN), []  # the floors time a training step: dropout on, after test()'s eval()

    def measure_floors(args, device, model, *rest, **kwargs):
        modes.append(model.training)
        return floors(args, device, model, *rest, **kwargs)

    floors = script.measure_floors
    monkeypatch.setattr(script, "measure_floors", measure_floors)
    status = run_main(TRAIN, [*TINY, "--epochs", "2", "--pipeline", pipeline, "--num-workers", workers,
                              "--results-dir", str(tmp_path)])
    assert status == 0 and modes == [True]
    out = capsys.readouterr().out
    assert "line profiler off" in out and "Train Epoch: 2" in out
    # The header says how batches are made: the device pipeline has no DataLoader (it said "workers 0" here).
    loader = "no DataLoader" if pipeline == "device" else f"workers {workers}"
    assert f"| pipeline {pipeline} | {loader} | batch " in next(line for line in out.splitlines()
                                                                if line.startswith("device "))
    (record,) = records(tmp_path)
    metrics = record["metrics"]
    assert record["lab"] == "lab02" and record["config"]["pipeline"] == pipeline
    assert record["config"]["line_profiler"] is False
    assert metrics["steps"] == 4 and len(metrics["epoch_time_s"]) == 2
    assert metrics["samples_per_s"] > 0 and 0 <= metrics["test_accuracy"] <= 1
    assert record["method"] == ("baseline" if pipeline == "pil" else "custom")


@pytest.mark.parametrize("flags, noted", [
    ([], False),  # the README's --pipeline device runs: no worker or pinning flag typed, none to call useless
    (["--num-workers", "3"], True), (["--pin-memory"], True), (["--persistent-workers"], True),
])
def test_the_device_pipeline_notes_only_the_loader_flags_that_were_given(flags, noted):
    """--pipeline device has no DataLoader: the note that worker and pinning flags change nothing is for a run that
    gave one (it used to be printed on every run, for the default number of workers)."""
    from common.cli import script_parser
    from labs.lab02_profiling.lab02_shared import add_train_args, flag_notes

    args = add_train_args(script_parser(None)).parse_args(["--pipeline", "device", *flags])
    notes = flag_notes(args, SimpleNamespace(type="cpu"))
    assert any(note.startswith("--pipeline device has no DataLoader") for note in notes) is noted, notes


@pytest.mark.parametrize("flags, noted", [([], False), (["--num-workers", "3"], True), (["--pin-memory"], True)])
def test_profile_trace_s_device_pipeline_notes_the_loader_flags_that_were_given(tmp_path, capsys, flags, noted):
    """profile_trace.py --pipeline device --num-workers 3 said nothing of the workers it never started, where
    mnist_classify.py says it in a note."""
    argv = ["--device", "cpu", "--pipeline", "device", "--dry-run", *flags, "--results-dir", str(tmp_path)]
    assert run_main(f"{LAB}/profile_trace.py", argv) == 0
    said = "--pipeline device has no DataLoader: worker and pinning flags have no effect"
    assert capsys.readouterr().out.count(f"note: {said}\n") == noted
    (record,) = records(tmp_path, "lab02_torch-profiler-*.json")
    assert (said in record["notes"]) is noted


@pytest.mark.parametrize("flags, method", [
    ([], "workers"),  # off a cluster the script's default is 2 workers: the sweep's "workers" step
    (["--num-workers", "1"], "baseline"), (["--num-workers", "0"], "custom"),
    (["--num-workers", "4", "--pin-memory"], "custom"), (["--num-workers", "1", "--method", "mine"], "mine"),
])
def test_a_run_is_named_after_the_sweep_step_it_matches(monkeypatch, flags, method):
    from labs.lab02_profiling.lab02_shared import default_method

    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    args = load_script(TRAIN).build_parser().parse_args(flags)
    assert (args.method or default_method(args)) == method


@pytest.mark.parametrize("cpus, workers, method", [("1", 1, "baseline"), ("8", 7, "workers")])
def test_job_slurm_s_allocation_gives_the_usc_lab_s_baseline_and_its_step_5(monkeypatch, cpus, workers, method):
    """job.slurm asks for one core, as the USC lab did: its one DataLoader worker is the baseline; the README's
    step 5 (--cpus-per-task=8) gives seven."""
    from labs.lab02_profiling.lab02_shared import default_method

    for key in ("SLURM_CPUS_ON_NODE", "SLURM_JOB_CPUS_PER_NODE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", cpus)
    monkeypatch.setattr("common.runtime.cpus.usable_cpus", lambda: 16)  # a GPU node's cores, not this machine's
    args = load_script(TRAIN).build_parser().parse_args([])
    assert (args.num_workers, default_method(args)) == (workers, method)


def test_the_sweep_s_workers_step_on_job_slurm_s_one_core_keeps_the_baseline_s_one_worker(monkeypatch):
    """On one core (SLURM_CPUS_PER_TASK=1) the allocation leaves no spare core: the workers step, like
    mnist_classify.py's default, keeps one worker (the README: "at least one"), not 0, which would load
    in the training process and make persistent-workers a no-op."""
    for key in ("SLURM_CPUS_ON_NODE", "SLURM_JOB_CPUS_PER_NODE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    sweep = load_script(f"{LAB}/sweep.py")
    args = sweep.build_parser().parse_args([])
    workers = next(step for step in sweep.optimisation_path(args) if step.name == "workers")
    assert dict(workers.settings)["num_workers"] == 1


def test_the_three_pipelines_give_the_same_numbers():
    import torch

    from common.data import pipelines

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
    status = run_main(f"{LAB}/sweep.py", ["--stages", "baseline,device", *TINY, "--results-dir", str(tmp_path)])
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


@pytest.mark.parametrize("ending, status, message", [
    (KeyboardInterrupt, 130, "interrupted"),
    (2, 2, "error: step baseline stopped at its input (exit status 2); the steps after it were not started"),
])
def test_sweep_stopped_mid_step_keeps_no_profile_of_the_unfinished_step(ending, status, message, tmp_path, capsys,
                                                                         monkeypatch):
    """Ctrl-C while a step runs, or a step that refuses its input: kernprof still writes that step's .lprof as it
    exits, but the step has no record and its profile is of a run that did not finish; the sweep removes it (it used
    to stay in lab02_lprof)."""
    sweep = load_script(f"{LAB}/sweep.py")

    def stopped(step, flags, lprof, records_dir):
        lprof.write_bytes(b"kernprof's profile of the part that ran")
        if ending is KeyboardInterrupt:
            raise KeyboardInterrupt
        return ending, []

    monkeypatch.setattr(sweep, "run_step", stopped)
    assert run_main(f"{LAB}/sweep.py", ["--stages", "baseline", *TINY, "--results-dir", str(tmp_path)]) == status
    assert capsys.readouterr().err.strip() == message
    assert not list(tmp_path.rglob("*.lprof")) and not list(tmp_path.rglob("*.json"))


def test_sweep_sent_sigterm_stops_its_step_removes_its_scratch_folder_and_says_what_it_kept(tmp_path):
    """``kill`` or a job's time limit (SIGTERM) while a step trains: the sweep used to die at once, its
    /tmp/lab02_sweep_* folder left behind and its kernprof step training on alone. Now the step is stopped, the
    scratch folder and the unfinished step's profile removed, and one line says what was kept."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    command = [sys.executable, str(REPO / LAB / "sweep.py"), "--device", "cpu", "--stages", "baseline",
               "--epochs", "1000", "--results-dir", str(tmp_path / "results")]
    status, output, left, running = terminate_when(command, "[baseline] ", str(tmp_path),
                                                   script_env(TMPDIR=str(scratch)),
                                                   lambda: list(scratch.glob("lab02_sweep_*")))
    assert len(running) == 1 and left == [], (running, left)  # its scratch folder while the step ran; no step now
    assert status == 143, output
    results = tmp_path / "results"
    assert re.fullmatch(rf"sweep (\w+): stopped by SIGTERM during step baseline \(removed\); kept the records in "
                        rf"{re.escape(str(results))} and line profiles {re.escape(str(results / 'lab02_lprof'))}/"
                        r"\1_\*\.lprof of the steps before it: none", output.strip().splitlines()[-1]), output
    assert not list(scratch.glob("lab02_sweep_*"))
    assert not list((tmp_path / "results").rglob("*.lprof")) and not list((tmp_path / "results").rglob("*.json"))


def test_sweep_rejects_an_unknown_step(capsys):
    assert run_main(f"{LAB}/sweep.py", ["--stages", "baseline,warp-drive"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown step(s) warp-drive") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--stages", "baseline,amp", "--precision", "fp16"], "error: step amp: fp16 autocast needs a CUDA GPU"),
    (["--stages", "baseline", "--device", "cuda"], "error: --device cuda was requested but PyTorch sees no CUDA GPU"),
])
def test_sweep_refuses_a_step_this_machine_cannot_run_before_any_starts(argv, message, tmp_path, capsys):
    """Checked with the training script's own parser and checks before the first step: one line, exit 2, no
    record, no line profile (it used to run each step, fail it, and write a failed record for each)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: both run")
    assert run_main(f"{LAB}/sweep.py", [*argv, "--results-dir", str(tmp_path / "results")]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith(message), captured.err
    assert "$ " not in captured.out and not (tmp_path / "results").exists()


def test_sweep_without_its_data_set_is_one_line_before_any_step_starts(tmp_path, capsys):
    """MNIST not downloaded: every step would stop at the same missing files (it used to start each of them)."""
    argv = ["--dataset", "mnist", "--data-dir", str(tmp_path), "--results-dir", str(tmp_path / "results")]
    assert run_main(f"{LAB}/sweep.py", argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith(f"error: mnist not found under {tmp_path}")
    assert "download_data.py mnist" in captured.err and not (tmp_path / "results").exists()


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


@pytest.mark.parametrize("script, flags", [
    (TRAIN, ["--pipeline", "tensor", "--num-workers", "0", "--epochs", "1"]),
    (f"{LAB}/profile_trace.py", ["--pipeline", "device", "--wait", "0", "--warmup", "0", "--active", "1"]),
])
def test_a_batch_larger_than_the_training_set_is_said_in_one_line(tmp_path, capsys, script, flags):
    """--batch-size 2000 on digits' 1,438 training images: one short step per epoch, and the run said nothing. The
    header's batch and the record's global_batch_size said 2000 too; both are the 1,438 a step held (the config keeps
    the flag as given)."""
    assert run_main(script, ["--device", "cpu", "--batch-size", "2000", *flags, "--results-dir", str(tmp_path)]) == 0
    said = "--batch-size 2000 is larger than the training set (1438 samples): every step trains on those 1438, " \
           "one step per epoch"
    out = capsys.readouterr().out
    assert out.count(f"note: {said}\n") == 1
    assert " | batch 1438 | " in out and "batch 2000" not in out
    (record,) = records(tmp_path, "lab02_[ct]*.json")  # lab02_custom_*, lab02_torch-profiler-*: not the trace
    assert said in record["notes"]
    assert record["energy"]["samples"] == 1438  # the samples drawn in the one step (profile_trace.py said 2000)
    assert record["metrics"]["global_batch_size"] == 1438 and record["config"]["batch_size"] == 2000


def test_profile_trace_named_gz_is_gzip_compressed(tmp_path):
    """torch's export_chrome_trace compresses a .gz path; --trace t.json.gz must be gzip too, whole, with its events
    counted in the record."""
    import gzip

    trace = tmp_path / "t.json.gz"
    status = run_main(f"{LAB}/profile_trace.py", ["--device", "cpu", "--pipeline", "tensor", "--num-workers", "0",
                                                  "--wait", "0", "--warmup", "0", "--active", "1",
                                                  "--trace", str(trace), "--results-dir", str(tmp_path)])
    assert status == 0
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    (record,) = records(tmp_path, "lab02_*.json")
    assert record["metrics"]["trace_events"] == len(events) > 0


def test_profile_trace_s_two_readme_runs_keep_both_timelines(tmp_path, capsys):
    """The README runs the USC lab's pipeline, then the device pipeline, without --trace: the second run must
    not overwrite the first one's timeline, which its record names; and the report of that folder reads the two
    records, not the traces beside them (lab02_trace_pil.json was read whole and warned of as a broken record)."""
    from common.results import load_records

    for pipeline in ("pil", "device"):
        status = run_main(f"{LAB}/profile_trace.py", ["--device", "cpu", "--pipeline", pipeline, "--num-workers", "0",
                                                      "--wait", "0", "--warmup", "1", "--active", "1",
                                                      "--results-dir", str(tmp_path)])
        assert status == 0
        header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("device "))
        loader = "no DataLoader" if pipeline == "device" else "workers 0"  # the device run said "workers 0"
        assert f"| pipeline {pipeline} | {loader} | batch " in header
    traces = {record["config"]["pipeline"]: Path(record["metrics"]["trace_file"])
              for record in records(tmp_path, "lab02_torch-profiler-*.json")}
    assert traces["pil"] != traces["device"] and all(path.is_file() for path in traces.values())
    assert all(path.parent == tmp_path for path in traces.values())
    loaded = load_records(tmp_path)
    assert len(loaded.records) == 2 and loaded.errors == []


def test_profile_trace_run_twice_into_one_folder_keeps_each_record_s_own_trace(tmp_path, capsys):
    """The same command twice (here 1, then 2 recorded steps) into one folder, to compare the runs: the second run
    replaced lab02_tensor_trace.json, so the first record's trace_file named the second run's timeline."""
    for active in ("1", "2"):
        assert run_main(f"{LAB}/profile_trace.py", ["--device", "cpu", "--pipeline", "tensor", "--num-workers", "0",
                                                    "--wait", "0", "--warmup", "0", "--active", active,
                                                    "--results-dir", str(tmp_path)]) == 0
    runs = records(tmp_path, "lab02_torch-profiler-*.json")
    assert sorted(run["metrics"]["profiled_steps"] for run in runs) == [1, 2]
    for run in runs:
        events = json.loads(Path(run["metrics"]["trace_file"]).read_text())["traceEvents"]
        assert run["metrics"]["trace_events"] == len(events)
        assert sum(event.get("name") == "forward" for event in events) == run["metrics"]["profiled_steps"]


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


@pytest.mark.parametrize("flag", [["--epochs", "3"], ["--num-workers", "4"]])
def test_data_pipeline_benchmark_offers_no_flag_it_would_ignore(flag, tmp_path, capsys):
    """Each variant trains one epoch per round and (a) has the USC lab's one worker: --epochs and
    --num-workers would change nothing, so they are refused in one line, nothing written."""
    status = run_main("bench/data_pipeline.py", ["--device", "cpu", "--dry-run", "--results-dir", str(tmp_path), *flag])
    err = capsys.readouterr().err
    assert status == 2 and f"unrecognized arguments: {' '.join(flag)}" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


def _run_job_script(tmp_path: Path, job_id: str | None, kernprof_status: int = 0) -> subprocess.CompletedProcess:
    """``bash job.slurm`` from the lab folder with stand-ins for kernprof (prints how it was called,
    exits ``kernprof_status``) and python (pytorch.sh asks: is torch importable? yes)."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "kernprof").write_text(f'#!/bin/sh\necho "KERNPROF $*"\nexit {kernprof_status}\n')
    (tools / "python").write_text("#!/bin/sh\nexit 0\n")
    for tool in tools.iterdir():
        tool.chmod(0o755)
    env = {key: value for key, value in script_env().items()
           if not key.startswith(("SLURM_", "HPC_DL_LABS_", "CONDA", "VIRTUAL_ENV"))}
    env.update(PATH=f"{tools}:/usr/bin:/bin", **({"SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id} if job_id else {}))
    return subprocess.run(["bash", str(REPO / LAB / "job.slurm")], cwd=REPO / LAB, env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("job_id", ["88", None])
def test_job_script_names_its_profile_after_the_job_or_local_outside_slurm(tmp_path, job_id):
    """In a job the profile is <jobid>.lprof as in the USC lab; run outside Slurm it is local.lprof,
    never the hidden ".lprof" that `line_profiler -rmt *.lprof` would skip."""
    done = _run_job_script(tmp_path, job_id)
    assert done.returncode == 0, done.stdout + done.stderr
    profile = f"{job_id or 'local'}.lprof"
    assert f"KERNPROF -o {profile} -l mnist_classify.py --epochs=3" in done.stdout.splitlines()
    assert f"line profile: {profile}  (python -m line_profiler -rmt {profile})" in done.stdout


def test_job_script_stops_with_the_status_of_a_failed_training(tmp_path):
    """A training that fails fails the job (Slurm shows FAILED, not COMPLETED), and the job does not
    go on to point at a profile that was never written."""
    done = _run_job_script(tmp_path, "88", kernprof_status=3)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "KERNPROF -o 88.lprof" in done.stdout and "line profile:" not in done.stdout


def test_job_script_directives_are_commented_and_shellcheck_clean():
    job = REPO / LAB / "job.slurm"
    for line in job.read_text().splitlines():
        if line.startswith("#SBATCH"):
            assert "#" in line[1:], f"directive without a comment saying what it asks for: {line}"
    shellcheck = Path(sys.executable).with_name("shellcheck")
    if not shellcheck.exists():
        pytest.skip("shellcheck is not installed in this environment (uv sync installs it)")
    done = subprocess.run([str(shellcheck), str(job)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout


def test_cuda_graph_step_on_a_cpu_runs_eagerly_says_why_and_records_the_floors(tmp_path, capsys):
    status = run_main(TRAIN, [*TINY, "--pipeline", "device", "--num-workers", "0", "--cuda-graph",
                              "--results-dir", str(tmp_path)])
    assert status == 0
    out = capsys.readouterr().out
    why = "graph: not captured (CPU: CUDA graphs need a GPU)"
    assert why in out and "regime: compute- or memory-bound" in out
    (record,) = records(tmp_path)
    metrics, floors = record["metrics"], record["metrics"]["floors"]
    assert why in record["notes"] and record["config"]["cuda_graph"] is True
    assert metrics["cuda_graph"]["captured"] is False and metrics["cuda_graph"]["reason"] in why
    assert metrics["steps"] == 2 and metrics["step_time_s"] == pytest.approx(metrics["epoch_time_s"][0] / 2)
    # One training step of MnistNet at batch 64: forward, then backward at twice the forward's FLOPs,
    # less the first convolution's input gradient (the images need none).
    conv1, conv2 = 2 * 64 * 32 * 26 * 26 * 1 * 9, 2 * 64 * 64 * 24 * 24 * 32 * 9
    forward = conv1 + conv2 + 2 * 64 * 9216 * 128 + 2 * 64 * 128 * 10
    assert floors["flops_per_step"] == 3 * forward - conv1
    assert metrics["achieved_tflops"] == pytest.approx(floors["flops_per_step"] / metrics["step_time_s"] / 1e12)
    # A CPU has no datasheet peak: no FLOP floor and no fraction of it, each with the reason.
    assert metrics["flop_floor_s"] is None and metrics["mfu"] is None
    assert "no peak known for a CPU" in floors["reasons"]["flop_floor_s"]
    assert floors["reasons"]["mfu"] == floors["reasons"]["flop_floor_s"]
    # The launch floor counts operators (said so) at the measured cost of calling one.
    assert "an operator count, not kernels" in floors["counted"] and metrics["kernels_per_step"] > 50
    assert metrics["launch_floor_s"] == pytest.approx(metrics["kernels_per_step"] * floors["launch_latency_s"])
    assert metrics["regime"] == "compute- or memory-bound" and metrics["launch_floor_s"] < metrics["step_time_s"] / 2


def test_a_larger_batch_adds_flops_not_kernels_and_moves_a_gpu_step_from_launch_to_compute_bound(monkeypatch):
    import torch
    import torch.nn.functional as F

    from common.measure import floors
    from common.models import MnistNet

    model = MnistNet()
    optimizer = torch.optim.Adadelta(model.parameters())

    def step(batch: int):
        def run():
            optimizer.zero_grad(set_to_none=True)
            F.nll_loss(model(torch.zeros(batch, 1, 28, 28)), torch.zeros(batch, dtype=torch.long)).backward()
            optimizer.step()
        return run

    small, large = step(4), step(32)
    counted = {name: (floors.count_flops(run), floors.count_kernels(run, torch.device("cpu"))[0])
               for name, run in (("small", small), ("large", large))}
    assert counted["large"][0] == 8 * counted["small"][0] and counted["large"][1] == counted["small"][1]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    from common import precision

    monkeypatch.setattr(precision, "fp32_math", lambda: {"matmul": "ieee", "cudnn_conv": "tf32"})
    assert precision.peak(torch.device("cuda"), "fp32")[:2] == (494.5, "tf32")  # cuDNN may use TF32: the lower floor
    monkeypatch.setattr(precision, "fp32_math", lambda: {"matmul": "ieee", "cudnn_conv": "ieee"})
    peak, maths, source = precision.peak(torch.device("cuda"), "fp32")
    assert (peak, maths) == (67.0, "fp32") and source.startswith("H100 SXM datasheet, fp32")
    flops_at_64, kernels = counted["small"][0] * 16, counted["small"][1]

    def regime(flops: int) -> str:
        return floors.step_floors(flops=flops, kernels=kernels, counted="CUDA kernels", latency_s=5e-6,
                                  latency_method="", step_time_s=1e-3, peak_tflops=peak, peak_source=source)["regime"]

    assert regime(flops_at_64) == "launch-bound" and regime(flops_at_64 * 1024) == "compute-bound"


def test_every_command_the_sweep_generates_parses_into_the_settings_of_its_steps():
    """Each step's command (its settings and every earlier step's) is what mnist_classify.py's parser
    reads back; the graph step comes right after the device step."""
    sweep, train = load_script(f"{LAB}/sweep.py"), load_script(TRAIN)
    args = sweep.build_parser().parse_args(["--include-compile", "--max-steps", "3", "--num-workers", "2"])
    path = sweep.optimisation_path(args)
    names = [step.name for step in path]
    assert names[names.index("device") + 1] == "graph" and names[-1] == "compile"
    settings: dict = {}
    for step in path:
        settings.update(step.settings)
        parsed = vars(train.build_parser().parse_args([*sweep.forwarded_flags(args), *sweep.command_line(settings)]))
        assert {name: parsed[name] for name in settings} == settings, step.name
        assert parsed["max_steps"] == 3 and parsed["device"] == args.device and parsed["seed"] == args.seed
    assert settings["cuda_graph"] and settings["compile"] and settings["pipeline"] == "device"


def test_a_setting_the_training_script_has_no_flag_for_is_refused_before_anything_runs():
    sweep = load_script(f"{LAB}/sweep.py")
    with pytest.raises(ValueError, match="no flag for 'pin_memry'"):
        sweep.command_line({"pin_memry": True})


@pytest.mark.gpu
def test_gpu_graph_step_is_captured_and_trains_step_by_step_like_the_eager_device_step(tmp_path):
    """Fresh processes, as a student runs them: the same seed, data and steps, eager and captured."""
    from helpers import run_script

    shared = ["--device", "cuda", "--pipeline", "device", "--num-workers", "0", "--epochs", "2", "--log-interval", "1"]
    found = {}
    for name, extra in (("eager", []), ("graph", ["--cuda-graph"])):
        done = run_script(TRAIN, *shared, *extra, "--results-dir", str(tmp_path / name))
        assert done.returncode == 0, done.stdout + done.stderr
        (found[name],) = records(tmp_path / name)
    assert "graph: captured in" in done.stdout
    graph = found["graph"]["metrics"]
    # digits: 1,438 training images = 22 batches of 64 and one of 30, which runs eagerly each epoch.
    assert graph["cuda_graph"]["captured"] is True and graph["cuda_graph"]["eager_steps"] == 2
    eager_losses, graph_losses = (sum(found[name]["metrics"]["logged_loss"], []) for name in ("eager", "graph"))
    assert len(eager_losses) == len(graph_losses) == 46
    # Same weights, batches, dropout masks and lr: step by step alike. On the H100 (2026-11-26) they agreed
    # to 1e-3 for 26 steps, then drifted (6% by step 46): cuDNN's backward kernels are not deterministic,
    # and training amplifies their last-bit differences, from a step no run can promise. A wrong lr or mask
    # would differ from the first steps: the first 10 are held to 1e-3, the rest only to the same curve.
    assert graph_losses[:10] == pytest.approx(eager_losses[:10], rel=1e-3)
    assert graph_losses[10:] == pytest.approx(eager_losses[10:], rel=0.25)
    for record in found.values():
        metrics = record["metrics"]
        assert metrics["kernels_per_step"] > 20 and record["metrics"]["floors"]["counted"] == "CUDA kernels"
        assert metrics["flop_floor_s"] > 0 and metrics["launch_floor_s"] > 0 and 0 < metrics["mfu"] < 1
        assert metrics["regime"] in ("launch-bound", "compute-bound")
    assert "CUDA graph" in graph["floors"]["latency_method"]
