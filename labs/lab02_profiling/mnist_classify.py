#!/usr/bin/env python3
"""Train the classic MNIST CNN and profile its training loop line by line (Lab-02).

Usage:
    kernprof -o run.lprof -l mnist_classify.py --epochs=3       # profile train(), as the USC lab does
    python -m line_profiler -rmt run.lprof                      # read the table
    kernprof -o sync.lprof -l mnist_classify.py --epochs=1 --launch-blocking   # GPU: each line's own GPU time
    python mnist_classify.py --epochs=3                         # the same run without the profiler
    python mnist_classify.py --pipeline device --batch-size 256 --channels-last --precision bf16
    python mnist_classify.py --pipeline device --cuda-graph     # GPU: the whole step replayed as one CUDA graph
    sbatch job.slurm                                            # on a cluster (kernprof, 3 epochs)
    (one process, one device: there is no torchrun form; Lab-01 is the multi-GPU lab)

What it teaches: where the time of a training epoch goes. The USC lab's line profile shows 84.5 % of
``train()`` on its first line, the loop that waits for the DataLoader, and only a few percent in the
forward and backward passes. Each flag below removes part of that wait; ``sweep.py`` runs them one
after another and records every step.

On a GPU, kernels run after the line that queued them, so their time lands on whichever line waits
first (``loss.item()``, the next ``.to(device)``). ``--launch-blocking`` sets
``CUDA_LAUNCH_BLOCKING=1`` before CUDA starts: every line then waits for its own kernels, and the
profile shows each line's GPU time (the README says which lines to trust in which profile).

Once the data wait is gone, the GPU waits for the CPU to issue the step's many tiny kernels. At
the end every run prints the step's two floors (its FLOPs at the GPU's peak, its kernels at the
time one launch takes) against the measured step, and the regime that follows; ``--cuda-graph``
captures the whole step once and replays it as one launch (on a CPU it runs eagerly and says why).

Data: ``--dataset digits`` (bundled, offline, the default), ``mnist`` (from ``--data-dir``) or
``synthetic`` (MNIST-sized, ``--synthetic-size``). ``--pipeline pil`` is the USC lab's per-sample PIL
transform pipeline on any of them (see ``common/data/pipelines.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from line_profiler import profile  # a no-op decorator unless the script runs under kernprof

from common.train import amp, cuda_graphs
from common.measure import floors
from common.data import pipelines
from common.cli import (add_common_args, add_dataset_args, add_precision_arg, apply_dry_run, config_dict, PIPELINES,
                        positive_float, positive_int, script_parser)
from common.runtime.device import (configure_threads, describe, resolve_device, seed_everything, set_launch_blocking,
                                   synchronize)
from common.measure.energy import EnergyMeter
from common.errors import run_main
from common.models import MnistNet
from common.results import make_record, provenance, write_record
from common.measure.timing import peak_memory, reset_peak_memory
from common.units import format_bytes

SCRIPT = "labs/lab02_profiling/mnist_classify.py"
#: The floors' numbers that are metrics of their own in the record (the rest stay under ``floors``).
FLOOR_METRICS = ("flop_floor_s", "launch_floor_s", "step_time_s", "regime", "kernels_per_step", "achieved_tflops",
                 "mfu")
#: The USC lab's starting point: what ``--method`` defaults to naming "baseline".
USC_CONFIGURATION = {"pipeline": "pil", "num_workers": 1, "batch_size": 64, "pin_memory": False,
                      "persistent_workers": False, "prefetch_factor": None, "channels_last": False,
                      "precision": "fp32", "compile": False, "cuda_graph": False}


@profile
def train(args, model, device, train_loader, optimizer, epoch, scaler, graph=None):
    """One epoch; returns (samples seen, optimiser steps, mean training loss, the losses printed)."""
    model.train()
    seen, loss_sum, steps, logged = 0, torch.zeros((), device=device), 0, []
    for batch_idx, (data, target) in enumerate(train_loader):
        if graph is not None and graph.fits(data, target):  # --cuda-graph: the step below, replayed in one launch
            loss = graph(data, target)
        else:  # eager (also the last, smaller batch of a --cuda-graph epoch: a graph has fixed shapes)
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            if args.channels_last:
                data = data.contiguous(memory_format=torch.channels_last)
            optimizer.zero_grad(set_to_none=True)
            with amp.autocast(device, args.precision):
                output = model(data)
                loss = F.nll_loss(output, target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        seen, steps = seen + len(data), steps + 1
        loss_sum += loss.detach().float()  # stays on the device: no synchronisation every step
        if batch_idx % args.log_interval == 0:
            logged.append(loss.item())
            print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
                epoch, batch_idx * len(data), len(train_loader.dataset),
                100. * batch_idx / len(train_loader), logged[-1]), flush=True)
        if args.max_steps is not None and steps >= args.max_steps:
            break
    return seen, steps, loss_sum.item() / max(steps, 1), logged


def training_step(args, model, device, optimizer, scaler, data, target):
    """train()'s eager step as a function (train() keeps its lines for the line profile): what
    --cuda-graph captures and the floors measure. Returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    with amp.autocast(device, args.precision):
        output = model(data)
        loss = F.nll_loss(output, target)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss


