"""Lab 01 (DataParallel vs DistributedDataParallel): memory balance and loss agreement.

Two things the summary table does not show directly: how unevenly DataParallel loads its first
device, and whether the three methods, given the same seed and global batch, trained the same thing.
"""

from __future__ import annotations

import pandas as pd

from common.report.checks import DDP_MIN_EFFICIENCY, is_ddp
from common.report.runs import BASELINE_METHOD, get
from common.report.sections import (
    Section, SectionContext, fmt_bytes, fmt_int, fmt_number, fmt_ratio, num, number_column, register_section,
    table_from_frame, text_column,
)


def _balance(memory: list[tuple[str, float]]) -> dict[str, float]:
    first = memory[0][1]
    others = [peak for _, peak in memory[1:]]
    mean_others = sum(others) / len(others)
    return {"first": first, "others": mean_others, "ratio": first / mean_others if mean_others else float("nan")}


#: Which run a row is: the first columns of both tables.
_RUN_COLUMNS = [text_column("run", "run_id"), text_column("method"), text_column("machine"),
                number_column("devices", "devices", fmt_int)]


def _cpu_ddp_notes(runs: pd.DataFrame) -> list[str]:
    """Why DDP on a CPU scales far below the GPU expectation (one paragraph per such run)."""
    notes = []
    for run in runs.to_dict("records"):
        efficiency = run["scaling_efficiency"]
        if not (is_ddp(run["method"]) and run["device_type"] == "cpu" and pd.notna(efficiency)
                and efficiency < DDP_MIN_EFFICIENCY):
            continue
        device = get(run["record"], "provenance", "device") or {}
        cores, threads = device.get("cpu_count"), device.get("threads")
        shared = (f"its {fmt_int(run['devices'])} processes ({threads} thread(s) each) shared this machine's "
                  f"{cores} cores" if cores and threads else f"its {fmt_int(run['devices'])} processes shared one machine")
        notes.append(
            f"DDP on CPU ({run['run_id']}): a scaling efficiency of {efficiency:.0%} is expected here and is not a "
            f"failure of DDP. On a GPU node each process owns a GPU, and the course expects at least "
            f"{DDP_MIN_EFFICIENCY:.0%}. Here {shared}: the processes compete for the same cores, memory "
            "bandwidth and caches that the single-process baseline had to itself, and Gloo's all-reduce "
            "runs on those same cores instead of overlapping on a separate device. What this run proves is "
            "that the replicas stayed identical and trained the same thing (the loss table below); the "
            "speed-up has to be measured on GPUs.")
    return notes


@register_section("lab01")
def dp_vs_ddp(ctx: SectionContext) -> Section | None:
    runs = ctx.runs
    tables = []

    multi = runs[runs["memory_per_device"].map(len) > 1].copy()
    if not multi.empty:
        balance = pd.DataFrame([_balance(m) for m in multi["memory_per_device"]], index=multi.index)
        multi = multi.join(balance)
        tables.append(table_from_frame(multi, [
            *_RUN_COLUMNS,
            number_column("first device peak", "first", fmt_bytes),
            number_column("other devices (mean)", "others", fmt_bytes),
            number_column("first ÷ others", "ratio", fmt_ratio),
        ], caption="Peak memory of the first device against the others, for runs that recorded several devices"))

    trained = runs[runs["final_loss"].notna() & (runs["status"] == "ok")].copy()
    if not trained.empty:
        baseline_loss = trained[trained["method"] == BASELINE_METHOD].groupby("comparison")["final_loss"].median()
        trained["loss_vs_baseline"] = trained["final_loss"] - trained["comparison"].map(baseline_loss)
        trained["steps"] = [get(record, "metrics", "steps") for record in trained["record"]]
        tables.append(table_from_frame(trained, [
            *_RUN_COLUMNS,
            number_column("global batch", "global_batch_size", fmt_int),
            ("steps", lambda r: num(fmt_int(r["steps"]) if isinstance(r["steps"], int) else "—")),
            number_column("final loss", "final_loss", fmt_number),
            number_column("minus baseline", "loss_vs_baseline", fmt_number, 2),
        ], caption="Final training loss: with the same seed, data and global batch the methods should agree"))

    if not tables:
        return None
    return Section("DataParallel vs DDP", paragraphs=[*_cpu_ddp_notes(runs),
        "DataParallel is one process: every step it copies the model to each GPU, scatters the batch from "
        "the first GPU and gathers the outputs back onto it, so the first device holds more than the others "
        "and a ratio well above 1 is expected. DDP runs one process per device, each with its own copy, "
        "and only all-reduces gradients, so its devices should sit close to 1.",
        "The three methods compute the same mathematics on the same global batch; their losses differ only "
        "by floating-point reduction order: equal to about 1e-6 over the first steps, while over a long run "
        "training amplifies those rounding differences into small differences of the final loss.",
    ], tables=tables)
