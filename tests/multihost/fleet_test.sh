#!/usr/bin/env bash
# hostfiles/fleet.sh for real, on three "hosts" that share no filesystem. As in netns_test.sh,
# network namespaces joined by a bridge play the hosts, each with its own hostname and sshd
# (lib.sh's netns_* functions); here each node's sshd also gets a mount namespace of its own with
# a private tmpfs on $T/srv, so a file put there on one host is not there on another, as on a
# cluster without a shared filesystem. From node 1, the launching host (in the hostfile itself),
# the test runs fleet.sh with pdsh/pdcp over ssh and checks: `check` before copying finds the
# binary, config and shards missing on nodes 2 and 3 (exit 1); `copy` puts them there (verified
# with sha256sum over ssh, independently of fleet.sh) and `check` then exits 0; an edited config,
# a truncated, an altered (same size) and an extra shard are each found on the right host and
# repaired by the next `copy`; `copy --dest` puts flat copies on every host, the launching one
# included; free space is judged against --min-free-gb; GPUs are counted
# (node 2 has a stand-in nvidia-smi with two); a host nobody answers and a host whose sshd
# accepts but never speaks are reported unreachable within a bounded time; bad usage exits 2
# with one line; finally `mpirun` trains 2 steps on the three hosts from the copied binary, config
# and shards, and the checkpoint lands on node 1 only.
#
# Usage: bash tests/multihost/fleet_test.sh PATH/TO/mpitrain
# Needs root (exit 77 = skipped when network namespaces cannot be created), iproute2,
# openssh-server and -client, util-linux, openmpi-bin and pdsh (pdsh and pdcp). 30-45 s on a
# busy 2-core VM. Uses 10.213.9.0/24 and namespaces named mpf<pid>-*, so it can run beside
# netns_test.sh. Everything is removed on exit, also on failure, timeout or Ctrl-C (lib.sh).
set -u

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"

