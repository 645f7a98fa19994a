#!/usr/bin/env bash
# optim.state_dtype: bf16 against fp32 AdamW moments on one CPU rank (issue 57, section 3): the same
# STEPS steps of a small GPT (N_LAYER x N_EMBD, byte vocabulary, seq SEQ, micro-batch MICRO_BATCH)
# from the same weights and data, with fp32 and with bf16 moments, and a second fp32 run from
# another seed (train.seed: other initial weights, the same data) as the noise a result is judged
# against: the bf16 gap to fp32 should be of the order of the seed gap.
#
#     bash bench/optim_state_dtype.sh [build/mpitrain]
#
# Columns: the train loss averaged over the last 100 steps (one step's loss is noisy), the final
# validation loss, AdamW's state per rank as the start-up line reports it, and the median ms per
# step after 20 warm-up steps; ratios are against fp32 measured in the same run.
#
# Environment: STEPS (1000), N_LAYER/N_EMBD/N_HEAD/SEQ/MICRO_BATCH (2/128/4/64/8), MPIRUN (mpirun).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=$(realpath "${1:-$REPO/build/mpitrain}")
MPIRUN=${MPIRUN:-mpirun}
STEPS=${STEPS:-1000}
L=${N_LAYER:-2} D=${N_EMBD:-128} H=${N_HEAD:-4} T=${SEQ:-64} B=${MICRO_BATCH:-8}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
WORK=$(mktemp -d /tmp/mpitrain-state-dtype-bench-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
. "$REPO/bench/table_lib.sh"
word_corpus "$((STEPS * B * (T + 1) + 65536))" words.txt
awk 'NR % 20 == 0 { print "%" } { print }' words.txt > corpus.txt  # documents of 20 lines: a val split
"$BIN" pack corpus.txt -o data/t --doc-separator % --val-fraction 0.05 > pack.log 2>&1 || { cat pack.log; exit 1; }

run() {  # state_dtype seed -> "train_loss val_loss state_mib ms_per_step"
  local out=$WORK/run-$1-$2
  cat > "$out.yaml" <<YAML
model: {preset: custom, n_layer: $L, n_head: $H, n_embd: $D, seq_len: $T}
data: {train: [$WORK/data/t-train-*.h5], val: [$WORK/data/t-val-*.h5]}
train: {micro_batch: $B, steps: $STEPS, threads: 1, seed: $2, out_dir: $out}
optim: {lr: 0.003, min_lr: 0.0003, warmup_steps: 50, state_dtype: $1}
eval: {every: $STEPS, batches: 20}
log: {every: 1}
checkpoint: {dir: $out/ckpt, every: 0, resume: none, at_end: false}
sample: {tokens: 0}
YAML
  "$MPIRUN" -np 1 "$BIN" "$out.yaml" > "$out.log" 2>&1 || { tail -20 "$out.log" >&2; exit 1; }
  local loss val mib ms
  loss=$(grep '"loss"' "$out/metrics.jsonl" | tail -n 100 | sed 's/.*"loss": \([0-9.e+-]*\).*/\1/' |
         awk '{ s += $1 } END { printf "%.4f", s / NR }')
  val=$(grep '"val_loss"' "$out/metrics.jsonl" | tail -1 | sed 's/.*"val_loss": \([0-9.e+-]*\).*/\1/')
  mib=$(grep -o 'optimizer state: [0-9.e+-]* MiB' "$out.log" | head -1 | awk '{ print $3 }')
  ms=$(grep '"ms_per_step"' "$out/metrics.jsonl" | tail -n +21 | sed 's/.*"ms_per_step": \([0-9.]*\).*/\1/' | median)
  echo "$loss $val $mib $ms"
}

echo "AdamW moments in fp32 and bf16 (optim.state_dtype), one CPU rank: GPT $L layers x $D, $H heads, seq $T, micro-batch $B, $STEPS steps, $(date -u +%F), $("$BIN" --version 2>/dev/null | head -n 1)"
r=$(run fp32 1); read -r l0 v0 m0 t0 <<< "$r"
r=$(run bf16 1); read -r l1 v1 m1 t1 <<< "$r"
r=$(run fp32 2); read -r l2 v2 m2 t2 <<< "$r"
echo "| run | train loss (last 100 steps) | val loss | AdamW state (MiB) | ratio to fp32 | ms/step | ratio to fp32 |"
echo "|---|---:|---:|---:|---:|---:|---:|"
printf '| fp32 moments, seed 1 | %s | %s | %s | 1.00 | %s | 1.00 |\n' "$l0" "$v0" "$m0" "$t0"
printf '| bf16 moments, seed 1 | %s | %s | %s | %s | %s | %s |\n' "$l1" "$v1" "$m1" "$(ratio "$m1" "$m0")" "$t1" "$(ratio "$t1" "$t0")"
printf '| fp32 moments, seed 2 (the noise) | %s | %s | %s | %s | %s | %s |\n' "$l2" "$v2" "$m2" "$(ratio "$m2" "$m0")" "$t2" "$(ratio "$t2" "$t0")"
awk -v a="$v0" -v b="$v1" -v c="$v2" 'BEGIN {
  printf "val loss: bf16 - fp32 = %+.4f; the seed noise |fp32 seed 2 - seed 1| = %.4f\n", b - a, (c > a ? c - a : a - c) }'
