#!/usr/bin/env bash
# A throwaway Slurm cluster on one machine, for testing the course's sbatch templates.
#
# Usage:
#   slurm/testbed/testbed.sh start [--nodes 1|2] [--dir D] [resource options]
#   eval "$(slurm/testbed/testbed.sh env)"      # SLURM_CONF for sbatch, squeue, scontrol ...
#   sbatch --wait my_job.sbatch
#   slurm/testbed/testbed.sh status
#   slurm/testbed/testbed.sh stop [--dir D] [--keep-logs]
#
# `start` installs Slurm and munge with apt when they are missing (needs root), writes every file
# under one directory D (default: ${TMPDIR:-/tmp}/hpc-dl-labs-slurm), starts munged, slurmctld and
# one slurmd per emulated node (n1, n2) in the background, records their PIDs and waits until the
# nodes are idle. `stop` cancels every job, stops each daemon by its recorded PID (munged last),
# removes the /etc/hosts lines it added and deletes D: nothing is kept between runs.
#
# The nodes claim the sizes of the real clusters in slurm/sites/ (CPUs, memory, typed GPUs,
# features, partition and reservation names) so that templates rendered for those sites are
# accepted. Nothing is enforced: a job still runs on this machine's few cores, and the GPUs are
# character devices with nothing behind them, so jobs must fall back to the CPU.
# Written for Debian 12's Slurm 22.05 and munge 0.5; see slurm/testbed/README.md.

set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
readonly SCRIPT_DIR REPO_ROOT
readonly DEFAULT_DIR="${TMPDIR:-/tmp}/hpc-dl-labs-slurm"
readonly MARKER=".hpc-dl-labs-testbed"     # a directory holding this file is ours to delete
readonly CTLD_PORT=16817                    # not Slurm's default 6817: a real Slurm may run here too
readonly SLURMD_PORT_BASE=17001
readonly HOSTS_TAG="# added by hpc-dl-labs slurm testbed"
readonly PACKAGES=(slurmctld slurmd slurm-client munge)

