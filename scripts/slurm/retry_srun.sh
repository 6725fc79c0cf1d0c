#!/usr/bin/env bash
# Run a job step; when it fails, check the dataset, then try again (up to N tries in all).
#
#   retry_srun.sh [-n MAX_TRIES] [-d DATASET]... [-q] [-b BACKOFF_S] [-r HOOK] -- srun ARGS...
#
#   -n MAX_TRIES  tries in all, the first included (default 3, or $RETRY_SRUN_MAX_TRIES)
#   -d DATASET    a shardio dataset to check with `shardio verify` after each failure;
#                 repeat for several (e.g. the Lustre copy and a BeeOND copy)
#   -q            `shardio verify --quick`: index and shard sizes only, no data read (a full
#                 check reads the whole dataset, which takes a while at many TB)
#   -b BACKOFF_S  wait before the 2nd try; doubled before each later one (default 10, or
#                 $RETRY_SRUN_BACKOFF_S); gives a flapping node or link time to settle
#   -r HOOK       a shell command run before each retry, e.g. re-staging node-local copies
#                 (`shardio stage` replaces what is missing or damaged and keeps the rest)
#
# The article's third level of fault tolerance: a job wrapper that retries srun with a
# storage check in between (checkpoints and ResilientDataset are the first two). Each try
# starts the program afresh: it should resume from its last checkpoint by itself.
#
# Storage repair: `shardio verify` exits 0 (intact), 3 (damaged) or another code (could not
# check). `shardio verify --repair` does not exist yet; when `shardio verify --help` starts
# listing --repair, this script uses it on a damaged dataset without any change here. Until
# then it prints what to do and retries anyway (ResilientDataset may still get through).
#
# Exits with the status of the last try. Each try is logged, with a timestamp, on stderr.
# SIGTERM/SIGINT (scancel, the time limit) stop the current try and end the retries.
# SHARDIO_BIN names the shardio command (default: shardio on PATH).
set -euo pipefail

prog="retry_srun.sh"
log() { printf '[%s %s] %s\n' "$prog" "$(date '+%Y-%m-%dT%H:%M:%S%z')" "$*" >&2; }
usage() {
    echo "usage: $prog [-n MAX_TRIES] [-d DATASET]... [-q] [-b BACKOFF_S] [-r HOOK]" \
        "-- srun ARGS..." >&2
    exit 2
}
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

max_tries="${RETRY_SRUN_MAX_TRIES:-3}"
backoff_s="${RETRY_SRUN_BACKOFF_S:-10}"
hook=""
datasets=()
verify_opts=(--no-progress)
while getopts ":n:d:qb:r:h" opt; do
    case "$opt" in
    n) max_tries="$OPTARG" ;;
    d) datasets+=("$OPTARG") ;;
    q) verify_opts+=(--quick) ;;
    b) backoff_s="$OPTARG" ;;
    r) hook="$OPTARG" ;;
    h) usage ;;
    :) log "error: -$OPTARG needs a value" && usage ;;
    *) log "error: unknown option -$OPTARG" && usage ;;
    esac
done
shift $((OPTIND - 1))
[[ $# -gt 0 ]] || { log "error: no command to run after --" && usage; }
if ! is_uint "$max_tries" || ((max_tries < 1)); then
    log "error: -n must be a whole number >= 1"
    usage
fi
is_uint "$backoff_s" || { log "error: -b must be whole seconds" && usage; }

read -r -a shardio <<<"${SHARDIO_BIN:-shardio}"

# Relay scancel/time-limit signals to the step and stop retrying: the job is ending.
child=""
stopping=""
# shellcheck disable=SC2317  # called by the traps below
on_signal() {
    stopping="$1"
    log "got SIG$1: stopping the current try, no more retries"
    if [[ -n "$child" ]]; then
        kill -s "$1" "$child" 2>/dev/null || true
    fi
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT

repair_supported() {
    "${shardio[@]}" verify --help 2>/dev/null | grep -q -- '--repair'
}

check_datasets() {
    local ds rc
    for ds in "${datasets[@]}"; do
        log "checking $ds: ${shardio[*]} verify ${verify_opts[*]} $ds"
        rc=0
        "${shardio[@]}" verify "${verify_opts[@]}" "$ds" >&2 || rc=$?
        case "$rc" in
        0) log "dataset $ds is intact" ;;
        3)
            if repair_supported; then
                log "dataset $ds is damaged: repairing with ${shardio[*]} verify --repair"
                rc=0
                "${shardio[@]}" verify --repair --no-progress "$ds" >&2 || rc=$?
                if ((rc == 0)); then
                    log "dataset $ds repaired"
                else
                    log "repair of $ds failed (exit $rc): restore the shards listed above"
                fi
            else
                log "dataset $ds is DAMAGED (shards listed above) and this shardio has no" \
                    "'verify --repair' yet: re-pack it from the source tree (shardio pack" \
                    "SRC $ds --force) or copy the listed shards back from a good copy, then" \
                    "check again with 'shardio verify $ds'. Retrying anyway."
            fi
            ;;
        *) log "could not check $ds (shardio verify exit $rc); retrying anyway" ;;
        esac
    done
}

rc=0
delay="$backoff_s"
for ((try = 1; try <= max_tries; try++)); do
    if ((try > 1)); then
        if [[ -n "$hook" ]]; then
            log "before try $try: $hook"
            hook_rc=0
            bash -c "$hook" >&2 || hook_rc=$?
            ((hook_rc == 0)) || log "hook exited $hook_rc; retrying anyway"
        fi
        if ((delay > 0)); then
            log "waiting ${delay}s before try $try"
            sleep "$delay" &
            child=$!
            wait "$child" || true
            child=""
            delay=$((delay * 2))
        fi
        [[ -z "$stopping" ]] || break
    fi
    log "try $try/$max_tries: $*"
    # In the background, so a signal reaches on_signal now, not when the step ends.
    "$@" &
    child=$!
    # wait returns early (>128) when a trapped signal arrives: wait again for the step's
    # own status while it is still there.
    while :; do
        rc=0
        wait "$child" || rc=$?
        if ((rc <= 128)) || ! kill -0 "$child" 2>/dev/null; then
            break
        fi
    done
    child=""
    if ((rc == 0)); then
        log "try $try/$max_tries succeeded"
        exit 0
    fi
    log "try $try/$max_tries failed with exit $rc"
    [[ -z "$stopping" ]] || break
    ((try < max_tries)) || break
    ((${#datasets[@]} == 0)) || check_datasets
done
if [[ -n "$stopping" ]]; then
    log "stopped by SIG$stopping after try $try; exit $rc"
else
    log "giving up after $max_tries tries; exit $rc"
fi
exit "$rc"
