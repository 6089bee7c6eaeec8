"""Lab-specific report sections: one module per lab, each registering with ``@register_section(lab)``.

Every module in this folder is imported when a report is built, so adding ``lab04.py`` here is all a
lab needs to do for its section to appear whenever its records are in the results folder. A module
reads records only (``ctx.runs``, and ``record`` for anything else): it must not import the lab's
scripts or torch. Names a lab's scripts and its section both need (Lab-03's precisions, say) live
once in ``common``.

Reports and the README tables call :func:`lab_sections` (or :func:`load_builtin_lab_sections` and then
``common.report.sections.lab_section_builders``); the registry in ``sections`` never imports this folder.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pandas as pd

from common.report.checks import Finding
from common.report.sections import Section, SectionContext, lab_section_builders

__all__ = ["load_builtin_lab_sections", "lab_sections"]


def load_builtin_lab_sections() -> list[tuple[str, str]]:
    """Import every module in ``common/report/labs/`` so their ``@register_section`` calls run.

    Returns ``(module, error)`` for each module that failed to import: one lab's broken section
    must not cost every other lab its report.
    """
    failed = []
    for module in pkgutil.iter_modules(__path__):
        name = f"{__name__}.{module.name}"
        try:
            importlib.import_module(name)
        except Exception as err:
            failed.append((name, f"{type(err).__name__}: {err}"))
    return failed


def lab_sections(runs: pd.DataFrame, results_dir: Path, plots: bool) -> tuple[list[Section], list[Finding]]:
    """Sections registered for the labs present; a section that fails becomes a warning, not a crash."""
    problems = [Finding(f"section module {module}", f"could not be imported: {error}")
                for module, error in load_builtin_lab_sections()]
    sections: list[Section] = []
    for lab in sorted(runs["lab"].dropna().unique()):
        lab_runs = runs[runs["lab"] == lab].reset_index(drop=True)
        for builder in lab_section_builders(lab):
            context = SectionContext(runs=lab_runs, all_runs=runs, results_dir=results_dir, plots=plots)
            try:
                result = builder(context)
            except Exception as err:  # one lab's section must not cost the whole report
                problems.append(Finding(f"section {builder.__name__} of {lab}",
                                        f"could not be built: {type(err).__name__}: {err}"))
                continue
            if isinstance(result, Section):
                result = [result]
            sections.extend(result or [])
    return sections, problems
