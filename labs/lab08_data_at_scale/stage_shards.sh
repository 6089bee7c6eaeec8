#!/usr/bin/env bash
# Lab-08: copy the tar shards to this node's own storage, once, and check every copy; or remove the copy.
#
# Usage (one task per node, from the job; see sbatch/stage_and_train_2node.sbatch.j2):
#   srun --ntasks-per-node=1 bash labs/lab08_data_at_scale/stage_shards.sh copy SHARDS_DIR STAGE_ROOT
#   srun --ntasks-per-node=1 bash labs/lab08_data_at_scale/stage_shards.sh clean STAGE_ROOT
#
# copy: SHARDS_DIR (on the shared file system: shards, manifest.csv, shards.json, SHA256SUMS) goes to
# STAGE_ROOT/<node>/shards, where <node> is Slurm's name for this node ($SLURMD_NODENAME, else the host):
# each node of the job, and each job, has a folder of its own even where nodes share a disk (as on the
# course's test cluster, where Slurm sets no per-job $TMPDIR). Before copying it reads how much space the
# node-local file system has free (df) and stops with one line when the shards do not fit. After copying,
# `sha256sum -c` checks every shard against the checksums the writer recorded.
# clean: removes STAGE_ROOT/<node>, and STAGE_ROOT itself once no node's folder is left in it.
set -euo pipefail

node=${SLURMD_NODENAME:-$(hostname -s)}
action=${1:-}

nearest_existing() {  # df needs a path that exists: the destination's closest existing parent
    local path=$1
    while [[ ! -e $path ]]; do path=$(dirname "$path"); done
    echo "$path"
}

case $action in
    copy)
        [[ $# == 3 ]] || { echo "usage: $0 copy SHARDS_DIR STAGE_ROOT" >&2; exit 2; }
        source_dir=$2
        target=$3/$node/shards
        [[ -f $source_dir/SHA256SUMS ]] || { echo "error: $node: no SHA256SUMS in $source_dir" >&2; exit 2; }
        need=$(du -sb "$source_dir" | cut -f1)
        base=$(nearest_existing "$3")
        free=$(df -B1 --output=avail "$base" | tail -n 1 | tr -d ' ')
        # A tenth more than the shards: the file system's own blocks, and room for the job's other files.
        if (( free < need + need / 10 )); then
            echo "error: $node: node-local storage $base has $free bytes free; staging needs $((need + need / 10))" \
                "($need bytes of shards + 10%): set NODE_LOCAL to a larger node-local folder" >&2
            exit 2
        fi
        began=$(date +%s.%N)
        mkdir -p "$target"
        cp -- "$source_dir"/* "$target"/
        # Every shard against the checksum the writer recorded: a copy cut short or damaged stops here.
        if ! (cd "$target" && sha256sum --check --quiet --strict SHA256SUMS >&2); then
            echo "error: $node: a staged shard in $target does not match its checksum (above)" >&2
            exit 1
        fi
        seconds=$(awk -v a="$began" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
        echo "$node: staged $(grep -c . "$target/SHA256SUMS") shard(s), $need bytes, to $target in $seconds s;" \
            "checksums OK ($free bytes were free)"
        ;;
    clean)
        [[ $# == 2 ]] || { echo "usage: $0 clean STAGE_ROOT" >&2; exit 2; }
        rm -rf -- "${2:?}/$node"
        rmdir -- "$2" 2>/dev/null || true  # the last node's task removes the job's folder
        echo "$node: removed the staged copy in $2/$node"
        ;;
    *)
        echo "usage: $0 copy SHARDS_DIR STAGE_ROOT | clean STAGE_ROOT" >&2
        exit 2
        ;;
esac
