#!/usr/bin/python3
"""Multiple-choice tasks scored without mpitrain's code: lm-evaluation-harness's loglikelihood
scoring (acc and acc_norm) in PyTorch, on an exported Hugging Face directory (config.json +
model.safetensors), with the byte tokenizer (a string's tokens are its UTF-8 bytes, ids 0..255).

  mc_reference.py HF_DIR TASK.jsonl [TASK2.jsonl ...] --seq-len N [--limit K] [--out scores.json] [--threads 1]

The model is one of this directory's independent references, chosen by config.json:
  model_type "gpt2" / GPT2LMHeadModel        -> hf_gpt2_reference.gpt2_logits
  the Llama family (LlamaForCausalLM, Qwen2/Qwen3, Mistral, Gemma 2/3, Qwen3-MoE, Mixtral, OLMoE)
                                             -> llama_reference.Llama

Task files are JSON Lines (blank lines skipped), each line one of
  HellaSwag form: ctx (or ctx_a + ctx_b), endings [str, ...], label (int or digit string),
                  optional activity_label; preprocessed as lm-evaluation-harness's hellaswag task:
                    preprocess(t) = re.sub(r"\\[.*?\\]", "", t.strip().replace(" [title]", ". ")).replace("  ", " ")
                    ctx   = ctx_a + " " + ctx_b.capitalize()   if ctx_a is given, else ctx
                    query = preprocess(activity_label + ": " + ctx)  if activity_label is given, else preprocess(ctx)
                    choices = [preprocess(e) for e in endings], answer = int(label)
  generic form:   context str, choices [str, ...], answer int (used as they are).
A line that is neither, has a wrong type, an answer out of range or fewer than 2 choices:
"FILE:LINE: what is wrong" on stderr, exit 2 (every line of every file is checked, --limit or not).

Scoring, per example and choice i:
  ctx  = list(context.encode("utf-8")), cont = list((" " + choice_i).encode("utf-8"))
  seq  = (ctx + cont)[-(seq_len + 1):]; inputs = seq[:-1]; targets = seq[1:]
  n    = min(len(cont), len(targets))
  score_i = sum over the last n positions t of log_softmax(float64(logits[t]))[targets[t]]
            (log softmax over every logit the model outputs, i.e. the config's whole vocab_size)
  acc      = mean over examples of [argmax_i score_i == answer]
  acc_norm = mean over examples of [argmax_i score_i / len(cont_i) == answer]
  (argmax: numpy's, ties to the lowest index). --limit K: each file's first K examples (0: all).

Prints "TASK acc A acc_norm B examples N" per file (TASK = the file's stem); --out writes
{TASK: {"acc": A, "acc_norm": B, "examples": N, "scores": [[s_0, s_1, ...], ...]}} (float64, file order).
"""
import argparse
import contextlib
import json
import os
import re
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

LLAMA_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
               "MistralForCausalLM": "mistral", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
               "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral", "OlmoeForCausalLM": "olmoe"}


class TaskError(Exception):
    pass


def die(msg, code=2):
    print(msg, file=sys.stderr)
    sys.exit(code)


# ---------------------------------------------------------------- tasks

def preprocess(text):
    """lm-evaluation-harness tasks/hellaswag/utils.py preprocess."""
    text = text.strip()
    # NOTE: Brackets are artifacts of the WikiHow dataset portion of HellaSwag.
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def is_str_list(v):
    return isinstance(v, list) and all(isinstance(s, str) for s in v)


