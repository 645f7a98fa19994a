#!/usr/bin/env bash
# Pipeline parallelism (parallel.pp, include/mpitrain/pipeline.h) by equivalence with real mpirun
# runs: a 4-block GPT-2 and a 4-block Qwen3 (tied and untied) on the e2e corpus, 8 steps of 4
# micro-batches (train.grad_accum) with test_train.cpp's SGD-like AdamW (lr / eps = 0.2, no decay,
# no clip: a gradient's rounding error reaches the parameters linearly, where AdamW's own
# normalisation would turn the last-bit noise of near-zero gradients into whole steps),
# checkpoints at 4 and 8:
#  - pp 2, pp 4 and pp 2 with the step's rows as 8 micro-batches of 1 (parallel.pp_microbatches)
#    (1f1b) train the one-rank run (2 rows x 4 micro-batches): its 8 losses and 3 validation losses within
#    1e-5, its final parameters (the exports) within test_train.cpp's reordering bound (1.5e-3 of
#    the last 4 steps' displacement; the tied embedding's two gradients, the first stage's and the
#    last's, are summed in another order than one rank's backward sums them), bitwise for an
#    untied Llama, whose stages add nothing in another order;
#  - gpipe and interleaved (2 chunks per stage: blocks 0 and 2 on the first, 1 and 3 on the
#    second) train 1f1b's run bitwise (each chunk's backwards in the same micro-batch order);
#  - pp 2 x dp 2 at ZeRO-3 (1f1b, gpipe; interleaved resuming its checkpoint, rank 0 writing) trains
#    the dp 2 run; an untied Qwen3 with bf16 gathers equals dp 2 at ZeRO-3 bitwise; ep 2 x pp 2 at
#    ZeRO-3 trains the dp 2 run, resumes and starts from init_from;
#  - pp 2 x dp 2 at np 4 with ZeRO-1 and full activation checkpointing trains the np 2 (dp 2) run
#    (each stage's state sliced over its dp pair; the tied embedding's averaged gradient gathered
#    whole on each end, exchanged and added into each rank's slices), and its step-4 checkpoint
#    resumed at ZeRO-2 with checkpoint.writers: rank0 (the stages' moments gathered over their dp
#    pairs, then sent to rank 0) trains the same steps 5-8 and final parameters;
#  - tp 2 x pp 2 (np 4) with a tied Qwen3 trains the one-rank run (its checkpoints written by each
#    stage's tp ranks into the one file), the one-rank checkpoint resumes there with rank 0
#    writing (the stages' shards made whole over tp, then sent to rank 0), and pp 2 x dp 2 x tp 2
#    at ZeRO-1 (np 8) trains the dp 2 run;
#  - checkpoints move between pp degrees: pp 2's step-4 checkpoint (each stage's rank writing its
#    own tensors into the one file) resumed at pp 4, and pp 4's (checkpoint.writers: rank0: each
#    stage's tensors sent to rank 0) on one rank and at pp 2 interleaved, train the one-rank run's
#    steps 5-8;
#  - a mixture of experts (Qwen3-MoE, the load-balancing loss over every stage's sparse layers)
#    at pp 4 and pp 2 interleaved trains the one-rank run; with the routing bias (aux-loss-free
#    balancing) pp 4 too, and its checkpoint resumes at pp 2 interleaved;
#  - fp16's loss scaling (its scaler run in fp32 by a test hook) at pp 2 interleaved: one stage's
#    overflow skips the step on both stages, which train the one-rank run with the same skip;
#  - DiLoCo's islands with a pipeline inside each: 2 islands x pp 2 (np 4) trains the 2 islands of
#    one rank (np 2);
#  - plan at pp 2 interleaved prints each stage's table and its predicted idle share (bench/pp.sh
#    compares that prediction with training's measured waiting);
#  - the start-up lines name the stages and the bubble; each stage's measured waiting (the bubble,
#    the transfers) on the progress line, in metrics.jsonl and per stage at the end; bad layouts
#    refused by name, exit 2.
#     bash tests/pp_test.sh BUILD/mpitrain [MPIRUN]
set -uo pipefail
BIN=$(realpath "$1")
MPIRUN=${2:-mpirun}
HERE=$(cd "$(dirname "$0")" && pwd)
E2E_NAME=pp
# shellcheck source=e2e_lib.sh
. "$HERE/e2e_lib.sh"
need_python 'import torch, numpy' 'python3-torch python3-numpy'

