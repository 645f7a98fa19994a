#!/usr/bin/env bash
# A real multi-host run on one machine. Three network namespaces joined by a Linux bridge play
# three hosts: each has its own address, its own hostname (a UTS namespace) and its own sshd.
# From node 1 a plain `mpirun --hostfile` starts 2 + 1 + 1 = 4 ranks over ssh, exactly as on a
# cluster (the filesystem is shared, so the binary's path is the same on every "host"), and the
# test checks the placement and local ranks, mpitrain's logged host map, a short training run
# with a checkpoint, and `mpitrain netcheck`.
#
# Usage: bash tests/multihost/netns_test.sh PATH/TO/mpitrain
# Needs root (exit 77 = skipped when network namespaces cannot be created), iproute2,
# openssh-server and -client, util-linux, openmpi-bin. Takes 35-75 s on a busy 2-core VM (the
# ranks, orteds and sshds of all three "hosts" share its cores); each mpirun is limited to
# NETNS_TEST_MPIRUN_LIMIT seconds (default 120).
#
# Isolation: the bridge lives in a fourth namespace, so nothing is added to the machine's own
# network namespace (no interface, address, route or sysctl); the nodes talk only to each other
# on 10.213.7.0/24 and to their own loopback. Everything is removed on exit, also on failure,
# timeout or Ctrl-C: the sshds and anything else left running in the namespaces (by PID), the
# namespaces with their veths and bridge, and the temporary directory.
set -u

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"

