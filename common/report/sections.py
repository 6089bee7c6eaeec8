"""What a report is made of (sections of data only), how a table shows its values, and the registry where labs add
sections (``docs/architecture.md``, "The report"). Tables are laid out by pandas' Styler through the page's own
autoescaped template, so a run named ``<script>`` shows as text and no section can inject markup.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

import jinja2
import markupsafe
import pandas as pd
from pandas.io.formats.style import Styler

from common.units import byte_unit, format_bytes

MISSING = "—"
#: The page's templates (templates/): autoescaped whatever the file's name, since record fields are untrusted text.
TEMPLATES = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).resolve().parent / "templates"),
                               autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


@dataclass
class Cell:
    """One table cell: the text shown, an optional hover text, and a style (``num``, ``warn``)."""

    text: str
    title: str | None = None
    style: str = ""


class _Layout(Styler):
    """pandas' Styler with the page's table template: autoescaped, the run id on each row, hover texts."""

    env = TEMPLATES
    template_html = TEMPLATES.get_template("table.html.j2")


@dataclass
class Table:
    """A table; ``row_ids`` (run ids) become ``data-run-id`` attributes so a reader's tools can find rows."""

    columns: list[str]
    rows: list[list[Cell]]
    id: str | None = None
    caption: str | None = None
    row_ids: list[str] | None = None

    def html(self) -> markupsafe.Markup:
        """The table laid out by pandas' Styler: the cells' texts, their styles as CSS classes, their hover texts."""
        texts, styles, titles = ([[getattr(cell, part) for cell in row] for row in self.rows]
                                 for part in ("text", "style", "title"))
        styler = _Layout(pd.DataFrame(texts, columns=self.columns), caption=self.caption, cell_ids=False)
        styler = styler.hide(axis="index")
        # Styler trims a table past styler.render.max_elements cells (262,144): every run keeps its row here.
        with pd.option_context("styler.render.max_elements", len(self.rows) * len(self.columns) + 1):
            html = styler.to_html(table_id=self.id, row_ids=self.row_ids, titles=titles, styles=styles)
        return markupsafe.Markup(html)


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

    def __post_init__(self) -> None:  # an HTML id from the title: "Runs by lab" -> "runs-by-lab"
        self.id = self.id or re.sub(r"[^a-z0-9]+", "-", self.title.lower()).strip("-") or "section"


@dataclass
class SectionContext:
    """What a section builder gets: its lab's runs and every run (:func:`common.report.runs.runs_frame`, one row
    each), and whether to draw figures."""

    runs: pd.DataFrame
    all_runs: pd.DataFrame
    plots: bool = True


class Row(dict):
    """A row of a frame as a table's columns read it (``frame.to_dict("records", into=Row)``): column name -> value,
    and a key that no row of the frame has reads as ``None``, like a value the record lacks."""

    def __missing__(self, key: str) -> None:
        return None


SectionBuilder = Callable[[SectionContext], "Section | Iterable[Section] | None"]
#: lab -> {builder name -> builder}; keyed by name so importing a module twice adds nothing twice.
_LAB_SECTIONS: dict[str, dict[str, SectionBuilder]] = {}
#: Labs whose runs compare strategies on the same devices rather than device counts (``scaling=False``): when every
#: run of a report is from these, the summary leaves out the speed-up and scaling-efficiency columns.
LABS_WITHOUT_SCALING: set[str] = set()


def register_section(lab: str, *, scaling: bool = True) -> Callable[[SectionBuilder], SectionBuilder]:
    """Decorator: call the builder with the runs of ``lab`` whenever a report contains that lab."""
    if not scaling:
        LABS_WITHOUT_SCALING.add(lab)

    def decorate(builder: SectionBuilder) -> SectionBuilder:
        _LAB_SECTIONS.setdefault(lab, {})[f"{builder.__module__}.{builder.__qualname__}"] = builder
        return builder
    return decorate


def lab_section_builders(lab: str) -> list[SectionBuilder]:
    """The builders registered for ``lab``, in the order they were registered."""
    return list(_LAB_SECTIONS.get(lab, {}).values())


