#!/usr/bin/env bash
# End-to-end test of the container kit (containers/): a real Docker swarm on this machine runs
# containers/stack.yml with 3 replicas of the image built from containers/Dockerfile, and a plain
# `mpirun -np 4 -hostfile hosts mpitrain config.yaml` started inside one container trains a small
# model across all three containers over ssh and the overlay network.
#
#   bash tests/multihost/swarm_test.sh [BINARY]            # from the repository root, as root
#   bash tests/multihost/swarm_test.sh --prepare [BINARY]  # only deps, base, dockerd, import and
#       build (into MPITRAIN_SWARM_DATA_ROOT, which it needs), then the cleanup: .ci/run starts it
#       beside the Debian 12 leg's tests, so that the test itself finds the image in the build
#       cache (from nothing its debootstrap and apt-get took 448 s beside those tests, which they
#       slowed: dpkg's unpacking is CPU work). It makes no link, swarm or rule, so the tests beside
#       it and it do not see each other's network state.
# One run at a time on a machine ($MPITRAIN_TEST_CACHE/swarm-test.lock, flock): the test waits for
# a preparation (or another run) to end, at most 20 minutes.
#
# What it does, each phase timed and bounded:
#   deps     apt-get installs docker.io, debootstrap, nftables when missing (never starting
#            Debian's own docker service)
#   base     a Debian 12 base image made here: debootstrap from the mirror apt is configured with,
#            cached as a tarball in $MPITRAIN_TEST_CACHE (default /var/cache/mpitrain-test), so only
#            the first run pays; then `docker import`
#   dockerd  its own dockerd (/usr/sbin/dockerd, Debian's) with its own socket, data-root,
#            exec-root and pidfile under a temp dir; no iptables rules, no ip_forward, no docker0,
#            and no registry pulls (DOCKER_SERVICE_PREFER_OFFLINE_IMAGE=1, --resolve-image never):
#            containers reach only each other on the overlay
#   build    containers/Dockerfile with BASE_IMAGE=the base above (the build's apt-get talks to the
#            mirror through the host's network); checks that the image holds no ssh keys
#   swarm    swarm init on 127.0.0.1 (no outside network needed), an attachable --internal overlay,
#            the ssh key pair (fresh) as a secret, `docker stack deploy` of containers/stack.yml
#   tasks    waits until the 3 tasks run; checks eth0 is the overlay NIC, sshd's settings, distinct
#            host keys
#   train    make-hostfile.sh in one container, a generated corpus packed in every container,
#            mpirun -np 4 across the 3 containers: exit 0, the host map says 3 hosts, a checkpoint
#   stop     a long run, then `docker stop` of a container holding a rank (not mpirun's): the job
#            checkpoints, every rank exits 75 and so does mpirun in the other container
#   cleanup  stack rm, swarm leave, dockerd stopped by PID, mounts, links, nft rules, sysctls,
#            temp dirs: the machine as it was (checked, and reported as PASS/FAIL)
#
# Output: PASS:/FAIL: lines, TIME: per phase, then "N passed, M failed". Exit 0 when all passed,
# 1 on any failure, 77 (with SKIP: reason) when this machine cannot run dockerd at all (no
# namespaces, cgroups, bridges or VXLAN).
#
# Argument: the mpitrain binary under test; the image uses it (build-arg MPITRAIN_PREBUILT)
# instead of compiling its own, unless MPITRAIN_SWARM_SOURCE_BUILD=1.
# Environment: MPITRAIN_TEST_CACHE (base tarball cache), MPITRAIN_SWARM_DATA_ROOT (keep dockerd's
# data-root there between runs: the build cache makes re-runs fast; default: a temp dir, removed),
# MPITRAIN_SWARM_PORT (swarm's listen port on 127.0.0.1, default 2377), MPITRAIN_SWARM_SUBNET
# (the overlay's subnet, default 10.77.0.0/16).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PREPARE=0
if [ "${1:-}" = --prepare ]; then PREPARE=1; shift; fi
CACHE=${MPITRAIN_TEST_CACHE:-/var/cache/mpitrain-test}
SWARM_PORT=${MPITRAIN_SWARM_PORT:-2377}
SUBNET=${MPITRAIN_SWARM_SUBNET:-10.77.0.0/16}
STACK=mpt
SERVICE=${STACK}_mpitrain
NETWORK=mpitrain-test-net
SECRET=mpitrain_ssh_key
IMAGE=mpitrain:swarm-test
BASE=mpitrain-base:bookworm
REPLICAS=3
NP=4
DOCKER=/usr/bin/docker    # Debian's client: /usr/local/bin/docker may be another, newer one
DOCKERD=/usr/sbin/dockerd

