"""Lab-09 without Slurm: sweep files become a fixed list of tasks, bad input is one line with nothing
written, and a sweep run here (one task after another) leaves each task's record and TensorBoard
curves in its own folder, the curves equal to the record's numbers, ranked in the report.

The job array, the resubmission, the chain, the pipeline and submitit run on the Slurm test cluster
(tests/slurm/test_lab09_many_jobs.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import os
import signal
import subprocess
from pathlib import Path

import pytest

from common.errors import Terminated, UserError
from helpers import PYTHON, REPO, load_script, run_main, run_script, script_env, terminate_when

LAB = "labs/lab09_many_jobs"
SWEEP = f"{LAB}/01_sweep.py"
STATUS = f"{LAB}/02_status.py"
shared = load_script(f"{LAB}/lab09_shared.py")
SWEEPS = REPO / LAB / "sweeps"


def slurm_stand_ins(folder: Path, **bodies: str) -> Path:
    """``folder`` (made if needed) with an executable stand-in per Slurm command, ``sbatch="echo 4242"``: a ``sh``
    script of that body; the folder, to put first on PATH."""
    folder.mkdir(exist_ok=True)
    for name, body in bodies.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return folder

def test_a_sweep_file_expands_into_the_same_tasks_every_time_in_toml_and_yaml(tmp_path):
    tasks = shared.expand(shared.read_sweep_file(SWEEPS / "random.yaml"), SWEEPS / "random.yaml")
    assert len(tasks) == 2 * 3 * 2  # batch sizes x random draws x seeds
    assert [t.index for t in tasks] == list(range(12))
    again = shared.expand(shared.read_sweep_file(SWEEPS / "random.yaml"), SWEEPS / "random.yaml")
    assert [t.argv() for t in again] == [t.argv() for t in tasks]  # the draws come from the sweep's seed
    assert {t.flags["batch-size"] for t in tasks[:6]} == {32} and {t.flags["batch-size"] for t in tasks[6:]} == {64}
    assert all(0.1 <= t.flags["lr"] <= 2.0 for t in tasks)
    assert [t.seed for t in tasks[:2]] == [1, 2] and tasks[0].flags == tasks[1].flags  # one config, two seeds
    # The same sweep written as TOML is the same sweep (same id, same tasks).
    toml = tmp_path / "random.toml"
    toml.write_text('script = "chapters/ch04_deep_learning/mnist_training.py"\nseed = 7\nseeds = [1, 2]\n'
                    '[fixed]\ndataset = "digits"\nepochs = 3\n[grid]\nbatch-size = [32, 64]\n'
                    '[random]\nsamples = 3\nlr = {log-uniform = [0.1, 2.0]}\ngamma = [0.7, 0.9]\n')
    from_toml = shared.read_sweep_file(toml)
    assert shared.sweep_id(from_toml) == shared.sweep_id(shared.read_sweep_file(SWEEPS / "random.yaml"))
    assert [t.argv() for t in shared.expand(from_toml, toml)] == [t.argv() for t in tasks]
    assert tasks[0].argv()[:4] == ["--dataset", "digits", "--epochs", "3"] and tasks[0].argv()[-2:] == ["--seed", "1"]
    assert shared.compress([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert shared.expand_indices("[0-2,5,7-8%4]") == [0, 1, 2, 5, 7, 8]
    assert shared.expand_indices("[1-7:2,10%2]") == [1, 3, 5, 7, 10]  # a step, as sbatch --array=1-7:2 takes it


def write_sweep(folder: Path, text: str) -> Path:
    path = folder / "bad.toml"
    path.write_text('script = "chapters/ch04_deep_learning/mnist_training.py"\n' + text)
    return path


@pytest.mark.parametrize(("body", "message"), [
    ('[grid]\nlrr = [0.1, 1.0]\n',
     r"error: task 0 \(--lrr 0.1 --seed 1\): chapters/ch04_deep_learning/mnist_training.py says: "
     r"unrecognized arguments: --lrr 0.1"),
    ('[grid]\nlr = []\n', "error: .*bad.toml: the grid's 'lr' has no values .*: the sweep would have no run"),
    ('[fixed]\nepochs = 1\n', "error: .*bad.toml: the grid is empty and there is no \\[random\\] table"),
    ('[grid]\nresults-dir = ["a", "b"]\n', "error: .*sets results-dir, which each task sets itself"),
    ('speed = 3\n[grid]\nlr = [1]\n', "error: .*bad.toml: unknown key\\(s\\) speed"),
    ('[grid]\nlr = [1]\n[random]\nsamples = 3\n',  # three alike tasks
     "error: .*bad.toml: \\[random\\] has samples = 3 but no flag to draw"),
    ('seed = "abc"\n[grid]\nlr = [1]\n', "error: .*bad.toml: 'seed' must be a whole number, got 'abc'"),  # 'seeds'
])
def test_bad_sweep_input_is_one_line_and_exit_2_with_nothing_written(tmp_path, body, message):
    sweep_dir = tmp_path / "sweep"
    done = run_script(SWEEP, str(write_sweep(tmp_path, body)), "--sweep-dir", str(sweep_dir), "--local")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert re.match(message, done.stderr), done.stderr
    assert not sweep_dir.exists()


@pytest.mark.parametrize(("body", "message"), [
    ("[grid]\nlr = [0.1, 0.01, 0.1]\n", "the grid's 'lr' lists 0.1 more than once: those tasks would be the same run"),
    ("[grid]\nepochs = [1, 2]\nlr = [1, 1.0]\n", "the grid's 'lr' lists 1.0 more than once"),  # --lr 1 is --lr 1.0
    ("seeds = [1, 2, 1]\n[grid]\nlr = [0.1]\n", r"'seeds' lists a seed more than once \(\[1, 2, 1\]\)"),
])
def test_a_sweep_that_would_run_one_task_twice_is_refused(tmp_path, body, message):
    """A value typed twice (a copy-paste) planned two identical runs: refused before anything is written (the
    test above shows that such a refusal is one line, exit 2)."""
    with pytest.raises(UserError, match=message):
        shared.expand(shared.read_sweep_file(write_sweep(tmp_path, body)), tmp_path / "bad.toml")


def test_a_sweep_of_a_script_without_build_parser_is_one_line_and_nothing_written(tmp_path, capsys):
    """The flags are checked by the named script's own parser, loaded into the sweep's process: a script that has
    none (here a shared module) cannot check them, and says so in one line before anything is written."""
    sweep = tmp_path / "noparser.toml"
    sweep.write_text('script = "labs/lab09_many_jobs/lab09_shared.py"\n[grid]\nlr = [0.1]\n')
    assert run_main(SWEEP, [str(sweep), "--sweep-dir", str(tmp_path / "sweep"), "--local"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert ("labs/lab09_many_jobs/lab09_shared.py could not check the flags (does it have build_parser()?): "
            "AttributeError") in err, err
    assert not (tmp_path / "sweep").exists()


def test_the_flag_check_parses_each_task_as_it_runs_not_the_defaults_the_sweep_replaces(tmp_path, monkeypatch):
    """From a copy of the course where ./results cannot be made (read-only, or here a file of that name), the
    training's default --results-dir is refused, but a task never uses it: the sweep gives each its own folder, so
    the check passes; a bad flag after -- is still refused, naming the task."""
    plan = shared.prepare_folder(tmp_path / "sweep", SWEEPS / "tiny.toml")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").write_text("a file where the default results folder would be\n")
    assert shared.check_with_script(plan, ["--device", "cpu"]) >= 0
    with pytest.raises(UserError, match=r"^task 0 \(.*--num-workers -1\): .*mnist_training.py says: argument "
                                        r"--num-workers"):
        shared.check_with_script(plan, ["--num-workers", "-1"])


def test_a_demonstration_fault_ends_its_task_with_status_3_and_records_the_attempt(tmp_path, monkeypatch, capsys):
    """faults.toml's task 1 fails on purpose on its first attempt: exit status 3 and an attempt that ended (it raised
    UnboundLocalError there, which made the array task exit 1 and a --local sweep stop at task 1); the second attempt
    trains normally. The training is a stand-in that exits 0 at once."""
    plan = shared.prepare_folder(tmp_path / "faults", SWEEPS / "faults.toml")
    shared.write_plan(plan)
    plan.add_submission("local", "local", [0, 1, 2])
    monkeypatch.setattr(shared, "task_command", lambda plan, index, extra=(): [PYTHON, "-c", "pass"])
    assert shared.run_task(plan, 1) == 3
    assert "task 1: demonstration fault: failing after 3 step(s)" in capsys.readouterr().out
    assert run_main(STATUS, ["--sweep-dir", str(plan.folder)]) == 0  # the status says what to do next
    assert ("task(s) 1 did not complete and task(s) 0, 2 have not run: 01_sweep.py --local with the same sweep goes on"
            in capsys.readouterr().out)
    assert shared.run_task(plan, 1) == 0
    attempts = shared.local_attempts(plan.task_dir(1))
    assert [(a["attempt"], a["exit"]) for a in attempts if "ended" in a] == [(1, 3), (2, 0)]


def test_a_refused_submission_names_the_placeholder_account_when_the_script_holds_it(tmp_path):
    script = tmp_path / "sweep_array.sbatch"
    refused = subprocess.CompletedProcess(["sbatch", "--parsable", str(script)], 1, "",
                                          "sbatch: error: Batch job submission failed: Invalid account\n")
    for account, hinted in (("edit-me", True), ("proj0042", False)):
        script.write_text(f"#!/bin/bash\n#SBATCH --account={account}  # the project\n")
        with pytest.raises(UserError) as refusal:
            shared.submitted_job_id(refused)
        assert str(refusal.value).startswith("sbatch refused the job: sbatch: error: Batch job submission failed")
        assert ("placeholder 'edit-me': set account: in that profile" in str(refusal.value)) is hinted


def test_a_local_sweep_with_a_stall_fault_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """faults.toml --local ran task 2, which stalls 'until the time limit' that nothing here sets: it hung for ever."""
    monkeypatch.setattr(load_script(SWEEP), "run_task", lambda *a, **k: pytest.fail("a task ran"))
    folder = tmp_path / "faults"
    assert run_main(SWEEP, [str(SWEEPS / "faults.toml"), "--sweep-dir", str(folder), "--local"]) == 2
    err = capsys.readouterr().err
    assert "[faults] stall waits for a Slurm time limit, and --local has none" in err and err.count("\n") == 1, err
    assert not folder.exists()


@pytest.mark.parametrize("how", [[], ["--plan"], ["--task", "0"]])
def test_device_without_local_is_one_line_not_ignored(how, tmp_path, monkeypatch, capsys):
    """A submitted (or planned) sweep's tasks train on their job's device: --device cuda there was silently dropped."""
    monkeypatch.setattr(load_script(SWEEP), "run_task", lambda *a, **k: pytest.fail("a task ran"))
    folder = tmp_path / "sweep"
    assert run_main(SWEEP, [str(SWEEPS / "tiny.toml"), "--sweep-dir", str(folder), "--device", "cuda", *how]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device is where --local runs train; a submitted task trains on its job's") and \
        "leave --device cuda out, or run here with --local\n" in err and err.count("\n") == 1, err
    assert not folder.exists()


@pytest.mark.parametrize("flag", [["--time", "1"], ["--hold"], ["--parallel", "2"], ["--site", "lanta"]])
def test_a_job_array_setting_with_local_is_one_line_not_ignored(flag, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(load_script(SWEEP), "run_task", lambda *a, **k: pytest.fail("a task ran"))
    folder = tmp_path / "sweep"
    assert run_main(SWEEP, [str(SWEEPS / "tiny.toml"), "--sweep-dir", str(folder), "--local", *flag]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {flag[0]} is a setting of the job array: --local ignores it\n", err
    assert not folder.exists()


def test_a_bad_flag_after_the_double_dash_is_one_line_before_anything_is_written(tmp_path, capsys):
    """The flags after -- go to every run: the training's parser checks them with the sweep's own (they ran, and
    every task failed, attempts written, exit 1)."""
    folder = tmp_path / "sweep"
    assert run_main(SWEEP, [str(SWEEPS / "tiny.toml"), "--sweep-dir", str(folder), "--local", "--device", "cpu",
                            "--", "--num-workers", "-1"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: the flags after -- (--num-workers -1): chapters/ch04_deep_learning/mnist_training.py says: "
                   "argument --num-workers: must be at least 0, got -1\n"), err
    assert not folder.exists()


@pytest.mark.parametrize("extra", [["--lr", "0.1"], ["--seed=4"], ["--results", "elsewhere"]])
def test_a_flag_after_the_double_dash_that_a_task_sets_itself_is_refused(tmp_path, capsys, extra):
    """After --, a value the sweep varies, the seed or a folder flag (any spelling the parser takes) would replace
    the task's own in every task: the runs of a sweep would all train alike, or write into one folder. A flag the
    sweep file fixes for every task may be changed there (the next test shortens the tiny sweep so)."""
    folder = tmp_path / "sweep"
    assert run_main(SWEEP, [str(SWEEPS / "tiny.toml"), "--sweep-dir", str(folder), "--local", "--device", "cpu",
                            "--", *extra]) == 2
    err = capsys.readouterr().err
    flag = {"--lr": "--lr", "--seed=4": "--seed", "--results": "--results-dir"}[extra[0]]
    assert err.startswith(f"error: each task sets {flag} itself") and err.count("\n") == 1, err
    assert not folder.exists()


def test_a_task_that_does_not_exist_is_one_line_and_writes_no_folder(tmp_path, capsys):
    folder = tmp_path / "sweep"
    assert run_main(SWEEP, [str(SWEEPS / "tiny.toml"), "--sweep-dir", str(folder), "--task", "2"]) == 2
    assert capsys.readouterr().err == "error: task 2 does not exist: this sweep has tasks 0-1\n"
    assert not folder.exists()


def test_a_site_that_does_not_exist_is_one_line_for_the_plan_too(tmp_path, capsys):
    """--plan printed 'would submit: ... (site lantaa)' for a misspelt --site."""
    folder = tmp_path / "sweep"
    assert run_main(SWEEP, [str(SWEEPS / "tiny.toml"), "--sweep-dir", str(folder), "--plan", "--site", "lantaa"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown site 'lantaa' (known sites: ") and err.count("\n") == 1, err
    assert not folder.exists()


@pytest.mark.parametrize("script", ["01_sweep.py", "03_chain.py", "04_pipeline.py"])
def test_a_time_limit_slurm_does_not_read_is_one_line_when_the_flags_are_parsed(script, tmp_path, capsys):
    """--time abc was taken (--plan printed the runs) and only sbatch refused it, at the submission."""
    folder = tmp_path / "out"
    where = ["--run-dir", str(folder)] if script == "03_chain.py" else [str(SWEEPS / "tiny.toml"), "--sweep-dir",
                                                                       str(folder)]
    for bad in ("abc", "1:2:3:4", "1-", "30m", "-1"):
        assert run_main(f"{LAB}/{script}", [*where, *(["--plan"] if script == "01_sweep.py" else []),
                                            f"--time={bad}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: argument --time: not a Slurm time: '{bad}'; give minutes, MM:SS, HH:MM:SS") \
            and err.count("\n") == 1, err
        assert not folder.exists()
    for good in ("30", "30:00", "01:30:00", "2-12", "2-12:30", "2-12:30:00"):
        assert shared.slurm_time(good) == good


def test_a_sweep_folder_of_another_sweep_is_refused_before_anything_is_written(tmp_path, capsys):
    folder = tmp_path / "sweep"
    plan = shared.prepare_folder(folder, SWEEPS / "tiny.toml")
    shared.write_plan(plan)
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    assert run_main(SWEEP, [str(SWEEPS / "faults.toml"), "--sweep-dir", str(folder), "--plan"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {folder} holds another sweep ({plan.sweep_id}, from ") and err.count("\n") == 1
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert run_main(SWEEP, [str(SWEEPS / "tiny.toml"), "--sweep-dir", str(other), "--plan"]) == 2
    assert "is not a sweep folder (no plan.yaml)" in capsys.readouterr().err


#: The end of an sbatch stand-in for the pipeline: the array is job 4242, evaluate 4243, report 4244.
PIPELINE_JOB_IDS = "case \"$*\" in\n  *evaluate*) echo 4243 ;;\n  *report*) echo 4244 ;;\n  *) echo 4242 ;;\nesac"


def test_the_pipeline_sent_sigterm_stops_the_sweep_it_runs_before_it_submits(tmp_path):
    """``kill`` on the pipeline while its sweep checked and submitted the array killed the pipeline alone: the sweep
    went on and submitted the array, with no evaluate or report after it. Now the sweep stops with it: nothing
    submitted, 'terminated (SIGTERM)', exit 143. Slurm's commands here are stand-ins; scontrol, asked for the cluster's
    array limit before any sbatch, sends the pipeline the kill and answers only 10 s later, so the kill always lands
    before the sweep could submit, on any machine (a sweep left running would answer and submit, alone)."""

    pipeline = "$(cut -d' ' -f4 /proc/$PPID/stat)"  # the sweep's parent
    tools = slurm_stand_ins(tmp_path / "bin", scontrol=f"kill -TERM {pipeline}\nsleep 10\necho 'MaxArraySize = 1001'",
                            sbatch=f"echo \"$@\" >> {tmp_path}/sbatch_calls\necho 4242")
    folder = tmp_path / "sweep"
    done = run_script(f"{LAB}/04_pipeline.py", str(SWEEPS / "tiny.toml"), "--sweep-dir", str(folder),
                      env=script_env(PATH=f"{tools}:{os.environ['PATH']}"))  # its output ends when the sweep's does
    out = done.stdout + done.stderr
    assert done.returncode == 143, out[-3000:]
    assert done.stdout.rstrip().endswith("pipeline stopped by SIGTERM before it submitted anything"), out[-3000:]
    assert done.stderr.rstrip().endswith("terminated (SIGTERM)"), out[-3000:]
    assert "submitted the sweep" not in out and not (tmp_path / "sbatch_calls").exists(), out[-3000:]


@pytest.mark.parametrize(("killed_in", "said"), [
    ("evaluate", "submitted train = array job 4242, evaluate = job 4243 (not report); cancel them: scancel 4242 4243"),
    ("sweep_array", "submitted train = array job 4242 (not evaluate, report); cancel them: scancel 4242")])
def test_the_pipeline_sent_sigterm_between_its_submissions_names_the_jobs_it_submitted(tmp_path, killed_in, said):
    """``kill`` on the pipeline after it had submitted the array, while it submitted the evaluate job, killed it at
    once: a pipeline half in the queue, and no word of which jobs. Now it waits for that sbatch, submits nothing
    more and says in one line which jobs it submitted and how to cancel them; exit 143. Killed while its sweep's
    sbatch submits the array, it names the array that sweep waited for and recorded. The sbatch stand-in sends the
    pipeline the SIGTERM as it submits ``killed_in``'s job."""
    pipeline = "$PPID" if killed_in == "evaluate" else "$(cut -d' ' -f4 /proc/$PPID/stat)"  # the sweep's parent
    tools = slurm_stand_ins(tmp_path / "bin", scontrol="echo 'MaxArraySize = 1001'",
                            sbatch=f"echo \"$@\" >> {tmp_path}/sbatch_calls\n"
                                   f"case \"$*\" in *{killed_in}*) kill -TERM {pipeline}; sleep 1 ;; esac\n"
                                   + PIPELINE_JOB_IDS)
    folder = tmp_path / "sweep"
    done = run_script(f"{LAB}/04_pipeline.py", str(SWEEPS / "tiny.toml"), "--sweep-dir", str(folder),
                      env=script_env(PATH=f"{tools}:{os.environ['PATH']}"))
    assert done.returncode == 143, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.rstrip().splitlines()[-1] == f"pipeline stopped by SIGTERM: {said}", done.stdout[-3000:]
    assert done.stderr.splitlines()[-1] == "terminated (SIGTERM)", done.stderr
    assert "report" not in (tmp_path / "sbatch_calls").read_text()


