#!/usr/bin/env bash
# comm.grad_dtype end to end: the demo model (configs/demo.yaml) made smaller still (2 layers of
# width 128, sequences of 64, micro-batch 8: 30 ms a step here, the demo's own shape 230 ms) trained
# for 200 steps on the fortunes corpus by mpirun -np 2 with fp32, bf16 and fp16 gradient
# communication. Why 200 steps: the PowerSGD criterion below compares where the runs got at steps
# 100 and 200, which needs runs that get below the corpus's unigram entropy, and the control must
# have had time to fail it. Why width 128: PowerSGD's rank 4 must leave each matrix at most a tenth
# of its bytes (4 x (128 + 128) of 128 x 128).
#  - the start-up log's bytes per rank per step for bf16/fp16 are exactly half of fp32's (counted
#    by the communicator: test_comm SixteenBitGradientsHalveTheBytesWithinTheirRounding);
#  - the 16-bit runs learn like the fp32 run: validation loss at steps 100 and 200, and the mean
#    train loss over steps 110-200, within 0.05 nats of fp32's. Why 0.05: 16-bit gradients differ
#    from fp32's by at most 2^-8 (bf16) / 2^-11 (fp16) relative per element; AdamW normalises each
#    element's update, so this perturbs the updates, not their scale, and the runs drift apart as
#    any two runs with different rounding do (the bf16-autocast test allows the same 0.05);
#    measured here: at most 0.0002 (bf16) and 0.0001 (fp16) (the demo's shape: 0.024 and 0.008);
#  - comm.compress: powersgd (rank 4, from step 11) sends at least 10x fewer bytes per step (the
#    start-up line) and learns: its steps before compression starts equal fp32's (steps 1-10: the
#    same arithmetic), and at steps 100 and 200 (validation) and over steps 110-200 (mean train
#    loss) it gets at least 3/4 as far below the corpus's unigram entropy (pack's figure, the loss
#    of a model that ignores context) as fp32 does. PowerSGD is lossy (a rank-4 projection of each
#    weight matrix's mean gradient, what it leaves out delayed by error feedback, not lost), so no
#    rounding argument bounds its distance from fp32, and an absolute bound is one machine's: the
#    old 0.1 nats passed here at 0.029-0.041 and failed elsewhere at 0.097-0.149 for the same
#    commit. Measured from the unigram entropy, not from the first loss: the fall to it comes from
#    token frequencies, which any learner gets (fp32 at a tenth of the learning rate falls 90% as
#    far as fp32 from step 1), while what lies below it needs the gradient's structure. That
#    control (fp32, lr / 10) must fail the criterion, so the check can fail (measured here at this
#    shape: PowerSGD 0.87-0.94 of fp32's on the default, OpenBLAS Sandybridge and ATen default
#    kernels alike, the control 0.20-0.63; the demo's shape: 0.95-0.96 and 0.55-0.69);
#  - comm.grad_dtype: int8 is refused (exit 2, one line naming the key); so is PowerSGD with ZeRO-1
#    (naming both keys).
# Usage: grad_comm_test.sh PATH/TO/mpitrain [mpirun]
set -u
BIN=$(realpath "$1")
MPIRUN=${2:-mpirun}
HERE=$(cd "$(dirname "$0")" && pwd)
E2E_NAME=gradcomm
E2E_NO_CORPUS=1
# shellcheck source=e2e_lib.sh
. "$HERE/e2e_lib.sh"
[ -d /usr/share/games/fortunes ] || { echo "FAIL: no /usr/share/games/fortunes (Debian: fortunes; scripts/setup.sh installs it)"; exit 1; }
"$BIN" pack /usr/share/games/fortunes -o data/f --doc-separator % --val-fraction 0.05 > pack.out 2>&1 || { cat pack.out; exit 1; }

for d in fp32 bf16 fp16 powersgd slow; do
  case $d in
    powersgd) set_comm=(--set comm.compress=powersgd) ;;
    slow) set_comm=(--set optim.lr=0.0003 --set optim.min_lr=0.00003) ;;  # the control: fp32, lr / 10
    *) set_comm=(--set "comm.grad_dtype=$d") ;;
  esac
  "$MPIRUN" -np 2 "$BIN" "$HERE/../configs/demo.yaml" --set "data.train=[data/f-train-*.h5]" \
    --set "data.val=[data/f-val-*.h5]" --set model.n_layer=2 --set model.seq_len=64 --set train.micro_batch=8 \
    --set train.steps=200 --set "train.out_dir=run_$d" \
    --set "checkpoint.dir=ckpt_$d" --set checkpoint.keep=1 --set sample.tokens=0 --set log.every=1 \
    --set eval.every=100 "${set_comm[@]}" > "$d.out" 2>&1
  rc=$?
  check "200 steps of the demo model, mpirun -np 2, comm.grad_dtype $d (exit $rc)" "[ $rc -eq 0 ]"
  [ $rc -eq 0 ] || tail -5 "$d.out"
