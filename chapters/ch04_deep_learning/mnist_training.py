#!/usr/bin/env python3
"""Train the classic MNIST CNN on one device: CPU or GPU, full precision or mixed precision.

Usage:
    python mnist_training.py --device cpu --dataset digits --epochs 3      # laptop / CI, offline
    python mnist_training.py --dataset mnist --data-dir ~/data --epochs 5  # GPU node (auto-detects)
    python mnist_training.py --amp bf16                                    # mixed precision
    sbatch sbatch/single_gpu.sbatch                                        # on a cluster

What it teaches: the device-agnostic training loop (move the model once, move every batch,
``model.train()``/``model.eval()``), how to time it honestly, and mixed precision with autocast and
a GradScaler. Every run writes a result record (``--results-dir``) that the report tool reads.

``--amp`` chooses the precision of the forward pass: ``fp32`` (off), ``bf16`` (CPU and recent GPUs)
or ``fp16`` (GPU; uses a GradScaler). Gradients are clipped after ``scaler.unscale_()`` so the clip
threshold applies to the true gradients, not the scaled ones. ``amp_training.py`` runs fp32 and AMP
side by side and compares their speed and accuracy. ``multi_gpu_ddp.py`` is this script under DDP:
diff the two files to see everything DDP changes.

Pre-emption (``sbatch/single_gpu.sbatch``): with ``--checkpoint PATH`` the run saves there after
every epoch, and on SIGUSR1 (``#SBATCH --signal=B:USR1@120``) or SIGTERM it stops at the next step,
saves atomically and exits 0. Run it again with ``--resume`` and it continues from that step, ending
with the same weights as a run that was never stopped. Without ``--checkpoint`` nothing is saved
and a signal ends the run as usual. ``common.run.TrainingRun`` does this bookkeeping (and the
timing and the result record), so that what you read below is the training itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere without installing
from common import amp
from common.cli import add_common_args, positive_float, positive_int
from common.data import DATASETS, get_dataset, make_loader
from common.device import seed_everything
from common.errors import run_main
from common.models import build_model
from common.run import TrainingRun, add_checkpoint_args

SCRIPT = "chapters/ch04_deep_learning/mnist_training.py"
#: Settings a resumed run must share with the run that wrote the checkpoint (more --epochs is fine).
RESUME_SETTINGS = ("dataset", "model", "batch_size", "seed", "amp", "max_steps")


def train(model, device, loader, optimizer, args, scaler, run) -> None:
    """One epoch: every batch ``run.steps`` hands out (timed; it stops early on a pre-emption signal)."""
    model.train()
    for data, target in run.steps(loader):
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with amp.autocast(device, args.amp):
            output = model(data)
            loss = F.nll_loss(output, target)
        scaler.scale(loss).backward()
        if args.clip_grad_norm:
            scaler.unscale_(optimizer)  # clip the real gradients, not the loss-scaled ones
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        run.log_loss(loss)


@torch.no_grad()
def test(model, device, loader, args) -> tuple[float, float]:
    """Mean loss and accuracy on the held-out split."""
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    for data, target in loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with amp.autocast(device, args.amp):
            output = model(data)
        loss_sum += F.nll_loss(output.float(), target, reduction="sum").item()
        correct += (output.argmax(dim=1) == target).sum().item()
        seen += len(target)
    return loss_sum / max(seen, 1), correct / max(seen, 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=DATASETS, default="digits",
                        help="digits is bundled (offline); mnist needs --data-dir (default: %(default)s)")
    parser.add_argument("--model", default="mnist_cnn", help="model name (default: %(default)s)")
    parser.add_argument("--lr", type=positive_float, default=1.0, help="Adadelta learning rate (default: %(default)s)")
    parser.add_argument("--gamma", type=positive_float, default=0.7,
                        help="learning-rate decay per epoch (default: %(default)s)")
    parser.add_argument("--amp", choices=amp.PRECISIONS, default="fp32",
                        help="forward-pass precision: fp32 (off), bf16, fp16 (GPU only) (default: %(default)s)")
    parser.add_argument("--clip-grad-norm", type=float, default=1.0,
                        help="clip gradients to this norm after unscaling; 0 turns it off (default: %(default)s)")
    parser.add_argument("--test-batch-size", type=positive_int, default=1000,
                        help="evaluation batch (default: %(default)s)")
    parser.add_argument("--log-interval", type=positive_int, default=10,
                        help="steps between loss lines (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps left out of timing (default: %(default)s)")
    parser.add_argument("--save-model", action="store_true", help="save the trained weights next to the record")
    add_checkpoint_args(parser)
    add_common_args(parser, epochs=3, batch_size=64, num_workers=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with TrainingRun(args, lab="ch04", script=SCRIPT, method=args.amp, resume_settings=RESUME_SETTINGS) as run:
        device = run.device
        args.amp = amp.check_precision(args.amp, device)
        seed_everything(args.seed)
        splits = get_dataset(args.dataset, args.data_dir, image_size=28, channels=1, seed=args.seed)  # MNIST-shaped
        model = build_model(args.model, num_classes=splits.num_classes, in_channels=splits.input_shape[0]).to(device)
        train_loader, _ = make_loader(splits.train, args.batch_size, shuffle=True, num_workers=args.num_workers,
                                      pin_memory=device.type == "cuda", seed=args.seed)
        test_loader, _ = make_loader(splits.test, args.test_batch_size, shuffle=False, num_workers=args.num_workers)
        optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
        scaler = amp.grad_scaler(device, args.amp)
        run.print(f"{run.describe()} | data {args.dataset} {splits.input_shape} train={len(splits.train)} "
                  f"test={len(splits.test)} | precision {args.amp}")

        run.track(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
        for _epoch in run.epochs(train_loader):  # the epoch's shuffle is seeded from its number
            train(model, device, train_loader, optimizer, args, scaler, run)
            run.evaluated(*test(model, device, test_loader, args))
            scheduler.step()
        record = run.finish(config=splits.describe())
        if args.save_model:
            torch.save(model.state_dict(), record.with_suffix(".pt"))
    return 0


if __name__ == "__main__":
    run_main(main)
