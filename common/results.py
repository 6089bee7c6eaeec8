"""Result records: one JSON file per run, with a versioned schema and full provenance.

A record is what a run measured (``metrics``), how it was configured (``config``) and where it ran
(``provenance``). Records are written atomically (temporary file, fsync, rename) so a crash never
leaves half a record, and :func:`load_records` reads a folder of them, reporting every file it
could not use by name instead of crashing. The schema is documented in ``docs/results-schema.md``.

This module must not import torch at import time: the report tool reads records without it.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from common.atomic import write_text_atomic
from common.measure.energy import not_measured
from common.precision import emulation_note
from common.runtime.envcheck import software_versions
from common.runtime.machine import cpu_description, gpu_description

SCHEMA_NAME = "hpc-dl-labs/result"
#: 2 added the required top-level ``energy`` entry (``common.measure.energy``); 3 the required
#: ``provenance.machine`` (``common.runtime.machine``: CPU model, cores, bf16/fp16 flags, GPU peaks).
#: Records of versions 1 and 2 are still read (the report labels their bf16 capability unknown). 4: one
#: key for "how far from the hardware", ``metrics.mfu`` (``common.precision.utilisation``); older records
#: are upgraded as they are read (:func:`upgrade_record`).
SCHEMA_VERSION = 4
#: Other JSON documents of the course that live among records (``scripts/gpu_proof.py``'s summary).
OTHER_SCHEMAS = ("hpc-dl-labs/gpu-proof",)
#: Versions of the schema this code can read.
READABLE_VERSIONS = (1, 2, 3, 4)
#: Top-level config values that mean the run computed in bf16 (``precision``, and the former names).
BF16_CONFIG_VALUES = ("bf16", "amp-bf16", "bfloat16")
#: What an ``energy`` entry's ``status`` may say.
ENERGY_STATUSES = ("ok", "unavailable")
#: Top-level keys every record must have, with their JSON types.
REQUIRED_KEYS: dict[str, type | tuple[type, ...]] = {
    "schema": str,
    "schema_version": int,
    "run_id": str,
    "created": str,
    "lab": str,
    "script": str,
    "method": str,
    "status": str,
    "config": dict,
    "metrics": dict,
    "provenance": dict,
}
#: Slurm variables copied into every record when present.
SLURM_KEYS = (
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_JOB_PARTITION",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NTASKS",
    "SLURM_CPUS_PER_TASK",
    "SLURM_GPUS_ON_NODE",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_RESTART_COUNT",
    "SLURM_CLUSTER_NAME",
)
_REPO_ROOT = Path(__file__).resolve().parent.parent


def _json_safe(value: Any) -> Any:
    """Turn paths, tuples, NaN/inf and other objects into plain JSON values."""
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _json_safe(value.item())
    return str(value)


def git_revision(repo: Path = _REPO_ROOT) -> dict[str, Any]:
    """The commit the code ran from and whether the tree had local changes (``None`` off git)."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def slurm_info(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``SLURM_*`` variables that describe the allocation (empty off-cluster)."""
    env = os.environ if env is None else env
    return {key: env[key] for key in SLURM_KEYS if key in env}


def device_info(device: Any) -> dict[str, Any]:
    """Device type, name(s) and count for a ``torch.device`` (imports torch)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        index = device.index if device.index is not None else torch.cuda.current_device()
        return {"type": "cuda", "name": torch.cuda.get_device_name(index), "index": index,
                "visible_devices": names, "count": len(names)}
    return {"type": device.type, "name": cpu_model_name(),
            "threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}


def fp32_math_info(device: Any) -> dict[str, Any]:
    """The float32 maths in force for matmuls and cuDNN convolutions (``ieee`` or ``tf32``), and
    whether the device has TF32 at all (``tf32_hardware``: CUDA compute capability 8.0 or newer)."""
    import torch

    from common.precision import fp32_math, gpu_support

    device = torch.device(device)
    hardware = device.type == "cuda" and gpu_support("tf32", torch.cuda.get_device_capability(device)) == "native"
    return {**fp32_math(), "tf32_hardware": hardware}


def cpu_model_name() -> str:
    """The CPU's marketing name (``/proc/cpuinfo``'s ``model name`` on Linux), else the architecture."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: Any = None) -> dict[str, Any]:
    """What this machine could do (``common.runtime.machine``): the CPU, and the CUDA ``device`` with its peaks."""
    machine: dict[str, Any] = {"cpu": cpu_description(), "gpus": []}
    if device is not None:
        import torch

        device = torch.device(device)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            machine["gpus"].append(gpu_description(props.name, (props.major, props.minor), int(props.total_memory)))
    return machine


