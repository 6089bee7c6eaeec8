"""The comparison report: any results folder -> one self-contained HTML page and a CSV summary.

Entry points: ``python scripts/compare_results.py --results-dir results`` (``cli.py``, which a lab's own entry such
as Lab-01's ``05_performance_comparison.py`` runs with the same flags), and :func:`build_report` from Python.

``runs.py`` reads each record once, into one tidy frame with a row per run: every key of the record is a column
named by its path in the schema (``metrics.samples_per_s``, ``config.precision``), and the values the summary
compares are typed columns (``samples_per_s``, ``machine``, ``devices``, ``speedup``). ``core.py`` makes the
sections every report has (warnings, summary, repeats, plots, energy, other metrics, provenance) and
``labs/labNN.py`` those of each lab; ``sections.py`` holds what a section is made of and lays its tables out with
pandas' Styler through ``templates/`` (autoescaped: a record cannot inject markup); ``render.py`` writes the page
and the CSV; ``checks.py`` turns results outside their expected range into warnings; ``plots.py`` draws the figures
(matplotlib is imported only when plots are wanted). Nothing here imports torch: the report runs wherever pandas,
matplotlib and jinja2 are installed, a login node included.

A lab adds its section in one module, ``common/report/labs/labNN.py``: every module there is imported when a report
is built, and its builder runs when the results folder holds records of that lab. It imports ``common.report.runs``
and ``common.report.sections`` (the package itself imports the lab modules). For example::

    from common.report.runs import numbers
    from common.report.sections import Section, SectionContext, register_section, table_from_frame

    @register_section("lab08")
    def data_at_scale(ctx: SectionContext) -> Section | None:
        runs = ctx.runs[ctx.runs["method"] == "shards"]  # this lab's runs, one row each, every record key a column
        if runs.empty:
            return None  # nothing to say: no section
        table = table_from_frame(runs.assign(wait=numbers(runs, "metrics.data_wait_s") / runs["time_per_epoch_s"]), {
            "run": "run_id", "machine": "machine",  # a key: its value as text ("—" when missing)
            "workers": ("config.num_workers", "int"),  # (key, format): a number, right-aligned
            "samples/s": ("samples_per_s", "rate", "file"),  # (key, format, key shown on hover)
            "waiting for data": ("wait", "%1"),
        }, id="lab08-shards", caption="What the loader cost")
        return Section("Lab 08: data at scale", paragraphs=["What the table shows."], tables=[table])

A format is a name in :data:`~common.report.sections.FORMATS` (``int``, ``num``, ``%``, ``%1``, ``x``, ``s``,
``rate``, ``bytes``), a format string (``"{:.3g}"``) or a function of the value. A column may also be a function
of the row returning text or a :class:`Cell` (a hover text, the ``warn`` style). :func:`numbers`, :func:`texts`
and :func:`entries` (one row per object of a list, ``metrics.sizes``) read record keys that may be missing or hold
the wrong type. Figures come from :func:`common.report.plots.axes` and :func:`~common.report.plots.png_figure`,
drawn only when ``ctx.plots``. A builder that raises becomes a warning on the page, never a failed report.
"""

from common.report.render import ReportOutcome, build_report
from common.report.runs import entries, numbers, texts
from common.report.sections import Cell, Figure, Section, SectionContext, Table, register_section, table_from_frame

__all__ = ["ReportOutcome", "build_report", "Cell", "Figure", "Section", "SectionContext", "Table", "entries",
           "numbers", "register_section", "table_from_frame", "texts"]
