# shellcheck shell=bash
# Shared helpers of the multi-host tests (sourced, not run).
#
# Results: ok/bad/check print `PASS: name` / `FAIL: name` and count them; summary prints the wall
# time and the final `N passed, M failed` line. skip prints `SKIP: reason` and exits 77, which
# CTest reports as skipped (SKIP_RETURN_CODE 77).

MT_PASSED=0
MT_FAILED=0
MT_T0=$(date +%s%N)

ok()    { echo "PASS: $1"; MT_PASSED=$((MT_PASSED + 1)); }
bad()   { echo "FAIL: $1"; MT_FAILED=$((MT_FAILED + 1)); }
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }   # name, shell condition
skip()  { echo "SKIP: $1"; exit 77; }

summary() {
  local ms=$((($(date +%s%N) - MT_T0) / 1000000))
  printf 'wall time: %d.%03d s\n' $((ms / 1000)) $((ms % 1000))
  echo "$MT_PASSED passed, $MT_FAILED failed"
}

# Prints the last lines of a log file, indented, to explain a failure.
show_tail() {  # file [lines]
  [ -f "$1" ] || return 0
  echo "  --- last lines of ${1##*/} ---"
  tail -n "${2:-25}" "$1" | sed 's/^/  | /'
}

# Runs a command with a time limit, in the background so that the test's INT/TERM traps fire at
# once (bash defers traps while a foreground child runs). MT_CHILD holds its PID meanwhile.
MT_CHILD=""
bounded() {  # seconds command...
  local limit=$1
  shift
  timeout -k 5 "$limit" "$@" &
  MT_CHILD=$!
  wait "$MT_CHILD"
  local rc=$?
  MT_CHILD=""
  return $rc
}

# ---- hosts made of network namespaces (netns_test.sh, fleet_test.sh) ---------------------------
# Network namespaces joined by a Linux bridge play hosts: each has its own address, its own
# hostname (a UTS namespace) and its own sshd. The bridge lives in one more namespace, so nothing
# is added to the machine's own network namespace (no interface, address, route or sysctl); the
# nodes talk only to each other and to their own loopback. A test sets
#   ID              prefix of its namespace names, unique per run (e.g. mpt$$)
#   NET             the first three octets of its private /24: node i (from 1) is $NET.i
#   HOSTS           the nodes' hostnames (an array)
#   NETNS_TMP       mktemp template of its temporary directory (e.g. /tmp/mpt-netns-XXXXXX)
#   NETNS_TOOLS     commands it needs besides the set-up's own (an array, may be empty)
#   NETNS_MOUNT_NS  1: every node's sshd, and so everything started through it, gets a private
#                   mount namespace of its own (on_node enters it too); 0: the machine's
#   NETNS_RATE      optional, e.g. 100mbit or 1gbit (a number with bit, kbit, mbit or gbit): every
#                   node's link is limited to this rate in each direction, as a NIC of that speed
#                   on a switch (unset or empty: no limit, the veths run at memory speed)
# and may define netns_node_prelude (node index: prints sh commands that run in the node's
# namespaces before its sshd starts, e.g. a mount), then calls netns_begin (traps: cleanup on
# exit, failure, timeout or Ctrl-C) and netns_setup. netns_setup skips (exit 77) when namespaces
# cannot be created, and leaves CIDR, ADDRS, NODE_NS, SWITCH_NS, T (the temporary directory),
# $T/ssh_config (key-only client, known_hosts filled in advance) and SSHD_PIDS (one sshd per
# node); its one PASS line says every node answers ssh from node 1 with its own hostname (and,
# under NETNS_RATE, a second one that every link carries the rate limit).
# netns_cleanup removes everything by PID and name: the sshds and anything else left running in
# the namespaces (private mounts go with their last process), the namespaces with their veths and
# bridge, the temporary directory; then prints the summary and exits.

T=""                             # temporary directory
MADE_NS=()                       # namespaces this run created
SSHD_PIDS=()                     # one sshd per node, started by this run
MADE_RUN_SSHD=0                  # whether this run created /run/sshd (sshd's privsep dir)
SKIPPED=0
NETNS_TOOLS=()
NETNS_MOUNT_NS=0
NETNS_RATE=${NETNS_RATE:-}

netns_begin() {
  exec 3>&1 4>&2                 # the test's own stdout/stderr, for netns_cleanup
  trap netns_cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}

