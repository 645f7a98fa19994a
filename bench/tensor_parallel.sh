#!/usr/bin/env bash
# Tensor parallelism's cost and saving on CPU ranks (bench/tensor_parallel.cpp): for tp 1, 2 and 4
# on 4 ranks (dp = 4 / tp) at one global batch, per rank: parameters + AdamW state, the step's peak
# extra memory (activations, gradients, buffers), step time, and the share of the step spent in
# the tp all-reduces; ratios against tp 1 measured in the same run.
#
#     bash bench/tensor_parallel.sh [build dir] [extra bench_tensor_parallel options]
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${1:-$REPO/build}
shift || true
export OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
[ "$(id -u)" -ne 0 ] || export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
NP=${NP:-4}
out=$(for tp in 1 2 4; do mpirun -np "$NP" "$BUILD/bench_tensor_parallel" --tp "$tp" "$@"; done)
echo "$out" | grep -m1 '^model:' | sed 's/^model: //'
echo "$(getconf _NPROCESSORS_ONLN) cores"
echo
echo "$out" | awk '
  /^row / { n++; tp[n]=$2; dp[n]=$3; held[n]=$4; peak[n]=$5; ms[n]=$6; share[n]=$7 }
  END {
    print "| layout | params + AdamW MB/rank | ratio | step peak extra MB/rank | ratio | step ms | ratio | share of the step in tp all-reduces |"
    print "|---|---:|---:|---:|---:|---:|---:|---:|"
    for (i = 1; i <= n; i++)
      printf "| tp %d x dp %d | %.1f | %.2f | %.1f | %.2f | %.0f | %.2f | %.2f |\n", tp[i], dp[i], held[i], held[i]/held[1],
             peak[i], peak[i]/peak[1], ms[i], ms[i]/ms[1], share[i]
    print ""
    print "(ratio: this layout / tp 1; memory below 1 is the saving, step time above 1 the cost)"
  }'
