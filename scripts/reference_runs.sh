#!/usr/bin/env bash
# Re-measure the reference records the docs quote, one part of the course at a time, then refresh
# the tables in the READMEs (scripts/update_results_tables.py). Run it on a quiet machine: every
# number in the docs comes from these records.
#
# Usage:
#   bash scripts/reference_runs.sh                      # every part, into reference-results/cpu-2core/
#   bash scripts/reference_runs.sh cpu-2core lab01 lab05   # only these parts
#   REFERENCE_DEVICE=cuda bash scripts/reference_runs.sh h100-1gpu ch04 lab03   # a GPU machine
#
# Parts: ch04 ch16 lab01 lab02 lab03 lab04 lab05 lab06 lab07 lab08. Each part runs into a scratch folder; only when
# every command of the part succeeded do its records replace reference-results/MACHINE/PART/
# (a failed part leaves the committed records as they were, and the script exits non-zero).
#
# MACHINE is only the folder's name: each record says what the machine could do (provenance.machine:
# CPU model, cores, bf16/fp16 flags, GPU and its peaks), and every README table is headed by the
# machine its records name, so numbers from a CPU with bf16 units never pass for another's.
#
# Environment (default in brackets):
#   PYTHON              the interpreter [.venv/bin/python when it exists, else python]
#   REFERENCE_DEVICE    cpu, cuda or auto [cpu]
#   REFERENCE_NPROC     processes of the distributed commands [2 on cpu; on cuda one per GPU: more
#                       processes than GPUs are refused, so a 1-GPU node runs them on 1 rank]
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

ALL_PARTS="ch04 ch16 lab01 lab02 lab03 lab04 lab05 lab06 lab07 lab08"
case ${1:-} in
    -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) echo "error: unknown option '$1' (usage: bash scripts/reference_runs.sh [MACHINE] [PARTS]; --help)" >&2; exit 2 ;;
esac
if [[ " $ALL_PARTS " == *" ${1:-} "* ]]; then  # the machine's folder would be named after the part, every part run
    echo "error: '$1' is a part: give the machine's folder first, e.g. bash scripts/reference_runs.sh cpu-2core $*" >&2
    exit 2
fi
if [[ -n ${1:-} && ! ${1} =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]]; then
    echo "error: MACHINE '$1' must be a folder name under reference-results/ (letters, digits, . _ -)" >&2
    exit 2