T0=$(date +%s.%N)
passed=0
failed=0
skip_reason=""
finished=0
WORK=""
DOCKERD_PID=""
PHASES=()
phase_name=""
phase_t0=""

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
info() { echo "  $*"; }
pass() { echo "PASS: $*"; passed=$((passed + 1)); }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }
check() {  # check "description" command...: PASS or FAIL by the command's status
  local what=$1; shift
  if "$@"; then pass "$what"; else fail "$what"; fi
}
phase() {
  end_phase
  phase_name=$1; phase_t0=$(now)
  echo "== $phase_name: $2"
}
end_phase() {
  if [ -n "$phase_name" ]; then
    local s; s=$(elapsed "$phase_t0")
    echo "TIME: $phase_name ${s}s"
    PHASES+=("$phase_name ${s}s")
    phase_name=""
  fi
}
skip() { skip_reason=$1; exit 77; }
abort() { fail "$1"; exit 1; }   # a failure after which nothing else can run

dk() {  # the test's own engine; every call bounded (DK_TIMEOUT seconds, default 120)
  DOCKER_CONFIG="$WORK/client" DOCKER_HOST="unix://$WORK/docker.sock" \
    timeout "${DK_TIMEOUT:-120}" "$DOCKER" "$@"
}

# ---- the state to restore ------------------------------------------------------------------------
links_of() { ip -o link show | awk -F': ' '{sub(/@.*/, "", $2); print $2}' | sort; }
snapshot() {
  BEFORE_LINKS=$(links_of)
  BEFORE_NFT=$(nft list ruleset 2>/dev/null || true)
  BEFORE_NFT_TABLES=$(nft list tables 2>/dev/null | sort || true)
  BEFORE_FWD=$(cat /proc/sys/net/ipv4/ip_forward)
  BEFORE_BRNF=()
  for f in /proc/sys/net/bridge/bridge-nf-call-iptables /proc/sys/net/bridge/bridge-nf-call-ip6tables \
           /proc/sys/net/bridge/bridge-nf-call-arptables; do
    [ -e "$f" ] && BEFORE_BRNF+=("$f=$(cat "$f")")
  done
  HAD_KEYJSON=0; [ -e /etc/docker/key.json ] && HAD_KEYJSON=1
  HAD_ETCDOCKER=0; [ -d /etc/docker ] && HAD_ETCDOCKER=1
  HAD_RUN=()
  for d in /run/docker /run/containerd; do [ -e "$d" ] && HAD_RUN+=("$d"); done
  HAD_CG=()
  for d in /sys/fs/cgroup/*/docker /sys/fs/cgroup/docker; do [ -d "$d" ] && HAD_CG+=("$d"); done
}

# Docker's rules, should any appear (this engine runs with --iptables=false): new tables go whole,
# in tables that were there before only DOCKER chains and the rules that jump to them.
nft_remove_docker() {
  command -v nft > /dev/null || return 0
  local fam tab line chain handle
  while read -r _ fam tab; do
    [ -n "$tab" ] || continue
    if ! grep -qx "table $fam $tab" <<< "$BEFORE_NFT_TABLES"; then
      nft list table "$fam" "$tab" 2>/dev/null | grep -qi docker && nft delete table "$fam" "$tab"
      continue
    fi
    chain=""
    nft -a list table "$fam" "$tab" 2>/dev/null | while read -r line; do
      case $line in
        chain\ *) chain=$(awk '{print $2}' <<< "$line") ;;
        *DOCKER*|*docker0*|*docker_gwbridge*)
          handle=$(sed -n 's/.*# handle \([0-9]*\)$/\1/p' <<< "$line")
          [[ $chain == DOCKER* ]] || { [ -n "$handle" ] && nft delete rule "$fam" "$tab" "$chain" handle "$handle"; } ;;
      esac
    done
    for chain in $(nft list table "$fam" "$tab" 2>/dev/null | awk '$1 == "chain" && $2 ~ /^DOCKER/ {print $2}'); do
      nft flush chain "$fam" "$tab" "$chain"
    done
    for chain in $(nft list table "$fam" "$tab" 2>/dev/null | awk '$1 == "chain" && $2 ~ /^DOCKER/ {print $2}'); do
      nft delete chain "$fam" "$tab" "$chain"
    done
  done < <(nft list tables 2>/dev/null)
}

mounts_under() { findmnt -rn -o TARGET 2>/dev/null | grep -F "$1/" | sort -r; }

cleanup() {
  [ -n "$WORK" ] || return 0
  echo "== cleanup"
  local t; t=$(now)
  if [ -n "$DOCKERD_PID" ] && kill -0 "$DOCKERD_PID" 2>/dev/null; then
    DK_TIMEOUT=60 dk stack rm "$STACK" > /dev/null 2>&1
    for _ in $(seq 60); do
      [ -z "$(DK_TIMEOUT=10 dk ps -aq --filter "label=com.docker.stack.namespace=$STACK" 2>/dev/null)" ] && break
      sleep 1
    done
    DK_TIMEOUT=30 dk network rm "$NETWORK" > /dev/null 2>&1
    DK_TIMEOUT=30 dk secret rm "$SECRET" > /dev/null 2>&1
    DK_TIMEOUT=60 dk swarm leave --force > /dev/null 2>&1
    DK_TIMEOUT=60 dk rm -f $(DK_TIMEOUT=10 dk ps -aq 2>/dev/null) > /dev/null 2>&1
    kill -TERM "$DOCKERD_PID" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$DOCKERD_PID" 2>/dev/null; then
      info "dockerd $DOCKERD_PID did not stop in 30 s: SIGKILL"
      kill -KILL "$DOCKERD_PID" 2>/dev/null; sleep 1
    fi
  fi
  # Whatever still runs from the test's directories (containerd, shims), by PID.
  local pids
  pids=$(pgrep -f -- "$WORK/" || true)
  if [ -n "$pids" ]; then
    info "stopping leftover processes: $(echo $pids)"
    kill -TERM $pids 2>/dev/null; sleep 2
    pids=$(pgrep -f -- "$WORK/" || true)
    [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
  fi
  local m data_root=${MPITRAIN_SWARM_DATA_ROOT:-}
  for m in $(mounts_under "$WORK") $([ -n "$data_root" ] && mounts_under "$data_root"); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
  done
  # Links Docker made (only those that were not there before).
  local l
  for l in $(comm -13 <(echo "$BEFORE_LINKS") <(links_of)); do
    case $l in
      docker0|docker_gwbridge|br-[0-9a-f]*) ip link delete "$l" 2>/dev/null ;;
    esac
  done
  nft_remove_docker
  [ "$(cat /proc/sys/net/ipv4/ip_forward)" = "$BEFORE_FWD" ] || echo "$BEFORE_FWD" > /proc/sys/net/ipv4/ip_forward
  local kv
  for kv in "${BEFORE_BRNF[@]}"; do
    [ "$(cat "${kv%%=*}")" = "${kv#*=}" ] || echo "${kv#*=}" > "${kv%%=*}"
  done
  [ "$HAD_KEYJSON" = 1 ] || rm -f /etc/docker/key.json
  [ "$HAD_ETCDOCKER" = 1 ] || rmdir /etc/docker 2>/dev/null
  local d
  for d in /run/docker /run/containerd; do
    [[ " ${HAD_RUN[*]} " == *" $d "* ]] || rm -rf "$d"
  done
  for d in /sys/fs/cgroup/*/docker /sys/fs/cgroup/docker; do
    [ -d "$d" ] || continue
    [[ " ${HAD_CG[*]} " == *" $d "* ]] && continue
    find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null
  done
  local left; left=$(mounts_under "$WORK")
  if [ -z "$left" ]; then
    rm -rf "$WORK"
  else
    info "not removing $WORK: still mounted: $(echo $left)"
  fi

  # ---- is the machine as it was? -------------------------------------------------------------------
  if [ -n "$DOCKERD_PID" ]; then
    check "cleanup: dockerd $DOCKERD_PID stopped" bash -c "! kill -0 $DOCKERD_PID 2>/dev/null"
  fi
  pids=$(pgrep -f -- "$WORK/" || true)
  check "cleanup: no process left from $WORK${pids:+: $(echo $pids)}" test -z "$pids"
  local extra; extra=$(comm -13 <(echo "$BEFORE_LINKS") <(links_of) | grep -E '^(docker|br-|veth|vx-)' || true)
  check "cleanup: no docker links left (ip link)${extra:+: $(echo $extra)}" test -z "$extra"
  if command -v nft > /dev/null; then
    local after; after=$(nft list ruleset 2>/dev/null || true)
    if [ "$after" = "$BEFORE_NFT" ]; then pass "cleanup: nft ruleset as before"
    else fail "cleanup: nft ruleset differs:"; diff <(echo "$BEFORE_NFT") <(echo "$after") | head -20; fi
  fi
  check "cleanup: ip_forward back to $BEFORE_FWD" test "$(cat /proc/sys/net/ipv4/ip_forward)" = "$BEFORE_FWD"
  check "cleanup: no mounts under $WORK, temp dir removed" test ! -e "$WORK"
  echo "TIME: cleanup $(elapsed "$t")s"
  PHASES+=("cleanup $(elapsed "$t")s")
}

