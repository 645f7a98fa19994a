#!/usr/bin/env python3
"""Where a training step's time goes, from mpitrain's profile (log.profile_start; a Chrome trace).

  python3 bench/profile_summary.py <out_dir>/profile/rank-0.json [--top N]

Prints markdown tables: the profiled steps' wall time; on a GPU, the GPU's busy share of it and
the kernel time by kind (matmul, attention, LayerNorm, GELU, softmax/cross-entropy, optimizer,
elementwise, reduction, copies, communication) and the top kernels; on the CPU (or for the CPU
side of a GPU run), the top operators by inclusive time. Step boundaries come from the
"ProfilerStep#N" annotations mpitrain records.
"""
import argparse
import json
import re
from collections import defaultdict

KINDS = [  # (kind, pattern over the kernel name), first match wins
    ("communication (NCCL)", r"nccl"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn.*(mha|sdpa)|_efficient_attention"),
    ("matmul (GEMM)", r"gemm|cutlass|xmma|cublas|nvjet|sm\d+_.*(mma|h\d+gemm)|ampere_|hopper_"),
    ("LayerNorm (fused add + LN)", r"layer_?norm|add_ln|addln|ln_fwd|ln_bwd"),
    ("bias + GELU", r"gelu"),
    ("softmax / cross-entropy", r"softmax|cross_entropy|nll_loss|log_softmax|xent"),
    ("optimizer (AdamW)", r"adam|multi_tensor_apply"),
    ("embedding", r"embedding|index_select|indexing_backward|index_put"),
    ("reduction", r"reduce|norm_kernel|sum_kernel"),
    ("copies / memset", r"^memcpy|^memset|copy_kernel|cat_|catarray"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|fill"),
]


def kind_of(name):
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def union_length(intervals):
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def short(name, width=90):
    return name if len(name) <= width else name[: width - 3] + "..."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    events = [e for e in json.load(open(args.trace))["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    gpu = [e for e in events if e.get("cat") == "gpu"]
    cpu = [e for e in events if e.get("cat") == "cpu_op"]
    if not steps:
        raise SystemExit(f"{args.trace}: no ProfilerStep# annotations (not an mpitrain profile?)")
    n = len(steps)
    window = (min(s["ts"] for s in steps), max(s["ts"] + s["dur"] for s in steps))
    wall_ms = sum(s["dur"] for s in steps) / 1e3
    print(f"profile of {n} steps ({', '.join(s['name'].split('#')[1] for s in steps)}): "
          f"step time {wall_ms / n:.2f} ms (wall, mean)")
    print()
    if gpu:
        inside = [e for e in gpu if window[0] <= e["ts"] <= window[1]]
        kernel_ms = sum(e["dur"] for e in inside) / 1e3
        busy_ms = union_length([(e["ts"], e["ts"] + e["dur"]) for e in inside]) / 1e3
        print(f"GPU busy {busy_ms / n:.2f} ms per step = {busy_ms / wall_ms:.1%} of the wall time "
              f"(idle {(wall_ms - busy_ms) / n:.2f} ms per step); {len(inside) / n:.0f} kernels and copies per step")
        print()
        by_kind = defaultdict(lambda: [0, 0.0])
        by_name = defaultdict(lambda: [0, 0.0])
        for e in inside:
            k = by_kind[kind_of(e["name"])]
            k[0] += 1
            k[1] += e["dur"]
            m = by_name[e["name"]]
            m[0] += 1
            m[1] += e["dur"]
        print("| kernel kind | ms per step | share of GPU time | launches per step |")
        print("|---|---:|---:|---:|")
        for kind, (count, us) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
            print(f"| {kind} | {us / 1e3 / n:.2f} | {us / 1e3 / kernel_ms:.1%} | {count / n:.0f} |")
        print()
        print(f"| top {args.top} kernels | kind | ms per step | share | launches per step |")
        print("|---|---|---:|---:|---:|")
        for name, (count, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: args.top]:
            print(f"| {short(name)} | {kind_of(name)} | {us / 1e3 / n:.3f} | {us / 1e3 / kernel_ms:.1%} | {count / n:.0f} |")
        print()
    ops = defaultdict(lambda: [0, 0.0])
    for e in cpu:
        if window[0] <= e["ts"] <= window[1]:
            o = ops[e["name"]]
            o[0] += 1
            o[1] += e["dur"]
    print(f"| top {args.top} CPU-side operators (inclusive) | ms per step | share of the step | calls per step |")
    print("|---|---:|---:|---:|")
    for name, (count, us) in sorted(ops.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"| {short(name, 60)} | {us / 1e3 / n:.2f} | {us / 1e3 / wall_ms:.1%} | {count / n:.0f} |")


if __name__ == "__main__":
    main()
