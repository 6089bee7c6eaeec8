"""What a training run measures besides its losses: step time, data waiting, energy, memory, placement.

A step starts when the loop asks for its batch, so waiting for the loader counts and samples/s
agrees with the epoch times; the warm-up steps are left out and the device is synchronised at each
step's end (:class:`common.measure.timing.StepTimer`). Energy is read over the epochs' steps only;
peak memory is every rank's; placement (each rank's cores, its GPU's NUMA node, DataLoader workers
against cores) is checked and gathered at the start of a distributed run.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch

from common.data.datasets import describe_loader
from common.measure.energy import EnergyMeter
from common.measure.timing import StepTimer, format_rate, peak_memory, reset_peak_memory
from common.runtime.distributed import gather_objects
from common.runtime.placement import record_placement

__all__ = ["RunMeter"]


def _batch_size(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    return len(first)


class RunMeter:
    """One run's measurements on this process; :meth:`gathered` collects every rank's."""

    def __init__(self, device: torch.device, *, warmup_steps: int) -> None:
        self.devices = [device]  # where peak memory is read; timing synchronises the first
        self.timer = StepTimer(device, warmup_steps=warmup_steps)
        self.energy = EnergyMeter(device)
        self.placement: list[dict[str, Any]] | None = None
        self.loader: dict[str, Any] | None = None  # what fed the loop (common.data.datasets.describe_loader)
        self.global_batch: int | None = None  # samples per optimiser step over all ranks
        self.waited_s = 0.0  # time the steps this process ran spent waiting for their batch
        self.loop_s = 0.0  # wall time of the epochs' loops this process ran
        self.samples = 0  # samples of every rank through the steps this process ran (energy per sample)
        self.last_epoch_s = 0.0
        reset_peak_memory(device)

    def place(self, num_workers: int | None) -> None:
        """Check and gather every rank's placement (collective: every rank calls it)."""
        self.placement = record_placement(self.devices[0], num_workers)

    def use_devices(self, devices: list[torch.device]) -> None:
        """One process driving several GPUs (DataParallel): time on the first, report every one's memory."""
        self.devices = list(devices)
        self.timer.device = devices[0]  # each step ends on the primary GPU: synchronising it is enough
        for device in devices:
            reset_peak_memory(device)

    @contextmanager
    def epoch(self, loader: Iterable[Any]) -> Iterator[None]:
        """Around an epoch's steps: the energy counters are read at its start and end, and its wall
        time is kept in ``last_epoch_s``."""
        self.loader = self.loader or describe_loader(loader)
        start = time.perf_counter()
        with self.energy:
            yield
        self.last_epoch_s = time.perf_counter() - start
        self.loop_s += self.last_epoch_s

    @contextmanager
    def step(self, batch: Any, *, world_size: int, waited_s: float) -> Iterator[None]:
        samples = _batch_size(batch) * world_size
        self.global_batch = self.global_batch or samples
        with self.timer.step(samples=samples, waited_s=waited_s):
            yield
        self.samples += samples
        self.waited_s += waited_s

    def rate(self) -> str:
        """Samples per second so far, for a progress line."""
        return format_rate(self.timer.summary()["samples_per_s"])

    def gathered(self, rank: int) -> dict[str, Any]:
        """Step-time summary, energy and every rank's peak memory (collective: every rank calls it)."""
        energy = self.energy.result(samples=self.samples or None)
        memory = [entry for entries in gather_objects([{**peak_memory(device), "rank": rank}
                                                       for device in self.devices]) for entry in entries]
        return {"step_time": self.timer.summary(), "energy": energy, "memory": memory}