finish() {
  local rc=$?
  [ "$finished" = 1 ] && return
  finished=1
  trap - INT TERM
  end_phase
  cleanup
  echo
  echo "phases: ${PHASES[*]/%/,} total $(elapsed "$T0")s"
  if [ -n "$skip_reason" ] && [ "$failed" -eq 0 ]; then
    echo "SKIP: $skip_reason"
    echo "$passed passed, $failed failed, 1 skipped"
    exit 77
  fi
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 1 ] && [ "$failed" -eq 0 ]; then
    fail "aborted (exit status $rc)"
  fi
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ] && exit 0 || exit 1
}
trap finish EXIT
trap 'echo "interrupted"; exit 130' INT TERM

# ==== preflight ====================================================================================
phase deps "packages and what the kernel allows"
[ "$(id -u)" -eq 0 ] || skip "needs root (dockerd, swarm, debootstrap)"
[ -f "$REPO/containers/Dockerfile" ] && [ -f "$REPO/containers/stack.yml" ] \
  || abort "run from the mpitrain repository (containers/ not found under $REPO)"

# One run at a time (the build cache and dockerd's data-root are one per machine): a preparation
# started beside the other tests holds the lock until its image is built.
mkdir -p "$CACHE"
exec 9> "$CACHE/swarm-test.lock"
if ! flock -n 9; then
  info "waiting for another run of this test (or its preparation) to end: $CACHE/swarm-test.lock"
  t_lock=$(now)
  flock -w 1200 9 || abort "another swarm test held $CACHE/swarm-test.lock for 20 minutes"
  info "waited $(elapsed "$t_lock")s for it"
