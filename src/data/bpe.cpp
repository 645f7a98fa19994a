// GPT-2 byte-level BPE (OpenAI's encoder.py): file loading and validation, the pre-tokenizer regex
// on PCRE2, merging by rank with a priority queue, a per-piece cache, and decoding.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "mpitrain/bpe.h"

#include <pcre2.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

namespace mpitrain {

namespace fs = std::filesystem;

namespace {

// ---- files -------------------------------------------------------------------------------------

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(path + ": cannot open for reading");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw UsageError(path + ": read error");
  return text;
}

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {  // bytes_to_unicode never goes past U+0143
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// encoder.py's bytes_to_unicode(): printable bytes stand for themselves, the other 68 bytes get
// code points from U+0100 on, so that every symbol in the vocabulary is printable text.
std::vector<uint32_t> bytes_to_unicode() {
  std::vector<uint32_t> cp(256, 0);
  std::vector<bool> printable(256, false);
  for (int b = '!'; b <= '~'; ++b) printable[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
  uint32_t n = 0;
  for (int b = 0; b < 256; ++b) cp[b] = printable[b] ? static_cast<uint32_t>(b) : 256 + n++;
  return cp;
}

// ---- the pre-tokenizer -------------------------------------------------------------------------

// encoder.py's pattern. \s is spelled out as Unicode White_Space, which is what Python's `regex`
// module matches; PCRE2's \s (and JavaScript's) differ on U+0085 and U+FEFF.
constexpr const char* kWhite =
    "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";

std::string gpt2_pattern() {
  const std::string w = kWhite;
  return "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" + w + "\\p{L}\\p{N}]+|[" + w +
         "]+(?![^" + w + "])|[" + w + "]+";
}

template <class T, void (*Free)(T*)>
struct Freer {
  void operator()(T* p) const { Free(p); }
};
using Code = std::unique_ptr<pcre2_code, Freer<pcre2_code, pcre2_code_free>>;
using MatchData = std::unique_ptr<pcre2_match_data, Freer<pcre2_match_data, pcre2_match_data_free>>;

std::string pcre2_message(int rc) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(rc, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

constexpr uint32_t kDead = UINT32_MAX;
constexpr size_t kCacheEntries = 1 << 20;  // cleared when full: bounded memory on huge corpora
constexpr size_t kCachePiece = 64;         // longer pieces are rare; not worth keeping

}  // namespace

// ---- locating the files ------------------------------------------------------------------------

BpeFiles find_bpe_files(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw UsageError(dir + ": not a directory (--bpe-dir)");
  for (auto [v, m] :
       {std::pair{"vocab.json", "merges.txt"}, std::pair{"encoder.json", "vocab.bpe"}}) {
    fs::path vocab = fs::path(dir) / v, merges = fs::path(dir) / m;
    if (fs::exists(vocab, ec) && fs::exists(merges, ec)) return {vocab.string(), merges.string()};
  }
  throw UsageError(dir +
                   ": no GPT-2 BPE files (expected vocab.json + merges.txt or encoder.json + "
                   "vocab.bpe)");
}

// ---- state -------------------------------------------------------------------------------------

struct Gpt2Bpe::Impl {
  std::vector<std::string> token_bytes;           // id -> the bytes it stands for
  std::unordered_map<std::string, uint32_t> sym;  // symbol text (mapped chars) -> symbol id
  std::vector<uint32_t> sym_token;                // symbol id -> token id (kDead: not a token)
  struct Merge {
    uint32_t rank, result;
  };
  std::unordered_map<uint64_t, Merge> merges;  // (left << 32 | right) -> rank, merged symbol
  int64_t vocab_size = 0, eot = -1;
  Code re;
  MatchData md;
  std::unordered_map<std::string, std::vector<uint32_t>> cache;
  struct Sym {
    uint32_t id;
    int32_t prev, next;
  };
  std::vector<Sym> work;  // scratch of merge()

  uint32_t symbol(const std::string& text) {
    auto [it, added] = sym.emplace(text, static_cast<uint32_t>(sym_token.size()));
    if (added) sym_token.push_back(kDead);
    return it->second;
  }
  const Merge* find(uint32_t left, uint32_t right) const {
    auto it = merges.find(uint64_t{left} << 32 | right);
    return it == merges.end() ? nullptr : &it->second;
  }
  void load_vocab(const std::string& path, std::unordered_map<std::string, uint32_t>& ids);
  void load_merges(const std::string& path, const std::unordered_map<std::string, uint32_t>& ids);
  void compile();
  void merge(std::string_view piece, std::vector<uint32_t>& out);
};

// ---- loading -----------------------------------------------------------------------------------

void Gpt2Bpe::Impl::load_vocab(const std::string& path,
                               std::unordered_map<std::string, uint32_t>& ids) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(slurp(path));
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(concat(path, ": malformed JSON: ", e.what()));
  }
  if (!j.is_object() || j.empty())
    throw UsageError(path + ": expected a JSON object {\"token\": id, ...}");
  std::vector<std::string> by_id;
  for (auto& [token, value] : j.items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() >= (1 << 30))
      throw UsageError(concat(path, ": id of token '", token, "' is ", value.dump(),
                              ", expected an integer in [0, 2^30)"));
    const auto id = value.get<uint32_t>();
    if (id >= by_id.size()) by_id.resize(id + 1);
    if (!by_id[id].empty())
      throw UsageError(
          concat(path, ": id ", id, " given to both '", by_id[id], "' and '", token, "'"));
    if (token.empty()) throw UsageError(path + ": empty token string");
    by_id[id] = token;
    ids.emplace(token, id);
  }
  vocab_size = static_cast<int64_t>(by_id.size());
  auto eot_it = ids.find("<|endoftext|>");
  if (eot_it == ids.end()) throw UsageError(path + ": no '<|endoftext|>' token");
  eot = eot_it->second;