def provenance(device: Any = None, world_size: int = 1, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Everything needed to say where and how a number was measured."""
    prov: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "command": [sys.executable, *sys.argv],
        "cwd": os.getcwd(),
        "world_size": int(world_size),
        "slurm": slurm_info(),
        "git": git_revision(),
    }
    if device is not None:
        prov["versions"] = software_versions()
        prov["device"] = device_info(device)
        prov["fp32_math"] = fp32_math_info(device)
    prov["machine"] = machine_info(device)
    if extra:
        prov.update(extra)
    return prov


def training_metrics(*, train_loss: list[float], loss_at_step: list[float], epoch_time_s: list[float],
                     step_time: Mapping[str, Any], steps: int, epochs: int, world_size: int,
                     memory: list[Mapping[str, Any]], global_batch_size: int | None,
                     test_loss: float | None = None, test_accuracy: float | None = None,
                     eval_history: Iterable[Mapping[str, Any]] = (),
                     replica_digests: list[Mapping[str, str]] | None = None,
                     whole_epochs_from: int = 1) -> dict[str, Any]:
    """The ``metrics`` of a training run, with the names ``docs/results-schema.md`` documents.

    Every training script's record is built here (through :class:`common.train.run.TrainingRun`), so
    the report reads the same keys from all of them. ``samples_per_s`` is the whole job's
    throughput (the step timer counts every rank's samples). ``whole_epochs_from``: the first epoch
    (from 1) this process ran whole; a resumed run's earlier epochs ran in another process (perhaps
    on other ranks) and the one it resumed inside only in part, so ``time_per_epoch_s`` leaves them out.
    """
    import statistics

    timed = list(epoch_time_s)[max(0, whole_epochs_from - 1):]

    metrics: dict[str, Any] = {
        "train_loss": list(train_loss), "final_loss": train_loss[-1] if train_loss else None,
        "loss_at_step": list(loss_at_step), "test_loss": test_loss, "test_accuracy": test_accuracy,
        "eval_history": [dict(entry) for entry in eval_history],
        "epochs": epochs, "steps": steps, "global_batch_size": global_batch_size,
        "world_size": world_size, "devices": world_size,
        "epoch_time_s": list(epoch_time_s),
        "time_per_epoch_s": statistics.median(timed) if timed else None,
        "samples_per_s": step_time.get("samples_per_s"), "step_time": dict(step_time),
        "memory": [dict(entry) for entry in memory],
    }
    if replica_digests is not None:
        metrics["replica_digests"] = [dict(d) for d in replica_digests]
        metrics["parameters_identical"] = len({d["parameters"] for d in replica_digests}) == 1
        metrics["buffers_identical"] = len({d["buffers"] for d in replica_digests}) == 1
    return metrics


def new_run_id(now: _dt.datetime | None = None) -> str:
    """A run's id, ``YYYYmmddTHHMMSS-<8 hex>`` (UTC), unique per run."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return f"{now:%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"


def make_record(
    *,
    lab: str,
    script: str,
    method: str,
    config: Mapping[str, Any],
    metrics: Mapping[str, Any],
    provenance: Mapping[str, Any],
    status: str = "ok",
    notes: Iterable[str] = (),
    energy: Mapping[str, Any] | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """Build a record dictionary in the current schema (see ``docs/results-schema.md``).

    ``run_id`` is :func:`new_run_id`'s, made here unless the run needed it earlier (a file of its own named after
    it, such as a profiler's trace).

    ``energy`` is what ``common.measure.energy.EnergyMeter.result()`` measured over the run's timed region;
    without it the record says energy was not measured (never a guessed number). A ``provenance``
    without ``machine`` gets this machine's CPU (records are made where the run ran); a bf16 run on
    a CPU that only emulates bf16 gets a note saying so (the report shows it as a warning).
    """
    provenance = dict(provenance)
    if not isinstance(provenance.get("machine"), Mapping):
        provenance["machine"] = machine_info()
    notes = list(notes)
    emulated = _bf16_emulation(config, provenance)
    if emulated and emulated not in notes:
        notes.append(emulated)

    now = _dt.datetime.now(_dt.timezone.utc)
    return _json_safe({
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id or new_run_id(now),
        "created": now.isoformat(timespec="seconds"),
        "lab": lab,
        "script": script,
        "method": method,
        "status": status,
        "config": dict(config),
        "metrics": dict(metrics),
        "provenance": provenance,
        "notes": notes,
        "energy": dict(energy) if energy is not None else not_measured(),
    })


def _bf16_emulation(config: Mapping[str, Any], prov: Mapping[str, Any]) -> str | None:
    """The emulation note when a CPU run computed in bf16 on a CPU without native bf16."""
    device = prov.get("device")
    cpu = prov["machine"].get("cpu")
    uses_bf16 = any(isinstance(value, str) and value.lower() in BF16_CONFIG_VALUES for value in config.values())
    if not (uses_bf16 and isinstance(device, Mapping) and device.get("type") == "cpu" and isinstance(cpu, Mapping)):
        return None
    return emulation_note(cpu)


def write_json_atomic(data: Any, path: str | os.PathLike[str]) -> Path:
    """:func:`~common.atomic.write_text_atomic` of ``data`` as indented JSON (NaN/inf become ``null``)."""
    text = json.dumps(_json_safe(data), indent=2, sort_keys=True, allow_nan=False) + "\n"
    return write_text_atomic(text, path)


def write_record(record: Mapping[str, Any], results_dir: str | os.PathLike[str]) -> Path:
    """Write ``record`` into ``results_dir`` as ``<lab>_<method>_<run_id>.json``; return its path."""
    problems = validate_record(record)
    if problems:
        raise ValueError(f"refusing to write an invalid record: {'; '.join(problems)}")
    safe = lambda s: "".join(c if c.isalnum() or c in "-_." else "-" for c in str(s))  # noqa: E731
    name = f"{safe(record['lab'])}_{safe(record['method'])}_{safe(record['run_id'])}.json"
    return write_json_atomic(record, Path(results_dir) / name)


def validate_record(record: Any) -> list[str]:
    """The reasons ``record`` is not a readable record (an empty list when it is)."""
    if not isinstance(record, Mapping):
        return [f"expected a JSON object, got {type(record).__name__}"]
    version = record.get("schema_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > max(READABLE_VERSIONS):
        # Another course's keys, or this one's from a newer commit: what it lacks by this code's schema says nothing.
        return [f"schema_version {version} is newer than this code reads ({', '.join(map(str, READABLE_VERSIONS))}): "
                "update the course's code (git pull) to read it"]
    problems = []
    for key, kind in REQUIRED_KEYS.items():
        if key not in record:
            problems.append(f"missing key '{key}'")
        elif not isinstance(record[key], kind) or (kind is int and isinstance(record[key], bool)):
            problems.append(f"key '{key}' should be {getattr(kind, '__name__', kind)}")
    if isinstance(record.get("schema"), str) and record["schema"] != SCHEMA_NAME:
        problems.append(f"schema is {record['schema']!r}, not {SCHEMA_NAME!r}")
    if isinstance(version, int) and version not in READABLE_VERSIONS:
        problems.append(f"schema_version {version} is not one this code reads {READABLE_VERSIONS}")
    if isinstance(version, int) and version >= 2:
        problems += _energy_problems(record.get("energy"))
    if isinstance(version, int) and version >= 3 and isinstance(record.get("provenance"), Mapping):
        machine = record["provenance"].get("machine")
        if not (isinstance(machine, Mapping) and isinstance(machine.get("cpu"), Mapping)
                and isinstance(machine.get("gpus"), list)):
            problems.append("provenance.machine should be an object with 'cpu' (object) and 'gpus' (list)")
    return problems


def _energy_problems(energy: Any) -> list[str]:
    """Why an ``energy`` entry is not one (version 2 and later require it)."""
    if energy is None:
        return ["missing key 'energy'"]
    if not isinstance(energy, Mapping):
        return ["key 'energy' should be dict"]
    status = energy.get("status")
    if status not in ENERGY_STATUSES:
        return [f"energy.status is {status!r}, not one of {ENERGY_STATUSES}"]
    joules = energy.get("joules")
    if status == "ok" and (isinstance(joules, bool) or not isinstance(joules, (int, float)) or joules < 0):
        return [f"energy.status is 'ok' but energy.joules is {joules!r}, not a number of joules"]
    if status == "unavailable" and not (isinstance(energy.get("reason"), str) and energy["reason"]):
        return ["energy.status is 'unavailable' without a reason"]
    return []


@dataclass
class LoadResult:
    """Records read from a folder, and the files that could not be used with the reason."""

    records: list[dict[str, Any]]
    errors: list[tuple[Path, str]]


#: Keys older records used, by the key version 4 reads (in ``metrics`` and ``metrics.floors``).
RENAMED_METRICS = {"fraction_of_peak": "mfu", "achieved_tflops_per_device": "achieved_tflops",
                   "peak_tflops_source": "peak_source"}
#: The precision flags' former names, as ``config`` keys (version 4: every script says ``--precision``).
RENAMED_CONFIG = {"amp": "precision", "mixed_precision": "precision", "precisions": "precision",
                  "dtypes": "precision"}


def upgrade_record(record: dict[str, Any]) -> dict[str, Any]:
    """A record of an older version, read as version 4 reads it (the file is left as it is)."""
    if record.get("schema_version", SCHEMA_VERSION) >= 4:
        return record
    config = record.get("config")
    if isinstance(config, dict):
        for old, new in RENAMED_CONFIG.items():
            if old in config and new not in config:
                config[new] = config.pop(old)
    for holder in (record.get("metrics"), (record.get("metrics") or {}).get("floors")):
        if isinstance(holder, dict):
            for old, new in RENAMED_METRICS.items():
                if old in holder and new not in holder:
                    holder[new] = holder.pop(old)
            if isinstance(holder.get("reasons"), dict) and "fraction_of_peak" in holder["reasons"]:
                holder["reasons"]["mfu"] = holder["reasons"].pop("fraction_of_peak")
    return record


def read_only_record(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The one record that a run started by another script (a sweep's step, a scaling point) wrote into a
    folder of its own, as written: the script adds to it and writes it again."""
    files = sorted(Path(folder).glob("*.json"))
    if len(files) != 1:
        raise RuntimeError(f"expected one record in {folder}, found {len(files)}")
    return json.loads(files[0].read_text(encoding="utf-8"))


def load_records(folder: str | os.PathLike[str], recursive: bool = True) -> LoadResult:
    """Read every ``*.json`` record under ``folder``; bad files are reported, not fatal. Files of
    another of the course's schemas (``hpc-dl-labs/gpu-proof``, say) are left out without a word, and so
    are profiler traces (``*trace.json``: Chrome's trace format, which the profiling lessons write into the
    results folder), unread: a trace can be hundreds of megabytes.

    Raises ``FileNotFoundError`` when ``folder`` does not exist or is not a directory.
    """
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"results folder not found: {root}")
    pattern = "**/*.json" if recursive else "*.json"
    records: list[dict[str, Any]] = []
    errors: list[tuple[Path, str]] = []
    for path in sorted(root.glob(pattern)):
        if path.name.startswith(".") or path.name.endswith("trace.json"):  # an atomic write in progress; a trace
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            errors.append((path, f"not valid JSON ({err})"))
            continue
        if isinstance(data, dict) and data.get("schema") in OTHER_SCHEMAS:
            continue  # another document of the course, kept beside records: not a record, not an error
        problems = validate_record(data)
        if problems:
            errors.append((path, "; ".join(problems)))
            continue
        data = upgrade_record(data)
        data["_path"] = str(path)
        records.append(data)
    return LoadResult(records=records, errors=errors)
