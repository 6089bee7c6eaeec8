"""Lab 04 (sharded data parallel): memory per rank (``01_memory_budget.py``), DDP against FSDP2 with their checkpoint
stalls and loss curves (``02_sharded_training.py``) and the largest model that fits (``03_largest_model.py``).
"""

from __future__ import annotations

import pandas as pd

from common.report.plots import axes, finish_axes, plain, png_figure
from common.report.runs import (entries, flags, group_key, largest, largest_loss_difference, losses, numbers, shape,
                                step_differences)
from common.report.sections import (Cell, Figure, Row, Section, SectionContext, fmt, is_missing, register_section,
                                    table_from_frame)

PARTS = ("parameters", "gradients", "optimizer", "activations")
#: Training methods of 02_sharded_training.py start with one of these.
STRATEGIES = ("ddp", "fsdp")
#: Line style and marker per curve of the loss plot, so that curves lying on one another stay visible.
_STYLES = [("-", "s"), (":", "^"), ("-.", "v"), ("-", "D"), (":", "x"), ("-.", "+")]
WHERE = {"ranks": ("world_size", "int"), "model (layers × width)": "shape", "machine": "machine"}


def _both(row: Row, part: str) -> Cell:
    """``measured (predicted)`` in one cell, or the prediction alone when nothing was measured."""
    predicted, measured = fmt(row[f"predicted.{part}"], "bytes"), row[f"measured.{part}"]
    return Cell(f"({predicted})" if is_missing(measured) else f"{fmt(measured, 'bytes')} ({predicted})", style="num")


def _training(runs: pd.DataFrame) -> pd.DataFrame:
    """The ``ddp`` and ``fsdp...`` runs that finished, with their checkpoint saves, tensors held, loss curve and its
    largest difference from the DDP run of the same model, batch and seed (``vs_ddp``)."""
    runs = runs[runs["method"].fillna("").str.split("+").str[0].isin(STRATEGIES) & (runs["status"] == "ok")]
    saves = entries(runs, "metrics.checkpoint_saves")
    saves = saves.assign(stall=numbers(saves, "stall_s"), complete=numbers(saves, "complete_s")).groupby("_run").agg(
        saves=("_position", "size"), stall=("stall", "median"), complete=("complete", "median"))
    training = runs.join(saves).assign(
        saves=lambda t: t["saves"].fillna(0), held=largest(runs, "metrics.tensor_bytes", "total"), shape=shape(runs),
        losses=losses(runs), mode=flags(runs, "config.async_checkpoint").map({True: "async", False: "sync"}),
        resumed_at=numbers(runs, "metrics.resumed_at_step").where(lambda v: v > 0))
    training["key"] = group_key(training, ["machine", "shape", "global_batch_size", "config.seed", "config.lr"])
    return training.assign(vs_ddp=largest_loss_difference(training, training["method"] == "ddp"))


def _label(row: Row) -> str:
    resumed = "" if is_missing(row["resumed_at"]) else f" · resumed at step {row['resumed_at']:.0f}"
    return f"{row['method']} · {fmt(row['world_size'], 'int')} ranks · {row['mode']}{resumed}"