[ $# -eq 1 ] || { echo "usage: $0 PATH/TO/mpitrain" >&2; exit 2; }
BIN=$(realpath -e "$1" 2>/dev/null) || { echo "$0: no such file: $1" >&2; exit 2; }

NET=10.213.7                     # private subnet that exists only inside the namespaces
CIDR=$NET.0/24
HOSTS=(mpt-node1 mpt-node2 mpt-node3)
ADDRS=("$NET.1" "$NET.2" "$NET.3")
SLOTS=(2 1 1)
ID=mpt$$                         # namespace names are unique per run
NODE_NS=("$ID-n1" "$ID-n2" "$ID-n3")
SWITCH_NS=$ID-sw
MPIRUN_LIMIT=${NETNS_TEST_MPIRUN_LIMIT:-120}   # seconds per mpirun

T=""                             # temporary directory
MADE_NS=()                       # namespaces this run created
SSHD_PIDS=()                     # one sshd per node, started by this run
MADE_RUN_SSHD=0                  # whether this run created /run/sshd (sshd's privsep dir)
SKIPPED=0

exec 3>&1 4>&2                   # the test's own stdout/stderr, for cleanup()

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  exec 1>&3 2>&4                 # a signal may arrive while output goes to a log file
  [ "$SKIPPED" -eq 1 ] && rc=77
  local child=$MT_CHILD           # a bounded command still running (interrupted)
  [ -n "$child" ] && kill "$child" 2>/dev/null
  local pid ns left
  for pid in "${SSHD_PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  # Whatever still runs inside the namespaces (ssh sessions, orted, ranks) was started by this
  # test through its own sshds or mpirun: TERM it, then KILL what is left after 5 s.
  for ns in "${MADE_NS[@]}"; do
    left=$(ip netns pids "$ns" 2>/dev/null)
    # shellcheck disable=SC2086  # a list of PIDs
    [ -n "$left" ] && kill $left 2>/dev/null
  done
  for _ in $(seq 50); do
    left=""
    for ns in "${MADE_NS[@]}"; do left+=$(ip netns pids "$ns" 2>/dev/null); done
    [ -z "$left" ] && break
    sleep 0.1
  done
  for ns in "${MADE_NS[@]}"; do
    left=$(ip netns pids "$ns" 2>/dev/null)
    # shellcheck disable=SC2086
    [ -n "$left" ] && kill -KILL $left 2>/dev/null
  done
  for pid in "${SSHD_PIDS[@]}" $child; do wait "$pid" 2>/dev/null; done
  # Deleting a namespace deletes its interfaces; each veth pair goes with either end.
  for ns in "${MADE_NS[@]}"; do ip netns del "$ns" 2>/dev/null; done
  cd / && [ -n "$T" ] && rm -rf "$T"
  if [ "$MADE_RUN_SSHD" -eq 1 ]; then  # unless some other sshd has started meanwhile
    for _ in $(seq 20); do pgrep -x sshd >/dev/null || break; sleep 0.1; done
    pgrep -x sshd >/dev/null || rmdir /run/sshd 2>/dev/null
  fi
  if [ "$rc" -eq 77 ]; then exit 77; fi
  if [ ${#MADE_NS[@]} -gt 0 ]; then
    left=$(ip netns list | grep -c "^$ID-")
    for pid in "${SSHD_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && left=$((left + 1)); done
    check "cleanup left no namespace or sshd behind" "[ $left -eq 0 ]"
  fi
  case $rc in 130|143) bad "interrupted by signal $((rc - 128))" ;; esac
  summary
  [ "$MT_FAILED" -eq 0 ] && [ "$rc" -eq 0 ] && exit 0
  exit 1
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

setup_fail() { bad "setup: $1"; [ -n "${2:-}" ] && show_tail "$2"; exit 1; }
run_quiet() { "$@" >"$T/setup.log" 2>&1 || setup_fail "$* (exit $?)" "$T/setup.log"; }

# ---- can this machine create network namespaces? ----------------------------------------------
[ "$(id -u)" -eq 0 ] || { SKIPPED=1; skip "network namespaces need root (uid $(id -u))"; }
for tool in ip unshare nsenter timeout /usr/sbin/sshd ssh ssh-keygen mpirun; do
  command -v "$tool" >/dev/null || setup_fail "missing $tool (packages iproute2, util-linux, openssh-server, openssh-client, openmpi-bin)"
done
if ! err=$(ip netns add "$SWITCH_NS" 2>&1); then
  case $err in
    *"Operation not permitted"*|*"Permission denied"*)
      SKIPPED=1; skip "cannot create network namespaces here: $err" ;;
  esac
  setup_fail "ip netns add $SWITCH_NS: $err"
fi
MADE_NS+=("$SWITCH_NS")
T=$(mktemp -d /tmp/mpt-netns-XXXXXX)

# ---- network: node i's eth0 <-> veth p<i> on bridge br0 in the switch namespace -----------------
run_quiet ip -n "$SWITCH_NS" link add br0 type bridge
run_quiet ip -n "$SWITCH_NS" link set br0 up
for i in 0 1 2; do
  ns=${NODE_NS[$i]}
  run_quiet ip netns add "$ns"
  MADE_NS+=("$ns")
  run_quiet ip link add name "p$((i + 1))" netns "$SWITCH_NS" type veth peer name eth0 netns "$ns"
  run_quiet ip -n "$SWITCH_NS" link set "p$((i + 1))" master br0 up
  run_quiet ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
  run_quiet ip -n "$ns" addr add "${ADDRS[$i]}/24" dev eth0
  run_quiet ip -n "$ns" link set lo up
  run_quiet ip -n "$ns" link set eth0 up
done
run_quiet ip netns exec "$SWITCH_NS" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1

# ---- ssh: a client key, a host key and an sshd per node, known_hosts filled in advance ---------
run_quiet ssh-keygen -q -t ed25519 -N '' -C mpt-netns-client -f "$T/id_ed25519"
cp "$T/id_ed25519.pub" "$T/authorized_keys"
cat > "$T/ssh_config" <<EOF
Host *
  User root
  IdentityFile $T/id_ed25519
  IdentitiesOnly yes
  IdentityAgent none
  UserKnownHostsFile $T/known_hosts
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
  CheckHostIP no
  UpdateHostKeys no
  BatchMode yes
  ConnectTimeout 5
  ControlMaster no
  ControlPath none
  ForwardAgent no
  ForwardX11 no
  LogLevel ERROR
EOF
: > "$T/known_hosts"
if [ ! -d /run/sshd ]; then mkdir -m 755 /run/sshd 2>/dev/null && MADE_RUN_SSHD=1; fi
for i in 0 1 2; do
  d=$T/node$((i + 1))
  mkdir "$d"
  run_quiet ssh-keygen -q -t ed25519 -N '' -C "${HOSTS[$i]}" -f "$d/ssh_host_ed25519_key"
  echo "${ADDRS[$i]} $(cut -d' ' -f1,2 "$d/ssh_host_ed25519_key.pub")" >> "$T/known_hosts"
  cat > "$d/sshd_config" <<EOF
ListenAddress ${ADDRS[$i]}
Port 22
HostKey $d/ssh_host_ed25519_key
PidFile $d/sshd.pid
AuthorizedKeysFile $T/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
PrintLastLog no
X11Forwarding no
AllowAgentForwarding no
AllowTcpForwarding no
MaxStartups 64
LogLevel INFO
EOF
  run_quiet /usr/sbin/sshd -t -f "$d/sshd_config"
  # The sshd gets the node's network namespace and a UTS namespace of its own named after the
  # node; the sessions it starts (mpirun's orted, then the ranks) inherit both.
  ip netns exec "${NODE_NS[$i]}" unshare --uts \
    sh -c 'echo "$1" > /proc/sys/kernel/hostname && exec /usr/sbin/sshd -D -e -f "$2"' \
    sh "${HOSTS[$i]}" "$d/sshd_config" > "$d/sshd.log" 2>&1 &
  SSHD_PIDS+=($!)
done

# Runs a command on node 1: its network and UTS namespaces, taken from its sshd.
on_node1() { nsenter --target "${SSHD_PIDS[0]}" --net --uts -- "$@"; }

# Wait for the sshds: every node answers ssh from node 1 with its own hostname (in parallel).
probe() {  # node index: retries for up to 10 s, leaves the answer in $T/probe<i>
  local i=$1
  for _ in $(seq 50); do
    on_node1 timeout 10 ssh -F "$T/ssh_config" "${ADDRS[$i]}" uname -n > "$T/probe$i" 2> "$T/probe$i.err" && return 0
    kill -0 "${SSHD_PIDS[$i]}" 2>/dev/null || return 1
    sleep 0.2
  done
  return 1
}
probes=()
for i in 0 1 2; do probe "$i" & probes+=($!); done
for i in 0 1 2; do
  wait "${probes[$i]}"
  got=$(cat "$T/probe$i" 2>/dev/null)
  [ "$got" = "${HOSTS[$i]}" ] || { show_tail "$T/probe$i.err"; setup_fail "ssh from node1 to ${ADDRS[$i]} (got '$got')" "$T/node$((i + 1))/sshd.log"; }
done
ok "ssh from node1 reaches each node's sshd (key-only, no prompt), which reports its own hostname"

# ---- data: a small corpus packed into token shards ---------------------------------------------
cd "$T" || setup_fail "cd $T"
if [ -d /usr/share/games/fortunes ]; then
  corpus=/usr/share/games/fortunes
else  # a generated stand-in when the fortunes package is absent
  mkdir corpus && corpus=$T/corpus
  for i in $(seq 1 3000); do
    printf 'Node %d says: the quick brown fox %d jumps over the lazy dog.\n%%\n' $((i % 3)) "$i"
  done > corpus/gen.txt
fi
run_quiet "$BIN" pack "$corpus" -o "$T/data/f" --doc-separator %

# ---- MPI settings: the launch kit's, with this test's network and ssh set-up --------------------
# OpenMPI 4 (ORTE) reads the launcher's settings as OMPI_MCA_*, OpenMPI 5 (PRRTE) as PRTE_MCA_*
# with "ssh" for "rsh" (hostfiles/README.md, section 7); each kit file is tested with its version.
OMPI_MAJOR=$(ompi_info --version 2>/dev/null | sed -n 's/^Open MPI v\([0-9]*\)\..*/\1/p' | head -1)
echo "OpenMPI ${OMPI_MAJOR:-?} ($(mpirun --version 2>&1 | head -1))"
if [ "${OMPI_MAJOR:-4}" -ge 5 ]; then
  KIT_ENV=$ROOT/hostfiles/mpitrain-ompi5.env
  # shellcheck source=../../hostfiles/mpitrain-ompi5.env
  [ -f "$KIT_ENV" ] && . "$KIT_ENV"
  export OMPI_MCA_btl_tcp_if_include=$CIDR PRTE_MCA_oob_tcp_if_include=$CIDR
  unset OMPI_MCA_btl_tcp_if_exclude PRTE_MCA_oob_tcp_if_exclude
  export PRTE_MCA_plm_ssh_args="-F $T/ssh_config ${PRTE_MCA_plm_ssh_args:-}"
  export PRTE_MCA_prte_tmpdir_base=$T/ompi         # session directories go with the temp dir
else
  KIT_ENV=$ROOT/hostfiles/mpitrain.env
  # shellcheck source=../../hostfiles/mpitrain.env
  [ -f "$KIT_ENV" ] && . "$KIT_ENV"
  export OMPI_MCA_btl_tcp_if_include=$CIDR OMPI_MCA_oob_tcp_if_include=$CIDR
  unset OMPI_MCA_btl_tcp_if_exclude OMPI_MCA_oob_tcp_if_exclude   # exclusive with the includes
  export OMPI_MCA_plm_rsh_args="-F $T/ssh_config ${OMPI_MCA_plm_rsh_args:-}"
  export OMPI_MCA_orte_tmpdir_base=$T/ompi         # session directories go with the temp dir
fi
export OMPI_MCA_mpi_yield_when_idle=1            # all three "hosts" share this machine's cores,
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1   # which may be fewer than the ranks
mkdir -p "$T/ompi"
for i in 0 1 2; do echo "${ADDRS[$i]} slots=${SLOTS[$i]}"; done > "$T/hosts"

# Every kit parameter must be one this OpenMPI knows (it ignores unknown names silently).
if command -v ompi_info >/dev/null && [ -f "$KIT_ENV" ]; then
  {
    ompi_info --all --parsable | sed -n 's/^mca:[^:]*:[^:]*:param:\([^:]*\):value:.*/\1/p'
    if command -v prte_info >/dev/null; then prte_info --all 2>/dev/null | sed -n 's/.*MCA [a-z]*: "\([a-z0-9_]*\)" (current value.*/\1/p'; fi
  } | sort -u > "$T/known_params"
  sed -n 's/^#\{0,1\}export \(OMPI\|PRTE\)_MCA_\([a-z0-9_]*\)=.*/\2/p' "$KIT_ENV" | sort -u > "$T/env_params"
  unknown=$(comm -23 "$T/env_params" "$T/known_params" | tr '\n' ' ')
  check "launch kit: every parameter of hostfiles/$(basename "$KIT_ENV") is known to OpenMPI $OMPI_MAJOR${unknown:+ (unknown: $unknown)}" \
    "[ -z '$unknown' ] && [ -s '$T/env_params' ]"
  if [ "${OMPI_MAJOR:-4}" -lt 5 ] && [ -f "$ROOT/hostfiles/mca-params.conf" ]; then
    # settings and commented-out optional ones: `name = value` / `#name = value`
    sed -n 's/^#\{0,1\}\([a-z0-9]*_[a-z0-9_]*\)[[:space:]]*=.*/\1/p' "$ROOT/hostfiles/mca-params.conf" | sort -u > "$T/conf_params"
    unknown=$(comm -23 "$T/conf_params" "$T/known_params" | tr '\n' ' ')
    check "launch kit: every parameter of hostfiles/mca-params.conf is known to ompi_info${unknown:+ (unknown: $unknown)}" \
      "[ -z '$unknown' ] && [ -s '$T/conf_params' ]"
    check "launch kit: hostfiles/mpitrain.env sets the same parameters as mca-params.conf" \
      "cmp -s '$T/conf_params' '$T/env_params'"
  fi
fi

# " (exit N)" or " (timed out after N s)" for a failed command's exit code, "" for 0.
why() {
  case $1 in
    0) ;;
    124|137) echo " (timed out after $MPIRUN_LIMIT s)" ;;
    *) echo " (exit $1)" ;;
  esac
}

