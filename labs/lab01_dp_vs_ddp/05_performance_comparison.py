#!/usr/bin/env python3
r"""Lab-01 step 5: compare the baseline, DataParallel and DDP runs in one HTML report.

Usage:
    python labs/lab01_dp_vs_ddp/05_performance_comparison.py --results-dir ./results --generate-plots \
        --output-report comparison_report.html
    python labs/lab01_dp_vs_ddp/05_performance_comparison.py --results-dir results   # results/comparison_report.html
    sbatch --wrap "python labs/lab01_dp_vs_ddp/05_performance_comparison.py --results-dir results"

(It reads files and starts no processes, so there is no torchrun form.)

This is the course's report tool (``common/report/``, also ``scripts/compare_results.py``) under the
lab's name and with the Lab-01 handout's flags: every lab uses the same tool, so there is one place to fix it.
It reads every result record in ``--results-dir`` (steps 1 to 4 each wrote one), and writes a
self-contained HTML page with the handout's table (method, global batch, time per epoch, memory per
device, throughput, scaling efficiency against the baseline), the plots, the DataParallel memory
imbalance, whether the three methods reached the same loss, and the provenance of every run; and a
CSV of the table beside it.
"""

from __future__ import annotations


from common.errors import run_main
from common.report.cli import main

if __name__ == "__main__":
    run_main(main)
