"""Byte counts for people: one formatter for the scripts' progress lines, the report and the environment check.

Binary units (1 GiB = 1024**3 bytes), as ``nvidia-smi`` and ``free -h`` show them, one decimal;
whole bytes below 1 KiB. This module must not import torch: the report uses it.
"""

from __future__ import annotations

__all__ = ["byte_unit", "format_bytes"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def byte_unit(n: float) -> tuple[str, int]:
    """The unit ``n`` bytes read best in, and its size in bytes: ``("GiB", 1024**3)`` for 3e9."""
    scale = 1
    for unit in _UNITS[:-1]:
        if abs(n) < 1024 * scale:
            return unit, scale
        scale *= 1024
    return _UNITS[-1], scale


def format_bytes(n: float | None, *, unit: str | None = None, missing: str = "n/a") -> str:
    """``n`` bytes as ``3.2 GiB`` (``512 B`` below 1 KiB); ``missing`` when ``n`` is ``None``.

    ``unit`` fixes the unit (``"GiB"`` for a column of GPU memories) instead of choosing it from ``n``.
    """
    if n is None:
        return missing
    unit, scale = (unit, 1024 ** _UNITS.index(unit)) if unit else byte_unit(n)
    return f"{int(n)} B" if unit == "B" else f"{n / scale:.1f} {unit}"
