#!/usr/bin/env bash
# Mixtures of experts (model.family qwen3_moe, mixtral and olmoe) against the independent PyTorch
# reference (tests/llama_reference.py's Qwen3MoeForCausalLM, MixtralForCausalLM and
# OlmoeForCausalLM, written from transformers' modeling code: the sparse blocks' router and expert
# loop, load_balancing_loss_func):
#  - a qwen3_moe of 4 layers (decoder_sparse_step 2: layers 1 and 3 sparse, 0 and 2 dense), 8
#    experts of 16 units, top 2, the chosen weights renormalised, an untied head, trains
#    under `mpirun -np 2`, is exported with `export --format hf`, and the reference's logits on the
#    export equal mpitrain's (tests/hf_logits.cpp); the check can fail: the reference with
#    norm_topk_prob, num_experts_per_tok or decoder_sparse_step changed, or two experts' weights
#    swapped, gives other logits;
#  - a Mixtral (Mistral's attention with a window of 8 that cuts the context, 4 experts on every
#    layer, always renormalised, block_sparse_moe's w1/w3/w2): the same, and the reference without
#    the window differs; an OLMoE (q/k norms over the whole projections, not renormalised): the
#    same, and the reference renormalising differs;
#  - 20 AdamW steps from each export (model.init_from: hf:DIR) on 2 ranks x 1 micro-batch of 2 and
#    in the reference (one process, batch 4): the losses, the load-balancing loss included (its
#    coefficient raised to 0.5 so that it matters), within 1e-4. The load-balancing loss is each
#    forward's (a rank's micro-batch), as transformers' under DDP: the reference computes it per
#    half of its batch; without the aux loss, or with it over the whole batch, it differs;
#  - the Qwen3-MoE export in shards, read by model.init_from: step-0 val loss = the exporter's last;
#    so do the Qwen3-MoE and Mixtral exports repacked in transformers 5's form (packed experts);
#  - the balancing options: a router z-loss and aux-loss-free balancing (a routing bias moved after
#    every step) at 0.01 each: 20 steps equal the reference's (which without the bias differs); a
#    resume from step 10 continues bitwise (the bias is in the checkpoint); the export says the
#    Hugging Face files cannot carry the bias; with 2 DiLoCo islands each island's bias its own
#    between outer steps (they differ mid-round in the state files), averaged by the outer step
#    (equal after it), and a mid-round resume continues bitwise;
#  - the start-up line describes the experts; bad configurations refused by name (exit 2, one line).
# Usage (KEEP=1 keeps the work directory): moe_test.sh PATH/TO/mpitrain PATH/TO/hf_logits [mpirun]
set -u
BIN=$(realpath "$1")
LOGITS=$(realpath "$2")
MPIRUN=${3:-mpirun}
HERE=$(cd "$(dirname "$0")" && pwd)
E2E_NAME=moe
# shellcheck source=e2e_lib.sh
. "$HERE/e2e_lib.sh"
need_python 'import torch, numpy' 'python3-torch python3-numpy'
REF=("$PY" "$HERE/llama_reference.py")

# Layers 1 and 3 sparse (decoder_sparse_step 2), 0 and 2 dense; lr 0.01 moves the router far
# enough from its start that its choices differ between tokens.
cat > qwen3_moe.yaml <<'EOF'
model: {preset: custom, family: qwen3_moe, n_layer: 4, n_head: 4, n_kv_head: 2, n_embd: 32, head_dim: 16,
        intermediate_size: 64, seq_len: 32, rope_theta: 1000000, norm_eps: 1e-6, vocab_size: 258,
        tie_embeddings: false, num_experts: 8, num_experts_per_tok: 2, moe_intermediate_size: 16,
        norm_topk_prob: true, decoder_sparse_step: 2, router_aux_loss_coef: 0.5}
data: {train: [data/c-train-*.h5], val: [data/c-val-*.h5]}
train: {micro_batch: 2, steps: 6, threads: 1}
optim: {warmup_steps: 2, lr: 0.01}
eval: {every: 3, batches: 2}
log: {every: 3}
checkpoint: {every: 0, keep: 1, resume: none}
sample: {tokens: 0}
EOF
# family SUFFIX YAML STARTUP-PATTERN EXPORT-WHAT EXPORT-CHECK: trains YAML 6 steps on 2 ranks
# (run$SUFFIX, ckpt$SUFFIX), checks the start-up line, exports to hf$SUFFIX and checks it (the check
# reads $D, the export's directory), and writes mpitrain's logits to logits$SUFFIX.
family() {
  local sfx=$1 yaml=$2 startup=$3 what=$4 test=$5 m=${2%.yaml} rc
  "$MPIRUN" -np 2 "$BIN" $yaml --set train.out_dir=run$sfx --set checkpoint.dir=ckpt$sfx > train$sfx.out 2>&1
  rc=$?
  check "$m: training (mpirun -np 2, 6 steps) exits 0; the start-up line names the experts" \
    "[ $rc -eq 0 ] && grep -q '$startup' train$sfx.out"
  [ $rc -eq 0 ] || tail -20 train$sfx.out
  "$BIN" export ckpt$sfx/ckpt-00000006.h5 --format hf hf$sfx > export$sfx.out 2>&1
  rc=$?
  D=hf$sfx
  check "$m: export --format hf: $what (exit $rc)" "[ $rc -eq 0 ] && $test"
  [ $rc -eq 0 ] || cat export$sfx.out
  mkdir -p logits$sfx
  "$LOGITS" ckpt$sfx/ckpt-00000006.h5 logits$sfx > logits$sfx.out 2>&1 || { cat logits$sfx.out; bad "hf_logits $m"; }
}
family "" qwen3_moe.yaml \
  'model: qwen3_moe (llama block), .*8 experts (2 per token, 16 units each, weights renormalised, every 2th layer, aux loss x 0.5)' \
  "Qwen3MoeForCausalLM with its experts' keys, per-expert tensors, layers 0 and 2 dense" \
  "grep -q Qwen3MoeForCausalLM \$D/config.json && grep -q '\"num_experts\": 8' \$D/config.json &&
   grep -q '\"num_experts_per_tok\": 2' \$D/config.json && grep -q '\"norm_topk_prob\": true' \$D/config.json &&
   grep -q '\"decoder_sparse_step\": 2' \$D/config.json && grep -q '\"moe_intermediate_size\": 16' \$D/config.json &&
   grep -q 'model.layers.3.mlp.experts.7.down_proj.weight' \$D/model.safetensors &&
   grep -q 'model.layers.1.mlp.gate.weight' \$D/model.safetensors && grep -q 'model.layers.2.mlp.down_proj.weight' \$D/model.safetensors &&
   ! grep -q 'model.layers.2.mlp.gate.weight' \$D/model.safetensors"