# mpirun on node 1 with the hostfile; output in $T/<name>.out, exit code returned.
mpirun_on_node1() {  # name, command...
  local name=$1
  shift
  bounded "$MPIRUN_LIMIT" nsenter --target "${SSHD_PIDS[0]}" --net --uts -- \
    mpirun --hostfile "$T/hosts" -np 4 --bind-to none "$@" > "$T/$name.out" 2>&1
}

# ---- placement: hostnames, ranks, local ranks, MCA settings reaching the remote ranks ----------
mpirun_on_node1 diag bash -c 'echo "DIAG $OMPI_COMM_WORLD_RANK $(uname -n) $OMPI_COMM_WORLD_LOCAL_RANK $OMPI_COMM_WORLD_LOCAL_SIZE ${OMPI_MCA_btl_tcp_if_include:-unset}"'
rc=$?
check "mpirun over ssh (hostfile slots 2,1,1) starts 4 processes and exits 0$(why $rc)" "[ $rc -eq 0 ] && [ \$(grep -c '^DIAG ' diag.out) -eq 4 ]"
printf 'DIAG %s\n' "0 mpt-node1 0 2 $CIDR" "1 mpt-node1 1 2 $CIDR" "2 mpt-node2 0 1 $CIDR" "3 mpt-node3 0 1 $CIDR" > diag.want
grep '^DIAG ' diag.out | sort -n -k2 > diag.got
check "ranks 0,1 on mpt-node1 (local 0,1), rank 2 on mpt-node2 and rank 3 on mpt-node3 (local 0), MCA settings forwarded" \
  "cmp -s diag.want diag.got"
