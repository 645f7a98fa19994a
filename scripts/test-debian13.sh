#!/usr/bin/env bash
# CI's second leg: this checkout on Debian 13 "trixie" (libtorch 2.6, OpenMPI 5, HDF5 1.14,
# spdlog 1.15, yaml-cpp 0.8, CLI11 2.4), as a new user there would run it: the README's
# scripts/test.sh, which installs the Debian packages with apt-get, builds and runs CTest.
#
# It runs in a Debian 13 root made by debootstrap from the mirror this machine's apt uses, kept
# in $MPITRAIN_TEST_CACHE (default /var/cache/mpitrain-test)/debian13-root so that a second run
# downloads nothing (the packages scripts/test.sh installs stay there too; apt-get upgrades them
# when the mirror has newer ones). The checkout is copied in fresh each run and built from
# scratch. Proc, sys, dev and a private /dev/shm are mounted in a mount namespace of this script's
# own: they vanish with it, even if it is killed.
#
# Inside, every CTest test runs (the netns multi-host test too, under OpenMPI 5) except these,
# which run in the Debian 12 leg only (scripts/test.sh), MPITRAIN_DEBIAN13_CTEST_ARGS replacing
# the selection:
#  - the Docker swarm and Slurm kits, which need this host's daemons;
#  - what tests no difference between the releases that the tests run here do not, and would
#    lengthen CI by some 17 minutes on a 2-core machine: the slow-links timing test, the fleet kit
#    (pdsh/pdcp, then the same mpirun over ssh as netns), fuzzing (its own clang build of the
#    parsers), grad_comm (five 200-step trainings: 16-bit and PowerSGD communication against fp32;
#    the arithmetic it rests on, test_comm and test_powersgd, runs here), gpu_check_rehearsal (the
#    lease script's flow; the training it drives is test_train's and cli's) and kernel_paths (the
#    numerical tests again under other OpenBLAS/ATen kernels; here they run on the default ones).
# And within the script tests, the refusals of bad input that mpitrain's own checks make alike on
# every rank (tests/e2e_lib.sh, expect_own_usage: MPITRAIN_TEST_OWN_CHECKS=elsewhere); those that
# pass through Open MPI 5, yaml-cpp 0.8, HDF5 1.14 or libtorch 2.6 run here.
# When this machine has a CUDA toolkit with nccl.h in /usr/local/cuda (as the CI machine has),
# it is mounted read-only into the root, so the GPU sources and CUDA kernels are compile-checked
# against libtorch 2.6's headers with trixie's GCC (only here: the Debian 12 leg's libtorch 1.13 is
# no GPU machine's, CMakeLists.txt); the leg fails if the build did not run that check. ROCm's are
# compile-checked always here (cmake/rocm-compile-check): trixie has hipcc (ROCm 5.7) and RCCL, installed in this leg only
# (182 MB download, 631 MB installed); the leg fails if the build did not run that check.
#
#   scripts/test-debian13.sh            (root; about 15 min the first time, then ~10)
#   scripts/test-debian13.sh --prepare  only makes the root and installs the packages the build and
#                                       the tests need (.ci/run does this beside the Debian 12 leg)
#   MPITRAIN_DEBIAN13_SHELL=1 scripts/test-debian13.sh   a shell in the root after the tests
set -euo pipefail
PREPARE=0
if [ "${1:-}" = --prepare ]; then PREPARE=1; fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${MPITRAIN_TEST_CACHE:-/var/cache/mpitrain-test}
ROOT=$CACHE/debian13-root
# Run once, in the Debian 12 leg (above).
CTEST_ARGS=${MPITRAIN_DEBIAN13_CTEST_ARGS:--E ^(multihost_slurm|multihost_swarm|multihost_slow|multihost_fleet|fuzz|grad_comm|gpu_check_rehearsal|kernel_paths)$}
# With that selection (and with a CTest selection, no MPICH-ABI build), the root needs not the
# packages of fuzz, the fleet kit and the MPICH-ABI build (scripts/test.sh, MPITRAIN_TEST_PACKAGES).
TEST_PACKAGES=release
[ -n "${MPITRAIN_DEBIAN13_CTEST_ARGS+x}" ] && TEST_PACKAGES=all