usage() {
    cat <<'EOF'
usage: testbed.sh COMMAND [options]

commands:
  start    install (when missing), configure and start a test cluster; wait until its nodes are idle
  stop     cancel all jobs, stop every daemon started by `start`, delete the cluster directory
  status   show the daemons, nodes and jobs of a running test cluster (exit 3 when none runs)
  env      print `export SLURM_CONF=...` for a running test cluster (use: eval "$(testbed.sh env)")

options:
  --dir D             cluster directory (default: ${TMPDIR:-/tmp}/hpc-dl-labs-slurm)
  --nodes N           emulated compute nodes n1..nN, 1 to 4 (default: 2)       [start]
  --keep-logs         keep D/log after stopping (default: delete everything)   [stop]

resources the nodes claim [start]; by default they are read from slurm/sites/*.yaml:
  --partitions LIST   comma-separated partition names; the first is the default partition
  --gpus LIST         typed GPUs per node, e.g. a100:8,v100:16
  --features LIST     node features for --constraint, e.g. a100,v100
  --reservations LIST reservations to create, e.g. itp-450-th
  --cpus N            CPUs per node
  --mem-mb N          memory per node in MB
EOF
}

die() {
    echo "testbed: error: $*" >&2
    exit 1
}

say() {
    echo "testbed: $*"
}

# Seconds since `start_clock` with one decimal, e.g. 1.3 (bash 5's EPOCHREALTIME, no subprocess).
start_clock() {
    CLOCK_START="$EPOCHREALTIME"
}
seconds_elapsed() {
    awk -v start="$CLOCK_START" -v now="$EPOCHREALTIME" 'BEGIN { printf "%.1f", now - start }'
}

# ---------------------------------------------------------------------------------------------
# Options

COMMAND=""
CLUSTER_DIR="$DEFAULT_DIR"
NODES=2
KEEP_LOGS=0
PARTITIONS=""
GPUS=""
FEATURES=""
RESERVATIONS=""
CPUS=""
MEM_MB=""
RESOURCES_GIVEN=0

parse_args() {
    [[ $# -gt 0 ]] || { usage >&2; exit 2; }
    case "$1" in
        -h | --help) usage; exit 0 ;;
        start | stop | status | env) COMMAND="$1" ;;
        *) die "unknown command '$1' (choose start, stop, status or env; see --help)" ;;
    esac
    shift
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --dir) CLUSTER_DIR="${2:?--dir needs a directory}"; shift ;;
            --nodes) NODES="${2:?--nodes needs a number}"; shift ;;
            --keep-logs) KEEP_LOGS=1 ;;
            --partitions) PARTITIONS="${2:?}"; RESOURCES_GIVEN=1; shift ;;
            --gpus) GPUS="${2:?}"; RESOURCES_GIVEN=1; shift ;;
            --features) FEATURES="${2?}"; RESOURCES_GIVEN=1; shift ;;
            --reservations) RESERVATIONS="${2?}"; RESOURCES_GIVEN=1; shift ;;
            --cpus) CPUS="${2:?}"; RESOURCES_GIVEN=1; shift ;;
            --mem-mb) MEM_MB="${2:?}"; RESOURCES_GIVEN=1; shift ;;
            -h | --help) usage; exit 0 ;;
            *) die "unknown option '$1' for '$COMMAND' (see --help)" ;;
        esac
        shift
    done
    [[ "$NODES" =~ ^[1-4]$ ]] || die "--nodes must be 1 to 4, got '$NODES'"
    [[ "$CLUSTER_DIR" == /* ]] || CLUSTER_DIR="$PWD/$CLUSTER_DIR"
    CLUSTER_DIR="${CLUSTER_DIR%/}"
}

node_names() {
    local i
    for ((i = 1; i <= NODES; i++)); do
        echo "n$i"
    done
}

# Slurm's short form of the node list: n1 or n[1-2].
node_range() {
    if ((NODES == 1)); then echo "n1"; else echo "n[1-$NODES]"; fi
}

# ---------------------------------------------------------------------------------------------
# Install

install_packages() {
    local missing=() cmd
    for cmd in munged slurmctld slurmd sbatch; do
        command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
    done
    ((${#missing[@]} == 0)) && return 0
    ((EUID == 0)) || die "Slurm is not installed (missing: ${missing[*]}) and installing it needs root"
    command -v apt-get >/dev/null 2>&1 || die "Slurm is not installed (missing: ${missing[*]}) and there is no apt-get to install it"
    start_clock
    say "installing ${PACKAGES[*]} with apt-get (missing: ${missing[*]})"
    local log
    log="$(mktemp)"
    if ! apt-get update >"$log" 2>&1 \
        || ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${PACKAGES[@]}" >>"$log" 2>&1; then
        tail -n 15 "$log" >&2
        rm -f "$log"
        die "installing ${PACKAGES[*]} with apt-get failed (output above)"
    fi
    rm -f "$log"
    say "installed in $(seconds_elapsed) s"
}

# ---------------------------------------------------------------------------------------------
# What the nodes claim: from the site profiles unless given on the command line

read_site_resources() {
    local python="python3" key value
    [[ -x "$REPO_ROOT/.venv/bin/python" ]] && python="$REPO_ROOT/.venv/bin/python"
    local output
    output="$("$python" "$REPO_ROOT/scripts/render_sbatch.py" --testbed-resources 2>&1)" \
        || die "cannot read the site profiles with $python ($output); pass --partitions and --gpus instead"
    while IFS='=' read -r key value; do
        case "$key" in
            partitions) PARTITIONS="$value" ;;
            gpus) GPUS="$value" ;;
            features) FEATURES="$value" ;;
            reservations) RESERVATIONS="$value" ;;
            cpus) CPUS="$value" ;;
            mem_mb) MEM_MB="$value" ;;
        esac
    done <<<"$output"
}

apply_default_resources() {
    ((RESOURCES_GIVEN == 1)) || read_site_resources
    : "${PARTITIONS:=cpu,gpu}"
    : "${GPUS:=a100:4}"
    : "${CPUS:=64}"
    : "${MEM_MB:=512000}"
    [[ "$CPUS" =~ ^[0-9]+$ ]] || die "--cpus must be a whole number, got '$CPUS'"
    [[ "$MEM_MB" =~ ^[0-9]+$ ]] || die "--mem-mb must be a whole number, got '$MEM_MB'"
    [[ "$GPUS" =~ ^[A-Za-z0-9_.-]+:[0-9]+(,[A-Za-z0-9_.-]+:[0-9]+)*$ ]] \
        || die "--gpus must look like a100:8,v100:16, got '$GPUS'"
}

# ---------------------------------------------------------------------------------------------
# Configuration files

write_config() {
    local dir="$1" host node i type count first=0 gres="" features_clause=""
    host="$(hostname -s)"
    mkdir -p "$dir"/{log,state,spool,tmp,dev,pids}

    # Fake GPU devices: character devices with NVIDIA's major number 195 and nothing behind them.
    # Slurm needs device files in gres.conf to set CUDA_VISIBLE_DEVICES (regular files leave it empty).
    : >"$dir/gres.conf"
    echo "AutoDetect=off" >>"$dir/gres.conf"
    local -a entries
    IFS=',' read -ra entries <<<"$GPUS"
    for node in $(node_names); do
        first=0
        for entry in "${entries[@]}"; do
            type="${entry%%:*}"
            count="${entry##*:}"
            for ((i = first; i < first + count; i++)); do
                mknod "$dir/dev/$node-gpu$i" c 195 "$i"
            done
            echo "NodeName=$node Name=gpu Type=$type File=$dir/dev/$node-gpu[$first-$((first + count - 1))]" >>"$dir/gres.conf"
            first=$((first + count))
        done
    done
    for entry in "${entries[@]}"; do
        gres+="${gres:+,}gpu:$entry"
    done
    [[ -n "$FEATURES" ]] && features_clause="Feature=$FEATURES"

    # Each reservation holds CPUS cores of every node for its own jobs, so a node claims CPUS once
    # more per reservation: jobs outside a reservation always find room and never wait behind one.
    local node_cpus=$((CPUS * (1 + $(reservation_count))))
    local cores_per_socket=$((node_cpus / 2)) sockets=2
    ((node_cpus % 2 == 0)) || { sockets=1; cores_per_socket=$node_cpus; }

    cat >"$dir/slurm.conf" <<EOF
# Written by slurm/testbed/testbed.sh: a throwaway cluster, everything under $dir.
ClusterName=hpcdllabs
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a revoked job credential is remembered, and so how long Slurm holds a
# requeued job back before it may start again (default 120 s). A node refuses to start a job whose
# credential it still holds as revoked ("Job credential revoked"), so a requeued job released
# earlier than this fails on the node it ran on; 15 s keeps the pre-emption test short.
AuthInfo=socket=$dir/munge.sock,cred_expire=15
MailProg=/bin/true
TmpFS=$dir/tmp/%n
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Nodes claim the real clusters' sizes, not this machine's (nothing is enforced).
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
MinJobAge=300
KillWait=5
GresTypes=gpu
NodeName=$(node_range) NodeHostname=$host NodeAddr=127.0.0.1 Port=[$SLURMD_PORT_BASE-$((SLURMD_PORT_BASE + NODES - 1))] CPUs=$node_cpus Boards=1 SocketsPerBoard=$sockets CoresPerSocket=$cores_per_socket ThreadsPerCore=1 RealMemory=$MEM_MB Gres=$gres $features_clause State=UNKNOWN
EOF
    local -a partitions
    IFS=',' read -ra partitions <<<"$PARTITIONS"
    local default="YES" partition
    for partition in "${partitions[@]}"; do
        echo "PartitionName=$partition Nodes=$(node_range) Default=$default MaxTime=INFINITE State=UP" >>"$dir/slurm.conf"
        default="NO"
    done
}

# ---------------------------------------------------------------------------------------------
# /etc/hosts: n1, n2 ... must resolve, since templates take MASTER_ADDR from the node list

add_host_entries() {
    local dir="$1" node
    for node in $(node_names); do
        getent hosts "$node" >/dev/null 2>&1 && continue
        echo "127.0.0.1 $node $HOSTS_TAG" >>/etc/hosts || die "cannot add $node to /etc/hosts (needed for MASTER_ADDR)"
        echo "$node" >>"$dir/hosts-added"
    done
}

remove_host_entries() {
    local dir="$1" kept
    [[ -s "$dir/hosts-added" ]] || return 0
    # Rewrite in place (not `sed -i`, which replaces the file and fails on a bind-mounted /etc/hosts).
    kept="$(grep -v -F "$HOSTS_TAG" /etc/hosts || true)"
    printf '%s\n' "$kept" >/etc/hosts
    rm -f "$dir/hosts-added"
}

# ---------------------------------------------------------------------------------------------
# Daemons

# True while PID runs (a zombie, which a container's PID 1 may never reap, counts as stopped).
is_running() {
    local pid="$1" state
    kill -0 "$pid" 2>/dev/null || return 1
    state="$(awk '{ print $3 }' "/proc/$pid/stat" 2>/dev/null || echo Z)"
    [[ "$state" != Z ]]
}

# Start a daemon in its own session, output to its log, and record its PID under a name.
launch() {
    local dir="$1" name="$2"
    shift 2
    setsid "$@" </dev/null >>"$dir/log/$name.out" 2>&1 &
    echo "$!" >"$dir/pids/$name"
}

recorded_pids() {
    local dir="$1" file
    for file in "$dir"/pids/*; do
        [[ -f "$file" ]] && echo "$(basename "$file") $(cat "$file")"
    done
    return 0
}

any_daemon_running() {
    local dir="$1" name pid
    while read -r name pid; do
        is_running "$pid" && return 0
    done < <(recorded_pids "$dir")
    return 1
}

# Wait up to SECONDS for every PID to stop; SIGKILL the ones still running after that.
wait_stopped() {
    local seconds="$1" deadline pid
    shift
    deadline=$((SECONDS + seconds))
    for pid in "$@"; do
        while is_running "$pid" && ((SECONDS < deadline)); do
            sleep 0.1
        done
        if is_running "$pid"; then
            say "PID $pid ignored SIGTERM for ${seconds} s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
}

show_log_tails() {
    local dir="$1" log
    for log in "$dir"/log/*; do
        [[ -s "$log" ]] || continue
        echo "---- $log (last lines)" >&2
        tail -n 8 "$log" >&2
    done
}

# Poll until every node is idle (fast: the nodes register within about a second).
wait_for_idle_nodes() {
    local dir="$1" timeout_s="$2" deadline states
    deadline=$((SECONDS + timeout_s))
    while ((SECONDS < deadline)); do
        states="$(sinfo --noheader --Node --format='%N %t' 2>/dev/null | sort -u || true)"
        if [[ -n "$states" ]] && ! grep -v -q ' idle$' <<<"$states"; then
            [[ "$(grep -c ' idle$' <<<"$states")" -eq "$NODES" ]] && return 0
        fi
        any_daemon_running "$dir" || break
        sleep 0.1
    done
    echo "testbed: nodes did not become idle within ${timeout_s} s; sinfo says: ${states:-nothing}" >&2
    show_log_tails "$dir"
    return 1
}

start_daemons() {
    local dir="$1" node

    head -c 1024 /dev/urandom >"$dir/munge.key"
    chmod 400 "$dir/munge.key"
    # Its own key and socket, so a munged already running on this machine is left alone.
    launch "$dir" munged munged --foreground --key-file="$dir/munge.key" --socket="$dir/munge.sock" \
        --pid-file="$dir/munged.pid" --seed-file="$dir/munge.seed" --log-file="$dir/log/munged.log"
    local deadline=$((SECONDS + 10))
    until [[ -S "$dir/munge.sock" ]]; do
        if ((SECONDS >= deadline)) || ! is_running "$(cat "$dir/pids/munged")"; then
            show_log_tails "$dir"
            return 1
        fi
        sleep 0.05
    done

    launch "$dir" slurmctld slurmctld -D -f "$dir/slurm.conf"
    for node in $(node_names); do
        launch "$dir" "slurmd-$node" slurmd -D -f "$dir/slurm.conf" -N "$node"
    done
}

create_reservations() {
    local name
    local -a names
    IFS=',' read -ra names <<<"$RESERVATIONS"
    for name in "${names[@]}"; do
        [[ -n "$name" ]] || continue
        scontrol create reservation ReservationName="$name" Users=root StartTime=now Duration=UNLIMITED \
            Nodes="$(node_range)" CoreCnt="$(reservation_cores)" >/dev/null \
            || die "cannot create reservation $name"
    done
}

# CPUS cores on every node, e.g. 128,128 (a reservation's CoreCnt lists cores per node).
reservation_cores() {
    local node cores=""
    for node in $(node_names); do
        cores+="${cores:+,}$CPUS"
    done
    echo "$cores"
}

reservation_count() {
    local -a names
    IFS=',' read -ra names <<<"$RESERVATIONS"
    echo "${#names[@]}"
}

# ---------------------------------------------------------------------------------------------
# Commands

is_our_dir() {
    [[ -f "$1/$MARKER" ]]
}

cmd_start() {
    local dir="$CLUSTER_DIR"
    if [[ -e "$dir" ]]; then
        if is_our_dir "$dir" && any_daemon_running "$dir"; then
            die "a test cluster is already running in $dir (stop it first: $0 stop --dir $dir)"
        elif is_our_dir "$dir"; then
            say "removing the leftovers of a stopped test cluster in $dir"
            remove_host_entries "$dir"
            rm -rf "$dir"
        elif [[ -n "$(ls -A "$dir")" ]]; then
            die "$dir exists and is not a test cluster directory; choose another --dir"
        fi
    fi
    # Our ports must be free: another test cluster (in another --dir) would hold them.
    if (exec 3<>"/dev/tcp/127.0.0.1/$CTLD_PORT") 2>/dev/null; then
        die "port $CTLD_PORT is in use: is a test cluster running in another directory? ($0 status --dir ...)"
    fi

    install_packages
    apply_default_resources
    ((EUID == 0)) || die "starting the test cluster needs root (slurmd runs jobs as any user)"

    start_clock
    mkdir -p "$dir"
    # munged insists that everyone may traverse the directory holding its socket.
    chmod 711 "$dir"
    touch "$dir/$MARKER"
    write_config "$dir"
    add_host_entries "$dir"
    export SLURM_CONF="$dir/slurm.conf"
    if ! start_daemons "$dir" || ! wait_for_idle_nodes "$dir" 30; then
        echo "testbed: error: the test cluster did not start; stopping what was started" >&2
        stop_cluster "$dir" 0 >/dev/null
        exit 1
    fi
    create_reservations
    say "$NODES node(s) idle in $(seconds_elapsed) s: $(sinfo --noheader --format='%P' | tr '\n' ' ')"
    say "GPUs per node: $GPUS; features: ${FEATURES:-none}; reservations: ${RESERVATIONS:-none}"
    say "use it with: eval \"\$($0 env --dir $dir)\""
}

# Cancel jobs, SIGTERM slurmd(s) and slurmctld together, then munged; delete the directory.
stop_cluster() {
    local dir="$1" keep_logs="$2" name pid
    export SLURM_CONF="$dir/slurm.conf"
    local ctld_pid=""
    [[ -f "$dir/pids/slurmctld" ]] && ctld_pid="$(cat "$dir/pids/slurmctld")"
    if [[ -n "$ctld_pid" ]] && is_running "$ctld_pid"; then
        # Running job steps survive a killed slurmd: cancel every job first and let them end.
        scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
        local deadline=$((SECONDS + 10))
        while [[ -n "$(squeue --noheader --states=RUNNING,COMPLETING --format=%i 2>/dev/null)" ]] \
            && ((SECONDS < deadline)); do
            sleep 0.1
        done
    fi
    local slurm_pids=()
    while read -r name pid; do
        [[ "$name" == munged ]] && continue
        if is_running "$pid"; then
            kill -TERM "$pid" 2>/dev/null || true
            slurm_pids+=("$pid")
        fi
    done < <(recorded_pids "$dir")
    ((${#slurm_pids[@]} == 0)) || wait_stopped 20 "${slurm_pids[@]}"
    if [[ -f "$dir/pids/munged" ]]; then
        pid="$(cat "$dir/pids/munged")"
        if is_running "$pid"; then
            kill -TERM "$pid" 2>/dev/null || true
            wait_stopped 10 "$pid"
        fi
    fi
    remove_host_entries "$dir"
    if ((keep_logs == 1)); then
        # The marker stays, so the next `start` in this directory may clear it.
        find "$dir" -mindepth 1 -maxdepth 1 ! -name log ! -name "$MARKER" -exec rm -rf {} +
        say "logs kept in $dir/log"
    else
        rm -rf "$dir"
    fi
}

cmd_stop() {
    local dir="$CLUSTER_DIR"
    is_our_dir "$dir" || die "no test cluster in $dir"
    start_clock
    stop_cluster "$dir" "$KEEP_LOGS"
    say "stopped in $(seconds_elapsed) s"
}

cmd_status() {
    local dir="$CLUSTER_DIR" name pid state
    if ! is_our_dir "$dir"; then
        say "no test cluster in $dir"
        exit 3
    fi
    say "cluster directory $dir"
    while read -r name pid; do
        state="stopped"
        is_running "$pid" && state="running"
        printf '  %-12s pid %-8s %s\n' "$name" "$pid" "$state"
    done < <(recorded_pids "$dir")
    any_daemon_running "$dir" || exit 3
    export SLURM_CONF="$dir/slurm.conf"
    sinfo || true
    squeue || true
}

cmd_env() {
    local dir="$CLUSTER_DIR"
    if ! is_our_dir "$dir" || ! any_daemon_running "$dir"; then
        die "no test cluster is running in $dir (start one: $0 start)"
    fi
    echo "export SLURM_CONF=$dir/slurm.conf"
}

main() {
    parse_args "$@"
    case "$COMMAND" in
        start) cmd_start ;;
        stop) cmd_stop ;;
        status) cmd_status ;;
        env) cmd_env ;;
    esac
}

main "$@"
