#!/usr/bin/env bash
# A fuzzing campaign (issue 39, section 3): each target until N executions (or a time cap), the
# corpus minimised and written back to fuzz/corpus/<target>/ (size-capped), so that the next
# campaign starts where this one stopped and CI's short run (tests/fuzz_test.sh) replays it.
#
#   scripts/fuzz-campaign.sh [--runs N] [--jobs J] [--max-time S] [--max-corpus-kb K] [TARGET ...]
#
#   --runs N           executions per target (default 1000000)
#   --jobs J           targets fuzzed at once (default: the number of cores)
#   --max-time S       stop a target after S seconds even below N executions (default 7200)
#   --max-corpus-kb K  a target's committed corpus is cut to K KiB, smallest inputs kept (default 1024)
# Targets: those tests/fuzz_test.sh builds (default all).
#
# Each target runs with -use_value_profile=1 and fuzz/dict/<target>.dict where it exists, from a
# copy of fuzz/corpus/<target>/, then `-merge=1` keeps the inputs that add coverage (over the old
# corpus and what this run found). A crash, leak, timeout or out-of-memory input is kept under
# build-fuzz/fuzz-artifacts/<target>/ and listed; fix it and commit it under
# fuzz/regressions/<target>/ (tests/fuzz_test.sh replays those). Prints a table: executions,
# libFuzzer's coverage (cov: edges, ft: features), corpus before and after, findings, seconds.
# Exit status 1 when any target found something.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
runs=1000000 jobs=$(getconf _NPROCESSORS_ONLN) max_time=7200 cap_kb=1024
targets=()
while [ $# -gt 0 ]; do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --max-time) max_time=$2; shift 2 ;;
    --max-corpus-kb) cap_kb=$2; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    -*) echo "fuzz-campaign: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
build=${FUZZ_BUILD_DIR:-$root/build-fuzz}
if [ ${#targets[@]} -eq 0 ]; then
  read -r -a targets <<<"$(sed -n 's/^read -r -a targets <<<"${FUZZ_TARGETS:-\(.*\)}"$/\1/p' "$root/tests/fuzz_test.sh")"
fi
# The build is tests/fuzz_test.sh's (the same flags as CI's short run).
FUZZ_BUILD_ONLY=1 FUZZ_TARGETS="${targets[*]}" FUZZ_BUILD_DIR=$build bash "$root/tests/fuzz_test.sh" || exit $?

work=$(mktemp -d "${TMPDIR:-/tmp}/mpitrain-fuzz-campaign.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
export FUZZ_SCRATCH=$work/scratch
mkdir -p "$FUZZ_SCRATCH"

one() {  # TARGET: fuzz, merge, write back; one line of results in $work/<target>.row
  local t=$1 bin=$build/$1 art=$build/fuzz-artifacts/$1 start=$SECONDS
  local corpus=$work/$t.corpus merged=$work/$t.merged log=$work/$t.log
  mkdir -p "$art" "$corpus" "$merged"
  [ -d "$root/fuzz/corpus/$t" ] && cp -R "$root/fuzz/corpus/$t/." "$corpus/"
  local before_n before_kb
  before_n=$(find "$corpus" -type f | wc -l)
  before_kb=$(du -sk "$corpus" | cut -f1)
  local dict=()
  [ -f "$root/fuzz/dict/$t.dict" ] && dict=(-dict="$root/fuzz/dict/$t.dict")
  "$bin" -runs="$runs" -max_total_time="$max_time" -use_value_profile=1 "${dict[@]}" -rss_limit_mb=2560 -timeout=60 \
    -print_final_stats=1 -artifact_prefix="$art/" "$corpus" > "$log" 2>&1
  local rc=$?
  local execs cov ft
  execs=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$log" | tail -n 1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)
  # Minimise: keep what adds coverage, over this run's corpus and the committed one.
  "$bin" -merge=1 -use_value_profile=1 -rss_limit_mb=2560 -timeout=60 "$merged" "$corpus" > "$work/$t.merge.log" 2>&1
  # Size cap: the smallest inputs first (they cover the most per byte).
  local kept=0 files
  files=$(find "$merged" -type f -printf '%s %p\n' | sort -n)
  mkdir -p "$work/$t.kept"
  while read -r bytes path; do
    [ -n "$path" ] || continue
    if [ $(((kept + bytes) / 1024)) -gt "$cap_kb" ]; then continue; fi
    cp "$path" "$work/$t.kept/"
    kept=$((kept + bytes))
  done <<<"$files"
  if [ "$(find "$work/$t.kept" -type f | wc -l)" -gt 0 ]; then
    rm -rf "$root/fuzz/corpus/$t"
    mkdir -p "$root/fuzz/corpus/$t"
    cp "$work/$t.kept/." -R "$root/fuzz/corpus/$t/"
  fi
  local after_n after_kb findings
  after_n=$(find "$root/fuzz/corpus/$t" -type f | wc -l)
  after_kb=$(du -sk "$root/fuzz/corpus/$t" | cut -f1)
  findings=$(find "$art" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) \
    -newer "$work/start" | wc -l)
  cp "$log" "$art/campaign.log"
  printf '| %s | %s | %s | %s | %s files, %s KiB | %s files, %s KiB | %s | %s |\n' "$t" "${execs:-?}" "${cov:-?}" \
    "${ft:-?}" "$before_n" "$before_kb" "$after_n" "$after_kb" "$findings$([ $rc -ne 0 ] && echo " (exit $rc)")" \
    $((SECONDS - start)) > "$work/$t.row"
}
export -f one
export root build work runs max_time cap_kb
touch "$work/start"
echo "fuzz-campaign: ${#targets[@]} targets, $runs executions each (at most $max_time s), $jobs at a time; logs in $build/fuzz-artifacts/<target>/campaign.log"
printf '%s\n' "${targets[@]}" | xargs -P "$jobs" -I{} bash -c 'one "$@"' _ {}
echo
echo "| target | executions | cov | ft | corpus before | corpus after (merged, capped at $cap_kb KiB) | findings | seconds |"
echo "|---|---:|---:|---:|---|---|---|---:|"
found=0
for t in "${targets[@]}"; do
  cat "$work/$t.row" 2>/dev/null || echo "| $t | (no result) | | | | | | |"
  grep -q '| 0 | [0-9]* |$' "$work/$t.row" 2>/dev/null || found=1
done
for t in "${targets[@]}"; do
  find "$build/fuzz-artifacts/$t" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) \
    -newer "$work/start" -printf "finding: $t: %p\n" 2>/dev/null
done
exit $found
