"""scripts/render_sbatch.py (common/slurm/sites.py, common/slurm/) and slurm/lib/job_header.sh, without Slurm.

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
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_script

from common.slurm import sites
from common.errors import UserError
from common.slurm import jobs, rendering

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "render_sbatch.py"
HELLO = REPO_ROOT / "slurm" / "examples" / "hello.sbatch.j2"

rs = load_script("scripts/render_sbatch.py")  # the command line
SITES = sites.site_names()


def repository_templates() -> list[Path]:
    """Every *.sbatch.j2 in the repository (labs, chapters, examples), outside virtual environments."""
    return sorted(path for path in REPO_ROOT.rglob("*.sbatch.j2")
                  if not any(part.startswith(".") for part in path.relative_to(REPO_ROOT).parts))


def render_text(template: Path, site: str, *settings: str) -> str:
    text, _ = rendering.render(jobs.read_template(template), sites.find_site(site), jobs.parse_settings(settings))
    return text


def write_template(tmp_path: Path, body: str, job_block: str = "job:\n  nodes: 1\n") -> Path:
    path = tmp_path / "custom.sbatch.j2"
    path.write_text("{# " + job_block + "#}\n#!/bin/bash\n" + body)
    return path


# -- site profiles -------------------------------------------------------------------------------

def test_the_profiles_table_of_the_sites_readme_is_what_list_sites_prints(capsys):
    """slurm/sites/README.md tells a student which profile is which cluster: every row is a profile
    that --list-sites prints, with the GPU and CPU partitions it prints, and no profile is missing."""
    readme = (REPO_ROOT / "slurm" / "sites" / "README.md").read_text()
    section = readme.split("\n## The profiles\n", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in section.splitlines() if re.match(r"^\| `[\w-]+` \|", line)]
    documented = {row[0].strip("`"): (re.match(r"`([^`]+)`", row[-2])[1], re.match(r"`([^`]+)`", row[-1])[1])
                  for row in rows}
    assert rs.main(["--list-sites"]) == 0
    listed = re.findall(r"^(\S+) .*\n +partitions: (.*)$", capsys.readouterr().out, re.M)
    missing = sorted({name for name, _ in listed} - set(documented))
    assert not missing, (f"slurm/sites/README.md, table 'The profiles': add a row for {', '.join(missing)} "
                         "(profile, cluster, source material, GPU partition, CPU partition)")
    assert sorted(documented) == sorted(name for name, _ in listed), "a row of that table names no profile"
    for name, partitions in listed:
        gpu, cpu = documented[name]
        assert f"{gpu} (" in partitions and re.search(rf"(^|, ){re.escape(cpu)}(,|$)", partitions), (name, partitions)


@pytest.mark.parametrize("name", SITES)
def test_site_profile_is_consistent(name):
    site = sites.find_site(name)
    gpu = site.partitions[site.default_partitions["gpu"]]
    assert gpu.gpus_per_node >= 1 and gpu.cpus_per_gpu >= 1
    assert gpu.cpus_per_gpu * gpu.gpus_per_node <= gpu.cpus_per_node
    assert sites.time_to_seconds(site.max_time) >= 3600
    assert site.setup, "a site says how jobs get Python (setup lines)"
    if site.account_required:
        assert site.account


def test_the_course_materials_facts_are_in_the_profiles():
    lanta = sites.find_site("lanta")
    assert lanta.partitions["gpu"].gpu_types == ("a100",) and lanta.partitions["gpu"].gpu_memory == "40G"
    assert lanta.account_required
    pi, siyuan = sites.find_site("sjtu-pi"), sites.find_site("sjtu-siyuan")
    assert pi.partitions["dgx2"].gpu_types == ("v100",) and pi.partitions["dgx2"].cpus_per_gpu == 6
    assert siyuan.partitions["a100"].cpus_per_gpu == 6
    assert "module load miniconda3" in pi.setup and "module use /dssg/share/imgs/" in siyuan.setup
    carc = sites.find_site("carc-discovery")
    assert carc.default_partitions["gpu"] == "gpu" and carc.account and carc.reservation


def test_list_sites_names_every_profile(capsys):
    assert rs.main(["--list-sites"]) == 0
    listed = capsys.readouterr().out
    for name in SITES:
        assert name in listed


def test_a_broken_profile_is_reported_with_its_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("name: bad\nmax_time: '1:00:00'\ndefault_partitions: {cpu: c, gpu: g}\n"
                                       "partitions:\n  c: {cpus_per_node: 4}\n"
                                       "  g: {cpus_per_node: 4, gpus_per_node: 2}\n")
    with pytest.raises(UserError, match=r"bad\.yaml: partitions\.g: a partition with GPUs needs cpus_per_gpu"):
        sites.load_sites(tmp_path)


def instructors_profile(folder: Path) -> Path:
    """An instructor's new site, made as the README says: generic.yaml copied to kestrel.yaml and edited."""
    text = (sites.SITES_DIR / "generic.yaml").read_text().replace("name: generic", "name: kestrel")
    text = text.replace("gpu_types: []", "gpu_types: [a100]").replace("account: null", "account: kst-dl")
    modules = '  - export HPC_DL_LABS_MODULES="${HPC_DL_LABS_MODULES:-cuda/12.4 py/3.11}"\n'
    text = text.replace("setup:\n", "setup:\n" + modules)
    folder.mkdir(exist_ok=True)
    path = folder / "kestrel.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("mistake", "expected"), [
    (("account_required:", "acount_required:"), "kestrel.yaml: unknown key(s) acount_required (allowed: account, "),
    (("    gpus_per_node:", "    gpus_per_nod:"), "kestrel.yaml: partitions.gpu: unknown key(s) gpus_per_nod "),
    (('max_time: "1-00:00:00"', ""), "kestrel.yaml: 'max_time' is required"),
    (("    cpus_per_gpu: 8", ""), "kestrel.yaml: partitions.gpu: a partition with GPUs needs cpus_per_gpu"),
    # a cluster of GPU nodes only: the instructor leaves out the cpu default along with the cpu partition
    (("  cpu: cpu\n", ""), "kestrel.yaml: default_partitions must name a partition for cpu and for gpu jobs, e.g. "
                           "{cpu: cpu, gpu: gpu} (missing: cpu; a cluster without CPU nodes names its GPU partition "
                           "for cpu)"),
    (("gpus_per_node: 4", "gpus_per_node: four"), "kestrel.yaml: partitions.gpu.gpus_per_node must be a whole number"),
    (("gpus_per_node: 4", 'gpus_per_node: "4"'), "kestrel.yaml: partitions.gpu.gpus_per_node must be a whole number"),
    (("default_partitions:", "default_partitions: ["), "kestrel.yaml line 19: not valid YAML: "),
    # `module avail` marks the default version "(D)"; copied into a setup line it is a syntax error of every job
    (("cuda/12.4 py/3.11}\"", "cuda/12.4 py/3.11}\"\n  - module load cuda/12.4 (D)"),
     "kestrel.yaml: setup[1] must be one whole command bash can read, got 'module load cuda/12.4 (D)' (bash: syntax "
     "error near unexpected token `('); every job would fail at this line"),
    (("py/3.11}\"", "py/3.11}"), "kestrel.yaml: setup[0] must be one whole command bash can read, got 'export "),
    # a key YAML reads as a number or true (on, yes) beside a typo: sorting them for the message raised TypeError
    (("account_required:", "on: true\n2: 4\nacount_required:"),
     "kestrel.yaml: unknown key(s) 2, True, acount_required (allowed: "),
], ids=["typo-site-key", "typo-partition-key", "missing-max_time", "missing-cpus_per_gpu", "missing-cpu-default",
        "text-for-a-number", "quoted-number", "not-yaml", "module-avail-marker", "open-quote", "keys-of-other-types"])
