"""Build the report: read a results folder, make the sections, render HTML and CSV, write both atomically."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.atomic import write_text_atomic
from common.errors import UserError
from common.report import core
from common.report.labs import lab_sections
from common.report.runs import configurations_frame, csv_frame, runs_frame, shown_path
from common.results import load_records

DEFAULT_REPORT_NAME = "comparison_report.html"


@dataclass
class ReportOutcome:
    """What :func:`build_report` wrote and what it found."""

    report_path: Path
    csv_path: Path
    runs: int
    skipped: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    labs: list[str] = field(default_factory=list)  # the labs (and chapters) whose runs the report shows


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def build_report(results_dir: str | os.PathLike[str], output_report: str | os.PathLike[str] | None = None,
                 csv_path: str | os.PathLike[str] | None = None, *, plots: bool = True, title: str | None = None,
                 lab: str | None = None) -> ReportOutcome:
    """Read every record under ``results_dir`` and write an HTML report and a CSV summary.

    ``output_report`` defaults to ``<results_dir>/comparison_report.html`` and ``csv_path`` to the report's path
    with ``.csv``. ``lab`` keeps only that lab's records (``"lab04"``, ``"ch04"``). Files that are not readable
    records are skipped and named, here on stderr and in the report. Raises :class:`UserError` when the folder is
    missing or holds no readable record.
    """
    folder = Path(results_dir)
    if not folder.is_dir():
        raise UserError(f"results folder not found: {folder} (run a lab script with --results-dir {folder} first)")
    report_path = Path(output_report) if output_report else folder / DEFAULT_REPORT_NAME
    csv_out = Path(csv_path) if csv_path else report_path.with_suffix(".csv")
    if report_path.is_dir() or csv_out.is_dir():
        raise UserError(f"{report_path if report_path.is_dir() else csv_out} is a folder; give a file name")
    if ".json" in (report_path.suffix.lower(), csv_out.suffix.lower()):  # it would replace a record, or be read as one
        raise UserError(f"*.json is a record's name: write .html and .csv, not {report_path.name}, {csv_out.name}")
    if report_path.resolve() == csv_out.resolve():
        raise UserError(f"the report and the CSV would both be {report_path}; give --csv another name")
    for place in {report_path.parent, csv_out.parent}:
        if place.is_dir() and not os.access(place, os.W_OK):  # said now, not after the whole report is built
            raise UserError(f"cannot write into {place} (read-only here): give --output-report and --csv elsewhere")

    loaded = load_records(folder)
    skipped = [(shown_path(path, folder), reason) for path, reason in loaded.errors]
    for name, reason in skipped:
        print(f"warning: skipped {name}: {reason}", file=sys.stderr)
    records = loaded.records if lab is None else [record for record in loaded.records if record.get("lab") == lab]
    if lab is not None and not records and loaded.records:
        found = sorted({str(record.get("lab")) for record in loaded.records})
        raise UserError(f"no result records of {lab} in {folder} (its records are of: {', '.join(found)})")
    if not records:
        if skipped:
            raise UserError(f"none of the {_plural(len(skipped), 'file')} in {folder} is a readable result record")
        raise UserError(f"no result records (*.json) in {folder}: run a lab script with --results-dir {folder} first")

    runs = runs_frame(records, folder)
    configs = configurations_frame(runs)
    extra_sections, problems = lab_sections(runs, plots)
    for problem in problems:
        print(f"warning: {problem.subject}: {problem.message}", file=sys.stderr)
    warned = core.warnings_section(skipped, runs, problems)  # its items: every warning, one line each
    sections = [warned, core.summary_section(runs), core.configurations_section(configs),
                core.plots_section(configs) if plots else None, *extra_sections, core.energy_section(runs),
                core.other_metrics_section(runs), core.provenance_section(runs)]
    machines = len(core.measuring_machines(runs)) or runs["machine"].nunique()  # as the mixed-machines warning counts
    facts = [f"{_plural(len(runs), 'run')} from {_plural(runs['lab'].nunique(), 'lab')} on "
             f"{_plural(machines, 'machine')}", _plural(len(skipped), "file") + " skipped",
             _plural(len(warned.items), "warning"), *([] if plots else ["plots not generated (--no-plots)"])]
    html = core.page(title or f"Results comparison: {folder.resolve().name}", facts, sections, folder.resolve())
    try:
        write_text_atomic(csv_frame(runs).to_csv(index=False), csv_out)
        write_text_atomic(html, report_path)
    except OSError as err:
        raise UserError(f"cannot write the report: {err}") from None
    return ReportOutcome(report_path=report_path, csv_path=csv_out, runs=len(runs), skipped=skipped,
                         warnings=list(warned.items), labs=sorted(runs["lab"].unique()))
