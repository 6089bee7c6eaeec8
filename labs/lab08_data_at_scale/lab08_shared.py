"""What the Lab-08 scripts share: the data set's layout on disk, the I/O each reader makes (counted,
with an optional wait per open), the readers of the three formats, and the lab's fixed model.

``01_make_dataset.py`` writes one data set in three formats under one folder::

    DATA/dataset.json                       what was written: counts, bytes, the source, the seed
    DATA/imagefolder/train/<class>/<id>.jpg one small file per image (torchvision's ImageFolder layout)
    DATA/shards/shard-000000.tar ...        tar shards in WebDataset's layout: <id>.jpg + <id>.cls per sample
    DATA/shards/manifest.csv                one row per tar member: id, label, shard, member, offset, size, crc32
    DATA/shards/shards.json                 one entry per shard: samples, bytes, sha256
    DATA/shards/SHA256SUMS                  the same checksums in the format ``sha256sum -c`` reads
    DATA/array/images.u8, index.npy         every JPEG back to back in one file (a numpy memmap), and
                                            (id, offset, size, label) per sample

``02_read_formats.py`` reads each format with the same model and batch; ``03_shards_exactly_once.py``
reads the shards over ranks x workers with :class:`ShardStream`, which keeps its position.

Reading a shard (:func:`check_shard`): the shard is read whole and checked against its SHA-256; its samples
then come either from the manifest's offsets (``index``, the default: a slice per member, no tar header parsed)
or from WebDataset's own tar reader (``webdataset``: Python's ``tarfile`` parses a 512-byte header per member,
about as costly as decoding the 64 x 64 JPEG it holds). Both give the same samples; a shard that fails its
checksum is read with WebDataset's reader, since its offsets can no longer be trusted.

Counting (:class:`IOCounter`): each process (the main one and every DataLoader worker) counts the
files its dataset code opens, the stat-family calls it makes and the bytes it reads. The dataset code
opens files only through :func:`read_file` (``os.open`` + ``os.read`` + ``os.close``: exactly one
``openat`` and no hidden ``fstat``, which ``strace -f -c`` confirms in the tests) and stats only
through :func:`stat_file`. Every batch carries its worker's counts so far; :class:`EpochIO` sums
them over the workers at the end of an epoch.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import random
import shlex
import statistics
import time
import zlib
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, get_worker_info
# Imported here, before any DataLoader worker is forked: a worker would otherwise import torchvision itself,
# seconds of CPU in every worker of every epoch.
from torchvision.io import ImageReadMode, decode_jpeg
from webdataset.tariterators import group_by_keys, tar_file_iterator

from common.checkpoint.single_file import load_checkpoint, save_checkpoint
from common.cli import add_common_args, add_lr_arg, positive_float, positive_int
from common.data.datasets import worker_ignores_sigterm
from common.errors import UserError
from common.runtime.device import synchronize
from common.train.flags import add_checkpoint_args, add_training_args
from common.train.preemption import TorchCheckpointer

LAB = "lab08"
FORMATS = ("imagefolder", "webdataset", "array")
IMAGE_SIZE = 64
NUM_CLASSES = 10
#: How uneven shard counts are made even across ranks x workers (03_shards_exactly_once.py).
POLICIES = ("pad", "drop", "uneven")
BAD_SAMPLE_ACTIONS = ("skip", "fail")
#: How a shard's samples are found in it: at the manifest's offsets, or by WebDataset's tar reader.
SHARD_READERS = ("index", "webdataset")
#: The documented Lustre-like cost of opening one small file, in ms: an open and a close, each one round trip
#: to the metadata server of 0.5 ms (MDtest's single-thread file-stat rate of about 2,000 per second on the
#: Dell HPC Lustre Storage with Intel Omni-Path, Lustre 2.7). The README's "Cost model" section explains it.
LUSTRE_METADATA_RTT_MS = 0.5
LUSTRE_LIKE_OPEN_MS = 2 * LUSTRE_METADATA_RTT_MS
#: The shared file system of 02_read_formats.py's cost model: each default is a public measurement (README,
#: "Cost model"). Dell HPC Lustre Storage with Intel Omni-Path (Lustre 2.7): MDtest file stat, one thread about
#: 2,000/s (0.5 ms a round trip), 240 threads more than 500,000/s; IOzone, one client reads about 1.3 GB/s.
#: Dell Storage for HPC with Intel EE for Lustre (960 TB, 24 OSTs): reads peak near 10 GB/s.
FS_DEFAULTS = {"metadata_rtt_ms": LUSTRE_METADATA_RTT_MS, "metadata_ops_per_s": 500_000.0,
               "stream_gb_per_s": 1.3, "total_gb_per_s": 10.0}


def default_data_dir() -> Path:
    """``data/lab08`` in the repository (ignored by git), wherever the script is started from."""
    return Path(__file__).resolve().parents[2] / "data" / "lab08"


def use_lab_data_dir(parser: argparse.ArgumentParser, what: str) -> None:
    """``--data-dir`` (from ``common.cli.add_common_args``) defaults to this lab's data set, and says so."""
    parser.set_defaults(data_dir=default_data_dir())
    for action in parser._actions:
        if action.dest == "data_dir":
            action.help = f"{what} (default: data/lab08 in the repository)"


