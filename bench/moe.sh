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
# (the start-up line's prediction for a balanced routing).
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

# median ms/step after WARMUP of one run's metrics.jsonl
median_ms() {
  /usr/bin/python3 - "$1" "$WARMUP" <<'PYEOF'
import json, sys
ms = [json.loads(l)["ms_per_step"] for l in open(sys.argv[1]) if '"ms_per_step"' in l][int(sys.argv[2]):]
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
declare -A eruns epeak eopt
for r in $(seq 1 "$REPEATS"); do
  for ep in 1 "$EP"; do
    rm -rf run_ep$ep
    mpirun -np "$EP" --oversubscribe "$BIN" moe.yaml --set parallel.ep=$ep --set train.out_dir=run_ep$ep \
      --set checkpoint.dir=ck_ep$ep > ep$ep.out 2>&1 || { tail -5 ep$ep.out; exit 1; }
    eruns[$ep]="${eruns[$ep]:-} $(median_ms run_ep$ep/metrics.jsonl)"
    epeak[$ep]=$(sed -n 's/.*peak CPU memory (allocated by libtorch, MiB): rank 0 \([0-9.]*\).*/\1/p' ep$ep.out | tail -1)
    eopt[$ep]=$(sed -n 's/.*optimizer state: \([0-9.]*\) MiB per rank.*/\1/p' ep$ep.out | head -1)
  done
done
a2a=$(sed -n "s/.*the experts' all-to-all: \([0-9.]*\) MiB sent per rank per step.*/\1/p" ep$EP.out | head -1)
ep1_ms=$(med "${eruns[1]}") epn_ms=$(med "${eruns[$EP]}")
echo
echo "expert parallelism: the mixture on $EP ranks (mpirun -np $EP, one thread each), $B sequences per rank per step"
echo "| layout | experts per rank | ms/step | tokens/s (all ranks) | AdamW state MiB per rank | peak MiB (rank 0) | all-to-all MiB/step | vs ep 1 |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|"
printf '| parallel.ep 1 | %d | %.1f | %.0f | %s | %s | 0 | 1.00 |\n' "$E" "$ep1_ms" "$(echo "$tokens * $EP * 1000 / $ep1_ms" | bc -l)" \
  "${eopt[1]}" "${epeak[1]}"
printf '| parallel.ep %d | %d | %.1f | %.0f | %s | %s | %s | %.2f |\n' "$EP" $((E / EP)) "$epn_ms" \
  "$(echo "$tokens * $EP * 1000 / $epn_ms" | bc -l)" "${eopt[$EP]}" "${epeak[$EP]}" "${a2a:-?}" "$(echo "$ep1_ms / $epn_ms" | bc -l)"
