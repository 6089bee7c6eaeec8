"""What differs between the PyTorch releases the course runs on, in one place.

A cluster's PyTorch module is often some releases behind the newest. Where a call, an import or an
environment variable changed between those releases, the course asks this module rather than the
release: each function below tries the current spelling first, then the older ones, and says which
it used, so a record or a test can tell.

- :func:`set_collective_timeout`: shorten the timeout of a process group that already exists.
  Recent PyTorch has ``torch.distributed.set_timeout``; older releases only the private
  ``distributed_c10d._set_pg_timeout``. Where neither exists, the group keeps the timeout it was
  created with: passing the short timeout to ``init_process_group`` instead would shorten the
  start-up rendezvous too, where ranks arrive seconds apart (imports, a loaded node) without any hang.
- The flight recorder (each rank's last collectives, kept by PyTorch): recent releases read
  ``TORCH_FR_BUFFER_SIZE`` for every backend, older ones ``TORCH_NCCL_TRACE_BUFFER_SIZE`` for NCCL;
  the dump is ``_dump_nccl_trace_json`` for NCCL's recorder and ``_dump_fr_trace_json`` for the
  backend-neutral one (Gloo's). :func:`enable_flight_recorder` sets both variables,
  :func:`dump_flight_recorder` asks the dump that belongs to the backend first. Measured on one H100
  (torch 2.11, the GPU proof's ``nccl_flight_recorder`` check): either variable alone made NCCL keep
  its collectives; ``_dump_nccl_trace_json`` returned them (3 of 3), ``_dump_fr_trace_json`` none;
  ``set_timeout`` was missing and ``_set_pg_timeout`` present.
"""

from __future__ import annotations

import datetime as _dt
import os
from typing import MutableMapping

import torch.distributed as dist

__all__ = ["set_collective_timeout", "FLIGHT_RECORDER_BUFFER_VARIABLES", "WATCHDOG_DUMP_VARIABLES",
           "enable_flight_recorder",
           "flight_recorder_dumps", "dump_flight_recorder"]

#: The variables that size the flight recorder, newest name first (both are set: each release reads its own).
FLIGHT_RECORDER_BUFFER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def set_collective_timeout(seconds: float, group: object | None = None) -> str | None:
    """Make collectives of ``group`` (default: the world) fail after ``seconds``, once the group exists.

    Returns the call that did it (``"set_timeout"`` or ``"_set_pg_timeout"``), or ``None`` where this
    PyTorch has neither: the group then keeps its start-up timeout.
    """
    timeout = _dt.timedelta(seconds=seconds)
    if hasattr(dist, "set_timeout"):
        dist.set_timeout(timeout, group)
        return "set_timeout"
    from torch.distributed import distributed_c10d

    private = getattr(distributed_c10d, "_set_pg_timeout", None)
    if private is not None:
        private(timeout, group)
        return "_set_pg_timeout"
    return None


#: Where NCCL's watchdog writes the recorder when a collective times out (it appends the rank), newest first.
WATCHDOG_DUMP_VARIABLES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def enable_flight_recorder(entries: int, env: MutableMapping[str, str] | None = None,
                           dump_prefix: str | os.PathLike | None = None) -> None:
    """Keep each rank's last ``entries`` collectives (set before the process group starts; a value the
    user exported wins). ``dump_prefix``: on NCCL, the watchdog writes the recorder to this path plus
    the rank when a collective times out, before it ends the process (``TORCH_NCCL_DUMP_ON_TIMEOUT``):
    on an H100 with torch 2.11 the watchdog aborted the rank (SIGABRT) and Python's ``except`` never
    ran, so that file is the only recorder a timed-out NCCL rank leaves."""
    env = os.environ if env is None else env
    for name in FLIGHT_RECORDER_BUFFER_VARIABLES:
        env.setdefault(name, str(entries))
    if dump_prefix is not None:
        env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        for name in WATCHDOG_DUMP_VARIABLES:
            env.setdefault(name, str(dump_prefix))


def flight_recorder_dumps(backend: str | None) -> list[str]:
    """The dump functions this PyTorch has, the one for ``backend``'s recorder first."""
    from torch._C import _distributed_c10d as c10d

    order = ("_dump_nccl_trace_json", "_dump_fr_trace_json") if backend == "nccl" else (
        "_dump_fr_trace_json", "_dump_nccl_trace_json")
    return [name for name in order if hasattr(c10d, name)]


def dump_flight_recorder(backend: str | None) -> tuple[bytes, str] | None:
    """This rank's flight recorder as JSON bytes and the function that wrote it; ``None`` where this
    PyTorch has no recorder for ``backend`` (a private API, so every failure means "none")."""
    from torch._C import _distributed_c10d as c10d

    for name in flight_recorder_dumps(backend):
        try:
            text = getattr(c10d, name)(True, True)  # with the collectives, only those not finished
        except Exception:  # noqa: BLE001 - a release without that recorder, or a backend it does not cover
            continue
        data = text if isinstance(text, bytes) else str(text).encode()
        if data:
            return data, name
    return None
