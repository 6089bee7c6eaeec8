# shellcheck shell=bash
# Set up a shell (or a job script) to run the course's PyTorch scripts. Source it, do not run it:
#
#     source slurm/module-loads/pytorch.sh                 # from the repository root
#     source ../../slurm/module-loads/pytorch.sh           # from a chapter folder
#
# (It replaces the LANTA chapter's `mamba activate hpc-ignite-ml`: it activates the conda environment
# of environments/ml-gpu.yaml, named hpc-dl-labs-gpu here, or hpc-ignite-ml if you created it so.)
#
# It (1) loads your cluster's modules, (2) activates the course's Python environment, and
# (3) exports the variables below. Safe under `set -euo pipefail`, and on a machine without
# environment modules (a laptop, CI): anything it cannot do becomes a "pytorch.sh: ..." note on
# stderr, never a failed job; only a job left without any Python that has PyTorch stops here.
#
#   OMP_NUM_THREADS   CPU threads per process = SLURM_CPUS_PER_TASK when Slurm set it (otherwise
#                     left as it was): PyTorch would start one thread per core of the whole node
#   MKL_NUM_THREADS   the same, for Intel MKL's own thread pool
#   PYTHONUNBUFFERED  1: print() reaches slurm-<jobid>.out as it happens, not when the job ends
#   HPC_DL_LABS_ROOT  the repository root (this file is slurm/module-loads/pytorch.sh in it)
#   PYTHONPATH        the repository root first, when the python found cannot import `common` (a
#                     site's PyTorch module, with no environment the course was installed into)
#
# Choose the environment with variables set before sourcing (defaults in brackets):
#   HPC_DL_LABS_MODULES   modules to load, space-separated [the SITE line below, else none]
#   HPC_DL_LABS_ENV       conda environment to activate [none: a python that already has PyTorch is
#                         kept (an environment you activated, a module's); else hpc-dl-labs-gpu from
#                         environments/ml-gpu.yaml, or hpc-ignite-ml, the name the LANTA chapter gave it;
#                         else the repository's .venv (bash scripts/bootstrap.sh)]
#
# Without any Python that has PyTorch it says so; inside a Slurm job it then returns 1, so the job
# stops with that one line (the generic site's jobs source this file: slurm/sites/generic.yaml).
#
# Which PyTorch module: PyTorch 2.8 or newer (the course's floor, run in CI by scripts/torch_floor.sh;
# the newest release tested is 2.15.0). With an older one every script stops at start with one line
# naming the release it found and the floor (exit status 2); vendor builds count as their release
# (NGC's 2.8.0a0+... is a 2.8).

_pt_note() { echo "pytorch.sh: $*" >&2; }

# Conda's and Lmod's shell functions read unset variables, so `set -u` in the caller would kill them:
# switch -u off while they run and restore the caller's setting afterwards.
_pt_nounset=0
case $- in *u*) _pt_nounset=1 ;; esac
set +u

HPC_DL_LABS_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export HPC_DL_LABS_ROOT

# --- 1. modules ----------------------------------------------------------------------------------
# SITE: uncomment the line for your cluster (module names change: check `module avail` first), or
# set HPC_DL_LABS_MODULES before sourcing this file.
# SITE LANTA (ThaiSC):         _pt_site_modules="Mamba/23.11.0-0"
# SITE SJTU π 2.0 / Siyuan-1:  _pt_site_modules="miniconda3"
# SITE USC CARC Discovery:     _pt_site_modules="conda"
_pt_site_modules="${_pt_site_modules:-}"
_pt_modules="${HPC_DL_LABS_MODULES:-$_pt_site_modules}"
if [[ -n "$_pt_modules" ]]; then
    if type module >/dev/null 2>&1; then
        # SITE: some clusters want a clean slate first (CARC's examples do `module purge`); on Cray
        # systems such as LANTA a purge also removes the programming environment, so it is off here.
        # module purge
        for _pt_module in $_pt_modules; do
            module load "$_pt_module" || _pt_note "could not load module $_pt_module (module avail lists the names)"
        done
    else
        _pt_note "no 'module' command on this machine; not loading: $_pt_modules"
    fi
fi

