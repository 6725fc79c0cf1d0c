#!/usr/bin/env bash
# Run a job step; when it fails, check and repair the data, then try again (up to N tries).
#
#   retry_srun.sh [-n MAX_TRIES] [-d DATASET]... [-s SOURCE] [-q] [-b BACKOFF_S] [-r HOOK]
#                 [-c CKPT_DIR] -- srun ARGS...
#
#   -n MAX_TRIES  tries in all, the first included, 1 to 1000 (default 3, or
#                 $RETRY_SRUN_MAX_TRIES)
#   -d DATASET    a shardio dataset, or a staging area (`shardio stage`), to check with
#                 `shardio verify` after each failure and repair with `shardio verify
#                 --repair`; repeat for several (e.g. the Lustre copy and a BeeOND copy)
#   -s SOURCE     another copy of the packed datasets given with -d, to repair them from
#                 (`shardio verify --repair --source SOURCE`); a staging area needs none: it
#                 is repaired from the source it was staged from
#   -q            `shardio verify --quick`: index and shard sizes only, no data read (a full
#                 check reads the whole dataset, which takes a while at many TB); a repair,
#                 when one is needed, still reads what it repairs
#   -b BACKOFF_S  wait before the 2nd try; doubled before each later one, up to a day
#                 (default 10, or $RETRY_SRUN_BACKOFF_S); gives a flapping node or link
#                 time to settle
#   -r HOOK       a shell command run before each retry, e.g. re-staging node-local copies
#                 (`shardio stage` replaces what is missing or damaged and keeps the rest)
#   -c CKPT_DIR   the job's checkpoint directory (shardio.checkpoint): before each try, say
#                 which checkpoint it resumes from (`shardio checkpoint latest`, the newest
#                 whose every byte checks: what load_latest loads) and export its path to the
#                 step as SHARDIO_RESUME_FROM, which the step loads (load_latest of that
#                 one checkpoint: never another, never a fresh start when it is damaged).
#                 Empty when none was found, or none could be checked now: the step's
#                 load_latest of the directory then decides (a fresh start only when there
#                 is none; an error when all are damaged or the storage does not answer)
#
# The article's third level of fault tolerance: a job wrapper that retries srun with a
# storage repair in between (checkpoints and a dataset's recovery= policy are the first two). Each try
# starts the program afresh: it should resume from its last checkpoint by itself.
#
# Storage check and repair between tries. `shardio verify DATASET` exits 0 (intact), 3
# (damaged), 5 (a staging area degraded: copies missing, damaged or stale while the source
# they fall back to is intact) or another code (could not check). On 3 or 5 the dataset is
# repaired with `shardio verify --repair` (a staging area from its source; a packed dataset
# from -s SOURCE, without which there is nothing to repair it from and the log says what to
# do), which exits 0 (nothing left to repair), 4 (repaired), 5 (staged copies left that the
# source stands in for: training works, reading the parallel filesystem) or 3 (damage is
# left). Whatever the outcome, it is logged and the step is retried: a dataset with recovery=
# "skip" may still get through.
#
# Exits with the status of the last try. Each try is logged, with a timestamp, on stderr.
# SIGTERM/SIGINT (scancel, the time limit) stop the current try and end the retries.
# SHARDIO_BIN names the shardio command (default: shardio on PATH).
set -euo pipefail

prog="retry_srun.sh"
log() { printf '[%s %s] %s\n' "$prog" "$(date '+%Y-%m-%dT%H:%M:%S%z')" "$*" >&2; }
usage() {
    echo "usage: $prog [-n MAX_TRIES] [-d DATASET]... [-s SOURCE] [-q] [-b BACKOFF_S]" \
        "[-r HOOK] [-c CKPT_DIR] -- srun ARGS..." >&2
    exit 2
}
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

max_tries="${RETRY_SRUN_MAX_TRIES:-3}"
backoff_s="${RETRY_SRUN_BACKOFF_S:-10}"
hook=""
ckpt_dir=""
source=""
datasets=()
verify_opts=(--no-progress)
while getopts ":n:d:s:qb:r:c:h" opt; do
    case "$opt" in
    n) max_tries="$OPTARG" ;;
    d) datasets+=("$OPTARG") ;;
    s) source="$OPTARG" ;;
    q) verify_opts+=(--quick) ;;
    b) backoff_s="$OPTARG" ;;
    r) hook="$OPTARG" ;;
    c) ckpt_dir="$OPTARG" ;;
    h) usage ;;
    :) log "error: -$OPTARG needs a value" && usage ;;
    *) log "error: unknown option -$OPTARG" && usage ;;
    esac