# --- formats: every value shown through fmt, a missing one as MISSING ---------------------------------------

def is_missing(value: Any) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)) or value == ""


#: The formats of the page by name; any other format string (``"{:.3g}"``) or function works too.
FORMATS: dict[str, Union[str, Callable[[Any], str]]] = {
    "text": "{}", "int": "{:,.0f}", "num": "{:.4g}", "%": "{:.0%}", "%1": "{:.1%}", "x": "{:.2f}×",
    "s": lambda v: f"{v:.3g} s" if v < 10 else f"{v:,.1f} s",  # seconds
    "rate": lambda v: f"{v:.3g}" if v < 100 else f"{v:,.0f}",  # samples/s and the like
    "bytes": format_bytes,  # binary units (1 GiB = 1024³ bytes), as nvidia-smi and free -h show them
}


def fmt(value: Any, spec: str | Callable[[Any], str] = "text") -> str:
    """``value`` as the page shows it with ``spec`` (a name in :data:`FORMATS`, a format string or a function):
    MISSING when missing, and as plain text when the format does not take it (text where a number belongs)."""
    if is_missing(value):
        return MISSING
    spec = FORMATS.get(spec, spec) if isinstance(spec, str) else spec
    try:
        shown = spec.format(value) if isinstance(spec, str) else spec(value)
        return f"{value:,.0f}" if "e+" in shown else shown  # "{:.3g}" would write 26,960 as 2.7e+04
    except (TypeError, ValueError):
        return str(value)


def fmt_memory(memory: Sequence[tuple[str, float]], source: str = "") -> Cell:
    """Peak memory per device in one unit, first device first: ``7.8 / 4.1 / 4.1 / 4.1 GiB``."""
    if not memory:
        return Cell(MISSING)
    unit, scale = byte_unit(max(peak for _, peak in memory))
    shown = " / ".join(str(int(peak)) if unit == "B" else f"{peak / scale:.1f}" for _, peak in memory) + f" {unit}"
    title = ", ".join(f"{device}: {format_bytes(peak)}" for device, peak in memory)
    return Cell(shown, title=f"{title} ({source})" if source else title, style="num")


#: What a column shows: a key (its value as text, MISSING where a row lacks it), ``(key, format)`` (through
#: :func:`fmt`, right-aligned), ``(key, format, hover key)``, or a function of the :class:`Row` giving text or a Cell.
ColumnSpec = Union[str, tuple, Callable[[Row], "str | Cell"]]


def _cell(row: Row, spec: ColumnSpec) -> Cell:
    if callable(spec):
        shown = spec(row)
        return shown if isinstance(shown, Cell) else Cell(shown)
    key, format, hover = (spec, "text", None) if isinstance(spec, str) else (*spec, None)[:3]
    title = None if hover is None or is_missing(row[hover]) else str(row[hover])
    return Cell(fmt(row[key], format), title=title, style="" if format == "text" else "num")


def table_from_frame(frame: pd.DataFrame, columns: Mapping[str, ColumnSpec], *,
                     id: str | None = None, caption: str | None = None, row_id_column: str | None = "run_id",
                     drop_empty: bool = False) -> Table:
    """A :class:`Table` with one row per row of ``frame``, each header's cells as its :data:`ColumnSpec` says.
    ``drop_empty`` leaves out each column no row has a value in: no column of dashes for what no run recorded."""
    rows = [[_cell(row, spec) for spec in columns.values()] for row in frame.to_dict("records", into=Row)]
    headers = list(columns)
    if drop_empty and rows:
        keep = [i for i in range(len(headers)) if any(row[i].text not in (MISSING, "") for row in rows)]
        headers, rows = [headers[i] for i in keep], [[row[i] for i in keep] for row in rows]
    row_ids = [fmt(value) for value in frame[row_id_column]] if row_id_column in frame.columns else None
    return Table(columns=headers, rows=rows, id=id, caption=caption, row_ids=row_ids)
