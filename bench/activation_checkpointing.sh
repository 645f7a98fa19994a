#!/usr/bin/env bash
# Activation checkpointing on one CPU rank: peak memory and step time of train.activation_checkpointing
# none (the baseline), selective and full, each on every block and on every 2nd block, in one run. The model:
# GPT-2-shaped, N_LAYER layers of width N_EMBD (default 8 x 256, 6.4M parameters), micro-batch
# MICRO_BATCH x SEQ (default 8 x 512), byte vocabulary, fp32, one torch thread: activations, not
# parameters, dominate its memory (libtorch 1.13's explicit attention keeps the heads' T x T scores).
#
#     bash bench/activation_checkpointing.sh [build/mpitrain]
#
# "peak RSS" is the process's peak resident memory (GNU time): libtorch, MPI, parameters, gradients,
# AdamW state and the activations of one micro-batch's backward. "ms/step" is the median step time
# after WARMUP steps. Ratios are against `none` measured in the same run. The final losses must be
# equal: the runs are bitwise the same (tests/test_train.cpp, ActivationCheckpointingGivesBitwiseTheSameRun).
# "plan" columns: what `mpitrain plan` predicts for the same config (optim.zero 0, one rank;
# docs/layouts.md "Memory per rank"): its activations and peak, and the measured peak RSS minus
# the plan's peak (what the process holds besides the plan's terms: libtorch, MPI, the data, the
# heap's slack; the same in every row if the activation model is right). Last lines: the saving of
# selective and of full checkpointing on every block, measured (peak RSS none - it) against predicted.
#
# Environment: STEPS (12), WARMUP (4), N_LAYER/N_EMBD/N_HEAD/SEQ/MICRO_BATCH (8/256/4/512/8), MPIRUN (mpirun).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=$(realpath "${1:-$REPO/build/mpitrain}")
MPIRUN=${MPIRUN:-mpirun}
STEPS=${STEPS:-12} WARMUP=${WARMUP:-4}
L=${N_LAYER:-8} D=${N_EMBD:-256} H=${N_HEAD:-4} T=${SEQ:-512} B=${MICRO_BATCH:-8}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
WORK=$(mktemp -d /tmp/mpitrain-ac-bench-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
. "$REPO/bench/table_lib.sh"
word_corpus "$((STEPS * B * (T + 1) + 4096))" corpus.txt
"$BIN" pack corpus.txt -o data/t --val-fraction 0 > pack.log 2>&1 || { cat pack.log; exit 1; }

write_cfg() {  # mode every out_dir
  local out=$3
  cat > cfg.yaml <<YAML
model: {preset: custom, n_layer: $L, n_head: $H, n_embd: $D, seq_len: $T}
data: {train: [$WORK/data/t-train-*.h5]}
train: {micro_batch: $B, steps: $STEPS, threads: 1, out_dir: $out, activation_checkpointing: $1, ac_every: $2}
optim: {warmup_steps: 2}
eval: {every: 0}
log: {every: 1}
checkpoint: {dir: $out/ckpt, every: 0, resume: none}
sample: {tokens: 0}
YAML
}

run() {  # mode every -> "ms_per_step final_loss peak_rss_mib"
  local out=$WORK/run-$1-$2
  write_cfg "$1" "$2" "$out"
  "$MPIRUN" -np 1 /usr/bin/time -o "$out.rss" -f %M "$BIN" cfg.yaml > "$out.log" 2>&1 || { cat "$out.log" >&2; exit 1; }
  local ms loss rss
  ms=$(grep '"ms_per_step"' "$out/metrics.jsonl" | tail -n +$((WARMUP + 1)) | sed 's/.*"ms_per_step": \([0-9.]*\).*/\1/' | median)
  loss=$(grep '"loss"' "$out/metrics.jsonl" | tail -1 | sed 's/.*"loss": \([0-9.]*\).*/\1/')
  rss=$(awk '{ printf "%.0f", $1 / 1024 }' "$out.rss")
  echo "$ms $loss $rss"
}

plan_row() {  # mode every -> "activations_mib peak_mib" of plan's optim.zero 0 row
  # plan's table holds the none, selective and full rows for the config's ac_every: one run per every.
  local out=$WORK/plan-every-$2
  if [ ! -f "$out.log" ]; then
    write_cfg "$1" "$2" "$out"
    "$MPIRUN" -np 1 "$BIN" plan cfg.yaml --iters 1 > "$out.log" 2>&1 || { cat "$out.log" >&2; rm -f "$out.log"; exit 1; }
  fi
  awk -F'|' -v mode="$1" '$2 ~ /^ 0 $/ && $3 ~ "^ " mode { gsub(/ /, "", $8); gsub(/ /, "", $9); print $8, $9; exit }' "$out.log"
}

echo "Activation checkpointing, one CPU rank: GPT-2 $L layers x $D, $H heads, seq $T, micro-batch $B, $STEPS steps, $(date -u +%F), $("$BIN" --version 2>/dev/null | head -n 1)"
echo "| activation_checkpointing | peak RSS (MiB) | ratio to none | ms/step | ratio to none | final loss | plan: activations (MiB) | plan: peak (MiB) | RSS - plan peak (MiB) |"
echo "|---|---:|---:|---:|---:|---|---:|---:|---:|"
# (a failed run ends the script: an assignment from a failed command substitution stops set -e)
r=$(run none 1); read -r t0 l0 m0 <<< "$r"
r=$(plan_row none 1); read -r a0 p0 <<< "$r"
printf '| none | %s | 1.00 | %s | 1.00 | %s | %s | %s | %.0f |\n' "$m0" "$t0" "$l0" "$a0" "$p0" "$(echo "$m0 - $p0" | bc -l)"
declare -A saved_measured saved_plan
for mode in selective full; do
  for every in 1 2; do
    r=$(run $mode $every); read -r t l m <<< "$r"
    r=$(plan_row $mode $every); read -r a p <<< "$r"
    printf '| %s, every %s block(s) | %s | %s | %s | %s | %s | %s | %s | %.0f |\n' "$mode" "$every" "$m" "$(ratio "$m" "$m0")" \
      "$t" "$(ratio "$t" "$t0")" "$l" "$a" "$p" "$(echo "$m - $p" | bc -l)"
    if [ "$every" = 1 ]; then saved_measured[$mode]=$((m0 - m)); saved_plan[$mode]=$(echo "$p0 - $p" | bc -l); fi
  done
done
for mode in selective full; do
  printf '%s checkpointing saves %s MiB of peak RSS, measured; the plan predicts %.0f MiB (ratio %s)\n' "$mode" \
    "${saved_measured[$mode]}" "${saved_plan[$mode]}" "$(ratio "${saved_measured[$mode]}" "${saved_plan[$mode]}")"
done
