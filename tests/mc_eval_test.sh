#!/usr/bin/env bash
# Multiple-choice evaluation (eval.tasks, `mpitrain eval`; include/mpitrain/mc_eval.h) on a tiny
# byte-level Qwen3 trained on the e2e corpus (40 steps), with two tasks made from the corpus's
# sentences, choosing among its numbers: a HellaSwag-format one (activity_label, ctx_a, ctx_b,
# endings with a [title] tag and a double space, string labels: the harness's preprocessing) and a
# generic one (context, choices, answer), each of which the trained model gets partly right:
#  - `mpitrain eval` on its Hugging Face export gives every example's choices' scores within 1e-4
#    of an independent PyTorch scorer written from lm-evaluation-harness's formulas
#    (tests/mc_reference.py, on tests/llama_reference.py's model), and the same acc and acc_norm;
#  - `mpitrain eval` on the checkpoint under mpirun -np 1, 2 and 4 (the examples split over the
#    ranks): the same acc, acc_norm and scores;
#  - in training (model.init_from the export, eval.tasks scored at step 0) at np 1, dp 2, tp 2,
#    dp 2 at ZeRO-3, dp 4, pp 2 x dp 2 (the batches through the stages) and 2 DiLoCo islands x pp 2:
#    the same acc and acc_norm as `mpitrain eval`, in metrics.jsonl and on the log line with
#    examples/s;
#  - on GPT-2 BPE shards (pack --tokenizer gpt2), eval.tokenizer naming the BPE directory: the
#    tasks scored in training as `mpitrain eval --tokenizer-file DIR` scores the checkpoint; without
#    it, or with a tokenizer larger than the shards' vocabulary, refused naming eval.tokenizer;
#  - bad task lines and specs refused by name (file and line), exit 2.
#     bash tests/mc_eval_test.sh BUILD/mpitrain [MPIRUN]
set -uo pipefail
BIN=$(realpath "$1")
MPIRUN=${2:-mpirun}
HERE=$(cd "$(dirname "$0")" && pwd)
E2E_NAME=mc_eval
# shellcheck source=e2e_lib.sh
. "$HERE/e2e_lib.sh"
need_python 'import torch, numpy' 'python3-torch python3-numpy'

cat > m.yaml <<'EOF'
model: {preset: custom, family: qwen3, n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 48, intermediate_size: 96, seq_len: 48,
        vocab_size: 258}
data: {train: [data/c-train-*.h5], val: [data/c-val-*.h5]}
train: {micro_batch: 8, steps: 40, threads: 1}
optim: {warmup_steps: 4, lr: 0.02, min_lr: 0.002}
eval: {every: 0}
log: {every: 10}
checkpoint: {every: 40, keep: 1, resume: none}
sample: {tokens: 0}
EOF
"$BIN" m.yaml --set train.out_dir=run_t --set checkpoint.dir=ckpt_t > train.out 2>&1 || { tail -5 train.out; exit 1; }
"$BIN" export ckpt_t/ckpt-00000040.h5 --format hf hf_t > export.out 2>&1 || { cat export.out; exit 1; }

"$PY" - <<'PYEOF'
import json, random
random.seed(3)
# The corpus's numbers make the choices: the model prefers some numbers to others, so it gets a
# part of each task right, and choices of one and two digits make acc and acc_norm differ.
with open("hs.jsonl", "w") as f:
    for i in range(36):
        numbers = random.sample(range(1, 81), 4)
        endings = [f"{n} jumps over the [title] lazy  dog." for n in numbers]
        f.write(json.dumps({"activity_label": "Foxes", "ctx_a": "The quick brown", "ctx_b": "FOX",
                            "endings": endings, "label": str(random.randrange(4))}) + "\n")
with open("gen.jsonl", "w") as f:
    for i in range(30):
        numbers = random.sample(range(1, 81), 4)
        f.write(json.dumps({"context": "A stitch in time saves", "choices": [f"{n}." for n in numbers],
                            "answer": random.randrange(4)}) + "\n")
        f.write("\n")  # blank lines are skipped
PYEOF

