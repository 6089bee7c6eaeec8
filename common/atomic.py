"""Files written whole or not at all: records, checkpoints, traces, reports, job scripts.

A job can die while it writes: a time limit, a pre-emption, a full disk. A half-written record is
skipped by the report, but a truncated checkpoint is worse: the requeued job fails to load it and
the run is lost. So every file goes through :func:`atomic_path`: the content is written to a
temporary file in the same folder, flushed to disk (``fsync``) and renamed over the target in one
step. Readers see the old file or the whole new one, never a part; a failure removes the
temporary file and leaves the old target as it was.

    with atomic_path(path) as tmp:              # any writer that takes a path
        torch.save(state, tmp)
    write_text_atomic(html, "report.html")      # text

This module must not import torch: the report writes through it.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_path", "write_text_atomic"]


@contextmanager
def atomic_path(path: str | os.PathLike[str], *, executable: bool = False) -> Iterator[Path]:
    """Give a temporary path beside ``path`` to write; when the block ends, make it ``path``.

    The temporary name starts with a dot (``.report.html.k3j2.tmp``), so readers of a folder that
    skip hidden files (as :func:`common.results.load_records` does) never see a file in progress,
    and it is unique, so two processes writing the same target do not write into one file. The new
    file's mode follows the umask like any new file (``mkstemp`` alone would make it owner-only,
    and results are shared with a course group); ``executable`` adds the execute bits (job scripts).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb") as handle:  # the writer may have opened and closed the file itself
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, (0o777 if executable else 0o666) & ~umask)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(text: str, path: str | os.PathLike[str], *, executable: bool = False) -> Path:
    """Write ``text`` (UTF-8, newlines as given) to ``path`` through :func:`atomic_path`; return the path."""
    with atomic_path(path, executable=executable) as tmp:
        with open(tmp, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
    return Path(path)