say() { echo "debian13: $*"; }
[ "$(id -u)" -eq 0 ] || { say "needs root (debootstrap, chroot, mounts)"; exit 1; }

if ! command -v debootstrap > /dev/null; then
  say "installing debootstrap"
  "$REPO/scripts/apt-get-wait" update -qq
  DEBIAN_FRONTEND=noninteractive "$REPO/scripts/apt-get-wait" install -y -qq --no-install-recommends debootstrap > /dev/null
fi

if [ ! -f "$ROOT/.mpitrain-root-complete" ]; then
  say "debootstrap --variant=minbase trixie into $ROOT (first run only)"
  . "$REPO/scripts/debian-root.sh"
  make_debian_root trixie "$ROOT" "$CACHE/debian13-debootstrap.log" || exit 1
  touch "$ROOT/.mpitrain-root-complete"
fi
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# tests/hf_tokenizer_test.sh's npm packages: the cache the Debian 12 leg filled (pure JavaScript,
# keyed by the lock file), and this host's CA bundle for npm where the registry is reached through
# a TLS-inspecting proxy that only the host trusts.
HOST_NPM_CACHE=${MPITRAIN_NPM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mpitrain-npm}
if [ -d "$HOST_NPM_CACHE" ]; then
  mkdir -p "$ROOT/root/.cache"
  cp -a "$HOST_NPM_CACHE/." "$ROOT/root/.cache/mpitrain-npm/" 2>/dev/null || true
fi
NODE_CA=""
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  mkdir -p "$ROOT/etc/ssl/certs"
  cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/mpitrain-host-ca.crt"
  NODE_CA=/etc/ssl/certs/mpitrain-host-ca.crt
fi
say "root $ROOT: $(cat "$ROOT/etc/debian_version") ($(du -sh "$ROOT" 2>/dev/null | cut -f1))"

# The checkout, fresh: tracked files and untracked ones git does not ignore (as CI's clone has).
# One tar reads the whole list (-T -): xargs would split a long list (the fuzz corpora: ~13,000
# files) over several tars, and the extracting tar stops at the first archive's end (SIGPIPE).
rm -rf "$ROOT/src/mpitrain"
mkdir -p "$ROOT/src/mpitrain"
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard | tar -cf - --null --no-recursion -T -) \
  | tar -C "$ROOT/src/mpitrain" -xf -
if [ -d "$REPO/../shared" ]; then
  rm -rf "$ROOT/src/shared"
  cp -r "$REPO/../shared" "$ROOT/src/shared"
fi

