#!/usr/bin/env bash
# Checkpoint save and load against dd on the same disk, and the loop stall of checkpoint.async saves
# (first and later ones): bench/checkpoint_io.cpp, one run, median of RUNS after WARMUP untimed
# rounds. The checkpoint is GPT-2 124M's (vocab 50304) with AdamW state: 1.49 GB. Run as root so
# the page cache is dropped before each read (else the reads are warm and the table says so).
#
#     bash bench/checkpoint_io.sh [build dir] [directory on the disk to measure]
#
# Environment: RUNS (5), WARMUP (2). Needs ~4.5 GB free there and ~5 GB of memory.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${1:-$REPO/build}
DIR=${2:-/tmp}/mpitrain-bench-ckpt-$$
trap 'rm -rf "$DIR"' EXIT
echo "disk: $(df -h --output=source,fstype,size,avail "${2:-/tmp}" | tail -1)"
"$BUILD/bench_checkpoint_io" --dir "$DIR" --runs "${RUNS:-5}" --warmup "${WARMUP:-2}"
