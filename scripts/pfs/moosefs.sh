#!/usr/bin/env bash
# A MooseFS test bed on one machine: a master (metadata server), N chunkservers (data servers)
# and a FUSE client mount, for shardio's parallel-filesystem tests and benchmarks.
#
#   scripts/pfs/moosefs.sh up DIR [--chunkservers N] [--ioretries N] [--goal N] [--cpus LIST]
#   scripts/pfs/moosefs.sh status DIR           # also each daemon's CPUs, from /proc
#   scripts/pfs/moosefs.sh stop-cs DIR I      # stop chunkserver I (1-based): a dead data server
#   scripts/pfs/moosefs.sh start-cs DIR I
#   scripts/pfs/moosefs.sh stop-master DIR | start-master DIR
#   scripts/pfs/moosefs.sh exec DIR CMD...    # run an mfs* admin tool inside the bed's namespace
#   scripts/pfs/moosefs.sh down DIR           # stop everything, leave nothing behind
#   Chunkserver I carries the label of its letter (1: A, 2: B, ...) for storage classes.
#   --cpus LIST (taskset syntax of online CPUs: 1, 0-1, 0,2): the master, every chunkserver
#   and the FUSE client run on those CPUs only (a bad LIST: one line, exit 2, nothing started).
#
# The servers run in a private network namespace with a 10.x address on its loopback
# (chunkservers refuse a 127.x master); the client is mounted with nsenter into that network
# namespace only, so the mount stays visible in this mount namespace. Nothing listens outside
# the namespace. DIR holds the configuration, data, logs and the mount point DIR/mnt; `up`
# prints `MFS_MOUNT=...`, `MFS_NETNS=...` and `MFS_ADDR=...` lines and writes them to DIR/bed.env.
# Needs root (network namespaces, FUSE); installs the Debian packages where missing.
#
# Pinning (--cpus) is CPU affinity, not a cgroup: each daemon is started under `taskset -c
# LIST`, so the affinity holds from its first instruction and every process it forks and every
# thread it starts later inherits it (re-pinning running processes would miss threads started
# afterwards). start-cs and start-master pin again to the LIST kept in DIR/bed.env (MFS_CPUS;
# empty: unpinned). Affinity bounds where the bed runs, not who else runs there: a benchmark
# pins its readers to the other CPUs (benchmarks/bench_pfs.py --bed-cpus/--reader-cpus).
set -euo pipefail

usage() {
  sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

die() {
  echo "moosefs.sh: $*" >&2
  exit 1
}

online_cpus() {
  # The online CPUs, one a line, from the kernel's list (e.g. 0-3,6).
  local item lo hi items
  IFS=, read -ra items </sys/devices/system/cpu/online
  for item in "${items[@]}"; do
    lo=${item%-*} hi=${item#*-}
    seq "$lo" "$hi"
  done
}

check_cpus() {
  # A taskset CPU list of online CPUs only (N, N-M with N <= M, joined by commas), or exit 2
  # with one line: a CPU that is not there would make taskset fail half-way through `up`.
  local list=$1 item lo hi c online items
  online=$(online_cpus | tr '\n' ' ')
  bad_cpus() {
    echo "moosefs.sh: --cpus takes a list of online CPUs such as 1 or 0-1 (online here:" \
      "$(tr -d '\n' </sys/devices/system/cpu/online)), not '$list': $1" >&2
    exit 2
  }
  [ -n "$list" ] || bad_cpus "empty"
  [ "${#list}" -le 200 ] || bad_cpus "too long"
  case "$list" in *[!0-9,-]* | ,* | *, | *,,*) bad_cpus "malformed" ;; esac
  IFS=, read -ra items <<<"$list"
  for item in "${items[@]}"; do
    case "$item" in
      [0-9] | [0-9][0-9] | [0-9][0-9][0-9] | [0-9][0-9][0-9][0-9]) lo=$item hi=$item ;;
      *-*-*) bad_cpus "malformed range '$item'" ;;
      [0-9]*-[0-9]*) lo=${item%-*} hi=${item#*-} ;;
      *) bad_cpus "malformed item '$item'" ;;
    esac
    if [ "${#lo}" -gt 4 ] || [ "${#hi}" -gt 4 ]; then bad_cpus "no such CPU in '$item'"; fi
    lo=$((10#$lo)) hi=$((10#$hi))
    [ "$lo" -le "$hi" ] || bad_cpus "range '$item' runs backwards"
    for c in $(seq "$lo" "$hi"); do
      case " $online " in *" $c "*) ;; *) bad_cpus "CPU $c is not online" ;; esac
    done
  done
}

