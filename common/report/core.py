"""The sections every report has: warnings, summary, repeats, plots, other metrics, provenance."""

from __future__ import annotations

import shlex
from collections import Counter
from typing import Any

import pandas as pd

from common.report.checks import DDP_MIN_EFFICIENCY, Finding, is_ddp, missing_baselines, mixed_machines, out_of_range
from common.report.runs import BASELINE_METHOD, SUMMARY_METRICS, get, number
from common.report.sections import (
    LABS_WITHOUT_SCALING, MISSING, Cell, Column, Row, Section, Table, fmt_int, fmt_memory, fmt_number,
    fmt_percent, fmt_rate, fmt_ratio, fmt_seconds, fmt_text, is_missing, num, number_column, table_from_frame, text_column,
)

#: How many extra metric columns a lab's "other metrics" table shows at most.
MAX_EXTRA_METRICS = 14


def warnings_section(unreadable: list[tuple[str, str]], runs: pd.DataFrame, problems: list[Finding]) -> Section:
    """Files skipped, runs from mixed machines or out of their expected range, sections that failed."""
    findings = mixed_machines(runs) + out_of_range(runs) + problems
    items = [f"skipped {name}: {reason}" for name, reason in unreadable]
    items += [f"{finding.subject}: {finding.message}" for finding in findings]
    paragraphs = [] if items else [
        "No warnings: every file was read and every result is within its expected range."]
    return Section("Warnings", paragraphs=paragraphs, items=items)


def _efficiency_cell(run: Row) -> Cell:
    value = run["scaling_efficiency"]
    low = is_ddp(run["method"]) and not is_missing(value) and value < DDP_MIN_EFFICIENCY
    return Cell(fmt_percent(value), style="num warn" if low else "num")


def _speedup_cell(run: Row) -> Cell:
    value = run["speedup"]
    if run["not_timed"] and is_missing(value):
        return Cell("n/a", title="this run timed no step, so there is no speed-up to compute", style="num")
    return Cell(fmt_ratio(value), title=f"baseline: {fmt_rate(run['baseline_samples_per_s'])} samples/s"
                if not is_missing(value) else None, style="num")


def _rate_cell(run: Row) -> Cell:
    if run["not_timed"] and is_missing(run["samples_per_s"]):
        return Cell("n/a", title="no step was timed: the run was no longer than its warm-up", style="num")
    return num(fmt_rate(run["samples_per_s"]))


def _device_cell(run: Row) -> Cell:
    return Cell(fmt_text(run["device_type"]), title=None if is_missing(run["device_name"]) else run["device_name"])


def _run_cell(run: Row) -> Cell:
    return Cell(fmt_text(run["run_id"]), title=None if is_missing(run["file"]) else run["file"], style="id")


DEVICE_MEMORY_COLUMN = ("GPU memory in use per device",
                        lambda r: fmt_memory(r["device_memory_per_device"], r["device_memory_source"]))

#: What ran where: the first columns of the summary and of the repeats.
WHAT_RAN = [text_column("lab"), text_column("method"), text_column("model"), text_column("machine")]

SUMMARY_COLUMNS = [
    ("run", _run_cell), *WHAT_RAN, ("device", _device_cell),
    number_column("world size", "world_size", fmt_int), number_column("devices", "devices", fmt_int),
    number_column("global batch", "global_batch_size", fmt_int),
    number_column("time / epoch", "time_per_epoch_s", fmt_seconds),
    ("peak memory per device", lambda r: fmt_memory(r["memory_per_device"], r["memory_source"])),
    ("samples/s", _rate_cell), number_column("TFLOP/s", "achieved_tflops", fmt_number, 3),
    ("% of peak", lambda r: Cell(fmt_percent(r["fraction_of_peak"], 1), style="num",
                                 title=None if is_missing(r["fraction_of_peak"]) else
                                 "achieved TFLOP/s ÷ the GPU's dense datasheet peak for the precision in force")),
    ("speed-up vs baseline", _speedup_cell), ("scaling efficiency", _efficiency_cell),
    number_column("final loss", "final_loss", fmt_number),
    number_column("test accuracy", "test_accuracy", fmt_percent, 1),
    ("status", lambda r: Cell(fmt_text(r["status"]), style="" if r["status"] == "ok" else "warn")),
]


