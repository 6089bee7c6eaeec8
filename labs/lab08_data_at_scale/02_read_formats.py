#!/usr/bin/env python3
"""Lab-08 step 2: train the same model from small files, tar shards or one array file; count what the reading costs.

Usage:
    python labs/lab08_data_at_scale/02_read_formats.py --format imagefolder
    python labs/lab08_data_at_scale/02_read_formats.py --format webdataset --metadata-latency 1.0
    python labs/lab08_data_at_scale/02_read_formats.py --format array --read-only --num-workers 1
    python labs/lab08_data_at_scale/02_read_formats.py --format webdataset --decode device  # nvJPEG on a GPU
    sbatch stage_and_train_2node.sbatch   # rendered from sbatch/stage_and_train_2node.sbatch.j2 (03 on staged shards)

What it teaches: where an epoch's time goes when the data are many small files. Each epoch prints and
records samples/s, the files the dataset's code opened, its stat-family calls, the bytes it read
(counted in every DataLoader worker, summed at the epoch's end) and the share of step time the loop
spent waiting for its batch. ``--metadata-latency MS`` waits that long before every real open, as a
shared file system's metadata round trips would (1.0 ms is the documented Lustre-like figure, see the
README's cost model): small files pay it once per image, shards once per thousand images. A cost model
(:func:`predict_here`, :func:`predict_cluster`) predicts the epoch from what this machine's run costs per
sample and per step, measured before the first epoch, and the structure of the format; the script prints
predicted against measured, and the epoch time of N nodes on a Lustre-like file system.

The model and batch are fixed for every format (``lab08_shared.build_model``, batch 64 of 64 x 64 grayscale
JPEGs, SGD with momentum): only the input pipeline differs. ``--read-only`` runs the loader alone (no model),
to see what the format itself can deliver. ``--decode device`` moves JPEG decoding out of the workers into
the training process, on the training device: ``torchvision.io.decode_jpeg(..., device="cuda")`` on a GPU
(the GPU proof's tier-2 check), libjpeg in the main process on a CPU.
"""

from __future__ import annotations

import argparse
import math
from functools import partial

import torch
import torch.nn.functional as F

from common.cli import non_negative_float, positive_int, refuse_unused, script_parser
from common.errors import run_main
from common.train.run import TrainingRun
from common.units import format_bytes
from labs.lab08_data_at_scale.lab08_shared import (
    FORMATS, LAB, SHARD_READERS, EpochIO, add_file_system_args, add_training_run_args, build_model, calibrate,
    check_batch, decode_batch, describe_dataset, expected_opens, file_system, make_loader, set_loader_epoch,
    set_metadata_latency, to_model_input,
)

SCRIPT = "labs/lab08_data_at_scale/02_read_formats.py"


# --------------------------------------------------------------------------------------------
# The cost model


def predict_here(*, samples: int, opens: int, workers: int, batch: int, sample_s: float, step_s: float,
                 open_wait_s: float) -> dict:
    """This machine's epoch: the loader's work (every sample's cost, every open's injected wait) shared by the
    workers, against the training's; with workers they overlap and the slower sets the pace (plus the first
    batch, made before training can start); without workers one process does both, one after the other."""
    load_s = samples * sample_s + opens * open_wait_s
    train_s = math.ceil(samples / batch) * step_s
    if workers == 0:
        return {"epoch_s": load_s + train_s, "load_s": load_s, "train_s": train_s, "bound": "sum (no workers)"}
    first_batch_s = load_s / samples * batch if samples else 0.0
    producer_s = load_s / workers
    return {"epoch_s": max(producer_s, train_s) + first_batch_s, "load_s": producer_s, "train_s": train_s,
            "bound": "loader" if producer_s > train_s else "training"}


