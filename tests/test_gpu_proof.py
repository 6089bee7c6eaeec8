"""The GPU proof on a machine without a GPU: its judges, its orchestration, and its CPU rehearsal.

The judges (``scripts/gpu_proof_checks.py``) read files only, so each is exercised here with synthetic
records: a healthy run passes, and each thing a GPU run can get wrong is named. The orchestration
(``scripts/gpu_proof.py``: tiers, the budget, the summary after every check, ``--only failed``, exit
status) runs with stand-in checks whose commands are small shell commands. The rehearsal runs the
real checks' CPU paths under the budget CI gives it.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from common.results import make_record, write_record
from helpers import PYTHON, REPO, script_env
from scripts import gpu_proof, gpu_proof_checks as proof

GPUS = 2


def judged(name: str, folder: Path, ranks: int = GPUS, device: str = "cuda") -> list[str]:
    return proof.judge(name, folder, ranks, device)[0]


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


def run_folder(tmp_path: Path, statuses: list[int], log: str = "", seconds: list[float] | None = None) -> Path:
    folder = tmp_path / "check"
    folder.mkdir(parents=True, exist_ok=True)
    seconds = seconds or [1.0] * len(statuses)
    (folder / "status.txt").write_text("".join(f"{s} {t}\n" for s, t in zip(statuses, seconds)))
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
    assert judged("lab01_ddp", ddp_run(tmp_path / "good"), GPUS) == []
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
        problems = judged("lab01_ddp", ddp_run(tmp_path / str(number), **change), GPUS)
        assert any(problem in p for p in problems), (problem, problems)


def test_ch04_needs_the_resumed_run_and_real_fp32(tmp_path):
    folder = run_folder(tmp_path, [0, 0], log="resumed from ck.pt: epoch 2, step 0\n")
    record(folder, "fp32", lab="ch04", config={"epochs": 1, "resume": False})
    record(folder, "fp32", lab="ch04", config={"epochs": 2, "resume": True})
    assert judged("ch04_fp32", folder, GPUS) == []
    (folder / "log.txt").write_text("")
    record(folder, "fp32", lab="ch04", config={"epochs": 3, "resume": True}, fp32="tf32")
    problems = " | ".join(judged("ch04_fp32", folder, GPUS))
    assert "3 record(s)" in problems and "resumed from" in problems and "expected ieee" in problems


def test_refusals_must_be_one_error_line_and_write_nothing(tmp_path):
    line = f"error: {GPUS + 1} processes on this node but only {GPUS} GPU(s) visible: one GPU per process"
    assert judged("refuse_ranks", run_folder(tmp_path / "a", [1], log=line + "\n"), GPUS) == []
    assert "succeeded" in judged("refuse_ranks", run_folder(tmp_path / "b", [0], log=line), GPUS)[0]
    bf16 = "error: NVIDIA H100 (compute capability 7.0) has no bf16 tensor cores (they start at 8.0)\n"
    assert judged("refuse_bf16", run_folder(tmp_path / "c", [2], log=bf16), GPUS) == []
    problems = judged("refuse_bf16", run_folder(tmp_path / "d", [1], log="Traceback (most recent call last):\n"),
                           GPUS)
    assert any("exited 1, expected 2" in p for p in problems) and any("no traceback" in p for p in problems)


def test_traces_must_hold_gpu_kernels(tmp_path):
    folder = run_folder(tmp_path, [0])
    record(folder, "torch-profiler", lab="ch16")
    (folder / "trace.json").write_text(json.dumps({"traceEvents": [{"name": "aten::mm", "cat": "cpu_op"}]}))
    assert any("no GPU kernel" in p for p in judged("ch16_profiling", folder, GPUS))
    (folder / "trace.json").write_text(json.dumps({"traceEvents": [{"name": "sm90_gemm", "cat": "kernel"}]}))
    assert judged("ch16_profiling", folder, GPUS) == []


def test_a_checker_error_is_a_problem_of_that_check_not_a_crash(tmp_path):
    folder = run_folder(tmp_path, [0])
    record(folder, "memory-management", lab="ch16", metrics={"phases": "not a list"})
    problems = judged("ch16_memory", folder, GPUS)
    assert problems and all(isinstance(p, str) for p in problems)
    assert judged("no_such_check", folder, GPUS) == ["unknown check 'no_such_check'"]


@pytest.mark.parametrize("check", list(proof.BY_NAME))
def test_every_check_fails_on_a_run_that_left_nothing(check, tmp_path):
    problems = judged(check, run_folder(tmp_path, []), GPUS)
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
        for step in proof.LAB02_SWEEP_STEPS:
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
        options = {"precision": "bf16", "activation_checkpointing": True}
        record(folder, "fsdp+ac+bf16", lab="lab04", provenance=ddp, config={"epochs": 1, "resume": False, **options},
               metrics={"world_size": GPUS, "memory": memory(GPUS), "checkpoint_saves": [{"mode": "async"}]})
        record(folder, "fsdp+ac+bf16", lab="lab04", provenance=ddp, config={"epochs": 2, "resume": True, **options})
    elif check == "lab04_largest":
        record(folder, "largest-model", lab="lab04", metrics={"measured_by": "cuda_max_memory_allocated", "largest": [
            {"variant": v, "largest": {"fits": True, "layers": 8}} for v in ("ddp", "fsdp", "fsdp+ac")]})
    elif check == "lab05_allreduce":
        for collective in proof.LAB05_COLLECTIVES:
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
    elif check == "lab08_gpu_decode":
        (folder / "status.txt").write_text("0\n0\n0\n")
        for method, rate in (("webdataset+read-only", 2000.0), ("webdataset+read-only+decode-on-device", 5000.0)):
            record(folder, method, lab="lab08", metrics={"epochs_io": [{"samples": 2048, "samples_per_s": rate}]})
    elif check == "lab08_shards":
        (folder / "status.txt").write_text("0\n0\n")
        record(folder, "shards-pad", lab="lab08", metrics={"exactly_once": True, "parameters_identical": True,
                                                           "epochs_io": [{"samples": 512, "distinct_all_ranks": 512}]})
    elif check == "main_job":
        for method in ("env", "baseline", "dp", "ddp"):
            record(folder, method, provenance=ddp if method == "ddp" else None,
                   metrics={"world_size": GPUS if method == "ddp" else 1})
        (folder / "comparison_report.html").write_text("<html></html>")
        (folder / "log.txt").write_text(f"[proof] env ... bash scripts/main_job.sh {folder}\n"
                                        f"report: {folder}/comparison_report.html\n[proof] exit 0 after 40 s\n")
    elif check == "pytest_gpu":
        (folder / "junit.xml").write_text(JUNIT.format(extra=""))
    elif check == "lab01_env":
        record(folder, "env", metrics={"gpus": GPUS, "multi_gpu": {
            "backend_tests": {"nccl": {"ok": True}}, "topology": {"available": True},
            "cuda_to_topology": [{"cuda": 0, "topology_name": "GPU1"}, {"cuda": 1, "topology_name": "GPU0"}]}})


@pytest.mark.parametrize("check", ["lab01_dp", "ch04_ddp", "amp_training", "ch16_memory", "lab02_sweep", "gpu_check",
                                   "lab01_env", "lab04_memory", "lab04_ddp", "lab04_fsdp_resume", "lab04_largest",
                                   "lab05_allreduce", "lab05_scaling", "lab05_overlap", "lab07_model_parallel",
                                   "lab08_gpu_decode", "lab08_shards",
                                   "main_job", "pytest_gpu"])
def test_a_healthy_run_passes_its_check(check, tmp_path):
    folder = run_folder(tmp_path, [0])
    good_run(check, folder)
    assert judged(check, folder, GPUS) == []


def test_lab04_fsdp_needs_async_saves_then_a_resumed_run_on_one_gpu(tmp_path):
    folder = run_folder(tmp_path, [0, 0])
    good_run("lab04_fsdp_resume", folder)
    assert judged("lab04_fsdp_resume", folder, GPUS) == []
    (folder / "status.txt").write_text("0\n")  # the resume never ran
    for path in folder.glob("*.json"):
        if json.loads(path.read_text())["config"]["resume"]:
            path.unlink()
    record(folder, "fsdp+ac+bf16", lab="lab04", provenance={"distributed": {"backend": "nccl"}},
           config={"epochs": 1, "resume": False, "precision": "fp32", "activation_checkpointing": True},
           metrics={"world_size": GPUS, "memory": memory(GPUS), "checkpoint_saves": [{"mode": "sync"}]})
    problems = " | ".join(judged("lab04_fsdp_resume", folder, GPUS))
    for expected in ("1 command(s) ran, 2 expected", "no record of the resumed run", "expected async only",
                     "ran without bf16 and activation checkpointing"):
        assert expected in problems, (expected, problems)


def test_lab04_memory_names_a_tensor_that_differs_from_its_prediction(tmp_path):
    folder = run_folder(tmp_path, [0])
    record(folder, "memory", lab="lab04", metrics={"memory": memory(GPUS), "world_size": GPUS, "budget": [
        {"variant": "fsdp", "predicted": {"parameters": 50, "gradients": 50, "optimizer": 100},
         "measured": {"parameters": 100, "gradients": 50, "optimizer": 100}}]})
    assert judged("lab04_memory", folder, GPUS) == ["fsdp: parameters predicted 50 B, measured 100 B"]


@pytest.mark.parametrize("gpus, hidden, statuses, log, problem", [
    (2, 3.03, [0], "", "hidden 303%, outside 0-100%"),
    (1, 0.5, [0], "", "hidden 0.5 on one rank, where nothing overlaps"),
    (1, None, [0], "", None),
], ids=["2-ranks-303%", "1-rank-a-share", "1-rank-no-share"])
def test_lab05_overlap_keeps_hidden_within_0_to_100_and_says_one_rank_has_nothing_to_hide(
        tmp_path, gpus, hidden, statuses, log, problem):
    folder = run_folder(tmp_path, statuses, log=log)
    if statuses == [0]:
        record(folder, "overlap", lab="lab05", provenance={"distributed": {"backend": "nccl"}},
               metrics={"world_size": gpus, "buckets": [{"bucket_cap_mb": 1.0, "hidden_fraction": hidden}]})
    problems = judged("lab05_overlap", folder, gpus)
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
    problems = judged("lab05_allreduce", folder, 1)
    assert (problems == []) if problem is None else any(problem in p for p in problems), problems


def test_main_job_must_print_the_reports_path_last_and_train_on_the_gpu(tmp_path):
    folder = run_folder(tmp_path, [0])
    good_run("main_job", folder)
    with (folder / "log.txt").open("a") as log:
        log.write("some later line\n")
    record(folder, "baseline", device="cpu")
    problems = " | ".join(judged("main_job", folder, GPUS))
    assert "not the report's path" in problems and "ran on 'cpu', not cuda" in problems


def test_the_main_job_runs_with_a_given_interpreter_without_syncing_a_venv(tmp_path):
    """How the proof runs the main job on an offline GPU node: PYTHON names the interpreter, and
    the lab runs with it, end to end, without bootstrap.sh (which needs the network to sync .venv)."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    # the report step ends with "report: PATH", as compare_results.py does (tests/test_report.py)
    fake.write_text(f'#!/bin/bash\necho "$*" >> {calls}\n'
                    'while [ $# -gt 0 ]; do [ "$1" = --output-report ] && echo "report: $2"; shift; done\n')
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "scripts/main_job.sh"), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=60, env=script_env(PYTHON=str(fake)))
    assert proc.returncode == 0, proc.stderr
    assert "bootstrap" not in proc.stderr
    check, *lines = calls.read_text().splitlines()
    assert check.startswith("-c ")  # scripts/require_python.sh asks the interpreter first
    scripts = [Path(line.split()[0]).name for line in lines]
    assert scripts[:3] == ["01_environment_check.py", "02_baseline_single_gpu.py", "03_dataparallel_training.py"]
    assert proc.stdout.splitlines()[-1] == f"report: {tmp_path / 'out' / 'comparison_report.html'}"
    assert proc.stdout.count("report: ") == 1, proc.stdout  # once: run_lab.sh no longer echoes it again


