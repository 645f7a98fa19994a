#!/usr/bin/env bash
# One command on a bare GPU machine (issues 12, 40): build the GPU variant, run test_gpu, train on
# the GPU and measure, every log under OUTDIR, a summary table printed last.
#
#   bash bench/gpu_check.sh OUTDIR [STAGE ...]
#
# Stages, in this order when none are named (each may be run alone; `build` is cheap once done):
#   env      the machine: GPU, driver, Python torch and its CUDA/cuDNN, NCCL, nvcc, MPI, nsys, and
#            which of the kit's libraries the image has of its own
#   build    CMake against Python torch's libtorch (torch.utils.cmake_prefix_path), the NCCL of
#            site-packages nvidia/nccl and the device kit, all cores, make -k (every compiler
#            error in one pass); checks: a GPU build, fused kernels built, no compiler warning in
#            mpitrain's own sources
#   test     mpirun -np 1 test_gpu: every test must run and pass, none skipped
#   train    a small byte-level GPT on Python's own sources: CPU fp32 reference; CUDA fp32 + NCCL
#            (learns like the CPU run); 2 ranks sharing the GPU (comm.backend mpi, the same
#            global batch: the same losses); pp 2 on the GPU (2 stages sharing it, comm mpi:
#            the same losses); GPU -> CPU -> GPU resume (losses continue); bf16;
#            fp16 with loss scaling, and pp 2 in fp16. TRAIN_STEPS steps (default 200); the mid-run checkpoint
#            and the shards are kept in OUTDIR/handoff for a resume on a CPU machine.
#   llama    the Llama 3.2 1B shape (preset llama3.2-1b: 16 layers, 32/8 heads, width 2048, SwiGLU
#            8192, vocab 128256), bf16, micro-batch 4 x seq 2048, on random tokens: tokens/s, MFU
#            and peak GPU memory (LLAMA_STEPS, default 40). Rehearsal: llama-debug on the CPU
#   memory   peak device memory of the Llama 3.2 1B shape on 2 ranks sharing the GPU, optim.zero
#            0/1/2 x activation checkpointing none/full (not in the default list: name it)
#   bench    bench/gpu_throughput.sh: GPT-2 124M yardstick vs PyTorch eager and torch.compile,
#            and the 50-step loss parity
#   profile  GPT-2 124M, bf16: mpitrain's own profiler trace (log.profile_start) beside PyTorch's
#            torch.compile and eager steps (bench/gpt2_reference.py --profile), GPU time by kernel
#            kind (bench/profile_summary.py), and nsys's kernel table where nsys is installed;
#            the bench stage's tokens where it ran, else random ones of its own
#
# The device kit: bench/device-kit.sh makes .device-kit/ (Debian 12's PCRE2, ISA-L, utf8proc,
# OpenSSL, nlohmann-json, CLI11, GoogleTest and pkgconf, ~11 MiB, relocatable); when KIT (default
# <repo>/.device-kit) holds env.sh, the build stage uses it, so the GPU image needs only what was
# seen there: Python torch with CUDA, nvcc, NCCL, Open MPI, HDF5, yaml-cpp, spdlog, CMake.
#
# The lease (15 minutes of device time in all, each machine start counted, 10 per command), one
# call from this machine, in the repository root, after `bash bench/device-kit.sh`:
#   device run, carry [".device-kit"], timeout_s 540, command:
#     bash bench/gpu_check.sh $OUT/check env build test train llama > $OUT/check.log 2>&1;
#     tail -n 60 $OUT/check.log
# Time budget of that call (<= 9 minutes, leaving ~5 for one rerun or `bench profile` after a
# machine start of 1-2 minutes): build ~3 min (measured on the H100 image: 172 s wall, 481 CPU s,
# -j16; its critical path, not its CPU seconds, sets it: bench/README.md), test <= 2.5 min (its own
# timeout: TEST_TIMEOUT, default 150 s), train ~1 min (40 s), llama ~1 min (54 s); each stage
# prints its seconds. The logs and summary come back
# under $OUT/check (at most 8 files come back: the whole OUTDIR is not fetched, only what the
# command copies there; summary.md and the logs the command names).
#
# Rehearsal without a GPU: REHEARSE=1 BUILD=build bash bench/gpu_check.sh OUTDIR env train
# runs the same flow on the CPU (CUDA runs become CPU runs, GPU-only checks are SKIP rows), so
# the script itself is tested where GPU time costs nothing (tests/gpu_check_rehearsal_test.sh).
# REHEARSE_BUILD=1 makes the build stage configure and build a CPU build the way the lease does
# (the kit, make -k), as bench/device-kit-rehearsal.sh does in a bare Debian 12 root.
#
# Environment: BUILD (default build-gpu), JOBS (default: all cores), CUDA_ARCH (default: the
# GPU's, as CMake's "native"), PYTHON (default python3), KIT. Exit status 1 when any check FAILed.
set -uo pipefail

