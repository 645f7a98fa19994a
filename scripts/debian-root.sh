# shellcheck shell=bash
# Sourced: make_debian_root SUITE ROOT LOG, a minimal Debian root for the scripts that build or
# test inside one (scripts/test-debian13.sh, bench/device-kit-rehearsal.sh): debootstrap
# --variant=minbase SUITE into ROOT from this machine's mirror (scripts/debian-mirror.sh), its
# sources (SUITE main and SUITE-updates), a policy-rc.d that lets no package start a daemon
# inside it, and dpkg's force-unsafe-io. Prints the debootstrap log's end and returns 1 when it
# fails (log: LOG).
make_debian_root() {
  local suite=$1 root=$2 log=$3 mirror
  mirror=$("$(dirname "${BASH_SOURCE[0]}")/debian-mirror.sh" bookworm)
  rm -rf "$root"
  mkdir -p "$(dirname "$root")" "$(dirname "$log")"
  if ! timeout 1500 debootstrap --variant=minbase --keyring=/usr/share/keyrings/debian-archive-keyring.gpg \
      "$suite" "$root" "$mirror" > "$log" 2>&1; then
    tail -20 "$log"
    echo "debootstrap of $suite from $mirror failed (log: $log)"
    return 1
  fi
  printf 'deb %s %s main\ndeb %s %s-updates main\n' "$mirror" "$suite" "$mirror" "$suite" > "$root/etc/apt/sources.list"
  printf '#!/bin/sh\nexit 101\n' > "$root/usr/sbin/policy-rc.d"  # no daemon starts inside the root
  # dpkg without an fsync per unpacked file, as Debian's official container images do: these roots
  # are the tests' caches (a machine that crashed while installing into one: remove the root, and
  # the next run makes it again).
  printf 'force-unsafe-io\n' > "$root/etc/dpkg/dpkg.cfg.d/mpitrain-unsafe-io"
  chmod +x "$root/usr/sbin/policy-rc.d"
}
