"""Test-suite wiring: make ``helpers`` and ``common`` importable from every test folder, skip GPU tests on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
for path in (TESTS, TESTS.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.gpu`` tests skip, with the reason, where PyTorch sees no CUDA device."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False on this machine")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def lab03_ddp_run(tmp_path_factory: pytest.TempPathFactory):
    """``benchmark_models.py -g 2`` run once for the two files that read it (each run starts three
    processes that import torch): tests/test_lab03.py checks what it records, and
    tests/test_distributed_teardown.py that no process-group thread is left when its processes exit.
    Returns the finished process and its folder (csv/, records/, threads/)."""
    from helpers import LAB03_DDP_ARGS, run_reporting_threads

    folder = tmp_path_factory.mktemp("lab03-ddp")
    result = run_reporting_threads("labs/lab03_precision_benchmark/benchmark_models.py", *LAB03_DDP_ARGS,
                                   folder=folder)
    return result, folder


_SECONDS_BY_FILE: dict[str, float] = {}
#: Per file: the machine's CPU ticks (all cores, /proc/stat) while its tests ran, idle and in all.
_TICKS_BY_FILE: dict[str, list[int]] = {}
_last_ticks: list[tuple[int, int] | None] = [None]


def _cpu_ticks() -> tuple[int, int] | None:
    """(idle, total) CPU ticks of the whole machine since boot, summed over its cores; None off Linux."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return values[3] + values[4], sum(values)  # idle + iowait; user .. steal


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's setup, call and teardown, summed by file (module fixtures count where they run), and how
    busy the machine's cores were meanwhile (everything it ran: pytest, its processes, Slurm's jobs)."""
    path = report.nodeid.split("::", 1)[0]
    _SECONDS_BY_FILE[path] = _SECONDS_BY_FILE.get(path, 0.0) + report.duration
    now, last = _cpu_ticks(), _last_ticks[0]
    if now is not None and last is not None:
        ticks = _TICKS_BY_FILE.setdefault(path, [0, 0])
        ticks[0] += now[0] - last[0]
        ticks[1] += now[1] - last[1]
    _last_ticks[0] = now


def pytest_runtest_logstart() -> None:
    if _last_ticks[0] is None:  # the first test's start: the count begins here, after collection
        _last_ticks[0] = _cpu_ticks()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Where the time went, by file: the suite's budget is kept by the slowest files (docs/testing.md). The
    share of the cores busy says whether a file computes (near 100%) or waits (timers, time-outs, a queue)."""
    if not _SECONDS_BY_FILE:
        return
    ranked = sorted(_SECONDS_BY_FILE.items(), key=lambda item: -item[1])
    idle, total = (sum(ticks[i] for ticks in _TICKS_BY_FILE.values()) for i in (0, 1))
    busy = f"; cores busy {1 - idle / total:.0%}" if total else ""
    terminalreporter.write_sep("=", f"seconds by file ({sum(_SECONDS_BY_FILE.values()):.0f} s in all{busy})")
    for path, seconds in ranked[:20]:
        idle, total = _TICKS_BY_FILE.get(path, (0, 0))
        busy = f"{1 - idle / total:4.0%} busy" if total else "          "
        terminalreporter.write_line(f"{seconds:8.1f} s  {busy}  {path}")
