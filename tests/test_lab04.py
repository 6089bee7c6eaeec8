"""Lab-04 acceptance: DDP against FSDP2, memory per rank, DCP checkpoints that reshard (real runs on CPU, Gloo).

The distributed runs share two launches (``tests/lab04_worker.py``): one of 4 processes, then one of
2 that resumes what the 4 saved; the resume on 1 process runs inside pytest. Tolerances:

- Losses step by step and final losses: ``RTOL = 1e-5`` relative. DDP all-reduces whole gradients,
  FSDP2 reduce-scatters shards, and a resumed run on fewer ranks adds its micro-batches in another
  order: float32 sums in another order, about 1e-7 relative each; measured differences here are
  below 1e-6 after 20 AdamW steps.
- Parameters: for every tensor, ``||a - b|| <= RTOL * ||b||`` (the relative error of the tensor as a
  whole; a single element near zero has no meaningful relative error of its own, and AdamW, which
  divides each gradient by its own running scale, turns rounding in a near-zero gradient into an
  update of up to the learning rate).

Each comparison has a control showing the tolerance is far below what a wrong result would move:
the loss changes by more than 1,000 x the tolerance over the run, and the parameters move by more
than that between the checkpoint a resume starts from and the end.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest

from helpers import REPO, launch_plan, load_script, run_fresh, run_main

LAB = "labs/lab04_sharded_training"
BUDGET = f"{LAB}/01_memory_budget.py"
TRAIN = f"{LAB}/02_sharded_training.py"
LARGEST = f"{LAB}/03_largest_model.py"

RTOL = 1e-5
MODEL = ["--device", "cpu", "--layers", "4", "--width", "32", "--heads", "4", "--context", "32"]
# 16 sequences per optimiser step whatever the world size (4 x 4, 2 x 4 x 2 micro-batches, 1 x 4 x 4);
# 2 epochs of 10 steps: 20 optimiser steps, each epoch in a new order.
TINY = [*MODEL, "--global-batch-size", "16", "--batch-size", "4", "--epochs", "2", "--max-steps", "10",
        "--eval-steps", "1", "--lr", "3e-3", "--seed", "3", "--warmup-steps", "1", "--log-interval", "100"]
MEMORY = [*MODEL, "--batch-size", "2"]


def _readme_command(script: str) -> list[str]:
    """The arguments of the README's CPU command for ``script`` (its step-by-step block), as typed."""
    import shlex

    text = (REPO / LAB / "README.md").read_text().replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if f"{LAB}/{script} --device cpu" in line]
    words = shlex.split(line)
    return words[words.index(f"{LAB}/{script}") + 1:]


# The README's command: depth doubles from 2 blocks; with 4 MiB per rank DDP fits 2 blocks of width 64,
# FSDP2 on 2 ranks 4, and FSDP2 with activation checkpointing more.
LARGEST_ARGS = _readme_command("03_largest_model.py")
STEPS = 20


def _train(name: str, root: Path, *extra: str, strategy: str = "fsdp") -> list[str]:
    return [*TINY, "--strategy", strategy, "--results-dir", str(root / name / "results"),
            "--checkpoint-dir", str(root / name / "ckpt"), *extra]


def _saved_at_end_of_epoch_1(source: Path, target: Path) -> None:
    """A copy of a run's checkpoint folder as it stood after epoch 1 (the newer save left out)."""
    folders = sorted(p for p in source.iterdir() if p.name.startswith("ckpt-"))
    assert [p.name.split("-", 2)[2] for p in folders] == ["epoch2-step0", "epoch3-step0"], folders
    target.mkdir(parents=True)
    shutil.copytree(folders[0], target / folders[0].name)


