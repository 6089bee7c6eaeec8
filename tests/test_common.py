"""The shared package: launch detection, records, data sets, models, timing, devices, flags."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from common import cli, results

from common.runtime import cpus, launch
from helpers import fake_cpuinfo, script_env

# --------------------------------------------------------------------------------------------
# launch: who started us (pure environment logic, no torch)


def test_plain_python_is_a_single_process():
    info = launch.detect_launch({})
    assert (info.launcher, info.rank, info.world_size, info.is_distributed) == ("single", 0, 1, False)


def test_torchrun_variables_win():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "29511",
           "GROUP_RANK": "1", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "5"}
    info = launch.detect_launch(env)
    assert info.launcher == "torchrun"
    assert (info.rank, info.local_rank, info.world_size, info.node_rank) == (3, 1, 4, 1)
    assert (info.master_addr, info.master_port) == ("node7", 29511)


def test_srun_step_maps_slurm_variables():
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
           "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    info = launch.detect_launch(env)
    assert info.launcher == "slurm"
    assert (info.rank, info.local_rank, info.world_size, info.node_rank) == (3, 1, 4, 1)
    assert info.master_addr == "gpu07"
    # Every task of the step must compute the same port, and it must not be a fixed constant.
    assert info.master_port == launch.port_from_job("4242", "1")
    assert launch.port_from_job("4242", "1") != launch.port_from_job("4243", "1")
    assert launch.PORT_BASE <= info.master_port < launch.PORT_BASE + launch.PORT_SPAN


def test_batch_script_outside_srun_is_not_a_multi_process_launch():
    # sbatch's batch step has SLURM_PROCID=0 and SLURM_NTASKS=N but no step: running python there
    # directly is ONE process; treating it as N would hang waiting for peers.
    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert launch.detect_launch(env).world_size == 1


def test_slurm_master_addr_and_port_can_be_overridden():
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
           "SLURM_JOB_NODELIST": "n1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "31000"}
    info = launch.detect_launch(env)
    assert (info.master_addr, info.master_port) == ("10.0.0.5", 31000)


@pytest.mark.parametrize("expression, hosts", [
    ("n1", ["n1"]),
    ("n[1-2]", ["n1", "n2"]),
    ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("x[009-011]", ["x009", "x010", "x011"]),
])
def test_expand_hostlist(expression, hosts):
    assert launch.expand_hostlist(expression) == hosts


def test_free_port_is_bindable():
    import socket

    port = launch.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# --------------------------------------------------------------------------------------------
# results: records written atomically, read back, bad files named


def _record(**overrides):
    base = dict(lab="lab01", script="labs/x.py", method="ddp", config={"model": "resnet18"},
                metrics={"samples_per_s": 123.4}, provenance={"hostname": "h", "world_size": 2})
    base.update(overrides)
    return results.make_record(**base)


def test_record_round_trip(tmp_path):
    path = results.write_record(_record(), tmp_path)
    assert path.name.startswith("lab01_ddp_") and path.suffix == ".json"
    loaded = results.load_records(tmp_path)
    assert loaded.errors == []
    assert len(loaded.records) == 1
    rec = loaded.records[0]
    assert rec["schema"] == results.SCHEMA_NAME and rec["schema_version"] == results.SCHEMA_VERSION
    assert rec["metrics"]["samples_per_s"] == 123.4
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_record_values_are_made_json_safe(tmp_path):
    rec = _record(metrics={"nan": float("nan"), "path": tmp_path, "tuple": (1, 2)})
    assert rec["metrics"] == {"nan": None, "path": str(tmp_path), "tuple": [1, 2]}


def test_reader_skips_and_names_bad_files(tmp_path):
    results.write_record(_record(), tmp_path)
    (tmp_path / "corrupt.json").write_text('{"schema": "hpc-dl-labs/result", "schema_ver')
    (tmp_path / "other.json").write_text(json.dumps({"hello": "world"}))
    future = _record()
    future["schema_version"] = 99
    (tmp_path / "future.json").write_text(json.dumps(future))
    (tmp_path / ".partial.json.tmp").write_text("{")
    (tmp_path / "ch16_profile_trace.json").write_text('{"traceEvents": [')  # a trace, even one cut short: no record
    loaded = results.load_records(tmp_path)
    assert len(loaded.records) == 1
    reasons = {path.name: reason for path, reason in loaded.errors}
    assert set(reasons) == {"corrupt.json", "other.json", "future.json"}
    assert "not valid JSON" in reasons["corrupt.json"]
    assert "missing key" in reasons["other.json"]
    assert "schema_version 99" in reasons["future.json"]


def test_reader_missing_folder_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        results.load_records(tmp_path / "nope")


def test_invalid_record_is_refused_and_nothing_written(tmp_path):
    rec = _record()
    del rec["metrics"]
    with pytest.raises(ValueError, match="metrics"):
        results.write_record(rec, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_leaves_old_file_when_serialisation_fails(tmp_path):
    target = tmp_path / "r.json"
    results.write_json_atomic({"a": 1}, target)

    class Boom:
        def __str__(self):
            raise RuntimeError("cannot serialise")

    with pytest.raises(RuntimeError):
        results.write_json_atomic({"a": Boom()}, target)
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


# --------------------------------------------------------------------------------------------
# machine: what the CPU and GPU could do, as every record carries it

ZEN4 = fake_cpuinfo("AMD EPYC", "avx2 avx512f avx512_bf16 avx_vnni", cpus=4, threads_per_core=2)
ZEN1 = fake_cpuinfo("AMD EPYC", "avx2")


def test_cpu_description_says_whether_bf16_is_native_from_the_flags():
    from common.runtime.machine import cpu_description

    zen4, zen1 = cpu_description(ZEN4), cpu_description(ZEN1)
    assert (zen4["model"], zen4["physical_cores"], zen4["logical_cpus"]) == ("AMD EPYC", 2, 4)
    assert zen4["bf16"] == "native" and zen4["fp16"] == "emulated"
    assert zen4["isa"]["avx512_bf16"] and not zen4["isa"]["amx_bf16"]
    assert zen1["bf16"] == "emulated" and zen1["isa"] == {flag: flag == "avx2" for flag in zen1["isa"]}
    arm = cpu_description("processor\t: 0\nFeatures\t: fp asimd fphp asimdhp bf16 sve\n")
    assert (arm["bf16"], arm["fp16"], arm["isa"]["sve"]) == ("native", "native", True)
    assert cpu_description("")["bf16"] == "unknown"  # no /proc/cpuinfo (macOS): not guessed


def test_every_new_record_carries_the_machine_and_older_versions_still_read(tmp_path, monkeypatch):
    from common.runtime import machine

    monkeypatch.setattr(machine, "read_cpuinfo", lambda path="/proc/cpuinfo": ZEN1)
    record = _record()  # a provenance without "machine": make_record adds this machine's
    assert record["schema_version"] == 4 and record["provenance"]["machine"]["cpu"]["bf16"] == "emulated"
    assert record["provenance"]["machine"]["gpus"] == []
    h100 = machine.gpu_description("NVIDIA H100 80GB HBM3", (9, 0), 80 * 2**30)
    assert (h100["peaks_from"], h100["peak_tflops"]["bf16"], h100["bf16"]) == ("H100 SXM", 989.5, "native")
    results.write_record(record, tmp_path)
    without = dict(record, provenance={"hostname": "h"}, run_id="no-machine")
    (tmp_path / "v4-without-machine.json").write_text(json.dumps(without))
    (tmp_path / "v2-without-machine.json").write_text(json.dumps(dict(without, schema_version=2, run_id="old")))
    # Version 3 said fraction_of_peak and --amp/--mixed-precision; read as version 4 says them.
    v3 = dict(record, run_id="v3", schema_version=3, config={"amp": "bf16", "epochs": 1},
              metrics={**record["metrics"], "fraction_of_peak": 0.25, "floors": {"fraction_of_peak": 0.25,
                                                                                "reasons": {"fraction_of_peak": "x"}}})
    (tmp_path / "v3.json").write_text(json.dumps(v3))
    loaded = results.load_records(tmp_path)
    assert sorted(r["run_id"] for r in loaded.records) == sorted([record["run_id"], "old", "v3"])
    assert [(p.name, "provenance.machine" in why) for p, why in loaded.errors] == [("v4-without-machine.json", True)]
    (old,) = [r for r in loaded.records if r["run_id"] == "v3"]
    assert old["config"] == {"precision": "bf16", "epochs": 1} and old["metrics"]["mfu"] == 0.25
    assert old["metrics"]["floors"] == {"mfu": 0.25, "reasons": {"mfu": "x"}}
    assert "fraction_of_peak" not in old["metrics"]


def test_a_bf16_run_on_a_cpu_without_bf16_says_so_at_start_and_in_its_record(monkeypatch, capsys):
    import torch

    from common.train import amp

    from common.runtime import machine

    cpu = torch.device("cpu")
    monkeypatch.setattr(machine, "read_cpuinfo", lambda path="/proc/cpuinfo": ZEN1.replace("EPYC", "EPYC 7551"))
    assert amp.check_precision("bf16", cpu) == "bf16"
    amp.check_precision("bf16", cpu)  # a second check of the same process says nothing new
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["note: bf16 is emulated on this CPU (AMD EPYC 7551: no avx512_bf16 or AMX): PyTorch "
                       "converts to fp32 and back, so bf16 runs slower than fp32 here; its timings say nothing "
                       "about bf16 hardware"]
    cpu_prov = {"hostname": "h", "device": {"type": "cpu", "name": "AMD EPYC 7551"}}
    bf16 = _record(config={"precision": "bf16"}, provenance=cpu_prov)
    fp32 = _record(config={"precision": "fp32"}, provenance=cpu_prov)
    assert bf16["notes"] == [printed[0].removeprefix("note: ")] and fp32["notes"] == []
    monkeypatch.setattr(machine, "read_cpuinfo", lambda path="/proc/cpuinfo": ZEN4)
    assert amp.announce_bf16_emulation("bf16", cpu) is None and capsys.readouterr().out == ""
    assert _record(config={"precision": "bf16"}, provenance=cpu_prov)["notes"] == []


@pytest.mark.gpu
def test_a_cuda_record_names_its_gpu_with_the_datasheet_peaks():
    """In a fresh process on a GPU: provenance.machine.gpus holds the GPU used, its capability and,
    for a GPU in common.precision.GPU_PEAKS, its dense peaks (an H100 SXM: bf16 989.5 TFLOP/s)."""
    code = ("import json, torch; from common.results import provenance; from common.precision import gpu_peaks; "
            "p = provenance(torch.device('cuda', 0)); g = p['machine']['gpus']; "
            "print(json.dumps([g, torch.cuda.get_device_name(0), gpu_peaks(torch.cuda.get_device_name(0))[1]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         cwd=__import__("helpers").REPO)
    gpus, name, peaks = json.loads(out.stdout)
    assert len(gpus) == 1 and gpus[0]["name"] == name and gpus[0]["peak_tflops"] == peaks
    assert gpus[0]["bf16"] == ("native" if float(gpus[0]["capability"]) >= 8.0 else "emulated")


def _git(repo, *args):
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          env=env).stdout.strip()


def test_git_revision_is_the_commit_and_says_when_the_tree_is_dirty(tmp_path):
    # A repository made here, so the expected commit is known whatever checkout the tests run from.
    _git(tmp_path, "init", "-q")
    (tmp_path / "train.py").write_text("print('v1')\n")
    _git(tmp_path, "add", "train.py")
    _git(tmp_path, "commit", "-q", "-m", "v1")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert results.git_revision(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "train.py").write_text("print('v2')\n")
    assert results.git_revision(tmp_path) == {"commit": head, "dirty": True}
    assert results.git_revision(tmp_path / "not-a-repo") == {"commit": None, "dirty": None}


def test_provenance_carries_slurm_and_git(monkeypatch, tmp_path):
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "commit", "-q", "--allow-empty", "-m", "empty")
    head = _git(tmp_path, "rev-parse", "HEAD")
    real_git_revision = results.git_revision
    monkeypatch.setattr(results, "git_revision", lambda *args, **kwargs: real_git_revision(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")
    monkeypatch.setenv("NOT_SLURM_SECRET", "x")
    prov = results.provenance(world_size=4)
    assert prov["slurm"] == {"SLURM_JOB_ID": "777", "SLURM_CPUS_PER_TASK": "4"}
    assert prov["world_size"] == 4
    assert prov["git"] == {"commit": head, "dirty": False}


def test_results_module_does_not_import_torch():
    modules = ("common.results, common.runtime.machine, common.runtime.launch, common.cli, common.runtime.cpus, "
               "common.units, common.atomic, common.errors, common.cli, common.cli, common.report, common.report.cli")
    code = f"import sys; import {modules}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(__import__('helpers').REPO)})
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------
# cli: the shared flags


def test_common_flags_and_defaults(monkeypatch):
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    parser = cli.add_common_args(argparse.ArgumentParser(prog="x"), epochs=5, batch_size=32)
    args = parser.parse_args([])
    assert (args.device, args.epochs, args.batch_size, args.num_workers) == ("auto", 5, 32, 0)
    args = cli.apply_dry_run(parser.parse_args(["--dry-run"]))
    assert (args.epochs, args.max_steps) == (1, 2)
    assert "(default: 5)" in parser.format_help()


def test_allocation_is_capped_at_usable_cpus(monkeypatch):
    # A test cluster (or a node without cgroups) may claim 64 CPUs on a 2-core machine.
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 2)
    assert cpus.allocated_cpus({"SLURM_CPUS_PER_TASK": "64"}) == 2
    assert cpus.default_num_workers({"SLURM_CPUS_PER_TASK": "64"}) == 1
    assert cpus.allocated_cpus({}) is None and cpus.default_num_workers({}) == 2


def test_processes_torchrun_starts_in_one_task_share_its_cpus_for_workers(monkeypatch):
    """A torchrun of 4 processes in a task of 64 CPUs: 15 workers each (16 cores a process), not 63 each (252 in
    all). srun's one task per process sets no LOCAL_WORLD_SIZE and each task has its own CPUs."""
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 64)
    assert cpus.default_num_workers({"SLURM_CPUS_PER_TASK": "64", "LOCAL_WORLD_SIZE": "4"}) == 15
    assert cpus.default_num_workers({"SLURM_CPUS_PER_TASK": "64"}) == 63
    assert cpus.default_num_workers({"SLURM_CPUS_PER_TASK": "2", "LOCAL_WORLD_SIZE": "4"}) == 0
    assert cpus.default_num_workers({"LOCAL_WORLD_SIZE": "4"}) == 2  # off-cluster: the laptop's default