def predict_cluster(*, samples: int, opens: int, stats: int, data_bytes: int, nodes: int, workers: int, batch: int,
                    sample_s: float, step_s: float, fs: dict) -> dict:
    """N nodes, each with ``workers`` loader processes, read 1/N of the epoch from one shared file system.

    Every open costs two metadata round trips (open and close) and every stat one, of ``metadata_rtt_ms``
    each, but the metadata servers serve at most ``metadata_ops_per_s`` for all nodes together; every process
    reads at ``stream_gb_per_s``, all together at most ``total_gb_per_s``; decoding costs what it cost here.
    The epoch lasts as long as the slower of one node's loader and its training (this machine's step time); with no
    workers the main process is the one reader and reads between its steps: the two add up (as in predict_here)."""
    readers = max(1, workers)
    round_trips = 2 * opens + stats
    metadata_s = max(round_trips / nodes * fs["metadata_rtt_ms"] / 1e3 / readers,
                     round_trips / fs["metadata_ops_per_s"])
    bandwidth_s = max(data_bytes / nodes / readers / (fs["stream_gb_per_s"] * 1e9),
                      data_bytes / (fs["total_gb_per_s"] * 1e9))
    train_s = math.ceil(samples / nodes / batch) * step_s
    parts = {"metadata": metadata_s, "bandwidth": bandwidth_s, "decode": samples / nodes * sample_s / readers}
    load_s = sum(parts.values())
    return {"nodes": nodes, "epoch_s": max(load_s, train_s) if workers else load_s + train_s,
            **{f"{k}_s": v for k, v in parts.items()}, "train_s": train_s,
            "bound": max(parts, key=parts.get) if load_s > train_s else "training"}


# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    group = parser.add_argument_group("what to read")
    group.add_argument("--format", choices=FORMATS, default="webdataset",
                       help="imagefolder: a file per image; webdataset: tar shards; array: one memory-mapped file "
                            "(default: %(default)s)")
    group.add_argument("--metadata-latency", type=non_negative_float, default=0.0, metavar="MS",
                       help="wait this long before every real open, as a shared file system's metadata server "
                            "would; 1.0 is the README's Lustre-like figure (default: %(default)s: this disk as it is)")
    group.add_argument("--read-only", action="store_true",
                       help="run the loader alone, no model: what the format delivers (default: off)")
    group.add_argument("--decode", choices=("loader", "device"), default="loader",
                       help="loader: the workers decode JPEGs on their CPUs; device: the training process decodes "
                            "whole batches on --device (nvJPEG on a GPU) (default: %(default)s)")
    group.add_argument("--shuffle-buffer", type=positive_int, default=256,
                       help="webdataset: samples in the shuffle buffer (default: %(default)s)")
    group.add_argument("--shard-reader", choices=SHARD_READERS, default="index",
                       help="webdataset: find each member at the manifest's offset (index) or parse every tar header "
                            "with WebDataset's reader (webdataset) (default: %(default)s)")
    group.add_argument("--calibration-samples", type=positive_int, default=2048,
                       help="samples the cost model times before the first epoch (default: %(default)s)")
    add_file_system_args(parser)  # --fs-metadata-rtt-ms ... --nodes: the cost model's file system (README)
    return add_training_run_args(parser, group, epochs=1, data="the data set 01_make_dataset.py wrote")


