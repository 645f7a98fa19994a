#!/usr/bin/env python3
# Writes the small tokenizer.json fixtures of tests/test_hf_tokenizer.cpp (run here; the output is
# committed): the 256 byte symbols of GPT-2's alphabet as ids 0..255, a few merges, and
#   pairs.json    merges as ["a", "b"] pairs (the newer format), NFC normalizer, Llama-3-style Split
#   strings.json  the same merges as "a b" strings (the older format)
#   wide.json     pairs.json with "<|endoftext|>" at id 70000: vocab 70001, uint32 shards
import json

def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}

sym = bytes_to_unicode()
vocab = {sym[b]: b for b in range(256)}
merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"),
          ("l", "d"), ("Ġwor", "ld"), ("Ġ", "Ġ"), ("Ã", "©"), ("a", "-"), ("-", "b"), ("-", "-")]
for a, b in merges:
    vocab[a + b] = len(vocab)
vocab["Ġxyz"] = len(vocab)  # reachable only through ignore_merges (no merges make it)
pattern = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
           "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")

def tokenizer(merge_list, eot_id):
    return {
        "version": "1.0",
        "added_tokens": [{"id": eot_id, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merge_list},
    }

def write(name, t):
    with open(name, "w", encoding="utf-8") as f:
        json.dump(t, f, ensure_ascii=False, indent=1)
        f.write("\n")

write("pairs.json", tokenizer([list(m) for m in merges], len(vocab)))
write("strings.json", tokenizer([a + " " + b for a, b in merges], len(vocab)))
write("wide.json", tokenizer([list(m) for m in merges], 70000))
