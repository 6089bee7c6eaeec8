"""The sections every report has: warnings, summary, repeats, plots, energy, other metrics, provenance. A warning
names a result outside the range the course teaches (DDP scales almost linearly on one node, DataParallel on several
GPUs beats one GPU) so a student can act on it; it is not an error."""

from __future__ import annotations

import datetime as _dt
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from common.precision import BF16_EMULATION_PREFIX
from common.report import plots
from common.report.runs import BASELINE_METHOD, DDP_MIN_EFFICIENCY, SUMMARY_METRICS, is_ddp, number, numbers, texts
from common.report.sections import (LABS_WITHOUT_SCALING, MISSING, TEMPLATES, Cell, Row, Section, fmt, fmt_memory,
                                    is_missing, table_from_frame)

#: How many extra metric columns a lab's "other metrics" table shows at most.
MAX_EXTRA_METRICS = 14
#: Longer text in "Other metrics" is cut here, the whole of it on hover: a sentence in a cell made its row 200 px tall.
MAX_METRIC_TEXT = 40
DP_METHODS = ("dp", "dataparallel")
#: The record keys the summary reads as numbers: a record that holds text there gets a warning, not a silent dash.
NUMBER_KEYS = [f"metrics.{name}" for name in SUMMARY_METRICS if name not in ("devices", "memory")]


@dataclass(frozen=True)
class Finding:
    """One warning: what it is about (a run id or a file name) and what is wrong, in words."""

    subject: str
    message: str


def _describe(run: Mapping[str, Any]) -> str:
    return ", ".join(part for key in ("lab", "model", "device_type", "machine") if isinstance(part := run[key], str))


def out_of_range(runs: pd.DataFrame) -> list[Finding]:
    """Runs that did not finish, bf16 runs on a CPU that emulates bf16, DDP runs below
    :data:`DDP_MIN_EFFICIENCY`, DP runs slower than baseline."""
    findings = []
    for run in runs.to_dict("records"):
        subject = f"run {run['run_id']} ({run['lab']} {run['method']})"
        findings += [Finding(subject, f"{key} is {run[key]!r}, not a number: the tables show {MISSING}") for key in
                     NUMBER_KEYS if number(run.get(key)) is None and not is_missing(run.get(key))]
        if run["status"] != "ok":
            reason = f": {run['notes'][0]}" if run["notes"] else ""
            findings.append(Finding(subject, f"status is '{run['status']}'{reason}"))
            continue
        # A CPU that emulates bf16: its bf16 timing is not what bf16 hardware does.
        findings += [Finding(subject, note) for note in run["notes"] if note.startswith(BF16_EMULATION_PREFIX)]
        efficiency = run["scaling_efficiency"]
        # DDP on CPU: the "devices" are processes sharing one machine's cores, so the GPU expectation
        # does not apply; the Lab-01 section explains the number instead of flagging it.
        if (is_ddp(run["method"]) and run["device_type"] != "cpu" and pd.notna(efficiency)
                and efficiency < DDP_MIN_EFFICIENCY):
            findings.append(Finding(subject, (
                f"DDP scaling efficiency {efficiency:.0%} on {run['devices']} devices is under the expected "
                f"{DDP_MIN_EFFICIENCY:.0%} ({_describe(run)})")))
        # DataParallel on one device (the CPU case) is the baseline plus overhead: only on several should it be faster.
        speedup = run["speedup"]
        if run["method"] in DP_METHODS and run["devices"] > 1 and pd.notna(speedup) and speedup < 1:
            findings.append(Finding(subject, (
                f"DataParallel on {run['devices']} devices is slower than the single-device baseline "
                f"({run['samples_per_s']:,.1f} vs {run['baseline_samples_per_s']:,.1f} samples/s; {_describe(run)})")))
    return findings


def measuring_machines(runs: pd.DataFrame) -> list[str]:
    """The machines of the runs with a device: not Lab-09's sweep records, made on a login node."""
    return sorted({str(m) for m in runs.loc[runs["device_type"].notna(), "machine"].dropna()})


def mixed_machines(runs: pd.DataFrame) -> list[Finding]:
    """One warning when runs with a device come from several machines."""
    machines = measuring_machines(runs)
    return [Finding(f"{len(machines)} machines", (
        "this report mixes records of different machines (" + "; ".join(machines) + "): compare a number only "
        "with numbers of the same machine (the summary's machine column); speed-ups and efficiencies are "
        "computed within one machine"))] if len(machines) > 1 else []


