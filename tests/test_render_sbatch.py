"""scripts/render_sbatch.py and slurm/lib/job_header.sh, without Slurm.

Every site profile loads; every template in the repository renders for every site and keeps the
template contract (comments on every #SBATCH line, the job header, srun --kill-on-bad-exit=1,
pre-emption lines where it trains with --resume); the committed renderings equal fresh ones;
requests a site cannot satisfy fail with one clear line; undefined template variables name the
template line. The job header is run by bash outside Slurm. shellcheck of every rendering:
tests/test_shellcheck.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_script

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "render_sbatch.py"
HELLO = REPO_ROOT / "slurm" / "examples" / "hello.sbatch.j2"




rs = load_script("scripts/render_sbatch.py")
UserError = rs.UserError
SITES = rs.site_names()


def repository_templates() -> list[Path]:
    """Every *.sbatch.j2 in the repository (labs, chapters, examples), outside virtual environments."""
    return sorted(path for path in REPO_ROOT.rglob("*.sbatch.j2")
                  if not any(part.startswith(".") for part in path.relative_to(REPO_ROOT).parts))


def render_text(template: Path, site: str, *settings: str) -> str:
    text, _ = rs.render(rs.read_template(template), rs.find_site(site), rs.parse_settings(settings))
    return text


def write_template(tmp_path: Path, body: str, job_block: str = "job:\n  nodes: 1\n") -> Path:
    path = tmp_path / "custom.sbatch.j2"
    path.write_text("{# " + job_block + "#}\n#!/bin/bash\n" + body)
    return path


# -- site profiles -------------------------------------------------------------------------------

def test_the_seed_sites_and_generic_exist():
    assert {"lanta", "sjtu-pi", "sjtu-siyuan", "carc-discovery", "generic"} <= set(SITES)


@pytest.mark.parametrize("name", SITES)
def test_site_profile_is_consistent(name):
    site = rs.find_site(name)
    gpu = site.partitions[site.default_partitions["gpu"]]
    assert gpu.gpus_per_node >= 1 and gpu.cpus_per_gpu >= 1
    assert gpu.cpus_per_gpu * gpu.gpus_per_node <= gpu.cpus_per_node
    assert rs.time_to_seconds(site.max_time) >= 3600
    assert site.setup, "a site says how jobs get Python (setup lines)"
    if site.account_required:
        assert site.account


def test_seed_facts_are_in_the_profiles():
    lanta = rs.find_site("lanta")
    assert lanta.partitions["gpu"].gpu_types == ("a100",) and lanta.partitions["gpu"].gpu_memory == "40G"
    assert lanta.account_required
    pi, siyuan = rs.find_site("sjtu-pi"), rs.find_site("sjtu-siyuan")
    assert pi.partitions["dgx2"].gpu_types == ("v100",) and pi.partitions["dgx2"].cpus_per_gpu == 6
    assert siyuan.partitions["a100"].cpus_per_gpu == 6
    assert "module load miniconda3" in pi.setup and "module use /dssg/share/imgs/" in siyuan.setup
    carc = rs.find_site("carc-discovery")
    assert carc.default_partitions["gpu"] == "gpu" and carc.account and carc.reservation


def test_list_sites_names_every_profile(capsys):
    assert rs.main(["--list-sites"]) == 0
    listed = capsys.readouterr().out
    for name in SITES:
        assert name in listed


def test_a_broken_profile_is_reported_with_its_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("name: bad\nmax_time: '1:00:00'\ndefault_partitions: {cpu: c, gpu: g}\n"
                                       "partitions:\n  c: {cpus_per_node: 4}\n  g: {cpus_per_node: 4, gpus_per_node: 2}\n")
    with pytest.raises(UserError, match=r"bad\.yaml: partitions\.g: a partition with GPUs needs cpus_per_gpu"):
        rs.load_sites(tmp_path)


# -- rendering -----------------------------------------------------------------------------------

@pytest.mark.parametrize("site", SITES)
def test_hello_renders_for_every_site(site, tmp_path):
    text = render_text(HELLO, site)
    profile = rs.find_site(site)
    partition = profile.partitions[profile.default_partitions["gpu"]]
    assert text.startswith("#!/bin/bash\n")
    assert "{#" not in text and "{{" not in text
    assert f"#SBATCH --partition={partition.name} " in text
    assert "#SBATCH --nodes=2 " in text
    assert f"#SBATCH --cpus-per-task={partition.cpus_per_gpu} " in text  # one GPU's share of the node
    assert "#SBATCH --gres=gpu:1 " in text
    assert ("#SBATCH --account=" in text) == bool(profile.account)
    assert ("#SBATCH --reservation=" in text) == bool(profile.reservation)
    for line in profile.setup:
        assert f"    {line}\n" in text
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            assert "  # " in line, f"every #SBATCH line carries a comment: {line}"
    assert "set -euo pipefail" in text and "source slurm/lib/job_header.sh" in text


@pytest.mark.parametrize("template", repository_templates(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_repository_template_renders_for_every_site_and_keeps_the_contract(template):
    only = rs.read_template(template).request.get("sites")
    for site in SITES if only is None else only:
        try:
            text = render_text(template, site)
        except UserError as err:
            pytest.fail(f"{err}")
        lines = text.splitlines()
        assert lines[0] == "#!/bin/bash" and "{{" not in text and "{%" not in text
        for line in lines:
            if line.startswith("#SBATCH"):
                assert "  # " in line, f"{template.name} for {site}: an #SBATCH line without a comment: {line}"
        assert "set -euo pipefail" in text and "source slurm/lib/job_header.sh" in text
        commands = [line.strip() for line in lines if not line.lstrip().startswith("#")]
        launches = [line for line in commands if re.match(r"(run_preemptible )?srun\b", line)]
        if template.parent.name == "examples":
            continue
        assert launches, f"{template.name}: no srun"
        assert all("--kill-on-bad-exit=1" in line for line in launches), launches
        assert "MASTER_PORT=" not in "\n".join(commands), "the port comes from the job header, never fixed"
        directives = "\n".join(line for line in lines if line.startswith("#SBATCH"))
        if resumes(text):  # a training that can continue: it must be pre-emption safe
            for needed in ("#SBATCH --signal=B:USR1@", "#SBATCH --requeue ", "trap _forward_usr1 USR1",
                           "scontrol requeue", 'wait "$_step_pid"', '--checkpoint "$CHECKPOINT" --resume'):
                assert needed in text, f"{template.name}: pre-emption needs {needed!r}"
        else:  # a requeued job that cannot resume would start over
            assert "--signal" not in directives and "--requeue" not in directives


def resumes(text: str) -> bool:
    """Whether a template's commands (not its comments) pass --resume."""
    return any("--resume" in line for line in text.splitlines() if not line.lstrip().startswith("#"))