netns_cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  exec 1>&3 2>&4                 # a signal may arrive while output goes to a log file
  [ "$SKIPPED" -eq 1 ] && rc=77
  local child=$MT_CHILD           # a bounded command still running (interrupted)
  [ -n "$child" ] && kill "$child" 2>/dev/null
  local pid ns left
  for pid in "${SSHD_PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  # Whatever still runs inside the namespaces (ssh sessions, orted, ranks) was started by this
  # test through its own sshds or mpirun: TERM it (CONT for a stopped one), then KILL what is
  # left after 5 s.
  for ns in "${MADE_NS[@]}"; do
    left=$(ip netns pids "$ns" 2>/dev/null)
    # shellcheck disable=SC2086  # a list of PIDs
    [ -n "$left" ] && kill $left 2>/dev/null && kill -CONT $left 2>/dev/null
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

setup_fail() { bad "setup: $1"; [ -n "${2:-}" ] && show_tail "$2"; exit 1; }
run_quiet() { "$@" >"$T/setup.log" 2>&1 || setup_fail "$* (exit $?)" "$T/setup.log"; }

# Runs a command on node i (from 0): its network and UTS namespaces (and its mount namespace
# under NETNS_MOUNT_NS=1), taken from its sshd.
on_node() {  # index command...
  local i=$1
  shift
  if [ "$NETNS_MOUNT_NS" -eq 1 ]; then
    # --root --wd=/: the sshd's root directory, and / in it (entering a mount namespace resets both to that
    # namespace's root, which in a chroot, e.g. scripts/test-debian13.sh's, is not the sshd's)
    nsenter --target "${SSHD_PIDS[$i]}" --net --uts --mount --root --wd=/ -- "$@"
  else
    nsenter --target "${SSHD_PIDS[$i]}" --net --uts -- "$@"
  fi
}
on_node1() { on_node 0 "$@"; }

netns_setup() {
  local i ns d tool err
  CIDR=$NET.0/24
  ADDRS=() NODE_NS=()
  for i in "${!HOSTS[@]}"; do ADDRS+=("$NET.$((i + 1))"); NODE_NS+=("$ID-n$((i + 1))"); done
  SWITCH_NS=$ID-sw

  # ---- can this machine create network namespaces? ----
  [ "$(id -u)" -eq 0 ] || { SKIPPED=1; skip "network namespaces need root (uid $(id -u))"; }
  local rate_tools=()
  if [ -n "$NETNS_RATE" ]; then
    rate_tools=(tc)
    netns_burst "$NETNS_RATE" >/dev/null || { bad "setup: NETNS_RATE=$NETNS_RATE: want a number with bit, kbit, mbit or gbit (e.g. 100mbit)"; exit 1; }
  fi
  for tool in ip unshare nsenter timeout /usr/sbin/sshd ssh ssh-keygen "${rate_tools[@]}" "${NETNS_TOOLS[@]}"; do
    command -v "$tool" >/dev/null || setup_fail "missing $tool (packages iproute2, util-linux, openssh-server, openssh-client, openmpi-bin, pdsh)"
  done
  if ! err=$(ip netns add "$SWITCH_NS" 2>&1); then
    case $err in
      *"Operation not permitted"*|*"Permission denied"*)
        SKIPPED=1; skip "cannot create network namespaces here: $err" ;;
    esac
    setup_fail "ip netns add $SWITCH_NS: $err"
  fi
  MADE_NS+=("$SWITCH_NS")
  T=$(mktemp -d "$NETNS_TMP")

  # ---- network: node i's eth0 <-> veth p<i> on bridge br0 in the switch namespace ----
  run_quiet ip -n "$SWITCH_NS" link add br0 type bridge
  run_quiet ip -n "$SWITCH_NS" link set br0 up
  for i in "${!HOSTS[@]}"; do
    ns=${NODE_NS[$i]}
    run_quiet ip netns add "$ns"
    MADE_NS+=("$ns")
    run_quiet ip link add name "p$((i + 1))" netns "$SWITCH_NS" type veth peer name eth0 netns "$ns"
    run_quiet ip -n "$SWITCH_NS" link set "p$((i + 1))" master br0 up
    run_quiet ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
    run_quiet ip -n "$ns" addr add "${ADDRS[$i]}/24" dev eth0
    run_quiet ip -n "$ns" link set lo up
    run_quiet ip -n "$ns" link set eth0 up
    if [ -n "$NETNS_RATE" ]; then netns_limit_link "$ns" "p$((i + 1))"; fi
  done
  run_quiet ip netns exec "$SWITCH_NS" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
  if [ -n "$NETNS_RATE" ]; then
    local shaped=0
    for i in "${!HOSTS[@]}"; do
      tc -n "${NODE_NS[$i]}" qdisc show dev eth0 | grep -q "^qdisc tbf .* rate " && shaped=$((shaped + 1))
      tc -n "$SWITCH_NS" qdisc show dev "p$((i + 1))" | grep -q "^qdisc tbf .* rate " && shaped=$((shaped + 1))
    done
    check "every node's link is limited to $NETNS_RATE each way (tbf on its eth0 and on its switch port; burst $(netns_burst "$NETNS_RATE") bytes)" \
      "[ $shaped -eq $((2 * ${#HOSTS[@]})) ]"
  fi

  # ---- ssh: a client key, a host key and an sshd per node, known_hosts filled in advance ----
  run_quiet ssh-keygen -q -t ed25519 -N '' -C "$ID-client" -f "$T/id_ed25519"
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
  for i in "${!HOSTS[@]}"; do
    d=$T/node$((i + 1))
    mkdir "$d"
    netns_sshd_config "$d" "${ADDRS[$i]}" "${HOSTS[$i]}"
    echo "${ADDRS[$i]} $(cut -d' ' -f1,2 "$d/ssh_host_ed25519_key.pub")" >> "$T/known_hosts"
    local prelude="" unshare_args=(--uts)
    declare -F netns_node_prelude >/dev/null && prelude=$(netns_node_prelude "$i")
    [ "$NETNS_MOUNT_NS" -eq 1 ] && unshare_args+=(--mount --propagation private)
    # The sshd gets the node's network namespace and a UTS namespace of its own named after the
    # node (and a mount namespace); the sessions it starts (mpirun's orted, then the ranks)
    # inherit them.
    # shellcheck disable=SC2016  # $1, $2: the inner shell's arguments
    ip netns exec "${NODE_NS[$i]}" unshare "${unshare_args[@]}" \
      sh -c "set -e; $prelude"'
