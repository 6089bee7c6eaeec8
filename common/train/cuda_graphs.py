"""A whole training step captured once as a CUDA graph, then replayed for every batch (Lab-02).

An eager step of a small model is many tiny kernels, each issued from Python through
PyTorch's dispatcher; the GPU finishes each before the CPU has issued the next, so the step takes
as long as the issuing. A CUDA graph records the kernels of one step once; a replay issues all of
them with one launch and the GPU runs them back to back. What a graph needs, and how it gets it here:

- **The same memory every time.** A replay reads and writes the addresses the capture used: each
  batch is copied into input buffers made once (from the device or from pinned host memory), the
  loss comes back in the same tensor, and parameters, gradients and optimizer state change in place.
- **The same shapes every time.** A batch of another shape (the last, smaller batch of an epoch)
  does not fit the graph; :meth:`CapturedStep.fits` says so and the caller runs it eagerly, with
  the same model and optimizer, so no sample is dropped.
- **No CPU-GPU synchronisation inside the step.** The optimizer keeps its step count on the GPU
  (``capturable=True``) and its learning rate in a GPU tensor: a float would be baked into the
  graph at capture, whereas an LR scheduler fills the tensor in place and the next replay reads it.
  A GradScaler (fp16) asks on the CPU whether the gradients overflowed, at every step: not capturable.
- **Warm-up before capture**, on a side stream, so that lazy set-up (the optimizer's state, cuBLAS
  and cuDNN handles) happens outside the capture. The warm-up steps are then undone (parameters and
  optimizer state put back in place, the CUDA random generator rewound), so the captured run trains
  from the same state, with the same dropout masks, as the eager one.

``torch.compile(mode="reduce-overhead")`` does the same capture automatically (CUDA graph trees);
Lab-02's README says why the lab captures by hand.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable

import torch

from common.runtime.device import synchronize

__all__ = ["CapturedStep", "capture_blocker"]

#: Eager steps before capture (PyTorch's CUDA graph notes use 3).
_WARMUP_STEPS = 3


def capture_blocker(device: torch.device, *, grad_scaling: bool, compiled: bool) -> str | None:
    """Why a training step cannot be captured here, in a few words; ``None`` when it can."""
    if device.type != "cuda":
        return f"{device.type.upper()}: CUDA graphs need a GPU"
    if grad_scaling:
        return "fp16: the GradScaler checks the gradients for overflow on the CPU at every step, which a graph cannot"
    if compiled:
        return "--compile: torch.compile(mode='reduce-overhead') captures graphs of its own"
    return None


class CapturedStep:
    """``step(data, target) -> loss`` captured once for batches shaped like ``data``/``target``.

    ``step`` must do the whole step (zero the gradients, forward, backward, optimizer step) on
    ``model`` with ``optimizer`` (``capturable=True``, learning rate a tensor on the device).
    ``captured(data, target)`` copies the batch into the graph's buffers, replays, and returns the
    loss (the same tensor each time: read or add it up before the next replay). ``capture_s`` is
    the time the warm-up and the capture took.
    """

    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, data: torch.Tensor, target: torch.Tensor) -> None:
        for group in optimizer.param_groups:
            if not group.get("capturable") or not isinstance(group["lr"], torch.Tensor):
                raise ValueError("a captured step needs an optimizer made with capturable=True and a tensor lr")
        self.optimizer = optimizer
        self.learning_rates = [group["lr"] for group in optimizer.param_groups]
        self.data, self.target = data.clone(), target.clone()  # the graph's input buffers
        device = data.device
        synchronize(device)
        start = time.perf_counter()
        saved_parameters = {name: value.clone() for name, value in model.state_dict().items()}
        saved_state = {param: {key: value.clone() for key, value in state.items() if torch.is_tensor(value)}
                       for param, state in optimizer.state.items()}
        saved_rng = torch.cuda.get_rng_state(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), warnings.catch_warnings():
            # capturable=True warns once when a step runs outside a capture, as the warm-up must
            warnings.filterwarnings("ignore", message=".*capturable=True.*")
            for _ in range(_WARMUP_STEPS):
                step(self.data, self.target)
        torch.cuda.current_stream(device).wait_stream(side)
        # Undo the warm-up in place: the graph will read and write these very tensors.
        with torch.no_grad():
            model.load_state_dict(saved_parameters)  # copies into the existing parameters
            for param, state in optimizer.state.items():
                for key, value in state.items():
                    if key in saved_state.get(param, {}):
                        value.copy_(saved_state[param][key])
                    elif torch.is_tensor(value):  # state the warm-up created starts at zero (Adadelta, Adam)
                        value.zero_()
        torch.cuda.set_rng_state(saved_rng, device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = step(self.data, self.target)
        synchronize(device)
        self.capture_s = time.perf_counter() - start

    def fits(self, data: torch.Tensor, target: torch.Tensor) -> bool:
        """Whether this batch has the captured shapes (else run it eagerly)."""
        return data.shape == self.data.shape and target.shape == self.target.shape

    def __call__(self, data: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for group, captured in zip(self.optimizer.param_groups, self.learning_rates):
            if group["lr"] is not captured:  # a scheduler that assigns a new lr instead of filling the tensor
                captured.fill_(group["lr"])
                group["lr"] = captured
        self.data.copy_(data, non_blocking=True)
        self.target.copy_(target, non_blocking=True)
        self.graph.replay()
        return self.loss
