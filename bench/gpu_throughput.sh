#!/usr/bin/env bash
# GPU throughput yardstick (issues 4 and 7): GPT-2 124M (vocab padded to 50304), bf16,
# micro-batch 16, seq 1024, one GPU. In one run: builds mpitrain against the Python torch's
# CUDA libtorch, trains it, then trains the plain-PyTorch reference (bench/gpt2_reference.py)
# eagerly and with torch.compile on the same token file, and prints one table.
#
#   bash bench/gpu_throughput.sh [steps]        (default 60; the first 10 are not timed)
#
# Environment: BUILD (default build-gpu-bench), WORK (scratch, default /tmp/mpitrain-gpu-bench),
# SKIP_COMPILE=1 skips the torch.compile reference, NCCL_HOME if NCCL is not found by CMake.
set -euo pipefail

steps=${1:-60}
warmup=10
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD:-$root/build-gpu-bench}
work=${WORK:-/tmp/mpitrain-gpu-bench}
mkdir -p "$work"
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' ||
  { echo "SKIP: no CUDA device visible to Python's torch"; exit 77; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# ---- build --------------------------------------------------------------------------------------
prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
echo "== building mpitrain against $prefix"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DMPITRAIN_BUILD_TESTS=OFF -DMPITRAIN_BUILD_BENCH=OFF >"$work/configure.log" 2>&1 ||
  { tail -n 40 "$work/configure.log"; exit 1; }
grep -q "mpitrain: GPU build" "$work/configure.log" ||
  { grep "mpitrain:" "$work/configure.log"; echo "FAIL: CMake did not configure a GPU build"; exit 1; }
cmake --build "$build" -j"$(nproc)" --target mpitrain >"$work/build.log" 2>&1 ||
  { grep -E "error" "$work/build.log" | head -n 40; exit 1; }

# ---- data: the same random GPT-2 token stream for everyone --------------------------------------
if [ ! -f "$work/tokens.npy" ]; then
  python3 - "$work/tokens.npy" <<'EOF'
import sys, numpy as np
rng = np.random.default_rng(1234)
np.save(sys.argv[1], rng.integers(0, 50257, size=40_000_000, dtype=np.uint16))
EOF
fi
rm -rf "$work/shards" "$work/run"
"$build/mpitrain" pack "$work/tokens.npy" -o "$work/shards/bench" --format npy --vocab-size 50257 \
  --eot 50256 --val-fraction 0 >"$work/pack.log" 2>&1 || { cat "$work/pack.log"; exit 1; }

cat >"$work/gpt2.yaml" <<EOF
model: {preset: gpt2, vocab_size: 50304, dropout: 0.0}
data: {train: ["$work/shards"], seed: 1}
train: {micro_batch: 16, grad_accum: 1, steps: $steps, device: cuda, precision: bf16, out_dir: "$work/run"}
optim: {lr: 6.0e-4, warmup_steps: 10, weight_decay: 0.1, grad_clip: 1.0}
eval: {every: 0}
log: {every: $warmup}
checkpoint: {dir: "$work/run/ckpt", resume: none}
comm: {backend: nccl}
EOF

# ---- mpitrain -----------------------------------------------------------------------------------
echo "== mpitrain ($steps steps)"
mpirun -np 1 "$build/mpitrain" "$work/gpt2.yaml" 2>&1 | tee "$work/mpitrain.log" | grep -E "step|peak|NCCL|device" || true
python3 - "$work/run/metrics.jsonl" "$work/mpitrain.log" "$warmup" >"$work/mpitrain.json" <<'EOF'
import json, re, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l]
timed = [r for r in rows if r["step"] > int(sys.argv[3])]  # the first interval includes start-up
tok = sum(r["tokens_per_s"] for r in timed) / len(timed)
ms = sum(r["ms_per_step"] for r in timed) / len(timed)
peak = re.findall(r"peak GPU memory[^:]*: ([0-9.e+-]+) GiB", open(sys.argv[2]).read())
print(json.dumps({"name": "mpitrain", "tokens_per_s": tok, "ms_per_step": ms,
                  "peak_gib": float(peak[-1]) if peak else float("nan"),
                  "losses": [round(r["loss"], 4) for r in rows]}))
EOF

# ---- references ---------------------------------------------------------------------------------
modes=(eager)
[ "${SKIP_COMPILE:-0}" = 1 ] || modes+=(compile)
for mode in "${modes[@]}"; do
  echo "== pytorch $mode ($steps steps)"
  python3 "$root/bench/gpt2_reference.py" --tokens "$work/tokens.npy" --mode "$mode" --steps "$steps" \
    --warmup "$warmup" | tail -n 1 >"$work/ref-$mode.json"
done

# ---- table --------------------------------------------------------------------------------------
python3 - "$work" "${modes[@]}" <<'EOF'
import json, sys
work, modes = sys.argv[1], sys.argv[2:]
rows = [json.load(open(f"{work}/mpitrain.json"))] + [json.load(open(f"{work}/ref-{m}.json")) for m in modes]
me = rows[0]
print()
print("GPT-2 124M, bf16, micro-batch 16, seq 1024, 1 GPU")
print("| run | tokens/s | ms/step | peak GPU memory (GiB) | mpitrain tokens/s ratio |")
print("|---|---:|---:|---:|---:|")
for r in rows:
    ratio = me["tokens_per_s"] / r["tokens_per_s"]
    print(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.1f} | {r['peak_gib']:.2f} | "
          f"{'-' if r is me else f'{ratio:.2f}x'} |")
for r in rows:
    print(f"{r['name']} losses: {r['losses']}")
EOF
