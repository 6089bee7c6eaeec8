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

from common.precision import (ARM_FEATURES, X86_FLAGS, cpu_flags, cpu_support, cpuinfo_blocks, gpu_peaks,
                              gpu_support, read_cpuinfo)
from common.runtime.cpus import usable_cpus

__all__ = ["cpu_description", "gpu_description", "machine_label", "describe_machine"]


def cpu_description(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU as a record stores it: model, cores, the relevant flags, and bf16/fp16 ``native``,
    ``emulated`` or ``unknown`` (:func:`common.precision.cpu_support`).

    ``cpuinfo`` is the text of ``/proc/cpuinfo`` (read from the machine when ``None``; tests pass
    another machine's). ``physical_cores`` counts distinct (package, core) pairs, ``logical_cpus``
    the hardware threads, ``usable_cpus`` the ones this process may run on (its affinity mask).
    """
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    blocks = cpuinfo_blocks(text) if text else []
    processors = [b for b in blocks if "processor" in b] or blocks
    first = processors[0] if processors else {}
    family, present, checked = cpu_flags(first)
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
        description[kind] = cpu_support(kind, family, present)
    return description


def gpu_description(name: str, capability: tuple[int, int] | None = None,
                    total_memory_bytes: int | None = None) -> dict[str, Any]:
    """A GPU as a record stores it, with its dense datasheet peaks (``common.precision.GPU_PEAKS``)."""
    peaks_name, peaks = gpu_peaks(name)
    entry: dict[str, Any] = {"name": name, "capability": f"{capability[0]}.{capability[1]}" if capability else None,
                             "total_memory_bytes": total_memory_bytes,
                             "peak_tflops": peaks, "peaks_from": peaks_name}
    if capability is not None:
        entry["bf16"] = gpu_support("bf16", capability)
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
                     else f"; GPU {gpu.get('name')} (no datasheet peak in common.precision.GPU_PEAKS)")
    return text