common='data: {train: [data/c-train-*.h5], val: [data/c-val-*.h5]}
train: {micro_batch: 2, steps: 8, threads: 1, grad_accum: 4}
optim: {warmup_steps: 2, lr: 0.01}
eval: {every: 4, batches: 2}
log: {every: 1}
checkpoint: {every: 4, keep: 2, resume: none}
sample: {tokens: 0}'
sgd=(--set optim.lr=4e3 --set optim.min_lr=4e2 --set optim.eps=2e4 --set optim.weight_decay=0 --set optim.grad_clip=0)
printf 'model: {preset: custom, n_layer: 4, n_head: 4, n_embd: 32, seq_len: 32}\n%s\n' "$common" > gpt.yaml
for tie in true false; do
  printf 'model: {preset: custom, family: qwen3, n_layer: 4, n_head: 4, n_kv_head: 2, n_embd: 32, intermediate_size: 64, seq_len: 32, tie_embeddings: %s}\n%s\n' \
    "$tie" "$common" > llama_$tie.yaml
done

# run NAME NP YAML ARGS...: trains (run_NAME, ckpt_NAME, NAME.out), exports step 8 to hf_NAME
declare -A rc_of
run() {
  local name=$1 np=$2 yaml=$3
  shift 3
  "$MPIRUN" -np "$np" --oversubscribe "$BIN" "$yaml" "${sgd[@]}" "$@" --set train.out_dir=run_$name --set checkpoint.dir=ckpt_$name \
    > $name.out 2>&1
  rc_of[$name]=$?
  [ "${rc_of[$name]}" -eq 0 ] || tail -5 $name.out
  "$BIN" export ckpt_$name/ckpt-00000008.h5 --format hf hf_$name > export_$name.out 2>&1 || cat export_$name.out
}
losses() { grep -o '"\(val_\)\?loss": [0-9.]*' run_$1/metrics.jsonl | tail -${2:-11} | grep -o '[0-9.]*$'; }
# same A B [N]: B's last N losses (default all 11: 8 train, 3 val) those of A within 1e-5
same() {
  [ "${rc_of[$1]:-1}" -eq 0 ] && [ "${rc_of[$2]:-1}" -eq 0 ] &&
    paste <(losses "$1" "${3:-11}") <(losses "$2" "${3:-11}") |
    awk -v want="${3:-11}" '{ d = $1 - $2; if (d < 0) d = -d; if (d > 1e-5 || $2 == "") bad = 1; n++ } END { exit bad || n != want }'
}
# close A B: B's final parameters within the reordering bound of A's (measured from A's step 4)
close() {
  "$BIN" export ckpt_$1/ckpt-00000004.h5 --format hf hf_$1_4 > /dev/null 2>&1
  "$PY" - "$1" "$2" "$HERE" <<'PYEOF'
import sys
sys.path.insert(0, sys.argv[3])
from llama_reference import parse_safetensors
a, b = sys.argv[1], sys.argv[2]
wa, wb = parse_safetensors(f"hf_{a}/model.safetensors"), parse_safetensors(f"hf_{b}/model.safetensors")
w0 = parse_safetensors(f"hf_{a}_4/model.safetensors")
gap = max((wa[k] - wb[k]).abs().max().item() for k in wa) if wa.keys() == wb.keys() else float("inf")
moved = max((wa[k] - w0[k]).abs().max().item() for k in wa)
print(f"  {b} against {a}: parameters max gap {gap:.2e}, {gap / moved:.2e} of steps 5-8's displacement {moved:.2e}")
sys.exit(0 if gap <= 1.5e-3 * moved else 1)
PYEOF
}

run g1 1 gpt.yaml --set sample.tokens=30
run g2 2 gpt.yaml --set parallel.pp=2
run g2g 2 gpt.yaml --set parallel.pp=2 --set parallel.pp_schedule=gpipe
run g2i 2 gpt.yaml --set parallel.pp=2 --set parallel.pp_schedule=interleaved --set parallel.pp_virtual=2
run g2f 2 gpt.yaml --set parallel.pp=2 --set parallel.pp_first_stage_blocks=1
run g4 4 gpt.yaml --set parallel.pp=4 --set checkpoint.writers=rank0 --set sample.tokens=30
# parallel.pp_microbatches: the step's 8 rows as 8 micro-batches of 1 (the bubble 1/8, not 1/4);
# evaluation reads eval.batches micro-batches, so 4 of 1 row are the one-rank run's 2 of 2
run g2m 2 gpt.yaml --set parallel.pp=2 --set parallel.pp_microbatches=8 --set eval.batches=4
for n in g2 g4 g2m; do
  close g1 $n > close_$n.out 2>&1
  rc=$?
  cat close_$n.out
  check "GPT-2 at parallel.pp ${n#g} (1f1b) trains the one-rank run: 8 losses and 3 val losses, final parameters (exit ${rc_of[$n]})" \
    "same g1 $n && [ $rc -eq 0 ]"
done
check "parallel.pp_microbatches 8 splits the step's 2 x 4 rows into 8 micro-batches of 1" \
  "grep -q 'pipeline: 2 stages .*; 1f1b over 8 micro-batches per step: bubble (pp - 1) / m = 13% of the ideal step' g2m.out"