def make_optimizer(args, model, device, capturable):
    """The USC lab's Adadelta. For a CUDA graph it keeps its state and learning rate on the GPU, so a
    replay never waits for the CPU and StepLR's new learning rate reaches the captured step."""
    if capturable:
        return torch.optim.Adadelta(model.parameters(), lr=torch.tensor(args.lr, device=device), capturable=True,
                                    foreach=True)
    return torch.optim.Adadelta(model.parameters(), lr=args.lr)


def example_batch(args, device):
    """A batch of the training shape (zeros): what the graph is captured with and the floors run on."""
    data = torch.zeros(args.batch_size, 1, 28, 28, device=device)
    if args.channels_last:
        data = data.contiguous(memory_format=torch.channels_last)
    return data, torch.zeros(args.batch_size, dtype=torch.long, device=device)


@torch.no_grad()
def test(args, model, device, test_loader):
    """Mean loss and accuracy on the held-out split."""
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    for data, target in test_loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        if args.channels_last:
            data = data.contiguous(memory_format=torch.channels_last)
        with amp.autocast(device, args.precision):
            output = model(data)
        loss_sum += F.nll_loss(output.float(), target, reduction="sum").item()
        correct += (output.argmax(dim=1) == target).sum().item()
        seen += len(target)
    print(f"Test set: average loss {loss_sum / max(seen, 1):.4f}, accuracy {correct}/{seen} "
          f"({100. * correct / max(seen, 1):.1f}%)", flush=True)
    return loss_sum / max(seen, 1), correct / max(seen, 1)


def compile_and_warm_up(model, device, args):
    """``torch.compile`` the model and run one forward/backward so compilation is timed on its own.

    Compilation happens at the first call, not at ``torch.compile()``; without this warm-up the
    first epoch would carry it and look slow. The gradients of the warm-up are thrown away. A last,
    smaller batch still triggers one recompilation (dynamic batch size) inside the first epoch.
    """
    compiled = torch.compile(model)
    data = torch.zeros(args.batch_size, 1, 28, 28, device=device)
    if args.channels_last:
        data = data.contiguous(memory_format=torch.channels_last)
    target = torch.zeros(args.batch_size, dtype=torch.long, device=device)
    synchronize(device)
    start = time.perf_counter()
    with amp.autocast(device, args.precision):
        loss = F.nll_loss(compiled(data), target)
    loss.backward()
    synchronize(device)
    model.zero_grad(set_to_none=True)
    return compiled, time.perf_counter() - start


def measure_floors(args, model, device, optimizer, scaler, graph, step_time_s):
    """The step's FLOP floor, launch floor and regime, printed; run after the last evaluation (the
    steps it runs change nothing that is reported)."""
    data, target = example_batch(args, device)
    eager_model = getattr(model, "_orig_mod", model)  # FLOPs of a compiled model: count on the module it wraps
    step_floors = floors.measure_floors(
        lambda: training_step(args, model, device, optimizer, scaler, data, target), device,
        precision=args.precision, step_time_s=step_time_s, in_graph=graph is not None,
        flop_step=(lambda: training_step(args, eager_model, device, optimizer, scaler, data, target))
        if args.compile else None,
        kernels_note="--compile on a CPU: its generated code calls no PyTorch operators to count"
        if args.compile and device.type == "cpu" else "")
    for line in floors.floors_lines(step_floors):
        print(line, flush=True)
    return step_floors


