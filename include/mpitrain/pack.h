// `mpitrain pack`: text and JSON Lines (byte, GPT-2 BPE or Hugging Face tokenizer.json) and token arrays (nanoGPT .bin, llm.c .bin,
// .npy, Megatron-LM .bin + .idx) into HDF5 token shards with a per-document train/val split. Collective over an MPI
// communicator: ranks share the input, and the shards are the same whatever the number of ranks
// (docs/pack.md).
#pragma once

#include "mpitrain/mpi_ops.h"

#include <cstdint>
#include <string>
#include <vector>

namespace mpitrain {

struct PackOptions {
  std::vector<std::string> inputs;    // files or directories (regular files, recursively)
  std::string output_prefix;          // shards are <prefix>-<split>-<index:05>.h5
  std::string format = "auto";        // auto | text | jsonl | nanogpt | llmc | npy | megatron (auto: by name)
  std::string tokenizer;              // byte | gpt2 | hf; "" = byte for text (token arrays: below)
  std::string bpe_dir;                // gpt2: vocab.json + merges.txt or encoder.json + vocab.bpe
  std::string bpe_vocab, bpe_merges;  // gpt2: the two files named directly (instead of bpe_dir)
  std::string tokenizer_file;         // hf: a Hugging Face tokenizer.json (byte-level BPE)
  // hf: special added tokens written in the text: "text" (also ""; plain text) or "match" (their
  // ids, as Hugging Face's encode gives them).
  std::string special_tokens;
  std::string text_key = "text";      // jsonl: the key of each line's text
  // Token-array inputs: every token must be < vocab_size; documents start at each eot. 0 / -1
  // mean the tokenizer's values, and without a tokenizer GPT-2's (50257 / 50256). hf: eot_token
  // overrides the file's document separator.
  int64_t vocab_size = 0;
  int64_t eot_token = -1;
  std::string doc_separator;            // text: a line holding exactly this splits documents
  double val_fraction = 0.05;           // share of documents that go to val, [0, 1)
  uint64_t shard_tokens = 100'000'000;  // tokens per shard, > 0
  uint64_t seed = 0;                    // seeds the per-document train/val choice
};

struct PackResult {
  std::vector<std::string> train_shards;
  std::vector<std::string> val_shards;
  uint64_t documents = 0;
  uint64_t train_tokens = 0;
  uint64_t val_tokens = 0;
  int64_t vocab_size = 0;
  int64_t eot_token = -1;
  std::string tokenizer;
  // Nats per token of the train split's token frequencies; NaN when the vocabulary is too large
  // to count densely (> 2^22).
  double train_unigram_entropy = 0;
};

// The byte tokenizer: vocab 257, token = byte value, end-of-text = 256.
constexpr int64_t kByteVocab = 257;
constexpr int64_t kByteEot = 256;
// GPT-2's vocabulary: the defaults for token arrays.
constexpr int64_t kGpt2Vocab = 50257;
constexpr int64_t kGpt2Eot = 50256;

// Packs on every rank of `comm` (collective; MPI_COMM_SELF packs alone). Every document becomes
// EOT followed by its tokens (text, and a Megatron index's documents), or keeps its tokens as they
// are (token arrays, whose documents start at their EOTs); /doc_offsets records each EOT. A document goes to val when
// hash(seed, global document index) < val_fraction. Bad input is a UsageError naming the file,
// thrown on every rank with the same message.
PackResult pack(const PackOptions& opts, MpiComm comm);

// pack(opts, MPI_COMM_SELF).
PackResult pack_text(const PackOptions& opts);

}  // namespace mpitrain
