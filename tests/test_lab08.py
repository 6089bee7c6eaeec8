"""Lab-08 acceptance: one data set in three formats, reading counted (and checked against strace), each sample once
per epoch over ranks x workers, a loader that resumes mid-epoch, bad data named by shard and member.

One tiny data set serves every test: 230 images in shards of 40, so the 6 shards (five of 40, one of 30) do not
divide evenly over 4 reader slots (2 ranks x 2 workers). Runs happen inside pytest (``run_main``) except where
a process of its own is the point: the strace count and the two-rank launch.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import re
import shutil
import subprocess
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from helpers import REPO, launch_plan, load_script, run_main, script_env

LAB = "labs/lab08_data_at_scale"
MAKE = f"{LAB}/01_make_dataset.py"
READ = f"{LAB}/02_read_formats.py"
SHARDS = f"{LAB}/03_shards_exactly_once.py"
SAMPLES, SHARD_SIZE = 230, 40


def _records(folder: Path) -> list[dict]:
    from common.results import load_records

    loaded = load_records(folder)
    assert not loaded.errors, loaded.errors
    return loaded.records


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lab08")
    with contextlib.redirect_stdout(io.StringIO()):
        assert run_main(MAKE, ["--samples", str(SAMPLES), "--shard-size", str(SHARD_SIZE), "--data-dir",
                               str(root / "data"), "--results-dir", str(root / "made")]) == 0
    return root / "data"


def _shard_rows(data: Path) -> list[dict]:
    """The manifest's rows: one per tar member (``.cls``, then ``.jpg``, for each sample)."""
    with open(data / "shards" / "manifest.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def _jpeg_rows(data: Path) -> list[dict]:
    return [row for row in _shard_rows(data) if row["member"].endswith(".jpg")]


# -- 1. three formats of one data set -----------------------------------------------------------------------


def test_three_formats_hold_the_same_jpegs_and_the_manifest_finds_each_in_its_shard(data):
    import numpy as np
    from PIL import Image

    description = json.loads((data / "dataset.json").read_text())
    assert description["samples"] == SAMPLES and set(description["formats"]) == {"imagefolder", "webdataset", "array"}
    files = sorted((data / "imagefolder" / "train").glob("*/*.jpg"))
    assert len(files) == SAMPLES
    rows = _jpeg_rows(data)
    assert sorted(int(row["id"]) for row in rows) == list(range(SAMPLES))
    assert Counter(row["shard"] for row in rows) == {f"shard-{i:06d}.tar": SHARD_SIZE for i in range(5)} | \
        {"shard-000005.tar": SAMPLES - 5 * SHARD_SIZE}
    index = np.load(data / "array" / "index.npy")
    array = np.memmap(data / "array" / "images.u8", dtype=np.uint8, mode="r")
    by_id = {int(row["id"]): row for row in rows}
    for path in files[::23]:  # every format holds the same bytes for a sample, where the manifest says
        sample_id, label = int(path.stem), int(path.parent.name)
        row, (array_id, offset, size, array_label) = by_id[sample_id], index[sample_id]
        shard = (data / "shards" / row["shard"]).read_bytes()
        jpeg = path.read_bytes()
        assert shard[int(row["offset"]):int(row["offset"]) + int(row["size"])] == jpeg
        assert (array_id, array_label, int(row["label"])) == (sample_id, label, label)
        assert array[offset:offset + size].tobytes() == jpeg
        with Image.open(path) as image:  # a real JPEG of 64 x 64 grayscale
            assert (image.format, image.size, image.mode) == ("JPEG", (64, 64), "L")
    labels = {int(row["id"]): row["label"] for row in _shard_rows(data) if row["member"].endswith(".cls")}
    assert labels == {sample_id: row["label"] for sample_id, row in by_id.items()}  # a row for every member
    # The checksums are what sha256sum -c reads after a copy.
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=data / "shards", capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.count(": OK") == 6, check.stdout + check.stderr


def test_the_writer_refuses_a_folder_that_exists_and_writes_nothing(data, capsys):
    before = sorted(p.name for p in data.parent.iterdir())
    assert run_main(MAKE, ["--samples", "10", "--data-dir", str(data), "--results-dir", str(data.parent / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "already exists" in err
    assert sorted(p.name for p in data.parent.iterdir()) == before


def test_shards_are_webdatasets_without_pax_headers_and_both_readers_find_the_same_samples(data, tmp_path):
    """WebDataset's own pipeline reads the shards; no member carries a PAX header (ShardWriter's float mtime
    would add one per member, and parsing them cost more than decoding); the manifest's offsets (``index``) give
    exactly the samples WebDataset's tar reader finds; and one seed writes byte-identical shards."""
    import webdataset as wds

    from labs.lab08_data_at_scale.lab08_shared import check_shard, read_shard_table

    shards = read_shard_table(data / "shards")
    first = str(data / "shards" / shards[0].name)
    keys = [sample["__key__"] for sample in wds.WebDataset(first, shardshuffle=False)]
    assert keys == [f"{int(row['id']):06d}" for row in shards[0].members if row["member"].endswith(".jpg")]
    for info in shards:
        raw = (data / "shards" / info.name).read_bytes()
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            members = tar.getmembers()
        assert all(m.pax_headers == {} and isinstance(m.mtime, int) for m in members)
        assert [m.offset_data for m in members] == [row["offset"] for row in info.members]
        (indexed, no_problems), (parsed, none_either) = (check_shard(info, raw, r) for r in ("index", "webdataset"))
        assert no_problems == none_either == [] and len(indexed) == info.samples
        assert [{k: s[k] for k in ("__key__", "jpg", "cls")} for s in parsed] == indexed
    with contextlib.redirect_stdout(io.StringIO()):
        assert run_main(MAKE, ["--samples", str(SAMPLES), "--shard-size", str(SHARD_SIZE), "--formats", "webdataset",
                               "--data-dir", str(tmp_path / "again"), "--results-dir", str(tmp_path / "made")]) == 0
    assert (tmp_path / "again" / "shards" / "SHA256SUMS").read_text() == (data / "shards" / "SHA256SUMS").read_text()


# -- 2. reading, counted -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reads(data, tmp_path_factory) -> dict[str, dict]:
    """One read-only epoch of each format with 2 workers; the shards (with WebDataset's tar reader instead of the
    manifest's offsets) and the array also with a wait of 40 ms per open."""
    out = tmp_path_factory.mktemp("reads")
    runs = {"imagefolder": [], "array": [], "webdataset": [],
            "webdataset+latency": ["--metadata-latency", "40", "--shard-reader", "webdataset"],
            "array+latency": ["--metadata-latency", "40"]}
    records = {}
    for name, extra in runs.items():
        fmt = name.split("+")[0]
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert run_main(READ, ["--format", fmt, "--data-dir", str(data), "--results-dir", str(out / name),
                                   "--device", "cpu", "--num-workers", "2", "--batch-size", "32", "--read-only",
                                   "--calibration-samples", "32", "--nodes", "1", "8", *extra]) == 0
        (record,) = _records(out / name)
        records[name] = {"record": record, "out": printed.getvalue()}
    return records


def test_each_format_counts_its_opens_bytes_and_workers(data, reads):
    shards = json.loads((data / "shards" / "shards.json").read_text())["shards"]
    jpeg_bytes = json.loads((data / "dataset.json").read_text())["jpeg_bytes"]
    expected = {"imagefolder": (SAMPLES, jpeg_bytes),       # a file per image
                "webdataset": (len(shards), sum(s["bytes"] for s in shards)),  # a file per shard, read whole
                "array": (2, jpeg_bytes)}                   # the array mapped once in each of the 2 workers
    for name, (opens, read) in expected.items():
        (epoch,) = reads[name]["record"]["metrics"]["epochs_io"]
        assert (epoch["samples"], epoch["opens"], epoch["bytes"], epoch["processes"]) == (SAMPLES, opens, read, 2), name
        assert epoch["expected_opens"] == opens and epoch["stats"] == 0
        assert 0 <= epoch["data_wait_share"] <= 1 and epoch["predicted_epoch_s"] > 0
        assert f"opened {opens:,} file(s)" in reads[name]["out"]
        # The loader read alone trains nothing: no loss, and not a "nan" that reads as a diverged run.
        assert "epoch 1: no loss logged |" in reads[name]["out"] and "nan" not in reads[name]["out"], reads[name]["out"]
        assert "no training step (--read-only)" in reads[name]["out"]
        assert reads[name]["record"]["metrics"]["final_loss"] is None


def test_injected_latency_is_waited_once_per_open_and_predicted(reads):
    model = load_script(READ)
    (plain,) = reads["webdataset"]["record"]["metrics"]["epochs_io"]
    (slow,) = reads["webdataset+latency"]["record"]["metrics"]["epochs_io"]
    assert plain["injected_wait_s"] == 0
    assert slow["opens"] == 6 and slow["injected_wait_s"] >= 6 * 0.040  # a sleep lasts at least what it asks
    (mapped,) = reads["array+latency"]["record"]["metrics"]["epochs_io"]
    assert mapped["opens"] == 2 and mapped["injected_wait_s"] >= 2 * 0.040  # counted in the worker that waited
    assert slow["epoch_s"] >= 3 * 0.040  # 6 waits of 40 ms shared by 2 workers
    # The prediction printed and recorded is the model's, from this run's calibration and the format's opens.
    cost = reads["webdataset+latency"]["record"]["metrics"]["cost"]
    assert cost["open_wait_s"] >= 0.040 and reads["webdataset"]["record"]["metrics"]["cost"]["open_wait_s"] == 0
    again = model.predict_here(samples=SAMPLES, opens=6, workers=2, batch=32, sample_s=cost["sample_s"],
                               step_s=cost["step_s"], open_wait_s=cost["open_wait_s"])
    assert slow["predicted_epoch_s"] == pytest.approx(again["epoch_s"])
    assert again["epoch_s"] - model.predict_here(samples=SAMPLES, opens=6, workers=2, batch=32,
                                                 sample_s=cost["sample_s"], step_s=cost["step_s"],
                                                 open_wait_s=0.0)["epoch_s"] >= 3 * 0.040
    assert "measured ÷ predicted" in reads["webdataset+latency"]["out"]
    assert "samples, 2 loader worker(s) per node: 1 node(s) " in reads["webdataset"]["out"]
    cluster = reads["webdataset"]["record"]["metrics"]["cluster_prediction"]
    assert [row["nodes"] for row in cluster] == [1, 8] and cluster[1]["epoch_s"] < cluster[0]["epoch_s"]


# torchvision 0.29 deprecates its image decoders (Lab-08 uses decode_jpeg): said once by the tests above,
# not per batch here.
@pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities of TorchVision:DeprecationWarning")
def test_calibration_reads_its_clock_after_the_decode_device_finished(data, tmp_path, monkeypatch):
    """--decode device: nvJPEG works on a CUDA stream, so a clock read right after decode_batch returns would time
    only the launch. Whatever the device, each clock read of the calibration that follows a decode comes after the
    device was synchronised (a no-op on a CPU; on a GPU the wait for the decode). With no workers the calibration's
    reads and the epoch's are one process's: the epoch's counts leave the calibration's out."""
    import time as real_time
    from types import SimpleNamespace

    import labs.lab08_data_at_scale.lab08_shared as shared

    events: list[str] = []
    decode, synchronize = shared.decode_batch, shared.synchronize
    monkeypatch.setattr(shared, "decode_batch", lambda *a, **k: events.append("decode") or decode(*a, **k))
    monkeypatch.setattr(shared, "synchronize", lambda *a, **k: events.append("sync") or synchronize(*a, **k))
    monkeypatch.setattr(shared, "time", SimpleNamespace(
        perf_counter=lambda: events.append("clock") or real_time.perf_counter(), sleep=real_time.sleep))
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert run_main(READ, ["--format", "array", "--data-dir", str(data), "--results-dir", str(tmp_path),
                               "--device", "cpu", "--num-workers", "0", "--batch-size", "32", "--read-only",
                               "--decode", "device", "--calibration-samples", "64", "--nodes", "1"]) == 0
    # The cluster line said '1 worker(s) per node' for --num-workers 0.
    assert "no loader workers (each node's main process reads between its steps): 1 node(s)" in printed.getvalue()
    assert "worker(s) per node" not in printed.getvalue()
    # With no workers the main process reads both the calibration and the epoch: the epoch counts its own opens only.
    (record,) = _records(tmp_path)
    (epoch,) = record["metrics"]["epochs_io"]
    assert (epoch["samples"], epoch["opens"], epoch["expected_opens"], epoch["processes"]) == (SAMPLES, 1, 1, 1), epoch
    assert events.count("decode") >= 3  # the warm-up batch and two timed ones at least
    last_decode = None
    for index, event in enumerate(events):
        if event == "decode":
            last_decode = index
        elif event == "clock" and last_decode is not None:
            assert "sync" in events[last_decode:index], events
            last_decode = None


def test_the_cost_model_adds_without_workers_and_overlaps_with_them():
    model = load_script(READ)
    args = dict(samples=1000, opens=1000, batch=100, sample_s=1e-3, step_s=0.05, open_wait_s=2e-3)
    alone = model.predict_here(workers=0, **args)
    assert alone["epoch_s"] == pytest.approx(1000 * 3e-3 + 10 * 0.05)
    two = model.predict_here(workers=2, **args)  # loader 1.5 s against training 0.5 s: the loader sets the pace
    assert two["bound"] == "loader" and two["epoch_s"] == pytest.approx(1.5 + 100 * 3e-3)
    fs = {"metadata_rtt_ms": 0.5, "metadata_ops_per_s": 1000.0, "stream_gb_per_s": 1.0, "total_gb_per_s": 10.0}
    wide = model.predict_cluster(samples=10_000, opens=10_000, stats=0, data_bytes=0, nodes=64, workers=4, batch=100,
                                 sample_s=0.0, step_s=0.0, fs=fs)
    # 20,000 round trips: 64 nodes x 4 workers would need 0.04 s, but the metadata servers serve 1,000 a second.
    assert wide["bound"] == "metadata" and wide["metadata_s"] == pytest.approx(20.0)
    # No workers: the main process reads between its steps, one reader per node; reading and training add up.
    one = dict(samples=1000, opens=0, stats=0, data_bytes=0, nodes=1, batch=100, sample_s=1e-3, step_s=0.05, fs=fs)
    main = model.predict_cluster(workers=0, **one)
    assert main["decode_s"] == model.predict_cluster(workers=1, **one)["decode_s"] == pytest.approx(1.0)
    assert main["epoch_s"] == pytest.approx(1.0 + 0.5) and model.predict_cluster(workers=1, **one)["epoch_s"] == 1.0


@pytest.mark.skipif(shutil.which("strace") is None, reason="Debian's strace is not installed (scripts/test.sh "
                                                               "installs it as root)")
def test_counted_opens_and_stats_agree_with_strace(data, tmp_path):
    """``strace -f -c`` over the data files only (``-P`` per file): every openat and stat-family call the run
    made on them, in the main process and its worker, against what the script counted (the epoch's and the
    cost model's calibration before it)."""
    files = sorted((data / "imagefolder" / "train").glob("*/*.jpg"))
    summary = tmp_path / "strace.txt"
    # --seccomp-bpf: only the traced calls stop the process, so Python's start costs little more than untraced.
    command = ["strace", "-f", "-c", "--seccomp-bpf", "-o", str(summary), "-e", "trace=open,openat,openat2,%stat",
               *[arg for path in files for arg in ("-P", str(path))], "--",
               str(Path(REPO / ".venv/bin/python") if (REPO / ".venv/bin/python").exists() else "python"),
               str(REPO / READ), "--format", "imagefolder", "--data-dir", str(data), "--results-dir",
               str(tmp_path / "r"), "--device", "cpu", "--num-workers", "1", "--read-only",
               "--calibration-samples", "16", "--batch-size", "16"]
    done = subprocess.run(command, env=script_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = {line.split()[-1]: int(line.split()[3] if len(line.split()) > 5 else line.split()[3])
             for line in summary.read_text().splitlines()
             if line.split() and line.split()[-1].isidentifier() and line.split()[0][0].isdigit()}
    (record,) = _records(tmp_path / "r")
    (epoch,) = record["metrics"]["epochs_io"]
    # A file per sample in the calibration too, its warm-up batch too.
    calibration_opens = 16 + record["metrics"]["cost"]["samples_timed"]
    assert calls.get("openat", 0) == epoch["opens"] + calibration_opens == SAMPLES + 32, summary.read_text()
    stat_calls = sum(n for name, n in calls.items() if "stat" in name)
    assert stat_calls == epoch["stats"] == 0, summary.read_text()


# -- 5. each sample once, over 2 ranks x 2 workers; 7. bad data ------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(data, tmp_path_factory) -> tuple[Path, dict[str, int]]:
    root = tmp_path_factory.mktemp("ranks")
    # One epoch each: a new order every epoch is shown on one rank (the resume test's unbroken run).
    common = ["--data-dir", str(data), "--device", "cpu", "--num-workers", "2", "--batch-size", "16", "--epochs", "1",
              "--verify-only"]
    plan = [{"name": policy, "script": SHARDS,
             "argv": [*common, "--shard-policy", policy, "--results-dir", str(root / policy),
                      "--ids-out", str(root / policy / "ids"), "--checkpoint", str(root / f"{policy}.pt")]}
            for policy in ("pad", "drop", "uneven")]
    return root, launch_plan(2, plan, root, "two")


def _ids(folder: Path, ranks: int = 2) -> list[list[list[int]]]:
    """[rank][epoch] -> the ids that rank read, in order."""
    return [[json.loads(line)["ids"] for line in (folder / f"ids-rank{rank}.jsonl").read_text().splitlines()]
            for rank in range(ranks)]


def _policy_run(two_ranks, policy: str) -> tuple[list[list[list[int]]], dict, dict]:
    """The two-rank run of one --shard-policy, which must have succeeded: the ids each rank read, its record
    and the plan it printed."""
    root, statuses = two_ranks
    assert statuses[policy] == 0
    (record,) = _records(root / policy)
    return _ids(root / policy / "ids"), record, record["config"]["plan"]


def test_pad_reads_every_sample_exactly_once_per_epoch_on_2_ranks_x_2_workers(two_ranks):
    root, _ = two_ranks
    ids, record, plan = _policy_run(two_ranks, "pad")
    assert (plan["slots"], plan["shards"], plan["samples"]) == (4, 6, SAMPLES)
    assert plan["slot_samples_min"] < plan["slot_samples_max"]  # the shards do not divide evenly
    assert len({len(ids[rank][0]) for rank in range(2)}) == 1  # as many on every rank (blanks too): equal steps
    for epoch, entry in enumerate(record["metrics"]["epochs_io"]):
        counts = Counter(i for rank in range(2) for i in ids[rank][epoch])
        blanks = counts.pop(-1, 0)
        assert counts == Counter(range(SAMPLES))  # each real sample once
        assert blanks == entry["plan"]["padded"] > 0
    assert record["metrics"]["exactly_once"] is True
    assert "every sample exactly once" in (root / "two-logs" / "pad.log").read_text()


def test_drop_leaves_out_what_the_smallest_slot_lacks_and_uneven_is_refused_on_two_ranks(two_ranks):
    root, statuses = two_ranks
    ids, record, plan = _policy_run(two_ranks, "drop")
    for epoch, entry in enumerate(record["metrics"]["epochs_io"]):
        counts = Counter(i for rank in range(2) for i in ids[rank][epoch])
        assert set(counts.values()) == {1} and -1 not in counts
        assert len(counts) == SAMPLES - entry["plan"]["dropped"] and entry["plan"]["dropped"] > 0
    assert plan == record["metrics"]["epochs_io"][0]["plan"]
    assert record["metrics"]["exactly_once"] is False
    assert statuses["uneven"] == 2
    log = (root / "two-logs" / "uneven.log").read_text()
    assert "error: --shard-policy uneven on 2 ranks" in log and not (root / "uneven").exists()


def test_uneven_on_one_rank_reads_each_sample_once_across_its_workers(data, tmp_path):
    with contextlib.redirect_stdout(io.StringIO()):
        assert run_main(SHARDS, ["--data-dir", str(data), "--device", "cpu", "--num-workers", "2", "--batch-size", "16",
                                 "--shard-policy", "uneven", "--verify-only", "--results-dir", str(tmp_path / "r"),
                                 "--ids-out", str(tmp_path / "ids"), "--checkpoint", str(tmp_path / "c.pt")]) == 0
    (epochs,) = _ids(tmp_path / "ids", ranks=1)
    assert Counter(epochs[0]) == Counter(range(SAMPLES))


@pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities of TorchVision:DeprecationWarning")
def test_a_pad_blank_has_weight_0_and_leaves_the_training_loss_as_the_real_samples_alone(data):
    """The runs above only read (--verify-only), so this is where padding is checked as training sees it: in
    one process, the pad stream of each of 2 ranks (one slot each: 6 shards split 3 and 3, 230 samples, so one
    slot gets 10 blanks) gives weight 0 to a blank (id -1) and 1 to each real sample, and ``weighted_loss`` of a
    batch that holds blanks is the mean loss over its real samples alone."""
    import torch
    import torch.nn.functional as F

    from labs.lab08_data_at_scale.lab08_shared import ShardStream

    weighted_loss = load_script(SHARDS).weighted_loss
    ids, weights = [], []
    for rank in range(2):
        stream = ShardStream(data / "shards", batch_size=16, rank=rank, world_size=2, policy="pad", seed=1)
        for _, _, extras in stream:
            ids += extras["ids"].tolist()
            weights += extras["weights"].tolist()
    assert Counter(i for i in ids if i >= 0) == Counter(range(SAMPLES)) and ids.count(-1) == 10
    assert weights == [0.0 if i < 0 else 1.0 for i in ids]
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 10), torch.tensor([3, 1, 4, 1, 5, 9])
    real = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])  # samples 1 and 4 are blanks
    expected = F.cross_entropy(logits[real.bool()], labels[real.bool()])
    assert not torch.isclose(expected, F.cross_entropy(logits, labels))  # the blanks would move a plain mean
    torch.testing.assert_close(weighted_loss(logits, labels, real), expected)


# -- 6. resume mid-epoch -----------------------------------------------------------------------------------


def test_a_run_stopped_mid_epoch_resumes_with_the_ids_an_unbroken_run_reads_next(data, tmp_path, monkeypatch,
                                                                                  capsys):
    """Three runs: unbroken; stopped by SIGUSR1 (as Slurm's --signal sends it) during step 21, in epoch 2; resumed.
    230 samples over 2 workers, padded to 2 x 120, 16 a batch: 16 steps an epoch, so the stop comes at epoch 2
    step 5 (0-based), after 5 of its batches. The loader alone (``--verify-only``): the weights' round trip
    through a checkpoint is TrainingRun's, tested with every training script."""
    import signal

    import common.train.meter
    from helpers import signalling_timer

    def run(name: str, *extra: str) -> int:
        return run_main(SHARDS, ["--data-dir", str(data), "--device", "cpu", "--num-workers", "2", "--batch-size", "16",
                                 "--epochs", "2", "--shuffle-buffer", "24", "--verify-only",
                                 "--results-dir", str(tmp_path / name),
                                 "--checkpoint", str(tmp_path / f"{name}.pt"), *extra])

    assert run("whole", "--ids-out", str(tmp_path / "whole-ids")) == 0
    monkeypatch.setattr(common.train.meter, "StepTimer", signalling_timer(common.train.meter.StepTimer, during_step=20))
    assert run("cut", "--ids-out", str(tmp_path / "cut-ids")) == 0
    monkeypatch.undo()
    out = capsys.readouterr().out
    assert "received SIGUSR1: saved" in out and "at epoch 2 step 5" in out, out[-2000:]
    assert not (tmp_path / "cut").exists()  # stopped before the end: no record
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    assert run("cut", "--resume", "--ids-out", str(tmp_path / "resumed-ids")) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out
    # The plan line is for the epoch the resumed run reads (it said 'in epoch 1', before 'resumed from ... epoch 2').
    plan_line = next(line for line in out.splitlines() if "--shard-policy pad:" in line)
    assert "weight-0 blank(s) in epoch 2 pad" in plan_line and out.index("resumed from") < out.index(plan_line), out
    # The ids read before the stop came with the checkpoint: the resumed epoch counts whole
    # (it said 'not exactly once').
    assert "epoch 2: 230 of 230 samples read, 0 more than once (every sample exactly once" in out, out[-2000:]
    assert [record["metrics"]["exactly_once"] for record in _records(tmp_path / "cut")] == [True]
    (whole,), (cut,), (resumed,) = (_ids(tmp_path / f"{name}-ids", 1) for name in ("whole", "cut", "resumed"))
    assert len(cut) == 2 and len(cut[1]) == 5 * 16 and len(resumed) == 1
    assert cut[0] == whole[0]
    assert whole[0] != whole[1] and Counter(whole[0]) == Counter(whole[1])  # the same samples, a new order each epoch
    assert cut[1] + resumed[0] == whole[1]  # exactly the ids an unbroken run read next, in its order


# -- 7. bad data -------------------------------------------------------------------------------------------


def _rewrite(shard: Path, change) -> None:
    """Rebuild a tar shard with ``change(members)`` applied: a broken file at its source (checksums match)."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    members = change(members)
    with tarfile.open(shard, "w") as tar:
        for member, payload in members:
            member.size = len(payload)
            tar.addfile(member, io.BytesIO(payload))


def _refresh_checksums(shards: Path) -> None:
    """What 01_make_dataset.py would have written for the shards as they are now."""
    import zlib

    table = json.loads((shards / "shards.json").read_text())
    rows = []
    for entry in table["shards"]:
        data = (shards / entry["name"]).read_bytes()
        entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
        with tarfile.open(shards / entry["name"]) as tar:
            for member in tar.getmembers():
                blob = data[member.offset_data:member.offset_data + member.size]
                rows.append({"id": int(member.name.split(".")[0]), "shard": entry["name"], "member": member.name,
                             "label": 0, "offset": member.offset_data, "size": member.size, "crc32": zlib.crc32(blob)})
    (shards / "shards.json").write_text(json.dumps(table))
    with open(shards / "manifest.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


@pytest.fixture(scope="module")
def damaged(data, tmp_path_factory) -> Path:
    """The shards with four kinds of damage, one per shard (0-3); shards 4 and 5 are whole. Shards 2 and 3 are
    broken at their source (their checksums match: read at the manifest's offsets), 0 and 1 after it (read with
    WebDataset's tar reader, their offsets no longer trusted)."""
    copy = tmp_path_factory.mktemp("damaged") / "shards"
    shutil.copytree(data / "shards", copy)
    _rewrite(copy / "shard-000002.tar", lambda ms: [(m, b"not a jpeg" if m.name == "000085.jpg" else p)
                                                   for m, p in ms])  # a corrupt JPEG at the source
    _rewrite(copy / "shard-000003.tar", lambda ms: [(m, p) for m, p in ms if m.name != "000130.cls"])  # missing
    _refresh_checksums(copy)
    manifest = _shard_rows(copy.parent)
    cut = next(row for row in manifest if row["member"] == "000020.jpg")  # truncated in sample 20 of 0-39
    shard0 = copy / "shard-000000.tar"
    shard0.write_bytes(shard0.read_bytes()[:int(cut["offset"]) + 100])
    flip = next(row for row in manifest if row["member"] == "000050.jpg")  # one byte of a member changed
    shard1 = bytearray((copy / "shard-000001.tar").read_bytes())
    shard1[int(flip["offset"]) + 100] ^= 0xFF
    (copy / "shard-000001.tar").write_bytes(bytes(shard1))
    return copy


def test_bad_data_fails_with_one_line_naming_the_shard_and_member_and_writes_nothing(damaged, tmp_path, capsys):
    status = run_main(SHARDS, ["--data-dir", str(damaged), "--device", "cpu", "--num-workers", "1", "--batch-size", "8",
                               "--epochs", "1", "--verify-only", "--shard-policy", "uneven", "--results-dir",
                               str(tmp_path / "r"), "--ids-out", str(tmp_path / "ids"),
                               "--checkpoint", str(tmp_path / "c.pt")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith("error: bad data: shard-0000") and (".jpg" in err or ".cls" in err), err
    assert any(f"shard-00000{i}.tar: {member}: " in err for i, member in ((0, "000020.jpg"), (1, "000050.jpg"),
                                                                        (2, "000085.jpg"), (3, "000130.cls"))), err
    assert not (tmp_path / "r").exists() and not (tmp_path / "ids").exists() and not (tmp_path / "c.pt").exists()


def test_bad_data_skipped_is_counted_and_named(damaged, tmp_path):
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert run_main(SHARDS, ["--data-dir", str(damaged), "--device", "cpu", "--num-workers", "2", "--batch-size",
                                 "8", "--epochs", "1", "--verify-only", "--shard-policy", "uneven", "--on-bad-sample",
                                 "skip", "--results-dir", str(tmp_path / "r"), "--ids-out", str(tmp_path / "ids"),
                                 "--checkpoint", str(tmp_path / "c.pt")]) == 0
    (record,) = _records(tmp_path / "r")
    bad = {(b["shard"], b["member"]): b["reason"] for b in record["metrics"]["bad_samples"]}
    assert bad[("shard-000001.tar", "000050.jpg")].startswith("checksum mismatch")
    assert bad[("shard-000002.tar", "000085.jpg")].startswith("corrupt JPEG")
    assert bad[("shard-000003.tar", "000130.cls")] == "missing member"
    truncated = [(member, reason) for (shard, member), reason in bad.items() if shard == "shard-000000.tar"]
    assert truncated == [("000020.jpg", truncated[0][1])] and truncated[0][1].startswith("truncated shard")
    cut = int(truncated[0][1].split("; ")[1].split()[0])  # "N sample(s) cut off from here"
    assert cut == 20  # samples 20-39 of shard 0
    (ids,) = _ids(tmp_path / "ids", 1)
    assert len(ids[0]) == SAMPLES - 3 - cut == len(set(ids[0]))
    assert record["metrics"]["skipped_samples"] == 3 + cut
    assert "skipped: shard-000002.tar: 000085.jpg: corrupt JPEG" in printed.getvalue()


def test_a_shard_cut_at_a_samples_first_member_keeps_the_whole_sample_before_the_cut(data):
    """Cut where sample 20's .cls begins, sample 19 (whole, before the cut) was lost too, counted nowhere: the
    tar reader's grouping held it until the next key, and the break came first. Skipped said 20, 21 were gone."""
    lab = load_script(f"{LAB}/lab08_shared.py")
    info = lab.read_shard_table(data / "shards")[0]
    cut = next(row for row in info.members if row["member"] == "000020.cls")
    shard = (data / "shards" / info.name).read_bytes()[:cut["offset"]]  # the header of 000020.cls, not its data
    good, bad = lab.check_shard(info, shard)
    assert [sample["__key__"] for sample in good] == [f"{i:06d}" for i in range(20)]
    assert [(b.member, b.samples) for b in bad] == [("000020.cls", SHARD_SIZE - 20)]


def test_a_shard_file_that_is_not_there_is_named_missing_not_truncated(data, tmp_path, capsys):
    """A deleted shard said 'truncated shard: 0 of N bytes' and named its first member."""
    shards = tmp_path / "shards"
    shutil.copytree(data / "shards", shards)
    (shards / "shard-000001.tar").unlink()
    assert run_main(SHARDS, ["--data-dir", str(shards), "--device", "cpu", "--num-workers", "0", "--batch-size", "8",
                             "--epochs", "1", "--verify-only", "--results-dir", str(tmp_path / "r"),
                             "--checkpoint", str(tmp_path / "c.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: bad data: shard-000001.tar: (the shard file): no such file in {shards}; its "
                          f"{SHARD_SIZE} sample(s) are missing") and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


# -- flags -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("script", "argv", "message"), [
    (READ, ["--metadata-latency", "-1"], "--metadata-latency: must be a number >= 0, got -1"),
    (SHARDS, ["--metadata-latency", "x"], "--metadata-latency: expected a number"),
    (READ, ["--format", "tfrecord"], "invalid choice"),
    (SHARDS, ["--shard-policy", "round-robin"], "invalid choice"),
    (MAKE, ["--quality", "101", "--data-dir", "/nonexistent/x"], "--quality: must be at most 100, got 101"),
    # Flags of the tar shards' reader, given with another format, were accepted and ignored.
    (READ, ["--format", "imagefolder", "--shuffle-buffer", "5"], "--shuffle-buffer: only with --format webdataset"),
    (READ, ["--format", "array", "--shard-reader", "webdataset"], "--shard-reader: only with --format webdataset"),
])
def test_a_bad_flag_is_one_error_line_and_exit_2(script, argv, message, tmp_path, capsys):
    assert run_main(script, [*argv, "--results-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "r").exists()


def test_making_the_data_set_checks_its_device_flag_as_every_script_does(tmp_path, capsys, monkeypatch):
    """--device cuda on a machine without a GPU was accepted (the images are made on the CPU) where 02 refuses it."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # any machine, a GPU node too
    assert run_main(MAKE, ["--dry-run", "--device", "cuda", "--data-dir", str(tmp_path / "data"),
                           "--results-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device cuda was requested but PyTorch sees no CUDA GPU") and err.count("\n") == 1
    assert sorted(tmp_path.iterdir()) == []


def test_a_folder_without_shards_is_one_line_before_any_set_up(tmp_path, capsys):
    assert run_main(SHARDS, ["--data-dir", str(tmp_path), "--device", "cpu", "--dry-run",
                             "--results-dir", str(tmp_path / "r")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "01_make_dataset.py" in err, (out, err)


def test_bad_data_in_02_points_to_what_02_can_do():
    """02 has no --on-bad-sample: its bad-data line offered that flag, which it then refused."""
    from common.errors import UserError
    from labs.lab08_data_at_scale.lab08_shared import check_batch

    for can_skip, hint in ((True, "(--on-bad-sample skip leaves"),
                           (False, "03_shards_exactly_once.py --on-bad-sample")):
        with pytest.raises(UserError, match=re.escape(hint)):
            check_batch({"error": "shard-000000.tar: 000001.jpg: corrupt JPEG"}, can_skip=can_skip)
    check_batch({"io": {}})  # a batch: nothing to say


def test_a_missing_data_set_says_how_to_make_one(tmp_path, capsys):
    assert run_main(READ, ["--data-dir", str(tmp_path / "none"), "--results-dir", str(tmp_path / "r")]) == 2
    assert "01_make_dataset.py" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities of TorchVision:DeprecationWarning")
def test_a_format_missing_from_the_data_set_is_named_with_the_command_that_adds_it(tmp_path, capsys):
    """A data set made with --formats webdataset: 02 --format imagefolder said 'make the data set', which exists.
    Now one line names the missing format and the command (01 writes a data set whole: --overwrite, the same
    images, the formats it has and the one asked for); that command runs, and the data set then holds both."""
    import shlex

    data = tmp_path / "data"
    with contextlib.redirect_stdout(io.StringIO()):
        assert run_main(MAKE, ["--samples", "20", "--shard-size", "10", "--quality", "80", "--seed", "7", "--formats",
                               "webdataset", "--data-dir", str(data), "--results-dir", str(tmp_path / "made")]) == 0
    assert run_main(READ, ["--format", "imagefolder", "--data-dir", str(data),
                           "--results-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: the data set in {data} has no imagefolder format (it holds webdataset)") \
        and err.count("\n") == 1 and "make the data set" not in err, err
    command = shlex.split(err.split(": ")[-1])
    assert command[:2] == ["python", MAKE] and not (tmp_path / "r").exists()
    args = load_script(MAKE).build_parser().parse_args(command[2:])
    assert (args.data_dir, args.overwrite, args.formats) == (data, True, ["imagefolder", "webdataset"])
    assert (args.samples, args.shard_size, args.quality, args.seed) == (20, 10, 80, 7)
    shards = (data / "shards" / "SHA256SUMS").read_text()
    with contextlib.redirect_stdout(io.StringIO()):
        assert run_main(MAKE, [*command[2:], "--results-dir", str(tmp_path / "made")]) == 0
    assert set(json.loads((data / "dataset.json").read_text())["formats"]) == {"imagefolder", "webdataset"}
    assert (data / "shards" / "SHA256SUMS").read_text() == shards  # the same images, byte for byte
    assert len(list((data / "imagefolder" / "train").glob("*/*.jpg"))) == 20
    # 03 reads DATA/shards: a data set without them says the same.
    assert run_main(MAKE, ["--samples", "20", "--formats", "array", "--data-dir", str(tmp_path / "arr"),
                           "--results-dir", str(tmp_path / "made")]) == 0
    capsys.readouterr()
    assert run_main(SHARDS, ["--data-dir", str(tmp_path / "arr"), "--device", "cpu", "--results-dir",
                             str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "has no webdataset format (it holds array)" in err and "--formats webdataset array" in err, err


def test_the_checkpoint_help_names_the_file_a_run_without_checkpoint_saves_to(tmp_path):
    """03 checkpoints without --checkpoint (a distributed script); its --help said 'nothing is saved'."""
    from common.train.flags import settle

    module = load_script(SHARDS)
    parser = module.build_parser()
    help_text = " ".join(parser.format_help().split())
    assert "RESULTS_DIR/checkpoints/<script name>.pt" in help_text and "nothing is saved" not in help_text
    args = parser.parse_args(["--results-dir", str(tmp_path / "r")])
    assert settle(args, module.SCRIPT, distributed=True) == tmp_path / "r" / "checkpoints" / "03_shards_exactly_once.pt"


# -- run_lab.sh ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device, gpus, ranks", [("cpu", 0, 2), ("cuda", 1, 1), ("auto", 4, 2)])
def test_run_lab_runs_every_step_with_flags_the_scripts_accept_and_ends_with_the_report(tmp_path, device, gpus, ranks):
    """``run_lab.sh`` with a stand-in for python that writes down each command (and answers how many GPUs it sees):
    every step in order, each script's own parser accepts its flags, one scratch data set for all of them (removed
    at the end), two ranks for the exactly-once run but one on a machine with one GPU, and the last line is the
    report's path. The steps themselves run for real in the tests above; a whole run_lab.sh is 15 processes that
    each import torch (about a minute of CPU), which the lab's share of the suite cannot afford."""
    calls = tmp_path / "calls"
    stand_in = tmp_path / "python"
    stand_in.write_text(f'#!/bin/sh\nfor arg in "$@"; do printf "%s\\n" "$arg"; done >> {calls}\n'
                        f'echo "--end--" >> {calls}\n'
                        f'case "$2" in *device_count*) echo {gpus};; esac\n'
                        # compare_results.py ends with "report: PATH" (tests/test_report.py): the stand-in does too
                        'case "$1" in *compare_results.py) while [ $# -gt 1 ]; do '
                        '[ "$1" = --output-report ] && echo "report: $2"; shift; done;; esac\n')
    stand_in.chmod(0o755)
    done = subprocess.run(["bash", str(REPO / LAB / "run_lab.sh"), str(tmp_path / "results")], cwd=tmp_path,
                          env=script_env(PYTHON=str(stand_in), TMPDIR=str(tmp_path), LAB08_DEVICE=device),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == f"report: {tmp_path / 'results' / 'comparison_report.html'}"
    assert done.stdout.count("report: ") == 1, done.stdout  # it was printed twice: by compare_results.py and again
    check, *commands = [command.strip("\n").split("\n") for command in calls.read_text().split("--end--\n") if command]
    assert check[0] == "-c"  # scripts/require_python.sh asks the interpreter first (tests/test_environments.py)
    if device != "cpu":  # then how many GPUs there are
        assert commands.pop(0)[0] == "-c"
    scripts = [next(Path(arg).name for arg in command if arg.endswith(".py")) for command in commands]
    assert scripts == ["01_make_dataset.py", *["02_read_formats.py"] * 12, "03_shards_exactly_once.py",
                       "compare_results.py"]
    parsed = []
    for command in commands[:-1]:
        at = next(i for i, arg in enumerate(command) if arg.endswith(".py"))
        parsed.append(load_script(f"{LAB}/{Path(command[at]).name}").build_parser().parse_args(command[at + 1:]))
    reads = {(a.format, a.read_only, a.metadata_latency) for a in parsed[1:13]}
    assert reads == {(f, r, ms) for f in ("imagefolder", "webdataset", "array")
                     for r in (True, False) for ms in (0, 1.0)}
    scratch = parsed[0].data_dir.parent  # made by run_lab.sh under TMPDIR, removed when it ends
    assert {a.data_dir for a in parsed} == {scratch / "lab08"} and scratch.parent == tmp_path and not scratch.exists()
    assert {str(a.results_dir) for a in parsed} == {str(tmp_path / "results")}
    assert commands[13][:4] == ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    assert {a.device for a in parsed[1:]} == {device}  # the reads and the exactly-once run
    assert commands[14][-4:] == ["--results-dir", str(tmp_path / "results"), "--output-report",
                                 str(tmp_path / "results" / "comparison_report.html")]


def test_resuming_on_a_data_set_made_again_with_other_settings_is_one_line(tmp_path, capsys):
    """A checkpoint's loader position belongs to its shards: after the data set is remade with other sizes,
    --resume stops with one error line naming the shards, not an IndexError deep in the loader."""
    def make(samples: int, shard: int) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            assert run_main(MAKE, ["--samples", str(samples), "--shard-size", str(shard), "--formats", "webdataset",
                                   "--overwrite", "--data-dir", str(tmp_path / "d"),
                                   "--results-dir", str(tmp_path / "m")]) == 0

    def shards(*extra: str) -> int:
        return run_main(SHARDS, ["--data-dir", str(tmp_path / "d"), "--device", "cpu", "--num-workers", "0",
                                 "--batch-size", "4", "--epochs", "2", "--verify-only", "--results-dir",
                                 str(tmp_path / "r"), "--checkpoint", str(tmp_path / "c.pt"), *extra])
    make(30, 7)
    assert shards("--step-budget", "1") == 0
    make(12, 5)
    capsys.readouterr()
    assert shards("--resume") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert "other settings (the shard set '30 samples in 5 shards (sha256 " in err, err  # named, not a Python key
