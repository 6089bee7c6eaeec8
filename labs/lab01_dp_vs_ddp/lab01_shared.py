"""What the Lab-01 scripts share: the training scripts' flags, so that their numbers compare, and the
environment check's reading of ``nvidia-smi topo -m`` and its report.

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
- :func:`parse_topology` and :func:`format_checks`: the GPU-to-GPU matrix of ``nvidia-smi topo -m``,
  and the multi-GPU part of ``01_environment_check.py``'s report. Importing this module does not
  import torch (the data sets are imported when the flags are added), so the check's ``--help``
  stays fast.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from common.cli import add_lr_arg, non_negative_float, positive_int
from common.errors import UserError
from common.train.flags import add_training_args

if TYPE_CHECKING:
    from common.data.datasets import DataSplits

LAB = "lab01"


# --------------------------------------------------------------------------------------------
# Flags


def add_lab_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The model, data and optimiser flags of scripts 02, 03 and 04 (same names, same defaults), then
    those of :func:`common.train.flags.add_training_args`."""
    from common.data.datasets import DATASETS  # imports torch: only where the training flags are added

    group = parser.add_argument_group("model and data (same in 02, 03 and 04)")
    group.add_argument("--model", default="resnet50",
                       help="torchvision model name, or plain_cnn (no BatchNorm: the three methods then agree "
                            "step by step) (default: %(default)s)")
    group.add_argument("--dataset", choices=DATASETS, default="synthetic",
                       help="synthetic is generated and digits bundled (both offline); cifar10 and imagefolder "
                            "read --data-dir (default: %(default)s)")
    group.add_argument("--image-size", type=positive_int, default=32,
                       help="side of the synthetic images: 32 is CIFAR-shaped, 224 ImageNet-shaped; also the "
                            "resize of digits and imagefolder images (mnist and cifar10 keep theirs) "
                            "(default: %(default)s)")
    group.add_argument("--synthetic-size", type=positive_int, default=12800,
                       help="training samples of the synthetic data set; the test split is a quarter of it "
                            "(default: %(default)s)")
    add_lr_arg(group, default=0.05)
    group.add_argument("--momentum", type=non_negative_float, default=0.9, help="SGD momentum (default: %(default)s)")
    group.add_argument("--weight-decay", type=non_negative_float, default=5e-4,
                       help="SGD weight decay (default: %(default)s)")
    add_training_args(parser)  # --deterministic among them: on GPUs the three methods then agree step by step
    return parser


#: 04_ddp_training.py's --bucket-cap-mb by default (PyTorch's own default too).
DDP_BUCKET_CAP_MB = 25.0


def ddp_method(args: argparse.Namespace) -> str:
    """The record's method for 04_ddp_training.py: ``ddp`` (``ddp-bf16`` ...), plus each DDP option that differs
    from the handout's optimised settings (``ddp+bucket100mb``): the report combines runs of one method as repeats,
    so the step-3 options must not all read ``ddp``."""
    parts = ["ddp" if args.precision == "fp32" else f"ddp-{args.precision}"]
    parts += ["no-bucket-view"] * (not args.gradient_as_bucket_view) + ["broadcast-buffers"] * args.broadcast_buffers
    parts += ["find-unused"] * args.find_unused_parameters
    parts += [f"bucket{args.bucket_cap_mb:g}mb"] * (args.bucket_cap_mb != DDP_BUCKET_CAP_MB)
    parts += [f"accumulate{args.accumulation_steps}"] * (args.accumulation_steps > 1)
    return "+".join(parts)


def lab_data(args: argparse.Namespace) -> DataSplits:
    """The data set the flags name, shaped by ``--image-size`` and ``--synthetic-size``."""
    from common.data.datasets import get_dataset

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


# --------------------------------------------------------------------------------------------
# The environment check (01_environment_check.py): nvidia-smi's topology, and the report

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def parse_topology(text: str) -> dict[str, dict[str, str]]:
    """The GPU-to-GPU part of ``nvidia-smi topo -m``: ``{"GPU0": {"GPU1": "NV12", ...}, ...}``.

    The matrix is tab-separated: a header of column names after an empty first cell (GPUs, then NICs
    and affinities), then one row per device. Only GPU rows and GPU columns are kept; the legend
    below the matrix is ignored.
    """
    lines = [ANSI_ESCAPE.sub("", line) for line in text.splitlines()]  # some versions underline the header
    header = next((line for line in lines if "GPU0" in line and not line.split("\t")[0].strip()), None)
    if header is None:
        return {}
    columns = [cell.strip() for cell in header.split("\t")]
    links: dict[str, dict[str, str]] = {}
    for line in lines:
        cells = [cell.strip() for cell in line.split("\t")]
        name = cells[0]
        if not (name.startswith("GPU") and name[3:].isdigit()) or len(cells) < 2:
            continue
        row = {}
        for column, cell in zip(columns[1:], cells[1:]):
            if column.startswith("GPU") and column[3:].isdigit() and column != name:
                row[column] = cell
        links[name] = row
    return links


def format_checks(checks: Mapping[str, Any], warnings: list[str]) -> str:
    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    lines = ["", "multi-GPU (Lab-01)",
             f"back ends       NCCL {yes(checks['nccl_available'])} | Gloo {yes(checks['gloo_available'])}"]
    for name, result in checks["backend_tests"].items():
        lines.append(f"  {name}: {result['detail']}")
    matrix = checks["peer_access"]
    links = checks.get("cuda_links")
    mapping = checks.get("cuda_to_topology", [])
    if mapping:
        lines.append("GPU numbers     PyTorch (CUDA) -> nvidia-smi (NVML), matched by PCI bus id: " + ", ".join(
            f"cuda:{row['cuda']} = {row['topology_name'] or '?'} ({row['bus_id'] or 'bus id unknown'})"
            for row in mapping))
    if matrix:
        lines.append("peer access     (row reads column directly" + ("; link from nvidia-smi topo -m" if links else "")
                     + "; PyTorch's numbering)")
        lines.append("         " + "".join(f"{f'cuda:{j}':<12}" for j in range(len(matrix))))
        for i, row in enumerate(matrix):
            cells = ["X" if ok is None else yes(ok) + (f" {links[i][j]}" if links and links[i][j] else "")
                     for j, ok in enumerate(row)]
            lines.append(f"  cuda:{i:<2} " + "".join(f"{cell:<12}" for cell in cells))
    else:
        lines.append("peer access     fewer than 2 GPUs: nothing to check")
    topology = checks["topology"]
    if topology["available"]:
        pairs = [(a, b, link) for a, row in topology["links"].items() for b, link in row.items() if a < b]
        nvlink = [f"{a}-{b}" for a, b, link in pairs if link.startswith("NV")]
        lines.append(f"links           {len(nvlink)} of {len(pairs)} GPU pair(s) over NVLink"
                     + (f": {', '.join(nvlink)}" if nvlink else ""))
        lines.append("nvidia-smi topo -m (nvidia-smi's numbering: every GPU of the node, PCI order):")
        lines.extend(f"  {line}" for line in topology["text"].rstrip().splitlines())
    else:
        lines.append(f"topology        {topology['reason']}")
    lines.extend(f"  WARNING: {warning}" for warning in warnings)
    return "\n".join(lines)