def parse_example(obj):
    """(context, choices, answer) of one decoded line; TaskError says what is wrong."""
    if not isinstance(obj, dict):
        raise TaskError(f"not a JSON object but {type(obj).__name__}")
    if "endings" in obj:  # HellaSwag
        endings = obj["endings"]
        if not is_str_list(endings):
            raise TaskError("endings is not a list of strings")
        if "ctx_a" in obj:
            if not isinstance(obj["ctx_a"], str):
                raise TaskError("ctx_a is not a string")
            if "ctx_b" not in obj:
                raise TaskError("ctx_a without ctx_b")
            if not isinstance(obj["ctx_b"], str):
                raise TaskError("ctx_b is not a string")
            ctx = obj["ctx_a"] + " " + obj["ctx_b"].capitalize()
        elif "ctx" in obj:
            if not isinstance(obj["ctx"], str):
                raise TaskError("ctx is not a string")
            ctx = obj["ctx"]
        else:
            raise TaskError("HellaSwag form (endings) without ctx or ctx_a + ctx_b")
        if obj.get("activity_label") is not None:
            if not isinstance(obj["activity_label"], str):
                raise TaskError("activity_label is not a string")
            query = preprocess(obj["activity_label"] + ": " + ctx)
        else:
            query = preprocess(ctx)
        if "label" not in obj:
            raise TaskError("HellaSwag form (endings) without label")
        label = obj["label"]
        if isinstance(label, bool) or not isinstance(label, (int, str)):
            raise TaskError(f"label is {type(label).__name__}, not an int or a digit string")
        if isinstance(label, str):
            if not re.fullmatch("[0-9]+", label):
                raise TaskError(f"label {label!r} is not a digit string")
            label = int(label)
        context, choices, answer = query, [preprocess(e) for e in endings], label
        what = "endings"
    elif "choices" in obj:  # generic
        if "context" not in obj or not isinstance(obj["context"], str):
            raise TaskError("context missing or not a string")
        if not is_str_list(obj["choices"]):
            raise TaskError("choices is not a list of strings")
        if "answer" not in obj:
            raise TaskError("answer missing")
        answer = obj["answer"]
        if isinstance(answer, bool) or not isinstance(answer, int):
            raise TaskError(f"answer is {type(answer).__name__}, not an int")
        context, choices = obj["context"], obj["choices"]
        what = "choices"
    else:
        raise TaskError("neither HellaSwag form (ctx/ctx_a+ctx_b, endings, label) "
                        "nor generic form (context, choices, answer)")
    if len(choices) < 2:
        raise TaskError(f"{len(choices)} {what}: at least 2 wanted")
    if not 0 <= answer < len(choices):
        raise TaskError(f"answer {answer} out of range for {len(choices)} {what}")
    return context, choices, answer


def read_task(path):
    examples = []
    try:
        with open(path, "rb") as f:
            raw_lines = f.read().split(b"\n")
    except OSError as e:
        die(f"{path}: {e.strerror}")
    for no, raw in enumerate(raw_lines, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            die(f"{path}:{no}: not UTF-8 ({e.reason} at byte {e.start})")
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            die(f"{path}:{no}: not JSON ({e.msg} at column {e.colno})")
        try:
            examples.append(parse_example(obj))
        except TaskError as e:
            die(f"{path}:{no}: {e}")
    return examples


# ---------------------------------------------------------------- models

def load_model(hf_dir, seq_len):
    """A function tokens [B, T] (int64 tensor) -> fp32 logits [B, T, V] (tensor)."""
    try:
        cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    except (OSError, json.JSONDecodeError) as e:
        die(f"{hf_dir}/config.json: {e}", 1)
    arch = (cfg.get("architectures") or [None])[0]
    mtype = cfg.get("model_type")
    with contextlib.redirect_stdout(sys.stderr):  # the references' progress lines are not our output
        if mtype == "gpt2" or arch == "GPT2LMHeadModel":
            import hf_gpt2_reference as g
            _, w = g.read_safetensors(os.path.join(hf_dir, "model.safetensors"))
            if "transformer.wte.weight" not in w and "wte.weight" in w:  # transformers' own files: no prefix
                w = {"transformer." + k: v for k, v in w.items()}
            cfg = dict(cfg)
            cfg.setdefault("tie_word_embeddings", True)  # GPT2Config's default
            cfg.setdefault("activation_function", "gelu_new")
            cfg.setdefault("layer_norm_epsilon", 1e-5)
            n_pos = w["transformer.wpe.weight"].shape[0]
            if seq_len > n_pos:
                die(f"--seq-len {seq_len} > the model's {n_pos} positions", 1)
            w = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in w.items()}
            print(f"  GPT-2 (hf_gpt2_reference): {cfg['n_layer']} layers, {cfg['n_head']} heads, "
                  f"n_embd {cfg['n_embd']}, vocab {w['transformer.wte.weight'].shape[0]}")
            return lambda idx: torch.from_numpy(g.gpt2_logits(cfg, w, idx.numpy()))
        if arch in LLAMA_ARCHS:
            if mtype != LLAMA_ARCHS[arch]:
                die(f"config.json: {arch} with model_type {mtype}", 1)
            if cfg.get("clip_qkv") is not None:
                die(f"config.json clip_qkv {cfg['clip_qkv']}: not in llama_reference", 1)
            import llama_reference as lr
            tensors = lr.load_weights(hf_dir)
            model = lr.Llama(cfg, tensors).eval()
            max_pos = cfg.get("max_position_embeddings")
            if max_pos and seq_len > max_pos:
                print(f"  warning: --seq-len {seq_len} > max_position_embeddings {max_pos}")
            print(f"  {arch} (llama_reference): {len(tensors)} tensors, {cfg['num_hidden_layers']} layers")
            return model
    die(f"{hf_dir}/config.json: model_type {mtype!r}, architectures {cfg.get('architectures')!r}: "
        f"neither gpt2 nor one of {sorted(LLAMA_ARCHS)}", 1)


