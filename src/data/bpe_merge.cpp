// The byte-level BPE pieces both tokenizers share: byte alphabet, UTF-8 checks, PCRE2 patterns and
// merging by rank with a priority queue and a per-piece cache.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "mpitrain/bpe_merge.h"

#include <pcre2.h>

#include <fstream>
#include <functional>
#include <iterator>
#include <queue>

#include "mpitrain/error.h"
#include "mpitrain/files.h"

namespace mpitrain::bpe {

namespace {

constexpr size_t kCacheEntries = 1 << 20;  // cleared when full: bounded memory on huge corpora
constexpr size_t kCachePiece = 64;         // longer pieces are rare; not worth keeping

std::string pcre2_message(int rc) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(rc, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

}  // namespace

// ---- the byte alphabet -------------------------------------------------------------------------

const std::vector<uint32_t>& bytes_to_unicode() {
  static const std::vector<uint32_t> cp = [] {
    std::vector<uint32_t> v(256, 0);
    auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b != 0xAD); };
    uint32_t n = 0;
    for (int b = 0; b < 256; ++b) v[b] = printable(b) ? static_cast<uint32_t>(b) : 256 + n++;
    return v;
  }();
  return cp;
}

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string byte_symbol(unsigned char b) {
  std::string s;
  append_utf8(s, bytes_to_unicode()[b]);
  return s;
}

std::string symbol_bytes(std::string_view t, bool* all_mapped) {
  static const std::unordered_map<uint32_t, char> byte_of = [] {
    std::unordered_map<uint32_t, char> m;
    for (int b = 0; b < 256; ++b) m[bytes_to_unicode()[b]] = static_cast<char>(b);
    return m;
  }();
  std::string out;
  if (all_mapped) *all_mapped = true;
  for (size_t i = 0; i < t.size();) {
    const auto c = static_cast<unsigned char>(t[i]);
    const size_t len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    uint32_t v = c;
    if (len == 2 && i + 1 < t.size())
      v = (c & 0x1Fu) << 6 | (static_cast<unsigned char>(t[i + 1]) & 0x3Fu);
    auto it = len <= 2 ? byte_of.find(v) : byte_of.end();
    if (it != byte_of.end()) {
      out += it->second;
    } else {
      out += t.substr(i, len);
      if (all_mapped) *all_mapped = false;
    }
    i += len;
  }
  return out;
}

// ---- UTF-8 -------------------------------------------------------------------------------------

size_t find_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp, min;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2, cp = c & 0x1F, min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3, cp = c & 0x0F, min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return i;  // a continuation byte, an overlong lead (C0, C1) or F5..FF
    }
    if (n - i < len) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = cp << 6 | (p[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string_view::npos;
}

std::string read_file(const std::string& path) {
  // The largest real tokenizer.json files are ~35 MB (Gemma 3's); vocab.json and merges.txt ~1 MB.
  return read_bounded_file(path, kMaxTokenizerFileBytes, "a tokenizer file");
}

// ---- patterns ----------------------------------------------------------------------------------

struct Pattern::Impl {
  pcre2_code* code = nullptr;
  pcre2_match_data* md = nullptr;
  ~Impl() {
    pcre2_match_data_free(md);
    pcre2_code_free(code);
  }
};

Pattern::Pattern(const std::string& pattern, const std::string& what)
    : impl_(std::make_unique<Impl>()) {
  int err = 0;
  PCRE2_SIZE off = 0;
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                              PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
  if (!impl_->code)
    throw UsageError(concat(what, ": ", pcre2_message(err), " at offset ", off));
  pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE);  // optional: the interpreter is the fallback
  impl_->md = pcre2_match_data_create_from_pattern(impl_->code, nullptr);
  if (!impl_->md) throw Error("pcre2_match_data_create: out of memory");
}

Pattern::~Pattern() = default;
Pattern::Pattern(Pattern&&) noexcept = default;
Pattern& Pattern::operator=(Pattern&&) noexcept = default;

bool Pattern::find(std::string_view text, size_t pos, size_t& begin, size_t& end) const {
  const int rc = pcre2_match(impl_->code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(),
                             pos, PCRE2_NO_UTF_CHECK, impl_->md, nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) throw Error(concat("pre-tokenizer pattern: ", pcre2_message(rc)));
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(impl_->md);
  begin = ov[0];
  end = ov[1];
  return true;
}

// PCRE2's \s (and JavaScript's) differ from White_Space on U+0085, U+180E and U+FEFF.
constexpr const char* kWhite =
    "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";