def test_an_instructors_profile_mistake_is_one_line_naming_file_and_field_and_nothing_is_written(
        tmp_path, monkeypatch, mistake, expected):
    profile = instructors_profile(tmp_path / "sites")
    monkeypatch.setattr(rs, "find_site", lambda name: sites.find_site(name, profile.parent))
    out = tmp_path / "out" / "job.sbatch"
    assert rs.main(["--site", "kestrel", str(HELLO), "-o", str(out)]) == 0  # the profile as made renders
    out.unlink()
    text = profile.read_text()
    assert mistake[0] in text
    profile.write_text(text.replace(mistake[0], mistake[1], 1))
    with pytest.raises(UserError) as raised:
        rs.main(["--site", "kestrel", str(HELLO), "-o", str(out)])
    message = str(raised.value)
    assert message.startswith(str(profile)) and expected in message and "\n" not in message
    assert list(out.parent.iterdir()) == []


def test_a_profile_or_template_saved_in_another_encoding_is_one_line_naming_its_line(tmp_path, monkeypatch):
    """An editor that saves Latin-1 or Windows-1252 (an \u00fc in the cluster's title): a traceback before."""
    profile = instructors_profile(tmp_path / "sites")
    monkeypatch.setattr(rs, "find_site", lambda name: sites.find_site(name, profile.parent))
    text = profile.read_text().replace("title: 'A generic", "title: 'Kestrel Z\u00fcrich, a generic")
    profile.write_bytes(text.encode("latin-1"))
    out = tmp_path / "out" / "job.sbatch"
    with pytest.raises(UserError, match=rf"^{re.escape(str(profile))} line 5: not UTF-8 text \(byte 0xfc\): save the "
                                        "file as UTF-8$"):
        rs.main(["--site", "kestrel", str(HELLO), "-o", str(out)])
    profile.write_text(text)  # saved again as UTF-8: the profile renders, the template does not
    template = write_template(tmp_path, "# caf\u00e9\n")
    template.write_bytes(template.read_text().encode("cp1252"))
    with pytest.raises(UserError, match=rf"^{re.escape(str(template))} line 5: not UTF-8 text \(byte 0xe9\)"):
        rs.main(["--site", "kestrel", str(template), "-o", str(out)])
    assert not out.parent.exists()


# -- rendering -----------------------------------------------------------------------------------

@pytest.mark.parametrize("site", SITES)
def test_hello_renders_for_every_site(site, tmp_path):
    text = render_text(HELLO, site)
    profile = sites.find_site(site)
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
    rendered, _ = rendering.renderings(jobs.read_template(template), sites.load_sites())
    assert rendered, f"{template.name}: no site can run it"
    for site, (text, _) in rendered.items():
        lines = text.splitlines()
        assert lines[0] == "#!/bin/bash" and "{{" not in text and "{%" not in text
        for line in lines:
            if line.startswith("#SBATCH"):
                assert "  # " in line, f"{template.name} for {site}: an #SBATCH line without a comment: {line}"
        assert "set -euo pipefail" in text and "source slurm/lib/job_header.sh" in text
        # Each command on one line (continuation lines joined), comments left out.
        joined = text.replace("\\\n", " ").splitlines()
        commands = [line.strip() for line in joined if not line.lstrip().startswith("#")]
        launches = [line for line in commands if re.match(r"(run_preemptible )?srun\b", line)]
        if template.parent.name == "examples":
            continue
        assert launches, f"{template.name}: no srun"
        # Every launch stops the others when one task fails; only staging data (Lab-08's copy to each node, whose
        # failing node's exit status must stay the job's) lets each node's task end on its own.
        unstoppable = [line for line in launches if "--kill-on-bad-exit=1" not in line
                       and not ("--kill-on-bad-exit=0" in line and "stage_shards.sh copy" in line)]
        assert not unstoppable, (f"{template.name}: every srun needs --kill-on-bad-exit=1 (docs/conventions.md, "
                                 f"Jobs), so that one failed task ends the step: {unstoppable}")
        # sbatch job.sbatch --epochs 10: the flags after the script's name reach its training (the template
        # contract, slurm/sites/README.md), unless the template reads its own arguments (Lab-09's stage name).
        assert any('"$@"' in line for line in commands) or '"${1' in text, (
            f'{template.name}: no command passes "$@" on, so flags given to sbatch after the script are lost')
        assert "MASTER_PORT=" not in "\n".join(commands), "the port comes from the job header, never fixed"
        directives = "\n".join(line for line in lines if line.startswith("#SBATCH"))
        if resumes(text) and chains(text):  # Lab-09's chain: each link hands over to the next job, never requeues
            for needed in ("#SBATCH --signal=B:USR1@", "trap ", 'wait "$_step_pid"', "--dependency=afterany:"):
                assert needed in text, f"{template.name}: a chain link needs {needed!r}"
            assert "--requeue" not in directives and "scontrol requeue" not in text
            assert '--checkpoint "$RUN_DIR/checkpoint.pt" --resume' in text
        elif resumes(text):  # a training that can continue: it must be pre-emption safe
            for needed in ("#SBATCH --signal=B:USR1@", "#SBATCH --requeue ", "trap _forward_usr1 USR1",
                           "scontrol requeue", 'wait "$_step_pid"'):
                assert needed in text, f"{template.name}: pre-emption needs {needed!r}"
            # The job's checkpoint: a file, or (sharded, Lab-04) a folder named after it.
            assert ('--checkpoint "$CHECKPOINT" --resume' in text
                    or '--checkpoint-dir "${CHECKPOINT%.pt}" --resume' in text), (
                f"{template.name}: pre-emption needs the job's $CHECKPOINT passed with --resume")
        else:  # a requeued job that cannot resume would start over
            assert "--signal" not in directives and "--requeue" not in directives


def resumes(text: str) -> bool:
    """Whether a template's commands (not its comments) pass --resume."""
    return any("--resume" in line for line in text.splitlines() if not line.lstrip().startswith("#"))


def chains(text: str) -> bool:
    """Whether a template's commands submit its next link after it (``--dependency=afterany``)."""
    return any("--dependency=afterany" in line for line in text.splitlines() if not line.lstrip().startswith("#"))