def test_the_pipeline_stopped_by_ctrl_c_names_the_jobs_it_submitted(tmp_path):
    """Ctrl-C (SIGINT) between the pipeline's submissions said only 'interrupted', with the array and the evaluate
    job in the queue. It now names them, and, since Ctrl-C reaches an sbatch under way too, says that the job it was
    submitting may be queued; exit 130. The sbatch stand-in sends SIGINT to the pipeline as it submits the report."""
    tools = slurm_stand_ins(tmp_path / "bin", scontrol="echo 'MaxArraySize = 1001'",
                            sbatch=f"echo \"$@\" >> {tmp_path}/sbatch_calls\n"
                                   "case \"$*\" in *report*) kill -INT $PPID; sleep 1 ;; esac\n"
                                   + PIPELINE_JOB_IDS)
    done = run_script(f"{LAB}/04_pipeline.py", str(SWEEPS / "tiny.toml"), "--sweep-dir", str(tmp_path / "sweep"),
                      env=script_env(PATH=f"{tools}:{os.environ['PATH']}"))
    assert done.returncode == 130, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.rstrip().splitlines()[-1] == (
        "pipeline stopped by Ctrl-C: submitted train = array job 4242, evaluate = job 4243 (not report); cancel them: "
        "scancel 4242 4243; Ctrl-C may have stopped sbatch after it submitted report: see squeue --me"), done.stdout
    assert done.stderr.splitlines()[-1] == "interrupted", done.stderr