def test_lab07_needs_tensor_parallel_traffic_within_10_percent_of_the_plan(tmp_path):
    folder = run_folder(tmp_path, [0, 0, 0])
    good_run("lab07_model_parallel", folder)
    (path,) = [p for p in folder.glob("*.json") if json.loads(p.read_text())["method"] == "tp"]
    made = json.loads(path.read_text())
    made["metrics"]["per_rank"][1]["comm_bytes"] = 1200  # 20% more than the plan says
    path.write_text(json.dumps(made))
    assert judged("lab07_model_parallel", folder, GPUS) == [
        "tensor parallel rank 1: traffic 1200, predicted 1000"]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_one[cuda]" time="3.1"/>
<testcase classname="tests.test_b" name="test_two" time="2.0"><skipped message="needs two GPUs"/></testcase>
{extra}</testsuite></testsuites>"""


def test_pytest_gpu_names_each_failed_test_from_its_junit_report(tmp_path):
    folder = run_folder(tmp_path, [1])
    (folder / "junit.xml").write_text(JUNIT.format(
        extra='<testcase classname="tests.test_c" name="test_three"><failure message="boom"/></testcase>'))
    problems, findings = proof.judge("pytest_gpu", folder, 1)
    assert problems == ["command 1 exited 1, expected 0", "tests.test_c::test_three failed"]
    assert findings == {"passed": 1, "failed": 1, "skipped": 1}


# --------------------------------------------------------------------------------------------
# The speed targets: judged on CUDA against the targets, on the CPU only for the path


def test_lab02_graph_holds_three_epochs_to_the_target_and_needs_the_capture(tmp_path):
    folder = run_folder(tmp_path, [0, 0])
    graph = {"requested": True, "captured": True, "reason": None}
    record(folder, "graph", lab="lab02", metrics={"cuda_graph": graph, "epoch_time_s": [0.7, 0.5, 0.5],
                                                  "test_accuracy": 0.99})
    problems, findings = proof.judge("lab02_graph", folder, 1)
    assert problems == [] and findings["lab02_graph_3_epochs_s"] == pytest.approx(1.7)
    slow = run_folder(tmp_path / "slow", [0, 0])
    record(slow, "graph", lab="lab02", metrics={"cuda_graph": {"captured": False, "reason": "no GPU"},
                                                "epoch_time_s": [2.0, 2.0, 2.0]})
    assert judged("lab02_graph", slow, 1) == ["the step was not captured: 'no GPU'",
                                              "lab02_graph_3_epochs_s: 6, target at most 2"]
    cpu = run_folder(tmp_path / "cpu", [0, 0])
    record(cpu, "graph", lab="lab02", device="cpu", metrics={"cuda_graph": {"captured": False, "reason": "CPU"},
                                                             "epoch_time_s": [9.0]})
    assert judged("lab02_graph", cpu, 1, "cpu") == []  # the path, not the target


def test_ch04_against_pytorch_examples_compares_wall_times_and_accuracy(tmp_path):
    folder = run_folder(tmp_path, [0, 0, 0], seconds=[3.0, 46.0, 20.0])
    (folder / "examples.txt").write_text("Train Epoch: 3 ...\n\nTest set: Average loss: 0.0412, Accuracy: "
                                         "9866/10000 (99%)\n\n")
    record(folder, "fp32", lab="ch04", metrics={"test_accuracy": 0.9881})
    problems, findings = proof.judge("ch04_vs_examples", folder, 1)
    assert problems == [] and findings["ch04_over_examples"] == pytest.approx(2.3)
    assert findings["examples_accuracy"] == 0.9866 and findings["examples_wall_s"] == 46.0
    slower = run_folder(tmp_path / "b", [0, 0, 0], seconds=[3.0, 46.0, 40.0])
    (slower / "examples.txt").write_text((folder / "examples.txt").read_text())
    record(slower, "fp32", lab="ch04", metrics={"test_accuracy": 0.95})
    problems = judged("ch04_vs_examples", slower, 1)
    assert "Chapter 4's accuracy 0.95 is below pytorch/examples' 0.9866" in problems
    assert any(p.startswith("ch04_over_examples: 1.15, target at least 2") for p in problems), problems


def test_lab04_speed_checks_judge_mfu_the_fsdp_ratio_and_count_recompiles(tmp_path):
    folder = run_folder(tmp_path, [0], log="V1126 Recompiling function forward in model.py:10\n"
                                           "    triggered by the following guard failure(s): ...\n")
    record(folder, "fsdp+bf16", lab="lab04", metrics={"mfu": 0.43, "tokens_per_s": 150000.0,
                                                      "step_time": {"median_s": 0.43}})
    problems, findings = proof.judge("lab04_mfu", folder, 1)
    assert problems == [] and findings["recompiles"] == 1 and findings["graph_breaks"] == 0
    pair = run_folder(tmp_path / "pair", [0, 0])
    record(pair, "ddp", lab="lab04", metrics={"step_time": {"median_s": 0.50}})
    record(pair, "fsdp", lab="lab04", metrics={"step_time": {"median_s": 0.60}})
    problems, findings = proof.judge("lab04_fsdp_vs_ddp", pair, 1)
    assert problems == ["lab04_fsdp_over_ddp: 1.2, target at most 1.15"] and findings["ddp_step_s"] == 0.5


def test_lab03_recipe_needs_a_compiled_model_and_the_images_per_second(tmp_path):
    folder = run_folder(tmp_path, [0])
    record(folder, "train-amp-bf16", lab="lab03", metrics={"samples_per_s": 5800.0, "compile": {"compiled": True}})
    assert judged("lab03_recipe", folder, 1) == []
    eager = run_folder(tmp_path / "eager", [0])
    record(eager, "train-amp-bf16", lab="lab03", metrics={"samples_per_s": 4000.0, "compile": {"compiled": False}})
    problems = judged("lab03_recipe", eager, 1)
    assert "was not really compiled" in problems[0] and problems[1] == "lab03_images_per_s: 4000, target at least 5500"


def test_lab06_checks_want_the_nan_stop_and_one_restart_over_gloo_on_a_shared_gpu(tmp_path):
    folder = run_folder(tmp_path, [0, 1])
    record(folder, "uninterrupted", lab="lab06")
    record(folder, "nan-loss", lab="lab06", status="failed", metrics={"nan_stop": {"step": 3, "ranks": [0]}})
    assert judged("lab06_inject", folder, 1) == []
    shared = run_folder(tmp_path / "shared", [0], log="resumed from run/checkpoint.pt at step 2 (restart 1)\n")
    record(shared, "crash-rank", lab="lab06", provenance={"distributed": {"backend": "gloo"}},
           metrics={"world_size": 2, "restarts": 1})
    assert judged("lab06_shared_gpu", shared, 2) == []
    nccl = run_folder(tmp_path / "nccl", [0], log="resumed from x\n")
    record(nccl, "crash-rank", lab="lab06", provenance={"distributed": {"backend": "nccl"}},
           metrics={"world_size": 2, "restarts": 0})
    problems = " | ".join(judged("lab06_shared_gpu", nccl, 2))
    assert "backend 'nccl', expected gloo" in problems and "expected 1 after 1 restart" in problems


def test_the_nccl_probe_needs_a_dump_with_collectives_and_a_stalled_rank_that_ended(tmp_path):
    folder = run_folder(tmp_path, [0, 0])
    facts = {"torch": "2.11.0", "dumps": {"TORCH_FR_BUFFER_SIZE": {"_dump_nccl_trace_json": 3,
                                                                   "_dump_fr_trace_json": 0}},
             "watchdog": {"exit_status": -6, "ended_within_s": 11.2, "python_except_ran": None}}
    (folder / "probe.json").write_text(json.dumps(facts))
    problems, findings = proof.judge("nccl_flight_recorder", folder, 1)
    assert problems == [] and findings["watchdog"]["exit_status"] == -6
    facts["dumps"]["TORCH_FR_BUFFER_SIZE"]["_dump_nccl_trace_json"] = "RuntimeError: no recorder"
    facts["watchdog"]["ended_within_s"] = None
    (folder / "probe.json").write_text(json.dumps(facts))
    assert len(judged("nccl_flight_recorder", folder, 1)) == 2


def test_the_mnist_stand_in_is_mnist_s_file_format_and_the_same_every_time(tmp_path):
    import torch
    from torchvision.datasets import MNIST

    raw = proof.write_mnist_standin(tmp_path / "a", train=300, test=100)
    again = proof.write_mnist_standin(tmp_path / "b", train=300, test=100)
    assert all((raw / name).read_bytes() == (again / name).read_bytes() for name in
               ("train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"))
    data = MNIST(str(tmp_path / "a"), train=True, download=False)  # torchvision reads it as MNIST
    assert data.data.shape == (300, 28, 28) and data.data.dtype == torch.uint8
    assert set(data.targets.tolist()) == set(range(10)) and 20 < data.data.float().mean() < 80


# --------------------------------------------------------------------------------------------
# The orchestration, with stand-in checks


def fake_check(name: str, tier: int, command: str, *, exclusive: bool = False, judge=None) -> proof.Check:
    return proof.Check(name, tier, f"stand-in {name}", lambda c: [proof.Step(["sh", "-c", command])],
                       judge or (lambda run: proof.exited(run)), exclusive=exclusive)


@pytest.fixture
def stand_ins(monkeypatch):
    """Install stand-in checks and a machine with one GPU; returns a runner of gpu_proof.main."""
    def install(*checks: proof.Check):
        monkeypatch.setattr(proof, "CHECKS", list(checks))
        monkeypatch.setattr(proof, "BY_NAME", {check.name: check for check in checks})
        machine = {"gpus": 1, "torch": "2.11.0", "python": "3.12.3", "host": "gpu01", "gpu_name": "NVIDIA H100",
                   "cpus": 16}
        monkeypatch.setattr(gpu_proof, "probe_machine", lambda: machine)
    return install


def summary_of(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def test_a_check_cut_at_the_budget_is_not_run_and_the_summary_is_written_after_each_check(stand_ins, tmp_path,
                                                                                         capsys):
    stand_ins(fake_check("quick", 1, "true"), fake_check("broken", 1, "exit 3"),
              fake_check("long", 1, "sleep 30", exclusive=True), fake_check("later", 2, "true"))
    out = tmp_path / "out"
    began = time.time()
    status = gpu_proof.main(["--budget", "17", "--out", str(out), "--jobs", "2", "--bundle", str(tmp_path / "b")])
    assert time.time() - began < 25  # stopped at the budget, not after the sleep
    assert status == 1  # "broken" ran and failed
    rows = {row["name"]: row for row in summary_of(out)["checks"]}
    assert [row["name"] for row in summary_of(out)["checks"]] == ["quick", "broken", "long", "later"]
    assert rows["quick"]["status"] == "ok" and rows["broken"]["status"] == "failed"
    assert rows["broken"]["reason"] == "command 1 exited 3, expected 0"
    assert rows["long"]["status"] == "not-run" and rows["long"]["reason"] == "cut at the budget in command 1 of 1"
    assert rows["later"]["status"] == "not-run" and "budget" in rows["later"]["reason"]
    assert summary_of(out)["counts"] == {"ok": 1, "failed": 1, "skipped": 0, "not-run": 2}
    assert "| long | 1 | not-run |" in (out / "summary.md").read_text()
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["proof.log", "proof.tar.gz", "summary.json",
                                                                 "summary.md"]
    import tarfile

    with tarfile.open(tmp_path / "b" / "proof.tar.gz") as archive:
        assert "gpu-proof/broken/log.txt" in archive.getnames()


def test_an_archive_too_large_to_come_back_leaves_out_its_largest_files_and_names_them(stand_ins, tmp_path,
                                                                                      monkeypatch):
    """A lease brings back no file over 16 MiB: the archive drops its largest files until it is within its limit
    (here made small), and lists them with their sizes; what fits is kept whole."""
    def writes(c):
        return [proof.Step(["sh", "-c", f"head -c 3000000 /dev/urandom | base64 > {c.folder}/trace.json; "
                                        f"head -c 400000 /dev/urandom | base64 > {c.folder}/verbose.txt; "
                                        f"echo small > {c.folder}/note.txt"])]
    stand_ins(proof.Check("writer", 1, "writes three files", writes, lambda run: proof.exited(run)))
    monkeypatch.setattr(gpu_proof, "BUNDLE_MAX_ARCHIVE", 300_000)
    out, bundle = tmp_path / "out", tmp_path / "b"
    assert gpu_proof.main(["--budget", "30", "--out", str(out), "--bundle", str(bundle)]) == 0
    import tarfile

    with tarfile.open(bundle / "proof.tar.gz") as archive:
        names = archive.getnames()
        left_out = archive.extractfile("gpu-proof/left-out.txt").read().decode().split()
        assert archive.extractfile("gpu-proof/writer/note.txt").read() == b"small\n"
    assert (bundle / "proof.tar.gz").stat().st_size <= 300_000
    assert "gpu-proof/summary.json" in names and "gpu-proof/writer/verbose.txt" not in names
    sizes = dict(zip(left_out[::2], map(int, left_out[1::2])))
    assert sizes == {"writer/trace.json": (out / "writer/trace.json").stat().st_size,
                     "writer/verbose.txt": (out / "writer/verbose.txt").stat().st_size}
    assert sorted(path.name for path in bundle.iterdir()) == ["proof.log", "proof.tar.gz", "summary.json", "summary.md"]


def test_each_line_of_a_check_s_log_is_timed_from_its_command_s_start(stand_ins, tmp_path):
    """timeline.txt: every line the commands printed, in order, none earlier than it could have been printed
    (a line printed after a 1 s sleep is seen at 1 s or later on any machine), a line per command's end."""
    command = "echo first; sleep 1; echo 'after a second'; printf 'no newline'"
    stand_ins(proof.Check("timed", 1, "stand-in", lambda c: [proof.Step(["sh", "-c", command]),
                                                             proof.Step(["sh", "-c", "echo again >&2"])],
                          lambda run: proof.exited(run, [0, 0])))
    out = tmp_path / "out"
    assert gpu_proof.main(["--budget", "60", "--out", str(out)]) == 0
    rows = [line.split(None, 1) for line in (out / "timed" / "timeline.txt").read_text().splitlines()]
    assert [text for _, text in rows] == [f"$ sh -c {shlex.quote(command)}", "first", "after a second", "no newline",
                                          "[exit 0]", "$ sh -c 'echo again >&2'", "again", "[exit 0]"]
    first, second = [float(seconds) for seconds, _ in rows[:5]], [float(seconds) for seconds, _ in rows[5:]]
    assert first == sorted(first) and second == sorted(second)  # each command's clock from its own start
    assert first[2] >= 1.0 and first[4] >= first[3]
    assert "after a second" in (out / "timed" / "log.txt").read_text()  # the log itself is as it was


