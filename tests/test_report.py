"""The comparison report (scripts/compare_results.py and common/report/): real records in, real files out.

Records are written with the real ``common.results.make_record``/``write_record``; only the
provenance is built by hand, because the real ``provenance(device)`` imports torch. The report is
built in-process through ``compare_results.main`` (the CLI) or ``build_report`` (the Python API);
one test runs the script as a subprocess because its exit status is the point.
"""

from __future__ import annotations

import base64
import csv
import json
import math
import os
import re
import stat
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from common.errors import run_main
from common.report import Section, build_report, register_section, sections as report_sections
from common.report.core import out_of_range
from common.report.runs import DDP_MIN_EFFICIENCY, configurations_frame, runs_frame
from common.results import make_record, write_record
from helpers import fake_cpuinfo
from scripts import compare_results

REPO = Path(__file__).resolve().parent.parent
SCRIPT_TAG = "<script>alert(1)</script>"

GIB = 1024**3


def provenance(host: str = "node-a", device_type: str = "cuda", device_name: str = "NVIDIA RTX 4090",
               world_size: int = 1, **extra: Any) -> dict[str, Any]:
    return {"hostname": host, "world_size": world_size, "device": {"type": device_type, "name": device_name},
            "platform": "Linux", "cwd": "/work", "slurm": {"SLURM_JOB_ID": "4242"},
            "versions": {"python": "3.11.7", "torch": "2.5.1", "cuda": "12.4", "cudnn": 90100, "nccl": "2.21.5"},
            "git": {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False},
            "command": ["python", "labs/lab01_dp_vs_ddp/04_ddp_training.py", "--epochs", "1"], **extra}