cmp -s diag.want diag.got || { show_tail diag.out; diff diag.want diag.got | sed 's/^/  | /'; }

# ---- training: the demo config shrunk to a few seconds, final checkpoint in the temp dir -------
mpirun_on_node1 train "$BIN" "$ROOT/configs/demo.yaml" \
  --set model.preset=custom --set model.n_layer=2 --set model.n_head=2 --set model.n_embd=32 \
  --set model.seq_len=64 --set "data.train=[$T/data/f-train-*.h5]" --set "data.val=[$T/data/f-val-*.h5]" \
  --set train.micro_batch=4 --set train.steps=5 --set train.threads=1 --set "train.out_dir=$T/run" \
  --set optim.warmup_steps=1 --set eval.every=5 --set eval.batches=1 --set log.every=1 \
  --set "checkpoint.dir=$T/ckpt" --set checkpoint.every=0 --set checkpoint.keep=1 \
  --set checkpoint.resume=none --set sample.tokens=0
rc=$?
check "training on 3 hosts exits 0$(why $rc)" "[ $rc -eq 0 ]"
want_map="4 ranks on 3 hosts: mpt-node1[0-1] mpt-node2[2] mpt-node3[3]"
got_map=$(grep -o '[0-9]* ranks\{0,1\} on [0-9]* hosts\{0,1\}: .*' train.out)
check "host map logged once: '$want_map'" "[ \"\$got_map\" = \"\$want_map\" ]"
[ "$got_map" = "$want_map" ] || echo "  got: '$got_map'"
check "training ran 5 steps (progress logged once, by rank 0)" "[ \$(grep -c 'step     5/5' train.out) -eq 1 ]"
check "final checkpoint written: ckpt/ckpt-00000005.h5, named by ckpt/latest" \
  "[ -f ckpt/ckpt-00000005.h5 ] && grep -qx ckpt-00000005.h5 ckpt/latest"
