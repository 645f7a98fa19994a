#!/usr/bin/env bash
# Builds mpitrain and runs the whole test suite (unit tests, real mpirun -np 2/-np 4 runs, and
# the CLI end-to-end tests) with CTest.
#
#   scripts/test.sh [CTEST ARGS]   e.g. -R llama to run some tests only
#   scripts/test.sh --quick        the quick tier while working: the tests labelled "quick" in
#                                  tests/CMakeLists.txt (the unit tests and one end-to-end run per
#                                  room: training, data, checkpoints, export, launch), no MPICH
#                                  build; under 10 minutes on 2 cores after a build
#   scripts/test.sh --packages-only   installs what the build and the tests need, builds nothing
#
# Every CTest run ends with its slowest tests, their time budgets (TIMEOUT) and the share used
# (scripts/slowest-tests.sh).
#
# Then, when no CTEST ARGS narrowed the run (or MPITRAIN_TEST_MPICH=1; =0 never), the MPICH-ABI
# build in build-mpich/ (-DMPITRAIN_MPI=mpich: Debian's libmpich-dev, hydra's mpiexec) runs the
# tests labelled "mpi" once more: every mpirun test (but test_fused_emu_tp_np2 and test_train_np4,
# below), the CLI's launches, signals and guards, the multi-host namespaces under hydra and the
# Slurm kit with srun --mpi=pmi2.
set -euo pipefail
cd "$(dirname "$0")/.."
packages_only=0 quick=0
if [ "${1:-}" = --packages-only ]; then packages_only=1; shift; fi
if [ "${1:-}" = --quick ]; then quick=1; shift; set -- -L quick "$@"; fi
if [ $packages_only = 1 ]; then scripts/setup.sh --packages-only; else scripts/setup.sh; fi
# What the fault and multi-host tests use beyond the build (Slurm, munge, docker.io and
# debootstrap are installed by their own tests), and the fuzz test's clang with its libFuzzer
# runtime (libclang_rt.fuzzer: libclang-rt-dev -> libclang-rt-14-dev on Debian 12), h5py
# (tests/h5py_test.sh reads checkpoints with it), crc32c and protobuf (tests/observe_test.sh reads
# the TensorBoard files with them), PyTorch (tests/export_test.sh: a GPT-2 on the exported Hugging
# Face weights), pdsh (tests/multihost/fleet_test.sh) and MPICH (the MPICH-ABI build below, and
# tests/cli_test.sh: a binary under another family's launcher is refused; Open MPI stays Debian's
# default MPI alternative).
# MPITRAIN_TEST_PACKAGES=release (scripts/test-debian13.sh with its default selection): not the
# packages of what only the Debian 12 leg runs (the fuzz test's clang and libclang-rt-dev, the
# fleet kit's pdsh, the MPICH-ABI build's libmpich-dev: 431 MB installed in the Debian 13 root).
test_packages=(openssh-server openssh-client iproute2 bc procps python3-h5py python3-crc32c python3-protobuf
               python3-torch mpich)
[ "${MPITRAIN_TEST_PACKAGES:-all}" = release ] || test_packages+=(clang libclang-rt-dev pdsh libmpich-dev)
missing=()
for p in "${test_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# node (tests/hf_tokenizer_test.sh: Hugging Face's tokenizers in JavaScript as the reference) from
# Debian unless the machine already has it; npm (Debian's pulls in some 340 packages) only when the
# test's npm packages are not installed in its cache yet (MPITRAIN_NO_NPM=1: they will be copied in
# before the test runs, as scripts/test-debian13.sh does).
command -v node >/dev/null 2>&1 || missing+=(nodejs)
if ! command -v npm >/dev/null 2>&1 && [ "${MPITRAIN_NO_NPM:-0}" != 1 ] && ! bash tests/hf_tokenizer_test.sh --installed; then
  missing+=(npm)
fi
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "test.sh: installing ${missing[*]}"
  $SUDO scripts/apt-get-wait update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO scripts/apt-get-wait install -y -qq --no-install-recommends "${missing[@]}"
fi
[ $packages_only = 1 ] && exit 0
mpich=${MPITRAIN_TEST_MPICH:-auto}
[ "$mpich" = auto ] && { [ $# -eq 0 ] && [ $quick = 0 ] && mpich=1 || mpich=0; }
# Open MPI's point-to-point layer: ob1, the one these machines use (no InfiniBand, Omni-Path or
# libfabric device). Left to choose, every rank of every test first probes the cm layer's PSM/PSM2
# transports (installed with Debian's Open MPI, no hardware here): 0.2-0.3 s per process, measured
# on `mpitrain --version` (1.5 -> 1.25 s). A user's setting is kept; MPICH reads no OMPI_ variable.
export OMPI_MCA_pml=${OMPI_MCA_pml:-ob1}
# run_ctest BUILD_DIR [CTEST ARGS]: CTest two at a time (a single-process test, one torch thread,
# beside another; a test that declares PROCESSORS 2, the mpirun ones, or RUN_SERIAL runs alone;
# MPITRAIN_TEST_JOBS=1: one at a time), then its slowest tests; returns CTest's exit status.
run_ctest() {
  local dir=$1 out rc
  shift
  out=$(mktemp "${TMPDIR:-/tmp}/mpitrain-ctest.XXXXXX")
  set +e
  (cd "$dir" && ctest --output-on-failure -j "${MPITRAIN_TEST_JOBS:-2}" "$@") 2>&1 | tee "$out"
  rc=${PIPESTATUS[0]}
  set -e
  scripts/slowest-tests.sh "$dir" "$out" 10
  rm -f "$out"
  return "$rc"
}
run_ctest build "$@"
[ "$mpich" = 1 ] || exit 0
# ---- the MPICH-ABI build: the tests labelled "mpi" once more (docs/operations.md, MPI families) ----
# After the tests, not beside them: on 2 cores anything running beside the tests, even under
# SCHED_IDLE, made them slower by more than it saved (measured: lock 20 -> 25 s, h5py 9 -> 17 s
# beside one compiler at idle priority).
start=$(date +%s)
echo "test.sh: MPICH-ABI build in build-mpich/ (scripts/build-mpich.sh; build-mpich.log)"
scripts/build-mpich.sh
# Not test_fused_emu_tp_np2 and test_train_np4: scripts/build-mpich.sh says why. The refusals made
# by mpitrain's own checks alike on every rank (tests/e2e_lib.sh, expect_own_usage) ran above.
MPITRAIN_TEST_OWN_CHECKS=elsewhere run_ctest build-mpich -L '^mpi$' -E '^(test_fused_emu_tp_np2|test_train_np4)$'
echo "test.sh: MPICH-ABI build and tests took $(( $(date +%s) - start )) s"
