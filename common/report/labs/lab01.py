"""Lab 01 (DataParallel vs DistributedDataParallel): memory balance and loss agreement.

Two things the summary table does not show directly: how unevenly DataParallel loads its first
device, and whether the three methods, given the same seed and global batch, trained the same thing.
"""

from __future__ import annotations

import pandas as pd

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
    return Section("DataParallel vs DDP", paragraphs=[
        "DataParallel is one process: every step it copies the model to each GPU, scatters the batch from "
        "the first GPU and gathers the outputs back onto it, so the first device holds more than the others "
        "and a ratio well above 1 is expected. DDP runs one process per device, each with its own copy, "
        "and only all-reduces gradients, so its devices should sit close to 1.",
        "The three methods compute the same mathematics on the same global batch; their final losses "
        "should differ only by floating-point reduction order.",
    ], tables=tables)