[ $rc -eq 0 ] || show_tail train.out

# ---- one job per checkpoint directory, the holder on another host ------------------------------
# A long run on mpt-node2 holds $T/ckpt (the directory all "hosts" share here, as a shared
# filesystem would); a job started from node 1 is refused naming mpt-node2 and the holder's pid;
# once the holder is killed with -9 the next job starts and resumes its checkpoint.
lock_args=(--set model.preset=custom --set model.n_layer=1 --set model.n_head=2 --set model.n_embd=16
  --set model.seq_len=32 --set "data.train=[$T/data/f-train-*.h5]" --set "data.val=[]" --set eval.every=0
  --set train.micro_batch=2 --set train.threads=1 --set "train.out_dir=$T/run-lock" --set log.every=100
  --set "checkpoint.dir=$T/ckpt" --set checkpoint.every=20 --set checkpoint.keep=1 --set sample.tokens=0)
rm -f "$T/ckpt/latest"
nsenter --target "${SSHD_PIDS[1]}" --net --uts -- "$BIN" "$ROOT/configs/demo.yaml" "${lock_args[@]}" \
  --set train.steps=1000000 --set checkpoint.resume=none > "$T/holder.out" 2>&1 &
HOLDER=$!
for _ in $(seq 1 300); do [ -s "$T/ckpt/latest" ] && break; sleep 0.1; done
mpirun_on_node1 lock_refused "$BIN" "$ROOT/configs/demo.yaml" "${lock_args[@]}" --set train.steps=1000000
rc=$?
check "a job on mpt-node2 holds checkpoint.dir; mpirun from mpt-node1 is refused (exit $rc), naming mpt-node2 and pid $HOLDER, once" \
  "[ $rc -eq 2 ] && [ \$(grep -c \"in use by another job (host mpt-node2, pid $HOLDER, started\" lock_refused.out) -eq 1 ]"