@pytest.mark.parametrize("flag", [["--batch-size", "0"], ["--epochs", "-1"], ["--batch-size", "abc"],
                                  ["--device", "tpu"]])
def test_bad_flags_give_one_line(flag, capsys):
    parser = cli.add_common_args(argparse.ArgumentParser(prog="x"))
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(flag)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")


def test_script_parser_and_dry_run_caps_a_scripts_own_counts(capsys):
    parser = cli.add_common_args(cli.script_parser("Time the thing.\n\nUsage:\n    python x.py"))
    parser.add_argument("--iterations", type=int, default=100)
    assert parser.description == "Time the thing."
    assert cli.apply_dry_run(parser.parse_args([]), iterations=2).iterations == 100  # no --dry-run: unchanged
    args = cli.apply_dry_run(parser.parse_args(["--dry-run"]), iterations=2)
    assert (args.epochs, args.max_steps, args.iterations) == (1, 2, 2)
    assert cli.apply_dry_run(parser.parse_args(["--dry-run", "--iterations", "1"]), iterations=2).iterations == 1
    with pytest.raises(SystemExit) as exit_:
        cli.script_parser(None).parse_args(["--no-such-flag"])  # one error line, even without add_common_args
    assert exit_.value.code == 2 and capsys.readouterr().err.startswith("error: unrecognized arguments")