fi
MACHINE=${1:-cpu-2core}
shift || true
PARTS=("$@")
if (( ${#PARTS[@]} == 0 )); then
    read -ra PARTS <<< "$ALL_PARTS"
fi
if [[ -x .venv/bin/python ]]; then PYTHON=${PYTHON:-$repo_root/.venv/bin/python}; else PYTHON=${PYTHON:-python}; fi
DEVICE=${REFERENCE_DEVICE:-cpu}
export PYTHON OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [[ $DEVICE == cpu ]]; then
    NPROC=${REFERENCE_NPROC:-2}
else
    NPROC=${REFERENCE_NPROC:-$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
fi
# Lab-04's memory budget on 2 and 4 ranks on a CPU (Gloo shares the cores); on GPUs, on the ranks there are.
MEMORY_NPROCS=${LAB04_MEMORY_NPROCS:-$NPROC}
if [[ $DEVICE == cpu ]]; then MEMORY_NPROCS=${LAB04_MEMORY_NPROCS:-"2 4"}; fi
SCALING_PROCESSES=1
if (( NPROC > 1 )); then SCALING_PROCESSES="1,$NPROC"; fi
torchrun() { "$PYTHON" -m torch.distributed.run --standalone "$@"; }

run_ch04() {
    local out=$1
    "$PYTHON" chapters/ch04_deep_learning/mnist_training.py --device "$DEVICE" --epochs 4 --log-interval 1000 \
        --results-dir "$out"
    "$PYTHON" chapters/ch04_deep_learning/mnist_training.py --device "$DEVICE" --epochs 4 --log-interval 1000 \
        --precision bf16 --results-dir "$out"
    torchrun --nproc_per_node "$NPROC" chapters/ch04_deep_learning/multi_gpu_ddp.py --device "$DEVICE" --epochs 4 \
        --log-interval 1000 --results-dir "$out" --checkpoint "$out/../checkpoints/ddp.pt"
}

run_ch16() {
    local out=$1
    "$PYTHON" chapters/ch16_gpu_distributed/benchmark_cpu_vs_gpu.py --device "$DEVICE" --results-dir "$out"
    "$PYTHON" chapters/ch16_gpu_distributed/memory_management.py --device "$DEVICE" --repeats 10 --results-dir "$out"
    "$PYTHON" chapters/ch16_gpu_distributed/efficient_loading.py --device "$DEVICE" --results-dir "$out"
    "$PYTHON" chapters/ch16_gpu_distributed/profiling.py --device "$DEVICE" --batch-size 8 --image-size 64 \
        --results-dir "$out" --trace "$out/../ch16_trace.json"
}

run_lab01() {  # the lab as a student runs it (its defaults: the main job)
    LAB01_DEVICE=$DEVICE bash labs/lab01_dp_vs_ddp/run_lab.sh "$1"
    rm -f "$1/comparison_report.html"
}

run_lab02() {
    "$PYTHON" labs/lab02_profiling/sweep.py --device "$DEVICE" --include-compile --results-dir "$1"
    "$PYTHON" bench/data_pipeline.py --device "$DEVICE" --threads 1 --rounds 7 --results-dir "$1"
}

run_lab03() {
    "$PYTHON" labs/lab03_precision_benchmark/benchmark_models.py --device "$DEVICE" --models resnet18,resnet50 \
        --image-size 128 -b 4 -w 2 -n 5 --folder "$1/../csv" --results-dir "$1"
}

run_lab04() {
    LAB04_DEVICE=$DEVICE LAB04_NPROC=$NPROC LAB04_MEMORY_NPROCS="$MEMORY_NPROCS" \
        bash labs/lab04_sharded_training/run_lab.sh "$1"
    rm -f "$1/comparison_report.html"
}

run_lab05() {
    torchrun --nproc_per_node "$NPROC" labs/lab05_scaling/01_allreduce_bench.py --device "$DEVICE" --results-dir "$1"
    "$PYTHON" labs/lab05_scaling/02_scaling_study.py --device "$DEVICE" --processes "$SCALING_PROCESSES" --epochs 3 \
        --results-dir "$1"
    torchrun --nproc_per_node "$NPROC" labs/lab05_scaling/03_overlap.py --device "$DEVICE" --model resnet18 \
        --image-size 32 --batch-size 8 --repeats 6 --results-dir "$1"
}

run_lab06() {  # a fault that ends the run (a hang, a NaN without restarts) exits non-zero by design: its record is the result
    local inject=(labs/lab06_failures/01_inject.py --device "$DEVICE" --results-dir "$1" --run-dir "${CHECKPOINT_DIR:-checkpoints}/reference-lab06")
    torchrun --nproc_per_node "$NPROC" "${inject[@]}"
    torchrun --nproc_per_node "$NPROC" --max-restarts 1 "${inject[@]}" --fault crash-rank --rank 1 --step 7
    torchrun --nproc_per_node "$NPROC" --max-restarts 1 "${inject[@]}" --fault nan-loss --rank 1 --step 4
    torchrun --nproc_per_node "$NPROC" "${inject[@]}" --fault skip-collective --rank 1 --step 3 --collective-timeout 10 || true
    torchrun --nproc_per_node "$NPROC" labs/lab06_failures/04_preflight.py --device "$DEVICE" --results-dir "$1"
}

run_lab07() {
    local out=$1 lab=labs/lab07_model_parallel script
    local model=(--device "$DEVICE" --layers 4 --width 128 --heads 4 --context 64 --batch-size 16 --steps 20
                 --results-dir "$out")
    for script in 01_tensor_parallel 02_pipeline_parallel 03_2d_parallel; do  # the one-process references
        "$PYTHON" "$lab/$script.py" "${model[@]}"
    done
    if (( NPROC > 1 )); then
        torchrun --nproc_per_node 2 "$lab/01_tensor_parallel.py" "${model[@]}"
        torchrun --nproc_per_node 2 "$lab/01_tensor_parallel.py" "${model[@]}" --sequence-parallel
        for script in gpipe 1f1b interleaved; do
            torchrun --nproc_per_node 2 "$lab/02_pipeline_parallel.py" "${model[@]}" --schedule "$script"
        done
        # The bubble against (p-1)/(m+p-1): micro-batches of 4 sequences, one wide block per stage.
        for script in 1 2 4 8; do
            torchrun --nproc_per_node 2 "$lab/02_pipeline_parallel.py" --device "$DEVICE" --layers 2 --width 512 \
                --heads 4 --context 32 --batch-size $((4 * script)) --microbatches "$script" --schedule gpipe \
                --steps 6 --warmup-steps 2 --results-dir "$out"
        done
    fi
    if [[ $DEVICE == cpu ]] || (( NPROC >= 4 )); then  # a 2 x 2 mesh: 4 processes (on a CPU Gloo shares the cores)
        torchrun --nproc_per_node 4 "$lab/03_2d_parallel.py" "${model[@]}" --mesh 2x2 \
            --checkpoint-dir "$out/../checkpoints/lab07"
    fi
}

run_lab08() {  # 50,000 images (made once, into LAB08_DATA), one loader worker as the README's commands, whole epochs
    local lab=labs/lab08_data_at_scale data=${LAB08_DATA:-data/lab08} format
    if [[ ! -f $data/dataset.json ]]; then
        "$PYTHON" "$lab/01_make_dataset.py" --data-dir "$data" --results-dir "$1/../made"
    fi
    local read=("$lab/02_read_formats.py" --device "$DEVICE" --data-dir "$data" --num-workers 1 --log-interval 1000
                --results-dir "$1")
    for format in imagefolder webdataset array; do
        "$PYTHON" "${read[@]}" --format "$format" --read-only
        "$PYTHON" "${read[@]}" --format "$format" --read-only --metadata-latency 1.0
        "$PYTHON" "${read[@]}" --format "$format" --metadata-latency 1.0
    done
    # The shards' tar headers parsed by WebDataset's reader instead of found at the manifest's offsets.
    "$PYTHON" "${read[@]}" --format webdataset --read-only --metadata-latency 1.0 --shard-reader webdataset
}

run_part() {  # PART RECORDS_DIR
    case $1 in
        ch04) run_ch04 "$2" ;;
        ch16) run_ch16 "$2" ;;
        lab01) run_lab01 "$2" ;;
        lab02) run_lab02 "$2" ;;
        lab03) run_lab03 "$2" ;;
        lab04) run_lab04 "$2" ;;
        lab05) run_lab05 "$2" ;;
        lab06) run_lab06 "$2" ;;
        lab07) run_lab07 "$2" ;;
        lab08) run_lab08 "$2" ;;
    esac
}

