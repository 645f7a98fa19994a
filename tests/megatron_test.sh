#!/usr/bin/env bash
# `mpitrain pack --format megatron`: Megatron-LM indexed datasets (PREFIX.bin + PREFIX.idx) written
# by an independent numpy writer from the format's description (uint16 and int32 tokens, a document
# of two sequences, an empty sequence and an empty document, >1024 documents so that a second rank
# starts from a mark, the optional sequence_modes) are packed alone and under mpirun -np 2; h5py reads
# the shards back: every split's tokens are the index's documents, each the EOT followed by its
# tokens, /doc_offsets marks exactly their starts, the two runs' shards are identical, and `auto`
# finds the pair by its .idx. Damaged indexes are refused, naming the file and the field, exit 2,
# printed once, nothing written.
# Usage: megatron_test.sh PATH/TO/mpitrain [mpirun]
set -u
BIN=$(realpath "$1")
MPIRUN=${2:-mpirun}
E2E_NAME=megatron
E2E_NO_CORPUS=1
# shellcheck source=e2e_lib.sh
. "$(dirname "$0")/e2e_lib.sh"
need_python "import h5py, numpy" "python3-h5py python3-numpy"

# ---- the independent writer --------------------------------------------------------------------
# megatron.py write PREFIX DTYPE SEED NDOCS VOCAB [modes]: documents of 1-3 sequences of random ids
# below VOCAB - 1 (the EOT is VOCAB - 1, never in a document); document 1 is two sequences, document
# 2 holds an empty sequence, document 3 has no sequences. Saves the documents as PREFIX.json.
# megatron.py damage SRC DST KIND [SRC DST KIND]...: DST.{bin,idx} = SRC's with one field broken.
cat > megatron.py <<'PYEOF'
import json, shutil, struct, sys
import numpy as np

CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
HEADER = 9 + 8 + 1 + 8 + 8

def write(prefix, dtype, docs, modes=False):
    seqs = [s for d in docs for s in d]
    item = np.dtype(dtype).itemsize
    lengths = np.array([len(s) for s in seqs], dtype=np.int32)
    pointers = np.zeros(len(seqs), dtype=np.int64)
    pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64) * item)
    doc_idx = np.zeros(len(docs) + 1, dtype=np.int64)
    doc_idx[1:] = np.cumsum([len(d) for d in docs])
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(np.asarray(s, dtype=dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<QBQQ", 1, CODES[dtype], len(seqs), len(doc_idx)))
        f.write(lengths.tobytes() + pointers.tobytes() + doc_idx.tobytes())
        if modes:
            f.write(np.zeros(len(seqs), dtype=np.int8).tobytes())

def make(prefix, dtype, seed, ndocs, vocab, modes):
    rng = np.random.default_rng(seed)
    docs = []
    for k in range(ndocs):
        nseq = 2 if k == 1 else 0 if k == 3 else int(rng.integers(1, 4))
        seqs = [rng.integers(0, vocab - 1, int(rng.integers(1, 40))).tolist() for _ in range(nseq)]
        if k == 2:
            seqs.insert(1, [])
        docs.append(seqs)
    write(prefix, dtype, docs, modes)
    json.dump(docs, open(prefix + ".json", "w"))

def damage(src, dst, kind):
    shutil.copy(src + ".bin", dst + ".bin")
    idx = bytearray(open(src + ".idx", "rb").read())
    S, D = struct.unpack_from("<QQ", idx, 18)
    L, P, Dx = HEADER, HEADER + 4 * S, HEADER + 12 * S  # where the three arrays start
    item = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 8: 2}[idx[17]]
    binsize = len(open(src + ".bin", "rb").read())
    if kind == "magic":      idx[0:9] = b"MMIDIDY\x00\x00"
    elif kind == "version":  struct.pack_into("<Q", idx, 9, 2)
    elif kind == "float":    idx[17] = 7
    elif kind == "code":     idx[17] = 9
    elif kind == "count":    struct.pack_into("<Q", idx, 18, S + 1000)
    elif kind == "trailing": idx += b"\x00\x00\x00"
    elif kind == "negative": struct.pack_into("<i", idx, L + 4 * 2, -3)
    elif kind == "past":     struct.pack_into("<q", idx, P + 8 * 2, binsize + 2 * item)
    elif kind == "odd":      struct.pack_into("<q", idx, P + 8 * 2, struct.unpack_from("<q", idx, P + 16)[0] + 1)
    elif kind == "long":     struct.pack_into("<i", idx, L + 4 * (S - 1), struct.unpack_from("<i", idx, L + 4 * (S - 1))[0] + 1)
    elif kind == "short":    struct.pack_into("<i", idx, L + 4 * (S - 1), struct.unpack_from("<i", idx, L + 4 * (S - 1))[0] - 1)
    elif kind == "docstart": struct.pack_into("<q", idx, Dx, 1)
    elif kind == "docorder": struct.pack_into("<q", idx, Dx + 8 * 2, 0)
    elif kind == "docend":   struct.pack_into("<q", idx, Dx + 8 * (D - 1), S - 1)
    elif kind == "token":    # the first token of the .bin: the vocabulary's size
        b = bytearray(open(src + ".bin", "rb").read()); b[0:2] = struct.pack("<H", 50257)
        open(dst + ".bin", "wb").write(b)
    elif kind == "negtoken":  # the third token of an int32 .bin
        b = bytearray(open(src + ".bin", "rb").read()); struct.pack_into("<i", b, 8, -5)
        open(dst + ".bin", "wb").write(b)
    else: sys.exit("unknown damage " + kind)
    open(dst + ".idx", "wb").write(idx)

if sys.argv[1] == "write":
    make(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), len(sys.argv) > 7)
