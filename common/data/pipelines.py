"""Three ways of feeding MNIST-shaped images to a model, from the USC lab's to the fastest.

Lab-02's scripts train with them, Chapter 16's ``efficient_loading.py`` times DataLoader options on
the first, and ``bench/data_pipeline.py`` races them against each other.

==========  ==========================================================  ===========================
pipeline    what happens for every batch                                where the work is done
==========  ==========================================================  ===========================
``pil``     the USC lab's: for each of the 64 samples, uint8 array -> PIL   DataLoader workers (or the
            image -> ``ToTensor`` (float in [0, 1]) -> ``Normalize``;    main process with
            then ``collate`` stacks 64 small tensors into a batch        ``--num-workers 0``)
``tensor``  the images were converted to one normalised float tensor     DataLoader: a BatchSampler
            once, before training; a batch is one indexing operation     hands it whole index lists
            ``images[indices]``
``device``  the whole normalised set was copied to the device once;     the training loop itself,
            an epoch draws a permutation there and slices batches        on the device: no loader
            out of it
==========  ==========================================================  ===========================

``pil`` is exactly what ``torchvision.datasets.MNIST`` does in ``__getitem__`` (see
:class:`PilImages`), so it is the USC lab's pipeline on any data set, not only MNIST. All three give
the same numbers for the same sample (the tests check this): only the cost differs.

The data arrive as uint8 images (N, 28, 28), as MNIST stores them: ``mnist`` from ``--data-dir``,
``digits`` (bundled, offline) or ``synthetic``, converted to uint8 the same way. The names and the
flags that choose them are in ``common.cli`` (no torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler, TensorDataset

from common.data.datasets import MNIST_MEAN, MNIST_STD, get_dataset, worker_ignores_sigterm
from common.errors import UserError
from common.cli import DATASETS, PIPELINES



@dataclass
class Uint8Images:
    """Images as MNIST stores them: ``images`` (N, 28, 28) uint8 in 0..255, ``labels`` (N,) int64."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)


def _to_uint8(normalised: torch.Tensor) -> torch.Tensor:
    """Undo MNIST normalisation and quantise to 0..255, the form the USC lab's images are stored in."""
    pixels = (normalised * MNIST_STD + MNIST_MEAN).clamp(0, 1)
    return (pixels * 255).round().to(torch.uint8).reshape(-1, 28, 28)



def load_uint8(name: str, data_dir: str | Path, *, seed: int = 0,
               synthetic_size: int = 60_000) -> tuple[Uint8Images, Uint8Images]:
    """Train and test images of ``mnist``, ``digits`` or ``synthetic`` as uint8 (N, 28, 28)."""
    if name == "mnist":
        splits = get_dataset("mnist", data_dir)
        train, test = splits.train, splits.test  # torchvision MNIST: .data uint8 (N, 28, 28), .targets
        return (Uint8Images(train.data.clone(), train.targets.clone()),
                Uint8Images(test.data.clone(), test.targets.clone()))
    if name == "digits":
        splits = get_dataset("digits", data_dir)
        train, test = splits.train.tensors, splits.test.tensors  # normalised floats (N, 1, 28, 28), labels
        return Uint8Images(_to_uint8(train[0]), train[1]), Uint8Images(_to_uint8(test[0]), test[1])
    if name == "synthetic":
        splits = get_dataset("synthetic", data_dir, image_size=28, channels=1, synthetic_size=synthetic_size,
                             seed=seed)
        stacked = [torch.stack([split[i][0] for i in range(len(split))]) for split in (splits.train, splits.test)]
        return (Uint8Images(_to_uint8(stacked[0]), splits.train.labels.clone()),
                Uint8Images(_to_uint8(stacked[1]), splits.test.labels.clone()))
    raise UserError(f"unknown dataset {name!r} for these pipelines; choose one of: {', '.join(DATASETS)}")


def pil_transform() -> Any:
    """The USC lab's per-sample transform: PIL image -> float tensor in [0, 1] -> normalised."""
    from torchvision import transforms

    return transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])


