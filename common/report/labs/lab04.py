"""Lab 04 (sharded data parallel): memory per rank, DDP against FSDP2, checkpoint stalls, the largest model.

``labs/lab04_sharded_training`` writes three kinds of record:

- ``01_memory_budget.py`` (method ``memory``): ``metrics.budget``, one entry per variant with the
  ``predicted`` and ``measured`` bytes per rank of ``parameters``, ``gradients``, ``optimizer``,
  ``activations``, their sum over the first three (``states``) and the ``total``;
- ``02_sharded_training.py`` (methods ``ddp``, ``fsdp``, ``fsdp+ac``, ``fsdp+bf16`` ...): the
  training metrics every script writes, plus ``metrics.checkpoint_saves`` (per save: ``mode``,
  ``stall_s``, ``complete_s``) and ``metrics.tensor_bytes`` (per rank);
- ``03_largest_model.py`` (method ``largest-model``): ``metrics.largest``, per variant the largest
  model that fitted within ``metrics.budget_bytes`` per rank and its size against DDP's.

Each gets a table here (and the training runs a plot of their loss curves).
"""

from __future__ import annotations

import statistics
from typing import Any

import pandas as pd

from common.report.runs import get, number
from common.report.sections import (
    LABS_WITHOUT_SCALING, Cell, Section, SectionContext, fmt_bytes, fmt_int, fmt_number, fmt_percent, fmt_ratio,
    fmt_seconds, fmt_text, num, register_section, table_from_frame,
)

PARTS = ("parameters", "gradients", "optimizer", "activations")
#: Training methods of 02_sharded_training.py start with one of these.
STRATEGIES = ("ddp", "fsdp")
#: Lab-04 compares strategies on the same ranks: no single-device baseline, so no speed-up or efficiency.
LABS_WITHOUT_SCALING.add("lab04")
#: Line style and marker per curve of the loss plot, so that curves lying on one another stay visible.
_STYLES = [("-", "s"), (":", "^"), ("-.", "v"), ("-", "D"), (":", "x"), ("-.", "+")]


def _config(record: dict, key: str) -> Any:
    return get(record, "config", key)


def _shape(record: dict) -> str | None:
    layers, width = number(_config(record, "layers")), number(_config(record, "width"))
    return f"{int(layers)} × {int(width)}" if layers is not None and width is not None else None


