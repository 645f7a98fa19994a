#!/usr/bin/env bash
# Fault injection under a real mpirun -np 4: a rank killed with SIGKILL, a rank that stops
# calling collectives and a rank frozen by SIGSTOP (the watchdog must name that rank), a corrupt
# newest checkpoint (fallback on resume), a disk that fills up during a save (root: a small tmpfs).
# Prints PASS/FAIL lines and the measured times to exit. Usage: fault_test.sh PATH/TO/mpitrain
# [LAUNCHER]: Open MPI's mpirun (the default) or, for an MPICH build, hydra's mpiexec.
set -u
BIN=$(realpath "$1")
MPIRUN=${2:-mpirun}
FAMILY=$("$BIN" --version 2>/dev/null | sed -n 's/^mpi: \([a-z]*\) .*/\1/p')
case $FAMILY in
  openmpi) RANK_VAR=OMPI_COMM_WORLD_RANK ;;
  mpich) RANK_VAR=PMI_RANK ;;
  *) echo "FAIL: $1 --version names no MPI family (openmpi or mpich)"; exit 1 ;;
esac
echo "binary: $FAMILY build, launcher $MPIRUN"
# mpirun LAUNCHER-ARGS...: the MPITRAIN_TEST_* variables of the caller reach every rank (hydra passes
# the whole environment on; Open MPI's mpirun only what -x names)
mpirun() {
  local forward=() v
  if [ "$FAMILY" = openmpi ]; then
    for v in ${!MPITRAIN_TEST_@}; do forward+=(-x "$v"); done
  fi
  command "$MPIRUN" "${forward[@]}" "$@"
}
e2e_on_exit() {  # its ranks and the small tmpfs of the disk-full case
  pkill -9 -f "$WORK" 2>/dev/null
  umount "$WORK/full" 2>/dev/null
}
E2E_NAME=fault
E2E_NO_CORPUS=1  # its own corpus: 200 documents
# shellcheck source=e2e_lib.sh
. "$(dirname "$0")/e2e_lib.sh"

mkdir corpus
for i in $(seq 1 200); do printf 'Line %d of a small corpus for fault tests.\n%%\n' $i >> corpus/a.txt; done
"$BIN" pack corpus -o data/c --doc-separator % --val-fraction 0.1 > /dev/null 2>&1
cat > cfg.yaml <<YAML
model: {preset: custom, n_layer: 1, n_head: 2, n_embd: 16, seq_len: 32}
data: {train: [$WORK/data/c-train-*.h5]}
train: {micro_batch: 2, steps: 100000, threads: 1, out_dir: $WORK/run}
eval: {every: 0}
log: {every: 1}
checkpoint: {dir: $WORK/ckpt, every: 5, keep: 3}
fault: {collective_timeout_s: 5, first_collective_timeout_s: 30}
YAML

wait_for_step() {  # file, step
  for _ in $(seq 1 900); do grep -q "step *$2/" "$1" 2>/dev/null && return 0; sleep 0.1; done
  return 1
}

# ---- kill -9 one of 4 ranks: every rank gone quickly, non-zero exit, newest checkpoint loads ----
mpirun -np 4 "$BIN" "$WORK/cfg.yaml" > kill.out 2>&1 &
mpid=$!
wait_for_step kill.out 12
victim=$(pgrep -f "$BIN $WORK/cfg.yaml" | sed -n 3p)
t0=$(date +%s.%N)
kill -9 "$victim"
timeout 60 tail --pid=$mpid -f /dev/null
rc=$(wait $mpid; echo $?)
t1=$(date +%s.%N)
left=$(pgrep -f "$BIN $WORK/cfg.yaml" | wc -l)
secs=$(echo "$t1 - $t0" | bc)
echo "time from kill -9 to job exit: ${secs} s (exit code $rc)"
check "kill -9 of one rank: job exits non-zero within 30 s" "[ $rc -ne 0 ] && [ \$(echo \"$secs < 30\" | bc) -eq 1 ]"
check "kill -9 of one rank: no orphan ranks" "[ $left -eq 0 ]"
latest=$(cat ckpt/latest)
"$BIN" inspect "ckpt/$latest" > inspect.out 2>&1
check "newest checkpoint after the kill is complete and loadable" "grep -q '@step' inspect.out"
"$BIN" sample "ckpt/$latest" --tokens 5 > /dev/null 2>&1
check "newest checkpoint after the kill loads (sample)" "[ \$? -eq 0 ]"

