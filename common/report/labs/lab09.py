"""Lab 09 (many jobs): each sweep's tasks ranked by accuracy and by cost, their curves side by side, the
best accuracy against the GPU-hours (or core-hours) spent, and the two ways of submitting compared.

The records (``labs/lab09_many_jobs/``): one per sweep, method ``sweep-<how>`` (``sbatch-array``,
``submitit``, ``local``), written by ``02_status.py --record`` or ``05_submitit.py``. ``metrics.tasks``
holds one entry per task: ``index``, ``flags``, ``seed``, ``state`` (Slurm's, or ``UNFINISHED``),
``attempts``, ``elapsed_s``, ``best_accuracy``, ``accuracy_history`` ([step, accuracy] from its
TensorBoard curves), ``core_hours``, ``gpu_hours`` (every attempt: failed ones cost too),
``energy_j``, ``training_s``; ``failed`` lists the tasks that did not complete, ``submissions`` how
and when they were submitted.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from common.report.plots import axes, plain, png_figure
from common.report.runs import entries, number, numbers
from common.report.sections import (
    Cell, Figure, Row, Section, SectionContext, Table, fmt, is_missing, register_section, table_from_frame,
)


def _configuration(task: Row, varied: list[str]) -> str:
    shown = [f"{name}={task[f'flags.{name}']}" for name in varied if not is_missing(task[f"flags.{name}"])]
    return " ".join([*shown, f"seed={fmt(task['seed'])}"])


def _tasks(tasks: pd.DataFrame, varied: object) -> pd.DataFrame:
    """A sweep's tasks with ``configuration`` (the varied flags and the seed) and ``cost`` (GPU-hours where the
    task held GPUs, else core-hours)."""
    varied = varied if isinstance(varied, list) else []
    configurations = [_configuration(task, varied) for task in tasks.to_dict("records", into=Row)]
    return tasks.assign(configuration=configurations,
                        cost=numbers(tasks, "gpu_hours").where(lambda gpu: gpu != 0).fillna(
                            numbers(tasks, "core_hours")).fillna(0))


def ranking_table(sweep: Row, tasks: pd.DataFrame, by: str) -> Table:
    order = -numbers(tasks, "best_accuracy").fillna(-1) if by == "accuracy" else tasks["cost"]
    ranked = tasks.iloc[order.argsort(kind="stable")].assign(rank=range(1, len(tasks) + 1))
    return table_from_frame(ranked, {
        "rank": ("rank", "int"), "task": ("index", "{}"), "configuration": "configuration",
        "state": lambda t: Cell(fmt(t["state"]), style="" if t["state"] == "COMPLETED" else "warn"),
        "best accuracy": ("best_accuracy", "%1"), "attempts": ("attempts", "{}"), "elapsed (last)": ("elapsed_s", "s"),
        "core-h": ("core_hours", "{:.3g}"), "GPU-h": ("gpu_hours", "{:.3g}"), "energy (J)": ("energy_j", "{:.4g}"),
    }, id=f"lab09-{sweep['run_id']}-by-{by}", row_id_column=None, caption=(
        "Ranked by the best held-out accuracy the task reached." if by == "accuracy" else
        "Ranked by cost (GPU-hours where the task held GPUs, else core-hours), every attempt counted."))


def cost_figure(tasks: pd.DataFrame) -> Figure:
    """Best accuracy against GPU-hours (core-hours without GPUs) per task, and every task's accuracy curve."""
    gpu = (numbers(tasks, "gpu_hours").fillna(0) != 0).any()
    unit = "GPU-hours" if gpu else "core-hours"
    fig, (left, right) = axes(11, 4, 2)
    for task in tasks.assign(best=numbers(tasks, "best_accuracy"), spent=numbers(
            tasks, "gpu_hours" if gpu else "core_hours")).to_dict("records", into=Row):
        if pd.notna(task["best"]) and pd.notna(task["spent"]):
            left.scatter([task["spent"]], [100 * task["best"]],
                         color="tab:blue" if task["state"] == "COMPLETED" else "tab:red")
            left.annotate(str(task["index"]), (task["spent"], 100 * task["best"]), xytext=(3, 3),
                          textcoords="offset points", fontsize="small")
        history = task["accuracy_history"]
        points = [(step, 100 * acc) for step, acc in (p for p in history if isinstance(p, list) and len(p) == 2)
                  if number(step) is not None and number(acc) is not None] if isinstance(history, list) else []
        if points:
            right.plot(*zip(*points), marker="o", label=plain(task["configuration"]))
    left.set(xlabel=f"{unit} spent (every attempt; red: did not complete)", ylabel="best held-out accuracy (%)")
    right.set(xlabel="optimiser step", ylabel="held-out accuracy (%)")
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize="x-small")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    return png_figure(fig, alt=f"Best accuracy against {unit}, and each task's accuracy curve",
                      caption=f"Left: what each task reached for what it cost ({unit}, from sacct or the records). "
                              "Right: the tasks' accuracy curves side by side, read from their TensorBoard event "
                              "files.")


