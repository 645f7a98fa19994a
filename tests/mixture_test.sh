#!/usr/bin/env bash
# Weighted data mixtures (data.train entries {path, weight}; include/mpitrain/shards.h): the e2e
# corpus and a second corpus at 0.7 / 0.3, 10 steps of 4 windows:
#  - every step's tokens per source in metrics.jsonl are the schedule's (the period's 700 / 300
#    slots laid out so that every prefix holds each share within one window: test_shards checks
#    the bound at every prefix; here the counts a run reports);
#  - np 2 trains np 1's run (the same windows in the same order: losses within 1e-5) and reports
#    the same tokens per source;
#  - np 1's step-5 checkpoint resumed at np 2 continues the same sequence: steps 6-10's losses and
#    tokens per source those of the run that never stopped;
#  - data.stages: from step 5 other shares, each source going on from its own windows; a resume at
#    np 2 of the step-5 checkpoint continues across the switch;
#  - bad mixtures refused by name: a weight count that differs from the entries, a weight <= 0, a
#    source of another vocabulary.
#     bash tests/mixture_test.sh BUILD/mpitrain [MPIRUN]
set -uo pipefail
BIN=$(realpath "$1")
MPIRUN=${2:-mpirun}
HERE=$(cd "$(dirname "$0")" && pwd)
E2E_NAME=mixture
# shellcheck source=e2e_lib.sh
. "$HERE/e2e_lib.sh"

mkdir corpus2
for i in $(seq 1 300); do printf 'Zebras %d graze on the open plain at dawn.\n%%\n' "$i" >> corpus2/z.txt; done
"$BIN" pack corpus2 -o data/z --doc-separator % --val-fraction 0 > pack2.out 2>&1 || { cat pack2.out; exit 1; }
cat > mix.yaml <<'EOF'
model: {preset: custom, n_layer: 2, n_head: 2, n_embd: 32, seq_len: 32}
data:
  train:
    - {path: "data/c-train-*.h5", weight: 0.7}
    - {path: "data/z-train-*.h5", weight: 0.3}
train: {micro_batch: 2, steps: 10, threads: 1, global_batch: 4}
optim: {warmup_steps: 2}
eval: {every: 0}
log: {every: 1}
checkpoint: {every: 5, keep: 2, resume: none}
sample: {tokens: 0}
EOF
run() {  # NAME NP ARGS...
  local name=$1 np=$2
  shift 2
  "$MPIRUN" -np "$np" --oversubscribe "$BIN" mix.yaml --set train.out_dir=run_$name --set checkpoint.dir=ckpt_$name "$@" \
    > $name.out 2>&1 || tail -5 $name.out
}
losses() { grep -o '"loss": [0-9.]*' run_$1/metrics.jsonl | tail -${2:-10} | grep -o '[0-9.]*$'; }
sources() { grep -o '"source_tokens": \[[0-9, ]*\]' run_$1/metrics.jsonl | tail -${2:-10}; }
same_losses() {
  paste <(losses "$1" "${3:-10}") <(losses "$2" "${3:-10}") |
    awk -v want="${3:-10}" '{ d = $1 - $2; if (d < 0) d = -d; if (d > 1e-5 || $2 == "") bad = 1; n++ } END { exit bad || n != want }'
}
run m1 1
run m2 2
run r2 2 --set checkpoint.resume=ckpt_m1/ckpt-00000005.h5
sources m1 | sed 's/^/  m1 /' | tail -3
check "the tokens per source each step: 0.7 / 0.3 of the windows within one window (step 10: 28 and 12 windows of 32 tokens)" \
  "grep -q 'data: a mixture of 2 sources, windows per 1000: data/c-train-\\*.h5 700/1000, data/z-train-\\*.h5 300/1000' m1.out &&
   [ \"\$(sources m1 1)\" = '\"source_tokens\": [896, 384]' ] &&
   sources m1 | $PY -c \"
import re, sys
for k, line in enumerate(sys.stdin, 1):
    a, b = map(int, re.findall(r'[0-9]+', line))
    w = 4 * k  # windows so far
    assert a + b == 32 * w and abs(a / 32 - 0.7 * w) < 1 and abs(b / 32 - 0.3 * w) < 1, (k, a, b)
\""
check "np 2 trains np 1's mixture run: its losses and tokens per source" "same_losses m1 m2 && [ \"\$(sources m1)\" = \"\$(sources m2)\" ]"
check "np 1's step-5 checkpoint resumed at np 2 continues the same sequence: steps 6-10's losses and tokens per source" \
  "same_losses m1 r2 5 && [ \"\$(sources m1 5)\" = \"\$(sources r2 5)\" ]"

# data.stages: from step 5 the shares 0.1 / 0.9, each source going on from its own windows; np 1's
# step-5 checkpoint resumed at np 2 continues across the switch.
run_stages() {  # NAME NP ARGS...
  local name=$1 np=$2
  shift 2
  "$MPIRUN" -np "$np" --oversubscribe "$BIN" mix.yaml --set 'data.stages=[5:0.1/0.9]' --set train.out_dir=run_$name \
    --set checkpoint.dir=ckpt_$name "$@" > $name.out 2>&1 || tail -5 $name.out
}
run_stages s1 1
run_stages s2 2 --set checkpoint.resume=ckpt_s1/ckpt-00000005.h5
check "data.stages: from step 5 each of the 20 windows at 0.1 / 0.9 (step 10: 14 + 2 and 6 + 18 windows), the log naming the stage" \
  "[ \"\$(sources s1 1)\" = '\"source_tokens\": [512, 768]' ] && [ \"\$(sources s1 6 | head -1)\" = \"\$(sources m1 6 | head -1)\" ] &&
   grep -q 'from step 5: 100 900' s1.out"
check "its step-5 checkpoint resumed at np 2 continues across the switch: steps 6-10's losses and tokens per source" \
  "same_losses s1 s2 5 && [ \"\$(sources s1 5)\" = \"\$(sources s2 5)\" ] && ! same_losses m1 s1 5"

"$PY" -c "import numpy as np; np.save('wide.npy', np.arange(2000, dtype=np.uint16) % 300)"
"$BIN" pack wide.npy -o data/w --vocab-size 300 --eot 299 --val-fraction 0 > pack3.out 2>&1 || cat pack3.out
expect_own_usage "a weight count that differs from the entries refused by name" \
  "data.weights must be one weight per data.train entry (2), or none" "$BIN" mix.yaml --set 'data.weights=[1]'
expect_own_usage "a weight <= 0 refused by name" "data.weights must be numbers > 0" "$BIN" mix.yaml --set 'data.weights=[1,0]'
expect_usage "a source of another vocabulary refused, naming the entry" \
  "data.train\[1\] (data/w-train-\*.h5): vocab_size 300 differs from data.train\[0\] (data/c-train-\*.h5)'s 257" \
  "$BIN" mix.yaml --set 'data.train=[data/c-train-*.h5,data/w-train-*.h5]'
summary