sample_of() { sed -n '/ sample:$/,$p' $1.out | sed -n 2p; }
check "the final sample generated through pp 4's stages is the one-rank run's" \
  "[ -n \"\$(sample_of g1)\" ] && [ \"\$(sample_of g1)\" = \"\$(sample_of g4)\" ]"
check "gpipe trains 1f1b's run bitwise (pp 2)" "same g2 g2g && cmp -s hf_g2/model.safetensors hf_g2g/model.safetensors"
check "parallel.pp_first_stage_blocks 1 (stages of blocks 0 | 1-3) trains 1f1b's run bitwise (exit ${rc_of[g2f]})" \
  "same g2 g2f && cmp -s hf_g2/model.safetensors hf_g2f/model.safetensors && grep -q 'pipeline: 2 stages of blocks 0-0 | 1-3 ' g2f.out"
check "interleaved with 2 chunks per stage trains 1f1b's run bitwise (pp 2; exit ${rc_of[g2i]})" \
  "same g2 g2i && cmp -s hf_g2/model.safetensors hf_g2i/model.safetensors &&
   grep -q 'pipeline: 2 stages of blocks 0-0 + 2-2 | 1-1 + 3-3 (.*); interleaved (2 chunks per stage) over 4 micro-batches per step: bubble (pp - 1) / (v m) = 13% of the ideal step' g2i.out"
check "the start-up lines name the stages, the schedule and the bubble" \
  "grep -q 'mesh: 4 ranks = pp 4 x dp 1; stages' g4.out &&
   grep -q 'pipeline: 2 stages of blocks 0-1 | 2-3 (the embedding on the first, the head on the last, the tied embedding.s gradient summed between them); 1f1b over 4 micro-batches per step: bubble (pp - 1) / m = 25% of the ideal step' g2.out &&
   grep -q 'checkpoint: rank 0 writes whole checkpoints (the 4 stages. tensors, one at a time, gathered to it): checkpoint.writers: rank0' g4.out &&
   grep -q 'checkpoint: the first pipeline.s ranks write their stages. tensors (2 writers' g2.out"
check "the waiting for the neighbouring stages measured: progress line, metrics.jsonl, each stage's share at the end" \
  "grep -q ' | pp wait [0-9]*% ' g4.out && grep -q '\"pp_wait_share\": 0\.[0-9]*' run_g4/metrics.jsonl &&
   grep -q 'pipeline: waiting for the neighbouring stages: stage 0 [0-9.]*%, stage 1 [0-9.]*%, stage 2 [0-9.]*%, stage 3 [0-9.]*% of the micro-batches. time (the 1f1b bubble alone: (pp - 1) / (m + pp - 1) = 42.9%' g4.out &&
   ! grep -q pp_wait_share run_g1/metrics.jsonl"

run d2 2 gpt.yaml
run g2d2 4 gpt.yaml --set parallel.pp=2 --set optim.zero=1 --set train.activation_checkpointing=full
close d2 g2d2 > close_g2d2.out 2>&1
rc=$?
cat close_g2d2.out
check "pp 2 x dp 2 at ZeRO-1 with full checkpointing (np 4) trains the dp 2 run (exit ${rc_of[g2d2]})" \
  "same d2 g2d2 && [ $rc -eq 0 ] && grep -q 'mesh: 4 ranks = pp 2 x dp 2; stages' g2d2.out"
run z2 4 gpt.yaml --set parallel.pp=2 --set optim.zero=2 --set checkpoint.writers=rank0 --set checkpoint.resume=ckpt_g2d2/ckpt-00000004.h5
close d2 z2 > close_z2.out 2>&1
rc=$?
cat close_z2.out
check "its step-4 checkpoint resumed at ZeRO-2 (rank 0 writing) trains dp 2's steps 5-8 and parameters (exit ${rc_of[z2]})" \
  "same d2 z2 5 && [ $rc -eq 0 ]"

# ZeRO-3 over each stage's dp group: 1f1b (every rank writing its shards of its stage) and gpipe
# (the last stage runs every forward before any backward: each backward gathers the outside unit
# again, which the previous one released; without that the run fails) train the dp 2 run; the
# 1f1b run's step-4 checkpoint resumed at pp 2 interleaved, rank 0 writing (each stage's units whole
# on its dp pair while it sends them), trains dp 2's steps 5-8. The untied Qwen3 with bf16 gathers,
# checkpoint.async and selective checkpointing equals dp 2 at ZeRO-3 bitwise.
run z3 4 gpt.yaml --set parallel.pp=2 --set optim.zero=3
run z3g 4 gpt.yaml --set parallel.pp=2 --set optim.zero=3 --set parallel.pp_schedule=gpipe
run z3r 4 gpt.yaml --set parallel.pp=2 --set optim.zero=3 --set parallel.pp_schedule=interleaved --set parallel.pp_virtual=2 \
  --set checkpoint.writers=rank0 --set checkpoint.resume=ckpt_z3/ckpt-00000004.h5
{ close d2 z3 && close d2 z3g && close d2 z3r; } > close_z3.out 2>&1
rc=$?
cat close_z3.out
check "pp 2 x dp 2 at ZeRO-3 (np 4), 1f1b and gpipe, trains the dp 2 run; its checkpoint resumed at pp 2 interleaved, rank 0 writing, trains steps 5-8 (exit ${rc_of[z3]}, ${rc_of[z3g]}, ${rc_of[z3r]})" \
  "same d2 z3 && same d2 z3g && same d2 z3r 5 && [ $rc -eq 0 ] &&
   grep -q 'ZeRO-3: sharded over 2 data-parallel ranks.*parameters sharded too, gathered per unit around its forward and backward: 3 units' z3.out &&
   grep -q 'checkpoint: every rank writes its ZeRO-3 share (4 writers' z3.out"
