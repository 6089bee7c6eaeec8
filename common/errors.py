"""User-facing errors: one clear line and a non-zero exit, never a traceback.

Scripts raise :class:`UserError` for anything the user can fix (a flag, a path, a missing data
set) and wrap their entry point with :func:`run_main`, which prints ``error: <message>`` on
stderr and exits with status 2. A run that stopped on purpose (:class:`Stopped`: pre-empted, its
checkpoint saved) exits 0. Bugs still raise normally so they keep their tracebacks.

This module must not import torch: the report tool and the test suite use it too.
"""

from __future__ import annotations

import gc
import sys
from typing import Callable, NoReturn, Sequence

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """Something the user asked for cannot be done; the message says what to do instead."""


class Stopped(Exception):
    """A run that stopped on purpose and exits 0: pre-empted, its checkpoint saved (the code that stopped it
    has said so), so that Slurm's requeue or the next link of a chain resumes it."""


def fail(message: str) -> NoReturn:
    """Raise a :class:`UserError` (a shorthand that reads well in argument checks)."""
    raise UserError(message)


def run_main(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> NoReturn:
    """Run ``main(argv)`` and exit with its status; a :class:`UserError` becomes one line on stderr."""
    try:
        status = main(argv)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    except Stopped:
        status = 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)
    # What main held in reference cycles (an FSDP2 model: its hooks point back at it) is freed only
    # by a collection; without one, the process group it still references would keep its threads
    # running into interpreter shutdown, which can abort the process after a successful run.
    gc.collect()
    sys.exit(int(status or 0))
