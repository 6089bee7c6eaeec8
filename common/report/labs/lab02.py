"""Lab 02 (profiling and the data pipeline): each sweep of ``sweep.py`` (a record per step, ``config.sweep``) as a
table and a plot in path order, and ``bench/data_pipeline.py``'s records (``config.bench``) as a table of their own.
"""

from __future__ import annotations

import pandas as pd

from common.report.plots import axes, plain, png_figure
from common.report.runs import numbers, texts
from common.report.sections import Figure, Section, SectionContext, Table, fmt, register_section, table_from_frame

#: Sweeps shown in full, newest first; older ones are only counted.
MAX_SWEEPS = 4
SWEEP_COLUMNS = {
    "step": "method", "change": "config.sweep.change", "batch": ("global_batch_size", "{:.0f}"),
    "time / epoch": ("time_per_epoch_s", "s"), "samples/s": ("samples_per_s", "rate"),
    "speed-up over the USC lab's script": ("metrics.speedup_vs_seed", "x"),
    "data-loading line": ("metrics.data_loading_share", "%1"), "compile time": ("metrics.compile_s", "s"),
    "test accuracy": ("test_accuracy", "%1"), "status": "status",
}


def _sweep_figure(sweep: pd.DataFrame, title: str) -> Figure:
    ok = sweep[sweep["status"] == "ok"]
    fig, panels_axes = axes(12, 3.6, 3, sharey=True)
    panels = [(ok["time_per_epoch_s"], "time per epoch (s)", "tab:gray"),
              (ok["samples_per_s"], "samples/s (label: speed-up over the USC lab's script)", "tab:blue"),
              (ok["share"] * 100, "data-loading line, % of train() (line_profiler)", "tab:orange")]
    for ax, (values, xlabel, color) in zip(panels_axes, panels):
        ax.barh(range(len(ok)), values.fillna(0), color=color)
        ax.set_xlabel(xlabel, fontsize="small")
        ax.grid(axis="x", alpha=0.3)
    panels_axes[0].set_yticks(range(len(ok)), [plain(str(step)) for step in ok["method"]])
    panels_axes[0].invert_yaxis()
    panels_axes[1].margins(x=0.15)  # room for the speed-up labels
    speedups = numbers(ok, "metrics.speedup_vs_seed").where(ok["samples_per_s"].notna())
    panels_axes[1].bar_label(panels_axes[1].containers[0], [f"{s:.2f}×" if pd.notna(s) else "" for s in speedups],
                             padding=3, fontsize="small")
    fig.suptitle(plain(title), fontsize="medium")
    return png_figure(fig, alt=f"Time per epoch, throughput and data-loading share for each step of {title}",
                      caption="Each step adds one change to the step above it (the optimisation path).")


def _share_paragraphs(sweep: pd.DataFrame, title: str) -> list[str]:
    ok = sweep[(sweep["status"] == "ok") & sweep["share"].notna()]
    if len(ok) < 2:
        return []
    first, last = ok.iloc[0], ok.iloc[-1]
    return [f"{title}: The data-loading line took {fmt(first['share'], '%1')} of train() at '{first['method']}' and "
            f"{fmt(last['share'], '%1')} at '{last['method']}' (the USC lab's own table: 84.5 % on a GPU with "
            "one CPU core)."]


def _bench_table(runs: pd.DataFrame) -> Table | None:
    """One row per benchmark: the three variants' throughput and the two ratios."""
    runs = runs.assign(bench_id=texts(runs, "config.bench.bench_id"), variant=texts(runs, "config.bench.variant"))
    runs = runs[runs["variant"].isin(["a", "b", "c"])]
    if runs.empty:
        return None
    rates = runs.pivot_table(index="bench_id", columns="variant", values="samples_per_s", aggfunc="last")
    first = runs.reindex(columns=["bench_id", "machine", "created", "run_id", "config.threads", "metrics.b_over_a",
                                  "metrics.b_over_c", "metrics.load_average_start"]).groupby("bench_id").first()
    frame = first.join(rates.reindex(columns=list("abc")).add_prefix("rate_"))
    return table_from_frame(frame.reset_index().sort_values("created"), {
        "bench": "bench_id", "machine": "machine", "threads": ("config.threads", "{}"),
        "(a) USC lab's pipeline, samples/s": ("rate_a", "rate"), "(b) best pipeline, samples/s": ("rate_b", "rate"),
        "(c) compute only, samples/s": ("rate_c", "rate"), "b ÷ a": ("metrics.b_over_a", "{:.3g}"),
        "b ÷ c": ("metrics.b_over_c", "{:.3g}"),
        "load average (1 min) at start": ("metrics.load_average_start", "{:.3g}"),
    }, caption="bench/data_pipeline.py: the same model and batch trained one epoch at a time with (a) the USC "
               "lab's pipeline, (b) the lab's best and (c) batches already in place; ratios are medians of "
               "within-round ratios")


@register_section("lab02")
def optimisation_path(ctx: SectionContext) -> Section | None:
    sweeps = ctx.runs.assign(sweep_id=texts(ctx.runs, "config.sweep.sweep_id"),
                             index=numbers(ctx.runs, "config.sweep.index"),
                             share=numbers(ctx.runs, "metrics.data_loading_share")).dropna(subset=["sweep_id"])
    bench = _bench_table(ctx.runs)
    if sweeps.empty and bench is None:
        return None
    paragraphs = [
        "Each step of a sweep runs mnist_classify.py under kernprof with one more optimisation than the step "
        "before. Speed-up is samples/s over the sweep's own baseline step (the USC lab's configuration) on the same "
        "machine; the data-loading line is the share of train()'s time spent on "
        "'for batch_idx, (data, target) in enumerate(train_loader)'."]
    tables, figures, notes = [], [], []
    newest = sweeps.groupby("sweep_id")["created"].max().sort_values(ascending=False).index
    for sweep_id in newest[:MAX_SWEEPS]:
        sweep = sweeps[sweeps["sweep_id"] == sweep_id].sort_values("index", kind="stable")
        title = f"sweep {sweep_id} · {fmt(texts(sweep, 'config.dataset').iloc[0])} · {sweep['machine'].iloc[0]}"
        tables.append(table_from_frame(sweep, SWEEP_COLUMNS, caption=title))
        paragraphs += _share_paragraphs(sweep, title)
        if ctx.plots and (sweep["status"] == "ok").any():
            figures.append(_sweep_figure(sweep, title))
    if len(newest) > MAX_SWEEPS:
        notes.append(f"{len(newest) - MAX_SWEEPS} older sweep(s) not shown; their runs are in the summary.")
    return Section("Lab 02: the optimisation path", paragraphs=paragraphs, figures=figures,
                   tables=tables + ([bench] if bench is not None else []), notes=notes)