def test_training_flags_are_the_ones_training_run_reads(capsys):
    from common.train.flags import add_training_args

    parser = cli.script_parser(None)
    add_training_args(parser)
    args = parser.parse_args([])
    assert (args.log_interval, args.warmup_steps, args.record_steps, args.deterministic) == (10, 2, 200, False)
    assert "steps left out of the timing (default: 2)" in " ".join(parser.format_help().split())
    with pytest.raises(SystemExit):
        parser.parse_args(["--warmup-steps", "-1"])
    assert capsys.readouterr().err.startswith("error: argument --warmup-steps")


# --------------------------------------------------------------------------------------------
# device, data, models, timing (these import torch, once for the whole session)


def test_device_resolution_on_this_machine():
    import torch

    from common.runtime.device import resolve_device
    from common.errors import UserError

    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU"):
            resolve_device("cuda")


def test_threads_follow_slurm_allocation():
    import torch

    from common.runtime.device import configure_threads

    before = torch.get_num_threads()
    try:
        assert configure_threads({"SLURM_CPUS_PER_TASK": "1"}) == 1
        # torchrun (and the job header) set OMP_NUM_THREADS to share a task's cores: it wins.
        torch.set_num_threads(2)
        assert configure_threads({"SLURM_CPUS_PER_TASK": "1", "OMP_NUM_THREADS": "2"}) == 2
    finally:
        torch.set_num_threads(before)


def test_digits_split_is_fixed_stratified_and_mnist_shaped():
    import torch

    from common.data.datasets import get_dataset

    a, b = get_dataset("digits"), get_dataset("digits")
    assert a.input_shape == (1, 28, 28) and a.num_classes == 10
    assert len(a.train) + len(a.test) == 1797
    assert torch.equal(a.test.tensors[0], b.test.tensors[0])  # the held-out split never changes
    counts = torch.bincount(a.test.tensors[1], minlength=10)
    assert counts.min() >= 30  # every class is in the test split
    x = a.train.tensors[0]
    assert abs(x.mean().item()) < 1.0 and x.shape[1:] == (1, 28, 28)


def test_synthetic_is_deterministic_and_learnable_shape():
    import torch

    from common.data.datasets import SyntheticImages, get_dataset

    s1 = get_dataset("synthetic", image_size=16, channels=3, synthetic_size=64, seed=3)
    s2 = get_dataset("synthetic", image_size=16, channels=3, synthetic_size=64, seed=3)
    x1, y1 = s1.train[5]
    x2, y2 = s2.train[5]
    assert torch.equal(x1, x2) and y1 == y2 and x1.shape == (3, 16, 16)
    assert not torch.equal(s1.train[0][0], s1.test[0][0])  # train and test differ
    # The per-sample (uncached) path gives the same kind of data as the cached one.
    big = SyntheticImages(4, (3, 8, 8), seed=1)
    big._cache = None
    assert big[2][0].shape == (3, 8, 8)


