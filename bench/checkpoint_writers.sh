#!/usr/bin/env bash
# A ZeRO-1 checkpoint of GPT-2 124M (vocab 50304; 1.49 GB of parameters and AdamW moments) written
# by rank 0 alone against every rank writing its own share of the file, for 2 and 4 ranks:
# bench/checkpoint_writers.cpp, one run per world size, median of RUNS after WARMUP untimed rounds.
#
#     bash bench/checkpoint_writers.sh [build dir] [directory on the disk to measure]
#
# Environment: RUNS (5), WARMUP (2), NPS ("2 4"). Needs ~3.5 GB free there and ~2 GB of memory per rank.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${1:-$REPO/build}
DIR=${2:-/tmp}/mpitrain-bench-writers-$$
trap 'rm -rf "$DIR"' EXIT
export OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
[ "$(id -u)" -ne 0 ] || export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo "disk: $(df -h --output=source,fstype,size,avail "${2:-/tmp}" | tail -1); $(getconf _NPROCESSORS_ONLN) cores"
for np in ${NPS:-2 4}; do
  echo
  mpirun -np "$np" "$BUILD/bench_checkpoint_writers" --dir "$DIR" --runs "${RUNS:-5}" --warmup "${WARMUP:-2}"
done
