"""Lab 03 (the precision benchmark): ms/batch, TFLOP/s against the peak and the loss check, laid out as the SJTU
page's table: a model per row, a precision per column, a table per machine, process count and mode.
"""

from __future__ import annotations

from typing import Callable, Iterable

import pandas as pd

from common.cli import BENCHMARK_MODES as MODES, BENCHMARK_PRECISIONS as PRECISIONS
from common.report.runs import flags, numbers, texts
from common.report.sections import MISSING, Cell, Section, SectionContext, Table, fmt, register_section


def _ordered(values: Iterable[object], order: Iterable[str]) -> list[str]:
    present = list(dict.fromkeys(v for v in values if isinstance(v, str)))
    return [v for v in order if v in present] + sorted(v for v in present if v not in order)


def _grid(group: pd.DataFrame, caption: str, measured: Callable[[pd.Series, float], Cell], mean: bool = False) -> Table:
    """A row per model, a cell per precision: ``measured(its medians over repeats, fp32's ms)``, else skipped (the
    device cannot run it: a record per mode, for every model), failed or MISSING."""
    ok = group[group["status"] == "ok"]
    cells = ok.groupby(["model", "precision"]).agg(
        ms=("ms", "median"), ms_std=("ms_std", "median"), runs=("run_id", ", ".join), n=("run_id", "size"),
        diverged=("diverged", "any"), inconclusive=("inconclusive", "any"), tflops=("achieved_tflops", "median"),
        peak=("peak", "median"), source=("source", "first"), relative=("relative", "median"), loss=("loss", "first"),
        fp32_loss=("fp32_loss", "first"), reason=("check_reason", "first"))
    skipped = dict(group.loc[group["status"] == "skipped", ["precision", "reason"]].values)
    failed = {(m, p): r for m, p, r in group.loc[group["status"] == "failed", ["model", "precision", "reason"]].values}
    models, precisions = list(dict.fromkeys(group["model"].dropna())), _ordered(group["precision"], PRECISIONS)
    rows = [[Cell(model)] + [
        Cell("skipped", title=skipped[precision]) if precision in skipped else
        measured(cells.loc[(model, precision)], cells["ms"].get((model, "fp32")))
        if (model, precision) in cells.index else
        Cell("failed", title=failed[(model, precision)], style="warn") if (model, precision) in failed else
        Cell(MISSING) for precision in precisions] for model in models]
    if mean and len(models) > 1:
        means = [cells["ms"].reindex([(m, p) for m in models]).mean(skipna=False) for p in precisions]
        rows.append([Cell("mean of models")] + [Cell(fmt(value, "{:.2f}"), style="num") for value in means])
    return Table(columns=["model", *precisions], rows=rows, caption=caption)


def _ms(cell: pd.Series, fp32: float | None) -> Cell:
    speedup = f" · {fp32 / cell['ms']:.2f}×" if fp32 and cell["ms"] and cell.name[1] != "fp32" else ""
    title = f"median of {cell['n']} run(s); std {fmt(cell['ms_std'], '{:.3g}')} ms; run {cell['runs']}"
    return Cell(fmt(cell["ms"], "{:.2f}") + speedup + (" ⚠" if cell["diverged"] else ""),
                title=title + ("; the loss check flagged it" if cell["diverged"] else ""),
                style="num warn" if cell["diverged"] else "num")


def _tflops(cell: pd.Series, _: float | None) -> Cell:
    share = f" ({fmt(cell['tflops'] / cell['peak'], '%')} of {cell['peak']:g})" if cell["peak"] > 0 else ""
    return Cell(fmt(cell["tflops"], "{:.3g}") + (share if pd.notna(cell["tflops"]) else ""),
                title=None if pd.isna(cell["source"]) else f"peak: {cell['source']}", style="num")


def _loss(cell: pd.Series, _: float | None) -> Cell:
    if pd.isna(cell["relative"]) and cell["inconclusive"]:  # GradScaler skipped every step: nothing to compare
        return Cell("inconclusive", title=cell["reason"], style="num warn")
    shown = "NaN/inf" if pd.isna(cell["relative"]) and cell["diverged"] else fmt(cell["relative"], "{:.2%}")
    title = f"loss {fmt(cell['loss'], 'num')} vs fp32 {fmt(cell['fp32_loss'], 'num')}"
    title += f"; {cell['reason']}" if cell["diverged"] and isinstance(cell["reason"], str) else ""
    return Cell(shown + (" ⚠ diverged" if cell["diverged"] else ""), title=title,
                style="num warn" if cell["diverged"] else "num")


@register_section("lab03")
def precision_section(ctx: SectionContext) -> Section | None:
    runs = ctx.runs
    results = runs.assign(
        precision=texts(runs, "config.precision"), mode=texts(runs, "config.mode"),
        processes=runs["world_size"].fillna(1).astype(int), reason=runs["notes"].map("; ".join),
        ms=numbers(runs, "metrics.ms_per_batch.median"), ms_std=numbers(runs, "metrics.ms_per_batch.std"),
        peak=numbers(runs, "metrics.peak_tflops"), source=texts(runs, "metrics.peak_source"),
        relative=numbers(runs, "metrics.loss_check.relative_diff"), loss=numbers(runs, "metrics.loss_check.loss"),
        fp32_loss=numbers(runs, "metrics.loss_check.fp32_loss"), diverged=flags(runs, "metrics.loss_check.diverged"),
        inconclusive=texts(runs, "metrics.loss_check.verdict") == "inconclusive",
        check_reason=texts(runs, "metrics.loss_check.reason")).dropna(subset=["precision", "mode"])
    if results.empty:
        return None
    tables, flagged = [], []
    for (machine, processes), group in results.groupby(["machine", "processes"], sort=True):
        where = f"{machine} · {processes} process" + ("es (DDP)" if processes > 1 else "")
        modes = _ordered(group["mode"], MODES)
        for mode in modes:
            in_mode, head = group[group["mode"] == mode], f"{mode}, {where}: "
            tables.append(_grid(in_mode, head + "median ms per batch · speed-up over fp32", _ms, mean=True))
            tables.append(_grid(in_mode, head + "achieved TFLOP/s per device (share of the datasheet peak)", _tflops))
        first = group[group["mode"] == modes[0]]
        tables.append(_grid(first, f"{where}: loss after the check steps, difference from fp32 as a share of the "
                                   "initial loss", _loss))
        flagged += [f"{where}: {m} at {p}" for m, p in first.loc[(first["status"] == "ok") & first["diverged"],
                                                                 ["model", "precision"]].values]
    return Section("Lab 03: precision benchmark", paragraphs=[
        "Each model ran at each precision from the same initial weights on the same fixed batch. ms/batch is the "
        "median over the timed iterations (warm-up dropped, the GPU synchronised before each clock read); "
        "the factor after it is fp32's time divided by this precision's (above 1 is faster). fp32 means TF32 off.",
        "Achieved TFLOP/s counts only convolutions and matmuls (torch.utils.flop_counter), per device; the peak is "
        "the device's datasheet figure for that precision (dense, no sparsity), where known.",
        "Correctness: after a few SGD steps the loss of each precision is compared with fp32's after as many applied "
        "steps (amp-fp16's GradScaler may skip some); a difference above the run's tolerance (5% of the initial loss "
        "by default) or a NaN/inf flags the precision (⚠); when every step was skipped the check is inconclusive.",
    ], tables=tables, notes=[f"Flagged by the loss check: {', '.join(dict.fromkeys(flagged))}."] if flagged else [])