def test_missing_data_names_the_download_script(tmp_path):
    from common.data.datasets import get_dataset
    from common.errors import UserError

    with pytest.raises(UserError, match="scripts/download_data.py mnist"):
        get_dataset("mnist", tmp_path)
    with pytest.raises(UserError, match="unknown dataset 'imagenet'"):
        get_dataset("imagenet", tmp_path)
    # An image folder whose class folders hold no image yet (torchvision raises FileNotFoundError): one line too.
    for name in ("cats", "dogs"):
        (tmp_path / "train" / name).mkdir(parents=True)
    with pytest.raises(UserError, match=r"^imagefolder under .*: Found no valid file for the classes cats, dogs"):
        get_dataset("imagefolder", tmp_path)
    for name in ("cats", "dogs"):
        (tmp_path / "train" / name / "a.png").write_bytes(b"")  # a file in each class: train is fine
    (tmp_path / "val").mkdir()
    with pytest.raises(UserError, match=r"Couldn't find any class folder in .*val"):
        get_dataset("imagefolder", tmp_path)


def test_an_unreadable_image_is_one_line_naming_it_even_from_a_dataloader_worker(tmp_path, capsys):
    """A file that is no image, read by a DataLoader worker: torch re-raises the worker's UserError with the
    worker's traceback in its message, and run_main still prints the one line."""
    from PIL import Image
    from torch.utils.data import DataLoader

    from common.data.datasets import get_dataset
    from common.errors import run_main

    for name in ("cats", "dogs"):
        (tmp_path / "train" / name).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "train" / name / "ok.png")
    (tmp_path / "train" / "dogs" / "zz.png").write_bytes(b"not an image")
    splits = get_dataset("imagefolder", tmp_path, image_size=8)

    def main(argv):
        for _ in DataLoader(splits.train, batch_size=3, num_workers=1):
            pass

    with pytest.raises(SystemExit) as stopped:
        run_main(main, [])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: cannot read image {tmp_path / 'train' / 'dogs' / 'zz.png'}: "), err


def test_models_by_name():
    import torch

    from common.errors import UserError
    from common.models import build_model, parameter_digest

    net = build_model("mnist_cnn", in_channels=1)
    assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    resnet = build_model("resnet18", num_classes=7)
    assert resnet.eval()(torch.zeros(1, 3, 32, 32)).shape == (1, 7)
    assert sum(p.numel() for p in net.parameters()) == 1199882  # the pytorch/examples MNIST network
    with pytest.raises(UserError, match="^unknown model 'resnet51'; did you mean resnet50 or "):
        build_model("resnet51")
    with pytest.raises(UserError, match=r"^unknown model .fancynet.; none of the \d+ valid ones is close \(mnist_cnn"):
        build_model("fancynet")  # a sample, not torchvision's 80 names on one line
    torch.manual_seed(0)
    a = build_model("mnist_cnn", in_channels=1)
    torch.manual_seed(0)
    b = build_model("mnist_cnn", in_channels=1)
    assert parameter_digest(a) == parameter_digest(b)
    with torch.no_grad():
        b.fc2.bias[0] += 1e-6
    assert parameter_digest(a) != parameter_digest(b)