def test_the_training_templates_are_the_ones_that_resume():
    """Chapter 4's two trainings, Lab-01's DDP runs, Lab-04's sharded trainings and Lab-09's chain link;
    Lab-01's baseline and DP runs are timings."""
    resumable = sorted(str(path.relative_to(REPO_ROOT)) for path in repository_templates()
                       if resumes(path.read_text().split("#}", 1)[1]))
    assert resumable == ["chapters/ch04_deep_learning/sbatch/multi_gpu.sbatch.j2",
                         "chapters/ch04_deep_learning/sbatch/single_gpu.sbatch.j2",
                         "labs/lab01_dp_vs_ddp/sbatch/ddp_srun_2node.sbatch.j2",
                         "labs/lab01_dp_vs_ddp/sbatch/ddp_torchrun_2node.sbatch.j2",
                         "labs/lab01_dp_vs_ddp/sbatch/ddp_torchrun_4gpu.sbatch.j2",
                         "labs/lab04_sharded_training/sbatch/sharded_srun_2node.sbatch.j2",
                         "labs/lab04_sharded_training/sbatch/sharded_torchrun_4gpu.sbatch.j2",
                         "labs/lab09_many_jobs/sbatch/chain_link.sbatch.j2"]


@pytest.mark.parametrize("template", sorted(rendering.COMMITTED_RENDERINGS))
def test_committed_renderings_equal_a_fresh_rendering(template):
    """`sbatch sbatch/single_gpu.sbatch` needs a plain file; it must never drift from its template.
    Refresh with: python scripts/render_sbatch.py --write-committed"""
    committed = rendering.committed_path(template)
    assert committed.read_text() == rendering.committed_text(template), (
        f"{committed.relative_to(REPO_ROOT)} differs from {template} rendered for "
        f"{rendering.COMMITTED_RENDERINGS[template]}: run python scripts/render_sbatch.py --write-committed")
    assert os.access(committed, os.X_OK)
    lines = committed.read_text().splitlines(keepends=True)
    assert lines[1].startswith("# Generated from ") and "--write-committed" in lines[1]
    assert "".join(lines[:1] + lines[3:]) == render_text(REPO_ROOT / template, rendering.COMMITTED_RENDERINGS[template])


def test_write_committed_writes_them(tmp_path, monkeypatch):
    monkeypatch.setattr(rendering, "REPO_ROOT", tmp_path)
    for template in rendering.COMMITTED_RENDERINGS:  # the templates, copied into a scratch repository
        (tmp_path / template).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / template).write_text((REPO_ROOT / template).read_text())
    (tmp_path / "slurm" / "lib").mkdir(parents=True)
    (tmp_path / "slurm" / "lib" / "preemptible_step.j2").write_text(
        (REPO_ROOT / "slurm" / "lib" / "preemptible_step.j2").read_text())
    assert rs.main(["--write-committed"]) == 0
    for template in rendering.COMMITTED_RENDERINGS:
        written = tmp_path / template.removesuffix(".j2")
        assert written.read_text() == (REPO_ROOT / template.removesuffix(".j2")).read_text()


def test_lab03_a100_and_dgx2_templates_differ_only_in_the_gpu():
    """The SJTU page's two run scripts are two templates; apart from the GPU model, the queue and the
    words saying so, they must stay the same script."""
    folder = REPO_ROOT / "labs" / "lab03_precision_benchmark" / "sbatch"

    def commands(name: str) -> list[str]:
        text = (folder / name).read_text().split("#}", 1)[1]
        return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]

    a100, dgx2 = commands("a100.sbatch.j2"), commands("dgx2.sbatch.j2")
    assert [line.replace("v100", "a100") for line in dgx2] == a100
    assert jobs.read_template(folder / "dgx2.sbatch.j2").request["gpu_type"] == "v100"
    assert jobs.read_template(folder / "a100.sbatch.j2").request["gpu_type"] == "a100"


def test_one_task_per_gpu_follows_the_gpu_count():
    template = REPO_ROOT / "chapters" / "ch04_deep_learning" / "sbatch" / "multi_gpu.sbatch.j2"
    assert jobs.read_template(template).request["ntasks_per_node"] == "gpus"
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
    # The header's render command is the template's: the line after the shebang names what was given beyond it.
    assert text.splitlines()[1].startswith("# Rendered with --set nodes=4 --set gpus_per_node=4 --set "
                                           "account=lt200123 --set time=02:00:00 ")
    assert "# Rendered with" not in render_text(HELLO, "lanta")
    cleared = render_text(HELLO, "lanta", "time=").splitlines()  # an empty value clears: the site's default
    assert cleared[1].startswith("# Rendered with --set time= (") and "None" not in cleared[1]


@pytest.mark.parametrize("template", ["sharded_srun_2node", "sharded_torchrun_4gpu"])
def test_lab04_templates_split_their_global_batch_over_any_number_of_gpus(template):
    """Rendered for 1 to 16 GPUs a node, each Lab-04 job's micro-batch divides its ranks' share of the
    global batch, as 02_sharded_training.py requires (4-GPU nodes: 8 ranks of 8, not 16, for the 2-node job)."""
    path = REPO_ROOT / "labs" / "lab04_sharded_training" / "sbatch" / f"{template}.sbatch.j2"
    for site, gpus in (("lanta", 1), ("lanta", 2), ("lanta", 4), ("sjtu-pi", 8), ("sjtu-pi", 16)):
        text = render_text(path, site, f"gpus_per_node={gpus}", "account=lt200123")
        ranks = gpus * (2 if "2node" in template else 1)
        if ranks > 16:  # more ranks than the tiny run's 16 sequences: that one cannot split
            continue
        batches = re.findall(r"--global-batch-size (\d+) --batch-size (\d+)", text)
        assert len(batches) == 2, text  # the lab's run and the tiny one
        for global_batch, micro in ((int(g), int(m)) for g, m in batches):
            assert global_batch % (ranks * micro) == 0 and micro <= 16, (template, gpus, global_batch, micro)


def test_set_sites_chooses_the_sites_of_every_rendering(tmp_path):
    """--all-sites --set sites=[lanta] rendered for every site (each script saying it was rendered with it)."""
    assert rs.main(["--all-sites", str(tmp_path), "--set", "sites=[lanta]", str(HELLO)]) == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [entry["site"] for entry in manifest] == ["lanta"]
    # the script says what was typed, not Python's ['lanta'] quoted for the shell
    second = (tmp_path / manifest[0]["script"]).read_text().splitlines()[1]
    assert second.startswith("# Rendered with --set 'sites=[lanta]' ("), second


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
    assert jobs.parse_settings(["time=10:00"]) == {"time": "10:00"}
    assert sites.time_to_seconds("10:00") == 600
    assert sites.time_to_seconds("1-02:00") == 26 * 3600
    assert sites.time_to_seconds("00:05:00") == 300


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
        # --all-sites --set account=... would charge every site's jobs to it: the profile is the other place to say it
        ("lanta", ["account=null"], "site lanta needs an account: pass --set account=YOUR_PROJECT, or give "
                                    "slurm/sites/lanta.yaml an account (edit-me renders, with a warning)"),
        ("generic", ["gpu_type=a100"], "asks for a100 GPUs but site generic, partition gpu has no named models"),
        # Zero is no limit to Slurm (--time=0) and all of the node's memory (--mem=0): past what the site allows.
        ("carc-discovery", ["time=0"], "time: '0' is no time limit to Slurm"),
        ("generic", ["mem=0G"], "mem: '0G' asks Slurm for all of each node's memory"),
        ("generic", ["ntasks_per_node=gpu"], "ntasks_per_node must be a whole number >= 1 or gpus (one process per "
                                             "GPU), got 'gpu'"),
        # sbatch splits an #SBATCH line into words: "my logs/%j.out" would log to "my" and pass "logs/%j.out" on.
        ("generic", ["output=my logs/%j.out"], "output must be one path without spaces or quotes"),
        ("generic", ["output=it's-%j.out"], "output must be one path without spaces or quotes"),
    ],
)
def test_impossible_requests_fail_with_one_clear_line(site, settings, expected):
    with pytest.raises(UserError) as raised:
        render_text(HELLO, site, *settings)
    message = str(raised.value)
    assert expected in message
    assert "\n" not in message
    assert message.startswith("slurm/examples/hello.sbatch.j2 for site ")


