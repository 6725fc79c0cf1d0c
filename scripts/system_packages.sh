#!/usr/bin/env bash
# The system packages the test suite uses, installed where missing (Debian, as root); `make
# test` and .ci/run run this first. Without root it installs nothing and says, in one line
# per group, what is missing: those tests then skip with the same reason.
#
# strace backs the syscall-count tests (opens and stats per sample); shellcheck checks the
# SLURM and BeeOND scripts; `locales` holds the en_US source that localedef (libc-bin)
# compiles (the suite runs under en_US.UTF-8, as users on a cluster do). The MooseFS test bed
# (scripts/pfs/moosefs.sh, tests/pfs): a master, chunkservers and a FUSE client on this
# machine, in a network namespace (iproute2) entered with nsenter (util-linux). The one-host
# SLURM cluster (scripts/slurm/cluster.sh, tests/slurm), and the Prometheus server that
# scrapes the exporter (tests/prometheus, promtool for the shipped alert rules).
set -euo pipefail
packages=()
need() {  # need COMMAND PACKAGE
  command -v "$1" >/dev/null 2>&1 || packages+=("$2")
}
need strace strace
need shellcheck shellcheck
[ -e /usr/share/i18n/locales/en_US ] || packages+=(locales)
need mfsmaster moosefs-master
need mfschunkserver moosefs-chunkserver
need mfsmount moosefs-client
need mfscli moosefs-cli
need fusermount3 fuse3
need ip iproute2
need nsenter util-linux
need slurmctld slurm-wlm
need munged munge
need prometheus prometheus
if [ ${#packages[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system_packages.sh: not root on Debian: not installing ${packages[*]};" \
      "the tests that need them skip (as root, make test installs them)" >&2
  else
    echo "system_packages.sh: installing ${packages[*]}" >&2
    marker="${TMPDIR:-/tmp}/.shardio-apt-updated"  # one `apt-get update` a boot
    if [ ! -e "$marker" ]; then
      apt-get update -qq && touch "$marker"
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
  fi
fi
if ! locale -a 2>/dev/null | grep -qiE '^en_US\.utf-?8$'; then
  if [ -e /usr/share/i18n/locales/en_US ] && [ "$(id -u)" -eq 0 ]; then
    localedef -i en_US -f UTF-8 en_US.UTF-8
  else
    echo "system_packages.sh: no en_US.UTF-8 locale (as root: localedef -i en_US -f UTF-8 en_US.UTF-8)" >&2
  fi
fi
