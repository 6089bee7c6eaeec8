"""What differs between the PyTorch releases the course runs on, in one place.

A cluster's PyTorch module is often some releases behind the newest. Where a call, an import or an
environment variable changed between those releases, the course asks this module rather than the
release: each function below tries the current spelling first, then the older ones, and says which
it used, so a record or a test can tell.

- :func:`set_collective_timeout`: shorten the timeout of a process group that already exists.
  Recent PyTorch has ``torch.distributed.set_timeout`` (2.14 on); older releases only the private
  ``distributed_c10d._set_pg_timeout``, which reaches NCCL's watchdog, and a Gloo group's collectives from
  2.9 on (measured with a stalled all-reduce: on 2.8.0 it still waited for the start-up timeout; on 2.9.1,
  2.10.0, 2.11.0, 2.12.0 and 2.13.0 it failed after the short one). Where nothing reaches the group,
  it keeps the timeout it was created with, and the caller says so: passing the short timeout to
  ``init_process_group`` instead would shorten the start-up rendezvous too, where ranks arrive seconds
  apart (imports, a loaded node) without any hang.
- The flight recorder (each rank's last collectives, kept by PyTorch): recent releases read
  ``TORCH_FR_BUFFER_SIZE`` for every backend, older ones ``TORCH_NCCL_TRACE_BUFFER_SIZE`` for NCCL;
  the dump is ``_dump_nccl_trace_json`` for NCCL's recorder and ``_dump_fr_trace_json`` for the
  backend-neutral one (Gloo's). :func:`enable_flight_recorder` sets the new name only (every release from the
  floor on reads it, and the old one makes 2.15 warn on every rank), :func:`dump_flight_recorder` asks the dump
  that belongs to the backend first. Measured on one H100
  (torch 2.11, the GPU proof's ``nccl_flight_recorder`` check): either variable alone made NCCL keep
  its collectives; ``_dump_nccl_trace_json`` returned them (3 of 3), ``_dump_fr_trace_json`` none;
  ``set_timeout`` was missing and ``_set_pg_timeout`` present.
- :func:`ddp_buffer_sync`: DDP's ``broadcast_buffers`` is ``forward_sync_buffers`` in recent releases
  (the old name warns there); older ones know only the old name.
- :func:`clear_dtensor_caches`: DTensor's sharding caches, emptied at teardown (they hold device meshes,
  and a mesh holds its process groups): one Python cache up to 2.x, a per-thread one in older releases,
  plus a C++ fast-path cache in recent ones.
- :func:`new_tf32_api`: TF32 is set per back end with ``fp32_precision`` in recent releases; older
  ones have only ``allow_tf32`` (``common.precision.set_fp32_math`` sets both where both exist).
- :data:`RECOMPILE_LIMIT_HIT`: how dynamo says it gave up recompiling a function (the limit's name changed).

The floor (``common.MINIMUM_VERSIONS``) is the oldest release on which every lesson's shortest run
works on a CPU (``bash scripts/torch_floor.sh`` proves it in CI). What a CPU cannot prove, a GPU run
must: :data:`GPU_ONLY` lists those differences, the release each needs, and the check of the GPU proof
(``scripts/gpu_proof_checks.py``) that exercises it; :func:`paths` says which spelling this PyTorch
gets, for the proof's findings.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
from dataclasses import dataclass
from typing import MutableMapping

import torch
import torch.distributed as dist

from common import _release

__all__ = ["set_collective_timeout", "GLOO_READS_PRIVATE_TIMEOUT", "FLIGHT_RECORDER_BUFFER_VARIABLES",
           "WATCHDOG_DUMP_VARIABLES", "enable_flight_recorder", "flight_recorder_dumps", "dump_flight_recorder",
           "ddp_buffer_sync", "clear_dtensor_caches", "new_tf32_api", "RECOMPILE_LIMIT_HIT", "GpuOnly", "GPU_ONLY",
           "paths"]

#: The variables that size the flight recorder, newest name first (2.8 and later read both; 2.15 warns about the old).
FLIGHT_RECORDER_BUFFER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


#: The first release whose Gloo collectives read the timeout ``_set_pg_timeout`` sets (the module's docstring).
GLOO_READS_PRIVATE_TIMEOUT = (2, 9)


def _torch_release() -> tuple[int, ...]:
    return _release(torch.__version__)[:2]


def set_collective_timeout(seconds: float, group: object | None = None) -> str | None:
    """Make collectives of ``group`` (default: the world) fail after ``seconds``, once the group exists.

    Returns the call that did it (``"set_timeout"`` or ``"_set_pg_timeout"``), or ``None`` where this
    PyTorch has no call that reaches the group (neither, or only the private one on a Gloo group of 2.8):
    the group then keeps its start-up timeout.
    """
    timeout = _dt.timedelta(seconds=seconds)
    if hasattr(dist, "set_timeout"):
        dist.set_timeout(timeout, group)
        return "set_timeout"
    from torch.distributed import distributed_c10d

    private = getattr(distributed_c10d, "_set_pg_timeout", None)
    # Measured on torch 2.8, the floor (tests/test_compat.py): the private call returns, and a Gloo group's
    # collectives still wait for the timeout the group started with; from 2.9 they read it. NCCL's watchdog
    # reads it (GPU_ONLY).
    if private is None or (dist.get_backend(group) == "gloo" and _torch_release() < GLOO_READS_PRIVATE_TIMEOUT):
        return None
    private(timeout, group)
    return "_set_pg_timeout"


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
    if not any(name in env for name in FLIGHT_RECORDER_BUFFER_VARIABLES):
        env[FLIGHT_RECORDER_BUFFER_VARIABLES[0]] = str(entries)
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


def ddp_buffer_sync(enabled: bool) -> dict[str, bool]:
    """DDP's "copy rank 0's buffers to every rank before each forward" option, as this PyTorch names it:
    ``{"forward_sync_buffers": enabled}`` where DDP takes that name (2.15 does), else ``broadcast_buffers``."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": enabled}
    return {"broadcast_buffers": enabled}


