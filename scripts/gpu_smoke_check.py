#!/usr/bin/env python3
"""What every run of ``scripts/gpu_smoke.sh`` must have left behind: one function per check.

    python scripts/gpu_smoke_check.py CHECK FOLDER --gpus N [--seconds S] [--summary FILE]
    python scripts/gpu_smoke_check.py --table FILE

The first form judges one check: ``FOLDER`` holds what its commands left (the result records
``*.json``, ``log.txt`` with their output, ``status.txt`` with one exit status per command, and any
trace or profile), ``N`` is the number of GPUs the smoke run saw. It prints ``ok`` or the problems
on one line, appends a row to ``--summary`` and exits 0 or 1. The second form prints the table of
all rows and exits 0 (all ok), 1 (a check failed) or 3 (none failed, but some were skipped).

The checks read files only (no torch, no GPU), so ``tests/test_gpu_smoke.py`` covers them on a
CPU machine with synthetic records. A record or log that is not what a check expects is a
problem to report, never a crash: each check runs isolated.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from common.results import load_records

ALLOCATOR = "cuda_max_memory_allocated"
#: Every precision Lab-03 measures; on a GPU from Ampere on, none may be skipped.
LAB03_PRECISIONS = ("fp64", "fp32", "tf32", "half", "amp-fp16", "amp-bf16")
#: The largest forward-pass allocation of memory_management.py's part 1 at the smoke check's size
#: (6 blocks of 128 features, batch 64: under 1 MiB of activations). cuBLAS's workspace, which the
#: warm-up allocates first, is several MiB: without the warm-up it would show here.
FORWARD_ACTIVATIONS_MAX_BYTES = 2 * 2**20


class Run:
    """What one check's commands left in its folder."""

    def __init__(self, folder: Path, gpus: int) -> None:
        self.folder, self.gpus = folder, gpus
        self.records = load_records(folder).records if folder.is_dir() else []
        log = folder / "log.txt"
        self.log = log.read_text(encoding="utf-8", errors="replace") if log.is_file() else ""
        status = folder / "status.txt"
        self.statuses = [int(line) for line in status.read_text().split() if line.strip().lstrip("-").isdigit()] \
            if status.is_file() else []

    def methods(self, method: str) -> list[dict[str, Any]]:
        return [record for record in self.records if record.get("method") == method]


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


def name_of(record: dict[str, Any]) -> str:
    return f"{record.get('method')} ({Path(str(record.get('_path', ''))).name or record.get('run_id')})"


# --------------------------------------------------------------------------------------------
# Assertions shared by the checks: each returns the problems it found (an empty list: none)


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


def on_cuda(records: Iterable[dict[str, Any]]) -> list[str]:
    return [f"{name_of(r)} ran on {get(r, 'provenance', 'device', 'type')!r}, not cuda" for r in records
            if get(r, "provenance", "device", "type") != "cuda"]


def status_ok(records: Iterable[dict[str, Any]]) -> list[str]:
    return [f"{name_of(r)} has status {r.get('status')!r}" for r in records if r.get("status") != "ok"]


def allocator_memory(records: Iterable[dict[str, Any]], devices: int | None = None) -> list[str]:
    """Every memory entry is a CUDA device measured by the caching allocator, with the device-level figure too."""
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
            if not isinstance(entry.get("device_used_bytes"), int) or not entry.get("device_used_source"):
                problems.append(f"{name_of(record)}: memory of {entry.get('device')} lacks the device-level "
                                "device_used_bytes/device_used_source")
    return problems


def fp32_math(records: Iterable[dict[str, Any]], expected: str = "ieee") -> list[str]:
    return [f"{name_of(r)}: fp32 maths {get(r, 'provenance', 'fp32_math')}, expected {expected} for matmul and "
            "cudnn_conv" for r in records
            if get(r, "provenance", "fp32_math", "matmul") != expected
            or get(r, "provenance", "fp32_math", "cudnn_conv") != expected]


def positive_rate(records: Iterable[dict[str, Any]]) -> list[str]:
    problems = []
    for record in records:
        rate = get(record, "metrics", "samples_per_s")
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or rate <= 0:
            problems.append(f"{name_of(record)}: samples_per_s is {rate!r}")
    return problems


