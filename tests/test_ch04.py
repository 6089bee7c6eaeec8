"""Chapter 4 acceptance: real training runs on CPU (digits, bundled offline), DDP, AMP, bad input."""

from __future__ import annotations

import json
import re
import sys

import pytest

from helpers import (REPO, code_diff, load_script, preempt_and_resume, run_main, run_script, torchrun,
                     write_tiny_mnist)

TRAIN = "chapters/ch04_deep_learning/mnist_training.py"
DDP = "chapters/ch04_deep_learning/multi_gpu_ddp.py"
AMP = "chapters/ch04_deep_learning/amp_training.py"


def _records(folder):
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def _accuracy_printed(out: str) -> float:
    return float(re.search(r"final: accuracy ([\d.]+)%", out).group(1)) / 100


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    """One real fp32 training run on digits, shared by the tests that read its output."""
    import contextlib
    import io

    results = tmp_path_factory.mktemp("fp32")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = run_main(TRAIN, ["--device", "cpu", "--dataset", "digits", "--epochs", "4",
                                  "--results-dir", str(results), "--log-interval", "1000"])
    return status, out.getvalue(), results


def test_digits_reaches_95_percent_and_record_holds_printed_accuracy(fp32_run):
    status, out, results = fp32_run
    assert status == 0
    printed = _accuracy_printed(out)
    assert printed >= 0.95, out
    (record,) = _records(results)
    assert record["metrics"]["test_accuracy"] == pytest.approx(printed, abs=5e-5)
    assert record["method"] == "fp32" and record["lab"] == "ch04"
    losses = record["metrics"]["train_loss"]
    assert len(losses) == 4 and losses[-1] < losses[0] / 2  # the loss falls
    assert record["config"]["batch_size"] == 64 and record["config"]["resolved_device"] == "cpu"
    assert record["metrics"]["samples_per_s"] > 0 and record["metrics"]["step_time"]["warmup_steps"] == 2
    assert record["provenance"]["versions"]["torch"]


def test_same_seed_gives_same_final_loss(tmp_path, capsys):
    finals = []
    for run in range(2):
        argv = ["--device", "cpu", "--epochs", "1", "--max-steps", "6", "--seed", "7",
                "--results-dir", str(tmp_path / str(run))]
        assert run_main(TRAIN, argv) == 0
        (record,) = _records(tmp_path / str(run))
        finals.append(record["metrics"]["final_loss"])
    assert finals[0] == finals[1]
    argv = ["--device", "cpu", "--epochs", "1", "--max-steps", "6", "--seed", "8", "--results-dir", str(tmp_path / "2")]
    assert run_main(TRAIN, argv) == 0
    assert _records(tmp_path / "2")[0]["metrics"]["final_loss"] != finals[0]