@pytest.mark.parametrize("mem", ["1.5G", "32B", "32 G"])
def test_a_memory_size_sbatch_cannot_read_is_refused(mem):
    """sbatch reads whole numbers only: --mem=1.5G and --mem=32B are "Invalid --mem specification" at submission."""
    with pytest.raises(UserError, match=f"mem: '{mem}' is not a size sbatch reads: a whole number, then K, M, G or T"):
        render_text(HELLO, "generic", f"mem={mem}")


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


def test_a_template_saved_with_a_bom_renders_as_without_one(tmp_path):
    """Notepad's UTF-8 starts with a byte-order mark: read as text, the job block was not first ('a template must start
    with its job block'), and a script starting with it is no batch script to sbatch."""
    template = tmp_path / "hello.sbatch.j2"
    template.write_bytes(b"\xef\xbb\xbf" + HELLO.read_bytes())
    out = tmp_path / "hello.sbatch"
    assert rs.main(["--site", "generic", str(template), "-o", str(out)]) == 0
    assert out.read_text() == render_text(HELLO, "generic")


def test_an_output_that_is_the_template_itself_is_refused_and_the_template_kept(tmp_path):
    """-o completed by the shell's tab to the template's own name replaced the template with its rendering."""
    template = write_template(tmp_path, "{{ job.sbatch }}\n")
    before = template.read_text()
    with pytest.raises(UserError, match=rf"^-o {re.escape(str(template))}: is the template itself, which the script "
                                        r"would replace; give the script's name, e\.g\. -o custom\.sbatch$"):
        rs.main(["--site", "generic", str(template), "-o", str(template)])
    assert template.read_text() == before and [path.name for path in tmp_path.iterdir()] == [template.name]


def test_placeholder_account_warns(capsys, tmp_path):
    assert rs.main(["--site", "lanta", str(HELLO), "-o", str(tmp_path / "x.sbatch")]) == 0
    assert "warning: account is the placeholder 'edit-me'" in capsys.readouterr().err


