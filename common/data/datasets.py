"""Data sets every lab uses, all available offline.

==============  ==================================================  ==========================
name            what                                                where it comes from
==============  ==================================================  ==========================
``mnist``       MNIST (60k/10k, 1x28x28), decoded once into one     ``--data-dir`` (downloaded on
                normalised tensor (:class:`DecodedImages`)          a login node beforehand)
``digits``      real handwritten digits (1,797, 8x8 upsampled to    bundled inside scikit-learn:
                1x28x28), fixed 80/20 stratified train/test split   always available
``cifar10``     CIFAR-10 (50k/10k, 3x32x32)                         ``--data-dir``
``imagefolder`` any ``class/image.jpg`` tree (``train/``, ``val/``)  ``--data-dir``
``synthetic``   deterministic random images of any shape with a     generated: always available
                learnable class signal
``stdlib-text`` character-level text (Lab-04): the source code of   the Python installation
                24 standard-library modules, windows of             running the script: always
                ``context`` characters, 90/10 train/validation      available
==============  ==================================================  ==========================

Nothing here downloads. A missing data set raises :class:`~common.errors.UserError` that names
the command to run on a login node (``scripts/download_data.py``).

``mnist`` and ``digits`` are held in memory as tensors, ready for the model: a batch is one indexing
operation. :func:`make_loader` feeds them through a DataLoader (``num_workers`` processes), or, with
``resident_on=device``, keeps the whole set in that device's memory and cuts the batches there
(:class:`ResidentBatches`; :func:`resident_device` decides when it fits).
"""

from __future__ import annotations

import atexit
import math
import multiprocessing.util  # registers its exit handler first: the one below runs before it
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset, TensorDataset

from common.cli import from_here
from common.errors import UserError

#: What a login node runs to fetch a data set (compute nodes have no internet); named in the missing-data error.
DOWNLOAD_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "download_data.py"

DATASETS = ("mnist", "digits", "cifar10", "imagefolder", "synthetic")
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
#: Above this many bytes a synthetic set is generated per sample instead of kept in memory.
SYNTHETIC_CACHE_LIMIT = 512 * 2**20
#: ``--data-on-device auto`` keeps a data set on a GPU when it takes at most this share of the free
#: memory: the rest is left for the model, its gradients, the optimiser and the activations.
RESIDENT_SHARE = 0.5
#: The choices of ``--data-on-device`` (:func:`resident_device`).
RESIDENT_CHOICES = ("auto", "yes", "no")


