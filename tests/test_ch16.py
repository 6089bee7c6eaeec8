"""Chapter 16 (GPU acceleration): memory, checkpointing, accumulation, profiler, CPU vs GPU; real runs, tiny sizes.

Every script is called through ``main(argv)`` in this process (torch and the profiler start once).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import load_script, run_fresh, run_main

CHAPTER = "chapters/ch16_gpu_distributed"


def only_record(folder: Path) -> dict:
    (path,) = sorted(folder.glob("ch16_*.json"))
    return json.loads(path.read_text())


def run_memory(tmp_path: Path, device: str, monkeypatch) -> tuple[dict, list[str]]:
    """Run memory_management.py; also returns the order of the model's forward passes and part 1's measuring."""
    memory = load_script(f"{CHAPTER}/memory_management.py")
    calls: list[str] = []

    class CountingNet(memory.DeepNet):
        def forward(self, x):
            calls.append("forward")
            return super().forward(x)

    measure = memory.memory_by_phase
    monkeypatch.setattr(memory, "DeepNet", CountingNet)
    monkeypatch.setattr(memory, "memory_by_phase", lambda *args: (calls.append("measure"), measure(*args))[1])
    status = run_main(f"{CHAPTER}/memory_management.py", ["--device", device, "--depth", "6", "--width", "128",
                                                           "--batch-size", "64", "--repeats", "1",
                                                           "--results-dir", str(tmp_path)])
    assert status == 0
    return only_record(tmp_path), calls


def test_memory_management_measures_phases_checkpointing_and_accumulation(tmp_path, capsys, monkeypatch):
    record, calls = run_memory(tmp_path, "cpu", monkeypatch)
    out = capsys.readouterr().out
    assert "torch.profiler" in out and "process peak RSS" in out  # the CPU run says where its numbers come from
    # A forward (and backward) pass ran before part 1 measured: on a GPU the first matmul allocates
    # cuBLAS's workspace, which would otherwise count as activations.
    assert calls[0] == "forward" and calls.index("measure") > 0
    assert "torch.cuda.memory_summary()" in out  # named, and why a CPU run has none to show
    metrics = record["metrics"]

    phases = {row["phase"]: row for row in metrics["phases"]}
    assert list(phases) == ["forward", "backward", "optimizer.step", "zero_grad"]
    parameters = (6 * (128 * 128 + 128 + 2 * 128) + 128 * 10 + 10) * 4
    # Activations live after the forward pass; Adam's first step adds two state tensors per parameter;
    # zero_grad(set_to_none=True) frees the gradients again.
    assert phases["forward"]["allocated_change_bytes"] > 64 * 128 * 4 * 6
    assert phases["optimizer.step"]["allocated_change_bytes"] - phases["backward"]["allocated_change_bytes"] \
        == pytest.approx(2 * parameters, rel=0.05)
    assert phases["optimizer.step"]["allocated_change_bytes"] - phases["zero_grad"]["allocated_change_bytes"] \
        == pytest.approx(parameters, rel=0.05)

    checkpointing = metrics["checkpointing"]
    assert checkpointing["checkpointed_peak_bytes"] < checkpointing["plain_peak_bytes"]
    assert checkpointing["checkpointed_saved_bytes"] < checkpointing["plain_saved_bytes"]
    assert metrics["checkpoint_peak_saving"] > 0.2

    accumulation = metrics["accumulation"]
    assert metrics["accumulation_match"] is True
    assert accumulation["equal"]["micro_batches"] == [16, 16, 16, 16]
    assert accumulation["equal"]["seed_loss_over_k"]["match"] is True  # equal sizes: loss / k is right
    assert len(set(accumulation["unequal"]["micro_batches"])) > 1
    assert accumulation["unequal"]["weighted"]["match"] is True
    assert accumulation["unequal"]["seed_loss_over_k"]["match"] is False  # unequal sizes: loss / k is not


def test_accumulation_check_would_catch_a_wrong_gradient():
    import torch

    memory, shared = load_script(f"{CHAPTER}/memory_management.py"), load_script(f"{CHAPTER}/ch16_shared.py")
    model = memory.DeepNet(32, 2)
    data, target = torch.randn(12, 32), torch.randint(0, 10, (12,))
    full = memory.gradients(model, [(data, target, 1.0)])
    assert shared.compare(full, [g.clone() for g in full])["match"] is True
    skipped_half = memory.gradients(model, [(data[:6], target[:6], 0.5)])
    assert shared.compare(full, skipped_half)["match"] is False


@pytest.mark.parametrize("flags", [["--batch-size", "2", "--accumulation-steps", "4"],
                                   ["--batch-size", "8", "--accumulation-steps", "16", "--dry-run"],
                                   ["--accumulation-steps", "1"]])
def test_memory_management_refuses_accumulation_steps_it_cannot_split_the_batch_into(tmp_path, capsys, flags):
    """More micro-batches than samples made empty ones (sizes 1/1/0/0, printed as an equal split); one micro-batch
    is the batch itself: one error line, exit 2, before anything runs or is written."""
    assert run_main(f"{CHAPTER}/memory_management.py", [*flags, "--results-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --accumulation-steps ") and "\n" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("batch, steps", [(10, 4), (12, 2)])
def test_accumulation_rows_are_equal_and_unequal_splits_as_labelled(tmp_path, batch, steps):
    """A batch that does not split evenly (10 into 4) was printed as "equal micro-batches" 3/3/2/2, and with 2
    micro-batches the "unequal" batch split evenly (14 into 7/7), so the notes' loss / k showed as right there."""
    status = run_main(f"{CHAPTER}/memory_management.py", ["--device", "cpu", "--depth", "2", "--width", "16",
                                                           "--batch-size", str(batch), "--accumulation-steps",
                                                           str(steps), "--repeats", "1", "--results-dir",
                                                           str(tmp_path)])
    assert status == 0
    accumulation = only_record(tmp_path)["metrics"]["accumulation"]
    assert len(set(accumulation["equal"]["micro_batches"])) == 1
    assert len(accumulation["equal"]["micro_batches"]) == len(accumulation["unequal"]["micro_batches"]) == steps
    assert len(set(accumulation["unequal"]["micro_batches"])) == 2
    assert accumulation["unequal"]["seed_loss_over_k"]["match"] is False


