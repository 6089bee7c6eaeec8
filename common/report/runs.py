"""Result records -> a table of runs: one row per run, with the numbers the report compares.

Every value is read defensively. A record from an older script, another lab or a crashed run may
lack a key or hold a value of the wrong type; the run must still be listed (its cell shows "—"), so
nothing here indexes a record directly.

Scaling efficiency follows the Lab-01 handout's table:
``throughput(N devices) / (N x baseline throughput)``, where the baseline is the median throughput
of the single-device ``baseline`` runs of the same lab, model and device type on the same
machine. Runs from different machines are never compared.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Iterable, Mapping

import pandas as pd

from common.runtime.machine import describe_machine, machine_label

BASELINE_METHOD = "baseline"
#: A run is compared only with runs that share these: same lab, model, kind of device and machine.
COMPARISON_KEYS = ("lab", "model", "device_type", "machine")
#: One configuration is one line of the Lab-01 handout's table; its repeats are combined with the median.
CONFIGURATION_KEYS = (*COMPARISON_KEYS, "method", "world_size", "devices")
#: Metric keys the summary table shows as columns (other scalar metrics get a table of their own).
SUMMARY_METRICS = ("samples_per_s", "time_per_epoch_s", "global_batch_size", "world_size", "devices", "memory",
                   "final_loss", "test_accuracy", "achieved_tflops", "mfu")

MEMORY_SOURCES = {
    "cuda_max_memory_allocated": "CUDA peak allocated",
    "process_max_rss": "process peak RSS",
    "nvml_process_used": "GPU memory of the process at the end (NVML)",
    "cuda_mem_get_info": "GPU memory in use on the device at the end (cudaMemGetInfo, all processes)",
}


def get(mapping: Any, *keys: str) -> Any:
    """``mapping[k1][k2]...``, or ``None`` as soon as a level is missing or is not a mapping."""
    for key in keys:
        if not isinstance(mapping, Mapping):
            return None
        mapping = mapping.get(key)
    return mapping


def number(value: Any) -> float | None:
    """A finite int or float as ``float``; anything else (text, bool, NaN, missing) as ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def text(value: Any) -> str | None:
    """A short display string for a name-like value; ``None`` when missing or empty."""
    if value is None or isinstance(value, (dict, list)):
        return None
    value = str(value).strip()
    return value or None


