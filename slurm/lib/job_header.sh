# shellcheck shell=bash
# Sourced by every course sbatch script, after `set -euo pipefail`, from the repository root:
#
#     source slurm/lib/job_header.sh
#
# It prints where and when the job runs and every SLURM_* variable (the first thing to read when a
# job misbehaves), then exports what the training scripts and their launchers need:
#
#   MASTER_ADDR      first host of the allocation: where rank 0 listens for the others
#   MASTER_PORT      port_from_job below, from the job id (and step id): jobs that share a node get
#                    different ports, and no port is hard-coded
#   OMP_NUM_THREADS  the CPU cores Slurm gave each task (capped at this node's cores / its tasks)
#   NUM_WORKERS      DataLoader workers: those cores minus the one that trains (0 for tiny runs)
#   NPROC_PER_NODE   processes per node for torchrun: the GPUs on this node, else the tasks per node
#   DEVICE           cuda when Slurm allocated GPUs to the job (outside Slurm: when nvidia-smi lists
#                    them), else cpu; see "the device" below
#   TINY_ARGS        bash array of extra flags for a run of seconds (HPC_DL_LABS_TINY=1), else empty
#   RESULTS_DIR      where result records go: $RESULTS_DIR when the submitter set it, else results
#   DATA_DIR         where downloaded data sets (MNIST, CIFAR-10) are: $DATA_DIR when set, else
#                    ~/data, the folder scripts/download_data.py fills by default on a login node
#   SRUN_CPUS_PER_TASK  = SLURM_CPUS_PER_TASK, so that every srun step gets the cores sbatch asked for
#
# Use them as:  srun --kill-on-bad-exit=1 python lab.py --device "$DEVICE" \
#                   --num-workers "$NUM_WORKERS" "${TINY_ARGS[@]}"
# A task that starts several processes itself (torchrun) first calls
#               share_cores_between "$NPROC_PER_NODE"
# so that its processes split the task's cores instead of each taking all of them.
# Works outside Slurm too (bash job.sbatch on a laptop): the values fall back to one local process.

# An array task says its array job and index: sacct and the log's name (%A_%a) know it by those.
_hdl_job="${SLURM_JOB_ID:-(not in Slurm)}"
if [[ -n "${SLURM_ARRAY_JOB_ID:-}" ]]; then
    _hdl_job="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID} (job id $SLURM_JOB_ID)"
fi
echo "== job $_hdl_job '${SLURM_JOB_NAME:-}' on $(hostname) at $(date '+%Y-%m-%d %H:%M:%S %Z')"
echo "== SLURM_* variables:"
while read -r _hdl_name; do
    printf '   %s=%s\n' "$_hdl_name" "${!_hdl_name}"
done < <(compgen -e | grep '^SLURM_' | sort)

