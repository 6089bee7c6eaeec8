"""The comparison report: any results folder -> one self-contained HTML page and a CSV summary.

Entry points:

- ``python scripts/compare_results.py --results-dir results``: the command line (:mod:`common.report.cli`,
  which a lab's own entry, such as Lab-01's ``05_performance_comparison.py``, runs with the same flags);
- :func:`build_report` from Python;
- :func:`register_section` for a section of a lab's own.

Where things are:

==================  ==========================================================================
``cli.py``          the flags and ``main``
``render.py``       :func:`build_report`: read the folder, build the sections, write HTML and CSV
``runs.py``         records -> a table of runs (one row each), baselines, speed-up, efficiency
``core.py``         the sections every report has: warnings, summary, repeats, plots, provenance
``sections.py``     what a section is made of, the cell formatting, the section registry
``checks.py``       results outside their expected range, as warnings
``plots.py``        the figures (matplotlib, imported only when plots are wanted)
``labs/labNN.py``   one module per lab with the sections of that lab (``lab01.py`` ... ``lab07.py``;
                    a new lab adds its own, ``labs/labNN.py``: every module there is imported when
                    a report is built, and its ``@register_section("labNN")`` builders run when the
                    results folder holds that lab's records)
``templates/``      the page (jinja2, autoescaped)
==================  ==========================================================================

Reads records with ``common.results.load_records`` and never imports torch, so it runs anywhere
pandas, matplotlib and jinja2 are installed, including a login node.
"""

from common.report.render import ReportOutcome, build_report
from common.report.sections import Cell, Figure, Section, SectionContext, Table, register_section, table_from_frame

__all__ = ["ReportOutcome", "build_report", "Cell", "Figure", "Section", "SectionContext", "Table",
           "register_section", "table_from_frame"]