def test_checkpointing_that_raises_the_peak_does_not_say_it_saves_a_negative_share(capsys):
    shared = load_script(f"{CHAPTER}/ch16_shared.py")
    ckpt = {"plain_peak_bytes": 288, "checkpointed_peak_bytes": 10_160, "plain_saved_bytes": 148,
            "checkpointed_saved_bytes": 116, "plain_time_s": 0.009, "checkpointed_time_s": 0.017,
            "peak_saving": 1 - 10_160 / 288, "time_ratio": 1.89}  # --depth 1 --width 1 --batch-size 2, measured
    shared.print_checkpointing(ckpt)
    out = capsys.readouterr().out
    assert "saves -" not in out and "raises the peak 35.28x" in out


def test_checkpointing_cost_says_it_is_the_pairs_ratio_not_the_medians_ratio(capsys):
    """On a loaded machine the medians of the table can say checkpointing is faster while the pairs' ratio says it
    costs more (seen: 797.5 ms plain, 478.9 ms checkpointed, "costs 1.26x"): the line says which ratio it is."""
    shared = load_script(f"{CHAPTER}/ch16_shared.py")
    ckpt = {"plain_peak_bytes": 25_800_000, "checkpointed_peak_bytes": 10_070_000, "plain_saved_bytes": 25_690_000,
            "checkpointed_saved_bytes": 8_910_000, "plain_time_s": 0.7975, "checkpointed_time_s": 0.4789,
            "peak_saving": 0.61, "time_ratio": 1.26}
    shared.print_checkpointing(ckpt)
    line = next(line for line in capsys.readouterr().out.splitlines() if "costs" in line)
    assert "costs 1.26x the time (median of the alternated pairs' ratios" in line


def test_checkpointing_peaks_are_measured_after_each_variant_has_run_once(monkeypatch):
    """What a variant allocates once per process (on a GPU, the workspace of the thread that recomputes
    checkpointed blocks) lands in an unmeasured pass of that same variant, not in its measured peak."""
    import torch

    memory = load_script(f"{CHAPTER}/memory_management.py")
    model = memory.DeepNet(16, 2)
    passes: list[tuple[str, bool]] = []
    forward = model.forward
    model.forward = lambda x: (passes.append(("pass", model.checkpoint_blocks)), forward(x))[1]
    measure = memory.peak_above_start

    def measured(model, *args):
        passes.append(("measured", model.checkpoint_blocks))
        return measure(model, *args)

    monkeypatch.setattr(memory, "peak_above_start", measured)
    data, target = torch.randn(8, 16), torch.randint(0, 10, (8,))
    memory.checkpointing_comparison(model, data, target, torch.device("cpu"), repeats=1)
    for checkpointed in (False, True):
        first_measured = passes.index(("measured", checkpointed))
        assert ("pass", checkpointed) in passes[:first_measured], (checkpointed, passes)