bed_cpus() {
  # The CPU list the bed was started with (DIR/bed.env), empty if unpinned.
  # (No bed.env, no bed: under pipefail a failed sed would end the script silently.)
  [ -r "$dir/bed.env" ] || return 0
  sed -n 's/^MFS_CPUS=//p' "$dir/bed.env" | head -n 1
}

pinned() {
  # Run "$@" under the bed's CPU affinity (taskset: inherited by its forks and threads).
  if [ -n "$cpus" ]; then
    taskset -c "$cpus" "$@"
  else
    "$@"
  fi
}

[ $# -ge 2 ] || usage
cmd=$1
dir=$2
shift 2
case "$dir" in
  /*) ;;
  *) dir="$(pwd)/$dir" ;;
esac
# The mount table escapes whitespace (\040), and the MooseFS configuration files take a path
# to the end of the line: refuse such a directory rather than start a bed we cannot find.
case "$dir" in
  *[[:space:]\\]*) die "the bed directory must not contain whitespace or a backslash: $dir" ;;
esac

# One namespace and address per bed directory, so two beds (two CI runs) never share one.
tag=$(printf %s "$dir" | sha256sum | cut -c1-8)
ns="shardio-mfs-$tag"
octet2=$((16#${tag:0:2}))
octet3=$((16#${tag:2:2}))
addr="10.$octet2.$octet3.1"
marker="$dir/.shardio-moosefs-bed"
mnt="$dir/mnt"

in_ns() {
  ip netns exec "$ns" "$@"
}

install_packages() {
  local missing=()
  command -v mfsmaster >/dev/null 2>&1 || missing+=(moosefs-master)
  command -v mfschunkserver >/dev/null 2>&1 || missing+=(moosefs-chunkserver)
  command -v mfsmount >/dev/null 2>&1 || missing+=(moosefs-client)
  command -v mfscli >/dev/null 2>&1 || missing+=(moosefs-cli)
  command -v fusermount3 >/dev/null 2>&1 || missing+=(fuse3)
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "moosefs.sh: installing ${missing[*]}" >&2
    if [ ! -e /tmp/.shardio-apt-updated ]; then
      apt-get update -qq && touch /tmp/.shardio-apt-updated
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

empty_metadata() {
  local f
  for f in /var/lib/mfs/metadata.mfs.empty /usr/share/doc/moosefs-master/metadata.mfs.empty; do
    if [ -f "$f" ]; then
      echo "$f"
      return 0
    fi
  done
  die "no metadata.mfs.empty from moosefs-master"
}

write_configs() {
  local n=$1 letters=ABCDEFGH
  mkdir -p "$dir/etc" "$dir/master" "$dir/log"
  cat >"$dir/etc/mfsexports.cfg" <<EOF
* / rw,alldirs,admin,maproot=0
* . rw
EOF
  cat >"$dir/etc/mfsmaster.cfg" <<EOF
WORKING_USER = root
WORKING_GROUP = root
SYSLOG_IDENT = shardio-mfsmaster-$tag
DATA_PATH = $dir/master
EXPORTS_FILENAME = $dir/etc/mfsexports.cfg
MATOML_LISTEN_HOST = $addr
MATOCS_LISTEN_HOST = $addr
MATOCL_LISTEN_HOST = $addr
REPLICATIONS_DELAY_INIT = 0
# A test bed heals at once: the master's loop over the chunks (where it finds a chunk with
# fewer copies than its goal, or more) runs every second, not every 300 s.
CHUNKS_LOOP_MIN_TIME = 1
NICE_LEVEL = 0
LOCK_MEMORY = 0
EOF
  local i
  for i in $(seq 1 "$n"); do
    mkdir -p "$dir/cs$i/data" "$dir/cs$i/hdd"
    echo "$dir/cs$i/hdd" >"$dir/etc/mfshdd$i.cfg"
    cat >"$dir/etc/mfschunkserver$i.cfg" <<EOF
WORKING_USER = root
WORKING_GROUP = root
SYSLOG_IDENT = shardio-mfscs$i-$tag
DATA_PATH = $dir/cs$i/data
HDD_CONF_FILENAME = $dir/etc/mfshdd$i.cfg
HDD_LEAVE_SPACE_DEFAULT = 64MiB
MASTER_HOST = $addr
BIND_HOST = $addr
CSSERV_LISTEN_HOST = $addr
CSSERV_LISTEN_PORT = $((9421 + i))
# Chunkserver i carries label A, B, C, ... (its letter): storage classes (mfsscadmin) can
# place a file on one of them; the default classes (goals) ignore labels.
LABELS = ${letters:i-1:1}
NICE_LEVEL = 0
LOCK_MEMORY = 0
EOF
  done
}

chunkservers() {
  local n=0
  while [ -e "$dir/etc/mfschunkserver$((n + 1)).cfg" ]; do n=$((n + 1)); done
  echo "$n"
}

mounted() {
  grep -qsF " $mnt fuse" /proc/self/mounts
}

start_master() {
  pinned ip netns exec "$ns" mfsmaster -c "$dir/etc/mfsmaster.cfg" start >>"$dir/log/master.log" 2>&1 ||
    die "mfsmaster did not start (see $dir/log/master.log)"
}

stop_master() {
  in_ns mfsmaster -c "$dir/etc/mfsmaster.cfg" stop >>"$dir/log/master.log" 2>&1 || true
}

start_cs() {
  pinned ip netns exec "$ns" mfschunkserver -c "$dir/etc/mfschunkserver$1.cfg" start >>"$dir/log/cs$1.log" 2>&1 ||
    die "chunkserver $1 did not start (see $dir/log/cs$1.log)"
}

stop_cs() {
  in_ns mfschunkserver -c "$dir/etc/mfschunkserver$1.cfg" stop >>"$dir/log/cs$1.log" 2>&1 || true
}

connected_chunkservers() {
  # mfscli -SCS lists one line per connected chunkserver ("chunk servers:|ADDR|PORT|...");
  # a stopped one stays listed under "Disconnected chunk servers:" for a while.
  in_ns mfscli -H "$addr" -SCS -s '|' 2>/dev/null | grep -c "^chunk servers:|$addr|" || true
}

cs_connected() {
  # 1 once the master lists chunkserver $1 (its port) as connected, else 0.
  in_ns mfscli -H "$addr" -SCS -s '|' 2>/dev/null | grep -c "^chunk servers:|$addr|$((9421 + $1))|" || true
}

wait_for() {
  local what=$1 want=$2 i
  shift 2
  for i in $(seq 1 150); do
    if [ "$("$what" "$@")" -ge "$want" ]; then return 0; fi
    sleep 0.2
  done
  return 1
}

up() {
  local n=2 retries=30 goal=1 pin=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --chunkservers) n=${2:?}; shift 2 ;;
      --ioretries) retries=${2:?}; shift 2 ;;
      --goal) goal=${2:?}; shift 2 ;;
      --cpus)
        [ $# -ge 2 ] || { cpus=""; check_cpus ""; }
        cpus=$2 pin=1
        shift 2
        ;;
      *) usage ;;
    esac
  done
  [ "$pin" = 0 ] || check_cpus "$cpus" # before anything is started or written
  case "$n$retries$goal" in *[!0-9]*) die "counts must be whole numbers" ;; esac
  small_in "$n" 1 8 || die "--chunkservers takes 1 to 8, not '$n'"
  small_in "$retries" 1 1000 || die "--ioretries takes 1 to 1000, not '$retries'"
  small_in "$goal" 1 9 || die "--goal takes 1 to 9, not '$goal'"
  n=$((10#$n)) retries=$((10#$retries)) goal=$((10#$goal))
  [ "$(id -u)" = 0 ] || die "needs root (network namespace, FUSE mount)"
  if [ -e "$marker" ]; then
    die "$dir already holds a bed: run 'down' first"
  fi
  if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ]; then
    die "$dir is not empty: give a new or empty directory"
  fi
  install_packages
  mkdir -p "$dir" "$mnt"
  echo "$ns" >"$marker"
  ip netns add "$ns"
  in_ns ip link set lo up
  in_ns ip addr add "$addr/32" dev lo
  write_configs "$n"
  cp "$(empty_metadata)" "$dir/master/metadata.mfs"
  start_master
  local i
  for i in $(seq 1 "$n"); do start_cs "$i"; done
  wait_for connected_chunkservers "$n" || die "only $(connected_chunkservers) of $n chunkservers registered"
  [ -e /dev/fuse ] || mknod -m 666 /dev/fuse c 10 229
  pinned nsenter --net="/var/run/netns/$ns" mfsmount "$mnt" -H "$addr" -P 9421 \
    -o "mfsioretries=$retries" -o mfsmkdircopysgid=0 >>"$dir/log/mount.log" 2>&1 ||
    die "mfsmount failed (see $dir/log/mount.log)"
  mounted || die "the client mount did not appear at $mnt"
  in_ns mfssetgoal -r "$goal" "$mnt" >/dev/null
  # Chunkservers report their space a moment after registering: wait until a write succeeds.
  for i in $(seq 1 100); do
    if (head -c 65536 /dev/zero >"$mnt/.probe") 2>/dev/null; then
      rm -f "$mnt/.probe"
      break
    fi
    sleep 0.2
  done
  {
    echo "MFS_MOUNT=$mnt"
    echo "MFS_NETNS=$ns"
    echo "MFS_ADDR=$addr"
    echo "MFS_CHUNKSERVERS=$n"
    echo "MFS_CPUS=$cpus"
  } | tee "$dir/bed.env"
}

status() {
  [ -e "$marker" ] || die "$dir holds no bed"
  echo "netns $ns, master $addr"
  if mounted; then echo "mounted at $mnt"; else echo "not mounted"; fi
  echo "chunkservers connected: $(connected_chunkservers) of $(chunkservers)"
  echo "pinned to CPUs: ${cpus:-no (any CPU)}"
  local pid comm tids allowed
  for pid in $(bed_pids); do
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || continue
    # Every thread's own list: one thread started elsewhere would show here.
    allowed=$(cat /proc/"$pid"/task/*/status 2>/dev/null | sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' | sort -u | paste -sd' ')
    tids=$(find "/proc/$pid/task" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)
    echo "  $comm pid $pid: $tids threads, Cpus_allowed_list $allowed"
  done
}

