#!/usr/bin/env bash
# Start a BeeOND file system over the job's nodes, stage a whole dataset into it once, stop it.
#
#   beeond_stage.sh start          # BeeOND over every node of the job (NVMe of each node)
#   beeond_stage.sh stage SRC      # copy all of SRC into it, verified; prints the staged path
#   beeond_stage.sh path SRC       # print where `stage` puts SRC:
#                                  #   $BEEOND_MOUNT/shardio-<uid>-<job>/<name of SRC>
#   beeond_stage.sh stop           # unmount, stop the services, delete the data and logs
#
# Run it from the batch script (on the job's first node), not under srun: `beeond` itself
# reaches the other nodes (pdsh with -P, else ssh one by one), and `stage` must run once for
# the whole job. BeeOND usually needs root or a site sudo rule: set BEEOND_BIN="sudo beeond".
# Sites that start BeeOND in the Slurm prolog (e.g. `--constraint=BEEOND`) only need `stage`,
# with BEEOND_MOUNT set to their mount point.
#
# `shardio stage` itself picks the staged path (its default, with the BeeOND mount as base):
# it creates shardio-<uid>-<job> with mode 0700 and refuses one that is a symlink, another
# user's or writable by others, so a user sharing the nodes cannot plant or read the copy.
#
# Why a shared BeeOND copy rather than per-node staging (`shardio stage --node auto`): every
# node sees every shard, so any rank may read any shard and a node's shards need not fit on
# its own disk; the parallel filesystem is read once for the whole job.
#
#   job script:
#     trap 'scripts/beeond/beeond_stage.sh stop' EXIT
#     scripts/beeond/beeond_stage.sh start
#     DATA=$(scripts/beeond/beeond_stage.sh stage /lustre/proj/imagenet-shards)
#     srun ... python train.py --data "$DATA"
#
# Environment:
#   BEEOND_BIN         the beeond command (default beeond)
#   BEEOND_DATA_DIR    where each node keeps its BeeGFS data (beeond -d; default
#                      /mnt/nvme/beeond): a directory on the node's NVMe
#   BEEOND_MOUNT       where the file system is mounted on every node (beeond -c; default
#                      /mnt/beeond)
#   BEEOND_NODEFILE    the node list file (default ${TMPDIR:-/tmp}/beeond-nodefile-$JOBID)
#   BEEOND_PDSH        1 (default): start and stop in parallel with pdsh (beeond -P);
#                      0: beeond uses ssh node by node
#   BEEOND_START_ARGS  more `beeond start` options, e.g. "-f /etc/beegfs" (configuration with
#                      connAuthFile), "-F" (empty a leftover data dir), "-m 4" (4 metadata
#                      servers), "-L /tmp/beeond-logs" (log dir), "-q" (quiet)
#   BEEOND_STOP_ARGS   more `beeond stop` options, e.g. "-c" (clean up after a failed stop)
#   SHARDIO_BIN        the shardio command (default shardio)
#   SHARDIO_STAGE_ARGS more `shardio stage` options, e.g. "--streams 16"
#
# beeond flags used (as documented in the usage text of beeond, ThinkParQ/beegfs
# beeond/source/beeond; `beeond` with no arguments prints it):
#   start -n FILE  node file, one hostname a line: the nodes that serve and mount the FS
#         -d PATH  data path on every node: storage and metadata of the BeeGFS live there
#         -c PATH  client mount point on every node
#         -P       start services in parallel with pdsh (else ssh, node by node)
#   stop  -n FILE  the same node file
#         -L       delete log files after a successful shutdown
#         -d       delete the BeeGFS data on the disks (the staged dataset included)
#         -P       shut down in parallel with pdsh
set -euo pipefail

prog="beeond_stage.sh"
log() { printf '[%s %s] %s\n' "$prog" "$(date '+%Y-%m-%dT%H:%M:%S%z')" "$*" >&2; }
die() {
    log "error: $*"
    exit 2
}
usage() {
    echo "usage: $prog start | stage SRC | path SRC | stop" >&2
    exit 2
}

read -r -a beeond <<<"${BEEOND_BIN:-beeond}"
read -r -a shardio <<<"${SHARDIO_BIN:-shardio}"
data_dir="${BEEOND_DATA_DIR:-/mnt/nvme/beeond}"
mount_dir="${BEEOND_MOUNT:-/mnt/beeond}"
nodefile="${BEEOND_NODEFILE:-${TMPDIR:-/tmp}/beeond-nodefile-${SLURM_JOB_ID:-nojob}}"
pdsh=()
[[ "${BEEOND_PDSH:-1}" == 1 ]] && pdsh=(-P)

