#!/usr/bin/env bash
# A SLURM cluster on one machine: munged, slurmctld and slurmd, for shardio's job-script tests
# (tests/slurm) and for trying the job scripts before a real cluster.
#
#   scripts/slurm/cluster.sh up DIR [--nodes N]   # start it; prints the client's exports
#   scripts/slurm/cluster.sh status DIR           # the daemons and sinfo's view
#   scripts/slurm/cluster.sh env DIR              # the exports a client needs (SLURM_CONF)
#   scripts/slurm/cluster.sh down DIR             # stop what `up` started, remove its files
#
#   eval "$(scripts/slurm/cluster.sh env DIR)"; sbatch -N1 -n2 job.sh
#
# Everything lives under DIR: slurm.conf, a munge key of its own and munged's socket, state,
# spool, logs and pid files; /etc/slurm and the system's munge key are never read or touched.
# The daemons listen on 127.0.0.1 only, on ports found free when `up` runs, so two clusters
# (two DIRs) run side by side. With --nodes N > 1, N slurmd run on this host, one per node
# name (node1, node2, ...), each on its own port; that needs a Slurm built with
# --enable-multiple-slurmd, and `up` says so when this one is not. Needs root (the daemons
# run as root, as SlurmUser).
set -euo pipefail

usage() {
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

die() {
  echo "cluster.sh: $*" >&2
  exit 1
}

[ $# -ge 2 ] || usage
cmd=$1
dir=$2
shift 2
case "$dir" in
  /*) ;;
  *) dir="$(pwd)/$dir" ;;
esac
# slurm.conf takes a path to the end of the line and munged's socket path is short-limited.
case "$dir" in
  *[[:space:]\\#=]*) die "the cluster directory must not contain whitespace, '\\', '#' or '=': $dir" ;;
esac
[ ${#dir} -le 80 ] || die "the cluster directory's path is too long (munge socket): $dir"

marker="$dir/.shardio-slurm-cluster"
conf="$dir/etc/slurm.conf"
socket="$dir/munge-run/munge.socket"
run="$dir/run"
envfile="$dir/cluster.env"
host=$(hostname -s)

port_taken() {
  # Listening TCP sockets of this machine (any address), from /proc: no ss or netstat needed.
  local hex
  hex=$(printf '%04X' "$1")
  cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | awk -v p=":$hex" '$2 ~ p"$" && $4 == "0A" {f=1} END {exit !f}'
}

free_ports() {
  # N consecutive ports free now, in 20000-29999, from a start derived from DIR: two clusters
  # started at the same moment, before either listens, try different ranges first.
  local n=$1 tag start p i ok tries
  tag=$(printf %s "$dir" | sha256sum | cut -c1-4)
  start=$((20000 + (16#$tag % 500) * 20))
  for tries in $(seq 0 499); do
    p=$((20000 + (start - 20000 + tries * 20) % 10000))
    ok=1
    for i in $(seq 0 $((n - 1))); do
      if port_taken $((p + i)); then
        ok=0
        break
      fi
    done
    if [ "$ok" = 1 ]; then
      echo "$p"
      return 0
    fi
  done
  die "no $n free consecutive TCP ports in 20000-29999"
}

node_names() {
  local n=$1 i
  if [ "$n" = 1 ]; then
    echo "$host"
  else
    for i in $(seq 1 "$n"); do echo "node$i"; done
  fi
}

write_configs() {
  local n=$1 base=$2 cpus node i=0 nodelist
  cpus=$(nproc)
  mkdir -p "$dir/etc" "$dir/munge" "$dir/munge-run" "$dir/state" "$dir/log" "$run"
  # The key is private to root; the socket's directory must be searchable by every user
  # who runs a client (munged refuses one that others can write).
  chmod 0700 "$dir/munge"
  chmod 0755 "$dir/munge-run"
  for node in $(node_names "$n"); do mkdir -p "$dir/spool/$node"; done
  # An empty plugin stack: the system's /etc/slurm/plugstack.conf is not this cluster's.
  : >"$dir/etc/plugstack.conf"
  nodelist=$(node_names "$n" | paste -sd, -)
  cat >"$conf" <<EOF
# Written by scripts/slurm/cluster.sh for the cluster in $dir.
ClusterName=shardio$(printf %s "$dir" | sha256sum | cut -c1-6)
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$base
SlurmdPort=$((base + 1))
SrunPortRange=$((base + 10))-$((base + 19))
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
AuthType=auth/munge
AuthInfo=socket=$socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$run/slurmctld.pid
SlurmdPidFile=$run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
PlugStackConfig=$dir/etc/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
MessageTimeout=10
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
EOF
  node_names "$n" | while read -r node; do
    i=$((i + 1))
    if [ "$n" = 1 ]; then
      echo "NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN" >>"$conf"
    else
      echo "NodeName=$node NodeHostname=$host NodeAddr=127.0.0.1 Port=$((base + i)) CPUs=$cpus State=UNKNOWN" >>"$conf"
    fi
  done
  echo "PartitionName=debug Nodes=$nodelist Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$conf"
}

start_munged() {
  mungekey --create --keyfile="$dir/munge/munge.key" --bits=1024 >/dev/null 2>&1 ||
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=128 count=1 status=none
  chmod 0400 "$dir/munge/munge.key"
  munged --socket="$socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$run/munged.pid" --log-file="$dir/log/munged.log" \
    --seed-file="$dir/munge/munged.seed" --force >>"$dir/log/munged.out" 2>&1 ||
    die "munged did not start: $(last_error munged.log munged.out)"
}

last_error() {
  # The last error line of these logs (a failed `up` removes them): what the message shows.
  local f line="" found
  for f in "$@"; do
    found=$(grep -ihE 'error|fatal' "$dir/log/$f" 2>/dev/null | tail -n 1 || true)
    [ -n "$found" ] && line=$found
  done
  echo "${line:-no error logged}"
}

client_env() {
  echo "export SLURM_CONF=$conf"
}

sinfo_states() {
  # "node state" lines, one per node, or nothing while slurmctld does not answer.
  SLURM_CONF="$conf" timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null || true
}

wait_idle() {
  local n=$1 i idle
  for i in $(seq 1 150); do
    idle=$(sinfo_states | awk '$2 == "idle"' | wc -l)
    [ "$idle" -ge "$n" ] && return 0
    sleep 0.2
  done
  die "after 30 s only $idle of $n node(s) are idle (sinfo: $(sinfo_states | paste -sd' ' -)):" \
    "$(last_error slurmctld.log "slurmd-$(node_names "$n" | head -n 1).log")"
}

up() {
  local n=1
  while [ $# -gt 0 ]; do
    case "$1" in
      --nodes) [ $# -ge 2 ] || die "--nodes needs a number"; n=$2; shift 2 ;;
      *) die "unknown option for up: $1" ;;
    esac
  done
  case "$n" in '' | *[!0-9]*) die "--nodes takes a whole number, not '$n'" ;; esac
  # Its length first: test(1) refuses a number past 2^63, and an `if` swallows that error.
  if [ "${#n}" -gt 2 ] || [ "$((10#$n))" -lt 1 ] || [ "$((10#$n))" -gt 8 ]; then
    die "--nodes takes 1 to 8, not '$n'"
  fi
  n=$((10#$n))
  [ "$(id -u)" = 0 ] || die "needs root (the daemons run as SlurmUser root)"
  local tool
  for tool in munged mungekey slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null 2>&1 || die "no $tool: install the Debian packages slurm-wlm and munge"
  done
  [ -e "$marker" ] && die "$dir already holds a cluster: run 'down' first"
  if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ]; then
    die "$dir is not empty: give a new or empty directory"
  fi
  local base
  base=$(free_ports 20) || exit 1
  mkdir -p "$dir"
  echo "$n" >"$marker"
  trap undo_up EXIT
  write_configs "$n" "$base"
  start_munged
  SLURM_CONF="$conf" slurmctld -i -f "$conf" >>"$dir/log/slurmctld.out" 2>&1 ||
    die "slurmctld did not start: $(last_error slurmctld.log slurmctld.out)"
  local node
  for node in $(node_names "$n"); do
    SLURM_CONF="$conf" slurmd -N "$node" -f "$conf" >>"$dir/log/slurmd.out" 2>&1 ||
      die "slurmd for node $node did not start: $(last_error "slurmd-$node.log" slurmd.out)"
  done
  wait_idle "$n"
  client_env | tee "$envfile"
  trap - EXIT
}

# shellcheck disable=SC2317,SC2329  # called by the EXIT trap of a failed `up`
undo_up() {
  # A failed `up` stops what it started and removes what it wrote: nothing half-started.
  down >/dev/null 2>&1 || true
}

pid_alive() {
  # The pid in file $1, when that process is alive and runs the program $2.
  local pid
  [ -f "$1" ] || return 1
  pid=$(cat "$1")
  case "$pid" in '' | *[!0-9]*) return 1 ;; esac
  [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$2" ] && echo "$pid"
}

status() {
  [ -e "$marker" ] || die "$dir holds no cluster"
  local f name pid
  for f in "$run"/*.pid; do
    [ -e "$f" ] || continue
    name=$(basename "$f" .pid)
    if pid=$(pid_alive "$f" "${name%%-*}"); then
      echo "$name running (pid $pid)"
    else
      echo "$name not running"
    fi
  done
  sinfo_states
}

stepds() {
  # The slurmstepd processes of this cluster's jobs: slurmd starts them in DIR/log.
  local d pid
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    [ "$(cat "$d/comm" 2>/dev/null)" = slurmstepd ] || continue
    case "$(readlink "$d/cwd" 2>/dev/null)" in "$dir"/*) echo "$pid" ;; esac
  done
}

cancel_jobs() {
  # Jobs still running end first, so slurmd and their slurmstepd clean up after them.
  local jobs i
  pid_alive "$run/slurmctld.pid" slurmctld >/dev/null || return 0 # no jobs without it
  jobs=$(SLURM_CONF="$conf" timeout 10 squeue -h -o %A 2>/dev/null || true)
  [ -n "$jobs" ] || return 0
  # shellcheck disable=SC2086  # one job id a word
  SLURM_CONF="$conf" timeout 10 scancel $jobs 2>/dev/null || true
  for i in $(seq 1 100); do
    [ -z "$(stepds)" ] && return 0
    sleep 0.1
  done
}

down() {
  [ -e "$marker" ] || die "$dir holds no cluster (nothing of ours to stop)"
  local f name pid pids=() i
  cancel_jobs
  # Clients first (slurmd, then slurmctld), munged last: each of them still authenticates.
  for f in "$run"/slurmd-*.pid "$run/slurmctld.pid" "$run/munged.pid"; do
    [ -e "$f" ] || continue
    name=$(basename "$f" .pid)
    if pid=$(pid_alive "$f" "${name%%-*}"); then
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  for pid in "${pids[@]}"; do
    for i in $(seq 1 50); do
      [ -d "/proc/$pid" ] || break
      sleep 0.1
    done
    if [ -d "/proc/$pid" ]; then kill -KILL "$pid" 2>/dev/null || true; fi
  done
  # A step that outlived its cancel (it ignored SIGTERM): its slurmstepd, then nothing else.
  for pid in $(stepds); do kill -KILL "$pid" 2>/dev/null || true; done
  # Only what `up` created: the cluster directory itself was empty or new.
  rm -rf "${dir:?}/etc" "$dir/munge" "$dir/munge-run" "$dir/state" "$dir/spool" "$dir/log" "$run" "$envfile"
  rm -f "$marker" "$dir/.shardio-cluster-owner" # the owner record tests/slurmbed.py writes
  rmdir "$dir" 2>/dev/null || true
}

case "$cmd" in
  up) up "$@" ;;
  down) [ $# -eq 0 ] || usage; down ;;
  status) [ $# -eq 0 ] || usage; status ;;
  env) [ $# -eq 0 ] || usage; [ -e "$marker" ] || die "$dir holds no cluster"; client_env ;;
  *) usage ;;
esac
