"""Lab-03 acceptance: the precision benchmark on CPU, tiny (resnet18, 64x64 images, batch 2, 2 timed iterations).

What is checked, from real runs:

- the SJTU page's CSV layout (one file per mode and precision, a column per model, a row per timed iteration,
  ms per batch) and the summary CSV, which also lists what was skipped and why;
- one record per model, mode and precision with the documented metrics;
- fp64, fp32, half and amp-bf16 run on a CPU; tf32 and amp-fp16 are skipped with the reason;
- the loss check: fp64 ends within 1e-3 of fp32's loss (same maths, more bits), amp-bf16 differs
  (bfloat16 really was used) but stays inside the 5% tolerance, and a precision over the tolerance is
  flagged in the record, the notes and the summary CSV;
- a clear one-line error for unknown model names and for an image size a model cannot take;
- ``-g 2`` runs the torchrun command it prints (DDP in two Gloo processes) and the record says so; ``-g``
  that cannot work (more processes than GPUs, or another count than the launcher's) is one error line;
- the report renders the lab's precision section from the records.

Why 64x64 and not 32x32: at 32x32 ResNet's last stage is 1x1 pixels, so its BatchNorm normalises
two numbers per channel (batch 2) and the loss after a few steps is chaotic: fp64 and fp32 already
end 15% apart. At 64x64 they agree to 1e-6, so the check measures the precision, not the chaos.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import PYTHON, REPO, fake_cpuinfo, load_script, run_main, run_script, script_env, terminate_when

SCRIPT = "labs/lab03_precision_benchmark/benchmark_models.py"
SHARED = "labs/lab03_precision_benchmark/lab03_shared.py"
TINY = ["--device", "cpu", "--models", "resnet18", "--image-size", "64", "-b", "2", "-w", "1", "-n", "2",
        "--check-steps", "3", "--seed", "1"]
CPU_RUNS = ("fp64", "fp32", "half", "amp-bf16")
CPU_SKIPS = ("tf32", "amp-fp16")


@contextlib.contextmanager
def quiet():
    """Run in-process with stdout captured. Torch keeps its threads (one per core): nothing else
    runs beside these tests, and the six-precision run takes 14 s on two cores instead of 23 s on one."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        yield out


def shared():
    from labs.lab03_precision_benchmark import lab03_shared

    return lab03_shared


def read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as handle:
        return list(csv.reader(handle))


def records_by_method(folder: Path) -> dict[str, list[dict]]:
    from common.results import load_records

    loaded = load_records(folder)
    assert not loaded.errors
    by_method: dict[str, list[dict]] = {}
    for record in loaded.records:
        by_method.setdefault(record["method"], []).append(record)
    return by_method


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """All six precisions in both modes, asked for on a CPU (the default --precision and --modes)."""
    folder = tmp_path_factory.mktemp("lab03")
    with quiet() as out:
        status = run_main(SCRIPT, [*TINY, "--folder", str(folder / "csv"), "--results-dir", str(folder / "records")])
    return {"status": status, "stdout": out.getvalue(), "csv": folder / "csv", "records": folder / "records"}


def test_cpu_run_writes_the_sjtu_pages_csv_layout(cpu_run):
    assert cpu_run["status"] == 0, cpu_run["stdout"]
    names = sorted(p.name for p in cpu_run["csv"].iterdir())
    expected = sorted([f"cpu_1_procs_{p}_model_{m}_benchmark.csv" for p in CPU_RUNS for m in ("train", "inference")]
                      + ["cpu_1_procs_summary.csv"])
    assert names == expected
    for precision in CPU_RUNS:
        for mode in ("train", "inference"):
            rows = read_csv(cpu_run["csv"] / f"cpu_1_procs_{precision}_model_{mode}_benchmark.csv")
            assert rows[0] == ["resnet18"]  # a column per model
            assert len(rows) == 1 + 2  # a row per timed iteration (-n 2), warm-up left out
            assert all(float(row[0]) > 0 for row in rows[1:])  # ms per batch


