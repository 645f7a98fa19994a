// The GPT-2 byte-level BPE tokenizer, as OpenAI's encoder.py: UTF-8 text is cut into pieces by the
// GPT-2 pre-tokenizer regex (PCRE2, UTF + UCP), each piece's bytes are mapped to printable symbols
// (bytes_to_unicode), and adjacent symbols are merged by rank until no ranked pair is left.
// Loads the standard files: vocab.json + merges.txt (Hugging Face names) or encoder.json +
// vocab.bpe (OpenAI names); the content is the same.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "mpitrain/error.h"

namespace mpitrain {

// The two files a GPT-2 BPE tokenizer is loaded from.
struct BpeFiles {
  std::string vocab;   // path of vocab.json / encoder.json: {"token": id, ...}
  std::string merges;  // path of merges.txt / vocab.bpe: "#version" line, then one "a b" merge per line
};

// Finds vocab.json + merges.txt or encoder.json + vocab.bpe in `dir`; a UsageError naming the
// directory when neither pair is complete.
BpeFiles find_bpe_files(const std::string& dir);

// Text that is not valid UTF-8: `offset` is the byte where the first bad sequence starts.
struct InvalidUtf8 : UsageError {
  InvalidUtf8(size_t offset_, const std::string& what) : UsageError(what), offset(offset_) {}
  size_t offset;
};

// Throws InvalidUtf8 ("invalid UTF-8 at byte N") unless `text` is UTF-8: what the tokenizers'
// encode() check first.
void require_utf8(std::string_view text);

class Gpt2Bpe {
 public:
  // Loads and validates both files. Malformed files are a UsageError naming the file (and the
  // line of merges): unreadable, bad JSON, an id that is not a non-negative integer, duplicate
  // ids, no "<|endoftext|>", a merge line without exactly two symbols, a merge whose result or a
  // byte symbol missing from the vocabulary.
  explicit Gpt2Bpe(const BpeFiles& files);
  ~Gpt2Bpe();
  Gpt2Bpe(Gpt2Bpe&&) noexcept;
  Gpt2Bpe& operator=(Gpt2Bpe&&) noexcept;

  int64_t vocab_size() const;  // the largest id + 1 (50257 for GPT-2)
  int64_t eot_token() const;   // the id of "<|endoftext|>" (50256 for GPT-2)

  // Appends the ids of `text` to `out`, like encoder.py's encode(): "<|endoftext|>" in the text
  // is ordinary text, never the EOT id. Throws InvalidUtf8 when `text` is not UTF-8.
  void encode(std::string_view text, std::vector<uint32_t>& out);
  std::vector<uint32_t> encode(std::string_view text);

  // The bytes of `ids` (ids >= vocab_size are a UsageError).
  std::string decode(const std::vector<uint32_t>& ids) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mpitrain