def test_the_training_templates_are_the_ones_that_resume():
    """Chapter 4's two trainings and Lab-01's DDP runs; Lab-01's baseline and DP runs are timings."""
    resumable = sorted(str(path.relative_to(REPO_ROOT)) for path in repository_templates()
                       if resumes(path.read_text().split("#}", 1)[1]))
    assert resumable == ["chapters/ch04_deep_learning/sbatch/multi_gpu.sbatch.j2",
                         "chapters/ch04_deep_learning/sbatch/single_gpu.sbatch.j2",
                         "labs/lab01_dp_vs_ddp/sbatch/ddp_srun_2node.sbatch.j2",
                         "labs/lab01_dp_vs_ddp/sbatch/ddp_torchrun_2node.sbatch.j2",
                         "labs/lab01_dp_vs_ddp/sbatch/ddp_torchrun_4gpu.sbatch.j2"]


@pytest.mark.parametrize("template", sorted(rs.COMMITTED_RENDERINGS))
def test_committed_renderings_equal_a_fresh_rendering(template):
    """`sbatch sbatch/single_gpu.sbatch` needs a plain file; it must never drift from its template.
    Refresh with: python scripts/render_sbatch.py --write-committed"""
    committed = rs.committed_path(template)
    assert committed.read_text() == rs.committed_text(template), (
        f"{committed.relative_to(REPO_ROOT)} differs from {template} rendered for "
        f"{rs.COMMITTED_RENDERINGS[template]}: run python scripts/render_sbatch.py --write-committed")
    assert os.access(committed, os.X_OK)
    lines = committed.read_text().splitlines(keepends=True)
    assert lines[1].startswith("# Generated from ") and "--write-committed" in lines[1]
    assert "".join(lines[:1] + lines[3:]) == render_text(REPO_ROOT / template, rs.COMMITTED_RENDERINGS[template])