# Where `shardio stage SRC` puts SRC when $SLURM_TMPDIR is the mount point: the rule of
# shardio.staging.default_stage_dir (name as Python's os.path.basename(os.path.abspath(SRC)),
# then 8 hex digits of the SHA-256 of SRC's real path: one area per source).
staged_path() {
    local src="$1" job="${SLURM_JOB_ID:-nojob}" name hash
    [[ -n "$src" ]] || die "stage: SRC is empty"
    [[ "$job" =~ ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$ ]] || die "SLURM_JOB_ID '$job' is not a job id"
    name="$(basename -- "$(realpath -ms -- "$src")")"
    [[ "$name" == / ]] && name=dataset
    hash="$(printf %s "$(realpath -m -- "$src")" | sha256sum | cut -c1-8)"
    printf '%s/shardio-%s-%s/%s-%s\n' "${mount_dir%/}" "$(id -u)" "$job" "$name" "$hash"
}

cmd_start() {
    [[ -n "${SLURM_JOB_NODELIST:-}" ]] || die "start: SLURM_JOB_NODELIST is not set (run in a job)"
    local hosts=()
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    ((${#hosts[@]} > 0)) || die "start: scontrol listed no hosts for '$SLURM_JOB_NODELIST'"
    mkdir -p "$(dirname "$nodefile")"
    printf '%s\n' "${hosts[@]}" >"$nodefile"
    local extra=()
    read -r -a extra <<<"${BEEOND_START_ARGS:-}"
    log "starting BeeOND on ${#hosts[@]} node(s) (${hosts[*]}): data $data_dir, mount $mount_dir"
    "${beeond[@]}" start -n "$nodefile" -d "$data_dir" -c "$mount_dir" "${pdsh[@]}" "${extra[@]}"
    log "BeeOND is up at $mount_dir; stop it with: $prog stop"
}

cmd_stage() {
    [[ $# -eq 1 ]] || usage
    local src="$1" dest
    dest="$(staged_path "$src")"
    # Once per job: several writers of one shard would race, and flock is not global on
    # BeeGFS unless tuneUseGlobalFileLocks is set.
    if [[ -n "${SLURM_PROCID:-}" && "${SLURM_PROCID}" != 0 ]]; then
        die "stage: run once from the batch script, not in every srun task (this is task" \
            "$SLURM_PROCID)"
    fi
    [[ -d "$mount_dir" ]] || die "stage: $mount_dir does not exist: run '$prog start' first"
    local extra=()
    read -r -a extra <<<"${SHARDIO_STAGE_ARGS:-}"
    log "staging all of $src into $dest"
    # --node 0/1: one "node" that reads everything, so every shard is copied and verified.
    # No DEST: shardio makes and checks the private directory on the mount (see above).
    SLURM_TMPDIR="$mount_dir" "${shardio[@]}" stage "$src" --node 0/1 --no-progress \
        "${extra[@]}" >&2
    [[ -f "$dest/.shardio-stage/area.json" ]] ||
        die "stage: no staging area at $dest after staging (SHARDIO_BIN=${shardio[*]} must" \
            "pass SLURM_TMPDIR on to shardio)"
    printf '%s\n' "$dest"
}

cmd_stop() {
    [[ -f "$nodefile" ]] || die "stop: no node file $nodefile (was '$prog start' run in this job?)"
    local extra=()
    read -r -a extra <<<"${BEEOND_STOP_ARGS:-}"
    log "stopping BeeOND at $mount_dir, deleting its data and logs"
    local rc=0
    "${beeond[@]}" stop -n "$nodefile" -L -d "${pdsh[@]}" "${extra[@]}" || rc=$?
    if ((rc != 0)); then
        log "beeond stop failed (exit $rc); clean up with:" \
            "${beeond[*]} stop -n $nodefile -L -d -c ${pdsh[*]}"
        exit "$rc"
    fi
    rm -f "$nodefile"
    log "BeeOND stopped"
}

[[ $# -ge 1 ]] || usage
action="$1"
shift
case "$action" in
start)
    [[ $# -eq 0 ]] || usage
    cmd_start
    ;;
stage) cmd_stage "$@" ;;
path)
    [[ $# -eq 1 ]] || usage
    staged_path "$1"
    ;;
stop)
    [[ $# -eq 0 ]] || usage
    cmd_stop
    ;;
-h | --help | help) usage ;;
*) die "unknown action '$action' (start, stage SRC, path SRC or stop)" ;;
esac
