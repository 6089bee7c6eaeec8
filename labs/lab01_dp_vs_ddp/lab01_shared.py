"""What the three Lab-01 training scripts share, so that their numbers compare.

``02_baseline_single_gpu.py``, ``03_dataparallel_training.py`` and ``04_ddp_training.py`` must train
the same model on the same samples in the same order with the same global batch; only then do a
time per epoch, a throughput and a loss curve say something about DP against DDP. This module holds
the pieces that make that true; the training loops stay in the scripts, where students read them.

- :func:`add_lab_args`: the flags the three scripts share (model, data, optimiser, logging).
- :class:`GlobalBatchSampler`: every run walks the same sequence of *global* batches; a DDP rank
  takes an interleaved slice of each one. (``DistributedSampler`` would give each rank its own
  shard of the whole epoch, so the samples that meet in one optimiser step would differ from the
  single-device run and the loss curves could not be compared step by step.)
- :class:`PlainCNN` (``--model plain_cnn``): a small network without BatchNorm or dropout, for the
  equivalence check. BatchNorm normalises with the statistics of the batch each replica sees, so a
  replica of DP or DDP that sees a quarter of the batch computes a different function than the
  single device; dropout draws different masks. Without them the three methods are the same
  mathematics and agree to floating-point rounding.
- :func:`parse_gpu_ids` / :func:`check_gpu_ids`: ``--gpus 0,1,2,3`` for DataParallel.
- :func:`replica_digests`: hashes of a replica's parameters and buffers, to prove DDP ranks agree.

Candidates for ``common`` once a second lab needs them: the sampler (``common.data``), the plain
CNN and the digests (``common.models``).
"""

from __future__ import annotations

import argparse
import os
from typing import Iterator, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from common.cli import non_negative_int, positive_float, positive_int
from common.data import DATASETS
from common.errors import UserError
from common.models import build_model, parameter_digest

LAB = "lab01"
LOCAL_MODELS = ("plain_cnn",)


# --------------------------------------------------------------------------------------------
# Flags


def add_lab_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The model, data and optimiser flags of scripts 02, 03 and 04 (same names, same defaults)."""
    group = parser.add_argument_group("model and data (same in 02, 03 and 04)")
    group.add_argument("--model", default="resnet50",
                       help="torchvision model name, or plain_cnn (no BatchNorm: the three methods then agree "
                            "step by step) (default: %(default)s)")
    group.add_argument("--dataset", choices=DATASETS, default="synthetic",
                       help="synthetic is generated (offline); cifar10 and imagefolder read --data-dir "
                            "(default: %(default)s)")
    group.add_argument("--image-size", type=positive_int, default=32,
                       help="side of the synthetic images: 32 is CIFAR-shaped, 224 ImageNet-shaped; also the "
                            "resize of imagefolder images (default: %(default)s)")
    group.add_argument("--synthetic-size", type=positive_int, default=12800,
                       help="training samples of the synthetic data set; the test split is a quarter of it "
                            "(default: %(default)s)")
    group.add_argument("--lr", type=positive_float, default=0.05, help="SGD learning rate (default: %(default)s)")
    group.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: %(default)s)")
    group.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay (default: %(default)s)")
    group.add_argument("--log-interval", type=positive_int, default=10,
                       help="steps between loss lines (default: %(default)s)")
    group.add_argument("--warmup-steps", type=non_negative_int, default=2,
                       help="steps left out of the timing (default: %(default)s)")
    group.add_argument("--record-steps", type=non_negative_int, default=200,
                       help="how many of the first optimiser steps keep their loss in the record "
                            "(metrics.loss_at_step) (default: %(default)s)")
    return parser


# --------------------------------------------------------------------------------------------
# The same global batches in every run


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields, for every optimiser step, this rank's share of one global batch.

    An epoch's order is ``randperm(num_samples)`` drawn from a generator seeded with
    ``seed + epoch`` (as ``DistributedSampler`` does), so it depends on nothing but the seed and the
    epoch: not on the world size, the number of DataLoader workers or what else drew random numbers.
    The order is cut into global batches of ``global_batch_size``; rank ``r`` of ``world_size``
    takes positions ``r, r + W, r + 2W, ...`` of each one. With ``world_size=1`` (baseline and
    DataParallel) a rank's share is the whole global batch.

    The last, incomplete global batch is dropped: with fewer samples the ranks' shares would differ
    in size, and DDP's gradient average (a mean of per-rank means) would no longer be the mean over
    the global batch.
    """

    def __init__(self, num_samples: int, global_batch_size: int, *, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, seed: int = 0) -> None:
        if global_batch_size % world_size:
            raise UserError(f"the global batch ({global_batch_size}) must divide evenly between "
                            f"{world_size} processes")
        if num_samples < global_batch_size:
            raise UserError(f"the training set has {num_samples} samples, fewer than one global batch of "
                            f"{global_batch_size}; use a smaller --batch-size or a larger --synthetic-size")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.rank, self.world_size, self.shuffle, self.seed = rank, world_size, shuffle, seed
        self.epoch, self.start_step = 0, 0

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Call before every epoch (a new order each epoch); ``start_step`` skips steps already done."""
        self.epoch, self.start_step = epoch, start_step

    def global_batches(self) -> list[list[int]]:
        """The epoch's global batches, identical on every rank and in every script."""
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.num_samples)
        size = self.global_batch_size
        return [order[step * size:(step + 1) * size].tolist() for step in range(self.steps_per_epoch)]

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches()[self.start_step:]:
            yield batch[self.rank::self.world_size]

    def __len__(self) -> int:
        return max(0, self.steps_per_epoch - self.start_step)


def make_train_loader(dataset: Dataset, global_batch_size: int, *, rank: int = 0, world_size: int = 1,
                      seed: int = 0, num_workers: int = 0, pin_memory: bool = False
                      ) -> tuple[DataLoader, GlobalBatchSampler]:
    """A DataLoader over :class:`GlobalBatchSampler`; call ``sampler.set_epoch(epoch)`` every epoch."""
    sampler = GlobalBatchSampler(len(dataset), global_batch_size, rank=rank,  # type: ignore[arg-type]
                                 world_size=world_size, seed=seed)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
                        persistent_workers=num_workers > 0)
    return loader, sampler


# --------------------------------------------------------------------------------------------
# Models


class PlainCNN(nn.Module):
    """Two conv + ReLU + max-pool blocks and two linear layers: no BatchNorm, no dropout.

    Works for any number of channels and any image size: the features are pooled to a 4x4 grid,
    which keeps where in the image a pattern was (a single global average would throw that away).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        )
        self.classifier = nn.Sequential(nn.Linear(2 * width * 16, 128), nn.ReLU(), nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def build_lab_model(name: str, num_classes: int, in_channels: int) -> nn.Module:
    """``plain_cnn``, or any model :func:`common.models.build_model` knows (randomly initialised)."""
    if name == "plain_cnn":
        return PlainCNN(num_classes=num_classes, in_channels=in_channels)
    return build_model(name, num_classes=num_classes, in_channels=in_channels)


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def replica_digests(model: nn.Module) -> dict[str, str]:
    """SHA-256 of the parameters and, separately, of the buffers (BatchNorm running statistics).

    DDP keeps parameters bitwise identical on every rank; buffers only when ``broadcast_buffers``
    is on, which is why they are hashed apart.
    """
    return {"parameters": parameter_digest(model, "parameters"), "buffers": parameter_digest(model, "buffers")}


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

