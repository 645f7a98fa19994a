#!/usr/bin/env python3
"""Plain-PyTorch reference for bench/gpu_throughput.sh: the same GPT-2 as mpitrain's model
(pre-LayerNorm blocks, GELU tanh, tied embeddings, GPT-2 initialisation, no dropout, parameter
names as mpitrain's), trained the way a careful PyTorch user would: SDPA attention (flash/cuDNN
kernels), bf16 autocast with fp32 master weights, fused AdamW, mpitrain's warm-up + cosine
schedule, optionally torch.compile. Prints one JSON line: tokens/s, ms/step, peak GPU memory,
losses.

    python3 bench/gpt2_reference.py --tokens data.npy --mode eager|compile [--steps 60]
    python3 bench/gpt2_reference.py --device cpu --precision fp32 --threads 1 --n-layer 4 ...
                                                           (bench/cpu_vs_pytorch.sh)
    python3 bench/gpt2_reference.py --dump-init DIR        initial weights, one .npy per parameter
                                                           (mpitrain's model.init_from), then exit

For the loss-parity check, --sequential reads the windows in mpitrain's unshuffled order (window
j = tokens [j*T, j*T+T], batch k = windows k*B .. k*B+B-1) and --all-losses records every step.
"""
import argparse
import contextlib
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.ModuleDict(dict(c_attn=nn.Linear(d, 3 * d), c_proj=nn.Linear(d, d)))
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(d, 4 * d), c_proj=nn.Linear(4 * d, d)))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch < 2.0 (Debian 12's 1.13): the plain masked-softmax attention
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            y = att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        x = x + self.attn.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, seq_len, n_layer, n_head, d):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq_len, d)
        self.h = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        proj_std = 0.02 / math.sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln_" in name:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, 0.0, proj_std if name.endswith("c_proj.weight") else 0.02)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


def lr_at(step, total, lr, min_lr, warmup):
    """mpitrain's schedule (src/state/optim.cpp): linear warm-up, then cosine decay to min_lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    decay_steps = total - warmup
    if decay_steps <= 1:
        return lr
    progress = min(1.0, (step - warmup) / (decay_steps - 1))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", help="1-D .npy of token ids")
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10, help="steps excluded from the timing")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--min-lr", type=float, default=6e-5)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--sequential", action="store_true", help="mpitrain's unshuffled window order")
    ap.add_argument("--all-losses", action="store_true", help="record the loss of every step")
    ap.add_argument("--dump-init", metavar="DIR", help="write the initial weights as .npy files and exit")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                    help="bf16: autocast with fp32 master weights; fp32: no autocast")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (CPU); 0 = torch's default")
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--init-from", metavar="DIR", help="start from the .npy weights --dump-init wrote")
    ap.add_argument("--profile", metavar="TRACE", help="profile the last 3 steps (torch.profiler, one "
                    "ProfilerStep#N annotation per step, each step synchronised) into a Chrome trace; "
                    "bench/profile_summary.py tabulates it")
    args = ap.parse_args()

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as mpitrain does for fp32 on the CPU
    torch.manual_seed(args.seed)
    # drawn on the CPU: the same for every mode
    model = GPT(args.vocab, args.seq_len, args.n_layer, args.n_head, args.n_embd)
    if args.init_from:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.from_numpy(np.load(os.path.join(args.init_from, name + ".npy"))))
    if args.dump_init:
        os.makedirs(args.dump_init, exist_ok=True)
        for name, p in model.named_parameters():
            np.save(os.path.join(args.dump_init, name + ".npy"), p.detach().numpy().astype(np.float32))
        print(f"wrote {len(list(model.parameters()))} tensors to {args.dump_init}")
        return
    if not args.tokens:
        ap.error("--tokens is required")

    cuda = args.device == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dev = torch.device(args.device)
    data = torch.from_numpy(np.load(args.tokens).astype(np.int64))
    model = model.to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    # The fastest AdamW this torch offers on the device: fused on CUDA; on the CPU fused from torch
    # 2.4, else the default (for-each where torch picks it).
    fused = cuda or tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 4)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if fused else {}))
    step_fn = torch.compile(model) if args.mode == "compile" else model
    B, T = args.micro_batch, args.seq_len
    gen = torch.Generator().manual_seed(args.seed)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    losses, t0, step_ms = [], None, []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    prof, first_profiled = None, max(args.warmup, args.steps - 3)
    for step in range(args.steps):
        if step == args.warmup:
            sync()
            t0 = time.perf_counter()
        if args.profile and step == first_profiled:
            sync()
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            prof = torch.profiler.profile(activities=acts)
            prof.__enter__()
        annotation = torch.profiler.record_function(f"ProfilerStep#{step + 1}") if prof else contextlib.nullcontext()
        annotation.__enter__()
        t_step = time.perf_counter()
        if args.sequential:
            starts = [(step * B + i) * T for i in range(B)]
        else:
            starts = torch.randint(0, data.numel() - T - 1, (B,), generator=gen).tolist()
        batch = torch.stack([data[s:s + T + 1] for s in starts])
        batch = batch.pin_memory().to(dev, non_blocking=True) if cuda else batch
        x, y = batch[:, :-1], batch[:, 1:]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.min_lr, args.warmup_steps)
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.all_losses or step < 5 or step + 1 == args.steps:
            losses.append(round(loss.item(), 4))
        if prof:
            sync()  # the step's kernels inside its annotation, as mpitrain's profiler does
        annotation.__exit__(None, None, None)
        if step >= args.warmup:
            step_ms.append(1e3 * (time.perf_counter() - t_step))
    sync()
    if prof:
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(args.profile)
    dt = time.perf_counter() - t0
    timed = args.steps - args.warmup
    print(json.dumps({
        "name": f"pytorch {args.mode}",
        "tokens_per_s": timed * B * T / dt,
        "ms_per_step": 1e3 * dt / timed,
        "median_ms_per_step": sorted(step_ms)[len(step_ms) // 2],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "losses": losses,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