def test_a_sweep_sent_sigterm_while_sbatch_submits_waits_for_it_and_records_the_array(tmp_path):
    """``kill`` on the sweep while sbatch submitted its array killed the sweep alone: sbatch went on and submitted an
    array that plan's submissions.jsonl never recorded. Now the sweep waits for sbatch, records the array, says so in
    one line with how to cancel it, and exits 143. The sbatch stand-in sends the SIGTERM itself, then answers."""
    tools = slurm_stand_ins(tmp_path / "bin", scontrol="echo 'MaxArraySize = 1001'",
                            sbatch="kill -TERM $PPID\nsleep 1\necho 4242")
    folder = tmp_path / "sweep"
    done = run_script(SWEEP, str(SWEEPS / "tiny.toml"), "--sweep-dir", str(folder),
                      env=script_env(PATH=f"{tools}:{os.environ['PATH']}"))
    assert done.returncode == 143, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.rstrip().splitlines()[-1] == ("SIGTERM came while sbatch submitted the sweep as array job 4242: "
                                                     "waited for it, it is in the queue; cancel it: scancel 4242"), (
        done.stdout[-3000:])
    assert done.stderr == "terminated (SIGTERM)\n"
    assert [s["job_id"] for s in shared.read_plan(folder).submissions()] == ["4242"]


