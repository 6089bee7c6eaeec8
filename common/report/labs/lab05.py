"""Lab 05 (the network and the scaling curve): bus bandwidth against the link's peak (``01_allreduce_bench.py``),
strong and weak scaling against ideal and time to a target accuracy (``02_scaling_study.py``), and how much
communication DDP hides (``03_overlap.py``). Repeats are combined with the median.
"""

from __future__ import annotations

import pandas as pd

from common.report.plots import axes, finish_axes, plain, png_figure
from common.report.runs import entries, numbers, text, texts
from common.report.sections import (Cell, Figure, Row, Section, SectionContext, Table, fmt, register_section,
                                    table_from_frame)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
#: matplotlib's tab10 ("C0" is tab:blue, "C1" tab:orange, ...): ten colours a reader tells apart.
COLORS = {"all_reduce": "C0", "all_gather": "C1", "reduce_scatter": "C2", "strong": "C0", "weak": "C1"}


def _bandwidth_table(group: pd.DataFrame, reference: float, caption: str) -> Table:
    """A row per message size, the median busbw of each collective (and its share of ``reference``) beside it."""
    cells = group.groupby(["bytes", "method"]).agg(busbw=("busbw", "median"), n=("busbw", "size"),
                                                   time=("time_s", "median"), algbw=("algbw", "median"))
    cells = cells.assign(share=cells["busbw"] / reference, title=[
        f"median of {n} run(s); time {fmt(t, 's')}; algbw {fmt(a, '{:.3g}')} GB/s" if pd.notna(b) else None
        for b, n, t, a in cells[["busbw", "n", "time", "algbw"]].itertuples(index=False)]).unstack("method")
    cells.columns = cells.columns.map(" ".join)
    columns: dict = {"size": ("bytes", "bytes")}
    for collective in [c for c in COLLECTIVES if c in set(group["method"])]:
        columns[f"{collective} busbw GB/s"] = (f"busbw {collective}", "{:.3g}", f"title {collective}")
        if reference > 0:
            columns[f"{collective} % of ref."] = (f"share {collective}", "%1")
    return table_from_frame(cells.reset_index(), columns, caption=caption, row_id_column=None)


def _bandwidth_figure(group: pd.DataFrame, reference: float, name: str, title: str) -> Figure:
    fig, ax = axes(8, 4)
    for collective in [c for c in COLLECTIVES if c in set(group["method"])]:
        curve = group[group["method"] == collective].groupby("bytes")["busbw"].median()
        ax.plot(curve.index, curve.values, marker="o", color=COLORS[collective], label=collective)
    if reference > 0:
        ax.axhline(reference, color="black", linestyle="--", linewidth=1, label=plain(f"{name}: {reference:.3g} GB/s"))
    ax.set_xscale("log", base=2)
    measured = [v for v in group["busbw"] if v]
    if measured and max(measured) > 100 * min(measured):  # latency-bound small sizes would sit on the axis
        ax.set_yscale("log")
    sizes = sorted(set(group["bytes"]))
    ax.set_xticks(sizes, [fmt(b, "bytes") for b in sizes], rotation=45, fontsize="small")
    finish_axes(ax, xlabel="message size S", ylabel="bus bandwidth (GB/s, one direction)")
    return png_figure(fig, f"Bus bandwidth against message size for {title}",
                      f"busbw against message size, {plain(title)}; dashed: the reference it is compared with.")