def _memory_rows(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per variant of every ``memory`` record, predicted and measured side by side."""
    rows = []
    for run in runs[runs["method"] == "memory"].to_dict("records"):
        budget = get(run["record"], "metrics", "budget")
        for entry in budget if isinstance(budget, list) else []:
            if not isinstance(entry, dict):
                continue
            predicted, measured = entry.get("predicted") or {}, entry.get("measured") or {}
            row = {"run_id": run["run_id"], "machine": run["machine"], "variant": entry.get("variant"),
                   "world_size": number(entry.get("world_size")), "shape": _shape(run["record"]),
                   "batch": number(_config(run["record"], "batch_size"))}
            for part in (*PARTS, "states", "total"):
                row[f"predicted_{part}"] = number(predicted.get(part))
                row[f"measured_{part}"] = number(measured.get(part))
            rows.append(row)
    return pd.DataFrame(rows)


def _both(row: dict, part: str) -> str:
    """``measured (predicted)`` in one cell, or the prediction alone when nothing was measured."""
    predicted, measured = row[f"predicted_{part}"], row[f"measured_{part}"]
    if measured is None or pd.isna(measured):
        return f"({fmt_bytes(predicted)})"
    return f"{fmt_bytes(measured)} ({fmt_bytes(predicted)})"


def _memory_table(rows: pd.DataFrame) -> Any:
    def ratio(row: dict) -> str:
        measured, predicted = row["measured_states"], row["predicted_states"]
        return fmt_number(measured / predicted, 3) if measured and predicted else "—"

    return table_from_frame(rows, [
        ("variant", lambda r: fmt_text(r["variant"])),
        ("ranks", lambda r: num(fmt_int(r["world_size"]))),
        ("model (layers × width)", lambda r: fmt_text(r["shape"])),
        ("machine", lambda r: fmt_text(r["machine"])),
        *[(part if part != "optimizer" else "AdamW state", lambda r, p=part: num(_both(r, p))) for part in PARTS],
        ("total", lambda r: num(_both(r, "total"))),
        ("measured ÷ predicted (parameters + gradients + AdamW)", lambda r: num(ratio(r))),
    ], id="lab04-memory", caption="Memory per rank, measured from the tensors (predicted by the formula in brackets); activations "
               "are what autograd saved for backward for one micro-batch")


def _training_rows(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for run in runs.to_dict("records"):
        method, record = run["method"] or "", run["record"]
        if not method.split("+")[0] in STRATEGIES or run["status"] != "ok":
            continue
        saves = get(record, "metrics", "checkpoint_saves")
        saves = [s for s in saves if isinstance(s, dict)] if isinstance(saves, list) else []
        held = get(record, "metrics", "tensor_bytes")
        held = [number(get(entry, "total")) for entry in held] if isinstance(held, list) else []
        losses = get(record, "metrics", "loss_at_step")
        rows.append({
            "run_id": run["run_id"], "machine": run["machine"], "method": method, "world_size": run["world_size"],
            "shape": _shape(record), "global_batch": run["global_batch_size"], "final_loss": run["final_loss"],
            "losses": [number(x) for x in losses] if isinstance(losses, list) else [],
            "samples_per_s": run["samples_per_s"], "peak": run["peak_memory_bytes"],
            "held": max((h for h in held if h is not None), default=None),
            "mode": "async" if _config(record, "async_checkpoint") else "sync",
            "saves": len(saves),
            "stall": statistics.median(s["stall_s"] for s in saves if number(s.get("stall_s")) is not None)
            if any(number(s.get("stall_s")) is not None for s in saves) else None,
            "complete": statistics.median(s["complete_s"] for s in saves if number(s.get("complete_s")) is not None)
            if any(number(s.get("complete_s")) is not None for s in saves) else None,
            "parameters": number(get(record, "metrics", "parameters")),
            "resumed_at": number(get(record, "metrics", "resumed_at_step")),
            "tokens_per_s": number(get(record, "metrics", "tokens_per_s")),
            "mfu": number(get(record, "metrics", "mfu")), "mfu_reason": get(record, "metrics", "mfu_reason"),
            "key": (run["machine"], _shape(record), run["global_batch_size"], _config(record, "seed"),
                    _config(record, "lr")),
        })
    return pd.DataFrame(rows)


def _loss_difference(training: pd.DataFrame) -> pd.Series:
    """Largest relative difference, step by step, from a DDP run of the same model, batch and seed."""
    differences = []
    for row in training.to_dict("records"):
        peers = training[(training["method"] == "ddp") & training["key"].map(lambda k: k == row["key"])]
        best = None
        for ddp in peers["losses"]:
            steps = min(len(ddp), len(row["losses"]))
            pairs = [(a, b) for a, b in zip(row["losses"][:steps], ddp[:steps]) if a is not None and b]
            if pairs and row["method"] != "ddp":
                worst = max(abs(a - b) / abs(b) for a, b in pairs)
                best = worst if best is None else min(best, worst)
        differences.append(best)
    return pd.Series(differences, index=training.index, dtype="object")


def _resumed_at(row: dict) -> int | None:
    value = row["resumed_at"]
    return None if value is None or pd.isna(value) or not value else int(value)


def _curve_label(row: dict) -> str:
    resumed = f" · resumed at step {_resumed_at(row)}" if _resumed_at(row) else ""
    return f"{row['method']} · {fmt_int(row['world_size'])} ranks · {row['mode']}{resumed}"


def _loss_figure(training: pd.DataFrame) -> Any:
    """Loss per step (top) and each run's relative difference from its DDP twin (bottom): runs that
    compute the same thing draw one curve on top of another, so the lower panel shows them apart."""
    from matplotlib.figure import Figure as MplFigure

    from common.report.plots import plain, png_figure

    rows = training.to_dict("records")[:12]
    fig = MplFigure(figsize=(8, 5.4))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    others = iter(_STYLES * 2)
    resumed = []
    for row in rows:
        steps = [i + 1 for i, x in enumerate(row["losses"]) if x is not None]
        values = [x for x in row["losses"] if x is not None]
        linestyle, marker = ("--", "o") if row["method"] == "ddp" else next(others)
        top.plot(steps, values, label=plain(_curve_label(row)), linestyle=linestyle, marker=marker, markersize=4,
                 markevery=max(1, len(steps) // 10), markerfacecolor="none", alpha=0.85)
        if _resumed_at(row):
            resumed.append(_curve_label(row))
            top.axvline(_resumed_at(row) + 0.5, color="grey", linewidth=0.8, linestyle=":")
        ddp = next((r for r in rows if r["method"] == "ddp" and r["key"] == row["key"]), None)
        if ddp is not None and row is not ddp:
            pairs = [(i + 1, abs(a - b) / abs(b)) for i, (a, b) in enumerate(zip(row["losses"], ddp["losses"]))
                     if a is not None and b]
            bottom.plot([p[0] for p in pairs], [p[1] for p in pairs], linestyle=linestyle, marker=marker,
                        markersize=4, markerfacecolor="none")
    top.set_ylabel("training loss (mean over ranks)")
    top.grid(alpha=0.3)
    top.legend(fontsize="small", loc="upper right")
    bottom.set_yscale("symlog", linthresh=1e-7)
    bottom.set_xlabel("optimiser step")
    bottom.set_ylabel("|loss − DDP's| / DDP's")
    bottom.grid(alpha=0.3)
    caption = ("With the same seed and global batch, DDP (dashed, circles) and FSDP2 (other line styles and "
               "markers) follow the same curve, drawn on top of one another; below, each run's relative "
               "difference from the DDP run of the same model and batch, step by step (0 where they agree exactly).")
    if resumed:
        caption += (" Resumed runs (dotted vertical line at the step they continued from; the steps before it "
                    "are the interrupted run's): " + "; ".join(resumed) + ".")
    return png_figure(fig, alt="Training loss per step of the DDP and FSDP2 runs, and their difference from DDP",
                      caption=caption)


def _largest_rows(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for run in runs[runs["method"] == "largest-model"].to_dict("records"):
        metrics = get(run["record"], "metrics") or {}
        for entry in metrics.get("largest") or []:
            if not isinstance(entry, dict):
                continue
            largest = entry.get("largest") if isinstance(entry.get("largest"), dict) else {}
            rows.append({"run_id": run["run_id"], "machine": run["machine"], "variant": entry.get("variant"),
                         "world_size": number(metrics.get("world_size")), "budget": number(metrics.get("budget_bytes")),
                         "grow": _config(run["record"], "grow"), "layers": number(largest.get("layers")),
                         "width": number(largest.get("width")), "parameters": number(largest.get("parameters")),
                         "bytes": number(largest.get("bytes")), "times_ddp": number(entry.get("times_ddp")),
                         "lower_bound": bool(entry.get("limited_by_doublings")),
                         "measured_by": metrics.get("measured_by")})
    return pd.DataFrame(rows)


@register_section("lab04")
def sharded_training(ctx: SectionContext) -> Section | None:
    runs = ctx.runs
    tables, figures, paragraphs = [], [], []
    memory = _memory_rows(runs)
    if not memory.empty:
        tables.append(_memory_table(memory))
        paragraphs.append("DDP keeps 16 bytes per parameter on every rank (fp32 weights and gradients, AdamW's two "
                          "moments); FSDP2 keeps 1/N of them. Activation checkpointing keeps only each block's input; "
                          "bf16 halves most activations. On CPU the process's resident memory also holds PyTorch "
                          "itself, so the per-part numbers come from the tensors.")
    training = _training_rows(runs)
    if not training.empty:
        training["vs_ddp"] = _loss_difference(training)
        tables.append(table_from_frame(training, [
            ("method", lambda r: fmt_text(r["method"])),
            ("ranks", lambda r: num(fmt_int(r["world_size"]))),
            ("model (layers × width)", lambda r: fmt_text(r["shape"])),
            ("machine", lambda r: fmt_text(r["machine"])),
            ("global batch", lambda r: num(fmt_int(r["global_batch"]))),
            ("checkpoint", lambda r: fmt_text(r["mode"])),
            ("steps", lambda r: num(fmt_int(len(r["losses"])))),
            ("final loss", lambda r: num(fmt_number(r["final_loss"]))),
            ("largest step difference from DDP", lambda r: num(fmt_number(r["vs_ddp"], 2))),
            ("held per rank (tensors)", lambda r: num(fmt_bytes(r["held"]))),
            ("peak per rank", lambda r: num(fmt_bytes(r["peak"]))),
            ("samples/s", lambda r: num(fmt_number(r["samples_per_s"], 3))),
            ("tokens/s", lambda r: num(fmt_number(r["tokens_per_s"], 3))),
            ("MFU", lambda r: Cell(fmt_percent(r["mfu"], 1), title=r["mfu_reason"] or None, style="num")
             if r["mfu"] is not None and not pd.isna(r["mfu"]) else Cell(
                 "n/a", title=r["mfu_reason"] if isinstance(r["mfu_reason"], str) else "not recorded", style="num")),
        ], id="lab04-training", caption="DDP against FSDP2: the same seed and global batch should give the same losses step by step "
                   "(relative difference from the DDP run of the same model and batch). MFU: the model's FLOPs per second "
                   "(6 N + 12 L H Q T per token) over the device's dense peak for the precision in force; "
                   "hover n/a for why there is none"))
        if ctx.plots and any(training["losses"].map(len)):
            figures.append(_loss_figure(training))
        saved = training[training["saves"] > 0]
        if not saved.empty:
            tables.append(table_from_frame(saved, [
                ("method", lambda r: fmt_text(r["method"])),
                ("ranks", lambda r: num(fmt_int(r["world_size"]))),
                ("model (layers × width)", lambda r: fmt_text(r["shape"])),
                ("parameters", lambda r: num(fmt_int(r["parameters"]))),
                ("machine", lambda r: fmt_text(r["machine"])),
                ("checkpoint", lambda r: fmt_text(r["mode"])),
                ("saves", lambda r: num(fmt_int(r["saves"]))),
                ("loop stalled (median)", lambda r: num(fmt_seconds(r["stall"]))),
                ("files complete after (median)", lambda r: num(fmt_seconds(r["complete"]))),
            ], id="lab04-checkpoints", caption="Distributed checkpoints: how long each save stopped the training loop, synchronous "
                       "(dcp.save) against asynchronous (dcp.async_save writes in the background)"))
    largest = _largest_rows(runs)
    if not largest.empty:
        tables.append(table_from_frame(largest, [
            ("variant", lambda r: fmt_text(r["variant"])),
            ("ranks", lambda r: num(fmt_int(r["world_size"]))),
            ("budget per rank", lambda r: num(fmt_bytes(r["budget"]))),
            ("machine", lambda r: fmt_text(r["machine"])),
            ("largest model (layers × width)", lambda r: fmt_text(
                f"{int(r['layers'])} × {int(r['width'])}" if r["layers"] is not None and not pd.isna(r["layers"])
                else None)),
            ("parameters", lambda r: num(fmt_int(r["parameters"]))),
            ("used per rank", lambda r: num(fmt_bytes(r["bytes"]))),
            ("× DDP's largest", lambda r: num(fmt_ratio(r["times_ddp"]) + ("+" if r["lower_bound"] else ""))),
        ], id="lab04-largest", caption="The largest model (doubling depth or width) that trains one step within the budget per rank "
                   "(+: still fitted at the last doubling allowed)"))
    if not tables:
        return None
    return Section("Lab 04: sharded data parallel (FSDP2)", paragraphs=paragraphs, figures=figures, tables=tables)