def add_training_run_args(parser: argparse.ArgumentParser, group: argparse._ArgumentGroup, *, epochs: int, data: str,
                          checkpoint: bool = False) -> argparse.ArgumentParser:
    """What both training lessons take after their own flags: SGD's rate (in ``group``), the training flags, the
    checkpoint flags (``checkpoint``: a distributed script's, which saves to RESULTS_DIR/checkpoints/ without
    ``--checkpoint``, and its help says so), those every script shares, and ``--data-dir`` on this lab's data set."""
    add_lr_arg(group, default=0.05)
    add_training_args(parser)
    if checkpoint:
        add_checkpoint_args(parser, always=True)
    add_common_args(parser, epochs=epochs, batch_size=64)
    use_lab_data_dir(parser, data)
    return parser


def add_file_system_args(parser: argparse.ArgumentParser) -> None:
    """The cost model's shared file system (``--fs-*``, defaults :data:`FS_DEFAULTS`) and ``--nodes``."""
    group = parser.add_argument_group("the shared file system of the cost model (defaults: README, 'Cost model')")
    for name, what in (("metadata_rtt_ms", "one round trip to the metadata servers"),
                       ("metadata_ops_per_s", "round trips the metadata servers serve per second, all clients"),
                       ("stream_gb_per_s", "GB/s one reading process gets"),
                       ("total_gb_per_s", "GB/s the file system delivers to all clients")):
        group.add_argument("--fs-" + name.replace("_", "-"), type=positive_float, default=FS_DEFAULTS[name],
                           help=f"{what} (default: %(default)s)")
    group.add_argument("--nodes", type=positive_int, nargs="+", default=[1, 4, 16, 64],
                       help="node counts to predict the epoch for (default: 1 4 16 64)")


def file_system(args: argparse.Namespace) -> dict[str, float]:
    """The ``--fs-*`` flags as the cost model's ``fs``: ``metadata_rtt_ms``, ``metadata_ops_per_s``, ..."""
    return {name: getattr(args, "fs_" + name) for name in FS_DEFAULTS}


# --------------------------------------------------------------------------------------------
# The model: the same for every format, so only the input pipeline differs


def build_model() -> nn.Module:
    """A small CNN for 64 x 64 grayscale digits (about 15 k parameters): three strided convolutions, then a
    linear layer. Light enough that the input pipeline matters on a CPU, heavy enough that one loader
    worker reading shards keeps it fed."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 4, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, NUM_CLASSES),
    )


def to_model_input(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """uint8 (B, 1, 64, 64) from the loader -> float in [0, 1] on ``device``: a quarter of the bytes cross
    to the device, and the conversion runs there."""
    return images.to(device, non_blocking=True).float().div_(255)


# --------------------------------------------------------------------------------------------
# The images (01_make_dataset.py)


def digit_variants(count: int, seed: int, *, chunk: int = 2048,
                   ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(ids, labels, uint8 images (n, 1, 64, 64)) in chunks: bundled digits under random affine maps + noise."""
    from common.data.datasets import load_digits_split
    from common.data.datasets import MNIST_MEAN, MNIST_STD

    digits, _ = load_digits_split(test_fraction=0.0, image_size=IMAGE_SIZE)
    sources = (digits.tensors[0] * MNIST_STD + MNIST_MEAN).clamp_(0, 1)  # back to ink in [0, 1]
    labels = digits.tensors[1]
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, count, chunk):
        n = min(chunk, count - start)
        pick = torch.randint(len(sources), (n,), generator=generator)
        angle = (torch.rand(n, generator=generator) - 0.5) * math.radians(30)
        scale = 0.85 + 0.3 * torch.rand(n, generator=generator)
        shear = (torch.rand(n, generator=generator) - 0.5) * 0.3
        shift = (torch.rand(n, 2, generator=generator) - 0.5) * 0.25
        cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
        theta = torch.stack([torch.stack([cos, -sin + shear, shift[:, 0]], 1),
                             torch.stack([sin, cos, shift[:, 1]], 1)], 1)
        grid = torch.nn.functional.affine_grid(theta, (n, 1, IMAGE_SIZE, IMAGE_SIZE), align_corners=False)
        images = torch.nn.functional.grid_sample(sources[pick], grid, align_corners=False)
        images = images * 235 + 10 + torch.randn(images.shape, generator=generator) * 12
        yield (torch.arange(start, start + n), labels[pick], images.clamp_(0, 255).to(torch.uint8))


# --------------------------------------------------------------------------------------------
# Counted I/O


@dataclass
class IOCounter:
    """What this process's dataset code did: files opened, stat-family calls, bytes read, and the wait it
    added before each open (``--metadata-latency``). A forked worker starts again from zero."""

    latency_s: float = 0.0
    opens: int = 0
    stats: int = 0
    bytes: int = 0
    waited_s: float = 0.0
    pid: int = field(default_factory=os.getpid)

    def fresh(self) -> "IOCounter":
        if self.pid != os.getpid():  # a DataLoader worker inherited the parent's counts: start from zero
            self.opens = self.stats = self.bytes = 0
            self.waited_s = 0.0
            self.pid = os.getpid()
        return self

    def snapshot(self) -> dict[str, Any]:
        return {"pid": self.pid, "opens": self.opens, "stats": self.stats, "bytes": self.bytes,
                "waited_s": self.waited_s}


COUNTER = IOCounter()


def set_metadata_latency(ms: float, worker_id: int | None = None) -> None:
    """The wait before each open, in ms; also a DataLoader ``worker_init_fn`` (``partial(set_metadata_latency,
    ms)``), so workers started with ``spawn`` (macOS) wait too."""
    COUNTER.latency_s = ms / 1000.0


def _wait() -> None:
    if COUNTER.latency_s > 0:
        start = time.perf_counter()
        time.sleep(COUNTER.latency_s)  # the round trips a shared file system's metadata server would cost
        COUNTER.waited_s += time.perf_counter() - start


