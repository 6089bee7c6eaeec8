"""The report's command line (``scripts/compare_results.py`` and every lab entry that runs it): the flags of the
Lab-01 handout's ``performance_comparison.py`` plus ``--lab``, ``--csv``, ``--no-plots`` and ``--title``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from common.cli import input_dir, one_line_errors, output_file_or_name
from common.report import build_report
from common.report.render import DEFAULT_REPORT_NAME

__all__ = ["beside_records", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = one_line_errors(argparse.ArgumentParser(
        description="Turn a folder of result records into one self-contained HTML report and a CSV summary."))
    parser.add_argument("--results-dir", type=input_dir, default=Path("results"),
                        help="folder of result records, searched recursively (default: %(default)s)")
    parser.add_argument("--lab", default=None,
                        help="only this lab's (or chapter's) records, e.g. lab04 or ch04; the report is then "
                             "RESULTS_DIR/LAB_comparison_report.html (default: every record found, all labs in "
                             "one report)")
    parser.add_argument("--output-report", type=output_file_or_name, default=None,
                        help="HTML file to write; a bare file name (no folder) is put in RESULTS_DIR, beside the "
                             f"records (default: RESULTS_DIR/{DEFAULT_REPORT_NAME})")
    parser.add_argument("--csv", type=output_file_or_name, default=None,
                        help="CSV summary to write, one row per run; a bare file name is put in RESULTS_DIR "
                             "(default: the report's path with .csv)")
    parser.add_argument("--generate-plots", dest="plots", action="store_true", default=True,
                        help="draw throughput, memory and efficiency plots (default: on)")
    parser.add_argument("--no-plots", dest="plots", action="store_false",
                        help="skip the plots: faster, and matplotlib is not imported (default: off)")
    parser.add_argument("--title", default=None,
                        help="page title (default: 'Results comparison: ' + the folder's name)")
    return parser


def beside_records(path: Path | None, results_dir: Path) -> Path | None:
    """A bare file name goes into the results folder, not the one the command was typed in (git ignores results/)."""
    return results_dir / path if path is not None and len(path.parts) == 1 else path


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = beside_records(args.output_report, args.results_dir)
    if report is None and args.lab is not None:
        report = args.results_dir / f"{args.lab}_{DEFAULT_REPORT_NAME}"
    outcome = build_report(args.results_dir, report, beside_records(args.csv, args.results_dir), plots=args.plots,
                           title=args.title, lab=args.lab)
    print(f"read {outcome.runs} run{'s' if outcome.runs != 1 else ''}"
          f"{f', skipped {len(outcome.skipped)} file(s)' if outcome.skipped else ''}"
          f"{f'; {len(outcome.warnings)} warning(s), listed in the report' if outcome.warnings else ''}")
    if len(outcome.labs) > 1:
        print(f"note: runs of {len(outcome.labs)} labs in one report ({', '.join(outcome.labs)}); --lab LAB, one of "
              f"them, writes a report of that lab alone: {args.results_dir / ('LAB_' + DEFAULT_REPORT_NAME)}")
    print(f"csv: {outcome.csv_path}")
    print(f"report: {outcome.report_path}")
    return 0
