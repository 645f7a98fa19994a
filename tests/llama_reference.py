#!/usr/bin/python3
"""An exported Hugging Face Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 / Gemma 3 / Qwen3-MoE / Mixtral / OLMoE
directory checked without mpitrain's code.

A Llama written here from Hugging Face's modeling semantics (transformers' LlamaForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM and MistralForCausalLM: RMSNorm in fp32 then cast, rotary in
the half-split layout with rotate_half, Llama 3.1's rope_scaling "llama3", grouped-query attention
by repeat_kv, SwiGLU, q/k/v biases for Qwen2, config.json's head_dim and the per-head q_norm /
k_norm before rotary for Qwen3, Mistral's sliding_window in the attention mask (query i sees keys
i - sliding_window + 1 .. i), tied or untied lm_head, and Gemma2ForCausalLM's parts: RMSNorm
times (1 + weight) in fp32, then cast; input_layernorm, post_attention_layernorm,
pre_feedforward_layernorm, post_feedforward_layernorm around each sublayer; the embedding times
sqrt(hidden_size) in its dtype; scores times query_pre_attn_scalar^-0.5, soft-capped by
attn_logit_softcapping, the sliding window on layers 0, 2, 4, ...; the gelu_pytorch_tanh gate; the
logits soft-capped by final_logit_softcapping; Gemma3ForCausalLM's: Gemma 2's parts, q_norm and
k_norm times (1 + weight), the layers whose layer_types entry is sliding_attention windowed and
rotated by rope_local_base_freq, the full_attention ones by rope_theta with rope_scaling
"linear" (frequencies / factor)); the mixtures of experts' sparse blocks (Qwen3MoeSparseMoeBlock,
MixtralSparseMoeBlock, OlmoeSparseMoeBlock: the router's softmax in fp32, top k, renormalised with
norm_topk_prob (Mixtral always), each expert's tokens through it, summed per token in expert order;
Qwen3-MoE's decoder_sparse_step and mlp_only_layers; OLMoE's q_norm and k_norm over the whole
projections) and load_balancing_loss_func added to the training loss times router_aux_loss_coef,
reading only config.json and the safetensors files:

  llama_reference.py logits HF_DIR TOKENS.npy LOGITS.npy
      mpitrain's logits (tests/hf_logits.cpp) for the same tokens must equal this model's:
      max |delta| <= 1e-5 x max |logit| + 1e-6 (two fp32 implementations; a layout or mapping
      mistake, e.g. interleaved instead of half-split rotary, is orders of magnitude larger).
  llama_reference.py train HF_DIR TOKENS.npy --steps N --batch B --lr LR --warmup W ...
      N AdamW steps from HF_DIR's weights on the windows of TOKENS.npy in mpitrain's unshuffled
      order (window j = tokens[j T : j T + T + 1], step k = windows k B .. k B + B - 1), with
      mpitrain's schedule, weight-decay groups (matrices decay) and global-norm clip; prints one
      JSON line {"losses": [...]}.

The safetensors files are read with the `safetensors` library where it is installed (Debian 13's
python3-safetensors) and by this file's own parser otherwise; where both exist they must agree.
Exit 1 on the first mismatch, with what differs.
"""
import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from gpt2_reference import lr_at  # noqa: E402  mpitrain's schedule, as the GPT-2 reference has it

DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def parse_safetensors(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack_from("<Q", raw, 0)
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        b, e = v["data_offsets"]
        if v["dtype"] == "BF16":  # numpy has no bfloat16: the upper half of an fp32
            u16 = np.frombuffer(data[b:e], dtype="<u2").astype(np.uint32) << 16
            arr = u16.view(np.float32)
        else:
            arr = np.frombuffer(data[b:e], dtype=np.dtype(DTYPES[v["dtype"]]).newbyteorder("<"))
        out[name] = torch.from_numpy(arr.astype(np.float32).reshape(v["shape"]).copy())
    return out


def load_weights(hf_dir):
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        weight_map = json.load(open(index))["weight_map"]
        files = sorted(set(weight_map.values()))
    tensors = {}
    for f in files:
        part = parse_safetensors(os.path.join(hf_dir, f))
        for k in part:
            if k in tensors:
                fail(f"{k} is in two files")
        tensors.update(part)
    try:
        from safetensors.torch import load_file
    except ImportError:
        print("  safetensors library: not installed here; this file's own parser only")
        return tensors
    lib = {}
    for f in files:
        lib.update({k: v.float() for k, v in load_file(os.path.join(hf_dir, f)).items()})
    if sorted(lib) != sorted(tensors) or any(not torch.equal(lib[k], tensors[k]) for k in lib):
        fail("the safetensors library and this file's parser read different tensors")
    print(f"  safetensors library: read the same {len(lib)} tensors as this file's parser")
    return tensors


class Llama(torch.nn.Module):
    """transformers' Llama / Qwen2 / Qwen3 / Mistral ForCausalLM forward, with HF's parameter names."""

    capacity_factor, groups, dropped = 0.0, 1, 0  # experts' capacity (run() sets them)
    bias = None  # --bias-update: each sparse layer's routing bias [E], by its name prefix

    def __init__(self, cfg, tensors):
        super().__init__()
        self.cfg = cfg
        self.params = torch.nn.ParameterDict({k.replace(".", "/"): torch.nn.Parameter(v.clone()) for k, v in tensors.items()})
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.inv_freq = self.rope_inv_freq()

    def w(self, name):
        return self.params[name.replace(".", "/")]

    def has(self, name):
        return name.replace(".", "/") in self.params

    def rope_inv_freq(self, local=False):
        cfg, dim = self.cfg, self.hd
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        base = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if local:  # Gemma 3's sliding layers: their own base, no scaling
            base, rope = cfg["rope_local_base_freq"], {}
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if rope.get("rope_type", rope.get("type")) == "linear":
            inv_freq = inv_freq / rope["factor"]
        if rope.get("rope_type", rope.get("type")) == "llama3":
            factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
            old = rope["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old / low, old / high
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
            smooth = (old / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            inv_freq = torch.where(medium, smoothed, scaled)
        return inv_freq

    def rms(self, x, name):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"])
        if self.cfg["model_type"] in ("gemma2", "gemma3_text"):  # GemmaRMSNorm: (1 + w) in fp32, then the input's dtype
            return (h * (1.0 + self.w(name).float())).type_as(x)
        return self.w(name) * h.to(x.dtype)

    def linear(self, x, name):
        b = self.w(name + ".bias") if self.has(name + ".bias") else None
        return F.linear(x, self.w(name + ".weight"), b)

    def swiglu(self, h, p, gemma=False):
        gate = self.linear(h, p + "gate_proj")
        gate = F.gelu(gate, approximate="tanh") if gemma else F.silu(gate)
        return self.linear(gate * self.linear(h, p + "up_proj"), p + "down_proj")

    def experts(self):
        """The experts per sparse layer and per token (MixtralConfig: num_local_experts, default 8 and 2;
        Qwen3MoeConfig: num_experts, 128 and 8)."""
        if self.cfg["model_type"] == "mixtral":
            return self.cfg.get("num_local_experts", 8), self.cfg.get("num_experts_per_tok", 2)
        if self.cfg["model_type"] == "olmoe":  # OlmoeConfig
            return self.cfg.get("num_experts", 64), self.cfg.get("num_experts_per_tok", 8)
        return self.cfg.get("num_experts", 128), self.cfg.get("num_experts_per_tok", 8)

    def sparse(self, i):
        """MixtralDecoderLayer: every layer's MLP is block_sparse_moe. Qwen3MoeDecoderLayer: the
        experts' block unless mlp_only_layers names the layer or decoder_sparse_step skips it."""
        cfg = self.cfg
        if cfg["model_type"] in ("mixtral", "olmoe"):  # every layer's MLP is the sparse block
            return True
        return (cfg["model_type"] == "qwen3_moe" and i not in (cfg.get("mlp_only_layers") or [])
                and cfg.get("num_experts", 128) > 0 and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0)

    def sparse_moe(self, h, p):
        """Qwen3MoeSparseMoeBlock and MixtralSparseMoeBlock: the router's softmax in fp32, top k,
        renormalised (Qwen3-MoE: with norm_topk_prob; Mixtral: always), cast back; each expert's
        tokens through it (Mixtral's w2(silu(w1 x) * w3 x)), times their weight, added per token in
        expert order."""
        cfg = self.cfg
        E, k = self.experts()
        mixtral = cfg["model_type"] == "mixtral"
        B, T, C = h.shape
        x = h.reshape(-1, C)
        logits = F.linear(x, self.w(p + "gate.weight"))
        self.router_logits.append(logits)
        weights = F.softmax(logits, dim=1, dtype=torch.float)
        if self.bias is not None:  # aux-loss-free balancing: the bias chooses, the probabilities weigh
            _, chosen = torch.topk(weights.detach() + self.bias.setdefault(p, torch.zeros(E)), k, dim=-1)
            weights = weights.gather(-1, chosen)
        else:
            weights, chosen = torch.topk(weights, k, dim=-1)
        self.chosen.append(chosen)
        if mixtral or cfg.get("norm_topk_prob", False):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(chosen, num_classes=E).permute(2, 1, 0)  # [E, k, tokens]
        for e in range(E):
            slot, token = torch.where(mask[e])
            if self.capacity_factor > 0:  # Megatron's capacity, first come first served by position,
                # per group of the batch (each data-parallel rank's forward): the rest of an expert's
                # copies dropped (they add nothing; the kept weights are not renormalised)
                order = torch.argsort(token, stable=True)
                slot, token = slot[order], token[order]
                n = x.shape[0] // self.groups
                cap = math.ceil(self.capacity_factor * n * k / E)
                keep = torch.zeros_like(token, dtype=torch.bool)
                for g in range(self.groups):
                    keep[torch.nonzero(token // n == g).flatten()[:cap]] = True
                self.dropped += int((~keep).sum())
                slot, token = slot[keep], token[keep]
            if mixtral:
                xe, q = x[token], f"{p}experts.{e}."
                y = self.linear(F.silu(self.linear(xe, q + "w1")) * self.linear(xe, q + "w3"), q + "w2")
            else:
                y = self.swiglu(x[token], f"{p}experts.{e}.")
            y = y * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out.reshape(B, T, C)

    def aux_loss(self, groups=1):
        """transformers' load_balancing_loss_func (no attention mask): every sparse layer's router logits
        concatenated, the share of the top-k choices per expert times its mean probability, times E;
        with `groups` > 1 the mean of that over consecutive groups of the batch's sequences, each
        computed alone (what each of `groups` data-parallel ranks computes on its share, as
        transformers' forward under DDP does)."""
        if groups > 1:
            per = [torch.chunk(l, groups, dim=0) for l in self.router_logits]
            chosen = [torch.chunk(c, groups, dim=0) for c in self.chosen]
            return sum(self.aux_of([p[g] for p in per], [c[g] for c in chosen]) for g in range(groups)) / groups
        return self.aux_of(self.router_logits, self.chosen)

    def aux_of(self, router_logits, chosen):
        """(The choices are those the layers made: transformers' top k of the probabilities, or with
        a routing bias the biased ones.)"""
        E, k = self.experts()
        logits = torch.cat(router_logits, dim=0)
        probs = F.softmax(logits, dim=-1)
        chosen = torch.cat(chosen, dim=0)
        tokens_per_expert = F.one_hot(chosen, E).float().mean(dim=0)
        return (tokens_per_expert * probs.mean(dim=0).unsqueeze(0)).sum() * E

    def forward(self, idx):
        cfg, hd = self.cfg, self.hd
        self.router_logits, self.chosen = [], []
        B, T = idx.shape
        H, KV = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        pos = torch.arange(T).float()

        def tables(inv_freq):
            freqs = pos[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos(), emb.sin()

        gemma3 = cfg["model_type"] == "gemma3_text"
        global_rope = tables(self.inv_freq)
        local_rope = tables(self.rope_inv_freq(local=True)) if gemma3 else global_rope

        def rotate_half(x):
            x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
            return torch.cat((-x2, x1), dim=-1)

        gemma = cfg["model_type"] in ("gemma2", "gemma3_text")
        causal = torch.full((T, T), float("-inf")).triu(1)
        window = cfg.get("sliding_window") if cfg["model_type"] in ("mistral", "mixtral", "gemma2", "gemma3_text") else None
        if gemma3:  # which layers slide: layer_types (transformers >= 4.53) or the pattern
            types = cfg.get("layer_types") or ["full_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6) == 0
                                               else "sliding_attention" for i in range(cfg["num_hidden_layers"])]
            sliding = [t == "sliding_attention" for t in types]
        else:
            sliding = [i % 2 == 0 for i in range(cfg["num_hidden_layers"])]  # Gemma 2: layers 0, 2, ...
        # Mistral (every layer) and Gemma 2 (layers 0, 2, ...): keys more than window - 1 positions back are masked too
        windowed = causal + torch.full((T, T), float("-inf")).tril(-window) if window else causal
        scaling = cfg["query_pre_attn_scalar"] ** -0.5 if gemma else 1 / math.sqrt(hd)
        attn_cap, final_cap = cfg.get("attn_logit_softcapping"), cfg.get("final_logit_softcapping")
        x = F.embedding(idx, self.w("model.embed_tokens.weight"))
        if gemma:
            x = x * torch.tensor(cfg["hidden_size"] ** 0.5, dtype=x.dtype)
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            mask = windowed if not gemma or sliding[i] else causal
            cos, sin = local_rope if gemma3 and sliding[i] else global_rope
            h = self.rms(x, p + "input_layernorm.weight")
            q = self.linear(h, p + "self_attn.q_proj")
            k = self.linear(h, p + "self_attn.k_proj")
            if cfg["model_type"] == "olmoe":  # OlmoeAttention: q_norm and k_norm over the whole projections
                q, k = self.rms(q, p + "self_attn.q_norm.weight"), self.rms(k, p + "self_attn.k_norm.weight")
            q, k = q.view(B, T, H, hd), k.view(B, T, KV, hd)
            if cfg["model_type"] != "olmoe" and self.has(p + "self_attn.q_norm.weight"):  # Qwen3, Gemma 3: each head normalised, then rotated
                q, k = self.rms(q, p + "self_attn.q_norm.weight"), self.rms(k, p + "self_attn.k_norm.weight")
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = self.linear(h, p + "self_attn.v_proj").view(B, T, KV, hd).transpose(1, 2)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            k = k[:, :, None].expand(B, KV, H // KV, T, hd).reshape(B, H, T, hd)  # repeat_kv
            v = v[:, :, None].expand(B, KV, H // KV, T, hd).reshape(B, H, T, hd)
            if gemma:
                att = (q @ k.transpose(2, 3)) * scaling
                if attn_cap:
                    att = torch.tanh(att / attn_cap) * attn_cap
                att = att + mask
            else:
                att = (q @ k.transpose(2, 3)) / math.sqrt(hd) + mask
            y = (att.float().softmax(-1).to(q.dtype) @ v).transpose(1, 2).reshape(B, T, H * hd)
            y = self.linear(y, p + "self_attn.o_proj")
            if gemma:
                y = self.rms(y, p + "post_attention_layernorm.weight")
            x = x + y
            h = self.rms(x, p + ("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight"))
            if self.sparse(i):
                y = self.sparse_moe(h, p + ("block_sparse_moe." if cfg["model_type"] == "mixtral" else "mlp."))
            else:
                y = self.swiglu(h, p + "mlp.", gemma)
            if gemma:
                y = self.rms(y, p + "post_feedforward_layernorm.weight")
            x = x + y
        x = self.rms(x, "model.norm.weight")
        head = self.w("lm_head.weight") if self.has("lm_head.weight") else self.w("model.embed_tokens.weight")
        logits = F.linear(x, head)
        if gemma and final_cap:
            logits = torch.tanh(logits / final_cap) * final_cap
        return logits


def parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["logits", "train", "list"],
                    help="list: hf_dir is a file of lines 'NAME MODE HF_DIR TOKENS ...' (this command's arguments "
                         "after the name), tokens an output directory: each line's run has its output in NAME.out "
                         "and its exit status in NAME.rc, all in this one process (importing torch once)")
    ap.add_argument("hf_dir")
    ap.add_argument("tokens")
    ap.add_argument("logits", nargs="?")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--min-lr", type=float, default=6e-5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--aux-groups", type=int, default=1,
                    help="train, Qwen3-MoE: the load-balancing loss per this many groups of the batch (data-parallel ranks)")
    ap.add_argument("--capacity-factor", type=float, default=0,
                    help="train, experts: each expert takes at most ceil(f x tokens x k / experts) of each group's "
                         "copies (--aux-groups), the first by position; 0: dropless")
    ap.add_argument("--z-loss", type=float, default=0,
                    help="router z-loss coefficient (ST-MoE): times the mean over every sparse layer's tokens "
                         "of logsumexp(router logits)^2")
    ap.add_argument("--bias-update", type=float, default=0,
                    help="aux-loss-free balancing (DeepSeek-V3): a routing bias per sparse layer for the top-k "
                         "choice, after each step += rate x sign(mean load - load), centred; 0: none")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: CPU autocast")
    ap.add_argument("--timing-warmup", type=int, default=0,
                    help="train: also print the median ms/step of the steps after this many (bench/cpu_vs_pytorch.sh)")
    return ap


def main():
    args = parser().parse_args()
    if args.mode != "list":
        run(args)
        return
    import contextlib, io, shlex
    os.makedirs(args.tokens, exist_ok=True)
    for line in open(args.hf_dir):
        if not line.strip():
            continue
        name, *words = shlex.split(line)
        out, rc = io.StringIO(), 0
        with contextlib.redirect_stdout(out):
            try:
                run(parser().parse_args(words))
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
            except Exception:  # this line's failure, not the others'
                import traceback
                traceback.print_exc(file=out)
                rc = 1
        open(os.path.join(args.tokens, name + ".out"), "w").write(out.getvalue())
        open(os.path.join(args.tokens, name + ".rc"), "w").write(f"{rc}\n")


def run(args):
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as mpitrain does for fp32 on the CPU

    cfg = json.load(open(os.path.join(args.hf_dir, "config.json")))
    arch = cfg["architectures"][0]
    types = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
             "MistralForCausalLM": "mistral", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
             "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral", "OlmoeForCausalLM": "olmoe"}
    if arch not in types:
        fail(f"config.json architectures {arch}")
    if cfg.get("model_type") != types[arch]:
        fail(f"config.json: {arch} with model_type {cfg.get('model_type')}")
    tensors = load_weights(args.hf_dir)
    tied = cfg.get("tie_word_embeddings", False)
    if tied == ("lm_head.weight" in tensors):
        fail(f"tie_word_embeddings {tied} but lm_head.weight {'present' if 'lm_head.weight' in tensors else 'absent'}")
    qkv_bias = "model.layers.0.self_attn.q_proj.bias" in tensors
    if qkv_bias != (arch == "Qwen2ForCausalLM"):
        fail(f"{arch} with q_proj.bias {'present' if qkv_bias else 'absent'}")
    qk_norm = "model.layers.0.self_attn.q_norm.weight" in tensors
    if qk_norm != (arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")):
        fail(f"{arch} with q_norm {'present' if qk_norm else 'absent'}")
    model = Llama(cfg, tensors)
    model.capacity_factor, model.groups, model.dropped = args.capacity_factor, args.aux_groups, 0
    model.bias = {} if args.bias_update > 0 else None
    print(f"  {arch}: {len(tensors)} tensors, {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads / "
          f"{cfg.get('num_key_value_heads')} kv heads of {model.hd}, rope_scaling {cfg.get('rope_scaling')}, tied {tied}"
          + (f", sliding_window {cfg.get('sliding_window')}" if arch != "LlamaForCausalLM" and "Qwen" not in arch else "")
          + (f", soft caps {cfg.get('attn_logit_softcapping')} / {cfg.get('final_logit_softcapping')}, query_pre_attn_scalar "
             f"{cfg.get('query_pre_attn_scalar')}, {cfg.get('hidden_activation')}" if "Gemma" in arch else "")
          + (f", rope_local_base_freq {cfg.get('rope_local_base_freq')}, layer_types {cfg.get('layer_types')}"
             if arch == "Gemma3ForCausalLM" else "")
          + (f", {model.experts()[0]} experts, top {model.experts()[1]}, norm_topk_prob "
             f"{cfg.get('norm_topk_prob')}, aux coef {cfg.get('router_aux_loss_coef')}" if "Moe" in arch or "Mixtral" in arch or "Olmoe" in arch else ""))
    if cfg.get("clip_qkv") is not None:
        fail(f"clip_qkv {cfg['clip_qkv']}: not written here")
    if "Gemma" in arch and "model.layers.0.post_feedforward_layernorm.weight" not in tensors:
        fail(f"{arch} without post_feedforward_layernorm")

    if args.mode == "logits":
        tokens = torch.from_numpy(np.load(args.tokens).astype(np.int64))
        ours = torch.from_numpy(np.load(args.logits))
        with torch.no_grad():
            ref = model(tokens)
        if ref.shape != ours.shape:
            fail(f"logits shape {tuple(ref.shape)} vs mpitrain's {tuple(ours.shape)}")
        diff = (ref - ours).abs().max().item()
        scale = ref.abs().max().item()
        bound = 1e-5 * scale + 1e-6
        print(f"  logits: max |delta| {diff:.3g} (max |logit| {scale:.3g}, bound {bound:.3g})")
        if not diff <= bound:
            fail(f"logits differ by {diff} > {bound}")
        return

    data = torch.from_numpy(np.load(args.tokens).astype(np.int64))
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    B, T = args.batch, args.seq_len
    losses, step_ms = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        batch = torch.stack([data[(step * B + i) * T:(step * B + i) * T + T + 1] for i in range(B)])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.min_lr, args.warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))
        if model.router_logits:  # Qwen3MoeForCausalLM with output_router_logits: loss + coef x aux
            loss = loss + cfg.get("router_aux_loss_coef", 0.001) * model.aux_loss(args.aux_groups)
            if args.z_loss > 0:
                lse = torch.cat([torch.logsumexp(l.float(), dim=-1) for l in model.router_logits])
                loss = loss + args.z_loss * (lse ** 2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if model.bias is not None:  # torchtitan's _update_expert_bias over the whole batch's choices
            E = model.experts()[0]
            for (name, b), chosen in zip(list(model.bias.items()), model.chosen):
                load = torch.bincount(chosen.reshape(-1), minlength=E).float()
                delta = args.bias_update * torch.sign(load.mean() - load)
                model.bias[name] = b + (delta - delta.mean())
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step_ms.append(1e3 * (time.perf_counter() - t0))
    out = {"losses": losses}
    if args.capacity_factor > 0:
        out["dropped"] = model.dropped
    if model.bias:
        out["max_bias"] = max(b.abs().max().item() for b in model.bias.values())
    if args.timing_warmup:
        timed = sorted(step_ms[args.timing_warmup:])
        out["median_ms_per_step"] = timed[len(timed) // 2]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