def read_file(path: str | os.PathLike[str]) -> bytes:
    """A whole file: one open (after the injected wait), reads until the end, one close."""
    counter = COUNTER.fresh()
    _wait()
    fd = os.open(path, os.O_RDONLY)
    counter.opens += 1
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    counter.bytes += len(data)
    return data


def stat_file(path: str | os.PathLike[str]) -> os.stat_result:
    COUNTER.fresh().stats += 1
    return os.stat(path)


def list_folder(path: str | os.PathLike[str]) -> list[os.DirEntry]:
    """The entries of a folder (``getdents``: a metadata call on a shared file system too, counted as a stat)."""
    COUNTER.fresh().stats += 1
    with os.scandir(path) as entries:
        return sorted(entries, key=lambda entry: entry.name)


class EpochIO:
    """Sums the counts every worker attached to its batches: each worker's latest snapshot, less what that
    process had counted before the epoch began (the main process, when it reads with no workers, counts on)."""

    def __init__(self) -> None:
        self.before: dict[int, dict[str, Any]] = {}
        self.latest: dict[int, dict[str, Any]] = {}

    def start_epoch(self) -> None:
        self.before = {**self.before, **self.latest, os.getpid(): COUNTER.fresh().snapshot()}
        self.latest = {}

    def saw(self, io_counts: dict[str, Any]) -> None:
        self.latest[io_counts["pid"]] = io_counts

    def totals(self) -> dict[str, Any]:
        total = {"opens": 0, "stats": 0, "bytes": 0, "injected_wait_s": 0.0, "processes": len(self.latest)}
        for pid, now in self.latest.items():
            then = self.before.get(pid, {})
            for key, name in (("opens", "opens"), ("stats", "stats"), ("bytes", "bytes"),
                              ("waited_s", "injected_wait_s")):
                total[name] += now[key] - then.get(key, 0)
        return total


# --------------------------------------------------------------------------------------------
# Decoding


def decode(jpeg: bytes) -> torch.Tensor:
    """One JPEG -> uint8 (1, 64, 64) with libjpeg (torchvision.io); raises ValueError on a broken file."""
    try:
        image = decode_jpeg(torch.frombuffer(bytearray(jpeg), dtype=torch.uint8), mode=ImageReadMode.GRAY)
    except RuntimeError as err:
        raise ValueError(str(err).splitlines()[0]) from None
    if image.shape != (1, IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(f"decoded to shape {tuple(image.shape)}, expected (1, {IMAGE_SIZE}, {IMAGE_SIZE})")
    return image


def decode_batch(jpegs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Raw JPEG bytes (one uint8 tensor each) decoded where ``device`` is: nvJPEG on a GPU, libjpeg on a CPU."""
    images = decode_jpeg(jpegs, mode=ImageReadMode.GRAY, device=device)
    return torch.stack(images)


# --------------------------------------------------------------------------------------------
# The data set on disk


def describe_dataset(root: Path, fmt: str | None = None) -> dict[str, Any]:
    """What ``dataset.json`` says of the data set in ``root``; with ``fmt``, refused (one line) if that format is
    not in it, with the command that adds it."""
    path = Path(root) / "dataset.json"
    if not path.is_file():
        raise UserError(f"no data set in {root} (no dataset.json): make one with "
                        f"python labs/lab08_data_at_scale/01_make_dataset.py --data-dir {shlex.quote(str(root))}")
    description = json.loads(path.read_text())
    if fmt is not None and fmt not in description.get("formats", {}):
        raise UserError(missing_format(root, fmt, description))
    return description


def missing_format(root: Path, fmt: str, description: dict[str, Any]) -> str:
    """The data set in ``root`` lacks ``fmt``: 01_make_dataset.py writes a data set whole (it refuses a folder that
    exists), so the command writes it again, with the same images (samples, seed, quality, shard size) in the
    formats it has and ``fmt``, and ``--overwrite`` replaces it once the new one is complete."""
    held = [name for name in FORMATS if name in description.get("formats", {})]
    command = ["python", "labs/lab08_data_at_scale/01_make_dataset.py", "--data-dir", str(root), "--overwrite",
               "--formats", *[name for name in FORMATS if name in held or name == fmt]]
    for flag, key in (("--samples", "samples"), ("--shard-size", "shard_size"), ("--quality", "quality"),
                      ("--seed", "seed")):
        if key in description:
            command += [flag, str(description[key])]
    return (f"the data set in {root} has no {fmt} format (it holds {', '.join(held) or 'none'}): 01_make_dataset.py "
            f"writes a data set whole, so write it again with the same images and {fmt} added: {shlex.join(command)}")


@dataclass(frozen=True)
class ShardInfo:
    name: str
    samples: int
    bytes: int
    sha256: str
    members: tuple[dict[str, Any], ...]  # manifest rows of this shard (one per tar member), in the tar's order


def read_shard_table(shard_dir: Path) -> list[ShardInfo]:
    """The shards and their manifest rows, as 01_make_dataset.py wrote them."""
    shard_dir = Path(shard_dir)
    table, manifest = shard_dir / "shards.json", shard_dir / "manifest.csv"
    if not table.is_file() or not manifest.is_file():
        if (shard_dir / "dataset.json").is_file():  # a data set made without its shards (03 reads DATA/shards)
            describe_dataset(shard_dir, "webdataset")  # one line with the command that adds them
        raise UserError(f"{shard_dir} has no shards.json and manifest.csv: make the data set with "
                        "python labs/lab08_data_at_scale/01_make_dataset.py")
    rows: dict[str, list[dict[str, Any]]] = {}
    with open(manifest, newline="") as handle:
        for row in csv.DictReader(handle):
            rows.setdefault(row["shard"], []).append(
                {"id": int(row["id"]), "label": int(row["label"]), "member": row["member"],
                 "offset": int(row["offset"]), "size": int(row["size"]), "crc32": int(row["crc32"])})
    return [ShardInfo(entry["name"], entry["samples"], entry["bytes"], entry["sha256"],
                      tuple(rows.get(entry["name"], ()))) for entry in json.loads(table.read_text())["shards"]]


# --------------------------------------------------------------------------------------------
# Map-style readers: a folder of small files, and one array file


def attach_io(images: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A batch as the loop receives it: images, labels, and what came with them (ids, weights, this worker's
    counts so far)."""
    return images, labels, {"ids": ids, "weights": torch.ones(len(ids)), "io": COUNTER.fresh().snapshot()}


class ImageFolderFiles(Dataset):
    """``imagefolder/train/<class>/<id>.jpg``: one open per image (the folder listing is made once, here)."""

    def __init__(self, root: Path, *, decode_in_loader: bool = True) -> None:
        train = Path(root) / "imagefolder" / "train"
        if not train.is_dir():
            raise UserError(f"{train} is missing: make the data set with "
                            "python labs/lab08_data_at_scale/01_make_dataset.py")
        self.decode_in_loader = decode_in_loader
        self.samples: list[tuple[str, int, int]] = []
        for class_dir in list_folder(train):
            if class_dir.is_dir():
                for entry in list_folder(class_dir.path):
                    self.samples.append((entry.path, int(class_dir.name), int(Path(entry.name).stem)))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int, int]:
        path, label, sample_id = self.samples[index]
        data = read_file(path)
        return (decode(data) if self.decode_in_loader else data), label, sample_id


class ArrayFile(Dataset):
    """``array/images.u8``: every JPEG back to back in one file, memory-mapped as a numpy uint8 array once per
    process; a sample is a slice at the offset ``index.npy`` gives, so no file is opened per image."""

    def __init__(self, root: Path, *, decode_in_loader: bool = True) -> None:
        self.folder = Path(root) / "array"
        if not (self.folder / "index.npy").is_file():
            raise UserError(f"{self.folder} is missing: make the data set with "
                            "python labs/lab08_data_at_scale/01_make_dataset.py")
        self.index = np.load(self.folder / "index.npy")  # (N, 4): id, offset, size, label
        self.decode_in_loader = decode_in_loader
        self._images: np.ndarray | None = None
        self._pid = -1

    def _array(self) -> np.ndarray:
        if self._images is None or self._pid != os.getpid():  # each worker maps the file itself
            counter = COUNTER.fresh()  # before the wait: a worker's wait is counted in the worker's counts
            _wait()
            self._images = np.memmap(self.folder / "images.u8", dtype=np.uint8, mode="r")
            counter.opens += 1
            self._pid = os.getpid()
        return self._images

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, index: int) -> tuple[Any, int, int]:
        sample_id, offset, size, label = (int(v) for v in self.index[index])
        data = self._array()[offset:offset + size].tobytes()
        COUNTER.bytes += size
        return (decode(data) if self.decode_in_loader else data), label, sample_id


