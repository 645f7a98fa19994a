#!/usr/bin/env bash
# A real multi-host run on one machine. Three network namespaces joined by a Linux bridge play
# three hosts: each has its own address, its own hostname (a UTS namespace) and its own sshd.
# From node 1 a plain `mpirun --hostfile` starts 2 + 1 + 1 = 4 ranks over ssh, exactly as on a
# cluster (the filesystem is shared, so the binary's path is the same on every "host"), and the
# test checks the placement and local ranks, mpitrain's logged host map, a short training run
# with a checkpoint, and `mpitrain netcheck`. An MPICH-ABI build (cmake -DMPITRAIN_MPI=mpich) is
# launched the MPICH way instead: hydra's `mpiexec -f hosts` over ssh with the kit
# hostfiles/mpitrain-mpich.env (HYDRA_IFACE, UCX_NET_DEVICES pinned to the nodes' eth0).
#
# Usage: bash tests/multihost/netns_test.sh PATH/TO/mpitrain
# Needs root (exit 77 = skipped when network namespaces cannot be created), iproute2,
# openssh-server and -client, util-linux, openmpi-bin. Takes 35-75 s on a busy 2-core VM (the
# ranks, orteds and sshds of all three "hosts" share its cores); each mpirun is limited to
# NETNS_TEST_MPIRUN_LIMIT seconds (default 120).
#
# Isolation (the set-up and cleanup are lib.sh's netns_* functions): the bridge lives in a fourth
# namespace, so nothing is added to the machine's own network namespace (no interface, address,
# route or sysctl); the nodes talk only to each other on 10.213.7.0/24 and to their own loopback.
# Everything is removed on exit, also on failure, timeout or Ctrl-C: the sshds and anything else
# left running in the namespaces (by PID), the namespaces with their veths and bridge, and the
# temporary directory.
set -u

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"

[ $# -eq 1 ] || { echo "usage: $0 PATH/TO/mpitrain" >&2; exit 2; }
BIN=$(realpath -e "$1" 2>/dev/null) || { echo "$0: no such file: $1" >&2; exit 2; }

NET=10.213.7                     # private subnet that exists only inside the namespaces
HOSTS=(mpt-node1 mpt-node2 mpt-node3)
SLOTS=(2 1 1)
ID=mpt$$                         # namespace names are unique per run
NETNS_TMP=/tmp/mpt-netns-XXXXXX
FAMILY=$("$BIN" --version 2>/dev/null | sed -n 's/^mpi: \([a-z]*\) .*/\1/p')   # openmpi or mpich
case $FAMILY in openmpi|mpich) ;; *) echo "FAIL: $BIN --version names no MPI family (openmpi or mpich)"; exit 1 ;; esac
if [ $FAMILY = mpich ]; then NETNS_TOOLS=(mpiexec.mpich); else NETNS_TOOLS=(mpirun); fi
MPIRUN_LIMIT=${NETNS_TEST_MPIRUN_LIMIT:-120}   # seconds per mpirun

# ---- three hosts: namespaces, bridge, sshds (lib.sh); removed on exit whatever happens ---------
netns_begin
netns_setup

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
if [ $FAMILY = mpich ]; then
  # The MPICH kit, then this test's network: the nodes' eth0, ssh with the test's own config.
  KIT_ENV=$ROOT/hostfiles/mpitrain-mpich.env
  # shellcheck source=../../hostfiles/mpitrain-mpich.env
  . "$KIT_ENV"
  export HYDRA_IFACE=eth0 UCX_NET_DEVICES=eth0
  printf '#!/bin/sh\nexec ssh -F %s "$@"\n' "$T/ssh_config" > "$T/ssh-wrapper"
  chmod +x "$T/ssh-wrapper"
  export HYDRA_LAUNCHER_EXEC=$T/ssh-wrapper
  echo "MPICH $(mpichversion 2>/dev/null | sed -n 's/^MPICH Version:[[:space:]]*//p') ($(mpichversion 2>/dev/null | sed -n 's/^MPICH Device:[[:space:]]*//p')), hydra over ssh"
  for i in 0 1 2; do echo "${ADDRS[$i]}:${SLOTS[$i]}"; done > "$T/hosts"
else
  netns_mpi_env "$ROOT"
  for i in 0 1 2; do echo "${ADDRS[$i]} slots=${SLOTS[$i]}"; done > "$T/hosts"
fi

# Every kit parameter must be one this OpenMPI knows (it ignores unknown names silently).
if [ $FAMILY = openmpi ] && command -v ompi_info >/dev/null && [ -f "$KIT_ENV" ]; then
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
  if [ $FAMILY = mpich ]; then
    bounded "$MPIRUN_LIMIT" nsenter --target "${SSHD_PIDS[0]}" --net --uts -- \
      mpiexec.mpich -f "$T/hosts" -n 4 "$@" > "$T/$name.out" 2>&1
  else
    bounded "$MPIRUN_LIMIT" nsenter --target "${SSHD_PIDS[0]}" --net --uts -- \
      mpirun --hostfile "$T/hosts" -np 4 --bind-to none "$@" > "$T/$name.out" 2>&1
  fi
}

# ---- placement: hostnames, ranks, local ranks, MCA settings reaching the remote ranks ----------
if [ $FAMILY = mpich ]; then
  pinned=eth0
  mpirun_on_node1 diag bash -c 'echo "DIAG $PMI_RANK $(uname -n) $MPI_LOCALRANKID $MPI_LOCALNRANKS ${UCX_NET_DEVICES:-unset}"'
else
  pinned=$CIDR
  mpirun_on_node1 diag bash -c 'echo "DIAG $OMPI_COMM_WORLD_RANK $(uname -n) $OMPI_COMM_WORLD_LOCAL_RANK $OMPI_COMM_WORLD_LOCAL_SIZE ${OMPI_MCA_btl_tcp_if_include:-unset}"'
fi
rc=$?
check "$FAMILY launcher over ssh (hostfile slots 2,1,1) starts 4 processes and exits 0$(why $rc)" "[ $rc -eq 0 ] && [ \$(grep -c '^DIAG ' diag.out) -eq 4 ]"
printf 'DIAG %s\n' "0 mpt-node1 0 2 $pinned" "1 mpt-node1 1 2 $pinned" "2 mpt-node2 0 1 $pinned" "3 mpt-node3 0 1 $pinned" > diag.want
grep '^DIAG ' diag.out | sort -n -k2 > diag.got
check "ranks 0,1 on mpt-node1 (local 0,1), rank 2 on mpt-node2 and rank 3 on mpt-node3 (local 0), the kit's interface setting forwarded" \
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