def clear_dtensor_caches() -> list[str]:
    """Empty DTensor's global caches; returns the caches it emptied (for a test to read).

    What ``torch.distributed.tensor.debug._clear_sharding_prop_cache`` does in recent releases, without
    importing that module (it imports dynamo: seconds of CPU at the end of every rank), and what older
    releases need instead: there the propagation cache is a per-thread ``lru_cache`` (``.cache``) and
    there is no C++ fast-path cache (2.7 is such a release).
    """
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    cleared = []
    propagate = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    for cache in (propagate, getattr(propagate, "cache", None)):
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
            cleared.append("sharding propagation")
            break
    fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if fast_path is not None:
        fast_path()
        cleared.append("sharding propagation fast path")
    planner = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if planner is not None:
        planner()
        cleared.append("redistribute planner")
    for name, cache in (("transform infos", getattr(_redistribute, "_gen_transform_infos", None)),
                        ("mesh topology", getattr(_collective_utils.MeshTopoInfo, "build_from_mesh", None))):
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
            cleared.append(name)
    return cleared


def new_tf32_api() -> bool:
    """Whether TF32 is set per back end with ``fp32_precision`` here (a mix of it and the old
    ``allow_tf32`` flags fails in those releases: ``common.precision`` writes both)."""
    return hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision")


#: How dynamo names giving up on a function after too many recompilations (older releases: cache_size_limit).
RECOMPILE_LIMIT_HIT = re.compile(r"(recompile|cache.size).{0,3}limit", re.IGNORECASE)


@dataclass(frozen=True)
class GpuOnly:
    """A difference between releases that only a GPU can show working: what the course uses, the first
    release that has it (read from PyPI's wheels, their Python sources and the strings of their
    libraries: at or below the floor means every release the course runs on has it), what the course
    does on a release before it, the GPU proof check (``scripts/gpu_proof_checks.py``) that exercises
    it, and the releases a GPU has run it on so far."""

    name: str
    needs: tuple[int, int]
    below: str
    check: str
    seen_working_on: tuple[str, ...] = ()


#: The differences a CPU cannot prove, for the GPU proof. From the wheels of 2.4.1 to 2.15.0: NCCL's
#: recorder dump is in 2.5 and later; the TORCH_FR_* names in 2.8 and later (TORCH_NCCL_* before, and
#: still read); ``set_timeout`` in 2.14 and later; ``fp32_precision`` in 2.9 and later.
GPU_ONLY = (
    GpuOnly("NCCL flight recorder: _dump_nccl_trace_json returns a rank's last collectives", (2, 5),
            "no recorder: Lab-06's ledger alone", "nccl_flight_recorder", ("2.11",)),
    GpuOnly("flight recorder sized by TORCH_FR_BUFFER_SIZE, watchdog dump to TORCH_FR_DUMP_TEMP_FILE", (2, 8),
            "the TORCH_NCCL_* names (below the floor)", "nccl_flight_recorder", ("2.11",)),
    # Not yet seen on NCCL either way: that takes two GPUs (Lab-06's --collective-timeout under NCCL);
    # the probe of nccl_flight_recorder records which of the two calls the release has.
    GpuOnly("a short timeout on an NCCL group that exists: torch.distributed.set_timeout", (2, 14),
            "distributed_c10d._set_pg_timeout (private)", "nccl_flight_recorder"),
    GpuOnly("TF32 per back end: torch.backends.cuda.matmul/cudnn.conv.fp32_precision", (2, 9),
            "the allow_tf32 flags alone (common.precision.set_fp32_math)", "lab03_precisions", ("2.11",)),
    GpuOnly("CUDA graphs: a step captured with a capturable optimizer and a tensor learning rate", (2, 8),
            "(every release the course runs on)", "lab02_graph", ("2.11",)),
)


def paths() -> dict[str, object]:
    """Which spelling of each difference this PyTorch gets (the GPU proof's findings, a test's check)."""
    from torch.distributed import distributed_c10d

    timeout = "set_timeout" if hasattr(dist, "set_timeout") else (
        "_set_pg_timeout" if hasattr(distributed_c10d, "_set_pg_timeout") else None)
    return {"torch": torch.__version__, "collective_timeout": timeout,
            "flight_recorder_dumps": {"nccl": flight_recorder_dumps("nccl"), "gloo": flight_recorder_dumps("gloo")},
            "ddp_buffer_sync": next(iter(ddp_buffer_sync(True))),
            "tf32_api": "fp32_precision" if new_tf32_api() else "allow_tf32"}
