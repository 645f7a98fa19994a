# Sourced by scripts/setup.sh, scripts/build-mpich.sh and tests/fuzz_test.sh: a CMake build that
# says how far it is, and the generator a new build directory gets.
#
#   cmake_generator_args BUILD_DIR   prints "-G Ninja" for a directory CMake has not configured
#       yet when ninja is installed (scripts/packages.txt has ninja-build), nothing otherwise (a
#       configured directory keeps its generator: CMake refuses to switch one). Ninja schedules
#       compiles across targets (a target's objects wait only for the headers they need, not for
#       the libraries it links to be linked, as with Makefiles), so the 2 cores stay busy where the
#       Makefiles left one idle: fused_ops.cpp beside the model's batches, the tests beside the
#       libraries.
#
#   build_with_progress NAME BUILD_DIR LOG [cmake --build args...]
#
# Runs `cmake --build BUILD_DIR -j${JOBS:-2} ARGS` with its whole output appended to LOG, and while
# it runs prints a line at every 10% of the compile steps, or after 30 s without one:
#   setup: build 40% (57 of 142 objects compiled), 6m12s, log build.log
# (the objects to compile are the entries of BUILD_DIR/compile_commands.json, the compiled ones the
# "Building ..." lines in LOG, Makefiles' "[ NN%] Building" or Ninja's "[n/N] Building", the
# percentage theirs: CMake's own [ NN%] went 100% then 91% under -j2, each target counting its own,
# and Ninja's N counts links and custom steps too). Safe under set -euo pipefail.
# When the build fails it prints the first compiler or linker error with its context, not the
# last lines of make, and returns 1.
cmake_generator_args() {
  if [ ! -f "$1/CMakeCache.txt" ] && command -v ninja > /dev/null 2>&1; then echo "-G Ninja"; fi
}

build_with_progress() {
  local name=$1 dir=$2 log=$3
  shift 3
  local total start pid pct=0 said_pct=-10 said_t compiled now rc=0
  total=$(grep -c '"file":' "$dir/compile_commands.json" 2>/dev/null || true)
  total=${total:-?}
  start=$(date +%s)
  said_t=$start
  cmake --build "$dir" -j"${JOBS:-2}" "$@" >> "$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 2
    # The objects compiled of all (monotonic; CMake's own [ NN%] jumps between targets under -j).
    compiled=$(grep -c -E '^\[( *[0-9]+%|[0-9]+/[0-9]+)\] Building' "$log" || true)
    compiled=${compiled:-0}
    if [ "$total" != "?" ] && [ "$total" -gt 0 ]; then pct=$((compiled * 100 / total)); else pct=0; fi
    [ "$pct" -le 100 ] || pct=100
    now=$(date +%s)
    if [ "$pct" -ge $((said_pct + 10)) ] || [ $((now - said_t)) -ge 30 ]; then
      printf '%s: build %3d%% (%s of %s objects compiled), %dm%02ds, log %s\n' "$name" "$pct" "$compiled" "$total" \
        $(((now - start) / 60)) $(((now - start) % 60)) "$log"
      said_pct=$pct
      said_t=$now
    fi
  done
  wait "$pid" || rc=$?
  [ $rc -eq 0 ] && return 0
  echo "$name: the build failed (exit $rc) after $(( $(date +%s) - start )) s; the first error (whole log: $log):"
  if grep -q -E ': (fatal )?error:' "$log"; then
    grep -m1 -B4 -A10 -E ': (fatal )?error:' "$log"
  elif grep -q -E 'undefined reference|ld returned|cannot find -l' "$log"; then
    grep -m1 -B2 -A8 -E 'undefined reference|ld returned|cannot find -l' "$log"
  elif grep -q 'CMake Error' "$log"; then
    grep -m1 -A12 'CMake Error' "$log"
  else
    tail -n 30 "$log"
  fi
  return 1
}
