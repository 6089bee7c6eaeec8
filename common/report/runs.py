"""Result records -> one tidy table of runs: each record read once, here, into one row.

Every value of a record becomes a column named by its path in the schema (``docs/results-schema.md``):
``metrics.samples_per_s``, ``config.precision``, ``provenance.versions.torch``; a list stays whole under its
path (``metrics.sizes``). The columns the summary compares get short names and a type: numbers are floats,
NaN where a record lacks the value or holds text, a bool or infinity; names are text, ``None`` when missing.
A record from an older script, another lab or a crashed run thus still gets its row, and no section reads a
record by hand: it takes a number with :func:`numbers`, a name with :func:`texts`, and the objects of a list
(one row each) with :func:`entries`.

Scaling efficiency follows the Lab-01 handout's table: ``throughput(N devices) / (N x baseline throughput)``,
where the baseline is the median throughput of the single-device ``baseline`` runs of the same lab, model and
device type on the same machine. Runs from different machines are never compared.
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
#: Names of the runs table and the record key each is read from.
TEXT_COLUMNS = {"run_id": "run_id", "lab": "lab", "method": "method", "status": "status", "script": "script",
                "created": "created", "model": "config.model", "device_type": "provenance.device.type",
                "device_name": "provenance.device.name", "hostname": "provenance.hostname",
                "git_commit": "provenance.git.commit"}
#: Metrics the summary shows as columns, read from ``metrics.<name>`` (other metrics get a table of their own).
SUMMARY_METRICS = ("samples_per_s", "time_per_epoch_s", "global_batch_size", "world_size", "devices", "memory",
                   "final_loss", "test_accuracy", "achieved_tflops", "mfu")
MEMORY_SOURCES = {
    "cuda_max_memory_allocated": "CUDA peak allocated",
    "process_max_rss": "process peak RSS",
    "nvml_process_used": "GPU memory of the process at the end (NVML)",
    "cuda_mem_get_info": "GPU memory in use on the device at the end (cudaMemGetInfo, all processes)",
}


def number(value: Any) -> float | None:
    """A finite int or float as ``float``; anything else (text, bool, NaN, missing) as ``None``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def text(value: Any) -> str | None:
    """A short display string for a name-like value; ``None`` when missing, empty, NaN or a list or object."""
    if value is None or isinstance(value, (dict, list)) or value != value:
        return None
    return str(value).strip() or None


def _column(frame: pd.DataFrame, key: str) -> pd.Series:
    return frame[key] if key in frame else pd.Series(None, index=frame.index, dtype=object)


def numbers(frame: pd.DataFrame, key: str) -> pd.Series:
    """``frame[key]`` as floats (NaN where missing or not a finite number); all NaN when no row has the key."""
    return _column(frame, key).map(lambda v: math.nan if number(v) is None else number(v)).astype("float64")


def texts(frame: pd.DataFrame, key: str) -> pd.Series:
    """``frame[key]`` as text (``None`` where missing, empty, or a list or object)."""
    return _column(frame, key).map(text).astype(object)


def flags(frame: pd.DataFrame, key: str) -> pd.Series:
    """``frame[key]`` as booleans: True only where the record holds ``true``."""
    return _column(frame, key).map(lambda v: v is True).astype(bool)


