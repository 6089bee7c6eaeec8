#!/usr/bin/env bash
# The GPU path of every chapter and lab script, run once with tiny settings, and what each run's
# record must say checked: one command for the first hour on a GPU node.
#
#   bash scripts/gpu_smoke.sh                      # every check; results in results/gpu_smoke/
#   bash scripts/gpu_smoke.sh --only lab03_compile,ch16_memory --out /tmp/smoke
#   bash scripts/gpu_smoke.sh --list               # the checks, one per line
#   PYTHON=.venv/bin/python SMOKE_TIMEOUT=300 bash scripts/gpu_smoke.sh
#
# Each check runs its script(s) (every command under a time limit, SMOKE_TIMEOUT seconds, default
# 240) into a folder of its own, then scripts/gpu_smoke_check.py reads what they left: the device is
# cuda, DDP used NCCL with identical replicas, memory comes from the CUDA allocator (and the device's
# own count), no precision row failed, the traces hold GPU kernels, the two refusals ("more processes
# than GPUs", "bf16 below compute capability 8.0") are one error line each, Lab-04's predicted memory is
# what the tensors held and its FSDP2 checkpoint (asynchronous, bf16, activation checkpointing) resumes
# on one GPU, Lab-05's collectives are correct over NCCL and its overlap stays within 0-100% (on one
# GPU: nothing to overlap, said so), the main job (scripts/main_job.sh) ends with the report's path,
# and every `pytest -m gpu` test passes, each in a pytest process of its own (pytest_gpu: a test must
# start CUDA itself; an earlier test in the same process would hide that). A failing check does not
# stop the others. The last lines are one table of all checks.
#
# Exit status: 0 every check passed, 1 a check failed, 3 none failed but some were skipped (a Python
# module they need is missing; the table names it), 2 bad usage. Without a GPU: one line, exit 0.
# shellcheck disable=SC2329  # t, t_out and the run_<check> functions are called by name ("run_$name")
set -uo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root" || exit 2
export PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
TIMEOUT=${SMOKE_TIMEOUT:-240}
OUT=results/gpu_smoke
ONLY=""

CHECKS=(gpu_check pytorch_basics ch04_fp32 ch04_fp16 ch04_bf16 amp_training ch04_ddp
        lab01_env lab01_baseline lab01_dp lab01_ddp lab01_run_lab refuse_ranks refuse_bf16
        lab02_line_profile lab02_trace lab02_sweep lab03_precisions lab03_compile lab03_channels_last
        ch16_memory ch16_profiling ch16_benchmark ch16_loading
        lab04_memory lab04_ddp lab04_fsdp_resume lab04_largest lab05_allreduce lab05_scaling lab05_overlap
        lab06_recover lab06_preflight
        lab07_model_parallel main_job pytest_gpu)
# Python modules a check needs beyond torch and torchvision (a missing one skips the check, by name).
declare -A NEEDS=(
    [ch04_fp32]=sklearn [ch04_fp16]=sklearn [ch04_bf16]=sklearn [amp_training]=sklearn [ch04_ddp]=sklearn
    [lab01_run_lab]="sklearn pandas jinja2 matplotlib" [lab02_line_profile]=line_profiler [lab02_sweep]=line_profiler
    [ch16_loading]=sklearn [main_job]="sklearn pandas jinja2 matplotlib" [pytest_gpu]=pytest
)

while (( $# )); do
    case $1 in
        --only) ONLY=${2:-}; shift 2 ;;
        --out) OUT=${2:-}; shift 2 ;;
        --list) printf '%s\n' "${CHECKS[@]}"; exit 0 ;;
        -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 && !/shellcheck/ {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"
                   exit 0 ;;
        *) echo "error: unknown argument $1 (see bash scripts/gpu_smoke.sh --help)" >&2; exit 2 ;;
    esac