fi
if [ $PREPARE = 1 ] && [ -z "${MPITRAIN_SWARM_DATA_ROOT:-}" ]; then
  abort "--prepare needs MPITRAIN_SWARM_DATA_ROOT (a data-root kept for the test: otherwise it prepares nothing)"
fi

need=()
for p in docker.io debootstrap nftables iproute2 openssh-client; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  info "installing ${need[*]}"
  # Debian's docker.io would start its own dockerd on /run/docker.sock: no daemon starts
  # (scripts/apt-install-no-daemons; it also waits for another package manager).
  "$REPO/scripts/apt-install-no-daemons" /tmp/mpitrain-swarm-apt.$$.log "${need[@]}" \
    || abort "apt-get install ${need[*]} (log: /tmp/mpitrain-swarm-apt.$$.log)"
  rm -f /tmp/mpitrain-swarm-apt.$$.log
fi
check "packages: docker.io, debootstrap, nftables present" test -x "$DOCKERD" -a -x "$DOCKER" -a -x /usr/sbin/debootstrap
[ -x "$DOCKERD" ] && [ -x "$DOCKER" ] || exit 1
info "$("$DOCKERD" --version)"

# What dockerd needs from the kernel, tried in throwaway namespaces (nothing on the host changes).
err=$(unshare --mount --uts --ipc --net --pid --fork true 2>&1) \
  || skip "cannot create namespaces (unshare: $err)"
cg_probe=""
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
  cg_probe=/sys/fs/cgroup/mpitrain-swarm-probe.$$
elif [ -d /sys/fs/cgroup/memory ]; then
  cg_probe=/sys/fs/cgroup/memory/mpitrain-swarm-probe.$$
fi
[ -n "$cg_probe" ] || skip "no cgroup filesystem mounted at /sys/fs/cgroup"
mkdir "$cg_probe" 2>/dev/null && rmdir "$cg_probe" || skip "cannot create cgroups under /sys/fs/cgroup"
err=$(unshare --net sh -c 'ip link add mpt-br type bridge && ip link add mpt-vx type vxlan id 42 dstport 4789 local 127.0.0.1' 2>&1) \
  || skip "cannot create bridge/VXLAN interfaces (overlay networks need both): $err"
grep -qw overlay /proc/filesystems || info "no overlayfs: dockerd falls back to a slow storage driver"
if ip link show docker_gwbridge > /dev/null 2>&1; then
  skip "another Docker engine's docker_gwbridge exists; the test's own engine cannot share it"
fi
if ss -Hltn "sport = :$SWARM_PORT" 2>/dev/null | grep -q .; then
  abort "port $SWARM_PORT is in use (set MPITRAIN_SWARM_PORT)"
fi
pass "kernel: namespaces, cgroups, bridge and VXLAN available"

snapshot
WORK=$(mktemp -d /tmp/mpitrain-swarm.XXXXXX)
mkdir -p "$WORK/client" "$CACHE"

# ==== base image ===================================================================================
phase base "Debian 12 base image (debootstrap, cached)"
mirror=$("$REPO/scripts/debian-mirror.sh" bookworm)
arch=$(dpkg --print-architecture)
tarball=$CACHE/debootstrap-bookworm-minbase-$arch-$(printf '%s' "$mirror" | md5sum | cut -c1-8).tar
info "mirror $mirror, cache $tarball"
if [ -s "$tarball" ]; then
  pass "base: cached debootstrap tarball ($(du -h "$tarball" | cut -f1))"
else
  info "debootstrap --variant=minbase bookworm (first run only: a few minutes)"
  # Like Debian's official images, dpkg in it does not fsync each file (docker-apt-speedup).
  if timeout 1200 debootstrap --variant=minbase bookworm "$WORK/rootfs" "$mirror" > "$WORK/debootstrap.log" 2>&1 \
     && rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"* \
     && printf 'force-unsafe-io\n' > "$WORK/rootfs/etc/dpkg/dpkg.cfg.d/docker-apt-speedup" \
     && tar -C "$WORK/rootfs" --numeric-owner -cf "$tarball.tmp.$$" . && mv "$tarball.tmp.$$" "$tarball"; then
    pass "base: debootstrap bookworm from $mirror"
  else
    tail -15 "$WORK/debootstrap.log"; rm -f "$tarball.tmp.$$"
    abort "base: debootstrap bookworm from $mirror"
  fi
  for m in $(mounts_under "$WORK/rootfs"); do umount -l "$m"; done
  rm -rf "$WORK/rootfs"