def write_run(folder: Path, *, lab: str = "lab01", method: str = "baseline", model: str = "resnet18",
              samples_per_s: float | None = 100.0, world_size: int = 1, devices: int | None = None,
              host: str = "node-a", status: str = "ok", peak_gib: float = 3.0, first_gib: float | None = None,
              metrics: dict[str, Any] | None = None, notes: tuple[str, ...] = (),
              config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write one record and return it (``devices`` GPUs for DataParallel, else ``world_size``)."""
    devices = devices or world_size
    memory = [{"device": f"cuda:{i}", "peak_bytes": int((first_gib if first_gib and i == 0 else peak_gib) * GIB),
               "source": "cuda_max_memory_allocated"} for i in range(devices)]
    values: dict[str, Any] = {"world_size": world_size, "global_batch_size": 64 * devices, "memory": memory,
                              "time_per_epoch_s": 12.5, "final_loss": 1.25, "steps": 20}
    if samples_per_s is not None:
        values["samples_per_s"] = samples_per_s
    values.update(metrics or {})
    record = make_record(lab=lab, script=f"labs/{lab}/train.py", method=method,
                         config={"model": model, **(config or {})}, metrics=values,
                         provenance=provenance(host=host, world_size=world_size), status=status, notes=notes)
    write_record(record, folder)
    return record


class ReportPage(HTMLParser):
    """The parts of a report the tests check: each table's rows, each section's text, the images.

    A row is ``{"run_id": <data-run-id>, "cells": {header: text}}``.
    """

    def __init__(self, html: str) -> None:
        super().__init__()
        self.tables: dict[str, list[dict[str, Any]]] = {}
        self.sections: dict[str, str] = {}
        self.images: list[str] = []
        self.script_tags = 0
        self._table: str | None = None
        self._headers: list[str] = []
        self._row: dict[str, Any] | None = None
        self._texts: list[str] = []
        self._cell: list[str] | None = None
        self._section: str | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "script":
            self.script_tags += 1
        elif tag == "section":
            self._section = attributes.get("id")
            self.sections[self._section] = ""
        elif tag == "table":
            self._table = attributes.get("id") or f"table-{len(self.tables)}"
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self._row = {"run_id": attributes.get("data-run-id"), "header": False}
            self._texts = []
        elif tag in ("td", "th") and self._row is not None:
            self._row["header"] = tag == "th"
            self._cell = []
        elif tag == "img":
            self.images.append(attributes.get("src") or "")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self._texts.append("".join(self._cell))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            if self._row.pop("header"):
                self._headers = self._texts
            else:
                assert len(self._texts) == len(self._headers), "a row with a different number of cells"
                self._row["cells"] = dict(zip(self._headers, self._texts, strict=True))
                self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None
        elif tag == "section":
            self._section = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._section is not None:
            self.sections[self._section] += data


def read_page(path: Path) -> ReportPage:
    return ReportPage(Path(path).read_text(encoding="utf-8"))


def report(folder: Path, *extra: str) -> ReportPage:
    """Run the CLI's ``main`` in-process on ``folder`` and parse the report it wrote."""
    out = folder.parent / f"{folder.name}-report.html"
    assert compare_results.main(["--results-dir", str(folder), "--output-report", str(out), *extra]) == 0
    return read_page(out)


def lab01_folder(folder: Path) -> list[dict[str, Any]]:
    """Baseline, DP on 4 GPUs and DDP on 4 GPUs, the Lab-01 handout's three rows (its own throughput numbers)."""
    return [
        write_run(folder, method="baseline", samples_per_s=425.0, peak_gib=3.2),
        write_run(folder, method="dp", samples_per_s=1205.0, world_size=1, devices=4, peak_gib=4.1, first_gib=7.8,
                  notes=("outputs gathered on cuda:0",)),
        write_run(folder, method="ddp", samples_per_s=1598.0, world_size=4, peak_gib=3.4),
    ]


def test_report_and_csv_list_every_run_with_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "results"
    records = lab01_folder(folder)
    records.append(write_run(folder, lab="ch04", method="bf16", model="mnist_cnn", samples_per_s=5000.0,
                             metrics={"test_accuracy": 0.975, "test_loss": 0.08}))
    records.append(write_run(folder, lab="lab02", method="gpipe", model="gpt-mini", samples_per_s=None,
                             metrics={"bubble_fraction": 0.27, "micro_batches": 8}))
    out = tmp_path / "out" / "comparison_report.html"

    assert compare_results.main(["--results-dir", str(folder), "--output-report", str(out)]) == 0

    stdout = capsys.readouterr().out.strip().splitlines()
    assert stdout[-1] == f"report: {out}"
    page = read_page(out)
    expected_ids = {r["run_id"] for r in records}
    summary = page.tables["summary-table"]
    assert [row["run_id"] for row in summary].count(None) == 0
    assert {row["run_id"] for row in summary} == expected_ids and len(summary) == len(records)
    assert {row["run_id"] for row in page.tables["provenance-table"]} == expected_ids
    by_id = {row["run_id"]: row["cells"] for row in summary}
    dp, ddp = by_id[records[1]["run_id"]], by_id[records[2]["run_id"]]
    assert dp["peak memory per device"] == "7.8 / 4.1 / 4.1 / 4.1 GiB"  # DP: the first GPU is fuller
    assert (dp["devices"], dp["world size"], ddp["devices"], ddp["world size"]) == ("4", "1", "4", "4")
    assert dp["scaling efficiency"] == "71%" and ddp["scaling efficiency"] == "94%"  # the Lab-01 handout's table
    assert by_id[records[4]["run_id"]]["samples/s"] == "—"  # lab02 recorded no throughput: shown, not crashed
    assert f"Note from run {records[1]['run_id']} (lab01 dp): outputs gathered on cuda:0" in page.sections["summary"]
    assert "bubble_fraction" in page.sections["other-metrics"] and "0.27" in page.sections["other-metrics"]
    assert by_id[records[3]["run_id"]]["test accuracy"] == "97.5%"

    # A figure of each kind per lab, each on its own scale: throughput, memory per device and scaling
    # efficiency of lab01; throughput and memory of ch04 (one device: no efficiency); lab02's memory alone.
    plots = page.sections["plots"]
    assert len(page.images) == 6
    assert [plots.count(f"{lab}: throughput") for lab in ("lab01", "ch04", "lab02")] == [1, 1, 0]
    assert [plots.count(f"{lab}: peak memory") for lab in ("lab01", "ch04", "lab02")] == [1, 1, 1]
    assert "lab01: scaling efficiency" in plots and "ch04: scaling efficiency" not in plots
    assert "expected for DDP" not in plots  # a legend inside the PNG; the caption does not name it
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(b"\x89PNG\r\n\x1a\n")

    csv_path = out.with_suffix(".csv")
    with csv_path.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert {row["run_id"] for row in rows} == expected_ids and len(rows) == len(records)
    ddp = next(row for row in rows if row["method"] == "ddp")
    assert float(ddp["scaling_efficiency"]) == pytest.approx(1598 / (4 * 425))
    assert ddp["world_size"] == "4" and ddp["peak_memory_per_device"].count("cuda:") == 4
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_bad_files_are_named_in_warnings_and_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "results"
    good = write_run(folder)
    (folder / "truncated.json").write_text('{"schema": "hpc-dl-labs/result", "run', encoding="utf-8")
    (folder / "other_tool.json").write_text(json.dumps({"schema": "someone-else", "value": 1}), encoding="utf-8")
    newer = dict(good, schema_version=99, run_id="from-the-future")
    del newer["energy"]  # a newer schema's keys: what it lacks by this code's schema is not the reason it is skipped
    (folder / "sub").mkdir()
    (folder / "sub" / "newer.json").write_text(json.dumps(newer), encoding="utf-8")

    page = report(folder)

    stderr = capsys.readouterr().err
    warnings = page.sections["warnings"]
    for name, reason in [("truncated.json", "not valid JSON"), ("other_tool.json", "schema is 'someone-else'"),
                         ("sub/newer.json", "schema_version 99 is newer than this code reads (1, ")]:
        assert f"skipped {name}: " in warnings and reason in warnings
        assert f"warning: skipped {name}: " in stderr
    assert "energy" not in stderr  # one reason for the newer record, not a list of keys its schema may not have
    assert [row["run_id"] for row in page.tables["summary-table"]] == [good["run_id"]]


@pytest.mark.parametrize("make_folder", [lambda p: p / "does-not-exist", lambda p: p])
def test_missing_or_empty_folder_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   make_folder: Any) -> None:
    folder = make_folder(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_main(compare_results.main, ["--results-dir", str(folder)])
    assert exit_info.value.code != 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1 and captured.err.startswith("error: ")
    assert str(folder) in captured.err
    assert not list(tmp_path.rglob("*.html")) and not list(tmp_path.rglob("*.csv"))


def test_folder_of_only_bad_files_fails_after_naming_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "broken.json").write_text("{", encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        run_main(compare_results.main, ["--results-dir", str(tmp_path)])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("warning: skipped broken.json: not valid JSON")
    assert err[-1].startswith("error: none of the 1 file in") and len(err) == 2


def test_cli_as_a_script_exit_status_and_report_path(tmp_path: Path) -> None:
    missing = subprocess.run([sys.executable, str(REPO / "scripts" / "compare_results.py"),
                              "--results-dir", str(tmp_path / "nothing-here")],
                             capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"error: results folder not found: {tmp_path / 'nothing-here'} "
        f"(run a lab script with --results-dir {tmp_path / 'nothing-here'} first)"]

    folder = tmp_path / "results"
    lab01_folder(folder)
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "compare_results.py"), "--results-dir", "results",
                           "--no-plots"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "report: results/comparison_report.html"
    assert (folder / "comparison_report.html").is_file() and (folder / "comparison_report.csv").is_file()


