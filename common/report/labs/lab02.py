"""Lab 02 (profiling and the data pipeline): the optimisation path, step by step.

``labs/lab02_profiling/sweep.py`` writes one record per step with ``config.sweep`` (which sweep,
which step, in what order) and, in ``metrics``, ``data_loading_share`` (the line_profiler share of
``train()`` spent waiting for the next batch) and ``speedup_vs_seed``. This section lays each
sweep out in path order as a table and a plot. ``bench/data_pipeline.py`` records (``config.bench``)
get a table of their own: the USC lab's pipeline, the lab's best and pure compute, with the ratios.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from common.report.runs import get, number
from common.report.sections import (
    Section, SectionContext, fmt_number, fmt_percent, fmt_rate, fmt_ratio, fmt_seconds, fmt_text, num,
    number_column, register_section, table_from_frame, text_column,
)

#: Sweeps shown in full, newest first; older ones are only counted.
MAX_SWEEPS = 4


def _sweep_rows(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for run in runs.to_dict("records"):
        record = run["record"]
        sweep_id = get(record, "config", "sweep", "sweep_id")
        if sweep_id is None:
            continue
        metrics = get(record, "metrics") or {}
        rows.append({
            "sweep_id": str(sweep_id), "index": number(get(record, "config", "sweep", "index")),
            "step": run["method"], "change": get(record, "config", "sweep", "change"),
            "status": run["status"], "machine": run["machine"], "created": run["created"], "run_id": run["run_id"],
            "dataset": get(record, "config", "dataset"), "batch": run["global_batch_size"],
            "time_per_epoch_s": run["time_per_epoch_s"], "samples_per_s": run["samples_per_s"],
            "speedup": number(metrics.get("speedup_vs_seed")), "share": number(metrics.get("data_loading_share")),
            "test_accuracy": run["test_accuracy"], "compile_s": number(metrics.get("compile_s")),
        })
    return pd.DataFrame(rows)


def _sweep_figure(sweep: pd.DataFrame, title: str) -> Any:
    from matplotlib.figure import Figure as MplFigure

    from common.report.plots import plain, png_figure

    ok = sweep[sweep["status"] == "ok"]
    labels = [plain(str(step)) for step in ok["step"]]
    fig = MplFigure(figsize=(12, 3.6))
    axes = fig.subplots(1, 3)
    y = list(range(len(ok)))
    panels = [
        (axes[0], ok["time_per_epoch_s"], "time per epoch (s)", "tab:gray"),
        (axes[1], ok["samples_per_s"], "samples/s (label: speed-up over the USC lab's script)", "tab:blue"),
        (axes[2], ok["share"] * 100, "data-loading line, % of train() (line_profiler)", "tab:orange"),
    ]
    for ax, values, xlabel, color in panels:
        ax.barh(y, values.fillna(0), color=color)
        ax.set_yticks(y, labels if ax is axes[0] else [""] * len(y))
        ax.invert_yaxis()
        ax.set_xlabel(xlabel, fontsize="small")
        ax.grid(axis="x", alpha=0.3)
    axes[1].margins(x=0.15)  # room for the speed-up labels
    for i, (rate, speedup) in enumerate(zip(ok["samples_per_s"], ok["speedup"])):
        if pd.notna(rate) and pd.notna(speedup):
            axes[1].annotate(f"{speedup:.2f}×", (rate, i), xytext=(3, 0), textcoords="offset points",
                             va="center", fontsize="small")
    fig.suptitle(plain(title), fontsize="medium")
    return png_figure(fig, alt=f"Time per epoch, throughput and data-loading share for each step of {title}",
                      caption="Each step adds one change to the step above it (the optimisation path).")


def _share_sentence(sweep: pd.DataFrame) -> str | None:
    ok = sweep[(sweep["status"] == "ok") & sweep["share"].notna()]
    if len(ok) < 2:
        return None
    first, last = ok.iloc[0], ok.iloc[-1]
    return (f"The data-loading line took {fmt_percent(first['share'], 1)} of train() at '{first['step']}' and "
            f"{fmt_percent(last['share'], 1)} at '{last['step']}' (the USC lab's own table: 84.5 % on a GPU with "
            "one CPU core).")


SWEEP_COLUMNS = [
    text_column("step"),
    text_column("change"),
    ("batch", lambda r: num(fmt_text(None if pd.isna(r["batch"]) else int(r["batch"])))),
    number_column("time / epoch", "time_per_epoch_s", fmt_seconds),
    number_column("samples/s", "samples_per_s", fmt_rate),
    number_column("speed-up over the USC lab's script", "speedup", fmt_ratio),
    number_column("data-loading line", "share", fmt_percent, 1),
    number_column("compile time", "compile_s", fmt_seconds),
    number_column("test accuracy", "test_accuracy", fmt_percent, 1),
    text_column("status"),
]


def _bench_table(runs: pd.DataFrame) -> Any | None:
    """One row per benchmark run: the three variants' throughput and the two ratios."""
    benches: dict[str, dict[str, Any]] = {}
    for run in runs.to_dict("records"):
        bench = get(run["record"], "config", "bench")
        if not isinstance(bench, dict) or bench.get("variant") not in ("a", "b", "c"):
            continue
        metrics = get(run["record"], "metrics") or {}
        row = benches.setdefault(str(bench.get("bench_id")), {
            "bench_id": bench.get("bench_id"), "machine": run["machine"], "created": run["created"],
            "threads": get(run["record"], "config", "threads"), "batch": run["global_batch_size"],
            "b_over_a": number(metrics.get("b_over_a")), "b_over_c": number(metrics.get("b_over_c")),
            "load": number(metrics.get("load_average_start")), "run_id": run["run_id"]})
        row[f"rate_{bench['variant']}"] = run["samples_per_s"]
    if not benches:
        return None
    frame = pd.DataFrame(sorted(benches.values(), key=lambda row: str(row["created"])))
    for variant in "abc":
        if f"rate_{variant}" not in frame:
            frame[f"rate_{variant}"] = None
    return table_from_frame(frame, [
        text_column("bench", "bench_id"),
        text_column("machine"),
        number_column("threads", "threads", fmt_text),
        number_column("(a) USC lab's pipeline, samples/s", "rate_a", fmt_rate),
        number_column("(b) best pipeline, samples/s", "rate_b", fmt_rate),
        number_column("(c) compute only, samples/s", "rate_c", fmt_rate),
        number_column("b ÷ a", "b_over_a", fmt_number, 3),
        number_column("b ÷ c", "b_over_c", fmt_number, 3),
        number_column("load average (1 min) at start", "load", fmt_number, 3),
    ], caption="bench/data_pipeline.py: the same model and batch trained one epoch at a time with (a) the USC lab's "
               "pipeline, (b) the lab's best and (c) batches already in place; ratios are medians of within-round "
               "ratios", row_id_column="run_id")