def missing_baselines(runs: pd.DataFrame) -> list[str]:
    """Comparison groups with multi-device runs but no baseline throughput to compute an efficiency from, each saying
    when its baseline run is there but has none (a tiny run no longer than its warm-up times no step)."""
    lacking = runs[(runs["devices"] > 1) & runs["baseline_samples_per_s"].isna()]
    there = set(runs.loc[(runs["method"] == BASELINE_METHOD) & (runs["devices"] == 1), "comparison"])
    return sorted({_describe(run) + (" (its baseline run measured no throughput: it failed, or timed no step past "
                                     "its warm-up)" if run["comparison"] in there else "")
                   for run in lacking.to_dict("records")})


def warnings_section(unreadable: list[tuple[str, str]], runs: pd.DataFrame, problems: list[Finding]) -> Section:
    """Files skipped, runs from mixed machines or out of their expected range, sections that failed."""
    items = [f"skipped {name}: {reason}" for name, reason in unreadable]
    items += [f"{f.subject}: {f.message}" for f in mixed_machines(runs) + out_of_range(runs) + problems]
    paragraphs = [] if items else ["No warnings: every file was read and every result is within its expected range."]
    return Section("Warnings", paragraphs=paragraphs, items=items)


def _speedup(run: Row) -> Cell:
    if run["not_timed"] and is_missing(run["speedup"]):
        return Cell("n/a", title="this run timed no step, so there is no speed-up to compute", style="num")
    title = None if is_missing(run["speedup"]) else f"baseline: {fmt(run['baseline_samples_per_s'], 'rate')} samples/s"
    return Cell(fmt(run["speedup"], "x"), title=title, style="num")


def _rate(run: Row) -> Cell:
    if run["not_timed"] and is_missing(run["samples_per_s"]):
        return Cell("n/a", title="no step was timed: the run was no longer than its warm-up", style="num")
    return Cell(fmt(run["samples_per_s"], "rate"), style="num")


def _efficiency(run: Row) -> Cell:
    value = run["scaling_efficiency"]
    low = is_ddp(run["method"]) and not is_missing(value) and value < DDP_MIN_EFFICIENCY
    return Cell(fmt(value, "%"), style="num warn" if low else "num")


PEAK_TITLE = "achieved TFLOP/s ÷ the GPU's dense datasheet peak for the precision in force"
RUN = {"run": lambda r: Cell(fmt(r["run_id"]), title=r["file"], style="id")}
SUMMARY_COLUMNS = {
    **RUN, "lab": "lab", "method": "method", "model": "model", "machine": "machine",
    "device": ("device_type", "text", "device_name"), "world size": ("world_size", "int"),
    "devices": ("devices", "int"), "global batch": ("global_batch_size", "int"),
    "time / epoch": ("time_per_epoch_s", "s"),
    "peak memory per device": lambda r: fmt_memory(r["memory_per_device"], r["memory_source"]),
    # After the allocator's peak: what the driver counts, which the allocator does not see.
    "GPU memory in use per device": lambda r: fmt_memory(r["device_memory_per_device"], r["device_memory_source"]),
    "samples/s": _rate, "TFLOP/s": ("achieved_tflops", "{:.3g}"),
    "% of peak": lambda r: Cell(fmt(r["mfu"], "%1"), style="num", title=None if is_missing(r["mfu"]) else PEAK_TITLE),
    "speed-up vs baseline": _speedup, "scaling efficiency": _efficiency, "final loss": ("final_loss", "num"),
    "test accuracy": ("test_accuracy", "%1"),
    "status": lambda r: Cell(fmt(r["status"]), style="" if r["status"] == "ok" else "warn"),
}
SUMMARY_NOTES = {
    "% of peak": "TFLOP/s is what the run achieved (its FLOPs ÷ its measured time); % of peak divides it by the GPU's "
                 "dense datasheet peak for the precision in force (common.precision).",
    "peak memory per device": "Memory on CUDA is the caching allocator's peak (torch.cuda.max_memory_allocated): "
        "tensors only; on CPU it is the peak resident set of the whole process (Python, PyTorch and the data set "
        "included). Several values are the devices of one run, first device first.",
    "GPU memory in use per device": "GPU memory in use is what the driver counts when the run ends: the CUDA "
        "context, cuBLAS/cuDNN workspaces, NCCL's buffers and the allocator's cache, none of which the allocator's "
        "peak includes (so DDP looks leaner than it is by the peak alone). Its source is NVML's figure for the "
        "process, or cudaMemGetInfo for the whole GPU (other processes included); hover a cell to see which.",
}


