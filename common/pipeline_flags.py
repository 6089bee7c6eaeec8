"""The names of Lab-02's input pipelines and data sets, and the flags that choose them.

``common.pipelines`` builds the pipelines; this module only names them, so that a script that
starts the training in other processes (Lab-02's ``sweep.py``, one process per step) offers the same
``--dataset`` and ``--synthetic-size`` without importing torch (2-4 s).

This module must not import torch.
"""

from __future__ import annotations

import argparse

from common.cli import positive_int

__all__ = ["PIPELINES", "DATASETS", "add_dataset_args"]

#: How batches are made (``common.pipelines.make_loader``), from the seed's to the fastest.
PIPELINES = ("pil", "tensor", "device")
#: The MNIST-shaped data sets the pipelines read as uint8 images (``common.pipelines.load_uint8``).
DATASETS = ("digits", "mnist", "synthetic")


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """``--dataset`` and ``--synthetic-size``: what ``common.pipelines.load_uint8`` reads, the same flags in every script."""
    parser.add_argument("--dataset", choices=DATASETS, default="digits",
                        help="digits is bundled (offline); mnist needs --data-dir (default: %(default)s)")
    parser.add_argument("--synthetic-size", type=positive_int, default=60_000,
                        help="training images of --dataset synthetic, MNIST's count by default (default: %(default)s)")
