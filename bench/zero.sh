#!/usr/bin/env bash
# ZeRO-1 and ZeRO-2 against plain data parallelism on CPU ranks: AdamW state per rank and step time,
# optim.zero 0, 1 and 2 (ZEROS, default "1 2", each against 0), at 1, 2 and 4 ranks, in one run. The model: GPT-2-shaped, N_LAYER layers of
# width N_EMBD (default 4 x 256, 3.3M parameters: 26 MiB of AdamW moments unsharded), micro-batch
# MICRO_BATCH x SEQ, byte vocabulary, fp32, one torch thread per rank (the ranks share this
# machine's cores: on 2 cores, 4 ranks oversubscribe it and their step times say so).
#
#     bash bench/zero.sh [build/mpitrain]
#
# "state/rank" is the start-up line `optimizer state: X MiB per rank` (AdamW's two moments as
# allocated); "state ratio" = zero 1 ÷ zero 0 at that rank count (1/dp plus bucket padding is the
# expectation). "ms/step" is the median step time after WARMUP steps; "time ratio" = zero 1 ÷
# zero 0 (above 1.0 ZeRO-1 is slower: it adds an all-gather of the parameters and runs AdamW on
# 1/dp of them). The final losses are printed too: they must be equal (tests/test_train.cpp checks
# that the runs are bitwise the same).
#
# "peak RSS" is each process's peak resident memory (GNU time), rank 0 and the largest of the
# others: the whole process (libtorch, MPI, activations, AdamW state, and the checkpoint saved at
# the end, which under ZeRO-1 rank 0 assembles whole in host memory: docs/formats.md).
#
# Environment: STEPS (30), WARMUP (5), N_LAYER/N_EMBD/N_HEAD/SEQ/MICRO_BATCH (4/256/4/128/4),
# RANKS ("1 2 4"), MPIRUN (mpirun).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=$(realpath "${1:-$REPO/build/mpitrain}")
MPIRUN=${MPIRUN:-mpirun}
STEPS=${STEPS:-30} WARMUP=${WARMUP:-5} RANKS=${RANKS:-"1 2 4"}
L=${N_LAYER:-4} D=${N_EMBD:-256} H=${N_HEAD:-4} T=${SEQ:-128} B=${MICRO_BATCH:-4}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe OMP_NUM_THREADS=1
WORK=$(mktemp -d /tmp/mpitrain-zero-bench-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"

# A text corpus of enough bytes for 4 ranks x STEPS steps.
. "$REPO/bench/table_lib.sh"
word_corpus "$((4 * STEPS * B * (T + 1) + 4096))" corpus.txt
"$BIN" pack corpus.txt -o data/t --val-fraction 0 > pack.log 2>&1 || { cat pack.log; exit 1; }


run() {  # ranks zero -> "state_mib ms_per_step final_loss rss_rank0_mib rss_others_mib"
  local np=$1 zero=$2 out=$WORK/run-$1-$2
  cat > cfg.yaml <<YAML
model: {preset: custom, n_layer: $L, n_head: $H, n_embd: $D, seq_len: $T}
data: {train: [$WORK/data/t-train-*.h5]}
train: {micro_batch: $B, steps: $STEPS, threads: 1, out_dir: $out}
optim: {zero: $zero, warmup_steps: 5}
eval: {every: 0}
log: {every: 1}
checkpoint: {dir: $out/ckpt, every: 0, resume: none}
YAML
  # Each rank's peak resident memory (GNU time; OpenMPI names the rank in OMPI_COMM_WORLD_RANK).
  "$MPIRUN" -np "$np" bash -c 'exec /usr/bin/time -o "$0.rss.$OMPI_COMM_WORLD_RANK" -f %M "$@"' "$out" "$BIN" cfg.yaml \
    > "$out.log" 2>&1 || { cat "$out.log" >&2; exit 1; }
  local state ms loss
  state=$(grep -o 'optimizer state: [0-9.]* MiB' "$out.log" | awk '{ print $3 }')
  ms=$(grep '"ms_per_step"' "$out/metrics.jsonl" | tail -n +$((WARMUP + 1)) | sed 's/.*"ms_per_step": \([0-9.]*\).*/\1/' | median)
  loss=$(grep '"loss"' "$out/metrics.jsonl" | tail -1 | sed 's/.*"loss": \([0-9.]*\).*/\1/')
  local r0 others
  r0=$(awk '{ printf "%.0f", $1 / 1024 }' "$out.rss.0")
  others=$(cat "$out".rss.* | sort -n | tail -1 | awk '{ printf "%.0f", $1 / 1024 }')
  [[ $np -gt 1 ]] && others=$(for f in "$out".rss.*; do [[ $f == "$out.rss.0" ]] || cat "$f"; done | sort -n | tail -1 | awk '{ printf "%.0f", $1 / 1024 }')
  echo "$state $ms $loss $r0 $others"
}

params=$(( (L * 12 * D * D) + (256 + T) * D ))
echo "ZeRO-1 and ZeRO-2 vs plain data parallel: GPT-2 $L layers x $D, seq $T, micro-batch $B, ~$((params / 1000))K parameters, $STEPS steps, $(getconf _NPROCESSORS_ONLN) cores, $(date -u +%F)"
echo "| ranks | optim.zero | state/rank (MiB) | state ratio | ms/step | time ratio | peak RSS rank 0 (MiB) | peak RSS others (MiB) | RSS ratio (largest) | final loss |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
for np in $RANKS; do
  read -r s0 t0 l0 m0 o0 <<< "$(run "$np" 0)"
  big0=$(( m0 > o0 ? m0 : o0 ))
  printf '| %s | 0 | %.2f | 1.000 | %s | 1.00 | %s | %s | 1.00 | %s |\n' "$np" "$s0" "$t0" "$m0" "$o0" "$l0"
  for z in ${ZEROS:-1 2}; do
    read -r s t l m o <<< "$(run "$np" "$z")"
    big=$(( m > o ? m : o ))
    printf '| %s | %s | %.2f | %s | %s | %s | %s | %s | %s | %s |\n' "$np" "$z" "$s" \
      "$(awk -v a="$s" -v b="$s0" 'BEGIN { printf "%.3f", a / b }')" "$t" \
      "$(awk -v a="$t" -v b="$t0" 'BEGIN { printf "%.2f", a / b }')" "$m" "$o" \
      "$(awk -v a="$big" -v b="$big0" 'BEGIN { printf "%.2f", a / b }')" "$l"
  done
done