echo "$1" > /proc/sys/kernel/hostname && exec /usr/sbin/sshd -D -e -f "$2"' \
      sh "${HOSTS[$i]}" "$d/sshd_config" > "$d/sshd.log" 2>&1 &
    SSHD_PIDS+=($!)
  done

  # Wait for the sshds: every node answers ssh from node 1 with its own hostname (in parallel).
  local probes=() got
  for i in "${!HOSTS[@]}"; do netns_probe "$i" & probes+=($!); done
  for i in "${!HOSTS[@]}"; do
    wait "${probes[$i]}"
    got=$(cat "$T/probe$i" 2>/dev/null)
    [ "$got" = "${HOSTS[$i]}" ] || { show_tail "$T/probe$i.err"; setup_fail "ssh from node1 to ${ADDRS[$i]} (got '$got')" "$T/node$((i + 1))/sshd.log"; }
  done
  ok "ssh from node1 reaches each node's sshd (key-only, no prompt), which reports its own hostname"
}

# ---- NETNS_RATE: links of a given speed ----
# A token bucket filter (tc-tbf) as the root qdisc of both ends of a node's veth: on the node's
# eth0 it shapes what the node sends, on its port p<i> in the switch namespace what the bridge
# delivers to it, so each node has a full-duplex link of NETNS_RATE and two nodes talk at that rate
# (several flows into one node share its port, as on a switch). tbf rather than netem's rate:
# tbf is a plain shaper (no added delay model, a bounded queue), and this machine's kernel has no
# sch_netem. The qdiscs live on the namespaces' interfaces and go when the namespaces are deleted.
# Bucket: 2 ms of traffic at the rate, at least 16 KiB (over ten 1500-byte frames, so that the
# shaper, not its timer, sets the rate); queue: 50 ms of traffic (a switch port's buffer), beyond
# which packets are dropped and TCP backs off, as on a real congested link.
netns_burst() {  # rate -> bytes of the token bucket; fails on a rate it cannot read
  awk -v r="$1" 'BEGIN {
    if (!match(tolower(r), /^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit)$/)) exit 1
    v = tolower(r); n = v + 0; sub(/^[0-9.]+/, "", v)
    bps = n * (v == "bit" ? 1 : v == "kbit" ? 1e3 : v == "mbit" ? 1e6 : 1e9) / 8
    b = int(bps * 0.002); if (b < 16384) b = 16384
    print b }'
}

netns_limit_link() {  # node namespace, its switch port (replace: sets the rate anew on a shaped link)
  local burst
  burst=$(netns_burst "$NETNS_RATE")
  run_quiet tc -n "$1" qdisc replace dev eth0 root tbf rate "$NETNS_RATE" burst "$burst" latency 50ms
  run_quiet tc -n "$SWITCH_NS" qdisc replace dev "$2" root tbf rate "$NETNS_RATE" burst "$burst" latency 50ms
}

