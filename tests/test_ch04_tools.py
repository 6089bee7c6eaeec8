"""Chapter 4's tools: pytorch_basics.py, gpu_check.py (common/runtime/envcheck.py), amp_training.py, the README.

Every script runs for real, in-process on CPU with tiny sizes. The README's commands are checked
against the files and argument parsers they name, and its Python examples are executed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common.runtime.envcheck import allocation_agreement, count_gpu_spec, slurm_gpu_count, visible_devices_count
from helpers import REPO, load_script, run_fresh, run_main

CHAPTER = REPO / "chapters" / "ch04_deep_learning"
BASICS = "chapters/ch04_deep_learning/pytorch_basics.py"
CHECK = "chapters/ch04_deep_learning/gpu_check.py"
AMP = "chapters/ch04_deep_learning/amp_training.py"
README = CHAPTER / "README.md"


def _records(folder: Path) -> dict[str, dict]:
    return {json.loads(p.read_text())["method"]: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


# --- pytorch_basics.py -----------------------------------------------------------------------------

def test_basics_times_matmul_per_dtype_and_writes_record(tmp_path, capsys):
    status = run_main(BASICS, ["--device", "cpu", "--size", "96", "--repeats", "3", "--warmup", "1",
                               "--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "== tensors" in out and "== device moves" in out and "pinned memory" in out
    assert "unknown" in out  # CPUs have no peak figure
    (record,) = _records(tmp_path).values()
    assert record["lab"] == "ch04" and record["method"] == "matmul"
    rows = {row["dtype"]: row for row in record["metrics"]["matmul"]}
    assert list(rows) == ["fp32", "bf16"]  # auto on CPU
    for row in rows.values():
        assert row["size"] == 96 and row["flops"] == 2 * 96**3
        assert row["tflops"] == pytest.approx(2 * 96**3 / row["median_s"] / 1e12)
        assert row["tflops_best"] >= row["tflops"] > 0
        assert row["peak_tflops"] is None and row["mfu"] is None
        assert row["timing"]["steps_timed"] == 3 and row["timing"]["warmup_steps"] == 1
        printed = re.search(rf"^{row['dtype']}\s+([\d.]+)", out, re.M)
        assert float(printed.group(1)) == pytest.approx(1000 * row["median_s"], abs=1e-3)
    # fp32 rounds at ~1e-7, bf16 (8 bits of precision) at ~1e-3: the error column shows the difference
    assert rows["fp32"]["rel_error_vs_fp64"] < 1e-5 < 1e-4 < rows["bf16"]["rel_error_vs_fp64"] < 5e-2
    assert record["config"]["size"] == 96 and record["config"]["precision"] == ["fp32", "bf16"]


def test_basics_explicit_dtypes_and_bad_input(tmp_path, capsys):
    assert run_main(BASICS, ["--device", "cpu", "--size", "32", "--repeats", "1", "--precision", "fp64,fp32,fp64",
                             "--skip-tour", "--results-dir", str(tmp_path / "ok")]) == 0
    out = capsys.readouterr().out
    assert "== tensors" not in out
    (record,) = _records(tmp_path / "ok").values()
    assert [row["dtype"] for row in record["metrics"]["matmul"]] == ["fp64", "fp32"]

    assert run_main(BASICS, ["--device", "cpu", "--precision", "tf32", "--results-dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: tf32 is a mode of NVIDIA tensor cores") and len(err.splitlines()) == 1
    with pytest.raises(SystemExit) as exit_:
        load_script(BASICS).build_parser().parse_args(["--precision", "fp32,int8"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("error: argument --precision: unknown precision(s) int8; choose from fp64, fp32")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("name, label, fp32, fp16", [
    ("NVIDIA A100-SXM4-40GB", "A100", 19.5, 312),     # the LANTA chapter's table
    ("NVIDIA A100 80GB PCIe", "A100", 19.5, 312),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 67, 989.5),
    ("NVIDIA H100 PCIe", "H100 PCIe", 51, 756),
    ("NVIDIA H200", "H200 SXM", 67, 989.5),
    ("NVIDIA H200 NVL", "H200 NVL", 60, 835.5),
    ("Tesla V100-SXM2-32GB", "V100 SXM2", 15.7, 125),
])
def test_peak_table_matches_gpu_names(name, label, fp32, fp16):
    found, peaks = load_script(BASICS).peak_for(name)
    assert label in found and peaks["fp32"] == fp32 and peaks["fp16"] == fp16


def test_peak_table_knows_no_peak_for_unknown_devices():
    basics = load_script(BASICS)
    assert basics.peak_for("NVIDIA GeForce RTX 4090") == (None, {})
    assert basics.peak_for("cpu (2 threads)") == (None, {})


# --- common/runtime/envcheck.py and gpu_check.py -----------------------------------------------------------

def test_envcheck_imports_without_torch():
    code = "import sys, common.runtime.envcheck; assert 'torch' not in sys.modules, 'torch was imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("value, count", [(None, None), ("", None), ("4", 4), ("a100:4", 4),
                                          ("a100:2,v100:1", 3), ("gpu:x", None)])
def test_count_gpu_spec(value, count):
    assert count_gpu_spec(value) == count


@pytest.mark.parametrize("env, expected", [
    ({}, (None, None)),
    ({"SLURM_GPUS_ON_NODE": "4"}, (4, "SLURM_GPUS_ON_NODE")),
    ({"SLURM_JOB_GPUS": "0"}, (1, "SLURM_JOB_GPUS")),            # an index list: "0" is one GPU
    ({"SLURM_JOB_GPUS": "0,1,2", "SLURM_GPUS_ON_NODE": "3"}, (3, "SLURM_GPUS_ON_NODE")),
    ({"SLURM_STEP_GPUS": "2,3", "SLURM_GPUS_ON_NODE": "4"}, (2, "SLURM_STEP_GPUS")),
    ({"SLURM_GPUS_PER_NODE": "a100:2"}, (2, "SLURM_GPUS_PER_NODE")),
    ({"SLURM_GPUS": "8", "SLURM_JOB_NUM_NODES": "2"}, (None, None)),  # the job's total over 2 nodes
    ({"SLURM_GPUS": "2", "SLURM_JOB_NUM_NODES": "1"}, (2, "SLURM_GPUS")),
])
def test_slurm_gpu_count(env, expected):
    assert slurm_gpu_count(env) == expected


@pytest.mark.parametrize("value, count", [(None, None), ("", 0), ("0,1", 2), ("GPU-1a2b,GPU-3c4d", 2),
                                          ("NoDevFiles", 0), ("-1", 0), ("0,-1,2", 1)])
def test_visible_devices_count(value, count):
    assert visible_devices_count(value) == count


def _info(slurm_gpus=None, torch_gpus=0, per_task=None, visible=None, in_job=True, cuda_build=True,
          slurm_cpus=None, usable=2, threads=2, gpus=None, nccl=True) -> dict:
    return {
        "slurm": {"in_job": in_job, "gpus": slurm_gpus, "gpus_source": "SLURM_GPUS_ON_NODE" if slurm_gpus else None,
                  "gpus_per_task": per_task, "cpus_per_task": slurm_cpus},
        "torch_gpus": torch_gpus, "cuda_visible_devices": visible, "cuda_visible_count": visible_devices_count(visible),
        "backends": {"cuda_build": cuda_build, "nccl_built": nccl},
        "gpus": gpus or [], "cpus": {"usable_cpus": usable, "torch_threads": threads},
    }


@pytest.mark.parametrize("info, fragments", [
    (_info(), []),
    (_info(slurm_gpus=4, torch_gpus=4, visible="0,1,2,3", slurm_cpus=2), []),
    (_info(slurm_gpus=4, torch_gpus=1, per_task=1, visible="2"), []),  # srun bound one GPU to this task
    (_info(in_job=False, torch_gpus=2), []),  # a workstation outside Slurm
    (_info(slurm_gpus=4, torch_gpus=0, visible="0,1,2,3"),
     ["Slurm allocated 4 GPU(s)", "PyTorch sees 0", "the allocation's GPUs are not visible", "nvidia-smi"]),
    (_info(slurm_gpus=4, cuda_build=False), ["not visible", "CPU-only build"]),
    (_info(slurm_gpus=2, visible=""), ["not visible", "CUDA_VISIBLE_DEVICES='' hides every GPU"]),
    (_info(slurm_gpus=4, torch_gpus=2, visible="0,1"), ["PyTorch sees 2", "--gpus-per-task"]),
    (_info(torch_gpus=2), ["asked for none", "--gres=gpu:N"]),
    (_info(slurm_gpus=2, torch_gpus=1, per_task=1, visible="0,7"), ["lists 2 GPU(s) but PyTorch sees 1"]),
    (_info(slurm_gpus=1, torch_gpus=1, visible="0", nccl=False), ["no NCCL"]),
    (_info(slurm_gpus=1, torch_gpus=1, visible="0",
           gpus=[{"index": 0, "name": "NVIDIA A100", "smoke_test": "failed: CUDA error"}]), ["failed: CUDA error"]),
    (_info(slurm_cpus=4, usable=2, threads=2), ["Slurm gave 4 CPU(s) per task", "run on only 2"]),
    (_info(slurm_cpus=2, usable=16, threads=16), ["16 threads on 2 allocated CPU(s)", "OMP_NUM_THREADS"]),
])
def test_allocation_agreement(info, fragments):
    warnings = allocation_agreement(info)
    assert len(warnings) == (1 if fragments else 0), warnings
    for fragment in fragments:
        assert fragment in warnings[0]


def test_gpu_check_json_warns_when_slurm_gpus_are_invisible(monkeypatch, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the case needs PyTorch to see none")
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert run_main(CHECK, ["--json"]) == 0
    info = json.loads(capsys.readouterr().out)  # one JSON object and nothing else
    assert info["torch_gpus"] == 0 and info["gpus"] == []
    assert info["slurm"]["gpus"] == 4 and info["slurm"]["variables"]["SLURM_JOB_ID"] == "4242"
    assert info["cuda_visible_count"] == 4
    assert info["versions"]["torch"] == torch.__version__ and info["versions"]["python"]
    assert info["backends"]["gloo_built"] is True and info["backends"]["cuda"] is False
    assert any("the allocation's GPUs are not visible" in w for w in info["warnings"])
    assert run_main(CHECK, ["--strict"]) == 1  # the same facts as text, and a failing status
    out = capsys.readouterr().out
    assert "WARNING: Slurm allocated 4 GPU(s) on this node (SLURM_GPUS_ON_NODE)" in out


def test_gpu_check_human_output_off_cluster(monkeypatch, capsys):
    import torch

    for key in [k for k in os.environ if k.startswith("SLURM_") or k == "CUDA_VISIBLE_DEVICES"]:
        monkeypatch.delenv(key)
    assert run_main(CHECK, ["--strict", "--no-smoke-test"]) == 0
    out = capsys.readouterr().out
    assert f"torch           {torch.__version__}" in out
    assert "not inside a Slurm job" in out and "agreement       ok" in out
    assert f"GPUs (PyTorch)  {torch.cuda.device_count() if torch.cuda.is_available() else 0}" in out


@pytest.mark.gpu
def test_gpu_check_on_a_gpu():
    import torch

    info = json.loads(run_fresh(CHECK, ["--json"]))
    assert info["torch_gpus"] == torch.cuda.device_count() and info["backends"]["cudnn"]
    assert all(gpu["smoke_test"] == "ok" and gpu["total_memory_bytes"] > 0 for gpu in info["gpus"])


@pytest.mark.gpu
def test_basics_on_a_gpu_reports_peak_fraction(tmp_path):
    import torch

    run_fresh(BASICS, ["--size", "2048", "--repeats", "3", "--skip-tour", "--results-dir", str(tmp_path)])
    (record,) = _records(tmp_path).values()
    rows = record["metrics"]["matmul"]
    assert record["config"]["resolved_device"].startswith("cuda") and rows
    if load_script(BASICS).peak_for(torch.cuda.get_device_name())[0]:
        assert all(0 < row["mfu"] < 1.2 for row in rows)


# --- amp_training.py -------------------------------------------------------------------------------

def test_amp_training_compares_records_it_ran(tmp_path, capsys):
    settings = ["--device", "cpu", "--seed", "7", "--epochs", "1", "--max-steps", "3", "--batch-size", "16",
                "--log-interval", "1000"]
    status = run_main(AMP, [*settings, "--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    records = _records(tmp_path)
    # Its fp32 run is mnist_training.py's loop: the same settings typed to that script train to the same loss.
    assert run_main("chapters/ch04_deep_learning/mnist_training.py",
                    [*settings, "--precision", "fp32", "--results-dir", str(tmp_path / "alone")]) == 0
    (alone,) = _records(tmp_path / "alone").values()
    assert records["fp32"]["metrics"]["final_loss"] == alone["metrics"]["final_loss"]
    assert records["fp32"]["metrics"]["test_accuracy"] == alone["metrics"]["test_accuracy"]
    assert set(records) == {"fp32", "bf16", "amp-comparison"}
    comparison = records["amp-comparison"]
    assert comparison["lab"] == "ch04" and comparison["metrics"]["baseline"] == "fp32"
    rows = {row["precision"]: row for row in comparison["metrics"]["runs"]}
    assert list(rows) == ["fp32", "bf16"]
    for precision, row in rows.items():
        run = records[precision]
        assert row["run_id"] == run["run_id"] and (tmp_path / row["record"]).is_file()
        assert row["test_accuracy"] == run["metrics"]["test_accuracy"]
        assert row["final_loss"] == run["metrics"]["final_loss"]
        # mnist_training.py's own run (the loop a student reads), with the same seed and settings every time
        assert run["script"] == "chapters/ch04_deep_learning/mnist_training.py"
        assert run["config"]["precision"] == precision
        for key in ("seed", "epochs", "max_steps", "batch_size", "dataset", "model", "log_interval"):
            assert run["config"][key] == records["fp32"]["config"][key]
    assert records["fp32"]["config"]["log_interval"] == 1000
    assert rows["fp32"]["speedup_vs_fp32"] == pytest.approx(1.0)
    assert rows["bf16"]["speedup_vs_fp32"] == pytest.approx(
        records["bf16"]["metrics"]["samples_per_s"] / records["fp32"]["metrics"]["samples_per_s"])
    assert rows["bf16"]["accuracy_diff_points"] == pytest.approx(
        100 * (records["bf16"]["metrics"]["test_accuracy"] - records["fp32"]["metrics"]["test_accuracy"]))
    table = re.search(r"^bf16\s+([\d.]+)%\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+([+-][\d.]+)$", out, re.M)
    assert table, out
    assert float(table.group(1)) == pytest.approx(100 * rows["bf16"]["test_accuracy"], abs=0.006)
    assert float(table.group(4)) == pytest.approx(rows["bf16"]["speedup_vs_fp32"], abs=0.006)


def test_amp_training_checks_precisions_before_running(tmp_path, capsys):
    assert run_main(AMP, ["--device", "cpu", "--precision", "fp16", "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: fp16 autocast needs a CUDA GPU; on CPU compare --precision fp32,bf16"
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


# --- the chapter README ----------------------------------------------------------------------------

def _code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.S | re.M)


def _commands() -> list[list[str]]:
    """Every command line of the README's bash blocks, comments dropped, continuations joined."""
    commands = []
    for block in _code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes
                words = words[1:]
            if words:
                commands.append(words)
    return commands