done
for name in ${ONLY//,/ }; do
    if [[ " ${CHECKS[*]} " != *" $name "* ]]; then
        echo "error: unknown check $name; bash scripts/gpu_smoke.sh --list shows them" >&2
        exit 2
    fi
done

# What this interpreter's PyTorch sees: "<GPUs> <torch version> <name of GPU 0>".
PROBE=$("$PYTHON" -c 'import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(n, torch.__version__, torch.cuda.get_device_name(0) if n else "")' 2>/dev/null)
GPUS=${PROBE%% *}
if [[ ! $GPUS =~ ^[0-9]+$ ]]; then
    echo "gpu_smoke: $PYTHON cannot import torch; set PYTHON to the course environment's interpreter" >&2
    exit 1
fi
if (( GPUS == 0 )); then
    echo "gpu_smoke: no CUDA GPU visible (torch.cuda.is_available() is False): nothing to check on this machine"
    exit 0
fi

mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
SUMMARY="$OUT/summary.tsv"
: >"$SUMMARY"
echo "gpu_smoke: $GPUS GPU(s), torch ${PROBE#* }; results in $OUT, at most $TIMEOUT s per command"

# --- helpers -----------------------------------------------------------------------------------
DIR=""  # the current check's folder

# t CMD...: one command of the current check, under the time limit; output to log.txt, status to status.txt.
t() {
    local start=$SECONDS rc
    echo "[smoke] $*" >>"$DIR/log.txt"
    timeout --kill-after=15 "$TIMEOUT" "$@" >>"$DIR/log.txt" 2>&1
    rc=$?
    echo "$rc" >>"$DIR/status.txt"
    echo "[smoke] exit $rc after $((SECONDS - start)) s" >>"$DIR/log.txt"
    return "$rc"
}

# t_out FILE CMD...: t, with the command's standard output kept in FILE.
t_out() {
    local file=$1 rc
    shift
    echo "[smoke] $* > $file" >>"$DIR/log.txt"
    timeout --kill-after=15 "$TIMEOUT" "$@" >"$file" 2>>"$DIR/log.txt"
    rc=$?
    echo "$rc" >>"$DIR/status.txt"
    return "$rc"
}

TORCHRUN=("$PYTHON" -m torch.distributed.run --standalone)  # add --nproc_per_node=N

# --- the checks: each runs in its own folder $DIR, with tiny settings ---------------------------
CH04=chapters/ch04_deep_learning
CH16=chapters/ch16_gpu_distributed
LAB01=labs/lab01_dp_vs_ddp
LAB02=labs/lab02_profiling
LAB03=labs/lab03_precision_benchmark/benchmark_models.py
TINY_LAB01=(--device cuda --model resnet18 --dataset synthetic --image-size 32 --synthetic-size 256
            --epochs 1 --max-steps 4 --num-workers 0 --log-interval 2)
TINY_LAB03=(--device cuda --models resnet18 --image-size 64 -b 8 -w 2 -n 3 --check-steps 2)

run_gpu_check() { t_out "$DIR/gpu_check.json" "$PYTHON" "$CH04"/gpu_check.py --json; }
run_pytorch_basics() { t "$PYTHON" "$CH04"/pytorch_basics.py --device cuda --size 2048 --repeats 3 --results-dir "$DIR"; }
run_ch04() {  # fp32|fp16|bf16: one epoch with a checkpoint, then resumed to two (deterministic, as the jobs run)
    local args=(--device cuda --amp "$1" --max-steps 6 --num-workers 0 --checkpoint "$DIR/ck.pt" --deterministic
                --results-dir "$DIR")
    t "$PYTHON" "$CH04"/mnist_training.py "${args[@]}" --epochs 1 &&
        t "$PYTHON" "$CH04"/mnist_training.py "${args[@]}" --epochs 2 --resume
}
run_ch04_fp32() { run_ch04 fp32; }
run_ch04_fp16() { run_ch04 fp16; }
run_ch04_bf16() { run_ch04 bf16; }
run_amp_training() { t "$PYTHON" "$CH04"/amp_training.py --device cuda --epochs 1 --max-steps 6 --results-dir "$DIR"; }
run_ch04_ddp() {
    t "${TORCHRUN[@]}" --nproc_per_node="$GPUS" "$CH04"/multi_gpu_ddp.py --device cuda --epochs 1 --max-steps 6 \
        --checkpoint "$DIR/ck.pt" --results-dir "$DIR"
}
run_lab01_env() { t "$PYTHON" "$LAB01"/01_environment_check.py --results-dir "$DIR"; }
run_lab01_baseline() { t "$PYTHON" "$LAB01"/02_baseline_single_gpu.py "${TINY_LAB01[@]}" --batch-size 32 --results-dir "$DIR"; }
run_lab01_dp() { t "$PYTHON" "$LAB01"/03_dataparallel_training.py "${TINY_LAB01[@]}" --batch-size $((16 * GPUS)) --results-dir "$DIR"; }
run_lab01_ddp() {
    t "${TORCHRUN[@]}" --nproc_per_node="$GPUS" "$LAB01"/04_ddp_training.py "${TINY_LAB01[@]}" --batch-size 16 \
        --checkpoint "$DIR/ck.pt" --results-dir "$DIR"
}
run_lab01_run_lab() {
    t env PYTHON="$PYTHON" LAB01_DEVICE=cuda LAB01_NPROC="$GPUS" LAB01_GLOBAL_BATCH=$((8 * GPUS)) \
        bash "$LAB01"/run_lab.sh "$DIR"
}
run_refuse_ranks() {
    t "${TORCHRUN[@]}" --nproc_per_node=$((GPUS + 1)) "$LAB01"/04_ddp_training.py "${TINY_LAB01[@]}" --batch-size 8 --dry-run \
        --checkpoint "$DIR/ck.pt" --results-dir "$DIR"
}
run_refuse_bf16() {  # the real GPU, made to report compute capability 7.0 (a V100) to PyTorch
    t "$PYTHON" -c 'import runpy, sys, torch
torch.cuda.get_device_capability = lambda device=None: (7, 0)
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")' "$CH04"/mnist_training.py --device cuda --amp bf16 --dry-run \
        --results-dir "$DIR"
}
run_lab02_line_profile() {
    local args=(--device cuda --dataset synthetic --synthetic-size 2048 --epochs 1 --max-steps 20 --num-workers 1
                --results-dir "$DIR")
    t "$PYTHON" -m kernprof -l -o "$DIR/run.lprof" "$LAB02"/mnist_classify.py "${args[@]}"
    t "$PYTHON" -m kernprof -l -o "$DIR/sync.lprof" "$LAB02"/mnist_classify.py "${args[@]}" --launch-blocking
    t_out "$DIR/profile.txt" "$PYTHON" -m line_profiler -rmt "$DIR/run.lprof"
}
run_lab02_trace() {
    t "$PYTHON" "$LAB02"/profile_trace.py --device cuda --dataset synthetic --pipeline tensor --num-workers 0 \
        --wait 1 --warmup 1 \
        --active 2 --trace "$DIR/trace.json" --results-dir "$DIR"
}
run_lab02_sweep() {
    t "$PYTHON" "$LAB02"/sweep.py --device cuda --dataset synthetic --synthetic-size 4096 --epochs 1 --max-steps 20 \
        --steps baseline,pin-memory,device,amp --results-dir "$DIR"
}
run_lab03_precisions() { t "$PYTHON" "$LAB03" "${TINY_LAB03[@]}" --folder "$DIR/csv" --results-dir "$DIR"; }
run_lab03_compile() {
    t "$PYTHON" "$LAB03" "${TINY_LAB03[@]}" --compile --precisions fp32,amp-bf16 --folder "$DIR/csv" --results-dir "$DIR"
}
run_lab03_channels_last() {
    t "$PYTHON" "$LAB03" "${TINY_LAB03[@]}" --channels-last --precisions fp32,amp-fp16,amp-bf16 \
        --folder "$DIR/csv" --results-dir "$DIR"
}
run_ch16_memory() {
    t "$PYTHON" "$CH16"/memory_management.py --device cuda --depth 6 --width 128 --batch-size 64 --repeats 2 \
        --results-dir "$DIR"
}
run_ch16_profiling() {
    t "$PYTHON" "$CH16"/profiling.py --device cuda --batch-size 8 --image-size 64 --iterations 3 \
        --trace "$DIR/trace.json" --results-dir "$DIR"
}
run_ch16_benchmark() { t "$PYTHON" "$CH16"/benchmark_cpu_vs_gpu.py --iterations 5 --warmup 2 --results-dir "$DIR"; }
run_ch16_loading() {
    t "$PYTHON" "$CH16"/efficient_loading.py --device cuda --steps 2 --num-workers 1 --batch-size 128 --results-dir "$DIR"
}

LAB04=labs/lab04_sharded_training
LAB05=labs/lab05_scaling
TINY_LAB04=(--device cuda --layers 4 --width 128 --heads 4 --context 64)
# 16 sequences per optimiser step on any number of GPUs (micro-batches of 4, accumulated as needed).
TINY_TRAIN04=("${TINY_LAB04[@]}" --global-batch-size 16 --batch-size 4 --max-steps 6 --eval-steps 1 --log-interval 100)
run_lab04_memory() { t "${TORCHRUN[@]}" --nproc_per_node="$GPUS" "$LAB04"/01_memory_budget.py "${TINY_LAB04[@]}" \
    --batch-size 4 --results-dir "$DIR"; }
run_lab04_ddp() {
    t "${TORCHRUN[@]}" --nproc_per_node="$GPUS" "$LAB04"/02_sharded_training.py "${TINY_TRAIN04[@]}" --strategy ddp \
        --epochs 1 --checkpoint-dir "$DIR/ckpt" --results-dir "$DIR"
}
run_lab04_fsdp_resume() {  # every option at once, asynchronous checkpoints; then resumed for one more epoch on 1 GPU
    local fsdp=("${TINY_TRAIN04[@]}" --strategy fsdp --activation-checkpointing --mixed-precision bf16
                --checkpoint-dir "$DIR/ckpt" --results-dir "$DIR")
    t "${TORCHRUN[@]}" --nproc_per_node="$GPUS" "$LAB04"/02_sharded_training.py "${fsdp[@]}" --epochs 1 --async-checkpoint &&
        t "${TORCHRUN[@]}" --nproc_per_node=1 "$LAB04"/02_sharded_training.py "${fsdp[@]}" --epochs 2 --resume
}
run_lab04_largest() {
    t "${TORCHRUN[@]}" --nproc_per_node="$GPUS" "$LAB04"/03_largest_model.py --device cuda --layers 2 --width 64 \
        --heads 4 --context 32 --batch-size 2 --budget 64MiB --max-doublings 4 --results-dir "$DIR"
}
run_lab05_allreduce() {
    t "${TORCHRUN[@]}" --nproc_per_node="$GPUS" "$LAB05"/01_allreduce_bench.py --device cuda --min-bytes 1024 \
        --max-bytes 1048576 --step-factor 16 --warmup 2 --iters 5 --results-dir "$DIR"
}
run_lab05_scaling() {  # one process: the point every scaling curve starts from
    t "$PYTHON" "$LAB05"/02_scaling_study.py --device cuda --processes 1 --model resnet18 --dataset synthetic \
        --image-size 32 --epochs 1 --max-steps 4 --results-dir "$DIR"
}
run_lab05_overlap() {  # on one GPU there is nothing to overlap: the script must say so, not print nonsense
    t "${TORCHRUN[@]}" --nproc_per_node="$GPUS" "$LAB05"/03_overlap.py --device cuda --model resnet18 --image-size 64 \
        --batch-size 8 --steps 3 --warmup-steps 1 --bucket-cap-mb 1,25 --results-dir "$DIR"
}
LAB06=labs/lab06_failures
run_lab06_recover() {  # rank 1 crashes at step 4 (rank 0 where there is one GPU); torchrun restarts, the run resumes
    t "${TORCHRUN[@]}" --nproc_per_node="$GPUS" --max-restarts=1 "$LAB06"/01_inject.py --device cuda --steps 6 \
        --fault crash-rank --rank $((GPUS > 1 ? 1 : 0)) --step 4 --checkpoint-every 2 --run-dir "$DIR/run" --results-dir "$DIR"
}
run_lab06_preflight() { t "${TORCHRUN[@]}" --nproc_per_node="$GPUS" "$LAB06"/04_preflight.py --device cuda --results-dir "$DIR"; }
LAB07=labs/lab07_model_parallel
# 8 blocks, 8 heads: tensor parallel and the pipeline fit any number of GPUs up to 8.
TINY_LAB07=(--device cuda --layers 8 --width 128 --heads 8 --context 64 --batch-size 16 --steps 6 --warmup-steps 2)
run_lab07_model_parallel() {  # each step on every GPU (on one GPU: the one-process reference of each script)
    t "${TORCHRUN[@]}" --nproc_per_node="$GPUS" "$LAB07"/01_tensor_parallel.py "${TINY_LAB07[@]}" --results-dir "$DIR" &&
        t "${TORCHRUN[@]}" --nproc_per_node="$GPUS" "$LAB07"/02_pipeline_parallel.py "${TINY_LAB07[@]}" \
            --schedule 1f1b --microbatches 8 --results-dir "$DIR" &&
        t "${TORCHRUN[@]}" --nproc_per_node="$GPUS" "$LAB07"/03_2d_parallel.py "${TINY_LAB07[@]}" \
            --checkpoint-dir "$DIR/ckpt" --results-dir "$DIR"
}
run_main_job() {  # the main job as README.md runs it, on the GPU(s); PYTHON: this interpreter, not a fresh .venv
    t env PYTHON="$PYTHON" LAB01_DEVICE=cuda LAB01_NPROC="$GPUS" LAB01_GLOBAL_BATCH=$((16 * GPUS)) \
        bash scripts/main_job.sh "$DIR"
}
run_pytest_gpu() {  # every gpu-marked test, each in a fresh process: CUDA is started by the test, never before
    t_out "$DIR/tests.txt" "$PYTHON" -m pytest -p no:cacheprovider -m gpu --collect-only -q tests || return
    local test
    while read -r test; do
        [[ $test == tests/*::* ]] && t "$PYTHON" -m pytest -p no:cacheprovider -q -rs -m gpu "$test"
    done < "$DIR/tests.txt"
    return 0
}

# --- run them ------------------------------------------------------------------------------------
for name in "${CHECKS[@]}"; do
    if [[ -n $ONLY && ",$ONLY," != *",$name,"* ]]; then
        continue
    fi
    missing=()
    for module in ${NEEDS[$name]:-}; do
        "$PYTHON" -c "import $module" >/dev/null 2>&1 || missing+=("$module")
    done
    if (( ${#missing[@]} )); then
        printf '%s\tSKIP\t\tneeds the Python module(s) %s\n' "$name" "${missing[*]}" >>"$SUMMARY"
        echo "$name: SKIP (needs ${missing[*]})"
        continue
    fi
    DIR="$OUT/$name"
    rm -rf "$DIR" && mkdir -p "$DIR"
    : >"$DIR/status.txt"
    start=$SECONDS
    ( "run_$name" ) || true
    "$PYTHON" scripts/gpu_smoke_check.py "$name" "$DIR" --gpus "$GPUS" --seconds $((SECONDS - start)) \
        --summary "$SUMMARY" ||
        if ! grep -q "^$name"$'\t' "$SUMMARY"; then  # the checker itself could not run
            printf '%s\tFAIL\t%s\tscripts/gpu_smoke_check.py could not judge it (see %s)\n' \
                "$name" $((SECONDS - start)) "$DIR/log.txt" >>"$SUMMARY"
        fi
done

echo
"$PYTHON" scripts/gpu_smoke_check.py --table "$SUMMARY"
status=$?
echo "logs and records: $OUT/<check>/"
exit "$status"
