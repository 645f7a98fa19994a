#!/usr/bin/env bash
# The device kit rehearsed (issue 40, section 1): a bare Debian 12 root with only what the GPU image
# was seen to have (a compiler, CMake, Open MPI, HDF5, yaml-cpp, spdlog, Python with numpy, and
# Debian's libtorch-dev standing in for the image's Python torch), plus the kit, must configure,
# build and run gpu_check's CPU flow (REHEARSE=1 REHEARSE_BUILD=1). A library the kit lacks fails
# here, at no device time.
#
#   bench/device-kit-rehearsal.sh          (root; first run ~10 min for the root, then the build)
#
# The root is cached in $MPITRAIN_TEST_CACHE (default /var/cache/mpitrain-test)/kit-rehearsal-root;
# the checkout and a fresh kit are copied in each run. Mounts live in a mount namespace of this
# script's own and vanish with it. libssl-dev, which Debian's libhdf5-dev pulls in, is removed
# from the root (dpkg --force-depends) so that the kit's OpenSSL headers are the ones used.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${MPITRAIN_TEST_CACHE:-/var/cache/mpitrain-test}
ROOT=$CACHE/kit-rehearsal-root
say() { echo "kit-rehearsal: $*"; }
[ "$(id -u)" -eq 0 ] || { say "needs root (debootstrap, chroot, mounts)"; exit 1; }
t0=$(date +%s)

if ! command -v debootstrap > /dev/null; then
  say "installing debootstrap"
  "$REPO/scripts/apt-get-wait" update -qq
  DEBIAN_FRONTEND=noninteractive "$REPO/scripts/apt-get-wait" install -y -qq --no-install-recommends debootstrap > /dev/null
fi

# What the GPU image was seen to have, as Debian 12 packages; nothing of the kit's.
IMAGE_STAND_IN=(g++ make cmake libopenmpi-dev openmpi-bin libhdf5-dev libyaml-cpp-dev libspdlog-dev
                libtorch-dev libopenblas0-openmp python3 python3-numpy)
if [ ! -f "$ROOT/.mpitrain-root-complete" ]; then
  say "debootstrap --variant=minbase bookworm into $ROOT (first run only)"
  . "$REPO/scripts/debian-root.sh"
  make_debian_root bookworm "$ROOT" "$CACHE/kit-rehearsal-debootstrap.log" || exit 1
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
  chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive bash -c "
    set -e
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends ${IMAGE_STAND_IN[*]} > /dev/null
    dpkg --purge --force-depends libssl-dev > /dev/null 2>&1 || true
    apt-get clean" > "$CACHE/kit-rehearsal-packages.log" 2>&1 ||
    { tail -20 "$CACHE/kit-rehearsal-packages.log"; say "installing the image's stand-ins failed"; exit 1; }
  touch "$ROOT/.mpitrain-root-complete"
fi
say "root $ROOT ready after $(( $(date +%s) - t0 )) s ($(du -sh "$ROOT" 2>/dev/null | cut -f1))"

# The kit's packages must not be in the root: then the build can only have found them in the kit.
present=$(chroot "$ROOT" dpkg-query -W -f='${Package} ${Status}\n' libpcre2-dev libisal-dev libutf8proc-dev \
  libssl-dev nlohmann-json3-dev libcli11-dev libgtest-dev pkgconf pkg-config 2>/dev/null | grep ' installed$' || true)
if [ -n "$present" ]; then
  say "the root has packages the kit stands for: $present"
  exit 1
fi

# The checkout as CI's clone has it, and a fresh kit made on this host (as before a lease).
rm -rf "$ROOT/src/mpitrain"
mkdir -p "$ROOT/src/mpitrain"
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard | tar -cf - --null --no-recursion -T -) \
  | tar -C "$ROOT/src/mpitrain" -xf -
"$REPO/bench/device-kit.sh" "$ROOT/src/mpitrain/.device-kit"

inner=$(cat <<'EOF'
set -uo pipefail
export PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
cd /src/mpitrain
command -v pkg-config && { echo "kit-rehearsal: the root has a pkg-config of its own"; exit 1; }
start=$(date +%s)
REHEARSE=1 REHEARSE_BUILD=1 BUILD=build-rehearsal TRAIN_STEPS=60 JOBS=${JOBS:-2} \
  bash bench/gpu_check.sh /tmp/kit-rehearsal env build test train llama > /tmp/kit-rehearsal.log 2>&1
rc=$?
sed -n '/^=== env/,/^=== env:/p' /tmp/kit-rehearsal.log | grep -E "pkg-config|device kit|compilers"
sed -n '/^mpitrain gpu_check/,$p' /tmp/kit-rehearsal.log
echo "kit-rehearsal: gpu_check exit $rc in $(( $(date +%s) - start )) s"
grep -q $'^build\tcompile\tPASS' /tmp/kit-rehearsal/summary.tsv || { echo "kit-rehearsal: the build did not pass"; rc=1; }
# The build above included test_gpu (GoogleTest from the kit); libstdc++ comes first.
grep -q $'^test\tstd::filesystem calls reach libstdc++.*\tPASS' /tmp/kit-rehearsal/summary.tsv ||
  { echo "kit-rehearsal: test_stdlib_binding did not pass"; rc=1; }
# The binary uses the kit's libraries, found through its RPATH, not through a search path.
ldd build-rehearsal/mpitrain | grep -E "^\s(libpcre2-8|libisal|libutf8proc|libcrypto)\.so"
ldd build-rehearsal/mpitrain | grep -E "^\s(libpcre2-8|libisal|libutf8proc|libcrypto)\.so" | grep -qv "/src/mpitrain/.device-kit/" &&
  { echo "kit-rehearsal: a kit library resolved outside the kit"; rc=1; }
exit $rc
EOF
)
rc=0
unshare --mount --propagation private -- env ROOT="$ROOT" INNER="$inner" JOBS="${JOBS:-2}" bash -c '
  set -euo pipefail
  mount -t proc proc "$ROOT/proc"
  mount --rbind /sys "$ROOT/sys"
  mount --rbind /dev "$ROOT/dev"
  mount -t tmpfs -o size=4g tmpfs "$ROOT/dev/shm"
  mount -t tmpfs -o size=8g tmpfs "$ROOT/tmp"
  exec chroot "$ROOT" /usr/bin/env -i JOBS="$JOBS" bash -c "$INNER"
' || rc=$?
say "exit $rc, $(( $(date +%s) - t0 )) s in all"
exit $rc