def test_script_tags_in_names_are_escaped(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    record = write_run(folder, method=SCRIPT_TAG, model=SCRIPT_TAG, host=SCRIPT_TAG,
                       metrics={SCRIPT_TAG: 1.0}, status=SCRIPT_TAG)
    out = tmp_path / "report.html"
    compare_results.main(["--results-dir", str(folder), "--output-report", str(out), "--title", SCRIPT_TAG])

    html = out.read_text(encoding="utf-8")
    assert "<script" not in html.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    page = read_page(out)
    assert page.script_tags == 0
    row = page.tables["summary-table"][0]
    assert row["run_id"] == record["run_id"]
    assert row["cells"]["method"] == SCRIPT_TAG and row["cells"]["model"] == SCRIPT_TAG
    assert f"status is '{SCRIPT_TAG}'" in page.sections["warnings"]


@pytest.mark.parametrize("ddp_samples_per_s, expect_warning", [(200.0, True), (380.0, False)])
def test_ddp_efficiency_warning_fires_at_50_percent_not_95(tmp_path: Path, ddp_samples_per_s: float,
                                                           expect_warning: bool) -> None:
    folder = tmp_path / "results"
    write_run(folder, method="baseline", samples_per_s=100.0)
    ddp = write_run(folder, method="ddp", samples_per_s=ddp_samples_per_s, world_size=4)

    outcome = build_report(folder, tmp_path / "report.html", plots=False)

    runs = runs_frame([json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))])
    efficiency = runs.loc[runs["method"] == "ddp", "scaling_efficiency"].item()
    assert efficiency == pytest.approx(ddp_samples_per_s / 400)
    ddp_warnings = [w for w in outcome.warnings if ddp["run_id"] in w and "scaling efficiency" in w]
    assert bool(ddp_warnings) is expect_warning
    if expect_warning:
        assert f"50% on 4 devices is under the expected {DDP_MIN_EFFICIENCY:.0%}" in ddp_warnings[0]
    page = read_page(tmp_path / "report.html")
    assert (ddp["run_id"] in page.sections["warnings"]) is expect_warning


def test_cpu_ddp_efficiency_is_explained_not_warned(tmp_path: Path) -> None:
    """Two Gloo processes on a 2-core machine scale poorly; the report says why instead of flagging DDP."""
    folder = tmp_path / "results"
    cpu = {"device": {"type": "cpu", "name": "AMD EPYC", "threads": 1, "cpu_count": 2}}
    for method, rate, world in (("baseline", 1000.0, 1), ("ddp", 900.0, 2)):
        record = make_record(lab="lab01", script="labs/lab01/train.py", method=method, config={"model": "plain_cnn"},
                             metrics={"world_size": world, "samples_per_s": rate, "final_loss": 0.2,
                                      "memory": [{"device": "cpu", "peak_bytes": GIB, "source": "process_max_rss"}]},
                             provenance={**provenance(world_size=world), **cpu})
        write_record(record, folder)
    outcome = build_report(folder, tmp_path / "report.html", plots=False)
    assert not [w for w in outcome.warnings if "scaling efficiency" in w], outcome.warnings
    text = read_page(tmp_path / "report.html").sections["dataparallel-vs-ddp"]
    assert "a scaling efficiency of 45% is expected here" in text
    assert "its 2 processes (1 thread(s) each) shared this machine's 2 cores" in text


def test_dp_slower_than_baseline_and_a_failed_run_are_warned(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    write_run(folder, method="baseline", samples_per_s=100.0)
    dp = write_run(folder, method="dp", samples_per_s=90.0, devices=2)
    one_device_dp = write_run(folder, method="dp", samples_per_s=95.0)  # the CPU case: not expected faster
    failed = write_run(folder, method="ddp", samples_per_s=None, world_size=2, status="failed",
                       notes=("NCCL timeout after 600 s",))

    warnings = build_report(folder, tmp_path / "report.html", plots=False).warnings

    assert any(dp["run_id"] in w and "slower than the single-device baseline" in w for w in warnings)
    assert not any(one_device_dp["run_id"] in w for w in warnings)
    assert any(failed["run_id"] in w and "status is 'failed': NCCL timeout after 600 s" in w for w in warnings)
    assert len(warnings) == 2


def test_runs_from_two_machines_use_their_own_baseline(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    write_run(folder, host="fast-node", method="baseline", samples_per_s=1000.0)
    write_run(folder, host="fast-node", method="ddp", samples_per_s=1900.0, world_size=2)
    write_run(folder, host="fast-node", method="baseline", samples_per_s=10.0, status="failed")  # not a baseline
    write_run(folder, host="slow-laptop", method="baseline", samples_per_s=100.0)
    write_run(folder, host="slow-laptop", method="ddp", samples_per_s=190.0, world_size=2)
    write_run(folder, host="other-node", method="ddp", samples_per_s=190.0, world_size=2)  # no baseline there
    write_run(folder, host="tiny-node", method="baseline", samples_per_s=None)  # one that timed no step
    write_run(folder, host="tiny-node", method="ddp", samples_per_s=190.0, world_size=2)

    runs = runs_frame([json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))])

    ddp = runs[runs["method"] == "ddp"].set_index("hostname")
    assert ddp.loc["fast-node", "scaling_efficiency"] == pytest.approx(0.95)
    assert ddp.loc["slow-laptop", "scaling_efficiency"] == pytest.approx(0.95)
    assert math.isnan(ddp.loc["other-node", "scaling_efficiency"])
    page = report(folder, "--no-plots")
    no_baseline = "No usable 'baseline' run to compute an efficiency for: lab01, resnet18, cuda, other-node"
    untimed = "tiny-node · NVIDIA RTX 4090 (its baseline run measured no throughput: it failed, or timed no step past"
    assert no_baseline in page.sections["summary"] and untimed in page.sections["summary"]
    assert page.sections["summary"].count("its baseline run measured no throughput") == 1  # not other-node's
    assert "4 machines" in Path(tmp_path / "results-report.html").read_text(encoding="utf-8")