@pytest.mark.parametrize("submits", ["resubmit", "chain", "submitit"])
def test_every_other_submission_sent_sigterm_waits_for_sbatch_and_names_the_job(submits, tmp_path, monkeypatch,
                                                                                capsys):
    """02_status.py --resubmit, 03_chain.py's first link and 05_submitit.py, killed while sbatch ran: the script died
    and sbatch went on, a job in the queue that no record or line named. Each now waits for sbatch (and records what
    it submitted), names the job and how to cancel it, and stops (exit 143). In this process: the sbatch stand-in sends
    it SIGTERM; where the script does not hold it back, a handler of the test's gets it and fails the test."""
    def not_held_back(*_):
        raise AssertionError("the script did not hold SIGTERM back while sbatch ran: it reached the test")

    previous = signal.signal(signal.SIGTERM, not_held_back)
    answer = "Submitted batch job 4242" if submits == "submitit" else "4242"
    tools = slurm_stand_ins(tmp_path / "bin", srun="exit 0", scontrol="echo 'MaxArraySize = 1001'",
                            sbatch=f"kill -TERM $PPID; sleep 0.5; echo '{answer}'")
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    folder = tmp_path / "sweep"
    try:
        if submits == "resubmit":
            plan = shared.prepare_folder(folder, SWEEPS / "tiny.toml")
            shared.write_plan(plan)
            status = load_script(f"{LAB}/02_status.py")
            failed = [type("Status", (), {"index": 1, "state": "FAILED"})()]
            with pytest.raises(Terminated):  # which run_main turns into 'terminated (SIGTERM)', exit 143
                status.resubmit(plan, failed)
            what, code = "the tasks as array job", 143
        elif submits == "chain":
            code = run_main(f"{LAB}/03_chain.py", ["--run-dir", str(tmp_path / "run"), "--", "--dataset", "digits"])
            what = "link 1 of the chain as job"
        else:
            code = run_main(f"{LAB}/05_submitit.py", [str(SWEEPS / "tiny.toml"), "--sweep-dir", str(folder)])
            what = "the sweep as array job"
    finally:
        signal.signal(signal.SIGTERM, previous)
    out = capsys.readouterr()
    assert code == 143, out
    assert out.out.rstrip().splitlines()[-1] == (f"SIGTERM came while sbatch submitted {what} 4242: waited for it, it "
                                                 "is in the queue; cancel it: scancel 4242"), out
    if submits != "chain":  # the chain keeps no record of its first link: the line is what names it
        assert [s["job_id"] for s in shared.read_plan(folder).submissions()] == ["4242"]