def main(argv: list[str] | None = None) -> int:
    args = (parser := build_parser()).parse_args(argv)
    refuse_unused(parser, args, args.format == "webdataset", "--format webdataset", "shard_reader", "shuffle_buffer")
    description = describe_dataset(args.data_dir, args.format)
    set_metadata_latency(args.metadata_latency)
    fs = file_system(args)
    method = args.format + ("+latency" if args.metadata_latency else "") + ("+read-only" if args.read_only else "") \
        + ("+decode-on-device" if args.decode == "device" else "") \
        + ("+tar-reader" if args.format == "webdataset" and args.shard_reader == "webdataset" else "")
    with TrainingRun(args, lab=LAB, script=SCRIPT, method=method) as run:
        device = run.device
        loader_for = partial(make_loader, args.format, args.data_dir, batch_size=args.batch_size, seed=args.seed,
                             shuffle_buffer=args.shuffle_buffer, decode_in_loader=args.decode == "loader",
                             metadata_latency_ms=args.metadata_latency, shard_reader=args.shard_reader,
                             pin_memory=device.type == "cuda")
        loader, held = loader_for(num_workers=args.num_workers)
        torch.manual_seed(args.seed)
        model = build_model().to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        run.track(model=model, optimizer=optimizer)
        # The cost model's inputs, measured here: one sample produced as the epochs' workers produce it (no
        # injected latency: its wait is measured on its own), one training step.
        cost = calibrate(lambda n: loader_for(num_workers=args.num_workers, metadata_latency_ms=0.0, limit=n)[0],
                         fmt=args.format, samples=args.calibration_samples, workers=args.num_workers,
                         decode_device=device if args.decode == "device" else None, model=model, lr=args.lr,
                         batch_size=args.batch_size, device=device, read_only=args.read_only)
        run.print(f"{method}: {held['samples']:,} samples in {held['files']:,} file(s) | {run.describe()} | "
                  f"{args.num_workers} loader worker(s), batch {args.batch_size} | one sample costs a worker "
                  f"{cost['sample_s'] * 1e6:.0f} us to produce here, "
                  + ("no training step (--read-only)" if args.read_only else f"one step {cost['step_s'] * 1e3:.1f} ms"))
        io, epochs = EpochIO(), []
        for epoch in run.epochs():
            set_loader_epoch(loader, args.seed, epoch)
            io.start_epoch()
            waited_before, samples = run.meter.waited_s, 0
            model.train()
            for images, labels, extras in run.steps(loader):
                check_batch(extras, can_skip=False)
                io.saw(extras["io"])  # this worker's counts so far
                samples += len(labels)
                if args.decode == "device":
                    images = decode_batch(images, device)
                if args.read_only:
                    continue
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(to_model_input(images, device)), labels.to(device))
                loss.backward()
                optimizer.step()
                run.log_loss(loss)
            counted, epoch_s = io.totals(), run.meter.last_epoch_s
            opens = expected_opens(args.format, held, samples, args.num_workers)
            predicted = predict_here(samples=samples, opens=opens, workers=args.num_workers, batch=args.batch_size,
                                     sample_s=cost["sample_s"], step_s=cost["step_s"], open_wait_s=cost["open_wait_s"])
            waited = run.meter.waited_s - waited_before
            epochs.append({"epoch": epoch, "samples": samples, "epoch_s": epoch_s, "samples_per_s": samples / epoch_s,
                           "opens": counted["opens"], "stats": counted["stats"], "bytes": counted["bytes"],
                           "injected_wait_s": counted["injected_wait_s"], "processes": counted["processes"],
                           "expected_opens": opens, "data_wait_s": waited,
                           "data_wait_share": waited / epoch_s, "predicted_epoch_s": predicted["epoch_s"],
                           "predicted_bound": predicted["bound"]})
            run.print(f"epoch {epoch}: {samples:,} samples in {epoch_s:.2f} s = {samples / epoch_s:,.0f} samples/s "
                      "(the whole epoch; the final line times the steps after warm-up) | "
                      f"opened {counted['opens']:,} file(s), {counted['stats']:,} stat call(s), read "
                      f"{format_bytes(counted['bytes'])} | waiting for data {waited / epoch_s:.0%} of step time | "
                      f"predicted {predicted['epoch_s']:.2f} s ({predicted['bound']}), measured ÷ predicted "
                      f"{epoch_s / predicted['epoch_s']:.2f}")
        last, whole = epochs[-1], held["samples"]
        scale = whole / max(last["samples"], 1)  # the counts of a whole epoch, from the last one
        cluster = [predict_cluster(samples=whole, opens=round(last["expected_opens"] * scale), stats=0,
                                   data_bytes=round(last["bytes"] * scale), nodes=nodes, workers=args.num_workers,
                                   batch=args.batch_size, sample_s=cost["sample_s"], step_s=cost["step_s"], fs=fs)
                   for nodes in args.nodes]
        run.print(f"on a Lustre-like file system ({fs['metadata_rtt_ms']} ms a metadata round trip, "
                  f"{fs['stream_gb_per_s']} GB/s a stream), one epoch of {whole:,} samples, "
                  + (f"{args.num_workers} loader worker(s) per node: " if args.num_workers else
                     "no loader workers (each node's main process reads between its steps): ")
                  + "; ".join(f"{row['nodes']} node(s) {row['epoch_s']:.1f} s ({row['bound']})" for row in cluster))
        wait_share = sum(e["data_wait_s"] for e in epochs) / sum(e["epoch_s"] for e in epochs)
        run.finish(config={"dataset": description, "file_system_model": fs},
                   metrics={"epochs_io": epochs, "cost": cost, "cluster_prediction": cluster,
                            "data_wait_share": wait_share})
    return 0


if __name__ == "__main__":
    run_main(main)
