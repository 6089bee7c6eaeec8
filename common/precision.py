"""Precision in one place: its names, what a device does natively, the datasheet peaks, and utilisation.

Every script of the course asks this module, never its own rule:

- **Names.** A run trains in one of :data:`TRAINING` (``fp32``, or autocast to ``bf16``/``fp16``), chosen
  with ``--precision``. Matrix maths runs in one of :data:`MATH` (the datasheet's columns: ``fp64``,
  ``fp32``, ``tf32``, ``bf16``, ``fp16``); :func:`math_of` maps any name the course uses (Lab-03's
  ``half``, ``amp-bf16`` ...) to the maths it runs in.
- **What "fp32" means on a GPU.** From Ampere on, PyTorch may run float32 matmuls and cuDNN convolutions
  on TF32 tensor cores (10-bit mantissa); its default is TF32 *on* for convolutions and off for matmuls,
  so a default "fp32" run is a hybrid. :func:`set_fp32_math` chooses one meaning for both
  (``common.runtime.device.resolve_device`` picks ``ieee``, real fp32, for every CUDA run), and
  :func:`fp32_math` reads the setting in force, which every record carries (``provenance.fp32_math``).
- **Native or emulated.** bf16 and TF32 tensor cores arrived with NVIDIA's compute capability 8.0
  (Ampere); ``torch.cuda.is_bf16_supported()`` says yes on a V100 too, where bf16 is emulated, so
  :func:`gpu_support` asks the capability. A CPU runs bf16 natively only with ``avx512_bf16``, AMX or
  ARM's ``bf16`` (``/proc/cpuinfo``, :func:`cpu_support`); elsewhere PyTorch converts every value to
  fp32 and back, and bf16 is *slower* than fp32. :func:`check` refuses what a device cannot run and says
  in one line when bf16 will be emulated.
- **Peaks and utilisation.** :data:`GPU_PEAKS` holds the dense datasheet TFLOP/s of the GPUs the course
  meets; :func:`peak` gives the one to divide by for a precision on a device (an ``fp32`` run uses TF32's
  peak where TF32 is in force), and :func:`utilisation` turns achieved FLOPs per second into the record
  keys every lab writes: ``achieved_tflops``, ``peak_tflops``, ``peak_precision``, ``mfu`` (the
  fraction of the peak) and ``mfu_reason`` (why there is none).

Peaks, dense, without 2:4 structured sparsity (NVIDIA's datasheets print tensor-core figures *with*
sparsity and mark them with an asterisk; the dense figure is half of that). ``fp32`` is the CUDA cores;
``tf32``, ``bf16``, ``fp16`` are tensor cores; ``fp64`` is the FP64 tensor-core figure where a GPU has one.
- A100: the LANTA chapter's table (FP32 19.5, FP16 tensor core 312) and NVIDIA's A100 datasheet
  (FP64 tensor core 19.5, TF32 156, BF16 312 dense); PCIe and SXM4 peak alike.
- H100: NVIDIA's H100 datasheet. SXM: FP64 TC 67, FP32 67, TF32 989*, BF16/FP16 1,979*; NVL: 60, 60,
  835*, 1,671*; PCIe: 51, 51, 756*, 1,513* (* with sparsity, halved here). H200: as H100 SXM and NVL.
- V100: NVIDIA's Tesla V100 datasheet. SXM2: FP64 7.8, FP32 15.7, tensor (fp16) 125; PCIe: 7, 14, 112;
  V100S PCIe: 8.2, 16.4, 130. DGX-2's SXM3 parts clock slightly higher and get the SXM2 figures.

This module imports torch only inside the functions that need a device (the report and
``common.runtime.machine`` read its tables without torch). It sits below ``common.runtime``
(``docs/architecture.md``).
"""

from __future__ import annotations

from typing import Any, Mapping

from common.errors import UserError

