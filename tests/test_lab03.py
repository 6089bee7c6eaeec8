"""Lab-03 acceptance: the precision benchmark on CPU, tiny (resnet18, 64x64 images, batch 2, 2 timed iterations).

What is checked, from real runs:

- the seed's CSV layout (one file per mode and precision, a column per model, a row per timed iteration,
  ms per batch) and the summary CSV, which also lists what was skipped and why;
- one record per model, mode and precision with the documented metrics;
- fp64, fp32, half and amp-bf16 run on a CPU; tf32 and amp-fp16 are skipped with the reason;
- the loss check: fp64 ends within 1e-3 of fp32's loss (same maths, more bits), amp-bf16 differs
  (bfloat16 really was used) but stays inside the 5% tolerance, and a precision over the tolerance is
  flagged in the record, the notes and the summary CSV;
- a clear one-line error for unknown model names and for an image size a model cannot take;
- ``-g 2`` runs DDP in two spawned Gloo processes and the record says so;
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
from pathlib import Path

import pytest

from helpers import REPO, load_script, run_main, run_script

SCRIPT = "labs/lab03_precision_benchmark/benchmark_models.py"
TINY = ["--device", "cpu", "--models", "resnet18", "--image-size", "64", "-b", "2", "-w", "1", "-n", "2",
        "--check-steps", "3", "--seed", "1"]
CPU_RUNS = ("fp64", "fp32", "half", "amp-bf16")
CPU_SKIPS = ("tf32", "amp-fp16")


@contextlib.contextmanager
def quiet_single_thread():
    """Run in-process with one intra-op thread and stdout captured.

    CI machines have two cores shared with other jobs; two OpenMP threads that spin-wait for each
    other on an oversubscribed machine run ResNet-18 several times slower than one thread does.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            yield out
    finally:
        torch.set_num_threads(threads)


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
    """All six precisions in both modes, asked for on a CPU (the default --precisions and --modes)."""
    folder = tmp_path_factory.mktemp("lab03")
    with quiet_single_thread() as out:
        status = run_main(SCRIPT, [*TINY, "--folder", str(folder / "csv"), "--results-dir", str(folder / "records")])
    return {"status": status, "stdout": out.getvalue(), "csv": folder / "csv", "records": folder / "records"}


def test_cpu_run_writes_the_seeds_csv_layout(cpu_run):
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
            assert metrics["peak_tflops"] is None and "CPU" in metrics["peak_tflops_source"]
            assert metrics["memory"][0]["source"] == "process_max_rss"
            assert metrics["step_time"]["method"].startswith("time.perf_counter per step, CPU")
            assert metrics["step_time"]["steps_timed"] == 2 and metrics["step_time"]["warmup_steps"] == 1
    # Training does forward and backward: about three times the FLOPs of inference.
    train = by_method["train-fp32"][0]["metrics"]["flops_per_batch"]
    inference = by_method["inference-fp32"][0]["metrics"]["flops_per_batch"]
    assert 2.5 < train / inference < 3.5
    assert any("float16 on a CPU" in note for note in by_method["train-half"][0]["notes"])


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
        assert check["steps"] == 3 and check["fp32_losses"] == fp32["losses"]
        assert check["tolerance"] == shared().DEFAULT_LOSS_TOLERANCE
        assert checks[precision]["loss_relative_diff_vs_fp32"] == check["relative_diff"]
        assert not checks[precision]["diverged"]
    assert checks["fp64"]["loss_relative_diff_vs_fp32"] < 1e-3
    # bfloat16 and float16 round for real (8 and 11 significant bits), yet stay inside the tolerance.
    for precision in ("half", "amp-bf16"):
        assert 1e-4 < checks[precision]["loss_relative_diff_vs_fp32"] < shared().DEFAULT_LOSS_TOLERANCE


