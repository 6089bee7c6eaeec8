#!/usr/bin/env python3
"""Fill the results tables in the docs from committed result records (no number typed by hand).

Usage:
    python scripts/update_results_tables.py            # rewrite the tables in every README that has a marker
    python scripts/update_results_tables.py --check    # exit 1 when a table is out of date (CI runs this)

A Markdown file asks for a table with a marker line ``<!-- results-table:LAB -->``; this script puts
the table of LAB's reference records after it, up to ``<!-- /results-table:LAB -->``. A marker
``<!-- gpu-proof:MACHINE -->`` gets the speed targets of the GPU proof committed in
``reference-results/MACHINE/gpu-proof/summary.json`` (``scripts/gpu_proof.sh``), each with its measured
value. The records come from ``reference-results/`` (one folder per machine, e.g. ``reference-results/cpu-2core/``),
and the columns are those of the report's summary table (common/report/), so the docs
and the report show the same numbers the same way. Each table is headed by the machine its records
name (``common.runtime.machine``: host, CPU, its CPUs, bf16 native or emulated, and what it could do), never
by a name typed here.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Sequence

from common.atomic import write_text_atomic
from common.cli import input_dir, input_file, one_line_errors
from common.errors import UserError, run_main
from common.results import load_records

REPO = Path(__file__).resolve().parents[1]
PROOF_MARKER = re.compile(r"<!-- gpu-proof:(?P<machine>[\w.-]+) -->\n(?:.*?<!-- /gpu-proof:(?P=machine) -->\n)?", re.S)
MARKER = re.compile(r"<!-- results-table:(?P<lab>[\w.-]+) -->\n(?:.*?<!-- /results-table:(?P=lab) -->\n)?", re.S)
#: Summary columns shown in the docs (the report's own formatting of each).
DOC_COLUMNS = ("method", "model", "machine", "device", "devices", "global batch", "time / epoch",
               "peak memory per device", "samples/s", "TFLOP/s", "% of peak", "speed-up vs baseline",
               "scaling efficiency", "final loss", "test accuracy")


def _markdown(columns: list[str], rows: list[list[str]]) -> list[str]:
    escape = lambda text: str(text).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return ["| " + " | ".join(map(escape, columns)) + " |", "|" + " --- |" * len(columns),
            *("| " + " | ".join(map(escape, row)) + " |" for row in rows)]


def summary_table(subset, doc: Path) -> list[str]:
    """The report's summary columns for these runs, minus columns no run has a value in."""
    from common.report.core import SUMMARY_COLUMNS
    from common.report.sections import table_from_frame

    # One machine: the heading above the table names it, a column repeating it adds nothing.
    single_machine = subset["machine"].nunique() <= 1
    table = table_from_frame(subset, {name: spec for name, spec in SUMMARY_COLUMNS.items()
                                      if name in DOC_COLUMNS and not (name == "machine" and single_machine)},
                             drop_empty=True)
    rows = []
    for run, row in zip(subset.to_dict("records"), table.rows):
        path = Path(run["record"]["_path"]).resolve()
        link = Path(*([".."] * len(doc.parent.relative_to(REPO).parts))) / path.relative_to(REPO)
        rows.append([cell.text for cell in row] + [f"[{path.stem[-8:]}]({link.as_posix()})"])
    return _markdown(table.columns + ["record"], rows)


def lab_section_tables(lab: str, subset, runs) -> list[str]:
    """The tables of the report sections a lab registered (e.g. Lab-03's ms/batch per precision)."""
    from common.report.labs import load_builtin_lab_sections
    from common.report.sections import Section, SectionContext, lab_section_builders

    load_builtin_lab_sections()
    lines: list[str] = []
    context = SectionContext(runs=subset.reset_index(drop=True), all_runs=runs, plots=False)
    for builder in lab_section_builders(lab):
        built = builder(context)
        sections = [] if built is None else [built] if isinstance(built, Section) else list(built)
        for section in sections:
            for table in section.tables:
                title = f"{section.title}: {table.caption}" if table.caption else section.title
                lines += ["", f"**{title}**", "",
                          *_markdown(table.columns, [[cell.text for cell in row] for row in table.rows])]
    return lines


def markdown_table(lab: str, runs, records_dir: Path, doc: Path) -> str:
    """The Markdown tables of ``lab``'s reference runs, with a link to each record."""
    subset = runs[runs["lab"] == lab] if runs is not None else None
    if subset is None or subset.empty:
        return f"_No reference records for `{lab}` yet: run the lab and copy its records to `{records_dir.name}/`._\n"
    machines = sorted({str(m) for m in subset["machine"].dropna()})
    # The heading names the machine from the records themselves: numbers from another CPU (one
    # without bf16 units, say) differ tenfold, and the reader must see which machine these are.
    lines = []
    for machine in machines:
        detail = subset.loc[subset["machine"] == machine, "machine_detail"].iloc[0]
        lines += [f"Measured on **{machine}**: {detail}.", ""]
    from common.report.core import mixed_machines  # the report's rule: records with a device on several machines

    if mixed_machines(subset):
        lines += ["_These records come from different machines: compare numbers only within one machine._", ""]
    lines += [*summary_table(subset, doc), *lab_section_tables(lab, subset, runs)]
    commits = sorted({str(c)[:10] for c in subset["git_commit"].dropna()})
    lines.append("")
    lines.append(f"_Generated by `scripts/update_results_tables.py` from {len(subset)} record(s) in "
                 f"`{records_dir.relative_to(REPO).as_posix()}/` (machine: {', '.join(machines) or 'unknown'}; "
                 f"code revision: {', '.join(commits) or 'unknown'}). Timing method and full provenance are "
                 "in each record._")
    return "\n".join(lines) + "\n"