def test_write_committed_writes_them(tmp_path, monkeypatch):
    monkeypatch.setattr(rs, "REPO_ROOT", tmp_path)
    for template in rs.COMMITTED_RENDERINGS:  # the templates, copied into a scratch repository
        (tmp_path / template).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / template).write_text((REPO_ROOT / template).read_text())
    (tmp_path / "slurm" / "lib").mkdir(parents=True)
    (tmp_path / "slurm" / "lib" / "preemptible_step.j2").write_text(
        (REPO_ROOT / "slurm" / "lib" / "preemptible_step.j2").read_text())
    assert rs.main(["--write-committed"]) == 0
    for template in rs.COMMITTED_RENDERINGS:
        written = tmp_path / template.removesuffix(".j2")
        assert written.read_text() == (REPO_ROOT / template.removesuffix(".j2")).read_text()


def test_lab03_a100_and_dgx2_templates_differ_only_in_the_gpu():
    """The seed's two run scripts are two templates; apart from the GPU model, the queue and the
    words saying so, they must stay the same script."""
    folder = REPO_ROOT / "labs" / "lab03_precision_benchmark" / "sbatch"

    def commands(name: str) -> list[str]:
        text = (folder / name).read_text().split("#}", 1)[1]
        return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]

    a100, dgx2 = commands("a100.sbatch.j2"), commands("dgx2.sbatch.j2")
    assert [line.replace("v100", "a100") for line in dgx2] == a100
    assert rs.read_template(folder / "dgx2.sbatch.j2").request["gpu_type"] == "v100"
    assert rs.read_template(folder / "a100.sbatch.j2").request["gpu_type"] == "a100"


def test_one_task_per_gpu_follows_the_gpu_count():
    template = REPO_ROOT / "chapters" / "ch04_deep_learning" / "sbatch" / "multi_gpu.sbatch.j2"
    assert rs.read_template(template).request["ntasks_per_node"] == "gpus"
    text = render_text(template, "lanta", "gpus_per_node=2")
    assert "#SBATCH --ntasks-per-node=2 " in text and "#SBATCH --gres=gpu:2 " in text
    assert "#SBATCH --cpus-per-task=16 " in text  # each task keeps one GPU's share of the node
    with pytest.raises(UserError, match="ntasks_per_node is 'gpus' .* but the job asks for no GPUs"):
        render_text(template, "lanta", "gpus_per_node=0", "kind=cpu")


def test_settings_override_the_job_block():
    text = render_text(HELLO, "lanta", "nodes=4", "gpus_per_node=4", "account=lt200123", "time=02:00:00")
    assert "#SBATCH --nodes=4 " in text
    assert "#SBATCH --gres=gpu:4 " in text
    assert "#SBATCH --cpus-per-task=64 " in text  # four GPUs' share of a 64-core node
    assert "#SBATCH --account=lt200123 " in text
    assert "#SBATCH --time=02:00:00 " in text


def test_gpu_model_is_named_only_where_the_site_types_its_gres():
    carc = render_text(HELLO, "carc-discovery", "gpu_type=a40")
    assert "#SBATCH --gres=gpu:a40:1 " in carc
    lanta = render_text(HELLO, "lanta", "gpu_type=a100")
    assert "#SBATCH --gres=gpu:1 " in lanta and "1 A100 GPU(s) per node" in lanta


def test_cpu_jobs_use_the_cpu_partition_and_no_gres(tmp_path):
    template = write_template(tmp_path, "{{ job.sbatch }}\n", "job:\n  kind: cpu\n  cpus_per_task: 8\n")
    text = render_text(template, "sjtu-pi")
    assert "#SBATCH --partition=cpu " in text and "--gres" not in text
    assert "#SBATCH --cpus-per-task=8 " in text


