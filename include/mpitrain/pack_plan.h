// The plan of `mpitrain pack`: rank 0 walks the inputs, reads the token files' headers and
// resolves the tokenizer and vocabulary, then broadcasts the result; every rank derives its own
// share of the input from the plan alone, so all ranks agree without further messages.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mpitrain/bpe.h"
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

// The GPT-2 tokenizer of the options (--bpe-dir, or --vocab and --merges).
std::optional<Gpt2Bpe> load_bpe(const PackOptions& o);

// Rank 0: checks the options, lists and identifies the input files (reading token files'
// headers), resolves the vocabulary and creates the output directory. Loads the GPT-2 tokenizer
// into `bpe` when text is packed with it. Bad input is a UsageError naming the file or option.
PackPlan make_pack_plan(const PackOptions& o, std::optional<Gpt2Bpe>& bpe);

// Rank 0's plan to every rank of `comm` (collective).
void broadcast_pack_plan(PackPlan& plan, MPI_Comm comm);

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