def test_an_output_in_a_folder_warns_that_slurm_does_not_create_it(capsys, tmp_path):
    """sbatch leaves a missing log folder missing: the job fails at once and no log says why."""
    argv = ["--site", "generic", str(HELLO), "-o", str(tmp_path / "x.sbatch")]
    assert rs.main([*argv, "--set", "output=logs/%x-%j.out"]) == 0
    assert "warning: output logs/%x-%j.out: Slurm does not create the folder logs; make it before sbatch " \
           "(mkdir -p logs where you submit)" in capsys.readouterr().err
    assert rs.main(argv) == 0
    assert "Slurm does not create" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--site", "nowhere", str(HELLO)], "unknown site 'nowhere' (known sites: "),
        (["--site", "lanta", str(HELLO), "--set", "gpus=2"], "--set gpus: unknown key"),
        (["--site", "lanta", str(HELLO), "--set", "nodes"], "expected key=value"),
        (["--site", "lanta", str(HELLO), "--set", "nodes=0"], "nodes must be a whole number >= 1, got 0"),
        (["--site", "lanta", str(HELLO), "--set", "sites=[generic]"], "--set sites: chooses the sites of --all-sites"),
        ([str(HELLO)], "choose a site with --site NAME"),
        (["--site", "lanta", "missing.sbatch.j2"], "missing.sbatch.j2: no such template"),
        # the name a README submits (the rendering's), the template without its folder, a committed rendering
        (["--site", "lanta", str(REPO_ROOT / "labs/lab01_dp_vs_ddp/sbatch/dp_4gpu.sbatch")],
         "labs/lab01_dp_vs_ddp/sbatch/dp_4gpu.sbatch: no such template (did you mean "
         "labs/lab01_dp_vs_ddp/sbatch/dp_4gpu.sbatch.j2?)"),
        (["--site", "lanta", "hello.sbatch.j2"], "hello.sbatch.j2: no such template (did you mean "
                                                  "slurm/examples/hello.sbatch.j2?)"),
        (["--site", "lanta", str(REPO_ROOT / "chapters/ch04_deep_learning/sbatch/single_gpu.sbatch")],
         "chapters/ch04_deep_learning/sbatch/single_gpu.sbatch: a rendered script, not a template: render its "
         "template, chapters/ch04_deep_learning/sbatch/single_gpu.sbatch.j2"),
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


@pytest.mark.parametrize(("expression", "expected"), [
    ("{{ job.time + 1 }}", 'TypeError: can only concatenate str (not "int") to str'),
    ("{{ job.gpus // (job.nodes - 1) }}", "ZeroDivisionError: integer division or modulo by zero"),
])
def test_an_expression_that_fails_names_the_template_line(tmp_path, expression, expected):
    """An instructor's own template: a failing expression was a traceback from inside Jinja."""
    template = write_template(tmp_path, "{{ job.sbatch }}\n\necho " + expression + "\n")
    with pytest.raises(UserError) as raised:
        rs.main(["--site", "generic", str(template), "-o", str(tmp_path / "job.sbatch")])
    assert str(raised.value) == f"{template}:7: {expected}"
    assert not (tmp_path / "job.sbatch").exists()


def test_undefined_site_variable_is_an_error_too(tmp_path):
    template = write_template(tmp_path, "echo {{ site.partitions.gpu.tflops }}\n")
    with pytest.raises(UserError, match=r"undefined variable: .*'tflops'"):
        render_text(template, "generic")


def test_template_without_job_block_is_refused(tmp_path):
    template = tmp_path / "plain.sbatch.j2"
    template.write_text("#!/bin/bash\necho hi\n")
    with pytest.raises(UserError, match="must start with its job block"):
        jobs.read_template(template)


def test_unknown_job_block_key_is_refused(tmp_path):
    template = write_template(tmp_path, "", "job:\n  gpus: 2\n")
    with pytest.raises(UserError, match=r"unknown key\(s\) gpus"):
        jobs.read_template(template)


def test_syntax_error_names_the_line(tmp_path):
    template = write_template(tmp_path, "{% if job.nodes %}\necho\n")
    with pytest.raises(UserError, match=r"custom\.sbatch\.j2:\d+: template syntax error"):
        render_text(template, "generic")


# -- every template for every site (what CI submits) ---------------------------------------------

def template_folder(tmp_path: Path, **job_blocks: str) -> Path:
    """``tmp_path/templates`` holding a template per keyword: its job block's YAML, then its #SBATCH lines."""
    folder = tmp_path / "templates"
    folder.mkdir()
    for name, block in job_blocks.items():
        (folder / f"{name}.sbatch.j2").write_text("{# job:\n  " + block + "\n#}\n#!/bin/bash\n{{ job.sbatch }}\n")
    return folder


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


def test_rendering_again_into_a_folder_removes_the_scripts_it_now_skips(tmp_path):
    """A site changed to 2 GPUs a node: its 4-GPU scripts of the last rendering were left there, submittable."""
    out = tmp_path / "out"
    assert rs.main(["--all-sites", str(out), str(HELLO)]) == 0
    first = {entry["script"] for entry in json.loads((out / "manifest.json").read_text())}
    (out / "mine.txt").write_text("not the renderer's")
    assert rs.main(["--all-sites", str(out), "--set", "sites=[lanta]", str(HELLO)]) == 0
    second = {entry["script"] for entry in json.loads((out / "manifest.json").read_text())}
    assert second < first and [p for p in out.rglob("*.sbatch")] == [out / script for script in second]
    assert (out / "mine.txt").read_text() == "not the renderer's"


def test_all_sites_warns_once_a_site_of_a_placeholder_account_and_refuses_to_render_nothing(tmp_path, capsys):
    """A single rendering warned of lanta's 'edit-me' account; --all-sites wrote 48 such scripts silently. And a
    request no site can meet rendered 0 scripts, wrote an empty list and exited 0."""
    assert rs.main(["--all-sites", str(tmp_path / "out"), str(HELLO)]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "placeholder" in line]
    placeholders = sorted(name for name, site in sites.load_sites().items()
                          if str(site.account or "").startswith(jobs.PLACEHOLDER))
    assert "lanta" in placeholders and [line.split(":")[1].strip() for line in warned] == placeholders
    with pytest.raises(rs.UserError, match=rf"nothing rendered: every site skipped every template \({len(SITES)} pair"):
        rs.main(["--all-sites", str(tmp_path / "none"), "--set", "gpus_per_node=64", str(HELLO)])
    assert not (tmp_path / "none").exists()


def test_all_sites_skips_a_site_that_cannot_run_a_template_and_says_why(tmp_path, capsys):
    templates = template_folder(tmp_path, eight_gpus="gpus_per_node: 8\n  cpus_per_task: 1")
    out = tmp_path / "out"
    assert rs.main(["--all-sites", str(out), str(templates)]) == 0
    printed = capsys.readouterr().out
    assert ("skipped lanta/templates/eight_gpus.sbatch: the job asks for 8 GPU(s) per node but site lanta, "
            "partition gpu has 4 per node\n") in printed
    assert ("skipped carc-discovery/templates/eight_gpus.sbatch: the job asks for 8 GPU(s) per node but site "
            "carc-discovery, partition gpu has 2 per node\n") in printed
    # The profiles decide (a site an instructor adds counts as well): those with 8 GPUs a node render it.
    eight = sorted(name for name, site in sites.load_sites().items()
                   if any(part.gpus_per_node >= 8 for part in site.partitions.values()))
    assert f"skipped {len(SITES) - len(eight)} pair(s) a site cannot run" in printed
    assert "sjtu-pi" in eight  # 16 per node
    assert [entry["site"] for entry in json.loads((out / "manifest.json").read_text())] == eight
    assert sorted(path.name for path in out.iterdir()) == sorted(["manifest.json", *eight])  # a site may sort first


def test_the_repository_templates_skip_only_the_sites_without_the_gpus_they_ask_for(tmp_path):
    """What --all-sites renders is decided by the profiles, not by lists in the templates: the 4-GPU jobs
    everywhere but carc-discovery (2 per node), the A100 and V100 benchmarks where the site has that model."""
    _, errors, skipped = rendering.render_all([REPO_ROOT / "chapters", REPO_ROOT / "labs"], tmp_path / "out", {},
                                              sites.load_sites())
    assert errors == []
    four_gpus = {"chapters/ch04_deep_learning/sbatch/multi_gpu.sbatch", "labs/lab01_dp_vs_ddp/sbatch/dp_4gpu.sbatch",
                 "labs/lab01_dp_vs_ddp/sbatch/ddp_torchrun_4gpu.sbatch", "labs/lab01_dp_vs_ddp/sbatch/env_check.sbatch",
                 "labs/lab04_sharded_training/sbatch/sharded_torchrun_4gpu.sbatch",
                 "labs/lab05_scaling/sbatch/bandwidth_1node.sbatch",
                 "labs/lab07_model_parallel/sbatch/model_parallel_4gpu.sbatch"}
    lab03 = "labs/lab03_precision_benchmark/sbatch/"
    expected = ({f"carc-discovery/{script}" for script in four_gpus}
                | {f"{site}/{lab03}a100.sbatch" for site in ("generic", "sjtu-pi")}
                | {f"{site}/{lab03}dgx2.sbatch" for site in ("generic", "lanta", "sjtu-siyuan")})
    course = ("carc-discovery", "generic", "lanta", "sjtu-pi", "sjtu-siyuan")  # a site an instructor adds: its own
    assert {line.partition(": ")[0] for line in skipped if line.startswith(course)} == expected
    assert all("the job asks for 4 GPU(s) per node but site carc-discovery, partition gpu has 2 per node" in line
               for line in skipped if line.startswith("carc-discovery/"))


def test_all_sites_renders_for_a_new_site_beside_the_generic_one_alone(tmp_path):
    """An instructor keeps generic.yaml and adds their cluster's profile (4 x A100): every template that such a
    node can run renders for it, the A100 benchmark included, with the other shipped profiles gone."""
    folder = tmp_path / "sites"
    folder.mkdir()
    shutil.copy(sites.SITES_DIR / "generic.yaml", folder)
    text = (sites.SITES_DIR / "generic.yaml").read_text().replace("name: generic", "name: aurora")
    (folder / "aurora.yaml").write_text(text.replace("gpu_types: []", "gpu_types: [a100]"))
    entries, errors, skipped = rendering.render_all([REPO_ROOT / "labs", REPO_ROOT / "chapters"], tmp_path / "out",
                                                    {}, sites.load_sites(folder))
    assert errors == []
    rendered = {entry["script"] for entry in entries}
    assert "aurora/labs/lab03_precision_benchmark/sbatch/a100.sbatch" in rendered
    assert "aurora/labs/lab05_scaling/sbatch/scaling_array.sbatch" in rendered
    assert sorted(line.partition(": ")[0] for line in skipped) == [
        "aurora/labs/lab03_precision_benchmark/sbatch/dgx2.sbatch",
        "generic/labs/lab03_precision_benchmark/sbatch/a100.sbatch",
        "generic/labs/lab03_precision_benchmark/sbatch/dgx2.sbatch"]


def test_all_sites_fails_whole_when_a_template_is_wrong(tmp_path, capsys):
    templates = template_folder(tmp_path, fine="nodes: 1", typo="kind: tpu")
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"failed; nothing written") as raised:
        rs.main(["--all-sites", str(out), str(templates)])
    assert re.search(r"typo\.sbatch\.j2 for site [\w-]+: kind must be cpu or gpu, got 'tpu' \(1 template\(s\) failed",
                     capsys.readouterr().err + str(raised.value))
    assert not out.exists()


