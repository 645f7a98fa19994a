# shellcheck shell=bash
# Shared helpers of the multi-host tests (sourced, not run).
#
# Results: ok/bad/check print `PASS: name` / `FAIL: name` and count them; summary prints the wall
# time and the final `N passed, M failed` line. skip prints `SKIP: reason` and exits 77, which
# CTest reports as skipped (SKIP_RETURN_CODE 77).

MT_PASSED=0
MT_FAILED=0
MT_T0=$(date +%s%N)

ok()    { echo "PASS: $1"; MT_PASSED=$((MT_PASSED + 1)); }
bad()   { echo "FAIL: $1"; MT_FAILED=$((MT_FAILED + 1)); }
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }   # name, shell condition
skip()  { echo "SKIP: $1"; exit 77; }

summary() {
  local ms=$((($(date +%s%N) - MT_T0) / 1000000))
  printf 'wall time: %d.%03d s\n' $((ms / 1000)) $((ms % 1000))
  echo "$MT_PASSED passed, $MT_FAILED failed"
}

# Prints the last lines of a log file, indented, to explain a failure.
show_tail() {  # file [lines]
  [ -f "$1" ] || return 0
  echo "  --- last lines of ${1##*/} ---"
  tail -n "${2:-25}" "$1" | sed 's/^/  | /'
}

# Runs a command with a time limit, in the background so that the test's INT/TERM traps fire at
# once (bash defers traps while a foreground child runs). MT_CHILD holds its PID meanwhile.
MT_CHILD=""
bounded() {  # seconds command...
  local limit=$1
  shift
  timeout -k 5 "$limit" "$@" &
  MT_CHILD=$!
  wait "$MT_CHILD"
  local rc=$?
  MT_CHILD=""
  return $rc
}