def worker_ignores_sigterm(worker_id: int, then: Callable[[int], None] | None = None) -> None:
    """A DataLoader's ``worker_init_fn``: the worker leaves SIGTERM to the training process, then runs ``then``.

    ``scancel``, Slurm's pre-emption and torchrun's own stop send SIGTERM to every process of the job, the
    loader's workers included. A worker dies of it (PyTorch's handler), and the training process, told by
    SIGCHLD, raises "DataLoader worker ... is killed by signal: Terminated" wherever it is, before its
    own SIGTERM handler can save a checkpoint. Ignoring it here, the worker lives until the training process
    has saved and shut the loader down (or, were that process gone, until the worker sees its parent gone).
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if then is not None:
        then(worker_id)


@atexit.register
def _end_workers_left_at_exit() -> None:
    """A process that ends with its loader's workers running (an exception's traceback, printed, keeps the loader
    alive to the end) would wait for them forever: multiprocessing's exit handler stops them with the SIGTERM they
    ignore, then joins them. This runs before it and ends them for good."""
    workers = [child for child in multiprocessing.active_children() if child.daemon]  # nothing else of ours is
    if workers:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # PyTorch's raises for a worker that ended: nobody reads it now
        for worker in workers:
            worker.kill()
        for worker in workers:
            worker.join(timeout=10)


@dataclass
class DataSplits:
    """Train and test sets plus what a model needs to know about them."""

    train: Dataset
    test: Dataset
    name: str
    input_shape: tuple[int, ...]  # C, H, W
    num_classes: int
    extra: dict[str, Any] = field(default_factory=dict)  # what else a record should know (e.g. a digest)

    def describe(self) -> dict[str, Any]:
        return {"dataset": self.name, "input_shape": list(self.input_shape),
                "num_classes": self.num_classes, "train_size": len(self.train),  # type: ignore[arg-type]
                "test_size": len(self.test), **self.extra}  # type: ignore[arg-type]


def _missing(name: str, data_dir: Path, detail: str = "") -> UserError:
    return UserError(
        f"{name} not found under {data_dir}{detail}. Compute nodes have no internet: on a login node run "
        f"'python {from_here(DOWNLOAD_SCRIPT)} {name} --data-dir {data_dir}', or use --dataset digits "
        "(bundled) or --dataset synthetic"
    )


class SyntheticImages(Dataset):
    """Deterministic images with a class signal: ``prototype[label] + noise``, any shape.

    The same ``seed`` gives the same samples on every machine and rank, so runs compare. Each class
    has a fixed random prototype (shared by both splits), so a model can learn it and the loss falls
    as on real data; ``split`` picks independent labels and noise for the train and test sets.
    """

    def __init__(self, num_samples: int, shape: tuple[int, ...] = (3, 32, 32), num_classes: int = 10,
                 seed: int = 0, split: str = "train", noise: float = 1.0, signal: float = 0.5) -> None:
        if num_samples < 1:
            raise UserError(f"synthetic data set needs at least 1 sample, got {num_samples}")
        self.num_samples, self.shape, self.num_classes = num_samples, tuple(shape), num_classes
        self.noise = noise
        self.prototypes = torch.randn((num_classes, *self.shape),
                                      generator=torch.Generator().manual_seed(seed)) * signal
        self.sample_seed = seed * 1_000_003 + (0 if split == "train" else 500_009)
        generator = torch.Generator().manual_seed(self.sample_seed)
        self.labels = torch.randint(0, num_classes, (num_samples,), generator=generator)
        self._cache: torch.Tensor | None = None
        if num_samples * math.prod(self.shape) * 4 <= SYNTHETIC_CACHE_LIMIT:
            self._cache = self.prototypes[self.labels] + torch.randn((num_samples, *self.shape),
                                                                     generator=generator) * noise

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = int(self.labels[index])
        if self._cache is not None:
            return self._cache[index], label
        generator = torch.Generator().manual_seed(self.sample_seed + 1 + index)
        return self.prototypes[label] + torch.randn(self.shape, generator=generator) * self.noise, label


def _read_bundled_digits() -> tuple[Any, Any]:
    """The 1,797 digits of ``sklearn.datasets.load_digits``, read from the file scikit-learn ships.

    Reading ``digits.csv.gz`` directly skips importing scikit-learn (3-4 s); the data are the same.
    """
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise UserError("the digits data set ships with scikit-learn, which is not installed: pip install scikit-learn")
    bundled = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if bundled.is_file():
        table = np.loadtxt(bundled, delimiter=",", dtype=np.float32)
        return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # a layout we do not know: let scikit-learn find it

    bunch = load_digits()
    return bunch.data, bunch.target


def load_digits_split(test_fraction: float = 0.2, image_size: int = 28,
                      seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's bundled 8x8 digits, scaled to MNIST's shape and statistics.

    The split is stratified and fixed by ``seed`` so the held-out test set never changes.
    """
    pixels, target = _read_bundled_digits()
    images = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0  # N,1,8,8 in [0,1]
    images = torch.nn.functional.interpolate(images, size=(image_size, image_size), mode="bilinear",
                                             align_corners=False).clamp_(0, 1)
    images = (images - MNIST_MEAN) / MNIST_STD
    labels = torch.tensor(target, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    train_idx, test_idx = [], []
    for cls in range(10):
        members = torch.nonzero(labels == cls).flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        n_test = int(round(len(members) * test_fraction))
        test_idx.append(members[:n_test])
        train_idx.append(members[n_test:])
    train, test = torch.cat(train_idx).sort().values, torch.cat(test_idx).sort().values
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


class DecodedImages(TensorDataset):
    """Images decoded once, before training: ``tensors`` holds the normalised float images
    (N, C, H, W) and the labels a model reads, so a sample or a batch is one indexing operation.

    ``data`` (the images as stored, uint8) and ``targets`` keep the names torchvision gives them.
    torchvision's own ``MNIST`` instead turns every sample of every epoch into a PIL image, then a
    float tensor, then a normalised one: 60,000 times an epoch, which starves a GPU.
    """

    def __init__(self, data: torch.Tensor, targets: torch.Tensor, mean: float, std: float) -> None:
        self.data, self.targets = data, targets
        images = (data.float() / 255 - mean) / std  # the arithmetic of ToTensor + Normalize, on all at once
        super().__init__(images.unsqueeze(1) if images.dim() == 3 else images, targets)


#: The torchvision sets read from ``--data-dir``: class, the folder that shows a copy is there, mean, std, shape.
_TORCHVISION_SETS: dict[str, tuple[Any, ...]] = {
    "mnist": ("MNIST", "MNIST/raw", (MNIST_MEAN,), (MNIST_STD,), (1, 28, 28)),
    "cifar10": ("CIFAR10", "cifar-10-batches-py", CIFAR_MEAN, CIFAR_STD, (3, 32, 32)),
}


def _torchvision_splits(name: str, data_dir: Path) -> DataSplits:
    """MNIST or CIFAR-10 as torchvision reads them from ``data_dir``, normalised; never downloads.

    MNIST comes back as :class:`DecodedImages` (decoded once); CIFAR-10 is transformed per sample.
    """
    from torchvision import datasets, transforms

    class_name, folder, mean, std, shape = _TORCHVISION_SETS[name]
    if not (data_dir / folder).is_dir():
        raise _missing(name, data_dir, f" (expected {folder}/)")
    tf = None if name == "mnist" else transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    dataset = getattr(datasets, class_name)
    try:
        train = dataset(str(data_dir), train=True, download=False, transform=tf)
        test = dataset(str(data_dir), train=False, download=False, transform=tf)
    except RuntimeError as err:
        raise _missing(name, data_dir, f" ({err})") from None
    if name == "mnist":  # torchvision holds the whole set as one uint8 tensor: normalise it once, here
        train, test = (DecodedImages(split.data, split.targets, mean[0], std[0]) for split in (train, test))
    return DataSplits(train, test, name, shape, 10)


def open_image(path: str) -> Any:
    """An image folder's file as RGB (torchvision's default loader), or one line naming the file it cannot read."""
    from PIL import Image

    try:
        with open(path, "rb") as handle:
            return Image.open(handle).convert("RGB")
    except OSError as err:  # PIL's UnidentifiedImageError and a truncated file are OSErrors
        raise UserError(f"cannot read image {path}: {err}") from None


def get_dataset(name: str, data_dir: str | Path = "data", *, image_size: int | None = None,
                channels: int | None = None, num_classes: int = 10, synthetic_size: int = 2048,
                seed: int = 0) -> DataSplits:
    """Train/test splits of a named data set (see the module docstring).

    ``image_size``/``channels`` shape ``synthetic`` and resize ``imagefolder``; ``synthetic_size``
    is the number of training samples of ``synthetic`` (the test split is a quarter of it).
    """
    data_dir = Path(data_dir)
    name = name.lower()
    if name == "digits":
        train, test = load_digits_split(image_size=image_size or 28)
        return DataSplits(train, test, "digits", (1, image_size or 28, image_size or 28), 10)
    if name == "synthetic":
        shape = (channels or 3, image_size or 32, image_size or 32)
        train = SyntheticImages(synthetic_size, shape, num_classes, seed=seed, split="train")
        test = SyntheticImages(max(1, synthetic_size // 4), shape, num_classes, seed=seed, split="test")
        return DataSplits(train, test, "synthetic", shape, num_classes)
    if name in _TORCHVISION_SETS:
        return _torchvision_splits(name, data_dir)
    if name == "imagefolder":
        from torchvision import datasets, transforms

        train_dir, val_dir = data_dir / "train", data_dir / "val"
        if not train_dir.is_dir():
            raise UserError(f"imagefolder expects {train_dir}/<class>/<image> (and optionally {val_dir}/); "
                            "copy your images there or use --dataset synthetic")
        size = image_size or 224
        tf = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size), transforms.ToTensor(),
                                 transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
        try:  # no class folder, or a class folder with no image in it: torchvision's FileNotFoundError
            train = datasets.ImageFolder(str(train_dir), transform=tf, loader=open_image)
            test = datasets.ImageFolder(str(val_dir), transform=tf, loader=open_image) if val_dir.is_dir() else train
        except FileNotFoundError as err:
            raise UserError(f"imagefolder under {data_dir}: {err}") from None
        return DataSplits(train, test, "imagefolder", (3, size, size), len(train.classes))
    raise UserError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")


def make_loader(dataset: Dataset, batch_size: int, *, shuffle: bool, sampler: Sampler[int] | None = None,
                num_workers: int = 0, pin_memory: bool = False, seed: int = 0, drop_last: bool = False,
                resident_on: torch.device | None = None,
                **loader_kwargs: Any) -> tuple[DataLoader | ResidentBatches, Sampler[int] | None]:
    """A DataLoader and its sampler (``sampler``: a ``DistributedSampler`` the caller made, say).

    Shuffled without a ``sampler``: a one-replica ``DistributedSampler``, so the order is the same
    epoch-seeded permutation whatever the workers do. Either way the training loop calls
    ``sampler.set_epoch(epoch)`` before each epoch: a shuffled order then depends only on ``seed``
    and the epoch, never on ``num_workers`` (a DataLoader with persistent workers would otherwise
    draw another order from the second epoch on, and a resumed run would not repeat an unbroken one).

    ``resident_on``: keep the whole data set in that device's memory and cut the batches there
    (:class:`ResidentBatches`, the same batches in the same order; no workers, no copies per step).
    """
    if sampler is None and shuffle:
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=drop_last)
    if resident_on is not None:
        return ResidentBatches(dataset, batch_size, resident_on, sampler=sampler, drop_last=drop_last), sampler
    if num_workers > 0:
        loader_kwargs.setdefault("persistent_workers", True)
    # Its own generator, for the seeds of the workers: without one the DataLoader draws them from the
    # global generator, and dropout masks would depend on the number of workers and of epochs begun.
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                        pin_memory=pin_memory, drop_last=drop_last, generator=torch.Generator().manual_seed(seed),
                        **{"worker_init_fn": worker_ignores_sigterm, **loader_kwargs})
    return loader, sampler


