// `mpitrain pack`: text files into byte-level HDF5 token shards with a train/val split.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mpitrain {

struct PackOptions {
  std::vector<std::string> inputs;  // text files or directories (regular files, recursively)
  std::string output_prefix;        // shards are <prefix>-<split>-<index:05>.h5
  std::string doc_separator;        // a line holding exactly this splits documents ("" = file)
  double val_fraction = 0.05;       // share of documents that go to val, [0, 1)
  uint64_t shard_tokens = 100'000'000;  // tokens per shard, > 0
  uint64_t seed = 0;                // seeds the per-document train/val choice
};

struct PackResult {
  std::vector<std::string> train_shards;
  std::vector<std::string> val_shards;
  uint64_t documents = 0;
  uint64_t train_tokens = 0;
  uint64_t val_tokens = 0;
  double train_unigram_entropy = 0;  // nats per token of the train split's token frequencies
};

// The byte tokenizer: vocab 257, token = byte value, end-of-text = 256.
constexpr int64_t kByteVocab = 257;
constexpr int64_t kByteEot = 256;

// Packs with the byte tokenizer: each document becomes EOT followed by its bytes; /doc_offsets
// records where each document's EOT is. Bad inputs (missing files, empty directories, no
// documents) are UsageError naming the path.
PackResult pack_text(const PackOptions& opts);

}  // namespace mpitrain
