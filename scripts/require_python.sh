#!/usr/bin/env bash
# Sourced by every lab's run_lab.sh once PYTHON is set, before anything is written: stop at start, in one
# line and with exit status 2, when that interpreter cannot run the course (it is missing, or lacks torch
# or the course's package `common`), rather than with a traceback at the lab's first step. It looks the
# packages up without importing them (a fraction of a second, not the seconds `import torch` takes), the
# way a lab's scripts see them: without the current folder on the path. It also gives the labs
# `ranks_on_gpus N`: the ranks to start on GPUs. Sourced without arguments, it sees the lab's: `--help` prints
# the lab's header (its usage and settings, with their defaults); an option it does not know, or a second
# argument, is one line and exit status 2 (a run_lab.sh takes one argument, the results folder).
case ${1:-} in
    -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[1]}"; exit 0 ;;
    -*) echo "error: unknown option '$1': $(basename "$(dirname "${BASH_SOURCE[1]}")")'s run_lab.sh takes one" \
             "argument, the results folder (--help for its settings)" >&2; exit 2 ;;
esac
if (( $# > 1 )); then
    echo "error: $# arguments given ($*): a run_lab.sh takes one, the results folder (--help for its settings)" >&2
    exit 2
fi
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