def proof_table(machine: str, records_dir: Path) -> str:
    """The speed targets of a committed GPU proof, each with the value its check measured."""
    try:
        from scripts.gpu_proof_checks import AT_MOST
    except ImportError:  # run as a file: the module beside this one
        from gpu_proof_checks import AT_MOST  # type: ignore[no-redef]

    path = records_dir / machine / "gpu-proof" / "summary.json"
    if not path.is_file():
        return f"_No GPU proof committed for `{machine}` yet: `bash scripts/gpu_proof.sh` on a GPU node._\n"
    summary = json.loads(path.read_text(encoding="utf-8"))
    checks, counts = summary.get("checks", []), summary.get("counts", {})
    failed = [row["name"] for row in checks if row.get("status") == "failed"]
    lines = [f"Measured on **{summary.get('gpu_name')}** ({summary.get('gpus')} GPU, torch {summary.get('torch')}, "
             f"{str(summary.get('started', ''))[:10]}) by `bash scripts/gpu_proof.sh`: {counts.get('ok', 0)} of "
             f"{len(checks)} checks ok, {counts.get('failed', 0)} failed"
             + (f" ({', '.join(failed)})" if failed else "") + f", {counts.get('skipped', 0)} skipped, "
             f"{counts.get('not-run', 0)} not run.", "",
             "| check | target | measured | status | what it runs |", "| --- | --- | --- | --- | --- |"]
    for row in checks:
        for key, goal in summary.get("targets", {}).items():
            value = row.get("findings", {}).get(key)
            if key in row.get("findings", {}):
                shown = format(value, ",.4g") if isinstance(value, (int, float)) else "—"
                lines.append(f"| {row['name']} | {'≤' if key in AT_MOST else '≥'} {goal:g} | {shown} | "
                             f"{row.get('status')} | {row.get('what', '')} |")
    lines += ["", f"_Generated by `scripts/update_results_tables.py` from "
                  f"`{path.relative_to(REPO).as_posix()}`; every check's row is in `summary.md` beside it._"]
    return "\n".join(lines) + "\n"


def docs_with_markers() -> list[Path]:
    candidates = [REPO / "README.md", *REPO.glob("chapters/*/README.md"), *REPO.glob("labs/*/README.md"),
                  *REPO.glob("docs/*.md")]
    return [p for p in sorted(set(candidates)) if p.is_file()
            and ("<!-- results-table:" in p.read_text() or "<!-- gpu-proof:" in p.read_text())]


def build_parser() -> argparse.ArgumentParser:
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--records", type=input_dir, default=REPO / "reference-results",
                        help="folder of committed reference records (default: reference-results/)")
    parser.add_argument("docs", nargs="*", type=input_file,
                        help="Markdown files to update (default: every README and doc with a marker)")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a table differs from what the records give")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    records_dir = args.records.resolve()
    if not records_dir.is_dir():
        raise UserError(f"reference records folder not found: {records_dir}")
    loaded = load_records(records_dir)
    for path, reason in loaded.errors:
        print(f"warning: skipped {path}: {reason}", file=sys.stderr)
    from common.report.runs import runs_frame

    runs = runs_frame(loaded.records) if loaded.records else None
    stale = []
    docs = [doc.resolve() for doc in args.docs] if args.docs else docs_with_markers()
    for doc in docs:
        text = doc.read_text()
        new = MARKER.sub(lambda m: (f"<!-- results-table:{m['lab']} -->\n"
                                    f"{markdown_table(m['lab'], runs, records_dir, doc)}"
                                    f"<!-- /results-table:{m['lab']} -->\n"), text)
        new = PROOF_MARKER.sub(lambda m: (f"<!-- gpu-proof:{m['machine']} -->\n{proof_table(m['machine'], records_dir)}"
                                          f"<!-- /gpu-proof:{m['machine']} -->\n"), new)
        if new != text:
            stale.append(doc.relative_to(REPO))
            if not args.check:
                write_text_atomic(new, doc)
    verb = "out of date" if args.check else "updated"
    for doc in stale:
        print(f"{verb}: {doc}")
    if args.check and stale:
        print("run: python scripts/update_results_tables.py", file=sys.stderr)
        return 1
    print(f"{len(loaded.records)} reference record(s); {len(stale)} file(s) {verb}")
    return 0


if __name__ == "__main__":
    run_main(main)
