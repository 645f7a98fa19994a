#!/usr/bin/env bash
# Builds mpitrain and runs the whole test suite (unit tests, real mpirun -np 2/-np 4 runs, and
# the CLI end-to-end tests) with CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cd build
ctest --output-on-failure "$@"