[ $# -ge 1 ] || { sed -n '2,30p' "$0"; exit 2; }
out=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "gpu_check: cannot create '$1'"; exit 2; }
shift
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(env build test train llama bench profile)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD:-$root/build-gpu}
case $build in /*) ;; *) build=$root/$build ;; esac
jobs=${JOBS:-$(getconf _NPROCESSORS_ONLN)}
py=${PYTHON:-python3}
rehearse=${REHEARSE:-0}
rehearse_build=${REHEARSE_BUILD:-0}
kit=${KIT:-$root/.device-kit}
case $kit in /*) ;; *) kit=$root/$kit ;; esac
bin=$build/mpitrain
summary=$out/summary.tsv
export OMPI_MCA_rmaps_base_oversubscribe=1
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
if [ "$rehearse" = 1 ]; then gpu=cpu; gpu_backend=mpi; else gpu=cuda; gpu_backend=nccl; fi

# row STAGE CHECK RESULT DETAIL: one line of the summary (RESULT: PASS, FAIL, SKIP or INFO)
row() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$summary"; echo "[$1] $3: $2${4:+ — $4}"; }
# check STAGE NAME DETAIL COMMAND...: PASS when COMMAND succeeds, else FAIL
check() {
  local stage=$1 name=$2 detail=$3
  shift 3
  if "$@"; then row "$stage" "$name" PASS "$detail"; else row "$stage" "$name" FAIL "$detail"; fi
}
seconds_since() { echo $(($(date +%s) - $1)); }

# ---- env ----------------------------------------------------------------------------------------
stage_env() {
  {
    echo "date: $(date -u +%FT%TZ)  host: $(hostname)  cores: $jobs  commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null)"
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv 2>&1
    else
      echo "nvidia-smi: none"
    fi
    $py - <<'EOF' 2>&1
import torch
print("python torch", torch.__version__, "cuda", torch.version.cuda, "cudnn",
      torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
      "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print("cmake prefix", torch.utils.cmake_prefix_path)
import importlib.util as u
try:
    s = u.find_spec("nvidia.nccl")
except ImportError:
    s = None
print("site-packages nccl", list(s.submodule_search_locations)[0] if s else None)
import os
nv = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia")
print("site-packages nvidia/:", " ".join(sorted(os.listdir(nv))) if os.path.isdir(nv) else None)
EOF
    echo "nvcc: $(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || echo none)"
    (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) | tail -n 2
    echo "nsys: $(command -v nsys || echo none)"
    mpirun --version 2>&1 | head -n 1
    cmake --version | head -n 1
    echo "compilers: $(c++ --version 2>/dev/null | head -n 1); glibc $(ldd --version 2>/dev/null | head -n 1 | grep -o '[0-9.]*$')"
    local m have=() lack=()
    for m in libpcre2-8 libisal libutf8proc libcrypto nlohmann_json CLI11 gtest yaml-cpp spdlog hdf5 ompi; do
      if command -v pkg-config >/dev/null && PKG_CONFIG_PATH= pkg-config --exists "$m" 2>/dev/null; then have+=("$m"); else lack+=("$m"); fi
    done
    echo "the machine's own pkg-config modules: has ${have[*]:-none}; lacks ${lack[*]:-none}$(command -v pkg-config >/dev/null || echo ' (no pkg-config)')"
    echo "device kit: $([ -f "$kit/env.sh" ] && echo "$kit ($(du -sh "$kit" | cut -f1))" || echo none)"
  } >"$out/env.txt" 2>&1
  cat "$out/env.txt"
  local gpus
  gpus=$(grep -A8 '^name' "$out/env.txt" | tail -n +2 | grep -v '^python' | head -n 8 | cut -d, -f1-3 | paste -sd';')
  row env machine INFO "${gpus:-no GPU (no nvidia-smi)}; $jobs cores"
  row env "python torch" INFO "$(grep -m1 '^python torch' "$out/env.txt" | cut -c14-90)"
}

# ---- build --------------------------------------------------------------------------------------
stage_build() {
  if [ "$rehearse" = 1 ] && [ "$rehearse_build" != 1 ]; then
    [ -x "$bin" ] || { row build "mpitrain binary" FAIL "REHEARSE=1 needs BUILD with a built mpitrain"; return; }
    row build "GPU build" SKIP "rehearsal: using the CPU build $build"
    return
  fi
  local prefix="" arch=${CUDA_ARCH:-native} t0 targets=(mpitrain test_gpu test_stdlib_binding bench_fused_ops)
  if [ -f "$kit/env.sh" ]; then
    # shellcheck disable=SC1091
    . "$kit/env.sh"
    row build "device kit" INFO "$MPITRAIN_KIT: $(grep -c ' KiB installed' "$kit/PACKAGES" 2>/dev/null) Debian packages"
  fi
  if [ "$rehearse" = 1 ]; then
    # The CPU flow of the lease: Debian's libtorch stands in for the image's Python torch.
    prefix=$($py -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null) || prefix=""
  else
    prefix=$($py -c 'import torch; print(torch.utils.cmake_prefix_path)') ||
      { row build configure FAIL "Python torch not importable"; return; }
  fi
  # nvcc: PATH, /usr/local/cuda, else a pip wheel's (nvidia-cuda-nvcc) under site-packages/nvidia.
  # Torch's own CMake config needs a CUDA toolkit too (it finds it the same way).
  if [ "$rehearse" != 1 ] && [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null; then
    local nvcc=""
    if [ -x /usr/local/cuda/bin/nvcc ]; then
      nvcc=/usr/local/cuda/bin/nvcc
    else
      nvcc=$(find "$($py -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')/nvidia" \
        -path '*/bin/nvcc' -type f 2>/dev/null | head -n 1)
    fi
    if [ -n "$nvcc" ]; then
      export CUDACXX=$nvcc CUDAToolkit_ROOT=${CUDAToolkit_ROOT:-$(dirname "$(dirname "$nvcc")")}
      row build "CUDA compiler" INFO "$nvcc"
    else
      row build "CUDA compiler" INFO "no nvcc found: no fused kernels, and torch's CMake config may not configure"
    fi
  fi
  # The compiler: the system's g++ where the environment names another (the H100 image sets
  # CXX=/opt/gcc/bin/g++, a wrapper whose links left libstdc++.so out of test_gpu's NEEDED list,
  # so std::filesystem bound to libtorch's broken copy; /usr/bin/g++ with mpitrain_stdlib_first
  # passed all of test_gpu there). GPU_CHECK_KEEP_CXX=1 keeps the environment's compiler.
  if [ "$rehearse" != 1 ] && [ "${GPU_CHECK_KEEP_CXX:-0}" != 1 ] && [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ] &&
     [ "$(readlink -f "$(command -v "${CXX:-g++}")")" != "$(readlink -f /usr/bin/g++)" ]; then
    row build compiler INFO "/usr/bin/g++ instead of CXX=${CXX:-g++} ($(file -b "$(command -v "${CXX:-g++}")" 2>/dev/null | cut -c1-40))"
    export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++
  fi
  local prefixes=$prefix
  [ -n "${MPITRAIN_KIT:-}" ] && prefixes="${prefixes:+$prefixes;}$MPITRAIN_KIT"
  local extra=()
  if [ "$rehearse" = 1 ]; then
    # What the lease's configure finds on its own there: no CUDA toolkit, no compile check.
    extra=(-DMPITRAIN_CUDA=OFF -DMPITRAIN_GPU_COMPILE_CHECK=OFF)
    targets=(mpitrain test_gpu test_stdlib_binding)  # test_gpu: GoogleTest links (from the kit)
  fi
  t0=$(date +%s)
  if ! cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release ${prefixes:+-DCMAKE_PREFIX_PATH="$prefixes"} \
      -DCMAKE_CUDA_ARCHITECTURES="$arch" -DMPITRAIN_BUILD_TESTS=ON -DMPITRAIN_BUILD_BENCH=ON "${extra[@]}" \
      >"$out/configure.log" 2>&1; then
    row build configure FAIL "see configure.log: $(grep -m1 -i -A2 'error' "$out/configure.log" | tr '\n' ' ' | cut -c1-200)"
    grep -i -A6 'error' "$out/configure.log" | head -n 30
    return
  fi
  grep "mpitrain:" "$out/configure.log"
  if [ "$rehearse" = 1 ]; then
    row build "GPU build" SKIP "rehearsal: a CPU build configured the lease's way ($(grep -m1 -o 'mpitrain: CPU build' "$out/configure.log"))"
  else
    check build "CMake configured a GPU build" "$(grep -m1 'mpitrain: GPU build' "$out/configure.log" | cut -c1-100)" \
      grep -q "mpitrain: GPU build" "$out/configure.log"
    check build "fused CUDA kernels built" "$(grep -m1 'mpitrain: .*CUDA' "$out/configure.log" | cut -c1-100)" \
      grep -q "mpitrain: fused CUDA kernels" "$out/configure.log"
  fi
  # make -k: every failing translation unit's first error in one pass, not only the first one's.
  local TIMEFORMAT='%R %U %S' build_rc=0 cpu_s
  { time cmake --build "$build" -j"$jobs" --target "${targets[@]}" -- -k >"$out/build.log" 2>&1; } 2>"$out/build.time" ||
    build_rc=$?
  cpu_s=$(awk '{ printf "%.0f s wall, %.0f CPU s", $1, $2 + $3 }' "$out/build.time" 2>/dev/null)
  if [ $build_rc -ne 0 ]; then
    row build compile FAIL "$(grep -m1 -E 'error' "$out/build.log" | cut -c1-160)"
    grep -E -A3 "(error|Error)[: ]" "$out/build.log" | head -n 80
    return
  fi
  row build compile PASS "${targets[*]} with -j$jobs: $cpu_s; $(seconds_since "$t0") s with configure"
  # Warnings in mpitrain's own sources (gcc's "file:line:col: warning:" and nvcc's "file(line): warning")
  grep -E "^$root/(src|include|tests|bench)/[^:(]*(:[0-9]+:[0-9]+: warning:|\([0-9]+\): warning)" \
    "$out/build.log" | sort -u >"$out/warnings.txt"
  check build "no warnings in mpitrain's sources" "$(wc -l <"$out/warnings.txt") (warnings.txt)" \
    test ! -s "$out/warnings.txt"
  [ -s "$out/warnings.txt" ] && head -n 20 "$out/warnings.txt"
  # libstdc++ before libtorch in the executable's NEEDED list (CMakeLists.txt, mpitrain_stdlib_first)
  local needed
  needed=$(readelf -d "$bin" 2>/dev/null | awk '/NEEDED/ { gsub(/[][]/, "", $5); print $5 }' | head -n 40)
  check build "libstdc++ is linked before libtorch" "NEEDED: $(echo "$needed" | grep -n -E '^(libstdc\+\+|libtorch)' | head -n 2 | paste -sd' ')" \
    test "$(echo "$needed" | grep -m1 -E '^(libstdc\+\+|libtorch)')" = libstdc++.so.6
  return 0
}