fi

# ==== dockerd ======================================================================================
phase dockerd "the test's own dockerd"
echo '{}' > "$WORK/daemon.json"
data_root=${MPITRAIN_SWARM_DATA_ROOT:-$WORK/data}
mkdir -p "$data_root" "$WORK/exec"
DOCKER_SERVICE_PREFER_OFFLINE_IMAGE=1 "$DOCKERD" \
  --config-file "$WORK/daemon.json" -H "unix://$WORK/docker.sock" \
  --data-root "$data_root" --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" \
  --iptables=false --ip-masq=false --ip-forward=false --bridge=none \
  --log-level warn > "$WORK/dockerd.log" 2>&1 9>&- &
DOCKERD_PID=$!
up=0
for _ in $(seq 60); do
  kill -0 "$DOCKERD_PID" 2>/dev/null || break
  DK_TIMEOUT=5 dk version > /dev/null 2>&1 && { up=1; break; }
  sleep 1
done
if [ $up -ne 1 ]; then
  tail -20 "$WORK/dockerd.log"
  abort "dockerd: did not come up in 60 s"
fi
pass "dockerd: pid $DOCKERD_PID on $WORK/docker.sock ($(dk version -f '{{.Server.Version}}'))"

phase import "docker import of the base"
# With a kept data-root (MPITRAIN_SWARM_DATA_ROOT) the base from an earlier run is reused, so the
# build cache stays valid; a fresh import would be a new image and rebuild everything.
base_label=$(basename "$tarball")
if [ "$(dk image inspect -f '{{index .Config.Labels "mpitrain.base"}}' "$BASE" 2>/dev/null)" = "$base_label" ]; then
  pass "import: $BASE already there (kept data-root)"
elif DK_TIMEOUT=300 dk import --change "LABEL mpitrain.base=$base_label" "$tarball" "$BASE" > /dev/null; then
  pass "import: $BASE"
else
  abort "import: $BASE"
fi

# ==== build ========================================================================================
phase build "containers/Dockerfile (apt-get from the mirror; the tested binary or a CMake build of mpitrain)"
# The context: the source tree as git sees it (tracked and new files, not the ignored build*/,
# runs/, data/), which is what containers/Dockerfile.dockerignore leaves to BuildKit.
mkdir -p "$WORK/context"
if git -C "$REPO" rev-parse --git-dir > /dev/null 2>&1; then
  (cd "$REPO" && git ls-files -z -co --exclude-standard \
     | tar --null --ignore-failed-read --no-recursion -T - -c 2>/dev/null) | tar -C "$WORK/context" -x
else
  (cd "$REPO" && tar --exclude='./build*' --exclude=./runs --exclude=./data --exclude=./.git -c .) \
    | tar -C "$WORK/context" -x
fi
info "context: $(du -sh "$WORK/context" | cut -f1), $(find "$WORK/context" -type f | wc -l) files"
# The binary this test was given (built on this Debian 12 host, the base image's release) goes
# into the image instead of a second compile inside the build, unless MPITRAIN_SWARM_SOURCE_BUILD=1
# (then the Dockerfile's CMake build runs, as for users).
prebuilt=()
if [ "${MPITRAIN_SWARM_SOURCE_BUILD:-0}" != 1 ] && [ -n "${1:-}" ] && [ -x "${1:-}" ]; then
  mkdir -p "$WORK/context/.prebuilt" && cp "$1" "$WORK/context/.prebuilt/mpitrain"
  # The packages it loads, learned here where it runs (the image's build stage then installs none
  # of the build packages: from nothing that was half of this phase).
  "$REPO/containers/runtime-packages.sh" "$1" > "$WORK/context/.prebuilt/packages.txt" \
    || abort "build: containers/runtime-packages.sh $1"
  prebuilt=(--build-arg MPITRAIN_PREBUILT=.prebuilt/mpitrain
            --build-arg MPITRAIN_PREBUILT_PACKAGES=.prebuilt/packages.txt)
  info "mpitrain: the tested binary $1 and its $(wc -l < "$WORK/context/.prebuilt/packages.txt") runtime packages (MPITRAIN_SWARM_SOURCE_BUILD=1 compiles it in the image instead)"
fi
# Host network for the build's RUN steps: the mirror is reached as the host reaches it, with no
# docker0, NAT or ip_forward.
if DOCKER_BUILDKIT=0 DK_TIMEOUT=3000 dk build --network host -f containers/Dockerfile \
     --build-arg BASE_IMAGE="$BASE" "${prebuilt[@]}" -t "$IMAGE" "$WORK/context" > "$WORK/build.log" 2>&1; then
  pass "build: $IMAGE ($(dk image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1 / 1e6}'))"
  grep -E '^runtime packages:' "$WORK/build.log" | sed 's/^/  /'