[ $rc -eq 2 ] || show_tail lock_refused.out
kill -9 "$HOLDER" 2>/dev/null
wait "$HOLDER" 2>/dev/null
at=$(sed 's/ckpt-0*\([0-9]*\).h5/\1/' "$T/ckpt/latest" 2>/dev/null)
mpirun_on_node1 lock_after "$BIN" "$ROOT/configs/demo.yaml" "${lock_args[@]}" --set train.steps=1000000 \
  --set checkpoint.resume=auto --stop-after $((${at:-0} + 2))
rc=$?
check "after kill -9 of the holder on mpt-node2 the job from mpt-node1 starts (exit $rc) and resumes step ${at:-?}" \
  "[ $rc -eq 0 ] && grep -q 'resumed from .*ckpt-0*${at:-x}.h5 at step ${at:-x}' lock_after.out"
[ $rc -eq 0 ] || show_tail lock_after.out

# ---- netcheck: host map, point-to-point and all-reduce over the three hosts --------------------
# (a binary without netcheck treats the word as a config file: its help is train's)
if ! nc_help=$("$BIN" netcheck --help 2>&1) || ! grep -q netcheck <<< "$nc_help"; then
  echo "SKIP netcheck: not built yet"
else
  # Small messages keep it to seconds; only the options this netcheck lists are passed.
  nc_args=()
  for opt in --max-bytes=4194304 --p2p-bytes=1048576 --iters=3; do
    grep -q -- "${opt%%=*}" <<< "$nc_help" && nc_args+=("${opt%%=*}" "${opt#*=}")
  done
  mpirun_on_node1 netcheck "$BIN" netcheck "${nc_args[@]}"
  rc=$?
  check "netcheck on 3 hosts exits 0$(why $rc)" "[ $rc -eq 0 ]"
  check "netcheck reports 3 hosts" "grep -q '3 hosts' netcheck.out"
  if [ $rc -eq 0 ]; then grep -E '^netcheck: ' netcheck.out | sed 's/^/  /'; else show_tail netcheck.out 40; fi
fi