bed_pids() {
  # The bed's daemons: everything in its network namespace (master, chunkservers, and the
  # client, which nsenter started there) that is an mfs* program.
  local pid
  for pid in $(ip netns pids "$ns" 2>/dev/null | sort -n); do
    case "$(cat "/proc/$pid/comm" 2>/dev/null)" in mfs*) echo "$pid" ;; esac
  done
}

abort_client() {
  # A client whose requests wait on a stopped chunkserver answers nothing else (with its
  # default retries, for about 2 minutes each): abort the bed's FUSE connection, so that
  # every pending request fails at once and neither the unmount nor the processes that hold
  # its files wait for it. The connection is named by the mount's device number (fusectl).
  local devno minor conns=/sys/fs/fuse/connections
  devno=$(awk -v m="$mnt" '$5 == m { for (i = 7; i < NF; i++) if ($i == "-") break;
    if ($(i + 1) ~ /^fuse/) { print $3; exit } }' /proc/self/mountinfo)
  [ -n "$devno" ] && [ "${devno%%:*}" = 0 ] || return 0
  minor=${devno#*:}
  if [ -d "$conns" ] && [ ! -e "$conns/$minor" ] && ! grep -qs " $conns fusectl" /proc/self/mounts; then
    mount -t fusectl fusectl "$conns" 2>/dev/null || true
  fi
  if [ -w "$conns/$minor/abort" ]; then
    echo 1 >"$conns/$minor/abort" 2>/dev/null || true
  fi
}

down() {
  [ -e "$marker" ] || die "$dir holds no bed (nothing of ours to remove)"
  if mounted; then
    abort_client
    fusermount3 -u "$mnt" 2>/dev/null || umount "$mnt" 2>/dev/null || umount -l "$mnt" || true
  fi
  local i
  if ip netns list | grep -qw "$ns"; then
    # The bed's data is removed below, so its daemons are killed rather than stopped (a
    # graceful stop saves the master's metadata and takes about 8 s). Only processes in the
    # bed's own namespace are touched.
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    for i in $(seq 1 50); do
      [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && break
      sleep 0.1
    done
    ip netns delete "$ns"
  fi
  mounted && die "$mnt is still mounted; not removing $dir"
  # Only what `up` created: the bed directory itself was empty or new.
  rm -rf "${dir:?}/etc" "$dir/master" "$dir/log" "$dir"/cs[0-9]* "$dir/bed.env"
  rmdir "$mnt" 2>/dev/null || true
  rm -f "$marker" "$dir/.shardio-bed-owner" # the owner record tests/mfsbed.py writes
  rmdir "$dir" 2>/dev/null || true
}

small_in() {
  # Whether the digits $1 are a number from $2 to $3 (at most 4 digits: test(1) errors past
  # 2^63, and an `if` swallows the error).
  [ -n "$1" ] && [ "${#1}" -le 4 ] && [ "$((10#$1))" -ge "$2" ] && [ "$((10#$1))" -le "$3" ]
}

cs_number() {
  # A chunkserver of this bed, 1 to N.
  local i=${1:-}
  case "$i" in '' | *[!0-9]*) die "give a chunkserver number, 1 to $(chunkservers)" ;; esac
  if ! small_in "$i" 1 "$(chunkservers)"; then
    die "no chunkserver $i: the bed has $(chunkservers)"
  fi
  echo "$((10#$i))"
}

cpus=""
[ "$cmd" = up ] || cpus=$(bed_cpus)
# A LIST read back from bed.env is checked again: a CPU may have gone offline since `up`.
[ -z "$cpus" ] || case "$cmd" in start-cs | start-master) check_cpus "$cpus" ;; esac

case "$cmd" in
  up) up "$@" ;;
  down) down ;;
  status) status ;;
  stop-cs) [ -e "$marker" ] || die "$dir holds no bed"; i=$(cs_number "${1:-}"); stop_cs "$i" ;;
  start-cs)
    [ -e "$marker" ] || die "$dir holds no bed"
    i=$(cs_number "${1:-}")
    start_cs "$i"
    # Back only once the master has it: a test that counts daemons or reads a chunk at once
    # must not race the new daemon's registration.
    wait_for cs_connected 1 "$i" || die "chunkserver $i started but did not register with the master"
    ;;
  stop-master) [ -e "$marker" ] || die "$dir holds no bed"; stop_master ;;
  start-master) [ -e "$marker" ] || die "$dir holds no bed"; start_master ;;
  exec) [ -e "$marker" ] || die "$dir holds no bed"; in_ns "$@" ;;
  *) usage ;;
esac
