#!/usr/bin/python3
"""An exported Hugging Face GPT-2 directory checked without mpitrain's code and without transformers.

  hf_gpt2_reference.py HF_DIR CHECKPOINT.h5 TOKENS.npy LOGITS.npy

1. model.safetensors is parsed here (8-byte header length, JSON header, raw little-endian data)
   and every tensor's name, dtype, shape and bytes are checked against the mpitrain checkpoint
   (read with h5py): Hugging Face's names ("transformer." + mpitrain's), Conv1D weights ([in, out],
   the transpose of the checkpoint's [out, in]), values bit for bit; no tensor left out, none extra,
   no byte of the data section unaccounted for.
2. A GPT-2 written against Hugging Face's parameter names and config.json (Conv1D: x @ W + b,
   GELU "gelu_new", LayerNorm eps from the config, tied lm_head) runs on those weights in PyTorch
   (Debian's python3-torch) for the tokens mpitrain ran, and its logits must equal mpitrain's:
   max |delta| <= 1e-4 * max|logit| + 1e-5 (both fp32, different summation orders: rounding only,
   ~1e-6 relative; a mapping or layout mistake is O(1)).
3. Where transformers is installed, GPT2LMHeadModel.from_pretrained(HF_DIR) must give the same logits.
Prints the figures; exit 1 on the first mismatch.
"""
import json
import math
import os
import struct
import sys

import h5py
import numpy as np
import torch

DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def read_safetensors(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack_from("<Q", raw, 0)
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    if (8 + n) % 8:
        fail(f"data section starts at byte {8 + n}, not 8-byte aligned")
    tensors, covered = {}, 0
    for name, v in header.items():
        if name == "__metadata__":
            continue
        b, e = v["data_offsets"]
        dt = DTYPES[v["dtype"]]
        arr = np.frombuffer(data[b:e], dtype=np.dtype(dt).newbyteorder("<")).reshape(v["shape"])
        if arr.size * np.dtype(dt).itemsize != e - b:
            fail(f"{name}: {e - b} bytes for shape {v['shape']}")
        tensors[name] = arr
        covered += e - b
    if covered != len(data):
        fail(f"the tensors cover {covered} of {len(data)} data bytes")
    return header, tensors


def conv1d(name):
    return (".attn.c_" in name or ".mlp.c_" in name) and name.endswith(".weight")


def check_against_checkpoint(tensors, ckpt):
    with h5py.File(ckpt, "r") as f:
        names = []
        f["model"].visit(lambda n: names.append(n) if isinstance(f["model"][n], h5py.Dataset) else None)
        want = {"transformer." + n for n in names}
        if set(tensors) != want:
            fail(f"names differ: extra {sorted(set(tensors) - want)[:3]}, missing {sorted(want - set(tensors))[:3]}")
        for n in names:
            ref = f["model"][n][()]
            got = tensors["transformer." + n]
            if conv1d(n):
                ref = ref.T
            if got.dtype != np.float32 or got.shape != ref.shape or not np.array_equal(got, ref):
                fail(f"{n}: {got.dtype} {got.shape} vs the checkpoint's float32 {ref.shape} (values equal: "
                     f"{got.shape == ref.shape and np.array_equal(got, ref)})")
    return len(names)


def gpt2_logits(cfg, w, tokens):
    """GPT-2 forward in Hugging Face's terms: every name is one transformers' GPT2LMHeadModel uses."""
    t = lambda name: torch.from_numpy(np.array(w["transformer." + name], dtype=np.float32))
    eps, H = cfg["layer_norm_epsilon"], cfg["n_head"]
    assert cfg["activation_function"] == "gelu_new" and cfg["tie_word_embeddings"]
    idx = torch.from_numpy(tokens)
    B, T = idx.shape
    x = t("wte.weight")[idx] + t("wpe.weight")[:T]
    ln = lambda x, p: torch.nn.functional.layer_norm(x, (x.shape[-1],), t(p + ".weight"), t(p + ".bias"), eps)
    conv = lambda x, p: x @ t(p + ".weight") + t(p + ".bias")  # Conv1D: weight [in, out]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg["n_layer"]):
        p = f"h.{i}."
        q, k, v = conv(ln(x, p + "ln_1"), p + "attn.c_attn").split(cfg["n_embd"], dim=2)
        heads = lambda z: z.view(B, T, H, -1).transpose(1, 2)
        q, k, v = heads(q), heads(k), heads(v)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, -1)
        x = x + conv(y, p + "attn.c_proj")
        h = conv(ln(x, p + "ln_2"), p + "mlp.c_fc")
        h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))  # gelu_new
        x = x + conv(h, p + "mlp.c_proj")
    return (ln(x, "ln_f") @ t("wte.weight").T).numpy()  # lm_head tied to wte


def main():
    hf_dir, ckpt, tokens_npy, logits_npy = sys.argv[1:5]
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    header, w = read_safetensors(os.path.join(hf_dir, "model.safetensors"))
    n = check_against_checkpoint(w, ckpt)
    print(f"model.safetensors: {n} tensors, names/shapes/dtypes/values equal the checkpoint's (Conv1D transposed)")
    for key, want in (("n_layer", None), ("vocab_size", w["transformer.wte.weight"].shape[0]),
                      ("n_positions", w["transformer.wpe.weight"].shape[0]), ("n_embd", w["transformer.wte.weight"].shape[1])):
        if want is not None and cfg[key] != want:
            fail(f"config.json {key} = {cfg[key]}, the weights say {want}")
    tokens = np.load(tokens_npy).astype(np.int64)
    ref = np.load(logits_npy)
    with torch.no_grad():
        got = gpt2_logits(cfg, w, tokens)
    delta = float(np.abs(got - ref).max())
    bound = 1e-4 * float(np.abs(ref).max()) + 1e-5
    print(f"logits {list(ref.shape)}: max |delta| = {delta:.3e} (bound {bound:.3e}, max |logit| {np.abs(ref).max():.3f})")
    if not delta <= bound:
        fail("the Hugging Face-named GPT-2 on the exported weights disagrees with mpitrain")
    # Where transformers is installed (not on Debian; on the GPU machine), the real thing too.
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: GPT2LMHeadModel.from_pretrained not tried here")
    else:
        model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
        with torch.no_grad():
            hf = model(torch.from_numpy(tokens)).logits.float().numpy()
        d = float(np.abs(hf - ref).max())
        print(f"transformers {transformers.__version__} GPT2LMHeadModel.from_pretrained: max |delta| = {d:.3e} (bound {bound:.3e})")
        if not d <= bound:
            fail("transformers' GPT2LMHeadModel on the exported directory disagrees with mpitrain")
    print("PASS")


if __name__ == "__main__":
    main()
