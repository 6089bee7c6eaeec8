"""Memory measured from the tensors themselves: what autograd saves for backward, and what a rank holds.

Lab-04 (data parallel, FSDP2) and Lab-07 (tensor and pipeline parallel) compare strategies by the
bytes each rank holds; both count them the same way, here. A DTensor counts by its local shard:
what this rank really holds.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

__all__ = ["SavedActivations", "local_bytes"]


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds of ``tensors`` (the local shard of a DTensor, the tensor itself otherwise)."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


class SavedActivations:
    """Bytes the forward pass keeps for backward, counted as autograd saves them.

    ``with SavedActivations() as saved: loss = model(x)...`` then ``saved.bytes``. Each storage is
    counted once (several views of one tensor cost its memory once); parameters and views of
    parameters are not activations and are left out (under FSDP2 those are the gathered copies,
    under tensor parallel the DTensor parameters). A DTensor counts by its local shard. With
    activation checkpointing, the wrapped blocks save only their input here; their insides are
    recomputed, and saved again briefly, during backward.
    """

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        self._hooks: Any = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, nn.Parameter):
            return tensor
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        base = local._base if local._base is not None else local
        if not (base.is_leaf and base.requires_grad):
            storage = local.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