@pytest.fixture(scope="module", autouse=True)
def _launch_variables_restored():
    """The runs inside pytest start one-process groups, and ``init_distributed`` exports torchrun's
    variables (RANK, MASTER_PORT, ...) for them; later test files must not think they run under torchrun."""
    import os

    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {name: os.environ.get(name) for name in names}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run the tests read, made once: 4 ranks, then 2 ranks, then 1 rank inside pytest."""
    root = tmp_path_factory.mktemp("lab04")
    statuses = launch_plan(4, [
        {"name": "ddp4", "script": TRAIN, "argv": _train("ddp4", root, strategy="ddp")},
        {"name": "fsdp4", "script": TRAIN, "argv": _train("fsdp4", root)},
        {"name": "memory4", "script": BUDGET, "argv": [*MEMORY, "--results-dir", str(root / "memory4")]},
    ], root, "four")
    for name in ("resume2", "resume1", "wrong_shape", "epoch1"):
        _saved_at_end_of_epoch_1(root / "fsdp4" / "ckpt", root / name / "ckpt")
    statuses |= launch_plan(2, [
        {"name": "ddp2", "script": TRAIN, "argv": _train("ddp2", root, strategy="ddp")},
        {"name": "fsdp2", "script": TRAIN, "argv": _train("fsdp2", root)},
        {"name": "resume2", "script": TRAIN, "argv": _train("resume2", root, "--resume")},
        # A pre-emption signal while step 13 runs: epoch 2 (10 steps each), so it stops before step 4.
        {"name": "preempted", "script": TRAIN, "argv": _train("preempted", root, "--async-checkpoint"),
         "signal_during_step": 13},
        {"name": "preempted_resumed", "script": TRAIN,
         "argv": [*_train("preempted_resumed", root, "--async-checkpoint", "--resume"),
                  "--checkpoint-dir", str(root / "preempted" / "ckpt")]},
        {"name": "memory2", "script": BUDGET, "argv": [*MEMORY, "--results-dir", str(root / "memory2")]},
        {"name": "largest2", "script": LARGEST, "argv": [*LARGEST_ARGS, "--results-dir", str(root / "largest2")]},
        {"name": "too_few_layers", "script": TRAIN, "argv": _train("too_few_layers", root, "--layers", "1")},
    ], root, "two")
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        statuses["resume1"] = run_main(TRAIN, _train("resume1", root, "--resume"))
    logs = {path.stem: path.read_text() for path in root.glob("*-logs/*.log")}
    logs["resume1"] = output.getvalue()
    return {"root": root, "statuses": statuses, "logs": logs}


def _record(folder: Path) -> dict:
    (path,) = sorted(folder.glob("*.json"))
    return json.loads(path.read_text())


def _training(runs, name: str) -> dict:
    assert runs["statuses"][name] == 0, runs["logs"].get(name, "")[-3000:]
    return _record(runs["root"] / name / "results")


def _final_parameters(folder: Path) -> dict:
    """The model tensors of the newest complete DCP checkpoint in ``folder``, read without any process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from common.checkpoint.sharded import complete_checkpoints

    newest = complete_checkpoints(folder)[-1]
    target = folder.parent / f"{newest.name}.pt"
    dcp_to_torch_save(newest, target)
    return torch.load(target, weights_only=False)["model"]


def _relative_differences(actual: dict, expected: dict) -> dict[str, float]:
    """``||a - b|| / ||b||`` for every tensor of ``expected``."""
    assert actual.keys() == expected.keys()
    return {name: float((actual[name] - tensor).norm() / tensor.norm()) for name, tensor in expected.items()}


def _assert_parameters_close(actual: dict, expected: dict) -> None:
    differences = _relative_differences(actual, expected)
    worst = max(differences, key=differences.get)
    assert differences[worst] <= RTOL, f"{worst}: {differences[worst]:.2e} relative"


# --------------------------------------------------------------------------------------------
# DDP and FSDP2 train the same thing


@pytest.mark.parametrize("processes", [2, 4])
def test_ddp_and_fsdp_losses_agree_step_by_step(runs, processes):
    import numpy as np

    ddp, fsdp = _training(runs, f"ddp{processes}"), _training(runs, f"fsdp{processes}")
    ddp_losses, fsdp_losses = (np.array(r["metrics"]["loss_at_step"]) for r in (ddp, fsdp))
    assert len(ddp_losses) == len(fsdp_losses) == STEPS
    np.testing.assert_allclose(fsdp_losses, ddp_losses, rtol=RTOL, atol=0)
    assert fsdp["metrics"]["final_loss"] == pytest.approx(ddp["metrics"]["final_loss"], rel=RTOL)
    # Not a vacuous match: the loss moves by far more than the tolerance as the model learns.
    assert ddp_losses[-1] < ddp_losses[0] - 1000 * RTOL * ddp_losses[0]
    assert (ddp["method"], fsdp["method"]) == ("ddp", "fsdp")
    for record in (ddp, fsdp):
        assert record["metrics"]["world_size"] == processes and record["metrics"]["global_batch_size"] == 16
        assert record["config"]["accumulation_steps"] == 4 // processes
        assert record["config"]["dataset"] == "stdlib-text" and len(record["config"]["text_sha256"]) == 64
    # Replicas are hashed and identical; shards are not replicas and are not hashed.
    assert ddp["metrics"]["parameters_identical"] is True and "replica_digests" not in fsdp["metrics"]


def test_the_world_size_does_not_change_the_optimiser_steps(runs):
    """The same global batch on 2 and on 4 ranks: the same losses (the premise of resuming elsewhere)."""
    import numpy as np

    np.testing.assert_allclose(_training(runs, "fsdp2")["metrics"]["loss_at_step"],
                               _training(runs, "fsdp4")["metrics"]["loss_at_step"], rtol=RTOL, atol=0)


