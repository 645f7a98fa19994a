#!/usr/bin/env bash
# Memory per rank on CPU ranks against `mpitrain plan` (issue 41, section 5): optim.zero 0/1/2/3 x
# train.activation_checkpointing none/selective/full (ZEROS, ACS), each at RANKS data-parallel
# ranks (default 4), in one run. The model: GPT-2-shaped, N_LAYER x N_EMBD (default 12 x 768: 85M parameters, byte
# vocabulary), micro-batch MICRO_BATCH x SEQ (2 x 256), fp32, one torch thread per rank, STEPS
# steps (3: the first allocates AdamW's state), no checkpoint written.
#
#     bash bench/memory.sh [build/mpitrain]
#
# Columns, every rank measured:
#   plan          the peak plan --memory-only predicts for the row (its memory table, MiB)
#   libtorch      the most bytes of CPU tensors the rank held during the steps (train's last lines:
#                 "peak CPU memory (allocated by libtorch)", counted by host_memory.h), rank 0 and
#                 the largest of the others; "/ plan" is the largest over all ranks / plan
#   start-up      the same count's peak before the first step (making the model, its shards and
#                 the optimizer), the largest over all ranks
#   RSS           each process's peak resident size (GNU time): libtorch's tensors plus the
#                 process (libtorch's code, MPI's buffers, HDF5, glibc's retained free blocks)
#   ms/step       the median step after the first, and its ratio to zero 0 without checkpointing
#   resume        with RESUME=1: the run writes a checkpoint at its end, and a second run resumes
#                 it for one more step; its start-up peak, rank 0 (which reads the file) and the
#                 largest of the others (the checkpoint at the first run's end then counts in its
#                 steps' peak)
#
# Environment: RANKS (4), TP (1: parallel.tp; dp = RANKS / TP), STEPS (3),
# N_LAYER/N_EMBD/N_HEAD/SEQ/MICRO_BATCH (12/768/12/256/2),
# ZEROS ("0 1 2 3"; the first row is the time baseline), ACS ("none selective full"), RESUME (0),
# MPIRUN (mpirun).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=$(realpath "${1:-$REPO/build/mpitrain}")
MPIRUN=${MPIRUN:-mpirun}
NP=${RANKS:-4} STEPS=${STEPS:-3} TP=${TP:-1}
L=${N_LAYER:-12} D=${N_EMBD:-768} H=${N_HEAD:-12} T=${SEQ:-256} B=${MICRO_BATCH:-2}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe OMP_NUM_THREADS=1
WORK=$(mktemp -d /tmp/mpitrain-memory-bench-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
. "$REPO/bench/table_lib.sh"
word_corpus "$((NP * (STEPS + 2) * B * (T + 1) + 4096))" corpus.txt
"$BIN" pack corpus.txt -o data/t --val-fraction 0 > pack.log 2>&1 || { cat pack.log; exit 1; }

config() {  # ZERO AC OUT [STEPS RESUME AT_END]
  cat <<YAML
model: {preset: custom, n_layer: $L, n_head: $H, n_embd: $D, seq_len: $T, dropout: 0.0}
data: {train: [$WORK/data/t-train-*.h5]}
train: {micro_batch: $B, steps: ${4:-$STEPS}, threads: 1, out_dir: $3, activation_checkpointing: $2}
optim: {zero: $1, warmup_steps: 1}
parallel: {tp: $TP}
eval: {every: 0}
log: {every: 1}
checkpoint: {dir: $3/ckpt, every: 0, resume: ${5:-none}, at_end: ${6:-false}}
sample: {tokens: 0}
YAML
}

config 0 none "$WORK/plan" > plan.yaml
"$MPIRUN" -np "$NP" "$BIN" plan plan.yaml --memory-only > plan.log 2>&1 || { cat plan.log; exit 1; }

startup_peaks() {  # LOG -> the start-up peaks line's MiB, one per rank
  sed -n 's/.*peak CPU memory at start-up (allocated by libtorch, MiB): //p' "$1" | tr ',' '\n' | awk '{ print $3 }'
}

run() {  # ZERO AC -> "plan lib0 lib_others rss0 rss_others ms startup resume0 resume_others"
  local zero=$1 ac=$2 out=$WORK/run-$1-$2
  if [ "${RESUME:-0}" = 1 ]; then config "$zero" "$ac" "$out" "$STEPS" none true; else config "$zero" "$ac" "$out"; fi > cfg.yaml
  "$MPIRUN" -np "$NP" bash -c 'exec /usr/bin/time -o "$0.rss.$OMPI_COMM_WORLD_RANK" -f %M "$@"' "$out" "$BIN" cfg.yaml \
    > "$out.log" 2>&1 || { cat "$out.log" >&2; exit 1; }
  local planned peaks ms
  planned=$(awk -F'|' -v z=" $zero " -v a=" $ac" '$2 == z && index($3, a) == 1 { gsub(/ /, "", $9); print $9; exit }' plan.log)
  peaks=$(sed -n 's/.*peak CPU memory (allocated by libtorch, MiB): //p' "$out.log" | tr ',' '\n' | awk '{ print $3 }')
  [ -n "$peaks" ] || { echo "no peak line in $out.log" >&2; exit 1; }
  local startup resumed="nan nan"
  startup=$(startup_peaks "$out.log" | sort -g | tail -n 1)
  [ -n "$startup" ] || { echo "no start-up peak line in $out.log" >&2; exit 1; }
  if [ "${RESUME:-0}" = 1 ]; then
    config "$zero" "$ac" "$out" "$((STEPS + 1))" auto false > cfg-resume.yaml
    "$MPIRUN" -np "$NP" "$BIN" cfg-resume.yaml > "$out.resume.log" 2>&1 || { cat "$out.resume.log" >&2; exit 1; }
    grep -q "resumed from" "$out.resume.log" || { echo "the second run did not resume: $out.resume.log" >&2; exit 1; }
    resumed="$(startup_peaks "$out.resume.log" | head -n 1) $(startup_peaks "$out.resume.log" | tail -n +2 | sort -g | tail -n 1)"
  fi
  ms=$(grep '"ms_per_step"' "$out/metrics.jsonl" | tail -n +2 | sed 's/.*"ms_per_step": \([0-9.]*\).*/\1/' | median)
  local lib0 libo rss0 rsso
  lib0=$(echo "$peaks" | head -n 1)
  libo=$(echo "$peaks" | tail -n +2 | sort -g | tail -n 1)
  rss0=$(awk '{ printf "%.0f", $1 / 1024 }' "$out.rss.0")
  rsso=$(for f in "$out".rss.*; do [[ $f == "$out.rss.0" ]] || cat "$f"; done | sort -n | tail -n 1 | awk '{ printf "%.0f", $1 / 1024 }')
  echo "$planned $lib0 ${libo:-nan} $rss0 ${rsso:-nan} $ms $startup $resumed"
}

params=$(grep -o 'memory per rank (MiB; [0-9]* parameters' plan.log | grep -o '[0-9]* parameters')
echo "Memory per rank vs plan: GPT-2 $L layers x $D, seq $T, micro-batch $B, $params, dp $((NP / TP)) x tp $TP, fp32, $STEPS steps, $(getconf _NPROCESSORS_ONLN) cores, $(date -u +%F)"
echo "| optim.zero | checkpointing | plan peak (MiB) | libtorch rank 0 | libtorch others (max) | largest / plan | start-up (max) | resume rank 0 | resume others (max) | RSS rank 0 | RSS others (max) | ms/step | time vs zero 0, none |"
echo "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
base_ms=""
for zero in ${ZEROS:-0 1 2 3}; do
  for ac in ${ACS:-none selective full}; do
    r=$(run "$zero" "$ac")  # (a failed run ends the script: set -e stops at a failed assignment)
    read -r p l0 lo r0 ro ms su rs0 rso <<< "$r"
    [ -n "$base_ms" ] || base_ms=$ms
    big=$(awk -v a="$l0" -v b="$lo" 'BEGIN { print (b != "nan" && b > a) ? b : a }')
    echo "| $zero | $ac | $(num "$p") | $(num "$l0") | $(num "$lo") | $(ratio "$big" "$p") | $(num "$su") | $(num "$rs0") | $(num "$rso") | $r0 | $ro | $(num "$ms") | $(ratio "$ms" "$base_ms") |"
  done
done
