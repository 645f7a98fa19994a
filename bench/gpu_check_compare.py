#!/usr/bin/env python3
"""The loss comparisons of bench/gpu_check.sh's train stage, from each run's metrics.jsonl.

  summary RUN                  val loss at the start and the end
  learns-like RUN REF [--tolerance T] [--loss-scale]
                               RUN learned (final val loss below 0.8 x its first), its final val
                               loss is within T (relative, default 0.03) of REF's, no loss is
                               NaN; --loss-scale: every step logs a finite loss scale (fp16)
  same-run A B                 A and B are the same training up to rounding: the first 20 steps'
                               losses within 1e-4 relative, every step within 1e-2, the final val
                               loss within 1%
  speed METRICS LOG VOCAB      tokens/s, MFU and peak GPU memory of a run on random tokens, whose
                               losses must stay finite and below ln(VOCAB) + 1
  resumed FULL FIRST SECOND    FIRST resumed FULL's checkpoint, SECOND resumed FIRST's (FIRST
                               starts after step 1, SECOND where FIRST stopped, both end as FULL): their
                               first 5 steps' losses within 1e-3 of FULL's (weights and AdamW
                               moments restored), every later step within 1e-2, the final val
                               loss within 1% of FULL's

Bounds: one fp32 step on another device or another reduction order changes a loss by about the
float epsilon times the depth of the sums (~1e-6); training amplifies such differences step by
step, so the bounds widen with the number of steps compared. "Learns like" compares outcomes,
not trajectories (different precisions follow different paths).

Prints one line of figures; exit status 1 when a check fails.
"""
import json
import math
import sys


def load(run):
    train, val = {}, {}
    for line in open(f"{run}/metrics.jsonl"):
        r = json.loads(line)
        if "val_loss" in r:
            val[r["step"]] = r["val_loss"]
        elif "loss" in r:
            train[r["step"]] = r
    return train, val


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def final_val(val):
    return val[max(val)] if val else math.nan


def worst(a, b, steps):
    common = [s for s in steps if s in a and s in b]
    if not common:
        return math.inf, None
    s = max(common, key=lambda s: rel(a[s]["loss"], b[s]["loss"]))
    return rel(a[s]["loss"], b[s]["loss"]), s


def main(argv):
    kind, args = argv[0], argv[1:]
    ok = True
    if kind == "summary":
        train, val = load(args[0])
        v = sorted(val)
        print(f"val loss {val[v[0]]:.4f} -> {val[v[-1]]:.4f} over {max(train)} steps" if v else "no val loss")
        return 0
    if kind == "learns-like":
        tol = float(args[args.index("--tolerance") + 1]) if "--tolerance" in args else 0.03
        (train, val), (_, ref_val) = load(args[0]), load(args[1])
        first, last, ref_last = val[min(val)], final_val(val), final_val(ref_val)
        finite = all(math.isfinite(r["loss"]) for r in train.values())
        ok = finite and last < 0.8 * first and rel(last, ref_last) <= tol
        text = (f"val loss {first:.4f} -> {last:.4f}, reference {ref_last:.4f} "
                f"(differs {rel(last, ref_last):.2%}, bound {tol:.0%})")
        if "--loss-scale" in args:
            scales = [r.get("loss_scale") for r in train.values()]
            has = all(s is not None and math.isfinite(s) and s > 0 for s in scales)
            ok = ok and has
            text += f"; loss scale {scales[0]:g} -> {scales[-1]:g}" if has else "; no loss scale logged"
        print(text + ("" if finite else "; NaN loss"))
    elif kind == "same-run":
        (a, aval), (b, bval) = load(args[0]), load(args[1])
        steps = sorted(b)
        w20, s20 = worst(a, b, steps[:20])
        wall, sall = worst(a, b, steps)
        dv = rel(final_val(aval), final_val(bval))
        ok = len(a) == len(b) and w20 <= 1e-4 and wall <= 1e-2 and dv <= 0.01
        print(f"{len(a)}/{len(b)} steps; loss differs at most {w20:.1e} in steps 1-20 (step {s20}), "
              f"{wall:.1e} overall (step {sall}); final val {final_val(aval):.4f} vs {final_val(bval):.4f}")
    elif kind == "resumed":
        (full, full_val), (first, _), (second, second_val) = load(args[0]), load(args[1]), load(args[2])
        f5, s1 = worst(first, full, sorted(first)[:5])
        g5, s2 = worst(second, full, sorted(second)[:5])
        wall, sall = worst({**first, **second}, full, sorted({**first, **second}))
        dv = rel(final_val(second_val), final_val(full_val))
        chained = (bool(first) and bool(second) and min(first) > min(full) and min(second) == max(first) + 1
                   and max(second) == max(full))
        ok = chained and f5 <= 1e-3 and g5 <= 1e-3 and wall <= 1e-2 and dv <= 0.01
        print(f"steps {min(first)}-{max(first)} then {min(second)}-{max(second)}: first 5 after each resume "
              f"within {f5:.1e} / {g5:.1e} of the uninterrupted run, at most {wall:.1e} overall (step {sall}); "
              f"final val {final_val(second_val):.4f} vs {final_val(full_val):.4f}"
              + ("" if chained else "; not a resume chain (FIRST must start after FULL's first step, SECOND where FIRST stopped)"))
    elif kind == "speed":  # speed METRICS.jsonl LOG VOCAB: a run on random tokens (the llama stage)
        import re
        rows = [json.loads(l) for l in open(args[0]) if '"tokens_per_s"' in l]
        timed = rows[1:] or rows  # the first interval includes start-up
        tok = sum(r["tokens_per_s"] for r in timed) / len(timed)
        mfu = [r["mfu"] for r in timed if "mfu" in r]
        peak = re.findall(r"peak GPU memory[^:]*: ([0-9.e+-]+) GiB", open(args[1]).read())
        # nothing to learn in random tokens: the loss must stay finite and near ln(vocab)
        ok = bool(rows) and all(math.isfinite(r["loss"]) and r["loss"] < math.log(int(args[2])) + 1 for r in rows)
        print(f"{tok:,.0f} tokens/s, " + (f"MFU {100 * sum(mfu) / len(mfu):.1f}%, " if mfu else "")
              + f"peak GPU memory {peak[-1] + ' GiB' if peak else 'n/a'}, loss {rows[0]['loss']:.3f} -> "
              f"{rows[-1]['loss']:.3f}" + ("" if ok else " (not finite, or above ln(vocab) + 1)"))
    else:
        print(f"unknown comparison '{kind}'")
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (OSError, ValueError, KeyError) as e:
        print(f"cannot compare: {e}")
        sys.exit(1)