def _tensors_of(dataset: Dataset) -> list[torch.Tensor] | None:
    """The tensors a data set is made of (a ``TensorDataset`` or a ``Subset`` of one), else ``None``."""
    if isinstance(dataset, TensorDataset):
        return list(dataset.tensors)
    if isinstance(dataset, Subset):
        inner = _tensors_of(dataset.dataset)
        index = torch.as_tensor(list(dataset.indices), dtype=torch.long)
        return None if inner is None else [tensor[index] for tensor in inner]
    return None


def resident_device(choice: str, datasets: Iterable[Dataset], device: torch.device) -> torch.device | None:
    """Where ``--data-on-device`` (``choice``: auto, yes, no) keeps ``datasets`` whole: ``device``, or
    ``None`` for a DataLoader.

    ``auto``: on a CPU whenever the sets are tensors already (a DataLoader's workers would only copy
    them), on a GPU when they also take at most :data:`RESIDENT_SHARE` of its free memory; ``yes``
    insists, and a set that is read sample by sample (``synthetic``, ``cifar10``, image folders)
    is then an error.
    """
    if choice == "no":
        return None
    tensors = [_tensors_of(dataset) for dataset in datasets]
    if any(parts is None for parts in tensors):
        if choice == "yes":
            raise UserError("--data-on-device yes needs a data set held in memory as tensors (mnist, digits); "
                            "this one is read sample by sample: use --data-on-device no")
        return None
    if choice == "auto" and device.type == "cuda":
        needed = sum(t.numel() * t.element_size() for parts in tensors for t in parts)  # type: ignore[union-attr]
        free, _total = torch.cuda.mem_get_info(device)
        if needed > RESIDENT_SHARE * free:
            return None
    return device