@register_section("lab05")
def bandwidth_section(ctx: SectionContext) -> Section | None:
    runs = ctx.runs[ctx.runs["method"].isin(COLLECTIVES) & (ctx.runs["status"] == "ok")]
    said = ("reference.name", "reference.source", "transport.summary", "transport.warning")
    sizes = entries(runs.assign(ranks=runs["world_size"].fillna(1).astype(int),
                                nodes=numbers(runs, "metrics.nodes").fillna(1).astype(int)), "metrics.sizes",
                    "machine", "method", "run_id", "ranks", "nodes", "metrics.reference.gb_per_s",
                    *(f"metrics.{key}" for key in said))
    sizes = sizes.assign(bytes=numbers(sizes, "bytes"), busbw=numbers(sizes, "busbw_gbps"),
                         time_s=numbers(sizes, "time_s"), algbw=numbers(sizes, "algbw_gbps"))
    tables, figures, notes = [], [], []
    for (machine, ranks, nodes), group in sizes.dropna(subset=["bytes"]).groupby(["machine", "ranks", "nodes"]):
        where = f"{machine} · {ranks} ranks on {nodes} node{'s' if nodes > 1 else ''}"
        found = {key: list(dict.fromkeys(texts(group, f"metrics.{key}").dropna())) for key in said}
        name, source = (found[key][0] if found[key] else None for key in said[:2])
        reference = numbers(group, "metrics.reference.gb_per_s").median()
        peak = f"reference {name} {reference:.3g} GB/s ({source})" if reference > 0 else "no reference peak recorded"
        tables.append(_bandwidth_table(group, reference, f"{where}: median busbw per message size; {peak}"))
        notes += [f"{where}: {t}" for t in found["transport.summary"]]
        notes += [f"WARNING {where}: {w}" for w in found["transport.warning"]]
        if ctx.plots:
            figures.append(_bandwidth_figure(group, reference, name or "reference", where))
    if not tables:
        return None
    return Section("Lab 05: bus bandwidth against the link's peak", paragraphs=[
        "Bus bandwidth (busbw) is nccl-tests' number: the algorithm bandwidth S/t times 2(n−1)/n for all-reduce "
        "and (n−1)/n for all-gather and reduce-scatter, so that it does not depend on the number of ranks and "
        "compares with one link's peak (GB/s = 10⁹ B/s, one direction): NVLink per GPU within a node, the "
        "node's network across nodes, from the site profile. On a CPU (Gloo) the reference is the machine's "
        "measured memory-copy bandwidth. Small messages measure latency, large ones bandwidth."],
        tables=tables, figures=figures, notes=notes)


