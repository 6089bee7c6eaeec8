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

from typing import Any


from common.report.runs import number
from common.report.sections import (LABS_WITHOUT_SCALING, Cell, Section, SectionContext, Table, fmt_number,
                                    fmt_percent, fmt_seconds, register_section)

LABS_WITHOUT_SCALING.add("lab09")


def _flags(task: dict[str, Any], varied: list[str]) -> str:
    shown = [f"{name}={task['flags'][name]}" for name in varied if name in task.get("flags", {})]
    return " ".join([*shown, f"seed={task.get('seed')}"])


def _cost(task: dict[str, Any]) -> float:
    """What ranks a task by cost: GPU-hours where it held GPUs, else core-hours."""
    return number(task.get("gpu_hours")) or number(task.get("core_hours")) or 0.0


def ranking_table(record: dict[str, Any], by: str) -> Table:
    metrics = record["metrics"]
    varied = metrics.get("varied_flags", [])
    tasks = list(metrics["tasks"])
    if by == "accuracy":
        tasks.sort(key=lambda t: -(number(t.get("best_accuracy")) if number(t.get("best_accuracy")) is not None else -1))
    else:
        tasks.sort(key=_cost)
    rows = []
    for rank, task in enumerate(tasks, 1):
        state = str(task.get("state"))
        rows.append([Cell(str(rank), style="num"), Cell(str(task["index"]), style="num"), Cell(_flags(task, varied)),
                     Cell(state, style="" if state == "COMPLETED" else "warn"),
                     Cell(fmt_percent(number(task.get("best_accuracy")), 1), style="num"),
                     Cell(str(task.get("attempts")), style="num"),
                     Cell(fmt_seconds(number(task.get("elapsed_s"))), style="num"),
                     Cell(fmt_number(number(task.get("core_hours")), 3), style="num"),
                     Cell(fmt_number(number(task.get("gpu_hours")), 3), style="num"),
                     Cell(fmt_number(number(task.get("energy_j")), 4), style="num")])
    caption = ("Ranked by the best held-out accuracy the task reached." if by == "accuracy" else
               "Ranked by cost (GPU-hours where the task held GPUs, else core-hours), every attempt counted.")
    return Table(["rank", "task", "configuration", "state", "best accuracy", "attempts", "elapsed (last)",
                  "core-h", "GPU-h", "energy (J)"], rows, id=f"lab09-{record['run_id']}-by-{by}", caption=caption)


def cost_figure(record: dict[str, Any]) -> Any:
    """Best accuracy against GPU-hours (core-hours without GPUs) per task, and every task's accuracy curve."""
    from matplotlib.figure import Figure as MplFigure

    from common.report.plots import plain, png_figure

    metrics = record["metrics"]
    tasks = metrics["tasks"]
    gpu = any(number(t.get("gpu_hours")) for t in tasks)
    unit = "GPU-hours" if gpu else "core-hours"
    fig = MplFigure(figsize=(11, 4))
    left, right = fig.subplots(1, 2)
    for task in tasks:
        best, cost = number(task.get("best_accuracy")), number(task.get("gpu_hours" if gpu else "core_hours"))
        label = plain(_flags(task, metrics.get("varied_flags", [])))
        if best is not None and cost is not None:
            left.scatter([cost], [100 * best], color="tab:blue" if task.get("state") == "COMPLETED" else "tab:red")
            left.annotate(str(task["index"]), (cost, 100 * best), xytext=(3, 3), textcoords="offset points",
                          fontsize="small")
        history = task.get("accuracy_history") or []
        if history:
            right.plot([step for step, _ in history], [100 * acc for _, acc in history], marker="o", label=label)
    left.set_xlabel(f"{unit} spent (every attempt; red: did not complete)")
    left.set_ylabel("best held-out accuracy (%)")
    right.set_xlabel("optimiser step")
    right.set_ylabel("held-out accuracy (%)")
    if any(task.get("accuracy_history") for task in tasks):
        right.legend(fontsize="x-small")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    return png_figure(fig, alt=f"Best accuracy against {unit}, and each task's accuracy curve",
                      caption=f"Left: what each task reached for what it cost ({unit}, from sacct or the records). "
                              "Right: the tasks' accuracy curves side by side, read from their TensorBoard event files.")


def comparison_table(records: list[dict[str, Any]]) -> Table | None:
    """The ways the sweeps were submitted, side by side: how long submitting took, and each task's overhead."""
    rows = []
    for record in records:
        metrics = record["metrics"]
        submissions = [s for s in metrics.get("submissions", []) if s.get("how") != "resubmit"]
        seconds = number(submissions[0].get("seconds")) if submissions else None
        overheads = [number(t["elapsed_s"]) - number(t["training_s"]) for t in metrics["tasks"]
                     if number(t.get("training_s")) is not None and number(t.get("elapsed_s"))]
        rows.append([Cell(record["config"].get("how", "")), Cell(str(len(metrics["tasks"])), style="num"),
                     Cell(fmt_seconds(seconds), style="num"),
                     Cell(fmt_seconds(sum(overheads) / len(overheads) if overheads else None), style="num"),
                     Cell(", ".join(f"{n} {state}" for state, n in metrics.get("states", {}).items()))])
    if len(rows) < 2:
        return None
    return Table(["submitted with", "tasks", "submission took", "overhead per task", "states"], rows, id="lab09-ways",
                 caption="The same sweep through sbatch --array (01_sweep.py) and submitit (05_submitit.py). Overhead per "
                         "task: the task's elapsed time (sacct) minus its training epochs' time (its record): Python, "
                         "imports, data, evaluation and, for submitit, its own wrapper.")


@register_section("lab09")
def lab09_sections(ctx: SectionContext) -> list[Section]:
    records = [run["record"] for run in ctx.runs.to_dict("records")
               if str(run["record"].get("method", "")).startswith("sweep-")]
    sections = []
    for record in sorted(records, key=lambda r: r["created"]):
        metrics = record["metrics"]
        failed = [f"{t['index']} ({t['state']})" for t in metrics["tasks"] if t.get("state") != "COMPLETED"]
        paragraphs = [
            f"Sweep {record['config'].get('sweep_id')} of {record['config'].get('sweep', {}).get('script')}, "
            f"submitted as {record['config'].get('how')}: {len(metrics['tasks'])} task(s); "
            f"{number(metrics.get('core_hours')) or 0:.4g} core-hours and {number(metrics.get('gpu_hours')) or 0:.4g} "
            "GPU-hours in all (every attempt).",
            ("Tasks that did not complete: " + ", ".join(failed) + ".") if failed else "Every task completed.",
        ]
        figures = [cost_figure(record)] if ctx.plots else []
        sections.append(Section(f"Lab 09: sweep {record['config'].get('sweep_id')} ({record['config'].get('how')})",
                                id=f"lab09-{record['run_id']}", paragraphs=paragraphs, figures=figures,
                                tables=[ranking_table(record, "accuracy"), ranking_table(record, "cost")]))
    newest = {record["config"].get("sweep_id"): record for record in sorted(records, key=lambda r: r["created"])}
    table = comparison_table(list(newest.values()))  # a sweep recorded again after resubmission: its last word
    if table is not None:
        sections.append(Section("Lab 09: sbatch --array or submitit", tables=[table]))
    return sections