zb=(--set optim.zero=3 --set comm.param_dtype=bf16)
run zbd2 2 llama_false.yaml "${zb[@]}"
run zbp2 4 llama_false.yaml "${zb[@]}" --set parallel.pp=2 --set checkpoint.async=true --set train.activation_checkpointing=selective
check "an untied Qwen3 at pp 2 x dp 2, ZeRO-3 with bf16 gathers, async checkpoints and selective checkpointing, equals dp 2 at ZeRO-3 bitwise (exit ${rc_of[zbp2]})" \
  "same zbd2 zbp2 && cmp -s hf_zbd2/model.safetensors hf_zbp2/model.safetensors"

run r24 4 gpt.yaml --set parallel.pp=4 --set checkpoint.resume=ckpt_g2/ckpt-00000004.h5
run r41 1 gpt.yaml --set checkpoint.resume=ckpt_g4/ckpt-00000004.h5
run r2i 2 gpt.yaml --set parallel.pp=2 --set parallel.pp_schedule=interleaved --set parallel.pp_virtual=2 \
  --set checkpoint.resume=ckpt_g4/ckpt-00000004.h5
check "pp 2's step-4 checkpoint resumed at pp 4 trains the one-rank run's steps 5-8" "same g1 r24 5"
check "pp 4's step-4 checkpoint resumed on one rank trains the same steps 5-8" "same g1 r41 5"
check "pp 4's step-4 checkpoint resumed at pp 2 interleaved trains the same steps 5-8" "same g1 r2i 5"

for tie in true false; do
  run l${tie}1 1 llama_$tie.yaml
  run l${tie}4 4 llama_$tie.yaml --set parallel.pp=4
done
close ltrue1 ltrue4 > close_ltrue.out 2>&1
rc=$?
cat close_ltrue.out
check "Qwen3 with tied embeddings at pp 4 trains the one-rank run (exit ${rc_of[ltrue4]})" "same ltrue1 ltrue4 && [ $rc -eq 0 ]"
check "Qwen3 with an output layer of its own at pp 4: the one-rank run bitwise (exit ${rc_of[lfalse4]})" \
  "same lfalse1 lfalse4 && cmp -s hf_lfalse1/model.safetensors hf_lfalse4/model.safetensors"

# The fused block ops (here their ATen reference; on a GPU the CUDA kernels): a chunk's last MLP
# output added to the residual stream before it travels, the next stage's first fused norm adding
# nothing, so the stream is the unpipelined one (and fused is not unfused: the check can fail).
fk=(--set model.fused_kernels=on)
run fk1 1 llama_false.yaml "${fk[@]}"
run fk2i 2 llama_false.yaml "${fk[@]}" --set parallel.pp=2 --set parallel.pp_schedule=interleaved --set parallel.pp_virtual=2
check "model.fused_kernels: on at pp 2 interleaved: the fused one-rank run bitwise, which is not the unfused run's (exit ${rc_of[fk2i]})" \
  "same fk1 fk2i && cmp -s hf_fk1/model.safetensors hf_fk2i/model.safetensors &&
   ! cmp -s hf_fk1/model.safetensors hf_lfalse1/model.safetensors"

# Tensor parallelism inside each stage (the tied Qwen3, its vocabulary padded to 258 rows for tp 2).
v258=(--set model.vocab_size=258)
run t1 1 llama_true.yaml "${v258[@]}"
run t4 4 llama_true.yaml "${v258[@]}" --set parallel.pp=2 --set parallel.tp=2
close t1 t4 > close_t4.out 2>&1
rc=$?
cat close_t4.out
check "tp 2 x pp 2 (np 4; each stage's checkpoint shards written by its tp ranks) trains the one-rank run (exit ${rc_of[t4]})" \
  "same t1 t4 && [ $rc -eq 0 ] && grep -q 'mesh: 4 ranks = pp 2 x dp 1 x tp 2; tp groups [^ ]*\[0-1\] [^ ]*\[2-3\]; stages' t4.out"