class ResidentBatches:
    """Batches cut from a data set held whole in one device's memory: the loader of a set that fits.

    The tensors are copied to ``device`` once; each epoch the order (from ``sampler``, the one a
    DataLoader would use, or the data set's own order) is copied there once too, and every batch is
    one ``index_select`` on the device: no worker processes, no host-to-device copy per step, no
    waiting. The batches are those of :func:`make_loader`'s DataLoader, in the same order.
    """

    num_workers = 0

    def __init__(self, dataset: Dataset, batch_size: int, device: torch.device, *,
                 sampler: Sampler[int] | None = None, drop_last: bool = False) -> None:
        tensors = _tensors_of(dataset)
        if tensors is None:
            raise UserError("only a data set held as tensors can be kept on the device")
        self.tensors = [tensor.to(device) for tensor in tensors]
        self.dataset, self.batch_size, self.device = dataset, batch_size, device
        self.sampler, self.drop_last = sampler, drop_last

    def __len__(self) -> int:
        count = len(self.sampler) if self.sampler is not None else len(self.tensors[0])  # type: ignore[arg-type]
        return count // self.batch_size if self.drop_last else math.ceil(count / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        if self.sampler is None:
            order = torch.arange(len(self.tensors[0]), device=self.device)
        else:
            order = torch.as_tensor(list(self.sampler), dtype=torch.long).to(self.device)
        for step in range(len(self)):
            index = order[step * self.batch_size:(step + 1) * self.batch_size]
            yield tuple(tensor.index_select(0, index) for tensor in self.tensors)