  // The byte each symbol character stands for, to decode ids back into bytes.
  std::unordered_map<uint32_t, char> byte_of;
  const std::vector<uint32_t> cp = bytes_to_unicode();
  for (int b = 0; b < 256; ++b) byte_of[cp[b]] = static_cast<char>(b);
  token_bytes.resize(by_id.size());
  for (size_t id = 0; id < by_id.size(); ++id) {
    const std::string& t = by_id[id];
    for (size_t i = 0; i < t.size();) {
      const auto c = static_cast<unsigned char>(t[i]);
      const size_t len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
      uint32_t v = c;
      if (len == 2 && i + 1 < t.size())
        v = (c & 0x1Fu) << 6 | (static_cast<unsigned char>(t[i + 1]) & 0x3Fu);
      auto it = len <= 2 ? byte_of.find(v) : byte_of.end();
      // Characters outside the byte alphabet (added tokens of other vocabularies) stay as they are.
      token_bytes[id] += it != byte_of.end() ? std::string(1, it->second) : t.substr(i, len);
      i += len;
    }
  }

  // Symbols 0..255 are the single bytes: a piece starts as its bytes' symbol ids.
  for (int b = 0; b < 256; ++b) {
    std::string s;
    append_utf8(s, cp[b]);
    symbol(s);
    auto it = ids.find(s);
    if (it == ids.end())
      throw UsageError(concat(path, ": the symbol for byte ", b, " ('", s, "') is missing"));
    sym_token[b] = it->second;
  }
}

void Gpt2Bpe::Impl::load_merges(const std::string& path,
                                const std::unordered_map<std::string, uint32_t>& ids) {
  const std::string text = slurp(path);
  size_t line_start = 0, line_no = 0;
  uint32_t rank = 0;
  while (line_start < text.size()) {
    size_t nl = text.find('\n', line_start);
    if (nl == std::string::npos) nl = text.size();
    std::string line = text.substr(line_start, nl - line_start);
    line_start = nl + 1;
    ++line_no;
    if (line_no == 1 && line.rfind("#version", 0) == 0) continue;
    // Fields split on whitespace like Python's str.split() (a CRLF file works too).
    std::vector<std::string> f;
    for (size_t i = 0; i < line.size();) {
      while (i < line.size() && std::isspace(static_cast<unsigned char>(line[i]))) ++i;
      size_t j = i;
      while (j < line.size() && !std::isspace(static_cast<unsigned char>(line[j]))) ++j;
      if (j > i) f.push_back(line.substr(i, j - i));
      i = j;
    }
    if (f.empty()) continue;
    if (f.size() != 2)
      throw UsageError(concat(path, ": line ", line_no,
                              ": expected two symbols separated by a "
                              "space, got '",
                              line, "'"));
    const uint32_t left = symbol(f[0]), right = symbol(f[1]);
    const std::string joined = f[0] + f[1];
    const uint32_t result = symbol(joined);
    auto it = ids.find(joined);
    if (it == ids.end())
      throw UsageError(concat(path, ": line ", line_no, ": merged symbol '", joined,
                              "' is not in the vocabulary"));
    sym_token[result] = it->second;
    merges[uint64_t{left} << 32 | right] = Merge{rank++, result};  // a repeat wins, as dict(zip())
  }
  if (rank == 0) throw UsageError(path + ": no merges");
}

void Gpt2Bpe::Impl::compile() {
  const std::string pattern = gpt2_pattern();
  int err = 0;
  PCRE2_SIZE off = 0;
  re.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(),
                         PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr));
  if (!re) throw Error(concat("GPT-2 pattern does not compile: ", pcre2_message(err), " at ", off));
  pcre2_jit_compile(re.get(), PCRE2_JIT_COMPLETE);  // optional: the interpreter is the fallback
  md.reset(pcre2_match_data_create_from_pattern(re.get(), nullptr));
  if (!md) throw Error("pcre2_match_data_create: out of memory");
}