def collate_counted(samples: list[tuple[Any, int, int]]) -> tuple[Any, torch.Tensor, dict]:
    """Runs in the worker: stacks the images (or keeps the raw JPEGs) and attaches the worker's counts."""
    images = [sample[0] for sample in samples]
    if isinstance(images[0], bytes):
        images = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in images]
    else:
        images = torch.stack(images)
    return attach_io(images, torch.tensor([s[1] for s in samples]), torch.tensor([s[2] for s in samples]))


# --------------------------------------------------------------------------------------------
# The shard reader that keeps its position


class BadSample(Exception):
    """A sample that cannot be used, named by its shard and member; ``samples``: how many samples it costs (a
    truncated shard loses all those after the cut; a damaged tar header alone, none)."""

    def __init__(self, shard: str, member: str, reason: str, samples: int = 1) -> None:
        super().__init__(f"{shard}: {member}: {reason}")
        self.shard, self.member, self.reason, self.samples = shard, member, reason, samples


def split_samples(data: bytes, samples: list[dict[str, Any]]) -> None:
    """A tar shard's members grouped into samples by key, in the tar's order, with WebDataset's own tar
    reader (``webdataset.tariterators``), appended to ``samples`` as they come (a tar cut short keeps what
    came before the cut): ``{"__key__": "000042", "jpg": b"...", "cls": b"3"}``."""
    members, error = [], None
    try:  # every member up to the break first: grouping holds the sample before it until the next key comes
        for member in tar_file_iterator(io.BytesIO(data), handler=_reraise):
            members.append({**member, "__url__": None})
    except Exception as err:  # noqa: BLE001 - raised again once the samples before the break are kept
        error = err
    samples.extend(group_by_keys(iter(members), handler=_reraise))
    if error is not None:
        raise error


def index_samples(info: ShardInfo, data: bytes) -> list[dict[str, Any]]:
    """The same samples as :func:`split_samples`, sliced at the manifest's offsets: no tar header is parsed.
    Members past the end of ``data`` are left out."""
    samples: dict[int, dict[str, Any]] = {}
    for row in info.members:
        if row["offset"] + row["size"] <= len(data):
            key, ext = row["member"].rsplit(".", 1)
            samples.setdefault(row["id"], {"__key__": key})[ext] = data[row["offset"]:row["offset"] + row["size"]]
    return list(samples.values())


def _reraise(error: Exception) -> bool:
    raise error