std::string gpt2_pattern() {
  const std::string w = kWhite;
  return "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" + w + "\\p{L}\\p{N}]+|[" + w +
         "]+(?![^" + w + "])|[" + w + "]+";
}

// ---- merging -----------------------------------------------------------------------------------

Merger::Merger(Order order) : order_(order) {
  for (int b = 0; b < 256; ++b) symbol(byte_symbol(static_cast<unsigned char>(b)));
}

uint32_t Merger::symbol(const std::string& text) {
  auto [it, added] = sym_.emplace(text, static_cast<uint32_t>(sym_token_.size()));
  if (added) sym_token_.push_back(kNone);
  return it->second;
}

void Merger::add_merge(uint32_t left, uint32_t right, uint32_t result, uint32_t rank) {
  merges_[uint64_t{left} << 32 | right] = Merge{rank, result};
}

const Merger::Merge* Merger::find(uint32_t left, uint32_t right) const {
  auto it = merges_.find(uint64_t{left} << 32 | right);
  return it == merges_.end() ? nullptr : &it->second;
}

// A min-heap of (rank, position) finds the best pair in O(log n) instead of rescanning the word.
// Order::rounds queues the pairs a round creates only after the round, so that a round merges
// exactly the occurrences encoder.py would (a new pair with a lower rank must not cut in).
void Merger::merge(std::string_view piece, std::vector<uint32_t>& out) {
  const auto n = static_cast<int32_t>(piece.size());
  work_.resize(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i)
    work_[i] = Sym{static_cast<unsigned char>(piece[i]), i - 1, i + 1 < n ? i + 1 : -1};
  merge_work(out);
}

void Merger::encode_symbols(const std::vector<uint32_t>& symbols, std::vector<uint32_t>& out) {
  const auto n = static_cast<int32_t>(symbols.size());
  if (n == 0) return;
  work_.resize(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) work_[i] = Sym{symbols[i], i - 1, i + 1 < n ? i + 1 : -1};
  merge_work(out);
}

std::optional<uint32_t> Merger::find_symbol(const std::string& text) const {
  auto it = sym_.find(text);
  if (it == sym_.end()) return std::nullopt;
  return it->second;
}

void Merger::merge_work(std::vector<uint32_t>& out) {
  const auto n = static_cast<int32_t>(work_.size());
  using Entry = std::pair<uint32_t, int32_t>;  // (rank, left position)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  auto push = [&](int32_t i) {
    if (i < 0 || work_[i].next < 0) return;
    if (const Merge* m = find(work_[i].id, work_[work_[i].next].id)) heap.emplace(m->rank, i);
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  std::vector<int32_t> merged;
  while (!heap.empty()) {
    const uint32_t rank = heap.top().first;
    merged.clear();
    while (!heap.empty() && heap.top().first == rank) {
      const int32_t i = heap.top().second;
      heap.pop();
      Sym& s = work_[i];
      if (s.id == kNone || s.next < 0) continue;  // stale: consumed by an earlier merge
      const Merge* m = find(s.id, work_[s.next].id);
      if (!m || m->rank != rank) continue;
      const int32_t gone = s.next;
      s.id = m->result;
      s.next = work_[gone].next;
      if (s.next >= 0) work_[s.next].prev = i;
      work_[gone].id = kNone;
      if (order_ == Order::immediate) {
        push(s.prev);
        push(i);
        break;  // the new pairs may outrank the rest of this rank's queue
      }
      merged.push_back(i);
    }
    for (int32_t i : merged) {
      push(work_[i].prev);
      push(i);
    }
  }
  for (int32_t i = 0; i >= 0; i = work_[i].next) out.push_back(sym_token_[work_[i].id]);
}

void Merger::encode_piece(std::string_view piece, std::vector<uint32_t>& out) {
  if (piece.empty()) return;
  if (piece.size() == 1) {
    out.push_back(sym_token_[static_cast<unsigned char>(piece[0])]);
    return;
  }
  if (!whole_.empty()) {
    if (auto it = whole_.find(std::string(piece)); it != whole_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (piece.size() > kCachePiece) {
    merge(piece, out);
    return;
  }
  auto it = cache_.find(std::string(piece));
  if (it == cache_.end()) {
    if (cache_.size() >= kCacheEntries) cache_.clear();
    std::vector<uint32_t> ids;
    merge(piece, ids);
    it = cache_.emplace(std::string(piece), std::move(ids)).first;
  }
  out.insert(out.end(), it->second.begin(), it->second.end());
}

}  // namespace mpitrain::bpe