done
mib() { sed -n 's/.*gradient communication: \([0-9.]*\) MiB per rank per step in.*/\1/p' "$1.out"; }
psgd_mib=$(sed -n 's/.*PowerSGD rank 4 from step 11: \([0-9.]*\) MiB.*/\1/p' powersgd.out)
check "powersgd: ${psgd_mib:-?} MiB per rank per step, at least 10x less than fp32's $(mib fp32)" \
  "awk -v a='${psgd_mib:-0}' -v b=$(mib fp32) 'BEGIN { exit !(a > 0 && a * 10 <= b) }'"
for d in bf16 fp16; do
  check "$d: $(mib $d) MiB per rank per step, half of fp32's $(mib fp32)" \
    "awk -v a=$(mib $d) -v b=$(mib fp32) 'BEGIN { exit !(a > 0 && a * 2 == b) }'"
  verdict=$($PY - "run_fp32/metrics.jsonl" "run_$d/metrics.jsonl" 0.05 <<'PYEOF'
import json, sys
def read(p):
    rows = [json.loads(l) for l in open(p)]
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    train = [r["loss"] for r in rows if "loss" in r and 110 <= r["step"] <= 200]
    return val, sum(train) / len(train)
(v32, t32), (v16, t16) = read(sys.argv[1]), read(sys.argv[2])
d = [abs(v16[s] - v32[s]) for s in (100, 200)] + [abs(t16 - t32)]
bound = float(sys.argv[3])
print(("ok" if max(d) <= bound else "no") + f" (|delta| val@100 {d[0]:.4f}, val@200 {d[1]:.4f}, "
      f"mean train 110-200 {d[2]:.4f}; bound {bound})")
PYEOF
)
  check "$d communication learns like fp32: $verdict" "[ '${verdict%% *}' = ok ]"
done
# PowerSGD and the control against fp32: how far each gets below the unigram entropy, over how far
# fp32 gets, at least 3/4 for val@100, val@200 and the mean train loss of steps 110-200;
# PowerSGD's steps 1-10 must equal fp32's (compression starts at step 11).
unigram=$(sed -n 's/.*train unigram entropy: \([0-9.]*\) nats.*/\1/p' pack.out)
falls() {
  $PY - "run_fp32/metrics.jsonl" "run_$1/metrics.jsonl" "$1" "${unigram:-nan}" <<'PYEOF'
import json, math, sys
def read(p):
    rows = [json.loads(l) for l in open(p)]
    train = {r["step"]: r["loss"] for r in rows if "loss" in r}
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    late = [train[s] for s in train if 110 <= s <= 200]
    return train, [val[100], val[200], sum(late) / len(late)]
(t32, m32), (t, m) = read(sys.argv[1]), read(sys.argv[2])
h = float(sys.argv[4])
ratios = [(h - b) / (h - a) for a, b in zip(m32, m)]
early = all(t[s] == t32[s] for s in range(1, 11))
ok = math.isfinite(h) and min(m32) < h and min(ratios) >= 0.75 and (early or sys.argv[3] != "powersgd")
print(("ok" if ok else "no") + " (below the unigram entropy %.4f, over fp32's: val@100 %.3f, val@200 %.3f, mean train "
      "110-200 %.3f; at least 0.75; steps 1-10 %s fp32's)" % (h, *ratios, "equal to" if early else "differ from"))
PYEOF
}
verdict=$(falls powersgd)
check "powersgd communication learns like fp32: $verdict" "[ '${verdict%% *}' = ok ]"
verdict=$(falls slow)
check "the control (fp32 at a tenth of the learning rate) fails the same criterion: $verdict" "[ '${verdict%% *}' = no ]"
"$BIN" "$HERE/../configs/demo.yaml" --set comm.grad_dtype=int8 > bad.out 2>&1
rc=$?
check "comm.grad_dtype: int8 refused: exit 2, one line naming the key" \
  "[ $rc -eq 2 ] && [ \$(wc -l < bad.out) -eq 1 ] && grep -q 'comm.grad_dtype' bad.out"
"$MPIRUN" -np 2 "$BIN" "$HERE/../configs/demo.yaml" --set comm.compress=powersgd --set optim.zero=1 > bad.out 2>&1
rc=$?
check "comm.compress: powersgd with optim.zero: 1 refused: exit 2, printed once, naming both keys" \
  "[ $rc -eq 2 ] && [ \$(grep -c 'mpitrain: ' bad.out) -eq 1 ] && grep -q 'comm.compress must be none with optim.zero: 1' bad.out"
summary
