"""Lab 05 (the network and the scaling curve): bus bandwidth against the link's peak, strong and weak
scaling against ideal, time to a target accuracy, and how much communication DDP hides.

The records (``labs/lab05_scaling/``):

- ``01_allreduce_bench.py``: method ``all_reduce`` / ``all_gather`` / ``reduce_scatter``, with
  ``metrics.sizes`` (one object per message size: ``bytes``, ``time_s``, ``algbw_gbps``,
  ``busbw_gbps``, ``busbw_pct_of_reference``), ``metrics.reference`` (the link's peak or the measured
  memory copy) and ``metrics.transport``;
- ``02_scaling_study.py``: method ``strong-scaling`` / ``weak-scaling``, one record per point, with
  ``metrics.world_size``, ``nodes``, ``samples_per_s``, ``evaluations`` and ``time_to_target_s``;
- ``03_overlap.py``: method ``overlap`` with ``metrics.buckets`` (one object per ``bucket_cap_mb``).

Repeats of one configuration are combined with the median. Efficiency is throughput divided by
(processes / the smallest point's processes) times the smallest point's throughput, on the same
machine, model, data set and batch setting: 100% is ideal.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

import pandas as pd

from common.report.runs import get, number
from common.report.sections import (
    MISSING, Cell, Section, SectionContext, Table, fmt_bytes, fmt_int, fmt_number, fmt_percent, fmt_rate, fmt_ratio,
    fmt_seconds, fmt_text, num, register_section,
)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
SCALING_METHODS = {"strong-scaling": "strong", "weak-scaling": "weak"}
#: Ten colours a reader tells apart (matplotlib's tab10): one per line of the time-to-accuracy plot.
PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
           "tab:olive", "tab:cyan")
COLORS = {"all_reduce": "tab:blue", "all_gather": "tab:orange", "reduce_scatter": "tab:green",
          "strong": "tab:blue", "weak": "tab:orange"}


def _median(values: Iterable[Any]) -> float | None:
    finite = [v for v in (number(x) for x in values) if v is not None]
    return statistics.median(finite) if finite else None


# --- bandwidth ---------------------------------------------------------------------------------

def _bandwidth_rows(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for run in runs[runs["status"] == "ok"].to_dict("records"):
        record = run["record"]
        sizes = get(record, "metrics", "sizes")
        if run["method"] not in COLLECTIVES or not isinstance(sizes, list):
            continue
        reference = get(record, "metrics", "reference") or {}
        for entry in sizes:
            if not isinstance(entry, dict) or number(entry.get("bytes")) is None:
                continue
            rows.append({"machine": run["machine"], "ranks": int(run["world_size"] or 1),
                         "nodes": int(number(get(record, "metrics", "nodes")) or 1),
                         "collective": run["method"], "bytes": int(entry["bytes"]), "run_id": run["run_id"],
                         "time_s": number(entry.get("time_s")), "algbw": number(entry.get("algbw_gbps")),
                         "busbw": number(entry.get("busbw_gbps")),
                         "reference_gbps": number(reference.get("gb_per_s")) if isinstance(reference, dict) else None,
                         "reference_name": reference.get("name") if isinstance(reference, dict) else None,
                         "reference_source": reference.get("source") if isinstance(reference, dict) else None,
                         "transport": get(record, "metrics", "transport", "summary"),
                         "warning": get(record, "metrics", "transport", "warning")})
    return pd.DataFrame(rows)


def _bandwidth_table(group: pd.DataFrame, caption: str) -> Table:
    collectives = [c for c in COLLECTIVES if c in set(group["collective"])]
    reference = _median(group["reference_gbps"])
    columns = ["size"]
    for collective in collectives:
        columns += [f"{collective} busbw GB/s"] + ([f"{collective} % of ref."] if reference else [])
    rows = []
    for size in sorted(set(group["bytes"])):
        cells = [Cell(fmt_bytes(size), style="num")]
        for collective in collectives:
            cell = group[(group["bytes"] == size) & (group["collective"] == collective)]
            busbw = _median(cell["busbw"])
            title = (f"median of {len(cell)} run(s); time {fmt_seconds(_median(cell['time_s']))}; algbw "
                     f"{fmt_number(_median(cell['algbw']), 3)} GB/s" if busbw is not None else None)
            cells.append(Cell(MISSING if busbw is None else f"{busbw:.3g}", title=title, style="num"))
            if reference:
                cells.append(num(MISSING if busbw is None else f"{100 * busbw / reference:.1f}%"))
        rows.append(cells)
    return Table(columns=columns, rows=rows, caption=caption)


def _bandwidth_figure(group: pd.DataFrame, title: str) -> Any:
    from matplotlib.figure import Figure as MplFigure

    from common.report.plots import plain, png_figure

    fig = MplFigure(figsize=(8, 4))
    ax = fig.add_subplot()
    for collective in COLLECTIVES:
        data = group[group["collective"] == collective]
        if data.empty:
            continue
        curve = data.groupby("bytes")["busbw"].median().sort_index()
        ax.plot(curve.index, curve.values, marker="o", color=COLORS[collective], label=collective)
    reference = _median(group["reference_gbps"])
    if reference:
        name = next((n for n in group["reference_name"] if isinstance(n, str)), "reference")
        ax.axhline(reference, color="black", linestyle="--", linewidth=1, label=plain(f"{name}: {reference:.3g} GB/s"))
    ax.set_xscale("log", base=2)
    measured = [v for v in group["busbw"] if v]
    if measured and max(measured) > 100 * min(measured):  # latency-bound small sizes would sit on the axis
        ax.set_yscale("log")
    ax.set_xticks(sorted(set(group["bytes"])), [fmt_bytes(b) for b in sorted(set(group["bytes"]))], rotation=45,
                  fontsize="small")
    ax.set_xlabel("message size S")
    ax.set_ylabel("bus bandwidth (GB/s, one direction)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return png_figure(fig, alt=f"Bus bandwidth against message size for {title}",
                      caption=f"busbw against message size, {plain(title)}; dashed: the reference it is compared with.")


def bandwidth_parts(runs: pd.DataFrame, plots: bool) -> tuple[list[Table], list[Any], list[str]]:
    rows = _bandwidth_rows(runs)
    tables, figures, notes = [], [], []
    if rows.empty:
        return tables, figures, notes
    for (machine, ranks, nodes), group in rows.groupby(["machine", "ranks", "nodes"], sort=True):
        where = f"{machine} · {ranks} ranks on {nodes} node{'s' if nodes > 1 else ''}"
        reference = _median(group["reference_gbps"])
        source = next((s for s in group["reference_source"] if isinstance(s, str)), None)
        ref_text = (f"reference {next(n for n in group['reference_name'] if isinstance(n, str))} "
                    f"{reference:.3g} GB/s ({source})" if reference else "no reference peak recorded")
        tables.append(_bandwidth_table(group, f"{where}: median busbw per message size; {ref_text}"))
        for transport in dict.fromkeys(t for t in group["transport"] if isinstance(t, str)):
            notes.append(f"{where}: {transport}")
        for warning in dict.fromkeys(w for w in group["warning"] if isinstance(w, str)):
            notes.append(f"WARNING {where}: {warning}")
        if plots:
            figures.append(_bandwidth_figure(group, where))
    return tables, figures, notes


# --- scaling -----------------------------------------------------------------------------------

def _scaling_rows(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for run in runs.to_dict("records"):
        mode = SCALING_METHODS.get(run["method"])
        if mode is None:
            continue
        record = run["record"]
        metrics = get(record, "metrics") or {}
        batch = number(get(record, "config", "batch_size" if mode == "weak" else "strong_global_batch_size"))
        rows.append({"mode": mode, "machine": run["machine"], "model": run["model"],
                     "dataset": get(record, "config", "dataset"), "batch_key": batch, "status": run["status"],
                     "processes": int(number(metrics.get("world_size")) or run["world_size"] or 1),
                     "nodes": int(number(metrics.get("nodes")) or 1),
                     "per_process": number(metrics.get("per_process_batch_size")),
                     "global_batch": number(metrics.get("global_batch_size")),
                     "samples_per_s": number(metrics.get("samples_per_s")),
                     "test_accuracy": number(metrics.get("test_accuracy")),
                     "target": number(metrics.get("target_accuracy")),
                     "time_to_target": number(metrics.get("time_to_target_s")),
                     "evaluations": metrics.get("evaluations") if isinstance(metrics.get("evaluations"), list) else [],
                     "evaluations_source": metrics.get("evaluations_source"),
                     "energy_per_sample": number(get(record, "energy", "joules_per_sample")),
                     # One training run can be the point of both curves (1 process, same batch).
                     "training_run_id": metrics.get("training_run_id") or run["run_id"],
                     "run_id": run["run_id"]})
    return pd.DataFrame(rows)


def scaling_curves(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (curve, processes): medians over repeats, speed-up and efficiency against the smallest point."""
    out = []
    ok = rows[rows["status"] == "ok"]
    keys = ["machine", "model", "dataset", "mode", "batch_key"]
    for key, curve in ok.groupby(keys, sort=True, dropna=False):
        points = []
        for processes, group in curve.groupby("processes", sort=True):
            points.append({**dict(zip(keys, key)), "processes": processes, "nodes": int(group["nodes"].max()),
                           "runs": len(group), "per_process": _median(group["per_process"]),
                           "global_batch": _median(group["global_batch"]),
                           "samples_per_s": _median(group["samples_per_s"]),
                           "test_accuracy": _median(group["test_accuracy"]), "target": _median(group["target"]),
                           "time_to_target": _median(group["time_to_target"]),
                           "reached": int(group["time_to_target"].notna().sum()),
                           "energy_per_sample": _median(group["energy_per_sample"]),
                           "run_ids": ", ".join(group["run_id"])})
        base = next((p for p in points if p["samples_per_s"] is not None), None)
        for point in points:
            if base is not None and point["samples_per_s"] is not None:
                point["speedup"] = point["samples_per_s"] / base["samples_per_s"]
                point["ideal"] = point["processes"] / base["processes"]
                point["efficiency"] = point["speedup"] / point["ideal"]
            else:
                point.update(speedup=None, ideal=point["processes"] / points[0]["processes"], efficiency=None)
            point["base_processes"] = base["processes"] if base else None
        out += points
    return pd.DataFrame(out)