# ---- test ---------------------------------------------------------------------------------------
stage_test() {
  local exe=$build/tests/test_gpu xml=$out/test_gpu.xml
  if [ -x "$build/tests/test_stdlib_binding" ]; then
    local brc=0
    "$build/tests/test_stdlib_binding" >"$out/stdlib_binding.log" 2>&1 || brc=$?
    check test "std::filesystem calls reach libstdc++, not libtorch's copy (test_stdlib_binding)" \
      "$(tail -n 1 "$out/stdlib_binding.log" | cut -c1-120) (exit $brc)" test "$brc" -eq 0
  fi
  if [ "$rehearse" = 1 ]; then row test test_gpu SKIP "rehearsal: no GPU"; return; fi
  [ -x "$exe" ] || { row test test_gpu FAIL "$exe not built"; return; }
  rm -f "$xml"
  timeout "${TEST_TIMEOUT:-150}" mpirun -np 1 "$exe" --gtest_output="xml:$xml" >"$out/test_gpu.log" 2>&1
  local rc=$?
  tail -n 30 "$out/test_gpu.log"
  local counts
  counts=$($py - "$xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
except Exception as e:
    print("0 0 0 0"); sys.exit()
n = failed = skipped = 0
for c in cases:
    n += 1
    failed += c.find("failure") is not None
    skipped += c.get("result") == "skipped" or c.find("skipped") is not None
print(n, n - failed - skipped, failed, skipped)
EOF
)
  read -r n passed failed skipped <<<"$counts"
  if [ "$n" -eq 0 ]; then
    # No XML: the process died. Count from the log, and name the test it died in.
    passed=$(grep -c '\[       OK \]' "$out/test_gpu.log")
    local died
    died=$(grep -o '\[ RUN      \].*' "$out/test_gpu.log" | tail -n 1 | sed 's/.*\] *//; s/\x1b\[[0-9;]*m//g')
    row test "test_gpu died (exit $rc)" FAIL "in ${died:-?} after $passed passed (test_gpu.log)"
  fi
  check test "test_gpu: every test runs and passes" "$n tests: $passed passed, $failed failed, $skipped skipped (exit $rc)" \
    test "$rc" -eq 0 -a "$n" -gt 0 -a "$failed" -eq 0 -a "$skipped" -eq 0
}