def test_summary_csv_lists_skipped_precisions_with_the_reason(cpu_run):
    with open(cpu_run["csv"] / "cpu_1_procs_summary.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert tuple(rows[0]) == shared().SUMMARY_COLUMNS
    by_key = {(r["mode"], r["precision"]): r for r in rows}
    assert len(by_key) == len(rows) == 12
    for mode in ("train", "inference"):
        assert "no TF32 mode" in by_key[(mode, "tf32")]["reason"]
        assert "CUDA" in by_key[(mode, "amp-fp16")]["reason"]
        for precision in CPU_SKIPS:
            assert by_key[(mode, precision)]["status"] == "skipped"
            assert by_key[(mode, precision)]["ms_per_batch_median"] == ""
        for precision in CPU_RUNS:
            row = by_key[(mode, precision)]
            assert row["status"] == "ok" and row["diverged"] == "no"
            assert float(row["ms_per_batch_median"]) > 0 and float(row["achieved_tflops"]) > 0


def test_records_carry_the_documented_metrics(cpu_run):
    by_method = records_by_method(cpu_run["records"])
    assert sorted(by_method) == sorted(f"{m}-{p}" for m in ("train", "inference") for p in (*CPU_RUNS, *CPU_SKIPS))
    for precision in CPU_RUNS:
        for mode in ("train", "inference"):
            (record,) = by_method[f"{mode}-{precision}"]
            assert record["lab"] == "lab03" and record["status"] == "ok"
            config, metrics = record["config"], record["metrics"]
            assert (config["model"], config["mode"], config["precision"]) == ("resnet18", mode, precision)
            assert config["parallel"] == "none" and metrics["world_size"] == 1
            ms = metrics["ms_per_batch"]
            assert ms["min"] <= ms["median"] <= ms["max"] and ms["std"] >= 0
            assert math.isclose(ms["mean"], sum(metrics["ms_per_batch_samples"]) / 2)
            assert len(metrics["ms_per_batch_samples"]) == 2
            assert metrics["samples_per_s"] > 0
            assert metrics["flops_per_batch"] > 0 and metrics["achieved_tflops"] > 0
            # The model's FLOPs per batch over the median time per batch (what the MFU of a GPU is a share of).
            assert metrics["achieved_tflops"] == pytest.approx(metrics["flops_per_batch"] / (ms["median"] / 1e3) / 1e12)
            assert metrics["peak_tflops"] is None and "no peak known for a CPU" in metrics["mfu_reason"]
            assert metrics["mfu"] is None and metrics["launch_bound"] is None
            assert metrics["memory"][0]["source"] == "process_max_rss"
            assert metrics["step_time"]["method"].startswith("time.perf_counter per step, CPU")
            assert metrics["step_time"]["steps_timed"] == 2 and metrics["step_time"]["warmup_steps"] == 1
    # Training does forward and backward: about three times the FLOPs of inference.
    train = by_method["train-fp32"][0]["metrics"]["flops_per_batch"]
    inference = by_method["inference-fp32"][0]["metrics"]["flops_per_batch"]
    assert 2.5 < train / inference < 3.5
    from common.runtime.machine import cpu_description

    # The note that float16 runs in float32 inside each kernel: only where this CPU has no float16 arithmetic.
    noted = any("float16 on a CPU" in note for note in by_method["train-half"][0]["notes"])
    assert noted == (cpu_description()["fp16"] != "native")
    assert "launch-bound" not in cpu_run["stdout"]  # no peak known for a CPU: nothing to be far from


def test_unsupported_precisions_are_skipped_records_with_the_reason(cpu_run):
    by_method = records_by_method(cpu_run["records"])
    for mode in ("train", "inference"):
        for precision in CPU_SKIPS:
            (record,) = by_method[f"{mode}-{precision}"]
            assert record["status"] == "skipped"
            assert record["notes"] == [record["metrics"]["skip_reason"]]
            assert record["config"]["model"] is None
    assert "skipping tf32: TF32 is a tensor-core format" in cpu_run["stdout"]


def test_loss_check_against_fp32(cpu_run):
    checks = {p: records_by_method(cpu_run["records"])[f"train-{p}"][0]["metrics"] for p in CPU_RUNS}
    fp32 = checks["fp32"]["loss_check"]
    assert fp32["relative_diff"] == 0 and fp32["losses"] == fp32["fp32_losses"]
    assert fp32["losses"][-1] < fp32["losses"][0]  # the three steps do train
    for precision in CPU_RUNS:
        check = checks[precision]["loss_check"]
        assert check["check_steps"] == check["applied_steps"] == check["attempts"] == 3
        assert check["skipped_steps"] == 0 and check["compared_after_steps"] == 2 and check["verdict"] == "agrees"
        assert check["fp32_losses"] == fp32["losses"]
        assert check["tolerance"] == shared().DEFAULT_LOSS_TOLERANCE
        assert checks[precision]["loss_relative_diff_vs_fp32"] == check["relative_diff"]
        assert not checks[precision]["diverged"]
    assert checks["fp64"]["loss_relative_diff_vs_fp32"] < 1e-3
    # bfloat16 and float16 round for real (8 and 11 significant bits), yet stay inside the tolerance.
    for precision in ("half", "amp-bf16"):
        assert 1e-4 < checks[precision]["loss_relative_diff_vs_fp32"] < shared().DEFAULT_LOSS_TOLERANCE


def with_overflowing_scaler(monkeypatch, backoff_factor: float):
    """amp-bf16's loss check gets a real GradScaler whose scale overflows float32 (2**127 times a gradient
    above 2), as amp-fp16's 65536 overflowed float16 on an H100: the scaler's own inf check skips those steps."""
    import torch

    bench = load_script(SCRIPT)
    make_optimizer = bench.make_optimizer

    def overflowing(model, precision, device, args):
        optimizer, scaler = make_optimizer(model, precision, device, args)
        if precision == "amp-bf16":
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, backoff_factor=backoff_factor)
        return optimizer, scaler

    monkeypatch.setattr(bench, "make_optimizer", overflowing)
    return bench