else
  tail -40 "$WORK/build.log"
  abort "build: containers/Dockerfile"
fi
baked=$(dk run --rm --network none --entrypoint /bin/sh "$IMAGE" -c \
  'ls /etc/ssh/ssh_host_* /root/.ssh/* /etc/mpitrain/ssh/* 2>/dev/null; true')
check "image: no ssh host keys or user keys baked in${baked:+: $(echo $baked)}" test -z "$baked"
if [ $PREPARE = 1 ]; then
  end_phase
  info "prepared: $IMAGE in $MPITRAIN_SWARM_DATA_ROOT's build cache (--prepare stops here)"
  exit 0
fi

# ==== swarm ========================================================================================
phase swarm "swarm init, overlay network, secret, stack deploy"
if dk swarm init --advertise-addr 127.0.0.1 --listen-addr "127.0.0.1:$SWARM_PORT" > "$WORK/swarm.log" 2>&1; then
  pass "swarm: init on 127.0.0.1:$SWARM_PORT"
else
  cat "$WORK/swarm.log"; abort "swarm: init"
fi
# --internal: the containers reach each other and nothing else (the stack works the same on a
# non-internal network, where each container also has a way out on eth1).
if dk network create --driver overlay --attachable --internal --subnet "$SUBNET" "$NETWORK" > /dev/null; then
  pass "network: overlay $NETWORK $SUBNET (attachable, internal)"
else abort "network: overlay $NETWORK"; fi
ssh-keygen -q -t ed25519 -N '' -C mpitrain-swarm-test -f "$WORK/ssh_key"
if dk secret create "$SECRET" "$WORK/ssh_key" > /dev/null; then pass "secret: $SECRET from a fresh key pair"
else abort "secret: $SECRET"; fi
if MPITRAIN_IMAGE=$IMAGE MPITRAIN_REPLICAS=$REPLICAS MPITRAIN_SLOTS=2 MPITRAIN_NETWORK=$NETWORK \
   MPITRAIN_SUBNET=$SUBNET MPITRAIN_SSH_SECRET=$SECRET \
   dk stack deploy --resolve-image never -c "$REPO/containers/stack.yml" "$STACK" > "$WORK/deploy.log" 2>&1; then
  pass "stack: deploy containers/stack.yml as $STACK ($REPLICAS replicas)"
  grep -i -E 'warn|ignor|unsupported' "$WORK/deploy.log" | sed 's/^/  /'
else
  cat "$WORK/deploy.log"; abort "stack: deploy containers/stack.yml"
fi

# ==== tasks ========================================================================================
phase tasks "waiting for $REPLICAS running tasks"
ctrs=""
for _ in $(seq 90); do
  states=$(dk service ps --filter desired-state=running --format '{{.CurrentState}}' "$SERVICE" 2>/dev/null)
  ctrs=$(dk ps -q --filter "label=com.docker.swarm.service.name=$SERVICE" --filter status=running 2>/dev/null)
  nrun=$(grep -c '^Running' <<< "$states")
  [ "$nrun" -eq $REPLICAS ] && [ "$(grep -c . <<< "$ctrs")" -eq $REPLICAS ] && break
  sleep 2
done
if [ "$(grep -c . <<< "$ctrs")" -ne $REPLICAS ]; then
  dk service ps --no-trunc "$SERVICE"
  for c in $(dk ps -aq --filter "label=com.docker.swarm.service.name=$SERVICE" | head -3); do
    dk logs "$c" 2>&1 | tail -10
  done
  abort "tasks: $REPLICAS running in 180 s"