def describe_loader(loader: Any) -> dict[str, Any]:
    """What feeds a training loop, for the record: resident on a device, or a DataLoader's workers."""
    if isinstance(loader, ResidentBatches):
        return {"kind": "resident", "device": str(loader.device), "num_workers": 0}
    return {"kind": type(loader).__name__, "num_workers": getattr(loader, "num_workers", 0),
            "pin_memory": bool(getattr(loader, "pin_memory", False))}


def loader_line(loader: Any) -> str:
    """:func:`describe_loader` as words for a progress line."""
    facts = describe_loader(loader)
    if facts["kind"] == "resident":
        return f"whole data set in {facts['device']} memory"
    return f"DataLoader, {facts['num_workers']} worker(s){', pinned memory' if facts['pin_memory'] else ''}"


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields, for every optimiser step, this rank's share of one global batch.

    An epoch's order is ``randperm(num_samples)`` drawn from a generator seeded with
    ``seed + epoch`` (as ``DistributedSampler`` does), so it depends on nothing but the seed and the
    epoch: not on the world size, the number of DataLoader workers or what else drew random numbers.
    The order is cut into global batches of ``global_batch_size``; rank ``r`` of ``world_size``
    takes positions ``r, r + W, r + 2W, ...`` of each one. With ``world_size=1`` (one process, or
    DataParallel) a rank's share is the whole global batch. So a baseline, DataParallel and DDP see
    the same samples in the same optimiser steps, and their loss curves compare step by step
    (``DistributedSampler`` gives each rank its own shard of the whole epoch instead).

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
                            f"{global_batch_size}; use a smaller --batch-size or a larger data set")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.rank, self.world_size, self.shuffle, self.seed = rank, world_size, shuffle, seed
        self.epoch = 0

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def set_epoch(self, epoch: int) -> None:
        """Call before every epoch: a new order each epoch, the same on every rank."""
        self.epoch = epoch

    def global_batches(self) -> list[list[int]]:
        """The epoch's global batches, identical on every rank and in every script."""
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.num_samples)
        size = self.global_batch_size
        return [order[step * size:(step + 1) * size].tolist() for step in range(self.steps_per_epoch)]

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches():
            yield batch[self.rank::self.world_size]

    def __len__(self) -> int:
        return self.steps_per_epoch


def make_global_batch_loader(dataset: Dataset, global_batch_size: int, *, rank: int = 0, world_size: int = 1,
                             seed: int = 0, num_workers: int = 0, pin_memory: bool = False) -> DataLoader:
    """A DataLoader over :class:`GlobalBatchSampler` (each rank's share of the same global batches)."""
    sampler = GlobalBatchSampler(len(dataset), global_batch_size, rank=rank,  # type: ignore[arg-type]
                                 world_size=world_size, seed=seed)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
                      persistent_workers=num_workers > 0, worker_init_fn=worker_ignores_sigterm)


# --------------------------------------------------------------------------------------------
# Character-level text from the standard library's own source (Lab-04)

#: Pure-Python standard-library modules present from Python 3.9 on; their source is the corpus.
STDLIB_TEXT_MODULES = (
    "argparse", "ast", "calendar", "configparser", "csv", "dataclasses", "difflib", "doctest", "enum",
    "fractions", "functools", "gettext", "heapq", "inspect", "pprint", "pydoc", "random", "shlex",
    "shutil", "statistics", "subprocess", "tarfile", "textwrap", "threading",
)
#: The characters the model knows: newline, tab and printable ASCII; anything else is UNKNOWN.
TEXT_ALPHABET = "\n\t" + "".join(chr(code) for code in range(32, 127))
UNKNOWN_CHAR_ID = len(TEXT_ALPHABET)
#: Vocabulary size of the model: the alphabet plus UNKNOWN, padded to a multiple of 64 (as nanoGPT
#: pads GPT-2's) so the embedding and the head shard evenly over 1, 2, 4, ... 64 ranks.
TEXT_VOCAB_SIZE = 128


