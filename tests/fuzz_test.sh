#!/usr/bin/env bash
# Coverage-guided fuzzing of the untrusted-input parsers, short enough for CI (fuzz/README.md).
#
#   bash tests/fuzz_test.sh [seconds-per-target]      (default 30)
#
# Configures <repo>/build-fuzz (or $FUZZ_BUILD_DIR; CTest's `fuzz` test uses <build>/fuzz) with
# clang (-DMPITRAIN_FUZZ=ON: libFuzzer + AddressSanitizer; -O1 and line tables only, which builds
# faster than RelWithDebInfo and still gives file:line in sanitizer reports), builds fuzz_config,
# fuzz_shard, fuzz_checkpoint, fuzz_safetensors, fuzz_hf_tokenizer, fuzz_hf_config, fuzz_jsonl,
# fuzz_token_files, fuzz_safetensors_index and fuzz_launch_env (-j2), then for each target, two
# targets at a time (FUZZ_JOBS=N: N at a time):
#   1. replays every input committed under fuzz/regressions/<target>/ (crashes found earlier);
#   2. fuzzes for the given time with fuzz/dict/<target>.dict, starting from a temporary copy of
#      fuzz/corpus/<target>/ (what scripts/fuzz-campaign.sh grew; this short run does not write
#      it back), printing libFuzzer's execution count.
# A crash input is kept under build-fuzz/fuzz-artifacts/<target>/ and its path printed.
# Exit status: 0 all passed, 1 something failed, 77 skipped (no clang or no libFuzzer runtime).
# FUZZ_TARGETS="fuzz_shard ..." limits the run to some targets.
set -uo pipefail

seconds=${1:-30}
if ! [[ $seconds =~ ^[0-9]+$ ]] || ((seconds < 1)); then
  echo "usage: bash tests/fuzz_test.sh [seconds-per-target]" >&2
  exit 2
fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=jobs_lib.sh
. "$root/tests/jobs_lib.sh"
build="${FUZZ_BUILD_DIR:-$root/build-fuzz}"
read -r -a targets <<<"${FUZZ_TARGETS:-fuzz_config fuzz_shard fuzz_checkpoint fuzz_safetensors fuzz_hf_tokenizer fuzz_hf_config fuzz_jsonl fuzz_token_files fuzz_safetensors_index fuzz_launch_env}"

skip() {
  echo "SKIP: $*"
  exit 77
}

# ---- tools ---------------------------------------------------------------------------------------
command -v clang >/dev/null 2>&1 && command -v clang++ >/dev/null 2>&1 ||
  skip "clang/clang++ not installed (Debian: apt-get install clang libclang-rt-dev)"