def test_all_sites_says_once_what_every_template_meets_at_a_site(tmp_path, capsys, monkeypatch):
    """A new site that needs an account and has none: one line said it for each of the repository's templates
    (24 lines that differ only in the template); now one line with the count, and nothing written."""
    folder = tmp_path / "sites"
    folder.mkdir()
    shutil.copy(sites.SITES_DIR / "generic.yaml", folder)
    text = (sites.SITES_DIR / "generic.yaml").read_text().replace("name: generic", "name: zz")
    (folder / "zz.yaml").write_text(text.replace("account_required: false", "account_required: true"))
    monkeypatch.setattr(rs, "load_sites", lambda: sites.load_sites(folder))
    templates = template_folder(tmp_path, first="nodes: 1", second="nodes: 1", typo="kind: tpu")
    with pytest.raises(UserError) as raised:
        rs.main(["--all-sites", str(tmp_path / "out"), str(templates)])
    printed, last = capsys.readouterr().err.splitlines(), str(raised.value)
    assert len(printed) == 1 and printed[0].startswith("error: ") and last.endswith("(3 template(s) failed; nothing "
                                                                                   "written)")
    said = [printed[0].removeprefix("error: "), last.removesuffix(" (3 template(s) failed; nothing written)")]
    assert [line for line in said if line.startswith("2 templates for site zz: site zz needs an account: pass "
                                                     "--set account=")]
    assert [line for line in said if line.endswith("typo.sbatch.j2 for site generic: kind must be cpu or gpu, got "
                                                   "'tpu'")]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("blocker", ["lanta", "manifest.json"])
def test_all_sites_writes_nothing_when_something_stands_where_it_writes(tmp_path, blocker):
    out = tmp_path / "out"
    out.mkdir()
    if blocker == "lanta":
        (out / "lanta").write_text("a file where the site's folder goes\n")
    else:
        (out / "manifest.json").mkdir()
    with pytest.raises(UserError) as raised:
        rs.main(["--all-sites", str(out), str(HELLO.parent)])
    message = str(raised.value)
    assert message.startswith(f"{out / blocker}: is a {'file' if blocker == 'lanta' else 'folder'}, where ")
    assert "nothing written" in message and "\n" not in message
    assert [path.name for path in out.iterdir()] == [blocker]


def test_a_template_may_name_the_sites_it_is_for(tmp_path):
    templates = template_folder(tmp_path, dgx2_only="gpus_per_node: 16\n  sites: [sjtu-pi]")
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


def test_job_header_counts_cores_not_an_omp_num_threads_already_exported():
    """GNU nproc prints OMP_NUM_THREADS when it is set: the generic site's pytorch.sh exports it before the header,
    and so may a login shell (sbatch passes the environment on). The header counts the cores all the same."""
    usable = min(2, len(os.sched_getaffinity(0)))
    for exported in ({"OMP_NUM_THREADS": "1"}, {"OMP_THREAD_LIMIT": "1"}):
        done = run_header({"SLURM_CPUS_PER_TASK": "2", **exported}, 'echo "RESULT $NUM_WORKERS $OMP_NUM_THREADS"')
        assert f"RESULT {max(usable - 1, 0)} {usable}" in done.stdout, (exported, done.stdout, done.stderr)


def test_job_header_workers_leave_one_core_for_training():
    done = run_header({"SLURM_CPUS_PER_TASK": "2"}, 'echo "RESULT $NUM_WORKERS $OMP_NUM_THREADS"')
    usable = min(2, len(os.sched_getaffinity(0)))
    assert f"RESULT {max(usable - 1, 0)} {usable}" in done.stdout


def test_job_header_device_can_be_forced():
    done = run_header({"HPC_DL_LABS_DEVICE": "cuda"}, 'echo "RESULT $DEVICE"')
    assert "RESULT cuda" in done.stdout


def node_tools(tmp_path: Path, gpus: int | None) -> str:
    """A PATH holding only what the header runs, plus a stand-in nvidia-smi listing ``gpus`` GPUs
    as the real one prints them (none at all when ``gpus`` is None)."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("hostname", "date", "grep", "sort", "nproc"):
        (tools / tool).symlink_to(shutil.which(tool))
    if gpus is not None:
        fake = tools / "nvidia-smi"
        fake.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-5d1e-{i})'\n"
                                                for i in range(gpus)))
        fake.chmod(0o755)
    return str(tools)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "cuda"),                                                # outside Slurm: every GPU
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, "cuda"),
        ({"CUDA_VISIBLE_DEVICES": "GPU-5d1e-1"}, "cuda"),            # Slurm may hand out UUIDs
        ({"CUDA_VISIBLE_DEVICES": "1,2"}, "cpu"),                    # index 2 is no GPU of this machine
        ({"CUDA_VISIBLE_DEVICES": ""}, "cpu"),
        ({"SLURM_JOB_ID": "7"}, "cpu"),                              # a job without a GPU allocation
        ({"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "0"}, "cuda"),
    ],
)
def test_job_header_without_a_gpu_allocation_takes_the_gpus_nvidia_smi_lists(tmp_path, env, expected):
    done = run_header({"PATH": node_tools(tmp_path, gpus=2), **env}, 'echo "RESULT $DEVICE"')
    assert done.returncode == 0, done.stderr
    assert f"RESULT {expected}" in done.stdout


def test_job_header_without_nvidia_smi_or_allocation_is_cpu(tmp_path):
    done = run_header({"PATH": node_tools(tmp_path, gpus=None), "CUDA_VISIBLE_DEVICES": "0"}, 'echo "RESULT $DEVICE"')
    assert done.returncode == 0, done.stderr
    assert "RESULT cpu" in done.stdout


GPU_JOB = {"SLURM_JOB_ID": "7", "SLURM_GPUS_ON_NODE": "2"}


@pytest.mark.parametrize(
    ("gpus", "env", "warning"),
    [
        (None, {**GPU_JOB, "CUDA_VISIBLE_DEVICES": "0,1"}, "nvidia-smi is not on PATH"),
        (0, {**GPU_JOB, "CUDA_VISIBLE_DEVICES": "0,1"}, "nvidia-smi lists no GPU"),
        (1, {**GPU_JOB, "CUDA_VISIBLE_DEVICES": "0,1"}, "CUDA_VISIBLE_DEVICES=0,1 names GPUs nvidia-smi does not list"),
        (None, GPU_JOB, "nvidia-smi is not on PATH"),                # and CUDA_VISIBLE_DEVICES unset
        (2, GPU_JOB, None),                                          # unset: every GPU of the node
        (2, {**GPU_JOB, "CUDA_VISIBLE_DEVICES": "1"}, None),
        (None, {"SLURM_JOB_ID": "7", "SLURM_JOB_GPUS": "3"}, "nvidia-smi is not on PATH"),  # older Slurm
    ],
)
def test_job_header_asks_for_cuda_whenever_slurm_allocated_gpus(tmp_path, gpus, env, warning):
    """A job with GPUs never turns into a CPU run that looks like a GPU result: it asks for cuda, and
    a GPU PyTorch cannot use stops the training with one error line (--device cuda)."""
    done = run_header({"PATH": node_tools(tmp_path, gpus), **env}, 'echo "RESULT $DEVICE"')
    assert done.returncode == 0, done.stderr
    assert "RESULT cuda" in done.stdout and "DEVICE=cuda" in done.stdout
    notes = [line for line in done.stdout.splitlines() if line.startswith("== warning:")]
    if warning is None:
        assert notes == []
    else:
        assert len(notes) == 1 and warning in notes[0] and "the training stops with an error" in notes[0], notes


def test_fake_gpus_switch_runs_a_gpu_job_on_the_cpu_and_says_so(tmp_path):
    """The test cluster's GPUs are device files with nothing behind them: it sets HPC_DL_LABS_FAKE_GPUS=1."""
    env = {"PATH": node_tools(tmp_path, gpus=None), **GPU_JOB, "CUDA_VISIBLE_DEVICES": "0,1"}
    done = run_header({**env, "HPC_DL_LABS_FAKE_GPUS": "1"}, 'echo "RESULT $DEVICE"')
    assert done.returncode == 0, done.stderr
    assert "RESULT cpu" in done.stdout
    assert ("== note: HPC_DL_LABS_FAKE_GPUS=1 (the test cluster): the allocated GPU(s) are not real; "
            "running on the CPU") in done.stdout
    forced = run_header({**env, "HPC_DL_LABS_DEVICE": "cpu"}, 'echo "RESULT $DEVICE"')
    assert "RESULT cpu" in forced.stdout and "== warning" not in forced.stdout