def test_on_the_cpu_two_checks_run_at_a_time_unless_jobs_says_otherwise(stand_ins, tmp_path, monkeypatch):
    """Each stand-in waits up to 5 s for the other to have started: together when two run at a time (the CPU's
    default on two cores), alone when --jobs 1 holds the second back until the first has ended."""
    monkeypatch.setattr(gpu_proof.os, "cpu_count", lambda: 2)
    meet = "touch {me}; for i in $(seq 50); do [ -e {other} ] && echo together && exit 0; sleep 0.1; done; echo alone"
    for jobs in ([], ["--jobs", "1"]):
        folder = tmp_path / ("default" if not jobs else "one")
        folder.mkdir()
        stand_ins(*(fake_check(name, 1, meet.format(me=folder / name, other=folder / other))
                    for name, other in (("a", "b"), ("b", "a"))))
        assert gpu_proof.main(["--device", "cpu", "--budget", "60", "--out", str(folder / "out"), *jobs]) == 0
        said = tuple(next(line for line in (folder / "out" / name / "log.txt").read_text().splitlines()
                          if not line.startswith("[proof]")) for name in ("a", "b"))
        assert said == (("together", "together") if not jobs else ("alone", "together")), said


def test_only_failed_reruns_what_did_not_pass_and_keeps_the_rest_of_the_summary(stand_ins, tmp_path):
    flag = tmp_path / "fixed"
    stand_ins(fake_check("good", 1, "true"), fake_check("flaky", 1, f"test -e {flag}"),
              fake_check("second", 2, "true"))
    out = tmp_path / "out"
    assert gpu_proof.main(["--budget", "60", "--out", str(out), "--tier", "1"]) == 1
    flag.touch()
    (out / "good" / "status.txt").write_text("marker")  # a rerun of "good" would replace its folder
    assert gpu_proof.main(["--budget", "60", "--out", str(out), "--only", "failed"]) == 0
    rows = {row["name"]: row["status"] for row in summary_of(out)["checks"]}
    assert rows == {"good": "ok", "flaky": "ok", "second": "ok"}  # tier 2 was never run: it is "failed"'s too
    assert (out / "good" / "status.txt").read_text() == "marker"


