#!/usr/bin/env bash
# What a user sees of a run, end to end under mpirun -np 2 (issue "see the run"):
#  - the progress line carries MFU (against log.peak_tflops) and the communication share, printed
#    once (rank 0), and metrics.jsonl the same values; MFU equals 6N + 12 L d T x tokens/s / peak
#    recomputed here from the logged model size;
#  - every rank writes <out_dir>/logs/rank-<r>.log, each line with time, rank and host; a warning
#    of rank 1 reaches the terminal (once, with its rank) and rank 1's file;
#  - TensorBoard event files read back by an independent reader (tests/tensorboard_read.py: CRC32C
#    from python3-crc32c, decoding by python3-protobuf): every record's CRCs, the file version,
#    every scalar equal to metrics.jsonl, and the restart marker of a resumed run at the first new
#    step; a file with one flipped byte is refused by the reader;
#  - scripts/plot-loss.sh (the demo's picture) draws the run's curves as a PNG.
# Usage: observe_test.sh PATH/TO/mpitrain [mpirun]
set -u
BIN=$(realpath "$1")
MPIRUN=${2:-mpirun}
HERE=$(cd "$(dirname "$0")" && pwd)
E2E_NAME=observe
# shellcheck source=e2e_lib.sh
. "$HERE/e2e_lib.sh"
need_python 'import crc32c, google.protobuf' 'python3-crc32c python3-protobuf'

cat > cfg.yaml <<'YAML'
model: {preset: custom, n_layer: 2, n_head: 2, n_embd: 32, seq_len: 32}
data: {train: [data/c-train-*.h5], val: [data/c-val-*.h5]}
train: {micro_batch: 2, steps: 8, threads: 1, out_dir: run}
optim: {warmup_steps: 2}
eval: {every: 3, batches: 1}
log: {every: 2, peak_tflops: 0.01}
checkpoint: {dir: ckpt, every: 4, keep: 2, resume: auto}
sample: {tokens: 0}
YAML

# ---- run 1: steps 1-4, then stopped (a checkpoint at 4) ----
MPITRAIN_TEST_WARN_RANK=1 "$MPIRUN" -np 2 "$BIN" cfg.yaml --stop-after 4 > run1.out 2>&1
rc=$?
check "run 1 (mpirun -np 2, --stop-after 4) exits 0" "[ $rc -eq 0 ]"
[ $rc -eq 0 ] || tail -20 run1.out
check "progress lines with MFU and comm share, printed once per report" \
  "[ \$(grep -cE 'step +2/8 \| .* \| MFU [0-9.]+% \| comm [0-9]+% \| ETA' run1.out) -eq 1 ] && [ \$(grep -c 'step     4/8' run1.out) -eq 1 ]"
grep -E 'step +4/8' run1.out | sed 's/^/  /'
check "rank 1's warning on the terminal once, with its rank" "[ \$(grep -c '\[rank 1 @ .*\] test: a warning of rank 1' run1.out) -eq 1 ]"
# MFU recomputed from the logged model size: (6 (N - T d) + 12 L d T) x tokens/s / (2 ranks x 0.01e12)
N=$(sed -n 's/.*model: [a-z0-9]*, \([0-9]*\) parameters.*/\1/p' run1.out | head -1)
mfu_ok=$($PY - "$N" run/metrics.jsonl <<'PYEOF'
import json, sys
n = int(sys.argv[1]); L, d, T = 2, 32, 32
flops = 6 * (n - T * d) + 12 * L * d * T
rows = [json.loads(l) for l in open(sys.argv[2]) if '"loss"' in l]
bad = [r for r in rows if not (0 <= r["comm_share"] <= 1) or
       abs(r["mfu"] - flops * r["tokens_per_s"] / (2 * 0.01e12)) > 1e-4 * r["mfu"] + 2e-5]
print("yes" if rows and not bad else f"no: {bad or 'no rows'}")
PYEOF
)
check "metrics.jsonl: mfu = (6N + 12 L d T) x tokens/s / peak, comm_share in [0, 1] ($mfu_ok)" "[ '$mfu_ok' = yes ]"

# ---- per-rank log files ----
line_re='^\[[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}\] \[rank R @ [^]]+\] \[(debug|info|warning|error)\] '
for r in 0 1; do
  f=run/logs/rank-$r.log
  re=${line_re/R/$r}
  check "$f exists, every line has time, rank $r and host" "[ -s $f ] && [ \$(grep -cvE '$re' $f) -eq 0 ]"
done
check "rank 1's file holds its warning, rank 0's the progress lines" \
  "grep -q '\[warning\] test: a warning of rank 1' run/logs/rank-1.log && grep -q 'step     4/8' run/logs/rank-0.log && ! grep -q 'step     4/8' run/logs/rank-1.log"

# ---- run 2: resumed at step 4, to 8 ----
"$MPIRUN" -np 2 "$BIN" cfg.yaml > run2.out 2>&1
rc=$?
check "run 2 resumes at step 4 and finishes (exit 0)" "[ $rc -eq 0 ] && grep -q 'resumed from .*ckpt-00000004.h5 at step 4' run2.out"
check "the rank files were appended to: two start headers each" \
  "[ \$(grep -c -- '---- mpitrain' run/logs/rank-0.log) -eq 2 ] && [ \$(grep -c -- '---- mpitrain' run/logs/rank-1.log) -eq 2 ]"