# ---- train --------------------------------------------------------------------------------------
# train_run TAG NP [--set key=value ...]: one run of the small model, its output in $work/TAG.log
train_run() {
  local tag=$1 np=$2
  shift 2
  rm -rf "$work/$tag"
  timeout 300 mpirun -np "$np" --bind-to none "$bin" "$work/small.yaml" --set train.out_dir="$work/$tag" \
    --set checkpoint.dir="$work/$tag/ckpt" "$@" >"$work/$tag.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || { echo "--- $tag failed (exit $rc):"; tail -n 15 "$work/$tag.log"; }
  return $rc
}

# compare KIND A B [args]: the loss comparisons of the train stage (prints a detail, exit 1 = FAIL)
compare() { $py "$root/bench/gpu_check_compare.py" "$@"; }

stage_train() {
  work=$out/train
  mkdir -p "$work"
  [ -x "$bin" ] || { row train "mpitrain binary" FAIL "$bin not built"; return; }
  local steps=${TRAIN_STEPS:-200}
  local half=$((steps / 2)) three_quarters=$((steps * 3 / 4))
  # The corpus: Python's own sources as bytes (on every machine with Python), one document per file.
  if [ ! -d "$work/shards" ]; then
    $py - "$work/corpus" <<'EOF'
import glob, os, sys, sysconfig
os.makedirs(sys.argv[1], exist_ok=True)
total = 0
for i, f in enumerate(sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))):
    data = open(f, "rb").read()
    open(os.path.join(sys.argv[1], f"{i:04d}.txt"), "wb").write(data)
    total += len(data)
    if total > 3_000_000:
        break
EOF
    "$bin" pack "$work/corpus" -o "$work/shards/py" --val-fraction 0.05 >"$work/pack.log" 2>&1 ||
      { row train "pack the corpus" FAIL "$(tail -n 1 "$work/pack.log")"; return; }
  fi
  cat >"$work/small.yaml" <<EOF
