#!/usr/bin/env bash
# The main job: Lab-01 (DataParallel vs DistributedDataParallel) end to end on this machine,
# from environment check to the HTML comparison report; the last line printed is the report's path.
#
#   bash scripts/main_job.sh                 # results in results/lab01/
#   RESULTS_DIR=/tmp/r bash scripts/main_job.sh
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
bash scripts/bootstrap.sh
export PYTHON="$repo_root/.venv/bin/python"
export PATH="$repo_root/.venv/bin:$PATH"
exec bash labs/lab01_dp_vs_ddp/run_lab.sh "$@"
