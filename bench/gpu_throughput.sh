#!/usr/bin/env bash
# GPU throughput yardstick (issues 4 and 7): GPT-2 124M (vocab padded to 50304), bf16,
# micro-batch 16, seq 1024, one GPU. In one run it builds mpitrain against the Python torch's
# CUDA libtorch, then
#   0. times the fused block ops against the libtorch ops they replace (bench_fused_ops);
#   1. speed: trains mpitrain (defaults, and with the fused block kernels off: the previous
#      version) and the plain-PyTorch reference (bench/gpt2_reference.py) eagerly and with
#      torch.compile on the same random token file, all from the same initial weights, and prints
#      one table of tokens/s, ms/step, peak memory and ratios;
#   2. loss parity: mpitrain and the eager reference train 50 steps from the same initial weights
#      on the same batches of real text (the Python standard library's sources as bytes, windows
#      in order) and every step's losses are compared: PASS when all agree within 1% (bf16).
#
#   bash bench/gpu_throughput.sh [steps]        (default 60; the first 10 are not timed)
#
# Environment: BUILD (default build-gpu-bench), WORK (scratch, default /tmp/mpitrain-gpu-bench),
# SKIP_COMPILE=1 skips the torch.compile reference, SKIP_PARITY=1 the parity run, NCCL_HOME if
# NCCL is not found by CMake, VARIANTS: more mpitrain rows, "name=key=value,key=value;name=..."
# (default "cudnn attention=model.attention=cudnn"; "" for none). Exit status: 1 when the parity
# check fails.
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
# The device kit (bench/device-kit.sh): the libraries the GPU image lacks.
kit=${KIT:-$root/.device-kit}
if [ -f "$kit/env.sh" ]; then
  . "$kit/env.sh"
  prefix="$prefix;$MPITRAIN_KIT"
fi
# The fused kernels need nvcc; CMake looks on PATH and at CUDACXX.
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
echo "== building mpitrain against $prefix"
if [ -f "$build/CMakeCache.txt" ]; then  # configured before (bench/gpu_check.sh): keep its options
  cmake "$build" >"$work/configure.log" 2>&1 || { tail -n 40 "$work/configure.log"; exit 1; }
else
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
    -DMPITRAIN_BUILD_TESTS=OFF -DMPITRAIN_BUILD_BENCH=ON >"$work/configure.log" 2>&1 ||
    { tail -n 40 "$work/configure.log"; exit 1; }
fi
grep -q "mpitrain: GPU build" "$work/configure.log" ||
  { grep "mpitrain:" "$work/configure.log"; echo "FAIL: CMake did not configure a GPU build"; exit 1; }
grep "mpitrain:" "$work/configure.log"
cmake --build "$build" -j"$(nproc)" --target mpitrain bench_fused_ops >"$work/build.log" 2>&1 ||
  { grep -E "error" "$work/build.log" | head -n 40; exit 1; }

# ---- 0. the fused ops alone (forward + backward at one GPT-2 layer's shapes) ---------------------
"$build/bench_fused_ops" | tee "$work/fused_ops.txt"

# ---- data and initial weights -------------------------------------------------------------------
# Speed: a random GPT-2 token stream. Parity: real text, so that the loss falls and a wrong
# gradient shows: the Python standard library's sources as bytes (vocab 257, EOT 256 first).
python3 - "$work/tokens.npy" "$work/text.npy" <<'EOF'
import glob, os, sys, sysconfig
import numpy as np
if not os.path.exists(sys.argv[1]):
    rng = np.random.default_rng(1234)
    np.save(sys.argv[1], rng.integers(0, 50257, size=40_000_000, dtype=np.uint16))
if not os.path.exists(sys.argv[2]):
    text = bytearray()
    for f in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)):
        text += open(f, "rb").read()
        if len(text) > 8_000_000:
            break
    tokens = np.concatenate([[256], np.frombuffer(bytes(text), dtype=np.uint8)]).astype(np.uint16)
    np.save(sys.argv[2], tokens)