run t4r 4 llama_true.yaml "${v258[@]}" --set parallel.pp=2 --set parallel.tp=2 --set checkpoint.writers=rank0 \
  --set checkpoint.resume=ckpt_t1/ckpt-00000004.h5
close t1 t4r > close_t4r.out 2>&1
rc=$?
cat close_t4r.out
check "the one-rank step-4 checkpoint resumed at tp 2 x pp 2 (rank 0 writing, the shards made whole over tp) trains steps 5-8 (exit ${rc_of[t4r]})" \
  "same t1 t4r 5 && [ $rc -eq 0 ]"
run td2 2 llama_true.yaml "${v258[@]}"
run t8 8 llama_true.yaml "${v258[@]}" --set parallel.pp=2 --set parallel.tp=2 --set optim.zero=1
close td2 t8 > close_t8.out 2>&1
rc=$?
cat close_t8.out
check "pp 2 x dp 2 x tp 2 at ZeRO-1 (np 8) trains the dp 2 run (exit ${rc_of[t8]})" "same td2 t8 && [ $rc -eq 0 ]"

# model.init_from: a Hugging Face export read by each stage's ranks (their stage's tensors, under tp
# their shards): the first two steps' losses and the first evaluation of the one-rank run's.
init_run() {
  local name=$1 np=$2 yaml=$3 from=$4
  shift 4
  "$MPIRUN" -np "$np" --oversubscribe "$BIN" "$yaml" "${sgd[@]}" "$@" --set model.init_from=hf:$from --set train.steps=2 \
    --set checkpoint.every=0 --set eval.every=2 --set train.out_dir=run_$name --set checkpoint.dir=ckpt_$name > $name.out 2>&1
  rc_of[$name]=$?
  [ "${rc_of[$name]}" -eq 0 ] || tail -5 $name.out
}
init_run i1 1 llama_true.yaml hf_t1 "${v258[@]}"
init_run i4 4 llama_true.yaml hf_t1 "${v258[@]}" --set parallel.pp=2 --set parallel.tp=2
init_run u1 1 llama_false.yaml hf_lfalse1
init_run u4 4 llama_false.yaml hf_lfalse1 --set parallel.pp=4
check "model.init_from at tp 2 x pp 2 (tied) and at pp 4 (untied: the output layer the last stage's) starts the one-rank run: its losses (exit ${rc_of[i4]}, ${rc_of[u4]})" \
  "same i1 i4 4 && same u1 u4 4 && grep -q 'each of the 2 stages. first replica read its stage.s tensors' i4.out"

# A mixture of experts (Qwen3-MoE, moe_test.sh's: sparse layers 1 and 3, 8 experts, top 2, the aux
# loss x 0.5 and a z-loss): pp 4 (stage 0 holds no sparse layer) and pp 2 interleaved (each stage
# a dense and a sparse chunk) train the one-rank run: losses, final parameters, and the aux loss,
# z-loss and each sparse layer's expert load in metrics.jsonl.
printf 'model: {preset: custom, family: qwen3_moe, n_layer: 4, n_head: 4, n_kv_head: 2, n_embd: 32, head_dim: 16, intermediate_size: 64, seq_len: 32, vocab_size: 258, tie_embeddings: false, num_experts: 8, num_experts_per_tok: 2, moe_intermediate_size: 16, norm_topk_prob: true, decoder_sparse_step: 2, router_aux_loss_coef: 0.5}\n%s\n' \
  "$common" > moe.yaml
run m1 1 moe.yaml --set train.moe_z_loss_coef=0.01
run m4 4 moe.yaml --set train.moe_z_loss_coef=0.01 --set parallel.pp=4
run m2i 2 moe.yaml --set train.moe_z_loss_coef=0.01 --set parallel.pp=2 --set parallel.pp_schedule=interleaved --set parallel.pp_virtual=2
moe_metrics() {  # A B: every logged step's aux loss and z-loss within 1e-5, expert loads within 1e-3
  "$PY" - "run_$1/metrics.jsonl" "run_$2/metrics.jsonl" <<'PYEOF'
import json, sys
def rows(p):
    return [r for r in map(json.loads, open(p)) if "aux_loss" in r]
a, b = rows(sys.argv[1]), rows(sys.argv[2])
ok = len(a) == len(b) == 8 and all(
    abs(x["aux_loss"] - y["aux_loss"]) <= 1e-5 and abs(x["z_loss"] - y["z_loss"]) <= 1e-5 and
    len(x["expert_load"]) == len(y["expert_load"]) == 2 and
    all(abs(p - q) <= 1e-3 for p, q in zip(x["expert_load"], y["expert_load"]))
    for x, y in zip(a, b))
last = (b[-1]["aux_loss"], b[-1]["expert_load"]) if b else None
print(f"  {sys.argv[2]}: {len(b)} steps with an aux loss; the last {last} against {(a[-1]['aux_loss'], a[-1]['expert_load']) if a else None}")
sys.exit(0 if ok else 1)
PYEOF
}
for n in m4 m2i; do
  { close m1 $n && moe_metrics m1 $n; } > close_$n.out 2>&1
  rc=$?
  cat close_$n.out
  what="pp 4 (stage 0 without a sparse layer)"
  [ $n = m2i ] && what="pp 2 interleaved"
  check "a mixture of experts (aux loss and z-loss over every stage's sparse layers) at $what trains the one-rank run: losses, final parameters, aux loss, z-loss and expert loads (exit ${rc_of[$n]})" \
    "same m1 $n && [ $rc -eq 0 ]"
