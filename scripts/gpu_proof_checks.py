#!/usr/bin/env python3
"""The checks of the GPU proof (``scripts/gpu_proof.sh``): what each one runs, and what its records must say.

A check is a few commands, run one after another in a folder of the check's own, and a judge that
reads what they left there (result records ``*.json``, ``log.txt`` with their output, ``status.txt``
with each command's exit status and seconds) and returns the problems it found: none means ok. The
judges read files only (no torch, no GPU), so ``tests/test_gpu_proof.py`` exercises them on a CPU
machine with synthetic records, and the CPU rehearsal (``--device cpu``) runs the same commands with
tiny settings. A record or log that is not what a judge expects is a problem to report, never a crash.

    python scripts/gpu_proof_checks.py mnist-standin DIR [--train N --test N]   # MNIST-format data, offline

Tiers (the order is the order they run in): tier 1 proves what a student meets first (the main job,
a short run of every single-process training script, Lab-06 on CUDA, two ranks on one GPU) and
measures the speed targets, cheapest first; tier 2 is every other path one GPU can run.
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from common.cli import one_line_errors, output_dir, positive_int
from common.results import load_records

ALLOCATOR = "cuda_max_memory_allocated"
#: Every precision Lab-03 measures; on a GPU from Ampere on, none may be skipped.
LAB03_PRECISIONS = ("fp64", "fp32", "tf32", "half", "amp-fp16", "amp-bf16")
#: The largest forward-pass allocation of memory_management.py's part 1 at the check's size (6 blocks
#: of 128 features, batch 64: under 1 MiB of activations). cuBLAS's workspace, which the warm-up
#: allocates first, is several MiB: without the warm-up it would show here.
FORWARD_ACTIVATIONS_MAX_BYTES = 2 * 2**20
#: The speed targets (issue "Fast on a GPU"), each judged on CUDA only.
TARGETS = {
    "lab02_graph_3_epochs_s": 2.0,       # Lab-02's captured step: 3 epochs of MNIST at batch 64, seconds at most
    "ch04_over_examples": 2.0,           # Chapter 4 at least this many times faster than pytorch/examples' mnist
    "lab04_mfu": 0.40,                   # Lab-04's 303 M bf16 configuration, model FLOPs utilisation at least
    "lab04_fsdp_over_ddp": 1.15,         # FSDP2's step time over DDP's on one GPU, at most
    "lab03_images_per_s": 5500.0,        # Lab-03's recipe, ResNet-50 training images/s at least
}
#: The targets met by staying at or below them (the others: at or above).
AT_MOST = frozenset({"lab02_graph_3_epochs_s", "lab04_fsdp_over_ddp"})
#: The shared-GPU test mode (common.runtime.device): two ranks on one GPU, over Gloo.
SHARE_GPUS = {"HPC_DL_LABS_SHARE_GPUS": "1"}


# --------------------------------------------------------------------------------------------
# What a check ran, and what its commands left


@dataclass
class Step:
    """One command of a check: its arguments, extra environment, and where its standard output goes
    (``None``: into ``log.txt`` with its standard error)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    stdout: str | None = None
    cwd: str | None = None
    timeout_s: float = 300.0
    expect: int = 0            # the exit status that lets the check's next command run


@dataclass
class Ctx:
    """What the commands of a check are made from."""

    device: str                # cuda or cpu
    gpus: int                  # visible GPUs (0 on the CPU rehearsal)
    python: str
    folder: Path               # this check's folder (records, logs)
    examples: Path             # pytorch/examples checkout (mnist/main.py), for the Chapter 4 comparison

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def ranks(self) -> int:
        """Processes of a distributed check: one per GPU; two Gloo processes on the CPU rehearsal."""
        return self.gpus if not self.cpu else 2

    @property
    def data(self) -> Path:
        """MNIST-format stand-in data, shared by every check (made by the ``mnist_data`` steps)."""
        return self.folder.parent / "data"

    def torchrun(self, nproc: int, *more: str) -> list[str]:
        return [self.python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *more]

    def script(self, path: str, *args: str) -> list[str]:
        return [self.python, path, *args]


class Run:
    """What one check's commands left in its folder; ``ranks``: the processes of its distributed
    commands; ``device``: where they had to run."""

    def __init__(self, folder: Path, ranks: int, device: str = "cuda") -> None:
        self.folder, self.gpus, self.device = folder, ranks, device
        self.records = load_records(folder).records if folder.is_dir() else []
        log = folder / "log.txt"
        self.log = log.read_text(encoding="utf-8", errors="replace") if log.is_file() else ""
        self.statuses: list[int] = []
        self.seconds: list[float] = []
        status = folder / "status.txt"
        for line in status.read_text().splitlines() if status.is_file() else []:
            parts = line.split()
            if parts and parts[0].lstrip("-").isdigit():
                self.statuses.append(int(parts[0]))
                self.seconds.append(float(parts[1]) if len(parts) > 1 else float("nan"))
        self.findings: dict[str, Any] = {}  # what a judge measured, for the summary (ratios, counts)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def methods(self, method: str) -> list[dict[str, Any]]:
        return [record for record in self.records if record.get("method") == method]

    def text(self, name: str) -> str:
        path = self.folder / name
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""


def get(mapping: Any, *keys: Any) -> Any:
    """``mapping[k1][k2]...`` or ``None`` where a level is missing (lists take integer keys)."""
    for key in keys:
        if isinstance(mapping, dict):
            mapping = mapping.get(key)
        elif isinstance(mapping, list) and isinstance(key, int) and -len(mapping) <= key < len(mapping):
            mapping = mapping[key]
        else:
            return None
    return mapping


def number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def name_of(record: dict[str, Any]) -> str:
    return f"{record.get('method')} ({Path(str(record.get('_path', ''))).name or record.get('run_id')})"


# --------------------------------------------------------------------------------------------
# Assertions shared by the judges: each returns the problems it found (an empty list: none)


def exited(run: Run, expected: Sequence[int] | None = None) -> list[str]:
    """Every command exited 0 (or with the statuses in ``expected``, in order)."""
    if not run.statuses:
        return ["no command ran (status.txt is empty)"]
    expected = list(expected) if expected is not None else [0] * len(run.statuses)
    if len(run.statuses) != len(expected):
        return [f"{len(run.statuses)} command(s) ran, {len(expected)} expected (a timeout or an earlier failure?)"]
    return [f"command {i + 1} exited {got}, expected {want}" + (" (timed out)" if got in (124, 137) else "")
            for i, (got, want) in enumerate(zip(run.statuses, expected)) if got != want]


def records_of(run: Run, method: str, count: int | None = 1) -> tuple[list[dict[str, Any]], list[str]]:
    found = run.methods(method)
    if count is not None and len(found) != count:
        return found, [f"{len(found)} record(s) of method {method!r}, expected {count}"]
    if not found:
        return found, [f"no record of method {method!r}"]
    return found, []


def on_device(run: Run, records: Iterable[dict[str, Any]]) -> list[str]:
    return [f"{name_of(r)} ran on {get(r, 'provenance', 'device', 'type')!r}, not {run.device}" for r in records
            if get(r, "provenance", "device", "type") != run.device]


def status_ok(records: Iterable[dict[str, Any]]) -> list[str]:
    return [f"{name_of(r)} has status {r.get('status')!r}" for r in records if r.get("status") != "ok"]


def allocator_memory(run: Run, records: Iterable[dict[str, Any]], devices: int | None = None) -> list[str]:
    """On CUDA, every memory entry is a GPU measured by the caching allocator, with the device-level figure too."""
    if not run.cuda:
        return []
    problems = []
    for record in records:
        entries = get(record, "metrics", "memory")
        if not isinstance(entries, list) or not entries:
            problems.append(f"{name_of(record)} has no metrics.memory")
            continue
        if devices is not None and len({str(e.get('device')) for e in entries if isinstance(e, dict)}) != devices:
            problems.append(f"{name_of(record)} has memory of {len(entries)} device entries, expected {devices} GPUs")
        for entry in entries:
            if not isinstance(entry, dict):
                problems.append(f"{name_of(record)}: a memory entry is not an object")
                continue
            if entry.get("source") != ALLOCATOR or not str(entry.get("device", "")).startswith("cuda"):
                problems.append(f"{name_of(record)}: memory of {entry.get('device')} from {entry.get('source')!r}, "
                                f"expected {ALLOCATOR} on a cuda device")
            if not isinstance(entry.get("peak_bytes"), int) or entry["peak_bytes"] <= 0:
                problems.append(f"{name_of(record)}: peak of {entry.get('device')} is {entry.get('peak_bytes')!r}, "
                                "not a measurement (was CUDA started before the first memory call?)")
            if not isinstance(entry.get("device_used_bytes"), int) or not entry.get("device_used_source"):
                problems.append(f"{name_of(record)}: memory of {entry.get('device')} lacks the device-level "
                                "device_used_bytes/device_used_source")
    return problems


def fp32_math(run: Run, records: Iterable[dict[str, Any]], expected: str = "ieee") -> list[str]:
    """On CUDA, fp32 means IEEE fp32 (or TF32 where a row measures TF32) for matmuls and convolutions."""
    if not run.cuda:
        return []
    return [f"{name_of(r)}: fp32 maths {get(r, 'provenance', 'fp32_math')}, expected {expected} for matmul and "
            "cudnn_conv" for r in records
            if get(r, "provenance", "fp32_math", "matmul") != expected
            or get(r, "provenance", "fp32_math", "cudnn_conv") != expected]