inner=$(cat <<'EOF'
set -euo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
[ -x /usr/local/cuda/bin/nvcc ] && PATH=$PATH:/usr/local/cuda/bin
export DEBIAN_FRONTEND=noninteractive
cd /src/mpitrain
apt-get update -qq
apt-get -y -qq upgrade > /dev/null
# The ROCm compile check's hipcc, HIP headers and rccl.h (Debian 12 has no RCCL: this leg only).
apt-get install -y -qq --no-install-recommends hipcc libamdhip64-dev librccl-dev > /dev/null
if [ "$PREPARE" = 1 ]; then
  # npm is left to the real run: by then the Debian 12 leg has filled the npm cache copied in.
  start=$(date +%s)
  MPITRAIN_NO_NPM=1 scripts/test.sh --packages-only > /dev/null
  echo "debian13: packages installed in $(( $(date +%s) - start )) s"
  exit 0
fi
echo "debian13: $(. /etc/os-release; echo "$PRETTY_NAME"); libtorch-dev $(dpkg-query -W -f='${Version}' libtorch-dev 2>/dev/null || echo '(not yet installed)')"
start=$(date +%s)
rc=0
scripts/test.sh $CTEST_ARGS || rc=$?
if ! grep -h "mpitrain: ROCm compile check: HIP kernels .* and the RCCL backend" build.log; then
  echo "debian13: the build did not run the ROCm compile check (build.log)"
  rc=1
fi
if [ -x /usr/local/cuda/bin/nvcc ] && ! grep -q "mpitrain: compiling the GPU sources as a check" build.log; then
  echo "debian13: the build did not run the GPU compile check (build.log)"
  rc=1
fi
echo "debian13: packages: libtorch-dev $(dpkg-query -W -f='${Version}' libtorch-dev), openmpi-bin $(dpkg-query -W -f='${Version}' openmpi-bin), libhdf5-dev $(dpkg-query -W -f='${Version}' libhdf5-dev), libspdlog-dev $(dpkg-query -W -f='${Version}' libspdlog-dev), libyaml-cpp-dev $(dpkg-query -W -f='${Version}' libyaml-cpp-dev), libcli11-dev $(dpkg-query -W -f='${Version}' libcli11-dev), hipcc $(dpkg-query -W -f='${Version}' hipcc), librccl-dev $(dpkg-query -W -f='${Version}' librccl-dev)"
echo "debian13: scripts/test.sh took $(( $(date +%s) - start )) s, exit $rc"
if [ "${MPITRAIN_DEBIAN13_SHELL:-0}" = 1 ]; then bash -i < /dev/tty > /dev/tty 2>&1 || true; fi
exit $rc
EOF
)

# A mount namespace of its own: the mounts below disappear when this command ends.
CUDA_DIR=""
if [ -x /usr/local/cuda/bin/nvcc ] && [ -f /usr/local/cuda/include/nccl.h ]; then
  CUDA_DIR=$(readlink -f /usr/local/cuda)
  say "CUDA toolkit $CUDA_DIR mounted read-only: the GPU sources are compile-checked"
else
  rm -f "$ROOT/usr/local/cuda"
  say "no CUDA toolkit with nccl.h in /usr/local/cuda: no GPU compile check in this leg"
fi
unshare --mount --propagation private -- env ROOT="$ROOT" CTEST_ARGS="$CTEST_ARGS" CUDA_DIR="$CUDA_DIR" NODE_CA="$NODE_CA" PREPARE="$PREPARE" TEST_PACKAGES="$TEST_PACKAGES" \
  MPITRAIN_DEBIAN13_SHELL="${MPITRAIN_DEBIAN13_SHELL:-0}" INNER="$inner" bash -c '
  set -euo pipefail
  mount --bind "$ROOT" "$ROOT"   # the root a mount point of its own (ip netns needs that)
  mount -t proc proc "$ROOT/proc"
  mount --rbind /sys "$ROOT/sys"
  mount --rbind /dev "$ROOT/dev"
  mount -t tmpfs -o size=4g tmpfs "$ROOT/dev/shm"
  mount -t tmpfs -o size=8g tmpfs "$ROOT/tmp"
  if [ -n "$CUDA_DIR" ]; then
    mkdir -p "$ROOT$CUDA_DIR"
    mount --bind -o ro "$CUDA_DIR" "$ROOT$CUDA_DIR"
    ln -sfn "$CUDA_DIR" "$ROOT/usr/local/cuda"
  fi
  exec chroot "$ROOT" /usr/bin/env -i CTEST_ARGS="$CTEST_ARGS" CI="${CI:-}" NODE_EXTRA_CA_CERTS="$NODE_CA" PREPARE="$PREPARE" \
    MPITRAIN_TEST_OWN_CHECKS=elsewhere MPITRAIN_TEST_PACKAGES="$TEST_PACKAGES" \
    MPITRAIN_DEBIAN13_SHELL="$MPITRAIN_DEBIAN13_SHELL" bash -c "$INNER"
'