def _all_gathers_per_step(monkeypatch, tmp_path, *flags: str) -> list[int]:
    """FSDP2's all-gathers (one per gathered block or root) in each optimiser step of a 1-rank run of
    4 micro-batches per step: the unshards FSDP2 starts (on one rank it copies instead of calling the
    collective, at the same places)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.optim.optimizer import register_optimizer_step_post_hook

    calls, at_step = [], []
    original = FSDPParamGroup.unshard

    def counted(group, *args, **kwargs):
        started = group._all_gather_result is None
        original(group, *args, **kwargs)
        calls.extend([1] if started and group._all_gather_result is not None else [])

    monkeypatch.setattr(FSDPParamGroup, "unshard", counted)
    hook = register_optimizer_step_post_hook(lambda *_: at_step.append(len(calls)))
    try:
        argv = [*TINY, "--strategy", "fsdp", "--epochs", "1", "--max-steps", "2", "--results-dir",
                str(tmp_path / "r"), "--checkpoint-dir", str(tmp_path / "c"), *flags]
        assert run_main(TRAIN, argv) == 0
    finally:
        hook.remove()
    return [b - a for a, b in zip([0, *at_step], at_step)]


def test_fsdp_keeps_blocks_gathered_between_micro_batches_of_one_step(monkeypatch, tmp_path, capsys):
    """Gradient accumulation re-gathers nothing the previous micro-batch's backward left gathered: of the 2
    all-gathers per block and micro-batch (forward, then backward), the later micro-batches' forwards need
    none; without resharding after forward, each block is gathered once per optimiser step."""
    units = 4 + 1  # 4 blocks, each its own unit, and the root's (embeddings, final norm, head)
    default = _all_gathers_per_step(monkeypatch, tmp_path / "default")
    assert "FSDP2's gathers and copies are pure overhead" in capsys.readouterr().out
    # The root is never resharded after its forward (FSDP2 gathers it once per micro-batch, for forward).
    assert default == [4 * (2 + 1 + 1 + 1) + (1 + 0 + 0 + 0)] * 2, default  # every micro-batch re-gathered: 4*8+4
    kept = _all_gathers_per_step(monkeypatch, tmp_path / "kept", "--no-reshard-after-forward")
    assert kept == [units] * 2, kept


def test_training_records_carry_tokens_per_second_and_no_made_up_peak_on_cpu(runs):
    """Tokens/s is samples/s x context; MFU needs the device's peak, which a CPU does not have."""
    from common.models import TransformerShape
    from labs.lab04_sharded_training.lab04_shared import flops_per_token

    for name in ("ddp4", "fsdp2", "resume1"):
        metrics = _training(runs, name)["metrics"]
        assert metrics["tokens_per_s"] == pytest.approx(metrics["samples_per_s"] * 32)
        assert metrics["flops_per_token"] == flops_per_token(TransformerShape(4, 32, 4, 32, 128))
        assert metrics["mfu"] is None and metrics["peak_tflops"] is None
        assert metrics["mfu_reason"].startswith("no peak known for a CPU")
        world = _training(runs, name)["provenance"]["world_size"]  # achieved: per device, the job's FLOP/s / ranks
        job_flops = metrics["tokens_per_s"] * metrics["flops_per_token"]
        assert world in (1, 2, 4) and metrics["achieved_tflops"] == pytest.approx(job_flops / world / 1e12)
    assert _training(runs, "resume1")["metrics"]["resumed_at_step"] == 10
    # Epoch 1 ran on 4 ranks before the checkpoint: time per epoch is the epoch this one process ran, not a mix.
    resumed = _training(runs, "resume1")["metrics"]
    assert len(resumed["epoch_time_s"]) == 2 and resumed["time_per_epoch_s"] == resumed["epoch_time_s"][1]
    assert _training(runs, "fsdp4")["metrics"]["resumed_at_step"] is None


def test_mfu_is_the_model_flops_over_the_gpus_dense_peak_for_the_precision_in_force(monkeypatch):
    """On a (faked) H100: 6 N + 12 L H Q T FLOPs per token against 989.5 TFLOP/s in bf16, TF32's
    494.5 for fp32 matmuls that PyTorch lets run as TF32, and fp32's 67 when it does not."""
    import torch

    from common.models import TransformerShape, transformer_parameter_count
    from labs.lab04_sharded_training.lab04_shared import flops_per_token, throughput

    shape = TransformerShape(layers=24, width=1024, heads=16, context=1024, vocab_size=128)
    assert transformer_parameter_count(shape) > 300e6  # the README's GPU-sized configuration
    multiplying = transformer_parameter_count(shape) - (128 + 1024) * 1024
    assert flops_per_token(shape) == 6 * multiplying + 12 * 24 * 16 * 64 * 1024
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpu = torch.device("cuda", 0)
    bf16 = throughput(shape, 40.0, gpu, "bf16", devices=1)
    assert bf16["tokens_per_s"] == 40 * 1024 and bf16["peak_tflops"] == 989.5
    assert bf16["mfu"] == pytest.approx(40 * 1024 * flops_per_token(shape) / 989.5e12)
    assert throughput(shape, 80.0, gpu, "bf16", devices=2)["mfu"] == pytest.approx(bf16["mfu"])  # per device
    from common.precision import fp32_math, set_fp32_math
    from common.runtime.compat import new_tf32_api

    previous = fp32_math()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 matmuls: TF32's peak
        assert throughput(shape, 40.0, gpu, "fp32", devices=1)["peak_tflops"] == 494.5
        set_fp32_math("ieee")  # IEEE matmuls and convolutions (cuDNN's own default is TF32): fp32's peak
        assert throughput(shape, 40.0, gpu, "fp32", devices=1)["peak_tflops"] == 67
    finally:  # as it was, whatever an earlier test left
        set_fp32_math(previous["matmul"])
        torch.backends.cudnn.allow_tf32 = previous["cudnn_conv"] == "tf32"
        if new_tf32_api():
            torch.backends.cudnn.conv.fp32_precision = previous["cudnn_conv"]
    assert fp32_math() == previous
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    unknown = throughput(shape, 40.0, gpu, "bf16", devices=1)
    assert unknown["mfu"] is None and "no datasheet peak for 'Some Future GPU'" in unknown["mfu_reason"]