else:
    for k in range(2, len(sys.argv), 3):
        damage(*sys.argv[k:k + 3])
PYEOF

# ---- the independent reader --------------------------------------------------------------------
# check.py OUT EOT EXPECTED.json... : OUT-{train,val}-*.h5 hold exactly the expected documents (of
# all files, in order; empty ones dropped), each the EOT then its tokens, train and val each an
# in-order subsequence; /doc_offsets are exactly the documents' starts. Prints what it found.
cat > check.py <<'PYEOF'
import glob, json, sys
import h5py, numpy as np
out, eot = sys.argv[1], int(sys.argv[2])
want = []
for path in sys.argv[3:]:
    for doc in json.load(open(path)):
        toks = [t for s in doc for t in s]
        if toks:
            want.append([eot] + toks)
def split(name):
    tokens, starts, base = [], [], 0
    for p in sorted(glob.glob(f"{out}-{name}-*.h5")):
        with h5py.File(p, "r") as f:
            t = f["tokens"][:]
            off = f["doc_offsets"][:] if "doc_offsets" in f else np.zeros(0, np.uint64)
            assert int(f.attrs["eot_token"]) == eot and int(f.attrs["num_tokens"]) == len(t), p
        tokens.append(t.astype(np.int64)); starts.extend(int(o) + base for o in off); base += len(t)
    tokens = np.concatenate(tokens) if tokens else np.zeros(0, np.int64)
    bounds = starts + [len(tokens)]
    docs = [tokens[bounds[i]:bounds[i + 1]].tolist() for i in range(len(starts))]
    ok = (not len(tokens) or starts[:1] == [0])
    return docs, ok
train, ok_t = split("train")
val, ok_v = split("val")
i = j = 0
for d in want:   # the documents are distinct: each must be the next one of train or of val
    if i < len(train) and train[i] == d: i += 1
    elif j < len(val) and val[j] == d: j += 1
    else: sys.exit(f"document {i + j} ({len(d)} tokens) is not the next of train ({i}) or val ({j})")
if (i, j) != (len(train), len(val)) or not (ok_t and ok_v):
    sys.exit(f"extra documents or offsets: train {len(train)} val {len(val)}, matched {i} + {j}")
print(f"{len(want)} documents ({sum(map(len, want))} tokens with their EOTs): train {i}, val {j}")
PYEOF

