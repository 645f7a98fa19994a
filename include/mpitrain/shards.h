// HDF5 token shards (format v1, docs/formats.md) and the reader that feeds training:
// a deterministic global order of training windows, of which each rank reads its own slice.
//
// A window is seq_len+1 consecutive tokens of one shard (inputs and shifted targets); shard i
// holds (num_tokens_i - 1) / seq_len windows, window j starting at token j*seq_len.
// The order of windows is a function of (seed, shard list, seq_len) only: epoch e is a seeded
// pseudo-random permutation (a Feistel bijection, O(1) memory) of all windows. The cursor saved in
// checkpoints is the global count of windows consumed, so resume is exact on any world size.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

namespace mpitrain {

constexpr const char* kShardFormat = "mpitrain-tokens";
constexpr int64_t kShardVersion = 1;

struct ShardMeta {
  int64_t vocab_size = 0;
  int64_t eot_token = -1;
  std::string tokenizer = "byte";  // byte | gpt2 | hf | unknown
  std::string source;              // free text
  // hf: the tokenizer.json the text was encoded with, as named to pack, and the SHA-256 of its
  // bytes (lower-case hex). Empty: not written (other tokenizers) or not present (older shards).
  std::string tokenizer_file;
  std::string tokenizer_sha256;
  // hf: how special added tokens written in the text were encoded (pack --special-tokens): "" =
  // as plain text (the default; attribute absent), "match" = as their ids. Shards packed both ways
  // are refused together.
  std::string special_tokens;
};

// Writes one shard: /tokens (uint16 if vocab_size <= 65536, else uint32; contiguous),
// /doc_offsets (uint64, when non-empty) and the root attributes. Tokens >= vocab_size are a
// UsageError. Written to `path + ".tmp"` then renamed, so a reader never sees half a shard.
void write_shard(const std::string& path, const std::vector<uint32_t>& tokens,
                 const std::vector<uint64_t>& doc_offsets, const ShardMeta& meta);

struct ShardInfo {
  std::string path;
  ShardMeta meta;
  uint64_t num_tokens = 0;
  int dtype_bytes = 2;  // 2 (uint16) or 4 (uint32)
};

// Opens and validates a shard's metadata. Bad files are UsageError naming the file and the
// attribute or dataset: "<path>: not an HDF5 file", "<path>: missing dataset 'tokens'",
// "<path>: attribute 'format' is 'x', expected 'mpitrain-tokens'", "<path>: unsupported version 2",
// "<path>: dataset 'tokens' has type float, expected uint16 or uint32".
ShardInfo read_shard_info(const std::string& path);

// Reads a whole shard's tokens (tests, inspect, pack round trips).
std::vector<uint32_t> read_shard_tokens(const std::string& path);

// Expands files, directories (their *.h5 files) and glob patterns into a sorted, de-duplicated
// list. Nothing matched is a UsageError naming `key` ("data.train: no shard matches 'x*.h5'").
std::vector<std::string> expand_shard_paths(const std::vector<std::string>& patterns,
                                            const std::string& key);

// A seeded bijection on [0, n): the shuffled order of one epoch.
class Permutation {
 public:
  Permutation(uint64_t n, uint64_t seed);
  uint64_t operator()(uint64_t i) const;  // i < n
  uint64_t size() const { return n_; }

 private:
  uint64_t n_;
  int half_bits_;
  uint64_t keys_[4];
};

// The token source for one split: opens every shard (memory-mapping contiguous datasets, reading
// chunked ones into memory), checks they agree on vocab_size, and serves windows by global index.
class TokenDataset {
 public:
  // Throws UsageError for bad shards, mixed vocab sizes, vocab_size > 2^31 (tokens are served as
  // int32), or shards shorter than one window.
  TokenDataset(const std::vector<std::string>& paths, int64_t seq_len, uint64_t seed, bool shuffle);
  // A weighted mixture (data.weights): source i is the shards `sources[i]` (their own seeded order,
  // epochs wrapping on their own), `weights` > 0 (any scale). The global window order interleaves
  // the sources by a fixed schedule of kMixturePeriod slots (each source's slots its weight's share,
  // rounded by largest remainders, at least one), laid out so that every prefix of the order holds
  // each source's windows within one of its share (the slot with the largest deficit next): the same
  // order on any number of ranks, and exact on resume (the cursor is the global window count).
  // Sources of different vocab sizes or tokenizers are refused, naming the entry (`names[i]`).
  // `later` (data.stages): from global window `first`, other weights (>= 0, one > 0): each source
  // goes on from the windows it had given there, the new shares laid out the same way.
  TokenDataset(const std::vector<std::vector<std::string>>& sources, const std::vector<double>& weights,
               const std::vector<std::string>& names, int64_t seq_len, uint64_t seed, bool shuffle,
               const std::vector<std::pair<uint64_t, std::vector<double>>>& later = {});
  static constexpr uint64_t kMixturePeriod = 1000;
  ~TokenDataset();
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;