# --------------------------------------------------------------------------------------------
# Memory per rank


@pytest.mark.parametrize("processes", [2, 4])
def test_fsdp_holds_an_nth_of_ddp_per_rank_and_the_formula_predicts_it(runs, processes):
    assert runs["statuses"][f"memory{processes}"] == 0, runs["logs"][f"memory{processes}"][-3000:]
    record = _record(runs["root"] / f"memory{processes}")
    budget = {row["variant"]: row for row in record["metrics"]["budget"]}
    assert set(budget) == {"ddp", "fsdp", "fsdp+ac", "fsdp+bf16"} and record["metrics"]["world_size"] == processes
    ddp_states = budget["ddp"]["measured"]["states"]  # parameters + gradients + AdamW state, from the tensors
    for variant in ("fsdp", "fsdp+ac", "fsdp+bf16"):
        assert budget[variant]["measured"]["states"] <= ddp_states / processes * 1.10, variant
    for variant, row in budget.items():
        assert [rank["rank"] for rank in row["measured_per_rank"]] == list(range(processes))
        for part in ("parameters", "gradients", "optimizer", "states", "activations"):
            assert row["predicted"][part] == pytest.approx(row["measured"][part], rel=0.10), (variant, part)
    activations = {variant: row["measured"]["activations"] for variant, row in budget.items()}
    assert activations["fsdp+ac"] < activations["fsdp"] / 3  # only each block's input is kept
    assert activations["fsdp+bf16"] < activations["fsdp"] * 0.6  # most activations in half the bytes
    # The training runs measure the same thing: FSDP2's ranks hold a quarter of DDP's.
    held = {name: max(e["total"] for e in _training(runs, name)["metrics"]["tensor_bytes"])
            for name in ("ddp4", "fsdp4")}
    assert held["fsdp4"] <= held["ddp4"] / 4 * 1.10


def test_fsdp_trains_a_larger_model_than_ddp_within_the_same_budget(runs):
    assert runs["statuses"]["largest2"] == 0, runs["logs"]["largest2"][-3000:]
    record = _record(runs["root"] / "largest2")
    largest = {row["variant"]: row for row in record["metrics"]["largest"]}
    assert largest["ddp"]["largest"]["layers"] == 2 and largest["fsdp"]["largest"]["layers"] == 4
    assert largest["fsdp"]["times_ddp"] > 1.7
    assert largest["fsdp+ac"]["largest"]["layers"] > largest["fsdp"]["largest"]["layers"]
    for row in largest.values():  # the search went on until a try did not fit, measured each time
        assert row["tries"][-1]["fits"] is False and row["tries"][-1]["bytes"] > record["metrics"]["budget_bytes"]
        assert all(t["bytes"] <= record["metrics"]["budget_bytes"] for t in row["tries"][:-1])


# --------------------------------------------------------------------------------------------
# Distributed checkpoints: save on 4, resume on 2 and on 1; pre-emption


@pytest.mark.parametrize("processes", [2, 1])
def test_saved_on_4_resumed_on_fewer_matches_the_uninterrupted_run(runs, processes):
    import numpy as np

    name = f"resume{processes}"
    resumed, whole = _training(runs, name), _training(runs, "fsdp4")
    assert "resumed from" in runs["logs"][name] and "epoch 2, step 0" in runs["logs"][name]
    assert resumed["metrics"]["world_size"] == processes
    assert resumed["metrics"]["final_loss"] == pytest.approx(whole["metrics"]["final_loss"], rel=RTOL)
    np.testing.assert_allclose(resumed["metrics"]["loss_at_step"], whole["metrics"]["loss_at_step"], rtol=RTOL, atol=0)
    root = runs["root"]
    final = _final_parameters(root / name / "ckpt")
    _assert_parameters_close(final, _final_parameters(root / "fsdp4" / "ckpt"))
    # The control: training epoch 2 moved the parameters far more than the tolerance.
    started_from = _final_parameters(root / "epoch1" / "ckpt")  # an untouched copy of epoch 1's save
    assert max(_relative_differences(final, started_from).values()) > 100 * RTOL


def test_preemption_saves_a_dcp_checkpoint_on_every_rank_and_the_resume_continues(runs):
    import numpy as np

    log = runs["logs"]["preempted"]
    assert runs["statuses"]["preempted"] == 0, log[-3000:]
    assert "received SIGUSR1: saved" in log and "at epoch 2 step 4" in log
    assert not (runs["root"] / "preempted" / "results").exists()  # stopped before the end: no record
    from common.checkpoint.sharded import complete_checkpoints

    folders = [p.name for p in complete_checkpoints(runs["root"] / "preempted" / "ckpt")]
    assert folders[-1].endswith("epoch3-step0")  # the resumed run's final save
    resumed, whole = _training(runs, "preempted_resumed"), _training(runs, "fsdp2")
    resumed_log = runs["logs"]["preempted_resumed"]
    assert "resumed from" in resumed_log and "epoch 2, step 4" in resumed_log
    np.testing.assert_allclose(resumed["metrics"]["loss_at_step"], whole["metrics"]["loss_at_step"], rtol=RTOL, atol=0)
    assert resumed["metrics"]["final_loss"] == pytest.approx(whole["metrics"]["final_loss"], rel=RTOL)
    _assert_parameters_close(_final_parameters(runs["root"] / "preempted" / "ckpt"),
                             _final_parameters(runs["root"] / "fsdp2" / "ckpt"))