# --- 2. the Python environment -------------------------------------------------------------------
# The first of: the conda environment HPC_DL_LABS_ENV names; a python on PATH that already has
# PyTorch (an environment you activated yourself, or the modules above); the course's conda
# environment (hpc-dl-labs-gpu from environments/ml-gpu.yaml, or hpc-ignite-ml, its name in the
# LANTA chapter); the repository's .venv (bash scripts/bootstrap.sh). "Has PyTorch" is asked without
# importing it (importlib.util.find_spec: milliseconds, not seconds).
_pt_has_torch() {
    python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' >/dev/null 2>&1
}
if [[ "$(type -t conda || true)" == file ]]; then
    # A module put conda on PATH without its shell function, which `conda activate` needs.
    eval "$(conda shell.bash hook 2>/dev/null)" || _pt_note "conda shell.bash hook failed"
fi
_pt_envs=""
if [[ "$(type -t conda || true)" == function ]]; then
    _pt_envs="$(conda env list 2>/dev/null || true)"  # captured, not piped: no SIGPIPE under pipefail
fi
_pt_env=""
for _pt_name in ${HPC_DL_LABS_ENV:-hpc-dl-labs-gpu hpc-ignite-ml}; do
    if [[ $'\n'"$_pt_envs" == *$'\n'"$_pt_name "* ]]; then
        _pt_env="$_pt_name"
        break
    fi
done
if [[ -n "$_pt_env" ]] && { [[ -n "${HPC_DL_LABS_ENV:-}" ]] || ! _pt_has_torch; }; then
    conda activate "$_pt_env" || _pt_note "conda activate $_pt_env failed"
elif ! _pt_has_torch && [[ -f "$HPC_DL_LABS_ROOT/.venv/bin/activate" ]]; then
    # shellcheck source=/dev/null
    source "$HPC_DL_LABS_ROOT/.venv/bin/activate"
fi
_pt_status=0
if ! _pt_has_torch; then
    _pt_found="no python with PyTorch (python is $(command -v python || echo 'not on PATH'))"
    _pt_fix="mamba env create -f environments/ml-gpu.yaml, or load your site's PyTorch module, or bash scripts/bootstrap.sh"
    if [[ -n "${SLURM_JOB_ID:-}" ]]; then
        # A job cannot train without it: stop here with one line, not with a traceback later.
        echo "error: pytorch.sh: $_pt_found; activate your environment before sbatch ($_pt_fix)" >&2
        _pt_status=1
    else
        _pt_note "$_pt_found: create one ($_pt_fix)"
    fi
fi

# --- 3. variables --------------------------------------------------------------------------------
if [[ "${SLURM_CPUS_PER_TASK:-}" =~ ^[0-9]+$ ]]; then
    export OMP_NUM_THREADS="$SLURM_CPUS_PER_TASK"
    export MKL_NUM_THREADS="$SLURM_CPUS_PER_TASK"
fi
export PYTHONUNBUFFERED=1
# The scripts `import common`. The course's environments have the repository installed (uv's .venv,
# the conda files' `-e ..`); a site's PyTorch module does not, and there the repository goes on
# PYTHONPATH: the one place the course edits Python's search path.
# (Asked from /: `python -c` would otherwise find `common` in the current folder.)
if _pt_has_torch && ! (cd / && python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("common") is None)') \
    >/dev/null 2>&1; then
    export PYTHONPATH="$HPC_DL_LABS_ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi

# A site's PyTorch module has PyTorch, not always what else the labs import (the report's pandas, the site
# profiles' PyYAML, Lab-02's line_profiler, Lab-08's webdataset ...): one note naming what this python lacks.
if _pt_has_torch; then
    _pt_missing="$(python -c 'import importlib.util as u
wanted = {"pandas": "pandas", "matplotlib": "matplotlib", "jinja2": "jinja2", "yaml": "pyyaml",
          "sklearn": "scikit-learn", "line_profiler": "line_profiler", "webdataset": "webdataset",
          "torchdata": "torchdata", "submitit": "submitit", "tensorboard": "tensorboard"}
print(" ".join(name for module, name in wanted.items() if u.find_spec(module) is None))' 2>/dev/null || true)"
    if [[ -n "$_pt_missing" ]]; then
        _pt_note "this python lacks what some labs import: $_pt_missing (python -m pip install --user $_pt_missing," \
            "or the course's own environment: environments/ml-gpu.yaml)"
    fi
fi

echo "pytorch.sh: python $(command -v python || command -v python3 || echo '(none)')" \
    "| OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset} | root $HPC_DL_LABS_ROOT" >&2

if ((_pt_nounset)); then set -u; fi
unset _pt_nounset _pt_modules _pt_site_modules _pt_module _pt_env _pt_envs _pt_name _pt_found _pt_fix _pt_missing
unset -f _pt_note _pt_has_torch
eval "unset _pt_status; return $_pt_status"  # 1 only in a job without PyTorch (see above)
