"""Mixed precision in one place: an autocast context and a matching gradient scaler.

=========  ================================  ==========================================
precision  autocast                          GradScaler
=========  ================================  ==========================================
``fp32``   none (``nullcontext``)            disabled (a pass-through)
``bf16``   ``torch.autocast(dev, bfloat16)``  disabled: bf16 has fp32's exponent range
``fp16``   ``torch.autocast(cuda, float16)``  enabled: small fp16 gradients underflow to 0
                                              unless the loss is scaled up first
=========  ================================  ==========================================

fp16 autocast is a CUDA feature here; on CPU use bf16. bf16 needs bfloat16 tensor cores, which
NVIDIA GPUs have from compute capability 8.0 (Ampere, A100) on: ``torch.cuda.is_bf16_supported()``
also says yes on a V100 or T4, where bf16 is emulated (slowly, or not at all in cuDNN), so
:func:`check_precision` asks the compute capability instead. Uses the current APIs only:
``torch.autocast(device_type, dtype)`` and ``torch.amp.GradScaler(device)``. On a CPU, bf16 is
fast only with bf16 instructions (``avx512_bf16``, AMX, ARM's ``bf16``); :func:`check_precision`
says in one line when they are missing (:func:`announce_bf16_emulation`).

What "fp32" means on a GPU is a setting too. From Ampere on, PyTorch may run float32 matmuls and
cuDNN convolutions on TF32 tensor cores (10-bit mantissa); its default is TF32 *on* for
convolutions and off for matmuls, so a default "fp32" run is a hybrid. :func:`set_fp32_math`
chooses one meaning for both (``common.runtime.device.resolve_device`` picks ``ieee``, real fp32, for every
CUDA run of the course), and :func:`fp32_math` reads the setting in force, which every result
record carries (``provenance.fp32_math``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from common.errors import UserError
from common.runtime.compat import new_tf32_api

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: bfloat16 tensor cores arrived with Ampere (A100, compute capability 8.0).
BF16_MIN_CAPABILITY = (8, 0)
#: The two meanings of float32 maths on a GPU: IEEE single precision, or TF32 tensor cores.
FP32_MATH = ("ieee", "tf32")


def check_precision(precision: str, device: torch.device) -> str:
    """Validate ``precision`` for ``device``; returns it normalised (``off`` means ``fp32``)."""
    precision = {"off": "fp32", "none": "fp32", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(
        precision, precision)
    if precision not in PRECISIONS:
        raise UserError(f"unknown precision {precision!r}; choose one of: {', '.join(PRECISIONS)}")
    if precision == "fp16" and device.type != "cuda":
        raise UserError("fp16 autocast needs a CUDA GPU; on CPU use --amp bf16")
    if precision == "bf16" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < BF16_MIN_CAPABILITY:
            major, minor = capability
            raise UserError(f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no bf16 "
                            "tensor cores (they start at 8.0, Ampere): bf16 would be emulated; use --amp fp16")
    announce_bf16_emulation(precision, device)
    return precision


#: Notes already printed by this process: a script that checks several precisions says it once.
_ANNOUNCED: set[str] = set()


def announce_bf16_emulation(precision: str, device: torch.device, cpuinfo: str | None = None) -> str | None:
    """Say in one line (rank 0) when ``precision`` is bf16 on a CPU without native bf16; return that line.

    Such a CPU (no ``avx512_bf16``, no AMX) converts every bf16 value to fp32 and back, so bf16 runs
    *slower* than fp32 and a reference table made on a CPU with bf16 units misleads. The record of
    the run carries the same note (``common.results.make_record``), and the report lists it as a
    warning. ``cpuinfo`` is another machine's ``/proc/cpuinfo`` text (tests).
    """
    from common.runtime.distributed import print0
    from common.runtime.machine import bf16_emulation_note, cpu_description

    if precision not in ("bf16", "amp-bf16") or device.type != "cpu":
        return None
    note = bf16_emulation_note(cpu_description(cpuinfo))
    if note and note not in _ANNOUNCED:
        _ANNOUNCED.add(note)
        print0(f"note: {note}", flush=True)
    return note


def fp32_math() -> dict[str, str]:
    """The float32 maths in force on CUDA: ``{"matmul": "ieee"|"tf32", "cudnn_conv": "ieee"|"tf32"}``.

    With the new API a back end set to ``none`` inherits its parent's setting; when nothing is set
    anywhere, PyTorch's defaults apply (matmuls IEEE, cuDNN convolutions TF32).
    """
    if not new_tf32_api():
        return {"matmul": "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee",
                "cudnn_conv": "tf32" if torch.backends.cudnn.allow_tf32 else "ieee"}

    def resolve(*levels: str, default: str) -> str:
        return next((level for level in levels if level != "none"), default)

    generic = torch.backends.fp32_precision
    return {"matmul": resolve(torch.backends.cuda.matmul.fp32_precision, generic, default="ieee"),
            "cudnn_conv": resolve(torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.fp32_precision,
                                  generic, default="tf32")}


def set_fp32_math(mode: str) -> None:
    """Run float32 matmuls and cuDNN convolutions as ``ieee`` (real fp32) or on ``tf32`` tensor cores.

    Only GPUs from Ampere (compute capability 8.0) on have TF32; elsewhere both modes are IEEE.
    """
    if mode not in FP32_MATH:
        raise ValueError(f"fp32 maths is one of {FP32_MATH}, not {mode!r}")
    # The old flags first: PyTorch carries them over to the new API, so code that still reads them
    # (``allow_tf32``, ``torch.get_float32_matmul_precision()``, many libraries do) keeps working.
    # Setting only the new API leaves the old readers raising "a mix of the legacy and new APIs".
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    torch.backends.cudnn.allow_tf32 = mode == "tf32"
    if new_tf32_api():  # then spell every level out, so both APIs read the same mode (conv and RNN agree)
        torch.backends.cuda.matmul.fp32_precision = mode
        torch.backends.cudnn.conv.fp32_precision = mode
        torch.backends.cudnn.rnn.fp32_precision = mode


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """The forward-pass context: autocast for bf16/fp16, a no-op for fp32."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """A GradScaler that is active only for fp16 (elsewhere its calls pass straight through)."""
    return torch.amp.GradScaler(device.type, enabled=(precision == "fp16"))
