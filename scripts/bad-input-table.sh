#!/usr/bin/env bash
# Regenerates the bad-input table of docs/operations.md: runs mpitrain on each bad input (under
# mpirun -np 2 where it matters) and prints a Markdown row with the exit code, how many times the
# message was printed, and the message. Usage: scripts/bad-input-table.sh [build/mpitrain]
set -u
B=$(realpath "${1:-build/mpitrain}")
R=$(cd "$(dirname "$0")/.." && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
W=$(mktemp -d /tmp/mpitrain-badin-XXXXXX)
trap 'umount "$W/full" 2>/dev/null; chmod -R u+w "$W"; rm -rf "$W"' EXIT
cd "$W"
mkdir c
for i in $(seq 1 50); do printf 'hello world %d\n%%\n' "$i" >> c/a.txt; done
"$B" pack c -o d/c --doc-separator % > /dev/null
cat > ok.yaml <<'YAML'
model: {preset: custom, n_layer: 1, n_head: 2, n_embd: 16, seq_len: 16}
data: {train: [d/c-train-*.h5], val: [d/c-val-*.h5]}
train: {micro_batch: 2, steps: 2, threads: 1}
optim: {warmup_steps: 1}
eval: {every: 0}
checkpoint: {dir: ck}
YAML
"$B" ok.yaml > /dev/null 2>&1

row() {  # description, command...
  local what=$1
  shift
  "$@" > out.txt 2>&1
  local rc=$?
  local n msg
  n=$(grep -c '^mpitrain: ' out.txt)
  msg=$(grep -m1 '^mpitrain: ' out.txt | sed "s|$W/||g; s/|/\\\\|/g")
  printf '| %s | %s | %s | `%s` |\n' "$what" "$rc" "$n" "$msg"
}
echo '| bad input | exit | printed | message |'
echo '|---|---|---|---|'
printf 'model: {preset: tiny\n' > syntax.yaml
row "config: YAML syntax (mpirun -np 2)" mpirun -np 2 "$B" syntax.yaml
printf 'train: {micro_bach: 2}\n' > unk.yaml
row "config: unknown key (mpirun -np 2)" mpirun -np 2 "$B" unk.yaml
row "config: wrong type" "$B" ok.yaml --set train.micro_batch=abc
row "config: out of range" "$B" ok.yaml --set optim.lr=-1
row "config: n_embd not divisible by n_head" "$B" ok.yaml --set model.n_head=3
row "config: global batch != micro x world x accum (mpirun -np 2)" mpirun -np 2 "$B" ok.yaml --set train.global_batch=6
row "config: validation on but no val data" "$B" ok.yaml --set eval.every=5 --set 'data.val=[]'
row "config: unknown preset" "$B" ok.yaml --set model.preset=gpt5
row "config: CUDA asked for, no GPU (mpirun -np 2)" mpirun -np 2 "$B" ok.yaml --set train.device=cuda --set checkpoint.resume=none
row "config: fp16 on the CPU" "$B" ok.yaml --set train.precision=fp16 --set checkpoint.resume=none
row "config: NCCL in a CPU build" "$B" ok.yaml --set comm.backend=nccl --set checkpoint.resume=none
row "CLI: missing config file" "$B" missing.yaml
row "CLI: unknown flag" "$B" ok.yaml --bogus
row "CLI: malformed --set" "$B" ok.yaml --set train
row "data: no shard matches" "$B" ok.yaml --set 'data.train=[nothing/*.h5]'
echo junk > d/c-train-00009.h5
row "data: not an HDF5 file (mpirun -np 2)" mpirun -np 2 "$B" ok.yaml --set checkpoint.resume=none
rm d/c-train-00009.h5
row "data: shard shorter than one window" "$B" ok.yaml --set model.seq_len=100000 --set checkpoint.resume=none
row "data: model vocab smaller than the data's" "$B" ok.yaml --set model.vocab_size=100 --set checkpoint.resume=none
row "checkpoint: wrong model shape" "$B" ok.yaml --set model.n_embd=32 --set train.steps=3
cp ck/ckpt-00000002.h5 trunc.h5 && truncate -s 3000 trunc.h5
row "checkpoint: truncated" "$B" ok.yaml --set checkpoint.resume=trunc.h5
cp ck/ckpt-00000002.h5 flip.h5
python3 - flip.h5 <<'PY' 2>/dev/null || printf '\xff\xff\xff\xff' | dd of=flip.h5 bs=1 seek=$(( $(stat -c %s flip.h5) - 200 )) conv=notrunc 2>/dev/null
import sys; p=sys.argv[1]; b=bytearray(open(p,'rb').read()); b[-200]^=0xff; open(p,'wb').write(b)
PY
row "checkpoint: checksum mismatch" "$B" ok.yaml --set checkpoint.resume=flip.h5
row "checkpoint: missing" "$B" ok.yaml --set checkpoint.resume=nope.h5
row "checkpoint: not a checkpoint (a shard)" "$B" ok.yaml --set checkpoint.resume=d/c-train-00000.h5
npy() {  # file, header dict, data bytes: a version 1.0 .npy header (padded to 64 bytes), zero data
  local h=$2
  while [ $(( (10 + ${#h} + 1) % 64 )) -ne 0 ]; do h="$h "; done
  { printf '\x93NUMPY\x01\x00'; printf "\\x$(printf %02x $(( (${#h} + 1) % 256 )))\\x$(printf %02x $(( (${#h} + 1) / 256 )))"
    printf '%s\n' "$h"; head -c "$3" /dev/zero; } > "$1"
}
row "init_from: no such directory (mpirun -np 2)" mpirun -np 2 "$B" ok.yaml --set model.init_from=nowhere --set checkpoint.resume=none
mkdir iw
printf junk > iw/wte.weight.npy && printf junk > iw/lm_head.weight.npy
row "init_from: missing and extra .npy files" "$B" ok.yaml --set model.init_from=iw --set checkpoint.resume=none
rm iw/lm_head.weight.npy
for n in wpe.weight ln_f.weight ln_f.bias h.0.ln_1.weight h.0.ln_1.bias h.0.ln_2.weight h.0.ln_2.bias \
         h.0.attn.c_attn.weight h.0.attn.c_attn.bias h.0.attn.c_proj.weight h.0.attn.c_proj.bias \
         h.0.mlp.c_fc.weight h.0.mlp.c_fc.bias h.0.mlp.c_proj.weight h.0.mlp.c_proj.bias; do
  printf junk > "iw/$n.npy"
done
row "init_from: not a .npy file" "$B" ok.yaml --set model.init_from=iw --set checkpoint.resume=none
npy iw/wte.weight.npy "{'descr': '<i8', 'fortran_order': False, 'shape': (257, 16), }" $((257 * 16 * 8))
row "init_from: integer dtype" "$B" ok.yaml --set model.init_from=iw --set checkpoint.resume=none
npy iw/wte.weight.npy "{'descr': '<f4', 'fortran_order': False, 'shape': (16, 257), }" $((257 * 16 * 4))
row "init_from: wrong (transposed) shape" "$B" ok.yaml --set model.init_from=iw --set checkpoint.resume=none
npy iw/wte.weight.npy "{'descr': '<f4', 'fortran_order': False, 'shape': (257, 16), }" 1000
row "init_from: truncated data" "$B" ok.yaml --set model.init_from=iw --set checkpoint.resume=none
row "CLI: inspect a missing file" "$B" inspect nothing.h5
sed 's/"h e"/"h zz"/' "$R/tests/data/hf/strings.json" > badmerge.json
printf '{"text": "ok"}\n{"text": "caf\xc3"}\n' > bad.jsonl
row "pack: tokenizer.json merge naming no token (mpirun -np 2)" mpirun -np 2 "$B" pack c -o d/h --tokenizer hf --tokenizer-file badmerge.json
row "pack: invalid UTF-8 in a JSON Lines line (mpirun -np 2)" mpirun -np 2 "$B" pack bad.jsonl -o d/j
row "CLI: sample from a non-HDF5 file" "$B" sample c/a.txt
mkdir ro && chmod 555 ro
row "CLI: checkpoint dir cannot be created" "$B" ok.yaml --set checkpoint.dir=/proc/mpitrain --set checkpoint.resume=none
row "CLI: out_dir cannot be created" "$B" ok.yaml --set train.out_dir=/proc/mpitrain --set checkpoint.resume=none
# Hardening classes (issue 17): command line, architecture, vocabulary, divergence, paths.
row "CLI: unknown flag (mpirun -np 2)" mpirun -np 2 "$B" ok.yaml --bogus
row "CLI: --set without a value (mpirun -np 2)" mpirun -np 2 "$B" ok.yaml --set
row "CLI: --stop-after -5" "$B" ok.yaml --stop-after -5
row "CLI: --stop-after before the resumed step" "$B" ok.yaml --stop-after 1
row "CLI: pack --shard-tokens -1" "$B" pack c -o d/c --doc-separator % --shard-tokens -1
row "CLI: sample --temperature nan" "$B" sample ck/ckpt-00000002.h5 --temperature nan
row "CLI: sample --tokens -1" "$B" sample ck/ckpt-00000002.h5 --tokens -1
row "CLI: netcheck --iters -1 (mpirun -np 2)" mpirun -np 2 "$B" netcheck --iters -1
row "config: YAML error inside --set" "$B" ok.yaml --set 'train.micro_batch=[1,'
row "config: path is /dev/zero" "$B" /dev/zero
mkfifo fifo.yaml
row "config: path is a FIFO" timeout 20 "$B" fifo.yaml
touch afile
row "config: checkpoint.dir is a file (mpirun -np 2)" mpirun -np 2 "$B" ok.yaml --set checkpoint.dir=afile
row "resume: another n_head, equal shapes (mpirun -np 2)" mpirun -np 2 "$B" ok.yaml --set model.n_head=4
row "resume: another n_layer (mpirun -np 2)" mpirun -np 2 "$B" ok.yaml --set model.n_layer=2
row "config: parallel.tp that does not split the heads (mpirun -np 2)" mpirun -np 2 "$B" ok.yaml --set parallel.tp=2 --set model.n_head=1 --set checkpoint.dir=ckt
row "config: parallel.tp that does not split an explicit vocabulary (mpirun -np 2, byte-level data)" mpirun -np 2 "$B" ok.yaml --set parallel.tp=2 --set model.vocab_size=257 --set checkpoint.dir=ckt
row "training diverges (lr 1e30, mpirun -np 2)" mpirun -np 2 "$B" ok.yaml --set optim.lr=1e30 --set optim.min_lr=0 \
  --set optim.grad_clip=0 --set checkpoint.dir=ckd --set log.every=1
row "optim.fused: on without the kernel" "$B" ok.yaml --set optim.fused=on --set checkpoint.dir=ckf
# Llama and Hugging Face directories (issue 30)
row "config: n_kv_head not dividing n_head" "$B" ok.yaml --set model.preset=llama-debug --set model.n_kv_head=3
row "config: a Llama key on a gpt2 model" "$B" ok.yaml --set model.rope_scaling=llama3
printf 'model: {preset: custom, arch: llama, n_layer: 1, n_head: 2, n_kv_head: 1, n_embd: 16, intermediate_size: 32, seq_len: 16, tie_embeddings: false}\n' > llama.yaml
sed -n '/^data:/,$p' ok.yaml | sed 's/dir: ck}/dir: ckl}/' >> llama.yaml
"$B" llama.yaml > /dev/null 2>&1 && "$B" export ckl/ckpt-00000002.h5 hfl > /dev/null 2>&1 && "$B" export ckl/ckpt-00000002.h5 hfs --max-shard-size 0.001 > /dev/null 2>&1
row "hf:DIR: config.json disagrees with a model key" "$B" ok.yaml --set model.init_from=hf:hfl --set model.n_layer=2 --set checkpoint.dir=ckx
cp -r hfs hfm && rm hfm/model-00002-of-*.safetensors
row "hf:DIR: the index names a missing file" "$B" ok.yaml --set model.init_from=hf:hfm --set checkpoint.dir=ckx
cp -r hfl hft && head -c 3000 hfl/model.safetensors > hft/model.safetensors
row "hf:DIR: truncated safetensors" "$B" ok.yaml --set model.init_from=hf:hft --set checkpoint.dir=ckx
# Launch and run errors (issue 31, section 5)
row "CLI: a mistyped command (mpirun -np 2)" mpirun -np 2 "$B" trian ok.yaml
cp d/c-train-00000.h5 oov-train-00000.h5
/usr/bin/python3 -c "
import h5py
with h5py.File('oov-train-00000.h5', 'r+') as f:
    t = f['tokens']
    for i in range(3, t.shape[0], 10): t[i] = 300
" 2>/dev/null && row "data: tokens outside the vocabulary on both ranks (mpirun -np 2)" mpirun -np 2 "$B" ok.yaml \
  --set 'data.train=[oov-train-*.h5]' --set checkpoint.dir=cko --set checkpoint.resume=none
printf '{"model": {"type": "BPE", "byte_fallback": true, "vocab": {"a": 0}, "merges": []}, "pre_tokenizer": {"type": "Metaspace"}}' > meta.json
row "pack: a Metaspace pre-tokenizer (SentencePiece-style)" "$B" pack c -o d/m --tokenizer hf --tokenizer-file meta.json
mkdir full
if mount -t tmpfs -o size=200k tmpfs full 2>/dev/null; then
  cp -r ck full/ck 2>/dev/null
  row "checkpoint: disk full on save (200 KiB tmpfs)" "$B" ok.yaml --set checkpoint.dir=full/ck2 --set checkpoint.resume=none --set model.n_embd=64
  umount full
fi
