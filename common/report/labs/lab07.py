"""Lab 07 (beyond data parallel): tensor, sequence, pipeline and 2-D parallel, held against one process.

``labs/lab07_model_parallel`` writes one record per run, method ``reference`` (one process, no
parallelism), ``tp`` / ``tp+sp`` (``01_tensor_parallel.py``), ``pp-gpipe`` / ``pp-1f1b`` /
``pp-interleaved`` (``02_pipeline_parallel.py``) or ``2d-DPxTP`` (``03_2d_parallel.py``). Every
record has ``metrics.loss_at_step`` and ``metrics.per_rank`` (``parameter_bytes``, and for tensor
parallel ``activation_bytes`` and ``comm_bytes``, the bytes it sent per step); tensor parallel adds
``metrics.comm_predicted``, the pipeline ``metrics.bubble_measured`` and ``metrics.bubble_formula``.

Tables: per strategy (memory per rank, tokens/s, traffic, bubble, and the largest loss difference
from the reference of the same script, model, batch and seed); the bubble against the formula, with
a plot; and a decision table whose numbers are these measurements (and Lab-04's DDP and FSDP2
records when the results folder has them).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from common.report.runs import get, number
from common.report.sections import (
    LABS_WITHOUT_SCALING, Section, SectionContext, fmt_bytes, fmt_int, fmt_number, fmt_percent, fmt_text, num,
    register_section, table_from_frame,
)

#: Lab-07 compares strategies with its own one-process reference: no speed-up columns in the summary.
LABS_WITHOUT_SCALING.add("lab07")

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


def _kind(method: str) -> str | None:
    if method in ("tp", "tp+sp"):
        return "TP (tensor parallel)"
    if method.startswith("pp-"):
        return "PP (pipeline)"
    if method.startswith("2d-"):
        return "2-D (FSDP x TP)"
    return None


def _per_rank(record: dict, key: str) -> float | None:
    entries = get(record, "metrics", "per_rank")
    entries = entries if isinstance(entries, list) else []
    values = [number(entry.get(key)) for entry in entries if isinstance(entry, dict)]
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _rows(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for run in runs.to_dict("records"):
        record = run["record"]
        if run["status"] != "ok":
            continue
        config = get(record, "config") or {}
        losses = get(record, "metrics", "loss_at_step")
        predicted = get(record, "metrics", "comm_predicted")
        rows.append({
            "run_id": run["run_id"], "machine": run["machine"], "method": run["method"] or "",
            "script": (run.get("script") or record.get("script") or "").rsplit("/", 1)[-1],
            "world_size": number(get(record, "metrics", "world_size")),
            "shape": f"{config.get('layers')} × {config.get('width')}", "batch": number(config.get("batch_size")),
            "microbatches": number(config.get("microbatches")) if str(run["method"]).startswith("pp-") else None,
            "mesh": config.get("mesh"),
            "parameters": _per_rank(record, "parameter_bytes"), "activations": _per_rank(record, "activation_bytes"),
            "comm": _per_rank(record, "comm_bytes"),
            "comm_predicted": number(predicted.get("total_bytes")) if isinstance(predicted, dict) else None,
            "bubble": number(get(record, "metrics", "bubble_measured")),
            "bubble_formula": number(get(record, "metrics", "bubble_formula")),
            "tokens_per_s": number(get(record, "metrics", "tokens_per_s")),
            "first_step": int(number(get(record, "metrics", "first_step")) or 0),
            "losses": [number(x) for x in losses] if isinstance(losses, list) else [],
            "key": (run["machine"], (run.get("script") or record.get("script")), config.get("layers"),
                    config.get("width"), config.get("heads"), config.get("context"), config.get("batch_size"),
                    config.get("seed"), config.get("lr")),
        })
    return pd.DataFrame(rows)


def _against_reference(rows: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Per run: the largest relative loss difference, step by step, from the one-process run of the same
    script and settings, and its parameter bytes per rank as a fraction of that run's."""
    differences, shares = [], []
    for row in rows.to_dict("records"):
        best = share = None
        if row["method"] != "reference":
            same = (rows["method"] == "reference") & rows["key"].map(lambda k: k == row["key"])
            for ref in rows[same].to_dict("records"):
                pairs = [(a, b) for a, b in zip(row["losses"], ref["losses"][row["first_step"]:])
                         if a is not None and b]
                if pairs:
                    worst = max(abs(a - b) / abs(b) for a, b in pairs)
                    best = worst if best is None else min(best, worst)
                if ref["parameters"] and row["parameters"] is not None and not pd.isna(row["parameters"]):
                    share = row["parameters"] / ref["parameters"]
        differences.append(best)
        shares.append(share)
    return pd.Series(differences, index=rows.index, dtype="object"), pd.Series(shares, index=rows.index, dtype="object")