model: {n_layer: 4, n_head: 4, n_embd: 128, seq_len: 128, dropout: 0.0}
data: {train: ["$work/shards/py-train-*.h5"], val: ["$work/shards/py-val-*.h5"], seed: 1}
train: {micro_batch: 16, steps: $steps, precision: fp32}
optim: {lr: 0.003, min_lr: 0.0003, warmup_steps: 30}
eval: {every: $half, batches: 8}
log: {every: 1}
checkpoint: {every: $half, keep: 5, resume: none}
sample: {tokens: 0}
EOF
  local d=$gpu b=$gpu_backend
  local t0
  t0=$(date +%s)
  if train_run cpu-fp32 1 --set train.device=cpu --set comm.backend=mpi; then
    row train "CPU fp32 reference (1 rank)" INFO "$(compare summary "$work/cpu-fp32")"
  else
    row train "CPU fp32 reference (1 rank)" FAIL "exit status, see train/cpu-fp32.log"
  fi
  if train_run gpu-fp32 1 --set train.device=$d --set comm.backend=$b; then
    grep -E "device:|attention:|fused:|optimizer:" "$work/gpu-fp32.log" | head -n 6 | sed 's/^/    /'
    [ "$rehearse" = 1 ] || check train "the log names the device, attention path and fused kernels" \
      "$(grep -m1 -o 'attention: .*' "$work/gpu-fp32.log" | cut -c1-90)" \
      grep -q "attention: SDPA" "$work/gpu-fp32.log"
    local detail
    detail=$(compare learns-like "$work/gpu-fp32" "$work/cpu-fp32")
    check train "$d fp32 + $b (1 rank) learns like the CPU run" "$detail" test $? -eq 0
  else
    row train "$d fp32 + $b (1 rank)" FAIL "exit status, see train/gpu-fp32.log"
  fi
  # The same global batch of 16 over 2 ranks sharing the GPU: data parallelism, the same losses.
  if train_run gpu-2ranks 2 --set train.device=$d --set comm.backend=mpi --set train.micro_batch=8; then
    [ "$rehearse" = 1 ] || check train "2 ranks share the GPU" "$(grep -m1 -o 'device: .*' "$work/gpu-2ranks.log" | cut -c1-80)" \
      grep -q "GPUs shared by ranks" "$work/gpu-2ranks.log"
    detail=$(compare same-run "$work/gpu-2ranks" "$work/gpu-fp32")
    check train "2 ranks x micro 8 on one $d (comm mpi) = 1 rank x 16" "$detail" test $? -eq 0
  else
    row train "2 ranks sharing one $d (comm mpi)" FAIL "exit status, see train/gpu-2ranks.log"
  fi
  # Pipeline parallelism on the device: 2 stages sharing it, 2 micro-batches of 8 (the same
  # batch of 16; evaluation's 16 batches of 8 the same sequences); the activations go through host
  # memory over MPI (pipeline.h), the GPU's fused block ops where built (fused: auto) in each stage.
  if train_run gpu-pp2 2 --set train.device=$d --set comm.backend=mpi --set parallel.pp=2 \
       --set train.micro_batch=8 --set train.grad_accum=2 --set eval.batches=16; then
    grep -E "pipeline:|fused:" "$work/gpu-pp2.log" | head -n 2 | sed 's/^/    /'
    detail=$(compare same-run "$work/gpu-pp2" "$work/gpu-fp32")
    check train "pp 2 (1f1b, 2 micro-batches of 8) on one $d (comm mpi) = 1 rank x 16" "$detail" test $? -eq 0
  else
    row train "pp 2 on one $d (comm mpi)" FAIL "exit status, see train/gpu-pp2.log"
  fi
  # GPU -> CPU -> GPU: resume the GPU run's mid-run checkpoint on the CPU for a quarter of the
  # that checkpoint on the GPU to the end.
  local ck100 ck150
  ck100=$work/gpu-fp32/ckpt/$(printf 'ckpt-%08d.h5' "$half")
  ck150=$work/resume-cpu/ckpt/$(printf 'ckpt-%08d.h5' "$three_quarters")
  if [ -f "$ck100" ] &&
     train_run resume-cpu 1 --set train.device=cpu --set comm.backend=mpi --set checkpoint.resume="$ck100" \
       --stop-after "$three_quarters" &&
     train_run resume-gpu 1 --set train.device=$d --set comm.backend=$b \
       --set checkpoint.resume="$ck150"; then
    detail=$(compare resumed "$work/gpu-fp32" "$work/resume-cpu" "$work/resume-gpu")
    check train "checkpoint $d -> CPU -> $d: losses continue" "$detail" test $? -eq 0
    mkdir -p "$out/handoff"
    cp "$ck100" "$out/handoff/" && cp -r "$work/shards" "$work/small.yaml" "$out/handoff/" &&
      cp "$work/gpu-fp32/metrics.jsonl" "$out/handoff/gpu-fp32-metrics.jsonl"
  else
    row train "checkpoint $d -> CPU -> $d" FAIL "a run failed, see train/resume-*.log"
  fi
  # On a CPU, libtorch's bf16 can be far slower than fp32 (libtorch 1.13 on a 2-core AVX2 EPYC
  # without AVX-512: ~5.6 s a step of this model, ~30x fp32, past train_run's timeout): a rehearsal
  # first times 3 bf16 steps and, over 10x the fp32 run's step, leaves the comparison to the GPU.
  local bf16_slow=""
  if [ "$rehearse" = 1 ] && train_run bf16-probe 1 --set train.device=$d --set comm.backend=$b \
       --set train.precision=bf16 --set train.steps=3 --set optim.warmup_steps=0 --set eval.every=0 \
       --set checkpoint.every=0 --set checkpoint.at_end=false; then
    bf16_slow=$($py - "$work/bf16-probe/metrics.jsonl" "$work/gpu-fp32/metrics.jsonl" <<'EOF'
import json, sys
def step_ms(path):
    ms = [json.loads(line)["ms_per_step"] for line in open(path) if '"loss"' in line]
    ms = ms[1:] or ms  # the first step includes start-up
    return sorted(ms)[len(ms) // 2]
bf16, fp32 = step_ms(sys.argv[1]), step_ms(sys.argv[2])
if bf16 > 10 * fp32:
    print(f"{bf16:.0f} ms a bf16 step against {fp32:.0f} ms in fp32")
EOF
)
  fi
  if [ -n "$bf16_slow" ]; then
    row train "$d bf16" SKIP "rehearsal: this CPU's bf16 is too slow to train here ($bf16_slow); the GPU lease compares it"
  elif train_run gpu-bf16 1 --set train.device=$d --set comm.backend=$b --set train.precision=bf16; then
    detail=$(compare learns-like "$work/gpu-bf16" "$work/gpu-fp32" --tolerance 0.05)
    check train "$d bf16 trains like fp32" "$detail" test $? -eq 0
  else
    row train "$d bf16" FAIL "exit status, see train/gpu-bf16.log"
  fi
  # optim.state_dtype bf16 (AdamW's moments stored stochastically rounded to bf16, issue 57): learns
  # like fp32 moments in the same precision, bf16 on the GPU (fp32 in a rehearsal, whose CPU bf16
  # may be too slow to train); the state's bytes are the memory stage's ":bf16" rows.
  local sp=bf16 against=gpu-bf16
  [ "$rehearse" = 1 ] && sp=fp32 against=gpu-fp32
  if train_run gpu-state-bf16 1 --set train.device=$d --set comm.backend=$b --set train.precision=$sp \
       --set optim.state_dtype=bf16; then
    detail=$(compare learns-like "$work/gpu-state-bf16" "$work/$against")
    check train "$d $sp, AdamW moments in bf16 train like fp32 moments" "$detail" test $? -eq 0
  else
    row train "$d $sp, AdamW moments in bf16" FAIL "exit status, see train/gpu-state-bf16.log"
  fi
  if [ "$rehearse" = 1 ]; then
    row train "cuda fp16 with loss scaling" SKIP "rehearsal: fp16 needs CUDA"
  elif train_run gpu-fp16 1 --set train.device=$d --set comm.backend=$b --set train.precision=fp16; then
    detail=$(compare learns-like "$work/gpu-fp16" "$work/gpu-fp32" --tolerance 0.05 --loss-scale)
    check train "$d fp16 with loss scaling trains like fp32" "$detail" test $? -eq 0
  else
    row train "$d fp16 with loss scaling" FAIL "exit status, see train/gpu-fp16.log"
  fi
  # fp16 through the pipeline: the last stage scales its loss, every stage unscales its gradients
  # and the overflow verdict is agreed over the stages (tests/pp_test.sh checks that logic on the
  # CPU, where fp16 cannot train).
  if [ "$rehearse" = 1 ]; then
    row train "pp 2 in fp16 on one cuda" SKIP "rehearsal: fp16 needs CUDA"
  elif train_run gpu-pp2-fp16 2 --set train.device=$d --set comm.backend=mpi --set parallel.pp=2 \
       --set train.precision=fp16 --set train.micro_batch=8 --set train.grad_accum=2 --set eval.batches=16; then
    detail=$(compare learns-like "$work/gpu-pp2-fp16" "$work/gpu-fp16" --tolerance 0.05 --loss-scale)
    check train "pp 2 in fp16 on one $d (comm mpi) trains like 1 rank in fp16" "$detail" test $? -eq 0
  else
    row train "pp 2 in fp16 on one $d (comm mpi)" FAIL "exit status, see train/gpu-pp2-fp16.log"
  fi
  row train "train stage time" INFO "$(seconds_since "$t0") s"
}

