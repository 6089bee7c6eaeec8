"""What the machine could do: the CPU (model, cores, the instruction sets that decide bf16/fp16
speed) and the GPU with its datasheet peaks, as every result record carries it
(``provenance.machine``, schema version 3), and the label a report tells machines apart by.

Two cloud VMs can both call their CPU "AMD EPYC" and differ tenfold in bf16 speed: one has
``avx512_bf16`` (or Intel's AMX) and runs bf16 matmuls natively, the other has only AVX2 and
PyTorch converts every bf16 value to fp32 and back (bf16 is then *slower* than fp32). The flags in
``/proc/cpuinfo`` say which; :func:`cpu_description` reads them, :func:`machine_label` puts the
verdict into the name a report groups runs by.

This module must not import torch (the report reads it).
"""

from __future__ import annotations

import os
import platform
from typing import Any, Mapping

from common.runtime.cpus import usable_cpus
from common.measure.gpu_peaks import gpu_peaks

__all__ = ["X86_FLAGS", "ARM_FEATURES", "BF16_EMULATION_PREFIX", "read_cpuinfo", "cpu_description", "gpu_description",
           "machine_label",
           "describe_machine", "bf16_emulation_note"]

#: x86 flags that decide low-precision speed: bf16 runs natively with avx512_bf16 or AMX (amx_bf16 on
#: amx_tile), fp16 with avx512_fp16; avx_vnni/avx512f/avx2 are the vector units oneDNN falls back to.
X86_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "avx_vnni")
#: ARM features (``Features`` in /proc/cpuinfo): bf16 instructions, half-precision arithmetic, SVE.
ARM_FEATURES = ("bf16", "fphp", "asimdhp", "sve", "i8mm")
#: How :func:`bf16_emulation_note` begins: the report finds the note in a record's notes by it.
BF16_EMULATION_PREFIX = "bf16 is emulated on this CPU"
_NATIVE = {"x86": {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16",)},
           "arm": {"bf16": ("bf16",), "fp16": ("fphp", "asimdhp")}}


def read_cpuinfo(path: str = "/proc/cpuinfo") -> str | None:
    """The text of ``/proc/cpuinfo``; ``None`` where there is none (macOS, Windows)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def _blocks(cpuinfo: str) -> list[dict[str, str]]:
    """One ``{field: value}`` per logical CPU (blocks separated by blank lines)."""
    blocks = []
    for chunk in cpuinfo.strip().split("\n\n"):
        fields = {}
        for line in chunk.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        if fields:
            blocks.append(fields)
    return blocks


def cpu_description(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU as a record stores it: model, cores, the relevant flags, and bf16/fp16 ``native``,
    ``emulated`` or ``unknown``.

    ``cpuinfo`` is the text of ``/proc/cpuinfo`` (read from the machine when ``None``; tests pass
    another machine's). ``physical_cores`` counts distinct (package, core) pairs, ``logical_cpus``
    the hardware threads, ``usable_cpus`` the ones this process may run on (its affinity mask).
    """
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    blocks = _blocks(text) if text else []
    processors = [b for b in blocks if "processor" in b] or blocks
    first = processors[0] if processors else {}
    if "flags" in first:
        family, present, checked = "x86", set(first["flags"].split()), X86_FLAGS
    elif "Features" in first:
        family, present, checked = "arm", set(first["Features"].split()), ARM_FEATURES
    else:
        family, present, checked = None, set(), ()
    cores = {(b.get("physical id", "0"), b["core id"]) for b in processors if "core id" in b}
    model = first.get("model name") or first.get("Model") or platform.processor() or platform.machine()
    description: dict[str, Any] = {
        "model": model,
        "architecture": platform.machine(),
        "physical_cores": len(cores) or None,
        "logical_cpus": len(processors) or os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "isa": {flag: flag in present for flag in checked},
    }
    for kind in ("bf16", "fp16"):
        if family is None:
            description[kind] = "unknown"
        else:
            description[kind] = "native" if present & set(_NATIVE[family][kind]) else "emulated"
    return description


def gpu_description(name: str, capability: tuple[int, int] | None = None,
                    total_memory_bytes: int | None = None) -> dict[str, Any]:
    """A GPU as a record stores it, with its dense datasheet peaks (``common.measure.gpu_peaks``)."""
    peaks_name, peaks = gpu_peaks(name)
    entry: dict[str, Any] = {"name": name, "capability": f"{capability[0]}.{capability[1]}" if capability else None,
                             "total_memory_bytes": total_memory_bytes,
                             "peak_tflops": peaks, "peaks_from": peaks_name}
    if capability is not None:  # bf16 tensor cores arrived with compute capability 8.0 (Ampere)
        entry["bf16"] = "native" if tuple(capability) >= (8, 0) else "emulated"
    return entry


def _machine(prov: Mapping[str, Any]) -> Mapping[str, Any]:
    machine = prov.get("machine") if isinstance(prov, Mapping) else None
    return machine if isinstance(machine, Mapping) else {}


def machine_label(prov: Mapping[str, Any]) -> str:
    """Which machine a record's numbers belong to, short enough for a table cell.

    ``where · device`` (the host, or on Slurm the cluster; the GPU, or the CPU model) and, for a
    CPU run, its logical CPUs and whether bf16 is native: two "vm · AMD EPYC" with and without
    ``avx512_bf16`` are different machines. A record written before schema 3 has no flags:
    ``bf16 unknown``.
    """
    slurm = prov.get("slurm") if isinstance(prov.get("slurm"), Mapping) else {}
    cluster = str(slurm.get("SLURM_CLUSTER_NAME") or "").strip()
    host = str(prov.get("hostname") or "").strip()
    where = f"{cluster} (Slurm)" if cluster else (host or "unknown host")
    device = prov.get("device") if isinstance(prov.get("device"), Mapping) else {}
    name = str(device.get("name") or "").strip()
    parts = [where, name] if name else [where]
    if device.get("type") == "cpu":
        cpu = _machine(prov).get("cpu") if isinstance(_machine(prov).get("cpu"), Mapping) else {}
        cpus = cpu.get("logical_cpus") or device.get("cpu_count")
        if cpus:
            parts.append(f"{cpus} CPUs")
        parts.append(f"bf16 {cpu.get('bf16') or 'unknown'}")
    return " · ".join(parts)


def describe_machine(prov: Mapping[str, Any]) -> str:
    """What a record says the machine could do, in one line (the report's provenance, README headings)."""
    machine = _machine(prov)
    cpu = machine.get("cpu") if isinstance(machine.get("cpu"), Mapping) else None
    if cpu is None:
        return "capabilities not recorded (written before schema version 3)"
    isa = cpu.get("isa") or {}
    # In the order of X86_FLAGS/ARM_FEATURES, not the record's (its JSON keys are sorted).
    flags = [flag for flag in (*X86_FLAGS, *ARM_FEATURES) if isa.get(flag)]
    cores = ", ".join(f"{value} {what}" for value, what in ((cpu.get("physical_cores"), "cores"),
                                                          (cpu.get("logical_cpus"), "CPUs"),
                                                          (cpu.get("usable_cpus"), "usable")) if value)
    text = (f"{cpu.get('model')} ({cores}; {' '.join(flags) or 'none of the bf16/fp16 flags'}): "
            f"bf16 {cpu.get('bf16')}, fp16 {cpu.get('fp16')} on the CPU")
    for gpu in machine.get("gpus") or []:
        if isinstance(gpu, Mapping):
            peaks = gpu.get("peak_tflops") or {}
            shown = ", ".join(f"{p} {v:g}" for p, v in peaks.items() if p in ("fp32", "tf32", "bf16", "fp16"))
            text += (f"; GPU {gpu.get('name')} (datasheet dense TFLOP/s: {shown})" if shown
                     else f"; GPU {gpu.get('name')} (no datasheet peak in common/measure/gpu_peaks.py)")
    return text


def bf16_emulation_note(cpu: Mapping[str, Any]) -> str | None:
    """The one line a bf16 run on this CPU prints, and its record keeps; ``None`` when bf16 is native
    (or the flags could not be read)."""
    if cpu.get("bf16") != "emulated":
        return None
    missing = "no avx512_bf16 or AMX" if "avx2" in (cpu.get("isa") or {}) else "no bf16 instructions"
    return (f"{BF16_EMULATION_PREFIX} ({cpu.get('model')}: {missing}): PyTorch converts to fp32 and back, "
            "so bf16 runs slower than fp32 here; its timings say nothing about bf16 hardware")