# same.py DIR1/P DIR2/P: the same shard names, every dataset and attribute equal.
cat > same.py <<'PYEOF'
import glob, os, sys
import h5py, numpy as np
a, b = sys.argv[1:3]
na = sorted(os.path.basename(p) for p in glob.glob(a + "-*.h5"))
nb = sorted(os.path.basename(p) for p in glob.glob(b + "-*.h5"))
assert na and na == nb, (na, nb)
for n in na:
    with h5py.File(os.path.join(os.path.dirname(a), n), "r") as f, h5py.File(os.path.join(os.path.dirname(b), n), "r") as g:
        assert sorted(f) == sorted(g), n
        for k in f:
            assert f[k].dtype == g[k].dtype and np.array_equal(f[k][:], g[k][:]), (n, k)
        assert {k: f.attrs[k] for k in f.attrs} == {k: g.attrs[k] for k in g.attrs}, n
print(f"{len(na)} shards identical")
PYEOF

mkdir in
$PY megatron.py write in/a uint16 1 40 50257          # GPT-2's vocabulary, EOT 50256
$PY megatron.py write in/c uint16 2 3000 50257        # 3000 documents: marks every 1024
$PY megatron.py write in/w int32 3 60 70000 modes     # ids beyond uint16, sequence_modes after
pack() { "$BIN" pack "$@" > pack.out 2>&1 || { cat pack.out; return 1; }; }
pack2() { "$MPIRUN" -np 2 --oversubscribe "$BIN" pack "$@" > pack.out 2>&1 || { cat pack.out; return 1; }; }

# ---- packed alone and under mpirun -np 2: the documents, and identical shards -------------------
args=(--format megatron in/a.idx in/c.bin --val-fraction 0 --shard-tokens 4000)
check "uint16, 2 datasets (named by .idx and .bin), alone: train = every document as EOT + tokens, doc_offsets at each" \
  "pack ${args[*]} -o one/s && $PY check.py one/s 50256 in/a.json in/c.json"
check "... under mpirun -np 2: the same documents, identical shards" \
  "pack2 ${args[*]} -o two/s && $PY check.py two/s 50256 in/a.json in/c.json && $PY same.py one/s two/s"
args=(--format megatron in/a in/c --val-fraction 0.3 --shard-tokens 3000 --seed 7)
check "val-fraction 0.3: train and val are in-order parts of the documents, alone and -np 2 identical" \
  "pack ${args[*]} -o split1/s && $PY check.py split1/s 50256 in/a.json in/c.json && [ -e split1/s-val-00000.h5 ] &&
   pack2 ${args[*]} -o split2/s && $PY same.py split1/s split2/s"
args=(--format megatron in/w --vocab-size 70000 --eot 69999 --val-fraction 0 --shard-tokens 500)
check "int32 with sequence_modes, vocab 70000: the documents, uint32 shards, -np 2 identical" \
  "pack ${args[*]} -o w1/s && $PY check.py w1/s 69999 in/w.json &&
   $PY -c 'import h5py, sys; sys.exit(h5py.File(\"w1/s-train-00000.h5\")[\"tokens\"].dtype != \"uint32\")' &&
   pack2 ${args[*]} -o w2/s && $PY same.py w1/s w2/s"
check "pack counts the index's documents, the empty ones left out: 39 of a's 40 + 2999 of c's 3000" \
  "pack --format megatron in/a in/c -o cnt/s && grep -q 'packed 3038 documents' pack.out"

# ---- auto ----------------------------------------------------------------------------------------
mkdir auto && cp in/a.bin in/a.idx auto/
check "auto: a directory holding a.bin + a.idx is one Megatron dataset (not nanoGPT)" \
  "pack auto --val-fraction 0 -o auto1/s && $PY check.py auto1/s 50256 in/a.json &&
   $PY -c 'import h5py, sys; sys.exit(\"1 files (1 megatron)\" not in str(h5py.File(\"auto1/s-train-00000.h5\").attrs[\"source\"]))'"
