"""Lab 07 (beyond data parallel): tensor, sequence, pipeline and 2-D parallel runs against the one-process run
(method ``reference``) of the same script and settings, the pipeline bubble against its formula, and a decision
table whose numbers are these measurements (and Lab-04's DDP and FSDP2 records when the folder has them).
"""

from __future__ import annotations

import pandas as pd

from common.report.plots import axes, finish_axes, plain, png_figure
from common.report.runs import group_key, largest, largest_loss_difference, losses, numbers, shape
from common.report.sections import (MISSING, Cell, Figure, Section, SectionContext, fmt, is_missing, register_section,
                                    table_from_frame)

#: When each strategy is the one to reach for, and what it costs; the numbers beside come from records.
WHEN = {
    "DP (DDP, Lab-04)": "model + gradients + AdamW state fit one device: one gradient all-reduce per step, "
                        "overlapped with backward; the cheapest traffic",
    "FSDP (FSDP2, Lab-04)": "the states do not fit but one block does: 1/N of them per rank for about 1.5x DDP's "
                            "traffic (gather per block forward and backward, reduce-scatter of gradients)",
    "TP (tensor parallel)": "one layer's weights or activations do not fit, or the batch per device cannot grow: "
                            "traffic on every layer, forward and backward, so keep it inside a node (NVLink)",
    "PP (pipeline)": "the depth does not fit and the link between nodes is slow: only activations at stage "
                     "boundaries move, but every rank idles (p-1)/(m+p-1) of a step; use m >= 4p micro-batches",
    "2-D (FSDP x TP)": "the largest models: tensor parallel inside a node, FSDP2 across nodes; the checkpoint "
                       "reshards onto any other mesh",
}
#: A method's strategy: Lab-04's by name; Lab-07's by the method (tp, tp+sp) or its prefix (pp-gpipe, 2d-2x2).
LAB04 = {"ddp": "DP (DDP, Lab-04)", "fsdp": "FSDP (FSDP2, Lab-04)"}
KINDS = {"tp": "TP (tensor parallel)", "tp+sp": "TP (tensor parallel)", "pp": "PP (pipeline)", "2d": "2-D (FSDP x TP)"}
KEY = ("script", *(f"config.{name}" for name in ("layers", "width", "heads", "context", "batch_size", "seed", "lr")))