__all__ = ["TRAINING", "MATH", "FP32_MATH", "BF16_MIN_CAPABILITY", "GPU_PEAKS", "X86_FLAGS", "ARM_FEATURES",
           "normalise", "math_of", "fp32_math", "set_fp32_math", "read_cpuinfo", "cpuinfo_blocks", "cpu_flags",
           "cpu_support", "gpu_support",
           "emulation_note", "BF16_EMULATION_PREFIX", "check", "gpu_peaks", "peak_of", "peak", "utilisation",
           "describe_utilisation"]

#: What a run trains in: float32, or autocast to bfloat16 or float16 (``--precision``).
TRAINING = ("fp32", "bf16", "fp16")
#: What matrix maths runs in: the datasheet's columns.
MATH = ("fp64", "fp32", "tf32", "bf16", "fp16")
#: The two meanings of float32 maths on a GPU: IEEE single precision, or TF32 tensor cores.
FP32_MATH = ("ieee", "tf32")
#: bfloat16 and TF32 tensor cores arrived with Ampere (A100, compute capability 8.0).
BF16_MIN_CAPABILITY = (8, 0)
#: Other spellings a user or an older record may use, by the course's name.
_ALIASES = {"off": "fp32", "none": "fp32", "float32": "fp32", "float": "fp32", "bfloat16": "bf16",
            "float16": "fp16", "half": "fp16", "amp-bf16": "bf16", "amp-fp16": "fp16", "double": "fp64",
            "float64": "fp64"}


def normalise(name: str) -> str:
    """The course's name for a precision (``float16``, ``half`` and ``amp-fp16`` are all ``fp16``)."""
    name = name.strip().lower()
    return _ALIASES.get(name, name)


def math_of(name: str, tf32_in_force: bool = False) -> str:
    """The maths a precision's matmuls run in: one of :data:`MATH` (fp32 is tf32 where TF32 is in force)."""
    maths = normalise(name)
    if maths not in MATH:
        raise ValueError(f"precision is one of {', '.join(MATH)} (or an alias), not {name!r}")
    return "tf32" if maths == "fp32" and tf32_in_force else maths


# --------------------------------------------------------------------------------------------
# What fp32 means on a GPU


def fp32_math() -> dict[str, str]:
    """The float32 maths in force on CUDA: ``{"matmul": "ieee"|"tf32", "cudnn_conv": "ieee"|"tf32"}``.

    With the new API a back end set to ``none`` inherits its parent's setting; when nothing is set
    anywhere, PyTorch's defaults apply (matmuls IEEE, cuDNN convolutions TF32).
    """
    import torch

    from common.runtime.compat import new_tf32_api

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
    import torch

    from common.runtime.compat import new_tf32_api

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
        # torch.set_float32_matmul_precision("high") also sets the CPU's (oneDNN's) matmuls to TF32; left so beside
        # IEEE CUDA matmuls, torch.get_float32_matmul_precision() raises ("a mix of the legacy and new APIs"),
        # and inductor reads it. The CPU's matmuls go back to PyTorch's default, real fp32, in either mode.
        mkldnn = getattr(torch.backends.mkldnn, "matmul", None)
        if getattr(mkldnn, "fp32_precision", "none") != "none":
            mkldnn.fp32_precision = "none"


# --------------------------------------------------------------------------------------------
# Native or emulated

