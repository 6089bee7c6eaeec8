"""The sections of each lab, a module per lab registering with ``@register_section(lab)`` (``docs/architecture.md``,
"The report"), every one imported when a report is built. A module reads records only, through ``ctx.runs``: it
never imports the lab's scripts or torch; a name both need lives once in ``common``.
"""

from __future__ import annotations

import importlib
import pkgutil

import pandas as pd

from common.report.core import Finding
from common.report.sections import Section, SectionContext, lab_section_builders

__all__ = ["load_builtin_lab_sections", "lab_sections"]


def load_builtin_lab_sections() -> list[tuple[str, str]]:
    """Import every module in this folder so their ``@register_section`` calls run; returns ``(module, error)`` for
    each that failed to import: one lab's broken section must not cost every other lab its report."""
    failed = []
    for module in pkgutil.iter_modules(__path__, prefix=f"{__name__}."):
        try:
            importlib.import_module(module.name)
        except Exception as err:
            failed.append((module.name, f"{type(err).__name__}: {err}"))
    return failed


def lab_sections(runs: pd.DataFrame, plots: bool) -> tuple[list[Section], list[Finding]]:
    """Sections registered for the labs present; a section that fails becomes a warning, not a crash."""
    problems = [Finding(f"section module {module}", f"could not be imported: {error}")
                for module, error in load_builtin_lab_sections()]
    sections: list[Section] = []
    for lab in sorted(runs["lab"].dropna().unique()):
        lab_runs = runs[runs["lab"] == lab].reset_index(drop=True)
        for builder in lab_section_builders(lab):
            try:
                result = builder(SectionContext(runs=lab_runs, all_runs=runs, plots=plots))
            except Exception as err:  # one lab's section must not cost the whole report
                problems.append(Finding(f"section {builder.__name__} of {lab}",
                                        f"could not be built: {type(err).__name__}: {err}"))
                continue
            sections.extend([result] if isinstance(result, Section) else result or [])
    return sections, problems
