"""The report's command line: ``python scripts/compare_results.py`` and every lab entry that runs it.

The flags are those of the seed's ``performance_comparison.py`` (``--results-dir``,
``--output-report``, ``--generate-plots``) plus ``--csv``, ``--no-plots`` and ``--title``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from common.cli import one_line_errors, output_file
from common.report import build_report
from common.report.render import DEFAULT_REPORT_NAME

__all__ = ["build_parser", "parse_args", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = one_line_errors(argparse.ArgumentParser(
        description="Turn a folder of result records into one self-contained HTML report and a CSV summary."))
    parser.add_argument("--results-dir", type=Path, default=Path("results"),
                        help="folder of result records, searched recursively (default: %(default)s)")
    parser.add_argument("--output-report", type=output_file, default=None,
                        help=f"HTML file to write (default: RESULTS_DIR/{DEFAULT_REPORT_NAME})")
    parser.add_argument("--csv", type=output_file, default=None,
                        help="CSV summary to write, one row per run (default: the report's path with .csv)")
    parser.add_argument("--generate-plots", dest="plots", action="store_true", default=True,
                        help="draw throughput, memory and efficiency plots (default: on)")
    parser.add_argument("--no-plots", dest="plots", action="store_false",
                        help="skip the plots: faster, and matplotlib is not imported (default: off)")
    parser.add_argument("--title", default=None,
                        help="page title (default: 'Results comparison: ' + the folder's name)")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    outcome = build_report(args.results_dir, args.output_report, args.csv, plots=args.plots, title=args.title)
    problems = len(outcome.warnings)
    print(f"read {outcome.runs} run{'s' if outcome.runs != 1 else ''}"
          f"{f', skipped {len(outcome.skipped)} file(s)' if outcome.skipped else ''}"
          f"{f'; {problems} warning(s), listed in the report' if problems else ''}")
    print(f"csv: {outcome.csv_path}")
    print(f"report: {outcome.report_path}")
    return 0