def score_example(model, context, choices, seq_len):
    """Each choice's summed log-likelihood (float64) of its continuation given the context."""
    ctx = list(context.encode("utf-8"))
    rows, spans = [], []
    for c in choices:
        cont = list((" " + c).encode("utf-8"))
        seq = (ctx + cont)[-(seq_len + 1):]
        inputs, targets = seq[:-1], seq[1:]
        n = min(len(cont), len(targets))
        rows.append((inputs, targets))
        spans.append(n)
    T = max(len(i) for i, _ in rows)
    if T == 0:  # a one-token sequence: no target to score
        return [0.0 for _ in choices]
    idx = torch.zeros((len(rows), T), dtype=torch.int64)  # padded on the right: causal, so no effect on the rest
    for r, (inputs, _) in enumerate(rows):
        idx[r, :len(inputs)] = torch.tensor(inputs, dtype=torch.int64)
    logits = model(idx)
    scores = []
    for r, ((inputs, targets), n) in enumerate(zip(rows, spans)):
        L = len(inputs)
        lp = torch.log_softmax(logits[r, L - n:L].to(torch.float64), dim=-1)
        tgt = torch.tensor(targets[L - n:], dtype=torch.int64)
        scores.append(float(lp.gather(-1, tgt[:, None]).sum()))
    return scores


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir")
    ap.add_argument("tasks", nargs="+", metavar="TASK.jsonl")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--limit", type=int, default=0, help="each file's first K examples (0: all)")
    ap.add_argument("--out", help="JSON file: per task acc, acc_norm, examples and every example's scores")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    if args.seq_len < 1:
        die("--seq-len must be at least 1")
    if args.limit < 0:
        die("--limit must be >= 0")
    torch.set_num_threads(args.threads)

    tasks = {}
    for path in args.tasks:  # all files checked before the model is loaded
        name = os.path.splitext(os.path.basename(path))[0]
        if name in tasks:
            die(f"{path}: task name {name} given twice")
        examples = read_task(path)
        tasks[name] = examples[:args.limit] if args.limit > 0 else examples

    model = load_model(args.hf_dir, args.seq_len)
    torch.set_flush_denormal(True)  # as mpitrain does for fp32 on the CPU (and llama_reference); after the
    # imports, whose numpy limits would warn about it
    if isinstance(model, torch.nn.Module):
        model.eval()
    out = {}
    with torch.no_grad():
        for name, examples in tasks.items():
            all_scores, hits, hits_norm = [], 0, 0
            for context, choices, answer in examples:
                scores = score_example(model, context, choices, args.seq_len)
                lens = [len((" " + c).encode("utf-8")) for c in choices]
                s = np.array(scores, dtype=np.float64)
                hits += int(np.argmax(s)) == answer
                hits_norm += int(np.argmax(s / np.array(lens, dtype=np.float64))) == answer
                all_scores.append(scores)
            n = len(examples)
            acc = hits / n if n else 0.0
            acc_norm = hits_norm / n if n else 0.0
            print(f"{name} acc {acc:.6f} acc_norm {acc_norm:.6f} examples {n}", flush=True)
            out[name] = {"acc": acc, "acc_norm": acc_norm, "examples": n, "scores": all_scores}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f)
            f.write("\n")


if __name__ == "__main__":
    main()
