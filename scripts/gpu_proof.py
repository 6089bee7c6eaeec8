#!/usr/bin/env python3
"""The GPU proof: run the checks of ``scripts/gpu_proof_checks.py`` by tier within a time budget.

Start it with ``bash scripts/gpu_proof.sh`` (which installs the wheels of ``.whl/`` first); see its
``--help``. Each check runs its commands in ``OUT/<check>/``; after every check ``OUT/summary.json``
and ``OUT/summary.md`` are written again (name, tier, seconds, status ok/failed/skipped/not-run, a
one-line reason, what the judge measured, the records), so a lease that ends mid-run loses nothing
that finished. A command is never started past the budget: one that would run past it is cut there,
and its check is ``not-run`` (cut at the budget), like the checks after it. Exit status 0 when every
check ran and is ok (or skipped, with its reason), 1 when one failed, 3 when none failed but the budget ran out
before one or more (``--only pending`` runs them), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from common.cli import input_dir, one_line_errors, output_dir, positive_float, positive_int

try:
    from scripts import gpu_proof_checks as proof
except ImportError:  # run as a file without the repository on the path: the module beside it
    import gpu_proof_checks as proof  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent
#: Seconds kept back at the end of the budget for the summary and the bundle.
RESERVE_S = 5.0
#: A check is not started with less than this left: it could not finish anything.
MIN_START_S = 10.0
#: Files of OUT that go into the bundle's archive (results, logs, tables; no checkpoints, data, traces).
BUNDLE_SUFFIXES = {".json", ".txt", ".csv", ".md", ".html", ".xml", ".log"}
BUNDLE_MAX_FILE = 2 * 2**20
#: The archive's limit: a lease brings back files of at most 16 MiB (a larger one does not come back at all).
BUNDLE_MAX_ARCHIVE = 15 * 2**20
BUNDLE_SKIP_DIRS = {"ckpt", "checkpoints", "data", "csv", "run", "run-ok", "run-nan"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bash scripts/gpu_proof.sh",
        description="Prove the course on a GPU: the checks of scripts/gpu_proof_checks.py by tier, within a budget.")
    parser.add_argument("--budget", type=positive_float, default=420.0,
                        help="seconds for the whole run, from the start of gpu_proof.sh (default: %(default)s)")
    parser.add_argument("--tier", choices=("1", "2", "all"), default="all",
                        help="which checks: tier 1 (what a student meets first, and the speed targets), tier 2 "
                             "(every other GPU path), or all, tier 1 first (default: %(default)s)")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                        help="check names, separated by spaces or commas; 'failed': those of the last summary that "
                             "did not pass (failed, not run, or new); 'pending': those not run yet. The last summary "
                             "is OUT/summary.json, else the newest committed "
                             "reference-results/*/gpu-proof/summary.json ('pending' only where that one ran this "
                             "tree's commit)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the rehearsal, the same checks' CPU paths with tiny settings (default: %(default)s)")
    parser.add_argument("--out", type=output_dir, default=Path("results/gpu_proof"),
                        help="where each check's folder and the summary go (default: %(default)s)")
    parser.add_argument("--bundle", type=output_dir, default=None,
                        help="also copy summary.json, summary.md, proof.log and proof.tar.gz (records and logs) "
                             "here after every check: few files, as a lease's $OUT takes them (default: none)")
    parser.add_argument("--jobs", type=positive_int, default=None,
                        help="checks that measure nothing run this many at a time; a speed check always runs "
                             "alone (default: 4 on a GPU machine with 8 or more cores, else 1; on the CPU 2, one a "
                             "core)")
    parser.add_argument("--examples", type=input_dir, default=Path(".examples"),
                        help="a checkout of pytorch/examples, for the Chapter 4 comparison (default: %(default)s)")
    parser.add_argument("--list", action="store_true", help="print the checks with their tiers and exit")
    return one_line_errors(parser)


class Proof:
    """One run of the proof: the checks chosen, their results, the summary written after each."""

    def __init__(self, args: argparse.Namespace, probe: dict[str, Any], started: float) -> None:
        self.args, self.probe, self.started = args, probe, started
        self.deadline = started + args.budget - RESERVE_S
        self.out: Path = args.out
        self.lock = threading.Lock()  # the results and the log
        self.writing = threading.Lock()  # the summary and the bundle: one writer at a time
        self.results: dict[str, dict[str, Any]] = {}
        self.log_path = self.out / "proof.log"

    # ------------------------------------------------------------------ output
    def say(self, line: str) -> None:
        with self.lock:
            print(line, flush=True)
            with open(self.log_path, "a", encoding="utf-8") as log:
                log.write(line + "\n")

    def left(self) -> float:
        return self.deadline - time.time()

    def record(self, name: str, status: str, seconds: float, reason: str = "", findings: dict | None = None,
               records: list[str] | None = None) -> None:
        check = proof.BY_NAME[name]
        with self.lock:
            self.results[name] = {"name": name, "tier": check.tier, "status": status, "seconds": round(seconds, 1),
                                  "reason": reason, "findings": findings or {}, "records": records or [],
                                  "what": check.what}
        detail = f": {reason}" if reason else ""
        self.say(f"[proof] {name} (tier {check.tier}) {status} in {seconds:.0f} s{detail}")
        self.write_summary()

    # ------------------------------------------------------------------ one check
    def run_check(self, check: proof.Check, pooled: bool) -> None:
        began = time.time()
        folder = self.out / check.name
        if folder.exists():
            import shutil

            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        ctx = proof.Ctx(device=self.args.device, gpus=self.probe["gpus"], python=sys.executable, folder=folder,
                        examples=self.args.examples.resolve())
        try:
            steps = check.steps(ctx)
        except Exception as error:  # noqa: BLE001 - a check that cannot even say its commands
            self.record(check.name, "failed", 0.0, f"its commands could not be made: {error}")
            return
        threads = max(1, (os.cpu_count() or 1) // self.jobs) if pooled else None
        cut = None
        for index, step in enumerate(steps, start=1):
            left = self.left()
            if left < 1:
                cut = index
                break
            status, seconds, hit_budget = self.run_step(step, folder, min(step.timeout_s, left), threads,
                                                        budget_cut=left < step.timeout_s)
            if hit_budget:
                cut = index
                break
            if status != step.expect:
                break
        seconds = time.time() - began
        if cut is not None:
            self.record(check.name, "not-run", seconds, f"cut at the budget in command {cut} of {len(steps)}")
            return
        ranks = check.ranks(ctx) if check.ranks else ctx.ranks
        problems, findings = proof.judge(check.name, folder, ranks, self.args.device)
        records = sorted(str(p.relative_to(self.out)) for p in folder.rglob("*.json")
                         if p.name not in ("probe.json", "gpu_check.json") and "ckpt" not in p.parts
                         and _is_record(p))
        self.record(check.name, "failed" if problems else "ok", seconds, "; ".join(problems), findings, records)

    def run_step(self, step: proof.Step, folder: Path, timeout: float, threads: int | None,
                 budget_cut: bool) -> tuple[int, float, bool]:
        env = {"PYTHONUNBUFFERED": "1", **os.environ, **step.env}  # each line in the log when it is printed
        if threads is not None and "OMP_NUM_THREADS" not in step.env:
            env["OMP_NUM_THREADS"] = str(threads)
        log = folder / "log.txt"
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(f"[proof] $ {shlex.join(step.argv)}" + (f"   (in {step.cwd})" if step.cwd else "") + "\n")
        began = time.time()
        timeline = Timeline(log, folder / "timeline.txt", began, f"$ {shlex.join(step.argv)}")
        timeline.start()
        with open(log, "a", encoding="utf-8") as errors, \
                open(folder / step.stdout if step.stdout else log, "a", encoding="utf-8") as output:
            proc = subprocess.Popen(step.argv, cwd=step.cwd or REPO, env=env, stdout=output, stderr=errors,
                                    start_new_session=True)  # its own group: torchrun's workers end with it
            try:
                status = proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                status, timed_out = 124, True
        seconds = time.time() - began
        timeline.finish(f"[exit {status}]")
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(f"[proof] exit {status} after {seconds:.1f} s" + (" (timed out)" if timed_out else "") + "\n")
        with open(folder / "status.txt", "a", encoding="utf-8") as handle:
            handle.write(f"{status} {seconds:.2f}\n")
        return status, seconds, timed_out and budget_cut

    # ------------------------------------------------------------------ all of them
    def run(self, checks: list[proof.Check], skipped: dict[str, str]) -> None:
        cores = os.cpu_count() or 1
        self.jobs = self.args.jobs or ((4 if cores >= 8 else 1) if self.args.device == "cuda" else min(2, cores))
        for check in checks:
            if check.name in skipped:
                self.record(check.name, "skipped", 0.0, skipped[check.name])
        todo = [check for check in checks if check.name not in skipped]
        running: dict[Future, str] = {}
        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            for check in todo:
                if check.exclusive:  # a measurement: nothing beside it
                    wait(running)
                    running.clear()
                else:
                    while len(running) >= self.jobs:
                        done, _ = wait(running, return_when=FIRST_COMPLETED)
                        for future in done:
                            running.pop(future)
                if self.left() < MIN_START_S:
                    self.record(check.name, "not-run", 0.0, f"the budget of {self.args.budget:g} s was spent")
                    continue
                future = pool.submit(self._guarded, check, not check.exclusive and self.jobs > 1)
                running[future] = check.name
                if check.exclusive:
                    wait([future])
                    running.clear()
            wait(running)

    def _guarded(self, check: proof.Check, pooled: bool) -> None:
        try:
            self.run_check(check, pooled)
        except Exception as error:  # noqa: BLE001 - the harness itself failed on this check: say so, go on
            self.record(check.name, "failed", 0.0, f"the harness failed: {type(error).__name__}: {error}")

    # ------------------------------------------------------------------ the summary
    def write_summary(self) -> None:
        with self.writing:
            self._write_summary()

    def _write_summary(self) -> None:
        with self.lock:
            ordered = [dict(self.results[c.name]) for c in proof.CHECKS if c.name in self.results]
        counts = {status: sum(1 for r in ordered if r["status"] == status)
                  for status in ("ok", "failed", "skipped", "not-run")}
        summary = {"schema": "hpc-dl-labs/gpu-proof", "schema_version": 1, "device": self.args.device, **self.probe,
                   "started": _iso(self.started), "budget_s": self.args.budget,
                   "elapsed_s": round(time.time() - self.started, 1), "git": _git_revision(), "targets": proof.TARGETS,
                   "counts": counts, "checks": ordered}
        _write(self.out / "summary.json", json.dumps(summary, indent=1) + "\n")
        _write(self.out / "summary.md", markdown(summary))
        if self.args.bundle is not None:
            self.write_bundle()

    def write_bundle(self) -> None:
        bundle: Path = self.args.bundle
        bundle.mkdir(parents=True, exist_ok=True)
        for name in ("summary.json", "summary.md", "proof.log"):
            if (self.out / name).is_file():
                _write(bundle / name, (self.out / name).read_text(encoding="utf-8"))
        sizes: dict[Path, int] = {}  # a check running beside may replace a file meanwhile: what vanished is not kept
        for path in sorted(self.out.rglob("*")):
            folders = path.relative_to(self.out).parts[:-1]
            if path.suffix in BUNDLE_SUFFIXES and not BUNDLE_SKIP_DIRS.intersection(folders):
                try:
                    if path.is_file():
                        sizes[path] = path.stat().st_size
                except OSError:
                    continue
        tmp, largest = bundle / "proof.tar.gz.tmp", BUNDLE_MAX_FILE
        while True:  # too large to come back: leave out the largest files, say which, and try again
            left_out = {path: size for path, size in sizes.items() if size > largest}
            with tarfile.open(tmp, "w:gz") as archive:
                for path, size in sizes.items():
                    if path not in left_out:
                        try:
                            archive.add(path, arcname=str(Path("gpu-proof") / path.relative_to(self.out)))
                        except OSError:
                            continue
                note = "".join(f"{path.relative_to(self.out)} {size}\n" for path, size in left_out.items()).encode()
                info = tarfile.TarInfo("gpu-proof/left-out.txt")  # the files over the size kept, with their bytes
                info.size, info.mtime = len(note), int(time.time())
                archive.addfile(info, io.BytesIO(note))
            if tmp.stat().st_size <= BUNDLE_MAX_ARCHIVE or largest < 1024:
                break
            largest //= 8
        tmp.replace(bundle / "proof.tar.gz")


def markdown(summary: dict[str, Any]) -> str:
    counts = summary["counts"]
    lines = [f"# GPU proof: {summary.get('gpu_name') or summary['device']}", "",
             f"{summary['gpus']} GPU(s), torch {summary.get('torch')}, Python {summary.get('python')}, git "
             f"{summary.get('git')}; started {summary['started']}, {summary['elapsed_s']:.0f} s of a "
             f"{summary['budget_s']:g} s budget. {counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} "
             f"skipped, {counts['not-run']} not run.", "",
             "| check | tier | status | seconds | reason / findings |", "| --- | --- | --- | --- | --- |"]
    for row in summary["checks"]:
        findings = ", ".join(f"{k}={_short(v)}" for k, v in row["findings"].items())
        detail = "; ".join(part for part in (row["reason"], findings) if part).replace("|", "\\|")
        lines.append(f"| {row['name']} | {row['tier']} | {row['status']} | {row['seconds']:.0f} | {detail} |")
    return "\n".join(lines) + "\n"


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 160 else text[:157] + "..."


def _is_record(path: Path) -> bool:
    try:
        return "schema_version" in json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


class Timeline(threading.Thread):
    """Follows a command's ``log.txt`` while it runs and writes each new line to ``timeline.txt`` with the
    seconds since the command started (read four times a second, so a line shows at most about 0.25 s late,
    never early): where a check's time went (start-up, first step, the end), at no cost to the check."""

    POLL_S = 0.25

    def __init__(self, log: Path, path: Path, began: float, title: str) -> None:
        super().__init__(daemon=True)
        self.log, self.path, self.began, self.title = log, path, began, title
        self.offset = log.stat().st_size  # what the log held before this command
        self.done, self.ended = threading.Event(), float("inf")

    def run(self) -> None:
        pending = b""
        with open(self.path, "a", encoding="utf-8") as timeline:
            timeline.write(f"{0:8.2f}  {self.title}\n")
            while True:
                last = self.done.is_set()
                with open(self.log, "rb") as log:
                    log.seek(self.offset)
                    chunk = log.read()
                self.offset += len(chunk)
                *lines, pending = (pending + chunk).split(b"\n")
                if last and pending:  # a last line without its newline
                    lines, pending = [*lines, pending], b""
                seen = min(time.time() - self.began, self.ended)  # a line read after the end was written before it
                timeline.writelines(f"{seen:8.2f}  {line.decode(errors='replace')}\n" for line in lines)
                timeline.flush()
                if last:
                    return
                self.done.wait(self.POLL_S)

    def finish(self, last_line: str) -> None:
        """After the command ended: what is left of its log, then ``last_line`` with the time now."""
        self.ended = time.time() - self.began
        self.done.set()
        self.join()
        with open(self.path, "a", encoding="utf-8") as timeline:
            timeline.write(f"{self.ended:8.2f}  {last_line}\n")


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _iso(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _git_revision() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


PROBE = """import json, platform, socket, sys, torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(json.dumps({"gpus": n, "torch": torch.__version__, "python": platform.python_version(),
                  "host": socket.gethostname(), "gpu_name": torch.cuda.get_device_name(0) if n else None,
                  "cpus": __import__("os").cpu_count()}))
"""


def probe_machine() -> dict[str, Any] | None:
    """What PyTorch sees, asked in a process of its own (so this one never holds a CUDA context)."""
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def missing_modules(modules: set[str]) -> set[str]:
    code = ("import importlib.util, sys\nprint(' '.join(m for m in sys.argv[1:] "
            "if importlib.util.find_spec(m) is None))")
    proc = subprocess.run([sys.executable, "-c", code, *sorted(modules)], capture_output=True, text=True, timeout=60)
    return set(proc.stdout.split())


def last_summary(out: Path) -> dict[str, Any] | None:
    """OUT's summary, else the newest committed one (each lease starts bare)."""
    candidates = [out / "summary.json"] if (out / "summary.json").is_file() else sorted(
        REPO.glob("reference-results/*/gpu-proof/summary.json"))
    summaries = []
    for path in candidates:
        try:
            summaries.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return max(summaries, key=lambda s: s.get("started", ""), default=None)


def choose(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list[proof.Check], dict | None, str]:
    """The checks to run, the summary they continue, and a line saying which summary ``--only`` read."""
    tiers = {"1": {1}, "2": {2}, "all": {1, 2}}[args.tier]
    checks = [check for check in proof.CHECKS if check.tier in tiers]
    previous = last_summary(args.out)
    names = [name.strip() for item in args.only or () for name in item.split(",") if name.strip()]
    if names in (["failed"], ["pending"]):
        done = {"ok", "skipped"} if names == ["failed"] else {"ok", "skipped", "failed"}
        rows, in_out = (previous or {}).get("checks", []), (args.out / "summary.json").is_file()
        note = f"gpu_proof: --only {names[0]}: no summary to read, every check" if previous is None else (
            f"gpu_proof: --only {names[0]}: "
            f"read {args.out / 'summary.json' if in_out else 'the newest committed summary'}"
            f" (started {previous.get('started')}, git {previous.get('git')})")
        # "pending" continues a run: a committed summary of an earlier lease that ran other code did not run this code
        if names == ["pending"] and previous is not None and not in_out and previous.get("git") != _git_revision():
            rows, note = [], note + f", of other code than this tree's ({_git_revision()}): every check is pending"
        passed = {row["name"] for row in rows if row.get("status") in done}
        return [check for check in checks if check.name not in passed], previous, note
    if names:
        unknown = [name for name in names if name not in proof.BY_NAME]
        if unknown:
            parser.error(f"unknown check(s) {', '.join(unknown)}; --list shows them")
        return [check for check in checks if check.name in names], previous, ""
    return checks, previous, ""


def main(argv: list[str] | None = None) -> int:
    started = float(os.environ.get("GPU_PROOF_STARTED") or time.time())
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        for check in proof.CHECKS:
            print(f"{check.tier}  {check.name:<22} {'[alone] ' if check.exclusive else ''}{check.what}")
        return 0
    if args.budget <= RESERVE_S + MIN_START_S:
        parser.error(f"--budget {args.budget:g}: at least {RESERVE_S + MIN_START_S:g} s")
    if args.jobs is not None and args.jobs < 1:
        parser.error("--jobs must be at least 1")
    checks, previous, note = choose(args, parser)
    probe = probe_machine()
    if probe is None:
        print(f"gpu_proof: {sys.executable} cannot import torch; run it with the course's interpreter (PYTHON=...)",
              file=sys.stderr)
        return 2
    if args.device == "cuda" and probe["gpus"] == 0:
        print("gpu_proof: no CUDA GPU visible (torch.cuda.is_available() is False); rehearse with --device cpu",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    runner = Proof(args, probe, started)
    if previous and (args.out / "summary.json").is_file():  # a rerun in the same folder keeps what passed before
        runner.results = {row["name"]: row for row in previous.get("checks", []) if row.get("name") in proof.BY_NAME}
    if note:
        runner.say(note)
    skipped = {}
    needed = {module for check in checks for module in check.needs}
    missing = missing_modules(needed) if needed else set()
    if missing:
        names = {m: [c.name for c in checks if m in c.needs] for m in sorted(missing)}
        runner.say("gpu_proof: missing Python module(s): " + "; ".join(f"{m} (for {', '.join(n)})"
                                                                      for m, n in names.items())
                   + ": put their wheels in .whl/ (bash scripts/gpu_proof_prepare.sh on a machine with internet)")
    for check in checks:
        lacking = sorted(set(check.needs) & missing)
        if lacking:
            skipped[check.name] = f"needs the Python module(s) {', '.join(lacking)}"
        elif args.device == "cpu" and check.cuda_only:
            skipped[check.name] = f"on the CPU: {check.cuda_only}"
        elif check.name == "ch04_vs_examples" and not (args.examples / "mnist" / "main.py").is_file():
            skipped[check.name] = (f"no pytorch/examples checkout at {args.examples} "
                                   "(bash scripts/gpu_proof_prepare.sh fetches it)")
    gpus = f"{probe['gpus']} GPU(s)" + (f" {probe['gpu_name']}" if probe.get("gpu_name") else "")
    runner.say(f"gpu_proof: {len(checks)} check(s) on {args.device} ({gpus}, torch {probe['torch']}), budget "
               f"{args.budget:g} s, results in {args.out}")
    runner.run(checks, skipped)
    runner.write_summary()
    print((args.out / "summary.md").read_text(encoding="utf-8"))
    ran = [runner.results[c.name] for c in checks if c.name in runner.results]
    if any(row["status"] == "failed" for row in ran):
        return 1
    pending = [row["name"] for row in ran if row["status"] == "not-run"]
    if pending:  # not a pass: a script or CI reading the status alone must not take a cut run for a proven one
        print(f"gpu_proof: {len(pending)} of {len(checks)} check(s) not run within the budget "
              f"({', '.join(pending)}): --only pending runs them", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