def test_devices_count_processes_or_devices_whichever_is_more(tmp_path: Path) -> None:
    cpu = provenance(host="laptop", device_type="cpu", device_name="x86_64")
    rss = [{"device": "cpu", "peak_bytes": 2 * GIB, "source": "process_max_rss"}]
    records = [
        make_record(lab="lab01", script="x", method="baseline", config={"model": "plain_cnn"}, provenance=cpu,
                    metrics={"samples_per_s": 100.0, "world_size": 1, "devices": 1, "memory": rss}),
        # two Gloo processes on one CPU: the record says one device, the job had two workers
        make_record(lab="lab01", script="x", method="ddp", config={"model": "plain_cnn"}, provenance=cpu,
                    metrics={"samples_per_s": 150.0, "world_size": 2, "devices": 1, "memory": rss}),
        # DataParallel over two GPUs, one process, written with `devices` but a single memory entry
        make_record(lab="lab01", script="x", method="dp", config={"model": "plain_cnn"}, provenance=cpu,
                    metrics={"samples_per_s": 120.0, "world_size": 1, "devices": 2, "memory": rss}),
    ]

    runs = runs_frame(records).set_index("method")

    assert runs["devices"].to_dict() == {"baseline": 1, "ddp": 2, "dp": 2}
    assert runs.loc["ddp", "scaling_efficiency"] == pytest.approx(0.75)
    assert runs.loc["dp", "scaling_efficiency"] == pytest.approx(0.6)
    assert runs.loc["ddp", "memory_source"] == "process peak RSS"


def test_a_record_with_almost_nothing_shows_dashes(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    record = make_record(lab="lab09", script="x.py", method="probe", config={}, metrics={"memory": "junk"},
                         provenance={"world_size": "two"})
    write_record(record, folder)

    page = report(folder)

    (row,) = page.tables["summary-table"]
    assert row["run_id"] == record["run_id"]
    cells = row["cells"]
    shown = (cells["lab"], cells["method"], cells["machine"], cells["devices"])
    assert shown == ("lab09", "probe", "unknown host", "1")
    # A column no run has a value in is not shown at all (a column of dashes teaches nothing).
    assert set(cells) == {"run", "lab", "method", "machine", "devices", "status"}
    assert page.images == []  # nothing to plot
    assert "No run recorded throughput or memory for these plots" in page.sections["plots"]


def test_repeats_are_combined_with_the_median(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    for rate in (90.0, 100.0, 130.0):
        write_run(folder, method="baseline", samples_per_s=rate)
    write_run(folder, method="ddp", samples_per_s=300.0, world_size=4)
    for peak in (1.0, 2.0, 3.0, 6.0):  # DataParallel on 2 GPUs, cuda:0 holding 4 GiB more: each GPU's median
        write_run(folder, method="dp", samples_per_s=250.0, devices=2, peak_gib=peak, first_gib=peak + 4)

    runs = runs_frame([json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))])
    configs = configurations_frame(runs).set_index("method")

    assert configs.loc["baseline", "runs"] == 3 and configs.loc["baseline", "samples_per_s"] == 100.0
    assert configs.loc["dp", "memory_per_device"] == [("cuda:0", 6.5 * GIB), ("cuda:1", 2.5 * GIB)]
    assert configs.loc["ddp", "scaling_efficiency"] == pytest.approx(0.75)  # against the median baseline
    ddp_id = runs.loc[runs["method"] == "ddp", "run_id"].item()
    assert [f.subject for f in out_of_range(runs)] == [f"run {ddp_id} (lab01 ddp)"]  # 75% < 80%
    page = report(folder, "--no-plots")
    assert len(page.tables["configurations-table"]) == 3


def test_a_dry_run_is_compared_only_with_dry_runs_and_other_epochs_or_step_caps_are_no_repeat(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    write_run(folder, method="baseline", samples_per_s=100.0, config={"epochs": 3})
    write_run(folder, method="baseline", samples_per_s=120.0, config={"epochs": 3})
    write_run(folder, method="baseline", samples_per_s=500.0, config={"epochs": 1})  # a longer epoch's warm-up share
    write_run(folder, method="baseline", samples_per_s=9.0, config={"epochs": 1, "max_steps": 2, "dry_run": True})
    write_run(folder, method="ddp", samples_per_s=2.0, world_size=2, config={"epochs": 1, "max_steps": 2,
                                                                             "dry_run": True})
    write_run(folder, method="ddp", samples_per_s=330.0, world_size=2, config={"epochs": 3})
    runs = runs_frame([json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))])
    ddp = runs[runs["method"] == "ddp"].set_index("dry_run")
    assert ddp.loc[False, "baseline_samples_per_s"] == 120.0  # the median of the three measured baselines, not 9
    assert ddp.loc[True, "baseline_samples_per_s"] == 9.0 and ddp.loc[True, "speedup"] == pytest.approx(2 / 9)
    configs = configurations_frame(runs)
    baselines = configs[configs["method"] == "baseline"].set_index(["dry_run", "epochs"])["runs"]
    assert baselines.to_dict() == {(False, 3.0): 2, (False, 1.0): 1, (True, 1.0): 1}
    dry_ids = sorted(runs.loc[runs["dry_run"], "run_id"])
    summary = " ".join(report(folder, "--no-plots").sections["summary"].split())
    listed = re.search(r"Dry runs \(--dry-run: [^)]*\), compared only with each other: run\(s\) ([^.]*)\.", summary)
    assert sorted(listed.group(1).split(", ")) == dry_ids


