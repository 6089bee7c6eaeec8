"""scripts/gpu_smoke.sh and its record checker, on a machine without a GPU.

The shell script is run for real: without a GPU it must say so in one line and exit 0. The checker
(``scripts/gpu_smoke_check.py``) is pure logic on files, so every check is exercised here with
synthetic records: a good run passes, and each thing a GPU run can get wrong is named.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from common.results import make_record, write_record
from helpers import PYTHON, REPO, script_env
from scripts import gpu_smoke_check as smoke

GPUS = 2


def test_without_a_gpu_the_smoke_check_says_so_in_one_line_and_exits_0(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the smoke check would run")
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu_smoke.sh"), "--out", str(tmp_path / "smoke")],
                          env=script_env(PYTHON=PYTHON), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "gpu_smoke: no CUDA GPU visible (torch.cuda.is_available() is False): nothing to check on this machine"]
    assert not (tmp_path / "smoke").exists()


def test_each_check_is_isolated_timed_out_skipped_or_judged_and_all_land_in_one_table(tmp_path):
    """The harness, with a stand-in interpreter: a GPU probe that says 1, a gpu_check.py that answers,
    a torchrun that hangs past the time limit, a missing line_profiler; the checker runs for real."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/bash
case "$1 $2" in
    "-c import torch"*) echo "1 2.15.0 NVIDIA H100 80GB HBM3" ;;
    "-c import line_profiler") exit 1 ;;
    "-c import "*) exit 0 ;;
    "scripts/gpu_smoke_check.py "*) exec {PYTHON} "$@" ;;
    *gpu_check.py*) echo '{{"torch_gpus": 1, "gpus": [{{"index": 0, "smoke_test": "ok"}}], "backends": {{"nccl_built": true}}}}' ;;
    "-m torch.distributed.run") sleep 60 ;;
    *) echo "unexpected: $*" >&2; exit 99 ;;
esac
""")
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu_smoke.sh"), "--only", "gpu_check,ch04_ddp,lab02_line_profile",
                           "--out", str(tmp_path / "smoke")], env=script_env(PYTHON=str(fake), SMOKE_TIMEOUT="2"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    table = proc.stdout[proc.stdout.index("check "):]
    assert re.search(r"gpu_check +ok", table)
    assert re.search(r"ch04_ddp +FAIL .*command 1 exited 124, expected 0 \(timed out\)", table)
    assert re.search(r"lab02_line_profile +SKIP +needs the Python module\(s\) line_profiler", table)
    assert "3 check(s): 1 ok, 1 failed, 1 skipped" in table
    assert (tmp_path / "smoke" / "ch04_ddp" / "log.txt").is_file()


def test_every_check_the_script_lists_is_judged_by_the_checker_and_runs_its_commands(tmp_path):
    """--list names the checker's checks; run with a stand-in interpreter (a GPU probe that says 1,
    every other command a no-op that exits 0), each of them starts at least one command of its own
    in its own folder and lands in the table."""
    listed = subprocess.run(["bash", str(REPO / "scripts/gpu_smoke.sh"), "--list"], capture_output=True, text=True,
                            timeout=30).stdout.split()
    assert listed == list(smoke.CHECKS)
    fake = tmp_path / "python"
    fake.write_text("""#!/bin/bash
case "$1 $2" in
    "-c import torch"*) echo "1 2.15.0 NVIDIA H100 80GB HBM3" ;;
    "scripts/gpu_smoke_check.py --table") cat "$3" ;;
    "scripts/gpu_smoke_check.py "*) printf '%s\\tok\\t0\\t\\n' "$2" >> "${@: -1}" ;;
    *) exit 0 ;;