def memory_entries(metrics: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The objects of ``metrics.memory`` (one per device), tolerating a single object or junk."""
    entries = metrics.get("memory")
    if isinstance(entries, Mapping):  # one device written as an object instead of a list of one
        entries = [entries]
    if not isinstance(entries, list):
        return []
    return [entry for entry in entries if isinstance(entry, Mapping)]


def memory_per_device(metrics: Mapping[str, Any], key: str = "peak_bytes") -> list[tuple[str, float]]:
    """``[(device, bytes), ...]`` from ``metrics.memory`` in the order the script wrote them.

    ``key`` is ``peak_bytes`` (the allocator's peak, or the peak RSS on CPU) or ``device_used_bytes``
    (what the GPU had in use, as the driver counts it: context and NCCL buffers included).
    """
    result = []
    for index, entry in enumerate(memory_entries(metrics)):
        value = number(get(entry, key))
        if value is not None:
            result.append((text(get(entry, "device")) or f"device {index}", value))
    return result


def sources_of(metrics: Mapping[str, Any], key: str = "source") -> str:
    """The memory sources a record names under ``key``, in words."""
    sources = {text(entry.get(key)) for entry in memory_entries(metrics)}
    return ", ".join(MEMORY_SOURCES.get(s, s) for s in sorted(sources - {None}))


def machine_of(prov: Mapping[str, Any]) -> str:
    """Which machine a run's numbers belong to (``common.runtime.machine.machine_label``): the host, or on
    Slurm the cluster, plus the device name, and for a CPU its CPUs and whether bf16 is native.

    On a cluster a baseline job and a DDP job rarely land on the same node, but nodes with the same
    device name in one cluster are the same hardware, so they compare. Off-cluster, two hosts with
    the same CPU name are still different machines, and so are two "vm · AMD EPYC" of which only one
    has bf16 instructions.
    """
    return machine_label(prov)


def run_row(record: Mapping[str, Any], results_dir: Path | None = None) -> dict[str, Any]:
    """One run's row of the table (missing values are ``None``)."""
    metrics = record.get("metrics") if isinstance(record.get("metrics"), Mapping) else {}
    config = record.get("config") if isinstance(record.get("config"), Mapping) else {}
    prov = record.get("provenance") if isinstance(record.get("provenance"), Mapping) else {}
    memory = memory_per_device(metrics)
    world_size = number(metrics.get("world_size"))
    if world_size is None:
        world_size = number(prov.get("world_size"))
    # N in the efficiency is processes or devices, whichever is more: DataParallel is one process
    # driving several GPUs (its record says so in `devices` or lists one memory entry per GPU), and
    # two Gloo processes sharing one CPU are still two workers.
    devices = max(int(world_size or 1), int(number(metrics.get("devices")) or 1),
                  len({device for device, _ in memory}))
    path = Path(record.get("_path", "")) if record.get("_path") else None
    if path is not None and results_dir is not None and path.is_relative_to(results_dir):
        path = path.relative_to(results_dir)
    command = prov.get("command")
    notes = record.get("notes")
    dirty = get(prov, "git", "dirty")
    slurm_job = text(get(prov, "slurm", "SLURM_JOB_ID"))
    array_task = text(get(prov, "slurm", "SLURM_ARRAY_TASK_ID"))
    return {
        "run_id": text(record.get("run_id")),
        "lab": text(record.get("lab")),
        "method": text(record.get("method")),
        "status": text(record.get("status")),
        "model": text(config.get("model")),
        "device_type": text(get(prov, "device", "type")),
        "device_name": text(get(prov, "device", "name")),
        "hostname": text(prov.get("hostname")),
        "machine": machine_of(prov),
        "machine_detail": describe_machine(prov),
        "world_size": world_size,
        "devices": devices,
        "global_batch_size": number(metrics.get("global_batch_size")),
        "time_per_epoch_s": number(metrics.get("time_per_epoch_s")),
        "samples_per_s": number(metrics.get("samples_per_s")),
        # How far from the hardware: the achieved TFLOP/s and its fraction of the GPU's datasheet
        # peak for the precision in force (Lab-03 and Lab-04 record them).
        "achieved_tflops": number(metrics.get("achieved_tflops")),
        "mfu": number(metrics.get("mfu")),
        # A run no longer than its warm-up timed nothing: its throughput is "n/a", not missing.
        "not_timed": get(metrics, "step_time", "steps_timed") == 0,
        "peak_memory_bytes": max((peak for _, peak in memory), default=None),
        "memory_per_device": memory,
        "memory_source": sources_of(metrics),
        "device_memory_per_device": memory_per_device(metrics, "device_used_bytes"),
        "device_memory_source": sources_of(metrics, "device_used_source"),
        "final_loss": number(metrics.get("final_loss")),
        "test_accuracy": number(metrics.get("test_accuracy")),
        "created": text(record.get("created")),
        "script": text(record.get("script")),
        "file": str(path) if path is not None else None,
        "notes": [str(note) for note in notes if note] if isinstance(notes, list) else [],
        "slurm_job_id": f"{slurm_job}_{array_task}" if slurm_job and array_task else slurm_job,
        "git_commit": text(get(prov, "git", "commit")),
        "git_dirty": dirty if isinstance(dirty, bool) else None,
        "command": [str(part) for part in command] if isinstance(command, list) else text(command),
        "record": record,
    }


def _key(frame: pd.DataFrame, columns: Iterable[str]) -> pd.Series:
    """One string per row naming its group; missing values become "" so they group together."""
    parts = [frame[c].map(lambda v: "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v))
             for c in columns]
    key = parts[0]
    for part in parts[1:]:
        key = key + "\x1f" + part
    return key


def runs_frame(records: Iterable[Mapping[str, Any]], results_dir: Path | None = None) -> pd.DataFrame:
    """The table of runs, sorted by comparison group, with baseline, speed-up and efficiency columns.

    Added columns: ``comparison`` and ``configuration`` (group keys), ``baseline_samples_per_s``
    (median of the group's single-device baseline runs), ``speedup`` (throughput / baseline, for
    every other method) and ``scaling_efficiency`` (throughput / (devices x baseline), for runs on
    more than one device).
    """
    # dtype=object keeps a missing name as None (pandas 3 would turn it into NaN in a string column).
    runs = pd.DataFrame([run_row(r, results_dir) for r in records], dtype=object)
    for column in ("world_size", "global_batch_size", "time_per_epoch_s", "samples_per_s", "achieved_tflops",
                   "mfu", "peak_memory_bytes", "final_loss", "test_accuracy"):
        runs[column] = pd.to_numeric(runs[column], errors="coerce").astype("float64")
    runs["devices"] = runs["devices"].astype("int64")
    runs["comparison"] = _key(runs, COMPARISON_KEYS)
    runs["configuration"] = _key(runs, CONFIGURATION_KEYS)

    is_baseline = (runs["method"] == BASELINE_METHOD) & (runs["devices"] == 1)
    usable = is_baseline & (runs["status"] == "ok") & runs["samples_per_s"].notna()
    baseline = runs[usable].groupby("comparison")["samples_per_s"].median()
    runs["baseline_samples_per_s"] = runs["comparison"].map(baseline).astype("float64")
    compared = ~is_baseline & runs["baseline_samples_per_s"].notna()
    runs["speedup"] = (runs["samples_per_s"] / runs["baseline_samples_per_s"]).where(compared)
    runs["scaling_efficiency"] = (runs["speedup"] / runs["devices"]).where(compared & (runs["devices"] > 1))

    # Baseline first, then the other methods by name: the order of the Lab-01 handout's table.
    runs["_method_order"] = (runs["method"] != BASELINE_METHOD).astype(int)
    order = ["lab", "model", "device_type", "machine", "devices", "_method_order", "method", "created", "run_id"]
    runs = runs.sort_values(order, na_position="last", kind="stable").drop(columns="_method_order")
    return runs.reset_index(drop=True)


def configurations_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration (successful runs only): repeats combined with the median.

    ``memory_per_device`` is the median peak of each device position over the repeats, so the
    imbalance between a DataParallel job's first GPU and the others survives the combining.
    """
    ok = runs[runs["status"] == "ok"]
    rows = []
    for _, group in ok.groupby("configuration", sort=False):
        first = group.iloc[0]
        per_position: dict[int, list[float]] = {}
        names: dict[int, str] = {}
        for memory in group["memory_per_device"]:
            for position, (device, peak) in enumerate(memory):
                per_position.setdefault(position, []).append(peak)
                names.setdefault(position, device)
        rows.append({
            **{key: first[key] for key in CONFIGURATION_KEYS},
            "runs": len(group),
            "global_batch_size": group["global_batch_size"].median(),
            "time_per_epoch_s": group["time_per_epoch_s"].median(),
            "samples_per_s": group["samples_per_s"].median(),
            "samples_per_s_min": group["samples_per_s"].min(),
            "samples_per_s_max": group["samples_per_s"].max(),
            "memory_per_device": [(names[p], statistics.median(peaks)) for p, peaks in sorted(per_position.items())],
            "memory_source": first["memory_source"],
            "speedup": group["speedup"].median(),
            "scaling_efficiency": group["scaling_efficiency"].median(),
            "final_loss": group["final_loss"].median(),
        })
    return pd.DataFrame(rows, columns=[*CONFIGURATION_KEYS, "runs", "global_batch_size", "time_per_epoch_s",
                                       "samples_per_s", "samples_per_s_min", "samples_per_s_max",
                                       "memory_per_device", "memory_source", "speedup",
                                       "scaling_efficiency", "final_loss"])


def csv_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """The summary as plain columns for a spreadsheet: raw numbers (seconds, bytes), one row per run."""
    out = runs[["run_id", "lab", "method", "status", "model", "device_type", "device_name", "hostname",
                "machine", "world_size", "devices", "global_batch_size", "time_per_epoch_s",
                "samples_per_s", "peak_memory_bytes"]].copy()
    for column in ("world_size", "global_batch_size", "peak_memory_bytes"):  # counts, not 64.0
        out[column] = out[column].round().astype("Int64")
    out["peak_memory_per_device"] = runs["memory_per_device"].map(
        lambda memory: ";".join(f"{device}={int(peak)}" for device, peak in memory))
    out["memory_source"] = runs["memory_source"]
    out["device_memory_per_device"] = runs["device_memory_per_device"].map(
        lambda memory: ";".join(f"{device}={int(used)}" for device, used in memory))
    out["device_memory_source"] = runs["device_memory_source"]
    for column in ("baseline_samples_per_s", "speedup", "scaling_efficiency", "achieved_tflops", "mfu",
                   "final_loss", "test_accuracy",
                   "slurm_job_id", "git_commit", "created", "file"):
        out[column] = runs[column]
    return out