def test_base_60_looking_times_stay_text():
    assert rs.parse_settings(["time=10:00"]) == {"time": "10:00"}
    assert rs.time_to_seconds("10:00") == 600
    assert rs.time_to_seconds("1-02:00") == 26 * 3600
    assert rs.time_to_seconds("00:05:00") == 300


def test_preamble_finds_the_repository_root_from_a_folder_inside_it(tmp_path):
    """The chapter README says `cd chapters/ch04_deep_learning && sbatch sbatch/single_gpu.sbatch`."""
    template = write_template(tmp_path, "{{ preamble }}\necho \"ROOT $PWD\"\n")
    script = tmp_path / "root.sbatch"
    script.write_text(render_text(template, "generic"))
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "HPC_DL_LABS_"))}
    env["HPC_DL_LABS_SKIP_MODULES"] = "1"
    inside = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env,
                            cwd=REPO_ROOT / "chapters" / "ch04_deep_learning")
    assert inside.returncode == 0, inside.stderr
    assert f"ROOT {REPO_ROOT}\n" in inside.stdout
    outside = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert outside.returncode == 2
    assert outside.stderr.startswith("error: submitted from outside the hpc-dl-labs repository")


# -- requests a site cannot satisfy --------------------------------------------------------------

@pytest.mark.parametrize(
    ("site", "settings", "expected"),
    [
        ("lanta", ["gpus_per_node=5"], "asks for 5 GPU(s) per node but site lanta, partition gpu has 4 per node"),
        ("lanta", ["gpu_type=v100"], "asks for v100 GPUs but site lanta, partition gpu has a100"),
        ("lanta", ["partition=dgx2"], "site lanta has no partition 'dgx2' (it has: compute, gpu)"),
        ("lanta", ["partition=compute"], "asks for 1 GPU(s) per node but site lanta, partition compute has no GPUs"),
        ("sjtu-pi", ["cpus_per_task=12"], "asks for 12 CPUs per node with 1 GPU(s) but site sjtu-pi, partition dgx2 "
                                          "allows 6 CPUs per GPU"),
        ("generic", ["cpus_per_task=64", "gpus_per_node=4"], "asks for 64 CPUs per node"),
        ("carc-discovery", ["time=3-00:00:00"], "allows at most 2-00:00:00"),
        ("carc-discovery", ["constraint=epyc"], "asks for feature 'epyc'"),
        ("generic", ["mem=1T"], "asks for 1T of memory per node"),
        ("lanta", ["account=null"], "site lanta needs an account: pass --set account=YOUR_PROJECT"),
        ("generic", ["gpu_type=a100"], "asks for a100 GPUs but site generic, partition gpu has no named models"),
    ],
)
def test_impossible_requests_fail_with_one_clear_line(site, settings, expected):
    with pytest.raises(UserError) as raised:
        render_text(HELLO, site, *settings)
    message = str(raised.value)
    assert expected in message
    assert "\n" not in message
    assert message.startswith("slurm/examples/hello.sbatch.j2 for site ")


def test_command_line_error_is_one_line_and_exit_2(tmp_path):
    out = tmp_path / "job.sbatch"
    done = subprocess.run([sys.executable, str(SCRIPT), "--site", "lanta", str(HELLO), "-o", str(out),
                           "--set", "gpus_per_node=8"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")
    assert "Traceback" not in done.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_output_file_is_written_whole_and_executable(tmp_path, capsys):
    out = tmp_path / "sub" / "hello.sbatch"
    assert rs.main(["--site", "generic", str(HELLO), "-o", str(out)]) == 0
    assert out.read_text() == render_text(HELLO, "generic")
    assert os.access(out, os.X_OK)
    assert [p.name for p in out.parent.iterdir()] == ["hello.sbatch"]


def test_placeholder_account_warns(capsys, tmp_path):
    assert rs.main(["--site", "lanta", str(HELLO), "-o", str(tmp_path / "x.sbatch")]) == 0
    assert "warning: account is the placeholder 'edit-me'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--site", "nowhere", str(HELLO)], "unknown site 'nowhere' (known sites: "),
        (["--site", "lanta", str(HELLO), "--set", "gpus=2"], "--set gpus: unknown key"),
        (["--site", "lanta", str(HELLO), "--set", "nodes"], "expected key=value"),
        (["--site", "lanta", str(HELLO), "--set", "nodes=0"], "nodes must be a whole number >= 1, got 0"),
        ([str(HELLO)], "choose a site with --site NAME"),
        (["--site", "lanta", "missing.sbatch.j2"], "missing.sbatch.j2: no such template"),
    ],
)
def test_bad_arguments_are_user_errors(argv, expected):
    with pytest.raises(UserError, match=None) as raised:
        rs.main(argv)
    assert expected in str(raised.value)