# ---- a corrupt newest checkpoint: resume falls back to the previous one with a warning ----
# The newest is the one `latest` names. A kill between a file's rename and `latest`'s update
# leaves a newer complete file beside it (seen under hydra): the fallback then takes that one,
# the newest of the others, as resume_candidates orders them.
newest=ckpt/$(cat ckpt/latest)
prev=$(ls ckpt/ckpt-*.h5 | sort | grep -vx "$newest" | tail -1)
size=$(stat -c %s "$newest")
truncate -s $((size / 2)) "$newest"
mpirun -np 2 "$BIN" "$WORK/cfg.yaml" --stop-after $(( $(basename "$prev" .h5 | sed 's/ckpt-0*//') + 2 )) > fallback.out 2>&1
rc=$?
check "corrupt newest checkpoint (the one latest names): resume falls back to the next complete one" \
  "[ $rc -eq 0 ] && grep -q 'cannot resume from .*$(basename "$newest")' fallback.out && grep -q 'resumed from .*$(basename "$prev")' fallback.out"

# ---- killed while writing a checkpoint: `latest` still names the previous complete one ----
rm -rf ckpt run
MPITRAIN_TEST_DIE_IN_SAVE=10 mpirun -np 2 "$BIN" "$WORK/cfg.yaml" > save.out 2>&1
rc=$?
check "killed during the checkpoint write: job fails" "[ $rc -ne 0 ] && [ -f ckpt/ckpt-00000010.h5.tmp ]"
check "killed during the checkpoint write: latest still names the previous complete checkpoint" \
  "grep -qx ckpt-00000005.h5 ckpt/latest && [ ! -f ckpt/ckpt-00000010.h5 ]"
mpirun -np 2 "$BIN" "$WORK/cfg.yaml" --stop-after 12 > save2.out 2>&1
check "killed during the checkpoint write: resume continues from step 5" \
  "[ \$? -eq 0 ] && grep -q 'resumed from .*ckpt-00000005.h5 at step 5' save2.out"

# The same with ZeRO-1, where both ranks write their shares of the file: rank 0 dies after its
# slices of the model tensors, rank 1 may have written all of its own.
rm -rf ckpt run
MPITRAIN_TEST_DIE_IN_SAVE=10 mpirun -np 2 "$BIN" "$WORK/cfg.yaml" --set optim.zero=1 \
  > save-zero.out 2>&1
rc=$?
check "ZeRO-1, every rank writing its share: the shares are written by 2 ranks" \
  "grep -q 'every rank writes its ZeRO-1 share (2 writers' save-zero.out"
check "ZeRO-1 shares, killed during the checkpoint write: job fails, latest still names step 5" \
  "[ $rc -ne 0 ] && [ -f ckpt/ckpt-00000010.h5.tmp ] && grep -qx ckpt-00000005.h5 ckpt/latest && [ ! -f ckpt/ckpt-00000010.h5 ]"
mpirun -np 2 "$BIN" "$WORK/cfg.yaml" --set optim.zero=1 --stop-after 12 > save-zero2.out 2>&1
check "ZeRO-1 shares, killed during the checkpoint write: resume continues from step 5" \
  "[ \$? -eq 0 ] && grep -q 'resumed from .*ckpt-00000005.h5 at step 5' save-zero2.out"

# ---- a rank that stops calling collectives: the watchdog names it and aborts the job ----
rm -rf ckpt run
HOST=$(hostname)
MPITRAIN_TEST_HANG=2:8 mpirun -np 4 "$BIN" "$WORK/cfg.yaml" > hang.out 2>&1 &
mpid=$!
wait_for_step hang.out 7
t0=$(date +%s.%N)
timeout 90 tail --pid=$mpid -f /dev/null
rc=$(wait $mpid; echo $?)
t1=$(date +%s.%N)
secs=$(echo "$t1 - $t0" | bc)
echo "time from the hang (step 8) to job exit with a 5 s collective timeout: ${secs} s (exit code $rc)"
grep 'watchdog:' hang.out | sed 's/^/  /'
check "watchdog: a hung rank ends the job with exit code 3 within 20 s" \
  "[ $rc -eq 3 ] && [ \$(echo \"$secs < 20\" | bc) -eq 1 ]"
check "watchdog: the message names the waiting rank's collective, step, rank and host" \
  "grep -q 'watchdog: .* (collective #[0-9]*) at step 8 on rank [013] (host $HOST) has not completed after' hang.out"
check "watchdog: the message names the stopped rank 2 and its host, and where it is" \
  "grep -q 'rank 2 (host $HOST) has not arrived: it is at step 8, outside any collective for [0-9.]* s (its last was #[0-9]* ' hang.out"
check "watchdog: the other waiting ranks are not blamed" \
  "! grep 'watchdog:' hang.out | grep -q -E 'rank [013] \\(host [^)]*\\) (has not arrived|did not answer)'"
check "watchdog: the report is printed once" "[ \$(grep -c 'watchdog:' hang.out) -eq 1 ]"
check "watchdog: no orphan ranks" "[ \$(pgrep -f \"$BIN $WORK/cfg.yaml\" | wc -l) -eq 0 ]"

# ---- a rank frozen whole (SIGSTOP: not even its watchdog thread runs): the query times out ----
rm -rf ckpt run
mpirun -np 4 "$BIN" "$WORK/cfg.yaml" > frozen.out 2>&1 &
mpid=$!
wait_for_step frozen.out 7
victim=""
for p in $(pgrep -f "$BIN $WORK/cfg.yaml"); do
  tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx "$RANK_VAR=2" && victim=$p