def _points(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per scaling point (a run of 02_scaling_study.py), with the batch setting its curve keeps."""
    mode = runs["method"].map({"strong-scaling": "strong", "weak-scaling": "weak"})
    runs = runs[mode.notna()].assign(mode=mode.dropna())
    batch = numbers(runs, "config.batch_size").where(runs["mode"] == "weak",
                                                     numbers(runs, "config.strong_global_batch_size"))
    return runs.assign(
        dataset=texts(runs, "config.dataset"), batch_key=batch, processes=numbers(runs, "metrics.world_size").fillna(
            runs["world_size"]).fillna(1).astype(int), nodes=numbers(runs, "metrics.nodes").fillna(1).astype(int),
        per_process=numbers(runs, "metrics.per_process_batch_size"), target=numbers(runs, "metrics.target_accuracy"),
        time_to_target=numbers(runs, "metrics.time_to_target_s"), energy=numbers(runs, "energy.joules_per_sample"),
        # One training run can be the point of both curves (1 process, same batch).
        training_run_id=texts(runs, "metrics.training_run_id").fillna(runs["run_id"]))


def scaling_curves(points: pd.DataFrame) -> pd.DataFrame:
    """One row per (curve, processes): medians over repeats, speed-up and efficiency against the smallest point."""
    keys = ["machine", "model", "dataset", "mode", "batch_key"]
    curves = points[points["status"] == "ok"].groupby([*keys, "processes"], dropna=False).agg(
        nodes=("nodes", "max"), runs=("run_id", "size"), per_process=("per_process", "median"),
        global_batch=("global_batch_size", "median"), samples_per_s=("samples_per_s", "median"),
        test_accuracy=("test_accuracy", "median"), target=("target", "median"),
        time_to_target=("time_to_target", "median"), reached=("time_to_target", "count"),
        energy=("energy", "median"), titles=("run_id", lambda ids: "run(s) " + ", ".join(ids))).reset_index()
    base = curves.dropna(subset=["samples_per_s"]).groupby(keys, dropna=False)[["processes", "samples_per_s"]].first()
    curves = curves.merge(base, on=keys, how="left", suffixes=("", "_base"))
    first = curves.groupby(keys, dropna=False)["processes"].transform("min")
    return curves.assign(speedup=curves["samples_per_s"] / curves["samples_per_s_base"],
                         ideal=curves["processes"] / curves["processes_base"].fillna(first),
                         efficiency=lambda c: c["speedup"] / c["ideal"])


def _reached(point: Row) -> Cell:
    if pd.isna(point["time_to_target"]):
        return Cell(f"not reached ({fmt(point['target'], '%')})" if pd.notna(point["target"]) else "—", style="num")
    return Cell(fmt(point["time_to_target"], "s"), style="num", title=f"first validation accuracy ≥ "
                f"{fmt(point['target'], '%')}; median of {point['reached']} run(s)")


def _scaling_figure(curves: pd.DataFrame, title: str) -> Figure:
    fig, (throughput, efficiency) = axes(11, 4, 2)
    measured = curves[curves["samples_per_s"].notna()].sort_values("processes", kind="stable")
    for mode, curve in measured.groupby("mode"):  # strong, then weak
        base = curve.iloc[0]
        throughput.plot(curve["processes"], curve["samples_per_s"], marker="o", color=COLORS[mode],
                        label=f"{mode}: measured")
        throughput.plot(curve["processes"], base["samples_per_s"] * curve["processes"] / base["processes"],
                        linestyle="--", color=COLORS[mode], alpha=0.6, label=f"{mode}: ideal")
        efficiency.plot(curve["processes"], curve["efficiency"] * 100, marker="o", color=COLORS[mode], label=mode)
    efficiency.axhline(100, color="black", linewidth=1, label="ideal (100%)")
    ticks = sorted(set(curves["processes"]))
    finish_axes(throughput, xlabel="processes", xticks=ticks, ylabel="throughput (samples/s, whole job)")
    finish_axes(efficiency, xlabel="processes", xticks=ticks, ylabel="scaling efficiency (%)", ylim=(0, None))
    return png_figure(fig, f"Throughput and scaling efficiency against processes for {title}",
                      f"Strong and weak scaling, {plain(title)}: measured against ideal (dashed).")


def _accuracy_figure(points: pd.DataFrame, title: str) -> Figure | None:
    """Validation accuracy against time: a line per training run (not per point) with two evaluations or more."""
    evaluations = entries(points, "metrics.evaluations")
    evaluations = evaluations.assign(x=numbers(evaluations, "elapsed_s"), y=100 * numbers(evaluations, "accuracy"))
    evaluations = evaluations.dropna(subset=["x", "y"]).sort_values("x", kind="stable")
    drawn = points[points.index.isin(evaluations["_run"].value_counts().loc[lambda n: n >= 2].index)]
    lines = drawn.assign(label=drawn.index).sort_values(["processes", "mode"]).groupby("training_run_id", sort=False) \
        .agg(modes=("mode", "unique"), processes=("processes", "first"), first=("label", "first"))
    if lines.empty:
        return None
    fig, ax = axes(8, 4)
    labels = []
    for index, line in enumerate(lines.itertuples()):
        labels.append(f"{' and '.join(line.modes)}, {line.processes} process{'es' if line.processes != 1 else ''}")
        curve = evaluations[evaluations["_run"] == line.first]
        ax.plot(curve["x"], curve["y"], marker=".", color=f"C{index % 10}",
                linestyle="-" if "strong" in line.modes else "--", label=labels[-1])
    target = points["target"].median()
    if pd.notna(target):
        ax.axhline(100 * target, color="black", linestyle=":", linewidth=1, label=f"target {target:.0%}")
    finish_axes(ax, xlabel="elapsed training time (s)", ylabel="validation accuracy (%)")
    return png_figure(fig, f"Validation accuracy against time for {title}: {'; '.join(labels)}",
                      f"Time to accuracy, {plain(title)} ({'; '.join(labels)}; strong scaling solid, weak dashed): "
                      "the first crossing of the dotted line is the time to target.")


@register_section("lab05", scaling=False)  # each curve against its smallest point here, not against a baseline run
def scaling_section(ctx: SectionContext) -> Section | None:
    points = _points(ctx.runs)
    if points.empty:
        return None
    tables, figures = [], []
    for (machine, model, dataset), group in scaling_curves(points).groupby(["machine", "model", "dataset"],
                                                                           dropna=False):
        where = f"{machine} · {model} on {dataset}"
        batches = "; ".join(f"{mode}: {'global batch' if mode == 'strong' else 'batch per process'} {fmt(key, 'int')}"
                            for mode, key in dict(zip(group["mode"], group["batch_key"])).items())
        tables.append(table_from_frame(group.sort_values(["mode", "processes"]), {
            "mode": "mode", "processes": ("processes", "int"), "nodes": ("nodes", "int"),
            "batch / process": ("per_process", "int"), "global batch": ("global_batch", "int"),
            "samples/s": ("samples_per_s", "rate", "titles"), "speed-up": ("speedup", "x"), "ideal": ("ideal", "x"),
            "efficiency": ("efficiency", "%"), "final accuracy": ("test_accuracy", "%1"), "time to target": _reached,
            "J / sample": ("energy", "{:.3g}")}, caption=f"{where} ({batches})"))
        if ctx.plots:
            figures.append(_scaling_figure(group, where))
            same = points[(points["machine"] == machine) & (points["model"] == model) & (points["status"] == "ok")]
            figures += [figure for figure in [_accuracy_figure(same, where)] if figure is not None]
    sources = sorted(set(texts(points, "metrics.evaluations_source").dropna()))
    notes = [f"Validation accuracy over time from: {', '.join(sources)}."] if sources else []
    return Section("Lab 05: strong and weak scaling", paragraphs=[
        "Each point is one training run of Lab-01's 04_ddp_training.py. Strong scaling keeps the global batch and "
        "splits it over the processes; weak scaling keeps the batch per process, so the global batch grows. "
        "Efficiency = throughput ÷ (processes ÷ the smallest point's processes × that point's throughput); "
        "100% is ideal. Time to target is the elapsed training time when the validation accuracy first reached "
        "the study's target."], tables=tables, figures=figures,
        notes=notes if tables else ["Every scaling point failed; see the warnings."])


def _overlap_figure(buckets: pd.DataFrame, title: str) -> Figure:
    fig, ax = axes(8, 3.6)
    x = range(len(buckets))
    for offset, key, color, label in ((-0.2, "exposed_comm_s", "tab:red", "exposed (step − no_sync step)"),
                                      (0.2, "comm_alone_s", "tab:gray", "communication alone")):
        ax.bar([i + offset for i in x], 1e3 * buckets[key].fillna(0), width=0.4, color=color, label=label)
    ax.axhline(0, color="black", linewidth=0.8)
    finish_axes(ax, "y", xticks=list(x), xticklabels=[f"{b:g}" for b in buckets["bucket_cap_mb"]],
                xlabel="bucket_cap_mb (MiB)", ylabel="ms per step")
    return png_figure(fig, f"Exposed and total communication per bucket size for {title}",
                      f"Overlap, {plain(title)}: the red bar is what backward did not hide.")


@register_section("lab05")
def overlap_section(ctx: SectionContext) -> Section | None:
    runs = ctx.runs[(ctx.runs["method"] == "overlap") & (ctx.runs["status"] == "ok")]
    buckets = entries(runs, "metrics.buckets", "machine", "world_size", "model", "run_id")
    ms = lambda v: f"{1e3 * v:.1f}"  # noqa: E731
    tables, figures = [], []
    for _, group in buckets.groupby("_run", sort=False):
        group = group.assign(**{key: numbers(group, key) for key in (
            "bucket_cap_mb", "hidden_fraction", "step_s", "no_sync_step_s", "exposed_comm_s", "comm_alone_s")})
        run = group.iloc[0]
        where = f"{run['machine']} · {fmt(run['world_size'], 'int')} ranks · {fmt(run['model'])} (run {run['run_id']})"
        clamped = lambda r: text(r["hidden_clamped_because"])  # noqa: E731  why "hidden" was kept within 0-100%
        tables.append(table_from_frame(group, {  # as 03_overlap.py prints them: "noise", and "*" (why: on hover)
            "bucket_cap_mb": ("bucket_cap_mb", "num"), "buckets": ("buckets", "int"), "step (ms)": ("step_s", ms),
            "no_sync step (ms)": ("no_sync_step_s", ms), "exposed comm. (ms)": lambda r: Cell(
                "noise" if r["exposed_is_noise"] is True else fmt(r["exposed_comm_s"], ms), style="num"),
            "comm. alone (ms)": ("comm_alone_s", ms), "hidden": lambda r: Cell(
                fmt(r["hidden_fraction"], "%") + "*" * bool(clamped(r)), title=clamped(r), style="num")},
            caption=f"{where}: median step times", row_id_column=None))
        if ctx.plots:
            figures.append(_overlap_figure(group, where))
    if not tables:
        return None
    return Section("Lab 05: communication hidden behind backward", tables=tables, figures=figures, notes=[
        "Exposed communication = step with gradient synchronisation − step under no_sync() (compute only). "
        "Communication alone = the same buckets all-reduced one after another with nothing to overlap. "
        "Hidden = 1 − exposed ÷ alone; below 0 the synchronised step lost more than the communication costs "
        "alone (on a CPU the all-reduce competes with backward for the same cores)."])

