"""What a report is made of, and the registry where labs add sections of their own.

A report is a list of :class:`Section` objects. A section holds only data (paragraphs, bullet
items, tables of :class:`Cell`, figures as PNG bytes); the jinja2 template turns it into HTML with
autoescaping on, so a run named ``<script>`` shows as text and no section can inject markup.

A lab adds a section with :func:`register_section`::

    from common.report.sections import Section, SectionContext, register_section, table_from_frame

    @register_section("lab03")
    def precision_section(ctx: SectionContext) -> Section | None:
        runs = ctx.runs                       # this lab's runs, one row per run (see runs.py)
        if runs.empty:
            return None                       # nothing to say: no section
        return Section("Mixed precision", paragraphs=["..."], tables=[table_from_frame(...)])

The builder is called only when the results folder holds records of that lab. Sections that ship
with the tool live in ``common/report/labs/<lab>.py`` and are imported automatically; a lab's own
entry script can also register one before it calls the report.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import pandas as pd

from common.units import byte_unit, format_bytes

MISSING = "—"


@dataclass
class Cell:
    """One table cell: the text shown, an optional hover text, and a style (``num``, ``warn``)."""

    text: str
    title: str | None = None
    style: str = ""


@dataclass
class Table:
    """A table; ``row_ids`` (run ids) become ``data-run-id`` attributes so tests can find rows."""

    columns: list[str]
    rows: list[list[Cell]]
    id: str | None = None
    caption: str | None = None
    row_ids: list[str] | None = None


@dataclass
class Figure:
    """A plot as base64-encoded PNG, embedded in the page as a ``data:`` URI."""

    png_base64: str
    alt: str
    caption: str = ""


@dataclass
class Section:
    """A titled part of the report. Content is shown in this order: paragraphs, items, figures, tables, notes."""

    title: str
    id: str = ""
    paragraphs: list[str] = field(default_factory=list)
    items: list[str] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.id = self.id or slug(self.title)


@dataclass
class SectionContext:
    """What a section builder gets: the runs it is about, every run, and where they came from.

    ``runs`` has one row per run with the columns of :func:`common.report.runs.run_row` (``method``,
    ``model``, ``machine``, ``devices``, ``samples_per_s``, ``memory_per_device``, ... and ``record``,
    the whole record for anything else) plus those :func:`~common.report.runs.runs_frame` adds
    (``speedup``, ``scaling_efficiency``, ``comparison``).
    """

    runs: pd.DataFrame
    all_runs: pd.DataFrame
    results_dir: Path
    plots: bool = True


#: A row of the runs table as table renderers and checks see it: column name -> value.
Row = Mapping[str, Any]
SectionBuilder = Callable[[SectionContext], "Section | Iterable[Section] | None"]
#: lab -> {builder name -> builder}; keyed by name so importing a module twice adds nothing twice.
_LAB_SECTIONS: dict[str, dict[str, SectionBuilder]] = {}
#: Labs whose runs compare strategies on the same devices rather than device counts: when every run of
#: a report is from these, the summary leaves out the speed-up and scaling-efficiency columns (a lab's
#: section module adds its lab).
LABS_WITHOUT_SCALING: set[str] = set()


def register_section(lab: str) -> Callable[[SectionBuilder], SectionBuilder]:
    """Decorator: call the builder with the runs of ``lab`` whenever a report contains that lab."""
    def decorate(builder: SectionBuilder) -> SectionBuilder:
        _LAB_SECTIONS.setdefault(lab, {})[f"{builder.__module__}.{builder.__qualname__}"] = builder
        return builder
    return decorate


def lab_section_builders(lab: str) -> list[SectionBuilder]:
    """The builders registered for ``lab``, in the order they were registered."""
    return list(_LAB_SECTIONS.get(lab, {}).values())


def slug(title: str) -> str:
    """An HTML id from a title: ``"Runs by lab"`` -> ``"runs-by-lab"``."""
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "section"


# --- formatting: every missing or unusable value shows as MISSING --------------------------------

def is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value == ""


def fmt_text(value: Any) -> str:
    return MISSING if is_missing(value) else str(value)


def fmt_int(value: Any) -> str:
    return MISSING if is_missing(value) else f"{int(value):,}"


def fmt_number(value: Any, digits: int = 4) -> str:
    """``digits`` significant digits: losses, ratios, metrics of unknown scale."""
    return MISSING if is_missing(value) else f"{value:.{digits}g}"


def fmt_seconds(value: Any) -> str:
    if is_missing(value):
        return MISSING
    return f"{value:.3g} s" if value < 10 else f"{value:,.1f} s"


def fmt_rate(value: Any) -> str:
    if is_missing(value):
        return MISSING
    return f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def fmt_percent(value: Any, digits: int = 0) -> str:
    return MISSING if is_missing(value) else f"{value:.{digits}%}"


def fmt_ratio(value: Any) -> str:
    return MISSING if is_missing(value) else f"{value:.2f}×"


def fmt_bytes(value: Any) -> str:
    """Binary units (1 GiB = 1024³ bytes), as ``nvidia-smi`` and ``free -h`` show them."""
    return MISSING if is_missing(value) else format_bytes(value)


def fmt_memory(memory: Sequence[tuple[str, float]], source: str = "") -> Cell:
    """Peak memory per device in one unit, first device first: ``7.8 / 4.1 / 4.1 / 4.1 GiB``."""
    if not memory:
        return Cell(MISSING)
    unit, scale = byte_unit(max(peak for _, peak in memory))
    if unit == "B":
        shown = " / ".join(str(int(peak)) for _, peak in memory) + " B"
    else:
        shown = " / ".join(f"{peak / scale:.1f}" for _, peak in memory) + f" {unit}"
    title = ", ".join(f"{device}: {fmt_bytes(peak)}" for device, peak in memory)
    return Cell(shown, title=f"{title} ({source})" if source else title, style="num")


def num(text: str) -> Cell:
    """A right-aligned cell."""
    return Cell(text, style="num")


#: A table column: its header, and what a row shows under it (text or a :class:`Cell`).
Column = tuple[str, Callable[[Row], "str | Cell"]]


def text_column(header: str, key: str | None = None) -> Column:
    """A column showing ``row[key]`` as text (``key`` defaults to the header)."""
    key = key or header
    return header, lambda row: fmt_text(row[key])


def number_column(header: str, key: str, fmt: Callable[..., str], *args: Any) -> Column:
    """A right-aligned column showing ``fmt(row[key], *args)``, e.g. ``fmt_percent`` with 1 digit."""
    return header, lambda row: num(fmt(row[key], *args))


def table_from_frame(
    frame: pd.DataFrame,
    columns: Sequence[Column],
    *,
    id: str | None = None,
    caption: str | None = None,
    row_id_column: str | None = "run_id",
    drop_empty: bool = False,
) -> Table:
    """A :class:`Table` with one row per row of ``frame``; each column is ``(header, row -> text or Cell)``.

    ``drop_empty`` leaves out every column in which no row has a value (every cell ``—``): a lab
    whose records have no such number gets no column of dashes.
    """
    rows = []
    # Plain dicts, not iterrows(): ten times faster, and a renderer reads row["column"] either way.
    for row in frame.to_dict("records"):
        cells = []
        for _, render in columns:
            value = render(row)
            cells.append(value if isinstance(value, Cell) else Cell(value))
        rows.append(cells)
    headers = [header for header, _ in columns]
    if drop_empty and rows:
        keep = [i for i in range(len(headers)) if any(row[i].text not in (MISSING, "") for row in rows)]
        headers, rows = [headers[i] for i in keep], [[row[i] for i in keep] for row in rows]
    row_ids = None
    if row_id_column and row_id_column in frame.columns:
        row_ids = [fmt_text(value) for value in frame[row_id_column]]
    return Table(columns=headers, rows=rows, id=id, caption=caption, row_ids=row_ids)