def test_only_pending_on_a_bare_machine_continues_a_committed_run_of_this_commit_only(stand_ins, tmp_path, monkeypatch,
                                                                                     capsys):
    """A lease's second call that lands on a bare machine finds no OUT summary: the committed one of an earlier lease
    continues only if it ran this tree's commit; of other code, every check is pending. Either way it says which."""
    stand_ins(fake_check("a", 1, "true"), fake_check("b", 2, "true"))
    committed = tmp_path / "repo" / "reference-results" / "h100-1gpu" / "gpu-proof"
    committed.mkdir(parents=True)
    monkeypatch.setattr(gpu_proof, "REPO", tmp_path / "repo")
    monkeypatch.setattr(gpu_proof, "_git_revision", lambda: "abc1234")
    ran = {}
    for git in ("0ld0000", "abc1234"):
        (committed / "summary.json").write_text(json.dumps({"started": "2026-11-26T11:40:07Z", "git": git, "checks": [
            {"name": "a", "status": "ok"}, {"name": "b", "status": "not-run"}]}))
        out = tmp_path / git
        assert gpu_proof.main(["--budget", "60", "--out", str(out), "--only", "pending"]) == 0
        ran[git] = sorted(path.name for path in out.iterdir() if path.is_dir())
        said = capsys.readouterr().out
        assert f"--only pending: read the newest committed summary (started 2026-11-26T11:40:07Z, git {git})" in said
        assert ("every check is pending" in said) == (git == "0ld0000")
    assert ran == {"0ld0000": ["a", "b"], "abc1234": ["b"]}