def test_the_pipeline_s_failed_list_of_a_folder_that_is_not_a_sweep_s_is_one_line(tmp_path, capsys):
    """Not there, or another folder (results/ itself): not 'no sweep record yet: the evaluate stage writes it'."""
    missing, other = tmp_path / "never-started", tmp_path / "results"
    other.mkdir()
    for folder in (missing, other):
        assert run_main(f"{LAB}/04_pipeline.py", ["--sweep-dir", str(folder), "--failed"]) == 2
        err = capsys.readouterr().err
        assert err == (f"error: {folder} is not a sweep folder (no plan.yaml): give the --sweep-dir the pipeline was "
                       "started with\n")
    assert not missing.exists() and not any(other.iterdir())


def test_a_slurm_without_a_controller_is_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """Slurm's commands installed, no controller answering (a laptop with the client, a login node whose
    controller is down): scontrol's four lines of complaint become one, and the sweep folder is not made."""
    complaint = ('echo "$0: error: fetch_config: DNS SRV lookup failed" >&2\n'
                 'echo "$0: fatal: Could not establish a configuration source" >&2\nexit 1')
    bin_dir = slurm_stand_ins(tmp_path / "bin", sbatch=complaint, scontrol=complaint)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    folder = tmp_path / "sweep"
    assert run_main(SWEEP, [str(SWEEPS / "tiny.toml"), "--sweep-dir", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: scontrol show config did not give MaxArraySize "
                                                    "(does a Slurm controller answer here?): "), err
    assert "DNS SRV lookup failed | " in err and "Could not establish a configuration source" in err
    assert not folder.exists()


def test_each_run_of_a_task_is_the_next_attempt(tmp_path, monkeypatch, capsys):
    """A task run three times (the training here a stand-in that exits 0, 0, then 1): attempts 1, 2, 3, each
    started and ended once in attempts.jsonl, and the status counts three attempts and takes the last one's state."""
    plan = shared.prepare_folder(tmp_path / "sweep", SWEEPS / "tiny.toml")
    shared.write_plan(plan)
    exits = iter([0, 0, 1])
    monkeypatch.setattr(shared, "task_command", lambda plan, index, extra=(): [
        os.sys.executable, "-c", f"raise SystemExit({next(exits)})"])
    assert [shared.run_task(plan, 0) for _ in range(3)] == [0, 0, 1]
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("task 0 attempt")]
    assert [line.split()[3] for line in printed] == ["1", "2", "3"]
    lines = shared.local_attempts(plan.task_dir(0))
    assert [(a["attempt"], "started" in a, a.get("exit")) for a in lines] == [
        (1, True, None), (1, False, 0), (2, True, None), (2, False, 0), (3, True, None), (3, False, 1)]
    statuses, _ = shared.sweep_status(plan)
    assert (statuses[0].attempts, statuses[0].state) == (3, "FAILED")


def test_a_local_chain_in_the_folder_of_a_finished_run_ends_at_the_link_that_trains_nothing(tmp_path, monkeypatch,
                                                                                           capsys):
    """Run twice into one --run-dir, every link said "nothing left to train" (exit 0, no record, no save) and the
    chain went on for --max-links links, then said the run was not finished (exit 1). Here the links are stand-ins:
    the first saves the checkpoint (a link ended by its budget), the second saves nothing."""
    chain = load_script(f"{LAB}/03_chain.py")
    links = []

    def link(command, env):
        links.append(command)
        if len(links) == 1:
            (tmp_path / "run" / "checkpoint.pt").write_bytes(b"saved")
        return 0, None

    monkeypatch.setattr(chain, "run_passing_signals_on", link)
    assert run_main(f"{LAB}/03_chain.py", ["--run-dir", str(tmp_path / "run"), "--local", "--max-links", "5"]) == 0
    assert len(links) == 2
    assert (f"== chain done: link 2 trained nothing, the run in {tmp_path / 'run'} had finished"
            in capsys.readouterr().out)


def test_a_local_chain_sent_sigterm_stops_its_link_which_saves_and_starts_no_next_link(tmp_path):
    """``kill`` on the chain (or a job's end) killed it at once and left its link training on alone; now the link gets
    the signal and saves, the chain starts no next link and says how to go on (exit 0), and no training is left. The
    link's own line said "link 2 of the chain resumes from it", which no link did; it now says what the chain says."""

    run_dir = tmp_path / "run"
    status, out, left, _ = terminate_when([PYTHON, str(REPO / LAB / "03_chain.py"), "--run-dir", str(run_dir),
                                           "--local", "--device", "cpu", "--", "--dataset", "digits", "--epochs", "40",
                                           "--log-interval", "1"], "epoch 1 step", str(run_dir), script_env())
    assert status == 0, out[-3000:]
    assert re.search(rf"^received SIGTERM: saved {re.escape(str(run_dir / 'checkpoint.pt'))} at epoch 1 step \d+; "
                     "the chain stops here, link 2 is not started; the same 03_chain.py command goes on from it$",
                     out, re.M), out[-3000:]
    assert out.rstrip().endswith(f"== chain stopped at link 1 by SIGTERM: link 2 is not started; the same 03_chain.py "
                                 f"command goes on from {run_dir / 'checkpoint.pt'}"), out[-3000:]
    assert "== chain link 2" not in out and left == []
    assert (run_dir / "checkpoint.pt").is_file()


