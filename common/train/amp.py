"""Mixed precision for training: an autocast context and a matching gradient scaler.

=========  ================================  ==========================================
precision  autocast                          GradScaler
=========  ================================  ==========================================
``fp32``   none (``nullcontext``)            disabled (a pass-through)
``bf16``   ``torch.autocast(dev, bfloat16)``  disabled: bf16 has fp32's exponent range
``fp16``   ``torch.autocast(cuda, float16)``  enabled: small fp16 gradients underflow to 0
                                              unless the loss is scaled up first
=========  ================================  ==========================================

The names, what a device runs natively and what "fp32" means on a GPU are
:mod:`common.precision`'s; this module is the training side. Uses the current APIs only:
``torch.autocast(device_type, dtype)`` and ``torch.amp.GradScaler(device)``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from common import precision as precisions
from common.runtime.distributed import print0
from common.runtime.machine import cpu_description

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str, device: torch.device, flag: str = "--precision") -> str:
    """``precision`` normalised for ``device`` (:func:`common.precision.check`: one error line for what it
    cannot train in), saying once when bf16 will be emulated on this CPU."""
    name = precisions.check(precision, device, flag)
    announce_bf16_emulation(name, device)
    return name


#: Notes already printed by this process: a script that checks several precisions says it once.
_ANNOUNCED: set[str] = set()


def announce_bf16_emulation(precision: str, device: torch.device, cpuinfo: str | None = None) -> str | None:
    """Say in one line (rank 0) when ``precision`` is bf16 on a CPU without native bf16; return that line.

    Such a CPU (no ``avx512_bf16``, no AMX) converts every bf16 value to fp32 and back, so bf16 runs
    *slower* than fp32 and a reference table made on a CPU with bf16 units misleads. The record of
    the run carries the same note (``common.results.make_record``), and the report lists it as a
    warning. ``cpuinfo`` is another machine's ``/proc/cpuinfo`` text (tests).
    """
    if precisions.normalise(precision) != "bf16" or device.type != "cpu":
        return None
    note = precisions.emulation_note(cpu_description(cpuinfo))
    if note and note not in _ANNOUNCED:
        _ANNOUNCED.add(note)
        print0(f"note: {note}", flush=True)
    return note


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """The forward-pass context: autocast for bf16/fp16, a no-op for fp32."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """A GradScaler that is active only for fp16 (elsewhere its calls pass straight through)."""
    return torch.amp.GradScaler(device.type, enabled=(precision == "fp16"))
