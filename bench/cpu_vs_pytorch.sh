#!/usr/bin/env bash
# mpitrain against a plain PyTorch training loop on the CPU: the same GPT-2 (4 layers, width 256,
# 4 heads, seq 256, micro-batch 8, byte vocabulary), the same initial weights (.npy), the same
# batches in the same order, the same AdamW, schedule and clipping, one process, the same thread
# count. The peer is bench/gpt2_reference.py on Debian's python3-torch, i.e. on the same libtorch
# as mpitrain on Debian 12 (1.13) — eager mode, the fastest attention and AdamW that torch offers.
#
#     bash bench/cpu_vs_pytorch.sh [build/mpitrain]
#
# Runs alternate (mpitrain, PyTorch, PyTorch, mpitrain, ...) REPEATS times per precision and thread
# count; each run's figure is its median step time after WARMUP steps, and the table shows the
# median over runs. ratio = PyTorch ms/step ÷ mpitrain ms/step: above 1.0 mpitrain is faster.
# The first losses of both are printed as a check that they compute the same thing.
#
# ARCH=llama: the llama-debug shape instead (6 layers, width 256, 16 heads / 4 kv heads, SwiGLU 768,
# rotary; seq 256, micro-batch 8, byte vocabulary), the peer tests/llama_reference.py (a Llama
# written from transformers' modeling code, PyTorch's AdamW) on the weights of mpitrain's first
# step, exported to Hugging Face's format; both start from those weights.
#
# Environment: STEPS (40), WARMUP (8), REPEATS (5), THREADS ("1 2"), PRECISIONS ("fp32 bf16"), ARCH (gpt2),
# PYTHON (python3, else /usr/bin/python3: the first that imports torch), N_LAYER/N_EMBD/N_HEAD/SEQ/MICRO_BATCH (4/256/4/256/8).
# Needs python3-torch and python3-numpy (apt-get install python3-torch).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=$(realpath "${1:-$REPO/build/mpitrain}")
PY=${PYTHON:-}
if [[ -z $PY ]]; then  # Debian's interpreter when another python3 (pyenv, a venv) comes first
  for c in python3 /usr/bin/python3; do "$c" -c 'import torch, numpy' 2> /dev/null && { PY=$c; break; }; done
  PY=${PY:-python3}
fi
STEPS=${STEPS:-40} WARMUP=${WARMUP:-8} REPEATS=${REPEATS:-5}
THREADS=${THREADS:-"1 2"} PRECISIONS=${PRECISIONS:-"fp32 bf16"}
ARCH=${ARCH:-gpt2}
if [[ $ARCH == llama ]]; then
  L=${N_LAYER:-6} D=${N_EMBD:-256} H=${N_HEAD:-16} T=${SEQ:-256} B=${MICRO_BATCH:-8}
else
  L=${N_LAYER:-4} D=${N_EMBD:-256} H=${N_HEAD:-4} T=${SEQ:-256} B=${MICRO_BATCH:-8}
fi
V=256

if ! "$PY" -c 'import torch, numpy' 2> /dev/null; then
  echo "cpu_vs_pytorch.sh: $PY cannot import torch and numpy (apt-get install python3-torch python3-numpy)" >&2
  exit 2
fi
WORK=$(mktemp -d /tmp/mpitrain-cpu-bench-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"

# Tokens: enough windows for every step, bytes 1..255 (0 is the end-of-text id and never occurs).
"$PY" - "$((STEPS * B * T + T + 1))" <<'EOF'
import sys, numpy as np
n = int(sys.argv[1])
np.save("tokens.npy", np.random.default_rng(7).integers(1, 256, n, dtype=np.uint16))
EOF
"$BIN" pack tokens.npy -o data/t --vocab-size $V --eot 0 --val-fraction 0 > pack.log 2>&1 || { cat pack.log; exit 1; }
if [[ $ARCH == llama ]]; then
  MODEL="preset: custom, arch: llama, n_layer: $L, n_head: $H, n_kv_head: 4, n_embd: $D, intermediate_size: 768, seq_len: $T, rope_theta: 500000, init_from: 'hf:$WORK/init'"
  # The initial weights: mpitrain's after one step, as a Hugging Face directory both start from.
  cat > init.yaml <<YAML
model: {preset: custom, arch: llama, n_layer: $L, n_head: $H, n_kv_head: 4, n_embd: $D, intermediate_size: 768, seq_len: $T, rope_theta: 500000}
data: {train: [$WORK/data/t-train-*.h5], shuffle: false}
train: {micro_batch: $B, steps: 1, threads: 1, out_dir: $WORK/init-run}
optim: {warmup_steps: 0}
eval: {every: 0}
checkpoint: {dir: $WORK/init-ckpt, resume: none}
YAML
  "$BIN" init.yaml > init.log 2>&1 && "$BIN" export init-ckpt/ckpt-00000001.h5 init > /dev/null || { cat init.log; exit 1; }
else
  MODEL="preset: custom, n_layer: $L, n_head: $H, n_embd: $D, seq_len: $T, init_from: $WORK/init"
  ref=("$PY" "$REPO/bench/gpt2_reference.py" --vocab $V --seq-len $T --n-layer $L --n-head $H --n-embd $D)
  "${ref[@]}" --dump-init init > /dev/null
fi

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }

run_mpitrain() {  # precision threads -> "ms_per_step first_loss"
  cat > cfg.yaml <<YAML
model: {$MODEL}
data: {train: [$WORK/data/t-train-*.h5], shuffle: false}
train: {micro_batch: $B, steps: $STEPS, threads: $2, precision: $1, out_dir: $WORK/run}
optim: {lr: 6e-4, min_lr: 6e-5, warmup_steps: 10}
eval: {every: 0}
log: {every: 1}
checkpoint: {dir: $WORK/ckpt, every: 0, resume: none}
YAML
  rm -rf run ckpt
  "$BIN" cfg.yaml > mpitrain.log 2>&1 || { tail -5 mpitrain.log >&2; return 1; }
  local ms loss
  ms=$(awk -v w="$WARMUP" -F'"ms_per_step": ' 'NR > w { split($2, a, /[,}]/); print a[1] }' run/metrics.jsonl | median)
  loss=$(head -1 run/metrics.jsonl | sed -E 's/.*"loss": ([0-9.]+).*/\1/')
  echo "$ms $loss"
}
run_pytorch() {  # precision threads -> "ms_per_step first_loss"
  local out
  if [[ $ARCH == llama ]]; then
    out=$("$PY" "$REPO/tests/llama_reference.py" train init tokens.npy --precision "$1" --threads "$2" --steps $STEPS \
          --batch $B --seq-len $T --lr 6e-4 --min-lr 6e-5 --warmup 10 --timing-warmup $WARMUP | tail -n 1)
  else
    out=$("${ref[@]}" --device cpu --precision "$1" --threads "$2" --tokens tokens.npy --sequential \
          --init-from init --micro-batch $B --steps $STEPS --warmup $WARMUP --lr 6e-4 --min-lr 6e-5 \
          --warmup-steps 10)
  fi
  "$PY" -c 'import json, sys; r = json.loads(sys.argv[1]); print(r["median_ms_per_step"], r["losses"][0])' "$out"
}

echo "mpitrain $("$BIN" --version 2>&1 | head -1) vs PyTorch $("$PY" -c 'import torch; print(torch.__version__)')"
echo "model: $ARCH, $L layers, width $D, $H heads, seq $T, micro-batch $B, vocab $V; $STEPS steps, median after $WARMUP, $REPEATS interleaved runs each"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores"
echo
printf '| %-9s | %7s | %16s | %15s | %17s | %-22s |\n' precision threads "mpitrain ms/step" "PyTorch ms/step" "ratio (PT/mpit.)" "first loss (mpit./PT)"
printf '|%s|%s|%s|%s|%s|%s|\n' ----------- --------- ------------------ ----------------- ------------------- ------------------------
runs=()
for p in $PRECISIONS; do
  for t in $THREADS; do
    : > m.txt; : > p.txt
    for r in $(seq 1 "$REPEATS"); do
      if (( r % 2 )); then run_mpitrain "$p" "$t" >> m.txt; run_pytorch "$p" "$t" >> p.txt
      else run_pytorch "$p" "$t" >> p.txt; run_mpitrain "$p" "$t" >> m.txt; fi
    done
    m=$(cut -d' ' -f1 m.txt | median); q=$(cut -d' ' -f1 p.txt | median)
    runs+=("$p, $t thread(s), each run's ms/step: mpitrain $(cut -d' ' -f1 m.txt | tr '\n' ' ')| PyTorch $(cut -d' ' -f1 p.txt | tr '\n' ' ')")
    printf '| %-9s | %7s | %16.1f | %15.1f | %16.2fx | %-22s |\n' "$p" "$t" "$m" "$q" \
      "$(awk -v a="$q" -v b="$m" 'BEGIN { print a / b }')" "$(head -1 m.txt | cut -d' ' -f2) / $(head -1 p.txt | cut -d' ' -f2)"
  done
done
echo
printf '%s\n' "${runs[@]}"