def test_a_run_the_budget_cut_short_exits_3_and_names_what_is_pending(stand_ins, tmp_path, capsys):
    """No check failed, but one never started: exit 0 said "proven" to anything that reads the status alone (CI, a
    script, a tired maintainer), with nothing of the second check run. Exit 3 and one line naming it."""
    stand_ins(fake_check("first", 1, "sleep 4"), fake_check("second", 1, "true"))
    # 18 s: 5 kept for the summary, and a check is not started with under 10 s left: "first" starts (3 s to spare on
    # a loaded machine), "second" never does.
    assert gpu_proof.main(["--budget", "18", "--out", str(tmp_path / "o")]) == 3
    assert [row["status"] for row in summary_of(tmp_path / "o")["checks"]] == ["ok", "not-run"]
    assert "gpu_proof: 1 of 2 check(s) not run within the budget (second): --only pending runs them" in \
        capsys.readouterr().err


def test_every_check_that_ran_ok_exits_0_and_unknown_names_are_one_usage_line(stand_ins, tmp_path, capsys):
    stand_ins(fake_check("a", 1, "true"), fake_check("b", 2, "true"))
    assert gpu_proof.main(["--budget", "60", "--out", str(tmp_path / "o"), "--only", "b"]) == 0
    assert [row["name"] for row in summary_of(tmp_path / "o")["checks"]] == ["b"]
    for names in (["a", "b"], ["a,b"], ["a,", "b"]):  # spaces or commas between the names
        assert gpu_proof.main(["--budget", "60", "--out", str(tmp_path / "o"), "--only", *names]) == 0
        assert [row["name"] for row in summary_of(tmp_path / "o")["checks"]] == ["a", "b"], names
    with pytest.raises(SystemExit) as exit_:
        gpu_proof.main(["--only", "b,nope", "--out", str(tmp_path / "o")])
    assert exit_.value.code == 2 and "unknown check(s) nope" in capsys.readouterr().err


