"""Open a generated report in headless Chromium and check what a reader would see.

The report itself has no scripts (and a Content-Security-Policy that forbids them), so the test
opens a COPY with two scripts added: one in <head> that counts calls to ``alert`` before the page
body is parsed, and one at the end that waits for the ``load`` event, inspects the page and writes
its findings as JSON into the DOM. Chromium's ``--dump-dom`` prints that DOM, and Python reads the
findings back: no DevTools protocol, no websocket library, nothing from the network.

The copy also drops the CSP, so the no-script checks test the escaping itself, not the policy.
Without Chromium the test is skipped with the reason, unless HPC_DL_LABS_REQUIRE_BROWSER=1 (CI).
"""

from __future__ import annotations

import html
import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bench.report_1000_records import synthetic_record
from common.report import build_report
from common.results import make_record, write_record

pytestmark = pytest.mark.browser

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
ALERT_NAME = "<script>alert(1)</script>"
TITLE_NAME = "<script>document.title='pwned'</script>"
LONG_TEXT = ("median of 5 repeats after 2 warm-up steps, the device synchronised before each read of the clock; "
             "the spread is the range over the repeats, and the first epoch is dropped as warm-up")

HEAD_HOOK = "<script>window.__alerts = 0; window.alert = function () { window.__alerts += 1; };</script>"
CHECKER = """<script>
window.addEventListener("load", function () {
  var images = Array.prototype.map.call(document.images, function (img) {
    return {ok: img.complete && img.naturalWidth > 0 && img.naturalHeight > 0 && img.getBoundingClientRect().width > 0,
            alt: img.alt, width: img.naturalWidth, height: img.naturalHeight};
  });
  var rows = document.querySelectorAll("#summary-table tbody tr");
  var result = {
    title: document.title,
    alerts: window.__alerts,
    scripts: document.scripts.length,
    images: images,
    row_ids: Array.prototype.map.call(rows, function (tr) { return tr.getAttribute("data-run-id"); }),
    method_cells: Array.prototype.map.call(rows, function (tr) { return tr.cells[2].textContent; }),
    other_metrics_row_px: Math.max.apply(null, Array.prototype.map.call(
      document.querySelectorAll("#other-metrics tbody tr"),
      function (tr) { return tr.getBoundingClientRect().height; })),
    alert_name_as_text: document.body.textContent.indexOf(%(alert)s) >= 0,
    title_name_as_text: document.body.textContent.indexOf(%(title)s) >= 0
  };
  var out = document.createElement("pre");
  out.id = "report-check";
  out.textContent = JSON.stringify(result);
  document.body.appendChild(out);
});
</script>""" % {"alert": json.dumps(ALERT_NAME).replace("</", "<\\/"),  # "</script>" in a string ends the script
       "title": json.dumps(TITLE_NAME).replace("</", "<\\/")}


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def require_browser() -> str:
    """The browser's path; skip with the reason when there is none, or fail where CI demands one."""
    path = find_browser()
    if path is None:
        reason = "headless Chromium not found (Debian: apt-get install chromium)"
        if os.environ.get("HPC_DL_LABS_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{reason}, and HPC_DL_LABS_REQUIRE_BROWSER=1 says this run must test the browser")
        pytest.skip(reason)
    return path


def instrumented_copy(report: Path, copy: Path) -> None:
    page = report.read_text(encoding="utf-8")
    page, policies = re.subn(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", page)
    assert policies == 1, "the report should carry a Content-Security-Policy"
    assert page.count("</head>") == 1 and page.count("</body>") == 1
    page = page.replace("</head>", HEAD_HOOK + "</head>").replace("</body>", CHECKER + "</body>")
    copy.write_text(page, encoding="utf-8")


def dump_dom(browser: str, page: Path, profile: Path) -> str:
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run", "--disable-sync", f"--user-data-dir={profile}",
               "--run-all-compositor-stages-before-draw", "--virtual-time-budget=10000", "--dump-dom",
               page.as_uri()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"chromium failed ({done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


def test_report_renders_in_chromium(tmp_path: Path) -> None:
    chromium = require_browser()
    folder = tmp_path / "results"
    rng = random.Random(3)
    records = [synthetic_record(rng) for _ in range(24)]
    provenance = {"hostname": "laptop", "world_size": 1, "device": {"type": "cpu", "name": "x86_64"}}
    records.append(make_record(lab="lab01", script="x.py", method=ALERT_NAME, config={"model": TITLE_NAME},
                               metrics={"samples_per_s": 10.0, "timing_method": LONG_TEXT}, provenance=provenance))
    for record in records:
        write_record(record, folder)
    outcome = build_report(folder, tmp_path / "report.html")
    copy = tmp_path / "report-checked.html"
    instrumented_copy(outcome.report_path, copy)

    dom = dump_dom(chromium, copy, tmp_path / "profile")

    found = re.search(r'<pre id="report-check">(.*?)</pre>', dom, re.S)
    assert found, "the check script did not run: the page never finished loading"
    result = json.loads(html.unescape(found.group(1)))
    assert result["title"] == "Results comparison: results"
    assert result["alerts"] == 0 and result["scripts"] == 2  # only the two the test added
    drawn = outcome.report_path.read_text(encoding="utf-8").count("<img ")  # a figure of each kind per lab
    assert len(result["images"]) == drawn >= 3
    assert all(image["ok"] for image in result["images"]), result["images"]
    assert sorted(result["row_ids"]) == sorted(r["run_id"] for r in records)
    assert ALERT_NAME in result["method_cells"]
    assert result["alert_name_as_text"] and result["title_name_as_text"]
    # A sentence in "Other metrics" is cut short (the whole on hover), not wrapped into a row 285 px tall;
    # a row is at most two lines (the method name above wraps once).
    assert 0 < result["other_metrics_row_px"] < 60, result["other_metrics_row_px"]