def run_loss_check(tmp_path: Path, image_size: int, *extra: str) -> tuple[str, dict[str, list[dict]]]:
    """fp32 and amp-bf16 inference on one resnet18 batch of 2 after a 2-step loss check: the output, the records."""
    argv = ["--device", "cpu", "--models", "resnet18", "--image-size", str(image_size), "-b", "2", "-w", "0", "-n", "1",
            "--check-steps", "2", "--precision", "fp32,amp-bf16", "--modes", "inference", *extra,
            "--folder", str(tmp_path / "csv"), "--results-dir", str(tmp_path / "records")]
    with quiet() as out:
        assert run_main(SCRIPT, argv) == 0
    return out.getvalue(), records_by_method(tmp_path / "records")


def test_the_loss_check_compares_after_the_same_number_of_applied_steps(tmp_path, monkeypatch):
    """Skipped GradScaler steps leave the weights as they were: the check tries again and compares the loss
    with fp32's after as many applied steps, so a healthy precision is not called DIVERGED."""
    with_overflowing_scaler(monkeypatch, backoff_factor=0.5)
    out, by_method = run_loss_check(tmp_path, 64, "--seed", "1")
    fp32, bf16 = (by_method[f"inference-{p}"][0]["metrics"]["loss_check"] for p in ("fp32", "amp-bf16"))
    assert fp32["skipped_steps"] == 0 and fp32["attempts"] == 2
    assert bf16["skipped_steps"] >= 1 and bf16["attempts"] == bf16["applied_steps"] + bf16["skipped_steps"]
    assert bf16["applied_steps"] == 2 and bf16["compared_after_steps"] == 1 and len(bf16["losses"]) == 2
    assert bf16["losses"][1] < bf16["losses"][0]  # the compared loss is after a real update
    assert bf16["verdict"] == "agrees" and not bf16["diverged"] and bf16["relative_diff"] < 0.05
    assert any(note.startswith(f"GradScaler skipped {bf16['skipped_steps']} of the {bf16['attempts']}")
               for note in by_method["inference-amp-bf16"][0]["notes"])
    assert "DIVERGED" not in out and "step(s) skipped" in out


def test_a_check_whose_every_step_was_skipped_is_inconclusive(tmp_path, monkeypatch):
    """Every attempt overflows (at 32x32 the gradients reach 100+; the scale stays above 2**126): the weights
    never move, and the verdict is inconclusive, not DIVERGED, in the record, the CSV and the report."""
    bench = with_overflowing_scaler(monkeypatch, backoff_factor=0.9)
    monkeypatch.setattr(bench, "MAX_SKIPPED_CHECK_STEPS", 2)  # the cap, small to stay cheap
    from common.runtime import machine

    # A CPU without bf16 units: the run says so in one line at start, and its bf16 record says so too.
    monkeypatch.setattr(machine, "read_cpuinfo", lambda path="/proc/cpuinfo": fake_cpuinfo("AMD EPYC 7302", "avx2"))
    out, by_method = run_loss_check(tmp_path, 32, "--seed", "1")
    (record,) = by_method["inference-amp-bf16"]
    check = record["metrics"]["loss_check"]
    assert (check["attempts"], check["skipped_steps"], check["applied_steps"]) == (2, 2, 0)
    assert check["verdict"] == "inconclusive" and not check["diverged"] and check["relative_diff"] is None
    assert len(check["losses"]) == 1  # the untrained loss only: nothing trained to compare
    assert record["notes"][0] == ("INCONCLUSIVE: GradScaler skipped all 2 attempted steps: the weights never moved, "
                                  "so there is no training to compare with fp32's")
    assert "INCONCLUSIVE" in out and "DIVERGED" not in out
    emulated = [line for line in out.splitlines() if line.startswith("note: bf16 is emulated")]
    assert len(emulated) == 1 and "AMD EPYC 7302" in emulated[0] and emulated[0][6:] in record["notes"]
    with open(tmp_path / "csv" / "cpu_1_procs_summary.csv", newline="") as handle:
        rows = {row["precision"]: row for row in csv.DictReader(handle)}
    assert (rows["amp-bf16"]["check_verdict"], rows["amp-bf16"]["diverged"]) == ("inconclusive", "no")
    from common.report import build_report

    page = build_report(tmp_path / "records", tmp_path / "report.html", plots=False).report_path.read_text()
    page = page[page.index("<h2>Lab 03: precision benchmark"):]
    page = page[:page.index("</section>")]
    assert ">inconclusive</td>" in page and "⚠ diverged" not in page


def test_half_keeps_batchnorm_in_float32():
    """model.half() for the convolutions and the linear layer; BatchNorm's weights and statistics stay float32."""
    import torch

    from common.models import build_model

    bench = load_script(SCRIPT)
    model = bench.make_model(build_model("resnet18", num_classes=10), "half", torch.device("cpu"), False)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all(t.dtype == torch.float32 for m in norms for t in (*m.parameters(), *m.buffers())
                         if t.is_floating_point())
    assert model.conv1.weight.dtype == model.fc.weight.dtype == torch.float16


