"""Lab 06 (when distributed training breaks): what each injected fault ended in, the doctor's verdicts,
and the preflight checks.

The records (``labs/lab06_failures/``):

- ``01_inject.py``: method ``uninterrupted`` or the fault's name (``skip-collective``, ``crash-rank`` ...),
  status ``ok`` (finished: ``metrics.final_loss``, ``steps_done``, ``restarts``) or ``failed`` (a hang or
  desync named in ``metrics.diagnosis`` with ``culprits`` and ``culprit_step``; a NaN stop in
  ``metrics.nan_stop``);
- ``02_diagnose.py``: method ``diagnosis``, ``metrics.verdict``, ``culprits``, ``step``, ``ranks``;
- ``04_preflight.py``: method ``preflight``, ``metrics.verdict``, ``problems``, ``transport``.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from common.report.runs import get, number
from common.report.sections import (
    LABS_WITHOUT_SCALING, Cell, Section, SectionContext, Table, fmt_int, fmt_number, fmt_seconds, fmt_text,
    register_section,
)

LABS_WITHOUT_SCALING.add("lab06")


def _outcome(record: dict[str, Any]) -> str:
    """What the run ended in, in a few words."""
    metrics = record.get("metrics", {})
    if record.get("status") == "ok":
        restarts = int(number(metrics.get("restarts")) or 0)
        return "finished" + (f" after {restarts} restart(s)" if restarts else "")
    if isinstance(metrics.get("nan_stop"), dict):
        stop = metrics["nan_stop"]
        return (f"every rank stopped at step {stop.get('step')} (NaN on rank(s) {stop.get('ranks')}); "
                f"last good checkpoint: step {stop.get('checkpoint_step')}")
    return str(metrics.get("diagnosis") or "failed")


def fault_table(runs: pd.DataFrame) -> Table | None:
    rows, ids = [], []
    for run in runs[runs["script"] == "labs/lab06_failures/01_inject.py"].to_dict("records"):
        record = run["record"]
        config = record.get("config", {})
        rows.append([Cell(fmt_text(run["method"])), Cell(fmt_int(run["world_size"]), style="num"),
                     Cell("-" if run["method"] == "uninterrupted" else f"{config.get('rank')} / {config.get('step')}"),
                     Cell(_outcome(record)),
                     Cell(fmt_number(get(record, "metrics", "final_loss"), 6), style="num"),
                     Cell(fmt_seconds(get(record, "metrics", "wall_s")), style="num")])
        ids.append(run["run_id"])
    if not rows:
        return None
    return Table(["fault", "ranks", "rank / step", "ended in", "final loss", "training time"], rows, id="lab06-faults",
                 caption="Each run of 01_inject.py: a restarted run that finished must show the uninterrupted run's "
                         "final loss.", row_ids=ids)


def verdict_table(runs: pd.DataFrame, method: str, caption: str) -> Table | None:
    chosen = runs[runs["method"] == method].to_dict("records")
    if not chosen:
        return None
    rows = [[Cell(fmt_text(run["machine"])), Cell(fmt_int(run["world_size"]), style="num"),
             Cell(fmt_text(get(run["record"], "metrics", "verdict")), style="" if run["status"] == "ok" else "warn")]
            for run in chosen]
    return Table(["machine", "ranks", "verdict"], rows, id=f"lab06-{method}", caption=caption,
                 row_ids=[run["run_id"] for run in chosen])


@register_section("lab06")
def lab06_sections(ctx: SectionContext) -> list[Section]:
    tables = [table for table in (
        fault_table(ctx.runs),
        verdict_table(ctx.runs, "diagnosis", "The hang doctor (02_diagnose.py): its verdict on a live or dead run."),
        verdict_table(ctx.runs, "preflight", "The preflight checklist (04_preflight.py), one line per allocation."),
    ) if table is not None]
    if not tables:
        return []
    return [Section("Lab 06: when distributed training breaks", paragraphs=[
        "Each fault fires once on one rank at one step. A hang or desync must end after the collective timeout in "
        "one line naming that rank and step; a crash or a NaN must end in recovery from the last checkpoint with the "
        "uninterrupted run's final loss."], tables=tables)]