def test_a_precision_over_the_tolerance_is_flagged(tmp_path):
    """The same check with a tolerance no rounding can meet: amp-bf16 is flagged, fp32 (the reference) is not."""
    argv = ["--device", "cpu", "--models", "resnet18", "--image-size", "32", "-b", "2", "-w", "0", "-n", "1",
            "--check-steps", "2", "--precisions", "fp32,amp-bf16", "--modes", "inference", "--loss-tolerance", "1e-6",
            "--folder", str(tmp_path / "csv"), "--results-dir", str(tmp_path / "records")]
    with quiet_single_thread() as out:
        assert run_main(SCRIPT, argv) == 0
    by_method = records_by_method(tmp_path / "records")
    bf16, fp32 = by_method["inference-amp-bf16"][0], by_method["inference-fp32"][0]
    assert bf16["metrics"]["diverged"] and not fp32["metrics"]["diverged"]
    assert any(note.startswith("DIVERGED: loss after 2 steps") for note in bf16["notes"])
    assert "DIVERGED" in out.getvalue()
    with open(tmp_path / "csv" / "cpu_1_procs_summary.csv", newline="") as handle:
        flagged = {row["precision"]: row["diverged"] for row in csv.DictReader(handle)}
    assert flagged == {"fp32": "no", "amp-bf16": "yes"}


@pytest.mark.parametrize("argv, message", [
    (["--models", "resnet18,resnet9000"], "error: unknown models 'resnet9000'; valid models: "),
    (["--precisions", "fp32,fp8"], "error: unknown precisions 'fp8'; valid precisions: fp64, fp32, tf32"),
    (["--models", "vit_b_16", "--image-size", "64"], "error: vit_b_16 cannot run on 64x64 images: "),
])
def test_bad_input_is_one_error_line_and_writes_nothing(tmp_path, capsys, argv, message):
    status = run_main(SCRIPT, [*argv, "--device", "cpu", "--folder", str(tmp_path / "csv"),
                               "--results-dir", str(tmp_path / "records")])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not (tmp_path / "csv").exists() and not (tmp_path / "records").exists()
    if "resnet9000" in message:
        assert "resnet18" in err and "wide_resnet101_2" in err  # the valid names are listed


