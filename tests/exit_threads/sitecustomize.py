"""At exit, every Python process of a test run writes down which threads it still has.

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that has one.
``tests/test_distributed_teardown.py`` puts this folder first on ``PYTHONPATH`` and names a report
folder in ``HPC_DL_LABS_THREAD_REPORT``; then each process, when it exits normally (after the script's
main function has returned, before the interpreter shuts down), writes ``<pid>.json`` there with its
command line and the names of its threads (``/proc/self/task/*/comm``). Child processes inherit the
environment, so the ranks that ``torch.multiprocessing.spawn`` or ``torchrun`` start report too.

Without ``HPC_DL_LABS_THREAD_REPORT`` this does nothing. It imports nothing heavy (no torch), so it
changes nothing about the process it watches.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

REPORT_DIR = os.environ.get("HPC_DL_LABS_THREAD_REPORT")


def thread_names() -> list[str]:
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended while we listed them
            pass
    return sorted(names)


def _report() -> None:
    report = {"pid": os.getpid(), "argv": sys.argv, "threads": thread_names()}
    Path(REPORT_DIR, f"{os.getpid()}.json").write_text(json.dumps(report))


if REPORT_DIR:
    atexit.register(_report)  # registered first, so it runs after every other exit handler