# ---- TensorBoard: decoded by the independent reader ----
"$PY" "$HERE/tensorboard_read.py" run/tensorboard > tb.jsonl 2> tb.err
rc=$?
check "every TensorBoard record's CRCs check out and every payload decodes (exit $rc)" "[ $rc -eq 0 ]"
[ $rc -eq 0 ] || cat tb.err
tb_ok=$($PY - tb.jsonl run/metrics.jsonl <<'PYEOF'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
files = sorted({e["file"] for e in ev})
problems = []
if len(files) != 2: problems.append(f"{len(files)} event files, want 2 (one per run)")
for f in files:
    first = next(e for e in ev if e["file"] == f)
    if first.get("file_version") != "brain.Event:2": problems.append(f"{f}: first record {first}")
starts = [(e["file"], e["step"]) for e in ev if e.get("session_log") == "START"]
if len(files) == 2 and starts != [(files[1], 5)]: problems.append(f"restart markers {starts}, want step 5 in the second file")
# Every scalar equals metrics.jsonl: float32 in the event, in the JSON rounded as progress.cpp prints
# it (half a unit of its last printed digit: tokens/s one decimal, mfu and comm_share five, lr six
# significant digits, the rest six decimals)
tb = {}
for e in ev:
    for tag, v in e.get("scalars", {}).items(): tb.setdefault((tag, e["step"]), []).append(v)
keys = {"loss": "loss/train", "lr": "optim/lr", "grad_norm": "optim/grad_norm", "val_loss": "loss/val",
        "mfu": "perf/mfu", "comm_share": "perf/comm_share", "tokens_per_s": "perf/tokens_per_s"}
n = 0
for line in open(sys.argv[2]):
    m = json.loads(line)
    for k, tag in keys.items():
        if k not in m: continue
        vals = tb.get((tag, m["step"]), [])
        printed = {"tokens_per_s": 0.05, "mfu": 5e-6, "comm_share": 5e-6, "lr": 5e-7 * abs(m[k])}.get(k, 5e-7)
        if not any(abs(v - m[k]) <= printed + 1e-6 * abs(m[k]) for v in vals):
            problems.append(f"{tag} at step {m['step']}: metrics {m[k]}, events {vals}")
        n += 1
for step in (2, 4, 6, 8):
    if ("loss/train", step) not in tb: problems.append(f"no loss/train at step {step}")
print("yes" if not problems and n > 20 else f"no ({n} values): {problems}")
PYEOF
)
check "TensorBoard: version records, one START at step 5 in the resumed run's file, every scalar = metrics.jsonl ($tb_ok)" '[ "$tb_ok" = yes ]'
grep -m1 '"loss/train"' tb.jsonl | sed 's/^/  /'
grep '"START"' tb.jsonl | sed 's/^/  /'
# The reader can fail: one flipped byte in a payload
f=$(ls run/tensorboard/events.out.tfevents.* | head -1)
cp "$f" flipped.tfevents
printf '\xff' | dd of=flipped.tfevents bs=1 seek=40 conv=notrunc status=none
"$PY" "$HERE/tensorboard_read.py" flipped.tfevents > /dev/null 2> flipped.err
rc=$?
check "a flipped byte is refused by the reader (exit $rc: $(head -c 120 flipped.err))" "[ $rc -eq 1 ] && grep -q 'CRC32C does not match' flipped.err"

# ---- the demo's picture: scripts/plot-loss.sh on this run's metrics ----
"$HERE/../scripts/plot-loss.sh" run/metrics.jsonl loss.png "observe test" > plot.out 2>&1
rc=$?
check "plot-loss.sh draws the train and val curves as a PNG (exit $rc)" \
  "[ $rc -eq 0 ] && [ \"\$(head -c 8 loss.png | od -An -tx1 | tr -d ' \n')\" = 89504e470d0a1a0a ] && [ \$(stat -c %s loss.png) -gt 5000 ]"
[ $rc -eq 0 ] || cat plot.out
"$HERE/../scripts/plot-loss.sh" no-such.jsonl x.png > plot_bad.out 2>&1
check "plot-loss.sh on a missing file: exit 2, one line" "[ \$? -eq 2 ] && [ \$(wc -l < plot_bad.out) -eq 1 ]"

# ---- off, and a bad value ----
"$BIN" cfg.yaml --set train.out_dir=run_off --set checkpoint.dir=ckpt_off --set log.tensorboard=off \
  --set log.rank_files=false --set train.steps=2 > off.out 2>&1
check "log.tensorboard: off and log.rank_files: false write neither" \
  "[ \$? -eq 0 ] && [ ! -e run_off/tensorboard ] && [ ! -e run_off/logs ] && [ -s run_off/metrics.jsonl ]"
"$BIN" cfg.yaml --set log.peak_tflops=-1 > neg.out 2>&1
rc=$?
check "log.peak_tflops: -1 is refused: exit 2, one line naming the key" \
  "[ $rc -eq 2 ] && [ \$(wc -l < neg.out) -eq 1 ] && grep -q 'cfg.yaml: log.peak_tflops' neg.out"
[ $rc -eq 2 ] || cat neg.out

summary
