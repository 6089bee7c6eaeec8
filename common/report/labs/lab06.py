"""Lab 06 (when distributed training breaks): what each injected fault ended in (``01_inject.py``), the doctor's
verdicts (``02_diagnose.py``) and the preflight checks (``04_preflight.py``).
"""

from __future__ import annotations

from common.report.runs import number
from common.report.sections import (Cell, Row, Section, SectionContext, fmt, is_missing, register_section,
                                    table_from_frame)


def _outcome(run: Row) -> str:
    """What the run ended in, in a few words."""
    if run["status"] == "ok":
        restarts = int(number(run["metrics.restarts"]) or 0)
        return "finished" + (f" after {restarts} restart(s)" if restarts else "")
    step, ranks, checkpoint = (run[f"metrics.nan_stop.{key}"] for key in ("step", "ranks", "checkpoint_step"))
    if not is_missing(step):
        return f"every rank stopped at step {step} (NaN on rank(s) {ranks}); last good checkpoint: step {checkpoint}"
    return "failed" if is_missing(run["metrics.diagnosis"]) else str(run["metrics.diagnosis"])


@register_section("lab06", scaling=False)
def lab06_sections(ctx: SectionContext) -> Section | None:
    runs = ctx.runs
    tables = [table_from_frame(runs[runs["script"] == "labs/lab06_failures/01_inject.py"], {
        "fault": "method", "ranks": ("world_size", "int"),
        "rank / step": lambda r: "-" if r["method"] == "uninterrupted" else
        f"{fmt(r['config.rank'])} / {fmt(r['config.step'])}",
        "ended in": _outcome, "final loss": ("metrics.final_loss", "{:.6g}"), "training time": ("metrics.wall_s", "s"),
    }, id="lab06-faults", caption="Each run of 01_inject.py: a restarted run that finished must show the "
                                  "uninterrupted run's final loss.")]
    for method, caption in (("diagnosis", "The hang doctor (02_diagnose.py): its verdict on a live or dead run."),
                            ("preflight", "The preflight checklist (04_preflight.py), one line per allocation.")):
        tables.append(table_from_frame(runs[runs["method"] == method], {
            "machine": "machine", "ranks": ("world_size", "int"),
            "verdict": lambda r: Cell(fmt(r["metrics.verdict"]), style="" if r["status"] == "ok" else "warn"),
        }, id=f"lab06-{method}", caption=caption))
    tables = [table for table in tables if table.rows]  # a table only for what was run
    if not tables:
        return None
    return Section("Lab 06: when distributed training breaks", paragraphs=[
        "Each fault fires once on one rank at one step. A hang or desync must end after the collective timeout in "
        "one line naming that rank and step; a crash or a NaN must end in recovery from the last checkpoint with the "
        "uninterrupted run's final loss."], tables=tables)