def test_a_precision_over_the_tolerance_is_flagged(tmp_path):
    """The same check with a tolerance no rounding can meet: amp-bf16 is flagged, fp32 (the reference) is not."""
    out, by_method = run_loss_check(tmp_path, 32, "--loss-tolerance", "1e-6")
    bf16, fp32 = by_method["inference-amp-bf16"][0], by_method["inference-fp32"][0]
    assert bf16["metrics"]["diverged"] and not fp32["metrics"]["diverged"]
    assert any(note.startswith("DIVERGED: loss after 1 applied steps") for note in bf16["notes"])
    assert "DIVERGED" in out
    with open(tmp_path / "csv" / "cpu_1_procs_summary.csv", newline="") as handle:
        flagged = {row["precision"]: row["diverged"] for row in csv.DictReader(handle)}
    assert flagged == {"fp32": "no", "amp-bf16": "yes"}


@pytest.mark.parametrize("argv, message", [
    (["--models", "resnet18,resnet9000"], "error: unknown models 'resnet9000'; did you mean resnet"),
    (["--models", "nothing_alike"], "error: unknown models 'nothing_alike'; none of the "),  # not 80 names in a row
    (["--precision", "fp32,fp8"], "error: unknown precisions 'fp8'; valid precisions: fp64, fp32, tf32"),
    (["--precision", "fp16"], "error: unknown precisions 'fp16'; did you mean half or amp-fp16?\n"),  # two rows here
    (["--models", "vit_b_16", "--image-size", "64"], "error: vit_b_16 cannot run on 64x64 images: "),
    (["--precision", "tf32,amp-fp16"], "error: no precision asked for runs on "),  # on a CPU
    pytest.param(["-g", "100000"], "error: -g 100000 on the CPU: 100000 processes of at least ",
                 marks=pytest.mark.skipif(sys.platform != "linux", reason="the memory check reads /proc")),
])
def test_bad_input_is_one_error_line_and_writes_nothing(tmp_path, capsys, argv, message):
    status = run_main(SCRIPT, [*argv, "--device", "cpu", "--folder", str(tmp_path / "csv"),
                               "--results-dir", str(tmp_path / "records")])
    out, err = capsys.readouterr()
    assert status == 2
    assert err.startswith(message) and err.count("\n") == 1, err
    assert out == ""  # said before the run's first line (and before seconds of FLOP counting)
    assert not (tmp_path / "csv").exists() and not (tmp_path / "records").exists()
    if "nothing_alike" in message:  # a sample of the names, not all of torchvision's
        assert "alexnet" in err and "wide_resnet101_2" not in err and len(err) < 200, err


def test_a_run_adds_its_models_to_the_csvs_an_earlier_run_left(tmp_path):
    """One job per model into one folder: the second run keeps the first one's columns and rows, and a model
    measured again replaces its own (no second column, no second row)."""
    argv = [*TINY, "--image-size", "32", "--check-steps", "2", "--modes", "train", "--precision", "fp32",
            "--folder", str(tmp_path / "csv"), "--results-dir", str(tmp_path / "records")]
    times = tmp_path / "csv" / "cpu_1_procs_fp32_model_train_benchmark.csv"
    with quiet() as out:
        assert run_main(SCRIPT, argv) == 0
        first = read_csv(times)
        assert run_main(SCRIPT, [*argv, "--models", "resnet34"]) == 0
        assert run_main(SCRIPT, [*argv, "--models", "resnet34"]) == 0
    second = read_csv(times)
    assert first[0] == ["resnet18"] and second[0] == ["resnet18", "resnet34"], second
    assert [row[0] for row in second[1:]] == [row[0] for row in first[1:]]  # the earlier run's times, as they were
    with open(tmp_path / "csv" / "cpu_1_procs_summary.csv", newline="") as handle:
        assert [row["model"] for row in csv.DictReader(handle)] == ["resnet18", "resnet34"]
    assert "(with an earlier run's resnet18)" in out.getvalue().splitlines()[-1]
    times.write_text("resnet18,resnet34\n1.0,oops\n")  # edited by hand: not read back as if it were numbers
    with quiet():
        assert run_main(SCRIPT, argv) == 2
    assert times.read_text() == "resnet18,resnet34\n1.0,oops\n"