def _scaling_table(curves: pd.DataFrame, caption: str) -> Table:
    rows = []
    for p in curves.to_dict("records"):
        target = p["target"]
        if p["time_to_target"] is not None:
            reached = Cell(fmt_seconds(p["time_to_target"]), style="num",
                           title=f"first validation accuracy ≥ {fmt_percent(target)}; "
                                 f"median of {p['reached']} run(s)")
        else:
            reached = Cell(f"not reached ({fmt_percent(target)})" if target is not None else MISSING, style="num")
        rows.append([Cell(p["mode"]), num(fmt_int(p["processes"])), num(fmt_int(p["nodes"])),
                     num(fmt_int(p["per_process"])), num(fmt_int(p["global_batch"])),
                     Cell(fmt_rate(p["samples_per_s"]), style="num", title=f"run(s) {p['run_ids']}"),
                     num(fmt_ratio(p["speedup"])), num(fmt_ratio(p["ideal"])),
                     Cell(fmt_percent(p["efficiency"]), style="num"),
                     num(fmt_percent(p["test_accuracy"], 1)), reached,
                     num(fmt_number(p["energy_per_sample"], 3))])
    return Table(columns=["mode", "processes", "nodes", "batch / process", "global batch", "samples/s", "speed-up",
                          "ideal", "efficiency", "final accuracy", "time to target", "J / sample"],
                 rows=rows, caption=caption)