done
shift $((OPTIND - 1))
[[ $# -gt 0 ]] || { log "error: no command to run after --" && usage; }
# Bounded before any arithmetic: bash wraps integers past 2^63 without a word.
if ! is_uint "$max_tries" || ((${#max_tries} > 4)) || ((10#$max_tries < 1 || 10#$max_tries > 1000)); then
    log "error: -n must be a whole number from 1 to 1000, got '$max_tries'"
    usage
fi
max_tries=$((10#$max_tries))
if ! is_uint "$backoff_s" || ((${#backoff_s} > 5)) || ((10#$backoff_s > 86400)); then
    log "error: -b must be whole seconds from 0 to 86400, got '$backoff_s'"
    usage
fi
backoff_s=$((10#$backoff_s))

read -r -a shardio <<<"${SHARDIO_BIN:-shardio}"

# Relay scancel/time-limit signals to the step and stop retrying: the job is ending.
child=""
stopping=""
# shellcheck disable=SC2317,SC2329  # called by the traps below
on_signal() {
    stopping="$1"
    log "got SIG$1: stopping the current try, no more retries"
    if [[ -n "$child" ]]; then
        kill -s "$1" "$child" 2>/dev/null || true
    fi
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT

is_area() { [[ -f "$1/.shardio-stage/area.json" ]]; }

# Repair one dataset that verify found damaged (3) or degraded (5), and log the outcome.
repair_dataset() {
    local ds="$1" rc
    local repair=("${shardio[@]}" verify --repair --no-progress)
    if ! is_area "$ds"; then
        if [[ -z "$source" ]]; then
            log "dataset $ds is DAMAGED (shards listed above) and there is no copy to repair" \
                "it from: give $prog -s SOURCE (another copy of it) to repair it with" \
                "'shardio verify --repair --source SOURCE $ds', or re-pack it (shardio pack" \
                "TREE $ds --force). Retrying anyway."
            return
        fi
        repair+=(--source "$source")
    fi
    log "repairing $ds: ${repair[*]} $ds"
    rc=0
    "${repair[@]}" "$ds" >&2 || rc=$?
    case "$rc" in
    0) log "dataset $ds: nothing left to repair" ;;
    4) log "dataset $ds repaired" ;;
    5)
        log "staging area $ds is still degraded (copies listed above could not be made):" \
            "training reads those shards from the source"
        ;;
    3)
        log "damage is left in $ds (listed above): restore those shards from a good copy" \
            "and check again with 'shardio verify $ds'. Retrying anyway."
        ;;
    *) log "repair of $ds failed (exit $rc); retrying anyway" ;;
    esac
}

check_datasets() {
    local ds rc
    for ds in "${datasets[@]}"; do
        log "checking $ds: ${shardio[*]} verify ${verify_opts[*]} $ds"
        rc=0
        "${shardio[@]}" verify "${verify_opts[@]}" "$ds" >&2 || rc=$?
        case "$rc" in
        0) log "dataset $ds is intact" ;;
        5)
            log "staging area $ds is degraded (its source is intact): repairing the area too"
            repair_dataset "$ds"
            ;;
        3) repair_dataset "$ds" ;;
        *) log "could not check $ds (shardio verify exit $rc); retrying anyway" ;;
        esac
    done
}

# Which checkpoint a try resumes from: the newest intact one, found by shardio the way
# load_latest finds it. Exported to the step; the damaged ones skipped are logged.
find_resume_point() {
    local try="$1" rc=0 found
    found="$("${shardio[@]}" checkpoint latest "$ckpt_dir" 2>"$resume_log")" || rc=$?
    while IFS= read -r line; do
        [[ -n "$line" ]] && log "$line"
    done <"$resume_log"
    case "$rc" in
    0) log "try $try resumes from checkpoint $found" ;;
    1) found="" && log "try $try starts from scratch: no checkpoint in $ckpt_dir yet" ;;
    3)
        found=""
        log "no checkpoint in $ckpt_dir is intact (see above): try $try's load_latest will" \
            "refuse to start from scratch"
        ;;
    75)
        found=""
        log "the checkpoints in $ckpt_dir cannot be read now (see above): try $try's" \
            "load_latest decides"
        ;;
    *) found="" && log "could not look for checkpoints in $ckpt_dir (exit $rc)" ;;
    esac
    export SHARDIO_RESUME_FROM="$found"
}
resume_log=""
if [[ -n "$ckpt_dir" ]]; then
    resume_log="$(mktemp "${TMPDIR:-/tmp}/retry_srun.XXXXXX")"
    trap 'rm -f "$resume_log"' EXIT
fi

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
            delay=$((delay * 2 > 86400 ? 86400 : delay * 2))  # doubled, at most a day
        fi
        [[ -z "$stopping" ]] || break
    fi
    [[ -z "$ckpt_dir" ]] || find_resume_point "$try"
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