def test_step_timer_drops_warmup_and_summarises(monkeypatch):
    """The timer reads the clock once before and once after each step (after synchronising): on a clock
    the test moves by hand, each step takes exactly what the test says, so what is dropped, what is
    kept and what is summed is exact on any machine, however loaded."""
    import torch

    import common.measure.timing as timing
    from common.measure.timing import StepTimer, peak_memory, summarize

    now = [100.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    timer = StepTimer(torch.device("cpu"), warmup_steps=2)
    durations = [5.0, 3.0, 0.25, 0.5, 0.125, 1.0]  # two slow warm-up steps, then the timed ones
    for step_s, waited_s in zip(durations, [0.0] * 5 + [0.5]):
        with timer.step(samples=10, waited_s=waited_s):
            now[0] += step_s
    summary = timer.summary()
    assert summary["steps_timed"] == 4 and summary["warmup_steps"] == 2
    assert timer.times == [0.25, 0.5, 0.125, 1.5]  # in order, the wait for the last batch counted in its step
    assert summary["median_s"] == 0.375 and summary["min_s"] == 0.125 and summary["max_s"] == 1.5
    assert summary["total_s"] == 2.375 and summary["samples_per_s"] == 40 / 2.375
    assert "first 2 step(s) dropped" in summary["method"] and "waiting for the batch included" in summary["method"]
    short = StepTimer(torch.device("cpu"), warmup_steps=2)  # no longer than its warm-up: nothing timed
    for _ in range(2):
        with short.step(samples=10):
            now[0] += 1.0
    assert short.summary()["steps_timed"] == 0 and short.summary()["samples_per_s"] is None
    monkeypatch.undo()
    stats = summarize([1.0, 2.0, 3.0, 4.0])
    assert stats["median_s"] == 2.5 and stats["p10_s"] == pytest.approx(1.3) and stats["min_s"] == 1.0
    mem = peak_memory(torch.device("cpu"))
    assert mem["source"] == "process_max_rss" and mem["peak_bytes"] > 10 * 2**20


def test_amp_choices():
    import torch

    from common.train import amp
    from common.errors import UserError

    cpu = torch.device("cpu")
    assert amp.check_precision("off", cpu) == "fp32"
    with pytest.raises(UserError, match="fp16 autocast needs a CUDA GPU"):
        amp.check_precision("fp16", cpu)
    with amp.autocast(cpu, "bf16"):
        out = torch.nn.Linear(4, 4)(torch.ones(1, 4))
    assert out.dtype == torch.bfloat16
    assert not amp.grad_scaler(cpu, "bf16").is_enabled()


def test_reductions_over_ranks_sum_mean_and_max_numbers_and_lists(monkeypatch):
    import torch
    import torch.distributed as dist

    from common.runtime import distributed

    # Not distributed: values come back as they were (as floats), nothing is communicated.
    assert distributed.all_reduce_sum(3) == 3.0 and distributed.all_reduce_mean([1, 2]) == [1.0, 2.0]
    assert distributed.any_rank(True) is True and distributed.any_rank(False) is False
    assert distributed.all_reduce_mean([]) == []

    # Two ranks: this one, and a peer whose values are ``peer["values"]``; all_reduce combines them as Gloo does.
    peer = {"values": [10.0, 20.0]}

    def all_reduce(tensor, op):
        assert tensor.dtype == torch.float64
        other = torch.tensor(peer["values"], dtype=torch.float64)
        tensor.copy_(torch.maximum(tensor, other) if op == dist.ReduceOp.MAX else tensor + other)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert distributed.all_reduce_sum([1, 2]) == [11.0, 22.0]
    assert distributed.all_reduce_mean([1, 2]) == [5.5, 11.0]  # element-wise over the two ranks
    peer["values"] = [4.0]
    assert distributed.all_reduce_sum(torch.tensor(2.0)) == 6.0
    assert distributed.all_reduce_mean(2) == 3.0
    peer["values"] = [1.0]
    assert distributed.any_rank(False) is True  # the peer got the signal: both stop
    peer["values"] = [0.0]
    assert distributed.any_rank(False) is False


def test_evaluate_scores_classifiers_and_token_models_and_adds_the_ranks_slices(monkeypatch):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from common.train.evaluation import evaluate

    cpu = torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(10, 4, generator=generator), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    model = torch.nn.Linear(4, 3)
    batches = [(x[:4], y[:4]), (x[4:8], y[4:8]), (x[8:], y[8:])]
    with torch.no_grad():
        logits = model(x)
    loss, accuracy = evaluate(model.train(), batches, cpu)
    assert not model.training
    assert loss == pytest.approx(F.cross_entropy(logits, y).item())
    assert accuracy == pytest.approx((logits.argmax(1) == y).double().mean().item())
    # Log-probabilities (MnistNet) with nll_loss: the same numbers; --max-steps: the first batches only.
    log_probabilities = torch.nn.Sequential(model, torch.nn.LogSoftmax(dim=1))
    assert evaluate(log_probabilities, batches, cpu, loss=F.nll_loss) == pytest.approx((loss, accuracy))
    assert evaluate(model, batches, cpu, max_batches=1)[0] == pytest.approx(F.cross_entropy(logits[:4], y[:4]).item())
    assert evaluate(model, batches, cpu, precision="bf16")[0] == pytest.approx(loss, rel=0.05)  # forward in bf16

    # A token model's (batch, time, vocabulary) outputs: one prediction per target token.
    tokens, targets = torch.randn(2, 5, 4, generator=generator), torch.randint(0, 3, (2, 5), generator=generator)
    with torch.no_grad():
        scores = model(tokens)
    token_loss, token_accuracy = evaluate(model, [(tokens, targets)], cpu)
    assert token_loss == pytest.approx(F.cross_entropy(scores.flatten(0, 1), targets.flatten()).item())
    assert token_accuracy == pytest.approx((scores.argmax(-1) == targets).double().mean().item())

    # Two ranks, each with its slice: this one has the first 8 samples, its peer the last 2.
    peer = [F.cross_entropy(logits[8:], y[8:], reduction="sum").item(), (logits[8:].argmax(1) == y[8:]).sum().item(), 2]

    def all_reduce(tensor, op):
        tensor += torch.tensor(peer, dtype=tensor.dtype)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert evaluate(model, batches[:2], cpu, across_ranks=True) == pytest.approx((loss, accuracy))  # the whole set's
    assert evaluate(model, batches[:2], cpu)[0] == pytest.approx(F.cross_entropy(logits[:8], y[:8]).item())


def test_checkpoint_is_atomic_and_stop_signal_sets_flag(tmp_path):
    import signal

    import torch

    from common.checkpoint.single_file import load_checkpoint, save_checkpoint
    from common.train.preemption import StopSignal

    path = save_checkpoint({"w": torch.arange(3)}, tmp_path / "c.pt")
    assert torch.equal(load_checkpoint(path)["w"], torch.arange(3))
    assert load_checkpoint(tmp_path / "none.pt") is None

    class DiesMidWrite:
        """Fails while the new checkpoint is being written, as a job killed at its time limit does."""

        def __reduce__(self):
            raise KeyboardInterrupt("killed while writing")

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"w": torch.zeros(100_000), "then": DiesMidWrite()}, path)
    assert torch.equal(load_checkpoint(path)["w"], torch.arange(3))  # the old checkpoint, whole
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # and no temporary file left behind
    stop = StopSignal().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.name == "SIGUSR1"
    finally:
        stop.restore()


def test_a_resume_with_other_settings_names_each_by_its_flag_or_in_words():
    """The refusal names what the user changes: a flag as typed (--batch-size), what no flag sets in words."""
    from common.checkpoint.single_file import check_same_settings
    from common.errors import UserError

    saved = {"config": {"batch_size": 8, "world_size": 2, "seed": 0}}
    check_same_settings(saved, {"batch_size": 8, "world_size": 2, "lr": 0.1}, "c.pt")  # a key not saved is not compared
    with pytest.raises(UserError) as refused:
        check_same_settings(saved, {"batch_size": 16, "world_size": 4, "seed": 0}, "c.pt")
    assert str(refused.value) == ("c.pt was written with other settings (--batch-size 8 there, 16 here; the number "
                                  "of ranks 2 there, 4 here); resume with the same settings or start fresh without "
                                  "--resume")


def test_the_atomic_writer_replaces_whole_and_makes_scripts_executable(tmp_path):
    from common.atomic import atomic_path, write_text_atomic

    script = tmp_path / "job.sbatch"
    old = os.umask(0o022)
    try:
        write_text_atomic("#!/bin/bash\necho one\n", script, executable=True)
        assert script.stat().st_mode & 0o777 == 0o755
        with pytest.raises(OSError), atomic_path(script) as tmp:
            tmp.write_text("#!/bin/bash\necho half")
            raise OSError("disk full")
    finally:
        os.umask(old)
    assert script.read_text() == "#!/bin/bash\necho one\n" and [p.name for p in tmp_path.iterdir()] == ["job.sbatch"]


def test_records_are_readable_by_the_group(tmp_path):
    # mkstemp alone makes owner-only files; shared course results must follow the umask.
    old = os.umask(0o022)
    try:
        path = results.write_record(_record(), tmp_path)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_print_rank_writes_each_line_in_one_piece(monkeypatch):
    """The ranks of a job share one output file: a line written in pieces (tag, space, text,
    newline, as print does) interleaves with the other ranks' lines mid-line."""
    from common.runtime.distributed import print_rank

    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch.socket, "gethostname", lambda: "n2.cluster")

    class Pieces:
        def __init__(self):
            self.writes, self.flushes = [], 0

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            self.flushes += 1

    out = Pieces()
    print_rank("device cpu", "(1 threads)", file=out)
    assert out.writes == ["[n2:3] device cpu (1 threads)\n"] and out.flushes == 1


# --- a checkpoint that cannot be read ---------------------------------------------------------------