# --- rendezvous: rank 0 runs on the first node of the allocation --------------------------------
# port_from_job JOB_ID [STEP_ID]: 20000 + (job id + 6180 x step id) mod 10000, the same number as
# port_from_job in common/runtime/launch.py (a test checks that they agree). Consecutive job ids get
# consecutive ports, so 10000 jobs in a row never share one; each step id moves the port by 6180
# (the span over the golden ratio), so the first steps of a job land far from the ports of jobs with
# nearby ids. Ports 20000-29999 stay below Linux's ephemeral range (32768 and up).
port_from_job() {
    local job="$1" step="${2:-0}"
    [[ "$step" =~ ^[0-9]+$ ]] || step=0
    echo $((20000 + (10#$job + 6180 * 10#$step) % 10000))
}
# job_time_limit_s: this job's time limit in seconds (squeue's [D-][H:]M:S); nothing outside a job, or when the
# limit is UNLIMITED or squeue does not answer.
job_time_limit_s() {
    [[ -n "${SLURM_JOB_ID:-}" ]] || return 0
    local limit
    limit="$(squeue -h -j "$SLURM_JOB_ID" -o %l 2>/dev/null || true)"
    [[ "$limit" =~ ^(([0-9]+)-)?(([0-9]+):)?([0-9]+):([0-9]+)$ ]] || return 0
    echo $(( ((10#${BASH_REMATCH[2]:-0} * 24 + 10#${BASH_REMATCH[4]:-0}) * 60 + 10#${BASH_REMATCH[5]}) * 60
             + 10#${BASH_REMATCH[6]} ))
}
if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
    # `scontrol show hostnames` expands n[1-2] into n1 and n2 (mapfile, not `| head`: with
    # pipefail a closed pipe would fail the job).
    mapfile -t _hdl_hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    MASTER_ADDR="${_hdl_hosts[0]}"
    MASTER_PORT="$(port_from_job "$SLURM_JOB_ID" "${SLURM_STEP_ID:-0}")"
else
    MASTER_ADDR="127.0.0.1"
    MASTER_PORT="$(port_from_job $$)"  # no job: this shell's process id
fi
export MASTER_ADDR MASTER_PORT

# --- CPU threads and DataLoader workers from the cores Slurm gave each task ---------------------
# Without cgroups (like the test cluster) a task may claim 16 cores on a 2-core machine, and all
# tasks of a node see all its cores: cap at this node's usable cores shared among its tasks, so
# threads and workers never oversubscribe it. (With cgroups, nproc here is the job's cores on this
# node, and the share is exactly SLURM_CPUS_PER_TASK.)
_hdl_cpus="${SLURM_CPUS_PER_TASK:-1}"
_hdl_usable="$(OMP_NUM_THREADS='' OMP_THREAD_LIMIT='' nproc)"  # the cores: nproc answers OMP_NUM_THREADS when it is set
_hdl_tasks="${SLURM_NTASKS_PER_NODE:-1}"
[[ "$_hdl_tasks" =~ ^[0-9]+$ && "$_hdl_tasks" -gt 0 ]] || _hdl_tasks=1
_hdl_usable=$((_hdl_usable / _hdl_tasks > 0 ? _hdl_usable / _hdl_tasks : 1))
((_hdl_cpus <= _hdl_usable)) || _hdl_cpus="$_hdl_usable"
export OMP_NUM_THREADS="$_hdl_cpus"
NUM_WORKERS=$((_hdl_cpus > 1 ? _hdl_cpus - 1 : 0))
# Slurm 22.05 to 23.02: srun no longer inherits --cpus-per-task from sbatch, so each task would be
# pinned to one core where cgroups are enforced. SRUN_CPUS_PER_TASK is srun's own way to pass it.
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
fi

# --- the device ----------------------------------------------------------------------------------
# A job that Slurm gave GPUs asks for cuda, whatever this shell can see of them: if PyTorch cannot
# use them (no driver on the node, CUDA_VISIBLE_DEVICES lost, a CPU-only PyTorch), the training
# stops at once with one error line (`--device cuda`), instead of training on the CPU and writing
# a record that reads like a GPU result. Only without a GPU allocation (outside Slurm: a laptop,
# `bash job.sbatch` on a node) is nvidia-smi asked, and the job takes the GPUs it lists.
# Test only: HPC_DL_LABS_FAKE_GPUS=1 says that the allocated GPUs are not real (the CI test cluster
# sets it: its GPUs are device files with nothing behind them) and runs the job on the CPU, saying so.
# HPC_DL_LABS_DEVICE=cpu|cuda overrides all of this.
_hdl_allocated=0
if [[ -n "${SLURM_JOB_ID:-}" ]] && [[ "${SLURM_GPUS_ON_NODE:-0}" =~ ^[1-9] || -n "${SLURM_JOB_GPUS:-}" ]]; then
    _hdl_allocated=1
fi
# The GPUs are real when each index (or UUID) of CUDA_VISIBLE_DEVICES is one that nvidia-smi lists.
# Asking nvidia-smi costs milliseconds; importing torch to ask would cost seconds per job.
_hdl_gpus="$(nvidia-smi --list-gpus 2>/dev/null || true)"
_hdl_count="$(grep -c '^GPU ' <<<"$_hdl_gpus" || true)"
if [[ -z "${CUDA_VISIBLE_DEVICES+set}" ]]; then
    # Unset: every GPU outside Slurm; inside a job without GPUs it means none.
    _hdl_real=0
    [[ -n "${SLURM_JOB_ID:-}" && "$_hdl_allocated" == 0 ]] || _hdl_real=$((_hdl_count > 0))
else
    _hdl_real=$((_hdl_count > 0))
    IFS=',' read -ra _hdl_ids <<<"$CUDA_VISIBLE_DEVICES"
    ((${#_hdl_ids[@]} > 0)) || _hdl_real=0
    for _hdl_id in "${_hdl_ids[@]}"; do
        if [[ "$_hdl_id" =~ ^[0-9]+$ ]]; then
            ((_hdl_id < _hdl_count)) || _hdl_real=0
        elif [[ -z "$_hdl_id" || "$_hdl_gpus" != *"UUID: $_hdl_id"* ]]; then
            _hdl_real=0
        fi
    done
fi
_hdl_note=""
if [[ "${HPC_DL_LABS_DEVICE:-}" == cuda || "${HPC_DL_LABS_DEVICE:-}" == cpu ]]; then
    DEVICE="$HPC_DL_LABS_DEVICE"
elif ((_hdl_allocated == 1)) && [[ "${HPC_DL_LABS_FAKE_GPUS:-0}" == 1 ]]; then
    DEVICE=cpu
    _hdl_note="note: HPC_DL_LABS_FAKE_GPUS=1 (the test cluster): the allocated GPU(s) are not real; running on the CPU"
elif ((_hdl_allocated == 1)); then
    DEVICE=cuda
    if ((_hdl_real == 0)); then
        if ! command -v nvidia-smi >/dev/null 2>&1; then
            _hdl_why="nvidia-smi is not on PATH"
        elif ((_hdl_count == 0)); then
            _hdl_why="nvidia-smi lists no GPU"
        else
            _hdl_why="CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES names GPUs nvidia-smi does not list"
        fi
        _hdl_note="warning: Slurm allocated GPU(s) (SLURM_GPUS_ON_NODE=${SLURM_GPUS_ON_NODE:-?}) but $_hdl_why;"
        _hdl_note+=" DEVICE=cuda all the same: if PyTorch sees no GPU either, the training stops with an error"
    fi
elif ((_hdl_real == 1)); then
    DEVICE=cuda
else
    DEVICE=cpu
fi
export DEVICE
NPROC_PER_NODE="${SLURM_GPUS_ON_NODE:-${SLURM_NTASKS_PER_NODE:-1}}"
export NPROC_PER_NODE

# --- tiny runs for CI ----------------------------------------------------------------------------
if [[ "${HPC_DL_LABS_TINY:-0}" == 1 ]]; then
    TINY_ARGS=(--dry-run)  # one epoch of two steps (common/cli.py)
    NUM_WORKERS=0          # starting worker processes would cost more than the two steps
else
    TINY_ARGS=()
fi
export NUM_WORKERS

# --- where records go: RESULTS_DIR=/scratch/me/run1 sbatch job.sbatch keeps runs apart ----------
export RESULTS_DIR="${RESULTS_DIR:-results}"

# --- where data sets are: one setting for the download (login node) and the jobs ----------------
export DATA_DIR="${DATA_DIR:-$HOME/data}"

# share_cores_between N: N processes of one task (torchrun's workers) share its cores, so each
# gets OMP_NUM_THREADS / N threads and that many DataLoader workers minus one (still 0 when tiny).
share_cores_between() {
    local processes="$1" cores
    cores=$((OMP_NUM_THREADS / processes > 0 ? OMP_NUM_THREADS / processes : 1))
    export OMP_NUM_THREADS="$cores"
    if [[ "${HPC_DL_LABS_TINY:-0}" != 1 ]]; then
        export NUM_WORKERS=$((cores > 1 ? cores - 1 : 0))
    fi
    echo "== $processes processes share the task's cores: OMP_NUM_THREADS=$OMP_NUM_THREADS NUM_WORKERS=$NUM_WORKERS each"
}

echo "== MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT OMP_NUM_THREADS=$OMP_NUM_THREADS" \
    "NUM_WORKERS=$NUM_WORKERS NPROC_PER_NODE=$NPROC_PER_NODE DEVICE=$DEVICE" \
    "TINY_ARGS=(${TINY_ARGS[*]}) RESULTS_DIR=$RESULTS_DIR DATA_DIR=$DATA_DIR"
if [[ -n "$_hdl_note" ]]; then
    echo "== $_hdl_note"
fi
unset _hdl_name _hdl_hosts _hdl_cpus _hdl_usable _hdl_tasks _hdl_gpus _hdl_count _hdl_real _hdl_ids _hdl_id \
    _hdl_allocated _hdl_note _hdl_why
