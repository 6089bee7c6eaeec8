"""What ``mnist_training.py`` and ``multi_gpu_ddp.py`` share: the flags of the MNIST training.

The two scripts are one lesson in two steps (``diff mnist_training.py multi_gpu_ddp.py`` shows what
DDP changes), so they take the same flags with the same defaults; here they are written once.
``amp_training.py``, which runs ``mnist_training.py`` once per precision, takes its data and model
flags from here too; it and ``pytorch_basics.py`` read their ``--precision`` lists with
:func:`precision_list`.
"""

from __future__ import annotations

import argparse
from typing import Callable, Collection

from common.cli import add_precision_arg, non_negative_float, positive_int
from common.data.datasets import DATASETS, RESIDENT_CHOICES, RESIDENT_SHARE
from common.models import model_name
from common.train.flags import add_adadelta_args, add_training_args

#: Settings a resumed run must share with the run that wrote the checkpoint (more --epochs is fine).
RESUME_SETTINGS = ("dataset", "model", "batch_size", "seed", "precision", "max_steps")


def add_data_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``--dataset``, ``--model`` and ``--data-on-device``: what the chapter trains, and where its
    batches come from (``amp_training.py`` passes them on)."""
    group = parser.add_argument_group("MNIST training (same in mnist_training.py and multi_gpu_ddp.py)")
    group.add_argument("--dataset", choices=DATASETS, default="digits",
                       help="digits is bundled (offline); mnist needs --data-dir (default: %(default)s)")
    group.add_argument("--model", type=model_name, default="mnist_cnn",
                       help="mnist_cnn, plain_cnn or a torchvision classifier (default: %(default)s)")
    group.add_argument("--data-on-device", choices=RESIDENT_CHOICES, default="auto",
                       help="keep the whole data set in the memory of --device and cut the batches there, with no "
                            "DataLoader: auto = when it is held as tensors (mnist, digits) and, on a GPU, takes at "
                            f"most {100 * RESIDENT_SHARE:.0f}%% of its free memory; no = a DataLoader with "
                            "--num-workers worker processes (default: %(default)s)")
    return group


def add_mnist_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Those of :func:`add_data_args`, the optimiser and precision flags, then those of
    :func:`common.train.flags.add_training_args`."""
    group = add_data_args(parser)
    add_adadelta_args(group)
    add_precision_arg(group, "--amp")
    group.add_argument("--clip-grad-norm", type=non_negative_float, default=1.0,
                       help="clip gradients to this norm after unscaling; 0 turns it off (default: %(default)s)")
    group.add_argument("--test-batch-size", type=positive_int, default=1000,
                       help="evaluation batch (default: %(default)s)")
    add_training_args(parser)
    return parser


def precision_list(valid: Collection[str]) -> Callable[[str], list[str]]:
    """argparse type: ``auto``, or a comma-separated list of the ``valid`` precisions (order kept, repeats dropped)."""
    def parse(text: str) -> list[str]:
        if text == "auto":
            return ["auto"]
        names = [name.strip().lower() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in valid]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown precision(s) {', '.join(unknown) or repr(text)}; "
                                             f"choose from {', '.join(valid)} or auto")
        return list(dict.fromkeys(names))
    return parse
