#!/usr/bin/env bash
# CI as a machine that has never run it sees it (issue 39): removes what earlier runs left on this
# machine, then runs .ci/run on a fresh clone of this checkout's HEAD, logging everything.
#
#   scripts/ci-from-scratch.sh [--purge-packages] [LOG]    (root; LOG default /tmp/ci-from-scratch.log)
#
# Removed first: debootstrap (whose absence made the Debian 13 preparation take apt's lock beside
# leg 1), ccache's cache, /var/cache/mpitrain-test (the Debian 13 root, the swarm test's dockerd
# data-root, the device-kit rehearsal root), the tokenizer test's npm cache, and with
# --purge-packages every package scripts/setup.sh and scripts/test.sh install (and what only
# they pulled in) except what a plain Debian 12 machine has and this one needs (KEEP: compiler,
# CMake, ssh, iproute2, procps), and what the Slurm and swarm tests install when they start
# (slurm-wlm, munge, docker.io, nftables: their install path, scripts/apt-install-no-daemons, runs
# too), so apt-get installs the rest again as on a new machine. Nothing outside
# those is touched; the clone is made from this repository's committed HEAD (uncommitted changes
# are not in it: commit first).
#
# Prints the end of the log, .ci/run's exit status and the time of each part.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
purge=0
if [ "${1:-}" = --purge-packages ]; then purge=1; shift; fi
log=${1:-/tmp/ci-from-scratch.log}
[ "$(id -u)" -eq 0 ] || { echo "ci-from-scratch: needs root (it removes packages and system caches)"; exit 1; }
say() { echo "ci-from-scratch: $*"; }

# The package lists are the scripts' own, read from them (not repeated here).
packages=$(sed 's/#.*//' "$REPO/scripts/packages.txt" | tr -s ' \t\n' ' ')
test_packages=$(grep -A1 '^for p in openssh-server' "$REPO/scripts/test.sh" | sed 's/for p in//; s/; do.*//; s/\\//' | tr -s ' \n' ' ')
# What a plain Debian 12 machine has anyway, and what this one needs to stay reachable and usable.
KEEP=" build-essential cmake pkg-config openssh-server openssh-client iproute2 bc procps libssl-dev "
drop() { local p out=""; for p in "$@"; do case $KEEP in *" $p "*) ;; *) out="$out $p" ;; esac; done; echo "$out"; }
if [ $purge = 1 ]; then
  say "purging the packages of setup.sh and test.sh, the Slurm and swarm tests', and debootstrap, ccache, nodejs, npm"
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive "$REPO/scripts/apt-get-wait" purge -y -qq $(drop $packages $test_packages) \
    slurm-wlm slurmctld slurmd slurm-client munge docker.io containerd runc nftables \
    debootstrap ccache nodejs npm > /dev/null 2>&1
  DEBIAN_FRONTEND=noninteractive "$REPO/scripts/apt-get-wait" autoremove --purge -y -qq > /dev/null 2>&1
else
  say "removing debootstrap"
  DEBIAN_FRONTEND=noninteractive "$REPO/scripts/apt-get-wait" purge -y -qq debootstrap > /dev/null 2>&1
fi
command -v debootstrap > /dev/null && { say "debootstrap is still installed"; exit 1; }
say "removing ccache's cache, /var/cache/mpitrain-test and the npm cache"
rm -rf "${CCACHE_DIR:-$HOME/.cache/ccache}" "$HOME/.ccache" /var/cache/mpitrain-test \
  "${XDG_CACHE_HOME:-$HOME/.cache}/mpitrain-npm"

work=$(mktemp -d /tmp/mpitrain-ci-from-scratch.XXXXXX)
git clone -q "$REPO" "$work/mpitrain"
say "clone of $(git -C "$work/mpitrain" rev-parse --short HEAD) in $work/mpitrain; log: $log"
start=$(date +%s)
rc=0
(cd "$work/mpitrain" && CI=true bash .ci/run) > "$log" 2>&1 || rc=$?
say ".ci/run exit $rc after $(( $(date +%s) - start )) s; the log's end:"
tail -n 25 "$log"
grep -E "^CI: |setup: built|test.sh: .*took|debian13: scripts/test.sh took|tests passed|tests failed" "$log"
rm -rf "$work"
exit $rc