done

# Aux-loss-free balancing (train.moe_bias_update_rate: each sparse layer's routing bias moved by
# the step's load, kept by the stage holding the layer): pp 4 trains the one-rank run, and its
# step-4 checkpoint (the stages' rows gathered into the whole model's bias) resumed at pp 2
# interleaved trains the one-rank run's steps 5-8.
run m1b 1 moe.yaml --set train.moe_bias_update_rate=0.05
run m4b 4 moe.yaml --set train.moe_bias_update_rate=0.05 --set parallel.pp=4
run m2b 2 moe.yaml --set train.moe_bias_update_rate=0.05 --set parallel.pp=2 --set parallel.pp_schedule=interleaved \
  --set parallel.pp_virtual=2 --set checkpoint.resume=ckpt_m4b/ckpt-00000004.h5
close m1b m4b > close_m4b.out 2>&1
rc=$?
cat close_m4b.out
check "the routing bias (aux-loss-free balancing) at pp 4 trains the one-rank run, and its checkpoint resumed at pp 2 interleaved trains steps 5-8 (exit ${rc_of[m4b]}, ${rc_of[m2b]})" \
  "same m1b m4b && [ $rc -eq 0 ] && same m1b m2b 5"

# Expert parallelism inside each stage (each stage's experts split over its ep ranks, the
# all-to-alls inside the stage's dp group): ep 2 x pp 2 at ZeRO-1 (np 4) trains the dp 2 run (np 2,
# the same global batch of 8): losses, final parameters, aux loss, z-loss and expert loads; its
# step-4 checkpoint (rank 0 writing: each stage's experts gathered, then the stages' tensors sent
# to it) resumed at dp 2, and the dp 2 run's resumed at tp 2 x ep 2 x pp 2 (np 8, whose step-8
# checkpoint its ranks write as shares: each stage's first ep group its experts), train dp 2's steps 5-8;
# model.init_from at ep 2 x pp 2 and at pp 4 (stage 0 without a sparse layer: the experts of
# every other stage are theirs, not unknown) starts the runs it should.
ez=(--set train.moe_z_loss_coef=0.01 --set train.grad_accum=2)
run ed2 2 moe.yaml "${ez[@]}"
run e2p2 4 moe.yaml "${ez[@]}" --set parallel.ep=2 --set parallel.pp=2 --set optim.zero=1 --set checkpoint.writers=rank0
run e2p2r 2 moe.yaml "${ez[@]}" --set checkpoint.resume=ckpt_e2p2/ckpt-00000004.h5
run te2p2r 8 moe.yaml "${ez[@]}" --set parallel.tp=2 --set parallel.ep=2 --set parallel.pp=2 --set checkpoint.resume=ckpt_ed2/ckpt-00000004.h5
norms() { grep -o '"grad_norm": [0-9.e+-]*' run_$1/metrics.jsonl | grep -o '[0-9.e+-]*$'; }
same_norms() {  # A B: every step's gradient norm (the experts' summed over ep, the stages' over pp) within 1e-5 relative
  paste <(norms "$1") <(norms "$2") | awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 1e-5 * $1 || $2 == "") bad = 1; n++ } END { exit bad || n != 8 }'
}
{ close ed2 e2p2 && moe_metrics ed2 e2p2 && same_norms ed2 e2p2 && close ed2 e2p2r && close ed2 te2p2r; } > close_e2p2.out 2>&1
rc=$?
cat close_e2p2.out
check "ep 2 x pp 2 at ZeRO-1 (np 4) trains the dp 2 run: losses, parameters, gradient norms, aux loss, z-loss, expert loads; its checkpoint resumed at dp 2 and dp 2's at tp 2 x ep 2 x pp 2 (np 8) train steps 5-8 (exit ${rc_of[e2p2]}, ${rc_of[e2p2r]}, ${rc_of[te2p2r]})" \
  "same ed2 e2p2 && [ $rc -eq 0 ] && same ed2 e2p2r 5 && same ed2 te2p2r 5 &&
   grep -q 'each of the 2 stages. experts gathered from the 2 ranks of its first ep group' e2p2.out &&
   grep -q 'the first pipeline.s ranks write their stages. tensors, the 2 ranks of the first ep group of each stage each its experts whole (8 writers' te2p2r.out"