def _minus(a: Any, b: Any) -> float | None:
    return a - b if a is not None and b is not None and not pd.isna(a) and not pd.isna(b) else None


def _bubble_figure(pipeline: pd.DataFrame) -> Any:
    from matplotlib.figure import Figure as MplFigure

    from common.report.plots import plain, png_figure

    fig = MplFigure(figsize=(6.5, 4))
    axis = fig.subplots()
    pipeline = pipeline.assign(**{column: pd.to_numeric(pipeline[column], errors="coerce")
                                  for column in ("microbatches", "bubble", "bubble_formula", "world_size")})
    for (method, ranks), group in pipeline.groupby(["method", "world_size"]):
        group = group.sort_values("microbatches")
        axis.plot(group["microbatches"], group["bubble"], marker="o",
                  label=plain(f"{method}, {int(ranks)} ranks measured"))
        axis.plot(group["microbatches"], group["bubble_formula"], linestyle="--", color="grey")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("micro-batches per step (m)")
    axis.set_ylabel("idle fraction of a step")
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize="small")
    return png_figure(fig, alt="Pipeline bubble measured against (p-1)/(m+p-1)",
                      caption="Measured idle fraction per rank (1 − compute time ÷ wall time of the step) "
                              "against the formula (p − 1)/(v m + p − 1) (dashed).")


def _decision_rows(rows: pd.DataFrame, all_runs: pd.DataFrame) -> pd.DataFrame:
    """One row per strategy: its measured runs, each against the one-process reference of the same model.

    DP and FSDP come from Lab-04's records of the same machine and model (layers x width) as a Lab-07
    reference, when the folder has them; a record of another model or machine would not compare.
    """
    references = {(r["machine"], r["shape"]): r["parameters"] for r in rows.to_dict("records")
                  if r["method"] == "reference" and r["parameters"]}
    lab04 = all_runs[all_runs["lab"] == "lab04"] if "lab" in all_runs else all_runs.iloc[0:0]
    table = []
    for name, method in (("DP (DDP, Lab-04)", "ddp"), ("FSDP (FSDP2, Lab-04)", "fsdp")):
        held, shares, speeds = [], [], []
        for run in lab04[lab04["method"] == method].to_dict("records"):
            config = get(run["record"], "config") or {}
            whole = references.get((run["machine"], f"{config.get('layers')} × {config.get('width')}"))
            entries = get(run["record"], "metrics", "tensor_bytes")
            most = max([number(get(e, "parameters")) or 0 for e in entries if isinstance(e, dict)], default=0) \
                if isinstance(entries, list) else 0
            if whole and most:
                held.append(most)
                shares.append(most / whole)
                speeds.append(number(get(run["record"], "metrics", "tokens_per_s")))
        table.append({"strategy": name, "runs": len(held), "parameters": min(held, default=None),
                      "share": min(shares, default=None), "comm": None, "bubble": None,
                      "tokens_per_s": max([v for v in speeds if v], default=None), "when": WHEN[name]})
    for name in ("TP (tensor parallel)", "PP (pipeline)", "2-D (FSDP x TP)"):
        group = rows[rows["method"].map(_kind) == name]
        shares = [x for x in group["share"] if x is not None and not pd.isna(x)]
        table.append({"strategy": name, "runs": len(group),
                      "parameters": group["parameters"].min() if not group.empty else None,
                      "share": min(shares, default=None),
                      "comm": group["comm"].dropna().min() if group["comm"].notna().any() else None,
                      "bubble": group["bubble"].dropna().min() if group["bubble"].notna().any() else None,
                      "tokens_per_s": group["tokens_per_s"].dropna().max() if group["tokens_per_s"].notna().any()
                      else None, "when": WHEN[name]})
    return pd.DataFrame(table)


