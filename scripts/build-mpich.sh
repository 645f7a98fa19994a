#!/usr/bin/env bash
# The MPICH-ABI build in build-mpich/ (-DMPITRAIN_MPI=mpich: Debian's libmpich-dev, hydra's
# mpiexec) of what scripts/test.sh runs against it: the tests labelled "mpi" (docs/operations.md,
# MPI families). scripts/test.sh runs it after CTest's run on the Open MPI build.
#
#   scripts/build-mpich.sh      (whole output: build-mpich.log; a progress line every 10% or 30 s)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
ccache=OFF
command -v ccache > /dev/null && ccache=ON
rm -f build-mpich/compile-times.tsv
. scripts/build-progress.sh
# shellcheck disable=SC2046  # "-G Ninja" is two words on purpose (or none)
cmake $(cmake_generator_args build-mpich) -S . -B build-mpich -DCMAKE_BUILD_TYPE=Release -DMPITRAIN_MPI=mpich \
  -DMPITRAIN_CCACHE=$ccache -DMPITRAIN_TIME_COMPILES=ON -DMPITRAIN_BUILD_BENCH=OFF -DMPITRAIN_GPU_COMPILE_CHECK=OFF \
  > build-mpich.log 2>&1 ||
  { grep -A12 'CMake Error' build-mpich.log || tail -n 30 build-mpich.log; echo "build-mpich: configure failed (build-mpich.log)"; exit 1; }
# Not built or run against MPICH (they run against Open MPI): test_fused_emu (its own build of
# fused_ops.cpp and the emulated kernels, whose two-rank test goes through the same
# communicator as test_tensor_parallel's) and test_train at -np 4 (the layouts of -np 2 and 4 are
# the same code over MPI; 4 ranks spinning in MPICH's polling on 2 cores took 264 s, Open MPI 62).
build_with_progress build-mpich build-mpich build-mpich.log --target mpitrain test_shards_mpi test_pack \
  test_hf_tokenizer test_comm test_powersgd test_train test_tensor_parallel || exit 1
echo "build-mpich: built in $(( $(date +%s) - start )) s; $(readelf -d build-mpich/mpitrain | grep -o 'libmpi[^]]*' | tr '\n' ' ')"
scripts/compile-times.sh build-mpich 5 || true  # a report: never what fails the build
