#!/usr/bin/env bash
# The whole test suite, installing what it needs first:
#   - the locked Python environment (.venv/, via uv);
#   - as root: Debian's chromium (report checked in a real browser), strace (Lab-08's I/O counts) and slurm-wlm + munge
#     (sbatch templates submitted to a throwaway Slurm cluster; tests/testbed/ installs it).
# Without root those tests skip and say why; HPC_DL_LABS_REQUIRE_SLURM=1 and
# HPC_DL_LABS_REQUIRE_BROWSER=1 (set by .ci/run) turn such skips into failures.
#
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -m "not slow"   # extra arguments go to pytest
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
bash scripts/bootstrap.sh

if [ "$(id -u)" = 0 ] && ! command -v chromium >/dev/null 2>&1; then
    echo "test.sh: installing chromium (browser check of the HTML report)" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi

if [ "$(id -u)" = 0 ] && ! command -v strace >/dev/null 2>&1; then
    echo "test.sh: installing strace (Lab-08's I/O counts checked against it)" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends strace >/dev/null
fi

start=$(date +%s)
status=0
.venv/bin/python -m pytest "$@" || status=$?
echo "test.sh: pytest finished in $(( $(date +%s) - start )) s with status $status" >&2
exit "$status"