@register_section("lab07")
def model_parallel(ctx: SectionContext) -> Section | None:
    rows = _rows(ctx.runs)
    if rows.empty:
        return None
    rows["difference"], rows["share"] = _against_reference(rows)
    tables, figures = [], []
    tables.append(table_from_frame(rows, [
        ("method", lambda r: fmt_text(r["method"])),
        ("script", lambda r: fmt_text(r["script"])),
        ("ranks", lambda r: num(fmt_int(r["world_size"]))),
        ("model (layers × width)", lambda r: fmt_text(r["shape"])),
        ("machine", lambda r: fmt_text(r["machine"])),
        ("batch", lambda r: num(fmt_int(r["batch"]))),
        ("parameters per rank", lambda r: num(fmt_bytes(r["parameters"]))),
        ("activations per rank", lambda r: num(fmt_bytes(r["activations"]))),
        ("sent per step (predicted)", lambda r: num(
            "—" if r["comm"] is None or pd.isna(r["comm"]) else
            f"{fmt_bytes(r['comm'])} ({fmt_bytes(r['comm_predicted'])})")),
        ("bubble (formula)", lambda r: num(
            "—" if r["bubble"] is None or pd.isna(r["bubble"]) else
            f"{fmt_percent(r['bubble'], 1)} ({fmt_percent(r['bubble_formula'], 1)})")),
        ("tokens/s", lambda r: num(fmt_number(r["tokens_per_s"], 3))),
        ("largest step difference from one process", lambda r: num(fmt_number(r["difference"], 2))),
    ], id="lab07-strategies", caption="Every run against the one-process run of the same script, model, batch "
               "and seed: memory held per rank (the largest rank), bytes a rank sent in one step's collectives (tensor "
               "parallel, counted at the dispatcher, ring algorithms; the plan's prediction in brackets), idle "
               "fraction (pipeline), and the loss step by step"))
    pipeline = rows[rows["bubble"].notna() & rows["microbatches"].notna()]
    if not pipeline.empty:
        tables.append(table_from_frame(pipeline.sort_values(["method", "microbatches"]), [
            ("schedule", lambda r: fmt_text(r["method"])),
            ("ranks", lambda r: num(fmt_int(r["world_size"]))),
            ("micro-batches", lambda r: num(fmt_int(r["microbatches"]))),
            ("model (layers × width)", lambda r: fmt_text(r["shape"])),
            ("machine", lambda r: fmt_text(r["machine"])),
            ("bubble measured", lambda r: num(fmt_percent(r["bubble"], 1))),
            ("formula", lambda r: num(fmt_percent(r["bubble_formula"], 1))),
            ("difference", lambda r: num(fmt_percent(_minus(r["bubble"], r["bubble_formula"]), 1))),
        ], id="lab07-bubble", caption="Pipeline bubble: each rank's idle fraction of a step (wall time between two "
                   "barriers minus the time its stage computed), mean over ranks, against (p − 1)/(v m + p − 1)"))
        if ctx.plots:
            figures.append(_bubble_figure(pipeline))
    decision = _decision_rows(rows, ctx.all_runs)
    tables.append(table_from_frame(decision, [
        ("strategy", lambda r: fmt_text(r["strategy"])),
        ("runs measured", lambda r: num(fmt_int(r["runs"]))),
        ("parameters per rank (least)", lambda r: num(fmt_bytes(r["parameters"]))),
        ("÷ one process (least)", lambda r: num(fmt_number(r["share"], 2))),
        ("sent per rank per step (least)", lambda r: num(fmt_bytes(r["comm"]))),
        ("bubble (least)", lambda r: num(fmt_percent(r["bubble"], 1))),
        ("tokens/s (best)", lambda r: num(fmt_number(r["tokens_per_s"], 3))),
        ("use it when", lambda r: fmt_text(r["when"])),
    ], id="lab07-decision", row_id_column=None,
        caption="When DP, FSDP, TP, PP or 2-D: the numbers are the measured runs in this folder, each against the "
                "one-process run of its model (— where none was recorded; DP and FSDP from Lab-04's records of the "
                "same machine and model); the last column is the rule they illustrate"))
    paragraphs = ["Every parallel run trains the same model on the same batches as the one-process run of its script; "
                  "in fp32 the losses agree to rounding, so the strategies differ only in memory, traffic, idle time "
                  "and speed. Runs on a CPU (Gloo) show the mechanics; speeds only mean something on GPUs."]
    return Section("Lab 07: beyond data parallel (tensor, sequence, pipeline, 2-D)", paragraphs=paragraphs,
                   figures=figures, tables=tables)
