"""Lab 01 (DataParallel vs DDP): what the summary does not show, how unevenly DataParallel loads its first device
and whether the three methods, given the same seed and global batch, trained the same thing.
"""

from __future__ import annotations

import statistics
from typing import Iterator

import pandas as pd

from common.report.runs import BASELINE_METHOD, DDP_MIN_EFFICIENCY, is_ddp, number
from common.report.sections import Row, Section, SectionContext, register_section, table_from_frame

#: Which run a row is: the first columns of both tables.
RUN_COLUMNS = {"run": "run_id", "method": "method", "machine": "machine", "devices": ("devices", "int")}


def _cpu_ddp_notes(runs: pd.DataFrame) -> Iterator[str]:
    """Why DDP on a CPU scales far below the GPU expectation (one paragraph per such run)."""
    low = runs["method"].map(is_ddp) & runs["device_type"].eq("cpu") & (runs["scaling_efficiency"] < DDP_MIN_EFFICIENCY)
    for run in runs[low].to_dict("records", into=Row):
        cores, threads = (number(run[f"provenance.device.{key}"]) for key in ("cpu_count", "threads"))
        shared = (f"its {run['devices']} processes ({threads:.0f} thread(s) each) shared this machine's {cores:.0f} "
                  "cores" if cores and threads else f"its {run['devices']} processes shared one machine")
        yield (f"DDP on CPU ({run['run_id']}): a scaling efficiency of {run['scaling_efficiency']:.0%} is expected "
               "here and is not a failure of DDP. On a GPU node each process owns a GPU, and the course expects at "
               f"least {DDP_MIN_EFFICIENCY:.0%}. Here {shared}: the processes compete for the same cores, memory "
               "bandwidth and caches that the single-process baseline had to itself, and Gloo's all-reduce runs on "
               "those same cores instead of overlapping on a separate device. What this run proves is that the "
               "replicas stayed identical and trained the same thing (the loss table below); the speed-up has to be "
               "measured on GPUs.")


@register_section("lab01")
def dp_vs_ddp(ctx: SectionContext) -> Section | None:
    runs = ctx.runs
    multi = runs[runs["memory_per_device"].map(len) > 1]
    first = multi["memory_per_device"].map(lambda memory: memory[0][1])
    others = multi["memory_per_device"].map(lambda memory: statistics.mean(peak for _, peak in memory[1:]))
    trained = runs[runs["final_loss"].notna() & (runs["status"] == "ok")]
    baseline = trained[trained["method"] == BASELINE_METHOD].groupby("comparison")["final_loss"].median()
    memory = table_from_frame(multi.assign(first=first, others=others, ratio=first / others.where(others > 0)), {
        **RUN_COLUMNS, "first device peak": ("first", "bytes"), "other devices (mean)": ("others", "bytes"),
        "first ÷ others": ("ratio", "x"),
    }, caption="Peak memory of the first device against the others, for runs that recorded several devices")
    losses = table_from_frame(trained.assign(vs=trained["final_loss"] - trained["comparison"].map(baseline)), {
        **RUN_COLUMNS, "global batch": ("global_batch_size", "int"), "steps": ("metrics.steps", "int"),
        "final loss": ("final_loss", "num"), "minus baseline": ("vs", "{:.2g}"),
    }, caption="Final training loss: with the same seed, data and global batch the methods should agree")
    tables = [table for table in (memory, losses) if table.rows]  # a table only where some run has its numbers
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
