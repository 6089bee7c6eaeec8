"""How fast could one training step be? Its FLOP floor, its launch floor, and the regime it is in.

Two lower bounds on the time of a step, each from one cause alone (Lab-02 prints and records them):

- **FLOP floor** = the step's floating-point operations ÷ the GPU's peak for the precision in force
  (``common.precision.peak``). ``torch.utils.flop_counter.FlopCounterMode`` counts the matrix maths of
  the forward and backward passes (convolutions, matmuls: 2 FLOPs per multiply-add); element-wise
  work (ReLU, dropout, the optimizer) is not counted. A CPU has no entry in the table, so on a CPU
  there is no FLOP floor: ``None``, with the reason.
- **launch floor** = kernels per step × the time one tiny kernel takes when kernels come back to
  back. The kernels are counted from ``torch.profiler``'s CUDA events (kernels, memory copies and
  sets) over one real step; the time per kernel is measured here, with a loop of one-element
  additions issued from Python (eager) or replayed as the nodes of one CUDA graph (``in_graph``). On a
  CPU there are no kernels: the count is of the operators the step calls (every ATen call,
  counted by a dispatch mode), an operator count, and the time is what calling one costs.

The measured step time lies above both. The larger floor names the **regime**: *launch-bound* when
issuing the kernels takes longer than their maths would at peak, *compute-bound* when the maths
does. Without a peak (a CPU) the launch floor is set against the measured step instead: launch-bound
when calling the operators is at least half the step, else the step is busy in the operators' own
work, compute or memory, which this count cannot tell apart.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable

import torch

from common import precision as precisions
from common.runtime.device import synchronize

__all__ = ["count_flops", "count_kernels", "launch_latency", "step_floors", "floors_lines",
           "measure_floors"]

def count_flops(step: Callable[[], Any]) -> int:
    """FLOPs of one call of ``step`` (it runs for real), as ``FlopCounterMode`` counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return int(counter.get_total_flops())