def test_a_stopped_run_keeps_what_it_measured_and_the_earlier_run_s_rows_and_says_how_to_go_on(tmp_path, monkeypatch,
                                                                                                capsys):
    """Ctrl-C during the second model: it said only 'interrupted', and the CSVs written after the first model had
    already dropped an earlier run's rows of the second, a model this run never finished measuring."""
    argv = [*TINY, "--image-size", "32", "--check-steps", "2", "--modes", "train", "--precision", "fp32,tf32",
            "--folder", str(tmp_path / "csv"), "--results-dir", str(tmp_path / "records")]  # tf32: skipped on a CPU
    times = tmp_path / "csv" / "cpu_1_procs_fp32_model_train_benchmark.csv"
    assert run_main(SCRIPT, [*argv, "--models", "resnet34"]) == 0
    earlier = read_csv(times)
    script, calls = load_script(SCRIPT), []
    real = script.time_mode

    def stopped_in_the_second_model(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as Ctrl-C in the middle of a measurement
        return real(*args, **kwargs)

    monkeypatch.setattr(script, "time_mode", stopped_in_the_second_model)
    capsys.readouterr()
    assert run_main(SCRIPT, [*argv, "--models", "resnet18,resnet34"]) == 130
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == (f"stopped: 2 record(s) in {tmp_path / 'records'}; the CSVs in {tmp_path / 'csv'} "
                                    "hold resnet18; to measure the rest: --models resnet34"), out  # and tf32 skipped
    assert err == "interrupted\n"
    now = read_csv(times)
    assert now[0] == ["resnet34", "resnet18"] and [row[0] for row in now[1:]] == [row[0] for row in earlier[1:]], now


def test_g_on_a_cpu_starts_only_as_many_processes_as_the_available_memory_holds():
    """Each process at least this one's resident size (PyTorch imported), against MemAvailable: 512 MiB each in
    8 GiB available is 16 processes; a 17th is one error line that says how many fit."""
    shared().check_processes_fit(16, available=8 * 2**30, each=2**29)
    with pytest.raises(shared().UserError, match=r"^-g 17 on the CPU: 17 processes of at least 512\.0 MiB each "
                                                 r"\(PyTorch alone\) need 8\.5 GiB, and this machine has 8\.0 GiB "
                                                 r"available: at most 16 fit$"):
        shared().check_processes_fit(17, available=8 * 2**30, each=2**29)


def test_the_csv_folder_is_beside_the_records_by_default(tmp_path, monkeypatch):
    """Not results/lab03_csv in whatever folder the command was typed in (the other scripts' side files are under
    RESULTS_DIR too)."""
    monkeypatch.chdir(tmp_path)
    args = load_script(SHARED).read_args(load_script(SCRIPT).build_parser(), ["--results-dir", "elsewhere/records"])
    assert args.folder == Path("elsewhere/records/lab03_csv")
    given = load_script(SHARED).read_args(load_script(SCRIPT).build_parser(), ["--folder", "csv"])
    assert given.folder == Path("csv")


def test_two_processes_run_ddp_on_the_cpu(lab03_ddp_run):
    """-g 2 on a CPU: torchrun starts two Gloo processes, DDP in training; rank 0 writes."""
    result, tmp_path = lab03_ddp_run  # shared with tests/test_distributed_teardown.py
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"-g 2: running torchrun --standalone --nproc_per_node=2 {REPO / SCRIPT} --device cpu -g 2" in result.stdout
    assert "2 process(es) with DDP" in result.stdout
    (record,) = records_by_method(tmp_path / "records")["train-fp32"]
    assert record["config"]["parallel"] == "ddp" and record["metrics"]["world_size"] == 2
    assert record["metrics"]["global_batch_size"] == 4
    distributed = record["provenance"]["distributed"]
    assert distributed["backend"] == "gloo" and distributed["world_size"] == 2
    assert distributed["launcher"] == "torchrun"  # the ranks saw torchrun's variables
    assert record["notes"] == ["2 DDP processes: the times are rank 0's"]
    rows = read_csv(tmp_path / "csv" / "cpu_2_procs_fp32_model_train_benchmark.csv")
    assert rows[0] == ["resnet18"] and len(rows) == 3


def test_g_sent_sigterm_stops_torchrun_and_its_processes(tmp_path):
    """``kill`` on ``-g 2``'s python (or a job's end) killed it alone: torchrun and its two processes benchmarked on.
    Now torchrun is stopped with it, and its processes: 'terminated (SIGTERM)', exit 143, no process left, no record."""

    from helpers import LAB03_DDP_ARGS

    argv = [arg if arg not in ("csv", "records") else str(tmp_path / arg) for arg in LAB03_DDP_ARGS]
    argv[argv.index("-n") + 1] = "100000"  # a benchmark that would run for hours
    status, out, left, _ = terminate_when([PYTHON, str(REPO / SCRIPT), *argv], "process(es) with DDP", str(tmp_path),
                                          script_env())  # rank 0 has started the benchmark under torchrun
    assert status == 143, out[-3000:]
    assert out.rstrip().endswith("terminated (SIGTERM)") and left == [], out[-3000:]
    assert not (tmp_path / "records").exists() or not any((tmp_path / "records").iterdir())


def test_g_runs_the_torchrun_command_it_prints_or_is_one_error_line(monkeypatch, capsys, tmp_path):
    """-g N from plain python: the printed torchrun command is what runs, its exit status is the script's.
    -g that cannot work fails before anything starts: more processes than GPUs, or -g against a launcher."""
    import torch

    import labs.lab03_precision_benchmark.lab03_shared as lab03_shared

    started = []
    monkeypatch.setenv("OMP_NUM_THREADS", "8")  # this process's threads (the job header sets it): shared out
    monkeypatch.setattr(lab03_shared, "run_attached", lambda command, env: started.append((command, env)) or 3)
    argv = ["-g", "4", "--device", "cpu", "--models", "resnet18", "--image-size", "32", "--results-dir", str(tmp_path)]
    assert run_main(SCRIPT, argv) == 3
    ((command, env),) = started
    printed = capsys.readouterr().out.strip()
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]  # torchrun, from this Python
    assert printed == "-g 4: running " + shlex.join(["torchrun", *command[3:]])
    assert command[3:] == ["--standalone", "--nproc_per_node=4", str(REPO / SCRIPT), *argv]
    assert int(env["OMP_NUM_THREADS"]) == max(1, torch.get_num_threads() // 4)  # the cores shared out

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert run_main(SCRIPT, [*argv[:2], "--device", "cuda", *argv[4:]]) == 2
    assert "error: 4 processes on this node but only 2 GPU(s) visible" in capsys.readouterr().err
    # -g 2 on the 2 GPUs: torchrun starts, and this process, which only waits for it, never starts CUDA (a context
    # on GPU 0 beside rank 0's, for the whole run)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *args: started.append("set_device"))
    monkeypatch.setattr(torch.cuda, "init", lambda: started.append("init"))
    assert run_main(SCRIPT, ["-g", "2", "--device", "cuda", *argv[4:]]) == 3
    assert started[1][0][3:5] == ["--standalone", "--nproc_per_node=2"] and len(started) == 2
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    assert run_main(SCRIPT, argv) == 2
    assert capsys.readouterr().err == "error: -g 4 but torchrun started 2 processes; under a launcher leave -g out\n"
    assert len(started) == 2 and not any(tmp_path.iterdir())


def test_report_renders_the_precision_section(cpu_run, tmp_path):
    from common.report import build_report

    outcome = build_report(cpu_run["records"], tmp_path / "report.html", plots=False)
    page = outcome.report_path.read_text()
    assert "Lab 03: precision benchmark" in page
    page = page[page.index("<h2>Lab 03: precision benchmark"):]
    page = page[:page.index("</section>")]
    assert "train, " in page and "median ms per batch · speed-up over fp32" in page
    assert "achieved TFLOP/s per device" in page and "loss after the check steps" in page
    assert 'title="TF32 is a tensor-core format' in page  # skipped cells carry the reason
    # tf32 and amp-fp16: in the ms and TFLOP/s tables of each mode, and in the loss-check table
    assert page.count(">skipped</td>") == 2 * 2 * 2 + 2


def test_report_names_the_peak_each_gpu_figure_is_a_share_of(tmp_path):
    """The H100 record of the GPU proof (schema 3, upgraded on reading): the TFLOP/s cell says which peak its
    share is of, on hover."""
    import shutil

    from common.report import build_report

    for record in (REPO / "reference-results/h100-1gpu/lab03").glob("*.json"):
        shutil.copy(record, tmp_path)
    page = build_report(tmp_path, tmp_path / "report.html", plots=False).report_path.read_text()
    page = page[page.index("achieved TFLOP/s per device"):]
    assert re.search(r'<td class="num" title="peak: H100 SXM datasheet[^"]*">130 \(13% of 989.5\)', page), page[:3000]


def test_shared_rules_without_torch():
    lab = shared()
    assert lab.unsupported_reason("fp64", "cpu") is None and lab.unsupported_reason("amp-bf16", "cpu") is None
    assert lab.unsupported_reason("half", "cpu") is None  # runs (slowly) on recent PyTorch
    assert lab.unsupported_reason("tf32", "cuda", "NVIDIA A100-SXM4-40GB", (8, 0)) is None
    assert "sm_70" in lab.unsupported_reason("tf32", "cuda", "Tesla V100-SXM2-32GB", (7, 0))
    assert "bfloat16" in lab.unsupported_reason("amp-bf16", "cuda", "Tesla V100-SXM2-32GB", (7, 0))
    ok = lab.compare_losses([6.9, 5.0, 3.01], [6.9, 5.0, 3.0])
    assert not ok["diverged"] and math.isclose(ok["relative_diff"], 0.01 / 6.9)
    stalled = lab.compare_losses([6.9, 6.9, 6.9], [6.9, 5.0, 3.0])  # gradients that underflowed to zero
    assert stalled["diverged"] and "over the 5% tolerance" in stalled["reason"]
    broken = lab.compare_losses([6.9, float("inf"), float("nan")], [6.9, 5.0, 3.0])
    assert broken["diverged"] and broken["reason"] == "loss became NaN or inf" and broken["relative_diff"] is None
    # Four skipped steps, as on the H100 (scale 65536 -> 4096): compared after the same two applied steps.
    late = lab.compare_losses([6.9, 5.01, 3.01], [6.9, 5.0, 3.0], attempts=7, skipped_steps=4)
    assert late["verdict"] == "agrees" and (late["applied_steps"], late["compared_after_steps"]) == (3, 2)
    capped = lab.compare_losses([6.9, 5.01], [6.9, 5.0, 3.0], attempts=17, skipped_steps=16)  # gave up at the cap
    assert capped["verdict"] == "agrees" and capped["fp32_loss"] == 5.0 and capped["compared_after_steps"] == 1
    never = lab.compare_losses([6.9], [6.9, 5.0, 3.0], attempts=16, skipped_steps=16)
    assert never["verdict"] == "inconclusive" and not never["diverged"] and "skipped all 16" in never["reason"]
    # Far from the peak is launch-bound; one line, with the remedy; nothing where no peak is known.
    h100 = [{"model": "resnet50", "mode": "train", "precision": p, "mfu": f}
            for p, f in (("fp32", 0.16), ("tf32", 0.03), ("amp-bf16", 0.015))]
    line = lab.launch_bound_line(h100, 12)
    assert line.startswith("launch-bound: 2 of 3 results below 5% of the GPU's peak (lowest: resnet50 train amp-bf16")
    assert "\n" not in line and "raise -b" in line and "--compile" in line and "CUDA graphs" in line
    assert lab.launch_bound_line([{**row, "mfu": None} for row in h100], 12) is None
    assert lab.iterations_csv({"a": [1.0, 2.5], "b": [3.0, 4.0]}) == "a,b\n1.0000,3.0000\n2.5000,4.0000\n"
    assert lab.csv_name(lab.device_tag("cuda", "NVIDIA A100-SXM4-40GB", 1), "fp32", "train") == \
        "NVIDIA-A100-SXM4-40GB_1_gpus_fp32_model_train_benchmark.csv"


def test_flags_are_the_sjtu_pages_plus_the_labs_and_say_their_defaults():
    script = load_script(SCRIPT)
    parser = script.build_parser()
    options = {option: action for action in parser._actions for option in action.option_strings}
    for flag in ("--folder", "-w", "--warmup", "-n", "--repeats", "-b", "--batch-size", "-g", "--num-gpus",
                 "--models", "--modes", "--precision", "--channels-last", "--compile", "--image-size", "--device",
                 "--results-dir", "--seed", "--dry-run", "--check-steps", "--loss-tolerance"):
        assert flag in options, flag
    formatter = parser._get_formatter()  # what --help prints for each flag, default included
    for action in set(options.values()):
        # Hidden: torch.distributed.launch's --local-rank.
        if action.dest != "help" and action.help != argparse.SUPPRESS:
            help_text = formatter._get_help_string(action) % {"default": action.default}
            assert help_text.count("(default: ") == 1 and "(default: None)" not in help_text, (action.dest, help_text)
    assert "(default: resnet18, resnet34, resnet50," in " ".join(parser.format_help().split())
    args = shared().read_args(parser, [])
    assert args.models == list(shared().SJTU_MODELS) and args.precision == list(shared().PRECISIONS)
    assert args.image_size == 224 and not args.dry_run
    # --dry-run checks every model and precision on small images: a check of the paths, in minutes on a CPU
    dry = shared().read_args(parser, ["--dry-run"])
    assert (dry.image_size, dry.batch_size, dry.warmup, dry.repeats, dry.check_steps) == (64, 12, 1, 2, 2)
    assert dry.models == args.models and dry.precision == args.precision
    assert shared().read_args(parser, ["--dry-run", "--image-size", "16"]).image_size == 16


def test_the_gpu_command_on_a_machine_without_one_says_it_benchmarks_the_cpu(capsys):
    """The README's GPU-node line typed on a laptop runs the nine models at 224x224 on the CPU (hours): one note
    says so first; a --dry-run, or images as small as its, says nothing."""
    import torch

    from common.runtime.launch import detect_launch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the command runs there")
    parser = load_script(SCRIPT).build_parser()
    for argv, noted in (([], True), (["--dry-run"], False), (["--image-size", "32"], False),
                        (["--device", "cpu"], False)):
        assert shared().check_request(shared().read_args(parser, ["-g", "1", *argv]), detect_launch()) is False
        out = capsys.readouterr().out
        assert out.startswith("note: no GPU visible: this benchmarks the CPU, 9 model(s) at 224x224") == noted, argv


APPTAINER_DEF = REPO / "environments/apptainer/pytorch.def"
#: What `pip freeze` says in the NGC image: its own builds of these three, which must stay.
NGC_BUILDS = "torch==2.6.0a0+df5bbc09d1.nv24.12\ntorchvision==0.20.0a0\nnumpy==1.26.4\npandas==2.2.2\n"


def definition() -> tuple[dict[str, str], dict[str, str]]:
    """environments/apptainer/pytorch.def as Apptainer reads it: ``Key: value`` header lines up to the
    first ``%section``, then each section's body up to the next line that starts with ``%``."""
    text = APPTAINER_DEF.read_text()
    header = text[:re.search(r"^%", text, re.M).start()]
    keys = dict(re.findall(r"^(\w+):\s*(.+?)\s*$", header, re.M))
    return keys, dict(re.findall(r"^%(\w+)\n(.*?)(?=^%|\Z)", text, re.M | re.S))


def test_container_build_installs_pyprojects_dependencies_and_keeps_the_images_torch(tmp_path):
    """Apptainer runs %post with /bin/sh inside the NGC image: here with a stand-in python that answers
    `pip freeze` as that image would and logs every call. pip installs exactly pyproject.toml's runtime
    dependencies other than torch, torchvision and numpy, constrained to the image's own builds of those."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")

    keys, sections = definition()
    assert keys["Bootstrap"] == "docker" and re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", keys["From"])
    tools, log = tmp_path / "bin", tmp_path / "calls.log"
    tools.mkdir()
    (tools / "python").write_text(f"""#!/bin/sh
printf '%s\\n' "$*" >> {log}
case "$1 $2 $3" in
    "-m pip freeze") printf '{NGC_BUILDS.replace(chr(10), chr(92) + "n")}' ;;
    "-m pip install")
        while [ $# -gt 1 ] && [ "$1" != --constraint ]; do shift; done
        sed 's/^/CONSTRAINT /' "$2" >> {log} ;;
esac
""")
    (tools / "python").chmod(0o755)
    done = subprocess.run(["/bin/sh", "-c", sections["post"]], cwd=tmp_path, capture_output=True, text=True,
                          env={"PATH": f"{tools}:/usr/bin:/bin"}, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    (install,) = [call for call in calls if call.startswith("-m pip install ")]
    pinned = [call.removeprefix("CONSTRAINT ") for call in calls if call.startswith("CONSTRAINT ")]
    assert pinned == NGC_BUILDS.splitlines()[:3]  # torch, torchvision and numpy as the image has them
    installed = shlex.split(install)[install.split().index("--constraint") + 1 + 1:]
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    same = lambda spec: re.sub(r"[\s'\"]", "", spec)  # noqa: E731 - a marker written without spaces or quotes
    in_the_image = ("torch", "torchvision", "numpy")
    assert [same(spec) for spec in installed] == [same(spec) for spec in dependencies
                                                  if re.split(r"[<>=]", spec, maxsplit=1)[0] not in in_the_image]
    assert calls[-1].startswith("-c import torch, torchvision")  # the build's own check comes last


@pytest.mark.parametrize("in_checkout", [True, False])
def test_container_environment_puts_the_checkout_on_pythonpath_and_drops_the_hosts(tmp_path, in_checkout):
    """%environment, sourced by /bin/sh as Apptainer does in the folder a job runs from."""
    _, sections = definition()
    if in_checkout:
        (tmp_path / "common").mkdir()
    (tmp_path / "environment.sh").write_text(sections["environment"])
    done = subprocess.run(["/bin/sh", "-c", '. ./environment.sh; echo "${PYTHONPATH-unset} $PYTHONUNBUFFERED"'],
                          cwd=tmp_path, capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": "/host/site-packages"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(tmp_path) if in_checkout else "unset", "1"]


@pytest.mark.gpu
def test_gpu_small_batch_says_launch_bound_and_fp16_is_compared_after_applied_steps(tmp_path):
    """A fresh process on a GPU: batch 2 is far below 5% of the peak (one launch-bound line, the fraction in every
    record), half runs with float32 BatchNorm, and amp-fp16's skipped steps do not make it DIVERGED."""
    result = run_script(SCRIPT, "--device", "cuda", "--models", "resnet50", "--image-size", "224", "-b", "12",
                        "-w", "3", "-n", "3", "--precision", "fp32,half,amp-fp16,amp-bf16", "--modes", "train",
                        "--folder", str(tmp_path / "csv"), "--results-dir", str(tmp_path / "records"), timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sum(line.startswith("launch-bound: ") for line in result.stdout.splitlines()) == 1
    by_method = records_by_method(tmp_path / "records")
    for precision in ("fp32", "half", "amp-fp16", "amp-bf16"):
        metrics = by_method[f"train-{precision}"][0]["metrics"]
        assert metrics["peak_tflops"] and 0 < metrics["mfu"] < 1
        assert metrics["loss_check"]["verdict"] != "diverged", metrics["loss_check"]
        assert metrics["loss_check"]["compared_after_steps"] == metrics["loss_check"]["check_steps"] - 1


def test_a_long_silence_says_what_is_still_being_measured_and_the_thread_ends(tmp_path, monkeypatch):
    """Rank 0 prints a line after QUIET_S seconds without one (here 20 ms: building a model alone takes longer on any
    machine), naming the model and precision it is measuring; its thread is gone when the run ends, after a success
    and after an error."""
    import threading

    monkeypatch.setattr(shared().Output, "QUIET_S", 0.02)
    argv = [*TINY, "--image-size", "32", "--modes", "train", "--precision", "fp32,fp64",
            "--folder", str(tmp_path / "csv"), "--results-dir", str(tmp_path / "records")]
    with quiet() as out:
        assert run_main(SCRIPT, argv) == 0
        assert run_main(SCRIPT, [*argv, "--precision", "tf32"]) == 2  # nothing runnable on a CPU: an error
    lines = [line for line in out.getvalue().splitlines() if "still measuring" in line]
    said = re.compile(r"  \.\.\. still measuring resnet18 at fp(32|64): \d+ s since the last line")
    assert lines and all(said.fullmatch(line) for line in lines), lines
    assert not [thread for thread in threading.enumerate() if thread.name == "lab03-progress"]