def default_method(args) -> str:
    """``baseline`` for the USC lab's configuration, ``custom`` for anything else (``--method`` names it)."""
    current = {key: getattr(args, key) for key in USC_CONFIGURATION}
    return "baseline" if current == USC_CONFIGURATION else "custom"


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_dataset_args(parser)
    parser.add_argument("--test-batch-size", type=positive_int, default=1000,
                        help="evaluation batch (default: %(default)s)")
    parser.add_argument("--lr", type=positive_float, default=1.0, help="Adadelta learning rate (default: %(default)s)")
    parser.add_argument("--gamma", type=positive_float, default=0.7,
                        help="learning-rate decay per epoch (default: %(default)s)")
    parser.add_argument("--log-interval", type=positive_int, default=10,
                        help="batches between loss lines (default: %(default)s)")
    tuning = parser.add_argument_group("the optimisation path (sweep.py turns these on one after another)")
    tuning.add_argument("--pipeline", choices=PIPELINES, default="pil",
                        help="pil: the USC lab's per-sample PIL transforms; tensor: converted once, one indexing op "
                             "per batch; device: whole set on the device, no DataLoader (default: %(default)s)")
    tuning.add_argument("--pin-memory", action="store_true",
                        help="page-locked host batches for faster, asynchronous copies to the GPU (default: off)")
    tuning.add_argument("--persistent-workers", action="store_true",
                        help="keep DataLoader workers alive between epochs instead of restarting them (default: off)")
    tuning.add_argument("--prefetch-factor", type=positive_int, default=None,
                        help="batches each worker prepares ahead (default: PyTorch's, 2)")
    tuning.add_argument("--channels-last", action="store_true",
                        help="NHWC memory layout for the model and the images (default: off)")
    add_precision_arg(tuning, "--amp")
    tuning.add_argument("--compile", action="store_true",
                        help="torch.compile the model; compile time is measured and recorded separately (default: off)")
    tuning.add_argument("--cuda-graph", action="store_true",
                        help="capture the whole training step once as a CUDA graph and replay it for every full "
                             "batch; on a CPU (or with fp16, --compile) the step runs eagerly and says why "
                             "(default: off)")
    parser.add_argument("--launch-blocking", action="store_true",
                        help="CUDA_LAUNCH_BLOCKING=1: every CUDA call waits for its kernels, so a line profile on a "
                             "GPU shows each line's own GPU time; slower overall (default: off)")
    parser.add_argument("--method", default=None,
                        help="name of this run in its result record (default: 'baseline' for the USC lab's "
                             "configuration, else 'custom')")
    add_common_args(parser, epochs=3, batch_size=64)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv))
    if args.launch_blocking:
        set_launch_blocking()  # before anything starts CUDA
    seed_everything(args.seed)
    threads = configure_threads()
    device = resolve_device(args.device)
    args.precision = amp.check_precision(args.precision, device)
    method = args.method or default_method(args)
    notes = []
    if args.launch_blocking and device.type != "cuda":
        notes.append("--launch-blocking changes nothing on a CPU: CPU operators already run synchronously")
    pin_memory = args.pin_memory and device.type == "cuda"
    if args.pin_memory and not pin_memory:
        notes.append("--pin-memory ignored: pinning only speeds up copies to a GPU")
    if args.pipeline == "device" and (args.num_workers or args.pin_memory or args.persistent_workers):
        notes.append("--pipeline device has no DataLoader: worker and pinning flags have no effect")
    if args.num_workers == 0 and (args.persistent_workers or args.prefetch_factor):
        notes.append("--persistent-workers/--prefetch-factor need --num-workers >= 1: ignored")
    for note in notes:
        print(f"note: {note}", flush=True)

    train_data, test_data = pipelines.load_uint8(args.dataset, args.data_dir, seed=args.seed,
                                                 synthetic_size=args.synthetic_size)
    loader_options = dict(device=device, num_workers=args.num_workers, pin_memory=pin_memory,
                          persistent_workers=args.persistent_workers, prefetch_factor=args.prefetch_factor,
                          channels_last=args.channels_last)
    train_loader = pipelines.make_loader(args.pipeline, train_data, args.batch_size, shuffle=True,
                                         seed=args.seed, **loader_options)
    test_loader = pipelines.make_loader(args.pipeline, test_data, args.test_batch_size, shuffle=False,
                                        **loader_options)

    model = MnistNet().to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    scaler = amp.grad_scaler(device, args.precision)
    blocker = cuda_graphs.capture_blocker(device, grad_scaling=scaler.is_enabled(), compiled=args.compile)
    optimizer = make_optimizer(args, model, device, capturable=args.cuda_graph and blocker is None)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    print(f"device {describe(device)} | data {args.dataset} train={len(train_data)} test={len(test_data)} | "
          f"pipeline {args.pipeline} | workers {args.num_workers} | batch {args.batch_size} | "
          f"precision {args.precision} | threads {threads} | line profiler {'on' if profile.enabled else 'off'}",
          flush=True)
    compile_s = None
    if args.compile:
        model, compile_s = compile_and_warm_up(model, device, args)
        print(f"torch.compile: first forward/backward took {compile_s:.1f} s (not counted in the epochs)", flush=True)
    graph = None
    if args.cuda_graph and blocker is None:
        try:
            graph = cuda_graphs.CapturedStep(
                lambda data, target: training_step(args, model, device, optimizer, scaler, data, target),
                model, optimizer, *example_batch(args, device))
        except RuntimeError as error:  # an operation that cannot be captured: train eagerly, and say so
            blocker = f"capture failed: {str(error).splitlines()[0]}"
    if args.cuda_graph:
        notes.append(f"graph: captured in {graph.capture_s:.2f} s (not counted in the epochs); the last, smaller "
                     "batch of an epoch runs eagerly" if graph else f"graph: not captured ({blocker})")
        print(notes[-1], flush=True)

    reset_peak_memory(device)
    epoch_times, epoch_samples, epoch_steps, train_losses, logged_losses = [], [], [], [], []
    test_loss, accuracy = float("nan"), 0.0
    meter = EnergyMeter(device).start()  # over the epochs, evaluation included
    for epoch in range(1, args.epochs + 1):
        synchronize(device)
        start = time.perf_counter()
        seen, steps, mean_loss, logged = train(args, model, device, train_loader, optimizer, epoch, scaler, graph)
        synchronize(device)
        epoch_times.append(time.perf_counter() - start)
        epoch_samples.append(seen)
        epoch_steps.append(steps)
        train_losses.append(mean_loss)
        logged_losses.append(logged)
        test_loss, accuracy = test(args, model, device, test_loader)
        scheduler.step()
        print(f"epoch {epoch}: {epoch_times[-1]:.2f} s, {seen / epoch_times[-1]:.0f} samples/s", flush=True)

    energy = meter.stop().result(samples=sum(epoch_samples))
    # The first epoch pays for starting workers, allocator growth and (with --compile) one
    # recompilation; with more than one epoch it is left out of the throughput.
    timed = slice(1, None) if args.epochs > 1 else slice(None)
    samples_per_s = sum(epoch_samples[timed]) / sum(epoch_times[timed])
    memory = peak_memory(device)
    step_floors = measure_floors(args, model, device, optimizer, scaler, graph,
                                 step_time_s=sum(epoch_times[timed]) / sum(epoch_steps[timed]))
    headline = {key: step_floors.pop(key) for key in FLOOR_METRICS}  # the rest stays under "floors"
    full_batches = len(train_data) // args.batch_size
    graph_record = {"requested": args.cuda_graph, "captured": graph is not None,
                    "reason": None if graph or not args.cuda_graph else blocker,
                    "capture_s": graph.capture_s if graph else None,
                    "eager_steps": sum(max(0, steps - full_batches) for steps in epoch_steps) if graph else None}
    metrics = {
        "train_loss": train_losses, "final_loss": train_losses[-1], "test_loss": test_loss,
        "test_accuracy": accuracy, "epochs": args.epochs, "steps": sum(epoch_steps), "logged_loss": logged_losses,
        "global_batch_size": args.batch_size, "world_size": 1, "epoch_time_s": epoch_times,
        "time_per_epoch_s": statistics.median(epoch_times), "samples_per_s": samples_per_s,
        "compile_s": compile_s, "memory": [memory],
        "cuda_graph": graph_record, **headline, "floors": step_floors,
        "timing_method": "time.perf_counter around train(), device synchronised before each read; the epoch "
                         "includes waiting for the loader; samples/s and step_time_s over epochs 2.. (all when "
                         "only one)",
    }
    config = config_dict(args, resolved_device=str(device), model="mnist_cnn", threads=threads,
                         pin_memory_effective=pin_memory, line_profiler=bool(profile.enabled),
                         train_size=len(train_data), test_size=len(test_data))
    record = make_record(lab="lab02", script=SCRIPT, method=method, config=config, metrics=metrics,
                         provenance=provenance(device), notes=notes, energy=energy)
    path = write_record(record, args.results_dir)
    print(f"final: accuracy {100 * accuracy:.2f}% | time per epoch {metrics['time_per_epoch_s']:.2f} s | "
          f"{samples_per_s:.0f} samples/s | peak memory {format_bytes(memory['peak_bytes'])} ({memory['source']})")
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