class PilImages(Dataset):
    """``torchvision.datasets.MNIST.__getitem__`` on any uint8 images: the USC lab's pipeline.

    Every sample, every epoch: a NumPy view, a PIL image, a float tensor, a normalised tensor.
    Cheap once, but 60,000 times an epoch on one worker it is most of the USC lab's 84.5 %.
    """

    def __init__(self, data: Uint8Images) -> None:
        self.images, self.labels = data.images, data.labels
        self.transform = pil_transform()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        image = Image.fromarray(self.images[index].numpy())  # uint8 (28, 28) -> a greyscale ("L") image
        return self.transform(image), int(self.labels[index])


def to_normalised_tensor(images: torch.Tensor) -> torch.Tensor:
    """uint8 (N, 28, 28) -> float (N, 1, 28, 28), the same arithmetic as ToTensor + Normalize, once."""
    return ((images.float() / 255.0 - MNIST_MEAN) / MNIST_STD).unsqueeze(1)


class TensorBatches(Dataset):
    """Pre-converted images; ``dataset[list_of_indices]`` returns a whole batch in one indexing op.

    Used with ``DataLoader(batch_size=None, sampler=BatchSampler(...))``: the loader then asks for
    a list of indices at a time instead of 64 single samples it must collate.
    """

    def __init__(self, data: Uint8Images) -> None:
        self.images, self.labels = to_normalised_tensor(data.images), data.labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices)
        return self.images[index], self.labels[index]


class DeviceBatches:
    """The whole data set on ``device``; an epoch is a permutation sliced into batches there.

    Iterates like a DataLoader (``for data, target in loader``; ``len(loader)`` batches;
    ``loader.dataset`` the samples) so the training loop does not change. MNIST's 60,000 images
    are 188 MB as float32: they fit on any GPU, and copying them once replaces 938 copies an epoch.
    """

    def __init__(self, data: Uint8Images, batch_size: int, *, shuffle: bool, device: torch.device,
                 seed: int = 0, channels_last: bool = False) -> None:
        images = to_normalised_tensor(data.images).to(device)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        self.dataset = TensorDataset(images, data.labels.to(device))
        self.batch_size, self.shuffle, self.device = batch_size, shuffle, device
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return math.ceil(len(self.dataset) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        images, labels = self.dataset.tensors
        count = len(labels)
        if self.shuffle:  # drawn on the CPU (one small copy an epoch) so the order is the same on every device
            order = torch.randperm(count, generator=self.generator).to(self.device, non_blocking=True)
            for start in range(0, count, self.batch_size):
                index = order[start:start + self.batch_size]
                yield images[index], labels[index]
        else:
            for start in range(0, count, self.batch_size):
                yield images[start:start + self.batch_size], labels[start:start + self.batch_size]


def make_loader(pipeline: str, data: Uint8Images, batch_size: int, *, shuffle: bool, device: torch.device,
                num_workers: int = 0, pin_memory: bool = False, persistent_workers: bool = False,
                prefetch_factor: int | None = None, seed: int = 0, channels_last: bool = False) -> Any:
    """An iterable of ``(data, target)`` batches for ``pipeline``; the loader flags apply to ``pil``/``tensor``.

    ``persistent_workers`` and ``prefetch_factor`` need worker processes: with ``num_workers=0``
    they are left out (the DataLoader would refuse them).
    """
    if pipeline == "device":
        return DeviceBatches(data, batch_size, shuffle=shuffle, device=device, seed=seed, channels_last=channels_last)
    generator = torch.Generator().manual_seed(seed)
    worker_options: dict[str, Any] = {}
    if num_workers > 0:
        worker_options["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            worker_options["prefetch_factor"] = prefetch_factor
    worker_options["worker_init_fn"] = worker_ignores_sigterm  # scancel's SIGTERM is the training process's
    if pipeline == "pil":
        return DataLoader(PilImages(data), batch_size=batch_size, shuffle=shuffle, num_workers=num_workers,
                          pin_memory=pin_memory, generator=generator, **worker_options)
    if pipeline == "tensor":
        dataset = TensorBatches(data)
        order = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
        return DataLoader(dataset, batch_size=None, sampler=BatchSampler(order, batch_size, drop_last=False),
                          num_workers=num_workers, pin_memory=pin_memory, **worker_options)
    raise UserError(f"unknown pipeline {pipeline!r}; choose one of: {', '.join(PIPELINES)}")
