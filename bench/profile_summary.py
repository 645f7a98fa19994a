#!/usr/bin/env python3
"""Where a training step's time goes, from mpitrain's profile (log.profile_start; a Chrome trace).

  python3 bench/profile_summary.py <out_dir>/profile/rank-0.json [--top N]
  python3 bench/profile_summary.py A.json B.json [--labels mpitrain,"torch.compile"]

Reads mpitrain's trace and torch.profiler's (Kineto's export_chrome_trace, e.g.
bench/gpt2_reference.py --profile). With two or more traces it first prints one table of GPU time
per step by kernel kind, a column per trace and the difference from the first, then each summary.

Prints markdown tables: the profiled steps' wall time; on a GPU, the GPU's busy share of it and
the kernel time by kind (matmul, attention, LayerNorm, GELU, softmax/cross-entropy, optimizer,
elementwise, reduction, copies, communication) and the top kernels; on the CPU (or for the CPU
side of a GPU run), the top operators by inclusive time. Step boundaries come from the
"ProfilerStep#N" annotations mpitrain records.
"""
import argparse
import json
import os
import re
from collections import defaultdict

KINDS = [  # (kind, pattern over the kernel name), first match wins
    ("communication (NCCL)", r"nccl"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn.*(mha|sdpa)|_efficient_attention"),
    ("matmul (GEMM)", r"gemm|cutlass|xmma|cublas|nvjet|sm\d+_.*(mma|h\d+gemm)|ampere_|hopper_"),
    ("LayerNorm / RMSNorm (fused add + norm)", r"layer_?norm|rms_?norm|add_ln|addln|ln_fwd|ln_bwd|add_norm|norm_param_grad"),
    ("bias + GELU", r"gelu"),
    ("softmax / cross-entropy", r"softmax|cross_entropy|nll_loss|log_softmax|xent"),
    ("optimizer (AdamW)", r"adam|multi_tensor_apply"),
    ("embedding", r"embedding|index_select|indexing_backward|index_put"),
    ("reduction", r"reduce|norm_kernel|sum_kernel"),
    ("copies / memset", r"^memcpy|^memset|copy_kernel|cat_|catarray"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|fill"),
    ("Triton fused (other)", r"^triton_"),
]
# A GPU event's category: "gpu" in mpitrain's own trace, Kineto's names in torch.profiler's.
GPU_CATS = {"gpu", "kernel", "gpu_memcpy", "gpu_memset"}


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


def load(path):
    """The profiled steps of one trace: (steps, GPU events inside them, CPU operators inside them)."""
    data = json.load(open(path))
    # Kineto's trace is an object with traceEvents; the legacy profiler's (torch 1.x built without
    # Kineto, as Debian 12's python3-torch) a bare list of events without categories.
    events = [e for e in (data["traceEvents"] if isinstance(data, dict) else data) if e.get("ph") == "X"]
    for e in events:
        e.setdefault("cat", "user_annotation" if e["name"].startswith("ProfilerStep#") else "cpu_op")
    steps = [e for e in events if e["cat"] == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise SystemExit(f"{path}: no ProfilerStep# annotations (not an mpitrain or gpt2_reference.py profile?)")
    window = (min(s["ts"] for s in steps), max(s["ts"] + s["dur"] for s in steps))
    # mpitrain's trace also holds the step annotations mirrored on the GPU's timeline: not kernels.
    gpu = [e for e in events if e.get("cat") in GPU_CATS and window[0] <= e["ts"] <= window[1]
           and not e["name"].startswith("ProfilerStep#")]
    cpu = [e for e in events if e.get("cat") == "cpu_op" and window[0] <= e["ts"] <= window[1]]
    return steps, gpu, cpu


def kind_ms(steps, gpu):
    by_kind = defaultdict(float)
    for e in gpu:
        by_kind[kind_of(e["name"])] += e["dur"] / 1e3 / len(steps)
    return by_kind


def compare(paths, labels):
    loaded = [load(p) for p in paths]
    kinds = [kind_ms(steps, gpu) for steps, gpu, _ in loaded]
    print("GPU time per step by kernel kind (ms)")
    print("| kernel kind | " + " | ".join(labels) + " | " + " | ".join(f"{l} - {labels[0]}" for l in labels[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(labels) - 1))
    order = sorted({k for d in kinds for k in d}, key=lambda k: -max(d.get(k, 0.0) for d in kinds))
    rows = [(k, [d.get(k, 0.0) for d in kinds]) for k in order]
    rows.append(("all kernels", [sum(d.values()) for d in kinds]))
    rows.append(("step (wall)", [sum(s["dur"] for s in steps) / 1e3 / len(steps) for steps, _, _ in loaded]))
    for name, v in rows:
        print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in v) + " | "
              + " | ".join(f"{x - v[0]:+.2f}" for x in v[1:]) + " |")
    print()


def summary(path, top):
    steps, inside, cpu = load(path)
    n = len(steps)
    wall_ms = sum(s["dur"] for s in steps) / 1e3
    print(f"profile of {n} steps ({', '.join(s['name'].split('#')[1] for s in steps)}): "
          f"step time {wall_ms / n:.2f} ms (wall, mean)")
    print()
    if inside:
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
        print(f"| top {top} kernels | kind | ms per step | share | launches per step |")
        print("|---|---|---:|---:|---:|")
        for name, (count, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"| {short(name)} | {kind_of(name)} | {us / 1e3 / n:.3f} | {us / 1e3 / kernel_ms:.1%} | {count / n:.0f} |")
        print()
    ops = defaultdict(lambda: [0, 0.0])
    for e in cpu:
        o = ops[e["name"]]
        o[0] += 1
        o[1] += e["dur"]
    print(f"| top {top} CPU-side operators (inclusive) | ms per step | share of the step | calls per step |")
    print("|---|---:|---:|---:|")
    for name, (count, us) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| {short(name, 60)} | {us / 1e3 / n:.2f} | {us / 1e3 / wall_ms:.1%} | {count / n:.0f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--labels", help="comma-separated names of the traces (default: their file names)")
    args = ap.parse_args()
    labels = args.labels.split(",") if args.labels else [os.path.basename(p) for p in args.traces]
    if len(labels) != len(args.traces):
        raise SystemExit(f"--labels names {len(labels)} traces, {len(args.traces)} given")
    if len(args.traces) > 1:
        compare(args.traces, labels)
    for path, label in zip(args.traces, labels):
        if len(args.traces) > 1:
            print(f"## {label}: {path}")
            print()
        summary(path, args.top)
        print()


if __name__ == "__main__":
    main()