init_run ei2 2 moe.yaml hf_ed2 "${ez[@]}"
init_run ei4 4 moe.yaml hf_ed2 "${ez[@]}" --set parallel.ep=2 --set parallel.pp=2
init_run ej1 1 moe.yaml hf_ed2
init_run ej4 4 moe.yaml hf_ed2 --set parallel.pp=4
check "model.init_from of a mixture of experts at ep 2 x pp 2 and at pp 4 (a stage without a sparse layer) starts the dp 2 and one-rank runs: their losses (exit ${rc_of[ei4]}, ${rc_of[ej4]})" \
  "same ei2 ei4 4 && same ej1 ej4 4"
# ep 2 x pp 2 at ZeRO-3: the shared parameters in units over each stage's dp pair, the experts
# whole; its checkpoint resumed with rank 0 writing (the experts' moments in the slots after the
# slices: until 2026-12-01 any resume at ep x pp with ZeRO >= 1 failed there), and init_from (the
# stages hold different numbers of tensors, whose reads are agreed over every rank).
run ez3 4 moe.yaml "${ez[@]}" --set parallel.ep=2 --set parallel.pp=2 --set optim.zero=3
run ez3r 4 moe.yaml "${ez[@]}" --set parallel.ep=2 --set parallel.pp=2 --set optim.zero=3 --set checkpoint.writers=rank0 \
  --set checkpoint.resume=ckpt_ez3/ckpt-00000004.h5
init_run ezi 4 moe.yaml hf_ed2 "${ez[@]}" --set parallel.ep=2 --set parallel.pp=2 --set optim.zero=3
{ close ed2 ez3 && close ed2 ez3r; } > close_ez3.out 2>&1
rc=$?
cat close_ez3.out
check "ep 2 x pp 2 at ZeRO-3 (np 4) trains the dp 2 run, its checkpoint resumes (rank 0 writing) and init_from starts it (exit ${rc_of[ez3]}, ${rc_of[ez3r]}, ${rc_of[ezi]})" \
  "same ed2 ez3 && same ed2 ez3r 5 && same ei2 ezi 4 && [ $rc -eq 0 ]"

# PowerSGD (comm.compress) over each stage's dp group: each matrix's first Q drawn from its name, so
# a stage draws what the whole model does; a tied embedding's two halves summed between the ends
# before it is compressed (the compression is not linear). pp 2 x dp 2 (np 4) trains the dp 2 run:
# the untied Qwen3 bitwise, GPT-2 within the reordering bound, which the uncompressed dp 2 run is not.
ps=(--set comm.compress=powersgd --set comm.powersgd_rank=2 --set comm.powersgd_start=2)
run psq2 2 llama_false.yaml "${ps[@]}"
run psqp2 4 llama_false.yaml "${ps[@]}" --set parallel.pp=2
run psd2 2 gpt.yaml "${ps[@]}"
run psp2 4 gpt.yaml "${ps[@]}" --set parallel.pp=2
{ close psd2 psp2 && ! close psd2 d2; } > close_ps.out 2>&1
rc=$?
cat close_ps.out
check "PowerSGD at pp 2 x dp 2 (np 4) trains the dp 2 run: the untied Qwen3 bitwise, GPT-2 (tied) within the reordering bound, unlike dp 2 uncompressed (exit ${rc_of[psqp2]}, ${rc_of[psp2]})" \
  "same psq2 psqp2 && cmp -s hf_psq2/model.safetensors hf_psqp2/model.safetensors && same psd2 psp2 && [ $rc -eq 0 ] &&
   grep -q 'PowerSGD rank 2 from step 3' psp2.out"

run dl2 2 gpt.yaml --set parallel.islands=2 --set diloco.inner_steps=3
run dlpp 4 gpt.yaml --set parallel.islands=2 --set diloco.inner_steps=3 --set parallel.pp=2
check "DiLoCo with a pipeline inside each island: 2 islands x pp 2 (np 4) trains 2 islands of one rank (np 2): its losses, validation losses and final parameters, island 0's first pipeline writing the checkpoints (exit ${rc_of[dlpp]})" \
  "same dl2 dlpp && close dl2 dlpp && grep -q 'mesh: 4 ranks = 2 islands x pp 2 x dp 1; stages [^ ]*\[0\] [^ ]*\[1\] [^ ]*\[2\] [^ ]*\[3\]; islands [^ ]*\[0-1\] [^ ]*\[2-3\]' dlpp.out &&
   [ -f ckpt_dlpp/ckpt-00000008.diloco/rank-00003.h5 ]"