def _loss_figure(training: pd.DataFrame) -> Figure:
    """Loss per step (top) and each run's relative difference from its DDP twin (bottom): runs that compute the
    same thing draw one curve on top of another, so the lower panel shows them apart."""
    rows = training.to_dict("records")[:12]
    fig, (top, bottom) = axes(8, 5.4, rows=2, sharex=True, height_ratios=(3, 2))
    others, resumed = iter(_STYLES * 2), []
    for row in rows:
        points = [(i + 1, x) for i, x in enumerate(row["losses"]) if x is not None]
        linestyle, marker = ("--", "o") if row["method"] == "ddp" else next(others)
        style = dict(linestyle=linestyle, marker=marker, markersize=4, markerfacecolor="none")
        top.plot(*zip(*points), label=plain(_label(row)), markevery=max(1, len(points) // 10), alpha=0.85, **style)
        if not is_missing(row["resumed_at"]):
            resumed.append(_label(row))
            top.axvline(row["resumed_at"] + 0.5, color="grey", linewidth=0.8, linestyle=":")
        ddp = next((r for r in rows if r["method"] == "ddp" and r["key"] == row["key"]), None)
        if ddp is not None and row is not ddp:
            steps = step_differences(row["losses"], ddp["losses"])
            bottom.plot(list(steps), list(steps.values()), **style)
    finish_axes(top, legend="upper right", ylabel="training loss (mean over ranks)")
    bottom.set_yscale("symlog", linthresh=1e-7)
    finish_axes(bottom, xlabel="optimiser step", ylabel="|loss − DDP's| / DDP's")
    caption = ("With the same seed and global batch, DDP (dashed, circles) and FSDP2 (other line styles and "
               "markers) follow the same curve, drawn on top of one another; below, each run's relative "
               "difference from the DDP run of the same model and batch, step by step (0 where they agree exactly).")
    if resumed:
        caption += (" Resumed runs (dotted vertical line at the step they continued from; the steps before it "
                    "are the interrupted run's): " + "; ".join(resumed) + ".")
    return png_figure(fig, alt="Training loss per step of the DDP and FSDP2 runs, and their difference from DDP",
                      caption=caption)


def _mfu(row: Row) -> Cell:
    reason = row["metrics.mfu_reason"] if isinstance(row["metrics.mfu_reason"], str) else None
    if is_missing(row["metrics.mfu"]):
        return Cell("n/a", title="not recorded" if reason is None else reason, style="num")
    return Cell(fmt(row["metrics.mfu"], "%1"), title=reason or None, style="num")


@register_section("lab04", scaling=False)  # strategies on the same ranks: no single-device baseline
def sharded_training(ctx: SectionContext) -> Section | None:
    runs, tables, figures, paragraphs = ctx.runs, [], [], []
    memory_runs = runs[runs["method"] == "memory"]
    memory = entries(memory_runs.assign(shape=shape(memory_runs)), "metrics.budget", "run_id", "machine", "shape")
    if not memory.empty:
        ratio = numbers(memory, "measured.states") / numbers(memory, "predicted.states").where(lambda v: v > 0)
        tables.append(table_from_frame(memory.assign(ratio=ratio.where(ratio > 0)), {
            "variant": "variant", **WHERE, **{part if part != "optimizer" else "AdamW state":
                                              lambda r, p=part: _both(r, p) for part in (*PARTS, "total")},
            "measured ÷ predicted (parameters + gradients + AdamW)": ("ratio", "{:.3g}"),
        }, id="lab04-memory", caption="Memory per rank, measured from the tensors (predicted by the formula in "
           "brackets); activations are what autograd saved for backward for one micro-batch"))
        paragraphs.append("DDP keeps 16 bytes per parameter on every rank (fp32 weights and gradients, AdamW's two "
                          "moments); FSDP2 keeps 1/N of them. Activation checkpointing keeps only each block's input; "
                          "bf16 halves most activations. On CPU the process's resident memory also holds PyTorch "
                          "itself, so the per-part numbers come from the tensors.")
    training = _training(runs)
    if not training.empty:
        tables.append(table_from_frame(training, {
            "method": "method", **WHERE, "global batch": ("global_batch_size", "int"), "checkpoint": "mode",
            "steps": lambda r: Cell(fmt(len(r["losses"]), "int"), style="num"), "final loss": ("final_loss", "num"),
            "largest step difference from DDP": ("vs_ddp", "{:.2g}"), "held per rank (tensors)": ("held", "bytes"),
            "peak per rank": ("peak_memory_bytes", "bytes"), "samples/s": ("samples_per_s", "{:.3g}"),
            "tokens/s": ("metrics.tokens_per_s", "{:.3g}"), "MFU": _mfu,
        }, id="lab04-training", caption="DDP against FSDP2: the same seed and global batch should give the same losses "
           "step by step (relative difference from the DDP run of the same model and batch). MFU: the model's FLOPs "
           "per second (6 N + 12 L H Q T per token) over the device's dense peak for the precision in force; hover "
           "n/a for why there is none"))
        if ctx.plots and training["losses"].map(len).any():
            figures.append(_loss_figure(training))
        if (training["saves"] > 0).any():
            tables.append(table_from_frame(training[training["saves"] > 0], {
                "method": "method", "ranks": ("world_size", "int"), "model (layers × width)": "shape",
                "parameters": ("metrics.parameters", "int"), "machine": "machine", "checkpoint": "mode",
                "saves": ("saves", "int"), "loop stalled (median)": ("stall", "s"),
                "files complete after (median)": ("complete", "s"),
            }, id="lab04-checkpoints", caption="Distributed checkpoints: how long each save stopped the training "
               "loop, synchronous (dcp.save) against asynchronous (dcp.async_save writes in the background)"))
    fitted = entries(runs[runs["method"] == "largest-model"], "metrics.largest", "run_id", "machine",
                     "metrics.world_size", "metrics.budget_bytes")
    if not fitted.empty:
        tables.append(table_from_frame(fitted.assign(shape=shape(fitted, "largest.")), {
            "variant": "variant", "ranks": ("metrics.world_size", "int"),
            "budget per rank": ("metrics.budget_bytes", "bytes"), "machine": "machine",
            "largest model (layers × width)": "shape", "parameters": ("largest.parameters", "int"),
            "used per rank": ("largest.bytes", "bytes"),
            "× DDP's largest": lambda r: Cell(fmt(r["times_ddp"], "x") + ("+" if r["limited_by_doublings"] is True
                                                                               else ""), style="num"),
        }, id="lab04-largest", caption="The largest model (doubling depth or width) that trains one step within the "
                                       "budget per rank (+: still fitted at the last doubling allowed)"))
    if not tables:
        return None
    return Section("Lab 04: sharded data parallel (FSDP2)", paragraphs=paragraphs, figures=figures, tables=tables)
