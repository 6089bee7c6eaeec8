#!/usr/bin/env python3
"""Lab-08 step 1: one data set of 50,000 JPEG digits, written three ways: small files, tar shards, one array.

Usage:
    python labs/lab08_data_at_scale/01_make_dataset.py                       # 50,000 images into data/lab08
    python labs/lab08_data_at_scale/01_make_dataset.py --samples 2000 --shard-size 100 --data-dir /tmp/digits
    python labs/lab08_data_at_scale/01_make_dataset.py --dry-run             # 200 images, to try it
    sbatch stage_and_train_2node.sbatch   # rendered from sbatch/stage_and_train_2node.sbatch.j2 (reads them)

What it teaches: the same images take three shapes on a file system, and the shape decides what a
shared file system must do to serve them. As a folder of small files (torchvision's ImageFolder
layout) every image is a file: one open, and on Lustre or GPFS one round trip to the metadata servers
all users share. As tar shards in WebDataset's layout (``<id>.jpg`` + ``<id>.cls`` per sample, written
with ``webdataset.ShardWriter``) a thousand images are one file read front to back. As one array file
(a numpy memmap of every JPEG back to back, with an index of offsets) the whole set is one file read
at the offsets a sampler asks for. The writer records a SHA-256 per shard (``SHA256SUMS``, what
``sha256sum -c`` reads after a copy) and a manifest, a row per tar member: sample id, label, shard, member,
byte offset, size, CRC-32. Every member gets the same integer modification time: no PAX header (README).

The images: scikit-learn's bundled 1,797 handwritten digits (8 x 8, offline), each drawn many times at
64 x 64 through a random affine transform (rotation, scale, shear, shift) and Gaussian noise, then
encoded as a real JPEG (quality 90, about 2 KB): decoding costs what a JPEG costs. They are not MNIST.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import shutil
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from common.cli import add_run_args, config_dict, output_dir, percent_int, positive_int, script_parser
from common.errors import UserError, run_main
from common.results import make_record, provenance, write_record
from common.runtime.device import resolve_device
from common.units import format_bytes
from labs.lab08_data_at_scale.lab08_shared import FORMATS, IMAGE_SIZE, LAB, default_data_dir, digit_variants

SCRIPT = "labs/lab08_data_at_scale/01_make_dataset.py"
#: Every shard member's modification time (2026-01-01): fixed, so one seed writes byte-identical shards.
SHARD_MTIME = 1_767_225_600


def encode(images: torch.Tensor, quality: int) -> list[bytes]:
    from torchvision.io import encode_jpeg

    return [bytes(jpeg.numpy()) for jpeg in encode_jpeg(list(images), quality=quality)]


def write_imagefolder(folder: Path, samples) -> dict:
    """``train/<class>/<id>.jpg``: one file per image."""
    files = 0
    for sample_id, label, jpeg in samples:
        path = folder / "train" / str(label) / f"{sample_id:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(jpeg)
        files += 1
    return {"files": files}


def write_shards(folder: Path, samples, shard_size: int) -> dict:
    """Tar shards of ``shard_size`` samples with WebDataset's ShardWriter, then a manifest row per tar member
    (where its ``.jpg`` or ``.cls`` sits in the tar, its label, its CRC-32) and a SHA-256 per shard."""
    import tarfile

    import webdataset as wds

    folder.mkdir(parents=True)
    # An integer mtime: ShardWriter's default is time.time(), a float, which the tar format can only hold in a PAX
    # header before every member, and parsing those headers, not decoding, then sets a reader's pace (README).
    with wds.ShardWriter(str(folder / "shard-%06d.tar"), maxcount=shard_size, verbose=0, mtime=SHARD_MTIME) as sink:
        for sample_id, label, jpeg in samples:
            sink.write({"__key__": f"{sample_id:06d}", "jpg": jpeg, "cls": str(label).encode()})
    rows, shards = [], []
    for path in sorted(folder.glob("shard-*.tar")):
        data = path.read_bytes()
        with tarfile.open(path) as tar:
            members = {member.name: member for member in tar.getmembers()}
        shard_rows = []
        for name, member in members.items():  # in the tar's order
            key = name.rsplit(".", 1)[0]
            cls = members[key + ".cls"]
            blob = data[member.offset_data:member.offset_data + member.size]
            shard_rows.append({"id": int(key), "shard": path.name, "member": name,
                               "label": int(data[cls.offset_data:cls.offset_data + cls.size]),
                               "offset": member.offset_data, "size": member.size, "crc32": zlib.crc32(blob)})
        rows += shard_rows
        shards.append({"name": path.name, "samples": len({row["id"] for row in shard_rows}),
                       "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    with open(folder / "manifest.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (folder / "shards.json").write_text(json.dumps({"shard_size": shard_size, "shards": shards}, indent=1) + "\n")
    (folder / "SHA256SUMS").write_text("".join(f"{s['sha256']}  {s['name']}\n" for s in shards))
    return {"files": len(shards) + 3, "shards": len(shards)}


def write_array(folder: Path, samples) -> dict:
    """``images.u8``: every JPEG back to back; ``index.npy``: (id, offset, size, label) per sample."""
    folder.mkdir(parents=True)
    index, offset = [], 0
    with open(folder / "images.u8", "wb") as handle:
        for sample_id, label, jpeg in samples:
            handle.write(jpeg)
            index.append((sample_id, offset, len(jpeg), label))
            offset += len(jpeg)
    np.save(folder / "index.npy", np.array(index, dtype=np.int64))
    return {"files": 2}


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    group = parser.add_argument_group("the data set")
    group.add_argument("--samples", type=positive_int, default=50_000,
                       help="images to make; every format holds all of them (default: %(default)s)")
    group.add_argument("--shard-size", type=positive_int, default=1000,
                       help="samples per tar shard (default: %(default)s)")
    group.add_argument("--quality", type=percent_int, default=90, help="JPEG quality, 1-100 (default: %(default)s)")
    group.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS),
                       help="which formats to write (default: all three)")
    group.add_argument("--data-dir", type=output_dir, default=default_data_dir(),
                       help="the folder to write; it must not exist yet (default: data/lab08 in the repository)")
    group.add_argument("--overwrite", action="store_true",
                       help="replace a data set already in --data-dir, once the new one is complete (default: off)")
    add_run_args(parser, dry_run="200 images in shards of 50: checks that everything runs")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    resolve_device(args.device, start=False)  # checked as every script does; the images are made on the CPU
    if args.dry_run:
        args.samples, args.shard_size = min(args.samples, 200), min(args.shard_size, 50)
    target = args.data_dir
    if target.exists() and not args.overwrite:
        raise UserError(f"{target} already exists; choose another --data-dir or add --overwrite")
    # Everything is written into a hidden folder beside the target and renamed into place when complete:
    # a crash leaves no half-written data set where the readers look.
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.writing"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        began = time.perf_counter()
        generated: list[tuple[int, int, bytes]] = []
        for ids, labels, images in digit_variants(args.samples, args.seed):
            generated += zip(ids.tolist(), labels.tolist(), encode(images, args.quality))
            print(f"made {len(generated):,} of {args.samples:,} images", flush=True)
        made_s = time.perf_counter() - began
        writers = {"imagefolder": lambda folder: write_imagefolder(folder, generated),
                   "webdataset": lambda folder: write_shards(folder, generated, args.shard_size),
                   "array": lambda folder: write_array(folder, generated)}
        folders = {"imagefolder": "imagefolder", "webdataset": "shards", "array": "array"}
        written = {}
        for name in args.formats:
            start = time.perf_counter()
            written[name] = {**writers[name](staging / folders[name]), "folder": folders[name],
                             "bytes": folder_bytes(staging / folders[name]), "write_s": time.perf_counter() - start}
            print(f"{name}: {written[name]['files']:,} file(s), {format_bytes(written[name]['bytes'])} "
                  f"in {written[name]['write_s']:.1f} s", flush=True)
        jpeg_bytes = sum(len(item[2]) for item in generated)
        description = {"samples": args.samples, "image_size": IMAGE_SIZE, "quality": args.quality, "seed": args.seed,
                       "shard_size": args.shard_size, "jpeg_bytes": jpeg_bytes, "formats": written,
                       "source": "scikit-learn's bundled digits under random affine transforms and noise"}
        (staging / "dataset.json").write_text(json.dumps(description, indent=1) + "\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"{args.samples:,} images ({format_bytes(jpeg_bytes)} of JPEG, {jpeg_bytes / args.samples:,.0f} bytes each) "
          f"in {target}")
    record = make_record(lab=LAB, script=SCRIPT, method="make-dataset", config=config_dict(args),
                         metrics={"samples": args.samples, "jpeg_bytes": jpeg_bytes, "make_s": made_s,
                                  "formats": written}, provenance=provenance(torch.device("cpu")))
    print(f"record: {write_record(record, args.results_dir)}")
    return 0


if __name__ == "__main__":
    run_main(main)
