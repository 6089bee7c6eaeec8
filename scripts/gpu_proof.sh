#!/usr/bin/env bash
# The GPU proof: the course's GPU paths and speed targets, by tier, within a time budget.
#
#   bash scripts/gpu_proof.sh                          # every check, tier 1 first, 420 s; results/gpu_proof/
#   bash scripts/gpu_proof.sh --budget 450 --out results/gpu_proof --bundle "$OUT"   # one lease's first call
#   bash scripts/gpu_proof.sh --only failed            # what the last summary did not pass
#   bash scripts/gpu_proof.sh --device cpu --budget 60 # the rehearsal CI runs: the same checks' CPU paths
#   bash scripts/gpu_proof.sh --list                   # the checks, their tiers, which run alone
#
# Tier 1 (what a student meets first): the main job on the GPU, a short run of every single-process
# training script, Lab-06 on CUDA and two ranks sharing one GPU, then the speed targets, cheapest
# first, each alone on the machine. Tier 2: every other path one GPU can run, pytest -m gpu last.
# The checks and what each record must say: scripts/gpu_proof_checks.py. After every check,
# OUT/summary.json and OUT/summary.md are written again, so a lease that ends mid-run keeps what
# finished. Exit status: 0 every check ran and is ok (or skipped), 1 one failed, 3 none failed but the
# budget ran out before some (--only pending runs them), 2 bad usage (or no GPU with --device cuda).
#
# A GPU machine without internet: wheels for Python modules it lacks (line_profiler, py-spy, PyYAML,
# webdataset, braceexpand, torchdata) are installed from .whl/ first, and pytorch/examples is read from
# .examples/; fill both on a machine with internet: bash scripts/gpu_proof_prepare.sh. PYTHON: the
# interpreter (default .venv/bin/python, else python3).
set -uo pipefail
GPU_PROOF_STARTED=$(date +%s.%N)
export GPU_PROOF_STARTED
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root" || exit 2
export PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
case " $* " in
    *" --list "*|*" -h "*|*" --help "*) exec "$PYTHON" scripts/gpu_proof.py "$@" ;;
esac
# The wheels of .whl/ whose package this interpreter lacks (py-spy is a program, looked for on PATH).
shopt -s nullglob
wheels=()
for wheel in .whl/*.whl; do
    package=$(basename "$wheel"); package=${package%%-*}
    case ${package,,} in pyyaml) package=yaml ;; esac  # the module's name where it is not the wheel's
    if [[ $package == py_spy ]]; then
        command -v py-spy >/dev/null 2>&1 || [[ -x $(dirname "$PYTHON")/py-spy ]] || wheels+=("$wheel")
    elif ! "$PYTHON" -c "import $package" >/dev/null 2>&1; then
        wheels+=("$wheel")
    fi
done
if (( ${#wheels[@]} )); then
    site="${TMPDIR:-/tmp}/hpc-dl-labs-wheels"
    if "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "${wheels[@]}" >/dev/null 2>&1; then
        export PYTHONPATH="$PYTHONPATH:$site" PATH="$site/bin:$PATH"
    else
        echo "gpu_proof: the wheels ${wheels[*]} did not install with $PYTHON -m pip (bash scripts/gpu_proof_prepare.sh" \
             "fetches them for Python 3.12); the checks that need them are skipped" >&2
    fi
fi
exec "$PYTHON" scripts/gpu_proof.py "$@"