def _env_names() -> set[str]:
    return {yaml.safe_load(p.read_text())["name"] for p in (REPO / "environments").glob("*.yaml")}


def test_readme_commands_name_existing_files_and_accepted_flags():
    commands = _commands()
    assert len(commands) >= 10
    checked_scripts = set()
    for words in commands:
        program = words[0]
        if program in ("python", "torchrun") or "python" in words:
            start = words.index("python") + 1 if "python" in words else 1
            rest = words[start:]
            while rest and rest[0].startswith("-"):  # torchrun's own flags
                rest = rest[1:]
            script = (CHAPTER / rest[0]).resolve()
            assert script.is_file(), f"README runs {rest[0]}, which does not exist"
            module = load_script(str(script.relative_to(REPO)))
            try:
                module.build_parser().parse_args(rest[1:])
            except SystemExit:
                pytest.fail(f"{script.name} does not accept: {' '.join(rest[1:])}")
            for previous, arg in zip(rest, rest[1:]):  # files the command reads (an -o output is made by it)
                if previous != "-o" and re.search(r"\.(j2|sbatch|yaml|py)$", arg):
                    assert (CHAPTER / arg).is_file(), (f"README's {script.name} command names {arg}, "
                                                       "which does not exist")
            checked_scripts.add(script.name)
        elif program in ("sbatch", "source"):
            assert (CHAPTER / words[-1]).is_file(), f"README {program}s {words[-1]}, which does not exist"
        elif program in ("mamba", "conda") and words[1] == "env":
            assert (CHAPTER / words[words.index("-f") + 1]).is_file()
        elif program in ("mamba", "conda") and words[1] == "activate":
            assert words[2] in _env_names(), f"no environment file names {words[2]}"
    assert {"gpu_check.py", "pytorch_basics.py", "mnist_training.py", "amp_training.py", "multi_gpu_ddp.py",
            "download_data.py"} <= checked_scripts


