"""Lab-05 acceptance on CPU (Gloo): bus bandwidth, the scaling study, overlap, energy in every record.

The real runs share one module-scoped fixture and start together (the machine has two cores; each
job spends most of its time importing torch): a 2-process and a 4-process bandwidth run, the scaling
study at 1 and 2 processes in strong and weak scaling, and the overlap script on 2 processes. The
numbers they measure on a loaded CI machine are whatever they are: the tests check that every size,
point and bucket size was measured and recorded with its reference, not how fast the machine is.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from common.runtime.launch import free_port
from helpers import PYTHON, REPO, load_script, run_main, script_env, terminate_when

LAB = "labs/lab05_scaling"
BENCH = f"{LAB}/01_allreduce_bench.py"
SCALING = f"{LAB}/02_scaling_study.py"
OVERLAP = f"{LAB}/03_overlap.py"
shared = load_script(f"{LAB}/lab05_shared.py")

BENCH_ARGS = ["--device", "cpu", "--min-bytes", "1K", "--max-bytes", "64K", "--step-factor", "4", "--repeats", "3",
              "--warmup", "1", "--memcpy-repeats", "2"]
SIZES = [1024, 4096, 16384, 65536]


# --- the formulas, by hand ---------------------------------------------------------------------------

def test_bus_bandwidth_matches_a_hand_computation():
    # all-reduce of S = 1 GiB in 10 ms on 4 ranks: algbw = 2**30 B / 0.01 s = 107.3741824 GB/s,
    # busbw = algbw x 2(4-1)/4 = 107.3741824 x 1.5 = 161.0612736 GB/s.
    assert shared.bandwidths("all_reduce", 2**30, 0.01, 4) == pytest.approx((107.3741824, 161.0612736))
    # all-gather of S = 64 MiB (the gathered output) in 2 ms on 8 ranks: 33.554432 GB/s x 7/8 = 29.360128.
    assert shared.bandwidths("all_gather", 64 * 2**20, 0.002, 8) == pytest.approx((33.554432, 29.360128))
    # reduce-scatter on 2 ranks: (n-1)/n = 1/2; all-reduce on 2 ranks: 2(n-1)/n = 1.
    assert shared.bandwidths("reduce_scatter", 10**9, 1.0, 2) == pytest.approx((1.0, 0.5))
    assert shared.bandwidths("all_reduce", 10**9, 0.5, 2) == pytest.approx((2.0, 2.0))
    assert shared.bus_factor("all_reduce", 1) == 0  # one rank moves nothing over a link


def test_message_sizes_and_their_limits():
    assert shared.message_sizes(1024, 64 * 1024, 4, "cpu") == SIZES
    assert shared.message_sizes(1024, 2**30, 2, "cuda")[-1] == 2**30  # 1 KiB .. 1 GiB on a GPU: 21 sizes
    assert shared.parse_size("64M") == 64 * 2**20 and shared.parse_size("1GiB") == 2**30
    with pytest.raises(shared.UserError, match=r"--max-bytes 128.0 MiB is above the cpu limit of 64.0 MiB"):
        shared.message_sizes(1024, 128 * 2**20, 2, "cpu")
    with pytest.raises(shared.UserError, match=r"below the smallest size timed, 1.0 KiB"):
        shared.message_sizes(512, 2048, 2, "cpu")


# --- what NCCL said it used (its NCCL_DEBUG=INFO lines) ---------------------------------------------

NVLINK_NODE = """\
gpu01:3512:3550 [0] NCCL INFO Pattern 4, crossNic 0, nChannels 12, bw 20.000000/20.000000, type NVL/PIX, sameChannels 1
gpu01:3512:3551 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu01:3513:3552 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/direct pointer/read
"""
TWO_NODES_SOCKET = """\
n1:101:130 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>
n1:101:130 [0] NCCL INFO Using network Socket
n1:101:131 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM
n1:101:131 [0] NCCL INFO Channel 00/0 : 3[1] -> 0[0] [receive] via NET/Socket/0
"""
TWO_NODES_IB = """\
gpu41:3928:3989 [0] NCCL INFO Using network IB
gpu41:3928:3989 [0] NCCL INFO Channel 01/0 : 5[1] -> 6[0] [receive] via NET/IBext_v8/1/GDRDMA
gpu34:34088:34142 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA
"""
NO_P2P = "box:7:9 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via SHM/direct/direct\n"


def test_the_transport_nccl_chose_is_read_from_its_debug_output():
    found = shared.parse_nccl_log(NVLINK_NODE.splitlines())
    assert found == {"via": ["P2P"], "networks": [], "paths": ["NVL", "PIX"]}
    assert shared.describe_nccl(found, nodes=1) == ("NCCL: NVLink peer-to-peer (P2P)", None)
    text, warning = shared.describe_nccl(shared.parse_nccl_log(TWO_NODES_SOCKET.splitlines()), nodes=2)
    assert "TCP sockets (NET/Socket)" in text and warning.startswith("NCCL moves data between nodes over TCP sockets")
    text, warning = shared.describe_nccl(shared.parse_nccl_log(TWO_NODES_IB.splitlines()), nodes=2)
    assert text == "NCCL: InfiniBand/RoCE (NET/IB)" and warning is None
    text, _ = shared.describe_nccl(shared.parse_nccl_log([NO_P2P]), nodes=1)
    assert "shared host memory (SHM" in text
    assert shared.describe_nccl({"via": []}, nodes=2)[1] == "NCCL's transport could not be read"


def test_nccl_writes_its_debug_output_to_a_file_per_process_unless_told_otherwise(tmp_path, monkeypatch):
    """The file is found under the name NCCL gives it, on a node whose host name has dots too: NCCL's ``%h`` is
    the name up to the first dot (before, the bench looked for the whole name and read no transport)."""
    import socket

    env = shared.nccl_debug_environment(tmp_path, env={})
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_FILE"] == str(tmp_path / "nccl.%p.log")
    assert shared.nccl_debug_environment(tmp_path, env={"NCCL_DEBUG_FILE": "/elsewhere/%h"}) == {}
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu01.cluster.example.org")
    written = [tmp_path / f"nccl.{os.getpid()}.log", tmp_path / f"mine.gpu01.{os.getpid()}.txt"]
    for path in written:
        path.write_text("NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM\n")
    assert shared.nccl_log_files(env) == written[:1]
    assert shared.nccl_log_files({"NCCL_DEBUG_FILE": str(tmp_path / "mine.%h.%p.txt")}) == written[1:]
    monkeypatch.setenv("NCCL_DEBUG_FILE", env["NCCL_DEBUG_FILE"])
    assert shared.nccl_found()["via"] == ["P2P"]


def test_link_peaks_come_from_the_site_profile_with_their_source():
    from common.slurm.sites import Link

    lanta = shared.site_links("lanta")
    reference = shared.link_reference(lanta, nodes=1, site="lanta")
    assert (reference.gb_per_s, reference.name) == (300, "NVLink (per GPU, one direction)")
    assert "A100" in reference.source and reference.source.startswith("site profile lanta:")
    assert shared.link_reference(lanta, nodes=2, site="lanta") is None  # the profile lists no network peak
    # Across nodes the node's network bounds busbw; without NVLink, PCIe is the GPUs' link.
    links = {"pcie": Link("pcie", 31.5, "gpu", "PCIe 4.0"), "infiniband": Link("infiniband", 100.0, "node", "4 x HDR")}
    assert shared.link_reference(links, nodes=2, site="x").name == "InfiniBand (per node, one direction)"
    assert shared.link_reference(links, nodes=1, site="x").gb_per_s == 31.5
    with pytest.raises(shared.UserError, match=r"unknown site 'nowhere'"):
        shared.site_links("nowhere")


# --- scaling points ----------------------------------------------------------------------------------

SLURM_2x2 = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "2(x2)"}


@pytest.mark.parametrize(("text", "modes"), [("both", ["strong", "weak"]), ("weak,strong", ["strong", "weak"]),
                                             ("weak", ["weak"]), ("both,weak", ["strong", "weak"])])
def test_modes_takes_a_mode_a_list_or_both(text, modes):
    assert shared.parse_modes(text) == modes


def test_the_overlap_dry_run_caps_steps_image_and_batch_and_the_benchmark_offers_no_training_flags():
    parser = load_script(OVERLAP).build_parser()
    dry = shared.read_overlap_args(parser, ["--dry-run"])
    assert (dry.model, dry.image_size, dry.batch_size, dry.repeats, dry.warmup_steps) == ("resnet50", 32, 8, 2, 1)
    assert shared.read_overlap_args(parser, ["--dry-run", "--image-size", "16"]).image_size == 16
    assert shared.read_overlap_args(parser, []).image_size == 224
    for script in (OVERLAP, BENCH):  # an epoch, a step cap or a data set would change nothing there
        flags = {option for action in load_script(script).build_parser()._actions for option in action.option_strings}
        assert not flags & {"--epochs", "--max-steps", "--data-dir", "--num-workers"}, script


def test_a_point_larger_than_the_allocation_is_refused():
    allocation = shared.current_allocation("cuda", SLURM_2x2)
    assert (allocation.processes, allocation.nodes, allocation.per_node) == (4, 2, 2)
    shared.check_points([1, 2, 4], allocation)
    assert [shared.nodes_for(n, allocation) for n in (1, 2, 3, 4)] == [1, 1, 2, 2]
    with pytest.raises(shared.UserError, match=r"scaling point of 8 processes is larger than the allocation "
                                               r"\(Slurm job 7: 4 task\(s\) on 2 node\(s\), 2 per node\)"):
        shared.check_points([1, 8], allocation)
    laptop = shared.current_allocation("cpu", {}, cpus=2)
    with pytest.raises(shared.UserError, match=r"larger than the allocation \(2 CPU core"):
        shared.check_points([1, 2, 4], laptop)
    with pytest.raises(shared.UserError, match=r"must divide evenly"):
        shared.per_process_batch("strong", 3, 64, 64)
    assert shared.per_process_batch("strong", 4, 64, 64) == 16 and shared.per_process_batch("weak", 4, 64, 64) == 64


def test_every_training_command_of_the_study_parses_into_what_the_point_asked_for(tmp_path):
    """The study writes each point's command from Lab-01's parser: parsed back, it is the point's settings."""
    study, training = load_script(SCALING), load_script("labs/lab01_dp_vs_ddp/04_ddp_training.py")
    for argv in (["--dry-run"], ["--max-steps", "5", "--device", "cpu", "--", "--precision", "bf16"]):
        args = study.build_parser().parse_args(argv)
        args = study.apply_dry_run(args)
        args.training_args = [a for a in args.training_args if a != "--"]
        for batch in (16, 64):
            flags = study.training_flags(args, batch, tmp_path / "records", tmp_path / "c.pt")
            parsed = training.build_parser().parse_args(flags)
            assert (parsed.batch_size, parsed.results_dir, parsed.checkpoint) == (batch, tmp_path / "records",
                                                                                  tmp_path / "c.pt")
            assert (parsed.max_steps, parsed.dry_run, parsed.device) == (args.max_steps, args.dry_run, args.device)
            assert (parsed.model, parsed.dataset, parsed.image_size) == (args.model, args.dataset, args.image_size)
    assert parsed.precision == "bf16"  # what follows "--" goes to the training as it is