def test_two_processes_run_ddp_on_the_cpu(tmp_path):
    """-g 2 on a CPU: two Gloo processes spawned by the script, DDP in training; rank 0 writes."""
    result = run_script(SCRIPT, "--device", "cpu", "-g", "2", "--models", "resnet18", "--image-size", "32",
                        "-b", "2", "-w", "1", "-n", "2", "--check-steps", "1", "--precisions", "fp32",
                        "--modes", "train", "--folder", str(tmp_path / "csv"),
                        "--results-dir", str(tmp_path / "records"), timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "spawning 2 processes" in result.stdout and "2 process(es) with DDP" in result.stdout
    (record,) = records_by_method(tmp_path / "records")["train-fp32"]
    assert record["config"]["parallel"] == "ddp" and record["metrics"]["world_size"] == 2
    assert record["metrics"]["global_batch_size"] == 4
    distributed = record["provenance"]["distributed"]
    assert distributed["backend"] == "gloo" and distributed["world_size"] == 2
    assert distributed["launcher"] == "torch.multiprocessing.spawn"
    assert record["notes"] == ["2 DDP processes: the times are rank 0's"]
    rows = read_csv(tmp_path / "csv" / "cpu_2_procs_fp32_model_train_benchmark.csv")
    assert rows[0] == ["resnet18"] and len(rows) == 3


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


def test_shared_rules_without_torch():
    lab = shared()
    assert lab.unsupported_reason("fp64", "cpu") is None and lab.unsupported_reason("amp-bf16", "cpu") is None
    assert lab.unsupported_reason("half", "cpu") is None  # runs (slowly) on recent PyTorch
    assert lab.unsupported_reason("tf32", "cuda", "NVIDIA A100-SXM4-40GB", (8, 0)) is None
    assert "sm_70" in lab.unsupported_reason("tf32", "cuda", "Tesla V100-SXM2-32GB", (7, 0))
    assert "bfloat16" in lab.unsupported_reason("amp-bf16", "cuda", "Tesla V100-SXM2-32GB", (7, 0))
    assert lab.peak_tflops("cuda", "NVIDIA A100-SXM4-40GB", "fp32")[0] == 19.5
    assert lab.peak_tflops("cuda", "NVIDIA A100 80GB PCIe", "amp-bf16")[0] == 312
    assert lab.peak_tflops("cuda", "NVIDIA H100 PCIe", "tf32")[0] == 378
    assert lab.peak_tflops("cuda", "NVIDIA H100 80GB HBM3", "tf32")[0] == 494.5
    assert lab.peak_tflops("cuda", "Tesla V100-SXM3-32GB", "half") == (125.0, "V100 SXM2 datasheet")
    assert lab.peak_tflops("cuda", "Tesla V100-SXM2-32GB", "tf32")[0] is None
    assert lab.peak_tflops("cuda", "NVIDIA GeForce RTX 4090", "fp32")[0] is None
    ok = lab.compare_losses([6.9, 5.0, 3.01], [6.9, 5.0, 3.0])
    assert not ok["diverged"] and math.isclose(ok["relative_diff"], 0.01 / 6.9)
    stalled = lab.compare_losses([6.9, 6.9, 6.9], [6.9, 5.0, 3.0])  # gradients that underflowed to zero
    assert stalled["diverged"] and "over the 5% tolerance" in stalled["reason"]
    broken = lab.compare_losses([6.9, float("inf"), float("nan")], [6.9, 5.0, 3.0])
    assert broken["diverged"] and broken["reason"] == "loss became NaN or inf" and broken["relative_diff"] is None
    assert lab.iterations_csv({"a": [1.0, 2.5], "b": [3.0, 4.0]}) == "a,b\n1.0000,3.0000\n2.5000,4.0000\n"
    assert lab.csv_name(lab.device_tag("cuda", "NVIDIA A100-SXM4-40GB", 1), "fp32", "train") == \
        "NVIDIA-A100-SXM4-40GB_1_gpus_fp32_model_train_benchmark.csv"


def test_flags_are_the_seeds_plus_the_labs_and_say_their_defaults():
    parser = load_script(SCRIPT).build_parser()
    options = {option: action for action in parser._actions for option in action.option_strings}
    for flag in ("--folder", "-w", "--warmup", "-n", "--num-iters", "-b", "--batch-size", "-g", "--num-gpus",
                 "--models", "--modes", "--precisions", "--channels-last", "--compile", "--image-size", "--device",
                 "--results-dir", "--seed", "--dry-run", "--check-steps", "--loss-tolerance"):
        assert flag in options, flag
    for action in set(options.values()):
        if action.dest != "help" and action.help != argparse.SUPPRESS:  # hidden: torch.distributed.launch's --local-rank
            assert "(default" in action.help, action.dest
    assert parser.parse_args([]).models.split(",") == list(shared().SEED_MODELS)


def test_container_definition_installs_the_course_dependencies():
    """environments/apptainer/pytorch.def: an NGC base, every non-torch runtime dependency, a runscript."""
    import re

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")

    text = (REPO / "environments/apptainer/pytorch.def").read_text()
    assert re.search(r"^Bootstrap: docker$", text, re.M)
    assert re.search(r"^From: nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3$", text, re.M)
    sections = dict(re.findall(r"^%(\w+)\n(.*?)(?=^%|\Z)", text, re.M | re.S))
    assert {"post", "environment", "runscript", "test"} <= set(sections)
    assert 'exec python "$@"' in sections["runscript"]
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for spec in dependencies:
        name = re.split(r"[<>=]", spec, maxsplit=1)[0]
        if name in ("torch", "torchvision", "numpy"):  # the NGC image's own builds, never replaced
            assert not re.search(rf'"{name}[<>=]', sections["post"])
        else:
            assert f'"{spec}"' in sections["post"], f"{spec} from pyproject.toml is not installed in the image"
