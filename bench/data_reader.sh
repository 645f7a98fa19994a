#!/usr/bin/env bash
# Prints the data-reader table for 1, 2 and 4 ranks: reader tokens/s per rank vs a memcpy from the
# page cache measured in the same run. Usage: bench/data_reader.sh [build dir] [extra args]
set -euo pipefail
BUILD=${1:-build}
shift || true
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
echo "| ranks | batch (rows x seq) | reader Mtok/s/rank | slowest rank Mtok/s | memcpy Mtok/s/rank | ratio |"
echo "|------:|--------------------|-------------------:|--------------------:|-------------------:|------:|"
for np in 1 2 4; do
  mpirun -np "$np" --oversubscribe "$BUILD/bench_data_reader" "$@"
done
