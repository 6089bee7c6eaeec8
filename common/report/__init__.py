"""The comparison report: any results folder -> one self-contained HTML page and a CSV summary.

Entry points: ``python scripts/compare_results.py --results-dir results`` (``cli.py``) and :func:`build_report`. What
each module owns, and how a lab adds its section (one module in ``labs/``): ``docs/architecture.md``, "The report".
"""

from common.report.render import ReportOutcome, build_report
from common.report.runs import entries, numbers, texts
from common.report.sections import Cell, Figure, Section, SectionContext, Table, register_section, table_from_frame

__all__ = ["ReportOutcome", "build_report", "Cell", "Figure", "Section", "SectionContext", "Table", "entries",
           "numbers", "register_section", "table_from_frame", "texts"]