# Hugging Face in, sharded: the Qwen3-MoE export in 20 kB shards (model.safetensors.index.json),
# read back by model.init_from (the shape and the experts' fields from config.json), evaluates at
# step 0 to the exporting run's last val loss.
"$BIN" export ckpt/ckpt-00000006.h5 --format hf hf_sh --max-shard-size 0.02 > export_sh.out 2>&1
nshards=$(ls hf_sh/model-*-of-*.safetensors 2>/dev/null | wc -l)
printf 'model: {init_from: "hf:hf_sh", seq_len: 32}\n' > init_sh.yaml
sed -n '/^data:/,$p' qwen3_moe.yaml >> init_sh.yaml
"$MPIRUN" -np 2 "$BIN" init_sh.yaml --set train.out_dir=run_sh --set checkpoint.dir=ckpt_sh --set train.steps=1 \
  --set optim.warmup_steps=0 > init_sh.out 2>&1
rc=$?
last_val=$(val_loss 6 train.out tail)
sh_val=$(val_loss 0 init_sh.out)
check "init_from the Qwen3-MoE export in $nshards shards: the experts' shape from config.json, step-0 val loss $sh_val = the exported run's last $last_val" \
  "[ $rc -eq 0 ] && [ $nshards -gt 1 ] && [ -s hf_sh/model.safetensors.index.json ] && [ -n '$sh_val' ] && [ '$sh_val' = '$last_val' ] &&
   grep -q 'model: qwen3_moe (llama block), .*8 experts (2 per token, 16 units each, weights renormalised, every 2th layer, aux loss x 0.5)' init_sh.out"
[ $rc -eq 0 ] || tail -5 init_sh.out

# Mixtral: Mistral's attention with a window of 8 that cuts the 32-token context, 4 experts of 24
# units on both layers, 2 per token, always renormalised (block_sparse_moe's w1, w3, w2).
printf '%s\n' 'model: {preset: custom, family: mixtral, n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 32, intermediate_size: 24,
        seq_len: 32, rope_theta: 1000000, vocab_size: 258, tie_embeddings: false, sliding_window: 8,
        num_experts: 4, num_experts_per_tok: 2, moe_intermediate_size: 24, router_aux_loss_coef: 0.5}' > mixtral.yaml
sed -n '/^data:/,$p' qwen3_moe.yaml >> mixtral.yaml
family _mx mixtral.yaml \
  'model: mixtral (llama block), .*attention window 8 (cuts the context), 4 experts (2 per token, 24 units each, weights renormalised, aux loss x 0.5)' \
  "MixtralForCausalLM with num_local_experts, block_sparse_moe's w1/w2/w3" \
  "grep -q MixtralForCausalLM \$D/config.json && grep -q '\"num_local_experts\": 4' \$D/config.json &&
   grep -q '\"sliding_window\": 8' \$D/config.json && grep -q 'model.layers.1.block_sparse_moe.experts.3.w2.weight' \$D/model.safetensors &&
   grep -q 'model.layers.0.block_sparse_moe.gate.weight' \$D/model.safetensors && ! grep -q 'mlp' \$D/model.safetensors"

# OLMoE: q and k each normalised over the whole projection (not per head), 4 experts of 16 units on
# both layers, 2 per token, not renormalised.
printf '%s\n' 'model: {preset: custom, family: olmoe, n_layer: 2, n_head: 4, n_embd: 32, intermediate_size: 16,
        seq_len: 32, vocab_size: 258, tie_embeddings: false, num_experts: 4, num_experts_per_tok: 2,
        moe_intermediate_size: 16, router_aux_loss_coef: 0.5}' > olqwen3_moe.yaml
sed -n '/^data:/,$p' qwen3_moe.yaml >> olqwen3_moe.yaml
family _ol olqwen3_moe.yaml 'model: olmoe (llama block), .*q/k norms, 4 experts (2 per token, 16 units each, aux loss x 0.5)' \
  "OlmoeForCausalLM, q_norm of the whole projection's width" \
  "grep -q OlmoeForCausalLM \$D/config.json && grep -q '\"num_experts\": 4' \$D/config.json &&
   grep -q '\"norm_topk_prob\": false' \$D/config.json &&
   grep -q '\"model.layers.0.self_attn.q_norm.weight\": *{[^}]*\"shape\": *\[32\]' \$D/model.safetensors"

# transformers 5's files: each sparse layer's experts packed into mlp.experts.gate_up_proj
# [E, 2I, C] and mlp.experts.down_proj [E, C, I] (Mixtral's under mlp too, its router mlp.gate),
# as transformers 5 saves them: the Qwen3-MoE and Mixtral exports repacked so, read by
# model.init_from, evaluate at step 0 to the exporting runs' last val losses.
pack_v5() {  # SRC DST: SRC's per-expert tensors packed
  "$PY" - "$1" "$2" "$HERE" <<'PYEOF'
import json, os, re, shutil, struct, sys
import torch
sys.path.insert(0, sys.argv[3])
from llama_reference import parse_safetensors
src, dst = sys.argv[1], sys.argv[2]
w = parse_safetensors(f"{src}/model.safetensors")
os.makedirs(dst, exist_ok=True)
shutil.copy(f"{src}/config.json", dst)
out, experts = {}, {}
pat = re.compile(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
for k, v in w.items():
    m = pat.fullmatch(k)
    if m:
        experts.setdefault(int(m[1]), {})[(int(m[3]), m[4])] = v
    else:
        out[k.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = v
part = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
for layer, t in experts.items():
    E = 1 + max(e for e, _ in t)
    g = lambda e, p: t.get((e, part[p][0]), t.get((e, part[p][1])))
    out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g(e, "gate"), g(e, "up")]) for e in range(E)])
    out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([g(e, "down") for e in range(E)])
header, blobs, off = {}, [], 0
for k in sorted(out):
    b = out[k].contiguous().float().numpy().tobytes()
    header[k] = {"dtype": "F32", "shape": list(out[k].shape), "data_offsets": [off, off + len(b)]}
    blobs.append(b)
    off += len(b)
h = json.dumps(header).encode()
h += b" " * ((8 - len(h) % 8) % 8)
open(f"{dst}/model.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
PYEOF
}
for v in "hf_v5:hf:train.out:qwen3_moe" "hf_mx_v5:hf_mx:train_mx.out:mixtral"; do
  IFS=: read -r dst src log m <<< "$v"
  pack_v5 $src $dst > pack_$dst.out 2>&1 || cat pack_$dst.out
  printf 'model: {init_from: "hf:%s", seq_len: 32}\n' $dst > init_$dst.yaml
  sed -n '/^data:/,$p' qwen3_moe.yaml >> init_$dst.yaml
  "$MPIRUN" -np 2 "$BIN" init_$dst.yaml --set train.out_dir=run_$dst --set checkpoint.dir=ckpt_$dst --set train.steps=1 \
    --set optim.warmup_steps=0 > init_$dst.out 2>&1
  rc=$?
  last_val=$(val_loss 6 $log tail)
  v5_val=$(val_loss 0 init_$dst.out)
  check "$m in transformers 5's form (experts packed in gate_up_proj / down_proj): init_from's step-0 val loss $v5_val = the exported run's last $last_val" \
    "[ $rc -eq 0 ] && [ -n '$v5_val' ] && [ '$v5_val' = '$last_val' ] && grep -q 'experts.gate_up_proj' $dst/model.safetensors &&
     ! grep -q 'experts\.0\.' $dst/model.safetensors"
  [ $rc -eq 0 ] || tail -5 init_$dst.out