fi
pass "tasks: $REPLICAS running"
ctrs=$(echo $ctrs)
first=${ctrs%% *}
declare -A HOSTNAME_OF=()
ok_if=1; fps=""; sshd_ok=1
for c in $ctrs; do
  h=$(dk exec "$c" hostname)
  HOSTNAME_OF[$h]=$c
  a=$(dk exec "$c" ip -4 -o addr show dev eth0 | awk '{print $4}')
  ifs=$(dk exec "$c" ip -4 -o addr show scope global | awk '{printf "%s=%s ", $2, $4}')
  info "$h ($c): $ifs"
  in_subnet=$(awk -v a="${a%/*}" -v n="${SUBNET%/*}" -v l="${SUBNET#*/}" 'function ip(s, p) { split(s, p, "."); return ((p[1] * 256 + p[2]) * 256 + p[3]) * 256 + p[4] }
    BEGIN { m = 2 ^ (32 - l); print (int(ip(a) / m) == int(ip(n) / m)) ? 1 : 0 }')
  [ "$in_subnet" = 1 ] || ok_if=0
  fps+="$(dk exec "$c" ssh-keygen -l -f /etc/ssh/ssh_host_ed25519_key.pub | cut -d' ' -f2) "
  t=$(dk exec "$c" sshd -T 2>/dev/null | awk '$1 ~ /^(permitrootlogin|passwordauthentication|kbdinteractiveauthentication|pubkeyauthentication)$/ {print $1 "=" $2}' | sort | tr '\n' ' ')
  [ "$t" = "kbdinteractiveauthentication=no passwordauthentication=no permitrootlogin=without-password pubkeyauthentication=yes " ] \
    || { sshd_ok=0; info "sshd -T on $h: $t"; }
done
check "network: eth0 is the overlay NIC ($SUBNET) in every task" test $ok_if = 1
check "ssh: host keys generated per container ($(echo $fps | wc -w) keys, $(echo $fps | tr ' ' '\n' | sort -u | grep -c .) distinct)" \
  test "$(echo $fps | tr ' ' '\n' | sort -u | grep -c .)" -eq $REPLICAS
check "ssh: sshd is key-only, root without password" test $sshd_ok = 1

# ==== train ========================================================================================
phase train "make-hostfile.sh, corpus, mpirun -np $NP across the containers"
if DK_TIMEOUT=150 dk exec -w /root "$first" make-hostfile.sh -n $REPLICAS -S 2 -t 120 -o /root/hosts > "$WORK/hostfile.log" 2>&1; then
  sed 's/^/  /' "$WORK/hostfile.log"
  hosts=$(dk exec "$first" cat /root/hosts)
  sed 's/^/  hosts: /' <<< "$hosts"
  check "hostfile: $REPLICAS tasks from tasks.mpitrain, slots=2 each" \
    test "$(grep -c ' slots=2$' <<< "$hosts")" -eq $REPLICAS
else
  cat "$WORK/hostfile.log"; fail "hostfile: make-hostfile.sh"
fi
# A key the service does not know gets no login (-F /dev/null: not the image's client config,
# which would offer the service's key as well).
other=$(dk exec "$first" sh -c 'ssh-keygen -q -t ed25519 -N "" -f /tmp/other_key
  a=$(sed -n "s/ slots=.*//p" /root/hosts | tail -1)
  ssh -F /dev/null -i /tmp/other_key -o IdentitiesOnly=yes -o BatchMode=yes -o StrictHostKeyChecking=no \
      -o UserKnownHostsFile=/dev/null -o PasswordAuthentication=no "root@$a" true 2>&1 && echo LOGGED-IN
  rm -f /tmp/other_key /tmp/other_key.pub')
check "ssh: a key other than the secret's is refused ($(grep -o 'Permission denied[^.]*' <<< "$other" | head -1))" \
  bash -c '! grep -q LOGGED-IN <<< "$1" && grep -q "Permission denied" <<< "$1"' _ "$other"

# Every container needs the data at the same path (on a cluster: a shared filesystem): the same
# generated text, packed in each (the packer is deterministic).
corpus_ok=1
for c in $ctrs; do
  DK_TIMEOUT=120 dk exec -i -w /root "$c" bash -s > "$WORK/pack-$c.log" 2>&1 <<'EOF' || corpus_ok=0
set -e
mkdir -p /root/data
awk 'BEGIN { srand(7)
  n = split("the a model rank host learns data token step loss train swarm node gradient batch " \
            "container network sends every reads writes small large quick slow byte shard " \
            "checkpoint all reduce broadcast", w, " ")
  for (d = 0; d < 400; d++) {
    for (l = 0; l < 6; l++) {
      k = 4 + int(rand() * 9); s = ""
      for (i = 0; i < k; i++) s = s (i ? " " : "") w[1 + int(rand() * n)]
      print toupper(substr(s, 1, 1)) substr(s, 2) "."
    }
    print "%"
  } }' > /root/corpus.txt
mpitrain pack /root/corpus.txt -o /root/data/corpus --doc-separator % --val-fraction 0.1
ls /root/data
EOF
done
check "corpus: generated and packed in all $REPLICAS containers ($(dk exec "$first" sh -c 'wc -c < /root/corpus.txt' 2>/dev/null) bytes each)" test $corpus_ok = 1
[ $corpus_ok = 1 ] || cat "$WORK"/pack-*.log | tail -20

# Every rank reads the config too: it goes into every container.
cat > "$WORK/config.yaml" <<'EOF'
# swarm_test.sh: a few steps of a tiny model on the generated corpus
model: {preset: custom, n_layer: 2, n_head: 2, n_embd: 32, seq_len: 32}
data:
  train: [/root/data/corpus-train-*.h5]
  val: [/root/data/corpus-val-*.h5]
train: {micro_batch: 4, steps: 5, threads: 1, out_dir: /root/run}
optim: {lr: 0.003, min_lr: 0.0003, warmup_steps: 1}
eval: {every: 5, batches: 2}
log: {every: 1}
checkpoint: {dir: /root/run/checkpoints, every: 0, keep: 1, resume: none}
EOF
for c in $ctrs; do dk exec -i "$c" sh -c 'cat > /root/config.yaml' < "$WORK/config.yaml"; done
# Ranks round-robin over the containers (--map-by node), so 4 ranks land on all 3.
t_mpi=$(now)
DK_TIMEOUT=300 dk exec -w /root "$first" \
  mpirun -np $NP --map-by node -hostfile /root/hosts mpitrain /root/config.yaml > "$WORK/mpirun.log" 2>&1
mpi_rc=$?
info "mpirun took $(elapsed "$t_mpi")s; its output:"
tail -25 "$WORK/mpirun.log" | sed 's/^/  | /'
check "mpirun: exit status 0 (was $mpi_rc)" test $mpi_rc -eq 0
hostmap=$(grep -Eo '[0-9]+ ranks on [0-9]+ hosts?:.*' "$WORK/mpirun.log" | head -1)
check "mpirun: host map reports $NP ranks on $REPLICAS hosts (${hostmap:-no host map line})" \
  grep -Eq "^$NP ranks on $REPLICAS hosts:" <<< "$hostmap"
rank0_host=$(sed -E 's/^[^:]*: *([^[ ]+)\[.*/\1/' <<< "$hostmap")
rank0_ctr=${HOSTNAME_OF[$rank0_host]:-}
ckpt=""
[ -n "$rank0_ctr" ] && ckpt=$(dk exec "$rank0_ctr" sh -c 'ls /root/run/checkpoints/*.h5 2>/dev/null')
check "checkpoint: written by rank 0 on ${rank0_host:-?} (${ckpt:-none})" \
  grep -q 'ckpt-00000005\.h5' <<< "$ckpt"
end_phase

# ==== stop =========================================================================================
# A container stop (docker stop, a node drain) must keep the trainer's promise: the ranks in the
# stopped container get SIGTERM from its entrypoint, the whole job checkpoints, every rank exits 75
# and so does the mpirun in another container.
phase stop "docker stop of one container mid-run: checkpoint, exit 75"
victim=""
for c in $ctrs; do
  [ "$c" != "$first" ] && [ "$c" != "$rank0_ctr" ] && { victim=$c; break; }
done
sed -e 's/steps: 5,/steps: 1000000,/' -e 's#/root/run#/root/run-stop#g' -e 's/eval: {every: 5, batches: 2}/eval: {every: 0}/' \
  "$WORK/config.yaml" > "$WORK/config-stop.yaml"
for c in $ctrs; do dk exec -i "$c" sh -c 'cat > /root/config-stop.yaml' < "$WORK/config-stop.yaml"; done
DK_TIMEOUT=300 dk exec -w /root "$first" \
  mpirun -np $NP --map-by node -hostfile /root/hosts mpitrain /root/config-stop.yaml > "$WORK/stop.log" 2>&1 &
stop_pid=$!
for _ in $(seq 1 600); do grep -q 'step  *20/' "$WORK/stop.log" && break; sleep 0.1; done
victim_host=$(dk exec "$victim" hostname 2>/dev/null)
info "training reached step $(grep -Eo 'step +[0-9]+/' "$WORK/stop.log" | tail -1 | tr -dc 0-9); docker stop $victim_host"
t_stop=$(now)
DK_TIMEOUT=150 dk stop -t 120 "$victim" > /dev/null 2>&1
stop_s=$(elapsed "$t_stop")
wait $stop_pid
stop_rc=$?
tail -6 "$WORK/stop.log" | sed 's/^/  | /'
dk logs "$victim" 2>&1 | grep 'mpitrain-entrypoint: SIG\|exited .* after' | sed 's/^/  victim: /'
check "container stop: the entrypoint passed SIGTERM to the rank in $victim_host" \
  bash -c 'grep -q "SIGTERM to 1 mpitrain rank" <<< "$1"' _ "$(dk logs "$victim" 2>&1)"
check "container stop: every rank stopped after a checkpoint ($(grep -Eo 'stopped by signal [0-9]+ after step [0-9]+' "$WORK/stop.log" | head -1))" \
  grep -q 'stopped by signal 15 after step [0-9]*: checkpoint written, exit code 75' "$WORK/stop.log"
check "container stop: mpirun in another container exited 75 (was $stop_rc); docker stop took ${stop_s}s of its 120 s grace" \
  test "$stop_rc" -eq 75
stopped_at=$(grep -Eo 'stopped by signal 15 after step [0-9]+' "$WORK/stop.log" | head -1 | grep -Eo '[0-9]+$')
stop_ckpt=$(dk exec "$rank0_ctr" sh -c 'ls /root/run-stop/checkpoints/ 2>/dev/null')
check "container stop: the checkpoint of step ${stopped_at:-?} is on rank 0's host (${stop_ckpt//$'\n'/ })" \
  grep -q "ckpt-$(printf '%08d' "${stopped_at:-0}")\.h5" <<< "$stop_ckpt"
end_phase