def summary_section(runs: pd.DataFrame) -> Section:
    """One row per run; a column no run has a value in is left out, and so is the note that explains it.
    Labs that are not about scaling (LABS_WITHOUT_SCALING) have no speed-up or efficiency columns."""
    scaling = not runs["lab"].isin(LABS_WITHOUT_SCALING).all()
    columns = SUMMARY_COLUMNS if scaling else [
        column for column in SUMMARY_COLUMNS if column[0] not in ("speed-up vs baseline", "scaling efficiency")]
    if "device_memory_per_device" in runs and any(runs["device_memory_per_device"].map(bool)):
        # After the allocator's peak: what the driver counts, which the allocator does not see.
        position = next(i for i, (name, _) in enumerate(columns) if name == "peak memory per device") + 1
        columns = [*columns[:position], DEVICE_MEMORY_COLUMN, *columns[position:]]
    table = table_from_frame(runs, columns, id="summary-table", drop_empty=True,
                             caption=f"{len(runs)} run{'s' if len(runs) != 1 else ''}, one row each")
    shown = set(table.columns)
    notes = []
    if shown & {"speed-up vs baseline", "scaling efficiency"}:
        ddp_measured = any(is_ddp(run["method"]) and not is_missing(run["scaling_efficiency"])
                           for run in runs.to_dict("records"))
        notes.append(
            f"Scaling efficiency = samples/s ÷ (devices × samples/s of the single-device '{BASELINE_METHOD}' "
            "run of the same lab, model and device type on the same machine; the median when it ran several "
            "times). Speed-up = samples/s ÷ that baseline."
            + (f" DDP is expected to reach {DDP_MIN_EFFICIENCY:.0%}." if ddp_measured else ""))
    if "% of peak" in shown:
        notes.append("TFLOP/s is what the run achieved (its FLOPs ÷ its measured time); % of peak divides it by the "
                     "GPU's dense datasheet peak for the precision in force (common/measure/gpu_peaks.py).")
    if "peak memory per device" in shown:
        notes.append(
            "Memory on CUDA is the caching allocator's peak (torch.cuda.max_memory_allocated): tensors only; on "
            "CPU it is the peak resident set of the whole process (Python, PyTorch and the data set included). "
            "Several values are the devices of one run, first device first.")
    if DEVICE_MEMORY_COLUMN[0] in shown:
        notes.append("GPU memory in use is what the driver counts when the run ends: the CUDA context, cuBLAS/cuDNN "
                     "workspaces, NCCL's buffers and the allocator's cache, none of which the allocator's peak "
                     "includes (so DDP looks leaner than it is by the peak alone). Its source is NVML's figure for "
                     "the process, or cudaMemGetInfo for the whole GPU (other processes included); hover a cell "
                     "to see which.")
    for run in runs.to_dict("records"):
        notes += [f"Note from run {run['run_id']} ({run['lab']} {run['method']}): {note}" for note in run["notes"]]
    releases = Counter(fmt_text(get(record, "provenance", "versions", "torch")) for record in runs["record"])
    if len(releases) > 1:  # a comparison across PyTorch releases measures the releases too
        notes.append(f"These runs used {len(releases)} PyTorch releases ("
                     + ", ".join(f"{release}: {count} run{'s' if count != 1 else ''}"
                                 for release, count in sorted(releases.items()))
                     + "): part of a difference between them may be the release. Each run's is in the provenance table.")
    lacking = missing_baselines(runs) if scaling else []
    if lacking:
        notes.append(f"No '{BASELINE_METHOD}' run to compute an efficiency for: " + "; ".join(lacking) + ".")
    return Section("Summary", paragraphs=[], tables=[table], notes=notes)