# fp16's loss scaling through the stages: the last stage scales its loss, the scaled gradients
# travel back, every stage unscales its own, and one stage's overflow skips the step on all of
# them. fp16 trains only on a GPU (bench/gpu_check.sh runs pp 2 in fp16 there); here the test hook
# MPITRAIN_TEST_LOSS_SCALE runs the scaler in fp32 (a power of two: the gradients bitwise) and
# MPITRAIN_TEST_NONFINITE=3:0:grad makes one of rank 0's gradients (stage 0: no loss there)
# infinite at step 3. A stage that skipped alone would leave the two stages' parameters a step apart.
export MPITRAIN_TEST_LOSS_SCALE=1024 MPITRAIN_TEST_NONFINITE=3:0:grad
run ls1 1 gpt.yaml
run ls2 2 gpt.yaml --set parallel.pp=2 --set parallel.pp_schedule=interleaved --set parallel.pp_virtual=2
unset MPITRAIN_TEST_LOSS_SCALE MPITRAIN_TEST_NONFINITE
close ls1 ls2 > close_ls.out 2>&1
rc=$?
cat close_ls.out
check "loss scaling at pp 2 interleaved: stage 0's overflow at step 3 skips it on both stages, the scale halved, and the run trains the one-rank run with the same skip (exit ${rc_of[ls2]})" \
  "same ls1 ls2 && [ $rc -eq 0 ] && grep -q 'step 3: fp16 gradients overflowed at loss scale 1024; step skipped' ls1.out &&
   grep -q 'step 3: fp16 gradients overflowed at loss scale 1024; step skipped' ls2.out &&
   ! cmp -s hf_g1/model.safetensors hf_ls1/model.safetensors"

expect_own_usage "more stages than blocks refused by name" "parallel.pp must be at most model.n_layer = 4 (each stage holds at least one block), got 5" \
  "$BIN" gpt.yaml --set parallel.pp=5
expect_own_usage "a pp that does not divide the world refused by name" "parallel.pp: 3 does not divide the world size 2" \
  "$MPIRUN" -np 2 "$BIN" gpt.yaml --set parallel.pp=3
expect_own_usage "an unknown schedule refused by name" "parallel.pp_schedule must be one of 1f1b|gpipe|interleaved, got 'zb'" \
  "$BIN" gpt.yaml --set parallel.pp=2 --set parallel.pp_schedule=zb
expect_own_usage "interleaved chunks that do not divide the blocks refused by name" \
  "parallel.pp_virtual must be a number whose product with parallel.pp (2) divides model.n_layer = 4" \
  "$BIN" gpt.yaml --set parallel.pp=2 --set parallel.pp_schedule=interleaved --set parallel.pp_virtual=3
expect_own_usage "interleaved with micro-batches not in groups of pp refused by name" \
  "parallel.pp_schedule: interleaved needs a multiple of parallel.pp = 2 micro-batches per step (train.grad_accum), got 3" \
  "$MPIRUN" -np 2 "$BIN" gpt.yaml --set parallel.pp=2 --set parallel.pp_schedule=interleaved --set parallel.pp_virtual=2 --set train.grad_accum=3
expect_own_usage "pipeline micro-batches that do not divide the step's rows refused by name" \
  "gpt.yaml: parallel.pp_microbatches must divide the rows each replica trains per step, train.micro_batch x train.grad_accum = 2 x 4 = 8, got 3" \
  "$MPIRUN" -np 2 "$BIN" gpt.yaml --set parallel.pp=2 --set parallel.pp_microbatches=3
expect_own_usage "a first stage that leaves the others no block refused by name" \
  "parallel.pp_first_stage_blocks must be small enough to leave at least a block to each of the other 3 stages (model.n_layer 4)" \
  "$BIN" gpt.yaml --set parallel.pp=4 --set parallel.pp_first_stage_blocks=2
"$MPIRUN" -np 2 "$BIN" plan gpt.yaml --set parallel.pp=2 --set parallel.pp_schedule=interleaved --set parallel.pp_virtual=2 \
  > plan.out 2>&1
rc=$?
check "plan at pp 2 interleaved: each stage's chunks, state, activations, times and predicted idle beside the schedule's bubble (exit $rc)" \
  "[ $rc -eq 0 ] && grep -q '^plan: pipeline parallel: 2 stages x dp 1; interleaved (2 chunks per stage) over 4 micro-batches' plan.out &&
   grep -Eq '^\| 0 \| 0-0 \+ 2-2 \| [0-9]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+% \|$' plan.out &&
   grep -Eq '^\| 1 \| 1-1 \+ 3-3 \| ' plan.out &&
   grep -q '^bubble: the schedule.s (pp - 1) / (v m) = 12.5% of the ideal step, 11.1% of the micro-batches. time' plan.out &&
   grep -q '^point-to-point: 8 KiB per activation (fp32 \[2, 32, 32\]) each way per stage boundary and micro-batch x 2 chunks: 0.13 MiB per boundary per step' plan.out"
summary