def test_without_a_gpu_the_cuda_proof_is_one_line_and_list_shows_every_check_with_its_tier():
    listing = subprocess.run(["bash", str(REPO / "scripts/gpu_proof.sh"), "--list"], capture_output=True,
                             text=True, timeout=60, env=script_env(PYTHON=PYTHON))
    rows = [line.split()[:2] for line in listing.stdout.splitlines()]
    assert rows == [[str(check.tier), check.name] for check in proof.CHECKS]
    assert [tier for tier, _ in rows] == sorted(tier for tier, _ in rows)  # tier 1 first
    import torch

    if torch.cuda.is_available():
        return
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu_proof.sh"), "--budget", "60"], capture_output=True,
                          text=True, timeout=120, env=script_env(PYTHON=PYTHON), cwd=REPO)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines()[-1].startswith("gpu_proof: no CUDA GPU visible")


def test_prepare_keeps_only_the_examples_mnist_script_and_its_commit_small_enough_to_carry(tmp_path):
    """``gpu_proof_prepare.sh --no-wheels`` against a local stand-in of pytorch/examples with a history and a large
    file elsewhere: ``.examples/`` holds mnist/, LICENSE and SOURCE (the commit), no .git and nothing else (a lease
    carries it within 64 MiB with the tree); a second run keeps it; an earlier fill that was a whole clone is cut down
    without a source; a source that is not a repository is one line, exit 1, nothing left."""
    source = tmp_path / "examples"
    (source / "mnist").mkdir(parents=True)
    (source / "imagenet").mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(source)]
    subprocess.run(["git", "init", "-q", str(source)], check=True)
    for generation in range(3):  # a history a clone of a local path would copy whole
        (source / "imagenet" / "weights.bin").write_bytes(bytes([generation]) * 2**20)
        (source / "mnist" / "main.py").write_text(f"print('examples {generation}')\n")
        (source / "LICENSE").write_text("BSD-3-Clause\n")
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-q", "-m", f"commit {generation}"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    work = tmp_path / "course"
    (work / "scripts").mkdir(parents=True)
    (work / "scripts" / "gpu_proof_prepare.sh").write_bytes((REPO / "scripts/gpu_proof_prepare.sh").read_bytes())

    def prepare(examples_git: Path) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "scripts/gpu_proof_prepare.sh", "--no-wheels"], cwd=work, capture_output=True,
                              text=True, timeout=60, env=script_env(EXAMPLES_GIT=str(examples_git)))

    for attempt in range(3):  # then: filled, kept whatever EXAMPLES_GIT says; an earlier fill's whole clone, cut down
        if attempt == 2:
            shutil.rmtree(work / ".examples")
            subprocess.run(["git", "clone", "-q", str(source), str(work / ".examples")], check=True)
        done = prepare(source if attempt == 0 else tmp_path / "gone")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"gpu_proof_prepare: 0 wheel(s) in .whl/, pytorch/examples {head} ({source})"), \
            done.stdout
        kept = sorted(str(path.relative_to(work / ".examples")) for path in (work / ".examples").rglob("*"))
        assert kept == ["LICENSE", "SOURCE", "mnist", "mnist/main.py"]
        assert (work / ".examples/mnist/main.py").read_text() == "print('examples 2')\n"
        assert sorted(path.name for path in work.iterdir()) == [".examples", ".whl", "scripts"]  # no clone left

    (work / ".examples" / "SOURCE").unlink()  # an older fill, without its commit: fetched again
    failed = prepare(tmp_path / "gone")
    assert failed.returncode == 1 and failed.stdout == ""
    assert failed.stderr.count("\n") == 1 and "error: no pytorch/examples from " in failed.stderr
    assert not (work / ".examples").exists() and not (work / ".examples.clone").exists()


def test_the_nccl_probe_without_a_gpu_is_one_line_and_writes_nothing(tmp_path):
    facts = tmp_path / "probe.json"
    for probe in ("recorder", "watchdog"):
        result = subprocess.run([PYTHON, str(REPO / "scripts/gpu_probe_nccl.py"), probe, str(facts)],
                                capture_output=True, text=True, timeout=120, env=script_env(CUDA_VISIBLE_DEVICES=""))
        assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
        assert result.stderr.strip().splitlines() == [
            "error: NCCL needs a CUDA GPU and none is visible here (torch.cuda.is_available() is False) "
            "(see gpu_probe_nccl.py --help)"], result.stderr
    assert not facts.exists()