#: x86 flags that decide low-precision speed, and ARM's features (``Features`` in /proc/cpuinfo).
X86_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "avx_vnni")
ARM_FEATURES = ("bf16", "fphp", "asimdhp", "sve", "i8mm")
_CPU_NATIVE = {"x86": {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16",)},
               "arm": {"bf16": ("bf16",), "fp16": ("fphp", "asimdhp")}}
#: How :func:`emulation_note` begins: the report finds the note in a record's notes by it.
BF16_EMULATION_PREFIX = "bf16 is emulated on this CPU"


def read_cpuinfo(path: str = "/proc/cpuinfo") -> str | None:
    """The text of ``/proc/cpuinfo``; ``None`` where there is none (macOS, Windows)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def cpuinfo_blocks(cpuinfo: str) -> list[dict[str, str]]:
    """One ``{field: value}`` per logical CPU of a ``/proc/cpuinfo`` text (blocks separated by blank lines)."""
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


def cpu_flags(first: Mapping[str, str]) -> tuple[str | None, set[str], tuple[str, ...]]:
    """``(family, flags present, flags that matter)`` from a CPU's ``/proc/cpuinfo`` block."""
    if "flags" in first:
        return "x86", set(first["flags"].split()), X86_FLAGS
    if "Features" in first:
        return "arm", set(first["Features"].split()), ARM_FEATURES
    return None, set(), ()


def cpu_support(kind: str, family: str | None, present: set[str]) -> str:
    """``native``, ``emulated`` or ``unknown``: does a CPU with these flags run ``kind`` (bf16, fp16) itself?"""
    if family is None:
        return "unknown"
    return "native" if present & set(_CPU_NATIVE[family][kind]) else "emulated"


def gpu_support(kind: str, capability: tuple[int, int] | None) -> str | None:
    """``native`` or ``emulated`` for bf16 or tf32 on a GPU of this compute capability (``None``: unknown).

    fp16 tensor cores exist from Volta (7.0) on; bf16 and TF32 from Ampere (8.0).
    """
    if capability is None:
        return None
    floor = (7, 0) if normalise(kind) == "fp16" else BF16_MIN_CAPABILITY
    return "native" if tuple(capability) >= floor else "emulated"


def emulation_note(cpu: Mapping[str, Any]) -> str | None:
    """The one line a bf16 run on this CPU prints, and its record keeps; ``None`` when bf16 is native
    (or the flags could not be read). ``cpu`` is ``common.runtime.machine.cpu_description()``."""
    if cpu.get("bf16") != "emulated":
        return None
    missing = "no avx512_bf16 or AMX" if "avx2" in (cpu.get("isa") or {}) else "no bf16 instructions"
    return (f"{BF16_EMULATION_PREFIX} ({cpu.get('model')}: {missing}): PyTorch converts to fp32 and back, "
            "so bf16 runs slower than fp32 here; its timings say nothing about bf16 hardware")


def check(precision: str, device: Any, flag: str = "--precision") -> str:
    """``precision`` normalised, after refusing (one :class:`UserError` line) what ``device`` cannot train in.

    fp16 autocast is a CUDA recipe here (on a CPU use bf16); bf16 on a GPU older than Ampere would be
    emulated. bf16 on a CPU without bf16 instructions runs (slowly): the caller says so
    (``common.train.amp.check_precision`` prints :func:`emulation_note` once).
    """
    name = normalise(precision)
    if name not in TRAINING:
        raise UserError(f"unknown precision {precision!r}; choose one of: {', '.join(TRAINING)}")
    if name == "fp16" and device.type != "cuda":
        raise UserError(f"fp16 autocast needs a CUDA GPU; on CPU use {flag} bf16")
    if name == "bf16" and device.type == "cuda":
        import torch

        capability = tuple(torch.cuda.get_device_capability(device))
        if gpu_support("bf16", capability) != "native":
            raise UserError(f"{torch.cuda.get_device_name(device)} "
                            f"(compute capability {capability[0]}.{capability[1]}) "
                            f"has no bf16 tensor cores (they start at 8.0, Ampere): bf16 would be emulated; use "
                            f"{flag} fp16")
    return name


# --------------------------------------------------------------------------------------------
# Datasheet peaks and utilisation

_ROWS: list[tuple[str, str, tuple[float | None, ...]]] = [
    # name contains  GPU           fp64   fp32   tf32   bf16   fp16    (None: not supported)
    ("h200 nvl",     "H200 NVL",   (60,   60,    417.5, 835.5, 835.5)),
    ("h200",         "H200 SXM",   (67,   67,    494.5, 989.5, 989.5)),
    ("h100 nvl",     "H100 NVL",   (60,   60,    417.5, 835.5, 835.5)),
    ("h100 pcie",    "H100 PCIe",  (51,   51,    378,   756,   756)),
    ("h100",         "H100 SXM",   (67,   67,    494.5, 989.5, 989.5)),
    ("a100",         "A100",       (19.5, 19.5,  156,   312,   312)),
    ("v100s",        "V100S PCIe", (8.2,  16.4,  None,  None,  130)),
    ("v100-pcie",    "V100 PCIe",  (7,    14,    None,  None,  112)),
    ("v100",         "V100 SXM2",  (7.8,  15.7,  None,  None,  125)),
]
#: ``(substring of the CUDA device name, GPU, {maths: dense TFLOP/s})``, the most specific name first
#: ("H100 NVL" before "H100", which is the SXM part: its name is ``NVIDIA H100 80GB HBM3``).
GPU_PEAKS: list[tuple[str, str, dict[str, float]]] = [
    (key, gpu, {maths: float(value) for maths, value in zip(MATH, values) if value is not None})
    for key, gpu, values in _ROWS
]


def gpu_peaks(device_name: str) -> tuple[str | None, dict[str, float]]:
    """``("H100 NVL", {"fp32": 60.0, ...})`` for a CUDA device name; ``(None, {})`` when not in the table."""
    name = device_name.lower()
    for key, gpu, peaks in GPU_PEAKS:
        if key in name:
            return gpu, dict(peaks)
    return None, {}


_CPU_PEAK = "no peak known for a CPU (it depends on cores, clock and vector units)"


def peak_of(device_name: str | None, maths: str) -> tuple[float | None, str]:
    """``(dense TFLOP/s, where it comes from)`` of a CUDA device by name at one of :data:`MATH`;
    ``None`` and why where the table has none (``device_name`` ``None``: a CPU)."""
    if device_name is None:
        return None, _CPU_PEAK
    gpu, peaks = gpu_peaks(device_name)
    if gpu is None:
        return None, f"no datasheet peak for {device_name!r} in common.precision.GPU_PEAKS"
    if maths not in peaks:
        return None, f"the {gpu} datasheet lists no {maths} peak"
    return peaks[maths], f"{gpu} datasheet, {maths}, dense"


def peak(device: Any, precision: str) -> tuple[float | None, str, str]:
    """``(dense TFLOP/s, the maths it is for, where the figure comes from or why there is none)``.

    ``precision`` is any name of the course; an fp32 run divides by TF32's peak where cuBLAS or cuDNN
    may use TF32 tensor cores (:func:`fp32_math`). A CPU has no datasheet peak here: it depends on the
    cores, the clock and the vector units.
    """
    if getattr(device, "type", device) != "cuda":
        return None, math_of(precision), _CPU_PEAK
    import torch

    maths = math_of(precision, tf32_in_force="tf32" in fp32_math().values())
    value, source = peak_of(torch.cuda.get_device_name(device), maths)
    return value, maths, source


def utilisation(flops_per_s: float | None, device: Any, precision: str, devices: int = 1) -> dict[str, Any]:
    """What a run achieved against the hardware, as every record stores it.

    ``flops_per_s`` is the whole job's (model FLOPs, or FLOPs counted by PyTorch's counter), spread
    over ``devices``; ``mfu`` is the fraction of one device's dense peak, ``None`` with ``mfu_reason``
    when there is no peak or nothing was timed.
    """
    top, maths, source = peak(device, precision)
    achieved = flops_per_s / devices / 1e12 if flops_per_s else None
    mfu = achieved / top if achieved is not None and top else None
    reason = None if mfu is not None else (source if top is None else "no step was timed (a run no longer than "
                                           "its warm-up) or no FLOPs counted")
    return {"achieved_tflops": achieved, "peak_tflops": top, "peak_precision": maths, "peak_source": source,
            "mfu": mfu, "mfu_reason": reason}


def describe_utilisation(speed: Mapping[str, Any]) -> str:
    """``271.2 TFLOP/s per device = MFU 27.4% of 989.5 (bf16 dense peak)``, or why there is no MFU."""
    if speed.get("mfu") is None:
        return f"MFU n/a: {speed.get('mfu_reason')}"
    return (f"{speed['achieved_tflops']:.1f} TFLOP/s per device = MFU {100 * speed['mfu']:.1f}% of "
            f"{speed['peak_tflops']:g} ({speed['peak_precision']} dense peak)")
