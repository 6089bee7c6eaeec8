"""The docs match the code and the records: generated tables current, the README's commands real."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import REPO, run_main


def test_results_tables_in_the_docs_match_the_committed_records(capsys):
    # Every table between <!-- results-table:LAB --> markers is what the reference records give.
    status = run_main("scripts/update_results_tables.py", ["--check"])
    assert status == 0, capsys.readouterr()


def test_every_lab_and_chapter_readme_with_a_table_has_reference_records():
    readmes = [p for p in REPO.glob("*/*/README.md") if "<!-- results-table:" in p.read_text()]
    assert len(readmes) >= 5
    for readme in readmes:
        assert "_No reference records" not in readme.read_text(), readme


def test_readme_two_commands_exist_and_ci_runs_the_test_command():
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^bash (scripts/\S+\.sh)", readme, re.M)
    assert commands[:2] == ["scripts/main_job.sh", "scripts/test.sh"]
    for command in commands:
        assert (REPO / command).is_file()
    ci = (REPO / ".ci" / "run").read_text()
    assert "exec bash scripts/test.sh" in ci


def test_readme_links_point_at_files_that_exist():
    for readme in [REPO / "README.md", *REPO.glob("*/*/README.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme.read_text()):
            assert (readme.parent / target).exists(), f"{readme.relative_to(REPO)} links to missing {target}"


def test_every_reference_record_reads_and_says_where_its_energy_is():
    """The docs quote these records: each one reads, has an energy entry (version 2 on: a measured
    number or why none could be read), and the docs name the machine each came from. Records of
    version 2 predate provenance.machine: their heading says the capabilities were not recorded
    until scripts/reference_runs.sh re-measures them."""
    from common.results import load_records

    loaded = load_records(REPO / "reference-results")
    assert not loaded.errors, loaded.errors
    assert len(loaded.records) >= 30
    old = sorted({Path(r["_path"]).parent.name for r in loaded.records if r["schema_version"] < 2})
    assert not old, f"reference records without an energy entry in {old}: run scripts/reference_runs.sh"
    assert all(r["energy"]["status"] in ("ok", "unavailable") for r in loaded.records)


def test_every_results_table_in_the_docs_is_headed_by_the_machine_its_records_came_from():
    """A student compares their numbers with these: the heading says which machine made them (CPU,
    its CPUs, bf16 native or emulated), from the records, so a 10x gap on another CPU is explained."""
    from common.runtime.machine import machine_label
    from common.results import load_records

    labels: dict[str, set[str]] = {}
    for record in load_records(REPO / "reference-results").records:
        labels.setdefault(record["lab"], set()).add(machine_label(record["provenance"]))
    docs = [p for p in [REPO / "README.md", *REPO.glob("*/*/README.md")] if "<!-- results-table:" in p.read_text()]
    checked = 0
    for doc in docs:
        for lab, block in re.findall(r"<!-- results-table:([\w.-]+) -->\n(.*?)<!-- /results-table:\1 -->",
                                     doc.read_text(), re.S):
            headings = re.findall(r"^Measured on \*\*(.+?)\*\*: ", block, re.M)
            assert sorted(headings) == sorted(labels[lab]), f"{doc.relative_to(REPO)} ({lab})"
            checked += 1
    assert checked >= 5
