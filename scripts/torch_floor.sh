#!/usr/bin/env bash
# Prove the course's PyTorch floor: a second environment, .venv-floor/ (ignored by git), with the
# oldest PyTorch the course supports (pyproject.toml's torch>=, common.MINIMUM_VERSIONS) and the
# torchvision and numpy that go with it; every other package at its uv.lock version. Then the tests of
# common/runtime/compat.py (the one module that knows what differs between releases) and every lesson
# script's shortest run (scripts/torch_floor.py) in it. The lesson runs end with
#     torch X.Y.Z: N of N lesson runs ok
# then come the compatibility tests' output and "torch_floor: finished in S s with status N".
# scripts/test.sh runs this after pytest. Exit status: 0 when all passed, 1 when something failed.
#
#   bash scripts/torch_floor.sh                          # everything
#   bash scripts/torch_floor.sh --only lab07-01_tensor_parallel   # arguments go to torch_floor.py
#
# A first run downloads the floor's torch wheel and the NVIDIA CUDA libraries it depends on (several
# GB: PyPI's Linux torch wheels are CUDA builds; they run on a CPU too); later runs install from uv's
# cache in seconds, and a run that finds .venv-floor/ already right installs nothing.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

# The floor, and the releases that go with it: torchvision 0.23 is built for torch 2.8 (it requires
# torch==2.8.0); numpy 2.2.6 is the lock's numpy for Python 3.10 and installs on every Python the course
# supports. tests/test_compat.py keeps TORCH equal to pyproject.toml's floor.
TORCH=2.8.0
TORCHVISION=0.23.0
NUMPY=2.2.6
venv=.venv-floor

if [[ " $* " == *" -h "* || " $* " == *" --help "* ]]; then  # before the set-up, which downloads GBs the first time
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
    printf '\nThe arguments of scripts/torch_floor.py (run here by %s):\n' "${PYTHON:-.venv/bin/python}"
    exec "${PYTHON:-.venv/bin/python}" scripts/torch_floor.py --help
fi
source scripts/find_uv.sh
start=$(date +%s)
if [ ! -x "$venv/bin/python" ]; then
    # The same Python as .venv when there is one (bootstrap.sh made it), so both environments test one interpreter.
    python="python3"
    if [ -x .venv/bin/python ]; then python=".venv/bin/python"; fi
    "${uv_cmd[@]}" venv --quiet --python "$python" "$venv"
fi
# Every package but the torch stack at its locked version: a constraint, so a new lock moves both
# environments together. torch's CUDA libraries (nvidia-*, triton, cuda-*) follow the floor's torch.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"${uv_cmd[@]}" export --quiet --frozen --no-hashes --no-annotate --no-header --no-emit-project --all-groups \
    --format requirements-txt | grep -vE '^(torch|torchvision|numpy|nvidia-|triton|cuda-)' > "$constraints"
# No bytecode compiled at install (pyproject.toml asks uv for it, for .venv): compiling all of torch took
# 45 of the 49 s the install took from a warm cache, and the runs below import about a third of it.
# Instead these runs write the bytecode of what they import (the floor's own environment, so
# PYTHONDONTWRITEBYTECODE is lifted here), one process first, so that the ranks do not each compile the same.
"${uv_cmd[@]}" pip install --quiet --no-compile-bytecode --python "$venv/bin/python" --constraint "$constraints" \
    "torch==$TORCH" "torchvision==$TORCHVISION" "numpy==$NUMPY" -e . pytest pytest-timeout
unset PYTHONDONTWRITEBYTECODE
"$venv/bin/python" -c "import torch, torchvision, numpy, pytest, torch.distributed.fsdp, torch.distributed.pipelining, \
torch.distributed.tensor.parallel, torch.distributed.checkpoint, torch.distributed.run"
echo "torch_floor: $venv ready in $(( $(date +%s) - start )) s" >&2

status=0
# The compatibility tests beside the lesson runs: most of their time is a collective waiting for its timeout.
compat_log="$(mktemp)"
trap 'rm -f "$constraints" "$compat_log"' EXIT
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_compat.py > "$compat_log" 2>&1 &
compat=$!
"$venv/bin/python" scripts/torch_floor.py "$@" || status=1
wait "$compat" || status=1
cat "$compat_log"
echo "torch_floor: finished in $(( $(date +%s) - start )) s with status $status" >&2
exit "$status"
