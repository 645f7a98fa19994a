#!/usr/bin/env bash
# Reruns the numerical unit tests under the CPU kernel paths this CPU can run besides its own:
# OpenBLAS's kernels (OPENBLAS_CORETYPE) and ATen's vectorised kernels (ATEN_CPU_CAPABILITY).
# The default path is what the ordinary CTest run covers; a path the CPU cannot run (SkylakeX
# without AVX-512, say) is named as not tried, never counted as passed. Which claims are bitwise
# and which are to a tolerance: tests/README.md.
#
#   kernel_paths_test.sh MPIEXEC single:TEST_BINARY... np2:TEST_BINARY...
#
# single: runs the binary alone; np2: under `mpiexec -np 2 --oversubscribe`.
set -uo pipefail
# shellcheck source=jobs_lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/jobs_lib.sh"

mpiexec=$1
shift
tests=("$@")

flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() {  # has FLAG...: every flag is in /proc/cpuinfo
  local f
  for f in "$@"; do [[ " $flags " == *" $f "* ]] || return 1; done
}
model=$(grep -m1 '^model name' /proc/cpuinfo | sed 's/.*: //')
native=$(OPENBLAS_VERBOSE=2 "${tests[0]#*:}" --gtest_list_tests 2>&1 | sed -n 's/^Core: //p' | head -1)
# ATen's own default kernels on this CPU, as `mpitrain --version` reports them (MPITRAIN_BINARY,
# set by CTest): libtorch 1.13 keeps AVX2 on an AVX-512 CPU, so its avx2 path is the default run's
# there. Unknown: every ATen path is run.
aten_native=$(env -u ATEN_CPU_CAPABILITY "${MPITRAIN_BINARY:-/nonexistent}" --version 2>/dev/null |
  sed -n 's/^torch: .*(CPU kernels: \(.*\))$/\1/p')
echo "CPU: ${model:-unknown}; OpenBLAS picks '${native:-?}' by itself, ATen '${aten_native:-?}'; BLAS library: $(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 2>/dev/null || echo '?')"

# name | environment | cpuinfo flags the path needs
paths=(
  "openblas=Sandybridge|OPENBLAS_CORETYPE=Sandybridge|avx"
  "openblas=Haswell|OPENBLAS_CORETYPE=Haswell|avx2 fma"
  "openblas=Zen|OPENBLAS_CORETYPE=Zen|avx2 fma"
  "openblas=SkylakeX|OPENBLAS_CORETYPE=SkylakeX|avx512f avx512bw avx512vl avx512dq"
  "openblas=Cooperlake|OPENBLAS_CORETYPE=Cooperlake|avx512f avx512bw avx512vl avx512dq avx512_bf16"
  "aten=default|ATEN_CPU_CAPABILITY=default|"
  "aten=avx2|ATEN_CPU_CAPABILITY=avx2|avx2 fma"
  "aten=avx512|ATEN_CPU_CAPABILITY=avx512|avx512f avx512bw avx512vl avx512dq"
  "aten=default+openblas=Haswell|ATEN_CPU_CAPABILITY=default OPENBLAS_CORETYPE=Haswell|avx2 fma"
)

log=$(mktemp -d /tmp/mpitrain-kernel-paths-XXXXXX)
trap 'rm -rf "$log"' EXIT
passed=0 failed=0 not_tried=()
# run_one MODE:BINARY ENVS: one binary under one path (run as the job <binary>-<path> of
# tests/jobs_lib.sh: its output in $log/<binary>-<path>.log, its exit status in .rc).
run_one() {
  local mode=${1%%:*} bin=${1#*:}
  # shellcheck disable=SC2086
  if [ "$mode" = np2 ]; then
    env $2 OPENBLAS_VERBOSE=2 "$mpiexec" -np 2 --oversubscribe "$bin"
  else
    env $2 OPENBLAS_VERBOSE=2 "$bin"
  fi
}
printf '%-36s %s\n' "kernel path" "result"
for entry in "${paths[@]}"; do
  IFS='|' read -r name envs needs <<<"$entry"
  # shellcheck disable=SC2086
  if ! has $needs; then
    not_tried+=("$name (needs ${needs})")
    continue
  fi
  # The ATen kernels this libtorch picks by itself are what the default run covers.
  if [[ $name == aten=* && $name != *+* && -n $aten_native ]]; then
    cap=${envs#ATEN_CPU_CAPABILITY=}
    [ "$cap" = default ] && cap="no avx"
    if [[ ${cap,,} == "${aten_native,,}" ]]; then
      not_tried+=("$name (ATen's default on this CPU)")
      continue
    fi
  fi
  core=${envs#*OPENBLAS_CORETYPE=}
  if [[ $envs == *OPENBLAS_CORETYPE=* ]]; then
    core=${core%% *}
    if [[ ${core,,} == "${native,,}" ]]; then  # the default run covers it already
      not_tried+=("$name (the default path on this CPU)")
      continue
    fi
  fi
  # The single-process binaries two at a time (one torch thread each; CTest gives this test both
  # cores), the np2 ones alone.
  bad=()
  path_start=$SECONDS
  for t in "${tests[@]}"; do
    job="$(basename "${t#*:}")-${name//[=+]/_}"
    if [ "${t%%:*}" = np2 ]; then
      jobs_wait
      jobs_run 1 "$log" "$job" run_one "$t" "$envs"
      jobs_wait
    else
      jobs_run 2 "$log" "$job" run_one "$t" "$envs"
    fi
  done
  jobs_wait
  for t in "${tests[@]}"; do
    bin=${t#*:}
    job="$(basename "$bin")-${name//[=+]/_}"
    out="$log/$job.log"
    rc=$(jobs_rc "$log" "$job")  # 99: no status written, the run did not end normally
    if [[ $envs == *OPENBLAS_CORETYPE=* ]] && ! grep -q "^Core: $core\$" "$out"; then
      echo "FAIL: $name: OpenBLAS did not run its $core kernels for $(basename "$bin"):" \
           "$(grep -m1 '^Core:' "$out" || echo 'no Core line')"
      rc=1
    fi
    if [ "$rc" -ne 0 ]; then
      bad+=("$(basename "$bin")")
      echo "---- $(basename "$bin") under $envs (exit $rc):"
      grep -E 'Failure|Expected|Which is|actual|FAILED|error' "$out" | head -40
    fi
  done
  if [ ${#bad[@]} -eq 0 ]; then
    printf '%-36s %s\n' "$name" "passed (${#tests[@]} test binaries, $((SECONDS - path_start)) s)"
    passed=$((passed + 1))
  else
    printf '%-36s %s\n' "$name" "FAILED: ${bad[*]}"
    failed=$((failed + 1))
  fi
done
for n in "${not_tried[@]}"; do printf '%-36s %s\n' "${n%% (*}" "not tried: ${n#* (}" | sed 's/)$//'; done
echo "kernel paths passed: $passed, failed: $failed"
[ $failed -eq 0 ] || exit 1
if [ $passed -eq 0 ]; then
  echo "skipped: this CPU runs none of the other kernel paths"
  exit 77
fi