check "auto: the bare prefix in/a, and in/a.bin, pack as Megatron" \
  "pack in/a --val-fraction 0 -o auto2/s && $PY check.py auto2/s 50256 in/a.json &&
   pack in/a.bin --val-fraction 0 -o auto3/s && $PY check.py auto3/s 50256 in/a.json"

# ---- damaged indexes ------------------------------------------------------------------------------
# refused NAME KIND WANT: the damaged copy bad/KIND is refused with WANT, and no shard is left.
mkdir bad
damages=()
for k in magic version float code count trailing negative past odd long short docstart docorder docend token; do
  damages+=(in/a "bad/$k" "$k")
done
$PY megatron.py damage "${damages[@]}" in/w bad/negtoken negtoken in/c bad/cpast past in/c bad/ctoken token
refused() {
  expect_own_usage "$1" "$3" "$BIN" pack --format megatron "bad/$2" -o "out_$2/s" &&
    check "... nothing written" "[ -z \"\$(ls -A out_$2 2>/dev/null)\" ]"
}
refused "wrong magic" magic "bad/magic.idx: bad magic (a Megatron .idx starts with MMIDIDX"
refused "version 2" version "bad/version.idx: version 2, expected 1"
refused "float dtype" float "bad/float.idx: dtype code 7 (float32) is not an integer type"
refused "unknown dtype code" code "bad/code.idx: dtype code 9 is not Megatron's"
refused "sequence count beyond the file" count "bad/count.idx: sequence count .* need more than the .* bytes after the header"
refused "trailing bytes that are not sequence_modes" trailing "bad/trailing.idx: 3 bytes after document_indices (trailing data"
refused "negative length" negative "bad/negative.idx: sequence_lengths\[2\] = -3 is negative"
refused "offset past the .bin" past "bad/past.idx: sequence_pointers\[2\] = .* is past the end of bad/past.bin"
refused "offset not a multiple of the dtype size" odd "bad/odd.idx: sequence_pointers\[2\] = .* is not a byte offset of a token"
refused "last length longer than the .bin" long "bad/long.idx: sequence .* ends at byte .*, past the end of bad/long.bin"
refused "lengths short of the .bin size" short "bad/short.idx: sequence_lengths add up to .* tokens (.* bytes), but bad/short.bin holds"
refused "doc indices not starting at 0" docstart "bad/docstart.idx: document_indices\[0\] = 1, expected 0"
refused "doc indices decreasing" docorder "bad/docorder.idx: document_indices\[2\] = 0 is less than document_indices\[1\]"
refused "doc indices not ending at the sequence count" docend "bad/docend.idx: document_indices\[40\] = .*, expected the sequence count"
refused "token >= vocab_size" token "bad/token.bin: token 50257 at position 0 is >= vocab_size 50257"
refused "negative token (int32)" negtoken "bad/negtoken.bin: token -5 at position 2 is negative"
rm bad/magic.bin
expect_own_usage "missing .bin" "bad/magic.bin: no such file (a Megatron dataset is the pair bad/magic.bin + bad/magic.idx)" \
  "$BIN" pack --format megatron bad/magic -o out_nobin/s
cp in/a.bin bad/noidx.bin
expect_own_usage "missing .idx" "bad/noidx.idx: no such file (a Megatron dataset is the pair bad/noidx.bin + bad/noidx.idx)" \
  "$BIN" pack --format megatron bad/noidx.bin -o out_noidx/s
expect_own_usage "under mpirun -np 2: refused once, exit 2" "bad/cpast.idx: sequence_pointers\[2\]" \
  "$MPIRUN" -np 2 --oversubscribe "$BIN" pack --format megatron bad/cpast -o out_cpast/s
expect_own_usage "under mpirun -np 2: a bad token found by rank 0's share, refused once" \
  "bad/ctoken.bin: token 50257 at position 0 is >= vocab_size 50257" \
  "$MPIRUN" -np 2 --oversubscribe "$BIN" pack --format megatron bad/ctoken -o out_ctoken/s
summary