# ---- llama --------------------------------------------------------------------------------------
stage_llama() {
  local work=$out/llama preset=llama3.2-1b steps=${LLAMA_STEPS:-40} micro=4 precision=bf16 vocab=128256 n=4000000
  mkdir -p "$work"
  [ -x "$bin" ] || { row llama "mpitrain binary" FAIL "$bin not built"; return; }
  if [ "$rehearse" = 1 ]; then preset=llama-debug steps=8 micro=2 precision=fp32 vocab=2048 n=200000; fi
  $py -c "import numpy as np, sys; np.save(sys.argv[1], np.random.default_rng(3).integers(1, $vocab, $n).astype(np.uint32))" \
    "$work/tokens.npy"
  rm -rf "$work/shards" "$work/run"
  "$bin" pack "$work/tokens.npy" -o "$work/shards/tok" --format npy --vocab-size $vocab --eot 0 --val-fraction 0 \
    >"$work/pack.log" 2>&1 || { row llama "pack random tokens" FAIL "$(tail -n 1 "$work/pack.log")"; return; }
  cat >"$work/llama.yaml" <<YAML
model: {preset: $preset}
data: {train: ["$work/shards/tok-train-*.h5"]}
train: {micro_batch: $micro, steps: $steps, device: $gpu, precision: $precision, out_dir: "$work/run"}
optim: {warmup_steps: 5, lr: 3.0e-4}
eval: {every: 0}
log: {every: 5}
checkpoint: {dir: "$work/run/ckpt", resume: none, every: 0}
comm: {backend: $gpu_backend}
sample: {tokens: 0}
YAML
  timeout 420 mpirun -np 1 --bind-to none "$bin" "$work/llama.yaml" >"$work/mpitrain.log" 2>&1
  local rc=$?
  # Random tokens: nothing to learn, the loss stays near ln(vocab); this stage measures speed.
  local facts frc
  facts=$($py "$root/bench/gpu_check_compare.py" speed "$work/run/metrics.jsonl" "$work/mpitrain.log" "$vocab")
  frc=$?
  check llama "$preset, $precision, micro $micro, $steps steps (llama/mpitrain.log)" "${facts:-no metrics} (exit $rc)" \
    test "$rc" -eq 0 -a "$frc" -eq 0
  grep -m1 "model: llama" "$work/mpitrain.log" | cut -c1-200
}