# -- template contract ---------------------------------------------------------------------------

def test_undefined_variable_names_the_template_line(tmp_path):
    template = write_template(tmp_path, "{{ job.sbatch }}\n\necho {{ job.nmoes }}\n")
    with pytest.raises(UserError) as raised:
        render_text(template, "generic")
    message = str(raised.value)
    assert message.startswith(f"{template}:7: undefined variable: ")
    assert "'nmoes'" in message and "site.*, job.*" in message


def test_undefined_site_variable_is_an_error_too(tmp_path):
    template = write_template(tmp_path, "echo {{ site.partitions.gpu.tflops }}\n")
    with pytest.raises(UserError, match=r"undefined variable: .*'tflops'"):
        render_text(template, "generic")


def test_template_without_job_block_is_refused(tmp_path):
    template = tmp_path / "plain.sbatch.j2"
    template.write_text("#!/bin/bash\necho hi\n")
    with pytest.raises(UserError, match="must start with its job block"):
        rs.read_template(template)


def test_unknown_job_block_key_is_refused(tmp_path):
    template = write_template(tmp_path, "", "job:\n  gpus: 2\n")
    with pytest.raises(UserError, match=r"unknown key\(s\) gpus"):
        rs.read_template(template)


def test_syntax_error_names_the_line(tmp_path):
    template = write_template(tmp_path, "{% if job.nodes %}\necho\n")
    with pytest.raises(UserError, match=r"custom\.sbatch\.j2:\d+: template syntax error"):
        render_text(template, "generic")


# -- every template for every site (what CI submits) ---------------------------------------------

def test_all_sites_renders_every_pair_and_a_manifest(tmp_path, capsys):
    out = tmp_path / "out"
    assert rs.main(["--all-sites", str(out), str(HELLO.parent)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    templates = sorted(HELLO.parent.rglob("*.sbatch.j2"))
    assert len(manifest) == len(templates) * len(SITES)
    for entry in manifest:
        script = out / entry["script"]
        assert script.read_text() == render_text(REPO_ROOT / entry["template"], entry["site"])
        assert entry["job"]["nodes"] >= 1 and entry["job"]["partition"]


def test_all_sites_fails_whole_when_one_site_cannot_run_a_template(tmp_path, capsys):
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "eight_gpus.sbatch.j2").write_text(
        "{# job:\n  gpus_per_node: 8\n  cpus_per_task: 1\n#}\n#!/bin/bash\n{{ job.sbatch }}\n")
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"failed; nothing written") as raised:
        rs.main(["--all-sites", str(out), str(templates)])
    errors = capsys.readouterr().err + str(raised.value)
    assert "asks for 8 GPU(s) per node but site lanta, partition gpu has 4 per node" in errors
    assert "site carc-discovery, partition gpu has 2 per node" in errors
    assert "sjtu-pi" not in errors  # its dgx2 nodes have 16 GPUs
    assert "(4 template/site pair(s) failed" in errors
    assert not out.exists()