def test_a_chain_link_stopped_by_scancel_submits_no_next_link_and_says_so(tmp_path, monkeypatch):
    """scancel (SIGTERM to the link's batch shell and to its training) stops the chain: the shell dies of it before it
    submits the next link. The training said 'link 2 of the chain resumes from it (this link submits it once the
    training has stopped)'; it now says that no link follows and how to go on. The rendered link runs under bash with
    stand-ins for srun (it keeps the training's environment, what it says on a stop), sbatch and scontrol."""
    from common.slurm.rendering import read_template, render
    from common.slurm.sites import find_site
    from common.train.preemption import Preemption

    tools = slurm_stand_ins(tmp_path / "bin", srun=f"env > {tmp_path}/training.env\ntrap 'exit 0' TERM\necho started\n"
                                                  "while :; do sleep 0.1; done",
                            sbatch=f"echo \"$@\" >> {tmp_path}/sbatch_calls\necho 99",
                            scontrol=f"echo 'Command={tmp_path}/link.sbatch StdOut={tmp_path}/l.out'")
    script = tmp_path / "link.sbatch"
    script.write_text(render(read_template(REPO / LAB / "sbatch" / "chain_link.sbatch.j2"), find_site("generic"))[0])
    env = script_env(PATH=f"{tools}:{os.environ['PATH']}", SLURM_JOB_ID="7", SLURM_JOB_NAME="chain-run",
                     HPC_DL_LABS_SKIP_MODULES="1", RUN_DIR=str(tmp_path / "run"), RESULTS_DIR=str(tmp_path / "res"),
                     CHAIN_LINK="1", CHAIN_MAX_LINKS="3")
    link = subprocess.Popen(["bash", str(script)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out = []
        for line in link.stdout:
            out.append(line)
            if line.startswith("started"):
                os.killpg(link.pid, signal.SIGTERM)  # scancel signals every process of the job
                break
        out.append(link.communicate(timeout=30)[0])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(link.pid, signal.SIGKILL)
    assert link.returncode == -signal.SIGTERM, "".join(out)[-3000:]
    assert not (tmp_path / "sbatch_calls").exists()  # no link 2
    training = dict(line.split("=", 1) for line in (tmp_path / "training.env").read_text().splitlines() if "=" in line)
    for name in ("HPC_DL_LABS_ON_STOP", "HPC_DL_LABS_ON_SIGTERM", "HPC_DL_LABS_ON_SIGUSR1"):
        monkeypatch.delenv(name, raising=False)
        if name in training:
            monkeypatch.setenv(name, training[name])
    stopped = Preemption(None, resume=False)
    stopped.signal.requested = signal.SIGTERM
    assert stopped.what_next("c.pt") == (  # what the training prints after "received SIGTERM: saved ..."
        "this link is cancelled (scancel, pre-emption or its time limit): no link follows; to go on from it: the same "
        f"03_chain.py command, or CHAIN_LINK=2 RUN_DIR={tmp_path / 'run'} RESULTS_DIR={tmp_path / 'res'} sbatch <this "
        "script> <its flags>")
    stopped.signal.requested = signal.SIGUSR1  # its time limit's warning: the shell lives on and submits link 2
    assert stopped.what_next("c.pt").startswith("link 2 of the chain resumes from it")


@pytest.mark.parametrize(("flags", "message"), [
    (["--lrr", "1"], "error: the flags after -- (--lrr 1): chapters/ch04_deep_learning/mnist_training.py says: "
                     "unrecognized arguments: --lrr 1"),
    (["--epochs", "1", "--lr", "-1"], "says: argument --lr: must be a positive number, got -1"),
    (["--checkpoint", "x.pt"], "error: the chain sets --checkpoint, --resume and --results-dir itself"),
    (["--dataset", "digits", "--checkpoint=x.pt"], "error: the chain sets --checkpoint"),  # it was missed
    (["--check", "x.pt"], "error: the chain sets --checkpoint"),  # a prefix argparse takes for --checkpoint
    (["--results-dir=r"], "error: the chain sets"),
    (["--resume"], "error: the chain sets"),
])
def test_the_chains_training_flags_are_checked_by_the_trainings_parser_before_link_1(flags, message, tmp_path,
                                                                                     monkeypatch, capsys):
    """A typo after -- started link 1's training and said 'chain broken at link 1' (exit 2); --checkpoint=X got
    through. Now the training's parser reads them first: one line, exit 2, no folder, no link started."""
    chain = load_script(f"{LAB}/03_chain.py")
    monkeypatch.setattr(chain, "run_passing_signals_on", lambda *a, **k: pytest.fail("a link started"))
    assert run_main(f"{LAB}/03_chain.py", ["--run-dir", str(tmp_path / "run"), "--local", "--", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_a_chain_passes_flags_its_training_takes_to_every_link(tmp_path, monkeypatch, capsys):
    chain = load_script(f"{LAB}/03_chain.py")
    links = []
    envs = []
    monkeypatch.setattr(chain, "run_passing_signals_on", lambda command, env: links.append(command) or
                        envs.append(env) or (0, None))
    assert run_main(f"{LAB}/03_chain.py", ["--run-dir", str(tmp_path / "run"), "--local", "--device", "cpu", "--",
                                           "--dataset", "digits", "--epochs=1", "--lr", "0.5"]) == 0
    (command,) = links  # no record, no checkpoint: the chain ends after one link
    assert command[-6:] == ["--save-model", "--dataset", "digits", "--epochs=1", "--lr", "0.5"]
    assert command[command.index("--checkpoint") + 1] == str(tmp_path / "run" / "checkpoint.pt")
    # What the training says when a link stops or finds the run finished: the chain's next step, not a lone run's
    # "the same command with --resume" (it has it) or "leave out --resume to train again" (the chain always sets it).
    assert envs[0]["HPC_DL_LABS_ON_STOP"] == "link 2 of the chain resumes from it"  # --step-budget's stop
    assert envs[0]["HPC_DL_LABS_ON_SIGTERM"] == envs[0]["HPC_DL_LABS_ON_SIGUSR1"] == (  # a signal stops the chain
        "the chain stops here, link 2 is not started; the same 03_chain.py command goes on from it")
    assert envs[0]["HPC_DL_LABS_TRAIN_AGAIN"] == "give 03_chain.py another --run-dir to train again"


@pytest.mark.parametrize("flag", [["--time", "5"], ["--site", "lanta"]])
def test_a_local_chain_with_a_job_setting_is_one_line_not_ignored(flag, tmp_path, capsys):
    assert run_main(f"{LAB}/03_chain.py", ["--run-dir", str(tmp_path / "run"), "--local", *flag]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag[0]} is a setting of the chain's jobs: --local ignores it") and \
        err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_a_chain_for_a_site_that_does_not_exist_is_one_line_and_makes_no_folder(tmp_path, capsys):
    assert run_main(f"{LAB}/03_chain.py", ["--run-dir", str(tmp_path / "run"), "--site", "lantaa"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown site 'lantaa'") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_status_refuses_a_negative_wait(tmp_path, capsys):
    assert run_main(STATUS, ["--sweep-dir", str(tmp_path), "--wait", "-5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "-5" in err, err


def test_a_local_sweep_on_a_gpu_that_is_not_there_is_one_line_before_anything_is_written(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    folder = tmp_path / "sweep"
    assert run_main(SWEEP, [str(SWEEPS / "tiny.toml"), "--local", "--device", "cuda", "--sweep-dir", str(folder)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "PyTorch sees no CUDA GPU" in captured.err, captured.err
    assert "task(s)" not in captured.out and not folder.exists()


def test_run_lab_without_a_controller_runs_here_and_says_why(tmp_path):
    """sbatch and scontrol installed, no controller answering: ``run_lab.sh`` says so in one line and takes the
    laptop path (01_sweep.py --local ...) instead of failing at its first submission. python is a stand-in that
    writes down each command: the steps run for real in the tests above and on the Slurm test cluster."""
    calls = tmp_path / "calls"
    complaint = ('echo "$0: fatal: Could not establish a configuration source" >&2\n'
                 f'echo "$0 $*" >> {tmp_path / "slurm_calls"}\nexit 1')
    bin_dir = slurm_stand_ins(tmp_path / "bin", sbatch=complaint, scontrol=complaint)
    stand_in = tmp_path / "python"
    stand_in.write_text(f'#!/bin/sh\nfor arg in "$@"; do printf "%s\\n" "$arg"; done >> {calls}\n'
                        f'echo "--end--" >> {calls}\n'
                        # the report step ends with "report: PATH", as compare_results.py does (tests/test_report.py)
                        'while [ $# -gt 0 ]; do [ "$1" = --output-report ] && echo "report: $2"; shift; done\n')
    stand_in.chmod(0o755)
    done = subprocess.run(["bash", str(REPO / LAB / "run_lab.sh"), str(tmp_path / "results")], cwd=tmp_path,
                          env=script_env(PYTHON=str(stand_in), PATH=f"{bin_dir}:{os.environ['PATH']}"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("note: sbatch is installed but no Slurm controller answers (scontrol ping)"), lines
    assert "without Slurm" in lines[1] and lines[-1].startswith("report: "), lines
    assert sum(line.startswith("report: ") for line in lines) == 1, lines  # once: run_lab.sh does not echo it again
    assert (tmp_path / "slurm_calls").read_text() == f"{bin_dir / 'scontrol'} ping\n"  # asked once, nothing submitted
    commands = [command.strip("\n").split("\n") for command in calls.read_text().split("--end--\n") if command][1:]
    scripts = [next(Path(arg).name for arg in command if arg.endswith(".py")) for command in commands]
    assert scripts == ["01_sweep.py", "02_status.py", "03_chain.py", "03_chain.py", "compare_results.py"]
    assert "--local" in commands[0] and "--local" in commands[2]


@pytest.mark.slow
def test_a_local_sweep_writes_each_task_into_its_own_folder_with_curves_that_match_its_record(tmp_path, capsys):
    folder = tmp_path / "tiny"
    done = run_script(SWEEP, str(SWEEPS / "tiny.toml"), "--local", "--sweep-dir", str(folder), "--device", "cpu",
                      "--", "--epochs", "1", "--max-steps", "3", "--num-workers", "0")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    from common.results import load_records

    for index, lr in enumerate([0.3, 1.0]):
        task_dir = folder / "tasks" / f"{index:03d}"
        (record,) = load_records(task_dir).records  # its record, in its own folder
        assert record["config"]["lr"] == lr and record["config"]["seed"] == 1
        assert record["config"]["results_dir"] == str(task_dir)
        assert (task_dir / "checkpoint.pt").is_file()
        losses, accuracy = shared.read_curves(task_dir / "tensorboard")  # TensorBoard's own reader
        steps = record["metrics"]["steps"]
        assert steps == 3 and [step for step, _ in losses] == [1, 2, 3]
        # TensorBoard keeps float32: the record's losses, rounded the same way, step by step.
        import numpy as np

        assert [np.float32(v) for _, v in losses] == [np.float32(v) for v in record["metrics"]["loss_at_step"]]
        assert accuracy == [(3, pytest.approx(record["metrics"]["eval_history"][0]["test_accuracy"], rel=1e-6))]

    assert run_main(STATUS, ["--sweep-dir", str(folder), "--record"]) == 0
    table = capsys.readouterr().out
    assert "2 task(s): 2 COMPLETED" in table
    sweep_records = [r for r in load_records(folder, recursive=False).records if r["lab"] == "lab09"]
    (sweep,) = sweep_records
    assert sweep["method"] == "sweep-local" and sweep["metrics"]["failed"] == []
    by_index = {t["index"]: t for t in sweep["metrics"]["tasks"]}
    assert by_index[0]["best_accuracy"] == load_records(folder / "tasks" / "000").records[0]["metrics"]["test_accuracy"]
    assert all(t["core_hours"] > 0 and t["gpu_hours"] == 0 for t in by_index.values())

    # The report ranks the tasks by accuracy and by cost.
    from common.report.labs import lab_sections
    from common.report.runs import runs_frame

    sections, problems = lab_sections(runs_frame(sweep_records), plots=False)
    assert problems == []
    (section,) = [s for s in sections if s.title.startswith("Lab 09: sweep")]
    by_accuracy, by_cost = section.tables
    accuracies = [by_index[int(row[1].text)]["best_accuracy"] for row in by_accuracy.rows]
    assert accuracies == sorted(accuracies, reverse=True)
    costs = [by_index[int(row[1].text)]["core_hours"] for row in by_cost.rows]
    assert costs == sorted(costs)
    assert "Every task completed." in section.paragraphs
    assert json.loads(json.dumps(sweep))  # the record is plain JSON

    # Recorded again (as after a resubmission): one section, from the latest record, which says so.
    assert run_main(STATUS, ["--sweep-dir", str(folder), "--record"]) == 0
    again = [r for r in load_records(folder, recursive=False).records if r["lab"] == "lab09"]
    sections, _ = lab_sections(runs_frame(again, folder), plots=False)
    (section,) = [s for s in sections if s.title.startswith("Lab 09: sweep")]
    assert len(again) == 2 and section.title == f"Lab 09: sweep {sweep['config']['sweep_id']} (local)"
    assert section.paragraphs[0].endswith("(every attempt); the latest of 2 records of it.")


def test_a_finished_task_run_again_says_how_to_train_the_sweep_again(tmp_path, capfd):
    """It said "leave out --resume to train again", which a sweep's user cannot do: the sweep adds it."""
    folder = tmp_path / "tiny"
    plan = shared.prepare_folder(folder, SWEEPS / "tiny.toml")
    shared.write_plan(plan)
    quick = ["--device", "cpu", "--epochs", "1", "--max-steps", "2", "--num-workers", "0"]
    assert [shared.run_task(plan, 0, quick) for _ in range(2)] == [0, 0]
    out = capfd.readouterr().out
    assert out.count("nothing left to train") == 1, out
    assert "no new record); to train the sweep again, give 01_sweep.py a new --sweep-dir" in out, out
    assert "leave out --resume" not in out
    from common.results import load_records

    assert len(load_records(folder / "tasks" / "000").records) == 1


def test_submitit_when_sbatch_refuses_is_one_line_and_the_plan_stays_for_the_next_try(tmp_path, monkeypatch, capsys):
    """A login node whose Slurm does not answer: submitit prints sbatch's words and raises them with a
    traceback; the lab ends after them in one line, exit 2, and a second try goes as far again."""
    tools = slurm_stand_ins(tmp_path / "bin", srun="exit 0",  # submitit picks Slurm where srun is on PATH
                            sbatch='echo "sbatch: error: Batch job submission failed: Unable to contact slurm '
                                   'controller (connect failure)" >&2; exit 1')
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    folder = tmp_path / "sweep"
    for _ in range(2):
        assert run_main("labs/lab09_many_jobs/05_submitit.py",
                        [str(SWEEPS / "tiny.toml"), "--sweep-dir", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err == ("sbatch: error: Batch job submission failed: Unable to contact slurm controller "
                       "(connect failure)\n"
                       "error: sbatch refused the array (exit status 1; its words above), nothing was submitted: the "
                       f"plan in {folder} stays, run this again once `sinfo` answers\n")
        assert shared.read_plan(folder).submissions() == []


def test_resubmit_says_which_way_a_sweep_never_submitted_goes_on(tmp_path, capsys):
    """A folder whose array sbatch refused holds the plan and no submission: --resubmit has nothing to resubmit and
    sends the student to submit the sweep (it never ran here); a sweep that ran here goes on with --local."""
    folder = tmp_path / "sweep"
    plan = shared.prepare_folder(folder, SWEEPS / "tiny.toml")
    shared.write_plan(plan)
    assert run_main(f"{LAB}/02_status.py", ["--sweep-dir", str(folder), "--resubmit"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {folder} holds no submission (did sbatch refuse it?): submit the whole sweep with "
                   f"01_sweep.py {plan.sweep_file} --sweep-dir {folder}, or run it here with --local\n"), err
    plan.add_submission("local", "local", [0, 1])
    assert run_main(f"{LAB}/02_status.py", ["--sweep-dir", str(folder), "--resubmit"]) == 2
    assert capsys.readouterr().err == (f"error: {folder} was not submitted to Slurm: run 01_sweep.py --local again to "
                                       "retry here\n")


def test_submitit_refuses_a_sweep_folder_submitted_already_before_calling_sbatch(tmp_path, monkeypatch, capsys):
    """As 01_sweep.py does: a second submission of the same folder would train every task again beside the first."""
    called = tmp_path / "sbatch-called"
    tools = slurm_stand_ins(tmp_path / "bin", srun="exit 0", sbatch=f"touch {called}; exit 1")
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    folder = tmp_path / "sweep"
    assert run_main("labs/lab09_many_jobs/05_submitit.py", [str(SWEEPS / "tiny.toml"), "--sweep-dir", str(folder)]) == 2
    assert called.exists()  # sbatch refused: the plan stays, nothing submitted
    called.unlink()
    shared.read_plan(folder).add_submission("submitit", "4242", [0, 1])  # what a submission that went through adds
    capsys.readouterr()
    assert run_main("labs/lab09_many_jobs/05_submitit.py", [str(SWEEPS / "tiny.toml"), "--sweep-dir", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {folder} was submitted already (job 4242): follow it or resubmit what failed with "
                          "02_status.py") and err.count("\n") == 1, err
    assert not called.exists() and len(shared.read_plan(folder).submissions()) == 1


def test_submitit_refuses_a_machine_without_slurm_and_a_task_s_own_flag_before_writing(tmp_path, monkeypatch, capsys):
    """Without sbatch, submitit's AutoExecutor would train every task here, one after another, then stop on sacct;
    with it, a seed after -- would replace each task's own, as 01_sweep.py refuses. One line each, nothing written."""
    tools = slurm_stand_ins(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(tools))
    folder = tmp_path / "sweep"
    assert run_main("labs/lab09_many_jobs/05_submitit.py", [str(SWEEPS / "tiny.toml"), "--sweep-dir", str(folder)]) == 2
    assert capsys.readouterr().err == ("error: sbatch is not on PATH: submitit submits to Slurm, run this on a "
                                       "cluster's login node (01_sweep.py --local runs a sweep on this machine)\n")
    slurm_stand_ins(tools, sbatch="exit 1")
    assert run_main("labs/lab09_many_jobs/05_submitit.py",
                    [str(SWEEPS / "tiny.toml"), "--sweep-dir", str(folder), "--", "--seed", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: each task sets --seed itself") and err.count("\n") == 1, err
    assert not folder.exists()


def test_a_local_sweep_sent_sigterm_passes_it_to_the_training_which_saves_and_the_status_says_so(tmp_path):
    """``kill`` on the sweep runner (or a job's end): the training it runs gets the signal and saves, the runner writes
    the attempt's end and stops there (exit 0, one line), no training is left behind, and the status tells that
    task from the ones never started; the same command later goes on from the checkpoint."""

    sweep = write_sweep(tmp_path, "seed = 1\n[fixed]\ndataset = \"digits\"\nepochs = 40\nlog-interval = 1\n"
                                  "[grid]\nlr = [0.3, 1.0]\n")
    folder = tmp_path / "sweep"
    status, out, left, _ = terminate_when([PYTHON, str(REPO / SWEEP), str(sweep), "--local", "--device", "cpu",
                                           "--sweep-dir", str(folder)], "epoch 2 step", str(folder), script_env())
    assert status == 0, out[-3000:]
    assert re.search(r"^received SIGTERM: saved \S+tasks/000/checkpoint\.pt at epoch 2 step \d+; the sweep resumes "
                     r"this task from it when the same 01_sweep.py command runs again$",
                     out, re.M)  # not the training's own
    assert out.rstrip().endswith("task 0: stopped by SIGTERM; run the same command again to go on from here")
    assert "task 1 attempt" not in out and left == []
    ended = json.loads((folder / "tasks" / "000" / "attempts.jsonl").read_text().splitlines()[-1])
    assert (ended["exit"], ended["stopped_by"]) == (0, "SIGTERM")
    statuses, _ = shared.sweep_status(shared.read_plan(folder))
    assert [s.state for s in statuses] == ["UNFINISHED", "NOT RUN"]  # a local sweep: nothing is submitted
    with contextlib.redirect_stdout(io.StringIO()) as said:
        assert run_main(STATUS, ["--sweep-dir", str(folder)]) == 0
    assert ("task(s) 0 did not complete and task(s) 1 have not run: 01_sweep.py --local with the same sweep goes on"
            in said.getvalue())