def _scaling_figure(curves: pd.DataFrame, title: str) -> Any:
    from matplotlib.figure import Figure as MplFigure

    from common.report.plots import plain, png_figure

    fig = MplFigure(figsize=(11, 4))
    throughput, efficiency = fig.subplots(1, 2)
    for mode in ("strong", "weak"):
        curve = curves[(curves["mode"] == mode) & curves["samples_per_s"].notna()].sort_values("processes")
        if curve.empty:
            continue
        color = COLORS[mode]
        throughput.plot(curve["processes"], curve["samples_per_s"], marker="o", color=color, label=f"{mode}: measured")
        base = curve.iloc[0]
        throughput.plot(curve["processes"], base["samples_per_s"] * curve["processes"] / base["processes"],
                        linestyle="--", color=color, alpha=0.6, label=f"{mode}: ideal")
        efficiency.plot(curve["processes"], curve["efficiency"] * 100, marker="o", color=color, label=mode)
    efficiency.axhline(100, color="black", linewidth=1, label="ideal (100%)")
    for ax in (throughput, efficiency):
        ax.set_xlabel("processes")
        ax.set_xticks(sorted(set(curves["processes"])))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    throughput.set_ylabel("throughput (samples/s, whole job)")
    efficiency.set_ylabel("scaling efficiency (%)")
    efficiency.set_ylim(bottom=0)
    return png_figure(fig, alt=f"Throughput and scaling efficiency against processes for {title}",
                      caption=f"Strong and weak scaling, {plain(title)}: measured against ideal (dashed).")


