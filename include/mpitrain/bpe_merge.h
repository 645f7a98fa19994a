// What the two byte-level BPE tokenizers share (GPT-2's own files: bpe.h; a Hugging Face
// tokenizer.json: hf_tokenizer.h): the byte alphabet that makes every byte a printable symbol,
// UTF-8 checks, a PCRE2 pattern, and the merge engine that turns a piece of text into token ids.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mpitrain::bpe {

// ---- the byte alphabet -------------------------------------------------------------------------

// encoder.py's bytes_to_unicode(): printable bytes stand for themselves, the other 68 bytes get
// code points from U+0100 on, so that every symbol in a vocabulary is printable text.
const std::vector<uint32_t>& bytes_to_unicode();
// The UTF-8 text of byte b's symbol ("a" for 'a', "Ġ" for ' ').
std::string byte_symbol(unsigned char b);
void append_utf8(std::string& s, uint32_t cp);

// The bytes a vocabulary entry stands for: each character of the alphabet becomes its byte.
// `all_mapped` (when given) tells whether every character was in the alphabet; the others are
// kept as their own UTF-8 (added tokens like "<|endoftext|>" of other vocabularies).
std::string symbol_bytes(std::string_view token, bool* all_mapped = nullptr);

// ---- UTF-8 -------------------------------------------------------------------------------------

// The byte offset where the first invalid UTF-8 sequence starts (overlong forms, surrogates and
// code points past U+10FFFF are invalid), or npos when `s` is valid UTF-8.
size_t find_invalid_utf8(std::string_view s);

// A tokenizer file (tokenizer.json, vocab.json, merges.txt) whole: a regular file of at most
// kMaxTokenizerFileBytes (files.h), else UsageError naming it ("PATH: cannot open for reading ...").
constexpr uint64_t kMaxTokenizerFileBytes = uint64_t{256} << 20;
std::string read_file(const std::string& path);

// ---- a compiled PCRE2 pattern (UTF + UCP, JIT when available) ----------------------------------

class Pattern {
 public:
  // Throws UsageError("<what>: <PCRE2's message> at offset N") when it does not compile.
  Pattern(const std::string& pattern, const std::string& what);
  ~Pattern();
  Pattern(Pattern&&) noexcept;
  Pattern& operator=(Pattern&&) noexcept;

  // The first match in `text` at or after byte `pos`: true and [begin, end), or false. `text`
  // must be valid UTF-8 (not checked again). An empty match is a match.
  bool find(std::string_view text, size_t pos, size_t& begin, size_t& end) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The pattern GPT-2's encoder.py cuts text with (also Hugging Face's ByteLevel pre-tokenizer with
// use_regex), \s spelled out as Unicode White_Space like Python's `regex` module and Oniguruma.
std::string gpt2_pattern();

// ---- merging -----------------------------------------------------------------------------------

// Symbols are the strings merges are written in (bytes mapped by bytes_to_unicode); symbols
// 0..255 are the single bytes, so a piece of text starts as its bytes' symbol ids. Each symbol
// may be a token (its id in the vocabulary).
class Merger {
 public:
  // How merges of equal rank interact with the pairs they create:
  //  - rounds: encoder.py: merge every occurrence of the best pair, then look again;
  //  - immediate: Hugging Face tokenizers: merge the best (rank, position) pair, queue the new
  //    pairs at once. The two agree whenever every merge's operands are made by earlier merges
  //    (true of real vocabularies); they differ only on out-of-order merge lists.
  enum class Order { rounds, immediate };
  explicit Merger(Order order);

  uint32_t symbol(const std::string& text);  // the id of a symbol, added when new
  void set_token(uint32_t symbol, uint32_t token) { sym_token_[symbol] = token; }
  bool is_token(uint32_t symbol) const { return sym_token_[symbol] != kNone; }
  // Merging `left` and `right` makes `result`; a repeated pair takes the later rank.
  void add_merge(uint32_t left, uint32_t right, uint32_t result, uint32_t rank);
  // Pieces whose bytes are a whole token come out as that token without merging (Hugging Face's
  // ignore_merges): `bytes -> id` of every such token.
  void set_whole_tokens(std::unordered_map<std::string, uint32_t> whole) {
    whole_ = std::move(whole);
  }

  // Appends the token ids of one pre-tokenized piece (raw bytes). Every symbol left after
  // merging must be a token (the loaders check the byte symbols and every merge's result).
  void encode_piece(std::string_view piece, std::vector<uint32_t>& out);
  // The same for a piece given as its first symbols, each a token (SentencePiece-style BPE: the
  // text's characters, byte-fallback tokens, the unknown token), merged in this Merger's order.
  void encode_symbols(const std::vector<uint32_t>& symbols, std::vector<uint32_t>& out);
  // The id of the symbol written `text`, if there is one.
  std::optional<uint32_t> find_symbol(const std::string& text) const;

 private:
  static constexpr uint32_t kNone = UINT32_MAX;
  struct Merge {
    uint32_t rank, result;
  };
  const Merge* find(uint32_t left, uint32_t right) const;
  void merge(std::string_view piece, std::vector<uint32_t>& out);
  void merge_work(std::vector<uint32_t>& out);  // merges work_ (its first symbols set) into out

  Order order_;
  std::unordered_map<std::string, uint32_t> sym_;  // symbol text -> symbol id
  std::vector<uint32_t> sym_token_;                // symbol id -> token id (kNone: not a token)
  std::unordered_map<uint64_t, Merge> merges_;     // (left << 32 | right) -> rank, result
  std::unordered_map<std::string, uint32_t> whole_;
  std::unordered_map<std::string, std::vector<uint32_t>> cache_;
  struct Sym {
    uint32_t id;
    int32_t prev, next;
  };
  std::vector<Sym> work_;  // scratch of merge()
};

}  // namespace mpitrain::bpe