def check_shard(info: ShardInfo, data: bytes, reader: str = "index") -> tuple[list[dict[str, Any]], list[BadSample]]:
    """The good samples of one shard read whole, and a :class:`BadSample` for every bad one: a truncated
    shard (fewer bytes than the manifest), a checksum mismatch (found member by member with each member's
    CRC-32), a sample missing its ``.jpg`` or ``.cls``. A JPEG that does not decode is found later, when it is.
    ``reader``: ``index`` slices the members at the manifest's offsets while the shard is whole (its SHA-256 as
    written); ``webdataset`` (and any shard that is not whole) parses the tar with WebDataset's reader."""
    import hashlib

    bad: list[BadSample] = []
    damaged: set[int] = set()  # sample ids with a member cut off or changed
    whole = len(data) == info.bytes and hashlib.sha256(data).hexdigest() == info.sha256
    if len(data) < info.bytes:
        cut = [row for row in info.members if row["offset"] + row["size"] > len(data)]
        damaged = {row["id"] for row in cut}
        bad.append(BadSample(info.name, cut[0]["member"] if cut else "(tar end)", f"truncated shard: {len(data)} "
                             f"of {info.bytes} bytes; {len(damaged)} sample(s) cut off from here",
                             samples=len(damaged)))
    elif not whole:
        for row in info.members:
            if row["id"] not in damaged and zlib.crc32(data[row["offset"]:row["offset"] + row["size"]]) != row["crc32"]:
                bad.append(BadSample(info.name, row["member"], "checksum mismatch (sha256 of the shard, "
                                                               "CRC-32 of this member)"))
                damaged.add(row["id"])
        if not damaged:
            bad.append(BadSample(info.name, "(tar headers)", "checksum mismatch outside the members' data", samples=0))
    samples: list[dict[str, Any]] = []
    if reader == "index" and whole:
        samples = index_samples(info, data)
    else:
        try:
            split_samples(data, samples)
        except Exception as err:  # a tar cut short or broken: keep what was read before the break
            if not bad:
                bad.append(BadSample(info.name, "(tar)", f"unreadable tar: {err}"))
    good = []
    for sample in samples:
        key = sample.get("__key__", "?")
        missing = [ext for ext in ("jpg", "cls") if ext not in sample]
        if key.isdigit() and int(key) in damaged:
            continue  # named above, with its shard
        if missing:
            bad.append(BadSample(info.name, f"{key}.{missing[0]}", "missing member"))
        else:
            good.append(sample)
    return good, bad


