"""The tables and rules behind ``benchmark_models.py`` that need no PyTorch.

Kept apart so that the benchmark script shows the measuring, and so that the report and the tests
can use these without importing torch:

- :func:`unsupported_reason`, which says why a precision of :data:`common.precision_names.PRECISIONS`
  cannot run on a device (the reason goes into the CSV summary and the record).
- :func:`peak_tflops`: the datasheet peak of known GPUs per precision (``common.gpu_peaks``), to
  put an achieved TFLOP/s next to what the device could do.
- :func:`compare_losses`: the correctness check of a precision against fp32, and its threshold.
- :func:`csv_name`, :func:`iterations_csv`, :func:`summary_csv`: the CSV layout of the seed's
  ``benchmark_models.py`` (one file per mode and precision, a column per model, a row per
  iteration, milliseconds per batch), plus one summary file that also lists what was skipped.
"""

from __future__ import annotations

import csv
import io
import math
import re
from typing import Any, Iterable, Mapping, Sequence

from common.errors import UserError
from common.gpu_peaks import gpu_peaks
from common.precision_names import PRECISIONS

LAB = "lab03"
SCRIPT = "labs/lab03_precision_benchmark/benchmark_models.py"

#: The models of the seed's table, in its order.
SEED_MODELS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d",
               "resnext101_32x8d", "wide_resnet50_2", "wide_resnet101_2")
#: ImageNet's classes, as the seed's models had.
NUM_CLASSES = 1000


#: A precision is flagged when its loss after the check steps is off fp32's by more than this
#: fraction of the initial loss (or is NaN/inf). Why 5%: bfloat16 keeps 8 significant bits (a
#: rounding error of up to 0.4% per operation) and float16 11; on ResNets at 224x224 the healthy
#: precisions land within about 1% of fp32 after three SGD steps (lab README, "Correctness").
#: A precision that breaks training is much further off: gradients that underflow to zero leave the
#: loss at its start, overflow gives inf or NaN. The initial loss (about ln 1000 = 6.9 at random
#: initialisation) is the scale, not the final loss: that one tends to zero as the steps fit the one
#: batch, and a ratio to a number near zero makes harmless rounding look large.
DEFAULT_LOSS_TOLERANCE = 0.05


def parse_list(text: str, valid: Sequence[str], what: str) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``, each checked against ``valid`` (order kept, repeats dropped)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise UserError(f"no {what} given; choose from: {', '.join(valid)}")
    unknown = [name for name in names if name not in valid]
    if unknown:
        raise UserError(f"unknown {what} {', '.join(map(repr, unknown))}; valid {what}: {', '.join(valid)}")
    return list(dict.fromkeys(names))


def unsupported_reason(precision: str, device_type: str, device_name: str = "",
                       capability: tuple[int, int] | None = None) -> str | None:
    """Why ``precision`` cannot run on this device, or ``None`` when it can.

    ``capability`` is the CUDA compute capability (``(8, 0)`` for an A100). Float16 on a CPU does
    run (recent PyTorch has CPU kernels for it), but a CPU without float16 arithmetic converts to
    float32 inside each kernel, so it is measured and expected to be slower than fp32.
    """
    if precision not in PRECISIONS:
        raise UserError(f"unknown precision {precision!r}; valid precisions: {', '.join(PRECISIONS)}")
    if device_type == "cpu":
        if precision == "tf32":
            return "TF32 is a tensor-core format of NVIDIA GPUs from Ampere (sm_80) on; CPUs have no TF32 mode"
        if precision == "amp-fp16":
            return ("amp-fp16 (float16 autocast + GradScaler) is the CUDA recipe; common.amp runs fp16 autocast "
                    "on CUDA only. On a CPU use amp-bf16, which needs no scaler")
        return None
    if device_type == "cuda" and capability is not None and capability < (8, 0):
        arch = f"sm_{capability[0]}{capability[1]}"
        name = f"{device_name} ({arch})" if device_name else arch
        if precision == "tf32":
            return f"TF32 tensor cores arrived with Ampere (sm_80); on {name} tf32 would be plain fp32"
        if precision == "amp-bf16":
            return f"{name} has no bfloat16 tensor cores (Ampere, sm_80, added them); PyTorch would emulate bf16 slowly"
    return None


# --------------------------------------------------------------------------------------------
# Peak TFLOP/s: the datasheet table in common.gpu_peaks (shared with Chapter 4's pytorch_basics.py),
# read with this lab's precision names. half and amp-fp16 are both float16 tensor-core maths.