done

# Variants the reference must tell apart: config.json edited, or experts 0 and 1 of layer 1 swapped.
variant() {  # NAME SOURCE-DIR PYTHON-EXPRESSION-ON-c: SOURCE-DIR's weights, its config.json edited
  mkdir -p hf_$1 && ln -sf "$PWD/$2/model.safetensors" hf_$1/model.safetensors
  "$PY" -c "import json; c = json.load(open('$2/config.json')); $3; json.dump(c, open('hf_$1/config.json', 'w'))"
}
variant nonorm hf 'c["norm_topk_prob"] = False'
variant top3 hf 'c["num_experts_per_tok"] = 3'
variant ol_norm hf_ol 'c["norm_topk_prob"] = True'
variant mx_nowin hf_mx 'c["sliding_window"] = None'
mkdir -p hf_swap && cp hf/config.json hf_swap/
"$PY" - hf/model.safetensors hf_swap/model.safetensors <<'PYEOF'
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
(n,) = struct.unpack_from("<Q", raw, 0)
h = json.loads(raw[8:8 + n])
for part in ("gate_proj", "up_proj", "down_proj"):  # the names of experts 0 and 1 of layer 1 exchanged
    a, b = (f"model.layers.1.mlp.experts.{e}.{part}.weight" for e in (0, 1))
    h[a], h[b] = h[b], h[a]
t = json.dumps(h).encode(); t += b" " * ((8 - len(t) % 8) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(t)) + t + raw[8 + n:])
PYEOF
# The learnable text of llama_hf: the GPL's bytes as tokens 1-256.
"$PY" -c 'import numpy as np; np.save("tokens.npy", np.frombuffer(open("/usr/share/common-licenses/GPL-3", "rb").read(), np.uint8).astype(np.uint16) + 1)'
"$BIN" pack tokens.npy -o data/t --vocab-size 257 --eot 0 --val-fraction 0 > pack_t.out 2>&1 || cat pack_t.out
declare -A prc
declare -a eprc
for m in hf hf_mx hf_ol; do
  printf 'model: {init_from: "hf:%s", seq_len: 32}\n' $m > init_$m.yaml
  sed -n '/^data:/,$p' qwen3_moe.yaml | sed 's/lr: 0.01/lr: 0.003/' >> init_$m.yaml
  "$MPIRUN" -np 2 "$BIN" init_$m.yaml --set "data.train=[data/t-train-*.h5]" --set "data.val=[]" --set data.shuffle=false \
    --set eval.every=0 --set log.every=1 --set train.steps=20 --set train.out_dir=run_par_$m --set checkpoint.dir=ckpt_par_$m > par_$m.out 2>&1
  prc[$m]=$?
done
# The Qwen3-MoE run again with a capacity factor of 1: each expert takes at most 16 of a rank's 64
# token copies per layer (2 sequences x 32 tokens x top 2 / 8 experts), the rest dropped.
"$MPIRUN" -np 2 "$BIN" init_hf.yaml --set "data.train=[data/t-train-*.h5]" --set "data.val=[]" --set data.shuffle=false \
  --set eval.every=0 --set log.every=1 --set train.steps=20 --set train.moe_capacity_factor=1 --set train.out_dir=run_par_cap \
  --set checkpoint.dir=ckpt_par_cap > par_cap.out 2>&1
prc[cap]=$?
# Aux-loss-free balancing (a routing bias moved 0.01 per step) and the router z-loss (x 0.01)
# together, with a checkpoint at step 10 that a second run resumes (the bias is in it).
bal=(init_hf.yaml --set "data.train=[data/t-train-*.h5]" --set "data.val=[]" --set data.shuffle=false --set eval.every=0
     --set log.every=1 --set train.steps=20 --set train.moe_z_loss_coef=0.01 --set train.moe_bias_update_rate=0.01
     --set checkpoint.every=10 --set checkpoint.keep=2)
"$MPIRUN" -np 2 "$BIN" "${bal[@]}" --set train.out_dir=run_par_bal --set checkpoint.dir=ckpt_par_bal > par_bal.out 2>&1
prc[bal]=$?
"$MPIRUN" -np 2 "$BIN" "${bal[@]}" --set train.out_dir=run_par_bal_res --set checkpoint.dir=ckpt_par_bal_res \
  --set checkpoint.resume=ckpt_par_bal/ckpt-00000010.h5 > par_bal_res.out 2>&1
prc[bal_res]=$?
"$BIN" export ckpt_par_bal/ckpt-00000020.h5 --format hf hf_bal > export_bal.out 2>&1
prc[bal_export]=$?
variant noaux hf 'c["router_aux_loss_coef"] = 0.0'
{
  for v in "" _nonorm _top3 _swap; do echo "logits$v logits hf$v logits/tokens.npy logits/logits.npy"; done
  for v in "" _nowin; do echo "logits_mx$v logits hf_mx$v logits_mx/tokens.npy logits_mx/logits.npy"; done
  for v in "" _norm; do echo "logits_ol$v logits hf_ol$v logits_ol/tokens.npy logits_ol/logits.npy"; done
  echo "train_ol train hf_ol tokens.npy --steps 20 --batch 4 --seq-len 32 --lr 3e-3 --min-lr 6e-5 --warmup 2 --aux-groups 2"
  echo "train_mx train hf_mx tokens.npy --steps 20 --batch 4 --seq-len 32 --lr 3e-3 --min-lr 6e-5 --warmup 2 --aux-groups 2"
  for v in "" _noaux; do echo "train$v train hf$v tokens.npy --steps 20 --batch 4 --seq-len 32 --lr 3e-3 --min-lr 6e-5 --warmup 2 --aux-groups 2"; done
  echo "train_whole train hf tokens.npy --steps 20 --batch 4 --seq-len 32 --lr 3e-3 --min-lr 6e-5 --warmup 2"
  echo "train_cap train hf tokens.npy --steps 20 --batch 4 --seq-len 32 --lr 3e-3 --min-lr 6e-5 --warmup 2 --aux-groups 2 --capacity-factor 1"
  echo "train_bal train hf tokens.npy --steps 20 --batch 4 --seq-len 32 --lr 3e-3 --min-lr 6e-5 --warmup 2 --aux-groups 2 --z-loss 0.01 --bias-update 0.01"
  echo "train_bal_nobias train hf tokens.npy --steps 20 --batch 4 --seq-len 32 --lr 3e-3 --min-lr 6e-5 --warmup 2 --aux-groups 2 --z-loss 0.01"
} > refs.list
"${REF[@]}" list refs.list refs > refs.log 2>&1 || cat refs.log
rc_of() { cat refs/$1.rc 2>/dev/null || echo none; }
sed 's/^/  /' refs/logits.out
check "the reference's Qwen3-MoE on the export gives mpitrain's logits (exit $(rc_of logits))" "[ $(rc_of logits) = 0 ]"
sed 's/^/  /' refs/logits_mx.out
check "the reference's Mixtral on the export gives mpitrain's logits (exit $(rc_of logits_mx))" "[ $(rc_of logits_mx) = 0 ]"
sed 's/^/  /' refs/logits_ol.out
check "the reference's OLMoE on the export gives mpitrain's logits (exit $(rc_of logits_ol))" "[ $(rc_of logits_ol) = 0 ]"
for v in nonorm:"norm_topk_prob false" top3:"num_experts_per_tok 3" swap:"experts 0 and 1 of layer 1 swapped" \
         mx_nowin:"Mixtral without its window" ol_norm:"OLMoE with norm_topk_prob true"; do
  n=${v%%:*}
  check "the reference with ${v#*:} does not give mpitrain's logits ($(tail -1 refs/logits_$n.out 2>/dev/null | cut -c1-100))" \
    "[ $(rc_of logits_$n) != 0 ] && grep -q 'logits differ' refs/logits_$n.out"