def positive_rate(records: Iterable[dict[str, Any]]) -> list[str]:
    return [f"{name_of(r)}: samples_per_s is {get(r, 'metrics', 'samples_per_s')!r}" for r in records
            if not number(get(r, "metrics", "samples_per_s")) or get(r, "metrics", "samples_per_s") <= 0]


def backend(run: Run, records: Iterable[dict[str, Any]], world_size: int, *, shared: bool = False) -> list[str]:
    """NCCL on CUDA (Gloo when ranks share a GPU, and on the CPU), one process per GPU."""
    expected = "nccl" if run.cuda and not shared else "gloo"
    problems = []
    for record in records:
        got = get(record, "provenance", "distributed", "backend")
        if got != expected:
            problems.append(f"{name_of(record)}: backend {got!r}, expected {expected}")
        world = get(record, "metrics", "world_size") or get(record, "provenance", "distributed", "world_size")
        if world != world_size:
            problems.append(f"{name_of(record)}: world size {world!r}, expected {world_size}")
    return problems


def in_log(run: Run, *texts: str) -> list[str]:
    return [f"the output does not say {text!r}" for text in texts if text not in run.log]


def no_records(run: Run) -> list[str]:
    return [f"a refused run wrote {len(run.records)} record(s)"] if run.records else []


def one_error_line(run: Run) -> list[str]:
    errors = [line for line in run.log.splitlines() if line.startswith("error:")]
    if len(errors) != 1 or "Traceback" in run.log:
        return [f"expected exactly one error line and no traceback, got {len(errors)} error line(s)"]
    return []


