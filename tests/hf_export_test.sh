#!/usr/bin/env bash
# Hugging Face export and import, end to end:
#  - a model trained by `mpirun -np 2` is exported with `mpitrain export CKPT --format hf DIR`;
#    tests/hf_gpt2_reference.py parses model.safetensors itself, checks every name, shape, dtype and
#    value against the checkpoint (h5py), and runs a PyTorch GPT-2 written against Hugging Face's
#    names on the exported weights: its logits must equal mpitrain's (tests/hf_logits.cpp);
#  - model.init_from takes the exported model.safetensors: the new run's step-0 validation loss
#    equals the exported run's last one (same weights, same validation windows);
#  - a GPT-2 BPE run exported with --bpe-dir carries vocab.json/merges.txt equal to the files it was
#    packed with; --dtype bf16 halves the file;
#  - bad input: an unknown --format, a truncated safetensors as init_from, an untied lm_head:
#    exit 2, one line naming the file.
# Usage (KEEP=1 keeps the work directory): hf_export_test.sh PATH/TO/mpitrain PATH/TO/hf_logits [mpirun]
set -u
BIN=$(realpath "$1")
LOGITS=$(realpath "$2")
MPIRUN=${3:-mpirun}
HERE=$(cd "$(dirname "$0")" && pwd)
E2E_NAME=hf
# shellcheck source=e2e_lib.sh
. "$HERE/e2e_lib.sh"
need_python 'import torch, h5py, numpy' 'python3-torch python3-h5py'

cat > cfg.yaml <<'YAML'
model: {preset: custom, n_layer: 2, n_head: 2, n_embd: 32, seq_len: 32}
data: {train: [data/c-train-*.h5], val: [data/c-val-*.h5]}
train: {micro_batch: 2, steps: 6, threads: 1, out_dir: run}
optim: {warmup_steps: 2}
eval: {every: 3, batches: 2}
log: {every: 3}
checkpoint: {dir: ckpt, every: 0, keep: 1, resume: none}
sample: {tokens: 0}
YAML

"$MPIRUN" -np 2 "$BIN" cfg.yaml > train.out 2>&1
rc=$?
check "training (mpirun -np 2, 6 steps) exits 0" "[ $rc -eq 0 ] && [ -f ckpt/ckpt-00000006.h5 ]"
[ $rc -eq 0 ] || tail -20 train.out

"$BIN" export ckpt/ckpt-00000006.h5 --format hf hf > export.out 2>&1
rc=$?
check "mpitrain export --format hf writes model.safetensors and config.json (exit $rc)" \
  "[ $rc -eq 0 ] && [ -s hf/model.safetensors ] && [ -s hf/config.json ] && grep -q 'no tokenizer files' export.out"
[ $rc -eq 0 ] || cat export.out
"$LOGITS" ckpt/ckpt-00000006.h5 . > logits.out 2>&1 || { cat logits.out; bad "hf_logits"; }
"$PY" "$HERE/hf_gpt2_reference.py" hf ckpt/ckpt-00000006.h5 tokens.npy logits.npy > ref.out 2>&1
rc=$?
sed 's/^/  /' ref.out
check "independent parser: every tensor = the checkpoint's; HF-named GPT-2 logits = mpitrain's (exit $rc)" "[ $rc -eq 0 ]"

# ---- the reverse: model.init_from takes the exported file ----
last_val=$(val_loss 6 train.out tail)
"$MPIRUN" -np 2 "$BIN" cfg.yaml --set model.init_from=hf/model.safetensors --set train.out_dir=run2 \
  --set checkpoint.dir=ckpt2 --set train.steps=1 --set optim.warmup_steps=0 > init.out 2>&1
rc=$?
first_val=$(val_loss 0 init.out)
check "model.init_from: hf/model.safetensors: step-0 val loss $first_val = the exported run's last $last_val" \
  "[ $rc -eq 0 ] && [ -n '$first_val' ] && [ '$first_val' = '$last_val' ] && grep -q 'initial weights from hf/model.safetensors' init.out"
[ $rc -eq 0 ] || tail -5 init.out
"$MPIRUN" -np 2 "$BIN" cfg.yaml --set model.init_from=hf --set train.out_dir=run3 \
  --set checkpoint.dir=ckpt3 --set train.steps=1 --set optim.warmup_steps=0 > init_dir.out 2>&1
