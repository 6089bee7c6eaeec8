"""User-facing errors: one clear line and a non-zero exit, never a traceback.

Scripts raise :class:`UserError` for anything the user can fix (a flag, a path, a missing data
set) and wrap their entry point with :func:`run_main`, which prints ``error: <message>`` on
stderr and exits with status 2. Running out of memory (CUDA's or the CPU's allocator) is one line
too, exit 1. A run that stopped on purpose (:class:`Stopped`: pre-empted, its checkpoint saved)
exits 0. Bugs still raise normally so they keep their tracebacks. A script that runs others one after another (Lab-02's
sweep, Lab-05's study) runs each with :func:`run_echoing` inside :func:`sigterm_raises`, so that Ctrl-C or SIGTERM
stops the child with it and the script can clean up and say what it kept; one that hands its work to one other
(Lab-09's pipeline to the sweep, Lab-03's ``-g N`` to torchrun) does the same with :func:`run_attached`. What must not
be cut in half (Lab-09's ``sbatch`` and the record of the job it submitted) runs inside :func:`sigterm_deferred`.

This module must not import torch: the report tool and the test suite use it too.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import re
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Sequence

from common.units import format_bytes

EXIT_USER_ERROR = 2
EXIT_OUT_OF_MEMORY = 1
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, as a shell reports a process that SIGTERM ended
#: How the CPU's allocator says it could not allocate (a RuntimeError; CUDA's is torch.OutOfMemoryError).
CPU_ALLOCATION_FAILED = "DefaultCPUAllocator: can't allocate memory"


class UserError(Exception):
    """Something the user asked for cannot be done; the message says what to do instead."""


class FlagError(UserError):
    """A bad value of the command line found after parsing (a list, sizes that contradict each other): every rank
    of torchrun or srun reads the same flags, so the first rank says it and the others exit 2 silently, as they do
    for argparse's own errors. What may differ between nodes (a data set, a GPU) stays a :class:`UserError`."""


def first_rank() -> bool:
    """Rank 0 of torchrun (``RANK``) or of an srun step (``SLURM_PROCID``), or no launcher: read before any process
    group exists, for what every rank would say alike (a bad flag, a former flag name)."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


class Stopped(Exception):
    """A run that stopped on purpose and exits 0: pre-empted, its checkpoint saved (the code that stopped it
    has said so), so that Slurm's requeue or the next link of a chain resumes it."""


class Terminated(BaseException):
    """SIGTERM (``kill``, ``scancel``, a job's time limit) reached a script inside :func:`sigterm_raises`: raised where
    it was, so that the script stops its child and cleans up as after Ctrl-C (a BaseException: no ``except
    Exception`` takes it for a child's failure)."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Terminated`. Its default ends the process at once, which left a
    script's scratch folder in /tmp and the child it ran (a sweep's step, a study's point) running on alone."""
    def stop(signum: int, frame: Any) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def sigterm_deferred() -> Iterator[list[int]]:
    """While inside, SIGTERM waits: it is noted in the list this yields (so that the code inside can say what it
    finished), and :class:`Terminated` is raised as the block ends. For a step that must not be cut in half: a script
    killed while ``sbatch`` submits cannot know whether the job is in the queue, and leaves it unrecorded."""
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)
    if received:
        raise Terminated


def run_echoing(command: list[str], tag: str, *, env: dict[str, str] | None = None,
                cwd: Path | None = None) -> tuple[int, list[str]]:
    """Run ``command``, echoing its output under ``[tag]``; its exit status and last lines. Whatever stops the caller
    meanwhile (Ctrl-C, :class:`Terminated`) stops the command too, and is raised once it has ended."""
    tail: deque[str] = deque(maxlen=15)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=cwd) as process:
        assert process.stdout is not None
        try:
            for line in process.stdout:
                print(f"[{tag}] {line}", end="", flush=True)
                tail.append(line.rstrip())
        except BaseException:
            process.terminate()  # the with waits for it; a job's end may have sent it SIGTERM already: no harm
            raise
    return process.returncode, list(tail)


def run_attached(command: list[str], *, env: dict[str, str] | None = None) -> int:
    """Run ``command`` with its output straight to this process's (its error line stays on stderr, as typed); its exit
    status. As in :func:`run_echoing`, whatever stops the caller meanwhile (Ctrl-C, :class:`Terminated`) stops the
    command too, and is raised once it has ended."""
    with subprocess.Popen(command, env=env) as process:
        try:
            return process.wait()
        except BaseException:
            process.terminate()  # the with waits for it
            raise


def fail(message: str) -> NoReturn:
    """Raise a :class:`UserError` (a shorthand that reads well in argument checks)."""
    raise UserError(message)


def out_of_memory(err: BaseException) -> str | None:
    """What an allocator's out-of-memory error says, in one line (CUDA's first three sentences: what it tried to
    allocate, and what the GPU has), or ``None`` when ``err`` is something else."""
    text = " ".join(str(err).split())
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return ". ".join(text.split(". ")[:3]).rstrip(".") or type(err).__name__
    if CPU_ALLOCATION_FAILED in text:
        tried = re.search(r"you tried to allocate (\d+) bytes", text)
        return "the CPU's allocator could not allocate " + (format_bytes(int(tried[1])) if tried else "memory")
    return None


def batch_too_small(err: BaseException) -> str | None:
    """What BatchNorm's refusal of a one-value batch means, in one line, or ``None`` when ``err`` is something else:
    training with one sample per rank where a feature map is down to 1x1 (a ResNet on small images)."""
    said = re.match(r"Expected more than 1 value per channel when training, got input size torch\.Size\((.*)\)",
                    str(err)) if isinstance(err, ValueError) else None
    return None if said is None else (f"BatchNorm cannot train on one value per channel (a layer got {said[1]}: one "
                                      "sample whose feature map is 1x1); use a --batch-size of 2 or more per rank, or "
                                      "larger images")


def run_main(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> NoReturn:
    """Run ``main(argv)`` and exit with its status; a :class:`UserError` becomes one line on stderr."""
    try:
        status = main(argv)
    except UserError as err:
        if isinstance(err, FlagError) and not first_rank():
            sys.exit(EXIT_USER_ERROR)
        message = str(err)
        if "\nOriginal Traceback" in message:  # raised in a DataLoader worker, whose traceback torch puts first
            message = message.rstrip().splitlines()[-1].split(": ", 1)[-1]
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    except Stopped:
        status = 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)
    except Terminated:  # inside sigterm_raises, whose child has been stopped
        print("terminated (SIGTERM)", file=sys.stderr, flush=True)
        sys.exit(EXIT_TERMINATED)
    except OSError as err:
        if err.errno != errno.ENAMETOOLONG:
            raise
        name = str(err.filename or "")  # a path typed on the command line, usually: bad input, not a bug
        print(f"error: {err.strerror}: {name[:60]}{'...' if len(name) > 60 else ''} ({len(name)} characters)",
              file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    except ValueError as err:
        said = batch_too_small(err)
        if said is None:
            raise
        print(f"error: {said}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    except (MemoryError, RuntimeError) as err:
        said = out_of_memory(err)
        if said is None:
            raise  # a bug keeps its traceback
        print(f"error: out of memory: {said}; a smaller --batch-size (or model, or input) fits", file=sys.stderr,
              flush=True)
        sys.exit(EXIT_OUT_OF_MEMORY)
    # What main held in reference cycles (an FSDP2 model: its hooks point back at it) is freed only
    # by a collection; without one, the process group it still references would keep its threads
    # running into interpreter shutdown, which can abort the process after a successful run.
    gc.collect()
    sys.exit(int(status or 0))
