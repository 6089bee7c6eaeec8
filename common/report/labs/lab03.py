"""Lab 03 (the precision benchmark): ms/batch per model and precision, TFLOP/s against the peak, and the loss check.

``labs/lab03_precision_benchmark/benchmark_models.py`` writes one record per model, mode and precision
(method ``<mode>-<precision>``; ``config.model``, ``config.mode``, ``config.precision``) with
``metrics.ms_per_batch.median``, ``achieved_tflops``, ``peak_tflops`` and ``loss_check``; a precision
the device cannot run is one ``skipped`` record per mode with ``config.model`` empty and the reason in
``notes``. This section lays them out as the SJTU page's table does, a model per row and a precision per
column, one table per machine, process count and mode; repeats of a cell are combined with the median.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Iterable

import pandas as pd

from common.cli import BENCHMARK_MODES as MODES, BENCHMARK_PRECISIONS as PRECISIONS
from common.report.runs import get, number
from common.report.sections import (
    MISSING, Cell, Section, SectionContext, Table, fmt_number, fmt_percent, register_section,
)

def _results(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per record: where it ran, what it ran, and the numbers this section shows."""
    rows = []
    for run in runs.to_dict("records"):
        record = run["record"]
        precision, mode = get(record, "config", "precision"), get(record, "config", "mode")
        if not isinstance(precision, str) or not isinstance(mode, str):
            continue
        check = get(record, "metrics", "loss_check") or {}
        rows.append({
            "machine": run["machine"], "processes": int(run["world_size"] or 1), "mode": mode,
            "precision": precision, "model": run["model"], "status": run["status"],
            "reason": "; ".join(run["notes"]) if run["status"] != "ok" else "",
            "run_id": run["run_id"],
            "ms": number(get(record, "metrics", "ms_per_batch", "median")),
            "ms_std": number(get(record, "metrics", "ms_per_batch", "std")),
            "tflops": number(get(record, "metrics", "achieved_tflops")),
            "peak": number(get(record, "metrics", "peak_tflops")),
            "peak_source": get(record, "metrics", "peak_tflops_source"),
            "loss_rel": number(check.get("relative_diff")) if isinstance(check, dict) else None,
            "loss": number(check.get("loss")) if isinstance(check, dict) else None,
            "fp32_loss": number(check.get("fp32_loss")) if isinstance(check, dict) else None,
            "diverged": bool(check.get("diverged")) if isinstance(check, dict) else False,
            "inconclusive": isinstance(check, dict) and check.get("verdict") == "inconclusive",
            "check_reason": check.get("reason") if isinstance(check, dict) else None,
        })
    return pd.DataFrame(rows)


def _ordered(values: Iterable[Any], order: tuple[str, ...]) -> list[Any]:
    present = list(dict.fromkeys(v for v in values if isinstance(v, str)))
    return [v for v in order if v in present] + sorted(v for v in present if v not in order)


def _median(values: Iterable[Any]) -> float | None:
    finite = [v for v in values if v is not None and not pd.isna(v)]
    return statistics.median(finite) if finite else None


class _Grid:
    """The records of one machine, process count and mode, indexed by (model, precision)."""

    def __init__(self, results: pd.DataFrame) -> None:
        self.ok = results[results["status"] == "ok"]
        self.models = list(dict.fromkeys(m for m in results["model"] if isinstance(m, str)))
        self.precisions = _ordered(results["precision"], tuple(PRECISIONS))
        # A skipped record speaks for every model (the device cannot run that precision at all).
        skipped = results[results["status"] == "skipped"]
        self.skipped = dict(zip(skipped["precision"], skipped["reason"]))
        self.failed = {(m, p): r for m, p, s, r in zip(results["model"], results["precision"], results["status"],
                                                       results["reason"]) if s == "failed"}

    def cell(self, model: str, precision: str) -> pd.DataFrame:
        return self.ok[(self.ok["model"] == model) & (self.ok["precision"] == precision)]

    def ms(self, model: str, precision: str) -> float | None:
        return _median(self.cell(model, precision)["ms"])

    def missing(self, model: str, precision: str) -> Cell | None:
        """The cell to show when nothing was measured: skipped, failed, or not run."""
        if precision in self.skipped:
            return Cell("skipped", title=self.skipped[precision])
        if (model, precision) in self.failed and self.cell(model, precision).empty:
            return Cell("failed", title=self.failed[(model, precision)], style="warn")
        if self.cell(model, precision).empty:
            return Cell(MISSING)
        return None

    def rows(self, measured: Callable[[str, str, pd.DataFrame], Cell]) -> list[list[Cell]]:
        """A row per model and a cell per precision: ``measured(model, precision, records)`` where
        something was measured, else what :meth:`missing` shows."""
        rows = []
        for model in self.models:
            cells = [Cell(model)]
            for precision in self.precisions:
                empty = self.missing(model, precision)
                cells.append(empty if empty is not None else measured(model, precision, self.cell(model, precision)))
            rows.append(cells)
        return rows