def encode_text(text: str) -> torch.Tensor:
    """Characters -> ids (uint8): the alphabet's position, or :data:`UNKNOWN_CHAR_ID` for any other."""
    import numpy as np

    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    raw = raw[(raw < 0x80) | (raw >= 0xC0)]  # one byte per character: drop UTF-8 continuation bytes
    table = np.full(256, UNKNOWN_CHAR_ID, dtype=np.uint8)
    for index, char in enumerate(TEXT_ALPHABET):
        table[ord(char)] = index
    return torch.from_numpy(table[raw].copy())


def stdlib_sources(modules: tuple[str, ...] = STDLIB_TEXT_MODULES) -> tuple[dict[str, str], list[str]]:
    """The source text of ``modules`` from this Python installation, and the modules without one.

    The loader reads the source wherever the installation keeps it (a folder or a zip archive); an
    installation that ships only compiled files has none for a module, which is then left out.
    """
    import importlib.util

    sources, missing = {}, []
    for name in modules:
        try:
            spec = importlib.util.find_spec(name)
            source = spec.loader.get_source(name) if spec and spec.loader else None  # type: ignore[union-attr]
        except (ImportError, AttributeError, OSError):
            source = None
        if source:
            sources[name] = source
        else:
            missing.append(name)
    return sources, missing


class CharWindows(Dataset):
    """Windows of a token stream: sample ``i`` is ``stream[i*S : i*S + L + 1]`` split into the input
    (the first ``L`` ids) and the target (the same shifted by one: the next character). The stride
    ``S`` is ``L`` by default (windows side by side); a smaller one overlaps them, so a long context
    still gets many samples from a small text."""

    def __init__(self, stream: torch.Tensor, context: int, stride: int | None = None) -> None:
        if len(stream) < context + 1:
            raise UserError(f"the text has {len(stream)} characters, fewer than one window of --context "
                            f"{context} + 1; use a smaller --context")
        self.stream, self.context, self.stride = stream, context, stride or context

    def __len__(self) -> int:
        return (len(self.stream) - 1 - self.context) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.stride
        window = self.stream[start:start + self.context + 1].long()
        return window[:-1], window[1:]


def load_stdlib_text(context: int, validation_fraction: float = 0.1, stride: int | None = None) -> DataSplits:
    """Character-level language modelling on the standard library's own source code.

    Offline on every Python installation, and deterministic: a fixed list of modules in a fixed
    order; the last ``validation_fraction`` of each module's text is the validation split, the rest
    the training split (so both hold every module's style). The record gets the Python version, the
    modules used and a SHA-256 of the text: runs compare when these agree.
    """
    import hashlib
    import platform

    sources, missing = stdlib_sources()
    if len(sources) < len(STDLIB_TEXT_MODULES) // 2:
        raise UserError(f"this Python installation has no source for {len(missing)} of the "
                        f"{len(STDLIB_TEXT_MODULES)} standard-library modules the text data set reads "
                        f"({', '.join(missing[:5])} ...); use a full Python installation")
    train_parts, validation_parts = [], []
    digest = hashlib.sha256()
    for name, text in sources.items():
        digest.update(name.encode() + b"\0" + text.encode("utf-8") + b"\0")
        cut = int(len(text) * (1 - validation_fraction))
        train_parts.append(text[:cut])
        validation_parts.append(text[cut:])
    train = CharWindows(encode_text("".join(train_parts)), context, stride)  # validation: side by side
    validation = CharWindows(encode_text("".join(validation_parts)), context)
    extra = {"text_python": platform.python_version(), "text_modules": len(sources),
             "text_modules_missing": missing, "text_characters": len(train.stream) + len(validation.stream),
             "text_sha256": digest.hexdigest(), "window_stride": train.stride}
    return DataSplits(train, validation, "stdlib-text", (context,), TEXT_VOCAB_SIZE, extra)