# ---- memory -------------------------------------------------------------------------------------
# Peak device memory (libtorch's allocator, rank 0) of the Llama 3.2 1B shape on 2 ranks sharing the
# GPU (comm.backend mpi, dp 2), bf16, micro-batch 2 x 2048, for optim.zero 0/1/2/3 x activation
# checkpointing none/selective/full (MEMORY_ROWS, "zero:ac ..."; the default puts the rows a short
# lease most needs first: zero 0 none, the baseline, then zero 3 and 2 with full checkpointing,
# then selective, which keeps attention's flash kernel state there), MEMORY_STEPS steps each (default 3: the first step allocates AdamW's
# state, the second runs with it): the table issue 41 asks of a lease, each figure against zero 0
# without checkpointing measured in the same call, and against what `mpitrain plan --memory-only`
# predicts for it (run once first; issue 41's "within 15%"). Each run writes no checkpoint. Rehearsal:
# llama-debug on the CPU, where there is no device peak to read (the runs must still end).
stage_memory() {
  local work=$out/memory preset=llama3.2-1b steps=${MEMORY_STEPS:-3} micro=2 precision=bf16 vocab=128256 n=3000000
  mkdir -p "$work"
  [ -x "$bin" ] || { row memory "mpitrain binary" FAIL "$bin not built"; return; }
  if [ "$rehearse" = 1 ]; then preset=llama-debug micro=2 precision=fp32 vocab=2048 n=200000; fi
  if [ ! -d "$work/shards" ]; then
    $py -c "import numpy as np, sys; np.save(sys.argv[1], np.random.default_rng(4).integers(1, $vocab, $n).astype(np.uint32))" \
      "$work/tokens.npy"
    "$bin" pack "$work/tokens.npy" -o "$work/shards/tok" --format npy --vocab-size $vocab --eot 0 --val-fraction 0 \
      >"$work/pack.log" 2>&1 || { row memory "pack random tokens" FAIL "$(tail -n 1 "$work/pack.log")"; return; }
  fi
  local base="" zero ac state peak rc planned row_spec
  for row_spec in ${MEMORY_ROWS:-0:none 3:full 0:none:bf16 2:full 3:selective 0:selective 3:none 0:full 2:none 1:none 1:full}; do
    # zero:checkpointing[:bf16]: a third field bf16 stores AdamW's moments in bf16 (optim.state_dtype)
    IFS=: read -r zero ac state <<<"$row_spec"
    state=${state:-fp32}
    rm -rf "$work/run"
    cat >"$work/m.yaml" <<YAML
model: {preset: $preset}
data: {train: ["$work/shards/tok-train-*.h5"]}
train: {micro_batch: $micro, steps: $steps, device: $gpu, precision: $precision, out_dir: "$work/run", activation_checkpointing: $ac}
optim: {warmup_steps: 2, zero: $zero, state_dtype: $state}
eval: {every: 0}
log: {every: 1}
checkpoint: {dir: "$work/run/ckpt", resume: none, every: 0, at_end: false}
comm: {backend: mpi}
sample: {tokens: 0}
YAML
    # mpitrain plan's prediction for every row, once per state dtype (the same model, world and micro-batch).
    local plan_log=$work/plan.log tag=zero$zero-$ac what="zero $zero, checkpointing $ac"
    if [ "$state" != fp32 ]; then plan_log=$work/plan-$state.log tag=$tag-$state what="$what, $state moments"; fi
    if [ ! -f "$plan_log" ]; then
      timeout 120 mpirun -np 2 --bind-to none "$bin" plan "$work/m.yaml" --memory-only >"$plan_log" 2>&1 \
        || row memory "mpitrain plan (memory per rank, $state moments)" FAIL "exit $?: $(tail -n 1 "$plan_log")"
    fi
    planned=$(awk -F'|' -v z=" $zero " -v a=" $ac" '$2 == z && index($3, a) == 1 { gsub(/ /, "", $9); printf "%.2f", $9 / 1024; exit }' "$plan_log")
    timeout 300 mpirun -np 2 --bind-to none "$bin" "$work/m.yaml" >"$work/$tag.log" 2>&1
    rc=$?
    peak=$(sed -n 's/.*peak GPU memory (allocated by libtorch, rank 0): \([0-9.]*\) GiB.*/\1/p' "$work/$tag.log" | tail -n 1)
    [ -z "$base" ] && base=$peak
    check memory "$what" \
      "peak ${peak:-n/a} GiB$([ -n "$peak" ] && [ -n "$base" ] && awk -v a="$peak" -v b="$base" 'BEGIN { printf " (%.2fx zero 0, none)", a / b }'); plan ${planned:-n/a} GiB (exit $rc)" \
      test "$rc" -eq 0
  done
}

# ---- bench --------------------------------------------------------------------------------------
stage_bench() {
  if [ "$rehearse" = 1 ]; then row bench "gpu_throughput.sh" SKIP "rehearsal: needs CUDA"; return; fi
  local t0
  t0=$(date +%s)
  BUILD=$build WORK=$out/bench timeout 560 bash "$root/bench/gpu_throughput.sh" 60 >"$out/bench.log" 2>&1
  local rc=$?
  sed -n '/^GPT-2 124M/,$p' "$out/bench.log" | grep -v " losses: " | tee "$out/bench-table.md"
  check bench "gpu_throughput.sh: table and 50-step loss parity" \
    "$(grep -m1 -o 'max relative difference.*' "$out/bench.log" | cut -c1-100) (exit $rc, $(seconds_since "$t0") s)" \
    test "$rc" -eq 0
  local line
  for line in "mpitrain |" "pytorch compile"; do
    grep -m1 "^| $line" "$out/bench-table.md" >/dev/null &&
      row bench "${line% |}" INFO "$(grep -m1 "^| $line" "$out/bench-table.md" | cut -d'|' -f3-5 | tr -s ' ')"
  done
}

