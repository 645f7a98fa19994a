// A tokenizer.json's added tokens, cut out of a text before the normalizer, the pre-tokenizer and
// the model see it, as the `tokenizers` library's AddedVocabulary does (hf_tokenizer.cpp uses it
// twice: the tokens written as they are on the raw text, the normalized ones on each normalized
// piece). Leftmost-longest matching (the library's Aho-Corasick automaton, MatchKind::
// LeftmostLongest) by a byte trie, then each token's flags.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mpitrain {

// One entry of added_tokens and the flags that decide where it is cut out of the text (the
// library's AddedToken): `single_word` only between non-word characters, `lstrip` / `rstrip`
// taking the whitespace before / after it, `normalized` matched in the normalized text (else in
// the text as written); a `special` one only when special tokens are matched.
struct AddedToken {
  uint32_t id = 0;
  bool special = false, single_word = false, lstrip = false, rstrip = false, normalized = false;
};

// Leftmost-longest matching of a set of strings: of the matches that start first, the longest.
// A byte trie walked from each position where an entry can start: a text costs at most its length
// times the longest entry's, never its length squared.
class AddedTokenTrie {
 public:
  // Adds `s` (non-empty) with `value`; of two equal entries the first added is found.
  void add(std::string_view s, uint32_t value);
  // The first match at or after `from`: its [begin, end) and value.
  bool find(std::string_view text, size_t from, size_t& begin, size_t& end, uint32_t& value) const;

 private:
  static uint64_t key(uint32_t node, char c) { return uint64_t{node} << 8 | static_cast<unsigned char>(c); }
  std::unordered_map<uint64_t, uint32_t> next_;  // (node, byte) -> node
  std::vector<int64_t> nodes_;                   // node -> the value of the entry ending there, -1: none
  std::array<bool, 256> first_{};                // bytes an entry starts with
};

// A piece of text after the added tokens are cut out: [begin, end) and the added token (an index
// into the tokens) or -1 for text.
struct AddedCut {
  size_t begin, end;
  int64_t token;
};

// The library's AddedVocabulary::find_matches over `s` (valid UTF-8): the trie's matches (values:
// indices into `tokens`) left to right, each search continuing after the previous match as found
// (not as stripped); a special token skipped unless `match_special`; a single_word one skipped
// next to a word character (Rust's \w); lstrip takes the whitespace (Rust's \s: White_Space)
// before it back to the previous cut, rstrip all the whitespace after it (so the next match may
// start inside it, as in the library, whose cuts then overlap). The text between is one cut each.
void find_added(std::string_view s, const AddedTokenTrie& trie, const std::vector<AddedToken>& tokens,
                bool match_special, std::vector<AddedCut>& cuts);

}  // namespace mpitrain