@register_section("lab02")
def optimisation_path(ctx: SectionContext) -> Section | None:
    sweeps = _sweep_rows(ctx.runs)
    bench = _bench_table(ctx.runs)
    if sweeps.empty and bench is None:
        return None
    paragraphs = [
        "Each step of a sweep runs mnist_classify.py under kernprof with one more optimisation than the step "
        "before. Speed-up is samples/s over the sweep's own baseline step (the USC lab's configuration) on the same "
        "machine; the data-loading line is the share of train()'s time spent on "
        "'for batch_idx, (data, target) in enumerate(train_loader)'.",
    ]
    tables, figures, notes = [], [], []
    if not sweeps.empty:
        order = (sweeps.groupby("sweep_id")["created"].max().sort_values(ascending=False).index.tolist())
        for sweep_id in order[:MAX_SWEEPS]:
            sweep = sweeps[sweeps["sweep_id"] == sweep_id].sort_values("index", kind="stable")
            machine, dataset = sweep["machine"].iloc[0], sweep["dataset"].iloc[0]
            title = f"sweep {sweep_id} · {dataset} · {machine}"
            tables.append(table_from_frame(sweep, SWEEP_COLUMNS, caption=title))
            sentence = _share_sentence(sweep)
            if sentence:
                paragraphs.append(f"{title}: {sentence}")
            if ctx.plots and (sweep["status"] == "ok").any():
                figures.append(_sweep_figure(sweep, title))
        if len(order) > MAX_SWEEPS:
            notes.append(f"{len(order) - MAX_SWEEPS} older sweep(s) not shown; their runs are in the summary.")
    if bench is not None:
        tables.append(bench)
    return Section("Lab 02: the optimisation path", paragraphs=paragraphs, figures=figures, tables=tables,
                   notes=notes)