CONFIGURATION_COLUMNS = [
    *WHAT_RAN, number_column("devices", "devices", fmt_int), number_column("runs", "runs", fmt_int),
    number_column("global batch", "global_batch_size", fmt_int),
    number_column("time / epoch (median)", "time_per_epoch_s", fmt_seconds),
    ("peak memory per device (median)", lambda c: fmt_memory(c["memory_per_device"], c["memory_source"])),
    number_column("samples/s (median)", "samples_per_s", fmt_rate),
    ("samples/s (min – max)", lambda c: num(f"{fmt_rate(c['samples_per_s_min'])} – {fmt_rate(c['samples_per_s_max'])}"
                                            if not is_missing(c["samples_per_s"]) else MISSING)),
    number_column("scaling efficiency (median)", "scaling_efficiency", fmt_percent),
]


def configurations_section(configs: pd.DataFrame) -> Section | None:
    """Shown only when some configuration ran more than once (otherwise it repeats the summary)."""
    if configs.empty or configs["runs"].max() < 2:
        return None
    table = table_from_frame(configs, CONFIGURATION_COLUMNS, id="configurations-table", row_id_column=None,
                             caption="Successful runs with the same lab, method, model, machine and devices")
    return Section("Repeats combined", tables=[table])


def plots_section(configs: pd.DataFrame) -> Section | None:
    from common.report import plots  # matplotlib is imported only when plots are wanted

    figures = [fig for fig in (plots.throughput_figure(configs), plots.memory_figure(configs),
                               plots.efficiency_figure(configs)) if fig is not None]
    if not figures:
        return Section("Plots", paragraphs=["No run recorded throughput or memory, so there is nothing to plot."])
    return Section("Plots", figures=figures)


def _scalar_metrics(metrics: Any) -> dict[str, Any]:
    """Metrics not in the summary that fit in a cell: numbers, text, and one level of nested objects."""
    if not isinstance(metrics, dict):
        return {}
    values = {}
    for key, value in metrics.items():
        if key in SUMMARY_METRICS:
            continue
        if isinstance(value, dict):
            for inner, inner_value in value.items():
                if isinstance(inner_value, (int, float, str)):
                    values[f"{key}.{inner}"] = inner_value
        elif isinstance(value, (int, float, str)):
            values[key] = value
    return values


#: Longer text in "Other metrics" is cut here, the whole of it on hover: a sentence in a cell made
#: its row 200 px tall.
MAX_METRIC_TEXT = 40


def _fmt_metric(value: Any) -> Cell:
    if isinstance(value, str) and len(value) > MAX_METRIC_TEXT:
        return Cell(value[:MAX_METRIC_TEXT - 1].rstrip() + "…", title=value, style="long")
    if isinstance(value, (bool, str)):
        return Cell(str(value))
    if number(value) is None:
        return Cell(MISSING)
    return num(fmt_int(value) if isinstance(value, int) else fmt_number(value))


def other_metrics_section(runs: pd.DataFrame) -> Section | None:
    """Per lab, the metrics a script recorded beyond the summary's columns (every lab has some)."""
    tables = []
    for lab, lab_runs in runs.groupby(runs["lab"].fillna(MISSING), sort=True):
        extras = [_scalar_metrics(get(record, "metrics")) for record in lab_runs["record"]]
        counts: dict[str, int] = {}
        for values in extras:
            for key in values:
                counts[key] = counts.get(key, 0) + 1
        if not counts:
            continue
        # Most common first; a script's own top-level values before the insides of objects like step_time.
        keys = sorted(counts, key=lambda k: (-counts[k], "." in k, k))[:MAX_EXTRA_METRICS]
        columns = [text_column("run", "run_id"), text_column("method")]
        frame = lab_runs[["run_id", "method"]].copy()
        for i, key in enumerate(keys):
            frame[f"_m{i}"] = [values.get(key) for values in extras]
            columns.append((key, lambda r, column=f"_m{i}": _fmt_metric(r[column])))
        caption = f"{lab}: {len(counts)} other metric{'s' if len(counts) != 1 else ''}"
        if len(counts) > len(keys):
            caption += f" (the {len(keys)} most common shown)"
        tables.append(table_from_frame(frame, columns, caption=caption))
    if not tables:
        return None
    return Section("Other metrics", paragraphs=["What each lab's scripts measured beyond the summary's columns."],
                   tables=tables)