def test_time_to_target_from_the_evaluation_history_or_the_final_evaluation():
    history = {"eval_history": [{"epoch": 1, "elapsed_s": 10.0, "test_loss": 1.0, "test_accuracy": 0.7},
                                {"epoch": 2, "elapsed_s": 21.0, "test_loss": 0.5, "test_accuracy": 0.92},
                                {"epoch": 3, "elapsed_s": 30.0, "test_loss": 0.4, "test_accuracy": 0.95}]}
    points, source = shared.evaluations(history)
    assert source.startswith("eval_history") and shared.time_to_target(points, 0.9) == 21.0
    assert shared.time_to_target(points, 0.99) is None
    points, source = shared.evaluations({"test_accuracy": 0.8, "epoch_time_s": [2.0, 3.0]})
    assert points == [{"epoch": 2, "elapsed_s": 5.0, "accuracy": 0.8}] and source.startswith("final evaluation only")
    assert shared.evaluations({}) == ([], "no validation accuracy recorded")


# --- bad input: one line, nothing written ------------------------------------------------------------

@pytest.mark.parametrize(("script", "argv", "message"), [
    (BENCH, ["--device", "cpu", "--max-bytes", "1G"],
     "error: --max-bytes 1.0 GiB is above the cpu limit of 64.0 MiB"),
    (BENCH, ["--device", "cpu", "--min-bytes", "100"], "error: --min-bytes 100 B is below the smallest size timed"),
    (BENCH, ["--device", "cpu", "--collectives", "all_reduce,broadcast"],
     "error: unknown collective broadcast; choose from all_reduce, all_gather, reduce_scatter"),
    (BENCH, ["--device", "cpu", "--max-bytes", "lots"], "error: argument --max-bytes: not a size: 'lots'"),
    (BENCH, ["--device", "cpu", "--site", "nowhere"], "error: unknown site 'nowhere'"),
    (BENCH, ["--device", "cpu", "--partition", "gpu"], "error: --partition gpu is a partition of a site profile: "
                                                       "give --site too"),
    (SCALING, ["--device", "cpu", "--modes", "weak", "--global-batch-size", "64"],
     "error: --global-batch-size 64: only with strong scaling"),
    (SCALING, ["--device", "cpu", "--processes", "1,2,4096"],
     "error: scaling point of 4096 processes is larger than the allocation"),
    (SCALING, ["--device", "cpu", "--modes", "diagonal"], "error: unknown scaling mode diagonal"),
    (SCALING, ["--device", "cpu", "--target-accuracy", "90"], "error: argument --target-accuracy: an accuracy is a "
                                                              "fraction from 0 to 1 (0.9 for 90%), got 90"),
    (SCALING, ["--device", "cpu", "--processes", "1,2", "--global-batch-size", "63"],
     "error: strong scaling splits the global batch 63 over 2 processes"),
    (OVERLAP, ["--device", "cpu", "--bucket-cap-mb", "25,zero"], "error: --bucket-cap-mb takes numbers"),
    # The model and the data set every point trains: checked once, not found wrong by each point (which wrote a
    # failed record per point and exit 1).
    (SCALING, ["--device", "cpu", "--processes", "1,2", "--model", "resnet"], "error: unknown model 'resnet'"),
    (SCALING, ["--device", "cpu", "--processes", "1,2", "--dataset", "mnist", "--data-dir", "/nonexistent/data"],
     "error: mnist not found under /nonexistent/data"),
    (SCALING, ["--device", "cpu", "--processes", "1,2", "--model", "resnet18"],
     "error: resnet18 expects 3-channel images, the data has 1"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, script, argv, message):
    results = tmp_path / "results"
    assert run_main(script, [*argv, "--results-dir", str(results)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not results.exists()


@pytest.mark.parametrize(("script", "argv"), [
    (BENCH, ["--collectives", "all_reduc"]), (BENCH, ["--min-bytes", "1M", "--max-bytes", "1K"]),
    (BENCH, ["--max-bytes", "128M"]), (OVERLAP, ["--bucket-cap-mb", "0"]),
])
@pytest.mark.parametrize(("rank", "said"), [("0", True), ("1", False)])
def test_a_bad_flag_value_under_torchrun_is_said_by_rank_0_alone(tmp_path, capsys, monkeypatch, script, argv, rank,
                                                                 said):
    """Every rank reads the same flags: under torchrun each printed the same error line (two copies on two ranks)."""
    monkeypatch.setenv("RANK", rank)
    results = tmp_path / "results"
    assert run_main(script, ["--device", "cpu", *argv, "--results-dir", str(results)]) == 2
    err = capsys.readouterr().err
    assert (err.startswith("error: --") or err.startswith("error: unknown collective")) and err.count("\n") == 1 \
        if said else err == "", err
    assert not results.exists()


def test_the_srun_launcher_where_there_is_no_srun_is_one_line(tmp_path, capsys, monkeypatch):
    """--launcher srun off a Slurm node was a FileNotFoundError traceback from the first point's Popen."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun on it (CI's Slurm testbed installs one)
    results = tmp_path / "results"
    argv = ["--device", "cpu", "--processes", "1", "--launcher", "srun", "--results-dir", str(results)]
    assert run_main(SCALING, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --launcher srun: there is no srun here") and err.count("\n") == 1, err
    assert not results.exists()


def test_training_flags_the_training_refuses_are_one_line_before_any_point_runs(tmp_path, capsys):
    """The flags after -- go to every point's training: checked with its parser first, not found wrong by each point
    (which wrote a failed record per point, exit 1, and a summary line that read like a finished study)."""
    results = tmp_path / "results"
    argv = ["--device", "cpu", "--processes", "1,2", "--results-dir", str(results), "--", "--lr", "0.1", "--bogus", "3"]
    assert run_main(SCALING, argv) == 2
    captured = capsys.readouterr()
    assert captured.err == ("error: the training (labs/lab01_dp_vs_ddp/04_ddp_training.py) refuses its flags: "
                            "unrecognized arguments: --bogus 3\n"), captured.err
    assert "scaling study" not in captured.out and not results.exists()


@pytest.mark.parametrize("extra, flag", [(["--batch-size", "4"], "--batch-size"), (["--epochs=5"], "--epochs"),
                                         (["--results-dir", "elsewhere"], "--results-dir"),
                                         (["--dry-run"], "--dry-run")])
def test_a_flag_the_study_sets_itself_after_dashdash_is_one_line(tmp_path, capsys, extra, flag):
    """A flag after -- that the study sets for every point came last and won: '-- --batch-size 4' trained at batch 4
    under records that said 32, and '-- --results-dir X' wrote the training's record to X and ended in a traceback
    ('expected one record ..., found 0'). Now one error line, exit 2, before any point runs."""
    results = tmp_path / "results"
    argv = ["--device", "cpu", "--processes", "1", "--results-dir", str(results), "--", "--lr", "0.1", *extra]
    assert run_main(SCALING, argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: {flag} after --: ") and captured.err.count("\n") == 1, captured.err
    assert "scaling study" not in captured.out and not results.exists()


# --- real runs ---------------------------------------------------------------------------------------

def _records(folder: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]


class Job:
    """One run: a process (the scaling study) or the ranks of a distributed script started as torchrun
    would start them (RANK, WORLD_SIZE, MASTER_ADDR/PORT), without torchrun's own process."""

    def __init__(self, command: list[str], env: dict[str, str], folder: Path, ranks: int = 0) -> None:
        self.processes = []
        port = free_port()
        for rank in range(max(ranks, 1)):
            rank_env = env if ranks == 0 else {**env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                               "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                                               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            self.processes.append(subprocess.Popen(command, cwd=folder, env=rank_env, text=True,
                                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT))

    def wait(self) -> tuple[int, str]:
        outputs = [process.communicate(timeout=600)[0] for process in self.processes]
        return max(process.returncode for process in self.processes), "".join(outputs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every real run, started together; their records and output by name."""
    env = script_env()
    folders = {name: tmp_path_factory.mktemp(name) for name in ("bench2", "bench4", "scaling", "overlap")}
    jobs = {
        "bench2": Job([PYTHON, str(REPO / BENCH), *BENCH_ARGS, "--results-dir", str(folders["bench2"])], env,
                      folders["bench2"], ranks=2),
        "bench4": Job([PYTHON, str(REPO / BENCH), *BENCH_ARGS, "--site", "lanta", "--results-dir",
                       str(folders["bench4"])], env, folders["bench4"], ranks=4),  # a GPU site's links: not on a CPU
        "scaling": Job([PYTHON, str(REPO / SCALING), "--device", "cpu", "--processes", "1,2", "--epochs", "1",
                        "--max-steps", "3", "--batch-size", "8", "--dataset", "synthetic",
                        "--image-size", "8", "--target-accuracy", "0", "--results-dir", str(folders["scaling"]),
                        "--", "--synthetic-size", "64", "--warmup-steps", "1"],
                       env, folders["scaling"]),
        "overlap": Job([PYTHON, str(REPO / OVERLAP), "--device", "cpu", "--model", "resnet18", "--image-size", "16",
                        "--batch-size", "2", "--bucket-cap-mb", "1,1000", "--repeats", "2", "--warmup-steps", "1",
                        "--results-dir", str(folders["overlap"])], env, folders["overlap"], ranks=2),
    }
    outputs = {}
    for name, job in jobs.items():
        status, outputs[name] = job.wait()
        assert status == 0, f"{name} exited {status}\n{outputs[name][-4000:]}"
    return {"records": {name: _records(folder) for name, folder in folders.items()}, "outputs": outputs,
            "folders": folders}


@pytest.mark.parametrize("name", ["bench2", "bench4"])
def test_cpu_bandwidth_run_records_every_size_with_busbw_and_the_memcpy_reference(runs, name):
    ranks = int(name[-1])
    records = {record["method"]: record for record in runs["records"][name]}
    assert sorted(records) == ["all_gather", "all_reduce", "reduce_scatter"]
    for collective, record in records.items():
        metrics = record["metrics"]
        assert metrics["world_size"] == ranks and metrics["nodes"] == 1
        assert metrics["bus_factor"] == pytest.approx(shared.bus_factor(collective, ranks))
        reference = metrics["reference"]
        assert reference["kind"] == "memcpy" and reference["gb_per_s"] > 0 and "copy_" in reference["source"]
        sizes = metrics["sizes"]
        # S splits into n equal chunks of float32: 1 KiB over 4 ranks is 64 elements each.
        assert [row["bytes"] for row in sizes] == SIZES
        for row in sizes:
            assert row["correct"] is True and row["time_s"] > 0
            algbw, busbw = shared.bandwidths(collective, row["bytes"], row["time_s"], ranks)
            assert row["algbw_gbps"] == pytest.approx(algbw) and row["busbw_gbps"] == pytest.approx(busbw)
            assert row["busbw_pct_of_reference"] == pytest.approx(100 * busbw / reference["gb_per_s"])
        assert metrics["transport"]["summary"].startswith("Gloo: TCP over the loopback interface")
        assert len(record["provenance"]["placement"]) == ranks
    output = runs["outputs"][name]
    assert "transport: Gloo" in output and "reference: memory copy of this machine" in output
    said = "note: on a CPU the reference is this machine's memory copy, not --site lanta's links"
    assert runs["outputs"][name].count(said) == (1 if name == "bench4" else 0)


def test_scaling_study_writes_strong_and_weak_points_at_one_and_two_processes(runs):
    records = runs["records"]["scaling"]
    points = sorted((r["config"]["mode"], r["metrics"]["world_size"], r["metrics"]["per_process_batch_size"])
                    for r in records)
    # strong: global batch 8 split over the processes; weak: 8 per process. One run serves both at 1 process.
    assert points == [("strong", 1, 8), ("strong", 2, 4), ("weak", 1, 8), ("weak", 2, 8)]
    one = [r for r in records if r["metrics"]["world_size"] == 1]
    assert one[0]["metrics"]["training_run_id"] == one[1]["metrics"]["training_run_id"]
    assert len({r["metrics"]["training_run_id"] for r in records}) == 3
    for record in records:
        metrics = record["metrics"]
        assert record["lab"] == "lab05" and record["status"] == "ok"
        assert metrics["samples_per_s"] > 0 and metrics["global_batch_size"] == 8 * (
            metrics["world_size"] if record["config"]["mode"] == "weak" else 1)
        assert metrics["evaluations"] and metrics["time_to_target_s"] == metrics["evaluations"][0]["elapsed_s"]
        assert record["config"]["training_script"] == "labs/lab01_dp_vs_ddp/04_ddp_training.py"
    # Strong scaling splits the same global batches: the same maths up to rounding, so the same losses at first.
    strong = {r["metrics"]["world_size"]: r["metrics"] for r in records if r["config"]["mode"] == "strong"}
    assert len(strong[1]["loss_at_step"]) == 3
    np.testing.assert_allclose(strong[2]["loss_at_step"], strong[1]["loss_at_step"], rtol=1e-4, atol=1e-5)
    # 1 process: plain python; 2 processes: torchrun, as a student would start them.
    assert runs["outputs"]["scaling"].count("torch.distributed.run --standalone --nproc_per_node=2") == 2


def test_the_study_sent_sigterm_stops_its_point_and_removes_its_scratch_folder(tmp_path):
    """``kill`` or a job's time limit (SIGTERM) while a point trains: the study used to die at once, its
    /tmp/lab05_scaling_* folder left behind and the point training on alone. Now the point is stopped and reaped,
    the folder removed, and the study says so (exit 143)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    command = [PYTHON, str(REPO / SCALING), "--device", "cpu", "--processes", "1", "--modes", "strong", "--epochs",
               "1000", "--dataset", "synthetic", "--image-size", "8", "--results-dir", str(tmp_path / "results")]
    status, output, left, running = terminate_when(command, "[1p strong] ", str(tmp_path),
                                                   script_env(TMPDIR=str(scratch)),
                                                   lambda: list(scratch.glob("lab05_scaling_*")))
    assert len(running) == 1 and left == [], (running, left)  # its scratch folder while the point ran; no point now
    assert status == 143 and output.strip().splitlines()[-1] == "terminated (SIGTERM)", output
    assert not list(scratch.glob("lab05_scaling_*")) and not (tmp_path / "results").exists()


def test_overlap_measures_exposed_communication_for_every_bucket_size(runs):
    (record,) = runs["records"]["overlap"]
    buckets = record["metrics"]["buckets"]
    assert [b["bucket_cap_mb"] for b in buckets] == [1.0, 1000.0]
    # resnet18's 11.7 M gradients (44.7 MB): buckets of at most 1 MiB (a larger tensor gets one of its own);
    # at 1000 MiB all in one bucket.
    assert buckets[0]["buckets"] > 5 and buckets[1]["buckets"] == 1
    for b in buckets:
        assert b["step_s"] > 0 and b["no_sync_step_s"] > 0 and b["comm_alone_s"] > 0
        assert b["exposed_comm_s"] == pytest.approx(b["step_s"] - b["no_sync_step_s"])
        assert b["exposed_is_noise"] is (b["exposed_comm_s"] <= b["timing_spread_s"])
        raw = 1 - b["exposed_comm_s"] / b["comm_alone_s"]
        assert b["hidden_fraction_unclamped"] == pytest.approx(raw)
        assert b["hidden_fraction"] == pytest.approx(min(1.0, max(0.0, raw)))  # 0-100%, whatever the machine did
        assert (b["hidden_clamped_because"] is not None) is not (0 <= raw <= 1)
    assert re.search(r"note: least exposed communication with bucket_cap_mb=", runs["outputs"]["overlap"])
    shown = [int(percent) for percent in re.findall(r"(-?\d+)%", runs["outputs"]["overlap"])]
    assert shown and all(0 <= percent <= 100 for percent in shown), shown  # never 303%, never -40%


def test_overlap_keeps_hidden_within_0_to_100_percent_and_calls_a_small_exposed_time_noise():
    overlap = load_script(OVERLAP)
    ms = [0.001 * t for t in range(10, 14)]  # 10, 11, 12, 13 ms: interquartile range 1.5 ms
    # Synchronised steps 2 ms slower than without, all-reduce alone 4 ms: half of it hid.
    plain = overlap.overlap_figures([t + 0.002 for t in ms], ms, 0.004)
    assert plain["exposed_comm_s"] == pytest.approx(0.002) and plain["timing_spread_s"] == pytest.approx(0.0015)
    assert plain["exposed_is_noise"] is False and plain["hidden_fraction"] == pytest.approx(0.5)
    assert plain["hidden_clamped_because"] is None
    # 1 ms slower with sync, inside the 1.5 ms spread: a real-looking share, but noise.
    small = overlap.overlap_figures([t + 0.001 for t in ms], ms, 0.004)
    assert small["exposed_is_noise"] is True and small["hidden_fraction"] == pytest.approx(0.75)
    # The step with sync 1 ms *faster*: within the spread, noise; 1 - (-1/4) = 125% is clamped to 100%.
    faster = overlap.overlap_figures([t - 0.001 for t in ms], ms, 0.004)
    assert faster["exposed_is_noise"] is True and faster["hidden_fraction"] == 1.0
    assert faster["hidden_fraction_unclamped"] == pytest.approx(1.25)
    assert "no slower" in faster["hidden_clamped_because"]
    # 10 ms exposed for a 4 ms all-reduce (a CPU's Gloo threads slowing backward down): none hid, not -150%.
    slower = overlap.overlap_figures([t + 0.010 for t in ms], ms, 0.004)
    assert slower["exposed_is_noise"] is False and slower["hidden_fraction"] == 0.0
    assert "more time than the communication costs alone" in slower["hidden_clamped_because"]


def test_overlap_on_one_rank_says_there_is_nothing_to_overlap_and_times_nothing(tmp_path, capsys):
    assert run_main(OVERLAP, ["--device", "cpu", "--model", "resnet18", "--image-size", "16", "--batch-size", "2",
                              "--repeats", "2", "--warmup-steps", "1", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and "placement" in out[0] and out[2].startswith("record: "), out
    assert out[1].startswith("overlap: 1 rank, backend gloo: ") and "no communication to overlap" in out[1]
    (record,) = _records(tmp_path)
    assert record["metrics"]["buckets"] == []
    assert "no communication to overlap" in record["metrics"]["nothing_to_overlap"]
    assert record["notes"] == [record["metrics"]["nothing_to_overlap"]] and "%" not in json.dumps(record["metrics"])


def test_every_record_has_an_energy_entry_and_says_why_when_it_is_unavailable(runs):
    records = [record for group in runs["records"].values() for record in group]
    assert len(records) == 3 + 3 + 4 + 1
    for record in records:
        energy = record["energy"]
        assert energy["status"] in ("ok", "unavailable"), record["method"]
        if energy["status"] == "ok":
            assert energy["joules"] >= 0 and energy["source"]
        else:
            assert energy["joules"] is None and energy["reason"]
    overlap = runs["records"]["overlap"][0]["energy"]
    assert set(overlap["sources"]) >= {"nvml", "rapl", "slurm"}  # rank 0 tried every source
    assert overlap["sources"]["nvml"] == {"status": "unavailable", "reason": "no GPU in this run"}


def test_the_report_s_overlap_table_says_noise_and_marks_a_clamped_share_as_the_script_does(tmp_path):
    """What 03_overlap.py prints, "noise" and "0%*", the report's table shows too, the reason on hover."""
    from common.report.labs.lab05 import overlap_section
    from common.report.runs import runs_frame
    from common.report.sections import SectionContext
    from common.results import make_record, provenance

    overlap = load_script(OVERLAP)
    ms = [0.001 * t for t in range(10, 14)]
    buckets = [{"bucket_cap_mb": cap, "buckets": 3, "step_s": 0.012, "no_sync_step_s": 0.011, "comm_alone_s": 0.004,
                **overlap.overlap_figures([t + shift for t in ms], ms, 0.004)} for cap, shift in ((1, -0.001),
                                                                                                  (25, 0.010))]
    record = make_record(lab="lab05", script=OVERLAP, method="overlap", config={"model": "resnet18"},
                         metrics={"buckets": buckets, "world_size": 2}, provenance=provenance(world_size=2))
    section = overlap_section(SectionContext(runs=runs_frame([record]), all_runs=runs_frame([record]), plots=False))
    (table,) = section.tables
    cells = [dict(zip(table.columns, row)) for row in table.rows]
    assert [row["exposed comm. (ms)"].text for row in cells] == ["noise", "10.0"]
    assert [row["hidden"].text for row in cells] == ["100%*", "0%*"]
    assert "no slower" in cells[0]["hidden"].title and "more time than" in cells[1]["hidden"].title


def test_the_report_shows_bandwidth_both_scaling_curves_and_overlap(runs, tmp_path):
    from common.report import build_report

    folder = tmp_path / "all"
    folder.mkdir()
    for source in runs["folders"].values():
        for path in source.glob("*.json"):
            (folder / path.name).write_text(path.read_text())
    with contextlib.redirect_stderr(io.StringIO()):
        outcome = build_report(folder, plots=True)
    html = outcome.report_path.read_text()
    for title in ("Lab 05: bus bandwidth against the link&#39;s peak", "Lab 05: strong and weak scaling",
                  "Lab 05: communication hidden behind backward", "Energy"):
        assert title in html, title
    assert html.count('alt="Throughput and scaling efficiency against processes') == 1
    assert html.count('alt="Bus bandwidth against message size') == 2  # 2 and 4 ranks
    scaling = html[html.index('<section id="lab-05-strong-and-weak-scaling">'):
                   html.index('<section id="lab-05-communication-hidden-behind-backward">')]
    rows = re.findall(r"<tr[^>]*>\s*<td[^>]*>(strong|weak)</td>\s*<td[^>]*>(\d)</td>", scaling)
    assert sorted(rows) == [("strong", "1"), ("strong", "2"), ("weak", "1"), ("weak", "2")]
    assert "memory copy of this machine (measured)" in html


def test_the_bandwidth_benchmark_on_one_rank_says_there_is_no_link_and_leaves_no_gloo_thread(tmp_path):
    """In-process, one rank: no bus bandwidth of 0 and no "unknown" transport, one line instead; the
    process group and its Gloo threads are gone when main() returns."""
    def gloo_threads() -> set[int]:
        """The Gloo threads of this process, by thread id: other tests in this process may have left some."""
        found = set()
        for task in Path("/proc/self/task").iterdir():
            try:
                if Path(task, "comm").read_text().startswith(("pt_gloo", "gloo_tcp")):
                    found.add(int(task.name))
            except OSError:  # a thread that ended while we looked
                pass
        return found

    before = gloo_threads()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run_main(BENCH, ["--device", "cpu", "--dry-run", "--memcpy-repeats", "1",
                                "--results-dir", str(tmp_path)]) == 0
    assert gloo_threads() <= before, f"Gloo threads the run started and left: {gloo_threads() - before}"
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "placement" in lines[0], lines
    assert lines[1].startswith("bandwidth: 1 rank, backend gloo: there is no link to measure"), lines
    assert "busbw" not in out.getvalue() and "transport:" not in out.getvalue()
    assert _records(tmp_path) == []  # nothing was timed


@pytest.mark.gpu
def test_on_gpus_nccl_reports_its_transport_and_nvml_the_energy(tmp_path):
    """On a GPU node (skipped elsewhere): every visible GPU (up to 4) all-reduces through NCCL. One GPU
    has no link to measure: one line, and no record of bandwidths that would all be 0."""
    import torch

    ranks = min(torch.cuda.device_count(), 4)
    env = script_env()
    job = Job([PYTHON, str(REPO / BENCH), "--device", "cuda", "--collectives", "all_reduce", "--max-bytes", "64M",
               "--repeats", "5", "--results-dir", str(tmp_path)], env, tmp_path, ranks=ranks)
    status, output = job.wait()
    assert status == 0, output[-4000:]
    if ranks == 1:
        assert "bandwidth: 1 rank, backend nccl: there is no link to measure" in output, output[-4000:]
        assert _records(tmp_path) == []
        return
    (record,) = _records(tmp_path)
    metrics = record["metrics"]
    assert metrics["sizes"][-1]["bytes"] == 64 * 2**20 and all(row["correct"] for row in metrics["sizes"])
    assert metrics["transport"]["backend"] == "nccl"
    assert metrics["transport"]["nccl"]["via"], metrics["transport"]
    assert metrics["sizes"][-1]["busbw_gbps"] > 1
    nvml = record["energy"]["sources"]["nvml"]
    assert nvml["status"] == "ok" or "energy counter" in nvml["reason"], nvml