def accuracy_curves(rows: pd.DataFrame) -> list[dict[str, Any]]:
    """The lines of the time-to-accuracy plot: one per training run that recorded more than one
    evaluation, each in its own colour.

    A run that is the point of both curves (one process: strong and weak scaling train the same
    batch) is drawn once, labelled with both modes. Strong scaling is solid, weak dashed.
    """
    palette = PALETTE
    curves: dict[str, dict[str, Any]] = {}
    for row in rows.sort_values(["processes", "mode"]).to_dict("records"):
        if len(row["evaluations"]) < 2:
            continue
        curve = curves.get(row["training_run_id"])
        if curve is not None:
            curve["modes"].append(row["mode"])
            continue
        points = sorted(row["evaluations"], key=lambda p: p["elapsed_s"])
        curves[row["training_run_id"]] = {"modes": [row["mode"]], "processes": row["processes"],
                                          "x": [p["elapsed_s"] for p in points],
                                          "y": [100 * p["accuracy"] for p in points]}
    lines = []
    for index, curve in enumerate(curves.values()):
        modes = " and ".join(dict.fromkeys(curve["modes"]))
        processes = curve["processes"]
        lines.append({**curve, "color": palette[index % len(palette)],
                      "linestyle": "-" if "strong" in curve["modes"] else "--",
                      "label": f"{modes}, {processes} process{'es' if processes != 1 else ''}"})
    return lines