def test_a_fresh_run_onto_an_existing_checkpoint_says_it_replaces_it(tmp_path, capsys):
    """The pre-emption demo's first command run again, --resume forgotten: it starts over and its first save
    replaces the checkpoint of the run that was stopped. It says so at the start, while Ctrl-C still keeps it."""
    argv = ["--device", "cpu", "--epochs", "1", "--max-steps", "1", "--log-interval", "1000",
            "--checkpoint", str(tmp_path / "mnist.pt"), "--results-dir", str(tmp_path)]
    assert run_main(TRAIN, argv) == 0
    assert "starting fresh" not in capsys.readouterr().out  # nothing there yet: nothing to say
    assert run_main(TRAIN, argv) == 0
    out = capsys.readouterr().out
    assert f"starting fresh (no --resume): {tmp_path / 'mnist.pt'} holds an earlier run" in out, out
    assert run_main(TRAIN, [*argv, "--resume"]) == 0
    assert "starting fresh" not in capsys.readouterr().out  # --resume: it goes on from it (here: nothing left)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_preempted_single_device_run_resumes_to_the_same_weights(device, tmp_path, monkeypatch, capsys):
    """A real SIGUSR1 (what ``#SBATCH --signal=B:USR1@120`` sends) mid-epoch, then ``--resume``:
    the same weights, losses and accuracy as a run that was never stopped (MnistNet has dropout, so
    the random generators must come back too). On a GPU that needs ``--deterministic``."""
    import torch

    argv = ["--device", device, "--epochs", "2", "--max-steps", "5", "--batch-size", "32", "--log-interval", "1000"]
    argv += ["--deterministic"] if device == "cuda" else []
    run, whole = preempt_and_resume(TRAIN, argv, tmp_path, monkeypatch, capsys, during_step=6,
                                    stopped_at="epoch 2 step 2")  # 5 steps per epoch
    (whole_record,), (resumed_record,) = _records(tmp_path / "whole"), _records(tmp_path / "cut")
    for key in ("train_loss", "test_loss", "test_accuracy"):
        assert resumed_record["metrics"][key] == whole_record["metrics"][key], key
    # Resumed inside epoch 2, the last: no epoch ran whole in this process, so there is no time per epoch to give.
    assert resumed_record["metrics"]["time_per_epoch_s"] is None and whole_record["metrics"]["time_per_epoch_s"] > 0

    # Resuming with other settings would train something else: refused, one line, nothing written.
    assert run("cut", "--resume", "--batch-size", "16") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--batch-size 32 there, 16 here" in err[0], err
    assert run_main(TRAIN, [*argv, "--resume", "--results-dir", str(tmp_path / "none")]) == 2
    assert "--resume needs --checkpoint" in capsys.readouterr().err
    torch.save({"model": whole["model"], "epoch": 2}, tmp_path / "old.pt")  # another version's checkpoint
    assert run_main(TRAIN, [*argv, "--resume", "--checkpoint", str(tmp_path / "old.pt"),
                            "--results-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "old.pt lacks optimizer, scheduler, scaler, rng, step" in err[0], err
    assert not (tmp_path / "none").exists()

    # The same command again (a requeued job that had finished): nothing to train, exit 0, no second record.
    assert run("cut", "--resume") == 0
    out = capsys.readouterr().out
    assert "nothing left to train" in out and "resumed from" not in out  # it trained nothing: no "resumed" line
    assert len(_records(tmp_path / "cut")) == 1
    # Asked for fewer epochs than the checkpoint holds: one line, nothing written.
    assert run("cut", "--resume", "--epochs", "1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has trained 2 epochs, more than --epochs 1" in err[0], err
    # A finished run whose job ended before its record: resuming writes that record, saying why it has no throughput.
    for path in (tmp_path / "cut").glob("*.json"):
        path.unlink()
    assert run("cut", "--resume") == 0
    (written,) = _records(tmp_path / "cut")
    assert written["metrics"]["test_accuracy"] == whole_record["metrics"]["test_accuracy"]
    assert written["metrics"]["samples_per_s"] is None
    assert any("finished run that had left no record" in note for note in written["notes"]), written["notes"]


def test_bf16_autocast_on_cpu_follows_the_fp32_run_step_by_step(fp32_run, tmp_path):
    """Same seed, same batches: bf16 autocast's first losses stay within bf16's rounding of fp32's.

    Only the first steps: on a CPU without bf16 instructions (the course's CI machine) every bf16 step
    is emulated and takes about a second, and later steps drift apart as rounding differences grow
    (the accuracy after whole epochs is in the chapter's reference table)."""
    steps = 6
    _, _, fp32_results = fp32_run
    (fp32_record,) = _records(fp32_results)
    assert run_main(TRAIN, ["--device", "cpu", "--dataset", "digits", "--epochs", "1", "--max-steps", str(steps),
                            "--precision", "bf16", "--results-dir", str(tmp_path), "--log-interval", "1000"]) == 0
    (record,) = _records(tmp_path)
    assert record["method"] == "bf16" and record["config"]["precision"] == "bf16"
    bf16_losses, fp32_losses = record["metrics"]["loss_at_step"], fp32_record["metrics"]["loss_at_step"][:steps]
    assert len(bf16_losses) == steps and bf16_losses != fp32_losses  # bf16 really ran: not the same bits
    assert bf16_losses == pytest.approx(fp32_losses, rel=0.05), (bf16_losses, fp32_losses)


def test_ddp_two_gloo_processes_agree_and_only_rank0_writes(tmp_path):
    from common.cli import WORKERS_PER_CPU
    from common.runtime.cpus import usable_cpus

    results, ckpt = tmp_path / "results", tmp_path / "ckpt"
    # More DataLoader workers than this machine's cores (the most --num-workers takes), for a data set kept whole in
    # memory: no loader, no workers.
    many = str(WORKERS_PER_CPU * usable_cpus())
    proc = run_script(DDP, "--device", "cpu", "--epochs", "1", "--max-steps", "8", "--results-dir", str(results),
                      "--checkpoint", str(ckpt / "ddp.pt"), "--num-workers", many, launcher=torchrun(2), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "batches: whole data set in cpu memory" in proc.stdout and "WARNING placement" not in proc.stdout
    assert "DDP: 2 process(es), backend gloo, launcher torchrun" in proc.stdout
    assert proc.stdout.count("record: ") == 1  # rank 0 speaks
    assert "parameters identical on all 2 rank(s): yes" in proc.stdout
    (record,) = _records(results)
    digests = record["metrics"]["replica_digests"]
    assert len(digests) == 2 and digests[0]["parameters"] == digests[1]["parameters"]
    assert record["metrics"]["world_size"] == 2 and record["metrics"]["global_batch_size"] == 128
    assert record["provenance"]["distributed"]["backend"] == "gloo"
    assert [p.name for p in ckpt.iterdir()] == ["ddp.pt"]  # one checkpoint, no temp file left
    # Every rank's own random generators are saved (restored per rank on resume), and they differ:
    # after the wrap each rank is reseeded with its rank, so dropout masks are not the same everywhere.
    import torch

    rng = torch.load(ckpt / "ddp.pt", weights_only=False)["rng"]
    assert len(rng) == 2 and not torch.equal(rng[0]["torch"], rng[1]["torch"])
    # Every distributed run records where each rank ran, and the energy of its training steps
    # (here every source says why it cannot be read: no GPU, no RAPL files, no Slurm job).
    assert [(p["rank"], p["num_workers"]) for p in record["provenance"]["placement"]] == [(0, 0), (1, 0)]
    energy = record["energy"]
    assert energy["samples"] == 8 * 128 and energy["seconds"] > 0
    assert energy["status"] == "ok" or (energy["joules"] is None and set(energy["sources"]) >= {"nvml", "rapl"})


def test_ddp_single_process_without_launcher(tmp_path, capsys):
    assert run_main(DDP, ["--device", "cpu", "--dry-run", "--results-dir", str(tmp_path),
                          "--checkpoint", str(tmp_path / "c.pt")]) == 0
    assert "DDP: 1 process(es), backend gloo, launcher single" in capsys.readouterr().out


def test_ddp_script_is_the_single_device_script_plus_the_ddp_lines():
    """A student diffs mnist_training.py against multi_gpu_ddp.py: the diff must be the lesson."""
    diff = code_diff(TRAIN, DDP)
    assert len(diff) <= 46, "\n".join(diff)
    added = "\n".join(line for line in diff if line.startswith("+"))
    for lesson in ("DistributedDataParallel as DDP", "model = DDP(model", "distributed=True",
                   "across_ranks=True", "seed_everything(args.seed + run.rank)", "sampler = DistributedSampler(",
                   "if run.is_main:"):
        assert lesson in added, lesson
    # The training step itself is the same code in both (DDP hides its all-reduce in backward()).
    assert not [line for line in diff if "optimizer.step" in line or "loss = " in line]


# --------------------------------------------------------------------------------------------
# Bad input: one clear line, non-zero exit, no traceback, nothing written


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda"], "no CUDA GPU"),
    (["--batch-size", "0"], "must be at least 1"),
    (["--clip-grad-norm", "-1"], "--clip-grad-norm: must be a number >= 0, got -1"),  # a negative norm trains backwards
    (["--model", "resnet51"], "unknown model 'resnet51'"),
    (["--dataset", "imagenet"], "invalid choice: 'imagenet'"),
    (["--dataset", "mnist", "--data-dir", "/nonexistent/data"], "mnist not found under /nonexistent/data"),
    (["--dataset", "synthetic", "--data-on-device", "yes", "--device", "cpu"],
     "--data-on-device yes needs a data set held in memory as tensors"),
])
def test_bad_input_one_line_and_nothing_written(argv, message, tmp_path, capsys):
    import torch

    if argv[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    status = run_main(TRAIN, [*argv, "--results-dir", str(tmp_path / "results")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "results").exists()


def test_tensorboard_without_its_package_is_one_line_before_the_run(tmp_path, capsys, monkeypatch):
    """The GPU image lacks the tensorboard package: --tensorboard ended in torch.utils.tensorboard's ImportError
    traceback after the process had started (a process group open under torchrun)."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed: importlib finds no module
    status = run_main(TRAIN, ["--device", "cpu", "--dataset", "digits", "--dry-run", "--tensorboard",
                              str(tmp_path / "curves"), "--results-dir", str(tmp_path / "results")])
    err = capsys.readouterr().err
    assert status == 2 and err == ("error: --tensorboard needs the tensorboard package, which this Python lacks (a GPU "
                                   "image without the course's environment): pip install tensorboard, or leave "
                                   "--tensorboard out\n"), err
    assert list(tmp_path.iterdir()) == []


def test_amp_comparison_refuses_an_unknown_model_before_its_first_run(tmp_path, capsys):
    """The comparison printed its header and "=== run 1/2: fp32 ===" before the first training found the name."""
    assert run_main(AMP, ["--device", "cpu", "--model", "resnet5", "--results-dir", str(tmp_path / "results")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith("error: argument --model: unknown model 'resnet5'; did you mean resnet50")
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("flag, place, message", [
    ("--results-dir", "a-file", "exists and is not a folder"),
    ("--results-dir", "a-file/sub", "is a file, not a folder"),
    ("--checkpoint", "a-file/ckpt.pt", "is a file, not a folder"),
    ("--checkpoint", "a-folder", "is a folder, expected a file path"),
    ("--results-dir", "/proc/no-such-place", "cannot write /proc/no-such-place"),
])
def test_unusable_output_location_is_one_line_before_training(flag, place, message, tmp_path, capsys):
    """A file where a folder is needed (or the reverse), or a place nobody can write: found at start."""
    (tmp_path / "a-file").write_text("keep me")
    (tmp_path / "a-folder").mkdir()
    target = place if place.startswith("/") else str(tmp_path / place)
    argv = ["--device", "cpu", "--results-dir", str(tmp_path / "results"), flag, target]
    assert run_main(DDP, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("error: argument " + flag), err
    assert (tmp_path / "a-file").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "a-folder"]  # nothing written


def test_both_training_scripts_take_chapter4s_shared_flags_with_the_same_defaults():
    """ch04_shared.py writes the flags once: the single-device and the DDP script (and amp_training's
    data flags, which it passes on to mnist_training.py) read the same names with the same defaults."""
    import argparse

    shared = load_script("chapters/ch04_deep_learning/ch04_shared.py")
    expected = vars(shared.add_mnist_args(argparse.ArgumentParser()).parse_args([]))
    assert {"dataset", "model", "lr", "gamma", "precision", "log_interval", "warmup_steps"} <= set(expected)
    for script in (TRAIN, DDP):
        parsed = vars(load_script(script).build_parser().parse_args([]))
        assert {name: parsed[name] for name in expected} == expected, script
    amp_training = vars(load_script("chapters/ch04_deep_learning/amp_training.py").build_parser().parse_args([]))
    assert (amp_training["dataset"], amp_training["model"]) == (expected["dataset"], expected["model"])


#: Flags that name a place a run writes (records, checkpoints, traces, tables, reports, rendered jobs).
WRITE_FLAGS = {"--results-dir", "--checkpoint", "--checkpoint-dir", "--trace", "--folder", "--profile-dir",
               "--output", "--all-sites", "--output-report", "--csv"}


def output_flags() -> list[tuple[str, str, str]]:
    """(file, flag, kind) for every write flag of every command line (the scripts, and the report's
    under scripts/compare_results.py); kind is the name of the flag's argparse type."""
    paths = [path for folder in ("chapters", "labs") for path in sorted((REPO / folder).glob("*/*.py"))]
    paths += [path for folder in ("scripts", "bench") for path in sorted((REPO / folder).glob("*.py"))]
    paths = [str(path.relative_to(REPO)) for path in paths if "def build_parser" in path.read_text()]
    found = []
    for script in [*paths, "common/report/cli.py"]:
        for action in load_script(script).build_parser()._actions:
            for flag in set(action.option_strings) & WRITE_FLAGS:
                found.append((script, flag, getattr(action.type, "__name__", str(action.type))))
    return found


def test_every_flag_that_names_a_place_to_write_is_checked_before_the_run(tmp_path, capsys):
    """For every script: a file where a folder is needed is one
    ``error: argument FLAG`` line and exit status 2 when the command line is read, before anything runs."""
    flags = output_flags()
    assert len({script for script, _, _ in flags}) >= 25 and {"--trace", "--checkpoint-dir", "--folder",
                                                               "--output", "--all-sites"} <= {f for _, f, _ in flags}
    checked = ("output_dir", "output_file", "output_file_or_name")
    unchecked = [(script, flag, kind) for script, flag, kind in flags if kind not in checked
                 and (script, flag) != ("common/report/cli.py", "--results-dir")]  # the records it reads
    assert not unchecked, f"write flags without common.cli.output_dir/output_file: {unchecked}"
    (tmp_path / "a-file").write_text("keep me")
    for script, flag, kind in flags:
        if kind not in checked:
            continue
        parser = load_script(script).build_parser()
        with pytest.raises(SystemExit) as stopped:
            parser.parse_args([flag, str(tmp_path / "a-file" / "sub")])
        err = capsys.readouterr().err.strip().splitlines()
        assert stopped.value.code == 2 and len(err) == 1, (script, err)
        named = err[0].split(": ")[1].removeprefix("argument ").split("/")  # "-o/--output"
        assert err[0].startswith("error: argument ") and flag in named, (script, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_ddp_dry_run_leaves_nothing_in_the_current_folder(tmp_path):
    """The default checkpoint lives under --results-dir: a run elsewhere leaves its cwd as it was."""
    cwd, results = tmp_path / "cwd", tmp_path / "results"
    cwd.mkdir()
    proc = run_script(DDP, "--device", "cpu", "--dry-run", "--results-dir", str(results), cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(cwd.iterdir()) == []
    assert (results / "checkpoints" / "multi_gpu_ddp.pt").is_file() and len(list(results.glob("ch04_ddp_*.json"))) == 1


def test_what_a_run_from_a_lab_folder_writes_is_ignored_by_git():
    import subprocess

    paths = ["labs/lab01_dp_vs_ddp/results/lab01_ddp_x.json", "chapters/ch04_deep_learning/results/checkpoints/x.pt",
             "chapters/ch04_deep_learning/checkpoints/old.pt", "results/lab01/comparison_report.html"]
    proc = subprocess.run(["git", "-C", str(REPO), "check-ignore", *paths], capture_output=True, text=True)
    assert proc.stdout.split() == paths


def test_bad_input_as_a_real_process_has_no_traceback(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_script(TRAIN, "--device", "cuda", "--results-dir", str(tmp_path / "r"), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: --device cuda was requested but PyTorch sees no CUDA GPU")
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_scripts_document_python_torchrun_and_sbatch_usage():
    for path in (TRAIN, DDP):
        doc = load_script(path).__doc__
        assert "python " in doc and "sbatch " in doc
    assert "torchrun " in load_script(DDP).__doc__


# --------------------------------------------------------------------------------------------
# Feeding the device: the data decoded once, workers from the allocation, honest samples/s


def test_mnist_is_decoded_once_into_normalised_tensors(tmp_path):
    """The whole set is one normalised float tensor, equal to torchvision's per-sample ToTensor +
    Normalize; a sample is a view into it (no work per sample); the stored uint8 images stay readable."""
    import numpy as np
    import torch
    from PIL import Image
    from torch.utils.data import TensorDataset
    from torchvision import transforms

    from common.data.datasets import MNIST_MEAN, MNIST_STD, get_dataset

    write_tiny_mnist(tmp_path, train=12, test=5)
    splits = get_dataset("mnist", tmp_path)
    assert isinstance(splits.train, TensorDataset) and isinstance(splits.test, TensorDataset)
    images, labels = splits.train.tensors
    assert images.dtype == torch.float32 and images.shape == (12, 1, 28, 28) and labels.tolist() == [
        i % 10 for i in range(12)]
    per_sample = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
    for index in range(12):
        expected = per_sample(Image.fromarray(splits.train.data[index].numpy()))
        torch.testing.assert_close(splits.train[index][0], expected, rtol=0, atol=1e-6)
        assert splits.train[index][0].untyped_storage().data_ptr() == images.untyped_storage().data_ptr()
    raw = np.frombuffer((tmp_path / "MNIST/raw/train-images-idx3-ubyte").read_bytes()[16:], dtype=np.uint8)
    assert splits.train.data.dtype == torch.uint8 and splits.train.data.flatten().tolist() == raw.tolist()


def test_the_worker_count_in_force_comes_from_the_allocation_and_is_recorded(tmp_path, monkeypatch, capsys):
    """SLURM_CPUS_PER_TASK sets --num-workers in all three scripts; the DataLoader a run used has
    that many workers, and the record says so (and what --data-on-device auto chose on a CPU)."""
    from common.runtime.cpus import default_num_workers, usable_cpus

    if usable_cpus() < 2:
        pytest.skip("one usable CPU: the allocation leaves no core for a worker")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "2")
    workers = default_num_workers()
    assert workers == 1  # two CPUs allocated: one trains, one loads
    for script in (TRAIN, DDP, "chapters/ch04_deep_learning/amp_training.py"):
        assert load_script(script).build_parser().parse_args([]).num_workers == workers, script
    assert run_main(TRAIN, ["--device", "cpu", "--dry-run", "--data-on-device", "no",
                            "--results-dir", str(tmp_path / "loader")]) == 0
    assert f"batches: DataLoader, {workers} worker(s)" in capsys.readouterr().out
    (record,) = _records(tmp_path / "loader")
    assert record["config"]["num_workers"] == workers
    assert record["config"]["data_loader"] == {"kind": "DataLoader", "num_workers": workers, "pin_memory": False}


def _slow_digits(delay_s: float):
    """get_dataset, but the digits' training samples take ``delay_s`` each to load (a slow disk)."""
    import time

    from torch.utils.data import Dataset

    from common.data.datasets import get_dataset

    class Slow(Dataset):
        def __init__(self, inner):
            self.inner = inner

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, index):
            time.sleep(delay_s)
            return self.inner[index]

    def slow_get_dataset(*args, **kwargs):
        splits = get_dataset(*args, **kwargs)
        splits.train = Slow(splits.train)
        return splits

    return slow_get_dataset


def test_samples_per_s_agrees_with_the_epoch_time_when_the_loader_is_slow(tmp_path, monkeypatch, capsys):
    """A step starts when the loop asks for its batch: with no step left out as warm-up, samples/s
    times the epoch's wall time is the epoch's samples, however long the loader made the loop wait;
    the record and the last line say how much of the epoch was spent waiting."""
    monkeypatch.setattr(load_script(TRAIN), "get_dataset", _slow_digits(delay_s=0.01))
    assert run_main(TRAIN, ["--device", "cpu", "--epochs", "1", "--max-steps", "4", "--batch-size", "8",
                            "--num-workers", "0", "--warmup-steps", "0", "--log-interval", "1000",
                            "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (record,) = _records(tmp_path)
    metrics = record["metrics"]
    assert record["config"]["data_loader"]["kind"] == "DataLoader"  # a set read sample by sample: not resident
    samples = metrics["steps"] * 8
    assert metrics["samples_per_s"] * metrics["epoch_time_s"][0] == pytest.approx(samples, rel=0.05)
    assert metrics["data_wait_s"] >= samples * 0.01
    share = re.search(r"waiting for data (\d+)% of the epochs", out)
    assert share and int(share.group(1)) == round(100 * metrics["data_wait_s"] / metrics["epoch_time_s"][0]), out


def test_data_resident_on_the_device_trains_on_the_loaders_batches(tmp_path, monkeypatch, capsys):
    """--data-on-device yes (the whole set in memory, batches cut there) and no (a DataLoader) give
    the same batches in the same order, epoch after epoch: the same losses, step by step. And the
    training steps read no number back from the device (on a GPU each read makes the CPU wait):
    the losses are fetched together at the log lines and the end of the epoch."""
    import torch

    script, reads = load_script(TRAIN), []
    real_train, real_item, real_float = script.train, torch.Tensor.item, torch.Tensor.__float__

    def counting_train(*args, **kwargs):
        if args[2].__class__.__name__ == "DataLoader":  # it draws its workers' seed with .item(), on the CPU
            return real_train(*args, **kwargs)
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "item", lambda self: reads.append("item") or real_item(self))
            patch.setattr(torch.Tensor, "__float__", lambda self: reads.append("float") or real_float(self))
            return real_train(*args, **kwargs)

    monkeypatch.setattr(script, "train", counting_train)
    losses = {}
    for choice in ("yes", "no"):
        assert run_main(TRAIN, ["--device", "cpu", "--epochs", "2", "--max-steps", "2", "--num-workers", "0",
                                "--data-on-device", choice, "--log-interval", "1000",
                                "--results-dir", str(tmp_path / choice)]) == 0
        (record,) = _records(tmp_path / choice)
        losses[choice] = record["metrics"]["loss_at_step"]
        kind = record["config"]["data_loader"]["kind"]
        assert kind == ("resident" if choice == "yes" else "DataLoader")
    assert len(losses["yes"]) == 4 and losses["yes"] == losses["no"]
    assert reads == []  # 4 training steps cut from the resident set, no loss read one at a time
    assert "batches: whole data set in cpu memory" in capsys.readouterr().out


def test_a_shuffled_loaders_order_does_not_depend_on_its_workers():
    """Every epoch's order comes from the seed and the epoch alone: with persistent workers too, so
    a resumed run (a fresh loader) repeats the epoch an unbroken run saw."""
    import torch
    from torch.utils.data import TensorDataset

    from common.data.datasets import make_loader

    dataset = TensorDataset(torch.arange(40))
    orders = {}
    for workers in (0, 1):
        loader, sampler = make_loader(dataset, 8, shuffle=True, num_workers=workers, seed=3)
        orders[workers] = []
        for epoch in (1, 2, 3):
            sampler.set_epoch(epoch)
            orders[workers].append(torch.cat([batch for (batch,) in loader]).tolist())
    assert orders[0] == orders[1] and orders[0][0] != orders[0][1]
    fresh, sampler = make_loader(dataset, 8, shuffle=True, num_workers=1, seed=3)
    sampler.set_epoch(2)  # a run resumed in epoch 2
    assert torch.cat([batch for (batch,) in fresh]).tolist() == orders[1][1]


def test_data_on_device_auto_keeps_the_set_on_a_gpu_only_when_it_fits(monkeypatch):
    """auto: on a GPU when the set takes at most half its free memory (the rest is the model's);
    a CPU keeps tensors where they are; a set read sample by sample goes through a DataLoader."""
    import torch
    from torch.utils.data import Subset

    from common.data.datasets import RESIDENT_SHARE, SyntheticImages, get_dataset, resident_device
    from common.errors import UserError

    splits = get_dataset("digits")
    size = sum(t.numel() * t.element_size() for split in (splits.train, splits.test) for t in split.tensors)
    gpu = torch.device("cuda", 0)
    for free, expected in ((size / RESIDENT_SHARE + 1, gpu), (size / RESIDENT_SHARE - 1, None)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (int(free), 80 * 2**30))
        assert resident_device("auto", [splits.train, splits.test], gpu) == expected, free
    assert resident_device("yes", [splits.train], gpu) == gpu  # insisted on: no memory check
    cpu = torch.device("cpu")
    assert resident_device("auto", [splits.train, Subset(splits.test, range(0, 359, 2))], cpu) == cpu
    assert resident_device("no", [splits.train], cpu) is None
    assert resident_device("auto", [SyntheticImages(8, (1, 28, 28))], cpu) is None
    with pytest.raises(UserError, match="--data-on-device yes needs a data set held in memory as tensors"):
        resident_device("yes", [SyntheticImages(8, (1, 28, 28))], cpu)


@pytest.mark.gpu
def test_on_a_gpu_mnist_is_resident_and_samples_per_s_agrees_with_the_epoch(tmp_path):
    """A fresh process on the GPU: MNIST (decoded once) sits in GPU memory, the batches are cut
    there, and the recorded throughput agrees with the epoch's wall time."""
    write_tiny_mnist(tmp_path / "data", train=640, test=100)
    proc = run_script(TRAIN, "--device", "cuda", "--dataset", "mnist", "--data-dir", str(tmp_path / "data"),
                      "--epochs", "1", "--warmup-steps", "0", "--results-dir", str(tmp_path / "r"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "batches: whole data set in cuda:0 memory" in proc.stdout
    (record,) = _records(tmp_path / "r")
    metrics = record["metrics"]
    assert record["config"]["data_loader"] == {"kind": "resident", "device": "cuda:0", "num_workers": 0}
    assert metrics["samples_per_s"] * metrics["epoch_time_s"][0] == pytest.approx(640, rel=0.1)