def summary_section(runs: pd.DataFrame) -> Section:
    """One row per run; a column no run has a value in is left out, and so is the note that explains it."""
    scaling = not runs["lab"].isin(LABS_WITHOUT_SCALING).all()
    columns = {name: spec for name, spec in SUMMARY_COLUMNS.items()
               if scaling or name not in ("speed-up vs baseline", "scaling efficiency")}
    table = table_from_frame(runs, columns, id="summary-table", drop_empty=True,
                             caption=f"{len(runs)} run{'s' if len(runs) != 1 else ''}, one row each")
    notes = []
    if {"speed-up vs baseline", "scaling efficiency"} & set(table.columns):
        ddp = runs["method"].map(is_ddp) & runs["scaling_efficiency"].notna()
        notes.append(f"Scaling efficiency = samples/s ÷ (devices × samples/s of the single-device '{BASELINE_METHOD}' "
                     "run of the same lab, model and device type on the same machine; the median when it ran several "
                     "times). Speed-up = samples/s ÷ that baseline."
                     + (f" DDP is expected to reach {DDP_MIN_EFFICIENCY:.0%}." if ddp.any() else ""))
    notes += [note for column, note in SUMMARY_NOTES.items() if column in table.columns]
    notes += [f"Note from run {run.run_id} ({run.lab} {run.method}): {run.notes}" for run in
              runs[["run_id", "lab", "method", "notes"]].explode("notes").dropna(subset="notes").itertuples()]
    releases = texts(runs, "provenance.versions.torch").dropna().value_counts().sort_index()  # none: not a release
    if len(releases) > 1:  # a comparison across PyTorch releases measures the releases too
        counts = ", ".join(f"{release}: {count} run{'s' if count != 1 else ''}" for release, count in releases.items())
        notes.append(f"These runs used {len(releases)} PyTorch releases ({counts}): part of a difference between them "
                     "may be the release. Each run's is in the provenance table.")
    if runs["dry_run"].any():
        notes.append("Dry runs (--dry-run: a check that the script runs, not a measurement), compared only with each "
                     "other: run(s) " + ", ".join(runs.loc[runs["dry_run"], "run_id"].astype(str)) + ".")
    lacking = missing_baselines(runs) if scaling else []
    if lacking:
        notes.append(f"No usable '{BASELINE_METHOD}' run to compute an efficiency for: " + "; ".join(lacking) + ".")
    return Section("Summary", tables=[table], notes=notes)


def configurations_section(configs: pd.DataFrame) -> Section | None:
    """Shown only when some configuration ran more than once (otherwise it repeats the summary)."""
    if configs.empty or configs["runs"].max() < 2:
        return None
    spread = lambda c: Cell(MISSING if is_missing(c["samples_per_s"]) else  # noqa: E731
                            f"{fmt(c['samples_per_s_min'], 'rate')} – {fmt(c['samples_per_s_max'], 'rate')}",
                            style="num")
    table = table_from_frame(configs, {
        "lab": "lab", "method": "method", "model": "model", "machine": "machine", "devices": ("devices", "int"),
        "runs": ("runs", "int"), "global batch": ("global_batch_size", "int"),
        "time / epoch (median)": ("time_per_epoch_s", "s"),
        "peak memory per device (median)": lambda c: fmt_memory(c["memory_per_device"], c["memory_source"]),
        "samples/s (median)": ("samples_per_s", "rate"), "samples/s (min – max)": spread,
        "scaling efficiency (median)": ("scaling_efficiency", "%"),
    }, id="configurations-table", row_id_column=None,
        caption="Successful runs with the same lab, method, model, machine, devices, global batch, epochs and step cap")
    return Section("Repeats combined", tables=[table])


def plots_section(configs: pd.DataFrame) -> Section:
    """Throughput, memory and efficiency per configuration, a figure of each per lab (their units and scales differ)."""
    figures = [fig for lab, group in configs.groupby(configs["lab"].fillna(MISSING)) for fig in (
        plots.throughput_figure(group, lab), plots.memory_figure(group, lab), plots.efficiency_figure(group, lab))
        if fig is not None]
    return Section("Plots", figures=figures, paragraphs=[] if figures else [
        "No run recorded throughput or memory for these plots; a lab's own figures are in its section."])


def _metric(value: object) -> Cell:
    if isinstance(value, str) and len(value) > MAX_METRIC_TEXT:
        return Cell(value[:MAX_METRIC_TEXT - 1].rstrip() + "…", title=value, style="long")
    if isinstance(value, (bool, str)):
        return Cell(str(value))
    if number(value) is None:
        return Cell(MISSING)
    return Cell(fmt(value, "int" if isinstance(value, int) else "num"), style="num")


