"""Mixed precision in one place: an autocast context and a matching gradient scaler.

=========  ================================  ==========================================
precision  autocast                          GradScaler
=========  ================================  ==========================================
``fp32``   none (``nullcontext``)            disabled (a pass-through)
``bf16``   ``torch.autocast(dev, bfloat16)``  disabled: bf16 has fp32's exponent range
``fp16``   ``torch.autocast(cuda, float16)``  enabled: small fp16 gradients underflow to 0
                                              unless the loss is scaled up first
=========  ================================  ==========================================

fp16 autocast is a CUDA feature here; on CPU use bf16. Uses the current APIs only:
``torch.autocast(device_type, dtype)`` and ``torch.amp.GradScaler(device)``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from common.errors import UserError

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str, device: torch.device) -> str:
    """Validate ``precision`` for ``device``; returns it normalised (``off`` means ``fp32``)."""
    precision = {"off": "fp32", "none": "fp32", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(
        precision, precision)
    if precision not in PRECISIONS:
        raise UserError(f"unknown precision {precision!r}; choose one of: {', '.join(PRECISIONS)}")
    if precision == "fp16" and device.type != "cuda":
        raise UserError("fp16 autocast needs a CUDA GPU; on CPU use --amp bf16")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError(f"{torch.cuda.get_device_name(device)} does not support bf16; use --amp fp16")
    return precision


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """The forward-pass context: autocast for bf16/fp16, a no-op for fp32."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """A GradScaler that is active only for fp16 (elsewhere its calls pass straight through)."""
    return torch.amp.GradScaler(device.type, enabled=(precision == "fp16"))