def _way(sweep: Row, tasks: pd.DataFrame) -> dict:
    """How a sweep was submitted: how long submitting took, and each task's overhead (elapsed minus training)."""
    submissions = sweep["metrics.submissions"] if isinstance(sweep["metrics.submissions"], list) else []
    submitted = [s for s in submissions if isinstance(s, dict) and s.get("how") != "resubmit"]
    overhead = numbers(tasks, "elapsed_s").where(lambda elapsed: elapsed != 0) - numbers(tasks, "training_s")
    states = sorted(key for key in sweep if key.startswith("metrics.states.") and not is_missing(sweep[key]))
    return {"tasks": len(tasks), "overhead": overhead.mean(),
            "seconds": submitted[0].get("seconds") if submitted else None,
            "states": ", ".join(f"{sweep[key]} {key.removeprefix('metrics.states.')}" for key in states)}


@register_section("lab09", scaling=False)
def lab09_sections(ctx: SectionContext) -> list[Section]:
    sweeps = ctx.runs[ctx.runs["method"].fillna("").str.startswith("sweep-")].sort_values("created", kind="stable")
    sweeps = sweeps.assign(folder=sweeps["file"].map(lambda f: str(Path(f).parent) if isinstance(f, str) else ""))
    same = ["config.sweep_id", "config.how", "folder"]  # a sweep recorded again (after a resubmission): its last record
    records = sweeps.groupby(same).size() if len(sweeps) else pd.Series(dtype=int)
    sweeps = sweeps.drop_duplicates(same, keep="last") if len(sweeps) else sweeps
    folders = sweeps.groupby(same[:2])["folder"].transform("size") if len(sweeps) else pd.Series(dtype=int)
    every_task, sections, ways = entries(sweeps, "metrics.tasks"), [], {}
    for label, sweep in zip(sweeps.index, sweeps.to_dict("records", into=Row)):
        tasks = _tasks(every_task[every_task["_run"] == label], sweep["metrics.varied_flags"])
        failed = [f"{t['index']} ({t['state']})" for t in tasks.to_dict("records", into=Row)
                  if t["state"] != "COMPLETED"]
        sweep_id, how, script = (fmt(sweep[f"config.{key}"]) for key in ("sweep_id", "how", "sweep.script"))
        paragraphs = [
            f"Sweep {sweep_id} of {script}, submitted as {how}: {len(tasks)} task(s); "
            f"{number(sweep['metrics.core_hours']) or 0:.4g} core-hours and "
            f"{number(sweep['metrics.gpu_hours']) or 0:.4g} GPU-hours in all (every attempt)"
            + (f"; the latest of {n} records of it." if (n := records.get((sweep_id, how, sweep["folder"]), 1)) > 1
               else "."),
            ("Tasks that did not complete: " + ", ".join(failed) + ".") if failed else "Every task completed.",
        ]
        where = f" in {sweep['folder']}" if folders[label] > 1 else ""  # the same sweep run in two folders
        sections.append(Section(f"Lab 09: sweep {sweep_id} ({how}){where}", id=f"lab09-{sweep['run_id']}",
                                paragraphs=paragraphs, figures=[cost_figure(tasks)] if ctx.plots else [],
                                tables=[ranking_table(sweep, tasks, "accuracy"), ranking_table(sweep, tasks, "cost")]))
        ways[sweep_id] = {"how": how, **_way(sweep, tasks)}
    if len(ways) > 1:
        sections.append(Section("Lab 09: sbatch --array or submitit", tables=[table_from_frame(pd.DataFrame(list(
            ways.values())), {
            "submitted with": "how", "tasks": ("tasks", "{}"), "submission took": ("seconds", "s"),
            "overhead per task": ("overhead", "s"), "states": "states",
        }, id="lab09-ways", caption="The same sweep through sbatch --array (01_sweep.py) and submitit "
           "(05_submitit.py). Overhead per task: the task's elapsed time (sacct) minus its training epochs' time (its "
           "record): Python, imports, data, evaluation and, for submitit, its own wrapper.")]))
    return sections