def other_metrics_section(runs: pd.DataFrame) -> Section | None:
    """Per lab, the metrics a script recorded beyond the summary's columns (numbers, text, and one level inside
    an object such as ``step_time``): the most common first, a script's own top-level values before the insides."""
    tables = []
    for lab, lab_runs in runs.groupby(runs["lab"].fillna(MISSING), sort=True):
        keys = [key for key in lab_runs if key.startswith("metrics.") and key.count(".") <= 2
                and key.split(".")[1] not in SUMMARY_METRICS]
        scalar = lab_runs[keys].map(lambda v: isinstance(v, (int, float, str)) and v == v)
        counts = {key[len("metrics."):]: count for key, count in scalar.sum().items() if count}
        if not counts:
            continue
        shown = sorted(counts, key=lambda k: (-counts[k], "." in k, k))[:MAX_EXTRA_METRICS]
        caption = f"{lab}: {len(counts)} other metric{'s' if len(counts) != 1 else ''}"
        caption += f" (the {len(shown)} most common shown)" if len(counts) > len(shown) else ""
        columns = {"run": "run_id", "method": "method",
                   **{key: lambda r, key=key: _metric(r[f"metrics.{key}"]) for key in shown}}
        tables.append(table_from_frame(lab_runs, columns, caption=caption))
    return Section("Other metrics", paragraphs=["What each lab's scripts measured beyond the summary's columns."],
                   tables=tables) if tables else None


def _energy(run: Row) -> Cell:
    if not isinstance(run["record"].get("energy"), dict):
        return Cell("not recorded", title="written before schema version 2, which added energy")
    return Cell("ok") if run["energy"] == "ok" else Cell("unavailable", title=fmt(run["energy.reason"]))


def energy_section(runs: pd.DataFrame) -> Section:
    """Every run's energy over its timed region, or why none could be read."""
    ok = texts(runs, "energy.status") == "ok"
    energy = runs.assign(energy=texts(runs, "energy.status"), source=texts(runs, "energy.source").where(ok), **{
        key: numbers(runs, f"energy.{key}").where(ok) for key in ("joules", "joules_per_sample", "watts")})
    table = table_from_frame(energy, {
        **RUN, "lab": "lab", "method": "method", "energy": _energy, "joules": ("joules", "num"), "source": "source",
        "J / sample": ("joules_per_sample", "{:.3g}"), "mean W": ("watts", "{:.3g}")}, id="energy-table")
    reasons = sorted({row[3].title for row in table.rows if row[3].text == "unavailable" and row[3].title})
    return Section("Energy", paragraphs=[  # no table of dashes where no run measured any
        f"{ok.sum()} of {len(runs)} run(s) measured their energy: NVML's counter of each GPU plus the RAPL counters "
        "of each node's CPU packages where readable, else Slurm's ConsumedEnergy (common/measure/energy.py)."
        + (" Hover over 'unavailable' for the reason." if ok.any() else "") + " No number is estimated."],
        tables=[table] if ok.any() else [], notes=[f"Why energy was unavailable: {reason}" for reason in reasons[:5]])


def provenance_section(runs: pd.DataFrame) -> Section:
    # torch.version.cuda and cuDNN's version are what this PyTorch was built with, true on a machine with no GPU
    # at all; NCCL is the version PyTorch loaded.
    versions = {"python": "python", "torch": "torch", "PyTorch built with CUDA": "cuda",
                "PyTorch built with cuDNN": "cudnn", "NCCL": "nccl"}
    table = table_from_frame(runs, {
        **RUN, "file": "file", "created (UTC)": "created", "host": "hostname", "device name": "device_name",
        "what the machine could do": lambda r: Cell(fmt(r["machine_detail"]), style="wide"),
        "launcher": "provenance.distributed.launcher",
        **{header: f"provenance.versions.{name}" for header, name in versions.items()},
        "git commit": lambda r: MISSING if is_missing(r["git_commit"]) else
        f"{r['git_commit'][:12]}{' (dirty)' if r['git_dirty'] else ''}",
        "Slurm job": "slurm_job_id",
        "command": lambda r: Cell(shlex.join(r["command"]) if isinstance(r["command"], list) else fmt(r["command"]),
                                  style="code"),
    }, id="provenance-table")
    return Section("Provenance", paragraphs=[
        "Where and how each run was measured, from its record. The CUDA and cuDNN versions are those the installed "
        "PyTorch was built with (torch.version.cuda), shown on a CPU run too: they say nothing about the machine's "
        "GPU or driver."], tables=[table])


def page(title: str, facts: list[str], sections: list[Section | None], results_dir: Path) -> str:
    """The page (templates/report.html.j2) with the sections that are there, each id once: "energy", "energy-2"..."""
    sections = [section for section in sections if section is not None]
    seen: set[str] = set()
    for section in sections:
        base, n = section.id, 1
        while section.id in seen:  # a title that already ends in "-2" must not collide either
            n += 1
            section.id = f"{base}-{n}"
        seen.add(section.id)
    return TEMPLATES.get_template("report.html.j2").render(
        title=title, facts=facts, sections=sections, results_dir=str(results_dir),
        generated=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
