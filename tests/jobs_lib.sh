# shellcheck shell=bash
# A pool of background jobs for the test scripts (fuzz_test.sh, hf_tokenizer_test.sh,
# kernel_paths_test.sh; sourced): N jobs at a time, each job's output in a file of its own, printed
# whole in the caller's order once all have ended. Bash only (wait -n: bash 4.3); safe under
# `set -euo pipefail` and under `set -u` alone.
#
#   jobs_run MAX DIR NAME CMD [ARGS...]
#       Waits until fewer than MAX jobs of the pool run (MAX not a positive number: 1), then starts
#       CMD (a command or a shell function) in the background, stdout and stderr to DIR/NAME.log,
#       stdin /dev/null, and its exit status, once it ended, to DIR/NAME.rc. CMD runs with the
#       caller's set -e/-u/pipefail. $! is the job's process afterwards.
#   jobs_wait
#       Waits for every background job (of the pool or not); the pool is empty afterwards.
#   jobs_rc DIR NAME
#       Prints NAME's exit status: 99 when it left none (killed before its status was written,
#       never started, or still running). A job killed by signal S shows 128+S.
#   jobs_print DIR NAME...
#       Prints each NAME's log whole, in the order given; returns 0 when every NAME exited 0, else
#       the number of the others (at most 255). Call it as `jobs_print ... || ...` under set -e.
#
# Only the pool's own jobs count towards MAX (a job's wrapper process still alive); other
# background jobs of the caller do not, but jobs_wait waits for them too. To run a job alone:
# jobs_wait; jobs_run 1 DIR NAME CMD...; jobs_wait.
_jobs_pids=()

jobs_run() {
  local max=$1 dir=$2 name=$3 opts=$- pid rc live
  shift 3
  [[ $max =~ ^[1-9][0-9]*$ ]] || max=1
  # The pool's jobs still alive (a bare `wait -n` can return at once for a job an earlier `wait`
  # collected, so counting its returns would let more than MAX run).
  while :; do
    live=()
    for pid in ${_jobs_pids[@]+"${_jobs_pids[@]}"}; do
      if kill -0 "$pid" 2>/dev/null; then live+=("$pid"); fi
    done
    _jobs_pids=(${live[@]+"${live[@]}"})
    ((${#_jobs_pids[@]} >= max)) || break
    rc=0
    wait -n || rc=$?
    if ((rc == 127)); then _jobs_pids=(); fi  # no child left at all
  done
  mkdir -p "$dir"
  rm -f "$dir/$name.rc"
  # set -e off here so that a failing CMD still gets its status written; back on inside for CMD.
  {
    set +e
    (_jobs_exec "$opts" "$@")
    echo $? >"$dir/$name.rc"
  } >"$dir/$name.log" 2>&1 &
  _jobs_pids+=("$!")
}

_jobs_exec() {  # OPTS CMD...: CMD with set -e where OPTS (the caller's $-) has it
  case $1 in *e*) set -e ;; esac
  shift
  "$@"
}

jobs_wait() {
  wait || true
  _jobs_pids=()
}

jobs_rc() {
  local rc=
  if [ -f "$1/$2.rc" ]; then read -r rc <"$1/$2.rc" || true; fi
  [[ $rc =~ ^[0-9]+$ ]] || rc=99
  echo "$rc"
}

jobs_print() {
  local dir=$1 name failed=0
  shift
  for name in "$@"; do
    cat "$dir/$name.log" 2>/dev/null || true
    [ "$(jobs_rc "$dir" "$name")" = 0 ] || failed=$((failed + 1))
  done
  return $((failed > 255 ? 255 : failed))
}