@pytest.mark.gpu
def test_memory_management_on_a_gpu_uses_the_cuda_allocator(tmp_path):
    """In a fresh process, as a user runs it, at a size where activations outweigh any one-time workspace
    (8 blocks of 1024 features, batch 256: about 1 MiB per activation tensor)."""
    run_fresh(f"{CHAPTER}/memory_management.py", ["--device", "cuda", "--depth", "8", "--width", "1024",
                                                   "--batch-size", "256", "--repeats", "2",
                                                   "--results-dir", str(tmp_path)])
    record = only_record(tmp_path)
    assert record["metrics"]["phases"][0]["source"] == "cuda_memory_allocated"
    checkpointing = record["metrics"]["checkpointing"]
    assert checkpointing["checkpointed_peak_bytes"] < checkpointing["plain_peak_bytes"]
    assert checkpointing["checkpointed_saved_bytes"] < checkpointing["plain_saved_bytes"]
    assert record["metrics"]["checkpoint_peak_saving"] > 0.3
    assert record["metrics"]["accumulation_match"] is True


def test_profiling_exports_a_valid_trace_with_events(tmp_path, capsys, monkeypatch):
    from common.measure.timing import Heartbeat

    monkeypatch.setattr(Heartbeat, "EVERY_S", 0.0)  # a line at every iteration, as a slow device gets every 10 s
    trace = tmp_path / "trace.json"
    status = run_main(f"{CHAPTER}/profiling.py", ["--device", "cpu", "--model", "mnist_cnn", "--batch-size", "4",
                                                  "--repeats", "2", "--trace", str(trace),
                                                  "--results-dir", str(tmp_path)])
    assert status == 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(event.get("name") == "model_training" for event in events)
    assert sum(str(event.get("name", "")).startswith("aten::") for event in events) > 10
    out = capsys.readouterr().out
    assert "Self CPU" in out
    assert re.findall(r"^  iterations profiled: (\d) of 2 \(\d+ s\)$", out, re.M) == ["1", "2"]
    record = only_record(tmp_path)
    assert record["metrics"]["trace_events"] == len(events) and record["metrics"]["top_operators"]
    assert not list(tmp_path.glob(".*.tmp"))


def test_profiling_run_twice_into_one_folder_keeps_each_record_s_own_trace(tmp_path, capsys):
    """Two runs (1, then 2 iterations) into one folder: the second replaced ch16_profile_trace.json, so the first
    record's trace_file named the second run's trace."""
    for repeats in ("1", "2"):
        assert run_main(f"{CHAPTER}/profiling.py", ["--device", "cpu", "--model", "mnist_cnn", "--batch-size", "2",
                                                    "--repeats", repeats, "--results-dir", str(tmp_path)]) == 0
    runs = [json.loads(path.read_text()) for path in tmp_path.glob("ch16_torch-profiler_*.json")]
    assert sorted(run["metrics"]["iterations"] for run in runs) == [1, 2]
    for run in runs:
        events = json.loads(Path(run["metrics"]["trace_file"]).read_text())["traceEvents"]
        assert run["metrics"]["trace_events"] == len(events)


def test_profiling_table_and_record_list_the_same_top_operators(tmp_path, capsys):
    """The record's top operators (and its sorted_by) are the table's rows, not another ranking."""
    status = run_main(f"{CHAPTER}/profiling.py", ["--device", "cpu", "--model", "mnist_cnn", "--batch-size", "4",
                                                  "--repeats", "1", "--row-limit", "5", "--trace",
                                                  str(tmp_path / "t" / "trace.json"), "--results-dir", str(tmp_path)])
    assert status == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("Name"))
    table = [line.split()[0] for line in lines[header + 2:header + 7]]
    metrics = only_record(tmp_path)["metrics"]
    assert table == [row["name"] for row in metrics["top_operators"]]
    assert metrics["sorted_by"] == "self_cpu_time_total"