def _broken_single_file(form: str, path) -> None:
    import torch

    if form == "truncated":
        torch.save({"model": {"w": torch.zeros(1000)}, "step": 3}, path)
        path.write_bytes(path.read_bytes()[:300])
    elif form == "not_a_checkpoint":
        path.write_text("these are notes, not a checkpoint\n")
    else:  # a pickle of something else
        torch.save([1, 2, 3], path)


def _broken_dcp_folder(form: str, folder) -> None:
    checkpoint = folder / "ckpt-000001-epoch1"  # what DistributedCheckpointer.save names a folder
    checkpoint.mkdir(parents=True)
    (checkpoint / ".metadata").write_bytes(b"" if form == "empty" else b"\x80\x04 broken metadata")
    if form == "shards_only":
        (checkpoint / "__0_0.distcp").write_bytes(b"\0" * 64)


SINGLE = "chapters/ch04_deep_learning/mnist_training.py"
SINGLE_ARGS = ["--device", "cpu", "--epochs", "1", "--max-steps", "2", "--batch-size", "8", "--resume"]
SHARDED = "labs/lab04_sharded_training/02_sharded_training.py"
SHARDED_ARGS = ["--device", "cpu", "--layers", "1", "--width", "16", "--heads", "2", "--context", "8",
                "--global-batch-size", "4", "--batch-size", "4", "--max-steps", "2", "--resume"]


@pytest.mark.parametrize("form", ["truncated", "not_a_checkpoint", "another_pickle"])
def test_an_unreadable_single_file_checkpoint_is_one_line_naming_it_before_training(form, tmp_path, capsys):
    from helpers import run_main

    checkpoint = tmp_path / "run.pt"
    _broken_single_file(form, checkpoint)
    status = run_main(SINGLE, [*SINGLE_ARGS, "--checkpoint", str(checkpoint), "--results-dir", str(tmp_path / "r")])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert status == 2 and len(err) == 1, captured.err[-2000:]
    assert str(checkpoint) in err[0] and "cannot be read as a checkpoint" in err[0] and "without --resume" in err[0]
    assert not (tmp_path / "r").exists()