command -v cmake >/dev/null 2>&1 || skip "cmake not installed"
work=$(mktemp -d "${TMPDIR:-/tmp}/mpitrain-fuzz.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
printf '#include <cstddef>\n#include <cstdint>\nextern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n' \
  >"$work/probe.cpp"
clang++ -fsanitize=fuzzer,address "$work/probe.cpp" -o "$work/probe" >/dev/null 2>&1 ||
  skip "clang++ cannot link -fsanitize=fuzzer,address (the libFuzzer runtime: apt-get install libclang-rt-dev)"

# ---- build -----------------------------------------------------------------------------------------
echo "== configuring and building $build (clang, libFuzzer + ASan)"
build_start=$SECONDS
# shellcheck source=../scripts/build-progress.sh
. "$root/scripts/build-progress.sh"
# shellcheck disable=SC2046  # "-G Ninja" is two words on purpose (or none)
if ! CC=clang CXX=clang++ cmake $(cmake_generator_args "$build") -S "$root" -B "$build" -DMPITRAIN_FUZZ=ON -DMPITRAIN_CCACHE=ON \
    -DMPITRAIN_BUILD_TESTS=OFF -DMPITRAIN_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=Fuzz \
    -DCMAKE_C_FLAGS_FUZZ="-O1 -gline-tables-only" -DCMAKE_CXX_FLAGS_FUZZ="-O1 -gline-tables-only" \
    >"$work/configure.log" 2>&1; then
  tail -n 30 "$work/configure.log"
  echo "FAIL: cmake configure of $build"
  echo "0 passed, 1 failed"
  exit 1
fi
if ! cmake --build "$build" -j2 --target "${targets[@]}" >"$work/build.log" 2>&1; then
  grep -E "error|Error" "$work/build.log" | head -n 30
  echo "FAIL: building ${targets[*]} (full log: rerun cmake --build $build --target ${targets[*]})"
  echo "0 passed, 1 failed"
  exit 1
fi
echo "   built in $((SECONDS - build_start)) s"
# scripts/fuzz-campaign.sh builds through this script and runs the targets itself.
[ "${FUZZ_BUILD_ONLY:-0}" = 1 ] && exit 0

# ---- run -------------------------------------------------------------------------------------------
# Two targets at a time (FUZZ_JOBS; each libFuzzer process is single-threaded; tests/jobs_lib.sh);
# each target's lines are printed whole, in the targets' order, at the end. The harnesses write
# their HDF5 files in a directory of their own below FUZZ_SCRATCH (fuzz/harness.h); a crash skips
# their own clean-up, the trap above does not.
export FUZZ_SCRATCH="$work/scratch"
mkdir -p "$FUZZ_SCRATCH"
common=(-rss_limit_mb=2048 -timeout=60)
jobs=${FUZZ_JOBS:-2}

# run_target TARGET: its regressions, then its fuzzing; prints PASS:/FAIL: lines.
run_target() {
  local target=$1
  local bin="$build/$target"
  local artifacts="$build/fuzz-artifacts/$target"
  mkdir -p "$artifacts"

  # 1. Regressions: every input that once crashed must now run clean.
  local regressions=() input log bad f
  if [[ -d $root/fuzz/regressions/$target ]]; then
    while IFS= read -r -d '' f; do regressions+=("$f"); done \
      < <(find "$root/fuzz/regressions/$target" -type f -print0 | sort -z)
  fi
  if ((${#regressions[@]})); then
    bad=0
    for input in "${regressions[@]}"; do
      log="$artifacts/regression-$(basename "$input").log"
      if ! "$bin" "${common[@]}" "$input" >"$log" 2>&1; then
        bad=$((bad + 1))
        echo "  $target: regression input ${input#"$root"/} still fails:"
        grep -E "PROPERTY VIOLATED|ERROR: |SUMMARY: " "$log" | head -n 3 | sed 's/^/    /'
        echo "    log: $log"
      fi
    done
    if ((bad)); then
      echo "FAIL: $target regressions ($bad of ${#regressions[@]} inputs fail)"
    else
      echo "PASS: $target regressions (${#regressions[@]} inputs)"
    fi
  fi

  # 2. Fuzzing from a throw-away copy of the seed corpus.
  local corpus="$work/corpus/$target"
  mkdir -p "$corpus"
  if [[ -d $root/fuzz/corpus/$target ]]; then cp -R "$root/fuzz/corpus/$target/." "$corpus/"; fi
  log="$build/fuzz-artifacts/$target.log"
  local dict=()
  [[ -f $root/fuzz/dict/$target.dict ]] && dict=(-dict="$root/fuzz/dict/$target.dict")
  "$bin" "${common[@]}" "${dict[@]}" -max_total_time="$seconds" -print_final_stats=1 \
    -artifact_prefix="$artifacts/" "$corpus" >"$log" 2>&1
  local rc=$?
  local execs
  execs=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$log" | tail -n 1)
  echo "  $target: execs ${execs:-?} in ${seconds}s (log: $log)"
  if ((rc == 0)); then
    echo "PASS: $target fuzzing ${seconds}s"
  else
    local crash
    crash=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n 1)
    grep -E "PROPERTY VIOLATED|ERROR: |SUMMARY: " "$log" | head -n 3 | sed 's/^/    /'
    if [[ -n $crash ]]; then
      echo "    crash input kept: $crash"
      echo "    replay: FUZZ_VERBOSE=1 $bin $crash   (then commit it under fuzz/regressions/$target/)"
    fi
    echo "FAIL: $target fuzzing ${seconds}s (exit status $rc)"
  fi
}

for target in "${targets[@]}"; do
  jobs_run "$jobs" "$work/results" "$target" run_target "$target"
done
jobs_wait
passed=0
failed=0
jobs_print "$work/results" "${targets[@]}" || true  # counted from the PASS:/FAIL: lines below
for target in "${targets[@]}"; do
  passed=$((passed + $(grep -c '^PASS: ' "$work/results/$target.log")))
  failed=$((failed + $(grep -c '^FAIL: ' "$work/results/$target.log")))
done
# A target whose job died before printing its verdict counts as failed.
for target in "${targets[@]}"; do
  grep -q "^[A-Z]*: $target fuzzing" "$work/results/$target.log" ||
    { echo "FAIL: $target: no verdict"; failed=$((failed + 1)); }
done

echo "$passed passed, $failed failed"
((failed == 0))