def test_readme_timeout_demo_exits_with_the_trainings_own_status():
    """``timeout`` exits 124 once its time is up, whatever the command did; the README says a signalled run saves
    and exits 0, so its pre-emption demo passes ``--preserve-status`` and ``echo $?`` shows the training's 0."""
    timeouts = [words for words in _commands() if words[0] == "timeout"]
    assert timeouts and all("--preserve-status" in words for words in timeouts), timeouts


def test_readme_file_map_lists_existing_files():
    table = re.findall(r"^\| `([^`]+)` \|", README.read_text(), re.M)
    assert "sbatch/single_gpu.sbatch" in table and "sbatch/multi_gpu.sbatch" in table
    missing = [name for name in table if not (CHAPTER / name).is_file()]
    assert not missing, f"README's file map names files that do not exist: {missing}"
    scripts = {p.name for p in CHAPTER.glob("*.py")}
    assert scripts <= set(table), f"scripts missing from the file map: {scripts - set(table)}"


def test_readme_python_examples_run_and_use_current_amp_api():
    blocks = _code_blocks("python")
    assert len(blocks) >= 2
    for block in blocks:
        assert "torch.cuda.amp" not in block
        exec(compile(block, str(README), "exec"), {"__name__": "readme_example"})
    assert any("torch.amp.GradScaler" in b and "torch.autocast" in b and "unscale_" in b for b in blocks)