# The two-host benches (bench/diloco.sh, bench/pp_hosts.sh), after their NET, HOSTS, ID,
# NETNS_TMP and NETNS_TOOLS: the hosts up with every link at the first of RATES, cd to $T, the
# fortunes corpus packed into $T/data/f, the MPI settings exported, and the hostfiles $T/hosts-1
# (node 1) and $T/hosts-2 (every node) written; the set-up's lines to stderr.
netns_bench_hosts() {  # mpitrain binary, RATES, repository root
  read -r NETNS_RATE _ <<< "$2"
  netns_begin
  exec 3>&2
  netns_setup >&2
  cd "$T" || setup_fail "cd $T"
  run_quiet "$1" pack /usr/share/games/fortunes -o "$T/data/f" --doc-separator % --val-fraction 0.02
  netns_mpi_env "$3" >&2
  echo "${ADDRS[0]} slots=1" > "$T/hosts-1"
  printf "%s slots=1\n" "${ADDRS[@]}" > "$T/hosts-2"
}

netns_set_rate() {  # rate: every node's link shaped anew to it (after netns_setup; bench/diloco.sh)
  NETNS_RATE=$1
  local i
  for i in "${!NODE_NS[@]}"; do netns_limit_link "${NODE_NS[$i]}" "p$((i + 1))"; done
}

netns_tx_bytes() {  # the bytes all nodes' eth0 have sent so far (their transmit counters)
  local i sum=0 b
  for i in "${!NODE_NS[@]}"; do
    b=$(ip netns exec "${NODE_NS[$i]}" cat /sys/class/net/eth0/statistics/tx_bytes) || return 1
    sum=$((sum + b))
  done
  echo "$sum"
}

# An sshd's host key and configuration in directory d: key-only root logins from $T's client key.
netns_sshd_config() {  # dir address hostname
  run_quiet ssh-keygen -q -t ed25519 -N '' -C "$3" -f "$1/ssh_host_ed25519_key"
  cat > "$1/sshd_config" <<EOF
ListenAddress $2
Port 22
HostKey $1/ssh_host_ed25519_key
PidFile $1/sshd.pid
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
  run_quiet /usr/sbin/sshd -t -f "$1/sshd_config"
}

netns_probe() {  # node index: retries for up to 10 s, leaves the answer in $T/probe<i>
  local i=$1
  for _ in $(seq 50); do
    on_node1 timeout 10 ssh -F "$T/ssh_config" "${ADDRS[$i]}" uname -n > "$T/probe$i" 2> "$T/probe$i.err" && return 0
    kill -0 "${SSHD_PIDS[$i]}" 2>/dev/null || return 1
    sleep 0.2
  done
  return 1
}

# The launch kit's MPI settings with this set-up's network and ssh: OpenMPI 4 (ORTE) reads the
# launcher's settings as OMPI_MCA_*, OpenMPI 5 (PRRTE) as PRTE_MCA_* with "ssh" for "rsh"
# (hostfiles/README.md, section 7); each kit file is tested with its version. Sets OMPI_MAJOR and
# KIT_ENV (the kit file used).
netns_mpi_env() {  # repository root
  OMPI_MAJOR=$(ompi_info --version 2>/dev/null | sed -n 's/^Open MPI v\([0-9]*\)\..*/\1/p' | head -1)
  echo "OpenMPI ${OMPI_MAJOR:-?} ($(mpirun --version 2>&1 | head -1))"
  if [ "${OMPI_MAJOR:-4}" -ge 5 ]; then
    KIT_ENV=$1/hostfiles/mpitrain-ompi5.env
    # shellcheck source=../../hostfiles/mpitrain-ompi5.env
    [ -f "$KIT_ENV" ] && . "$KIT_ENV"
    export OMPI_MCA_btl_tcp_if_include=$CIDR PRTE_MCA_oob_tcp_if_include=$CIDR
    unset OMPI_MCA_btl_tcp_if_exclude PRTE_MCA_oob_tcp_if_exclude
    export PRTE_MCA_plm_ssh_args="-F $T/ssh_config ${PRTE_MCA_plm_ssh_args:-}"
    export PRTE_MCA_prte_tmpdir_base=$T/ompi         # session directories go with the temp dir
  else
    KIT_ENV=$1/hostfiles/mpitrain.env
    # shellcheck source=../../hostfiles/mpitrain.env
    [ -f "$KIT_ENV" ] && . "$KIT_ENV"
    export OMPI_MCA_btl_tcp_if_include=$CIDR OMPI_MCA_oob_tcp_if_include=$CIDR
    unset OMPI_MCA_btl_tcp_if_exclude OMPI_MCA_oob_tcp_if_exclude   # exclusive with the includes
    export OMPI_MCA_plm_rsh_args="-F $T/ssh_config ${OMPI_MCA_plm_rsh_args:-}"
    export OMPI_MCA_orte_tmpdir_base=$T/ompi         # session directories go with the temp dir
  fi
  export OMPI_MCA_mpi_yield_when_idle=1            # all "hosts" share this machine's cores,
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1   # which may be fewer than the ranks
  mkdir -p "$T/ompi"
}
