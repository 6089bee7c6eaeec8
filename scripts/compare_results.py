#!/usr/bin/env python3
"""Turn a folder of result records into one self-contained HTML report and a CSV summary.

Usage:
    python scripts/compare_results.py --results-dir results                      # -> results/comparison_report.html
    python scripts/compare_results.py --results-dir results --output-report comparison_report.html --no-plots
    sbatch --wrap "python scripts/compare_results.py --results-dir results"      # after the jobs, on the cluster

(It reads files and never starts processes, so there is no torchrun form.)

Every run in the folder gets a row: method, model, machine, world size, global batch, time per epoch,
peak memory per device, throughput and scaling efficiency against the single-device baseline of the
same machine, as in Lab 01's expected-results table. Then come plots, sections of the labs present,
the provenance of every run, and warnings for files that could not be read and results outside their
expected range. The page has no scripts and loads nothing from the network: mail it, or open it on
a laptop after ``scp``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
from common.cli import output_file
from common.errors import run_main
from scripts.report import build_report
from scripts.report.render import DEFAULT_REPORT_NAME


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    return parser.parse_args(argv)


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


if __name__ == "__main__":
    run_main(main)