def test_a_template_may_name_the_sites_it_is_for(tmp_path):
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "dgx2_only.sbatch.j2").write_text(
        "{# job:\n  gpus_per_node: 16\n  sites: [sjtu-pi]\n#}\n#!/bin/bash\n{{ job.sbatch }}\n")
    out = tmp_path / "out"
    assert rs.main(["--all-sites", str(out), str(templates)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert [entry["site"] for entry in manifest] == ["sjtu-pi"]
    assert "#SBATCH --gres=gpu:16 " in (out / manifest[0]["script"]).read_text()


# -- shell pieces --------------------------------------------------------------------------------

def run_header(env: dict[str, str], after: str = "") -> subprocess.CompletedProcess[str]:
    clean = {key: value for key, value in os.environ.items()
             if not key.startswith(("SLURM_", "HPC_DL_LABS_", "MASTER_", "CUDA_"))}
    script = f"set -euo pipefail\nsource slurm/lib/job_header.sh\n{after}\n"
    return subprocess.run([shutil.which("bash"), "-c", script], capture_output=True, text=True, cwd=REPO_ROOT,
                          env={**clean, **env})


def test_job_header_outside_slurm_falls_back_to_one_local_process():
    done = run_header({}, 'echo "RESULT $MASTER_ADDR $DEVICE $NPROC_PER_NODE ${#TINY_ARGS[@]}"')
    assert done.returncode == 0, done.stderr
    assert "RESULT 127.0.0.1 cpu 1 0" in done.stdout
    port = int(done.stdout.split("MASTER_PORT=")[1].split()[0])
    assert 20000 <= port < 30000


def test_job_header_tiny_mode_and_cpu_cap():
    done = run_header({"HPC_DL_LABS_TINY": "1", "SLURM_CPUS_PER_TASK": "512"},
                      'echo "RESULT ${TINY_ARGS[*]} $NUM_WORKERS $OMP_NUM_THREADS"')
    assert done.returncode == 0, done.stderr
    usable = len(os.sched_getaffinity(0))
    assert f"RESULT --dry-run 0 {usable}" in done.stdout
    assert "SLURM_CPUS_PER_TASK=512" in done.stdout  # the SLURM_* listing


def test_job_header_shares_the_node_among_its_tasks():
    """Unconfined tasks (no cgroups, like the test cluster) must not each take every core."""
    usable = len(os.sched_getaffinity(0))
    done = run_header({"SLURM_CPUS_PER_TASK": "64", "SLURM_NTASKS_PER_NODE": "2"}, 'echo "RESULT $OMP_NUM_THREADS"')
    assert done.returncode == 0, done.stderr
    assert f"RESULT {max(usable // 2, 1)}" in done.stdout


def test_job_header_workers_leave_one_core_for_training():
    done = run_header({"SLURM_CPUS_PER_TASK": "2"}, 'echo "RESULT $NUM_WORKERS $OMP_NUM_THREADS"')
    usable = min(2, len(os.sched_getaffinity(0)))
    assert f"RESULT {max(usable - 1, 0)} {usable}" in done.stdout


def test_job_header_device_can_be_forced():
    done = run_header({"HPC_DL_LABS_DEVICE": "cuda"}, 'echo "RESULT $DEVICE"')
    assert "RESULT cuda" in done.stdout


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "cuda"),                                                # outside Slurm: every GPU
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, "cuda"),
        ({"CUDA_VISIBLE_DEVICES": "GPU-5d1e-b"}, "cuda"),            # Slurm may hand out UUIDs
        ({"CUDA_VISIBLE_DEVICES": "1,2"}, "cpu"),                    # index 2 is no real GPU (test cluster)
        ({"CUDA_VISIBLE_DEVICES": ""}, "cpu"),
        ({"SLURM_JOB_ID": "7"}, "cpu"),                              # a job without a GPU allocation
        ({"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "0"}, "cuda"),
    ],
)
def test_job_header_trusts_only_gpus_nvidia_smi_lists(tmp_path, env, expected):
    """A stand-in nvidia-smi that lists two GPUs, as the real one prints them."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n"
                    "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5d1e-a)'\n"
                    "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-5d1e-b)'\n")
    fake.chmod(0o755)
    path = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"
    done = run_header({"PATH": path, **env}, 'echo "RESULT $DEVICE"')
    assert done.returncode == 0, done.stderr
    assert f"RESULT {expected}" in done.stdout


def test_job_header_without_nvidia_smi_is_cpu(tmp_path):
    tools = tmp_path / "bin"  # a PATH holding only what the header runs, and no nvidia-smi
    tools.mkdir()
    for tool in ("hostname", "date", "grep", "sort", "nproc"):
        (tools / tool).symlink_to(shutil.which(tool))
    done = run_header({"PATH": str(tools), "CUDA_VISIBLE_DEVICES": "0"}, 'echo "RESULT $DEVICE"')
    assert done.returncode == 0, done.stderr
    assert "RESULT cpu" in done.stdout
