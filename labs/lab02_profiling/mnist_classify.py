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
import time

import torch
import torch.nn.functional as F
from line_profiler import profile  # a no-op decorator unless the script runs under kernprof

from common.train import amp, cuda_graphs
from common.data import pipelines
from common.cli import apply_dry_run, script_parser
from common.runtime.device import configure_threads, resolve_device, seed_everything, set_launch_blocking, synchronize
from common.measure.energy import EnergyMeter
from common.models import MnistNet
from common.measure.timing import peak_memory, reset_peak_memory
from labs.lab02_profiling.lab02_shared import (Epochs, add_train_args, flag_notes, measure_floors, print_header,
                                              run_main_profiled, time_first_call, write_train_record)


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


def build_parser() -> argparse.ArgumentParser:
    return add_train_args(script_parser(__doc__))


def main(argv: list[str] | None = None) -> int:
    args = apply_dry_run(build_parser().parse_args(argv))
    if args.launch_blocking:
        set_launch_blocking()  # before anything starts CUDA
    seed_everything(args.seed)
    threads = configure_threads()
    device = resolve_device(args.device)
    args.precision = amp.check_precision(args.precision, device)
    pin_memory = args.pin_memory and device.type == "cuda"  # pinning only speeds up copies to a GPU
    train_data, test_data = pipelines.load_uint8(args.dataset, args.data_dir, seed=args.seed,
                                                 synthetic_size=args.synthetic_size)
    notes = flag_notes(args, device, len(train_data))  # flags that change nothing here (or less), each said once
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
    print_header(args, device, threads, (len(train_data), len(test_data)), line_profiler=profile.enabled)
    compile_s = None
    if args.compile:  # compilation happens at the first call: timed apart, or the first epoch would carry it
        model = torch.compile(model)
        compile_s = time_first_call(model, device, args)
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
    epochs, test_loss, accuracy = Epochs(), float("nan"), 0.0
    meter = EnergyMeter(device).start()  # over the epochs, evaluation included
    for epoch in range(1, args.epochs + 1):
        synchronize(device)
        start = time.perf_counter()
        seen, steps, mean_loss, logged = train(args, model, device, train_loader, optimizer, epoch, scaler, graph)
        synchronize(device)
        epochs.add(time.perf_counter() - start, seen, steps, mean_loss, logged)
        test_loss, accuracy = test(args, model, device, test_loader)
        scheduler.step()
        print(f"epoch {epoch}: {epochs.times[-1]:.2f} s, {seen / epochs.times[-1]:.0f} samples/s", flush=True)

    energy = meter.stop().result(samples=sum(epochs.samples))
    memory = peak_memory(device)  # before the floors' own steps
    data, target = example_batch(args, device)  # the floors time the step on a batch of the training shape
    model.train()  # test() left it in eval mode: the floors time a training step, dropout included
    step_floors = measure_floors(args, device, model, lambda m: training_step(args, m, device, optimizer, scaler,
                                                                             data, target),
                                 in_graph=graph is not None, step_time_s=epochs.step_time_s)
    write_train_record(args, device, threads, epochs, test_loss=test_loss, accuracy=accuracy, memory=memory,
                       step_floors=step_floors, graph=graph, blocker=blocker, compile_s=compile_s,
                       pin_memory=pin_memory, line_profiler=bool(profile.enabled),
                       sizes=(len(train_data), len(test_data)), notes=notes, energy=energy)
    return 0


if __name__ == "__main__":
    run_main_profiled(main)