def _rows(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs that finished, each with the largest loss difference, step by step, from the one-process run of the
    same script and settings (``difference``) and its parameter bytes per rank as a share of that run's."""
    runs = runs[runs["status"] == "ok"].assign(method=lambda ok: ok["method"].fillna(""))
    rows = runs.assign(
        script_name=runs["script"].fillna("").str.rsplit("/", n=1).str[-1], shape=shape(runs), losses=losses(runs),
        ranks=numbers(runs, "metrics.world_size"), batch=numbers(runs, "config.batch_size"),
        microbatches=numbers(runs, "config.microbatches").where(runs["method"].str.startswith("pp-")),
        parameters=largest(runs, "metrics.per_rank", "parameter_bytes"),
        activations=largest(runs, "metrics.per_rank", "activation_bytes"),
        comm=largest(runs, "metrics.per_rank", "comm_bytes"),
        comm_predicted=numbers(runs, "metrics.comm_predicted.total_bytes"),
        bubble=numbers(runs, "metrics.bubble_measured"), bubble_formula=numbers(runs, "metrics.bubble_formula"),
        tokens_per_s=numbers(runs, "metrics.tokens_per_s"),
        first_step=numbers(runs, "metrics.first_step").fillna(0).astype(int), key=group_key(runs, ["machine", *KEY]))
    references = rows["method"] == "reference"
    whole = rows[references & (rows["parameters"] > 0)].groupby("key")["parameters"].last()
    return rows.assign(difference=largest_loss_difference(rows, references, rows["first_step"]),
                       share=(rows["parameters"] / rows["key"].map(whole)).where(~references))


def _bubble_figure(pipeline: pd.DataFrame) -> Figure:
    fig, axis = axes(6.5, 4)
    for (method, ranks), group in pipeline.sort_values("microbatches", kind="stable").groupby(["method", "ranks"]):
        axis.plot(group["microbatches"], group["bubble"], marker="o",
                  label=plain(f"{method}, {int(ranks)} ranks measured"))
        axis.plot(group["microbatches"], group["bubble_formula"], linestyle="--", color="grey")
    axis.set_xscale("log", base=2)
    finish_axes(axis, xlabel="micro-batches per step (m)", ylabel="idle fraction of a step")
    return png_figure(fig, alt="Pipeline bubble measured against (p-1)/(m+p-1)",
                      caption="Measured idle fraction per rank (1 − compute time ÷ wall time of the step) "
                              "against the formula (p − 1)/(v m + p − 1) (dashed).")


def _decision(rows: pd.DataFrame, all_runs: pd.DataFrame) -> pd.DataFrame:
    """One row per strategy: its measured runs against the one-process reference of the same model; DP and FSDP
    from Lab-04's records of the same machine and model as a Lab-07 reference (no other would compare)."""
    references = rows[(rows["method"] == "reference") & (rows["parameters"] > 0)]
    whole = references.groupby(["machine", "shape"])["parameters"].last().rename("whole")
    lab04 = all_runs[all_runs["lab"] == "lab04"]
    lab04 = lab04.assign(strategy=lab04["method"].map(LAB04), shape=shape(lab04),
                         parameters=largest(lab04, "metrics.tensor_bytes", "parameters"),
                         tokens_per_s=numbers(lab04, "metrics.tokens_per_s")).join(whole, on=["machine", "shape"])
    lab04 = lab04[(lab04["parameters"] > 0) & lab04["whole"].notna()]
    lab04 = lab04.assign(share=lab04["parameters"] / lab04["whole"])
    strategies = rows["method"].map(lambda method: KINDS.get(method, KINDS.get(method.split("-")[0])))
    table = pd.concat([lab04, rows.assign(strategy=strategies)]).groupby("strategy").agg(
        runs=("run_id", "size"), parameters=("parameters", "min"), share=("share", "min"), comm=("comm", "min"),
        bubble=("bubble", "min"), tokens_per_s=("tokens_per_s", "max"))
    return table.reindex(list(WHEN)).fillna({"runs": 0}).reset_index().assign(when=lambda t: t["strategy"].map(WHEN))


def _with_bracket(value: str, bracket: str, spec: str) -> object:
    return lambda r: Cell(MISSING if is_missing(r[value]) else f"{fmt(r[value], spec)} ({fmt(r[bracket], spec)})",
                          style="num")


@register_section("lab07", scaling=False)  # against its own one-process reference: no speed-up columns
def model_parallel(ctx: SectionContext) -> Section | None:
    rows = _rows(ctx.runs)
    if rows.empty:
        return None
    tables = [table_from_frame(rows, {
        "method": "method", "script": "script_name", "ranks": ("ranks", "int"), "model (layers × width)": "shape",
        "machine": "machine", "batch": ("batch", "int"), "parameters per rank": ("parameters", "bytes"),
        "activations per rank": ("activations", "bytes"),
        "sent per step (predicted)": _with_bracket("comm", "comm_predicted", "bytes"),
        "bubble (formula)": _with_bracket("bubble", "bubble_formula", "%1"), "tokens/s": ("tokens_per_s", "{:.3g}"),
        "largest step difference from one process": ("difference", "{:.2g}"),
    }, id="lab07-strategies", caption="Every run against the one-process run of the same script, model, batch "
       "and seed: memory held per rank (the largest rank), bytes a rank sent in one step's collectives (tensor "
       "parallel, counted at the dispatcher, ring algorithms; the plan's prediction in brackets), idle "
       "fraction (pipeline), and the loss step by step")]
    pipeline = rows[rows["bubble"].notna() & rows["microbatches"].notna()]
    if not pipeline.empty:
        tables.append(table_from_frame(pipeline.sort_values(["method", "microbatches"]).assign(
            difference=pipeline["bubble"] - pipeline["bubble_formula"]), {
            "schedule": "method", "ranks": ("ranks", "int"), "micro-batches": ("microbatches", "int"),
            "model (layers × width)": "shape", "machine": "machine", "bubble measured": ("bubble", "%1"),
            "formula": ("bubble_formula", "%1"), "difference": ("difference", "%1"),
        }, id="lab07-bubble", caption="Pipeline bubble: each rank's idle fraction of a step (wall time between two "
           "barriers minus the time its stage computed), mean over ranks, against (p − 1)/(v m + p − 1)"))
    tables.append(table_from_frame(_decision(rows, ctx.all_runs), {
        "strategy": "strategy", "runs measured": ("runs", "int"),
        "parameters per rank (least)": ("parameters", "bytes"), "÷ one process (least)": ("share", "{:.2g}"),
        "sent per rank per step (least)": ("comm", "bytes"), "bubble (least)": ("bubble", "%1"),
        "tokens/s (best)": ("tokens_per_s", "{:.3g}"), "use it when": "when",
    }, id="lab07-decision", row_id_column=None,
        caption="When DP, FSDP, TP, PP or 2-D: the numbers are the measured runs in this folder, each against the "
                "one-process run of its model (— where none was recorded; DP and FSDP from Lab-04's records of the "
                "same machine and model); the last column is the rule they illustrate"))
    figures = [_bubble_figure(pipeline)] if ctx.plots and not pipeline.empty else []
    return Section("Lab 07: beyond data parallel (tensor, sequence, pipeline, 2-D)", paragraphs=[
        "Every parallel run trains the same model on the same batches as the one-process run of its script; in "
        "fp32 the losses agree to rounding, so the strategies differ only in memory, traffic, idle time and speed. "
        "Runs on a CPU (Gloo) show the mechanics; speeds only mean something on GPUs."], figures=figures, tables=tables)