first_dir=$(val_loss 0 init_dir.out)
check "model.init_from: hf (a directory holding model.safetensors) loads the same ($first_dir)" "[ '$first_dir' = '$last_val' ]"

# ---- bf16 export; GPT-2 BPE with its tokenizer files ----
"$BIN" export ckpt/ckpt-00000006.h5 hf16 --dtype bf16 > export16.out 2>&1
s32=$(stat -c %s hf/model.safetensors) s16=$(stat -c %s hf16/model.safetensors 2>/dev/null || echo 0)
check "--dtype bf16: about half the bytes ($s16 vs $s32) and torch_dtype bfloat16" \
  "[ $s16 -gt 0 ] && [ \$((s16 * 2)) -lt \$((s32 + 4096)) ] && [ \$((s16 * 2)) -gt \$((s32 - 4096)) ] && grep -q bfloat16 hf16/config.json"
"$BIN" pack corpus -o data/g --tokenizer gpt2 --bpe-dir "$HERE/data/gpt2" --doc-separator % --val-fraction 0.2 > packg.out 2>&1
"$BIN" cfg.yaml --set "data.train=[data/g-train-*.h5]" --set "data.val=[]" --set eval.every=0 --set model.n_embd=16 \
  --set train.steps=2 --set train.out_dir=rung --set checkpoint.dir=ckptg > traing.out 2>&1
"$BIN" export ckptg/ckpt-00000002.h5 hfg --bpe-dir "$HERE/data/gpt2" > exportg.out 2>&1
rc=$?
check "GPT-2 BPE: --bpe-dir copies vocab.json and merges.txt (= encoder.json, vocab.bpe) and a GPT2Tokenizer config" \
  "[ $rc -eq 0 ] && cmp -s hfg/vocab.json '$HERE/data/gpt2/encoder.json' && cmp -s hfg/merges.txt '$HERE/data/gpt2/vocab.bpe' && grep -q GPT2Tokenizer hfg/tokenizer_config.json && grep -q '\"vocab_size\": 50257' hfg/config.json"
[ $rc -eq 0 ] || { tail -3 traing.out; cat exportg.out; }

# ---- bad input ----
"$BIN" export ckpt/ckpt-00000006.h5 x --format onnx > bad_format.out 2>&1
rc=$?
check "export --format onnx: exit 2, one line" "[ $rc -eq 2 ] && [ \$(wc -l < bad_format.out) -eq 1 ] && grep -q 'format onnx' bad_format.out"
head -c 20000 hf/model.safetensors > trunc.safetensors
"$BIN" cfg.yaml --set model.init_from=trunc.safetensors --set train.out_dir=run4 --set checkpoint.dir=ckpt4 > trunc.out 2>&1
rc_trunc=$?
# An untied output layer: the exported file with lm_head.weight = 2 x wte added (written here)
"$PY" - hf/model.safetensors untied.safetensors <<'PYEOF'
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
(n,) = struct.unpack_from("<Q", raw, 0)
h = json.loads(raw[8:8 + n]); data = bytearray(raw[8 + n:])
b, e = h["transformer.wte.weight"]["data_offsets"]
import numpy as np
w = np.frombuffer(bytes(data[b:e]), dtype="<f4") * 2
h["lm_head.weight"] = {"dtype": "F32", "shape": h["transformer.wte.weight"]["shape"], "data_offsets": [len(data), len(data) + w.nbytes]}
data += w.tobytes()
t = json.dumps(h).encode(); t += b" " * ((8 - len(t) % 8) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(t)) + t + bytes(data))
PYEOF
"$BIN" cfg.yaml --set model.init_from=untied.safetensors --set train.out_dir=run5 --set checkpoint.dir=ckpt5 > untied.out 2>&1
rc=$?
check "init_from with an untied lm_head.weight: exit 2, one error line ($(grep mpitrain: untied.out | head -c 200))" \
  "[ $rc -eq 2 ] && [ \$(grep -c '^mpitrain: ' untied.out) -eq 1 ] && grep -q 'lm_head.weight differs from the token embedding' untied.out"
check "init_from a truncated safetensors: exit 2, one error line naming model.init_from and the file ($(grep mpitrain: trunc.out | head -c 200))" \
  "[ $rc_trunc -eq 2 ] && [ \$(grep -c '^mpitrain: ' trunc.out) -eq 1 ] && grep -q '^mpitrain: cfg.yaml: model.init_from: trunc.safetensors: ' trunc.out && [ ! -e ckpt4/latest ]"

summary