def flatten(value: dict[str, Any], prefix: str = "", into: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: objects (JSON's, so dicts) are opened, lists and values stay whole."""
    into = {} if into is None else into
    for name, item in value.items():
        if isinstance(item, dict):
            flatten(item, f"{prefix}{name}.", into)
        else:
            into[f"{prefix}{name}"] = item
    return into


def entries(frame: pd.DataFrame, key: str, *keep: str) -> pd.DataFrame:
    """One row per object in the list under ``key`` of each row (``metrics.sizes``), its keys flattened, with
    ``_run`` (the row it came from), ``_position`` (its place in the list) and that row's ``keep`` columns.
    Anything that is not a list of objects adds no row."""
    rows = [{"_run": label, "_position": position, **flatten(item)}
            for label, value in _column(frame, key).items() if isinstance(value, list)
            for position, item in enumerate(value) if isinstance(item, dict)]
    found = pd.DataFrame(rows, columns=None if rows else ["_run", "_position"], dtype=object)
    return found.join(frame.reindex(columns=list(keep)), on="_run") if keep else found


def _per_device(memory: pd.DataFrame, key: str, index: pd.Index) -> pd.Series:
    """``[(device, bytes), ...]`` per run from its ``metrics.memory``, in the order the script wrote them."""
    values = numbers(memory, key)
    names = texts(memory, "device").fillna("device " + memory["_position"].astype(str))
    pairs = pd.Series(list(zip(names, values)), index=memory.index, dtype=object)[values.notna()]
    found = pairs.groupby(memory["_run"][values.notna()]).agg(list) if len(pairs) else pd.Series(dtype=object)
    return pd.Series([found.get(label, []) for label in index], index=index, dtype=object)


def _sources(memory: pd.DataFrame, key: str, index: pd.Index) -> pd.Series:
    """The memory sources each run names under ``key``, in words."""
    words = texts(memory, key).map(lambda s: MEMORY_SOURCES.get(s, s)).dropna()
    found = words.groupby(memory["_run"][words.index]).agg(lambda s: ", ".join(sorted(set(s))))
    return pd.Series([found.get(label, "") for label in index], index=index, dtype=object)


def _key(frame: pd.DataFrame, columns: Iterable[str]) -> pd.Series:
    """One string per row naming its group; missing values become "" so they group together."""
    return frame[list(columns)].apply(lambda row: "\x1f".join(text(v) or "" for v in row), axis=1)


def runs_frame(records: Iterable[Mapping[str, Any]], results_dir: Path | None = None) -> pd.DataFrame:
    """The table of runs, sorted by comparison group: the typed columns first, then every record key.

    Added columns: ``machine`` (``common.runtime.machine.machine_label``), ``devices`` (processes or devices,
    whichever is more), ``memory_per_device``, ``comparison`` and ``configuration`` (group keys),
    ``baseline_samples_per_s`` (median of the group's single-device baseline runs), ``speedup`` (throughput /
    baseline, for every other method) and ``scaling_efficiency`` (throughput / (devices x baseline)).
    """
    records = list(records)
    flat = pd.DataFrame([flatten(record) for record in records], dtype=object)
    runs = pd.DataFrame({name: texts(flat, key) for name, key in TEXT_COLUMNS.items()})
    for name in ("samples_per_s", "time_per_epoch_s", "global_batch_size", "final_loss", "test_accuracy",
                 "achieved_tflops", "mfu"):
        runs[name] = numbers(flat, f"metrics.{name}")
    runs["world_size"] = numbers(flat, "metrics.world_size").fillna(numbers(flat, "provenance.world_size"))
    provenances = [record.get("provenance") if isinstance(record.get("provenance"), Mapping) else {}
                   for record in records]
    runs["machine"] = [machine_label(prov) for prov in provenances]
    runs["machine_detail"] = [describe_machine(prov) for prov in provenances]
    memory = entries(flat, "metrics.memory")
    runs["memory_per_device"] = _per_device(memory, "peak_bytes", runs.index)
    runs["memory_source"] = _sources(memory, "source", runs.index)
    runs["device_memory_per_device"] = _per_device(memory, "device_used_bytes", runs.index)
    runs["device_memory_source"] = _sources(memory, "device_used_source", runs.index)
    runs["peak_memory_bytes"] = runs["memory_per_device"].map(lambda m: max((p for _, p in m), default=math.nan))
    # N in the efficiency is processes or devices, whichever is more: DataParallel is one process driving
    # several GPUs (its record says so in `devices` or lists one memory entry per GPU), and two Gloo
    # processes sharing one CPU are still two workers.
    distinct = runs["memory_per_device"].map(lambda m: len({device for device, _ in m}))
    runs["devices"] = pd.concat([runs["world_size"], numbers(flat, "metrics.devices"), distinct], axis=1) \
        .max(axis=1).fillna(1).clip(lower=1).astype("int64")
    # A run no longer than its warm-up timed nothing: its throughput is "n/a", not missing.
    runs["not_timed"] = _column(flat, "metrics.step_time.steps_timed").map(lambda v: v == 0)
    runs["notes"] = _column(flat, "notes").map(lambda v: [str(n) for n in v if n] if isinstance(v, list) else [])
    runs["file"] = [_file(record, results_dir) for record in records]
    runs["slurm_job_id"] = [f"{job}_{task}" if job and task else job for job, task in
                            zip(texts(flat, "provenance.slurm.SLURM_JOB_ID"), texts(flat, "provenance.slurm.SLURM_ARRAY_TASK_ID"))]
    runs["git_dirty"] = _column(flat, "provenance.git.dirty").map(lambda v: v if isinstance(v, bool) else None)
    runs["command"] = _column(flat, "provenance.command").map(
        lambda v: [str(part) for part in v] if isinstance(v, list) else text(v))
    runs["record"] = records
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
    runs["_order"] = (runs["method"] != BASELINE_METHOD).astype(int)
    runs = pd.concat([runs, flat.drop(columns=[c for c in flat if c in runs or c == "_path"])], axis=1)
    order = ["lab", "model", "device_type", "machine", "devices", "_order", "method", "created", "run_id"]
    runs = runs.sort_values(order, na_position="last", kind="stable").drop(columns="_order")
    return runs.reset_index(drop=True).copy()  # one block per type: sections add columns to it


def _file(record: Mapping[str, Any], results_dir: Path | None) -> str | None:
    path = Path(record["_path"]) if record.get("_path") else None
    if path is not None and results_dir is not None and path.is_relative_to(results_dir):
        path = path.relative_to(results_dir)
    return str(path) if path is not None else None


def _median_per_device(memories: pd.Series) -> list[tuple[str, float]]:
    """The median peak of each device position over the repeats, so that the imbalance between a DataParallel
    job's first GPU and the others survives the combining; each position named by the first run that has it."""
    at = [[memory[i] for memory in memories if len(memory) > i] for i in range(max(map(len, memories), default=0))]
    return [(pairs[0][0], statistics.median(peak for _, peak in pairs)) for pairs in at]


def configurations_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration (successful runs only): repeats combined with the median."""
    groups = runs[runs["status"] == "ok"].groupby("configuration", sort=False)
    median = ("global_batch_size", "time_per_epoch_s", "samples_per_s", "speedup", "scaling_efficiency", "final_loss")
    configs = groups.agg(**{key: (key, "first") for key in (*CONFIGURATION_KEYS, "memory_source")},
                         runs=("run_id", "size"), **{key: (key, "median") for key in median},
                         samples_per_s_min=("samples_per_s", "min"), samples_per_s_max=("samples_per_s", "max"),
                         memory_per_device=("memory_per_device", _median_per_device))
    return configs.reset_index(drop=True)


def csv_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """The summary as plain columns for a spreadsheet: raw numbers (seconds, bytes), one row per run."""
    out = runs[["run_id", "lab", "method", "status", "model", "device_type", "device_name", "hostname", "machine",
                "world_size", "devices", "global_batch_size", "time_per_epoch_s", "samples_per_s",
                "peak_memory_bytes"]].copy()
    for column in ("world_size", "global_batch_size", "peak_memory_bytes"):  # counts, not 64.0
        out[column] = out[column].round().astype("Int64")
    for column, source in (("peak_memory_per_device", "memory_source"),
                           ("device_memory_per_device", "device_memory_source")):
        out[column] = runs[column if column != "peak_memory_per_device" else "memory_per_device"].map(
            lambda memory: ";".join(f"{device}={int(peak)}" for device, peak in memory))
        out[source] = runs[source]
    for column in ("baseline_samples_per_s", "speedup", "scaling_efficiency", "achieved_tflops", "mfu",
                   "final_loss", "test_accuracy", "slurm_job_id", "git_commit", "created", "file"):
        out[column] = runs[column]
    return out