tasks=(--task hs=hs.jsonl --task gen.jsonl)
"$BIN" eval hf:hf_t --tokenizer-file byte "${tasks[@]}" --scores s_hf.json > e_hf.out 2>&1
rc_hf=$?
"$PY" "$HERE/mc_reference.py" hf_t hs.jsonl gen.jsonl --seq-len 48 --out s_ref.json > ref.out 2> ref.err || cat ref.err
cat e_hf.out ref.out
# compare A.json B.json TOL: the same acc and acc_norm per task, every score within TOL (relative + absolute)
compare() {
  "$PY" - "$@" <<'PYEOF'
import json, sys
a, b, tol = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), float(sys.argv[3])
ok = a.keys() == b.keys()
for t in a:
    gap = max(abs(x - y) / (1 + abs(y)) for ra, rb in zip(a[t]["scores"], b[t]["scores"]) for x, y in zip(ra, rb))
    same = a[t]["acc"] == b[t]["acc"] and a[t]["acc_norm"] == b[t]["acc_norm"] and len(a[t]["scores"]) == len(b[t]["scores"])
    print(f"  {t}: acc {a[t]['acc']:.4f} / {b[t]['acc']:.4f}, acc_norm {a[t]['acc_norm']:.4f} / {b[t]['acc_norm']:.4f}, scores' largest gap {gap:.1e}")
    ok = ok and same and gap <= tol
sys.exit(0 if ok else 1)
PYEOF
}
compare s_hf.json s_ref.json 1e-4 > cmp_ref.out 2>&1
rc=$?
cat cmp_ref.out
check "mpitrain eval on the export: every choice's score within 1e-4 of the independent scorer, the same acc and acc_norm (exit $rc_hf)" \
  "[ $rc_hf -eq 0 ] && [ $rc -eq 0 ]"
check "the trained model gets each task partly right (neither 0 nor 1: the check can tell)" \
  "$PY -c \"import json,sys; a=json.load(open('s_hf.json')); sys.exit(0 if all(0 < a[t]['acc'] < 1 for t in a) else 1)\""

for np in 1 2 4; do
  "$MPIRUN" -np $np --oversubscribe "$BIN" eval ckpt_t/ckpt-00000040.h5 "${tasks[@]}" --rows 3 --scores s_$np.json > e_$np.out 2>&1
  echo "  np $np: exit $?; $(head -1 e_$np.out)"
done
check "mpitrain eval on the checkpoint at np 1, 2 and 4: the export's acc and acc_norm, every score within 1e-5" \
  "compare s_hf.json s_1.json 1e-5 > /dev/null && compare s_1.json s_2.json 1e-5 > /dev/null && compare s_1.json s_4.json 1e-5 > /dev/null &&
   grep -q '^hs acc [0-9.]* acc_norm [0-9.]* examples 36 ([0-9.]* examples/s on 4 ranks)' e_4.out"