Gpt2Bpe::Gpt2Bpe(const BpeFiles& files) : impl_(std::make_unique<Impl>()) {
  std::unordered_map<std::string, uint32_t> ids;
  impl_->load_vocab(files.vocab, ids);
  impl_->load_merges(files.merges, ids);
  impl_->compile();
}

Gpt2Bpe::~Gpt2Bpe() = default;
Gpt2Bpe::Gpt2Bpe(Gpt2Bpe&&) noexcept = default;
Gpt2Bpe& Gpt2Bpe::operator=(Gpt2Bpe&&) noexcept = default;

int64_t Gpt2Bpe::vocab_size() const { return impl_->vocab_size; }
int64_t Gpt2Bpe::eot_token() const { return impl_->eot; }

// ---- merging -----------------------------------------------------------------------------------

// encoder.py's bpe(): repeatedly merge every occurrence of the lowest-ranked adjacent pair, left to
// right. A min-heap of (rank, position) finds that pair in O(log n) instead of rescanning the
// word; pairs that a round creates are queued only after the round, so a round merges exactly the
// occurrences the reference would (a new pair with a lower rank must not cut in).
void Gpt2Bpe::Impl::merge(std::string_view piece, std::vector<uint32_t>& out) {
  const auto n = static_cast<int32_t>(piece.size());
  work.resize(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i)
    work[i] = Sym{static_cast<unsigned char>(piece[i]), i - 1, i + 1 < n ? i + 1 : -1};
  using Entry = std::pair<uint32_t, int32_t>;  // (rank, left position)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  auto push = [&](int32_t i) {
    if (i < 0 || work[i].next < 0) return;
    if (const Merge* m = find(work[i].id, work[work[i].next].id)) heap.emplace(m->rank, i);
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  std::vector<int32_t> merged;
  while (!heap.empty()) {
    const uint32_t rank = heap.top().first;
    merged.clear();
    while (!heap.empty() && heap.top().first == rank) {
      const int32_t i = heap.top().second;
      heap.pop();
      Sym& s = work[i];
      if (s.id == kDead || s.next < 0) continue;  // stale: consumed by an earlier merge
      const Merge* m = find(s.id, work[s.next].id);
      if (!m || m->rank != rank) continue;
      const int32_t gone = s.next;
      s.id = m->result;
      s.next = work[gone].next;
      if (s.next >= 0) work[s.next].prev = i;
      work[gone].id = kDead;
      merged.push_back(i);
    }
    for (int32_t i : merged) {
      push(work[i].prev);
      push(i);
    }
  }
  for (int32_t i = 0; i >= 0; i = work[i].next) out.push_back(sym_token[work[i].id]);
}

// ---- encode / decode ---------------------------------------------------------------------------

std::vector<uint32_t> Gpt2Bpe::encode(std::string_view text) {
  std::vector<uint32_t> out;
  encode(text, out);
  return out;
}

void Gpt2Bpe::encode(std::string_view text, std::vector<uint32_t>& out) {
  Impl& m = *impl_;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  uint32_t options = 0;  // the first match checks the whole subject's UTF-8; later ones skip it
  for (size_t pos = 0; pos < text.size();) {
    const int rc = pcre2_match(m.re.get(), subject, text.size(), pos, options, m.md.get(), nullptr);
    if (rc <= PCRE2_ERROR_UTF8_ERR1 && rc >= PCRE2_ERROR_UTF8_ERR21) {
      const size_t at = pcre2_get_startchar(m.md.get());
      throw InvalidUtf8(at, concat("invalid UTF-8 at byte ", at, ": ", pcre2_message(rc)));
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;  // cannot happen: the alternatives cover every character
    if (rc < 0) throw Error(concat("GPT-2 pre-tokenizer: ", pcre2_message(rc)));
    options = PCRE2_NO_UTF_CHECK;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(m.md.get());
    if (ov[1] <= pos) throw Error("GPT-2 pre-tokenizer: empty match");
    const std::string_view piece = text.substr(ov[0], ov[1] - ov[0]);
    pos = ov[1];
    if (piece.size() == 1) {
      out.push_back(m.sym_token[static_cast<unsigned char>(piece[0])]);
      continue;
    }
    if (piece.size() > kCachePiece) {
      m.merge(piece, out);
      continue;
    }
    auto it = m.cache.find(std::string(piece));
    if (it == m.cache.end()) {
      if (m.cache.size() >= kCacheEntries) m.cache.clear();
      std::vector<uint32_t> ids;
      m.merge(piece, ids);
      it = m.cache.emplace(std::string(piece), std::move(ids)).first;
    }
    out.insert(out.end(), it->second.begin(), it->second.end());
  }
}

std::string Gpt2Bpe::decode(const std::vector<uint32_t>& ids) const {
  std::string text;
  for (uint32_t id : ids) {
    if (id >= impl_->token_bytes.size())
      throw UsageError(concat("token ", id, " is >= vocab_size ", impl_->vocab_size));
    text += impl_->token_bytes[id];
  }
  return text;
}

}  // namespace mpitrain