[ $# -eq 1 ] || { echo "usage: $0 PATH/TO/mpitrain" >&2; exit 2; }
BIN=$(realpath -e "$1" 2>/dev/null) || { echo "$0: no such file: $1" >&2; exit 2; }
FLEET=$ROOT/hostfiles/fleet.sh

NET=10.213.9                     # private subnet that exists only inside the namespaces
HOSTS=(fleet-node1 fleet-node2 fleet-node3)
ID=mpf$$                         # namespace names are unique per run
NETNS_TMP=/tmp/mpt-fleet-XXXXXX
NETNS_TOOLS=(mpirun pdsh pdcp sha256sum)
NETNS_MOUNT_NS=1                 # every node has a mount namespace of its own
FLEET_LIMIT=90                   # seconds per fleet.sh run (it bounds itself well below that)
MPIRUN_LIMIT=${FLEET_TEST_MPIRUN_LIMIT:-120}   # seconds for the mpirun

# Before each node's sshd starts, in the node's own mount namespace: a tmpfs on $T/srv (the
# "local disk" that the files are copied to), and on node 2 a tmpfs on /usr/local/bin holding a
# stand-in nvidia-smi that lists two GPUs (first in the PATH of ssh sessions there).
netns_node_prelude() {  # node index
  echo "mkdir -p '$T/srv' && mount -t tmpfs -o size=100m,mode=755 mpt-fleet '$T/srv'"
  if [ "$1" -eq 1 ]; then
    printf '#!/bin/sh\necho "GPU 0: Stand-in GPU (UUID: GPU-0)"\necho "GPU 1: Stand-in GPU (UUID: GPU-1)"\n' > "$T/nvidia-smi"
    echo "mount -t tmpfs -o size=1m mpt-fleet-bin /usr/local/bin && install -m 755 '$T/nvidia-smi' /usr/local/bin/"
  fi
}

# ---- three hosts: namespaces, bridge, sshds, private mounts; removed on exit whatever happens ---
netns_begin
netns_setup
SRV=$T/srv
cd "$T" || setup_fail "cd $T"

on_node 0 sh -c "echo node1 > '$SRV/marker'"
check "no shared filesystem: a file written to $SRV on fleet-node1 is not seen on fleet-node2, fleet-node3 or this machine" \
  "on_node 0 test -f '$SRV/marker' && ! on_node 1 test -e '$SRV/marker' && ! on_node 2 test -e '$SRV/marker' && ! test -e '$SRV/marker'"
rm_marker() { on_node 0 rm -f "$SRV/marker"; }
rm_marker

# ---- what a run needs, on node 1 only: binary, config, 5 shards ---------------------------------
mkdir corpus
for i in $(seq 1 3000); do
  printf 'Node %d says: the quick brown fox %d jumps over the lazy dog.\n%%\n' $((i % 3)) "$i"
done > corpus/gen.txt
run_quiet "$BIN" pack "$T/corpus" -o "$T/data/f" --doc-separator % --shard-tokens 50000
cat > "$T/config.yaml" <<EOF
# fleet_test: 2 steps of a tiny model; the shards and checkpoints are on each host's own disk
model:
  preset: custom
  n_layer: 2
  n_head: 2
  n_embd: 32
  seq_len: 64
data:
  train: [$SRV/data/f-train-*.h5]   # a flow list with a glob
  val:
    - $SRV/data/f-val-*.h5
train:
  micro_batch: 4
  steps: 2
  threads: 1
  out_dir: $SRV/run
optim:
  warmup_steps: 1
eval:
  every: 2
  batches: 1
log:
  every: 1
checkpoint:
  dir: $SRV/ckpt
  every: 0
  keep: 1
  resume: none
sample:
  tokens: 0
EOF
# shellcheck disable=SC2016  # the inner shell's arguments
run_quiet on_node 0 sh -c 'mkdir -p "$1/bin" "$1/data" && cp "$2" "$1/bin/mpitrain" && cp "$3"/data/*.h5 "$1/data/" && cp "$3/config.yaml" "$1/"' \
  sh "$SRV" "$BIN" "$T"
N_DATA=$(find "$T/data" -name '*.h5' | wc -l)
[ "$N_DATA" -ge 3 ] || setup_fail "pack made $N_DATA shards, wanted at least 3"
SHARD=$(find "$T/data" -name 'f-train-*.h5' | sort | head -1)
SHARD=$SRV/data/${SHARD##*/}     # a shard's path on the hosts

# The hostfile: node 1 (the launching host) is in it, with a comment and a blank line.
cat > "$T/hosts" <<EOF
# the launching host first
$NET.1 slots=2

$NET.2 slots=1
$NET.3 slots=1
EOF
ARGS=(--binary "$SRV/bin/mpitrain" --config "$SRV/config.yaml")
export FLEET_SSH_ARGS="-F $T/ssh_config"

# fleet.sh on node 1; output in $T/<name>.out, exit code returned, seconds taken in SECS.
fleet() {  # name args...
  local name=$1 t0 rc
  shift
  t0=$(date +%s%N)
  bounded "$FLEET_LIMIT" nsenter --target "${SSHD_PIDS[0]}" --net --uts --mount --root --wd=/ -- \
    "$FLEET" "$@" > "$T/$name.out" 2>&1
  rc=$?
  SECS=$((($(date +%s%N) - t0) / 1000000000))
  return $rc
}
# A host's table row without the free-space column: "reachable|binary|config|data|GPUs|verdict".
row() {  # name host
  awk -F '  +' -v h="$2" '$1 == h || index($1, h " (") == 1 { print $2 "|" $3 "|" $4 "|" $5 "|" $7 "|" $8; exit }' "$T/$1.out"
}
free_cell() { awk -F '  +' -v h="$2" '$1 == h || index($1, h " (") == 1 { print $6; exit }' "$T/$1.out"; }
explain() { [ "$1" = "$2" ] || { echo "  want: $2"; echo "  got:  $1"; show_tail "$T/$3.out" 40; }; }
on_ssh() { on_node 0 ssh -F "$T/ssh_config" "$@"; }   # ssh from node 1

GPUS_HERE=none                   # what node 1 and node 3 report (node 2: the stand-in's 2)
command -v nvidia-smi >/dev/null && GPUS_HERE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
H1="$NET.1 (fleet-node1)" H2="$NET.2 (fleet-node2)" H3="$NET.3 (fleet-node3)"

# ---- check before copying: nodes 2 and 3 have nothing -------------------------------------------
fleet before check "$T/hosts" "${ARGS[@]}"
rc=$?
check "check before copying exits 1 (exit $rc)" "[ $rc -eq 1 ]"
got="$(row before "$H1") / $(row before "$H2") / $(row before "$H3")"
want="yes (local)|ok|ok|ok ($N_DATA)|$GPUS_HERE|OK / yes|missing|missing|$N_DATA missing|2|FAIL / yes|missing|missing|$N_DATA missing|$GPUS_HERE|FAIL"
check "  node 1 (the launching host, checked without ssh) OK; binary, config and $N_DATA shards missing on nodes 2 and 3; GPUs counted (stand-in: 2)" \
  "[ \"\$got\" = \"\$want\" ]"
explain "$got" "$want" before
check "  the last line names the failed hosts" "tail -1 before.out | grep -qx 'fleet check: FAIL (2 of 3 hosts): $NET.2 $NET.3'"

# ---- copy, then every host matches ---------------------------------------------------------------
fleet copy copy "$T/hosts" "${ARGS[@]}"
rc=$?
check "copy exits 0 (exit $rc, ${SECS} s)" "[ $rc -eq 0 ]"
check "  it copied $((N_DATA + 2)) files to each of nodes 2 and 3 and nothing to node 1" \
  "grep -q '^fleet copy: $NET.2: $((N_DATA + 2)) file(s) to copy' copy.out && grep -q '^fleet copy: $NET.3: $((N_DATA + 2)) file(s) to copy' copy.out && grep -qx 'fleet copy: $NET.1: up to date' copy.out"
check "  the check after it: every host OK" "tail -1 copy.out | grep -qx 'fleet check: OK (3 hosts)'"
[ $rc -eq 0 ] || show_tail copy.out 40
# shellcheck disable=SC2016  # run there
sums='cd "$1" && sha256sum bin/mpitrain config.yaml data/*.h5 && stat -c %a bin/mpitrain && ls -A "$1" "$1/data" | grep -c fleet-copy'
want=$(on_node 0 bash -c "$sums" sh "$SRV")
got2=$(on_ssh "$NET.2" "bash -c '$sums' sh $SRV" 2>&1)
# shellcheck disable=SC2034  # both are read by check's condition
got3=$(on_ssh "$NET.3" "bash -c '$sums' sh $SRV" 2>&1)
check "  sha256sum over ssh: nodes 2 and 3 have node 1's binary, config and shards, the binary mode $(sed -n "$((N_DATA + 3))p" <<< "$want"), no staging directory left" \
  "[ -n \"\$want\" ] && [ \"\$got2\" = \"\$want\" ] && [ \"\$got3\" = \"\$want\" ]"
[ "$got2" = "$want" ] || diff <(echo "$want") <(echo "$got2") | sed 's/^/  | /'

fleet after check "$T/hosts" "${ARGS[@]}" --data "$SRV/data" --hash-data
rc=$?
got="$(row after "$H1") / $(row after "$H2") / $(row after "$H3")"
want="yes (local)|ok|ok|ok ($N_DATA)|$GPUS_HERE|OK / yes|ok|ok|ok ($N_DATA)|2|OK / yes|ok|ok|ok ($N_DATA)|$GPUS_HERE|OK"
check "check --data DIR --hash-data after the copy exits 0, every sha256 matching (exit $rc)" "[ $rc -eq 0 ] && [ \"\$got\" = \"\$want\" ]"
explain "$got" "$want" after

# ---- drift: an edited config on node 3 (same size: only sha256 tells), a truncated shard on node 2 --
on_ssh "$NET.3" "sed -i 's/steps: 2/steps: 3/' $SRV/config.yaml"
on_ssh "$NET.2" "truncate -s -100 $SHARD"
fleet drift check "$T/hosts" "${ARGS[@]}"
rc=$?
got="$(row drift "$H1") / $(row drift "$H2") / $(row drift "$H3")"
want="yes (local)|ok|ok|ok ($N_DATA)|$GPUS_HERE|OK / yes|ok|ok|1 differ|2|FAIL / yes|ok|differs|ok ($N_DATA)|$GPUS_HERE|FAIL"
check "an edited config on node 3 and a truncated shard on node 2: exit 1, each on its own host (exit $rc)" \
  "[ $rc -eq 1 ] && [ \"\$got\" = \"\$want\" ]"
explain "$got" "$want" drift
check "  named below the table: node 3's config (same size, by sha256), node 2's shard with both sizes" \
  "grep -q '^  config $SRV/config.yaml: differs (same size; sha256 ' drift.out && grep -q '^  data $SHARD: differs (size [0-9]* there, [0-9]* here)' drift.out && tail -1 drift.out | grep -qx 'fleet check: FAIL (2 of 3 hosts): $NET.2 $NET.3'"

fleet recopy copy "$T/hosts" "${ARGS[@]}"
rc=$?
check "the next copy sends just those 2 files and exits 0 (exit $rc)" \
  "[ $rc -eq 0 ] && grep -q '^fleet copy: $NET.2: 1 file(s) to copy: ${SHARD##*/}' recopy.out && grep -q '^fleet copy: $NET.3: 1 file(s) to copy: config.yaml' recopy.out && tail -1 recopy.out | grep -qx 'fleet check: OK (3 hosts)'"
[ $rc -eq 0 ] || show_tail recopy.out 40

# ---- a same-size change (sizes pass; --hash-data finds it) and an extra shard ---------------------
on_ssh "$NET.2" "printf X | dd of=$SHARD bs=1 seek=1000 conv=notrunc status=none"
on_ssh "$NET.3" "cp $SHARD $SRV/data/f-train-99999.h5"
fleet samesize check "$T/hosts" "${ARGS[@]}" --hash-data
rc=$?
got="$(row samesize "$H2") / $(row samesize "$H3")"
want="yes|ok|ok|1 differ|2|FAIL / yes|ok|ok|1 extra|$GPUS_HERE|FAIL"
check "--hash-data finds one changed byte in a shard on node 2, and node 3's extra shard that the config's glob would add (exit $rc)" \
  "[ $rc -eq 1 ] && [ \"\$got\" = \"\$want\" ] && grep -q 'f-train-99999.h5' samesize.out"
explain "$got" "$want" samesize
fleet sizes check "$T/hosts" "${ARGS[@]}" --data "$SRV/data/f-*.h5"
rc=$?
check "  without --hash-data sizes are compared: node 2 passes (documented); --data GLOB also sees node 3's extra shard (exit $rc)" \
  "[ $rc -eq 1 ] && [ \"\$(row sizes \"$H2\")\" = 'yes|ok|ok|ok ($N_DATA)|2|OK' ] && [ \"\$(row sizes \"$H3\")\" = 'yes|ok|ok|1 extra|$GPUS_HERE|FAIL' ]"
on_ssh "$NET.3" "rm $SRV/data/f-train-99999.h5"
fleet rehash copy "$T/hosts" "${ARGS[@]}" --hash-data
rc=$?
check "  copy --hash-data repairs node 2's shard (exit $rc)" \
  "[ $rc -eq 0 ] && grep -q '^fleet copy: $NET.2: 1 file(s) to copy: ${SHARD##*/}' rehash.out"
[ $rc -eq 0 ] || show_tail rehash.out 40

# ---- copy --dest DIR: flat copies under DIR, on node 1 too (a plain cp there) --------------------
fleet dest copy "$T/hosts" "${ARGS[@]}" --dest "$SRV/flat"
rc=$?
want=$(on_node 0 sh -c "cd '$SRV' && sha256sum bin/mpitrain config.yaml data/*.h5 | cut -d' ' -f1 | sort")
flat_ok=1
for a in "$NET.1" "$NET.2" "$NET.3"; do
  got=$(on_ssh "$a" "cd $SRV/flat && sha256sum * | cut -d' ' -f1 | sort && ls -A | wc -l")
  [ "$got" = "$want"$'\n'"$((N_DATA + 2))" ] || { flat_ok=0; echo "  $a: $got"; }
done
check "copy --dest DIR: exit 0; on every host, node 1 (a local copy) included, DIR holds the $((N_DATA + 2)) files, sha256 as here, and nothing else (exit $rc)" \
  "[ $rc -eq 0 ] && [ $flat_ok -eq 1 ] && grep -q '^fleet copy: $NET.1 (local): copied $((N_DATA + 2)) file(s)' dest.out && tail -1 dest.out | grep -qx 'fleet check: OK (3 hosts)'"
[ $rc -eq 0 ] || show_tail dest.out 30

# ---- free space where checkpoints go: the tmpfs has ~0.1 GB -----------------------------------------
fleet space check "$T/hosts" "${ARGS[@]}" --min-free-gb 1
rc=$?
cells=$(for h in "$H1" "$H2" "$H3"; do free_cell space "$h"; done | grep -cE '^0\.[01] < 1$')
check "--min-free-gb 1: every host fails on the 100 MB tmpfs that holds checkpoint.dir's parent, free GB '0.1 < 1' (exit $rc)" \
  "[ $rc -eq 1 ] && [ $cells -eq 3 ] && tail -1 space.out | grep -q '^fleet check: FAIL (3 of 3 hosts)'"
[ "$cells" -eq 3 ] || show_tail space.out
fleet space2 check "$T/hosts" "${ARGS[@]}" --min-free-gb 0.02
rc=$?
check "  --min-free-gb 0.02: every host passes (exit $rc)" "[ $rc -eq 0 ]"
[ $rc -eq 0 ] || show_tail space2.out

# ---- unreachable hosts: nobody at .99; at .98 an sshd that accepts connections but is stopped ----
run_quiet ip -n "$SWITCH_NS" addr add "$NET.98/24" dev br0
mkdir "$T/hung"
netns_sshd_config "$T/hung" "$NET.98" hung
ip netns exec "$SWITCH_NS" /usr/sbin/sshd -D -e -f "$T/hung/sshd_config" > "$T/hung/sshd.log" 2>&1 &
HUNG=$!
for _ in $(seq 50); do on_node 0 timeout 2 bash -c "echo > /dev/tcp/$NET.98/22" 2>/dev/null && break; sleep 0.2; done
kill -STOP "$HUNG"
{ cat "$T/hosts"; echo "$NET.99 slots=1"; echo "$NET.98 slots=1"; } > "$T/hosts.down"
fleet down check "$T/hosts.down" "${ARGS[@]}"
rc=$?
kill -CONT "$HUNG"; kill "$HUNG"; wait "$HUNG" 2>/dev/null
check "a host nobody answers and a host whose sshd never speaks: exit 1 after ${SECS} s (limit 40 s)" "[ $rc -eq 1 ] && [ $SECS -lt 40 ]"
got="$(row down "$NET.99") / $(row down "$NET.98") / $(row down "$H1") / $(row down "$H2") / $(row down "$H3")"
want="no|-|-|-|-|FAIL / no|-|-|-|-|FAIL / yes (local)|ok|ok|ok ($N_DATA)|$GPUS_HERE|OK / yes|ok|ok|ok ($N_DATA)|2|OK / yes|ok|ok|ok ($N_DATA)|$GPUS_HERE|OK"
check "  both reported unreachable, with ssh's reason; the others OK" \
  "[ \"\$got\" = \"\$want\" ] && grep -A1 -x '$NET.99:' down.out | grep -q '^  unreachable: ..' && grep -A1 -x '$NET.98:' down.out | grep -q '^  unreachable: ..'"
explain "$got" "$want" down
grep '^  unreachable:' down.out | sed 's/^/  /'

# ---- bad usage: exit 2 and one line ------------------------------------------------------------------
usage_ok=1
for args in "" "frobnicate" "check" "check $T/hosts --config $T/config.yaml" "check $T/hosts --binary $BIN" \
  "check $T/nohosts --binary $BIN --config $T/config.yaml" "check $T/hosts --binary $T/nobin --config $T/config.yaml" \
  "copy $T/hosts --binary $BIN --config $T/config.yaml --bogus" "check $T/hosts --binary $BIN --config $T/config.yaml --min-free-gb lots" \
  "check $T/hosts --binary $BIN --config $T/config.yaml --data $T/nothing*" "copy $T/hosts --binary $BIN --config $T/config.yaml --dest relative/dir"; do
  # shellcheck disable=SC2086  # the words of one case
  out=$("$FLEET" $args 2>&1)
  rc=$?
  if [ $rc -ne 2 ] || [ "$(grep -c . <<< "$out")" -ne 1 ] || [[ $out != "fleet.sh: "* ]]; then
    usage_ok=0
    echo "  fleet.sh $args -> exit $rc: $out"
  fi
done
check "bad usage (11 cases): exit 2 with one line 'fleet.sh: ...'" "[ $usage_ok -eq 1 ]"

# ---- train on the three hosts from the copies ------------------------------------------------------
netns_mpi_env "$ROOT"
bounded "$MPIRUN_LIMIT" nsenter --target "${SSHD_PIDS[0]}" --net --uts --mount --root --wd=/ -- \
  mpirun --hostfile "$T/hosts" -np 4 --bind-to none "$SRV/bin/mpitrain" "$SRV/config.yaml" > train.out 2>&1
rc=$?
check "mpirun trains 2 steps on 3 hosts from the copied binary, config and shards (exit $rc)" \
  "[ $rc -eq 0 ] && grep -q '4 ranks on 3 hosts: fleet-node1\[0-1\] fleet-node2\[2\] fleet-node3\[3\]' train.out"
[ $rc -eq 0 ] || show_tail train.out 30
check "  the checkpoint is on node 1's disk only" \
  "on_node 0 test -f '$SRV/ckpt/ckpt-00000002.h5' && ! on_node 1 test -e '$SRV/ckpt' && ! on_node 2 test -e '$SRV/ckpt'"