class ShardStream(IterableDataset):
    """WebDataset shards read over ranks x workers, each sample once per epoch, resumable mid-epoch.

    - **Who reads what.** The epoch's shard order is a permutation seeded by ``(seed, epoch)``; the
      ``world_size x workers`` reader slots (slot = rank x workers + worker) deal the shards out in that order,
      slot ``s`` taking shards ``s, s + slots, ...``. Every shard goes to exactly one slot.
    - **Uneven counts** (``policy``): the slots may hold different numbers of samples. ``uneven`` leaves them
      so (every sample once; ranks take different numbers of steps); ``pad`` fills every slot up to the
      largest with weight-0 blanks (id -1: every real sample still once, equal steps); ``drop`` stops every
      slot at the smallest (equal steps; what is left is not read this epoch, counted).
    - **Shuffle at two levels**: the shard order, then a buffer of ``buffer_size`` samples from which each
      sample is drawn at random (``random.Random`` seeded by seed, epoch and slot).
    - **Position**: :meth:`state_dict` is where this worker stands (shard, member, the buffer's samples as
      pointers, the generator's state); torchdata's ``StatefulDataLoader`` collects it from every worker
      with each batch, and :meth:`load_state_dict` continues from it.
    - **Bad data**: ``on_bad_sample="skip"`` leaves a bad sample out and counts it; ``"fail"`` stops the run
      with one line naming the shard and the member.

    Yields whole batches ``(images uint8 (B,1,64,64), labels, extras)``: use ``batch_size=None`` in the loader.
    """

    def __init__(self, shard_dir: Path, *, batch_size: int, rank: int = 0, world_size: int = 1, num_workers: int = 0,
                 seed: int = 0, policy: str = "uneven", buffer_size: int = 256, on_bad_sample: str = "fail",
                 decode_in_loader: bool = True, reader: str = "index") -> None:
        self.shard_dir = Path(shard_dir)
        self.shards = read_shard_table(self.shard_dir)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.workers = max(1, num_workers)
        self.seed, self.policy, self.buffer_size = seed, policy, buffer_size
        self.on_bad_sample, self.decode_in_loader, self.reader = on_bad_sample, decode_in_loader, reader
        self.epoch = 1
        self._resume: dict[str, Any] | None = None
        self._state: dict[str, Any] | None = None

    # ---------------------------------------------------------------- the plan of an epoch
    @property
    def slots(self) -> int:
        return self.world_size * self.workers

    def shard_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.shards)))
        random.Random(f"{self.seed}-{epoch}-shards").shuffle(order)
        return order

    def plan(self, epoch: int) -> list[list[int]]:
        """The shards of every slot this epoch (indices into ``self.shards``)."""
        order = self.shard_order(epoch)
        return [order[slot::self.slots] for slot in range(self.slots)]

    def slot_samples(self, epoch: int) -> list[int]:
        return [sum(self.shards[i].samples for i in shards) for shards in self.plan(epoch)]

    def target(self, epoch: int, slot: int) -> int | None:
        """Samples this slot yields this epoch: every slot the same under pad and drop, its own under uneven."""
        counts = self.slot_samples(epoch)
        return {"pad": max(counts), "drop": min(counts)}.get(self.policy)

    def describe(self, epoch: int) -> dict[str, Any]:
        counts = self.slot_samples(epoch)
        total = sum(counts)
        used = {"pad": max(counts) * len(counts), "drop": min(counts) * len(counts)}.get(self.policy, total)
        return {"epoch": epoch, "policy": self.policy, "shards": len(self.shards), "slots": self.slots,
                "samples": total, "slot_samples_min": min(counts), "slot_samples_max": max(counts),
                "padded": max(0, used - total), "dropped": max(0, total - used)}

    def plan_line(self, epoch: int) -> str:
        """The plan of ``epoch`` in one line: the shards over the reader slots, and what the policy costs in it."""
        plan = self.describe(epoch)
        cost = {"pad": f"{plan['padded']:,} weight-0 blank(s) in epoch {epoch} pad the slots to the largest",
                "drop": f"{plan['dropped']:,} sample(s) left out in epoch {epoch} (the smallest slot sets the pace)",
                "uneven": "every sample once, ranks take different numbers of steps (DDP's Join)"}[self.policy]
        return (f"{plan['shards']} shard(s), {plan['samples']:,} samples, over {plan['slots']} reader slot(s) "
                f"({self.world_size} rank(s) x {self.workers} worker(s)): {plan['slot_samples_min']:,} to "
                f"{plan['slot_samples_max']:,} samples a slot | --shard-policy {self.policy}: {cost}")

    def __len__(self) -> int:
        """Batches this rank's loader yields in an epoch (each worker batches its own samples)."""
        own = range(self.rank * self.workers, (self.rank + 1) * self.workers)
        counts = self.slot_samples(self.epoch)
        target = {"pad": max(counts), "drop": min(counts)}.get(self.policy)
        return sum(-(-(counts[slot] if target is None else target) // self.batch_size) for slot in own)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    # ---------------------------------------------------------------- position
    def state_dict(self) -> dict[str, Any]:
        return dict(self._state) if self._state is not None else {"epoch": self.epoch, "fresh": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = None if state.get("fresh") else dict(state)
        self.epoch = state["epoch"]

    # ---------------------------------------------------------------- reading
    def _read(self, index: int, bad_samples: list[dict[str, str]]) -> list[dict[str, Any]]:
        info = self.shards[index]
        try:
            data = read_file(self.shard_dir / info.name)
        except FileNotFoundError:  # not a truncated shard (its first member named): the file is not there
            self._bad(BadSample(info.name, "(the shard file)", f"no such file in {self.shard_dir}; its "
                                f"{len(info.members) // 2} sample(s) are missing", samples=len(info.members) // 2),
                      bad_samples)
            return []
        good, bad = check_shard(info, data, self.reader)
        for sample in good:
            sample["__shard__"] = info.name
        for problem in bad:
            self._bad(problem, bad_samples)
        return good

    def _bad(self, problem: BadSample, bad_samples: list[dict[str, str]]) -> None:
        if self.on_bad_sample == "fail":
            raise problem
        bad_samples.append({"shard": problem.shard, "member": problem.member, "reason": problem.reason,
                            "samples": problem.samples})

    def __iter__(self) -> Iterator[tuple[Any, torch.Tensor, dict[str, Any]]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        slot = self.rank * self.workers + worker
        bad_samples: list[dict[str, str]] = []
        try:
            yield from self._batches(slot, bad_samples)
        except BadSample as problem:  # --on-bad-sample fail: the loop raises it as one line (see check_batch)
            yield _empty(), torch.zeros(0, dtype=torch.long), {"error": str(problem), "io": COUNTER.fresh().snapshot()}

    def _batches(self, slot: int, bad_samples: list[dict[str, str]]) -> Iterator[tuple[Any, torch.Tensor, dict]]:
        state, self._resume = self._resume, None
        epoch = state["epoch"] if state else self.epoch
        shards = self.plan(epoch)[slot]
        target = self.target(epoch, slot)
        rng = random.Random(f"{self.seed}-{epoch}-slot{slot}")
        position, member, emitted, skipped_before = 0, 0, 0, 0
        buffer: list[tuple[int, int, dict[str, Any]]] = []  # (position in `shards`, member index, sample)
        cache: dict[int, list[dict[str, Any]]] = {}
        if state:
            position, member, emitted = state["position"], state["member"], state["emitted"]
            skipped_before = state["skipped"]
            rng.setstate(_tuples(state["rng"]))
            for pos, index in state["buffer"]:  # the buffer's samples are pointers: read their shards again
                if pos not in cache:
                    cache[pos] = self._read(shards[pos], bad_samples)
                buffer.append((pos, index, cache[pos][index]))
            bad_samples.clear()  # counted before the stop already

        def samples() -> Iterator[tuple[int, int, dict[str, Any]]]:
            nonlocal position, member
            while position < len(shards):
                good = cache.pop(position, None)
                if good is None:
                    good = self._read(shards[position], bad_samples)
                cache.clear()
                while member < len(good):
                    member += 1
                    yield position, member - 1, good[member - 1]
                position, member = position + 1, 0

        def drawn() -> Iterator[tuple[int, int, dict[str, Any]] | None]:
            for entry in samples():  # first level: shards in this epoch's order; second: the buffer
                buffer.append(entry)
                if len(buffer) >= self.buffer_size:
                    yield buffer.pop(rng.randrange(len(buffer)))
            while buffer:
                yield buffer.pop(rng.randrange(len(buffer)))
            while True:  # this slot is out of samples: blanks (pad), or nothing more
                yield None

        batch: list[tuple[torch.Tensor | bytes, int, int, float]] = []
        for entry in drawn():
            if target is not None and emitted >= target:
                break
            if entry is None:  # this slot has no sample left: uneven stops; pad and drop fill up to the target
                if target is None:
                    break
                batch.append((_blank(self.decode_in_loader), 0, -1, 0.0))
            else:
                _, _, sample = entry
                try:
                    image = decode(sample["jpg"]) if self.decode_in_loader else sample["jpg"]
                    label = int(sample["cls"].decode())
                except (ValueError, UnicodeDecodeError) as err:
                    self._bad(BadSample(sample["__shard__"], f"{sample['__key__']}.jpg", f"corrupt JPEG ({err})"),
                              bad_samples)
                    continue
                batch.append((image, label, int(sample["__key__"]), 1.0))
            emitted += 1
            if len(batch) == self.batch_size:
                yield self._batch(batch, epoch, slot, position, member, emitted, buffer, rng, bad_samples,
                                  skipped_before)
                batch = []
        if batch:
            yield self._batch(batch, epoch, slot, position, member, emitted, buffer, rng, bad_samples, skipped_before)

    def _batch(self, batch, epoch, slot, position, member, emitted, buffer, rng, bad_samples, skipped_before):
        # Where this worker stands after this batch: what StatefulDataLoader keeps with it.
        self._state = {"epoch": epoch, "slot": slot, "position": position, "member": member, "emitted": emitted,
                       "buffer": [[pos, index] for pos, index, _ in buffer], "rng": rng.getstate(),
                       "skipped": skipped_before + _cost(bad_samples)}
        images = [item[0] for item in batch]
        images = (torch.stack(images) if self.decode_in_loader
                  else [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in images])
        return images, torch.tensor([item[1] for item in batch]), {
            "ids": torch.tensor([item[2] for item in batch]), "weights": torch.tensor([item[3] for item in batch]),
            "io": COUNTER.fresh().snapshot(), "slot": slot, "skipped": skipped_before + _cost(bad_samples),
            "bad": list(bad_samples[-20:])}


def _cost(bad_samples: list[dict[str, Any]]) -> int:
    """The samples that bad data cost (a truncated shard, every sample after the cut)."""
    return sum(problem["samples"] for problem in bad_samples)


def _tuples(value: Any) -> Any:
    """``random.Random.getstate()`` after a round trip through a checkpoint (lists back to tuples)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _blank(decoded: bool) -> torch.Tensor | bytes:
    return torch.zeros(1, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.uint8) if decoded else b""


def _empty() -> torch.Tensor:
    return torch.zeros(0, 1, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.uint8)


def check_batch(extras: dict[str, Any], *, can_skip: bool = True) -> None:
    """A worker that met bad data under ``--on-bad-sample fail`` sends its one line instead of a batch.
    ``can_skip``: the script has ``--on-bad-sample`` (03_shards_exactly_once.py; 02_read_formats.py has not)."""
    if "error" in extras:
        hint = ("--on-bad-sample skip leaves such samples out and counts them" if can_skip else
                "remake the data set with 01_make_dataset.py, or read it with 03_shards_exactly_once.py "
                "--on-bad-sample skip")
        raise UserError(f"bad data: {extras['error']} ({hint})")


# --------------------------------------------------------------------------------------------
# 02_read_formats.py's loaders and the cost model's calibration


def make_loader(fmt: str, data_dir: Path, *, batch_size: int, num_workers: int, seed: int, shuffle_buffer: int,
                decode_in_loader: bool, metadata_latency_ms: float, shard_reader: str, pin_memory: bool,
                limit: int | None = None) -> tuple[DataLoader, dict[str, int]]:
    """The format's dataset and its loader; what it holds (``samples``, ``files``). Shards come as whole batches
    from each worker (:class:`ShardStream` deals them out); the other two through a seeded ``RandomSampler``,
    which draws only ``limit`` samples when given (the cost model's calibration: no batch made beyond it)."""
    init = partial(worker_ignores_sigterm, then=partial(set_metadata_latency, metadata_latency_ms))  # spawn too
    common = dict(num_workers=num_workers, worker_init_fn=init, pin_memory=pin_memory)
    if fmt == "webdataset":
        stream = ShardStream(data_dir / "shards", batch_size=batch_size, num_workers=num_workers, seed=seed,
                             policy="uneven", buffer_size=shuffle_buffer, decode_in_loader=decode_in_loader,
                             reader=shard_reader)
        return DataLoader(stream, batch_size=None, **common), {"samples": sum(s.samples for s in stream.shards),
                                                               "files": len(stream.shards)}
    dataset = (ImageFolderFiles if fmt == "imagefolder" else ArrayFile)(data_dir, decode_in_loader=decode_in_loader)
    sampler = RandomSampler(dataset, num_samples=limit, generator=torch.Generator())
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_counted, **common)
    return loader, {"samples": len(dataset), "files": len(dataset) if fmt == "imagefolder" else 1}


def set_loader_epoch(loader: DataLoader, seed: int, epoch: int) -> None:
    """This epoch's order, the same in every run with this seed."""
    if isinstance(loader.dataset, ShardStream):
        loader.dataset.set_epoch(epoch)
    else:
        loader.sampler.generator.manual_seed(seed * 1000 + epoch)


def expected_opens(fmt: str, held: dict[str, int], samples: int, num_workers: int) -> int:
    """The files an epoch of ``samples`` opens, from the format alone: one per image, one per shard, one array
    per loader process."""
    if fmt == "imagefolder":
        return samples
    if fmt == "webdataset":
        return held["files"] if samples >= held["samples"] else math.ceil(samples * held["files"] / held["samples"])
    return max(1, num_workers)


def calibrate(make: Any, *, fmt: str, samples: int, workers: int, decode_device: torch.device | None,
              model: nn.Module, lr: float, batch_size: int, device: torch.device, read_only: bool) -> dict[str, Any]:
    """What this machine pays, measured before the epochs: producing one sample of this format the way the epochs
    do (``make(limit)``: a loader with the epochs' ``workers`` and no injected latency, drawing ``limit`` samples;
    open, read, checksum, decode, batch, and a worker's hand-over of each batch to this process), per worker,
    after one batch that is not timed (the workers' start; the decoder's first call loads its library); what one
    injected wait before an open lasts here (a sleep lasts longer than it asks, the more so on a busy machine);
    and one training step on a batch (median of 5 after 2 warm-up steps)."""
    latency = COUNTER.latency_s
    waits = [0.0]
    while latency > 0 and (len(waits) < 6 or sum(waits) < 0.2):
        start = time.perf_counter()
        time.sleep(latency)
        waits.append(time.perf_counter() - start)
    COUNTER.latency_s = 0.0
    try:
        loader = make(batch_size + samples)  # the warm-up batch, then the timed samples
        set_loader_epoch(loader, 0, 10_000)  # another order than the epochs', so the page cache is not primed
        if fmt == "webdataset":  # whole shards: a shard's checksum and its index belong to its samples
            size = loader.dataset.shards[0].samples
            samples = max(samples, size * max(1, round(samples / size)))
        produced, start = -1, 0.0
        for images, labels, extras in loader:
            check_batch(extras, can_skip=False)  # 02_read_formats.py has no --on-bad-sample
            if decode_device is not None:
                images = decode_batch(images, decode_device)
                synchronize(decode_device)  # nvJPEG decodes on a CUDA stream: done before the clock is read
            if produced < 0:  # the warm-up batch: the clock starts after it
                produced, start = 0, time.perf_counter()
                continue
            produced += len(labels)
            if produced >= samples:
                break
        sample_s = (time.perf_counter() - start) * max(workers, 1) / max(produced, 1)  # one worker's share
    finally:
        COUNTER.latency_s = latency
    step_s = 0.0
    if not read_only:
        probe = build_model().to(device)
        probe.load_state_dict(model.state_dict())
        optimizer = torch.optim.SGD(probe.parameters(), lr=lr, momentum=0.9)
        images = torch.randint(0, 255, (batch_size, 1, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8)
        labels = torch.randint(0, NUM_CLASSES, (batch_size,))
        times = []
        for _ in range(2 + 5):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(probe(to_model_input(images, device)), labels.to(device)).backward()
            optimizer.step()
            synchronize(device)
            times.append(time.perf_counter() - start)
        step_s = statistics.median(times[2:])
    return {"sample_s": sample_s, "samples_timed": produced, "step_s": step_s,
            "open_wait_s": statistics.mean(waits[1:] or waits),
            "method": "the epochs' loader workers, no injected latency, before the first epoch, after one batch, per "
                      "worker; the wait: the mean "
                      "of at least 5 sleeps, 0.2 s in all; step: median of 5 after 2"}


# --------------------------------------------------------------------------------------------
# 03_shards_exactly_once.py's checkpoint: the loader's position is every rank's own


class IdsRead:
    """The ids this rank read in the epoch under way, kept in its loader checkpoint: a run resumed mid-epoch counts
    those read before the stop (``before``) when rank 0 says whether every sample was read exactly once."""

    def __init__(self) -> None:
        self.before: list[int] = []  # read before the stop, by the run this one resumes
        self.ids: list[int] = []  # read by this process in this epoch

    def start_epoch(self) -> list[int]:
        self.ids = []
        return self.ids

    def all(self) -> list[int]:
        return [*self.before, *self.ids]

    def end_epoch(self) -> None:  # counted: the checkpoint at the epoch's end carries none into the next
        self.before, self.ids = [], []

    def state_dict(self) -> dict[str, list[int]]:
        return {"ids": self.all()}

    def load_state_dict(self, state: dict[str, list[int]]) -> None:
        self.before = list(state["ids"])


class LoaderCheckpoint(TorchCheckpointer):
    """Rank 0's file holds the model and the optimiser (the same on every rank); the loader's position is each
    rank's own, so every rank writes it beside, with the ids it read this epoch (:class:`IdsRead`):
    ``<checkpoint>.loader-rank<r>``. A resumed run must have as
    many ranks and workers (the plan of an epoch depends on both)."""

    every_rank_writes = True

    def __init__(self, path: Path, rank: int) -> None:
        super().__init__(path)
        self.rank = rank

    def rank_path(self) -> Path:
        return self.path.with_name(f"{self.path.name}.loader-rank{self.rank}")

    def save(self, state, tracked) -> None:
        save_checkpoint({"loader": tracked["loader"].state_dict(), "epoch": state["epoch"], "step": state["step"],
                         **({"ids": tracked["ids"].state_dict()} if "ids" in tracked else {})}, self.rank_path())
        if self.rank == 0:  # written last: a checkpoint is whole once this file says so
            super().save(state, {name: obj for name, obj in tracked.items() if name not in ("loader", "ids")})

    def read(self):
        state = super().read()
        if state is None:
            return None
        own = load_checkpoint(self.rank_path())
        if own is None or (own["epoch"], own["step"]) != (state["epoch"], state["step"]):
            raise UserError(f"{self.rank_path()} does not match {self.path} (epoch {state['epoch']} step "
                            f"{state['step']}): start fresh without --resume")
        state["loader"], state["ids"] = own["loader"], own.get("ids", {"ids": []})  # (ids: the ids read this epoch)
        return state
