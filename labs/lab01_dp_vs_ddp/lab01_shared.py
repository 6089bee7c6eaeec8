"""What the three Lab-01 training scripts share, so that their numbers compare.

``02_baseline_single_gpu.py``, ``03_dataparallel_training.py`` and ``04_ddp_training.py`` must train
the same model on the same samples in the same order with the same global batch; only then do a
time per epoch, a throughput and a loss curve say something about DP against DDP. The pieces that
make that true and that other labs use too live in ``common``: the global-batch sampler
(``common.data.datasets.GlobalBatchSampler``: every run walks the same global batches, a DDP rank takes a
slice of each), the plain CNN without BatchNorm or dropout (``common.models.PlainCNN``, for the
step-by-step equivalence check) and the replica hashes (``common.models.replica_digests``). What
is Lab-01's own is here:

- :func:`add_lab_args` and :func:`lab_data`: the flags the three scripts share (model, data,
  optimiser, logging) and the data set they name.
- :func:`parse_gpu_ids` / :func:`check_gpu_ids`: ``--gpus 0,1,2,3`` for DataParallel.
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

from common.cli import positive_float, positive_int
from common.data.datasets import DATASETS, DataSplits, get_dataset
from common.errors import UserError
from common.train.flags import add_training_args

LAB = "lab01"


# --------------------------------------------------------------------------------------------
# Flags


def add_lab_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The model, data and optimiser flags of scripts 02, 03 and 04 (same names, same defaults), then
    those of :func:`common.train.flags.add_training_args`."""
    group = parser.add_argument_group("model and data (same in 02, 03 and 04)")
    group.add_argument("--model", default="resnet50",
                       help="torchvision model name, or plain_cnn (no BatchNorm: the three methods then agree "
                            "step by step) (default: %(default)s)")
    group.add_argument("--dataset", choices=DATASETS, default="synthetic",
                       help="synthetic is generated and digits bundled (both offline); cifar10 and imagefolder "
                            "read --data-dir (default: %(default)s)")
    group.add_argument("--image-size", type=positive_int, default=32,
                       help="side of the synthetic images: 32 is CIFAR-shaped, 224 ImageNet-shaped; also the "
                            "resize of imagefolder images (default: %(default)s)")
    group.add_argument("--synthetic-size", type=positive_int, default=12800,
                       help="training samples of the synthetic data set; the test split is a quarter of it "
                            "(default: %(default)s)")
    group.add_argument("--lr", type=positive_float, default=0.05, help="SGD learning rate (default: %(default)s)")
    group.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: %(default)s)")
    group.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay (default: %(default)s)")
    add_training_args(parser)  # --deterministic among them: on GPUs the three methods then agree step by step
    return parser


def lab_data(args: argparse.Namespace) -> DataSplits:
    """The data set the flags name, shaped by ``--image-size`` and ``--synthetic-size``."""
    return get_dataset(args.dataset, args.data_dir, image_size=args.image_size,
                       synthetic_size=args.synthetic_size, seed=args.seed)


# --------------------------------------------------------------------------------------------
# --gpus for DataParallel


def parse_gpu_ids(text: str) -> list[int]:
    """argparse type: ``"0,1,2,3"`` -> ``[0, 1, 2, 3]`` (distinct, non-negative whole numbers)."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"expected GPU numbers separated by commas such as 0,1,2,3, got {text!r}")
    ids = [int(part) for part in parts]
    if len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"a GPU is named twice in {text!r}")
    return ids


def check_gpu_ids(ids: Sequence[int], visible: int, env: dict[str, str] | None = None) -> None:
    """Raise a :class:`UserError` naming the GPUs in ``ids`` that are not among ``visible`` devices.

    The numbers count the GPUs PyTorch sees, which under Slurm or ``CUDA_VISIBLE_DEVICES`` start at
    0 whatever the physical numbers are.
    """
    env = dict(os.environ) if env is None else env
    missing = [i for i in ids if i >= visible]
    if not missing:
        return
    mask = env.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={mask!r})" if mask is not None else ""
    listed = ",".join(map(str, ids))
    if visible == 0:
        raise UserError(f"--gpus {listed}: PyTorch sees no CUDA GPU{where}; leave out --gpus to run the "
                        "one-device CPU case, or run on a GPU node")
    raise UserError(f"--gpus {listed}: GPU {','.join(map(str, missing))} does not exist; PyTorch sees "
                    f"{visible} GPU(s), numbered 0..{visible - 1}{where}")

