#!/usr/bin/env bash
# Checkpoints stay readable by h5py (Debian's python3-h5py; exit 77 = skipped where it is not
# installed, which CTest reports as skipped): a checkpoint saved by a 2-rank run, every dataset
# read by h5py with its values' CRC32 equal to the crc32 attribute the writer computed from memory
# (the tensors' bytes are written at their datasets' offsets by pwrite, not by H5Dwrite:
# checkpoint.cpp), shapes as the attributes declare, and an async save equal to the sync one.
# Usage: h5py_test.sh PATH/TO/mpitrain [mpirun]
set -u
BIN=$(realpath "$1")
MPIRUN=${2:-mpirun}
PY=/usr/bin/python3
$PY -c 'import h5py, numpy' 2>/dev/null || { echo "SKIP: no h5py for $PY (Debian: python3-h5py)"; exit 77; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
WORK=$(mktemp -d /tmp/mpitrain-h5py-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK" || exit 1
mkdir corpus
for i in $(seq 1 60); do printf 'The quick brown fox %d jumps over the lazy dog.\n%%\n' $i >> corpus/a.txt; done
"$BIN" pack corpus -o data/c --doc-separator % --shard-tokens 3000 > pack.out 2>&1 || { cat pack.out; exit 1; }
cat > cfg.yaml <<'YAML'
model: {preset: custom, n_layer: 2, n_head: 2, n_embd: 32, seq_len: 32}
data: {train: [data/c-train-*.h5]}
train: {micro_batch: 2, steps: 4, threads: 1, out_dir: run}
optim: {warmup_steps: 1}
eval: {every: 0}
checkpoint: {dir: ckpt, every: 2, keep: 2}
sample: {tokens: 0}
YAML
"$MPIRUN" -np 2 "$BIN" cfg.yaml > sync.out 2>&1 || { cat sync.out; exit 1; }
"$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=ckpt_async --set checkpoint.async=true > async.out 2>&1 ||
  { cat async.out; exit 1; }
$PY - ckpt/ckpt-00000004.h5 ckpt_async/ckpt-00000004.h5 <<'PY'
import sys, zlib
import h5py, numpy as np
path, async_path = sys.argv[1], sys.argv[2]
failed = 0
def check(name, ok):
    global failed
    print(("PASS: " if ok else "FAIL: ") + name)
    failed += 0 if ok else 1
with h5py.File(path, "r") as f:
    check("h5py opens the checkpoint: format mpitrain-checkpoint, step 4",
          f.attrs["format"] in (b"mpitrain-checkpoint", "mpitrain-checkpoint") and int(f.attrs["step"]) == 4)
    datasets, bad = [], []
    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and "crc32" in obj.attrs:
            a = np.ascontiguousarray(obj[()])
            datasets.append(name)
            if zlib.crc32(a.tobytes()) != int(obj.attrs["crc32"]) or (a.dtype.kind == "f" and not np.isfinite(a).all()):
                bad.append(name)
    f.visititems(visit)
    params = [d for d in datasets if d.startswith("model/")]
    moments = [d for d in datasets if d.startswith("optim/")]
    check(f"h5py reads {len(datasets)} datasets ({len(params)} parameters, {len(moments)} moments): every value's CRC32 equals the writer's attribute"
          + (f" (mismatch: {bad[:3]})" if bad else ""), not bad and len(params) > 0 and len(moments) == 2 * len(params))
    L, E, T, V = (int(f.attrs[k]) for k in ("n_layer", "n_embd", "seq_len", "vocab_size"))
    check(f"shapes as the attributes declare (wte [{V}, {E}], wpe [{T}, {E}], {L} layers)",
          f["model/wte.weight"].shape == (V, E) and f["model/wpe.weight"].shape == (T, E)
          and f[f"model/h.{L-1}.attn.c_attn.weight"].shape == (3 * E, E) and f"model/h.{L}.attn.c_attn.weight" not in f)
    with h5py.File(async_path, "r") as g:
        same = all(np.array_equal(f[d][()], g[d][()]) for d in datasets)
    check("the async save's tensors equal the synchronous save's", same)
print(f"{failed} failed")
sys.exit(1 if failed else 0)
PY
