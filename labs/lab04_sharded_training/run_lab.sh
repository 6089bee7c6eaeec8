#!/usr/bin/env bash
# Lab-04 end to end on this machine: the memory budget, DDP and FSDP2 training with distributed
# checkpoints (synchronous and asynchronous), FSDP2 with activation checkpointing and bf16, a resume
# on one process of what several saved, the largest model per strategy, then the comparison
# report; the last line printed is the report's path.
#
# Usage:
#   bash labs/lab04_sharded_training/run_lab.sh [RESULTS_DIR]     # default: $RESULTS_DIR, else results/lab04
#   LAB04_MEMORY_NPROCS="2 4" bash labs/lab04_sharded_training/run_lab.sh   # the memory budget on 2 and on 4 ranks
#   LAB04_DEVICE=cuda LAB04_NPROC=4 LAB04_LAYERS=16 LAB04_WIDTH=1024 LAB04_HEADS=16 LAB04_CONTEXT=512 \
#       LAB04_GLOBAL_BATCH=64 LAB04_BUDGET= bash labs/lab04_sharded_training/run_lab.sh   # a 4-GPU node
#
# The defaults suit a CPU: a 4-block transformer of width 256 (3.2 M parameters), 10 steps per
# epoch, 2 epochs, two Gloo processes. Every training run has the same seed and global batch, so
# their losses compare step by step. The FSDP2 run's checkpoint (saved on LAB04_NPROC ranks) is
# then continued for one more epoch on a single process: DCP reshards it.
#
# Environment overrides (default in brackets):
#   PYTHON              the interpreter to run everything with [python]
#   LAB04_DEVICE        cpu, cuda or auto [cpu]
#   LAB04_NPROC         processes of the training runs and of the largest-model search [2]
#   LAB04_MEMORY_NPROCS process counts to run the memory budget with, e.g. "2 4" [LAB04_NPROC]
#   LAB04_LAYERS, LAB04_WIDTH, LAB04_HEADS, LAB04_CONTEXT   the model [4, 256, 8, 64]
#   LAB04_GLOBAL_BATCH  sequences per optimiser step, all processes together [16]
#   LAB04_BATCH         micro-batch per process [8]
#   LAB04_STEPS         optimiser steps per epoch [10]
#   LAB04_EPOCHS        epochs [2]
#   LAB04_BUDGET        memory per rank for the largest-model search; empty on GPUs (their memory) [128MiB]
#   LAB04_SEED          seed shared by all runs [1]
#   OMP_NUM_THREADS     threads per process on CPU [1]
set -euo pipefail

PYTHON=${PYTHON:-python}
DEVICE=${LAB04_DEVICE:-cpu}
NPROC=${LAB04_NPROC:-2}
MEMORY_NPROCS=${LAB04_MEMORY_NPROCS:-$NPROC}
GLOBAL_BATCH=${LAB04_GLOBAL_BATCH:-16}
BATCH=${LAB04_BATCH:-8}
STEPS=${LAB04_STEPS:-10}
EPOCHS=${LAB04_EPOCHS:-2}
BUDGET=${LAB04_BUDGET-128MiB}
SEED=${LAB04_SEED:-1}
RESULTS_DIR=${1:-${RESULTS_DIR:-results/lab04}}
LAB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/require_python.sh
source "$LAB_DIR/../../scripts/require_python.sh"  # stops here when $PYTHON cannot run the course
MODEL=(--device "$DEVICE" --layers "${LAB04_LAYERS:-4}" --width "${LAB04_WIDTH:-256}"
       --heads "${LAB04_HEADS:-8}" --context "${LAB04_CONTEXT:-64}")

if [[ $DEVICE == cpu ]]; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
mkdir -p "$RESULTS_DIR"
RESULTS_DIR=$(cd "$RESULTS_DIR" && pwd)  # absolute, so the report path printed last works from anywhere
# Checkpoints are working files, not results: they go to a scratch folder of their own.
CHECKPOINTS=$(mktemp -d "${TMPDIR:-/tmp}/lab04-checkpoints.XXXXXX")
trap 'rm -rf "$CHECKPOINTS"' EXIT

# --standalone: torchrun picks a free port itself; a fixed MASTER_PORT would clash with other jobs.
launch() { "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$1" "${@:2}"; }
step() { printf '\n=== %s\n' "$*"; }
TRAIN=("$LAB_DIR/02_sharded_training.py" "${MODEL[@]}" --global-batch-size "$GLOBAL_BATCH" --batch-size "$BATCH"
       --max-steps "$STEPS" --epochs "$EPOCHS" --seed "$SEED" --results-dir "$RESULTS_DIR")

echo "Lab-04 on $(hostname): ${MODEL[*]}, global batch $GLOBAL_BATCH, $STEPS step(s) x $EPOCHS epoch(s)"
echo "results: $RESULTS_DIR"

for nproc in $MEMORY_NPROCS; do
    step "1/7 memory budget on $nproc rank(s)"
    launch "$nproc" "$LAB_DIR/01_memory_budget.py" "${MODEL[@]}" --batch-size "$BATCH" --results-dir "$RESULTS_DIR"
done

step "2/7 DDP, $NPROC processes, synchronous checkpoints"
launch "$NPROC" "${TRAIN[@]}" --strategy ddp --checkpoint-dir "$CHECKPOINTS/ddp"

step "3/7 FSDP2, $NPROC processes, synchronous checkpoints"
launch "$NPROC" "${TRAIN[@]}" --strategy fsdp --checkpoint-dir "$CHECKPOINTS/fsdp"

step "4/7 FSDP2, $NPROC processes, asynchronous checkpoints"
launch "$NPROC" "${TRAIN[@]}" --strategy fsdp --async-checkpoint --checkpoint-dir "$CHECKPOINTS/fsdp-async"

step "5/7 FSDP2 + activation checkpointing + bf16, $NPROC processes"
launch "$NPROC" "${TRAIN[@]}" --strategy fsdp --activation-checkpointing --precision bf16 \
    --checkpoint-dir "$CHECKPOINTS/fsdp-ac-bf16"

step "6/7 step 3's checkpoint (saved on $NPROC ranks) continued for one more epoch on 1 process"
"$PYTHON" "${TRAIN[@]}" --strategy fsdp --epochs "$((EPOCHS + 1))" --checkpoint-dir "$CHECKPOINTS/fsdp" --resume

step "7/7 the largest model per strategy, $NPROC processes"
BUDGET_ARGS=()
[[ -z $BUDGET ]] || BUDGET_ARGS=(--budget "$BUDGET")
launch "$NPROC" "$LAB_DIR/03_largest_model.py" "${MODEL[@]}" --batch-size "$BATCH" "${BUDGET_ARGS[@]}" \
    --results-dir "$RESULTS_DIR"

step "comparison report"
# Its last line is "report: PATH", the last line of the lab (printed once: not echoed again here).
"$PYTHON" "$LAB_DIR/../../scripts/compare_results.py" --results-dir "$RESULTS_DIR" \
    --output-report "$RESULTS_DIR/comparison_report.html"
