"""Result records -> one tidy frame of runs, a row per record and a column per key (named by its path in
``docs/results-schema.md``). The readers (:func:`numbers`, :func:`texts`, :func:`flags`, :func:`entries`) type a
value or give NaN/``None``, so a record from an older script, another lab or a crashed run still gets its row.

Scaling efficiency follows the Lab-01 handout's table: ``throughput(N devices) / (N x baseline throughput)``, the
baseline being the median of the single-device ``baseline`` runs of the same lab, model, device type and machine.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Iterable, Mapping

import pandas as pd

from common.runtime.machine import describe_machine, machine_label

BASELINE_METHOD = "baseline"
#: DDP below this scaling efficiency is flagged (the Lab-01 handout's 4-GPU run reached 94%).
DDP_MIN_EFFICIENCY = 0.80
#: A run is compared only with runs that share these: same lab, model, kind of device and machine; a dry run (a check
#: that the script runs) only with dry runs.
COMPARISON_KEYS = ("lab", "model", "device_type", "machine", "dry_run")
#: One configuration (another batch, epoch count or step cap is another): a line of Lab-01's table; repeats: the median.
CONFIGURATION_KEYS = (*COMPARISON_KEYS, "method", "world_size", "devices", "global_batch_size", "epochs", "max_steps")
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


def is_ddp(method: object) -> bool:
    return isinstance(method, str) and (method == "ddp" or method.startswith(("ddp-", "ddp_", "ddp+")))


def text(value: Any) -> str | None:
    """A short display string for a name-like value; ``None`` when missing, empty, NaN or a list or object."""
    if value is None or isinstance(value, (dict, list)) or value != value:
        return None
    return str(value).strip() or None


def _column(frame: pd.DataFrame, key: str) -> pd.Series:
    return frame[key] if key in frame else pd.Series(None, index=frame.index, dtype=object)


def numbers(frame: pd.DataFrame, key: str) -> pd.Series:
    """``frame[key]`` as floats (NaN where missing or not a finite number); all NaN when no row has the key."""
    return _column(frame, key).map(number).astype("float64")


def texts(frame: pd.DataFrame, key: str) -> pd.Series:
    """``frame[key]`` as text (``None`` where missing, empty, or a list or object)."""
    return _column(frame, key).map(text).astype(object)


def flags(frame: pd.DataFrame, key: str) -> pd.Series:
    """``frame[key]`` as booleans: True only where the record holds ``true``."""
    return _column(frame, key).map(lambda v: v is True).astype(bool)


def flatten(value: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: objects (JSON's, so dicts) are opened, lists and values stay whole."""
    flat: dict[str, Any] = {}
    for name, item in value.items():
        flat.update(flatten(item, f"{prefix}{name}.") if isinstance(item, dict) else {f"{prefix}{name}": item})
    return flat


def entries(frame: pd.DataFrame, key: str, *keep: str) -> pd.DataFrame:
    """A row per object of the list under ``key`` of each row, flattened, with ``_run`` (that row's label),
    ``_position`` (its place in the list) and that row's ``keep`` columns."""
    rows = [{"_run": label, "_position": position, **flatten(item)}
            for label, value in _column(frame, key).items() if isinstance(value, list)
            for position, item in enumerate(value) if isinstance(item, dict)]
    found = pd.DataFrame(rows, columns=None if rows else ["_run", "_position"], dtype=object)
    return found.join(frame.reindex(columns=list(keep)), on="_run") if keep else found


def largest(frame: pd.DataFrame, list_key: str, key: str) -> pd.Series:
    """Per row, the largest number under ``key`` in the objects of its list ``list_key`` (the busiest rank)."""
    found = entries(frame, list_key)
    return numbers(found, key).groupby(found["_run"]).max().reindex(frame.index)


def losses(frame: pd.DataFrame, key: str = "metrics.loss_at_step") -> pd.Series:
    """Per row, the list under ``key`` with ``None`` for each value that is not a number (``[]`` without a list)."""
    return _column(frame, key).map(lambda v: [number(x) for x in v] if isinstance(v, list) else [])


def step_differences(losses: list, reference: list) -> dict[int, float]:
    """Step (counted from 1) -> ``|loss - reference| / |reference|``, at the steps where both are numbers."""
    return {step: abs(a - b) / abs(b) for step, (a, b) in enumerate(zip(losses, reference), 1) if a is not None and b}