def test_runs_with_another_global_batch_are_another_configuration_not_a_repeat(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    for rate in (90.0, 110.0):
        write_run(folder, method="baseline", samples_per_s=rate)
    write_run(folder, method="baseline", samples_per_s=700.0, metrics={"global_batch_size": 1438})
    configs = configurations_frame(runs_frame([json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]))
    by_batch = configs.set_index("global_batch_size")
    assert sorted(by_batch.index) == [64, 1438]
    assert by_batch.loc[64, "runs"] == 2 and by_batch.loc[64, "samples_per_s"] == 100.0
    assert by_batch.loc[1438, "runs"] == 1 and by_batch.loc[1438, "samples_per_s"] == 700.0


def test_the_section_example_of_docs_architecture_md_builds_its_table(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The example a maintainer copies to add a lab's section runs as written and shows its table."""
    monkeypatch.setattr(report_sections, "_LAB_SECTIONS",
                        {lab: dict(builders) for lab, builders in report_sections._LAB_SECTIONS.items()})
    doc = (REPO / "docs" / "architecture.md").read_text()
    example = doc.split("A lab adds its section in one module", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(example, "docs/architecture.md", "exec"), {"__name__": "labNN_example"})
    folder = tmp_path / "results"
    write_run(folder, lab="labNN", method="shards", metrics={"data_wait_s": 2.5})  # 12.5 s an epoch
    write_run(folder, lab="labNN", method="other")

    page = report(folder, "--no-plots")

    (row,) = page.tables["labNN-loader"]
    assert row["cells"]["waiting for data"] == "20.0%" and row["cells"]["workers"] == "—"
    assert "What the table shows." in page.sections["lab-nn-what-the-loader-cost"]


def test_a_lab_registers_its_own_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A copy of every lab's builders, so the ones registered here are gone after the test.
    monkeypatch.setattr(report_sections, "_LAB_SECTIONS",
                        {lab: dict(builders) for lab, builders in report_sections._LAB_SECTIONS.items()})
    seen: list[int] = []

    @register_section("lab03")
    def precision(ctx: report_sections.SectionContext) -> Section:
        seen.append(len(ctx.runs))
        return Section("Mixed precision", paragraphs=[f"{len(ctx.runs)} precision runs of {len(ctx.all_runs)}"])

    @register_section("lab03")
    def broken(ctx: report_sections.SectionContext) -> Section:
        raise KeyError("speedup_vs_fp32")

    @register_section("lab07")
    def absent(ctx: report_sections.SectionContext) -> Section:
        raise AssertionError("lab07 has no runs, so its section must not be built")

    folder = tmp_path / "results"
    write_run(folder, lab="lab03", method="fp32")
    write_run(folder, lab="lab03", method="amp-bf16")
    write_run(folder)

    page = report(folder, "--no-plots")

    assert seen == [2]
    assert page.sections["mixed-precision"].split() == "Mixed precision 2 precision runs of 3".split()
    assert "section broken of lab03: could not be built: KeyError" in page.sections["warnings"]


def test_a_lab_section_module_that_does_not_import_is_a_warning(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "lab98.py").write_text("import a_module_that_is_not_installed\n", encoding="utf-8")
    from common.report import labs

    monkeypatch.setattr(labs, "__path__", [*labs.__path__, str(plugins)])
    monkeypatch.delitem(sys.modules, "common.report.labs.lab98", raising=False)
    folder = tmp_path / "results"
    write_run(folder)

    page = report(folder, "--no-plots")

    assert len(page.tables["summary-table"]) == 1
    assert ("section module common.report.labs.lab98: could not be imported: ModuleNotFoundError"
            in page.sections["warnings"])


def test_lab01_section_shows_dataparallel_memory_imbalance(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    lab01_folder(folder)

    page = report(folder, "--no-plots")

    assert "dataparallel-vs-ddp" in page.sections
    balance = next(rows for rows in page.tables.values() if rows and "first ÷ others" in rows[0]["cells"])
    ratio = {row["cells"]["method"]: row["cells"]["first ÷ others"] for row in balance}
    assert ratio == {"dp": "1.90×", "ddp": "1.00×"}


def test_dollar_signs_in_names_do_not_break_the_plots(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    write_run(folder, method="baseline")
    write_run(folder, method=r"cost $\notacommand{x}$ run", devices=2)  # a mathtext error unescaped
    write_run(folder, method=r"ddp $\frac{", world_size=2, samples_per_s=150.0)

    page = report(folder)

    assert len(page.images) == 3


def test_a_hundred_records_from_the_benchmark_all_listed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import report_1000_records

    assert report_1000_records.main(["--records", "100", "--no-plots", "--keep", str(tmp_path)]) == 0

    assert "report over 100 records (without plots" in capsys.readouterr().out
    run_ids = {json.loads(p.read_text())["run_id"] for p in (tmp_path / "records").glob("*.json")}
    page = read_page(tmp_path / "report.html")
    assert len(run_ids) == 100 and {row["run_id"] for row in page.tables["summary-table"]} == run_ids
    with (tmp_path / "report.csv").open(newline="", encoding="utf-8") as handle:
        assert {row["run_id"] for row in csv.DictReader(handle)} == run_ids
    assert "3 machines" in (tmp_path / "report.html").read_text(encoding="utf-8")


def test_outputs_replace_the_old_file_whole_and_are_readable_by_others(tmp_path: Path) -> None:
    from common.atomic import write_text_atomic

    target = tmp_path / "comparison_report.html"
    target.write_text("the previous report", encoding="utf-8")
    old_umask = os.umask(0o022)
    try:
        write_text_atomic("the new report", target)
    finally:
        os.umask(old_umask)

    assert target.read_text(encoding="utf-8") == "the new report"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644  # not mkstemp's 0600: reports are shared
    assert list(tmp_path.iterdir()) == [target]


def test_cpus_with_and_without_bf16_are_different_machines_and_emulated_bf16_is_warned(tmp_path: Path) -> None:
    """Two VMs both called "AMD EPYC", one with avx512_bf16: their bf16 timings differ tenfold, so the
    report labels them apart, warns that it mixes machines, and warns about the emulated bf16 run."""
    from common.runtime.machine import cpu_description

    folder = tmp_path / "results"
    made = {}
    for name, flags in (("emulated", "avx2"), ("native", "avx2 avx512f avx512_bf16")):
        machine = {"cpu": cpu_description(fake_cpuinfo("AMD EPYC", flags)), "gpus": []}
        prov = provenance(host="vm", device_type="cpu", device_name="AMD EPYC", machine=machine)
        made[name] = make_record(lab="lab02", script="x.py", method="amp",
                                 config={"model": "mnist_cnn", "precision": "bf16"},
                                 metrics={"samples_per_s": 4.1 if name == "emulated" else 77.2}, provenance=prov)
        write_record(made[name], folder)

    outcome = build_report(folder, tmp_path / "report.html", plots=False)

    page = read_page(tmp_path / "report.html")
    machines = {row["run_id"]: row["cells"]["machine"] for row in page.tables["summary-table"]}
    assert machines == {made["emulated"]["run_id"]: "vm · AMD EPYC · 2 CPUs · bf16 emulated",
                        made["native"]["run_id"]: "vm · AMD EPYC · 2 CPUs · bf16 native"}
    warnings = page.sections["warnings"]
    assert "2 machines: this report mixes records of different machines" in warnings
    emulated = [w for w in outcome.warnings if "bf16 is emulated on this CPU (AMD EPYC: no avx512_bf16 or AMX)" in w]
    assert len(emulated) == 1 and made["emulated"]["run_id"] in emulated[0]
    detail = {row["run_id"]: row["cells"]["what the machine could do"] for row in page.tables["provenance-table"]}
    assert "avx2 avx512f avx512_bf16): bf16 native" in detail[made["native"]["run_id"]]


def test_summary_shows_only_filled_columns_and_tflops_where_recorded(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    sentence = "median of 5 repeats after 2 warm-up steps, the device synchronised before each clock read"
    measured = write_run(folder, lab="lab03", method="train-amp-bf16",
                         metrics={"achieved_tflops": 123.4, "mfu": 0.1247, "timing_method": sentence})
    page = report(folder, "--no-plots")
    html = (tmp_path / "results-report.html").read_text(encoding="utf-8")

    (row,) = page.tables["summary-table"]
    assert (row["cells"]["TFLOP/s"], row["cells"]["% of peak"]) == ("123", "12.5%")
    assert "speed-up vs baseline" not in row["cells"] and "scaling efficiency" not in row["cells"]
    assert "DDP is expected" not in page.sections["summary"] and "% of peak divides it" in page.sections["summary"]
    (other,) = [rows for rows in page.tables.values() if rows and "timing_method" in rows[0]["cells"]]
    shown = other[0]["cells"]["timing_method"]
    assert len(shown) <= 40 and shown.endswith("…") and sentence.startswith(shown[:-1])
    assert f'title="{sentence}"' in html  # the whole text on hover
    assert {"PyTorch built with CUDA", "PyTorch built with cuDNN"} <= set(page.tables["provenance-table"][0]["cells"])
    assert measured["run_id"] in html

    lab01 = tmp_path / "lab01"
    lab01_folder(lab01)
    page = report(lab01, "--no-plots")
    assert {"speed-up vs baseline", "scaling efficiency"} <= set(page.tables["summary-table"][0]["cells"])
    assert "TFLOP/s" not in page.tables["summary-table"][0]["cells"]
    assert "DDP is expected to reach 80%" in page.sections["summary"]


def _scaling_point(folder: Path, mode: str, processes: int, rate: float, training_run_id: str,
                   accuracies: list[float]) -> dict[str, Any]:
    evaluations = [{"epoch": i + 1, "elapsed_s": 2.0 * (i + 1) / processes, "accuracy": a}
                   for i, a in enumerate(accuracies)]
    record = make_record(
        lab="lab05", script="labs/lab05_scaling/02_scaling_study.py", method=f"{mode}-scaling",
        config={"model": "plain_cnn", "dataset": "digits", "mode": mode, "batch_size": 32,
                "strong_global_batch_size": 32},
        metrics={"world_size": processes, "nodes": 1, "samples_per_s": rate, "global_batch_size": 32,
                 "evaluations": evaluations, "target_accuracy": 0.9, "time_to_target_s": None,
                 "training_run_id": training_run_id,
                 "memory": [{"device": "cpu", "peak_bytes": GIB, "source": "process_max_rss"}]},
        provenance=provenance(host="vm", device_type="cpu", device_name="AMD EPYC", world_size=processes))
    write_record(record, folder)
    return record


def test_lab05_report_draws_each_training_run_once_in_its_own_colour(tmp_path: Path) -> None:
    """The one-process run is the point of both curves: one line, labelled with both modes; every
    line has a colour of its own (tab10's first three, read back from the PNG on the page); the summary
    carries no empty baseline columns."""
    import io

    import numpy as np
    from matplotlib.image import imread

    folder = tmp_path / "results"
    _scaling_point(folder, "strong", 1, 3500.0, "one", [0.8, 0.93])
    _scaling_point(folder, "weak", 1, 3500.0, "one", [0.8, 0.93])
    _scaling_point(folder, "strong", 2, 3000.0, "strong-two", [0.75, 0.9])
    _scaling_point(folder, "weak", 2, 4600.0, "weak-two", [0.7, 0.91])

    page = report(folder)

    html = (tmp_path / "results-report.html").read_text(encoding="utf-8")
    (src, alt), = re.findall(r'<img src="([^"]+)" alt="(Validation accuracy against time[^"]*)"', html)
    assert alt.endswith(": strong and weak, 1 process; strong, 2 processes; weak, 2 processes")
    pixels = (imread(io.BytesIO(base64.b64decode(src.split(",", 1)[1])), format="png")[..., :3] * 255).round()
    for red, green, blue in ((31, 119, 180), (255, 127, 14), (44, 160, 44)):  # tab:blue, tab:orange, tab:green
        assert (np.abs(pixels - (red, green, blue)).max(axis=-1) < 8).sum() > 20
    columns = set(page.tables["summary-table"][0]["cells"])
    assert not columns & {"speed-up vs baseline", "scaling efficiency"}
    assert "DDP is expected" not in page.sections["summary"]


def test_records_with_junk_in_any_value_still_get_their_row_and_their_lab_sections(tmp_path: Path) -> None:
    """Every committed reference record, with one value in five of its metrics and config replaced by junk (text,
    null, a list, an object, a bool, NaN): the report is still written, every run has its row, and the sections of
    Labs 01-07 are built (a section that raised would be a warning naming it)."""
    import random

    from common.results import load_records

    junk = ["x", None, [], {}, -1, True, [1, "a", None], {"a": 1}, float("nan")]
    rng = random.Random(7)

    def spoil(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: rng.choice(junk) if rng.random() < 0.2 else spoil(v) for k, v in value.items()}
        if isinstance(value, list):
            return [rng.choice(junk) if rng.random() < 0.2 else spoil(v) for v in value]
        return value

    folder = tmp_path / "results"
    folder.mkdir()
    records = load_records(REPO / "reference-results").records
    for index, record in enumerate(records):
        spoiled = {key: value for key, value in record.items() if key != "_path"}
        spoiled.update(metrics=spoil(record["metrics"]), config=spoil(record["config"]))
        (folder / f"{index}.json").write_text(json.dumps(spoiled), encoding="utf-8")

    outcome = build_report(folder, tmp_path / "report.html", plots=False)

    page = read_page(tmp_path / "report.html")
    assert outcome.skipped == [] and len(page.tables["summary-table"]) == len(records)
    assert {row["run_id"] for row in page.tables["summary-table"]} == {r["run_id"] for r in records}
    failed = [w for w in outcome.warnings if "could not be built" in w]
    assert not [w for w in failed if any(f" of lab0{n}:" in w for n in range(1, 8))], failed
    assert {"dataparallel-vs-ddp", "lab-02-the-optimisation-path", "lab-03-precision-benchmark"} <= set(page.sections)


def test_every_run_keeps_its_row_past_pandas_styler_limit(tmp_path: Path) -> None:
    """pandas' Styler trims a table past ``styler.render.max_elements`` cells (262,144 by default, a summary of
    about 13,000 runs); the report lifts the limit for its own tables. Here the limit is 40 cells."""
    import pandas as pd

    folder = tmp_path / "results"
    records = lab01_folder(folder)
    with pd.option_context("styler.render.max_elements", 40):
        page = report(folder, "--no-plots")
    assert len(page.tables["summary-table"]) * len(page.tables["summary-table"][0]["cells"]) > 40
    assert {row["run_id"] for row in page.tables["summary-table"]} == {r["run_id"] for r in records}
    assert {row["run_id"] for row in page.tables["provenance-table"]} == {r["run_id"] for r in records}


def test_a_summary_of_runs_from_two_pytorch_releases_says_so(tmp_path: Path) -> None:
    from common.report.core import summary_section

    records = [write_run(tmp_path, method=method) for method in ("baseline", "dp", "ddp")]
    assert not [n for n in summary_section(runs_frame(records)).notes if "PyTorch releases" in n]
    records[2]["provenance"]["versions"]["torch"] = "2.8.0+cu128"  # one run on the course's floor
    (note,) = [n for n in summary_section(runs_frame(records)).notes if "PyTorch releases" in n]
    assert "2 PyTorch releases (2.5.1: 2 runs, 2.8.0+cu128: 1 run)" in note
    # A record that names no release (Lab-06's diagnosis and preflight) is no second release.
    records[2]["provenance"]["versions"].pop("torch")
    assert not [n for n in summary_section(runs_frame(records)).notes if "PyTorch releases" in n]


def test_a_record_without_a_device_does_not_make_the_report_mix_machines(tmp_path: Path) -> None:
    """Lab-09's sweep record is written on the login node with no device (its numbers are the tasks' and Slurm's):
    beside the tasks' records from a compute node it is no second machine; a second device's record is."""
    folder = tmp_path / "results"
    write_run(folder, lab="lab09", method="custom", host="gpu-node-1")
    sweep = provenance(host="login1")
    del sweep["device"]
    write_record(make_record(lab="lab09", script="labs/lab09_many_jobs/02_status.py", method="sweep-array",
                             config={"tasks": 1}, metrics={"core_hours": 0.5}, provenance=sweep), folder)
    page = report(folder, "--no-plots")
    assert len(page.tables["summary-table"]) == 2
    assert "mixes records of different machines" not in page.sections["warnings"]
    header = (folder.parent / "results-report.html").read_text(encoding="utf-8")
    assert ": 2 runs from 1 lab on 1 machine · " in header  # the page's count is the warning's
    write_run(folder, lab="lab09", method="custom", host="gpu-node-2")
    assert "2 machines: this report mixes records" in report(folder, "--no-plots").sections["warnings"]
    assert ": 3 runs from 1 lab on 2 machines · " in (folder.parent / "results-report.html").read_text(encoding="utf-8")


def test_text_where_the_summary_reads_a_number_is_warned_with_its_key(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    run = write_run(folder, metrics={"samples_per_s": "fast", "final_loss": [1.0]})
    warnings = report(folder, "--no-plots").sections["warnings"]
    assert f"run {run['run_id']} (lab01 baseline): metrics.samples_per_s is 'fast', not a number" in warnings
    assert "metrics.final_loss is [1.0], not a number: the tables show —" in warnings
    assert "No warnings" not in warnings


def test_a_read_only_results_folder_is_said_before_the_report_is_built(tmp_path: Path, monkeypatch, capsys) -> None:
    """A folder of someone else's records (a course's shared results) takes no report beside them."""
    folder = tmp_path / "results"
    write_run(folder)
    writable = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == folder else writable(path, mode))
    with pytest.raises(SystemExit) as stopped:
        run_main(compare_results.main, ["--results-dir", str(folder), "--no-plots"])
    assert stopped.value.code == 2 and capsys.readouterr().err == (
        f"error: cannot write into {folder} (read-only here): give --output-report and --csv elsewhere\n")
    assert sorted(p.suffix for p in folder.iterdir()) == [".json"]


def test_a_bare_report_name_is_checked_where_it_goes_not_where_the_command_is_typed(tmp_path: Path, monkeypatch,
                                                                                      capsys) -> None:
    """--output-report r.html goes into RESULTS_DIR: a folder r.html where the command was typed refused it."""
    folder = tmp_path / "results"
    write_run(folder)
    typed_in = tmp_path / "elsewhere"
    (typed_in / "r.html").mkdir(parents=True)
    monkeypatch.chdir(typed_in)
    with pytest.raises(SystemExit) as stopped:
        run_main(compare_results.main, ["--results-dir", str(folder), "--no-plots", "--output-report", "r.html"])
    assert stopped.value.code == 0 and (folder / "r.html").is_file() and (folder / "r.csv").is_file()
    (folder / "q.html").mkdir()  # where it goes, a folder in its place is one line
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        run_main(compare_results.main, ["--results-dir", str(folder), "--no-plots", "--output-report", "q.html"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and str(folder / "q.html") in err, err


def test_energy_without_any_measurement_is_one_paragraph_not_a_table_of_dashes(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    write_run(folder)
    page = report(folder, "--no-plots")
    assert page.sections["energy"].split()[:8] == ["Energy", "0", "of", "1", "run(s)", "measured", "their", "energy:"]
    assert "Why energy was unavailable: this script does not measure energy" in page.sections["energy"]
    assert "energy-table" not in page.tables and "Hover" not in page.sections["energy"]
    write_record(make_record(lab="lab01", script="labs/lab01/train.py", method="ddp", config={}, metrics={},
                             energy={"status": "ok", "joules": 120.0, "joules_per_sample": 0.5, "watts": 60.0,
                                     "source": "nvml"}, provenance=provenance()), folder)
    page = report(folder, "--no-plots")
    assert [row["cells"]["energy"] for row in page.tables["energy-table"]].count("ok") == 1


def test_a_failed_run_gets_no_speed_up_or_efficiency(tmp_path: Path) -> None:
    """A DDP run that failed after timing some steps showed 3.64x and 182% in the summary, beside 'failed'."""
    records = [write_run(tmp_path, method="baseline", samples_per_s=100.0),
               write_run(tmp_path, method="ddp", world_size=2, samples_per_s=364.0, status="failed"),
               write_run(tmp_path, method="ddp", world_size=2, samples_per_s=190.0)]
    runs = runs_frame(records).set_index("run_id")
    failed, ok = records[1]["run_id"], records[2]["run_id"]
    assert math.isnan(runs.loc[failed, "speedup"]) and math.isnan(runs.loc[failed, "scaling_efficiency"])
    assert runs.loc[ok, "speedup"] == pytest.approx(1.9) and runs.loc[ok, "scaling_efficiency"] == pytest.approx(0.95)


def test_large_numbers_are_written_out_not_in_e_notation(tmp_path: Path) -> None:
    """Lab-04's H100 row showed 22,107 tokens/s as '2.21e+04' and Chapter 4's 26,960 samples/s under 'Other metrics'
    as '2.696e+04': a "g" format switches to e-notation past its digits. Large numbers are whole, with separators."""
    assert report_sections.fmt(26960.4, "num") == "26,960" and report_sections.fmt(22107.3, "{:.3g}") == "22,107"
    assert report_sections.fmt(1.5e-5, "{:.2g}") == "1.5e-05" and report_sections.fmt(0.3185, "num") == "0.3185"
    assert report_sections.fmt("1e+04 steps", "num") == "1e+04 steps"  # text where a number belongs stays text
    write_run(tmp_path, lab="ch04", method="fp32", metrics={"step_time": {"samples_per_s": 26960.4}})
    page = report(tmp_path)
    assert "e+0" not in page.sections["other-metrics"] and "26,960" in page.sections["other-metrics"]


def test_a_json_report_or_csv_name_is_refused_before_it_replaces_a_record(tmp_path: Path, capsys) -> None:
    """``--csv lab01_dp_....json`` (a record's name, tab-completed) overwrote that record with the CSV: the next report
    skipped it as 'not valid JSON'. A .json output name is one error line, exit status 2, and every file untouched."""
    record = write_run(tmp_path)
    path = next(tmp_path.glob(f"*{record['run_id']}.json"))
    before = path.read_bytes()
    for flag in ("--csv", "--output-report"):
        with pytest.raises(SystemExit) as stopped:
            run_main(compare_results.main, ["--results-dir", str(tmp_path), "--no-plots", flag, path.name])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.count("\n") == 1 and path.name in err, err
        assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]


def test_each_bar_of_a_plot_names_its_configuration_the_global_batch_included(tmp_path: Path) -> None:
    """Lab-07's pipeline runs at global batch 4, 8, 16 and 32 were four bars labelled alike ('pp-gpipe · 2 dev ·
    transformer-2x512 · vm ...'): a bar per configuration must say which, and the batch is part of one."""
    from common.report import plots
    records = [write_run(tmp_path, lab="lab07", method="pp-gpipe", world_size=2, metrics={"global_batch_size": batch})
               for batch in (4, 8)]
    configs = configurations_frame(runs_frame(records))
    ax = plots._configuration_axes(configs)[3]
    labels = sorted(label.get_text() for label in ax.get_yticklabels())
    assert len(labels) == 2 and "· batch 4 ·" in labels[0] and "· batch 8 ·" in labels[1], labels
