#!/usr/bin/env bash
# Pipeline parallelism: plan's predicted idle share per stage against what training measures, for
# each schedule, on PP ranks of this machine (one rank per core: the stages run at once, as on
# separate machines). For each of 1f1b, gpipe and interleaved (pp_virtual V): `mpitrain plan` (each
# stage's chunks timed inside a few steps of the schedule, the schedule simulated from those times
# and the link's measured transfer time: simulate_pipeline), then STEPS training steps, whose end
# line says each stage's measured
# share of its micro-batches' time spent waiting for the neighbouring stages. The table: per
# stage the schedule's bubble alone ((pp - 1) / (v m + pp - 1)), plan's prediction, the measured
# share and prediction / measured; then the step's ms and tokens/s, predicted and measured (median
# step after WARMUP steps). The one-rank run of the same steps is the baseline of the tokens/s.
#
#     bash bench/pp.sh [build/mpitrain]
#
# Environment: PP (2), V (2), N_LAYER (8), N_EMBD (256), N_HEAD (4), SEQ (128), MICRO_BATCH (4),
# ACCUM (8), STEPS (12), WARMUP (3), THREADS (1), PLAN_ITERS (5: plan --iters, its timed steps).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=$(realpath "${1:-$REPO/build/mpitrain}")
PP=${PP:-2} V=${V:-2} L=${N_LAYER:-8} D=${N_EMBD:-256} H=${N_HEAD:-4} T=${SEQ:-128} B=${MICRO_BATCH:-4}
M=${ACCUM:-8} STEPS=${STEPS:-12} WARMUP=${WARMUP:-3} THREADS=${THREADS:-1} PLAN_ITERS=${PLAN_ITERS:-5}
WORK=$(mktemp -d /tmp/mpitrain-bench-pp-XXXXXX)
[ -n "${KEEP:-}" ] || trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
/usr/bin/python3 - <<'PYEOF'
import numpy as np
rng = np.random.default_rng(0)
np.save("tokens.npy", rng.integers(1, 257, size=400000).astype(np.uint16))
PYEOF
"$BIN" pack tokens.npy -o data/t --vocab-size 257 --eot 0 --val-fraction 0 > pack.out 2>&1 || { cat pack.out; exit 1; }
cat > m.yaml <<EOF
model: {preset: custom, n_layer: $L, n_head: $H, n_embd: $D, seq_len: $T}
data: {train: [data/t-train-*.h5], val: []}
train: {micro_batch: $B, steps: $STEPS, threads: $THREADS, grad_accum: $M}
optim: {warmup_steps: 2}
eval: {every: 0}
log: {every: 1}
checkpoint: {every: 0, resume: none}
sample: {tokens: 0}
EOF
median_ms() { grep -o '[0-9]* ms/step' "$1" | awk -v w="$WARMUP" 'NR > w { print $1 }' | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
"$BIN" m.yaml --set train.out_dir=run1 --set checkpoint.dir=ck1 > one.out 2>&1 || { tail -5 one.out; exit 1; }
one_ms=$(median_ms one.out)
tokens=$((M * B * T))
printf 'pipeline parallel on %s ranks of %s (%s cores), %s blocks of width %s, micro-batch %s x %s, %s micro-batches per step\n' \
  "$PP" "$(uname -n)" "$(nproc)" "$L" "$D" "$B" "$T" "$M"
printf '| schedule | stage | bubble alone | plan: idle | measured idle | plan / measured |\n|---|---:|---:|---:|---:|---:|\n'
summary=""
for sched in 1f1b gpipe interleaved; do
  set -- --set parallel.pp="$PP" --set parallel.pp_schedule=$sched
  [ $sched = interleaved ] && set -- "$@" --set parallel.pp_virtual="$V"
  mpirun -np "$PP" --oversubscribe "$BIN" plan m.yaml --iters "$PLAN_ITERS" "$@" > plan_$sched.out 2>&1 || { tail -5 plan_$sched.out; exit 1; }
  mpirun -np "$PP" --oversubscribe "$BIN" m.yaml "$@" --set train.out_dir=run_$sched --set checkpoint.dir=ck_$sched \
    > train_$sched.out 2>&1 || { tail -5 train_$sched.out; exit 1; }
  v=1
  [ $sched = interleaved ] && v=$V
  bubble=$(awk -v p="$PP" -v v="$v" -v m="$M" 'BEGIN { printf "%.1f%%", 100 * (p - 1) / (v * m + p - 1) }')
  measured=$(grep -o 'stage [0-9]* [0-9.]*%' train_$sched.out | awk '{ print $3 }')
  planned=$(grep '^| [0-9]' plan_$sched.out | awk -F'|' '{ gsub(/ /, "", $10); print $10 }')
  paste <(echo "$planned") <(echo "$measured") | awk -v s="$sched$([ $v -gt 1 ] && echo " v $v")" -v b="$bubble" \
    '{ p = $1 + 0; q = $2 + 0; printf "| %s | %d | %s | %s | %s | %.2f |\n", s, NR - 1, b, $1, $2, (q > 0 ? p / q : 0) }'
  pred_ms=$(grep -o 'take [0-9.]* ms' plan_$sched.out | awk '{ print $2 }')
  ms=$(median_ms train_$sched.out)
  summary+=$(awk -v s="$sched" -v p="$pred_ms" -v ms="$ms" -v t="$tokens" -v one="$one_ms" \
    'BEGIN { printf "| %s | %s | %s | %.0f | %.2fx |", s, p, ms, t * 1000 / ms, one / ms }')$'\n'
done
printf '\n| schedule | plan: micro-batches ms | measured ms/step | tokens/s | vs one rank (%s ms/step) |\n|---|---:|---:|---:|---:|\n%s' \
  "$one_ms" "$summary"
