// The plan of `mpitrain pack`: rank 0 walks the inputs, reads the token files' headers and
// resolves the tokenizer and vocabulary, then broadcasts the result; every rank derives its own
// share of the input from the plan alone, so all ranks agree without further messages.
#pragma once

#include "mpitrain/mpi_ops.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mpitrain/bpe.h"
#include "mpitrain/hf_tokenizer.h"
#include "mpitrain/importers.h"
#include "mpitrain/pack.h"
#include "mpitrain/shards.h"

namespace mpitrain {

struct PackInput {
  std::string path;
  InputFormat format = InputFormat::text;
  uint64_t bytes = 0;  // text: file size; token arrays: layout.count * dtype size
  TokenLayout layout;  // token arrays
};

struct PackPlan {
  std::vector<PackInput> files;
  ShardMeta meta;  // vocab_size, eot_token, tokenizer and source of every shard
};

// The text tokenizer of a pack: byte values (nothing loaded), GPT-2's files or a tokenizer.json.
struct TextTokenizer {
  std::optional<Gpt2Bpe> gpt2;
  std::optional<HfTokenizer> hf;
  // Appends the ids of `text` (bytes: their values); the BPE tokenizers throw InvalidUtf8.
  void encode(std::string_view text, std::vector<uint32_t>& out);
};

// The GPT-2 tokenizer of the options (--bpe-dir, or --vocab and --merges).
std::optional<Gpt2Bpe> load_bpe(const PackOptions& o);

// Loads the tokenizer the plan's meta names, on a rank that did not make the plan; a
// tokenizer.json whose SHA-256 differs from the plan's is a UsageError (changed while packing).
void load_text_tokenizer(const PackOptions& o, const ShardMeta& meta, TextTokenizer& tok);

// Text-like inputs (text, jsonl) go to ranks whole and are tokenized; the others are token arrays.
inline bool is_text_like(InputFormat f) { return f == InputFormat::text || f == InputFormat::jsonl; }

// Rank 0: checks the options, lists and identifies the input files (reading token files'
// headers), resolves the vocabulary and creates the output directory. Loads the text tokenizer
// into `tok` when text is packed with it. Bad input is a UsageError naming the file or option.
PackPlan make_pack_plan(const PackOptions& o, TextTokenizer& tok);

// Rank 0's plan to every rank of `comm` (collective).
void broadcast_pack_plan(PackPlan& plan, MpiComm comm);

// One rank's share of one input file: a whole text file, or tokens [begin, end) of a token array.
struct PackRange {
  size_t file;
  uint64_t begin, end;
};

// Rank `rank`'s share: a contiguous stretch of the input weighted by bytes. Text files go whole
// to the rank holding their middle byte; token arrays are cut at token boundaries. Contiguous
// shares make each rank's documents a contiguous block of the global document order.
std::vector<PackRange> pack_ranges(const PackPlan& plan, int rank, int world);

}  // namespace mpitrain