#: For each group of argv[1] (JSON: [[modules absent, [scripts]], ...]), a child forked after torch and torchvision
#: are imported imports each script (repo-relative) as a module, its main not run, with none of that group's absent
#: modules to be found, as on a machine without them. Prints one JSON list: per group, {script: the module whose
#: absence stopped its import, or null}.
IMPORT_WITHOUT = r"""
import importlib.util, json, os, sys
sys.path[:0] = ["tests", "tests/slurm"]  # what pytest puts first for the test files (helpers, testbed)
import torch, torchvision  # noqa: E401,F401  what every check may use, imported once
found = []
for absent, scripts in json.loads(sys.argv[1]):
    read, write = os.pipe()
    if os.fork() == 0:
        os.close(read)
        # None in sys.modules: an import of the name raises ModuleNotFoundError, and find_spec says it is not there.
        sys.modules.update(dict.fromkeys(absent))
        stopped = {}
        for number, script in enumerate(scripts):
            spec = importlib.util.spec_from_file_location(f"_script_{number}", script)
            sys.modules[spec.name] = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(sys.modules[spec.name])
                stopped[script] = None
            except ModuleNotFoundError as error:
                stopped[script] = error.name.partition(".")[0]
        os.write(write, json.dumps(stopped).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        found.append(json.loads(pipe.read() or "null"))
    os.wait()
print(json.dumps(found))
"""


def absent_beyond(modules: tuple[str, ...]) -> list[str]:
    """The top-level modules of this environment's packages that neither torch, torchvision nor the packages of
    ``modules`` bring with them (their requirements followed through): what a GPU image with PyTorch and those may
    lack."""
    import importlib.metadata as metadata

    def name(distribution: str) -> str:
        return re.split(r"[\s;<>=!~\[(]", distribution, maxsplit=1)[0].lower().replace("_", "-")

    owners = metadata.packages_distributions()
    brought, todo = set(), ["torch", "torchvision", *(name(d) for module in modules for d in owners.get(module, []))]
    while todo:
        dist = todo.pop()
        if dist not in brought:
            brought.add(dist)
            try:
                todo += [name(r) for r in metadata.requires(dist) or [] if "extra ==" not in r]
            except metadata.PackageNotFoundError:
                pass
    return sorted(module for module, dists in owners.items() if not {name(d) for d in dists} & brought
                  and module.isidentifier() and not module.startswith("_") and not (REPO / module).exists())


def test_each_check_declares_every_module_its_scripts_import_beyond_torch(tmp_path):
    """A GPU image has PyTorch and some of the rest (the last lease's had no line_profiler): a check whose scripts
    import a module it does not declare in ``needs`` fails there with a traceback, where gpu_proof.sh would have
    skipped it and said which wheel to bring. Each check's scripts are imported (not run) with every module
    beyond torch and torchvision absent but those it declares; the import must get through."""
    assert {"yaml", "pandas", "line_profiler", "webdataset", "pluggy"} <= set(absent_beyond(()))
    assert "pluggy" not in absent_beyond(("pytest",))  # pytest's own requirement comes with it
    ctx = proof.Ctx(device="cuda", gpus=1, python=PYTHON, folder=tmp_path / "check", examples=tmp_path / "examples")
    by_needs: dict[tuple[str, ...], dict[str, str]] = {}  # declared modules -> {script: check}
    for check in proof.CHECKS:
        for step in check.steps(ctx):
            scripts = [part for part in step.argv if part.endswith(".py") and (REPO / part).is_file()]
            if step.argv[1:3] == ["-m", "pytest"]:  # pytest collects every test file, and its conftest.py files
                scripts += sorted(str(path.relative_to(REPO)) for pattern in ("conftest.py", "test_*.py")
                                  for path in (REPO / "tests").rglob(pattern))
            by_needs.setdefault(tuple(sorted(check.needs)), {}).update(dict.fromkeys(scripts, check.name))
    assert len({script for scripts in by_needs.values() for script in scripts}) >= 50
    groups = [[absent_beyond(needs), list(scripts)] for needs, scripts in by_needs.items()]
    proc = subprocess.run([PYTHON, "-c", IMPORT_WITHOUT, json.dumps(groups)], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=script_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = dict(zip(by_needs, json.loads(proc.stdout.splitlines()[-1])))
    assert None not in found.values(), proc.stderr[-3000:]  # every child answered
    undeclared = {by_needs[needs][script]: f"{script} imports {module}"
                  for needs, stopped in found.items() for script, module in stopped.items() if module}
    assert not undeclared, f"add to the check's needs (and its wheel to scripts/gpu_proof_prepare.sh): {undeclared}"


@pytest.mark.slow
def test_the_cpu_rehearsal_runs_the_real_checks_within_its_budget(tmp_path):
    """What CI runs before any GPU is lent: the real checks' CPU paths, tier 1 first, stopped at the budget.
    How many checks fit depends on the machine's speed and load; what holds on any machine is asserted:
    the exit status, the budget kept, every check accounted for in order, nothing failed, and every check
    that passed has its records."""
    out = tmp_path / "rehearsal"
    no_examples = tmp_path / "no-examples"  # CI cannot fetch pytorch/examples: the same skip on every machine
    no_examples.mkdir()
    began = time.time()
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu_proof.sh"), "--device", "cpu", "--budget", "60", "--out",
                           str(out), "--examples", str(no_examples)], capture_output=True, text=True, timeout=200,
                          env=script_env(PYTHON=PYTHON), cwd=REPO)
    assert time.time() - began < 90, "the rehearsal ran past its budget"
    assert proc.returncode in (0, 3), (proc.stdout + proc.stderr)[-4000:]  # 3: the budget cut a tail (below)
    assert re.search(rf"^gpu_proof: {len(proof.CHECKS)} check\(s\) on cpu \(0 GPU\(s\), torch [^,]+\), budget 60 s, ",
                     proc.stdout + proc.stderr, re.M), (proc.stdout + proc.stderr)[:1000]
    summary = summary_of(out)
    rows = summary["checks"]
    assert summary["device"] == "cpu" and summary["counts"]["failed"] == 0
    assert [row["name"] for row in rows] == [check.name for check in proof.CHECKS]  # every one, in tier order
    assert "[proof] $ bash scripts/main_job.sh" in (out / "main_job" / "log.txt").read_text()  # it did start
    for row in rows:
        assert row["status"] in ("ok", "skipped", "not-run"), row
        if row["status"] == "ok":
            assert row["records"] and all((out / path).is_file() for path in row["records"]), row
        elif row["name"] == "ch04_vs_examples":
            assert row["status"] == "skipped" and row["reason"].startswith("no pytorch/examples checkout at "), row
        elif row["status"] == "skipped":
            assert row["reason"].startswith("on the CPU: "), row
        else:
            assert "budget" in row["reason"], row
    started = [row["status"] for row in rows if row["status"] != "skipped"]
    assert started == sorted(started, key=lambda status: status != "ok")  # the budget cut a tail, not a middle
    assert proc.returncode == (3 if "not-run" in started else 0)
    assert re.search(r"\| main_job \| 1 \| (ok|not-run) \| \d+ \|", (out / "summary.md").read_text())