done
# Each family's 20 losses against the reference's (ref_parity, e2e_lib.sh).
for v in train:hf:qwen3_moe train_mx:hf_mx:mixtral train_ol:hf_ol:olmoe; do
  IFS=: read -r ref dir m <<< "$v"
  ref_parity run_par_$dir/metrics.jsonl refs/$ref.out > parity_$ref.out 2>&1
  arc=$?
  cat parity_$ref.out
  check "$m: 20 AdamW steps from the export (2 ranks, aux loss x 0.5): losses within 1e-4 of the reference's, and learning" \
    "[ ${prc[$dir]} -eq 0 ] && [ $(rc_of $ref) = 0 ] && [ $arc -eq 0 ]"
  [ ${prc[$dir]} -eq 0 ] || tail -5 par_$dir.out
  [ "$(rc_of $ref)" = 0 ] || tail -5 refs/$ref.out
done
# The capacity: the reference drops each expert's copies past the first 16 of each rank's half of the
# batch, by position; mpitrain's 20 losses are its, and the dropless run's are not.
ref_parity run_par_cap/metrics.jsonl refs/train_cap.out > parity_cap.out 2>&1
arc=$?
cat parity_cap.out
ref_dropped=$(sed -n 's/.*"dropped": \([0-9]*\).*/\1/p' refs/train_cap.out 2>/dev/null | tail -1)
check "qwen3_moe with train.moe_capacity_factor 1: the reference's 20 losses dropping the same copies (it dropped ${ref_dropped:-?}; exit ${prc[cap]})" \
  "[ ${prc[cap]} -eq 0 ] && [ $arc -eq 0 ] && [ \${ref_dropped:-0} -gt 0 ] && grep -q '\"dropped\": 0\.0*[1-9]' run_par_cap/metrics.jsonl &&
   grep -q ' | dropped [0-9.]*%' par_cap.out"
ref_parity run_par_hf/metrics.jsonl refs/train_cap.out > parity_nocap.out 2>&1
rc=$?
check "the reference with the capacity does not give the dropless run's losses ($(tail -1 parity_nocap.out))" "[ $rc -ne 0 ]"
# The balancing bias and the z-loss: the reference's 20 losses; the reference without the bias
# (the z-loss alone) differs; a resume from step 10 trains the same steps 11-20 (the bias travels
# in the checkpoint); the export says the bias has no place in Qwen3MoeForCausalLM's files.
ref_parity run_par_bal/metrics.jsonl refs/train_bal.out > parity_bal.out 2>&1
arc=$?
cat parity_bal.out
ref_bias=$(sed -n 's/.*"max_bias": \([0-9.e-]*\).*/\1/p' refs/train_bal.out 2>/dev/null | tail -1)
check "qwen3_moe with train.moe_bias_update_rate 0.01 and train.moe_z_loss_coef 0.01: the reference's 20 losses (its largest bias ${ref_bias:-?}; exit ${prc[bal]})" \
  "[ ${prc[bal]} -eq 0 ] && [ $arc -eq 0 ] && grep -q '\"z_loss\": [0-9.]*' run_par_bal/metrics.jsonl && grep -q ' | z [0-9.]*' par_bal.out"
ref_parity run_par_bal/metrics.jsonl refs/train_bal_nobias.out > parity_bal_nobias.out 2>&1
rc=$?
check "the reference without the routing bias (z-loss alone) does not give those losses ($(tail -1 parity_bal_nobias.out))" "[ $rc -ne 0 ]"
grep -o '"loss": [0-9.]*' run_par_bal/metrics.jsonl | tail -10 > bal.losses
grep -o '"loss": [0-9.]*' run_par_bal_res/metrics.jsonl > bal_res.losses 2>/dev/null
check "resumed from step 10 with its routing bias: the uninterrupted run's losses 11-20 (exit ${prc[bal_res]})" \
  "[ ${prc[bal_res]} -eq 0 ] && [ \$(wc -l < bal_res.losses) -eq 10 ] && cmp -s bal.losses bal_res.losses"
check "export of a checkpoint with a routing bias says the Hugging Face files have no place for it (exit ${prc[bal_export]})" \
  "[ ${prc[bal_export]} -eq 0 ] && grep -q 'routing bias (train.moe_bias_update_rate; largest |bias| .*) has no place in Qwen3MoeForCausalLM' export_bal.out"
for v in noaux:"without the aux loss" whole:"with the aux loss over the batch of 4 (not each rank's 2)"; do
  n=${v%%:*}
  ref_parity run_par_hf/metrics.jsonl refs/train_$n.out > parity_$n.out 2>&1
  rc=$?
  check "the reference ${v#*:} does not give mpitrain's losses ($(tail -1 parity_$n.out))" "[ $rc -ne 0 ]"
done