def _energy_cells(run: Row) -> list[Cell]:
    energy = get(run["record"], "energy")
    if not isinstance(energy, dict):
        return [Cell("not recorded", title="written before schema version 2, which added energy"),
                *[num(MISSING)] * 4]
    if energy.get("status") != "ok":
        return [Cell("unavailable", title=fmt_text(energy.get("reason"))), *[num(MISSING)] * 4]
    return [Cell("ok"), num(fmt_number(number(energy.get("joules")), 4)), Cell(fmt_text(energy.get("source"))),
            num(fmt_number(number(energy.get("joules_per_sample")), 3)),
            num(fmt_number(number(energy.get("watts")), 3))]


ENERGY_COLUMNS = ["run", "lab", "method", "energy", "joules", "source", "J / sample", "mean W"]


def energy_section(runs: pd.DataFrame) -> Section:
    """Every run's energy over its timed region, or why none could be read."""
    rows = [[_run_cell(run), Cell(fmt_text(run["lab"])), Cell(fmt_text(run["method"])), *_energy_cells(run)]
            for run in runs.to_dict("records")]
    table = Table(columns=ENERGY_COLUMNS, rows=rows, id="energy-table", row_ids=[fmt_text(r) for r in runs["run_id"]])
    measured = sum(1 for row in rows if row[3].text == "ok")
    reasons = sorted({row[3].title for row in rows if row[3].text == "unavailable" and row[3].title})
    notes = [f"Why energy was unavailable: {reason}" for reason in reasons[:5]]
    return Section("Energy", paragraphs=[
        f"{measured} of {len(rows)} run(s) measured their energy: NVML's counter of each GPU plus the RAPL counters "
        "of each node's CPU packages where readable, else Slurm's ConsumedEnergy (common/measure/energy.py). Hover over "
        "'unavailable' for the reason; no number is estimated."], tables=[table], notes=notes)


def _command(value: Any) -> str:
    if isinstance(value, list):
        return shlex.join(value)
    return fmt_text(value)


def _commit(run: Row) -> str:
    commit = run["git_commit"]
    if is_missing(commit):
        return MISSING
    return f"{commit[:12]}{' (dirty)' if run['git_dirty'] else ''}"


def _version(header: str, name: str) -> Column:
    return header, lambda r: fmt_text(get(r["record"], "provenance", "versions", name))


PROVENANCE_COLUMNS = [
    ("run", _run_cell), text_column("file"), text_column("created (UTC)", "created"),
    text_column("host", "hostname"), text_column("device name", "device_name"),
    ("what the machine could do", lambda r: Cell(fmt_text(r["machine_detail"]), style="wide")),
    ("launcher", lambda r: fmt_text(get(r["record"], "provenance", "distributed", "launcher"))),
    # torch.version.cuda and cuDNN's version are what this PyTorch was built with, true on a machine
    # with no GPU at all; NCCL is the version PyTorch loaded.
    *(_version(header, name) for header, name in
      (("python", "python"), ("torch", "torch"), ("PyTorch built with CUDA", "cuda"),
       ("PyTorch built with cuDNN", "cudnn"), ("NCCL", "nccl"))),
    ("git commit", _commit),
    text_column("Slurm job", "slurm_job_id"),
    ("command", lambda r: Cell(_command(r["command"]), style="code")),
]


def provenance_section(runs: pd.DataFrame) -> Section:
    table = table_from_frame(runs, PROVENANCE_COLUMNS, id="provenance-table")
    return Section("Provenance", paragraphs=[
        "Where and how each run was measured, from its record. The CUDA and cuDNN versions are those the "
        "installed PyTorch was built with (torch.version.cuda), shown on a CPU run too: they say nothing about "
        "the machine's GPU or driver."], tables=[table])