def test_both_checkpoint_modes_record_how_long_the_loop_stalled(runs):
    """Sync and async saves are both timed and recorded; which stalls less is measured, not asserted:
    on a loaded 2-core machine the order of two sub-second times is not deterministic (the reference
    records, on a quiet machine, show it)."""
    sync, asynchronous = _training(runs, "fsdp2"), _training(runs, "preempted_resumed")
    assert sync["config"]["async_checkpoint"] is False and asynchronous["config"]["async_checkpoint"] is True
    for record, mode in ((sync, "sync"), (asynchronous, "async")):
        saves = record["metrics"]["checkpoint_saves"]
        assert saves and {save["mode"] for save in saves} == {mode}
        assert all(save["stall_s"] > 0 and save["complete_s"] > 0 for save in saves), saves
    for save in sync["metrics"]["checkpoint_saves"]:  # a synchronous save is complete before the loop goes on
        assert save["complete_s"] <= save["stall_s"]
    stalls = {mode: [s["stall_s"] for s in r["metrics"]["checkpoint_saves"]] for mode, r in
              (("sync", sync), ("async", asynchronous))}
    print(f"checkpoint stalls (s): {stalls}")


# --------------------------------------------------------------------------------------------
# The report


def test_report_section_shows_memory_losses_checkpoint_stalls_and_the_largest_model(runs, tmp_path):
    from common.results import load_records
    from common.report import build_report
    from common.report.runs import runs_frame
    from common.report.labs import load_builtin_lab_sections
    from common.report.sections import SectionContext, lab_section_builders

    folder = tmp_path / "records"
    folder.mkdir()
    for path in runs["root"].glob("**/lab04_*.json"):
        shutil.copy(path, folder / path.name)
    outcome = build_report(folder, tmp_path / "report.html")  # with plots: the loss curves are drawn
    assert outcome.skipped == [] and outcome.runs == len(list(folder.glob("*.json")))
    html = (tmp_path / "report.html").read_text()
    assert "Lab 04: sharded data parallel (FSDP2)" in html and "Training loss per step of the DDP and FSDP2" in html
    # Lab-04 has no single-device baseline: no empty speed-up or efficiency columns, no DDP efficiency target.
    summary = html[html.index('id="summary-table"'):]
    summary = summary[:summary.index("</table>")]
    assert "<th" in summary and "speed-up" not in summary and "scaling efficiency" not in summary
    assert "DDP is expected to reach" not in html
    # The loss plot names the resumed runs and where they continued (epoch 1 = 10 steps), and says how
    # curves that lie on one another are told apart.
    caption = html[html.index("DDP (dashed, circles)"):]
    caption = caption[:caption.index("</figcaption>")]
    assert "relative difference from the DDP run" in caption
    assert "fsdp · 1 ranks · sync · resumed at step 10" in caption
    assert "fsdp · 2 ranks · sync · resumed at step 10" in caption
    assert "fsdp · 4 ranks" not in caption  # the uninterrupted runs are not called resumed
    assert "no peak known for a CPU" in html

    load_builtin_lab_sections()
    frame = runs_frame(load_records(folder).records)
    context = SectionContext(runs=frame, all_runs=frame, plots=False)
    (section,) = [section for builder in lab_section_builders("lab04") if (section := builder(context))]
    tables = {table.id: [dict(zip(table.columns, (cell.text for cell in row))) for row in table.rows]
              for table in section.tables}
    memory = tables["lab04-memory"]
    assert sorted((row["variant"], row["ranks"]) for row in memory) == sorted(
        (variant, ranks) for variant in ("ddp", "fsdp", "fsdp+ac", "fsdp+bf16") for ranks in ("2", "4"))
    assert all(row["measured ÷ predicted (parameters + gradients + AdamW)"] == "1" for row in memory)
    training = tables["lab04-training"]
    assert {row["MFU"] for row in training} == {"n/a"} and all(row["tokens/s"] != "—" for row in training)
    differences = {(row["method"], row["ranks"]): row["largest step difference from DDP"] for row in training}
    assert differences[("ddp", "4")] == "—" and float(differences[("fsdp", "4")]) <= RTOL
    stalls = tables["lab04-checkpoints"]
    assert {row["checkpoint"] for row in stalls} == {"sync", "async"}
    assert all(row["loop stalled (median)"].endswith(" s") for row in stalls)
    largest = {row["variant"]: row for row in tables["lab04-largest"]}
    from common.models import TransformerShape, transformer_parameter_count

    ratio = transformer_parameter_count(TransformerShape(4, 64, 4, 32)) / transformer_parameter_count(
        TransformerShape(2, 64, 4, 32))
    assert largest["ddp"]["largest model (layers × width)"] == "2 × 64"
    assert largest["fsdp"]["× DDP's largest"] == f"{ratio:.2f}×"


# --------------------------------------------------------------------------------------------
# Bad input: one line each, non-zero exit, nothing written


