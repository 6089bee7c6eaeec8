#!/usr/bin/env bash
# Lab-01 end to end on this machine: environment check, baseline, DataParallel, DDP (torchrun),
# then the comparison report; the last line printed is the report's path.
#
# Usage:
#   bash labs/lab01_dp_vs_ddp/run_lab.sh [RESULTS_DIR]     # default: $RESULTS_DIR, else results/lab01
#   LAB01_MODEL=resnet18 LAB01_DATASET=synthetic LAB01_STEPS=4 bash labs/lab01_dp_vs_ddp/run_lab.sh
#   LAB01_DEVICE=cuda LAB01_NPROC=4 LAB01_GLOBAL_BATCH=256 LAB01_MODEL=resnet50 LAB01_DATASET=synthetic \
#       LAB01_IMAGE_SIZE=224 LAB01_STEPS=50 bash labs/lab01_dp_vs_ddp/run_lab.sh            # a 4-GPU node
#
# The defaults train on real data that needs no download: scikit-learn's bundled handwritten digits
# (1,438 training and 359 test images, scaled to 16x16), with the plain CNN (no BatchNorm, no
# dropout, so the baseline, DataParallel and DDP compute the same steps and their losses agree),
# 3 whole epochs of 44 steps, two Gloo processes for DDP: the lab takes about a minute on 2 CPU
# cores and the baseline reaches about 96% test accuracy. The three training runs share one global
# batch: DataParallel gets it whole (--batch-size is global there), each of the LAB01_NPROC DDP
# processes gets LAB01_GLOBAL_BATCH / LAB01_NPROC. On GPUs, DataParallel and DDP use the same GPUs:
# the first LAB01_NPROC (cuda:0 .. cuda:N-1, one per DDP process).
#
# Environment overrides (default in brackets):
#   PYTHON              the interpreter to run everything with [python]
#   LAB01_MODEL         model name: plain_cnn or a torchvision model [plain_cnn]
#   LAB01_DATASET       digits (bundled), synthetic (generated), cifar10/imagefolder (--data-dir) [digits]
#   LAB01_STEPS         optimiser steps per epoch; empty = the whole epoch; with synthetic data the
#                       data set is made exactly LAB01_STEPS global batches long [empty]
#   LAB01_EPOCHS        epochs [3]
#   LAB01_GLOBAL_BATCH  samples per optimiser step, all processes together [32]
#   LAB01_NPROC         DDP processes [2; one on a machine with one GPU]
#   LAB01_DEVICE        cpu, cuda or auto [cpu]
#   LAB01_IMAGE_SIZE    image side: digits are resized to it; synthetic 32 is CIFAR-shaped, 224 ImageNet [16]
#   LAB01_LR            SGD learning rate [0.05]
#   LAB01_SEED          seed shared by all runs [1]
#   OMP_NUM_THREADS     threads per process on CPU [1]
set -euo pipefail

PYTHON=${PYTHON:-python}
MODEL=${LAB01_MODEL:-plain_cnn}
DATASET=${LAB01_DATASET:-digits}
STEPS=${LAB01_STEPS:-}
EPOCHS=${LAB01_EPOCHS:-3}
GLOBAL_BATCH=${LAB01_GLOBAL_BATCH:-32}
NPROC=${LAB01_NPROC:-2}
DEVICE=${LAB01_DEVICE:-cpu}
IMAGE_SIZE=${LAB01_IMAGE_SIZE:-16}
LR=${LAB01_LR:-0.05}
SEED=${LAB01_SEED:-1}
# Records of an earlier run in the same folder count as repeats in the report (it takes the median).
RESULTS_DIR=${1:-${RESULTS_DIR:-results/lab01}}
LAB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/require_python.sh
source "$LAB_DIR/../../scripts/require_python.sh"  # stops here when $PYTHON cannot run the course

# auto is decided once, here, so that 03 and 04 get the same GPUs (below) or both run on the CPU.
if [[ $DEVICE == auto ]]; then
    DEVICE=$("$PYTHON" -c 'from common.runtime.device import device_type; print(device_type("auto"))')
fi
if [[ -z ${LAB01_NPROC:-} && $DEVICE == cuda ]]; then  # a DDP process per GPU: more would be refused at step 3
    NPROC=$(ranks_on_gpus "$NPROC")
fi
if (( GLOBAL_BATCH % NPROC != 0 )); then
    echo "error: LAB01_GLOBAL_BATCH=$GLOBAL_BATCH does not divide between LAB01_NPROC=$NPROC processes" >&2
    exit 2
fi
PER_PROCESS_BATCH=$((GLOBAL_BATCH / NPROC))
# DDP's NPROC processes take cuda:0 .. cuda:NPROC-1 (one per LOCAL_RANK); DataParallel would take
# every visible GPU unless told otherwise, so it is given exactly that set.
DP_GPUS=()
if [[ $DEVICE == cuda ]]; then
    DP_GPUS=(--gpus "$(seq -s, 0 $((NPROC - 1)))")
fi

# The same data, model, seed and global batch in 02, 03 and 04.
SHARED=(--device "$DEVICE" --model "$MODEL" --dataset "$DATASET" --image-size "$IMAGE_SIZE"
        --epochs "$EPOCHS" --lr "$LR" --seed "$SEED" --num-workers 0 --log-interval 20 --results-dir "$RESULTS_DIR")
if [[ -n $STEPS ]]; then
    SHARED+=(--max-steps "$STEPS" --synthetic-size "$((GLOBAL_BATCH * STEPS))")
fi

step() { printf '\n=== %s\n' "$*"; }

# On CPU a "device" is a core: torchrun gives each DDP process one thread, so the baseline gets one
# too. Otherwise the baseline's threads would be compared with DDP's processes, and a busy machine
# slows several threads of one process far more than single-threaded processes.
if [[ $DEVICE == cpu ]]; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

mkdir -p "$RESULTS_DIR"
RESULTS_DIR=$(cd "$RESULTS_DIR" && pwd)  # absolute, so the report path printed last works from anywhere
echo "Lab-01 on $(hostname): $MODEL on $DATASET, global batch $GLOBAL_BATCH, ${STEPS:-all} step(s) x $EPOCHS epoch(s), device $DEVICE"
echo "results: $RESULTS_DIR"

step "1/5 environment check"
"$PYTHON" "$LAB_DIR/01_environment_check.py" --results-dir "$RESULTS_DIR"

step "2/5 baseline, one device, global batch $GLOBAL_BATCH"
"$PYTHON" "$LAB_DIR/02_baseline_single_gpu.py" "${SHARED[@]}" --batch-size "$GLOBAL_BATCH"

step "3/5 DataParallel, global batch $GLOBAL_BATCH split over GPUs ${DP_GPUS[1]:-(none: one CPU device, not wrapped)}"
"$PYTHON" "$LAB_DIR/03_dataparallel_training.py" "${SHARED[@]}" --batch-size "$GLOBAL_BATCH" "${DP_GPUS[@]}"

step "4/5 DDP, $NPROC processes x $PER_PROCESS_BATCH = global batch $GLOBAL_BATCH"
# --standalone: torchrun picks a free port itself; a fixed MASTER_PORT would clash with other jobs.
"$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
    "$LAB_DIR/04_ddp_training.py" "${SHARED[@]}" --batch-size "$PER_PROCESS_BATCH"

step "5/5 comparison report"
# Its last line is "report: PATH", the last line of the lab (printed once: not echoed again here).
"$PYTHON" "$LAB_DIR/05_performance_comparison.py" --results-dir "$RESULTS_DIR" --generate-plots \
    --output-report "$RESULTS_DIR/comparison_report.html"