def kernel_events(run: Run, name: str) -> list[str]:
    """A Chrome trace from a GPU run holds CUDA kernel events (``"cat": "kernel"``); a CPU trace, events."""
    path = run.folder / name
    try:
        events = json.loads(path.read_text(encoding="utf-8"))["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"no readable trace {path.name}: {err}"]
    if not run.cuda:
        return [] if events else [f"{path.name} holds no events"]
    kernels = sum(1 for event in events if isinstance(event, dict) and event.get("cat") == "kernel")
    return [] if kernels else [f"{path.name} holds {len(events)} events but no GPU kernel"]


def identical_replicas(records: Iterable[dict[str, Any]], world_size: int) -> list[str]:
    """Every rank hashed its replica (``metrics.replica_digests``) and the parameters agree."""
    return [f"{name_of(r)}: {len(get(r, 'metrics', 'replica_digests') or [])} rank digest(s), parameters identical: "
            f"{get(r, 'metrics', 'parameters_identical')!r} (every rank's replica must agree)" for r in records
            if len(get(r, "metrics", "replica_digests") or []) != world_size
            or get(r, "metrics", "parameters_identical") is not True]


def dp_devices(run: Run, records: Iterable[dict[str, Any]]) -> list[str]:
    if not run.cuda:
        return []
    return [f"DataParallel over GPUs {get(r, 'config', 'dp_device_ids')}, expected all {run.gpus} visible (the same "
            "GPUs as DDP)" for r in records if get(r, "config", "dp_device_ids") != list(range(run.gpus))]


def target(run: Run, name: str, value: Any, *, at_most: bool = False) -> list[str]:
    """A speed target, judged on CUDA only (the CPU rehearsal runs the path, not the target)."""
    run.findings[name] = value
    if not run.cuda:
        return []
    goal = TARGETS[name]
    if not number(value):
        return [f"{name}: no figure ({value!r})"]
    assert at_most == (name in AT_MOST), name
    met = value <= goal if at_most else value >= goal
    return [] if met else [f"{name}: {value:.4g}, target {'at most' if at_most else 'at least'} {goal:g}"]


# --------------------------------------------------------------------------------------------
# The judges, one per check


def _judge_ch04(precision: str) -> Callable[[Run], list[str]]:
    def judge(run: Run) -> list[str]:
        """A 1-epoch run with --checkpoint, then --resume to 2 epochs: two records, the second resumed."""
        records, problems = records_of(run, precision, count=2)
        problems += exited(run, [0, 0]) + in_log(run, "resumed from")
        resumed = [r for r in records if get(r, "config", "epochs") == 2 and get(r, "config", "resume")]
        if not resumed:
            problems.append("no record of the resumed run (config.epochs 2, config.resume true)")
        problems += on_device(run, records) + status_ok(records) + allocator_memory(run, records)
        return problems + fp32_math(run, records) + positive_rate(resumed)
    return judge


def judge_main_job(run: Run) -> list[str]:
    """scripts/main_job.sh: the three methods on the device, and the report's path printed last."""
    problems = exited(run)
    methods = {record.get("method") for record in run.records}
    problems += [f"the main job left no {m!r} record" for m in ("env", "baseline", "dp", "ddp") if m not in methods]
    lines = [line for line in run.log.splitlines() if line.strip() and not line.startswith("[proof]")]
    report = run.folder / "comparison_report.html"
    if not report.is_file():
        problems.append("no comparison_report.html")
    elif not lines or not lines[-1].strip().endswith(report.name):
        problems.append(f"the last line printed is {lines[-1] if lines else ''!r}, not the report's path")
    training = [r for r in run.records if r.get("method") in ("baseline", "dp", "ddp")]
    return problems + on_device(run, training) + status_ok(training) + backend(run, run.methods("ddp"), run.gpus)


def judge_amp_training(run: Run) -> list[str]:
    records, problems = records_of(run, "amp-comparison")
    problems += exited(run)
    for record in records:
        runs = get(record, "metrics", "runs") or []
        precisions = sorted(str(row.get("precision")) for row in runs)
        expected = ["bf16", "fp16", "fp32"] if run.cuda else ["bf16", "fp32"]  # no fp16 autocast on a CPU
        if precisions != expected:
            problems.append(f"compared {precisions}, expected {', '.join(expected)}")
        problems += [f"{row.get('precision')}: speed-up {row.get('speedup_vs_fp32')!r}" for row in runs
                     if not number(row.get("speedup_vs_fp32"))]
    fp32_runs, more = records_of(run, "fp32")
    if run.cuda:
        problems += in_log(run, "fp32 baseline maths: ieee matmuls, ieee convolutions")
    return problems + more + fp32_math(run, fp32_runs + records) + on_device(run, run.records) \
        + allocator_memory(run, fp32_runs)


def judge_lab01_baseline(run: Run) -> list[str]:
    records, problems = records_of(run, "baseline")
    return problems + exited(run) + on_device(run, records) + status_ok(records) \
        + allocator_memory(run, records, 1) + positive_rate(records) + fp32_math(run, records)


def judge_lab01_dp(run: Run) -> list[str]:
    records, problems = records_of(run, "dp")
    return problems + exited(run) + on_device(run, records) + allocator_memory(run, records, run.gpus if run.cuda
                                                                              else None) \
        + positive_rate(records) + dp_devices(run, records)


def _judge_ddp(method: str, *, shared: bool = False) -> Callable[[Run], list[str]]:
    def judge(run: Run) -> list[str]:
        """DDP over every rank: one record, the backend the device calls for, identical replicas."""
        records, problems = records_of(run, method)
        devices = None if shared or not run.cuda else run.gpus
        return problems + exited(run) + on_device(run, records) + backend(run, records, run.gpus, shared=shared) \
            + allocator_memory(run, records, devices) + identical_replicas(records, run.gpus) + positive_rate(records)
    return judge


def judge_lab01_env(run: Run) -> list[str]:
    records, problems = records_of(run, "env")
    problems += exited(run)
    for record in records if run.cuda else []:
        metrics = record.get("metrics", {})
        if metrics.get("gpus") != run.gpus:
            problems.append(f"the check saw {metrics.get('gpus')} GPU(s), the proof {run.gpus}")
        if get(metrics, "multi_gpu", "backend_tests", "nccl", "ok") is not True:
            problems.append(f"NCCL all-reduce: {get(metrics, 'multi_gpu', 'backend_tests', 'nccl')}")
        if get(metrics, "multi_gpu", "topology", "available"):
            mapping = get(metrics, "multi_gpu", "cuda_to_topology") or []
            unmatched = [row.get("cuda") for row in mapping if not row.get("topology_name")]
            if len(mapping) != run.gpus or unmatched:
                problems.append(f"CUDA devices not matched to nvidia-smi's GPUs by PCI bus id: {unmatched or mapping}")
    return problems


def judge_lab01_run_lab(run: Run) -> list[str]:
    return judge_main_job(run)


def judge_gpu_check(run: Run) -> list[str]:
    problems = exited(run)
    try:
        info = json.loads(run.text("gpu_check.json"))
    except ValueError as err:
        return problems + [f"gpu_check.py --json printed no JSON: {err}"]
    if not run.cuda:
        return problems
    if info.get("torch_gpus") != run.gpus:
        problems.append(f"gpu_check.py saw {info.get('torch_gpus')} GPU(s), the proof {run.gpus}")
    problems += [f"GPU {gpu.get('index')}: smoke test {gpu.get('smoke_test')!r}" for gpu in info.get("gpus", [])
                 if gpu.get("smoke_test") != "ok"]
    if not get(info, "backends", "nccl_built"):
        problems.append("this PyTorch has no NCCL")
    return problems


def judge_pytorch_basics(run: Run) -> list[str]:
    records, problems = records_of(run, "matmul")
    problems += exited(run)
    for record in records:
        problems += on_device(run, [record])
        rows = get(record, "metrics", "matmul") or []
        problems += [f"matmul {row.get('dtype')}: {row.get('tflops')!r} TFLOP/s" for row in rows
                     if not number(row.get("tflops")) or row["tflops"] <= 0]
        if get(record, "provenance", "fp32_math", "tf32_hardware"):
            missing = {"fp32", "tf32", "bf16", "fp16"} - {row.get("dtype") for row in rows}
            problems += [f"no matmul row for {', '.join(sorted(missing))}"] if missing else []
        if run.cuda and get(record, "metrics", "peak_source") is None:
            problems.append("no datasheet peak for this GPU in common.precision.GPU_PEAKS")
    return problems


def judge_refuse_ranks(run: Run) -> list[str]:
    """torchrun with one process more than there are GPUs: every rank refuses with one line."""
    problems = [] if run.statuses and run.statuses[0] != 0 else ["the run with more processes than GPUs succeeded"]
    return problems + no_records(run) + in_log(
        run, f"error: {run.gpus + 1} processes on this node but only {run.gpus} GPU(s) visible")


def judge_refuse_bf16(run: Run) -> list[str]:
    """mnist_training.py --precision bf16 on a GPU made to report compute capability 7.0 (a V100)."""
    return exited(run, [2]) + no_records(run) + in_log(run, "(compute capability 7.0) has no bf16 tensor cores") \
        + one_error_line(run)


def judge_lab02_train(run: Run) -> list[str]:
    records = run.records
    problems = exited(run) + status_ok(records) + on_device(run, records) + allocator_memory(run, records)
    return problems + ([] if len(records) == 1 else [f"{len(records)} record(s), expected 1"])


def judge_lab02_line_profile(run: Run) -> list[str]:
    problems = exited(run, [0, 0, 0])
    records = run.records
    if len(records) != 2:
        problems.append(f"{len(records)} record(s), expected 2 (asynchronous and --launch-blocking)")
    if not any(get(r, "config", "launch_blocking") is True for r in records):
        problems.append("no record of the --launch-blocking run")
    if not any(get(r, "config", "line_profiler") is True for r in records):
        problems.append("no record says it ran under the line profiler")
    if "Function: train" not in run.text("profile.txt"):
        problems.append("python -m line_profiler shows no profile of train()")
    return problems + on_device(run, records) + allocator_memory(run, records)


def judge_lab02_trace(run: Run) -> list[str]:
    records, problems = records_of(run, "torch-profiler-tensor")
    return problems + exited(run) + on_device(run, records) + kernel_events(run, "trace.json")


LAB02_SWEEP_STEPS = ("baseline", "pin-memory", "device", "amp")


def judge_lab02_sweep(run: Run) -> list[str]:
    """Each step of the optimisation path under kernprof: a record with its speed-up and data-loading share."""
    problems = exited(run)
    steps = {r.get("method"): r for r in run.records}
    problems += [f"no record of the sweep's {step!r} step" for step in LAB02_SWEEP_STEPS if step not in steps]
    problems += status_ok(steps.values()) + on_device(run, steps.values()) + allocator_memory(run, steps.values())
    for step, record in steps.items():
        for key in ("speedup_vs_seed", "data_loading_share"):
            if not number(get(record, "metrics", key)):
                problems.append(f"{step}: {key} is {get(record, 'metrics', key)!r}")
    return problems


def judge_lab02_graph(run: Run) -> list[str]:
    """The seed's model at batch 64, the whole step one CUDA graph: 3 epochs within the target, and
    trained (accuracy); on the CPU the run trains eagerly and says why there is no graph."""
    problems = exited(run)
    records = run.records
    if len(records) != 1:
        return problems + [f"{len(records)} record(s), expected 1"]
    record = records[0]
    graph = get(record, "metrics", "cuda_graph") or {}
    problems += on_device(run, records) + status_ok(records)
    if run.cuda and graph.get("captured") is not True:
        problems.append(f"the step was not captured: {graph.get('reason')!r}")
    if not run.cuda and (graph.get("captured") is not False or not graph.get("reason")):
        problems.append(f"on the CPU the record must say why there is no graph: {graph}")
    epochs = get(record, "metrics", "epoch_time_s") or []
    run.findings["epoch_time_s"] = epochs
    run.findings["test_accuracy"] = get(record, "metrics", "test_accuracy")
    problems += target(run, "lab02_graph_3_epochs_s", sum(epochs) if epochs else None, at_most=True)
    return problems


EXAMPLES_ACCURACY = re.compile(r"Test set: Average loss: [\d.]+, Accuracy: (\d+)/(\d+)")


def judge_ch04_vs_examples(run: Run) -> list[str]:
    """pytorch/examples' mnist/main.py --epochs 3 and Chapter 4's --epochs 3 on the same data and device:
    wall times of the two commands, and the held-out accuracy of each (Chapter 4's at least as good)."""
    problems = exited(run, [0, 0, 0])
    if len(run.seconds) != 3:
        return problems
    examples_s, ours_s = run.seconds[1:]
    accuracies = EXAMPLES_ACCURACY.findall(run.text("examples.txt"))
    theirs = int(accuracies[-1][0]) / int(accuracies[-1][1]) if accuracies else None
    records, more = records_of(run, "fp32")
    ours = get(records[0], "metrics", "test_accuracy") if records else None
    run.findings.update(examples_wall_s=round(examples_s, 2), ch04_wall_s=round(ours_s, 2),
                        examples_accuracy=theirs, ch04_accuracy=ours)
    problems += more + on_device(run, records)
    if theirs is None:
        problems.append("pytorch/examples printed no test accuracy")
    elif not number(ours) or ours < theirs - 0.002:  # 20 test images of 10,000: the same, within noise
        problems.append(f"Chapter 4's accuracy {ours!r} is below pytorch/examples' {theirs:.4f}")
    return problems + target(run, "ch04_over_examples", examples_s / ours_s if ours_s > 0 else None)


def _lab03(run: Run, modes: Sequence[str], precisions: Sequence[str]) -> list[str]:
    problems = exited(run)
    failed = [name_of(r) for r in run.records if r.get("status") == "failed"]
    problems += [f"failed precision rows: {', '.join(failed)}"] if failed else []
    skipped = [f"{r.get('method')}: {get(r, 'metrics', 'skip_reason')}" for r in run.records
               if r.get("status") == "skipped" and get(r, "provenance", "fp32_math", "tf32_hardware")]
    problems += [f"skipped on a GPU that has every precision: {'; '.join(skipped)}"] if skipped else []
    ok = {r.get("method"): r for r in run.records if r.get("status") == "ok"}
    wanted = [f"{m}-{p}" for m in modes for p in precisions]
    if run.cuda:
        missing = [name for name in wanted if name not in ok]
        problems += [f"no result for {', '.join(missing)}"] if missing else []
    elif not ok:
        problems.append(f"no result at all (wanted {', '.join(wanted)})")
    problems += on_device(run, ok.values()) + allocator_memory(run, ok.values())
    for method, record in ok.items():  # the fp32 rows are real fp32, the tf32 rows TF32
        problems += fp32_math(run, [record], "tf32" if str(method).endswith("-tf32") else "ieee")
    return problems


def judge_lab03_short(run: Run) -> list[str]:
    return _lab03(run, ("train",), ("fp32", "amp-bf16"))


def judge_lab03_precisions(run: Run) -> list[str]:
    return _lab03(run, ("train", "inference"), LAB03_PRECISIONS)


def judge_lab03_channels_last(run: Run) -> list[str]:
    problems = _lab03(run, ("train", "inference"), ("fp32", "amp-fp16", "amp-bf16"))
    return problems + [f"{name_of(r)} ran without channels_last" for r in run.records
                       if get(r, "config", "channels_last") is not True]


def judge_lab03_recipe(run: Run) -> list[str]:
    """The fast recipe (channels-last, bf16, torch.compile, batch 256): ResNet-50 training images/s."""
    problems = _lab03(run, ("train",), ("amp-bf16",))
    rows = [r for r in run.records if r.get("status") == "ok"]
    for record in rows:
        if run.cuda and get(record, "metrics", "compile", "compiled") is not True:
            problems.append(f"{name_of(record)} was not really compiled: {get(record, 'metrics', 'compile')}")
        run.findings["compile"] = get(record, "metrics", "compile")
    rate = get(rows[0], "metrics", "samples_per_s") if rows else None
    return problems + target(run, "lab03_images_per_s", rate)


def judge_ch16_memory(run: Run) -> list[str]:
    records, problems = records_of(run, "memory-management")
    problems += exited(run) + on_device(run, records)
    if not run.cuda:
        return problems
    problems += in_log(run, "CUDA memory summary")
    for record in records:
        phases = get(record, "metrics", "phases") or []
        if get(phases, 0, "source") != "cuda_memory_allocated":
            problems.append(f"phase memory from {get(phases, 0, 'source')!r}, expected the CUDA allocator")
        forward = get(phases, 0, "allocated_change_bytes")
        if not isinstance(forward, int) or forward > FORWARD_ACTIVATIONS_MAX_BYTES:
            problems.append(f"the forward pass allocated {forward!r} bytes, more than its activations "
                            f"({FORWARD_ACTIVATIONS_MAX_BYTES} at most): a workspace counted as activations?")
        if get(record, "metrics", "accumulation_match") is not True:
            problems.append("gradient accumulation did not match the one-batch gradients")
    return problems


def judge_ch16_profiling(run: Run) -> list[str]:
    records, problems = records_of(run, "torch-profiler")
    return problems + exited(run) + on_device(run, records) + kernel_events(run, "trace.json")


def judge_ch16_benchmark(run: Run) -> list[str]:
    problems = exited(run)
    if not run.cuda:
        return problems + ([] if run.methods("train-cpu") else ["no record of method 'train-cpu'"])
    cuda, more = records_of(run, "train-cuda")
    _, cpu = records_of(run, "train-cpu")
    problems += more + cpu + on_device(run, cuda)
    return problems + [f"speed-up {get(r, 'metrics', 'gpu_over_cpu_speedup')!r}" for r in cuda
                       if not number(get(r, "metrics", "gpu_over_cpu_speedup"))]


def judge_ch16_loading(run: Run) -> list[str]:
    records, problems = records_of(run, "efficient-loading")
    problems += exited(run) + on_device(run, records)
    for record in records if run.cuda else []:
        rows = get(record, "metrics", "cudnn_benchmark") or []
        if [row.get("cudnn_benchmark") for row in rows] != [False, True]:
            problems.append(f"cudnn.benchmark rows {rows}, expected off and on")
    return problems


def judge_lab04_memory(run: Run) -> list[str]:
    """The memory budget on every rank: what the tensors were predicted to hold is what they held."""
    records, problems = records_of(run, "memory")
    problems += exited(run) + on_device(run, records) + allocator_memory(run, records, run.gpus)
    for record in records:
        if get(record, "metrics", "world_size") != run.gpus:
            problems.append(f"world size {get(record, 'metrics', 'world_size')!r}, expected {run.gpus}")
        budget = get(record, "metrics", "budget") or []
        if not budget:
            problems.append("no variant in metrics.budget")
        for row in budget:
            for part in ("parameters", "gradients", "optimizer"):
                predicted, measured = get(row, "predicted", part), get(row, "measured", part)
                if predicted != measured:
                    problems.append(f"{row.get('variant')}: {part} predicted {predicted!r} B, measured {measured!r} B")
    return problems


def sharded_training(run: Run, records: Iterable[dict[str, Any]], ranks: int) -> list[str]:
    records = list(records)
    return on_device(run, records) + status_ok(records) + backend(run, records, ranks) \
        + allocator_memory(run, records, ranks) + positive_rate(records)


def judge_lab04_ddp(run: Run) -> list[str]:
    records, problems = records_of(run, "ddp")
    problems += exited(run) + sharded_training(run, records, run.gpus) + identical_replicas(records, run.gpus)
    return problems + [f"{name_of(r)}: no checkpoint was saved" for r in records
                       if not get(r, "metrics", "checkpoint_saves")]


def judge_lab04_fsdp_resume(run: Run) -> list[str]:
    """FSDP2 + activation checkpointing + bf16 with asynchronous DCP saves on every rank, then resumed on one."""
    records, problems = records_of(run, "fsdp+ac+bf16", count=2)
    problems += exited(run, [0, 0])
    first = [r for r in records if not get(r, "config", "resume")]
    resumed = [r for r in records if get(r, "config", "resume") and get(r, "config", "epochs") == 2]
    if not resumed:
        problems.append("no record of the resumed run (config.epochs 2, config.resume true)")
    for record in first:
        modes = {save.get("mode") for save in get(record, "metrics", "checkpoint_saves") or []}
        if modes != {"async"}:
            problems.append(f"{name_of(record)}: checkpoint saves {sorted(map(str, modes))}, expected async only")
    for record in records:
        settings = (get(record, "config", "precision"), get(record, "config", "activation_checkpointing"))
        if settings != ("bf16", True):
            problems.append(f"{name_of(record)} ran without bf16 and activation checkpointing")
    return problems + sharded_training(run, first, run.gpus) + sharded_training(run, resumed, 1)


def judge_lab04_largest(run: Run) -> list[str]:
    records, problems = records_of(run, "largest-model")
    problems += exited(run) + on_device(run, records) + status_ok(records)
    for record in records:
        if run.cuda and get(record, "metrics", "measured_by") != ALLOCATOR:
            problems.append(f"measured by {get(record, 'metrics', 'measured_by')!r}, expected {ALLOCATOR}")
        rows = get(record, "metrics", "largest") or []
        if not rows:
            problems.append("no variant in metrics.largest")
        problems += [f"{row.get('variant')}: nothing fits the budget" for row in rows
                     if get(row, "largest", "fits") is not True]
    return problems


def judge_lab04_mfu(run: Run) -> list[str]:
    """The 303 M bf16 configuration, compiled per block: its MFU, and what the compiler logged
    (TORCH_LOGS=recompiles,graph_breaks): recompiles and graph breaks counted for the summary."""
    records, problems = records_of(run, "fsdp+bf16")
    problems += exited(run) + on_device(run, records) + status_ok(records)
    run.findings["recompiles"] = len(re.findall(r"Recompiling function", run.log))
    run.findings["graph_breaks"] = len(re.findall(r"Graph break", run.log))
    run.findings["tokens_per_s"] = get(records[0], "metrics", "tokens_per_s") if records else None
    run.findings["step_median_s"] = get(records[0], "metrics", "step_time", "median_s") if records else None
    return problems + target(run, "lab04_mfu", get(records[0], "metrics", "mfu") if records else None)


def judge_lab04_fsdp_vs_ddp(run: Run) -> list[str]:
    """DDP and FSDP2 on one GPU at equal precision (fp32) and micro-batch: FSDP2's step time over DDP's."""
    problems = exited(run, [0, 0])
    ddp, more = records_of(run, "ddp")
    fsdp, more2 = records_of(run, "fsdp")
    problems += more + more2 + on_device(run, ddp + fsdp) + status_ok(ddp + fsdp)
    steps = [get(r[0], "metrics", "step_time", "median_s") if r else None for r in (ddp, fsdp)]
    run.findings.update(ddp_step_s=steps[0], fsdp_step_s=steps[1])
    ratio = steps[1] / steps[0] if all(number(s) and s > 0 for s in steps) else None
    return problems + target(run, "lab04_fsdp_over_ddp", ratio, at_most=True)


LAB05_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def judge_lab05_allreduce(run: Run) -> list[str]:
    """Every collective correct at every size; one rank has no link: one line and no record."""
    problems = exited(run)
    if run.gpus == 1:
        if "there is no link to measure" not in run.log:
            problems.append("one rank: the 'there is no link to measure' line is missing")
        return problems + [f"one rank: {len(run.records)} record(s) written, expected none"] * bool(run.records)
    for collective in LAB05_COLLECTIVES:
        records, more = records_of(run, collective)
        problems += more + on_device(run, records) + status_ok(records) + backend(run, records, run.gpus)
        for record in records:
            sizes = get(record, "metrics", "sizes") or []
            wrong = [row.get("bytes") for row in sizes if row.get("correct") is not True]
            if not sizes or wrong:
                problems.append(f"{collective}: {len(sizes)} message size(s), wrong result at {wrong}")
    return problems


def judge_lab05_scaling(run: Run) -> list[str]:
    problems = exited(run)
    points = [r for r in run.records if str(r.get("method", "")).endswith("-scaling")]
    if not points:
        problems.append("no strong-scaling or weak-scaling record")
    return problems + on_device(run, points) + status_ok(points) + positive_rate(points) + [
        f"{name_of(r)}: world size {get(r, 'metrics', 'world_size')!r}, expected 1" for r in points
        if get(r, "metrics", "world_size") != 1]


def judge_lab05_overlap(run: Run) -> list[str]:
    """With more than one rank the hidden share of communication is within 0-100%; with one there is
    nothing to overlap, and the record says so instead of a share."""
    records, problems = records_of(run, "overlap")
    problems += exited(run) + on_device(run, records) + status_ok(records) + backend(run, records, run.gpus)
    for record in records:
        for row in get(record, "metrics", "buckets") or []:
            hidden = row.get("hidden_fraction")
            if run.gpus == 1 and hidden is not None:
                problems.append(f"bucket_cap_mb {row.get('bucket_cap_mb')}: hidden {hidden!r} on one rank, where "
                                "nothing overlaps")
            elif hidden is not None and not 0 <= hidden <= 1:
                problems.append(f"bucket_cap_mb {row.get('bucket_cap_mb')}: hidden {hidden:.0%}, outside 0-100%")
    return problems


def judge_lab06_inject(run: Run) -> list[str]:
    """01_inject.py on the device: a run without a fault, then a NaN on the last rank that stops every
    rank at the same step (exit 1, one record that says so)."""
    problems = exited(run, [0, 1])
    records = run.methods("uninterrupted")
    nan = run.methods("nan-loss")
    problems += status_ok(records) + on_device(run, records + nan)
    if len(records) != 1:
        problems.append(f"{len(records)} record(s) of the run without a fault, expected 1")
    if len(nan) != 1 or get(nan[0], "metrics", "nan_stop", "step") != 3:
        problems.append(f"the NaN at step 3 did not stop the run there: {[get(r, 'metrics', 'nan_stop') for r in nan]}")
    return problems


def judge_lab06_shared_gpu(run: Run) -> list[str]:
    """Two ranks on one device: rank 1 crashes at step 4, torchrun restarts both, the run resumes
    from its checkpoint and finishes after one restart."""
    records, problems = records_of(run, "crash-rank", count=None)
    finished = [r for r in records if r.get("status") == "ok"]
    problems += exited(run) + on_device(run, finished) + backend(run, finished, 2, shared=True)
    if len(finished) != 1 or get(finished[0], "metrics", "restarts") != 1:
        problems.append(f"{len(finished)} finished crash-rank record(s), expected 1 after 1 restart")
    return problems + in_log(run, "resumed from")


def judge_lab06_preflight(run: Run) -> list[str]:
    """One verdict, ok; NCCL's transport named when there are two GPUs or more."""
    records, problems = records_of(run, "preflight")
    problems += exited(run) + status_ok(records)
    for record in records:
        transport = str(get(record, "metrics", "transport"))
        if run.cuda and run.gpus > 1 and "/" not in transport:
            problems.append(f"NCCL transport not named: {transport!r}")
    return problems


def judge_lab07_model_parallel(run: Run) -> list[str]:
    """Tensor parallel, a 1F1B pipeline and the 2-D mesh on every rank (one GPU: the one-process
    reference of each); losses finite, tensor parallel's traffic within 10% of its plan's."""
    problems = exited(run)
    scripts = {Path(str(r.get("script", ""))).name: r for r in run.records}
    for script in ("01_tensor_parallel.py", "02_pipeline_parallel.py", "03_2d_parallel.py"):
        if script not in scripts:
            problems.append(f"no record of {script}")
    problems += on_device(run, run.records) + status_ok(run.records)
    if run.gpus > 1:
        problems += backend(run, run.records, run.gpus)
    for record in run.records:
        losses = get(record, "metrics", "loss_at_step") or []
        if not losses or not all(number(x) and x < 1e4 for x in losses):
            problems.append(f"{name_of(record)}: losses {losses[:3]!r}...")
    tensor = scripts.get("01_tensor_parallel.py")
    predicted = get(tensor, "metrics", "comm_predicted", "total_bytes")
    for rank in (get(tensor, "metrics", "per_rank") or []) if run.gpus > 1 else []:
        measured = rank.get("comm_bytes")
        if not predicted or not number(measured) or abs(measured - predicted) > 0.1 * predicted:
            problems.append(f"tensor parallel rank {rank.get('rank')}: traffic {measured!r}, predicted {predicted!r}")
    return problems


def judge_lab08_gpu_decode(run: Run) -> list[str]:
    """Lab-08's shards read with the JPEGs decoded by the CPU workers, then by the training device in whole
    batches (nvJPEG on a GPU): both ran on the device, each read every sample; samples/s of both, and their ratio."""
    problems = exited(run)
    rates = {}
    for method in ("webdataset+read-only", "webdataset+read-only+decode-on-device"):
        records, more = records_of(run, method)
        problems += more + on_device(run, records) + status_ok(records)
        for record in records:
            epochs = get(record, "metrics", "epochs_io") or [{}]
            if not number(epochs[-1].get("samples_per_s")):
                problems.append(f"{name_of(record)}: no samples/s")
            else:
                rates[method] = epochs[-1]["samples_per_s"]
    if len(rates) == 2:
        run.findings["samples_per_s_cpu_workers"] = rates["webdataset+read-only"]
        run.findings["samples_per_s_decode_on_device"] = rates["webdataset+read-only+decode-on-device"]
        run.findings["device_over_workers"] = (rates["webdataset+read-only+decode-on-device"]
                                               / rates["webdataset+read-only"])
    return problems


def judge_lab08_shards(run: Run) -> list[str]:
    """Lab-08's shards read exactly once by two loader workers while DDP trains on the device (pinned batches on a
    GPU): every sample of the epoch read once, the loader's position in the checkpoint, identical replicas."""
    problems = exited(run)
    records, more = records_of(run, "shards-pad")
    problems += more + on_device(run, records) + status_ok(records)
    for record in records:
        io = get(record, "metrics", "epochs_io", -1) or {}
        if get(record, "metrics", "exactly_once") is not True or io.get("distinct_all_ranks") != io.get("samples"):
            problems.append(f"{name_of(record)}: read {io.get('distinct_all_ranks')} distinct of {io.get('samples')} "
                            "samples: not every sample exactly once")
        if get(record, "metrics", "parameters_identical") is not True:
            problems.append(f"{name_of(record)}: the replicas' parameters differ")
    return problems


def judge_nccl_flight_recorder(run: Run) -> list[str]:
    """The flight recorder on NCCL in this PyTorch (which variable sizes it, which dump reads it) and
    what NCCL's watchdog does to a rank whose collective never finishes (see scripts/gpu_probe_nccl.py)."""
    problems = exited(run, [0, 0])
    try:
        facts = json.loads(run.text("probe.json"))
    except ValueError as err:
        return problems + [f"the probe wrote no JSON: {err}"]
    run.findings.update(facts)
    counts = [n for dumps in (facts.get("dumps") or {}).values() if isinstance(dumps, dict)
              for n in dumps.values() if isinstance(n, int)]
    if run.cuda and not any(n > 0 for n in counts):
        problems.append(f"no dump function returned this rank's collectives: {facts.get('dumps')}")
    if run.cuda and facts.get("watchdog", {}).get("ended_within_s") is None:
        problems.append(f"the stalled rank did not end: {facts.get('watchdog')}")
    return problems


def judge_pytest_gpu(run: Run) -> list[str]:
    """Every gpu-marked test passed (or skipped, saying why: e.g. it needs two GPUs)."""
    problems = exited(run, [0]) if run.statuses and run.statuses[0] not in (0, 5) else []
    path = run.folder / "junit.xml"
    if not path.is_file():
        return problems + ["pytest wrote no junit.xml"]
    import xml.etree.ElementTree as ElementTree

    cases = ElementTree.parse(path).getroot().iter("testcase")
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            problems.append(f"{name} failed")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    run.findings.update(counts)
    return problems if run.cuda or sum(counts.values()) else problems + ["no test ran"]


# --------------------------------------------------------------------------------------------
# The checks: what each runs (tiny settings on the CPU rehearsal), in the order they run


CH04, CH16 = "chapters/ch04_deep_learning", "chapters/ch16_gpu_distributed"
LAB01, LAB02 = "labs/lab01_dp_vs_ddp", "labs/lab02_profiling"
LAB03 = "labs/lab03_precision_benchmark/benchmark_models.py"
LAB04, LAB05 = "labs/lab04_sharded_training", "labs/lab05_scaling"
LAB06, LAB07 = "labs/lab06_failures", "labs/lab07_model_parallel"
LAB08 = "labs/lab08_data_at_scale"


def tiny_lab01(c: Ctx) -> list[str]:
    return ["--device", c.device, "--model", "resnet18", "--dataset", "synthetic", "--image-size", "32",
            "--synthetic-size", "256", "--epochs", "1", "--max-steps", "4", "--num-workers", "0", "--log-interval", "2"]


def tiny_lab03(c: Ctx) -> list[str]:
    return ["--device", c.device, "--models", "resnet18", "--image-size", "32" if c.cpu else "64", "-b", "4" if c.cpu
            else "8", "-w", "1" if c.cpu else "2", "-n", "2" if c.cpu else "3", "--check-steps", "2"]


def tiny_lab04(c: Ctx) -> list[str]:
    return ["--device", c.device, "--layers", "2" if c.cpu else "4", "--width", "64" if c.cpu else "128",
            "--heads", "4", "--context", "32" if c.cpu else "64"]


def tiny_train04(c: Ctx) -> list[str]:
    return [*tiny_lab04(c), "--global-batch-size", "16", "--batch-size", "4", "--max-steps", "4" if c.cpu else "6",
            "--eval-steps", "1", "--log-interval", "100"]


def mnist_data(c: Ctx) -> Step:
    """The MNIST-format stand-in the Chapter 4 / Lab-02 speed checks read (made once, then reused)."""
    sizes = ["--train", "2048", "--test", "512"] if c.cpu else []
    return Step([c.python, "scripts/gpu_proof_checks.py", "mnist-standin", str(c.data), *sizes], timeout_s=120)


def ch04(precision: str) -> Callable[[Ctx], list[Step]]:
    def steps(c: Ctx) -> list[Step]:
        args = [CH04 + "/mnist_training.py", "--device", c.device, "--precision", precision, "--max-steps", "6",
                "--num-workers", "0", "--checkpoint", str(c.folder / "ck.pt"), "--deterministic",
                "--results-dir", str(c.folder)]
        return [Step(c.script(*args, "--epochs", "1")), Step(c.script(*args, "--epochs", "2", "--resume"))]
    return steps


def steps_main_job(c: Ctx) -> list[Step]:
    env = {"PYTHON": c.python, "LAB01_DEVICE": c.device, "LAB01_NPROC": str(c.ranks),
           "LAB01_GLOBAL_BATCH": str(16 * c.ranks)}
    return [Step(["bash", "scripts/main_job.sh", str(c.folder)], env=env, timeout_s=420)]


def steps_lab06_inject(c: Ctx) -> list[Step]:
    base = [*c.torchrun(1), LAB06 + "/01_inject.py", "--device", c.device, "--steps", "6", "--num-workers", "0",
            "--results-dir", str(c.folder)]
    return [Step([*base, "--run-dir", str(c.folder / "run-ok")]),
            Step([*base, "--fault", "nan-loss", "--rank", "0", "--step", "3", "--run-dir", str(c.folder / "run-nan")],
                 expect=1)]


def steps_lab06_shared_gpu(c: Ctx) -> list[Step]:
    return [Step([*c.torchrun(2, "--max-restarts=1"), LAB06 + "/01_inject.py", "--device", c.device, "--steps", "6",
                  "--num-workers", "0", "--fault", "crash-rank", "--rank", "1", "--step", "4",
                  "--checkpoint-every", "2", "--run-dir", str(c.folder / "run"), "--results-dir", str(c.folder)],
                 env={} if c.cpu else SHARE_GPUS)]


def steps_lab01_ddp_shared_gpu(c: Ctx) -> list[Step]:
    return [Step([*c.torchrun(2), LAB01 + "/04_ddp_training.py", *tiny_lab01(c), "--batch-size", "8",
                  "--checkpoint", str(c.folder / "ck.pt"), "--results-dir", str(c.folder)],
                 env={} if c.cpu else SHARE_GPUS)]


def steps_lab02_graph(c: Ctx) -> list[Step]:
    size = ["--epochs", "1", "--max-steps", "8"] if c.cpu else ["--epochs", "3"]
    return [mnist_data(c), Step(c.script(LAB02 + "/mnist_classify.py", "--device", c.device, "--dataset", "mnist",
                                         "--data-dir", str(c.data), "--pipeline", "device", "--cuda-graph",
                                         "--method", "graph", *size,
                                         "--results-dir", str(c.folder)))]


def steps_ch04_vs_examples(c: Ctx) -> list[Step]:
    """Both read ``<examples>/data/MNIST/raw`` (main.py's ``../data`` from ``mnist/``)."""
    data = c.examples / "data"
    make = [c.python, "scripts/gpu_proof_checks.py", "mnist-standin", str(data)]
    if c.cpu:  # the rehearsal runs both scripts' paths, not the comparison's size
        make += ["--train", "1024", "--test", "256"]
    epochs = ["--epochs", "1", "--dry-run"] if c.cpu else ["--epochs", "3"]
    theirs = [c.python, "main.py", *(["--epochs", "1", "--dry-run", "--no-accel"] if c.cpu else ["--epochs", "3"])]
    ours = c.script(CH04 + "/mnist_training.py", "--device", c.device, "--dataset", "mnist", "--data-dir", str(data),
                    *epochs, "--results-dir", str(c.folder))
    return [Step(make, timeout_s=120), Step(theirs, cwd=str(c.examples / "mnist"), stdout="examples.txt"), Step(ours)]


def lab04_model(c: Ctx, *, steps: int, warmup: int, global_batch: int, batch: int, compile: bool = False) -> list[str]:
    """Lab-04's 303M transformer on the GPU (these steps and batches), or the tiny one of the CPU rehearsal."""
    if c.cpu:
        return [*tiny_lab04(c), "--max-steps", "3", "--warmup-steps", "1", "--global-batch-size", "8",
                "--batch-size", "4"]
    return ["--device", "cuda", "--layers", "24", "--width", "1024", "--heads", "16", "--context", "1024",
            "--window-stride", "128", "--max-steps", str(steps), "--warmup-steps", str(warmup),
            *(["--compile"] if compile else []), "--global-batch-size", str(global_batch), "--batch-size", str(batch)]


def steps_lab04_mfu(c: Ctx) -> list[Step]:
    # Micro-batch 16: on the H100 (2026-11-26) micro-batch 8 gave 27.4% MFU, 16 gave 40.7%.
    model = lab04_model(c, steps=24, warmup=10, global_batch=64, batch=16, compile=True)
    return [Step([*c.torchrun(1), LAB04 + "/02_sharded_training.py", *model, "--epochs", "1", "--eval-steps", "1",
                  "--strategy", "fsdp", "--precision", "bf16", "--no-reshard-after-forward",
                  "--checkpoint-dir", str(c.folder / "ckpt"), "--results-dir", str(c.folder)],
                 env={"TORCH_LOGS": "recompiles,graph_breaks"}, timeout_s=400)]


def steps_lab04_fsdp_vs_ddp(c: Ctx) -> list[Step]:
    # fp32 is IEEE fp32 here (~50 TFLOP/s): two micro-batches a step keep it short
    model = lab04_model(c, steps=12, warmup=4, global_batch=16, batch=8)
    run = [*c.torchrun(1), LAB04 + "/02_sharded_training.py", *model, "--epochs", "1", "--eval-steps", "1",
           "--checkpoint-dir", str(c.folder / "ckpt"), "--results-dir", str(c.folder)]
    return [Step([*run, "--strategy", "ddp"]), Step([*run, "--strategy", "fsdp", "--no-reshard-after-forward"])]


def steps_lab03_recipe(c: Ctx) -> list[Step]:
    if c.cpu:
        recipe = ["--models", "resnet18", "--image-size", "32", "-b", "4", "-w", "1", "-n", "2", "--check-steps", "1"]
    else:
        recipe = ["--models", "resnet50", "--compile", "-b", "256", "-w", "20", "-n", "30"]
    return [Step(c.script(LAB03, "--device", c.device, *recipe, "--modes", "train", "--precision", "amp-bf16",
                          "--channels-last", "--folder", str(c.folder / "csv"), "--results-dir", str(c.folder)),
                 timeout_s=400)]


def steps_refuse_bf16(c: Ctx) -> list[Step]:
    """The real GPU, made to report compute capability 7.0 (a V100) to PyTorch."""
    fake = ("import runpy, sys, torch\ntorch.cuda.get_device_capability = lambda device=None: (7, 0)\n"
            "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')")
    return [Step([c.python, "-c", fake, CH04 + "/mnist_training.py", "--device", "cuda", "--precision", "bf16",
                  "--dry-run", "--results-dir", str(c.folder)])]


def steps_lab02_line_profile(c: Ctx) -> list[Step]:
    args = [LAB02 + "/mnist_classify.py", "--device", c.device, "--dataset", "synthetic", "--synthetic-size",
            "512" if c.cpu else "2048", "--epochs", "1", "--max-steps", "5" if c.cpu else "20", "--num-workers", "1",
            "--results-dir", str(c.folder)]
    kernprof = [c.python, "-m", "kernprof", "-l"]
    return [Step([*kernprof, "-o", str(c.folder / "run.lprof"), *args]),
            Step([*kernprof, "-o", str(c.folder / "sync.lprof"), *args, "--launch-blocking"]),
            Step([c.python, "-m", "line_profiler", "-rmt", str(c.folder / "run.lprof")], stdout="profile.txt")]


def steps_pytest_gpu(c: Ctx) -> list[Step]:
    """Every gpu-marked test in one pytest process: each test runs its script in a fresh process, so
    CUDA starts in the script, never earlier."""
    return [Step([c.python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "-m", "gpu", "tests",
                  "--junitxml", str(c.folder / "junit.xml")], timeout_s=600)]


@dataclass
class Check:
    name: str
    tier: int
    what: str
    steps: Callable[[Ctx], list[Step]]
    judge: Callable[[Run], list[str]]
    exclusive: bool = False        # a measurement: runs alone, nothing beside it
    needs: tuple[str, ...] = ()    # Python modules beyond torch and torchvision
    cuda_only: str | None = None   # on the CPU rehearsal: skipped, for this reason
    ranks: Callable[[Ctx], int] | None = None  # the ranks its judge expects (default: Ctx.ranks)


def _one(_c: Ctx) -> int:
    return 1


def _two(_c: Ctx) -> int:
    return 2


REPORT = ("sklearn", "pandas", "jinja2", "matplotlib")
#: Lab-05 reads the link's peak from the site profiles (YAML, common.slurm.sites).
LAB05_NEEDS = ("yaml",)
CHECKS: list[Check] = [
    # --- tier 1: what a student meets first ---
    Check("main_job", 1, "scripts/main_job.sh on the device: Lab-01 end to end, the report's path last",
          steps_main_job, judge_main_job, exclusive=True, needs=REPORT),
    Check("ch04_fp32", 1, "Chapter 4 mnist_training.py fp32: one epoch with a checkpoint, resumed to two",
          ch04("fp32"), _judge_ch04("fp32"), needs=("sklearn",)),
    Check("ch04_bf16", 1, "the same with --precision bf16", ch04("bf16"), _judge_ch04("bf16"), needs=("sklearn",)),
    Check("amp_training", 1, "Chapter 4 amp_training.py: fp32, fp16 and bf16 compared",
          lambda c: [Step(c.script(CH04 + "/amp_training.py", "--device", c.device, "--epochs", "1", "--max-steps", "6",
                                   "--results-dir", str(c.folder)))], judge_amp_training, needs=("sklearn",)),
    Check("lab01_baseline", 1, "Lab-01 02_baseline_single_gpu.py",
          lambda c: [Step(c.script(LAB01 + "/02_baseline_single_gpu.py", *tiny_lab01(c), "--batch-size", "32",
                                   "--results-dir", str(c.folder)))], judge_lab01_baseline),
    Check("lab01_dp", 1, "Lab-01 03_dataparallel_training.py over every GPU",
          lambda c: [Step(c.script(LAB01 + "/03_dataparallel_training.py", *tiny_lab01(c), "--batch-size",
                                   str(16 * max(c.gpus, 1)), "--results-dir", str(c.folder)))], judge_lab01_dp,
          ranks=lambda c: max(c.gpus, 1)),
    Check("lab02_train", 1, "Lab-02 mnist_classify.py, the seed's pipeline, without the profiler",
          lambda c: [Step(c.script(LAB02 + "/mnist_classify.py", "--device", c.device, "--dataset", "synthetic",
                                   "--synthetic-size", "1024", "--epochs", "1", "--max-steps", "10", "--num-workers",
                                   "1", "--results-dir", str(c.folder)))], judge_lab02_train, needs=("line_profiler",)),
    Check("lab03_short", 1, "Lab-03 benchmark_models.py: resnet18 training in fp32 and amp-bf16",
          lambda c: [Step(c.script(LAB03, *tiny_lab03(c), "--modes", "train", "--precision", "fp32,amp-bf16",
                                   "--folder", str(c.folder / "csv"), "--results-dir", str(c.folder)))],
          judge_lab03_short),
    Check("lab04_fsdp_resume", 1,
          "Lab-04 FSDP2 + activation checkpointing + bf16, async DCP saves, resumed on one rank",
          lambda c: [Step([*c.torchrun(1), LAB04 + "/02_sharded_training.py", *tiny_train04(c), "--strategy", "fsdp",
                           "--activation-checkpointing", "--precision", "bf16", "--checkpoint-dir",
                           str(c.folder / "ckpt"), "--results-dir", str(c.folder), *extra])
                     for extra in (["--epochs", "1", "--async-checkpoint"], ["--epochs", "2", "--resume"])],
          judge_lab04_fsdp_resume, ranks=_one),
    Check("lab05_scaling", 1, "Lab-05 02_scaling_study.py with one process",
          lambda c: [Step(c.script(LAB05 + "/02_scaling_study.py", "--device", c.device, "--processes", "1",
                                   "--model", "resnet18", "--dataset", "synthetic", "--image-size", "32", "--epochs",
                                   "1", "--max-steps", "4", "--results-dir", str(c.folder)))], judge_lab05_scaling,
          needs=LAB05_NEEDS),
    Check("lab06_inject", 1, "Lab-06 01_inject.py on the device: no fault, then a NaN that stops the run at its step",
          steps_lab06_inject, judge_lab06_inject),
    Check("lab06_shared_gpu", 1, "Lab-06 on two ranks sharing one GPU (Gloo): a crash, torchrun's restart, the resume",
          steps_lab06_shared_gpu, judge_lab06_shared_gpu, ranks=_two),
    Check("lab01_ddp_shared_gpu", 1, "Lab-01 DDP on two ranks sharing one GPU (Gloo): identical replicas",
          steps_lab01_ddp_shared_gpu, _judge_ddp("ddp", shared=True), ranks=_two),
    # --- tier 1: the speed targets, cheapest first; each runs alone ---
    Check("lab02_graph", 1, "Lab-02's step as one CUDA graph: 3 epochs of MNIST at batch 64 in <= 2.0 s",
          steps_lab02_graph, judge_lab02_graph, exclusive=True, needs=("line_profiler", "sklearn")),
    Check("ch04_vs_examples", 1, "Chapter 4 against pytorch/examples mnist/main.py, 3 epochs each: >= 2x faster",
          steps_ch04_vs_examples, judge_ch04_vs_examples, exclusive=True, needs=("sklearn",)),
    Check("lab04_fsdp_vs_ddp", 1, "Lab-04 303 M model, fp32, micro-batch 8 (2 a step): FSDP2 step <= 1.15x DDP's",
          steps_lab04_fsdp_vs_ddp, judge_lab04_fsdp_vs_ddp, exclusive=True, ranks=_one),
    Check("lab04_mfu", 1, "Lab-04 303 M model, bf16, compiled blocks, micro-batch 16: >= 40% MFU; recompiles and graph "
          "breaks logged",
          steps_lab04_mfu, judge_lab04_mfu, exclusive=True, ranks=_one),
    Check("lab03_recipe", 1, "Lab-03's recipe (ResNet-50, channels-last, bf16, compile, batch 256): >= 5,500 img/s",
          steps_lab03_recipe, judge_lab03_recipe, exclusive=True),
    # --- tier 2: every other path one GPU can run ---
    Check("gpu_check", 2, "Chapter 4 gpu_check.py --json",
          lambda c: [Step(c.script(CH04 + "/gpu_check.py", "--json"), stdout="gpu_check.json")], judge_gpu_check),
    Check("pytorch_basics", 2, "Chapter 4 pytorch_basics.py: matmul TFLOP/s per precision against the datasheet",
          lambda c: [Step(c.script(CH04 + "/pytorch_basics.py", "--device", c.device, "--size", "256" if c.cpu
                                   else "2048", "--repeats", "3", "--results-dir", str(c.folder)))],
          judge_pytorch_basics),
    Check("ch04_fp16", 2, "Chapter 4 mnist_training.py --precision fp16, checkpoint and resume", ch04("fp16"),
          _judge_ch04("fp16"), needs=("sklearn",), cuda_only="fp16 autocast needs a CUDA GPU"),
    Check("ch04_ddp", 2, "Chapter 4 multi_gpu_ddp.py over every GPU",
          lambda c: [Step([*c.torchrun(c.ranks), CH04 + "/multi_gpu_ddp.py", "--device", c.device, "--epochs", "1",
                           "--max-steps", "6", "--checkpoint", str(c.folder / "ck.pt"), "--results-dir",
                           str(c.folder)])], _judge_ddp("ddp"), needs=("sklearn",)),
    Check("lab01_env", 2, "Lab-01 01_environment_check.py (NCCL all-reduce, GPUs matched to the topology)",
          lambda c: [Step(c.script(LAB01 + "/01_environment_check.py", "--results-dir", str(c.folder)))],
          judge_lab01_env),
    Check("lab01_ddp", 2, "Lab-01 04_ddp_training.py over every GPU (NCCL)",
          lambda c: [Step([*c.torchrun(c.ranks), LAB01 + "/04_ddp_training.py", *tiny_lab01(c), "--batch-size", "16",
                           "--checkpoint", str(c.folder / "ck.pt"), "--results-dir", str(c.folder)])],
          _judge_ddp("ddp")),
    Check("refuse_ranks", 2, "one process more than GPUs: every rank refuses in one line",
          lambda c: [Step([*c.torchrun(c.gpus + 1), LAB01 + "/04_ddp_training.py", *tiny_lab01(c), "--batch-size", "8",
                           "--dry-run", "--checkpoint", str(c.folder / "ck.pt"), "--results-dir", str(c.folder)])],
          judge_refuse_ranks, cuda_only="a refusal of more processes than GPUs needs GPUs"),
    Check("refuse_bf16", 2, "--precision bf16 on a GPU that reports compute capability 7.0: one error line",
          steps_refuse_bf16, judge_refuse_bf16, cuda_only="the bf16 refusal is about a GPU's compute capability"),
    Check("lab02_line_profile", 2, "Lab-02 under kernprof, asynchronous and --launch-blocking; the line table",
          steps_lab02_line_profile, judge_lab02_line_profile, needs=("line_profiler",)),
    Check("lab02_trace", 2, "Lab-02 profile_trace.py: a Chrome trace with GPU kernels",
          lambda c: [Step(c.script(LAB02 + "/profile_trace.py", "--device", c.device, "--dataset", "synthetic",
                                   "--pipeline", "tensor", "--num-workers", "0", "--wait", "1", "--warmup", "1",
                                   "--active", "2", "--trace", str(c.folder / "trace.json"), "--results-dir",
                                   str(c.folder)))], judge_lab02_trace, needs=("line_profiler",)),
    Check("lab02_sweep", 2, "Lab-02 sweep.py: baseline, pin-memory, device, amp under kernprof",
          lambda c: [Step(c.script(LAB02 + "/sweep.py", "--device", c.device, "--dataset", "synthetic",
                                   "--synthetic-size", "1024" if c.cpu else "4096", "--epochs", "1", "--max-steps",
                                   "5" if c.cpu else "20", "--stages", ",".join(LAB02_SWEEP_STEPS), "--results-dir",
                                   str(c.folder)))], judge_lab02_sweep, needs=("line_profiler",)),
    Check("lab03_precisions", 2, "Lab-03 every precision, training and inference",
          lambda c: [Step(c.script(LAB03, *tiny_lab03(c), "--folder", str(c.folder / "csv"), "--results-dir",
                                   str(c.folder)))], judge_lab03_precisions),
    Check("lab03_channels_last", 2, "Lab-03 channels-last in fp32, amp-fp16 and amp-bf16",
          lambda c: [Step(c.script(LAB03, *tiny_lab03(c), "--channels-last", "--precision", "fp32,amp-fp16,amp-bf16",
                                   "--folder", str(c.folder / "csv"), "--results-dir", str(c.folder)))],
          judge_lab03_channels_last),
    Check("ch16_memory", 2, "Chapter 16 memory_management.py: the CUDA allocator, accumulation matches",
          lambda c: [Step(c.script(CH16 + "/memory_management.py", "--device", c.device, "--depth", "6", "--width",
                                   "128", "--batch-size", "64", "--repeats", "2", "--results-dir", str(c.folder)))],
          judge_ch16_memory),
    Check("ch16_profiling", 2, "Chapter 16 profiling.py: a trace with GPU kernels",
          lambda c: [Step(c.script(CH16 + "/profiling.py", "--device", c.device, "--batch-size", "8", "--image-size",
                                   "32" if c.cpu else "64", "--repeats", "3", "--trace",
                                   str(c.folder / "trace.json"), "--results-dir", str(c.folder)))],
          judge_ch16_profiling),
    Check("ch16_benchmark", 2, "Chapter 16 benchmark_cpu_vs_gpu.py",
          lambda c: [Step(c.script(CH16 + "/benchmark_cpu_vs_gpu.py", "--repeats", "5", "--warmup", "2",
                                   "--results-dir", str(c.folder)))], judge_ch16_benchmark),
    Check("ch16_loading", 2, "Chapter 16 efficient_loading.py: cudnn.benchmark off and on",
          lambda c: [Step(c.script(CH16 + "/efficient_loading.py", "--device", c.device, "--repeats", "2",
                                   "--num-workers", "1", "--batch-size", "32" if c.cpu else "128", "--results-dir",
                                   str(c.folder)))], judge_ch16_loading, needs=("sklearn",)),
    Check("lab04_memory", 2, "Lab-04 01_memory_budget.py: predicted = held, per variant",
          lambda c: [Step([*c.torchrun(c.ranks), LAB04 + "/01_memory_budget.py", *tiny_lab04(c), "--batch-size", "4",
                           "--results-dir", str(c.folder)])], judge_lab04_memory),
    Check("lab04_ddp", 2, "Lab-04 02_sharded_training.py --strategy ddp with a checkpoint",
          lambda c: [Step([*c.torchrun(c.ranks), LAB04 + "/02_sharded_training.py", *tiny_train04(c), "--strategy",
                           "ddp", "--epochs", "1", "--checkpoint-dir", str(c.folder / "ckpt"), "--results-dir",
                           str(c.folder)])], judge_lab04_ddp),
    Check("lab04_largest", 2, "Lab-04 03_largest_model.py under a small budget (64 MiB on CPU, 160 MiB on a GPU)",
          lambda c: [Step([*c.torchrun(c.ranks), LAB04 + "/03_largest_model.py", "--device", c.device, "--layers", "2",
                           "--width", "64", "--heads", "4", "--context", "32", "--batch-size", "2", "--budget",
                           "64MiB" if c.cpu else "160MiB",  # on the H100, 2 blocks took 66-68 MiB in all
                           "--max-doublings", "2" if c.cpu else "4", "--results-dir", str(c.folder)])],
          judge_lab04_largest),
    Check("lab05_allreduce", 2, "Lab-05 01_allreduce_bench.py (one GPU: no link to measure, said once)",
          lambda c: [Step([*c.torchrun(c.ranks), LAB05 + "/01_allreduce_bench.py", "--device", c.device,
                           "--min-bytes", "1024", "--max-bytes", "1048576", "--step-factor", "16", "--warmup", "2",
                           "--repeats", "5", "--results-dir", str(c.folder)])], judge_lab05_allreduce,
          needs=LAB05_NEEDS),
    Check("lab05_overlap", 2, "Lab-05 03_overlap.py (one GPU: nothing to overlap, said so)",
          lambda c: [Step([*c.torchrun(c.ranks), LAB05 + "/03_overlap.py", "--device", c.device, "--model",
                           "resnet18", "--image-size", "32" if c.cpu else "64", "--batch-size", "8", "--repeats", "3",
                           "--warmup-steps", "1", "--bucket-cap-mb", "1,25", "--results-dir", str(c.folder)])],
          judge_lab05_overlap, needs=LAB05_NEEDS),
    Check("lab06_preflight", 2, "Lab-06 04_preflight.py over every GPU",
          lambda c: [Step([*c.torchrun(c.ranks), LAB06 + "/04_preflight.py", "--device", c.device, "--results-dir",
                           str(c.folder)])], judge_lab06_preflight),
    Check("lab07_model_parallel", 2, "Lab-07 tensor parallel, 1F1B pipeline and the 2-D mesh on every GPU",
          lambda c: [Step([*c.torchrun(c.ranks), LAB07 + "/" + script, "--device", c.device, "--layers", "8",
                           "--width", "64" if c.cpu else "128", "--heads", "8", "--context", "32" if c.cpu else "64",
                           "--batch-size", "16", "--steps", "4" if c.cpu else "6", "--warmup-steps", "2", *extra,
                           "--results-dir", str(c.folder)])
                     for script, extra in (("01_tensor_parallel.py", []),
                                           ("02_pipeline_parallel.py", ["--schedule", "1f1b", "--microbatches", "8"]),
                                           ("03_2d_parallel.py", ["--checkpoint-dir", str(c.folder / "ckpt")]))],
          judge_lab07_model_parallel),
    Check("lab08_gpu_decode", 2, "Lab-08 shards read with JPEGs decoded by 2 CPU workers, then by the device "
          "(torchvision.io.decode_jpeg on cuda): samples/s of each",
          lambda c: [Step(c.script(LAB08 + "/01_make_dataset.py", "--samples", "2048", "--shard-size", "256",
                                   "--data-dir", str(c.folder.parent / "lab08-data"), "--overwrite",
                                   "--results-dir", str(c.folder))),
                     *[Step(c.script(LAB08 + "/02_read_formats.py", "--device", c.device, "--format", "webdataset",
                                     "--read-only", "--decode", decode, "--num-workers", "2", "--batch-size", "128",
                                     "--data-dir", str(c.folder.parent / "lab08-data"), "--results-dir",
                                     str(c.folder))) for decode in ("loader", "device")]],
          judge_lab08_gpu_decode, needs=("webdataset", "braceexpand", "yaml")),
    Check("lab08_shards", 2, "Lab-08 03_shards_exactly_once.py on the device: two loader workers, pinned batches, "
          "every sample once, the loader's position checkpointed",
          lambda c: [Step(c.script(LAB08 + "/01_make_dataset.py", "--samples", "512", "--shard-size", "64",
                                   "--data-dir", str(c.folder / "data"), "--results-dir", str(c.folder / "made"))),
                     Step(c.script(LAB08 + "/03_shards_exactly_once.py", "--device", c.device, "--num-workers", "2",
                                   "--batch-size", "64", "--epochs", "1", "--data-dir", str(c.folder / "data"),
                                   "--checkpoint", str(c.folder / "shards.pt"), "--results-dir", str(c.folder)))],
          judge_lab08_shards, needs=("webdataset", "braceexpand", "yaml", "torchdata")),
    Check("nccl_flight_recorder", 2, "NCCL's flight recorder in this PyTorch, and its watchdog on a stalled rank",
          lambda c: [Step([c.python, "scripts/gpu_probe_nccl.py", "recorder", str(c.folder / "probe.json")]),
                     Step([c.python, "scripts/gpu_probe_nccl.py", "watchdog", str(c.folder / "probe.json")])],
          judge_nccl_flight_recorder, cuda_only="NCCL needs a GPU"),
    Check("pytest_gpu", 2, "every gpu-marked test (pytest -m gpu), each script in a fresh process",
          steps_pytest_gpu, judge_pytest_gpu, needs=("pytest", "yaml", *REPORT),  # what the test files import
          cuda_only="gpu-marked tests skip without a GPU"),
]
BY_NAME = {check.name: check for check in CHECKS}


def judge(name: str, folder: Path, ranks: int, device: str = "cuda") -> tuple[list[str], dict[str, Any]]:
    """The problems of one check and what its judge measured; a judge that breaks on odd input reports
    that as the problem."""
    if name not in BY_NAME:
        return [f"unknown check {name!r}"], {}
    run = Run(folder, ranks, device)
    try:
        return BY_NAME[name].judge(run), run.findings
    except Exception as err:  # noqa: BLE001 - one check's bad input must not stop the others
        return [f"the judge failed on this check's output: {type(err).__name__}: {err}"], run.findings


# --------------------------------------------------------------------------------------------
# MNIST-format data, made offline from the handwritten digits scikit-learn ships


def write_mnist_standin(root: Path, train: int = 60_000, test: int = 10_000, seed: int = 0) -> Path:
    """``root/MNIST/raw/*-ubyte`` in MNIST's own file format (what torchvision and the course read),
    made from scikit-learn's 1,797 8x8 digits: each scaled to 24x24, placed at a random offset in a
    28x28 frame, its ink scaled by a random factor, with noise. The same files for the same seed; an
    existing set of the same sizes is kept. Not MNIST: accuracies are only comparable on this data."""
    import numpy as np
    from sklearn.datasets import load_digits

    raw = Path(root) / "MNIST" / "raw"
    names = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", train),
             "t10k": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", test)}
    if all(_idx_count(raw / images) == count for images, _, count in names.values()):
        return raw
    raw.mkdir(parents=True, exist_ok=True)
    digits = load_digits()
    big = np.repeat(np.repeat(digits.images, 3, axis=1), 3, axis=2) * (255.0 / 16.0)  # (1797, 24, 24)
    rng = np.random.default_rng(seed)
    for split, (images_name, labels_name, count) in names.items():
        pick = rng.integers(0, len(big), size=count)
        frames = np.zeros((count, 28, 28), dtype=np.float32)
        offsets = rng.integers(0, 5, size=(count, 2))
        for dy in range(5):
            for dx in range(5):
                where = (offsets[:, 0] == dy) & (offsets[:, 1] == dx)
                frames[where, dy:dy + 24, dx:dx + 24] = big[pick[where]]
        frames *= rng.uniform(0.7, 1.0, size=(count, 1, 1))
        frames += rng.normal(0.0, 12.0, size=frames.shape)
        pixels = np.clip(frames, 0, 255).astype(np.uint8)
        for name, header, body in ((images_name, struct.pack(">IIII", 2051, count, 28, 28), pixels),
                                   (labels_name, struct.pack(">II", 2049, count),
                                    digits.target[pick].astype(np.uint8))):
            tmp = raw / (name + ".tmp")
            tmp.write_bytes(header + body.tobytes())
            tmp.replace(raw / name)
    return raw


def _idx_count(path: Path) -> int | None:
    try:
        with open(path, "rb") as handle:
            return struct.unpack(">II", handle.read(8))[1]
    except (OSError, struct.error):
        return None


def build_parser() -> argparse.ArgumentParser:
    parser = one_line_errors(argparse.ArgumentParser(description="helpers of the GPU proof"))
    sub = parser.add_subparsers(dest="command", required=True)
    standin = sub.add_parser("mnist-standin", help="write MNIST-format data made from scikit-learn's digits")
    standin.add_argument("root", type=output_dir, help="folder that gets MNIST/raw/")
    standin.add_argument("--train", type=positive_int, default=60_000, help="training images (default: %(default)s)")
    standin.add_argument("--test", type=positive_int, default=10_000, help="test images (default: %(default)s)")
    one_line_errors(standin)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(f"MNIST-format stand-in: {write_mnist_standin(args.root, args.train, args.test)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
