"""Datasheet peak TFLOP/s of the GPUs the course meets, per precision: one table for every script.

``pytorch_basics.py`` (Chapter 4) sets its matmul TFLOP/s against these, Lab-03 its models'.
:func:`gpu_peaks` matches a lower-case substring of ``torch.cuda.get_device_name()``, first match
wins, so the specific names come before the general ones ("H100 NVL" and "H100 PCIe" before "H100",
which is the SXM part: its name is ``NVIDIA H100 80GB HBM3``).

Dense figures, without 2:4 structured sparsity: NVIDIA's datasheets print the tensor-core figures
*with* sparsity and mark them with an asterisk; the dense figure is half of that. ``fp32`` is the
CUDA cores (TF32 off); ``tf32``, ``bf16`` and ``fp16`` are tensor cores; ``fp64`` is the FP64
tensor-core figure where the GPU has one (cuBLAS uses it for fp64 matmuls; cuDNN's double
convolutions rarely approach it). A precision a GPU lacks (bf16 and TF32 before Ampere) has no entry.

- A100: the LANTA chapter's table (FP32 19.5, FP16 tensor core 312) and the NVIDIA A100 Tensor Core GPU
  datasheet (FP64 tensor core 19.5, TF32 156, BF16 312 dense); PCIe and SXM4 peak alike.
- H100: NVIDIA H100 Tensor Core GPU datasheet. SXM: FP64 TC 67, FP32 67, TF32 989*, BF16/FP16
  1,979*; NVL: FP64 TC 60, FP32 60, TF32 835*, BF16/FP16 1,671*; PCIe: FP64 TC 51, FP32 51,
  TF32 756*, BF16/FP16 1,513* (* with sparsity, halved here).
- H200: NVIDIA H200 Tensor Core GPU datasheet. SXM: as H100 SXM; NVL: as H100 NVL.
- V100: NVIDIA Tesla V100 datasheet. SXM2: FP64 7.8, FP32 15.7, tensor (fp16) 125; PCIe: 7, 14,
  112; V100S PCIe: 8.2, 16.4, 130. DGX-2's SXM3 parts (the SJTU page's dgx2 partition) clock slightly
  higher and are given the SXM2 figures.

This module must not import torch.
"""

from __future__ import annotations

PRECISIONS = ("fp64", "fp32", "tf32", "bf16", "fp16")

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
#: ``(substring, GPU, {precision: dense TFLOP/s})``, most specific name first.
GPU_PEAKS: list[tuple[str, str, dict[str, float]]] = [
    (key, gpu, {precision: float(value) for precision, value in zip(PRECISIONS, values) if value is not None})
    for key, gpu, values in _ROWS
]


def gpu_peaks(device_name: str) -> tuple[str | None, dict[str, float]]:
    """``("H100 NVL", {"fp32": 60.0, ...})`` for a CUDA device name; ``(None, {})`` when not in the table."""
    name = device_name.lower()
    for key, gpu, peaks in GPU_PEAKS:
        if key in name:
            return gpu, dict(peaks)
    return None, {}


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Dense datasheet TFLOP/s of a CUDA device at one of :data:`PRECISIONS`; ``None`` when not in the table.

    The figure to divide an achieved TFLOP/s by (model FLOPs utilisation): the precision is the one
    the matrix maths ran in (``bf16`` for bfloat16 autocast, ``tf32`` for float32 on TF32 tensor cores).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision is one of {PRECISIONS}, not {precision!r}")
    return gpu_peaks(device_name)[1].get(precision)
