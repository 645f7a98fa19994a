#!/usr/bin/env bash
# A mixture of experts against the dense model of the same active size, on the CPU, one rank:
#   dense   a llama-block model (qwen3 family) whose MLPs have k x U units
#   moe     the same model whose MLPs are E experts of U units, k chosen per token (qwen3_moe)
# Both do the same matrix FLOPs per token (the router's E x width aside); the mixture holds E / k
# times the MLP parameters. The table: ms/step and tokens/s (median over REPEATS runs of their
# median step after WARMUP steps), the parameters (whole and active per token), the peak memory
# libtorch allocated, and the ratio against dense. "routing" = 1 - dense ms / moe ms: the share
# of the mixture's step spent on what the dense model does not do (router, sort, gather, scatter,
# one GEMM per expert instead of one per layer) — an estimate from the two runs, not a timer.
# Then expert parallelism (EP ranks, default 2; 1 skips it): the mixture on EP ranks with every rank
# holding every expert (parallel.ep 1) against the experts split over them (parallel.ep EP): ms/step,
# tokens/s over all ranks, AdamW's state and the peak memory per rank, the all-to-all MiB per step
# (the start-up line's prediction for a balanced routing) and the share of the step rank 0 spent
# inside the all-to-alls, measured (metrics.jsonl's all_to_all_share: the exchanges' wall time,
# waiting for the other ranks included, over the step's; median after WARMUP); then ep EP with
# optim.zero 1 and 3 (the shared parameters' state, and under 3 the parameters, sharded over the
# EP ranks; each rank's experts whole).
#
#     bash bench/moe.sh [build/mpitrain]
#
# Environment: E (16), K (2), U (128: units per expert), N_LAYER (4), N_EMBD (256), N_HEAD (8), SEQ (256),
# MICRO_BATCH (8), STEPS (30), WARMUP (8), REPEATS (3), THREADS (1), EP (2).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=$(realpath "${1:-$REPO/build/mpitrain}")
E=${E:-16} K=${K:-2} U=${U:-128} L=${N_LAYER:-4} D=${N_EMBD:-256} H=${N_HEAD:-8} T=${SEQ:-256} B=${MICRO_BATCH:-8}
STEPS=${STEPS:-30} WARMUP=${WARMUP:-8} REPEATS=${REPEATS:-3} THREADS=${THREADS:-1}
WORK=$(mktemp -d /tmp/mpitrain-bench-moe-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
/usr/bin/python3 - <<'PYEOF'
import numpy as np
rng = np.random.default_rng(0)
np.save("tokens.npy", rng.integers(1, 257, size=600000).astype(np.uint16))
PYEOF
"$BIN" pack tokens.npy -o data/t --vocab-size 257 --eot 0 --val-fraction 0 > pack.out 2>&1 || { cat pack.out; exit 1; }
common="data: {train: [data/t-train-*.h5], val: []}
train: {micro_batch: $B, steps: $STEPS, threads: $THREADS}
optim: {warmup_steps: 2}
eval: {every: 0}
log: {every: 1}
checkpoint: {every: 0, at_end: false}
sample: {tokens: 0}"
shape="n_layer: $L, n_head: $H, n_kv_head: $H, n_embd: $D, seq_len: $T, vocab_size: 320, norm_eps: 1e-6"
printf 'model: {preset: custom, family: qwen3, %s, intermediate_size: %d}\n%s\n' "$shape" $((K * U)) "$common" > dense.yaml
printf 'model: {preset: custom, family: qwen3_moe, %s, intermediate_size: %d, num_experts: %d, num_experts_per_tok: %d, moe_intermediate_size: %d}\n%s\n' \
  "$shape" $((K * U)) "$E" "$K" "$U" "$common" > moe.yaml

# median ms/step (or another KEY) after WARMUP of one run's metrics.jsonl
median_ms() {
  /usr/bin/python3 - "$1" "$WARMUP" "${2:-ms_per_step}" <<'PYEOF'
import json, sys
key = sys.argv[3]
ms = [json.loads(l)[key] for l in open(sys.argv[1]) if f'"{key}"' in l][int(sys.argv[2]):]
ms.sort()
print(ms[len(ms) // 2])
PYEOF
}
declare -A runs params peak
for r in $(seq 1 "$REPEATS"); do
  for m in dense moe; do
    rm -rf run_$m
    "$BIN" $m.yaml --set train.out_dir=run_$m --set checkpoint.dir=ck_$m > $m.out 2>&1 || { tail -5 $m.out; exit 1; }
    runs[$m]="${runs[$m]:-} $(median_ms run_$m/metrics.jsonl)"
    params[$m]=$(sed -n 's/.*model: [^,]*, \([0-9]*\) parameters.*/\1/p' $m.out | head -1)
    peak[$m]=$(sed -n 's/.*peak CPU memory (allocated by libtorch, MiB): rank 0 \([0-9.]*\).*/\1/p' $m.out | tail -1)
  done
done
mflops() { sed -n 's/.*MFU: \([0-9.]*\) MFLOPs per token.*/\1/p' "$1" | head -1; }
med() { tr ' ' '\n' <<< "$1" | grep . | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
dense_ms=$(med "${runs[dense]}") moe_ms=$(med "${runs[moe]}")
tokens=$((B * T))
echo
echo "mpitrain $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null), $(nproc) cores, $THREADS thread(s); $L layers, width $D, seq $T, micro-batch $B"
echo "| model | MLP per layer | parameters | model MFLOPs/token | ms/step | tokens/s | peak MiB | vs dense |"
echo "|---|---|---:|---:|---:|---:|---:|---:|"
printf '| dense (qwen3) | %d units | %s | %s | %.1f | %.0f | %s | 1.00 |\n' $((K * U)) "${params[dense]}" "$(mflops dense.out)" \
  "$dense_ms" "$(echo "$tokens * 1000 / $dense_ms" | bc -l)" "${peak[dense]}"
printf '| moe (qwen3_moe) | %d experts x %d units, top %d | %s | %s | %.1f | %.0f | %s | %.2f |\n' "$E" "$U" "$K" "${params[moe]}" \
  "$(mflops moe.out)" "$moe_ms" "$(echo "$tokens * 1000 / $moe_ms" | bc -l)" "${peak[moe]}" "$(echo "$dense_ms / $moe_ms" | bc -l)"
printf '\nrouting (1 - dense ms / moe ms): %.0f%% of the mixture'"'"'s step\n' "$(echo "100 * (1 - $dense_ms / $moe_ms)" | bc -l)"

EP=${EP:-2}
[ "$EP" -gt 1 ] || exit 0
declare -A eruns epeak eopt a2a_share
layouts=("1:0" "$EP:0" "$EP:1" "$EP:3")
for r in $(seq 1 "$REPEATS"); do
  for l in "${layouts[@]}"; do
    ep=${l%:*} zero=${l#*:}
    rm -rf run_${ep}_$zero
    mpirun -np "$EP" --oversubscribe "$BIN" moe.yaml --set parallel.ep=$ep --set optim.zero=$zero \
      --set train.out_dir=run_${ep}_$zero --set checkpoint.dir=ck_${ep}_$zero > ep$l.out 2>&1 || { tail -5 ep$l.out; exit 1; }
    eruns[$l]="${eruns[$l]:-} $(median_ms run_${ep}_$zero/metrics.jsonl)"
    epeak[$l]=$(sed -n 's/.*peak CPU memory (allocated by libtorch, MiB): rank 0 \([0-9.]*\), rank 1 \([0-9.]*\).*/\1 \/ \2/p' ep$l.out | tail -1)
    eopt[$l]=$(sed -n 's/.*optimizer state: \([0-9.]*\) MiB per rank.*/\1/p' ep$l.out | head -1)
    [ "$ep" = 1 ] || a2a_share[$l]="${a2a_share[$l]:-} $(median_ms run_${ep}_$zero/metrics.jsonl all_to_all_share)"
  done
done
a2a=$(sed -n "s/.*the experts' all-to-all: \([0-9.]*\) MiB sent per rank per step.*/\1/p" ep$EP:0.out | head -1)
ep1_ms=$(med "${eruns[1:0]}")
echo
echo "expert parallelism: the mixture on $EP ranks (mpirun -np $EP, one thread each), $B sequences per rank per step"
echo "| layout | experts per rank | ms/step | tokens/s (all ranks) | AdamW state MiB per rank | peak MiB (rank 0 / 1) | all-to-all MiB/step | all-to-all share of the step (measured) | vs ep 1 |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
for l in "${layouts[@]}"; do
  ep=${l%:*} zero=${l#*:} ms=$(med "${eruns[$l]}")
  printf '| parallel.ep %d, optim.zero %d | %d | %.1f | %.0f | %s | %s | %s | %s | %.2f |\n' "$ep" "$zero" $((E / ep)) "$ms" \
    "$(echo "$tokens * $EP * 1000 / $ms" | bc -l)" "${eopt[$l]}" "${epeak[$l]}" "$([ "$ep" = 1 ] && echo 0 || echo "${a2a:-?}")" \
    "$([ "$ep" = 1 ] && echo 0 || printf '%.1f%%' "$(echo "100 * $(med "${a2a_share[$l]}")" | bc -l)")" "$(echo "$ep1_ms / $ms" | bc -l)"
done