done
t0=$(date +%s.%N)
kill -STOP "$victim"
timeout 90 tail --pid=$mpid -f /dev/null
rc=$(wait $mpid; echo $?)
t1=$(date +%s.%N)
secs=$(echo "$t1 - $t0" | bc)
echo "time from SIGSTOP of rank 2 to job exit with a 5 s collective timeout: ${secs} s (exit code $rc)"
grep 'watchdog:' frozen.out | sed 's/^/  /'
check "watchdog: a frozen rank ends the job with exit code 3 within 25 s" \
  "[ -n \"$victim\" ] && [ $rc -eq 3 ] && [ \$(echo \"$secs < 25\" | bc) -eq 1 ]"
check "watchdog: the frozen rank 2 is named as not answering" \
  "grep -q 'rank 2 (host $HOST) did not answer within 3 s' frozen.out && [ \$(grep -c 'watchdog:' frozen.out) -eq 1 ]"
check "watchdog: no orphan ranks after the frozen rank" "[ \$(pgrep -f \"$BIN $WORK/cfg.yaml\" | wc -l) -eq 0 ]"

# ---- disk full during a save: exit 2, one line, the .tmp removed, the earlier checkpoint intact ----
# A tmpfs with room for one checkpoint of this model (~1.4 MB each) but not two: step 2's save
# fits, step 4's fails half-way (direct writes on kernels whose tmpfs has O_DIRECT, 6.6 and later;
# the page-cache path on older ones).
if [ "$(id -u)" -eq 0 ] && mkdir -p full && mount -t tmpfs -o size=2200k tmpfs full 2>/dev/null; then
  cat > full.yaml <<YAML
model: {preset: custom, n_layer: 2, n_head: 2, n_embd: 64, seq_len: 32}
data: {train: [$WORK/data/c-train-*.h5]}
train: {micro_batch: 2, steps: 4, threads: 1, out_dir: $WORK/run-full}
optim: {warmup_steps: 1}
eval: {every: 0}
checkpoint: {dir: $WORK/full/ck, every: 2, keep: 2}
sample: {tokens: 0}
YAML
  mpirun -np 2 "$BIN" "$WORK/full.yaml" > full.out 2>&1
  rc=$?
  check "disk full at step 4's save: exit 2, one line naming the file, 'No space left on device'" \
    "[ $rc -eq 2 ] && [ \$(grep -c 'mpitrain: .*full/ck/ckpt-00000004.h5.tmp: cannot write checkpoint (disk full or not writable?): .*No space left on device; earlier checkpoints are untouched' full.out) -eq 1 ]"
  check "disk full: no .tmp left, latest still names step 2" \
    "! ls full/ck/*.tmp >/dev/null 2>&1 && grep -qx ckpt-00000002.h5 full/ck/latest"
  "$BIN" inspect full/ck/ckpt-00000002.h5 > /dev/null 2>&1 && cp full/ck/ckpt-00000002.h5 ck2.h5
  # ZeRO-1 with both ranks writing their shares, asynchronously: whichever rank's write fails,
  # rank 0 says so once, naming that rank, and every rank ends with exit 2.
  rm -rf full/ck
  mpirun -np 2 "$BIN" "$WORK/full.yaml" --set optim.zero=1 --set checkpoint.async=true > full-zero.out 2>&1
  rc=$?
  check "disk full, ZeRO-1 shares written asynchronously: exit 2, one line naming the file and the rank" \
    "[ $rc -eq 2 ] && grep -q 'every rank writes its ZeRO-1 share' full-zero.out && [ \$(grep -c 'mpitrain: .*full/ck/ckpt-00000004.h5.tmp: cannot write checkpoint (disk full or not writable?): .*No space left on device; earlier checkpoints are untouched' full-zero.out) -eq 1 ] && [ \$(grep -c '^mpitrain: ' full-zero.out) -eq 1 ]"
  check "disk full, ZeRO-1 shares: no .tmp left, latest still names step 2, which loads" \
    "! ls full/ck/*.tmp >/dev/null 2>&1 && grep -qx ckpt-00000002.h5 full/ck/latest && '$BIN' sample full/ck/ckpt-00000002.h5 --tokens 2 >/dev/null 2>&1"
  umount full
  "$BIN" "$WORK/full.yaml" --set checkpoint.dir=$WORK/ck2dir --set checkpoint.resume=$WORK/ck2.h5 \
    --stop-after 3 > full-resume.out 2>&1
  check "disk full: the checkpoint of step 2 loads (every CRC verified) and training resumes from it" \
    "grep -q 'resumed from $WORK/ck2.h5 at step 2' full-resume.out"
else
  echo "SKIP (not counted): disk-full check needs root to mount a tmpfs"
fi

summary