def _section(heading: str) -> str:
    """The README's text under ``heading`` (## or ###), up to the next heading of any level."""
    text = README.read_text()
    match = re.search(rf"^#+ {re.escape(heading)}\n(.*?)(?=^#)", text, re.S | re.M)
    assert match, f"no section {heading!r} in {README.relative_to(REPO)}"
    return match.group(1)


@pytest.mark.parametrize("heading", ["Moving work to the GPU", "Mixed precision training"])
def test_readme_key_ideas_with_code_run_without_deprecation_warnings(heading):
    """The two key ideas a student can try run as printed, on this CPU; a deprecated API (the
    torch.cuda.amp aliases warn with FutureWarning) fails here."""
    import warnings

    (block,) = re.findall(r"^```python\n(.*?)^```", _section(heading), re.S | re.M)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        exec(compile(block, f"{README} ({heading})", "exec"), {"__name__": "readme_example"})


def test_readme_a100_table_is_the_peak_table_pytorch_basics_measures_against():
    _, a100 = load_script(BASICS).peak_for("NVIDIA A100-SXM4-40GB")
    rows = dict(re.findall(r"^\| (.+?) \| (.+?) \|$", _section("NVIDIA A100 specifications (LANTA)"), re.M))
    assert rows["FP32 Performance"] == f"{a100['fp32']:g} TFLOPS"
    assert rows["FP16 Performance"] == f"{a100['fp16']:g} TFLOPS"