def largest_loss_difference(runs: pd.DataFrame, references: pd.Series, start: pd.Series | None = None) -> pd.Series:
    """Per run, the largest of its :func:`step_differences` (``losses`` column) from a reference run with the same
    ``key`` column, from step ``start`` on (where it resumed): the closest reference where there are several."""
    found = []
    for position, run in enumerate(runs.to_dict("records")):
        offset = 0 if start is None else int(start.iloc[position])
        worst = [max(steps.values()) for reference in runs.loc[references & (runs["key"] == run["key"]), "losses"]
                 if (steps := step_differences(run["losses"], reference[offset:]))]
        found.append(min(worst) if worst and not references.iloc[position] else None)
    return pd.Series(found, index=runs.index, dtype=float)


def _memory(memory: pd.DataFrame, key: str, source: str, index: pd.Index) -> tuple[pd.Series, pd.Series]:
    """Per run: ``[(device, bytes), ...]`` under ``key`` of its ``metrics.memory``, and the sources, in words."""
    values = numbers(memory, key)
    names = texts(memory, "device").fillna("device " + memory["_position"].astype(str))
    pairs = pd.Series(list(zip(names, values)), index=memory.index, dtype=object)[values.notna()]
    found = pairs.groupby(memory["_run"][values.notna()]).agg(list) if len(pairs) else pd.Series(dtype=object)
    words = texts(memory, source).map(lambda s: MEMORY_SOURCES.get(s, s)).dropna()
    named = words.groupby(memory["_run"][words.index]).agg(lambda s: ", ".join(sorted(set(s))))
    return (pd.Series([found.get(label, []) for label in index], index=index, dtype=object),
            pd.Series([named.get(label, "") for label in index], index=index, dtype=object))


def shown_path(path: Path, results_dir: Path | None) -> str:
    """A file's name as the user knows it: relative to the results folder when inside it."""
    return str(path.relative_to(results_dir) if results_dir is not None and path.is_relative_to(results_dir) else path)


def shape(frame: pd.DataFrame, prefix: str = "config.") -> pd.Series:
    """A transformer's size as shown and compared: ``"4 × 64"`` (``<prefix>layers`` × ``<prefix>width``), else None."""
    layers, width = numbers(frame, f"{prefix}layers"), numbers(frame, f"{prefix}width")
    return pd.Series([None if pd.isna(l) or pd.isna(w) else f"{l:.0f} × {w:.0f}" for l, w in zip(layers, width)],
                     index=frame.index, dtype=object)


def group_key(frame: pd.DataFrame, columns: Iterable[str]) -> pd.Series:
    """One string per row naming its group; missing values become "" so they group together."""
    return frame.reindex(columns=list(columns)).apply(lambda row: "\x1f".join(text(v) or "" for v in row), axis=1)