def _accuracy_figure(rows: pd.DataFrame, title: str) -> Any | None:
    """Validation accuracy against elapsed time for every run that recorded more than one evaluation."""
    from matplotlib.figure import Figure as MplFigure

    from common.report.plots import plain, png_figure

    lines = accuracy_curves(rows)
    if not lines:
        return None
    fig = MplFigure(figsize=(8, 4))
    ax = fig.add_subplot()
    for line in lines:
        ax.plot(line["x"], line["y"], marker=".", color=line["color"], linestyle=line["linestyle"], label=line["label"])
    target = _median(rows["target"])
    if target is not None:
        ax.axhline(100 * target, color="black", linestyle=":", linewidth=1, label=f"target {target:.0%}")
    ax.set_xlabel("elapsed training time (s)")
    ax.set_ylabel("validation accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    drawn = "; ".join(line["label"] for line in lines)
    return png_figure(fig, alt=f"Validation accuracy against time for {title}: {drawn}",
                      caption=f"Time to accuracy, {plain(title)} ({drawn}; strong scaling solid, weak dashed): "
                              "the first crossing of the dotted line is the time to target.")


def scaling_parts(runs: pd.DataFrame, plots: bool) -> tuple[list[Table], list[Any], list[str]]:
    rows = _scaling_rows(runs)
    tables, figures, notes = [], [], []
    if rows.empty:
        return tables, figures, notes
    curves = scaling_curves(rows)
    if curves.empty:
        return tables, figures, ["Every scaling point failed; see the warnings."]
    for (machine, model, dataset), group in curves.groupby(["machine", "model", "dataset"], sort=True, dropna=False):
        where = f"{machine} · {model} on {dataset}"
        batches = "; ".join(f"{mode}: {'global batch' if mode == 'strong' else 'batch per process'} "
                            f"{fmt_int(key)}" for mode, key in dict(zip(group["mode"], group["batch_key"])).items())
        tables.append(_scaling_table(group.sort_values(["mode", "processes"]), f"{where} ({batches})"))
        if plots:
            figures.append(_scaling_figure(group, where))
            point_rows = rows[(rows["machine"] == machine) & (rows["model"] == model) & (rows["status"] == "ok")]
            accuracy = _accuracy_figure(point_rows, where)
            if accuracy is not None:
                figures.append(accuracy)
    sources = sorted({s for s in rows["evaluations_source"] if isinstance(s, str)})
    notes += [f"Validation accuracy over time from: {', '.join(sources)}."] if sources else []
    return tables, figures, notes


# --- overlap -----------------------------------------------------------------------------------

def overlap_parts(runs: pd.DataFrame, plots: bool) -> tuple[list[Table], list[Any], list[str]]:
    tables, figures = [], []
    for run in runs[(runs["method"] == "overlap") & (runs["status"] == "ok")].to_dict("records"):
        buckets = get(run["record"], "metrics", "buckets")
        if not isinstance(buckets, list) or not buckets:
            continue
        ms = lambda v: num(MISSING if number(v) is None else f"{1e3 * v:.1f}")  # noqa: E731
        rows = [[num(fmt_number(b.get("bucket_cap_mb"))), num(fmt_int(b.get("buckets"))), ms(b.get("step_s")),
                 ms(b.get("no_sync_step_s")), ms(b.get("exposed_comm_s")), ms(b.get("comm_alone_s")),
                 num(fmt_percent(number(b.get("hidden_fraction"))))] for b in buckets if isinstance(b, dict)]
        model = fmt_text(run["model"])
        where = f"{run['machine']} · {fmt_int(run['world_size'])} ranks · {model} (run {run['run_id']})"
        tables.append(Table(columns=["bucket_cap_mb", "buckets", "step (ms)", "no_sync step (ms)",
                                     "exposed comm. (ms)", "comm. alone (ms)", "hidden"],
                            rows=rows, caption=f"{where}: median step times"))
        if plots:
            figures.append(_overlap_figure(buckets, where))
    notes = ["Exposed communication = step with gradient synchronisation − step under no_sync() (compute only). "
             "Communication alone = the same buckets all-reduced one after another with nothing to overlap. "
             "Hidden = 1 − exposed ÷ alone; below 0 the synchronised step lost more than the communication costs "
             "alone (on a CPU the all-reduce competes with backward for the same cores)."] if tables else []
    return tables, figures, notes


def _overlap_figure(buckets: list[dict], title: str) -> Any:
    from matplotlib.figure import Figure as MplFigure

    from common.report.plots import plain, png_figure

    labels = [f"{b.get('bucket_cap_mb'):g}" for b in buckets]
    fig = MplFigure(figsize=(8, 3.6))
    ax = fig.add_subplot()
    x = list(range(len(buckets)))
    ax.bar([i - 0.2 for i in x], [1e3 * (number(b.get("exposed_comm_s")) or 0) for b in buckets], width=0.4,
           color="tab:red", label="exposed (step − no_sync step)")
    ax.bar([i + 0.2 for i in x], [1e3 * (number(b.get("comm_alone_s")) or 0) for b in buckets], width=0.4,
           color="tab:gray", label="communication alone")
    ax.set_xticks(x, labels)
    ax.set_xlabel("bucket_cap_mb (MiB)")
    ax.set_ylabel("ms per step")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return png_figure(fig, alt=f"Exposed and total communication per bucket size for {title}",
                      caption=f"Overlap, {plain(title)}: the red bar is what backward did not hide.")


# --- the section ---------------------------------------------------------------------------------

@register_section("lab05")
def lab05_sections(ctx: SectionContext) -> list[Section]:
    """Up to three sections: bus bandwidth, the scaling curves, overlap (each only when its records are there)."""
    sections = []
    tables, figures, notes = bandwidth_parts(ctx.runs, ctx.plots)
    if tables:
        sections.append(Section("Lab 05: bus bandwidth against the link's peak", paragraphs=[
            "Bus bandwidth (busbw) is nccl-tests' number: the algorithm bandwidth S/t times 2(n−1)/n for all-reduce "
            "and (n−1)/n for all-gather and reduce-scatter, so that it does not depend on the number of ranks and "
            "compares with one link's peak (GB/s = 10⁹ B/s, one direction): NVLink per GPU within a node, the "
            "node's network across nodes, from the site profile. On a CPU (Gloo) the reference is the machine's "
            "measured memory-copy bandwidth. Small messages measure latency, large ones bandwidth."],
            tables=tables, figures=figures, notes=notes))
    tables, figures, notes = scaling_parts(ctx.runs, ctx.plots)
    if tables or notes:
        sections.append(Section("Lab 05: strong and weak scaling", paragraphs=[
            "Each point is one training run of Lab-01's 04_ddp_training.py. Strong scaling keeps the global batch and "
            "splits it over the processes; weak scaling keeps the batch per process, so the global batch grows. "
            "Efficiency = throughput ÷ (processes ÷ the smallest point's processes × that point's throughput); "
            "100% is ideal. Time to target is the elapsed training time when the validation accuracy first reached "
            "the study's target."], tables=tables, figures=figures, notes=notes))
    tables, figures, notes = overlap_parts(ctx.runs, ctx.plots)
    if tables:
        sections.append(Section("Lab 05: communication hidden behind backward", tables=tables, figures=figures,
                                notes=notes))
    return sections
