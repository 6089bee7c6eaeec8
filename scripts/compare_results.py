#!/usr/bin/env python3
"""Turn a folder of result records into one self-contained HTML report and a CSV summary.

Usage:
    python scripts/compare_results.py --results-dir results               # -> results/comparison_report.html
    python scripts/compare_results.py --results-dir results --lab lab04   # -> results/lab04_comparison_report.html
    python scripts/compare_results.py --results-dir results --output-report comparison_report.html --no-plots
    sbatch --wrap "python scripts/compare_results.py --results-dir results"      # after the jobs, on the cluster

(It reads files and never starts processes, so there is no torchrun form.)

Every run in the folder gets a row: method, model, machine, world size, global batch, time per epoch,
peak memory per device, throughput and scaling efficiency against the single-device baseline of the
same machine, as in Lab 01's expected-results table. Then come plots, sections of the labs present,
the provenance of every run, and warnings for files that could not be read and results outside their
expected range. Every lab's scripts write into ``results/`` by default, so that folder gathers the
runs of every lab you did: the report then shows them all (one section per lab, one summary table,
and a note naming the labs on the terminal); ``--lab`` keeps one lab's. A bare file name for
``--output-report`` or ``--csv`` is written beside the records, never into the folder you typed the
command in (git ignores ``results/``, not a report left in a lab folder). The page has no scripts
and loads nothing from the network: mail it, or open it on a laptop after ``scp``.

The report itself is ``common/report/`` (labs run it under their own names too); this file is its
command line.
"""

from __future__ import annotations


from common.errors import run_main
from common.report.cli import main

if __name__ == "__main__":
    run_main(main)
