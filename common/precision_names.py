"""The names the precision benchmark (Lab-03) and its report section share: precisions and modes.

``labs/lab03_precision_benchmark/benchmark_models.py`` takes these names on its command line and
writes them into its records (``config.precision``, ``config.mode``, method ``<mode>-<precision>``);
the report's Lab-03 section (``common/report/labs/lab03.py``) lays its tables out in this order.
Defined once here so that the two cannot drift apart. (The ``--amp`` choices of the training
scripts are another list: :data:`common.amp.PRECISIONS`.)

This module must not import torch: the report reads it.
"""

from __future__ import annotations

__all__ = ["PRECISIONS", "MODES"]

#: Every precision the benchmark knows, in the order the tables show them, with what it means.
PRECISIONS: dict[str, str] = {
    "fp64": "float64 weights and inputs (model.double()): the seed's 'double'",
    "fp32": "float32 with TF32 off: true IEEE single precision, the seed's 'float' (PyTorch 1.6 had no TF32)",
    "tf32": "float32 storage, convolutions and matmuls on TF32 tensor cores (10-bit mantissa); "
            "PyTorch's default for cuDNN convolutions on Ampere and newer",
    "half": "the model cast to float16 (model.half()) but BatchNorm kept float32, no loss scaling: "
            "the SJTU page's 'half'",
    "amp-fp16": "float32 weights, autocast to float16 for convolutions and matmuls, GradScaler against underflow",
    "amp-bf16": "float32 weights, autocast to bfloat16 (float32's exponent range, so no scaler)",
}
#: What is timed: a training step (forward, backward, optimiser) or a forward pass alone.
MODES = ("train", "inference")