def nccl(records: Iterable[dict[str, Any]], world_size: int) -> list[str]:
    problems = []
    for record in records:
        backend = get(record, "provenance", "distributed", "backend")
        if backend != "nccl":
            problems.append(f"{name_of(record)}: backend {backend!r}, expected nccl")
        world = get(record, "metrics", "world_size")
        if world != world_size:
            problems.append(f"{name_of(record)}: world size {world!r}, expected {world_size} (one process per GPU)")
    return problems


def in_log(run: Run, *texts: str) -> list[str]:
    return [f"the output does not say {text!r}" for text in texts if text not in run.log]


def no_records(run: Run) -> list[str]:
    return [f"a refused run wrote {len(run.records)} record(s)"] if run.records else []


def kernel_events(path: Path) -> list[str]:
    """A Chrome trace from a GPU run holds CUDA kernel events (``"cat": "kernel"``)."""
    try:
        events = json.loads(path.read_text(encoding="utf-8"))["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"no readable trace {path.name}: {err}"]
    kernels = sum(1 for event in events if isinstance(event, dict) and event.get("cat") == "kernel")
    return [] if kernels else [f"{path.name} holds {len(events)} events but no GPU kernel"]


# --------------------------------------------------------------------------------------------
# The checks, by the name gpu_smoke.sh gives them


def check_pytorch_basics(run: Run) -> list[str]:
    records, problems = records_of(run, "matmul")
    problems += exited(run)
    for record in records:
        problems += on_cuda([record])
        rows = get(record, "metrics", "matmul") or []
        problems += [f"matmul {row.get('dtype')}: {row.get('tflops')!r} TFLOP/s" for row in rows
                     if not isinstance(row.get("tflops"), (int, float)) or row["tflops"] <= 0]
        if get(record, "provenance", "fp32_math", "tf32_hardware"):
            missing = {"fp32", "tf32", "bf16", "fp16"} - {row.get("dtype") for row in rows}
            problems += [f"no matmul row for {', '.join(sorted(missing))}"] if missing else []
        if get(record, "metrics", "peak_source") is None:
            problems.append("no datasheet peak for this GPU in common/measure/gpu_peaks.py")
    return problems


def check_gpu_check(run: Run) -> list[str]:
    problems = exited(run)
    try:
        info = json.loads((run.folder / "gpu_check.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return problems + [f"gpu_check.py --json printed no JSON: {err}"]
    if info.get("torch_gpus") != run.gpus:
        problems.append(f"gpu_check.py saw {info.get('torch_gpus')} GPU(s), the smoke run {run.gpus}")
    problems += [f"GPU {gpu.get('index')}: smoke test {gpu.get('smoke_test')!r}" for gpu in info.get("gpus", [])
                 if gpu.get("smoke_test") != "ok"]
    if not get(info, "backends", "nccl_built"):
        problems.append("this PyTorch has no NCCL")
    return problems


def _check_ch04(precision: str) -> Callable[[Run], list[str]]:
    def check(run: Run) -> list[str]:
        """A 1-epoch run with --checkpoint, then --resume to 2 epochs: two records, the second resumed."""
        records, problems = records_of(run, precision, count=2)
        problems += exited(run, [0, 0]) + in_log(run, "resumed from")
        resumed = [r for r in records if get(r, "config", "epochs") == 2 and get(r, "config", "resume")]
        if not resumed:
            problems.append("no record of the resumed run (config.epochs 2, config.resume true)")
        problems += on_cuda(records) + status_ok(records) + allocator_memory(records) + fp32_math(records)
        return problems + positive_rate(resumed)
    return check


def check_amp_training(run: Run) -> list[str]:
    records, problems = records_of(run, "amp-comparison")
    problems += exited(run)
    for record in records:
        runs = get(record, "metrics", "runs") or []
        precisions = [row.get("precision") for row in runs]
        if sorted(precisions) != ["bf16", "fp16", "fp32"]:
            problems.append(f"compared {precisions}, expected fp32, fp16 and bf16")
        problems += [f"{row.get('precision')}: speed-up {row.get('speedup_vs_fp32')!r}" for row in runs
                     if not isinstance(row.get("speedup_vs_fp32"), (int, float))]
    fp32_runs, more = records_of(run, "fp32")
    problems += in_log(run, "fp32 baseline maths: ieee matmuls, ieee convolutions")
    return problems + more + fp32_math(fp32_runs + records) + on_cuda(run.records) + allocator_memory(fp32_runs)


def identical_replicas(records: Iterable[dict[str, Any]], world_size: int) -> list[str]:
    """Every rank hashed its replica (``metrics.replica_digests``) and the parameters agree."""
    problems = []
    for record in records:
        digests = get(record, "metrics", "replica_digests") or []
        if len(digests) != world_size or get(record, "metrics", "parameters_identical") is not True:
            problems.append(f"{name_of(record)}: {len(digests)} rank digest(s), parameters identical: "
                            f"{get(record, 'metrics', 'parameters_identical')!r} (every rank's replica must agree)")
    return problems


def dp_devices(records: Iterable[dict[str, Any]], gpus: int) -> list[str]:
    return [f"DataParallel over GPUs {get(r, 'config', 'dp_device_ids')}, expected all {gpus} visible (the same "
            "GPUs as DDP)" for r in records if get(r, "config", "dp_device_ids") != list(range(gpus))]


def check_ch04_ddp(run: Run) -> list[str]:
    records, problems = records_of(run, "ddp")
    return problems + exited(run) + on_cuda(records) + nccl(records, run.gpus) + allocator_memory(records, run.gpus) \
        + identical_replicas(records, run.gpus)


def check_lab01_env(run: Run) -> list[str]:
    records, problems = records_of(run, "env")
    problems += exited(run)
    for record in records:
        metrics = record.get("metrics", {})
        if metrics.get("gpus") != run.gpus:
            problems.append(f"the check saw {metrics.get('gpus')} GPU(s), the smoke run {run.gpus}")
        if get(metrics, "multi_gpu", "backend_tests", "nccl", "ok") is not True:
            problems.append(f"NCCL all-reduce: {get(metrics, 'multi_gpu', 'backend_tests', 'nccl')}")
        if get(metrics, "multi_gpu", "topology", "available"):
            mapping = get(metrics, "multi_gpu", "cuda_to_topology") or []
            unmatched = [row.get("cuda") for row in mapping if not row.get("topology_name")]
            if len(mapping) != run.gpus or unmatched:
                problems.append(f"CUDA devices not matched to nvidia-smi's GPUs by PCI bus id: {unmatched or mapping}")
    return problems


def check_lab01_baseline(run: Run) -> list[str]:
    records, problems = records_of(run, "baseline")
    return problems + exited(run) + on_cuda(records) + status_ok(records) + allocator_memory(records, 1) \
        + positive_rate(records) + fp32_math(records)


def check_lab01_dp(run: Run) -> list[str]:
    records, problems = records_of(run, "dp")
    return problems + exited(run) + on_cuda(records) + allocator_memory(records, run.gpus) + positive_rate(records) \
        + dp_devices(records, run.gpus)


def check_lab01_ddp(run: Run) -> list[str]:
    records, problems = records_of(run, "ddp")
    return problems + exited(run) + on_cuda(records) + nccl(records, run.gpus) + allocator_memory(records, run.gpus) \
        + identical_replicas(records, run.gpus) + positive_rate(records)


def check_lab01_run_lab(run: Run) -> list[str]:
    problems = exited(run)
    methods = {record.get("method") for record in run.records}
    problems += [f"run_lab.sh left no {m!r} record" for m in ("env", "baseline", "dp", "ddp") if m not in methods]
    if not (run.folder / "comparison_report.html").is_file():
        problems.append("no comparison_report.html")
    training = [r for r in run.records if r.get("method") in ("baseline", "dp", "ddp")]
    return problems + on_cuda(training) + nccl(run.methods("ddp"), run.gpus) + dp_devices(run.methods("dp"), run.gpus)


def check_refuse_ranks(run: Run) -> list[str]:
    """torchrun with one process more than there are GPUs: every rank refuses with one line."""
    problems = [] if run.statuses and run.statuses[0] != 0 else ["the run with more processes than GPUs succeeded"]
    return problems + no_records(run) + in_log(
        run, f"error: {run.gpus + 1} processes on this node but only {run.gpus} GPU(s) visible")


def check_refuse_bf16(run: Run) -> list[str]:
    """mnist_training.py --amp bf16 on a GPU made to report compute capability 7.0 (a V100)."""
    problems = exited(run, [2]) + no_records(run) + in_log(run, "(compute capability 7.0) has no bf16 tensor cores")
    errors = [line for line in run.log.splitlines() if line.startswith("error:")]
    if len(errors) != 1 or "Traceback" in run.log:
        problems.append(f"expected exactly one error line and no traceback, got {len(errors)} error line(s)")
    return problems


def check_lab02_line_profile(run: Run) -> list[str]:
    problems = exited(run, [0, 0, 0])
    records = run.records
    if len(records) != 2:
        problems.append(f"{len(records)} record(s), expected 2 (asynchronous and --launch-blocking)")
    if not any(get(r, "config", "launch_blocking") is True for r in records):
        problems.append("no record of the --launch-blocking run")
    if not any(get(r, "config", "line_profiler") is True for r in records):
        problems.append("no record says it ran under the line profiler")
    profile = run.folder / "profile.txt"
    text = profile.read_text(encoding="utf-8", errors="replace") if profile.is_file() else ""
    if "Function: train" not in text:
        problems.append("python -m line_profiler shows no profile of train()")
    return problems + on_cuda(records) + allocator_memory(records)


def check_lab02_trace(run: Run) -> list[str]:
    records, problems = records_of(run, "torch-profiler-tensor")
    return problems + exited(run) + on_cuda(records) + kernel_events(run.folder / "trace.json")


LAB02_SWEEP_STEPS = ("baseline", "pin-memory", "device", "amp")


def check_lab02_sweep(run: Run) -> list[str]:
    """Each step of the optimisation path under kernprof: a record with its speed-up and data-loading share."""
    problems = exited(run)
    steps = {r.get("method"): r for r in run.records}
    problems += [f"no record of the sweep's {step!r} step" for step in LAB02_SWEEP_STEPS if step not in steps]
    problems += status_ok(steps.values()) + on_cuda(steps.values()) + allocator_memory(steps.values())
    for step, record in steps.items():
        for key in ("speedup_vs_seed", "data_loading_share"):
            if not isinstance(get(record, "metrics", key), (int, float)):
                problems.append(f"{step}: {key} is {get(record, 'metrics', key)!r}")
    return problems


def _lab03(run: Run, modes: Sequence[str], precisions: Sequence[str]) -> list[str]:
    problems = exited(run)
    failed = [name_of(r) for r in run.records if r.get("status") == "failed"]
    problems += [f"failed precision rows: {', '.join(failed)}"] if failed else []
    skipped = [f"{r.get('method')}: {get(r, 'metrics', 'skip_reason')}" for r in run.records
               if r.get("status") == "skipped" and get(r, "provenance", "fp32_math", "tf32_hardware")]
    problems += [f"skipped on a GPU that has every precision: {'; '.join(skipped)}"] if skipped else []
    ok = {r.get("method"): r for r in run.records if r.get("status") == "ok"}
    missing = [f"{m}-{p}" for m in modes for p in precisions if f"{m}-{p}" not in ok]
    problems += [f"no result for {', '.join(missing)}"] if missing else []
    problems += on_cuda(ok.values()) + allocator_memory(ok.values())
    for method, record in ok.items():  # the fp32 rows are real fp32, the tf32 rows TF32
        problems += fp32_math([record], "tf32" if method.endswith("-tf32") else "ieee")
    return problems


def check_lab03_precisions(run: Run) -> list[str]:
    return _lab03(run, ("train", "inference"), LAB03_PRECISIONS)


def check_lab03_compile(run: Run) -> list[str]:
    problems = _lab03(run, ("train", "inference"), ("fp32", "amp-bf16"))
    for record in run.records:
        if record.get("status") == "ok" and get(record, "metrics", "compile", "compiled") is not True:
            problems.append(f"{name_of(record)} was not really compiled: {get(record, 'metrics', 'compile')}")
    return problems


def check_lab03_channels_last(run: Run) -> list[str]:
    problems = _lab03(run, ("train", "inference"), ("fp32", "amp-fp16", "amp-bf16"))
    return problems + [f"{name_of(r)} ran without channels_last" for r in run.records
                       if get(r, "config", "channels_last") is not True]


def check_ch16_memory(run: Run) -> list[str]:
    records, problems = records_of(run, "memory-management")
    problems += exited(run) + on_cuda(records) + in_log(run, "CUDA memory summary")
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


def check_ch16_profiling(run: Run) -> list[str]:
    records, problems = records_of(run, "torch-profiler")
    return problems + exited(run) + on_cuda(records) + kernel_events(run.folder / "trace.json")


def check_ch16_benchmark(run: Run) -> list[str]:
    cuda, problems = records_of(run, "train-cuda")
    _, more = records_of(run, "train-cpu")
    problems += more + exited(run) + on_cuda(cuda)
    problems += [f"speed-up {get(r, 'metrics', 'gpu_over_cpu_speedup')!r}" for r in cuda
                 if not isinstance(get(r, "metrics", "gpu_over_cpu_speedup"), (int, float))]
    return problems


def check_ch16_loading(run: Run) -> list[str]:
    records, problems = records_of(run, "efficient-loading")
    problems += exited(run) + on_cuda(records)
    for record in records:
        rows = get(record, "metrics", "cudnn_benchmark") or []
        if [row.get("cudnn_benchmark") for row in rows] != [False, True]:
            problems.append(f"cudnn.benchmark rows {rows}, expected off and on")
    return problems


def check_lab04_memory(run: Run) -> list[str]:
    """The memory budget on every GPU: what the tensors were predicted to hold is what they held."""
    records, problems = records_of(run, "memory")
    problems += exited(run) + on_cuda(records) + allocator_memory(records, run.gpus)
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


def sharded_training(records: Iterable[dict[str, Any]], gpus: int) -> list[str]:
    return on_cuda(records) + status_ok(records) + nccl(records, gpus) + allocator_memory(records, gpus) \
        + positive_rate(records)


def check_lab04_ddp(run: Run) -> list[str]:
    records, problems = records_of(run, "ddp")
    problems += exited(run) + sharded_training(records, run.gpus) + identical_replicas(records, run.gpus)
    problems += [f"{name_of(r)}: no checkpoint was saved" for r in records if not get(r, "metrics", "checkpoint_saves")]
    return problems


def check_lab04_fsdp_resume(run: Run) -> list[str]:
    """FSDP2 + activation checkpointing + bf16 with asynchronous DCP saves on every GPU, then resumed on one."""
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
        settings = (get(record, "config", "mixed_precision"), get(record, "config", "activation_checkpointing"))
        if settings != ("bf16", True):
            problems.append(f"{name_of(record)} ran without bf16 and activation checkpointing")
    return problems + sharded_training(first, run.gpus) + sharded_training(resumed, 1)


def check_lab04_largest(run: Run) -> list[str]:
    records, problems = records_of(run, "largest-model")
    problems += exited(run) + on_cuda(records) + status_ok(records)
    for record in records:
        if get(record, "metrics", "measured_by") != ALLOCATOR:
            problems.append(f"measured by {get(record, 'metrics', 'measured_by')!r}, expected {ALLOCATOR}")
        rows = get(record, "metrics", "largest") or []
        if not rows:
            problems.append("no variant in metrics.largest")
        problems += [f"{row.get('variant')}: nothing fits the budget" for row in rows
                     if get(row, "largest", "fits") is not True]
    return problems


LAB05_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def check_lab05_allreduce(run: Run) -> list[str]:
    """Every collective over NCCL with correct results at every size; on one GPU there is no link, and
    the script says so in one line and writes no record."""
    problems = exited(run)
    if run.gpus == 1:
        if "there is no link to measure" not in run.log:
            problems.append("one GPU: the 'there is no link to measure' line is missing")
        return problems + [f"one GPU: {len(run.records)} record(s) written, expected none"] * bool(run.records)
    for collective in LAB05_COLLECTIVES:
        records, more = records_of(run, collective)
        problems += more + on_cuda(records) + status_ok(records)
        for record in records:
            if get(record, "provenance", "distributed", "backend") != "nccl":
                problems.append(f"{collective}: backend {get(record, 'provenance', 'distributed', 'backend')!r}")
            if get(record, "metrics", "world_size") != run.gpus:
                problems.append(f"{collective}: world size {get(record, 'metrics', 'world_size')!r}, "
                                f"expected {run.gpus}")
            sizes = get(record, "metrics", "sizes") or []
            wrong = [row.get("bytes") for row in sizes if row.get("correct") is not True]
            if not sizes or wrong:
                problems.append(f"{collective}: {len(sizes)} message size(s), wrong result at {wrong}")
    return problems


def check_lab06_recover(run: Run) -> list[str]:
    """The crashed rank's run was restarted by torchrun and finished on the GPU(s) after one restart."""
    records, problems = records_of(run, "crash-rank", count=None)
    finished = [r for r in records if r.get("status") == "ok"]
    problems += exited(run) + on_cuda(finished)
    if len(finished) != 1 or get(finished[0], "metrics", "restarts") != 1:
        problems.append(f"{len(finished)} finished crash-rank record(s), expected 1 after 1 restart")
    return problems


def check_lab06_preflight(run: Run) -> list[str]:
    """One verdict, ok; NCCL's transport named when there are two GPUs or more."""
    records, problems = records_of(run, "preflight")
    problems += exited(run) + status_ok(records)
    for record in records:
        transport = str(get(record, "metrics", "transport"))
        if run.gpus > 1 and "/" not in transport:
            problems.append(f"NCCL transport not named: {transport!r}")
    return problems


def check_lab05_scaling(run: Run) -> list[str]:
    problems = exited(run)
    points = [r for r in run.records if str(r.get("method", "")).endswith("-scaling")]
    if not points:
        problems.append("no strong-scaling or weak-scaling record")
    return problems + on_cuda(points) + status_ok(points) + positive_rate(points) + [
        f"{name_of(r)}: world size {get(r, 'metrics', 'world_size')!r}, expected 1" for r in points
        if get(r, "metrics", "world_size") != 1]


def check_lab05_overlap(run: Run) -> list[str]:
    """With more than one GPU the hidden share of communication is within 0-100%; with one there is
    nothing to overlap, and the script says so (one error line) or records no share at all."""
    if run.gpus == 1 and run.statuses and run.statuses[0] == 2:
        errors = [line for line in run.log.splitlines() if line.startswith("error:")]
        problems = no_records(run)
        if not errors or "Traceback" in run.log:
            problems.append("exit status 2 without one error line (or with a traceback)")
        return problems
    records, problems = records_of(run, "overlap")
    problems += exited(run) + on_cuda(records) + status_ok(records)
    for record in records:
        if get(record, "provenance", "distributed", "backend") != "nccl":
            problems.append(f"backend {get(record, 'provenance', 'distributed', 'backend')!r}, expected nccl")
        for row in get(record, "metrics", "buckets") or []:
            hidden = row.get("hidden_fraction")
            if run.gpus == 1 and hidden is not None:
                problems.append(f"bucket_cap_mb {row.get('bucket_cap_mb')}: hidden {hidden!r} on one rank, where "
                                "nothing overlaps")
            elif hidden is not None and not 0 <= hidden <= 1:
                problems.append(f"bucket_cap_mb {row.get('bucket_cap_mb')}: hidden {hidden:.0%}, outside 0-100%")
    return problems


def check_lab07_model_parallel(run: Run) -> list[str]:
    """Tensor parallel, a 1F1B pipeline and the 2-D mesh, each on every GPU (on one GPU: the one-process
    reference); over NCCL, tensor parallel's traffic within 10% of its plan's, a bubble and finite losses."""
    problems = exited(run)
    scripts = {Path(str(r.get("script", ""))).name: r for r in run.records}
    for script in ("01_tensor_parallel.py", "02_pipeline_parallel.py", "03_2d_parallel.py"):
        if script not in scripts:
            problems.append(f"no record of {script}")
    problems += on_cuda(run.records) + status_ok(run.records)
    if run.gpus > 1:
        problems += nccl(run.records, run.gpus)
    for record in run.records:
        losses = get(record, "metrics", "loss_at_step") or []
        if not losses or not all(isinstance(x, (int, float)) and x == x and x < 1e4 for x in losses):
            problems.append(f"{name_of(record)}: losses {losses[:3]!r}...")
    tensor = scripts.get("01_tensor_parallel.py")
    predicted = get(tensor, "metrics", "comm_predicted", "total_bytes")
    for rank in (get(tensor, "metrics", "per_rank") or []) if run.gpus > 1 else []:
        measured = rank.get("comm_bytes")
        if not predicted or not isinstance(measured, (int, float)) or abs(measured - predicted) > 0.1 * predicted:
            problems.append(f"tensor parallel rank {rank.get('rank')}: traffic {measured!r}, predicted {predicted!r}")
    pipeline = scripts.get("02_pipeline_parallel.py")
    bubble = get(pipeline, "metrics", "bubble_measured")
    if run.gpus > 1 and pipeline is not None and not (isinstance(bubble, (int, float)) and 0 <= bubble < 1):
        problems.append(f"pipeline bubble {bubble!r}, expected a fraction of the step")
    return problems


def check_main_job(run: Run) -> list[str]:
    """scripts/main_job.sh on the GPU(s): the three methods on cuda, and the report's path printed last."""
    problems = exited(run)
    methods = {record.get("method") for record in run.records}
    problems += [f"the main job left no {m!r} record" for m in ("env", "baseline", "dp", "ddp") if m not in methods]
    lines = [line for line in run.log.splitlines() if line.strip() and not line.startswith("[smoke]")]
    report = run.folder / "comparison_report.html"
    if not report.is_file():
        problems.append("no comparison_report.html")
    elif not lines or not lines[-1].strip().endswith(str(report.name)):
        problems.append(f"the last line printed is {lines[-1] if lines else ''!r}, not the report's path")
    training = [r for r in run.records if r.get("method") in ("baseline", "dp", "ddp")]
    return problems + on_cuda(training) + status_ok(training) + nccl(run.methods("ddp"), run.gpus)


def pytest_runs(run: Run) -> list[tuple[str, int | None]]:
    """(test id, exit status) of every ``pytest ... TEST_ID`` command in the log, in order."""
    runs: list[tuple[str, int | None]] = []
    for line in run.log.splitlines():
        if line.startswith("[smoke] exit ") and runs and runs[-1][1] is None:
            runs[-1] = (runs[-1][0], int(line.split()[2]))
        elif line.startswith("[smoke] ") and " pytest " in line and "--collect-only" not in line:
            runs.append((line.split()[-1], None))
    return runs


def check_pytest_gpu(run: Run) -> list[str]:
    """Every gpu-marked test ran in a process of its own and passed (or skipped, e.g. needing 2 GPUs)."""
    listing = run.folder / "tests.txt"
    collected = [line.strip() for line in listing.read_text(encoding="utf-8").splitlines()
                 if "::" in line] if listing.is_file() else []
    if not collected:
        return ["no gpu-marked test was collected (pytest -m gpu --collect-only)"]
    runs = dict(pytest_runs(run))
    problems = [f"{test}: not run (a timeout of the whole check?)" for test in collected if test not in runs]
    problems += [f"{test}: exit {status}" + (" (timed out)" if status in (124, 137) else " (failed)")
                 for test, status in runs.items() if status != 0]
    return problems


CHECKS: dict[str, Callable[[Run], list[str]]] = {
    "gpu_check": check_gpu_check,
    "pytorch_basics": check_pytorch_basics,
    "ch04_fp32": _check_ch04("fp32"),
    "ch04_fp16": _check_ch04("fp16"),
    "ch04_bf16": _check_ch04("bf16"),
    "amp_training": check_amp_training,
    "ch04_ddp": check_ch04_ddp,
    "lab01_env": check_lab01_env,
    "lab01_baseline": check_lab01_baseline,
    "lab01_dp": check_lab01_dp,
    "lab01_ddp": check_lab01_ddp,
    "lab01_run_lab": check_lab01_run_lab,
    "refuse_ranks": check_refuse_ranks,
    "refuse_bf16": check_refuse_bf16,
    "lab02_line_profile": check_lab02_line_profile,
    "lab02_trace": check_lab02_trace,
    "lab02_sweep": check_lab02_sweep,
    "lab03_precisions": check_lab03_precisions,
    "lab03_compile": check_lab03_compile,
    "lab03_channels_last": check_lab03_channels_last,
    "ch16_memory": check_ch16_memory,
    "ch16_profiling": check_ch16_profiling,
    "ch16_benchmark": check_ch16_benchmark,
    "ch16_loading": check_ch16_loading,
    "lab04_memory": check_lab04_memory,
    "lab04_ddp": check_lab04_ddp,
    "lab04_fsdp_resume": check_lab04_fsdp_resume,
    "lab04_largest": check_lab04_largest,
    "lab05_allreduce": check_lab05_allreduce,
    "lab05_scaling": check_lab05_scaling,
    "lab05_overlap": check_lab05_overlap,
    "lab06_recover": check_lab06_recover,
    "lab06_preflight": check_lab06_preflight,
    "lab07_model_parallel": check_lab07_model_parallel,
    "main_job": check_main_job,
    "pytest_gpu": check_pytest_gpu,
}


def judge(name: str, folder: Path, gpus: int) -> list[str]:
    """The problems of one check; a checker that breaks on odd input reports that as the problem."""
    if name not in CHECKS:
        return [f"unknown check {name!r}"]
    try:
        return CHECKS[name](Run(folder, gpus))
    except Exception as err:  # noqa: BLE001 - one check's bad input must not stop the table
        return [f"the checker failed on this check's output: {type(err).__name__}: {err}"]


# --------------------------------------------------------------------------------------------
# The table


def read_summary(path: Path) -> list[tuple[str, str, str, str]]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        name, result, seconds, detail = (line.split("\t") + ["", "", ""])[:4]
        rows.append((name, result, seconds, detail))
    return rows


def table(rows: Sequence[tuple[str, str, str, str]]) -> tuple[str, int]:
    """The summary table and the exit status: 0 all ok, 1 a failure, 3 skipped checks but no failure."""
    header = ("check", "result", "seconds", "detail")
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(3)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
             for row in (header, *rows)]
    failed = sum(1 for row in rows if row[1] != "ok" and row[1] != "SKIP")
    skipped = sum(1 for row in rows if row[1] == "SKIP")
    lines.append(f"{len(rows)} check(s): {len(rows) - failed - skipped} ok, {failed} failed, {skipped} skipped")
    return "\n".join(lines), (1 if failed else 3 if skipped else 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", nargs="?", help=f"one of: {', '.join(CHECKS)}")
    parser.add_argument("folder", nargs="?", type=Path, help="what the check's commands left")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the smoke run saw (default: %(default)s)")
    parser.add_argument("--seconds", default="", help="how long the check's commands took, for the table")
    parser.add_argument("--summary", type=Path, default=None, help="append the verdict to this table file")
    parser.add_argument("--table", type=Path, default=None, help="print the table in this file and exit")
    args = parser.parse_args(argv)
    if args.table is not None:
        text, status = table(read_summary(args.table))
        print(text)
        return status
    if args.check is None or args.folder is None:
        parser.error("give CHECK FOLDER, or --table FILE")
    problems = judge(args.check, args.folder, args.gpus)
    detail = "; ".join(problems)
    print(f"{args.check}: {'ok' if not problems else 'FAIL: ' + detail}", flush=True)
    if args.summary is not None:
        with args.summary.open("a", encoding="utf-8") as handle:
            handle.write(f"{args.check}\t{'FAIL' if problems else 'ok'}\t{args.seconds}\t{detail}\n".replace(
                "\n", " ").rstrip(" ") + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