def runs_frame(records: Iterable[Mapping[str, Any]], results_dir: Path | None = None) -> pd.DataFrame:
    """The table of runs, sorted by comparison group: the typed columns first, then every record key."""
    records = list(records)
    flat = pd.DataFrame([flatten(record) for record in records], dtype=object)
    runs = pd.DataFrame({name: texts(flat, key) for name, key in TEXT_COLUMNS.items()} | {
        name: numbers(flat, f"metrics.{name}") for name in SUMMARY_METRICS if name not in ("devices", "memory")})
    runs["world_size"] = runs["world_size"].fillna(numbers(flat, "provenance.world_size"))
    provenances = [p if isinstance(p := record.get("provenance"), Mapping) else {} for record in records]
    runs["machine"] = [machine_label(p) for p in provenances]
    runs["machine_detail"] = [describe_machine(p) for p in provenances]
    memory = entries(flat, "metrics.memory")
    runs["memory_per_device"], runs["memory_source"] = _memory(memory, "peak_bytes", "source", runs.index)
    runs["device_memory_per_device"], runs["device_memory_source"] = _memory(
        memory, "device_used_bytes", "device_used_source", runs.index)
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
    runs["file"] = [shown_path(Path(record["_path"]), results_dir) if record.get("_path") else None
                    for record in records]
    job, task = texts(flat, "provenance.slurm.SLURM_JOB_ID"), texts(flat, "provenance.slurm.SLURM_ARRAY_TASK_ID")
    runs["slurm_job_id"] = [f"{j}_{t}" if j and t else j for j, t in zip(job, task)]
    runs["git_dirty"] = _column(flat, "provenance.git.dirty").map(lambda v: v if isinstance(v, bool) else None)
    runs["command"] = _column(flat, "provenance.command").map(
        lambda v: [str(part) for part in v] if isinstance(v, list) else text(v))
    runs["record"] = records
    runs["dry_run"], runs["epochs"] = flags(flat, "config.dry_run"), numbers(flat, "config.epochs")
    runs["max_steps"] = numbers(flat, "config.max_steps")
    runs["comparison"] = group_key(runs, COMPARISON_KEYS)
    runs["configuration"] = group_key(runs, CONFIGURATION_KEYS)

    is_baseline = (runs["method"] == BASELINE_METHOD) & (runs["devices"] == 1)
    usable = is_baseline & (runs["status"] == "ok") & runs["samples_per_s"].notna()
    baseline = runs[usable].groupby("comparison")["samples_per_s"].median()
    runs["baseline_samples_per_s"] = runs["comparison"].map(baseline).astype("float64")
    compared = ~is_baseline & runs["baseline_samples_per_s"].notna() & (runs["status"] == "ok")  # a failed run: none
    runs["speedup"] = (runs["samples_per_s"] / runs["baseline_samples_per_s"]).where(compared)
    runs["scaling_efficiency"] = (runs["speedup"] / runs["devices"]).where(compared & (runs["devices"] > 1))

    # Baseline first, then the other methods by name: the order of the Lab-01 handout's table.
    runs["_order"] = (runs["method"] != BASELINE_METHOD).astype(int)
    runs = pd.concat([runs, flat.drop(columns=[c for c in flat if c in runs or c == "_path"])], axis=1)
    order = ["lab", "model", "device_type", "machine", "devices", "_order", "method", "created", "run_id"]
    runs = runs.sort_values(order, na_position="last", kind="stable").drop(columns="_order")
    return runs.reset_index(drop=True).copy()  # one block per type: sections add columns to it


def _median_per_device(memories: pd.Series) -> list[tuple[str, float]]:
    """The median peak of each device position over the repeats: a DataParallel job's imbalance survives."""
    at = [[memory[i] for memory in memories if len(memory) > i] for i in range(max(map(len, memories), default=0))]
    return [(pairs[0][0], statistics.median(peak for _, peak in pairs)) for pairs in at]


def configurations_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration (successful runs only): repeats combined with the median."""
    groups = runs[runs["status"] == "ok"].groupby("configuration", sort=False)
    median = ("time_per_epoch_s", "samples_per_s", "speedup", "scaling_efficiency", "final_loss")
    return groups.agg(**{key: (key, "first") for key in (*CONFIGURATION_KEYS, "memory_source")},
                      runs=("run_id", "size"), **{key: (key, "median") for key in median},
                      samples_per_s_min=("samples_per_s", "min"), samples_per_s_max=("samples_per_s", "max"),
                      memory_per_device=("memory_per_device", _median_per_device)).reset_index(drop=True)


def csv_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """The summary as plain columns for a spreadsheet: raw numbers (seconds, bytes), one row per run."""
    joined = lambda memory: ";".join(f"{device}={int(peak)}" for device, peak in memory)  # noqa: E731
    return runs.assign(
        peak_memory_per_device=runs["memory_per_device"].map(joined),
        device_memory_per_device=runs["device_memory_per_device"].map(joined),
        **{count: runs[count].round().astype("Int64")  # counts, not 64.0
           for count in ("world_size", "global_batch_size", "peak_memory_bytes")},
    )[["run_id", "lab", "method", "status", "model", "device_type", "device_name", "hostname", "machine",
       "world_size", "devices", "global_batch_size", "time_per_epoch_s", "samples_per_s", "peak_memory_bytes",
       "peak_memory_per_device", "memory_source", "device_memory_per_device", "device_memory_source",
       "baseline_samples_per_s", "speedup", "scaling_efficiency", "achieved_tflops", "mfu", "final_loss",
       "test_accuracy", "slurm_job_id", "git_commit", "created", "file"]]
