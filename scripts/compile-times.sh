#!/usr/bin/env bash
# Where a build's compile time went, from BUILD_DIR/compile-times.tsv (written by scripts/compile-timer
# when CMake's MPITRAIN_TIME_COMPILES is on, as scripts/setup.sh and scripts/build-mpich.sh build):
# the seconds per target (an object's target is its CMakeFiles/<target>.dir), the N slowest first,
# and the slowest objects. Objects ccache had cost it a fraction of a second.
#   scripts/compile-times.sh BUILD_DIR [N]
set -euo pipefail
f=$1/compile-times.tsv
n=${2:-10}
[ -s "$f" ] || { echo "compile times: no $f (built without -DMPITRAIN_TIME_COMPILES=ON, or nothing compiled)"; exit 0; }
awk -F'\t' -v n="$n" '
  { t = $2; if (match(t, /CMakeFiles\/[^\/]+\.dir\//)) t = substr(t, RSTART + 11, RLENGTH - 16); else t = "(other)"
    s[t] += $1; c[t]++; all += $1; objs++ }
  END {
    printf "compile time per target (%d objects, %.0f s of compiler time in all; the %d slowest):\n", objs, all / 1000, n
    printf "  %-28s %9s %8s %7s\n", "target", "seconds", "objects", "share"
    m = 0
    for (t in s) { k[++m] = t }
    for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (s[k[j]] > s[k[i]]) { x = k[i]; k[i] = k[j]; k[j] = x }
    for (i = 1; i <= m && i <= n; i++) printf "  %-28s %9.1f %8d %6.0f%%\n", k[i], s[k[i]] / 1000, c[k[i]], 100 * s[k[i]] / (all > 0 ? all : 1)
  }' "$f"
echo "the slowest objects:"
# (awk takes the first 5 and reads on: a `head` would end the pipe early, and sort's SIGPIPE fail
# this script under pipefail)
sort -t$'\t' -k1,1 -rn "$f" | awk -F'\t' 'NR <= 5 { o = $2; sub(/.*CMakeFiles\//, "", o); printf "  %7.1f s  %s\n", $1 / 1000, o }'