#: Lesson scripts no check of the GPU proof starts itself, and why.
NOT_STARTED_BY_A_CHECK = {
    "labs/lab01_dp_vs_ddp/05_performance_comparison.py":
        "the main job runs it (scripts/main_job.sh, Lab-01's run_lab.sh)",
    "labs/lab06_failures/02_diagnose.py": "reads a run's files and processes (py-spy), on no device",
    **{f"labs/lab09_many_jobs/{name}": "Slurm's tools (sbatch, sacct): a GPU machine without Slurm cannot run them; "
       "the trainings they submit are Lab-01's, which tier 1 runs"
       for name in ("01_sweep.py", "02_status.py", "03_chain.py", "04_pipeline.py", "05_submitit.py")},
}


def test_every_lesson_script_is_in_the_gpu_proof_or_says_why_not(tmp_path):
    """A new lab's scripts join a check (scripts/gpu_proof_checks.py), or NOT_STARTED_BY_A_CHECK says why: the proof
    no longer silently covers less of the course than docs/gpu-proof.md says."""
    ctx = proof.Ctx(device="cuda", gpus=1, python=PYTHON, folder=tmp_path / "check", examples=tmp_path / "examples")
    started = {part for check in proof.CHECKS for step in check.steps(ctx) for part in step.argv
               if part.endswith(".py") and (REPO / part).is_file()}
    lessons = {str(path.relative_to(REPO)) for path in [*REPO.glob("chapters/*/*.py"), *REPO.glob("labs/*/*.py")]
               if 'if __name__ == "__main__"' in path.read_text(encoding="utf-8")}
    assert len(lessons) >= 38
    missing = lessons - started - set(NOT_STARTED_BY_A_CHECK)
    assert not missing, f"add a check to scripts/gpu_proof_checks.py (or a reason here) for {sorted(missing)}"
    assert not set(NOT_STARTED_BY_A_CHECK) & started, "a script a check starts has a reason for not being started"
    assert set(NOT_STARTED_BY_A_CHECK) <= lessons


def imports_inside_functions(path: Path) -> set[str]:
    """The top-level packages ``path`` imports inside a function body (a lazy import, which importing the file does
    not reach), unless a ``try`` around it catches ImportError: such a script fails only when it gets there."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    guarded = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.Try) and any(
        "ImportError" in ast.unparse(handler.type or ast.Name("BaseException")) for handler in node.handlers)
        for statement in node.body for inner in ast.walk(statement)}
    found = set()
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if id(node) not in guarded and isinstance(node, ast.Import):
                    found |= {alias.name.split(".")[0] for alias in node.names}
                elif id(node) not in guarded and isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return found


def test_each_check_declares_what_its_scripts_import_inside_functions(tmp_path):
    """The import test above imports each check's scripts, which does not reach an import inside ``main`` (Lab-08's
    StatefulDataLoader from torchdata): read the scripts and their folder's ``*_shared.py`` for those, and hold them to
    the check's ``needs`` the same way."""
    ctx = proof.Ctx(device="cuda", gpus=1, python=PYTHON, folder=tmp_path / "check", examples=tmp_path / "examples")
    undeclared = {}
    for check in proof.CHECKS:
        absent = set(absent_beyond(tuple(check.needs)))
        scripts = {REPO / part for step in check.steps(ctx) for part in step.argv
                   if part.endswith(".py") and (REPO / part).is_file()}
        for script in sorted(scripts | {shared for s in scripts for shared in s.parent.glob("*_shared.py")}):
            if missing := imports_inside_functions(script) & absent:
                undeclared[f"{check.name}: {script.relative_to(REPO)}"] = sorted(missing)
    assert "torchdata" in imports_inside_functions(REPO / "labs/lab08_data_at_scale/03_shards_exactly_once.py")
    assert not undeclared, f"add to the check's needs (and its wheel to scripts/gpu_proof_prepare.sh): {undeclared}"


def test_prepare_help_and_a_bad_python_version_write_nothing(tmp_path):
    """``gpu_proof_prepare.sh --help`` ran ``pip download --python-version --help``: pip's whole usage, exit 2, and an
    empty ``.whl/`` left behind; ``3.x`` the same. --help prints the header's usage, exit 0; a bad argument is one
    ``error:`` line, exit 2; neither writes anything (nor reaches the network)."""
    work = tmp_path / "course"
    (work / "scripts").mkdir(parents=True)
    (work / "scripts" / "gpu_proof_prepare.sh").write_bytes((REPO / "scripts/gpu_proof_prepare.sh").read_bytes())

    def prepare(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "scripts/gpu_proof_prepare.sh", *args], cwd=work, capture_output=True,
                              text=True, timeout=60, env=script_env(EXAMPLES_GIT=str(tmp_path / "gone")))

    helped = prepare("--help")
    assert helped.returncode == 0 and "[--no-wheels] [PYTHON_VERSION]" in helped.stdout and not helped.stderr
    for bad in (["3.x"], ["3.12", "--no-wheels"], ["--no-wheels", "3.12", "extra"]):
        refused = prepare(*bad)
        assert refused.returncode == 2 and refused.stderr.startswith("error: ") and refused.stderr.count("\n") == 1, \
            (bad, refused.stderr)
    assert sorted(path.name for path in work.iterdir()) == ["scripts"]