esac
""")
    fake.chmod(0o755)
    out = tmp_path / "smoke"
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu_smoke.sh"), "--out", str(out)],
                          env=script_env(PYTHON=str(fake)), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "command not found" not in proc.stderr, proc.stdout + proc.stderr
    assert [line.split("\t")[0] for line in (out / "summary.tsv").read_text().splitlines()] == listed
    for name in listed:
        assert (out / name / "status.txt").read_text().split(), f"{name} started no command"


# --------------------------------------------------------------------------------------------
# Synthetic runs


def memory(devices: int = 1, source: str = "cuda_max_memory_allocated", used: bool = True) -> list[dict[str, Any]]:
    return [{"device": f"cuda:{i}", "peak_bytes": 2**30, "source": source,
             **({"device_used_bytes": 2 * 2**30, "device_used_source": "cuda_mem_get_info"} if used else {})}
            for i in range(devices)]


def record(folder: Path, method: str, *, lab: str = "lab01", device: str = "cuda", status: str = "ok",
           metrics: dict[str, Any] | None = None, config: dict[str, Any] | None = None,
           provenance: dict[str, Any] | None = None, fp32: str = "ieee", script: str = "x.py") -> dict[str, Any]:
    prov = {"hostname": "gpu01", "device": {"type": device, "name": "NVIDIA H100 80GB HBM3"},
            "fp32_math": {"matmul": fp32, "cudnn_conv": fp32, "tf32_hardware": True}, **(provenance or {})}
    values = {"memory": memory(), "samples_per_s": 1000.0, "world_size": 1, **(metrics or {})}
    made = make_record(lab=lab, script=script, method=method, config=config or {}, metrics=values,
                       provenance=prov, status=status)
    write_record(made, folder)
    return made


def run_folder(tmp_path: Path, statuses: list[int], log: str = "") -> Path:
    folder = tmp_path / "check"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "status.txt").write_text("".join(f"{s}\n" for s in statuses))
    (folder / "log.txt").write_text(log)
    return folder


def ddp_run(tmp_path: Path, **changes: Any) -> Path:
    folder = run_folder(tmp_path, changes.pop("statuses", [0]))
    metrics = {"memory": memory(GPUS), "world_size": GPUS, "parameters_identical": True,
               "replica_digests": [{"parameters": "ab", "buffers": "cd"}] * GPUS, **changes.pop("metrics", {})}
    record(folder, "ddp", metrics=metrics, provenance={"distributed": {"backend": changes.pop("backend", "nccl")}},
           **changes)
    return folder


def test_lab01_ddp_passes_a_good_run_and_names_each_defect(tmp_path):
    assert smoke.judge("lab01_ddp", ddp_run(tmp_path / "good"), GPUS) == []
    cases = {
        "backend 'gloo', expected nccl": dict(backend="gloo"),
        "ran on 'cpu', not cuda": dict(device="cpu"),
        "parameters identical: False": dict(metrics={"parameters_identical": False}),
        "from 'process_max_rss'": dict(metrics={"memory": memory(GPUS, source="process_max_rss")}),
        "lacks the device-level": dict(metrics={"memory": memory(GPUS, used=False)}),
        "expected 2 GPUs": dict(metrics={"memory": memory(1)}),
        "world size 1, expected 2": dict(metrics={"world_size": 1}),
        "command 1 exited 124, expected 0 (timed out)": dict(statuses=[124]),
        "samples_per_s is None": dict(metrics={"samples_per_s": None}),
    }
    for number, (problem, change) in enumerate(cases.items()):
        problems = smoke.judge("lab01_ddp", ddp_run(tmp_path / str(number), **change), GPUS)
        assert any(problem in p for p in problems), (problem, problems)


def test_ch04_needs_the_resumed_run_and_real_fp32(tmp_path):
    folder = run_folder(tmp_path, [0, 0], log="resumed from ck.pt: epoch 2, step 0\n")
    record(folder, "fp32", lab="ch04", config={"epochs": 1, "resume": False})
    record(folder, "fp32", lab="ch04", config={"epochs": 2, "resume": True})
    assert smoke.judge("ch04_fp32", folder, GPUS) == []
    (folder / "log.txt").write_text("")
    record(folder, "fp32", lab="ch04", config={"epochs": 3, "resume": True}, fp32="tf32")
    problems = " | ".join(smoke.judge("ch04_fp32", folder, GPUS))
    assert "3 record(s)" in problems and "resumed from" in problems and "expected ieee" in problems


def test_lab03_flags_failed_rows_skips_missing_results_tf32_and_eager_compiles(tmp_path):
    folder = run_folder(tmp_path, [0])
    for mode in ("train", "inference"):
        for precision in ("fp32", "amp-bf16"):
            record(folder, f"{mode}-{precision}", lab="lab03",
                   metrics={"compile": {"compiled": True, "graphs": 3, "recompile_limit_hits": 0}})
    assert smoke.judge("lab03_compile", folder, GPUS) == []
    record(folder, "inference-fp32", lab="lab03", metrics={"compile": {"compiled": False, "graphs": 0,
                                                                       "recompile_limit_hits": 1}})
    record(folder, "train-half", lab="lab03", status="failed")
    problems = " | ".join(smoke.judge("lab03_compile", folder, GPUS))
    assert "was not really compiled" in problems and "failed precision rows: train-half" in problems
    precisions = " | ".join(smoke.judge("lab03_precisions", folder, GPUS))
    assert "no result for train-fp64" in precisions
    record(folder, "train-tf32", lab="lab03", fp32="ieee")  # a tf32 row that ran in IEEE fp32
    assert "expected tf32" in " | ".join(smoke.judge("lab03_precisions", folder, GPUS))


def test_refusals_must_be_one_error_line_and_write_nothing(tmp_path):
    line = f"error: {GPUS + 1} processes on this node but only {GPUS} GPU(s) visible: one GPU per process"
    assert smoke.judge("refuse_ranks", run_folder(tmp_path / "a", [1], log=line + "\n"), GPUS) == []
    assert "succeeded" in smoke.judge("refuse_ranks", run_folder(tmp_path / "b", [0], log=line), GPUS)[0]
    bf16 = "error: NVIDIA H100 (compute capability 7.0) has no bf16 tensor cores (they start at 8.0)\n"
    assert smoke.judge("refuse_bf16", run_folder(tmp_path / "c", [2], log=bf16), GPUS) == []
    problems = smoke.judge("refuse_bf16", run_folder(tmp_path / "d", [1], log="Traceback (most recent call last):\n"),
                           GPUS)
    assert any("exited 1, expected 2" in p for p in problems) and any("no traceback" in p for p in problems)


def test_traces_must_hold_gpu_kernels(tmp_path):
    folder = run_folder(tmp_path, [0])
    record(folder, "torch-profiler", lab="ch16")
    (folder / "trace.json").write_text(json.dumps({"traceEvents": [{"name": "aten::mm", "cat": "cpu_op"}]}))
    assert any("no GPU kernel" in p for p in smoke.judge("ch16_profiling", folder, GPUS))
    (folder / "trace.json").write_text(json.dumps({"traceEvents": [{"name": "sm90_gemm", "cat": "kernel"}]}))
    assert smoke.judge("ch16_profiling", folder, GPUS) == []


def test_a_checker_error_is_a_problem_of_that_check_not_a_crash(tmp_path):
    folder = run_folder(tmp_path, [0])
    record(folder, "memory-management", lab="ch16", metrics={"phases": "not a list"})
    problems = smoke.judge("ch16_memory", folder, GPUS)
    assert problems and all(isinstance(p, str) for p in problems)
    assert smoke.judge("no_such_check", folder, GPUS) == ["unknown check 'no_such_check'"]


def test_the_table_and_its_exit_status(tmp_path, capsys):
    summary = tmp_path / "summary.tsv"
    folder = ddp_run(tmp_path)
    assert smoke.main(["lab01_ddp", str(folder), "--gpus", str(GPUS), "--seconds", "12", "--summary", str(summary)]) == 0
    assert smoke.main(["--table", str(summary)]) == 0
    summary.write_text(summary.read_text() + "lab02_trace\tSKIP\t\tneeds the Python module(s) line_profiler\n")
    assert smoke.main(["--table", str(summary)]) == 3  # nothing failed, but not everything ran
    assert smoke.main(["lab01_ddp", str(tmp_path / "missing"), "--gpus", "2", "--summary", str(summary)]) == 1
    assert smoke.main(["--table", str(summary)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"lab01_ddp +ok +12", out) and "3 check(s): 1 ok, 1 failed, 1 skipped" in out


@pytest.mark.parametrize("check", list(smoke.CHECKS))
def test_every_check_fails_on_a_run_that_left_nothing(check, tmp_path):
    problems = smoke.judge(check, run_folder(tmp_path, []), GPUS)
    assert problems and not any(p.startswith("the checker failed") for p in problems), problems


def good_run(check: str, folder: Path) -> None:
    """What a healthy GPU run of ``check`` leaves (as far as its checker looks)."""
    ddp = {"distributed": {"backend": "nccl"}}
    if check == "lab01_dp":
        record(folder, "dp", metrics={"memory": memory(GPUS)}, config={"dp_device_ids": [0, 1]})
    elif check == "ch04_ddp":
        record(folder, "ddp", lab="ch04", provenance=ddp, metrics={
            "world_size": GPUS, "memory": memory(GPUS), "parameters_identical": True,
            "replica_digests": [{"parameters": "ab", "buffers": "cd"}] * GPUS})
    elif check == "amp_training":
        (folder / "log.txt").write_text("fp32 baseline maths: ieee matmuls, ieee convolutions (ieee: real fp32)\n")
        for precision in ("fp32", "fp16", "bf16"):
            record(folder, precision, lab="ch04")
        record(folder, "amp-comparison", lab="ch04", metrics={"runs": [
            {"precision": p, "speedup_vs_fp32": s} for p, s in (("fp32", 1.0), ("fp16", 2.1), ("bf16", 2.0))]})
    elif check == "ch16_memory":
        (folder / "log.txt").write_text("|  PyTorch CUDA memory summary, device ID 0  |\n")
        record(folder, "memory-management", lab="ch16", metrics={"accumulation_match": True, "phases": [
            {"phase": "forward", "allocated_change_bytes": 600_000, "source": "cuda_memory_allocated"}]})
    elif check == "lab02_sweep":
        for step in smoke.LAB02_SWEEP_STEPS:
            record(folder, step, lab="lab02", metrics={"speedup_vs_seed": 1.5, "data_loading_share": 0.2})
    elif check == "gpu_check":
        (folder / "gpu_check.json").write_text(json.dumps({"torch_gpus": GPUS, "backends": {"nccl_built": True},
                                                           "gpus": [{"index": i, "smoke_test": "ok"} for i in (0, 1)]}))
    elif check == "lab04_memory":
        tensors = {"parameters": 100, "gradients": 100, "optimizer": 200}
        record(folder, "memory", lab="lab04", metrics={"memory": memory(GPUS), "world_size": GPUS, "budget": [
            {"variant": v, "predicted": {**tensors, "activations": 50}, "measured": {**tensors, "activations": 51}}
            for v in ("ddp", "fsdp")]})
    elif check == "lab04_ddp":
        record(folder, "ddp", lab="lab04", provenance=ddp, metrics={
            "world_size": GPUS, "memory": memory(GPUS), "parameters_identical": True,
            "replica_digests": [{"parameters": "ab", "buffers": "cd"}] * GPUS,
            "checkpoint_saves": [{"mode": "sync", "stall_s": 0.1}]})
    elif check == "lab04_fsdp_resume":
        (folder / "status.txt").write_text("0\n0\n")
        options = {"mixed_precision": "bf16", "activation_checkpointing": True}
        record(folder, "fsdp+ac+bf16", lab="lab04", provenance=ddp, config={"epochs": 1, "resume": False, **options},
               metrics={"world_size": GPUS, "memory": memory(GPUS), "checkpoint_saves": [{"mode": "async"}]})
        record(folder, "fsdp+ac+bf16", lab="lab04", provenance=ddp, config={"epochs": 2, "resume": True, **options})
    elif check == "lab04_largest":
        record(folder, "largest-model", lab="lab04", metrics={"measured_by": "cuda_max_memory_allocated", "largest": [
            {"variant": v, "largest": {"fits": True, "layers": 8}} for v in ("ddp", "fsdp", "fsdp+ac")]})
    elif check == "lab05_allreduce":
        for collective in smoke.LAB05_COLLECTIVES:
            record(folder, collective, lab="lab05", provenance=ddp, metrics={
                "world_size": GPUS, "sizes": [{"bytes": 1024, "correct": True}, {"bytes": 2**20, "correct": True}]})
    elif check == "lab05_scaling":
        record(folder, "strong-scaling", lab="lab05")
    elif check == "lab05_overlap":
        record(folder, "overlap", lab="lab05", provenance=ddp, metrics={"world_size": GPUS, "buckets": [
            {"bucket_cap_mb": 1.0, "hidden_fraction": 0.4}, {"bucket_cap_mb": 25.0, "hidden_fraction": 0.9}]})
    elif check == "lab07_model_parallel":
        (folder / "status.txt").write_text("0\n0\n0\n")
        lab07 = "labs/lab07_model_parallel/"
        record(folder, "tp", lab="lab07", provenance=ddp, script=lab07 + "01_tensor_parallel.py", metrics={
            "world_size": GPUS, "loss_at_step": [4.8, 4.1], "comm_predicted": {"total_bytes": 1000},
            "per_rank": [{"rank": r, "comm_bytes": 1000} for r in range(GPUS)]})
        record(folder, "pp-1f1b", lab="lab07", provenance=ddp, script=lab07 + "02_pipeline_parallel.py",
               metrics={"world_size": GPUS, "loss_at_step": [4.8, 4.1], "bubble_measured": 0.2})
        record(folder, "2d-1x2", lab="lab07", provenance=ddp, script=lab07 + "03_2d_parallel.py",
               metrics={"world_size": GPUS, "loss_at_step": [4.8]})
    elif check == "main_job":
        for method in ("env", "baseline", "dp", "ddp"):
            record(folder, method, provenance=ddp if method == "ddp" else None,
                   metrics={"world_size": GPUS if method == "ddp" else 1})
        (folder / "comparison_report.html").write_text("<html></html>")
        (folder / "log.txt").write_text(f"[smoke] env ... bash scripts/main_job.sh {folder}\n"
                                        f"report: {folder}/comparison_report.html\n[smoke] exit 0 after 40 s\n")
    elif check == "pytest_gpu":
        (folder / "tests.txt").write_text("tests/test_a.py::test_one[cuda]\ntests/test_b.py::test_two\n\n"
                                          "2/600 tests collected (598 deselected) in 9.1s\n")
        (folder / "status.txt").write_text("0\n0\n0\n")
        (folder / "log.txt").write_text("".join(
            f"[smoke] python -m pytest -p no:cacheprovider -q -rs -m gpu {test}\n1 passed in 3.2s\n"
            f"[smoke] exit 0 after 5 s\n" for test in ("tests/test_a.py::test_one[cuda]", "tests/test_b.py::test_two")))
    elif check == "lab01_env":
        record(folder, "env", metrics={"gpus": GPUS, "multi_gpu": {
            "backend_tests": {"nccl": {"ok": True}}, "topology": {"available": True},
            "cuda_to_topology": [{"cuda": 0, "topology_name": "GPU1"}, {"cuda": 1, "topology_name": "GPU0"}]}})


@pytest.mark.parametrize("check", ["lab01_dp", "ch04_ddp", "amp_training", "ch16_memory", "lab02_sweep", "gpu_check",
                                   "lab01_env", "lab04_memory", "lab04_ddp", "lab04_fsdp_resume", "lab04_largest",
                                   "lab05_allreduce", "lab05_scaling", "lab05_overlap", "lab07_model_parallel",
                                   "main_job", "pytest_gpu"])
def test_a_healthy_run_passes_its_check(check, tmp_path):
    folder = run_folder(tmp_path, [0])
    good_run(check, folder)
    assert smoke.judge(check, folder, GPUS) == []


def test_lab04_fsdp_needs_async_saves_then_a_resumed_run_on_one_gpu(tmp_path):
    folder = run_folder(tmp_path, [0, 0])
    good_run("lab04_fsdp_resume", folder)
    assert smoke.judge("lab04_fsdp_resume", folder, GPUS) == []
    (folder / "status.txt").write_text("0\n")  # the resume never ran
    for path in folder.glob("*.json"):
        if json.loads(path.read_text())["config"]["resume"]:
            path.unlink()
    record(folder, "fsdp+ac+bf16", lab="lab04", provenance={"distributed": {"backend": "nccl"}},
           config={"epochs": 1, "resume": False, "mixed_precision": "fp32", "activation_checkpointing": True},
           metrics={"world_size": GPUS, "memory": memory(GPUS), "checkpoint_saves": [{"mode": "sync"}]})
    problems = " | ".join(smoke.judge("lab04_fsdp_resume", folder, GPUS))
    for expected in ("1 command(s) ran, 2 expected", "no record of the resumed run", "expected async only",
                     "ran without bf16 and activation checkpointing"):
        assert expected in problems, (expected, problems)


def test_lab04_memory_names_a_tensor_that_differs_from_its_prediction(tmp_path):
    folder = run_folder(tmp_path, [0])
    record(folder, "memory", lab="lab04", metrics={"memory": memory(GPUS), "world_size": GPUS, "budget": [
        {"variant": "fsdp", "predicted": {"parameters": 50, "gradients": 50, "optimizer": 100},
         "measured": {"parameters": 100, "gradients": 50, "optimizer": 100}}]})
    assert smoke.judge("lab04_memory", folder, GPUS) == ["fsdp: parameters predicted 50 B, measured 100 B"]


@pytest.mark.parametrize("gpus, hidden, statuses, log, problem", [
    (2, 3.03, [0], "", "hidden 303%, outside 0-100%"),
    (1, 0.5, [0], "", "hidden 0.5 on one rank, where nothing overlaps"),
    (1, None, [0], "", None),
    (1, None, [2], "error: one rank: there is no communication to overlap (use 2 or more)\n", None),
    (1, None, [2], "Traceback (most recent call last):\n", "without one error line"),
], ids=["2-ranks-303%", "1-rank-a-share", "1-rank-no-share", "1-rank-refused", "1-rank-traceback"])
def test_lab05_overlap_keeps_hidden_within_0_to_100_and_says_one_rank_has_nothing_to_hide(
        tmp_path, gpus, hidden, statuses, log, problem):
    folder = run_folder(tmp_path, statuses, log=log)
    if statuses == [0]:
        record(folder, "overlap", lab="lab05", provenance={"distributed": {"backend": "nccl"}},
               metrics={"world_size": gpus, "buckets": [{"bucket_cap_mb": 1.0, "hidden_fraction": hidden}]})
    problems = smoke.judge("lab05_overlap", folder, gpus)
    assert (problems == []) if problem is None else any(problem in p for p in problems), problems


@pytest.mark.parametrize(("log", "records", "problem"), [
    ("bandwidth: 1 rank, backend nccl: there is no link to measure (one rank sends nothing)\n", 0, None),
    ("bandwidth: 1 rank, backend nccl: there is no link to measure (one rank sends nothing)\n", 1,
     "1 record(s) written, expected none"),
    ("all_reduce 1024 B busbw 0.00 GB/s\n", 0, "line is missing"),
], ids=["says-so", "wrote-a-record", "printed-numbers"])
def test_lab05_allreduce_on_one_gpu_says_there_is_no_link_and_writes_nothing(tmp_path, log, records, problem):
    folder = run_folder(tmp_path, [0], log=log)
    for _ in range(records):
        record(folder, "all_reduce", lab="lab05", metrics={"world_size": 1})
    problems = smoke.judge("lab05_allreduce", folder, 1)
    assert (problems == []) if problem is None else any(problem in p for p in problems), problems


def test_main_job_must_print_the_reports_path_last_and_train_on_the_gpu(tmp_path):
    folder = run_folder(tmp_path, [0])
    good_run("main_job", folder)
    with (folder / "log.txt").open("a") as log:
        log.write("some later line\n")
    record(folder, "baseline", device="cpu")
    problems = " | ".join(smoke.judge("main_job", folder, GPUS))
    assert "not the report's path" in problems and "ran on 'cpu', not cuda" in problems


def test_pytest_gpu_names_each_failed_or_missing_test(tmp_path):
    folder = run_folder(tmp_path, [0, 0, 1])
    good_run("pytest_gpu", folder)
    (folder / "tests.txt").write_text("tests/test_a.py::test_one[cuda]\ntests/test_b.py::test_two\n"
                                      "tests/test_c.py::test_three\n")
    log = (folder / "log.txt").read_text().replace("exit 0 after 5 s", "exit 1 after 5 s", 1)
    (folder / "log.txt").write_text(log)
    assert smoke.judge("pytest_gpu", folder, GPUS) == ["tests/test_c.py::test_three: not run (a timeout of the whole "
                                                       "check?)", "tests/test_a.py::test_one[cuda]: exit 1 (failed)"]


def test_the_pytest_check_runs_each_collected_gpu_test_in_its_own_process(tmp_path):
    """gpu_smoke.sh with a stand-in interpreter: pytest's collection lists two tests, and each is then
    run by a pytest process of its own; the checker reads the log those runs left."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/bash