def test_more_ranks_than_blocks_is_one_error_line(runs):
    assert runs["statuses"]["too_few_layers"] == 2
    errors = [line for line in runs["logs"]["too_few_layers"].splitlines() if line.startswith("error:")]
    assert errors == ["error: --strategy fsdp on 2 ranks needs at least 2 blocks to shard, the model has --layers 1: "
                      "each block is gathered whole, so with more ranks than blocks the gathered block outweighs "
                      "each rank's shard; use more --layers or fewer ranks"]
    assert not (runs["root"] / "too_few_layers" / "results").exists()


def test_a_checkpoint_of_another_model_shape_is_one_error_line(runs, capsys):
    root = runs["root"]
    status = run_main(TRAIN, [*_train("wrong_shape", root, "--resume"), "--width", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert "was written with other settings (--width 32 there, 64 here)" in err[0]
    assert not (root / "wrong_shape" / "results").exists()


def test_dcp_folder_with_other_tensor_shapes_is_refused_before_loading(runs):
    """The second guard: a folder whose tensors do not fit the model (say, another script's)."""
    from common.errors import UserError
    from common.models import DecoderOnlyTransformer, TransformerShape
    from common.checkpoint.sharded import check_same_model, complete_checkpoints

    folder = complete_checkpoints(runs["root"] / "fsdp4" / "ckpt")[-1]
    wider = DecoderOnlyTransformer(TransformerShape(layers=4, width=64, heads=4, context=32)).state_dict()
    with pytest.raises(UserError, match=r"token_embedding.weight is \[128, 32\] there and \[128, 64\] here"):
        check_same_model(folder, wider)
    deeper = DecoderOnlyTransformer(TransformerShape(layers=5, width=32, heads=4, context=32)).state_dict()
    with pytest.raises(UserError, match="this model has blocks.4.attention.proj.bias and 10 more"):
        check_same_model(folder, deeper)
    same = DecoderOnlyTransformer(TransformerShape(layers=4, width=32, heads=4, context=32)).state_dict()
    check_same_model(folder, same)


def test_bf16_on_a_gpu_older_than_ampere_is_one_error_line(monkeypatch):
    import torch

    from common.errors import UserError
    from labs.lab04_sharded_training.lab04_shared import check_strategy

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    with pytest.raises(UserError) as error:
        check_strategy("fsdp", "bf16", torch.device("cuda", 0), world_size=4, layers=8)
    assert "\n" not in str(error.value) and "Tesla V100-SXM2-32GB is sm_70" in str(error.value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    check_strategy("fsdp", "bf16", torch.device("cuda", 0), world_size=4, layers=8)  # an A100 may


def test_fsdp_without_a_process_group_is_one_error_line():
    import torch
    import torch.distributed as dist

    from common.errors import UserError
    from common.models import DecoderOnlyTransformer, TransformerShape
    from labs.lab04_sharded_training.lab04_shared import apply_strategy

    assert not dist.is_initialized()
    model = DecoderOnlyTransformer(TransformerShape(layers=2, width=32, heads=4, context=16))
    with pytest.raises(UserError, match="needs a process group") as error:
        apply_strategy(model, "fsdp", torch.device("cpu"))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("argv, message", [
    (["--width", "30", "--heads", "4"], "--width 30 must be a multiple of --heads 4"),
    (["--global-batch-size", "6"], "--global-batch-size 6 must be a multiple of 1 rank(s) x --batch-size 4"),
    (["--strategy", "ddp", "--precision", "bf16"], "--precision bf16 is FSDP2's MixedPrecisionPolicy"),
])
def test_bad_training_flags_are_one_error_line(tmp_path, capsys, argv, message):
    status = run_main(TRAIN, [*TINY, "--results-dir", str(tmp_path / "r"), "--checkpoint-dir", str(tmp_path / "c"),
                              *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "r").exists() and not (tmp_path / "c").exists()


def test_largest_model_on_cpu_needs_a_budget(tmp_path, capsys):
    status = run_main(LARGEST, ["--device", "cpu", "--results-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "--budget is required on CPU" in err[0], err


# --------------------------------------------------------------------------------------------
# The pieces in common


def test_stdlib_text_is_deterministic_split_per_module_and_shifted_by_one():
    from common.data.datasets import (STDLIB_TEXT_MODULES, TEXT_ALPHABET, TEXT_VOCAB_SIZE, UNKNOWN_CHAR_ID,
                                      load_stdlib_text)

    first, second = load_stdlib_text(64), load_stdlib_text(64)
    assert first.describe() == second.describe()
    assert first.num_classes == TEXT_VOCAB_SIZE == 128 and first.describe()["text_modules"] == len(STDLIB_TEXT_MODULES)
    tokens, targets = first.train[3]
    assert tokens.shape == targets.shape == (64,) and int(tokens.max()) <= UNKNOWN_CHAR_ID
    assert tokens[1:].tolist() == targets[:-1].tolist()  # the target is the next character
    assert "def " in "".join(TEXT_ALPHABET[i] for i in first.train.stream[:20000].tolist() if i < len(TEXT_ALPHABET))
    ratio = len(first.test.stream) / (len(first.train.stream) + len(first.test.stream))
    assert 0.09 < ratio < 0.11  # the last tenth of every module


def test_stdlib_text_leaves_out_modules_without_source_and_refuses_an_install_without_any(monkeypatch):
    import importlib.util

    import common.data.datasets as data
    from common.errors import UserError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "difflib" else real(name, *a))
    splits = data.load_stdlib_text(32)
    assert splits.describe()["text_modules_missing"] == ["difflib"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(UserError, match="no source for 24 of the 24 standard-library modules"):
        data.load_stdlib_text(32)


def test_transformer_parameter_formula_and_activation_checkpointing_change_nothing_but_memory():
    import torch

    from common.errors import UserError
    from common.models import DecoderOnlyTransformer, TransformerShape, transformer_parameter_count

    for shape in (TransformerShape(2, 32, 4, 16), TransformerShape(3, 48, 6, 8, vocab_size=64)):
        model = DecoderOnlyTransformer(shape)
        assert sum(p.numel() for p in model.parameters()) == transformer_parameter_count(shape)
    torch.manual_seed(0)
    model = DecoderOnlyTransformer(TransformerShape(2, 32, 4, 16))
    tokens = torch.randint(0, 128, (2, 16))
    grads = []
    for checkpointed in (False, True):
        model.activation_checkpointing = checkpointed
        model.zero_grad()
        model(tokens).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*grads))
    with pytest.raises(UserError, match="multiple of --heads"):
        DecoderOnlyTransformer(TransformerShape(2, 30, 4, 16))


def test_only_complete_checkpoint_folders_count(tmp_path):
    from common.checkpoint.sharded import complete_checkpoints

    for name, complete in (("ckpt-000002-epoch2-step0", True), ("ckpt-000010-epoch3-step0", True),
                           ("ckpt-000011-epoch3-step5", False), ("notes", True)):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / ".metadata").write_text("")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["ckpt-000002-epoch2-step0", "ckpt-000010-epoch3-step0"]
    assert complete_checkpoints(tmp_path / "missing") == []


def test_byte_sizes_parse_like_people_write_them():
    import argparse

    from labs.lab04_sharded_training.lab04_shared import byte_size

    sizes = ("512MiB", "2GiB", "1e9", "1.5GB", "100")
    assert [byte_size(t) for t in sizes] == [2**29, 2**31, 10**9, 1_500_000_000, 100]
    for bad in ("abc", "0", "5 parsecs", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)


def test_memory_budget_predicts_for_a_world_size_it_does_not_measure(tmp_path, capsys):
    status = run_main(BUDGET, [*MEMORY, "--world-size", "4", "--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0 and "nothing is measured" in out
    record = _record(tmp_path)
    rows = {row["variant"]: row for row in record["metrics"]["budget"]}
    assert record["metrics"]["measured"] is False and "measured" not in rows["fsdp"]
    assert rows["fsdp"]["predicted"]["parameters"] * 4 == rows["ddp"]["predicted"]["parameters"]


def test_help_shows_defaults():
    import argparse

    for script in (BUDGET, TRAIN, LARGEST):
        parser = load_script(script).build_parser()
        flags = [action for action in parser._actions
                 if action.option_strings and action.help not in (None, argparse.SUPPRESS) and action.dest != "help"]
        assert len(flags) >= 9, script
        assert [action.option_strings[0] for action in flags if "default" not in action.help] == [], script


@pytest.mark.gpu
def test_on_a_gpu_the_allocator_peak_holds_at_least_what_the_tensors_hold(tmp_path):
    """On a GPU every tensor comes from the caching allocator, so its peak over a step is at least the
    parameters, gradients, AdamW state and saved activations the step ends with."""
    run_fresh(BUDGET, [*MEMORY, "--device", "cuda", "--results-dir", str(tmp_path)])
    record = _record(tmp_path)
    for row in record["metrics"]["budget"]:
        assert row["predicted"]["states"] == pytest.approx(row["measured"]["states"], rel=0.10), row["variant"]
        (rank,) = row["measured_per_rank"]
        assert rank["peak"]["source"] == "cuda_max_memory_allocated"
        assert rank["peak"]["peak_bytes"] >= row["measured"]["total"], row["variant"]


def test_report_section_survives_records_with_missing_or_odd_values():
    from common.report.runs import runs_frame
    from common.report.labs import load_builtin_lab_sections
    from common.report.sections import SectionContext, lab_section_builders

    load_builtin_lab_sections()
    base = {"schema": "hpc-dl-labs/result", "schema_version": 1, "created": "2026-01-01T00:00:00+00:00",
            "lab": "lab04", "script": "x", "status": "ok", "provenance": {}}
    records = [
        {**base, "run_id": "a", "method": "memory", "config": {}, "metrics": {"budget": [{"variant": "fsdp"}, "junk"]}},
        {**base, "run_id": "b", "method": "fsdp", "config": {"layers": "four"},
         "metrics": {"checkpoint_saves": [{"mode": "sync"}, 3], "loss_at_step": ["x", None, 2.0], "tensor_bytes": "?"}},
        {**base, "run_id": "c", "method": "ddp", "config": {}, "metrics": {}},
        {**base, "run_id": "d", "method": "largest-model", "config": {}, "metrics": {"largest": "none"}},
        {**base, "run_id": "e", "method": "largest-model", "config": {}, "metrics": {"largest": [{"variant": "ddp"}]}},
    ]
    frame = runs_frame(records)
    context = SectionContext(runs=frame, all_runs=frame, plots=True)
    sections = [section for builder in lab_section_builders("lab04") if (section := builder(context))]
    assert len(sections) == 1 and {table.id for table in sections[0].tables} >= {"lab04-memory", "lab04-training",
                                                                                 "lab04-largest"}


def test_overlapping_windows_give_the_gpu_configuration_enough_steps_for_an_mfu_figure():
    """At context 1,024 the corpus holds about 18 global batches of 64 side by side: fewer than the
    README's 30 steps (10 of them compiling). --window-stride 128 starts a window every 128 characters."""
    import torch

    from common.data.datasets import CharWindows, load_stdlib_text

    stream = torch.arange(100, dtype=torch.uint8)
    side_by_side, overlapping = CharWindows(stream, 10), CharWindows(stream, 10, stride=5)
    assert len(side_by_side) == 9 and len(overlapping) == 18
    inputs, targets = overlapping[3]
    assert inputs.tolist() == list(range(15, 25)) and targets.tolist() == list(range(16, 26))
    assert overlapping[17][1][-1].item() == 95  # the last window still has its next character
    assert len(load_stdlib_text(1024).train) // 64 < 30
    assert len(load_stdlib_text(1024, stride=128).train) // 64 >= 30


def test_resuming_a_finished_sharded_run_trains_nothing_and_writes_no_second_record(runs, capsys):
    """resume1 finished both epochs (DCP checkpoints in --checkpoint-dir, its record beside): the same command
    again, as a requeued job that had already finished would run it, stops at once with exit 0."""
    before = _training(runs, "resume1")
    assert run_main(TRAIN, _train("resume1", runs["root"], "--resume")) == 0
    assert "nothing left to train" in capsys.readouterr().out
    assert _record(runs["root"] / "resume1" / "results") == before  # still the one record


def test_the_sharded_training_offers_no_data_folder_its_text_does_not_come_from(tmp_path, capsys):
    """Its text is the Python standard library's source: --data-dir was accepted, recorded and not read."""
    flags = {option for action in load_script(TRAIN).build_parser()._actions for option in action.option_strings}
    assert "--data-dir" not in flags and "--num-workers" in flags  # its DataLoader still takes workers
    from common.checkpoint.sharded import DistributedCheckpointer

    assert DistributedCheckpointer.flag in flags  # what a stopped run tells the user to give again
    assert run_main(TRAIN, ["--data-dir", str(tmp_path), "--results-dir", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.startswith("error: unrecognized arguments: --data-dir")


def test_a_dry_run_validates_on_two_batches(tmp_path):
    """--dry-run took 92 s on a 2-core CPU with the lab's model, most of it the 20 validation batches."""
    assert run_main(TRAIN, [*MODEL, "--dry-run", "--results-dir", str(tmp_path)]) == 0
    (record,) = [json.loads(path.read_text()) for path in tmp_path.glob("lab04_*.json")]
    assert record["config"]["eval_steps"] == 2 and len(record["metrics"]["eval_history"]) == 1
    assert run_main(TRAIN, [*MODEL, "--dry-run", "--eval-steps", "1", "--results-dir", str(tmp_path / "one")]) == 0
    (record,) = [json.loads(path.read_text()) for path in (tmp_path / "one").glob("lab04_*.json")]
    assert record["config"]["eval_steps"] == 1  # a smaller count stays


@pytest.mark.parametrize("template", ["sharded_srun_2node", "sharded_torchrun_4gpu"])
def test_the_templates_give_fsdp_a_block_and_a_batch_per_rank_on_any_number_of_gpus(template):
    """Rendered for 8 or 16 ranks (``--set gpus_per_node=4`` on the 2-node job, as its header suggests), the tiny
    run (and on 16 ranks the lab's) kept 4 (8) blocks, and 02_sharded_training.py stopped with "--strategy fsdp on
    8 ranks needs at least 8 blocks": the model now has at least one block per rank. On 32 ranks the tiny run's
    --batch-size was 0, and on 3 or 6 the global batch of 64 (16) was no multiple of the ranks' micro-batches: each
    rank now has a whole micro-batch, and the global batch is a multiple of them, as the script checks."""
    from common.slurm import jobs, rendering, sites

    path = REPO / LAB / "sbatch" / f"{template}.sbatch.j2"
    for site, gpus in (("lanta", 1), ("lanta", 2), ("lanta", 3), ("lanta", 4), ("sjtu-pi", 6), ("sjtu-pi", 8),
                       ("sjtu-pi", 16)):
        settings = jobs.parse_settings([f"gpus_per_node={gpus}", "account=lt200123"])
        text, _ = rendering.render(jobs.read_template(path), sites.find_site(site), settings)
        ranks = gpus * (2 if "2node" in template else 1)
        layers = [int(n) for n in re.findall(r"--layers (\d+)", text)]
        assert len(layers) == 2 and min(layers) >= ranks, (template, gpus, layers)
        batches = [(int(g), int(b)) for g, b in re.findall(r"--global-batch-size (\d+) --batch-size (\d+)", text)]
        assert len(batches) == 2 and all(b >= 1 and g % (b * ranks) == 0 for g, b in batches), (template, gpus, batches)
        # The lab's global batch, or the largest multiple below it, or one sequence per rank where there are more ranks.
        assert all(lab - b * ranks < g <= max(lab, ranks) for (g, b), lab in zip(batches, (64, 16))), batches