def _operator_counter() -> Any:
    """A dispatch mode that counts every ATen operator call that reaches a kernel (CPU runs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OperatorCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
            self.calls[str(func)] += 1
            return func(*args, **(kwargs or {}))

    return OperatorCounter()


def count_kernels(step: Callable[[], Any], device: torch.device) -> tuple[int, str]:
    """``(count, what)`` for one call of an already warmed-up ``step``.

    On a GPU: the CUDA events ``torch.profiler`` records (kernels, memory copies and sets), each one
    thing the GPU was asked to run. On a CPU: the ATen operators the step calls.
    """
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            synchronize(device)
        gpu_events = [event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]
        return len(gpu_events), "CUDA kernels"
    with _operator_counter() as counter:
        step()
    return sum(counter.calls.values()), "CPU operators (an operator count, not kernels)"


def launch_latency(device: torch.device, *, in_graph: bool = False, launches: int = 500,
                   repeats: int = 3) -> tuple[float, str]:
    """``(seconds per tiny kernel, how it was measured)``: the fastest of ``repeats`` loops of ``launches``.

    Eager: ``x.add_(1)`` on a one-element tensor from Python, the device synchronised after the loop:
    the cost of one launch through PyTorch (or, on a CPU, of one operator call). In a graph: the same
    additions captured once as a CUDA graph and replayed, what each node costs the GPU.
    """
    x = torch.zeros(1, device=device)
    if in_graph:
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            x.add_(1)  # warm up outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(launches):
                x.add_(1)
        run: Callable[[], Any] = graph.replay
        method = f"{launches} one-element additions captured as one CUDA graph, replayed; fastest of {repeats}"
    else:
        def run() -> None:
            for _ in range(launches):
                x.add_(1)
        method = f"{launches} one-element additions issued from Python, device synchronised; fastest of {repeats}"
    run()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / launches)
    return best, method


def step_floors(*, flops: int | None, kernels: int | None, counted: str, latency_s: float | None,
                latency_method: str, step_time_s: float, peak_tflops: float | None, peak_source: str,
                peak_precision: str | None = None, kernels_note: str = "") -> dict[str, Any]:
    """The floors, the achieved rate and the regime of a step measured at ``step_time_s`` (arithmetic only).

    Every number that cannot be had is ``None`` and ``reasons[key]`` says why.
    """
    reasons: dict[str, str] = {}
    flop_floor = flops / (peak_tflops * 1e12) if flops and peak_tflops else None
    if flop_floor is None:
        reasons["flop_floor_s"] = peak_source if not peak_tflops else "no FLOPs counted"
    if peak_tflops is None:
        reasons["mfu"] = peak_source
    launch_floor = kernels * latency_s if kernels is not None and latency_s is not None else None
    if launch_floor is None:
        reasons["launch_floor_s"] = reasons["kernels_per_step"] = kernels_note or "not counted"
    achieved = flops / step_time_s / 1e12 if flops and step_time_s > 0 else None
    fraction = achieved / peak_tflops if achieved is not None and peak_tflops else None
    regime, why = _regime(flop_floor, launch_floor, step_time_s, counted)
    if regime is None:
        reasons["regime"] = why
    return {"flop_floor_s": flop_floor, "launch_floor_s": launch_floor, "step_time_s": step_time_s,
            "regime": regime, "regime_why": why, "kernels_per_step": kernels, "counted": counted,
            "launch_latency_s": latency_s, "latency_method": latency_method, "flops_per_step": flops,
            "achieved_tflops": achieved, "peak_tflops": peak_tflops, "peak_source": peak_source,
            "peak_precision": peak_precision, "mfu": fraction, "reasons": reasons}


def _regime(flop_floor: float | None, launch_floor: float | None, step_time: float,
            counted: str) -> tuple[str | None, str]:
    if launch_floor is None:
        return None, "no launch floor, so no regime"
    things = counted.partition(" (")[0]
    if flop_floor is not None:
        if launch_floor >= flop_floor:
            return "launch-bound", (f"issuing its {things} takes {launch_floor / flop_floor:.1f}x as long as its "
                                    "maths would at peak")
        return "compute-bound", (f"its maths at peak takes {flop_floor / launch_floor:.1f}x as long as issuing "
                                 f"its {things}")
    share = launch_floor / step_time if step_time > 0 else float("inf")
    if share >= 0.5:
        return "launch-bound", f"calling its {things} is {share:.1%} of the step"
    return "compute- or memory-bound", (f"calling its {things} is {share:.1%} of the step; the rest is their own "
                                        "work (without a peak, compute and memory cannot be told apart)")


#: Printed after the regime: what moves a step out of it.
_WHAT_MOVES_IT = {
    "launch-bound": " (a larger batch adds maths, not kernels; a CUDA graph issues them all in one launch; "
                    "torch.compile fuses them into fewer)",
    "compute-bound": " (fewer FLOPs or a faster precision lower this floor; fewer launches no longer help)",
}


def _seconds(value: float | None) -> str:
    if value is None:
        return "unknown"
    return f"{value * 1e6:.1f} us" if value < 1e-3 else f"{value * 1e3:.2f} ms"


def floors_lines(floors: dict[str, Any]) -> list[str]:
    """The two lines a script prints: the floors against the measured step, and the regime."""
    reasons = floors["reasons"]
    gflop = f"{floors['flops_per_step'] / 1e9:.3g} GFLOP" if floors["flops_per_step"] else "no FLOPs counted"
    flop = (f"FLOP floor {_seconds(floors['flop_floor_s'])} = {gflop} / {floors['peak_tflops']:g} TFLOP/s "
            f"({floors['peak_source']})" if floors["flop_floor_s"] is not None
            else f"FLOP floor unknown: {gflop}, {reasons['flop_floor_s']}")
    counted, _, note = floors["counted"].partition(" (")
    launch = (f"launch floor {_seconds(floors['launch_floor_s'])} = {floors['kernels_per_step']} {counted} x "
              f"{_seconds(floors['launch_latency_s'])}{' (' + note if note else ''}"
              if floors["launch_floor_s"] is not None else f"launch floor unknown ({reasons['launch_floor_s']})")
    rate = ""
    if floors["achieved_tflops"] is not None:
        rate = f", {floors['achieved_tflops']:.3g} TFLOP/s"
        if floors["mfu"] is not None:
            rate += f" = {floors['mfu']:.1%} of peak"
    return [f"per step: {flop} | {launch} | measured {_seconds(floors['step_time_s'])}{rate}",
            f"regime: {floors['regime'] or 'unknown'}: {floors['regime_why']}"
            f"{_WHAT_MOVES_IT.get(floors['regime'], '')}"]


def measure_floors(step: Callable[[], Any], device: torch.device, *, precision: str, step_time_s: float,
                   in_graph: bool = False, flop_step: Callable[[], Any] | None = None,
                   kernels_note: str = "") -> dict[str, Any]:
    """Run ``step`` twice (FLOPs, then kernels) and time tiny launches: :func:`step_floors` of the result.

    ``step`` changes the model like any training step: call this when the run no longer needs it.
    ``flop_step`` counts FLOPs when ``step`` cannot (a ``torch.compile``'d model: count on the
    original module). The FLOP count's step also warms ``step`` up (the optimizer's state is made at
    its first step), so the kernels are those of a steady step. ``kernels_note`` set: the kernels are
    not counted, and it says why.
    """
    flops = count_flops(flop_step or step)
    if flop_step is not None:
        step()  # warm-up of the step whose kernels are counted
    kernels, counted = (None, "") if kernels_note else count_kernels(step, device)
    latency, method = launch_latency(device, in_graph=in_graph)
    peak, maths, source = precisions.peak(device, precision)
    return step_floors(flops=flops, kernels=kernels, counted=counted, latency_s=latency, latency_method=method,
                       step_time_s=step_time_s, peak_tflops=peak, peak_source=source, peak_precision=maths,
                       kernels_note=kernels_note)
