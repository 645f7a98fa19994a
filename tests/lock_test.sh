#!/usr/bin/env bash
# One job per checkpoint directory (include/mpitrain/dir_lock.h), with real jobs: a second job on a
# directory in use is refused (exit 2 on every rank, one line naming the directory and the holder,
# printed once, the holder's checkpoints untouched); --force-unlock never overrides a live holder
# on this host; a holder killed with -9 does not block the next job, which resumes its checkpoint;
# a lock left by a holder that is gone from another host (held here by flock(1), as a shared
# filesystem keeps a dead node's lock) is refused, then overridden by --force-unlock, which says
# whose lock it overrode. ZeRO-1 ranks that do not see rank 0's checkpoint.dir leave the writing to
# rank 0. The holder on another real host: tests/multihost/netns_test.sh.
# Usage: lock_test.sh PATH/TO/mpitrain [mpirun]
set -u
BIN=$(realpath "$1")
MPIRUN=${2:-mpirun}
BG=()  # background processes this test started, killed on exit whatever happens
e2e_on_exit() {
  for p in "${BG[@]}"; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
}
E2E_NAME=lock
E2E_NO_CORPUS=1  # its own corpus: shards of 3000 tokens
# shellcheck source=e2e_lib.sh
. "$(dirname "$0")/e2e_lib.sh"

mkdir corpus
for i in $(seq 1 60); do
  printf 'The quick brown fox %d jumps over the lazy dog.\n%%\nA stitch in time saves %d.\n%%\n' $i $i >> corpus/a.txt
done
"$BIN" pack corpus -o data/c --doc-separator % --shard-tokens 3000 > pack.out 2>&1 || { cat pack.out; exit 1; }
cat > cfg.yaml <<'YAML'
model: {preset: custom, n_layer: 1, n_head: 2, n_embd: 16, seq_len: 32}
data: {train: [data/c-train-*.h5]}
train: {micro_batch: 2, steps: 1000000, threads: 1, out_dir: run}
optim: {warmup_steps: 2}
eval: {every: 0}
log: {every: 50}
checkpoint: {dir: ckpt, every: 20, keep: 2}
sample: {tokens: 0}
YAML
host=$(uname -n)

# ---- the holder: a long run, once it has written a checkpoint ----
"$BIN" cfg.yaml > a.out 2>&1 &
A=$!
BG+=("$A")
for _ in $(seq 1 600); do [ -s ckpt/latest ] && break; sleep 0.1; done
check "holder runs and has written a checkpoint" "kill -0 $A && [ -s ckpt/latest ]"
check "the lock file names the holder: host, pid, start time" \
  "grep -qx 'host=$host' ckpt/.mpitrain.lock && grep -qx 'pid=$A' ckpt/.mpitrain.lock && grep -q '^started=20' ckpt/.mpitrain.lock"

# ---- a second job on the same directory ----
before=$(ls -l --time-style=+%s.%N ckpt/*.h5 | wc -l)
expect_usage "second job (mpirun -np 2) refused: exit 2, one line naming the directory and the holder" \
  "cfg.yaml: checkpoint.dir: 'ckpt' is in use by another job (host $host, pid $A, started 20" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml
check "the refused job resumed nothing and wrote nothing (no 'resumed', no training)" \
  "! grep -q 'resumed from' err.out && ! grep -q 'step ' err.out"
check "the holder is still running" "kill -0 $A"
expect_usage "--force-unlock does not override a live holder on this host" \
  "is locked by pid $A, which is alive on this host" "$BIN" cfg.yaml --force-unlock
check "the holder is still running after the refused --force-unlock" "kill -0 $A"
expect_usage "singleton second job refused too" "is in use by another job" "$BIN" cfg.yaml

# ---- the holder killed with -9: the next job starts and resumes its checkpoint ----
kill -9 $A
wait $A 2>/dev/null
at=$(sed 's/ckpt-0*\([0-9]*\).h5/\1/' ckpt/latest)
"$BIN" cfg.yaml --stop-after $((at + 2)) > c.out 2>&1
rc=$?
check "after kill -9 of the holder the next job starts (exit $rc) and resumes at step $at" \
  "[ $rc -eq 0 ] && grep -q \"resumed from ckpt/ckpt-0*$at.h5 at step $at\" c.out"
check "a job that ended leaves the lock free and the lock file without a holder" \
  "[ -f ckpt/.mpitrain.lock ] && [ ! -s ckpt/.mpitrain.lock ]"

# ---- a lock kept for a holder that is gone from another host ----
printf 'host=mpt-gone-node\npid=4242\nslurm_job=777\nstarted=2026-01-01T00:00:00Z\n' > ckpt/.mpitrain.lock
( exec 9<ckpt/.mpitrain.lock && flock -n 9 && exec sleep 600 ) &   # the holder is the sleep itself
F=$!
BG+=("$F")
sleep 0.5
expect_usage "a lock kept for a gone holder on another host is refused, naming it with its Slurm job" \
  "in use by another job (host mpt-gone-node, pid 4242, Slurm job 777, started 2026-01-01T00:00:00Z" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml
"$MPIRUN" -np 2 "$BIN" cfg.yaml --force-unlock --stop-after $((at + 4)) > force.out 2>&1
rc=$?
check "--force-unlock overrides it (exit $rc) and says whose lock" \
  "[ $rc -eq 0 ] && grep -q 'force-unlock overrode the lock of host mpt-gone-node, pid 4242, Slurm job 777' force.out"
check "--force-unlock: the run resumed the directory's checkpoint" "grep -q 'resumed from ckpt/' force.out"
kill $F 2>/dev/null
"$BIN" cfg.yaml --force-unlock --stop-after $((at + 5)) > force2.out 2>&1
rc=$?
check "--force-unlock on a free directory overrides nothing and says so" \
  "[ $rc -eq 0 ] && grep -q \"'ckpt' was not locked, nothing overridden\" force2.out"

# ---- ranks that do not see the same checkpoint.dir write nothing there ----
# ZeRO-1 ranks write their own shares of a checkpoint only where every rank sees rank 0's lock
# file in checkpoint.dir. Here rank 1 runs in another working directory, so the relative
# checkpoint.dir is another directory for it (as a node-local disk would be): rank 0 writes whole
# checkpoints alone, and says why.
# (Each rank changes into its own directory by its rank: OpenMPI 5's mpirun crashed on an MPMD
# command line with -wdir per context.)
mkdir -p split-0 split-1
sed -e "s|data/c-train|$WORK/data/c-train|" -e 's|steps: 1000000|steps: 4|' cfg.yaml > split.yaml
"$MPIRUN" -np 2 bash -c 'cd "$0/split-$OMPI_COMM_WORLD_RANK" && exec "$1" "$0/split.yaml" --set optim.zero=1' \
  "$WORK" "$BIN" > split.out 2>&1
rc=$?
check "a checkpoint.dir not seen by every rank: rank 0 writes whole checkpoints alone (exit $rc) and says why" \
  "[ $rc -eq 0 ] && grep -q \"rank 0 writes whole checkpoints (ZeRO-1 state gathered to it): rank 1 (host .*) does not see checkpoint.dir 'ckpt'\" split.out"
check "... its checkpoint is complete and loads, and nothing was written on rank 1's side" \
  "'$BIN' sample split-0/ckpt/ckpt-00000004.h5 --tokens 2 >/dev/null 2>&1 && ! ls split-1/ckpt/ckpt-* >/dev/null 2>&1"

summary
