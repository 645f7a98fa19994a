#!/usr/bin/env bash
# Checkpoints stay readable by h5py (Debian's python3-h5py; exit 77 = skipped where it is not
# installed, which CTest reports as skipped): a checkpoint saved by a 2-rank run, every dataset
# read by h5py with its values' CRC32 equal to the crc32 attribute the writer computed from memory
# (the tensors' bytes are written at their datasets' offsets by pwrite, not by H5Dwrite:
# checkpoint.cpp), shapes as the attributes declare, an async save equal to the sync one, and a
# ZeRO-1 checkpoint written by both ranks (each its share) equal to the one rank 0 writes alone.
# Usage: h5py_test.sh PATH/TO/mpitrain [mpirun]
set -u
BIN=$(realpath "$1")
MPIRUN=${2:-mpirun}
PY=/usr/bin/python3
$PY -c 'import h5py, numpy' 2>/dev/null || { echo "SKIP: no h5py for $PY (Debian: python3-h5py)"; exit 77; }
E2E_NAME=h5py
E2E_NO_CORPUS=1  # its own corpus: shards of 3000 tokens
# shellcheck source=e2e_lib.sh
. "$(dirname "$0")/e2e_lib.sh"
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
# ZeRO-1: both ranks write their shares of the file (checkpoint.writers: auto), or rank 0 alone
"$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=ckpt_shares --set optim.zero=1 > shares.out 2>&1 ||
  { cat shares.out; exit 1; }
grep -q 'every rank writes its ZeRO-1 share (2 writers' shares.out || { echo "FAIL: shares not written by 2 ranks"; exit 1; }
"$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=ckpt_rank0 --set optim.zero=1 --set checkpoint.writers=rank0 \
  > rank0.out 2>&1 || { cat rank0.out; exit 1; }
$PY - ckpt/ckpt-00000004.h5 ckpt_async/ckpt-00000004.h5 ckpt_shares/ckpt-00000004.h5 ckpt_rank0/ckpt-00000004.h5 <<'PY'
import sys, zlib
import h5py, numpy as np
path, async_path, shares_path, rank0_path = sys.argv[1:5]
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
with h5py.File(shares_path, "r") as f, h5py.File(rank0_path, "r") as g:
    names = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    bad = [d for d in names if "crc32" in f[d].attrs and zlib.crc32(np.ascontiguousarray(f[d][()]).tobytes()) != int(f[d].attrs["crc32"])]
    check(f"ZeRO-1 shares written by 2 ranks: h5py reads all {len(names)} datasets, every CRC32 (combined from the ranks' pieces) right"
          + (f" (mismatch: {bad[:3]})" if bad else ""), not bad and len(names) == len(datasets))
    same = all(np.array_equal(f[d][()], g[d][()]) and dict(f[d].attrs) == dict(g[d].attrs) for d in names)
    check("... and every dataset and its attributes equal the checkpoint rank 0 writes alone (checkpoint.writers: rank0)", same)
print(f"{failed} failed")
sys.exit(1 if failed else 0)
PY