# In training: the export as model.init_from, scored at step 0 in each layout.
acc_of() { grep '"task"' run_$1/metrics.jsonl | head -2 | grep -o '"\(task\|acc\|acc_norm\|examples\)": [^,]*' | tr '\n' ' '; }
want=$("$PY" -c "
import json; a = json.load(open('s_hf.json'))
print(' '.join(f'\"task\": \"{t}\" \"acc\": {a[t][\"acc\"]:.6f} \"acc_norm\": {a[t][\"acc_norm\"]:.6f} \"examples\": {a[t][\"examples\"]}' for t in ['hs', 'gen']))")
layouts=("1:" "2:" "2:--set parallel.tp=2" "2:--set optim.zero=3" "4:" "4:--set parallel.pp=2" "4:--set parallel.islands=2 --set parallel.pp=2")
for i in "${!layouts[@]}"; do
  np=${layouts[$i]%%:*} extra=${layouts[$i]#*:}
  # shellcheck disable=SC2086
  "$MPIRUN" -np "$np" --oversubscribe "$BIN" m.yaml --set model.init_from=hf:hf_t --set train.steps=1 --set optim.warmup_steps=0 --set eval.tasks_every=1 \
    --set 'eval.tasks=[hs=hs.jsonl,gen.jsonl]' --set checkpoint.every=0 --set checkpoint.at_end=false \
    --set train.out_dir=run_l$i --set checkpoint.dir=ckpt_l$i $extra > l$i.out 2>&1
  rc=$?
  got=$(acc_of l$i)
  [ $rc -eq 0 ] && [ "$(echo $got)" = "$(echo $want)" ] || { echo "  layout np $np $extra (exit $rc): $got"; echo "  want: $want"; tail -3 l$i.out; }
  check "in training at np $np ${extra:-(data parallel)}: step 0's acc and acc_norm those of mpitrain eval (exit $rc)" \
    "[ $rc -eq 0 ] && [ \"$(echo $got)\" = \"$(echo $want)\" ]"
done
check "the log line has the task's accuracy and its examples/s" \
  "grep -q 'step 0 | task hs acc [0-9.]* acc_norm [0-9.]* | 36 examples, [0-9.]* examples/s' l4.out &&
   grep -q 'eval.tasks: hs (36 examples), gen (30 examples), scored every 1 steps and at the end, split over 4 replicas' l4.out"

# GPT-2 BPE shards (pack --tokenizer gpt2, whose files the shards do not record): eval.tokenizer
# names the BPE directory; a tiny GPT-2 trained 6 steps on them scores the tasks at the end as
# `mpitrain eval --tokenizer-file DIR` scores its checkpoint (choices of GPT-2 tokens, not bytes).
"$BIN" pack corpus -o data/g --doc-separator % --val-fraction 0.2 --tokenizer gpt2 --bpe-dir "$HERE/data/gpt2" > pack_g.out 2>&1 ||
  cat pack_g.out
gpt2_run=(g.yaml --set 'eval.tasks=[hs=hs.jsonl,gen.jsonl]' --set eval.tasks_every=6)
cat > g.yaml <<'EOF'
model: {preset: custom, n_layer: 1, n_head: 2, n_embd: 32, seq_len: 32}
data: {train: [data/g-train-*.h5], val: [data/g-val-*.h5]}
train: {micro_batch: 4, steps: 6, threads: 1}
optim: {warmup_steps: 1, lr: 0.01}
eval: {every: 0}
log: {every: 3}
checkpoint: {every: 6, keep: 1, resume: none}
sample: {tokens: 0}
EOF
"$BIN" "${gpt2_run[@]}" --set "eval.tokenizer=$HERE/data/gpt2" --set train.out_dir=run_g --set checkpoint.dir=ckpt_g > g.out 2>&1
rc_g=$?
"$MPIRUN" -np 2 "$BIN" eval ckpt_g/ckpt-00000006.h5 --task hs=hs.jsonl --task gen.jsonl --tokenizer-file "$HERE/data/gpt2" \
  --scores s_g.json > e_g.out 2>&1
rc_ge=$?
got_g=$(grep '"task"' run_g/metrics.jsonl | tail -2 | grep -o '"\(task\|acc\|acc_norm\|examples\)": [^,]*' | tr '\n' ' ')
want_g=$("$PY" -c "
import json; a = json.load(open('s_g.json'))
print(' '.join(f'\"task\": \"{t}\" \"acc\": {a[t][\"acc\"]:.6f} \"acc_norm\": {a[t][\"acc_norm\"]:.6f} \"examples\": {a[t][\"examples\"]}' for t in ['hs', 'gen']))" 2>&1)
echo "  gpt2 shards, training: $got_g"
echo "  mpitrain eval:         $want_g"
check "GPT-2 BPE shards: eval.tokenizer (the BPE directory) scores the tasks in training as mpitrain eval --tokenizer-file DIR does at np 2 (exit $rc_g, $rc_ge)" \
  "[ $rc_g -eq 0 ] && [ $rc_ge -eq 0 ] && [ -n \"$got_g\" ] && [ \"$(echo $got_g)\" = \"$(echo $want_g)\" ] &&
   grep -q 'model: gpt2, .*vocab 50257' g.out"
expect_own_usage "GPT-2 BPE shards without eval.tokenizer: tasks refused naming the key" \
  "eval.tokenizer: the shards were packed with the 'gpt2' tokenizer, whose files they do not record" "$BIN" "${gpt2_run[@]}"
expect_own_usage "an eval.tokenizer with more tokens than the shards refused naming the key" \
  "eval.tokenizer: $HERE/data/gpt2 has 50257 tokens, the shards' vocabulary 257: not the tokenizer they were packed with" \
  "$BIN" m.yaml --set 'eval.tasks=[gen.jsonl]' --set "eval.tokenizer=$HERE/data/gpt2"

printf '{"context": "x", "choices": ["a"], "answer": 0}\n' > one.jsonl
printf '{"ctx": "x", "endings": ["a", "b"], "label": "2"}\n' > label.jsonl
printf '{"context": "x", "choices": ["a", "b"], "answer": 0}\nnot json\n' > json.jsonl
expect_own_usage "a task line with one choice refused, naming the file and line" "one.jsonl: line 1: 'choices' must be a list of at least 2 strings" \
  "$BIN" eval ckpt_t/ckpt-00000040.h5 --task one.jsonl
expect_own_usage "a label out of range refused by name" "label.jsonl: line 1: 'label' = 2 is not one of the 2 choices' indices" \
  "$BIN" eval ckpt_t/ckpt-00000040.h5 --task label.jsonl
expect_own_usage "a line that is not JSON refused by name" "json.jsonl: line 2: not JSON" \
  "$BIN" eval ckpt_t/ckpt-00000040.h5 --task json.jsonl
expect_own_usage "a bad limit in eval.tasks refused by name" "eval.tasks: 'hs.jsonl@ten': the limit after @ must be a number of examples" \
  "$BIN" m.yaml --set 'eval.tasks=[hs.jsonl@ten]'
expect_own_usage "two tasks of one name refused" "eval.tasks must be a list of tasks with different names" \
  "$BIN" m.yaml --set 'eval.tasks=[hs.jsonl,hs=gen.jsonl]'
summary