def test_profiling_trace_named_gz_is_gzip_compressed(tmp_path):
    """torch's export_chrome_trace compresses a .gz path; the script's own --trace t.json.gz must too."""
    import gzip

    trace = tmp_path / "t.json.gz"
    status = run_main(f"{CHAPTER}/profiling.py", ["--device", "cpu", "--model", "mnist_cnn", "--batch-size", "2",
                                                  "--repeats", "1", "--trace", str(trace), "--results-dir",
                                                  str(tmp_path / "r")])
    assert status == 0
    assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]


def test_benchmark_times_the_cpu_and_says_when_there_is_no_gpu(tmp_path, capsys, monkeypatch):
    import torch

    from common.measure.timing import Heartbeat

    monkeypatch.setattr(Heartbeat, "EVERY_S", 0.0)
    status = run_main(f"{CHAPTER}/benchmark_cpu_vs_gpu.py", ["--repeats", "3", "--warmup", "1",
                                                             "--results-dir", str(tmp_path)])
    assert status == 0
    out = capsys.readouterr().out
    records = {json.loads(p.read_text())["method"]: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    cpu = records["train-cpu"]["metrics"]["step_time"]
    assert cpu["steps_timed"] == 3 and cpu["warmup_steps"] == 1 and cpu["median_s"] > 0
    assert re.findall(r"^  cpu steps: (\d) of 4 ", out, re.M) == ["1", "2", "3", "4"]  # warm-up included
    if torch.cuda.is_available():
        assert "speed-up of the GPU over the CPU" in out and "train-cuda" in records
    else:
        assert "nothing to compare" in out and set(records) == {"train-cpu"}


def test_benchmark_with_device_cpu_does_not_say_no_gpu_is_visible(tmp_path, capsys):
    """--device cpu on a GPU node times the CPU only: that is what it asked for, not a missing GPU, whatever
    this machine has (on a GPU node the old line said "no CUDA GPU visible" with one visible)."""
    status = run_main(f"{CHAPTER}/benchmark_cpu_vs_gpu.py", ["--device", "cpu", "--repeats", "2", "--warmup", "0",
                                                             "--batch-size", "8", "--results-dir", str(tmp_path)])
    assert status == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU visible" not in out and "--device cpu: the CPU only, nothing to compare" in out


def test_benchmark_with_cuda_on_a_cpu_machine_is_a_one_line_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert run_main(f"{CHAPTER}/benchmark_cpu_vs_gpu.py", ["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --device cuda") and "\n" not in err


@pytest.mark.parametrize("model, size, said", [
    ("vit_b_16", 32, "vit_b_16 cannot run on 32x32 images: Wrong image height! Expected 224 but got 32!"),
    ("inception_v3", 32, "inception_v3 cannot run on 32x32 images: Calculated padded input size per channel")])
def test_benchmark_of_a_model_that_cannot_take_the_image_size_is_one_line(tmp_path, capsys, model, size, said):
    """A zoo model that cannot take --image-size (the default 32 included) ended in the model's own traceback
    (vit_b_16's AssertionError, inception_v3's RuntimeError); it is one line naming the model, before any step."""
    assert run_main(f"{CHAPTER}/benchmark_cpu_vs_gpu.py", ["--dry-run", "--model", model, "--image-size", str(size),
                                                           "--results-dir", str(tmp_path / "r")]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: {said}") and captured.err.count("\n") == 1, captured.err
    assert "steps per device" not in captured.out and not (tmp_path / "r").exists()


def test_benchmark_trains_a_model_with_auxiliary_outputs(tmp_path, capsys):
    """googlenet (and inception_v3) return their auxiliary classifiers' outputs too while training: the step's
    cross_entropy got GoogLeNetOutputs and ended in a TypeError traceback; it takes the main logits now."""
    assert run_main(f"{CHAPTER}/benchmark_cpu_vs_gpu.py", ["--dry-run", "--device", "cpu", "--model", "googlenet",
                                                           "--batch-size", "2", "--results-dir", str(tmp_path)]) == 0
    record = only_record(tmp_path)
    assert record["config"]["model"] == "googlenet" and record["metrics"]["step_time"]["median_s"] > 0


def test_efficient_loading_prints_each_loader_setting_as_soon_as_it_is_measured(tmp_path, capsys, monkeypatch):
    """Part 3 said nothing until every setting was measured (minutes with many workers on a loaded machine)."""
    from common.data import pipelines

    printed_before, make_loader = [], pipelines.make_loader

    def recording(*args, **kwargs):  # when a setting's loader is made, count the rows printed so far
        printed_before.append(capsys.readouterr().out.count("samples/s in epoch 2)"))
        return make_loader(*args, **kwargs)

    monkeypatch.setattr(pipelines, "make_loader", recording)
    assert run_main(f"{CHAPTER}/efficient_loading.py", ["--device", "cpu", "--dry-run", "--num-workers", "0",
                                                        "--batch-size", "512", "--results-dir", str(tmp_path)]) == 0
    assert printed_before == [0, 1]  # the first setting's line was out before the second setting started


@pytest.mark.parametrize("workers", [1, 0])
def test_efficient_loading_measures_threads_and_loader_options(tmp_path, capsys, workers):
    """With --num-workers 0 no persistent_workers row runs, and the table said to compare it all the same."""
    status = run_main(f"{CHAPTER}/efficient_loading.py", ["--device", "cpu", "--dry-run", "--num-workers",
                                                          str(workers), "--batch-size", "128", "--results-dir",
                                                          str(tmp_path)])
    assert status == 0
    metrics = only_record(tmp_path)["metrics"]
    assert metrics["thread_scaling"][0]["threads"] == 1 and metrics["thread_scaling"][0]["median_s"] > 0
    options = metrics["loader_options"]
    assert [row["num_workers"] for row in options] == [0, 1, 1][:2 + workers]
    assert all(row["epoch2_s"] > 0 for row in options)
    assert [row.get("persistent_workers", False) for row in options] == [False, False, True][:2 + workers]
    out = capsys.readouterr().out
    assert out.count("samples/s in epoch 2)") == len(options)
    assert ("unless persistent_workers=True: compare the epoch-2 column" in out) is bool(workers)
    assert metrics["cudnn_benchmark"] == []  # CPU: nothing to tune, nothing recorded


def test_efficient_loading_refuses_more_workers_than_the_cpus_can_run_in_one_line(tmp_path, capsys):
    """--num-workers 1000 was taken, and part 3 then started a thousand DataLoader processes; the parser refuses more
    than common.cli.WORKERS_PER_CPU per CPU of this process, saying the number and the limit (the rule every script's
    --num-workers shares: tests/test_script_paths.py)."""
    from common.runtime.cpus import usable_cpus

    parser = load_script(f"{CHAPTER}/efficient_loading.py").build_parser()
    with pytest.raises(SystemExit) as refused:  # parsed only: the old parser's run would start the thousand
        parser.parse_args(["--num-workers", "1000"])
    assert refused.value.code == 2
    capsys.readouterr()
    limit = 4 * usable_cpus()
    assert parser.parse_args(["--num-workers", str(limit)]).num_workers == limit
    assert run_main(f"{CHAPTER}/efficient_loading.py", ["--num-workers", "1000",
                                                        "--results-dir", str(tmp_path / "r")]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and f"must be at most {limit} (4 per CPU; this process may use " \
        f"{usable_cpus()}), got 1000" in captured.err, captured.err
    assert captured.out == "" and not (tmp_path / "r").exists()


@pytest.mark.parametrize("over", [1, 0])
def test_efficient_loading_refuses_a_batch_larger_than_the_digits_set_before_allocating(tmp_path, capsys, monkeypatch,
                                                                                       over):
    """--batch-size 100000 went on to part 1, whose random batch of that size took tens of GiB (OOM-killed on a
    24 GiB machine), and part 3's batches held the 1,438 digits only; a batch larger than the set part 3 loads is one
    line and exit 2 before any part runs. The whole set as one batch still runs (up to part 1, stubbed here)."""
    from common.data import pipelines

    script = load_script(f"{CHAPTER}/efficient_loading.py")

    class PartOneStarted(Exception):
        pass

    def part_one(*args):  # the old script went on to allocate here: stop before it can
        raise PartOneStarted

    monkeypatch.setattr(script, "thread_scaling", part_one)
    size = len(pipelines.load_uint8("digits", ".")[0])
    argv = ["--device", "cpu", "--batch-size", str(size + over), "--results-dir", str(tmp_path / "r")]
    if not over:
        with pytest.raises(PartOneStarted):
            script.main(argv)
        return
    assert run_main(f"{CHAPTER}/efficient_loading.py", argv) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: --batch-size {size + 1} is larger than the digits training set that part 3 loads " \
                           f"({size} samples); every part takes the same batch: give at most {size}\n"
    assert captured.out == "" and not (tmp_path / "r").exists()
