// The added tokens' matching (added_tokens.h).
#include "mpitrain/added_tokens.h"

#include <utf8proc.h>

#include <algorithm>

namespace mpitrain {

void AddedTokenTrie::add(std::string_view s, uint32_t value) {
  if (nodes_.empty()) nodes_.push_back(-1);
  first_[static_cast<unsigned char>(s[0])] = true;
  uint32_t node = 0;
  for (char c : s) {
    auto [it, fresh] = next_.try_emplace(key(node, c), static_cast<uint32_t>(nodes_.size()));
    if (fresh) nodes_.push_back(-1);
    node = it->second;
  }
  if (nodes_[node] < 0) nodes_[node] = value;
}

bool AddedTokenTrie::find(std::string_view text, size_t from, size_t& begin, size_t& end, uint32_t& value) const {
  if (nodes_.empty()) return false;
  for (size_t at = from; at < text.size(); ++at) {
    if (!first_[static_cast<unsigned char>(text[at])]) continue;
    uint32_t node = 0;
    size_t longest = 0;
    for (size_t k = at; k < text.size(); ++k) {
      const auto it = next_.find(key(node, text[k]));
      if (it == next_.end()) break;
      node = it->second;
      if (nodes_[node] >= 0) longest = k + 1, value = static_cast<uint32_t>(nodes_[node]);
    }
    if (longest > 0) {
      begin = at, end = longest;
      return true;
    }
  }
  return false;
}

namespace {

// The code point that starts at `at` (valid UTF-8).
char32_t code_point_at(std::string_view s, size_t at, size_t* len = nullptr) {
  utf8proc_int32_t cp = 0;
  const utf8proc_ssize_t n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + at),
                                              static_cast<utf8proc_ssize_t>(s.size() - at), &cp);
  if (len) *len = n > 0 ? static_cast<size_t>(n) : 1;
  return static_cast<char32_t>(cp);
}

// Where the character that ends at `at` (> 0) starts.
size_t previous_char(std::string_view s, size_t at) {
  do --at;
  while (at > 0 && (static_cast<unsigned char>(s[at]) & 0xC0) == 0x80);
  return at;
}

// `\s` of the Rust regex crate that the library's lstrip / rstrip use: Unicode White_Space.
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// `\w` of the Rust regex crate that the library's single_word uses: Alphabetic (letters, Nl and
// Other_Alphabetic, which outside the marks is the circled and squared Latin letters), marks,
// decimal digits, connector punctuation and the two join controls.
bool is_word(char32_t c) {
  if (c == 0x200C || c == 0x200D) return true;
  if ((c >= 0x24B6 && c <= 0x24E9) || (c >= 0x1F130 && c <= 0x1F149) || (c >= 0x1F150 && c <= 0x1F169) ||
      (c >= 0x1F170 && c <= 0x1F189))
    return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT: case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN: case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

}  // namespace

void find_added(std::string_view s, const AddedTokenTrie& trie, const std::vector<AddedToken>& tokens,
                bool match_special, std::vector<AddedCut>& cuts) {
  cuts.clear();
  size_t offset = 0, begin = 0, end = 0;
  size_t run_from = std::string_view::npos, run_to = 0;  // a run of whitespace measured by rstrip
  uint32_t k = 0;
  for (size_t from = 0; trie.find(s, from, begin, end, k); from = end) {
    const AddedToken& t = tokens[k];
    if (t.special && !match_special) continue;
    if (t.single_word && ((begin > 0 && is_word(code_point_at(s, previous_char(s, begin)))) ||
                          (end < s.size() && is_word(code_point_at(s, end)))))
      continue;
    size_t start = begin, stop = end;
    if (t.lstrip) {  // back over whitespace, never before the previous cut's end
      while (start > offset && is_white_space(code_point_at(s, previous_char(s, start)))) start = previous_char(s, start);
      start = std::max(start, offset);
    }
    if (t.rstrip) {  // a run already measured is not walked again: whitespace tokens stay linear
      if (run_from != std::string_view::npos && run_from <= stop && stop <= run_to) {
        stop = run_to;
      } else {
        run_from = stop;
        size_t len = 0;
        while (stop < s.size() && is_white_space(code_point_at(s, stop, &len))) stop += len;
        run_to = stop;
      }
    }
    if (offset < start) cuts.push_back({offset, start, -1});
    cuts.push_back({start, stop, k});
    offset = stop;
  }
  if (offset < s.size()) cuts.push_back({offset, s.size(), -1});
}

}  // namespace mpitrain
