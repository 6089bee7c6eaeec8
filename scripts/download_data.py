#!/usr/bin/env python3
"""Download the course's data sets on a LOGIN node, so jobs on compute nodes (no internet) can read them.

Usage:
    python scripts/download_data.py mnist                              # on the login node, into ~/data
    export DATA_DIR=/scratch/$USER/data    # elsewhere: then this script and the jobs use that folder
    python scripts/download_data.py mnist --check                      # in a job: are they there?
    python chapters/ch04_deep_learning/mnist_training.py --dataset mnist --data-dir ~/data
    (a login-node tool: no torchrun or sbatch form, since compute nodes cannot download)

The default folder is the course's one data setting: ``$DATA_DIR`` when set, else ``~/data``. The
sbatch jobs read the same (``slurm/lib/job_header.sh`` exports ``DATA_DIR`` with that default), so
what you download here is what the jobs find; ``export DATA_DIR=...`` moves both.

This is the only code in the repository that downloads anything: the training scripts read
``--data-dir`` and stop with a message naming this script when a data set is missing. Put the data on
a file system the compute nodes mount (home or project space, not a node's /tmp). ``digits`` and
``synthetic`` need no download: they ship with scikit-learn or are generated.

Downloads go to a hidden temporary folder inside ``--data-dir`` and are moved into place only when
complete, so an interrupted download never leaves a half-written data set behind. ``--check``
reads what is there without touching the network and exits non-zero when something is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from common.cli import input_dir, output_dir, script_parser
from common.errors import UserError, run_main

#: name -> (torchvision class, the folder it keeps under --data-dir, approximate download size)
DATASETS: dict[str, tuple[str, str, str]] = {
    "mnist": ("MNIST", "MNIST", "12 MB"),
    "cifar10": ("CIFAR10", "cifar-10-batches-py", "170 MB"),
}


def dataset_class(name: str) -> Any:
    from torchvision import datasets

    return getattr(datasets, DATASETS[name][0])


def check(name: str, data_dir: Path) -> tuple[bool, str]:
    """Whether ``name`` is complete under ``data_dir`` (read with ``download=False``), and what was found."""
    cls = dataset_class(name)
    try:
        train = cls(str(data_dir), train=True, download=False)
        test = cls(str(data_dir), train=False, download=False)
    except (RuntimeError, OSError, ValueError) as err:  # torchvision: "Dataset not found or corrupted"
        message = str(err).splitlines()[0]
        # torchvision's own advice ("use download=True") is wrong on a compute node: say what it means.
        return False, "not found or incomplete" if "not found" in message.lower() else message
    return True, f"train {len(train)}, test {len(test)} samples"


def download(name: str, data_dir: Path) -> None:
    """Fetch ``name`` into a temporary folder in ``data_dir``, then move the finished set into place."""
    cls = dataset_class(name)
    folder = DATASETS[name][1]
    created = [path for path in (data_dir, *data_dir.parents) if not path.exists()]  # deepest first
    data_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".download-{name}-", dir=data_dir))
    try:
        try:
            cls(str(staging), train=True, download=True)
            cls(str(staging), train=False, download=True)
        except (RuntimeError, OSError) as err:  # URLError is an OSError; torchvision wraps mirror failures
            shutil.rmtree(staging, ignore_errors=True)
            for path in created:  # the folders this run made, now empty: a failed download leaves nothing
                path.rmdir()
            raise UserError(f"could not download {name}: {str(err).splitlines()[0]} "
                            "(compute nodes have no internet: run this on a login node)") from None
        target = data_dir / folder
        if target.exists():  # an incomplete earlier copy (check() said so): replace it
            shutil.rmtree(target)
        (staging / folder).rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # the archives and anything half-fetched


def default_data_dir() -> Path:
    """``$DATA_DIR``, else ``~/data``: the folder the course's sbatch jobs read (job_header.sh)."""
    return Path(os.environ.get("DATA_DIR") or Path.home() / "data")


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("datasets", nargs="+", choices=sorted(DATASETS), metavar="DATASET",
                        help=f"data sets to fetch: {', '.join(sorted(DATASETS))}")
    parser.add_argument("--data-dir", type=input_dir, default=default_data_dir(),
                        help="folder to put them in; the sbatch jobs read $DATA_DIR, else ~/data, and the "
                             "training scripts take it as --data-dir (default: %(default)s)")
    parser.add_argument("--check", action="store_true",
                        help="only verify that the data sets are there; never downloads (default: off)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.check:  # --check only reads (a shared, read-only copy is fine); a download writes there
        try:
            output_dir(str(args.data_dir))
        except argparse.ArgumentTypeError as err:
            parser.error(f"argument --data-dir: {err}")
    data_dir = args.data_dir.expanduser().resolve()
    missing = []
    for name in dict.fromkeys(args.datasets):
        ok, detail = check(name, data_dir)
        if ok:
            print(f"{name}: present in {data_dir / DATASETS[name][1]} ({detail})")
            continue
        if args.check:
            print(f"{name}: MISSING in {data_dir} ({detail})")
            missing.append(name)
            continue
        print(f"{name}: downloading about {DATASETS[name][2]} into {data_dir} ...", flush=True)
        download(name, data_dir)
        ok, detail = check(name, data_dir)
        if not ok:
            raise UserError(f"{name} was downloaded but does not read back: {detail}")
        print(f"{name}: fetched into {data_dir / DATASETS[name][1]} ({detail})")
    if missing:
        raise UserError(f"{', '.join(missing)} not found under {data_dir}; on a login node run "
                        f"'python scripts/download_data.py {' '.join(missing)} --data-dir {data_dir}'")
    print(f"pass --data-dir {data_dir} to the training scripts")
    return 0


if __name__ == "__main__":
    run_main(main)
