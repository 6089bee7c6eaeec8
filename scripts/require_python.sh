#!/usr/bin/env bash
# Sourced by every lab's run_lab.sh once PYTHON is set, before anything is written: stop at start, in one
# line and with exit status 2, when that interpreter cannot run the course (it is missing, or lacks torch
# or the course's package `common`), rather than with a traceback at the lab's first step. It looks the
# packages up without importing them (a fraction of a second, not the seconds `import torch` takes), the
# way a lab's scripts see them: without the current folder on the path. It also gives the labs
# `ranks_on_gpus N`: the ranks to start on GPUs.
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "error: no Python interpreter '$PYTHON' on this PATH: activate the course's environment" \
         "(bash scripts/bootstrap.sh, then source .venv/bin/activate) or set PYTHON=/path/to/python" >&2
    exit 2
fi
if ! lacking=$("$PYTHON" -c 'import importlib.util as u, sys; sys.path[:1] = [p for p in sys.path[:1] if p]; lacking = [n for n in ("torch", "common") if u.find_spec(n) is None]; print(" and ".join(lacking)); sys.exit(bool(lacking))' 2>/dev/null); then
    [[ -n $lacking ]] || lacking="torch or the course's package"  # the interpreter itself failed
    echo "error: $PYTHON ($(command -v "$PYTHON")) cannot import $lacking: activate the course's" \
         "environment (bash scripts/bootstrap.sh, then source .venv/bin/activate) or set PYTHON=/path/to/python" >&2
    exit 2
fi

# The ranks a lab starts on GPUs: N, or 1 on a machine with one GPU, where a second rank would be refused.
ranks_on_gpus() {
    local gpus
    gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
    if (( gpus == 1 )); then echo 1; else echo "$1"; fi
}
