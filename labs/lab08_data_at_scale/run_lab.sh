#!/usr/bin/env bash
# Lab-08 end to end on this machine: one data set written as small files, tar shards and one array file;
# the same model trained from each, with and without a Lustre-like wait before every open, counted and
# predicted; the shards read on two ranks, each sample once; then the comparison report. The last line
# printed is the report's path.
#
# Usage:
#   bash labs/lab08_data_at_scale/run_lab.sh [RESULTS_DIR]      # default: $RESULTS_DIR, else results/lab08
#   LAB08_SAMPLES=50000 LAB08_SHARD_SIZE=1000 bash labs/lab08_data_at_scale/run_lab.sh   # the README's size
#
# The defaults suit a laptop or CI: 2,000 images in shards of 200, one epoch per run, one loader worker
# (a 2-core machine: one core trains, one feeds). The data set goes to a scratch folder, removed at the end.
#
# Environment overrides (default in brackets):
#   PYTHON            the interpreter to run everything with [python]
#   LAB08_DEVICE      cpu, cuda or auto [cpu]
#   LAB08_SAMPLES     images in the data set [2000]
#   LAB08_SHARD_SIZE  images per tar shard [200]
#   LAB08_WORKERS     DataLoader workers per process [1]
#   LAB08_LATENCY     ms waited before every open in the "+latency" runs: the README's Lustre-like figure [1.0]
#   LAB08_NPROC       ranks of the exactly-once run (torchrun) [2; on GPUs at most one per GPU]
#   LAB08_DATA        where to write the data set [a scratch folder]
#   OMP_NUM_THREADS   threads per process on CPU [1]
set -euo pipefail

PYTHON=${PYTHON:-python}
DEVICE=${LAB08_DEVICE:-cpu}
SAMPLES=${LAB08_SAMPLES:-2000}
SHARD_SIZE=${LAB08_SHARD_SIZE:-200}
WORKERS=${LAB08_WORKERS:-1}
LATENCY=${LAB08_LATENCY:-1.0}
NPROC=${LAB08_NPROC:-2}
RESULTS_DIR=${1:-${RESULTS_DIR:-results/lab08}}
LAB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/require_python.sh
source "$LAB_DIR/../../scripts/require_python.sh"  # stops here when $PYTHON cannot run the course
if [[ -z ${LAB08_NPROC:-} && $DEVICE != cpu ]]; then  # a rank per GPU: more would be refused at step 4
    NPROC=$(ranks_on_gpus "$NPROC")
fi

if [[ $DEVICE == cpu ]]; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
mkdir -p "$RESULTS_DIR"
RESULTS_DIR=$(cd "$RESULTS_DIR" && pwd)  # absolute, so the report path printed last works from anywhere
if [[ -z ${LAB08_DATA:-} ]]; then
    SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/lab08-data.XXXXXX")
    trap 'rm -rf "$SCRATCH"' EXIT
    LAB08_DATA=$SCRATCH/lab08
fi
step() { printf '\n=== %s\n' "$*"; }
READ=("$LAB_DIR/02_read_formats.py" --device "$DEVICE" --data-dir "$LAB08_DATA" --num-workers "$WORKERS"
      --results-dir "$RESULTS_DIR")

echo "Lab-08 on $(hostname): $SAMPLES images in shards of $SHARD_SIZE, $WORKERS loader worker(s), $DEVICE"
echo "results: $RESULTS_DIR"

step "1/4 the data set in three formats"
"$PYTHON" "$LAB_DIR/01_make_dataset.py" --samples "$SAMPLES" --shard-size "$SHARD_SIZE" --data-dir "$LAB08_DATA" \
    --results-dir "$RESULTS_DIR"

step "2/4 each format read alone, then trained from, on this disk as it is"
for format in imagefolder webdataset array; do
    "$PYTHON" "${READ[@]}" --format "$format" --read-only
    "$PYTHON" "${READ[@]}" --format "$format"
done

step "3/4 the same with $LATENCY ms waited before every open (a Lustre-like metadata server)"
for format in imagefolder webdataset array; do
    "$PYTHON" "${READ[@]}" --format "$format" --read-only --metadata-latency "$LATENCY"
    "$PYTHON" "${READ[@]}" --format "$format" --metadata-latency "$LATENCY"
done

step "4/4 the shards on $NPROC ranks x $WORKERS worker(s), each sample once per epoch"
# --standalone: torchrun picks a free port itself; a fixed MASTER_PORT would clash with other jobs.
"$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" "$LAB_DIR/03_shards_exactly_once.py" \
    --device "$DEVICE" --data-dir "$LAB08_DATA" --num-workers "$WORKERS" --results-dir "$RESULTS_DIR" \
    --checkpoint "$RESULTS_DIR/checkpoints/03_shards_exactly_once.pt"

step "comparison report"
# Its last line is "report: PATH", the last line of the lab (printed once: not echoed again here).
"$PYTHON" "$LAB_DIR/../../scripts/compare_results.py" --results-dir "$RESULTS_DIR" \
    --output-report "$RESULTS_DIR/comparison_report.html"