def test_a_distributed_checkpoint_round_trips_in_one_process_without_warnings(tmp_path):
    """One process and no process group (Lab-07's one-process reference, ``--mesh 1x1``): DCP is told so,
    instead of guessing it and printing a UserWarning at every save and load."""
    import warnings

    import torch

    from common.checkpoint.sharded import DistributedCheckpointer

    def tracked(seed: int) -> dict:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        return {"model": model, "optimizer": optimizer}

    saved, fresh = tracked(1), tracked(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DistributedCheckpointer(tmp_path).save({"epoch": 1, "step": 3}, saved)
        reader = DistributedCheckpointer(tmp_path)
        state = reader.read()
        reader.restore(fresh)
    assert (state["epoch"], state["step"]) == (1, 3)
    assert torch.equal(fresh["model"].weight, saved["model"].weight)
    moments = [tracked["optimizer"].state_dict()["state"][0]["exp_avg"] for tracked in (fresh, saved)]
    assert moments[0].equal(moments[1])
    assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize("form", ["empty", "garbage", "shards_only"])
def test_a_distributed_checkpoint_with_broken_metadata_is_one_line_naming_the_folder(form, tmp_path, capsys):
    from helpers import run_main

    _broken_dcp_folder(form, tmp_path / "ckpt")
    status = run_main(SHARDED, [*SHARDED_ARGS, "--checkpoint-dir", str(tmp_path / "ckpt"),
                                "--results-dir", str(tmp_path / "r")])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert status == 2 and len(err) == 1, captured.err[-2000:]
    assert "ckpt-000001-epoch1" in err[0] and "cannot be read as a checkpoint" in err[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("script", [SINGLE, SHARDED])
def test_an_unreadable_checkpoint_ends_a_real_process_with_status_2_and_no_traceback(script, tmp_path):
    from helpers import run_script

    if script == SINGLE:
        _broken_single_file("truncated", tmp_path / "run.pt")
        argv = [*SINGLE_ARGS, "--checkpoint", str(tmp_path / "run.pt")]
    else:
        _broken_dcp_folder("garbage", tmp_path / "ckpt")
        argv = [*SHARDED_ARGS, "--checkpoint-dir", str(tmp_path / "ckpt")]
    done = run_script(script, *argv, "--results-dir", str(tmp_path / "r"), timeout=120)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and "cannot be read as a checkpoint" in err[0], done.stderr[-3000:]
    assert not (tmp_path / "r").exists()


def test_the_stop_flag_is_agreed_only_where_a_handler_is_armed_and_on_the_cpus(tmp_path, monkeypatch):
    """No checkpoint, no handler: no collective at all. Armed: one all-reduce of a CPU tensor per
    check, over the world on a Gloo run and over a Gloo group beside NCCL's on a GPU run, so the
    check never waits for the GPU's queued work."""
    import signal

    import torch.distributed as dist

    from common.runtime.distributed import open_process, teardown_distributed
    from common.train.preemption import Preempted, Preemption, TorchCheckpointer

    ctx = open_process("cpu", distributed=True)
    try:
        calls = []
        real = dist.all_reduce

        def spy(tensor, *args, **kwargs):
            calls.append((tensor.device.type, kwargs.get("group")))
            return real(tensor, *args, **kwargs)

        monkeypatch.setattr(dist, "all_reduce", spy)
        with Preemption(None, resume=False) as unarmed:
            for step in range(3):
                unarmed.check(step, across_ranks=True)
        assert calls == []
        with Preemption(TorchCheckpointer(tmp_path / "ck.pt"), resume=False) as armed:
            armed.check(0, across_ranks=True)
            assert calls == [("cpu", None)]
            with monkeypatch.context() as nccl:  # the world group is NCCL's on a GPU run
                nccl.setattr(dist, "get_backend", lambda group=None: "nccl")
                armed.check(1, across_ranks=True)
                armed.check(2, across_ranks=True)
            assert [device for device, _ in calls] == ["cpu"] * 3
            assert calls[1][1] is not None and calls[1][1] is calls[2][1]  # one Gloo group, made once
            armed.signal.requested = signal.SIGUSR1
            with pytest.raises(Preempted):
                armed.check(3, across_ranks=True)
    finally:
        teardown_distributed(ctx)


def test_the_flight_recorder_is_turned_on_under_its_current_name_and_a_user_setting_wins():
    from common.runtime.compat import enable_flight_recorder

    env = {"TORCH_FR_BUFFER_SIZE": "2000"}
    enable_flight_recorder(64, env=env, dump_prefix="/run/ledger/nccl-watchdog-rank")
    assert env == {"TORCH_FR_BUFFER_SIZE": "2000",
                   "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": "/run/ledger/nccl-watchdog-rank",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/run/ledger/nccl-watchdog-rank"}
    old_name = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}  # exported under the old name: still the user's size
    enable_flight_recorder(64, env=old_name)
    assert old_name == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}
    quiet = {}
    enable_flight_recorder(8, env=quiet)
    assert quiet == {"TORCH_FR_BUFFER_SIZE": "8"}  # not the old name too: torch 2.15 warned about it on every rank


RANK0_ONLY_SAVE = """import sys
from chapters.ch04_deep_learning import mnist_training
from common.errors import run_main
from common.train.run import TrainingRun


def main(argv):
    args = mnist_training.build_parser().parse_args(argv)
    with TrainingRun(args, lab="ch04", script="rank0_save.py", method="fp32", distributed=True) as run:
        if run.is_main:  # the way students write it: save_checkpoint() is a collective
            run.save_checkpoint()
    return 0


run_main(main, sys.argv[1:])
"""


def test_a_collective_called_on_rank_0_alone_ends_in_one_line_naming_the_missing_rank(tmp_path):
    """save_checkpoint() under `if run.is_main:` on 2 ranks: the job ends within the collective timeout
    (5 s here) plus start-up, with one error line that says the call is collective and names rank 1."""
    import time

    from helpers import torchrun

    (tmp_path / "rank0_save.py").write_text(RANK0_ONLY_SAVE)
    began = time.monotonic()
    result = subprocess.run([*torchrun(2), str(tmp_path / "rank0_save.py"), "--device", "cpu", "--epochs", "1",
                             "--checkpoint", str(tmp_path / "ck.pt"), "--results-dir", str(tmp_path / "r")],
                            cwd=tmp_path, env=script_env(HPC_DL_LABS_DIST_TIMEOUT="5"), capture_output=True,
                            text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and time.monotonic() - began < 120, output[-3000:]
    errors = [line for line in output.splitlines() if "error: save_checkpoint() is collective" in line]
    assert len(errors) == 1 and "1" in errors[0].split(":", 2)[-1], output[-3000:]
    assert not (tmp_path / "ck.pt").exists()


def test_a_folder_typed_without_its_flag_is_one_line_naming_the_flag(tmp_path, capsys):
    """``compare_results.py results/lab01`` (the folder without --results-dir): argparse's "unrecognized
    arguments", and the flag that takes it; a word that is no folder gets no such hint."""
    from common.errors import run_main as run
    from common.report.cli import main as report

    for word, hint in ((str(tmp_path), f"; a folder is given as --results-dir {tmp_path} "), ("nosuch", " ")):
        with pytest.raises(SystemExit) as stop:
            run(report, [word])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: unrecognized arguments: {word}{hint}(see "), err


@pytest.mark.parametrize(("env", "said"), [({"RANK": "0"}, True), ({"RANK": "1"}, False),
                                           ({"SLURM_PROCID": "3"}, False)])
def test_a_bad_flag_under_a_launcher_is_said_by_rank_0_alone(env, said, capsys, monkeypatch):
    """Every rank of torchrun or srun reads the same flags: N copies of one line were N lines of noise."""
    for name in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from helpers import run_main

    assert run_main("chapters/ch04_deep_learning/mnist_training.py", ["--bogus"]) == 2
    err = capsys.readouterr().err
    assert (err.startswith("error: unrecognized arguments: --bogus (see ") and err.count("\n") == 1) if said else \
        err == "", err


@pytest.mark.parametrize(("script", "former", "current"), [
    ("chapters/ch04_deep_learning/mnist_training.py", ["--amp", "bf16"], ("precision", "bf16")),
    ("labs/lab04_sharded_training/02_sharded_training.py", ["--mixed-precision", "bf16"], ("precision", "bf16")),
    ("chapters/ch04_deep_learning/pytorch_basics.py", ["--dtypes", "fp32,bf16"], ("precision", ["fp32", "bf16"])),
    ("labs/lab05_scaling/01_allreduce_bench.py", ["--iters", "3"], ("repeats", 3)),
    ("chapters/ch16_gpu_distributed/profiling.py", ["--iterations", "4"], ("repeats", 4)),
    ("labs/lab03_precision_benchmark/benchmark_models.py", ["--num-iters", "5"], ("repeats", 5)),
    ("labs/lab02_profiling/sweep.py", ["--steps", "baseline"], ("stages", "baseline")),
])
def test_a_flag_s_former_name_still_works_and_says_the_new_one_once(script, former, current, capsys):
    from helpers import load_script

    args = load_script(script).build_parser().parse_args(former)
    assert getattr(args, current[0]) == current[1]
    new = max((a for a in load_script(script).build_parser()._actions if a.dest == current[0]),
              key=lambda a: a.help != argparse.SUPPRESS).option_strings
    assert capsys.readouterr().err == f"note: {former[0]} is now {max(new, key=len)}; the old name still works\n"
    assert former[0] not in load_script(script).build_parser().format_help()  # hidden from --help


def test_every_count_a_script_caps_under_dry_run_is_one_of_its_flags():
    """``apply_dry_run(args, repeats=2)`` caps a flag's value: a name that is no flag of the script (a count
    renamed since, ``iterations`` for ``--repeats``) makes ``--dry-run`` end in an AttributeError."""
    import ast

    from helpers import REPO, load_script

    checked = 0
    for path in sorted([*(REPO / "chapters").glob("*/*.py"), *(REPO / "labs").glob("*/*.py")]):
        caps = {keyword.arg for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "apply_dry_run"
                for keyword in node.keywords}
        if not caps:
            continue
        script = str(path.relative_to(REPO))
        # A shared module caps for its scripts (Lab-05's read_overlap_args, Chapter 16's parse_memory_args): the
        # flags of the folder's scripts, all together.
        scripts = [load_script(script)] if not path.name.endswith("_shared.py") else [
            load_script(str(other.relative_to(REPO))) for other in sorted(path.parent.glob("*.py"))
            if not other.name.endswith("_shared.py")]
        flags = {action.dest for module in scripts if hasattr(module, "build_parser")
                 for action in module.build_parser()._actions}
        assert caps <= flags, (script, sorted(caps - flags))
        checked += 1
    assert checked >= 5


def test_running_out_of_memory_is_one_line_and_exit_1_and_a_bug_keeps_its_traceback(capsys):
    """A real allocation the CPU's allocator refuses (4 PiB: past any machine's address space), and CUDA's
    torch.OutOfMemoryError as its allocator words it: one ``error: out of memory`` line each, exit 1."""
    import torch

    from common.errors import run_main

    def allocate(argv):
        torch.empty(1 << 50)  # floats

    def cuda_refuses(argv):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity "
                                     "of 79.19 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this "
                                     "process has 78.16 GiB memory in use.\nOf the allocated memory ...")

    def bug(argv):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)")

    expected = {allocate: "error: out of memory: the CPU's allocator could not allocate 4096.0 TiB",
                cuda_refuses: "error: out of memory: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a "
                              "total capacity of 79.19 GiB of which 1.02 GiB is free; a smaller --batch-size"}
    for main, line in expected.items():
        with pytest.raises(SystemExit) as stopped:
            run_main(main, [])
        err = capsys.readouterr().err
        assert stopped.value.code == 1 and err.count("\n") == 1 and err.startswith(line), err
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        run_main(bug, [])


def test_one_sample_per_rank_into_batchnorm_is_one_line_and_another_value_error_keeps_its_traceback(capsys):
    """A ResNet trained with --batch-size 1 on small images: BatchNorm's ValueError ended the run in a traceback."""
    import torch

    from common.errors import run_main

    def one_sample(argv):
        torch.nn.BatchNorm2d(4).train()(torch.zeros(1, 4, 1, 1))

    def bug(argv):
        raise ValueError("Expected more than 1 value per channel")  # not BatchNorm's words in full

    with pytest.raises(SystemExit) as stopped:
        run_main(one_sample, [])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: BatchNorm cannot train on one value per channel (a layer got [1, 4, 1, 1]: one "
                          "sample whose feature map is 1x1); use a --batch-size of 2 or more per rank"), err
    with pytest.raises(ValueError, match="per channel"):
        run_main(bug, [])


def test_a_stopped_run_says_how_to_go_on_where_it_ran(monkeypatch):
    """SIGUSR1 in a job: the template requeues it, unless what started the training says otherwise
    (HPC_DL_LABS_ON_STOP: a chain's next link, a sweep task's resubmission; HPC_DL_LABS_ON_SIGTERM where
    SIGTERM ends a chain instead, HPC_DL_LABS_ON_SIGUSR1 where a time limit is too short to requeue). Another
    signal in a job (scancel, a time limit): a requeued job finds its checkpoint, a new one (a new id) needs it
    given. Outside a job, or a step budget: --resume."""
    from common.checkpoint.sharded import DistributedCheckpointer
    from common.train.preemption import Preemption

    stopped = Preemption(None, resume=False, budget=3)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert stopped.what_next("c.pt") == "to go on from there: the same command with --resume --checkpoint c.pt"
    assert stopped.what_next("ckpt", DistributedCheckpointer.flag) == (  # Lab-04's folder of shards
        "to go on from there: the same command with --resume --checkpoint-dir ckpt")
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    assert stopped.what_next("c.pt").startswith("to go on from there")  # a step budget, not a signal
    stopped.signal.requested = signal.SIGUSR1
    assert stopped.what_next("c.pt") == "exiting so the job can requeue itself and resume from it"
    monkeypatch.setenv("HPC_DL_LABS_ON_STOP", "the next link of the chain resumes from it")  # the batch script knows
    monkeypatch.setenv("HPC_DL_LABS_ON_SIGTERM", "the chain stops here")  # ... and that scancel ends the chain
    assert stopped.what_next("c.pt") == "the next link of the chain resumes from it"
    stopped.signal.requested = signal.SIGTERM
    assert stopped.what_next("c.pt") == "the chain stops here"
    stopped.signal.requested = None  # the step budget: the next link resumes
    assert stopped.what_next("c.pt") == "the next link of the chain resumes from it"
    monkeypatch.delenv("HPC_DL_LABS_ON_STOP")
    monkeypatch.delenv("HPC_DL_LABS_ON_SIGTERM")
    stopped.signal.requested = signal.SIGTERM
    assert stopped.what_next("c.pt").endswith("to go on in a new job: CHECKPOINT=c.pt sbatch <the same script>")
    monkeypatch.delenv("SLURM_JOB_ID")
    assert stopped.what_next("c.pt").startswith("to go on from there")


def test_a_heartbeat_speaks_only_when_its_interval_has_passed(capsys):
    """A quick loop stays quiet (a run of seconds needs no progress line); a slow one gets a line per interval."""
    from common.measure.timing import Heartbeat

    quiet, every = Heartbeat("steps", 3), Heartbeat("steps", 3, every_s=0.0)
    for done in (1, 2, 3):
        quiet(done)
        every(done)
    assert re.findall(r"^  steps: (\d) of 3 \(\d+ s\)$", capsys.readouterr().out, re.M) == ["1", "2", "3"]


def test_a_path_longer_than_the_file_system_allows_is_one_line(tmp_path, capsys):
    """--results-dir (or -o, --lab ...) of 300 characters ended in OSError's traceback, exit 1."""
    from helpers import run_main

    long = tmp_path / ("a" * 300)
    assert run_main("chapters/ch04_deep_learning/mnist_training.py", ["--dry-run", "--results-dir", str(long)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: File name too long: ") and err.endswith(f"... ({len(str(long))} characters)\n"), err
    assert list(tmp_path.iterdir()) == []


def test_the_data_folder_is_data_dir_when_set_as_for_the_download_script_and_the_jobs(tmp_path, monkeypatch):
    """`export DATA_DIR=/scratch/...` (the READMEs' one setting) moved the downloads and the jobs, not a script run
    by hand, which still read data/: mnist "not found" right after it was downloaded."""
    from pathlib import Path

    from common.cli import add_common_args
    from helpers import load_script

    monkeypatch.delenv("DATA_DIR", raising=False)
    assert add_common_args(argparse.ArgumentParser()).parse_args([]).data_dir == Path("data")
    monkeypatch.setenv("DATA_DIR", str(tmp_path))
    assert add_common_args(argparse.ArgumentParser()).parse_args([]).data_dir == tmp_path
    downloads = load_script("scripts/download_data.py")
    assert downloads.build_parser().parse_args(["mnist"]).data_dir == tmp_path  # the same folder