# -- the committed Chapter 4 jobs, as the LANTA chapter's commands submit them -------------------

def job_root(tmp_path: Path) -> Path:
    """A repository root with what a job's preamble runs (the job header, pytorch.sh) and no .venv."""
    root = tmp_path / "repo"
    for relative in ("slurm/lib/job_header.sh", "slurm/module-loads/pytorch.sh"):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / relative, root / relative)
    return root


def stand_ins(folder: Path, *, python: bool | None) -> Path:
    """``srun`` that prints which python it would start and its arguments, and (unless None) a
    ``python`` that answers pytorch.sh's "is torch importable?" with yes or no."""
    folder.mkdir(parents=True)
    (folder / "srun").write_text('#!/bin/sh\necho "SRUN $(command -v python) $*"\n')
    if python is not None:
        (folder / "python").write_text(f"#!/bin/sh\nexit {0 if python else 1}\n")
    for tool in folder.iterdir():
        tool.chmod(0o755)
    return folder


def run_committed_job(name: str, tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``bash <committed sbatch> ARGS`` as a job would run it (SLURM_JOB_ID set, one GPU allocated,
    the test cluster's fake-GPU switch), from a repository root without .venv, in ``env``."""
    clean = {key: value for key, value in os.environ.items()
             if not key.startswith(("SLURM_", "HPC_DL_LABS_", "MASTER_", "CUDA_", "CONDA", "VIRTUAL_ENV", "DATA_DIR"))}
    job = {"SLURM_JOB_ID": "41", "SLURM_JOB_NAME": name, "SLURM_GPUS_ON_NODE": "1", "HPC_DL_LABS_FAKE_GPUS": "1",
           "HOME": str(tmp_path / "home"), "HPC_DL_LABS_ROOT": str(job_root(tmp_path))}
    script = REPO_ROOT / "chapters" / "ch04_deep_learning" / "sbatch" / f"{name}.sbatch"
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, cwd=tmp_path,
                          env={**clean, **job, **env}, timeout=60)


@pytest.mark.parametrize("name", ["single_gpu", "multi_gpu"])
@pytest.mark.parametrize("environment", ["conda", "venv", "module"])
def test_committed_chapter4_jobs_run_in_the_environment_the_user_has_active(tmp_path, name, environment):
    """The LANTA chapter: `source slurm/module-loads/pytorch.sh`, then `sbatch sbatch/single_gpu.sbatch`.
    Slurm passes the submitting shell's environment to the job: a conda environment, a venv or a
    module's python must be what the job runs, with or without the repository's .venv."""
    active = stand_ins(tmp_path / "env" / "bin", python=True)
    env = {"PATH": f"{active}:/usr/bin:/bin"}
    if environment == "conda":
        env.update(CONDA_PREFIX=str(active.parent), CONDA_DEFAULT_ENV="mine")
    elif environment == "venv":
        env.update(VIRTUAL_ENV=str(active.parent))
    else:
        env.update(HPC_DL_LABS_MODULES="pytorch/2.4")  # no `module` command here: a note, and the python stays
    done = run_committed_job(name, tmp_path, env)
    assert done.returncode == 0, done.stdout + done.stderr
    launches = [line for line in done.stdout.splitlines() if line.startswith("SRUN ")]
    assert launches and all(line.startswith(f"SRUN {active / 'python'} ") for line in launches), done.stdout


def test_committed_job_falls_back_to_the_repository_venv_and_stops_without_any_python(tmp_path):
    bare = stand_ins(tmp_path / "bin", python=False)  # a python without PyTorch, like the system's
    venv = job_root(tmp_path) / ".venv" / "bin"
    stand_ins(venv, python=True)
    (venv / "activate").write_text(f'export PATH="{venv}:$PATH"\n')
    done = run_committed_job("single_gpu", tmp_path, {"PATH": f"{bare}:/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SRUN {venv / 'python'} --kill-on-bad-exit=1 python chapters/ch04_deep_learning/mnist_training.py" \
        in done.stdout
    shutil.rmtree(venv.parent)
    done = run_committed_job("single_gpu", tmp_path, {"PATH": f"{bare}:/usr/bin:/bin"})
    assert done.returncode == 1 and "SRUN" not in done.stdout
    assert [line for line in done.stderr.splitlines() if line.startswith("error:")] == [
        f"error: pytorch.sh: no python with PyTorch (python is {bare / 'python'}); activate your environment before "
        "sbatch (mamba env create -f environments/ml-gpu.yaml, or load your site's PyTorch module, or bash "
        "scripts/bootstrap.sh)"]


def readme_download_folder(home: Path, monkeypatch) -> Path:
    """Where the Chapter 4 README's download command puts MNIST for a user whose home is ``home``."""
    readme = (REPO_ROOT / "chapters" / "ch04_deep_learning" / "README.md").read_text()
    (line,) = [line for line in readme.splitlines() if "download_data.py mnist" in line and line.startswith("python")]
    words = shlex.split(line, comments=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("DATA_DIR", raising=False)
    args = load_script("scripts/download_data.py").build_parser().parse_args(words[2:])
    return args.data_dir.expanduser()


@pytest.mark.parametrize("data_dir", [None, "/scratch/me/data"])
def test_the_readme_downloads_mnist_where_the_committed_jobs_read_it(tmp_path, monkeypatch, data_dir):
    """One data setting: DATA_DIR (default ~/data) for the download on the login node and for the jobs."""
    env = {"PATH": f"{stand_ins(tmp_path / 'env' / 'bin', python=True)}:/usr/bin:/bin", "HOME": str(tmp_path / "home")}
    if data_dir:
        env["DATA_DIR"] = data_dir
        monkeypatch.setenv("DATA_DIR", data_dir)
        downloaded = load_script("scripts/download_data.py").build_parser().parse_args(["mnist"]).data_dir
    else:
        downloaded = readme_download_folder(tmp_path / "home", monkeypatch)
    for name in ("single_gpu", "multi_gpu"):
        done = run_committed_job(name, tmp_path / name, env, "--dataset", "mnist")
        assert done.returncode == 0, done.stdout + done.stderr
        (training,) = [line for line in done.stdout.splitlines() if line.startswith("SRUN ") and "--resume" in line]
        assert f" --data-dir {downloaded} " in training and training.endswith(" --dataset mnist"), training
    assert downloaded == (Path(data_dir) if data_dir else tmp_path / "home" / "data")


@pytest.mark.parametrize("has_seff", [True, False])
def test_lab02_jobs_end_with_seff(tmp_path, has_seff):
    """The USC lab runs `seff <jobid>` after the job: both Lab-02 jobs print it at their end (or, where
    the cluster has no seff, how to get the same numbers), without failing the job either way."""
    tools = stand_ins(tmp_path / "bin", python=True)
    stand_in = {"kernprof": "KERNPROF", **({"seff": "SEFF"} if has_seff else {})}
    for name, word in stand_in.items():
        (tools / name).write_text(f'#!/bin/sh\necho "{word} $*"\n')
        (tools / name).chmod(0o755)
    clean = {key: value for key, value in os.environ.items()
             if not key.startswith(("SLURM_", "HPC_DL_LABS_", "MASTER_", "CUDA_", "CONDA", "VIRTUAL_ENV"))}
    env = {**clean, "PATH": f"{tools}:/usr/bin:/bin", "SLURM_JOB_ID": "88", "SLURM_JOBID": "88",
           "RESULTS_DIR": str(tmp_path / "results")}
    usc_job = subprocess.run(["bash", str(REPO_ROOT / "labs" / "lab02_profiling" / "job.slurm")], capture_output=True,
                             text=True, cwd=tmp_path, timeout=60,
                             env={**env, "SLURM_SUBMIT_DIR": str(REPO_ROOT / "labs" / "lab02_profiling")})
    rendered = tmp_path / "profile.sbatch"
    rendered.write_text(render_text(REPO_ROOT / "labs" / "lab02_profiling" / "sbatch" / "profile.sbatch.j2", "generic"))
    template_job = subprocess.run(["bash", str(rendered)], capture_output=True, text=True, cwd=tmp_path, timeout=60,
                                  env={**env, "HPC_DL_LABS_ROOT": str(job_root(tmp_path))})
    for done in (usc_job, template_job):
        assert done.returncode == 0, done.stdout + done.stderr
        lines = done.stdout.splitlines()
        assert any(line.startswith(("KERNPROF ", "SRUN ")) for line in lines)
        if has_seff:
            assert lines[-1] == "SEFF 88"
        else:
            assert "seff" in lines[-1] and "sacct -j 88 --format=JobID,Elapsed,TotalCPU,MaxRSS" in lines[-1]


def test_the_sites_readme_lists_every_template_of_the_course():
    """slurm/sites/README.md's "The course's templates" table, where an instructor looks for a job: every template
    of chapters/ and labs/ has a row (a row may name a second template of the same folder by its file name)."""
    table = (REPO_ROOT / "slurm" / "sites" / "README.md").read_text().split("## The course's templates", 1)[1]
    table = table.split("\n\n", 2)[1]
    listed = set()
    for first_cell in re.findall(r"^\| (.*?) \|", table, re.M):
        paths = re.findall(r"`([^`]+\.sbatch\.j2)`", first_cell)
        folder = paths[0].rsplit("/", 1)[0] if paths else ""
        listed |= {path if "/" in path else f"{folder}/{path}" for path in paths}
    templates = {str(path.relative_to(REPO_ROOT)) for path in repository_templates()
                 if path.relative_to(REPO_ROOT).parts[0] in ("chapters", "labs")}
    assert len(templates) >= 25
    assert not templates - listed, ("slurm/sites/README.md's template table lacks a row for "
                                    f"{sorted(templates - listed)}")
    assert not listed - templates, ("slurm/sites/README.md's template table names templates that are gone: "
                                    f"{listed - templates}")


@pytest.mark.parametrize(("limit", "requeued"), [("1:00", False), ("1:00:00", True), ("1-00:00:00", True)])
def test_a_preemptible_job_requeues_itself_only_when_its_time_limit_leaves_room(tmp_path, limit, requeued):
    """The training templates' pre-emption block (slurm/lib/preemptible_step.j2) under bash, with squeue and scontrol
    stand-ins: a job whose limit is within the 120 s signal margin would be signalled at every start and go round
    the queue for ever, so it saves and stops; a job with room requeues itself after its save."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(f"#!/bin/bash\necho {limit}\n")
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$*" >> {tmp_path}/scontrol_calls\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    block = re.sub(r"\{#.*?#\}\n", "", (REPO_ROOT / "slurm" / "lib" / "preemptible_step.j2").read_text(), flags=re.S)
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --signal=B:USR1@120  # as the templates ask\nset -euo pipefail\n"
                      "source slurm/lib/job_header.sh\n" + block +
                      "run_preemptible bash -c 'trap \"echo saved; exit 0\" USR1; "
                      # what the training would say (Preemption.what_next: HPC_DL_LABS_ON_<SIGNAL>, then _ON_STOP)
                      "echo \"on SIGTERM: ${HPC_DL_LABS_ON_SIGTERM:-${HPC_DL_LABS_ON_STOP:-its own words}}\"; "
                      "echo \"started: ${HPC_DL_LABS_ON_SIGUSR1:-${HPC_DL_LABS_ON_STOP:-requeue}}\"; "
                      "while :; do sleep 0.1; done'\necho 'after the step'\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "t"}
    job = subprocess.Popen(["bash", str(script)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in job.stdout:
            seen.append(line)
            if line.startswith("started"):
                job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 sends the batch shell
                break
        out = "".join(seen) + job.communicate(timeout=30)[0]
    finally:
        job.kill()
    assert job.returncode == 0 and "saved" in out and "after the step" not in out, out[-3000:]
    calls = (tmp_path / "scontrol_calls").read_text() if (tmp_path / "scontrol_calls").exists() else ""
    assert ("requeue 77" in calls) is requeued, (calls, out[-2000:])
    assert ("WARNING: a time limit of 60 s leaves no room past the 120 s signal margin" in out) is not requeued
    assert ("CHECKPOINT=checkpoints/t-77.pt sbatch --time=<longer>" in out) is not requeued
    told = "started: requeue" if requeued else (
        "started: this job does not requeue itself (its time limit is too short); "
        "to go on: CHECKPOINT=checkpoints/t-77.pt sbatch --time=<longer>")
    assert told in out  # the training is told too, and says the same when SIGUSR1 stops it
    assert "on SIGTERM: its own words" in out  # scancel: the job is cancelled, whatever its time limit