  int64_t seq_len() const { return seq_len_; }
  int64_t vocab_size() const { return vocab_size_; }
  int64_t eot_token() const { return eot_token_; }
  const std::string& tokenizer() const { return tokenizer_; }
  // hf: the tokenizer.json the shards were packed with (as named to pack) and its SHA-256; empty
  // for other tokenizers and older shards. Shards of different tokenizer.json files are refused.
  const std::string& tokenizer_file() const { return tokenizer_file_; }
  const std::string& tokenizer_sha256() const { return tokenizer_sha256_; }
  uint64_t num_windows() const { return total_windows_; }  // per epoch
  uint64_t num_tokens() const { return total_tokens_; }
  const std::vector<std::string>& paths() const { return paths_; }

  // Writes the seq_len+1 tokens of global window `index` (any index >= 0: epochs wrap) to `dst`.
  // Tokens are int32 (what the embedding takes; a shard's uint16 widens with a plain vector
  // copy): the constructor refuses vocab_size > 2^31, so every in-vocabulary token fits. A stored
  // value >= 2^31 (out of vocabulary, never written by write_shard) comes out negative.
  void window(uint64_t index, int32_t* dst) const;

  // Fills `dst` (rows x (seq_len+1)) with the windows of one rank's slice of one micro-step:
  // global windows start + rank*rows + i for i in [0, rows).
  void batch(uint64_t start, int rank, int64_t rows, int32_t* dst) const;

  // A mixture's sources (0: not a mixture), each source's slots of the kMixturePeriod, and how many
  // windows of each the first `windows` global windows hold.
  size_t sources() const { return sources_.size(); }
  const std::vector<uint64_t>& source_slots(size_t stage = 0) const { return stages_.at(stage).slots; }
  std::vector<uint64_t> source_windows(uint64_t windows) const;

 private:
  struct Shard;
  // Global window index -> the first of its seq_len+1 tokens (native uint16/uint32) and their width.
  const unsigned char* locate(uint64_t k, int* dtype_bytes) const;
  // Throws the UsageError naming the shard and position of the first token >= vocab_size in the
  // window copied from `window` into `row`.
  [[noreturn]] void report_out_of_vocabulary(const unsigned char* window, const int32_t* row, int64_t width) const;
  // A mixture: the sources, the period's schedule (the source of each slot), each source's slots
  // and, per source, its windows among the schedule's first k slots (k = 0..period).
  std::vector<std::unique_ptr<TokenDataset>> sources_;
  struct MixStage {
    uint64_t from = 0;                         // its first global window
    std::vector<uint64_t> slots, base;         // per source: its slots; its windows before `from`
    std::vector<uint32_t> schedule;            // the source of each slot of the period
    std::vector<std::vector<uint32_t>> before;  // per source, its windows among the first k slots
  };
  std::vector<MixStage> stages_;
  static MixStage make_stage(const std::vector<double>& weights, uint64_t from, std::vector<uint64_t> base);
  const MixStage& stage_at(uint64_t window) const;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<std::string> paths_;
  std::vector<uint64_t> first_window_;  // prefix sums of windows per shard
  int64_t seq_len_;
  uint64_t seed_;
  bool shuffle_;
  int64_t vocab_size_ = 0;
  int64_t eot_token_ = -1;
  std::string tokenizer_;
  std::string tokenizer_file_, tokenizer_sha256_, special_tokens_;
  uint64_t total_windows_ = 0;
  uint64_t total_tokens_ = 0;
};

// Prepares the next micro-batch on a background thread while the current one trains, so the
// loop never waits on I/O. The caller names the batch it needs now and the one it will need next;
// a batch that was not prefetched is read synchronously (always correct, only slower).
class BatchPrefetcher {
 public:
  BatchPrefetcher(const TokenDataset& data, int rank, int64_t rows);
  ~BatchPrefetcher();
  BatchPrefetcher(const BatchPrefetcher&) = delete;
  BatchPrefetcher& operator=(const BatchPrefetcher&) = delete;

  // The rows x (seq_len+1) int32 tokens of the micro-batch at global window `start` (see
  // batch()), then starts reading the one at `next_start` in the background.
  const std::vector<int32_t>& take(uint64_t start, uint64_t next_start);

 private:
  std::vector<int32_t> read(uint64_t start) const;

  const TokenDataset& data_;
  int rank_;
  int64_t rows_;
  std::vector<int32_t> current_;
  std::future<std::vector<int32_t>> pending_;
  uint64_t pending_start_ = 0;
};

}  // namespace mpitrain