for part in "${PARTS[@]}"; do
    case $part in
        ch04 | ch16 | lab01 | lab02 | lab03 | lab04 | lab05 | lab06 | lab07 | lab08) ;;
        *) echo "error: unknown part '$part' (parts: $ALL_PARTS)" >&2
           exit 2 ;;
    esac
done

scratch=$(mktemp -d "${TMPDIR:-/tmp}/reference-runs.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
status=0
for part in "${PARTS[@]}"; do
    out="$scratch/$part/records"
    mkdir -p "$out"
    began=$(date +%s)
    printf '\n===== %s (records into %s)\n' "$part" "$out"
    # In a subshell of its own, outside any `if`, so that set -e stops the part at its first failure.
    set +e
    (set -e; run_part "$part" "$out")
    part_status=$?
    set -e
    if (( part_status == 0 )); then
        found=$(find "$out" -maxdepth 1 -name '*.json' | wc -l)
        if (( found == 0 )); then
            echo "reference_runs: $part wrote no record; reference-results/$MACHINE/$part kept" >&2
            status=1
            continue
        fi
        target="reference-results/$MACHINE/$part"
        rm -rf "$target.new" && mkdir -p "$target.new"
        find "$out" -maxdepth 1 -name '*.json' -exec cp {} "$target.new/" \;
        rm -rf "$target" && mv "$target.new" "$target"
        echo "reference_runs: $part: $found record(s) in $target ($(( $(date +%s) - began )) s)"
    else
        echo "reference_runs: $part failed; reference-results/$MACHINE/$part kept as it was" >&2
        status=1
    fi
done
"$PYTHON" scripts/update_results_tables.py
exit "$status"