# ---- profile ------------------------------------------------------------------------------------
stage_profile() {
  local work=$out/profile
  mkdir -p "$work"
  [ -x "$bin" ] || { row profile "mpitrain binary" FAIL "$bin not built"; return; }
  local shards=$out/bench/shards tokens=$out/bench/tokens.npy cfg=$work/gpt2.yaml steps=30 vocab=50257
  local ref_args=(--device cuda --precision bf16 --micro-batch 16 --seq-len 1024 --vocab 50304)
  if [ "$rehearse" = 1 ]; then
    shards=$out/train/shards
    cat >"$cfg" <<EOF
model: {n_layer: 4, n_head: 4, n_embd: 128, seq_len: 128, dropout: 0.0}
data: {train: ["$shards/py-train-*.h5"]}
train: {micro_batch: 16, steps: 12, device: cpu, out_dir: "$work/run"}
EOF
    steps=12 vocab=257 tokens=$work/tokens.npy
    ref_args=(--device cpu --precision fp32 --micro-batch 16 --seq-len 128 --vocab 257 --n-layer 4 --n-head 4 --n-embd 128)
  else
    if [ ! -d "$shards" ] || [ ! -f "$tokens" ]; then  # without the bench stage: random GPT-2 tokens of its own
      shards=$work/shards tokens=$work/tokens.npy
      if [ ! -d "$shards" ]; then
        $py -c "import numpy as np, sys; np.save(sys.argv[1], np.random.default_rng(5).integers(0, $vocab, 2000000).astype(np.uint16))" \
          "$tokens" && "$bin" pack "$tokens" -o "$shards/gpt2" --format npy --vocab-size $vocab --eot $((vocab - 1)) \
          --val-fraction 0 >"$work/pack.log" 2>&1 || { row profile "pack random GPT-2 tokens" FAIL "$(tail -n 1 "$work/pack.log")"; return; }
      fi
    fi
    cat >"$cfg" <<EOF
model: {preset: gpt2, vocab_size: 50304, dropout: 0.0}
data: {train: ["$shards"]}
train: {micro_batch: 16, steps: $steps, device: cuda, precision: bf16, out_dir: "$work/run"}
comm: {backend: nccl}
EOF
  fi
  cat >>"$cfg" <<EOF
optim: {warmup_steps: 5}
eval: {every: 0}
log: {every: 5, profile_start: $((steps - 4)), profile_steps: 3}
checkpoint: {dir: "$work/run/ckpt", resume: none, every: 0, at_end: false}
sample: {tokens: 0}
EOF
  rm -rf "$work/run"
  local traces=() labels=()
  if timeout 300 mpirun -np 1 "$bin" "$cfg" >"$work/mpitrain.log" 2>&1 && [ -f "$work/run/profile/rank-0.json" ]; then
    traces+=("$work/run/profile/rank-0.json") labels+=(mpitrain)
  else
    row profile "mpitrain profiler trace" FAIL "see profile/mpitrain.log: $(grep -m1 'mpitrain:' "$work/mpitrain.log" | cut -c1-120)"
  fi
  # The same model, batch and step count in PyTorch (bench/gpt2_reference.py), profiled the same
  # way: where mpitrain's step differs from torch.compile's and eager's, kernel kind by kind.
  if $py -c 'import torch' 2>/dev/null; then
    [ -f "$tokens" ] || $py -c "import numpy as np, sys; np.save(sys.argv[1], np.random.default_rng(5).integers(0, $vocab, 400000).astype(np.uint16))" "$tokens"
    local mode
    for mode in compile eager; do
      [ "$rehearse" = 1 ] && [ "$mode" = compile ] && continue  # a C compiler for Inductor is not promised on the CPU
      if timeout 300 "$py" "$root/bench/gpt2_reference.py" --tokens "$tokens" --mode $mode --steps $steps --warmup 8 \
          "${ref_args[@]}" --profile "$work/$mode.json" >"$work/$mode.log" 2>&1 && [ -f "$work/$mode.json" ]; then
        traces+=("$work/$mode.json") labels+=("pytorch $mode")
      else
        row profile "pytorch $mode profiler trace" FAIL "see profile/$mode.log: $(tail -n 1 "$work/$mode.log" | cut -c1-120)"
      fi
    done
  else
    row profile "pytorch profiles" SKIP "Python torch not importable"
  fi
  if [ ${#traces[@]} -gt 0 ]; then
    local joined rc
    joined=$(IFS=,; echo "${labels[*]}")
    "$py" "$root/bench/profile_summary.py" "${traces[@]}" --labels "$joined" >"$work/summary.md" 2>&1
    rc=$?
    cat "$work/summary.md"
    check profile "profiler traces summarised ($joined)" \
      "profile/summary.md: $(grep -m1 -o 'step time.*' "$work/summary.md" | cut -c1-60) $(grep -m1 -o 'GPU busy.* wall time' "$work/summary.md")" \
      test "$rc" -eq 0
  fi
  if [ "$rehearse" != 1 ] && command -v nsys >/dev/null; then
    timeout 300 mpirun -np 1 nsys profile -o "$work/nsys" --force-overwrite true --stats=true -t cuda,nvtx \
      "$bin" "$cfg" --set log.profile_start=0 --set train.out_dir="$work/run-nsys" \
      --set checkpoint.dir="$work/run-nsys/ckpt" >"$work/nsys.log" 2>&1
    check profile "nsys kernel table" "profile/nsys.log" grep -q "cuda_gpu_kern_sum" "$work/nsys.log"
  else
    row profile "nsys" SKIP "nsys not installed (or rehearsal)"
  fi
}

# ---- run the stages, then the summary -----------------------------------------------------------
for s in "${stages[@]}"; do
  case $s in
    env | build | test | train | llama | memory | bench | profile) ;;
    *) echo "gpu_check: unknown stage '$s' (env build test train llama memory bench profile)"; exit 2 ;;
  esac
done
for s in "${stages[@]}"; do
  echo "=== $s"
  [ -f "$summary" ] && sed -i "/^$s\t/d" "$summary"  # a stage run again replaces its rows
  t0=$(date +%s)
  "stage_$s"
  echo "=== $s: $(seconds_since "$t0") s"
done
{
  echo
  echo "mpitrain gpu_check, $(date -u +%F), $(grep -m1 -A1 '^name' "$out/env.txt" 2>/dev/null | tail -n 1)"
  echo "| stage | check | result | detail |"
  echo "|---|---|---|---|"
  for s in env build test train llama memory bench profile; do
    awk -F'\t' -v s="$s" '$1 == s { printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4 }' "$summary"
  done
} | tee "$out/summary.md"
! grep -q $'\tFAIL\t' "$summary"
