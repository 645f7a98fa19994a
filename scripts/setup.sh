#!/usr/bin/env bash
# Installs mpitrain's Debian packages (when missing) and builds it into build/.
# Used by scripts/demo.sh and scripts/test.sh; safe to run again (does only what is missing).
#   scripts/setup.sh [--packages-only]   (--packages-only: install, do not build)
set -euo pipefail
cd "$(dirname "$0")/.."

# The package list: scripts/packages.txt (words after '#' are comments).
mapfile -t PACKAGES < <(sed 's/#.*//' scripts/packages.txt | tr -s ' \t' '\n' | grep -v '^$')
[ ${#PACKAGES[@]} -gt 0 ] || { echo "setup: no packages in scripts/packages.txt"; exit 1; }
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  # apt-get-wait: another package manager running (unattended-upgrades at boot) is waited for.
  $SUDO scripts/apt-get-wait update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO scripts/apt-get-wait install -y -qq --no-install-recommends "${missing[@]}"
fi

[ "${1:-}" = --packages-only ] && exit 0
build_start=$(date +%s)
if command -v ccache > /dev/null; then ccache -z > /dev/null 2>&1 || true; fi
. scripts/build-progress.sh
echo "setup: configuring and building build/ with ${JOBS:-2} jobs (about 10 minutes on 2 cores the first time; the whole log: build.log)"
rm -f build/compile-times.tsv
# shellcheck disable=SC2046  # "-G Ninja" is two words on purpose (or none)
cmake $(cmake_generator_args build) -S . -B build -DCMAKE_BUILD_TYPE=Release -DMPITRAIN_CCACHE=ON -DMPITRAIN_TIME_COMPILES=ON > build.log 2>&1 ||
  { grep -A12 'CMake Error' build.log || tail -n 30 build.log; echo "setup: configure failed (build.log)"; exit 1; }
build_with_progress setup build build.log || exit 1
echo "setup: built build/mpitrain in $(( $(date +%s) - build_start )) s$(command -v ccache > /dev/null && ccache --print-stats 2>/dev/null | awk -F'\t' '$1 == "direct_cache_hit" || $1 == "preprocessed_cache_hit" { h += $2 } $1 == "cache_miss" { m = $2 } END { if (h + m > 0) printf " (ccache: %d objects reused, %d compiled)", h, m }')"
scripts/compile-times.sh build 10 || true  # a report: never what fails the build
