"""The held-out evaluation every training script runs after an epoch: mean loss and accuracy.

    test_loss, accuracy = evaluate(model, test_loader, device, loss=F.nll_loss, precision=args.precision)
    run.evaluated(test_loss, accuracy)                       # common.train.run.TrainingRun keeps it per epoch

One loop serves the image classifiers (Chapter 4's ``MnistNet`` returns log-probabilities, hence
``F.nll_loss``; Lab-01's models return logits, ``F.cross_entropy``) and Lab-04's character model,
whose outputs of shape (batch, time, vocabulary) are scored as one prediction per target token.

Under DDP each rank evaluates its own slice of the test set (``across_ranks=True``): the sums of
loss, correct predictions and samples are added up over the ranks, so every rank returns the
numbers of the whole set and the record does not depend on the world size.
"""

from __future__ import annotations

from itertools import islice
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from common.train import amp
from common.runtime.distributed import all_reduce_sum

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: Iterable, device: torch.device, *,
             loss: Callable[..., torch.Tensor] = F.cross_entropy, precision: str = "fp32",
             max_batches: int | None = None, across_ranks: bool = False) -> tuple[float, float]:
    """Mean loss and accuracy of ``model`` over ``(inputs, targets)`` batches, in eval mode.

    ``loss`` is called as ``loss(outputs, targets, reduction="sum")`` on float32 outputs (the
    forward pass runs under :func:`common.train.amp.autocast` for ``precision``). ``max_batches`` stops
    after that many batches (``None``: all). ``across_ranks``: a collective; every rank must call it.
    """
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    for data, target in islice(loader, max_batches):
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with amp.autocast(device, precision):
            output = model(data)
        output, target = output.float().flatten(0, -2), target.flatten()  # one row of scores per target
        loss_sum += loss(output, target, reduction="sum").item()
        correct += (output.argmax(dim=1) == target).sum().item()
        seen += target.numel()
    if across_ranks:  # each rank saw its own slice: add the slices up
        loss_sum, correct, seen = all_reduce_sum([loss_sum, correct, seen], device)
    return loss_sum / max(seen, 1), correct / max(seen, 1)
