"""The comparison report: any results folder -> one self-contained HTML page and a CSV summary.

Entry points:

- ``python scripts/compare_results.py --results-dir results`` (the command line, see that file);
- :func:`build_report` from Python, e.g. a lab's ``05_performance_comparison.py``;
- :func:`register_section` for a lab that wants a section of its own (see ``sections.py``).

A lab's ``05_performance_comparison.py`` can be a thin entry with the same flags::

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
    from common.errors import run_main
    from scripts.compare_results import main

    if __name__ == "__main__":
        run_main(main)

Reads records with ``common.results.load_records`` and never imports torch, so it runs anywhere
pandas, matplotlib and jinja2 are installed, including a login node.
"""

from scripts.report.render import ReportOutcome, build_report
from scripts.report.sections import Cell, Figure, Section, SectionContext, Table, register_section, table_from_frame

__all__ = ["ReportOutcome", "build_report", "Cell", "Figure", "Section", "SectionContext", "Table",
           "register_section", "table_from_frame"]