EOF
rm -rf "$work/shards" "$work/text-shards" "$work"/run-* "$work/init" "$work"/variant-*
"$build/mpitrain" pack "$work/tokens.npy" -o "$work/shards/bench" --format npy --vocab-size 50257 \
  --eot 50256 --val-fraction 0 >"$work/pack.log" 2>&1 || { cat "$work/pack.log"; exit 1; }
"$build/mpitrain" pack "$work/text.npy" -o "$work/text-shards/text" --format npy --vocab-size 257 \
  --eot 256 --val-fraction 0 >>"$work/pack.log" 2>&1 || { cat "$work/pack.log"; exit 1; }
python3 "$root/bench/gpt2_reference.py" --dump-init "$work/init" --seed 42

cat >"$work/gpt2.yaml" <<EOF
model: {preset: gpt2, vocab_size: 50304, dropout: 0.0, init_from: "$work/init"}
data: {train: ["$work/shards"], seed: 1}
train: {micro_batch: 16, grad_accum: 1, steps: $steps, device: cuda, precision: bf16, out_dir: "$work/run"}
optim: {lr: 6.0e-4, min_lr: 6.0e-5, warmup_steps: 10, weight_decay: 0.1, grad_clip: 1.0}
eval: {every: 0}
log: {every: $warmup}
checkpoint: {dir: "$work/run/ckpt", resume: none}
comm: {backend: nccl}
EOF

# run_mpitrain NAME TAG [--set key=value ...]: one mpitrain run, summarised in $work/TAG.json
run_mpitrain() {
  local name=$1 tag=$2
  shift 2
  echo "== $name"
  mpirun -np 1 "$build/mpitrain" "$work/gpt2.yaml" --set train.out_dir="$work/run-$tag" \
    --set checkpoint.dir="$work/run-$tag/ckpt" "$@" 2>&1 | tee "$work/$tag.log" |
    grep -E "step|peak|NCCL|device|fused|initial|error" || true
  python3 - "$name" "$work/run-$tag/metrics.jsonl" "$work/$tag.log" "$warmup" >"$work/$tag.json" <<'EOF' ||
import json, re, sys
name, metrics, log, warmup = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rows = [json.loads(l) for l in open(metrics) if '"tokens_per_s"' in l]
timed = [r for r in rows if r["step"] > warmup]  # the first interval includes start-up
tok = sum(r["tokens_per_s"] for r in timed) / len(timed) if timed else float("nan")
ms = sum(r["ms_per_step"] for r in timed) / len(timed) if timed else float("nan")
peak = re.findall(r"peak GPU memory[^:]*: ([0-9.e+-]+) GiB", open(log).read())
print(json.dumps({"name": name, "tokens_per_s": tok, "ms_per_step": ms,
                  "peak_gib": float(peak[-1]) if peak else float("nan"),
                  "losses": [round(r["loss"], 4) for r in rows]}))
EOF
    { rm -f "$work/$tag.json"; echo "== $name: no result (see $work/$tag.log)"; }
}

# ---- 1. speed -----------------------------------------------------------------------------------
run_mpitrain "mpitrain" mpitrain
run_mpitrain "mpitrain, fused_kernels off" mpitrain-unfused --set model.fused_kernels=off
# Candidates measured beside the default (a row per variant; one that cannot run says so):
# VARIANTS="name=key=value,..." e.g. the default cuDNN attention instead of libtorch's choice.
variants=()
IFS=';' read -r -a specs <<<"${VARIANTS:-cudnn attention=model.attention=cudnn}"
for spec in "${specs[@]}"; do
  [ -n "$spec" ] || continue
  vname=${spec%%=*} tag="variant-${#variants[@]}"
  sets=()
  IFS=',' read -r -a kvs <<<"${spec#*=}"
  for kv in "${kvs[@]}"; do sets+=(--set "$kv"); done
  echo "mpitrain, $vname" >"$work/$tag.name"
  run_mpitrain "mpitrain, $vname" "$tag" "${sets[@]}"
  variants+=("$tag")