#: This lab's precisions by their name in common.gpu_peaks.
_PEAK_PRECISION = {"fp64": "fp64", "fp32": "fp32", "tf32": "tf32", "half": "fp16", "amp-fp16": "fp16",
                   "amp-bf16": "bf16"}


def peak_tflops(device_type: str, device_name: str, precision: str) -> tuple[float | None, str]:
    """``(peak TFLOP/s, where the figure comes from)`` of one device; ``None`` when not known."""
    if device_type != "cuda":
        return None, "not known for CPUs (it depends on cores, clock and vector units)"
    gpu, peaks = gpu_peaks(device_name)
    if gpu is None:
        return None, f"no datasheet figure for {device_name!r} in common/gpu_peaks.py"
    value, source = peaks.get(_PEAK_PRECISION[precision]), f"{gpu} datasheet"
    return (value, source) if value is not None else (None, f"{source} lists no {precision} figure")


# --------------------------------------------------------------------------------------------
# Correctness against fp32


def compare_losses(losses: Sequence[float], reference: Sequence[float],
                   tolerance: float = DEFAULT_LOSS_TOLERANCE) -> dict[str, Any]:
    """Compare the loss after the check steps with fp32's (same initial weights, same batch).

    ``relative_diff`` is ``|loss - fp32 loss| / fp32's first loss`` (see
    :data:`DEFAULT_LOSS_TOLERANCE` for why the first loss is the scale). ``diverged`` is true when the
    loss is NaN/inf or ``relative_diff`` exceeds ``tolerance``; ``reason`` says which.
    """
    loss, ref_loss, scale = losses[-1], reference[-1], abs(reference[0]) or 1.0
    result: dict[str, Any] = {"steps": len(losses), "losses": list(losses), "fp32_losses": list(reference),
                              "loss": loss, "fp32_loss": ref_loss, "tolerance": tolerance,
                              "abs_diff": None, "relative_diff": None, "diverged": False, "reason": ""}
    if not all(math.isfinite(v) for v in losses):
        result.update(diverged=True, reason="loss became NaN or inf")
        return result
    result["abs_diff"] = abs(loss - ref_loss)
    result["relative_diff"] = result["abs_diff"] / scale
    if result["relative_diff"] > tolerance:
        result.update(diverged=True, reason=(f"loss after {len(losses)} steps is {loss:.4g}, fp32's is "
                                             f"{ref_loss:.4g}: {result['relative_diff']:.1%} of the initial loss, "
                                             f"over the {tolerance:.0%} tolerance"))
    return result


# --------------------------------------------------------------------------------------------
# CSV output


def device_tag(device_type: str, device_name: str, world_size: int) -> str:
    """The seed's file-name prefix, ``<device name>_<N>_gpus`` (``cpu_<N>_procs`` on a CPU)."""
    if device_type != "cuda":
        return f"cpu_{world_size}_procs"
    slug = re.sub(r"[^A-Za-z0-9.-]+", "-", device_name).strip("-") or "cuda"
    return f"{slug}_{world_size}_gpus"


def csv_name(tag: str, precision: str, mode: str) -> str:
    """``<tag>_<precision>_model_<mode>_benchmark.csv``, as the seed names its files."""
    return f"{tag}_{precision}_model_{mode}_benchmark.csv"


def iterations_csv(ms_by_model: Mapping[str, Sequence[float]]) -> str:
    """The seed's layout: one column per model, one row per timed iteration, ms per batch."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    models = list(ms_by_model)
    writer.writerow(models)
    rows = max((len(v) for v in ms_by_model.values()), default=0)
    for i in range(rows):
        writer.writerow([f"{ms_by_model[m][i]:.4f}" if i < len(ms_by_model[m]) else "" for m in models])
    return out.getvalue()


SUMMARY_COLUMNS = ("mode", "precision", "model", "status", "ms_per_batch_median", "ms_per_batch_mean",
                   "ms_per_batch_std", "samples_per_s", "achieved_tflops", "peak_tflops", "check_loss",
                   "fp32_check_loss", "loss_relative_diff", "diverged", "reason")


def summary_csv(rows: Iterable[Mapping[str, Any]]) -> str:
    """One row per model, mode and precision that was asked for, with the skipped ones and why."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=SUMMARY_COLUMNS, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: _cell(row.get(key)) for key in SUMMARY_COLUMNS})
    return out.getvalue()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