case "$*" in
    "-c import torch"*) echo "1 2.15.0 NVIDIA H100 80GB HBM3" ;;
    "-c import "*) exit 0 ;;
    scripts/gpu_smoke_check.py*) exec {PYTHON} "$@" ;;
    *--collect-only*) printf 'tests/test_a.py::test_one[cuda]\\ntests/test_b.py::test_two\\n\\n2/9 tests collected\\n' ;;
    *"-m gpu tests/test_a.py::test_one[cuda]") echo "1 passed" ;;
    *"-m gpu tests/test_b.py::test_two") echo "1 failed"; exit 1 ;;
    *) echo "unexpected: $*" >&2; exit 99 ;;
esac
""")
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu_smoke.sh"), "--only", "pytest_gpu", "--out",
                           str(tmp_path / "smoke")], env=script_env(PYTHON=str(fake)), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"pytest_gpu +FAIL .*tests/test_b.py::test_two: exit 1 \(failed\)$", proc.stdout, re.M), proc.stdout
    assert "test_one" not in proc.stdout.splitlines()[-2]
    log = (tmp_path / "smoke" / "pytest_gpu" / "log.txt").read_text()
    runs = [line for line in log.splitlines() if line.startswith("[smoke] ") and " -m gpu tests/" in line]
    assert [line.split()[-1] for line in runs] == ["tests/test_a.py::test_one[cuda]", "tests/test_b.py::test_two"]
    assert "1 passed" in log


def test_the_main_job_runs_with_a_given_interpreter_without_syncing_a_venv(tmp_path):
    """How the smoke check runs the main job on an offline GPU node: PYTHON names the interpreter, and
    the lab runs with it, end to end, without bootstrap.sh (which needs the network to sync .venv)."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/bash\necho "$*" >> {calls}\n')
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "scripts/main_job.sh"), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=60, env=script_env(PYTHON=str(fake)))
    assert proc.returncode == 0, proc.stderr
    assert "bootstrap" not in proc.stderr
    scripts = [Path(line.split()[0]).name for line in calls.read_text().splitlines()]
    assert scripts[:3] == ["01_environment_check.py", "02_baseline_single_gpu.py", "03_dataparallel_training.py"]
    assert proc.stdout.splitlines()[-1] == f"report: {tmp_path / 'out' / 'comparison_report.html'}"


def test_lab07_needs_tensor_parallel_traffic_within_10_percent_of_the_plan(tmp_path):
    folder = run_folder(tmp_path, [0, 0, 0])
    good_run("lab07_model_parallel", folder)
    (path,) = [p for p in folder.glob("*.json") if json.loads(p.read_text())["method"] == "tp"]
    made = json.loads(path.read_text())
    made["metrics"]["per_rank"][1]["comm_bytes"] = 1200  # 20% more than the plan says
    path.write_text(json.dumps(made))
    assert smoke.judge("lab07_model_parallel", folder, GPUS) == [
        "tensor parallel rank 1: traffic 1200, predicted 1000"]