done
modes=(eager)
[ "${SKIP_COMPILE:-0}" = 1 ] || modes+=(compile)
for mode in "${modes[@]}"; do
  echo "== pytorch $mode ($steps steps)"
  python3 "$root/bench/gpt2_reference.py" --tokens "$work/tokens.npy" --mode "$mode" --steps "$steps" \
    --warmup "$warmup" | tail -n 1 >"$work/ref-$mode.json"
done

# ---- 2. loss parity -----------------------------------------------------------------------------
parity_steps=50
if [ "${SKIP_PARITY:-0}" != 1 ]; then
  run_mpitrain "mpitrain (parity)" parity --set train.steps=$parity_steps --set log.every=1 \
    --set data.shuffle=false --set "data.train=[$work/text-shards]"
  echo "== pytorch eager (parity)"
  python3 "$root/bench/gpt2_reference.py" --tokens "$work/text.npy" --mode eager --steps $parity_steps \
    --warmup 1 --sequential --all-losses | tail -n 1 >"$work/ref-parity.json"
fi

# ---- tables -------------------------------------------------------------------------------------
python3 - "$work" "${SKIP_PARITY:-0}" "${#variants[@]}" "${modes[@]}" <<'EOF'
import json, math, sys
work, skip_parity, n_variants, modes = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4:]
load = lambda name: json.load(open(f"{work}/{name}.json"))
def variant(i):  # a variant that could not run (e.g. no cuDNN attention) still gets its row
    try:
        return load(f"variant-{i}")
    except (OSError, ValueError):
        name = open(f"{work}/variant-{i}.name").read().strip()
        return {"name": f"{name} (did not run: {work}/variant-{i}.log)", "tokens_per_s": math.nan,
                "ms_per_step": math.nan, "peak_gib": math.nan, "losses": []}
rows = ([load("mpitrain"), load("mpitrain-unfused")] + [variant(i) for i in range(n_variants)]
        + [load(f"ref-{m}") for m in modes])
me = rows[0]
print()
print("GPT-2 124M, bf16, micro-batch 16, seq 1024, 1 GPU")
print("| run | tokens/s | ms/step | peak GPU memory (GiB) | mpitrain tokens/s ratio | mpitrain memory ratio |")
print("|---|---:|---:|---:|---:|---:|")
for r in rows:
    ratio = "-" if r is me else f"{me['tokens_per_s'] / r['tokens_per_s']:.2f}x"
    mem = "-" if r is me else f"{me['peak_gib'] / r['peak_gib']:.2f}x"
    print(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.1f} | {r['peak_gib']:.2f} | {ratio} | {mem} |")
for r in rows:
    print(f"{r['name']} losses: {r['losses']}")
if skip_parity:
    sys.exit(0)
a, b = load("parity")["losses"], load("ref-parity")["losses"]
n = min(len(a), len(b))
rel = [abs(x - y) / max(abs(y), 1e-6) for x, y in zip(a[:n], b[:n])]
print()
print(f"loss parity: mpitrain vs pytorch eager, same initial weights and batches (text bytes), {n} steps")
print("| step | mpitrain | pytorch eager | relative difference |")
print("|---:|---:|---:|---:|")
for i in sorted({0, 1, 4, 9, 19, 29, 39, n - 1} & set(range(n))):
    print(f"| {i + 1} | {a[i]:.4f} | {b[i]:.4f} | {rel[i]:.2%} |")
worst = max(range(n), key=lambda i: rel[i]) if n else 0
ok = n == 50 and all(r <= 0.01 for r in rel)
print(f"max relative difference {rel[worst] if n else float('nan'):.2%} at step {worst + 1}: "
      f"{'PASS' if ok else 'FAIL'} (bound 1%, {n} of 50 steps compared)")
sys.exit(0 if ok else 1)
EOF