# The memory layouts and a resume: ZeRO-1, ZeRO-3, full activation checkpointing and selective
# with ZeRO-3 train the plain run's 8 losses bitwise (every rank holds every expert; ZeRO-3 gathers a
# block's experts with the block; a checkpointed block's second run gives the router the aux loss's
# gradient); a run resumed from step 4's checkpoint under ZeRO-3 trains the uninterrupted run's last 4.
for v in "plain:" "zero1:--set optim.zero=1" "zero3:--set optim.zero=3" "full:--set train.activation_checkpointing=full" \
         "selective:--set train.activation_checkpointing=selective --set optim.zero=3"; do
  n=${v%%:*}; a=${v#*:}
  "$MPIRUN" -np 2 "$BIN" qwen3_moe.yaml $a --set train.out_dir=run_l_$n --set checkpoint.dir=ckpt_l_$n --set log.every=1 \
    --set eval.every=0 --set train.steps=8 --set checkpoint.every=4 --set checkpoint.keep=2 > l_$n.out 2>&1 || tail -3 l_$n.out
  grep -o '"loss": [0-9.]*' run_l_$n/metrics.jsonl > l_$n.losses
done
for n in zero1 zero3 full selective; do
  check "qwen3_moe with $n: the plain run's 8 losses ($(tr '\n' ' ' < l_plain.losses | cut -c1-60)...)" \
    "[ \$(wc -l < l_plain.losses) -eq 8 ] && cmp -s l_plain.losses l_$n.losses"
done
"$MPIRUN" -np 2 "$BIN" qwen3_moe.yaml --set optim.zero=3 --set checkpoint.resume=ckpt_l_plain/ckpt-00000004.h5 \
  --set train.out_dir=run_res --set checkpoint.dir=ckpt_res --set log.every=1 --set eval.every=0 --set train.steps=8 > res.out 2>&1
rc=$?
grep -o '"loss": [0-9.]*' run_res/metrics.jsonl > res.losses
check "qwen3_moe resumed at step 4 under ZeRO-3: the uninterrupted run's losses 5-8 (exit $rc)" \
  "[ $rc -eq 0 ] && [ \$(wc -l < res.losses) -eq 4 ] && tail -4 l_plain.losses | cmp -s - res.losses"
check "metrics.jsonl has the aux loss and each sparse layer's expert load (2 layers)" \
  "grep -q '\"aux_loss\": [0-9.]*, \"expert_load\": \[[0-9.]*, [0-9.]*\]' run_l_plain/metrics.jsonl && grep -q ' | aux [0-9.]* | load [0-9.]*' l_plain.out"

"$BIN" plan qwen3_moe.yaml --memory-only > plan.out 2>&1
rc=$?
check "plan --memory-only on a mixture of experts: the memory table with its checkpointing rows (exit $rc)" \
  "[ $rc -eq 0 ] && grep -q '^| 0 | none |' plan.out && grep -q '^| 0 | selective |' plan.out && grep -q '^| 0 | full |' plan.out"
[ $rc -eq 0 ] || tail -5 plan.out

# Expert parallelism (parallel.ep) at np 4: the experts split over ep 2
# (two ep groups, each expert's gradient averaged over its two replicas; ZeRO-3 shards the shared
# parameters and their AdamW state over the 4 ranks, its units holding no expert) and ep 4 (one
# group; ZeRO-2, the shared gradients
# reduce-scattered as backward fills each bucket; with selective activation checkpointing) train the
# ep 1 run's 8
# steps: its losses and its final parameters within the reordering bound (test_train.cpp's
# kReorderTolerance, 1.5e-3 of the displacement: each expert's tokens from every rank of its group
# go through one GEMM and its gradient is summed in another order; a wrong routing, gradient or
# average moves the parameters by a different amount altogether, a gap near 1). The ep 4 run's
# step-4 checkpoint (whole tensors, the experts gathered to rank 0, the shared state from every
# rank) resumed under ep 2 at ZeRO-1, and at ZeRO-3 with selective checkpointing, trains the same
# last 4 steps (each rank taking its experts and their AdamW moments from the file, and its slices
# of the others'; ZeRO-3 of their values too). The ep 1 run's step-4 export read by model.init_from
# under ep 2 at ZeRO-3 (each rank its experts from files holding all of them) evaluates to ep 1's
# step-0 validation loss from the same files.
# to_hf RUN STEP NAME: ckpt_RUN's checkpoint of STEP exported to hf_NAME (Hugging Face files).
to_hf() {
  "$BIN" export "ckpt_$1/ckpt-$(printf %08d "$2").h5" --format hf "hf_$3" > "export_$3.out" 2>&1 || cat "export_$3.out"
}
# Every ep run balances with the routing bias and the z-loss as well (the loads all-reduced over the
# 4 ranks, whatever holds which experts; the bias travels in the checkpoint across ep degrees).
ep_balancing=(--set train.moe_bias_update_rate=0.01 --set train.moe_z_loss_coef=0.01)
ep_zero=([1]=0 [2]=3 [4]=2)
# Checkpoints: ep 2 (ZeRO-3), and the resumed runs below, each rank writing its share into the one
# file (its experts whole from the first ep group, its ZeRO slices of the rest); ep 4 through rank 0
# (checkpoint.writers: rank0: the experts gathered to it).
for ep in 1 2 4; do
  ac=none writers=auto
  [ $ep = 4 ] && ac=selective writers=rank0  # (and the exchanges run again in backward's second run of each block)
  "$MPIRUN" -np 4 --oversubscribe "$BIN" qwen3_moe.yaml --set parallel.ep=$ep --set train.activation_checkpointing=$ac \
    --set checkpoint.writers=$writers \
    --set optim.zero=${ep_zero[$ep]} --set train.out_dir=run_ep$ep "${ep_balancing[@]}" \
    --set checkpoint.dir=ckpt_ep$ep --set log.every=1 --set eval.every=4 --set train.steps=8 --set checkpoint.every=4 \
    --set checkpoint.keep=2 > ep$ep.out 2>&1
  eprc[$ep]=$?
  [ ${eprc[$ep]} -eq 0 ] || tail -5 ep$ep.out
  to_hf ep$ep 8 ep$ep
done
to_hf ep1 4 ep1_4
"$MPIRUN" -np 4 --oversubscribe "$BIN" qwen3_moe.yaml --set parallel.ep=2 --set optim.zero=1 \
  --set checkpoint.resume=ckpt_ep4/ckpt-00000004.h5 "${ep_balancing[@]}" \
  --set train.out_dir=run_ep_res --set checkpoint.dir=ckpt_ep_res --set log.every=1 --set eval.every=4 --set train.steps=8 \
  > ep_res.out 2>&1
eprc[0]=$?
"$MPIRUN" -np 4 --oversubscribe "$BIN" qwen3_moe.yaml --set parallel.ep=2 --set optim.zero=3 --set train.activation_checkpointing=selective \
  --set checkpoint.resume=ckpt_ep4/ckpt-00000004.h5 "${ep_balancing[@]}" \
  --set train.out_dir=run_ep_res3 --set checkpoint.dir=ckpt_ep_res3 --set log.every=1 --set eval.every=4 --set train.steps=8 \
  > ep_res3.out 2>&1
eprc[3]=$?
to_hf ep_res3 8 ep_res3
for ep in 1 2; do
  "$MPIRUN" -np 4 --oversubscribe "$BIN" qwen3_moe.yaml --set parallel.ep=$ep --set optim.zero=$((ep == 2 ? 3 : 0)) \
    --set model.init_from=hf_ep1_4 --set train.steps=2 --set optim.warmup_steps=1 --set eval.every=2 \
    --set train.out_dir=run_init_ep$ep --set checkpoint.dir=ckpt_init_ep$ep > init_ep$ep.out 2>&1 || tail -5 init_ep$ep.out
  init_val[$ep]=$(grep -o '"step": 0, "val_loss": [0-9.]*' run_init_ep$ep/metrics.jsonl 2>/dev/null | grep -o '[0-9.]*$')
done
to_hf ep_res 8 ep_res
# close A B [BASE LOSS-BOUND]: losses within LOSS-BOUND (default 1e-5; "reorder": 1.5e-3 of the
# loss, test_train.cpp's bound) and final parameters within the reordering bound of run A's, the
# displacement measured from hf_BASE (default ep1_4, run A's step-4 export).
close() {
  "$PY" - "$1" "$2" "$HERE" "${3:-ep1_4}" "${4:-1e-5}" <<'PYEOF'
import json, sys
sys.path.insert(0, sys.argv[3])
from llama_reference import parse_safetensors
def losses(run):
    return [json.loads(l)["loss"] for l in open(f"run_{run}/metrics.jsonl") if '"loss"' in l]
a, b = sys.argv[1], sys.argv[2]
la, lb = losses(a), losses(b)
la = la[len(la) - len(lb):]
wa, wb = parse_safetensors(f"hf_{a}/model.safetensors"), parse_safetensors(f"hf_{b}/model.safetensors")
w0 = parse_safetensors(f"hf_{sys.argv[4]}/model.safetensors")
gap = max((wa[k] - wb[k]).abs().max().item() for k in wa) if wa.keys() == wb.keys() else float("inf")
moved = max((wa[k] - w0[k]).abs().max().item() for k in wa)
rel = sys.argv[5] == "reorder"
dl = max(abs(x - y) / (abs(x) if rel else 1) for x, y in zip(la, lb)) if la and len(lb) in (4, 8) else float("inf")
bound = 1.5e-3 if rel else float(sys.argv[5])
print(f"  {b} against {a}: losses {len(lb)}, max |delta| {dl:.2e}{' of the loss' if rel else ''} (bound {bound:.1e}); "
      f"parameters: max gap {gap:.2e}, {gap / moved:.2e} of steps 5-8's displacement {moved:.2e}")
sys.exit(0 if dl <= bound and gap <= 1.5e-3 * moved else 1)
PYEOF
}
for ep in 2 4; do
  close ep1 ep$ep > close_ep$ep.out 2>&1
  rc=$?
  cat close_ep$ep.out
  check "parallel.ep $ep at np 4 with optim.zero ${ep_zero[$ep]} trains the ep 1 run: losses and final parameters (exit ${eprc[$ep]})" \
    "[ ${eprc[1]} -eq 0 ] && [ ${eprc[$ep]} -eq 0 ] && [ $rc -eq 0 ]"
done
check "the start-up lines name the ep groups and the experts' buckets; the progress line and metrics.jsonl the all-to-alls' share of the step" \
  "grep -q 'mesh: 4 ranks = dp 4 (ep 2: 2 groups of 2 ranks each holding 1/2 of the experts)' ep2.out &&
   grep -q 'and 1 of the experts. over their 2 replicas' ep2.out && grep -q 'experts gathered to it from the 4 ranks' ep4.out &&
   grep -q 'checkpoint: every rank writes its ZeRO-3 share, the 2 ranks of the first ep group each its experts whole (4 writers' ep2.out &&
   grep -q 'ZeRO-3: sharded over 4 data-parallel ranks; the experts. whole on each of their replicas' ep2.out &&
   grep -q ' | a2a [0-9]*% ' ep2.out && grep -q '\"all_to_all_share\": 0\.[0-9]*' run_ep2/metrics.jsonl &&
   ! grep -q 'all_to_all_share' run_ep1/metrics.jsonl"
close ep4 ep_res > close_res.out 2>&1
rc=$?
cat close_res.out
check "an ep 4 ZeRO-2 checkpoint resumed under ep 2 at ZeRO-1 trains the ep 4 run's steps 5-8 (exit ${eprc[0]})" \
  "[ ${eprc[0]} -eq 0 ] && [ $rc -eq 0 ]"
close ep4 ep_res3 > close_res3.out 2>&1
rc=$?
cat close_res3.out
check "the same checkpoint resumed under ep 2 at ZeRO-3 with selective checkpointing: the same steps 5-8 (exit ${eprc[3]})" \
  "[ ${eprc[3]} -eq 0 ] && [ $rc -eq 0 ]"
check "init_from an export of all the experts under ep 2 at ZeRO-3: step-0 val loss ${init_val[2]} = ep 1's ${init_val[1]}" \
  "[ -n '${init_val[1]}' ] && [ '${init_val[1]}' = '${init_val[2]}' ]"
# The layouts below compare with test_train.cpp's SGD-like AdamW (lr / eps = 0.2, no decay, no
# clip), which carries a gradient's error into the parameters linearly: AdamW's own normalisation
# turns the last-bit noise of elements with near-zero gradients into whole steps (at lr 0.01 a gap
# of 1.6e-2 of the displacement for tp 2 with this model and 8e-4 for its dense twin, 8e-4 for the
# islands below with their outer Nesterov step, with every gradient right). 8 steps, checkpoints at
# 4 and 8.
sgd=(--set optim.lr=4e3 --set optim.min_lr=4e2 --set optim.eps=2e4 --set optim.weight_decay=0 --set optim.grad_clip=0
     --set log.every=1 --set eval.every=0 --set train.steps=8 --set checkpoint.every=4 --set checkpoint.keep=2)
# ep_pair NAME ARGS...: the SGD-like run with ARGS at np 4 under parallel.ep 1 and 2 (run_NAME1,
# run_NAME2; exit statuses in pair_rc[1], pair_rc[2]), both exported, and close NAME1 NAME2 against
# NAME1's step 4 within the reordering bound (exit status in pair_close, its line printed).
declare -a pair_rc
ep_pair() {
  local name=$1 ep
  shift
  for ep in 1 2; do
    "$MPIRUN" -np 4 --oversubscribe "$BIN" qwen3_moe.yaml "${sgd[@]}" "$@" --set parallel.ep=$ep \
      --set train.out_dir=run_$name$ep --set checkpoint.dir=ckpt_$name$ep > $name$ep.out 2>&1
    pair_rc[$ep]=$?
    [ ${pair_rc[$ep]} -eq 0 ] || tail -5 $name$ep.out
  done
  to_hf ${name}1 8 ${name}1
  to_hf ${name}1 4 ${name}1_4
  to_hf ${name}2 8 ${name}2
  close ${name}1 ${name}2 ${name}1_4 reorder > close_$name.out 2>&1
  pair_close=$?
  cat close_$name.out
}
# DiLoCo's islands with expert parallelism: 2 islands x dp 2 at np 4, ZeRO-2 in each island over two
# micro-batches per step (each one's shared gradients reduce-scattered, the experts' accumulated
# whole), an outer step every 2 steps; ep 2 (each island's pair holds the experts between them; the outer
# all-reduce pairs the ranks that hold the same experts and the same slices of the shared
# parameters, and each rank keeps its own outer state) trains ep 1's 8 steps;
# its step-4 checkpoint (and each rank's DiLoCo state beside it) resumed trains the same steps 5-8.
dl=(--set parallel.islands=2 --set diloco.inner_steps=2 --set optim.zero=2 --set train.micro_batch=1 --set train.grad_accum=2)
ep_pair dl "${dl[@]}"
check "2 DiLoCo islands x ep 2 at ZeRO-2 over 2 micro-batches train the islands' ep 1 run: losses and final parameters (exit ${pair_rc[2]})" \
  "[ ${pair_rc[1]} -eq 0 ] && [ ${pair_rc[2]} -eq 0 ] && [ $pair_close -eq 0 ] && grep -q 'mesh: 4 ranks = 2 islands x dp 2 (ep 2' dl2.out"
"$MPIRUN" -np 4 --oversubscribe "$BIN" qwen3_moe.yaml "${sgd[@]}" "${dl[@]}" --set parallel.ep=2 --set train.out_dir=run_dlres \
  --set checkpoint.dir=ckpt_dlres --set checkpoint.resume=ckpt_dl2/ckpt-00000004.h5 > dlres.out 2>&1
rc=$?
grep -o '"loss": [0-9.]*' run_dl2/metrics.jsonl | tail -4 > dl2.losses
grep -o '"loss": [0-9.]*' run_dlres/metrics.jsonl > dlres.losses 2>/dev/null
check "islands x ep 2 resumed from step 4 (each rank's DiLoCo state beside the checkpoint): the same steps 5-8 (exit $rc)" \
  "[ $rc -eq 0 ] && [ \$(wc -l < dlres.losses) -eq 4 ] && cmp -s dl2.losses dlres.losses"
# Aux-loss-free balancing with DiLoCo islands: each island moves its own routing bias between
# outer steps, and the outer step averages them (2 islands of one rank, an outer step every 4
# steps and after the last, checkpoints every 3): the state files of step 3 (mid-round) hold the
# islands' own biases, which differ; those of step 8 (after the last outer step) equal ones; the
# step-3 checkpoint resumed (each island its own bias back) trains steps 4-8 bitwise.
bias_dl=(--set parallel.islands=2 --set diloco.inner_steps=4 --set train.moe_bias_update_rate=0.05 --set checkpoint.every=3
         --set checkpoint.keep=3)
"$MPIRUN" -np 2 "$BIN" qwen3_moe.yaml "${sgd[@]}" "${bias_dl[@]}" --set train.out_dir=run_bd --set checkpoint.dir=ckpt_bd > bd.out 2>&1
rc1=$?
"$MPIRUN" -np 2 "$BIN" qwen3_moe.yaml "${sgd[@]}" "${bias_dl[@]}" --set train.out_dir=run_bdr --set checkpoint.dir=ckpt_bdr \
  --set checkpoint.resume=ckpt_bd/ckpt-00000003.h5 > bdr.out 2>&1
rc2=$?
grep -o '"loss": [0-9.]*' run_bd/metrics.jsonl | tail -5 > bd.losses
grep -o '"loss": [0-9.]*' run_bdr/metrics.jsonl > bdr.losses 2>/dev/null
"$PY" - > bd_state.out 2>&1 <<'PYEOF'
import sys
import h5py, numpy as np
def bias(step, rank):
    with h5py.File(f"ckpt_bd/ckpt-{step:08d}.diloco/rank-{rank:05d}.h5", "r") as f:
        return np.array(f["island_state"])
mid = np.abs(bias(3, 0) - bias(3, 1)).max()
after = np.abs(bias(8, 0) - bias(8, 1)).max()
moved = np.abs(bias(8, 0)).max()
print(f"  routing bias: islands apart by {mid:.3g} at step 3 (mid-round), {after:.3g} at step 8 (after the last outer step); largest |bias| {moved:.3g}")
sys.exit(0 if mid > 0 and after == 0 and moved > 0 else 1)
PYEOF
rc3=$?
cat bd_state.out
check "the routing bias with 2 DiLoCo islands: each island's own between outer steps, averaged by them, resumed mid-round bitwise (exit $rc1, $rc2)" \
  "[ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] && [ $rc3 -eq 0 ] && [ \$(wc -l < bdr.losses) -eq 5 ] && cmp -s bd.losses bdr.losses"
# PowerSGD with experts: the shared parameters' gradients compressed (rank 4, from step 3), the
# experts' whole (averaged over their replicas) at any ep, so ep 2 trains ep 1's run.
ep_pair ps --set comm.compress=powersgd --set comm.powersgd_start=2
check "comm.compress powersgd with ep 2 trains ep 1's run, the experts' gradients whole (exit ${pair_rc[2]})" \
  "[ ${pair_rc[1]} -eq 0 ] && [ ${pair_rc[2]} -eq 0 ] && [ $pair_close -eq 0 ] && grep -q 'weight matrices compressed.*the experts. gradients whole' ps2.out"
# Tensor parallelism with experts: np 4 as tp 2 x dp 2 (each expert's units split over the tp pair as
# the dense MLP's are, the router replicated, one all-reduce per sparse layer; with selective
# checkpointing, whose second runs sum the experts' partial outputs again) trains an np 2 run's 8
# steps (dp 2: the same global batch): losses and final parameters within the reordering bound.
"$MPIRUN" -np 2 "$BIN" qwen3_moe.yaml "${sgd[@]}" --set train.out_dir=run_sgd --set checkpoint.dir=ckpt_sgd > sgd.out 2>&1 || tail -5 sgd.out
to_hf sgd 8 sgd
to_hf sgd 4 sgd_4
# tp_run NAME ARGS...: the SGD-like run with ARGS at np 4 (run_NAME; exit status in tprc), exported,
# and close sgd NAME within the reordering bound (exit status in rc, its line printed).
tp_run() {
  local name=$1
  shift
  "$MPIRUN" -np 4 --oversubscribe "$BIN" qwen3_moe.yaml "${sgd[@]}" "$@" --set train.out_dir=run_$name \
    --set checkpoint.dir=ckpt_$name > $name.out 2>&1
  tprc=$?
  [ $tprc -eq 0 ] || tail -5 $name.out
  to_hf $name 8 $name
  close sgd $name sgd_4 reorder > close_$name.out 2>&1
  rc=$?
  cat close_$name.out
}
tp_run tp --set parallel.tp=2 --set train.activation_checkpointing=selective
check "parallel.tp 2 with experts (np 4, selective checkpointing) trains the dp 2 run: losses and final parameters (exit $tprc)" \
  "[ $tprc -eq 0 ] && [ $rc -eq 0 ] && grep -q 'mesh: 4 ranks = dp 2 x tp 2' tp.out"
# Expert parallelism with tensor parallelism: np 4 as tp 2 x dp 2 with ep 2 at ZeRO-1 (each rank
# holds its tp shards of half the experts; the token copies go over the ep group of its tp rank, and
# each expert's partial outputs are summed over the tp pair; the shared tp shards' AdamW state
# sliced over the dp pair) trains the same dp 2 run; its step-4 checkpoint (the experts and the
# shared moments made whole over tp, then the experts gathered over ep) resumed at ZeRO-2 (each
# rank taking its tp shards of its experts, and its slices of its tp shards of the others') trains
# the same steps 5-8. The same layout at ZeRO-3 with selective checkpointing (the units holding the
# shared tp shards, the model made without values and each rank drawing its own shards of its
# experts) trains the dp 2 run too.
tp_run tpep --set parallel.tp=2 --set parallel.ep=2 --set optim.zero=1
check "parallel.tp 2 with parallel.ep 2 at ZeRO-1 (np 4) trains the dp 2 run: losses and final parameters (exit $tprc)" \
  "[ $tprc -eq 0 ] && [ $rc -eq 0 ] && grep -q 'mesh: 4 ranks = dp 2 (ep 2: 1 group of 2 ranks each holding 1/2 of the experts) x tp 2' tpep.out &&
   grep -q 'every rank writes its ZeRO-1 slices of its tensor-parallel shards, the 2 ranks of the first ep group each its experts whole' tpep.out"
tp_run tpep3 --set parallel.tp=2 --set parallel.ep=2 --set optim.zero=3 --set train.activation_checkpointing=selective
check "the same at ZeRO-3 with selective checkpointing trains the dp 2 run (exit $tprc)" \
  "[ $tprc -eq 0 ] && [ $rc -eq 0 ]"
"$MPIRUN" -np 4 --oversubscribe "$BIN" qwen3_moe.yaml "${sgd[@]}" --set parallel.tp=2 --set parallel.ep=2 --set optim.zero=2 \
  --set train.out_dir=run_tpepres --set checkpoint.dir=ckpt_tpepres --set checkpoint.resume=ckpt_tpep/ckpt-00000004.h5 > tpepres.out 2>&1
rc=$?
grep -o '"loss": [0-9.]*' run_tpep/metrics.jsonl | tail -4 > tpep.losses
grep -o '"loss": [0-9.]*' run_tpepres/metrics.jsonl > tpepres.losses 2>/dev/null
check "tp 2 x ep 2 resumed from its step-4 checkpoint at ZeRO-2: the same steps 5-8 (exit $rc)" \
  "[ $rc -eq 0 ] && [ \$(wc -l < tpepres.losses) -eq 4 ] && cmp -s tpep.losses tpepres.losses"
expect_own_usage "parallel.ep not dividing the experts refused by name" "parallel.ep: 3 does not divide model.num_experts (8)" \
  "$BIN" qwen3_moe.yaml --set parallel.ep=3
printf 'model: {preset: custom, family: qwen3, n_layer: 2, n_head: 4, n_embd: 32, intermediate_size: 64, seq_len: 32}\n' > dense.yaml
sed -n '/^data:/,$p' qwen3_moe.yaml >> dense.yaml
expect_own_usage "parallel.ep on a dense model refused by name" "parallel.ep: 2: a model without experts has none to split" \
  "$BIN" dense.yaml --set parallel.ep=2
expect_own_usage "parallel.ep not dividing the data-parallel ranks refused by name" "parallel.ep: 4 does not divide the 2 data-parallel ranks" \
  "$MPIRUN" -np 2 "$BIN" qwen3_moe.yaml --set parallel.ep=4

# Bad configurations: one line naming the key, exit 2.
expect_own_usage "num_experts_per_tok above num_experts refused" "model.num_experts_per_tok: 9 is more than model.num_experts (8)" \
  "$BIN" qwen3_moe.yaml --set model.num_experts_per_tok=9
expect_own_usage "num_experts 0 refused" "model.num_experts must be in \[1, 65536\], got 0" \
  "$BIN" qwen3_moe.yaml --set model.num_experts=0
printf 'model: {preset: custom, family: qwen3_moe, n_layer: 2, n_head: 4, n_embd: 32, intermediate_size: 64, seq_len: 32}\n' > unset.yaml
sed -n '/^data:/,$p' qwen3_moe.yaml >> unset.yaml
expect_own_usage "num_experts unset refused" "model.num_experts must be set (in \[1, 65536\]) with model.family qwen3_moe" \
  "$BIN" unset.yaml
expect_own_usage "experts on a llama refused" "model.num_experts applies to model.family qwen3_moe|mixtral|olmoe only" \
  "$BIN" qwen3_moe.yaml --set model.family=qwen3
expect_own_usage "router_aux_loss_coef < 0 refused" "model.router_aux_loss_coef must be >= 0" \
  "$BIN" qwen3_moe.yaml --set model.router_aux_loss_coef=-1
expect_own_usage "mixtral's renormalisation is fixed" "model.norm_topk_prob must be true with model.family mixtral, got 0" \
  "$BIN" mixtral.yaml --set model.norm_topk_prob=false
expect_own_usage "olmoe's experts are its MLPs: one size" "model.moe_intermediate_size: 8 differs from model.intermediate_size (16)" \
  "$BIN" olqwen3_moe.yaml --set model.moe_intermediate_size=8
expect_own_usage "mixtral's experts are its MLPs: one size" "model.moe_intermediate_size: 16 differs from model.intermediate_size (24)" \
  "$BIN" mixtral.yaml --set model.moe_intermediate_size=16
expect_own_usage "a capacity factor <= 0 refused by name" "train.moe_capacity_factor must be none (dropless) or a number > 0, got '0'" \
  "$BIN" qwen3_moe.yaml --set train.moe_capacity_factor=0
expect_own_usage "a capacity factor on a dense model refused by name" "train.moe_capacity_factor must be none for a model without experts" \
  "$BIN" dense.yaml --set train.moe_capacity_factor=1.5
expect_own_usage "a z-loss on a dense model refused by name" "train.moe_z_loss_coef must be 0 for a model without experts" \
  "$BIN" dense.yaml --set train.moe_z_loss_coef=0.01
expect_own_usage "a negative bias update rate refused" "train.moe_bias_update_rate must be >= 0" \
  "$BIN" qwen3_moe.yaml --set train.moe_bias_update_rate=-1
expect_own_usage "a non-integer num_experts refused" "model.num_experts must be an integer, got 'x'" \
  "$BIN" qwen3_moe.yaml --set model.num_experts=x
expect_own_usage "a tp that does not divide the experts' units refused by name" "parallel.tp: 2 does not divide model.moe_intermediate_size (15)" \
  "$BIN" qwen3_moe.yaml --set parallel.tp=2 --set model.moe_intermediate_size=15
expect_own_usage "olmoe's whole-projection q/k norms refuse tp by name" \
  "parallel.tp: 2: olmoe's q/k norms are over the whole projections (every head at once), which tensor parallelism would split (1)" \
  "$BIN" olqwen3_moe.yaml --set parallel.tp=2
summary