def _ms_table(grid: _Grid, caption: str) -> Table:
    def measured(model: str, precision: str, results: pd.DataFrame) -> Cell:
        fp32, ms = grid.ms(model, "fp32"), grid.ms(model, precision)
        speedup = f" · {fp32 / ms:.2f}×" if fp32 and ms and precision != "fp32" else ""
        diverged = bool(results["diverged"].any())
        title = (f"median of {len(results)} run(s); std {fmt_number(_median(results['ms_std']), 3)} ms; "
                 f"run {', '.join(results['run_id'])}")
        return Cell(f"{ms:.2f}{speedup}{' ⚠' if diverged else ''}",
                    title=title + ("; the loss check flagged it" if diverged else ""),
                    style="num warn" if diverged else "num")

    rows = grid.rows(measured)
    means = [Cell("mean of models")]
    for precision in grid.precisions:
        values = [grid.ms(model, precision) for model in grid.models]
        complete = values and all(v is not None for v in values)
        means.append(Cell(f"{sum(values) / len(values):.2f}" if complete else MISSING, style="num"))
    if len(grid.models) > 1:
        rows.append(means)
    return Table(columns=["model", *grid.precisions], rows=rows, caption=caption)


def _tflops_table(grid: _Grid, caption: str) -> Table:
    def measured(model: str, precision: str, results: pd.DataFrame) -> Cell:
        tflops, peak = _median(results["tflops"]), _median(results["peak"])
        share = f" ({fmt_percent(tflops / peak)} of {peak:g})" if tflops is not None and peak else ""
        source = next((s for s in results["peak_source"] if isinstance(s, str)), "")
        return Cell(f"{fmt_number(tflops, 3)}{share}", title=f"peak: {source}" if source else None, style="num")

    return Table(columns=["model", *grid.precisions], rows=grid.rows(measured), caption=caption)


def _loss_table(grid: _Grid, caption: str) -> Table:
    def measured(model: str, precision: str, results: pd.DataFrame) -> Cell:
        diverged = bool(results["diverged"].any())
        relative = _median(results["loss_rel"])
        text = "NaN/inf" if relative is None and diverged else fmt_percent(relative, 2)
        first = results.iloc[0]
        if relative is None and results["inconclusive"].any():  # GradScaler skipped every step: nothing to compare
            return Cell("inconclusive", title=first["check_reason"], style="num warn")
        title = (f"loss {fmt_number(first['loss'])} vs fp32 {fmt_number(first['fp32_loss'])}"
                 + (f"; {first['check_reason']}" if diverged and first["check_reason"] else ""))
        return Cell(text + (" ⚠ diverged" if diverged else ""), title=title, style="num warn" if diverged else "num")

    return Table(columns=["model", *grid.precisions], rows=grid.rows(measured), caption=caption)


@register_section("lab03")
def precision_section(ctx: SectionContext) -> Section | None:
    results = _results(ctx.runs)
    if results.empty:
        return None
    tables, flagged = [], []
    for (machine, processes), group in results.groupby(["machine", "processes"], sort=True):
        where = f"{machine} · {processes} process{'es' if processes > 1 else ''}{' (DDP)' if processes > 1 else ''}"
        for mode in _ordered(group["mode"], MODES):
            grid = _Grid(group[group["mode"] == mode])
            tables.append(_ms_table(grid, f"{mode}, {where}: median ms per batch · speed-up over fp32"))
            tables.append(_tflops_table(grid, f"{mode}, {where}: achieved TFLOP/s per device (share of the "
                                              "datasheet peak)"))
        grid = _Grid(group[group["mode"] == _ordered(group["mode"], MODES)[0]])
        tables.append(_loss_table(grid, f"{where}: loss after the check steps, difference from fp32 as a share "
                                        "of the initial loss"))
        flagged += [f"{where}: {m} at {p}" for m, p in zip(grid.ok["model"], grid.ok["precision"])
                    if grid.cell(m, p)["diverged"].any()]
    paragraphs = [
        "Each model ran at each precision from the same initial weights on the same fixed batch. ms/batch is the "
        "median over the timed iterations (warm-up dropped, the GPU synchronised before each clock read); "
        "the factor after it is fp32's time divided by this precision's (above 1 is faster). fp32 means TF32 off.",
        "Achieved TFLOP/s counts only convolutions and matmuls (torch.utils.flop_counter), per device; the peak is "
        "the device's datasheet figure for that precision (dense, no sparsity), where known.",
        "Correctness: after a few SGD steps the loss of each precision is compared with fp32's after as many applied "
        "steps (amp-fp16's GradScaler may skip some); a difference above the run's tolerance (5% of the initial loss "
        "by default) or a NaN/inf flags the precision (⚠); when every step was skipped the check is inconclusive.",
    ]
    notes = [f"Flagged by the loss check: {', '.join(dict.fromkeys(flagged))}."] if flagged else []
    return Section("Lab 03: precision benchmark", paragraphs=paragraphs, tables=tables, notes=notes)
