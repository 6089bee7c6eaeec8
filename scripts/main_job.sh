#!/usr/bin/env bash
# The main job: Lab-01 (DataParallel vs DistributedDataParallel) end to end on this machine,
# from environment check to the HTML comparison report; the last line printed is the report's path.
#
#   bash scripts/main_job.sh                 # results in results/lab01/
#   RESULTS_DIR=/tmp/r bash scripts/main_job.sh
#   PYTHON=python3 bash scripts/main_job.sh  # an interpreter that has the course's packages: no .venv sync
#                                            # (an offline GPU node; scripts/gpu_proof.sh runs it so)
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
if [[ ${1:-} == -h || ${1:-} == --help ]]; then  # before the set-up: this header, then the lab's settings
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
    printf "\nIt runs labs/lab01_dp_vs_ddp/run_lab.sh [RESULTS_DIR]:\n"
    exec sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' labs/lab01_dp_vs_ddp/run_lab.sh
fi
if [[ -z ${PYTHON:-} ]]; then
    bash scripts/bootstrap.sh
    export PYTHON="$repo_root/.venv/bin/python"
    export PATH="$repo_root/.venv/bin:$PATH"
fi
exec bash labs/lab01_dp_vs_ddp/run_lab.sh "$@"
