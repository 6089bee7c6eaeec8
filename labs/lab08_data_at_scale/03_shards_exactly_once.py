#!/usr/bin/env python3
"""Lab-08 step 3: train from tar shards on every rank and every worker, each sample once per epoch, resumable mid-epoch.

Usage:
    python labs/lab08_data_at_scale/03_shards_exactly_once.py
    torchrun --standalone --nproc_per_node=2 labs/lab08_data_at_scale/03_shards_exactly_once.py --num-workers 2
    python labs/lab08_data_at_scale/03_shards_exactly_once.py --checkpoint ckpt.pt     # then again with --resume
    python labs/lab08_data_at_scale/03_shards_exactly_once.py --on-bad-sample skip   # leave bad samples out, count them
    srun --kill-on-bad-exit=1 python labs/lab08_data_at_scale/03_shards_exactly_once.py --data-dir "$STAGED"
    sbatch stage_and_train_2node.sbatch   # rendered from sbatch/stage_and_train_2node.sbatch.j2: shards staged per node

What it teaches: with R ranks of W loader workers each, R x W processes read the shards, and each must
get its own: the epoch's shard order (seeded by the epoch) is dealt out to the R x W reader slots, and a
buffer shuffles samples inside a slot (``lab08_shared.ShardStream``). When the shards do not divide evenly
the slots hold different numbers of samples, and ranks that take different numbers of steps hang DDP;
``--shard-policy`` chooses, and the run prints what it costs: ``pad`` (blank, weight-0 samples fill every
slot up to the largest), ``drop`` (every slot stops at the smallest; the rest wait for another epoch) or
``uneven`` (every sample once; for one rank's workers only: ranks that step unevenly would hang). At each
epoch's end the ranks gather the ids they read, and rank 0 says whether every sample was read exactly once.

The loader's position is part of the checkpoint: torchdata's ``StatefulDataLoader`` asks every worker for
``ShardStream.state_dict()`` (shard, member, the shuffle buffer as pointers, the generator's state) with
each batch, so a run stopped mid-epoch (SIGUSR1, as Slurm's ``--signal`` sends it) resumes with exactly the
batch an unbroken run would have read next. WebDataset's own pipeline restarts an epoch from its start.
Each rank's position is its own, so each rank writes it beside rank 0's checkpoint (:class:`LoaderCheckpoint`).

Bad data (a truncated shard, a checksum mismatch, a missing member, a JPEG that does not decode) is one
line naming the shard and the member: ``--on-bad-sample fail`` stops there, writing nothing; ``skip``
leaves the sample out, counts it in the record, and the run goes on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import warnings
from collections import Counter
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from common.atomic import write_text_atomic
from common.data.datasets import worker_ignores_sigterm
from common.cli import non_negative_float, output_dir, positive_int, script_parser
from common.errors import UserError, run_main
from common.runtime.distributed import gather_objects
from common.runtime.launch import detect_launch
from common.train.flags import settle
from common.train.preemption import Preempted
from common.train.run import TrainingRun
from labs.lab08_data_at_scale.lab08_shared import (
    BAD_SAMPLE_ACTIONS, LAB, POLICIES, EpochIO, IdsRead, LoaderCheckpoint, ShardStream, build_model, check_batch,
    add_training_run_args, read_shard_table, set_metadata_latency, to_model_input,
)

SCRIPT = "labs/lab08_data_at_scale/03_shards_exactly_once.py"


def weighted_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The mean loss of the real samples: a pad blank has weight 0."""
    per_sample = F.cross_entropy(logits, labels, reduction="none")
    return (per_sample * weights).sum() / weights.sum().clamp_min(1)


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    group = parser.add_argument_group("the shards")
    group.add_argument("--shard-policy", choices=POLICIES, default="pad",
                       help="when the slots hold different numbers of samples: pad with weight-0 blanks, drop what "
                            "the smallest slot lacks, or read unevenly (default: %(default)s)")
    group.add_argument("--shuffle-buffer", type=positive_int, default=256,
                       help="samples in each worker's shuffle buffer (default: %(default)s)")
    group.add_argument("--on-bad-sample", choices=BAD_SAMPLE_ACTIONS, default="fail",
                       help="a bad shard member: fail (one line, nothing written) or skip it and count it "
                            "(default: %(default)s)")
    group.add_argument("--verify-only", action="store_true",
                       help="read every sample once without training, e.g. after staging (default: off)")
    group.add_argument("--metadata-latency", type=non_negative_float, default=0.0, metavar="MS",
                       help="wait this long before every open (see 02_read_formats.py) (default: %(default)s)")
    group.add_argument("--ids-out", type=output_dir, default=None,
                       help="write the sample ids each rank read, in order, one line per epoch, to ids-rank<r>.jsonl "
                            "here; a resumed run writes what it read since the resume (default: none)")
    return add_training_run_args(parser, group, epochs=2, checkpoint=True,
                                 data="the data set 01_make_dataset.py wrote, or a staged copy of it")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shard_dir = args.data_dir / "shards" if (args.data_dir / "shards").is_dir() else args.data_dir
    shards = read_shard_table(shard_dir)  # a folder without the shards: one line now, before the device and the group
    args.shards = (f"{sum(s.samples for s in shards)} samples in {len(shards)} shards (sha256 "
                   f"{hashlib.sha256(''.join(s.sha256 for s in shards).encode()).hexdigest()[:12]})")
    set_metadata_latency(args.metadata_latency)
    launch = detect_launch()  # this process's rank, before the process group exists
    # Where the checkpoint goes (--checkpoint, else RESULTS_DIR/checkpoints/): every rank adds its loader's position.
    checkpointer = LoaderCheckpoint(settle(args, SCRIPT, distributed=True), launch.rank)
    ids_read: list[list[int]] = []
    try:
        with TrainingRun(args, lab=LAB, script=SCRIPT, method=f"shards-{args.shard_policy}", distributed=True,
                         checkpointer=checkpointer, resume_settings=("seed", "batch_size", "shard_policy",
                                                                     "shuffle_buffer", "num_workers", "shards")) as run:
            device = run.device
            if args.shard_policy == "uneven" and run.world_size > 1:
                raise UserError(f"--shard-policy uneven on {run.world_size} ranks: the ranks would take different "
                                "numbers of steps, and DDP's all-reduce and the stop agreed at every step would wait "
                                "forever for the rank that ran out; use pad or drop (uneven suits one rank's workers)")
            stream = ShardStream(shard_dir, batch_size=args.batch_size, rank=run.rank, world_size=run.world_size,
                                 num_workers=args.num_workers, seed=args.seed, policy=args.shard_policy,
                                 buffer_size=args.shuffle_buffer, on_bad_sample=args.on_bad_sample)
            from torchdata.stateful_dataloader import StatefulDataLoader

            # torchdata 0.11 calls torch.set_vital, which newer PyTorch deprecates: a warning per loader, nothing more.
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

            # Whole batches come from each worker (batch_size=None); the loader keeps every worker's position.
            loader = StatefulDataLoader(stream, batch_size=None, num_workers=args.num_workers,
                                        worker_init_fn=partial(worker_ignores_sigterm, then=partial(
                                            set_metadata_latency, args.metadata_latency)),
                                        pin_memory=device.type == "cuda")
            torch.manual_seed(args.seed)
            model = build_model().to(device)
            if run.world_size > 1:
                from torch.nn.parallel import DistributedDataParallel as DDP

                model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
            optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
            read = IdsRead()  # the ids this rank read this epoch: in the checkpoint too, to count a resumed epoch whole
            run.track(model=model, optimizer=optimizer, loader=loader, ids=read)  # the loader's position is in it
            plan = stream.describe(min(run.epoch, run.settings.epochs))  # after a resume: the epoch it reads
            run.print(stream.plan_line(plan["epoch"]))
            io, epochs, bad = EpochIO(), [], {}
            for epoch in run.epochs():
                stream.set_epoch(epoch)
                io.start_epoch()
                waited_before, ids, padded, skipped = run.meter.waited_s, read.start_epoch(), 0, {}
                ids_read.append(ids)
                model.train()
                for images, labels, extras in run.steps(loader, loader_resumes=True):
                    check_batch(extras)
                    io.saw(extras["io"])
                    ids += extras["ids"].tolist()
                    padded += int((extras["weights"] == 0).sum())
                    skipped[extras["slot"]] = extras["skipped"]  # each worker counts its own
                    bad.update({(b["shard"], b["member"]): b for b in extras["bad"]})
                    if args.verify_only:
                        continue
                    optimizer.zero_grad(set_to_none=True)
                    loss = weighted_loss(model(to_model_input(images, device)), labels.to(device),
                                         extras["weights"].to(device))
                    loss.backward()
                    optimizer.step()
                    run.log_loss(loss)
                # Every rank's ids at rank 0 (a collective: every rank calls it), counted against the manifest.
                gathered = gather_objects({"ids": [i for i in read.all() if i >= 0], "skipped": sum(skipped.values()),
                                           "bad": list(bad.values())})
                everyone = [entry["ids"] for entry in gathered]
                skipped_all = sum(entry["skipped"] for entry in gathered)
                bad = {(b["shard"], b["member"]): b for entry in gathered for b in entry["bad"]}
                counted = io.totals()
                epoch_s, waited = run.meter.last_epoch_s, run.meter.waited_s - waited_before
                if run.is_main:
                    seen = Counter(i for rank_ids in everyone for i in rank_ids)
                    twice = sum(1 for n in seen.values() if n > 1)
                    exact = len(seen) == plan["samples"] and not twice
                    run.print(f"epoch {epoch}: {len(seen):,} of {plan['samples']:,} samples read, {twice} more than "
                              f"once ({'every sample exactly once' if exact else 'not exactly once'}"
                              f"; policy {args.shard_policy} planned {stream.describe(epoch)['padded']} blank(s), "
                              f"{stream.describe(epoch)['dropped']} left out) | rank 0: {padded} blank(s) (planned, or "
                              f"in place of a skipped sample) | {skipped_all} skipped on all ranks | rank 0 opened "
                              f"{counted['opens']} shard file(s), waiting for data {waited / epoch_s:.0%} of step time")
                read.end_epoch()
                run.save_checkpoint()  # model, optimiser and, from every rank, the loader's position
                epochs.append({"epoch": epoch, "plan": stream.describe(epoch), "samples": sum(1 for i in ids if i >= 0),
                               "padded": padded,
                               "skipped_all_ranks": skipped_all,
                               "distinct_all_ranks": len({i for rank_ids in everyone for i in rank_ids}),
                               "read_all_ranks": sum(len(rank_ids) for rank_ids in everyone), "epoch_s": epoch_s,
                               "opens": counted["opens"], "bytes": counted["bytes"], "data_wait_s": waited,
                               "data_wait_share": waited / epoch_s if epoch_s else None})
            for problem in bad.values():
                run.print(f"skipped: {problem['shard']}: {problem['member']}: {problem['reason']}")
            run.finish(config={"plan": plan, "shard_dir": str(shard_dir)},
                       metrics={"epochs_io": epochs, "skipped_samples": sum(e["skipped_all_ranks"] for e in epochs),
                                "bad_samples": list(bad.values())[:100],
                                "exactly_once": all(e["distinct_all_ranks"] == plan["samples"] ==
                                                    e["read_all_ranks"] for e in epochs) if run.is_main else None})
    except Preempted:  # stopped by a signal, the checkpoint saved (run_main exits 0): what it read until then
        write_ids(args.ids_out, launch, args, ids_read)
        raise
    write_ids(args.ids_out, launch, args, ids_read)
    return 0


def write_ids(folder: Path | None, launch, args: argparse.Namespace, ids_read: list[list[int]]) -> None:
    """The ids this rank read, in order: a JSON line per epoch (not .json, which a results folder reads as a record)."""
    if folder is not None:
        lines = [json.dumps({"rank": launch.rank, "world_size": launch.world_size, "workers": args.num_workers,
                             "policy": args.shard_policy, "epoch_index": index, "ids": ids})
                 for index, ids in enumerate(ids_read)]
        write_text_atomic("".join(line + "\n" for line in lines), folder / f"ids-rank{launch.rank}.jsonl")


if __name__ == "__main__":
    run_main(main)
