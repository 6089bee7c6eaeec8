#!/usr/bin/env bash
# Lab-09 end to end on tiny settings; the last line printed is the report's path.
#
# Usage:
#   bash labs/lab09_many_jobs/run_lab.sh [RESULTS_DIR]     # default: $RESULTS_DIR, else results/lab09
#
# On a machine with Slurm (sbatch on PATH and a controller answering `scontrol ping`; on the test cluster
# also SLURM_CONF), from a login node:
#   1. the faults sweep (3 tasks: one completes, one fails, one stalls into its time limit, LAB09_FAULTS_TIME) as a
#      pipeline: train (job array) -> evaluate (afterany) -> report (afterok) (04_pipeline.py);
#   2. the tiny sweep submitted with submitit (05_submitit.py), while the pipeline runs;
#   3. a chain of three links of 3 steps each, and the same run unbroken in one job (03_chain.py);
#   4. when the pipeline's evaluation is in: the status, then only the failed and timed-out tasks
#      resubmitted (02_status.py --resubmit); they resume from their checkpoints; the sweep's record again;
#   5. one report over every sweep record.
# Without Slurm (a laptop): the tiny sweep here, one task after another (01_sweep.py --local), the
# chain's three links here (03_chain.py --local) and the unbroken run, the status, then the report.
#
# Environment overrides (default in brackets):
#   PYTHON        the interpreter [python]
#   LAB09_DEVICE  cpu, cuda or auto, for the runs started here [cpu]
#   LAB09_SITE    the site profile jobs are rendered for [generic]
#   LAB09_LOCAL   1: the laptop path even where sbatch exists [0]
#   LAB09_FAULTS_TIME  the faults sweep's time limit in minutes [1]: each task's start and its first 3 steps
#                 must fit in it (a machine that runs much else beside it needs more; the Slurm tests give 2)
set -euo pipefail

PYTHON=${PYTHON:-python}
DEVICE=${LAB09_DEVICE:-cpu}
FAULTS_TIME=${LAB09_FAULTS_TIME:-1}
SITE=${LAB09_SITE:-generic}
RESULTS_DIR=${1:-${RESULTS_DIR:-results/lab09}}
LAB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/require_python.sh
source "$LAB_DIR/../../scripts/require_python.sh"  # stops here when $PYTHON cannot run the course
REPO=$(cd "$LAB_DIR/../.." && pwd)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export HPC_DL_LABS_TINY=0  # the settings below are tiny already: no --dry-run in the jobs on top of them
mkdir -p "$RESULTS_DIR"
RESULTS_DIR=$(cd "$RESULTS_DIR" && pwd)  # absolute: jobs run from the repository root
cd "$REPO"
step() { printf '\n=== %s\n' "$*"; }
# The chain's run: one epoch of 9 steps; each link may take 3 (--step-budget), so three links.
CHAIN=(--dataset digits --epochs 1 --max-steps 9 --batch-size 32 --num-workers 0)
# Each sweep's record is the newest lab09 record in its folder; wait_for_record FOLDER SECONDS.
wait_for_record() {
    local deadline=$((SECONDS + $2))
    until compgen -G "$1/lab09_sweep-*.json" >/dev/null; do
        ((SECONDS < deadline)) || { echo "error: no sweep record in $1 after $2 s" >&2; return 1; }
        sleep 2
    done
}

# Slurm is here when sbatch is and a controller answers: the client alone (a laptop with slurm-client, a
# login node whose controller is down) would fail at the first submission.
with_slurm=0
if [[ "${LAB09_LOCAL:-0}" != 1 ]] && command -v sbatch >/dev/null 2>&1; then
    if timeout 30 scontrol ping >/dev/null 2>&1; then
        with_slurm=1
    else
        echo "note: sbatch is installed but no Slurm controller answers (scontrol ping): running here instead" \
             "(LAB09_LOCAL=1 asks for that)"
    fi
fi

if ((with_slurm)); then
    echo "Lab-09 on $(hostname) with Slurm (site $SITE); results: $RESULTS_DIR"
    step "1/5 the faults sweep as a pipeline: train (array, $FAULTS_TIME-minute limit) -> evaluate -> report"
    "$PYTHON" "$LAB_DIR/04_pipeline.py" "$LAB_DIR/sweeps/faults.toml" --sweep-dir "$RESULTS_DIR/faults" \
        --site "$SITE" --time "$FAULTS_TIME" -- --num-workers 0
    step "2/5 the tiny sweep with submitit"
    "$PYTHON" "$LAB_DIR/05_submitit.py" "$LAB_DIR/sweeps/tiny.toml" --sweep-dir "$RESULTS_DIR/tiny-submitit" \
        --device "$DEVICE" -- --num-workers 0 > "$RESULTS_DIR/submitit.log" 2>&1 &
    submitit_pid=$!
    step "3/5 a chain of three links, and the same run unbroken"
    "$PYTHON" "$LAB_DIR/03_chain.py" --run-dir "$RESULTS_DIR/chain" --site "$SITE" -- "${CHAIN[@]}" --step-budget 3
    "$PYTHON" "$LAB_DIR/03_chain.py" --run-dir "$RESULTS_DIR/unbroken" --site "$SITE" -- "${CHAIN[@]}"
    step "4/5 the pipeline's evaluation, then only the failed tasks again"
    wait_for_record "$RESULTS_DIR/faults" 400
    "$PYTHON" "$LAB_DIR/02_status.py" --sweep-dir "$RESULTS_DIR/faults" --resubmit
    "$PYTHON" "$LAB_DIR/02_status.py" --sweep-dir "$RESULTS_DIR/faults" --wait 300 --record
    wait "$submitit_pid" || { cat "$RESULTS_DIR/submitit.log"; exit 1; }
    tail -n 4 "$RESULTS_DIR/submitit.log"
    for run in chain unbroken; do  # each chain's last link writes the record
        deadline=$((SECONDS + 300))
        until compgen -G "$RESULTS_DIR/$run/results/*.json" >/dev/null; do
            ((SECONDS < deadline)) || { echo "error: the $run run did not finish in 300 s" >&2; exit 1; }
            sleep 2
        done
    done
else
    echo "Lab-09 on $(hostname) without Slurm: everything here, one run after another; results: $RESULTS_DIR"
    step "1/5 the tiny sweep, one task after another"
    "$PYTHON" "$LAB_DIR/01_sweep.py" "$LAB_DIR/sweeps/tiny.toml" --local --sweep-dir "$RESULTS_DIR/tiny" \
        --device "$DEVICE" -- --num-workers 0
    step "2/5 its status and its record"
    "$PYTHON" "$LAB_DIR/02_status.py" --sweep-dir "$RESULTS_DIR/tiny" --record
    step "3/5 the chain's three links here, and the same run unbroken"
    "$PYTHON" "$LAB_DIR/03_chain.py" --run-dir "$RESULTS_DIR/chain" --local --device "$DEVICE" -- "${CHAIN[@]}" \
        --step-budget 3
    "$PYTHON" "$LAB_DIR/03_chain.py" --run-dir "$RESULTS_DIR/unbroken" --local --device "$DEVICE" -- "${CHAIN[@]}"
    step "4/5 (the pipeline and submitit need Slurm: skipped)"
fi

step "5/5 the report"
# Its last line is "report: PATH", the last line of the lab (printed once: not echoed again here).
"$PYTHON" scripts/compare_results.py --results-dir "$RESULTS_DIR" --lab lab09 \
    --output-report "$RESULTS_DIR/lab09_comparison_report.html"
