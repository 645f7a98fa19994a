// A Hugging Face byte-level BPE tokenizer.json: loading and checking every key the encoding depends
// on, the Oniguruma-style Split patterns rewritten for PCRE2, the pre-tokenizer pipeline with the
// `tokenizers` library's split behaviours, NFC through utf8proc, and the shared merge engine
// (bpe_merge.h) in Hugging Face's merge order.
#include "mpitrain/hf_tokenizer.h"

#include <openssl/evp.h>
#include <utf8proc.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <deque>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "mpitrain/bpe_merge.h"
#include "mpitrain/error.h"
#include "mpitrain/onig_pattern.h"

namespace mpitrain {

using nlohmann::json;

namespace {

std::string sha256_hex(const std::string& bytes) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (!EVP_Digest(bytes.data(), bytes.size(), md, &n, EVP_sha256(), nullptr))
    throw Error("SHA-256 (OpenSSL EVP_Digest) failed");
  static const char* kHex = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < n; ++i) {
    hex += kHex[md[i] >> 4];
    hex += kHex[md[i] & 15];
  }
  return hex;
}

enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

// One step of the pre-tokenizer: a Split, or the ByteLevel step (which must come last).
struct Step {
  bool byte_level = false;
  std::unique_ptr<bpe::Pattern> pattern;  // Split; ByteLevel with use_regex: GPT-2's
  Behavior behavior = Behavior::isolated;
  bool invert = false;
  bool add_prefix_space = false;
};

}  // namespace

// ---- state -------------------------------------------------------------------------------------

struct HfTokenizer::Impl {
  std::string path, sha256;
  bool nfc = false;
  std::vector<Step> steps;
  bpe::Merger merger{bpe::Merger::Order::immediate};
  std::unordered_map<std::string, uint32_t> ids;  // vocab and added tokens, as written
  std::vector<std::string> token_bytes;           // id -> bytes (decode)
  std::vector<bool> known;                        // id -> names a token
  std::optional<uint32_t> separator;
  // Scratch of encode(): the pieces of one text, and the strings a prefix space made.
  std::vector<std::string_view> pieces, next;
  std::deque<std::string> owned;

  [[noreturn]] void bad(const std::string& key, const std::string& what) const {
    throw UsageError(concat(path, ": ", key, ": ", what));
  }
  void load_normalizer(const json& j);
  void load_pre_tokenizer(const json& j);
  void load_model(const json& j);
  void load_added(const json& j);
  void find_separator(const json& root);
  void split(std::string_view text, const Step& s);
};

namespace {

const json* member(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

std::string type_of(const json& j) {
  const json* t = j.is_object() ? member(j, "type") : nullptr;
  return t && t->is_string() ? t->get<std::string>() : "";
}

constexpr const char* kSentencePiece =
    "a SentencePiece-style tokenizer (byte_fallback / Metaspace); only byte-level BPE "
    "tokenizer.json files (GPT-2, Llama 3, Qwen2/3) are supported";

}  // namespace

// ---- loading -----------------------------------------------------------------------------------

void HfTokenizer::Impl::load_normalizer(const json& j) {
  std::vector<std::pair<std::string, const json*>> list{{"normalizer", &j}};
  if (type_of(j) == "Sequence") {
    const json* n = member(j, "normalizers");
    if (!n || !n->is_array()) bad("normalizer.normalizers", "expected an array");
    list.clear();
    for (size_t i = 0; i < n->size(); ++i)
      list.emplace_back(concat("normalizer.normalizers[", i, "]"), &(*n)[i]);
  }
  for (auto& [key, n] : list) {
    if (type_of(*n) != "NFC")
      bad(key + ".type", concat("'", type_of(*n), "' is not supported (supported: NFC, or none)"));
    nfc = true;
  }
}

void HfTokenizer::Impl::load_pre_tokenizer(const json& j) {
  std::vector<std::pair<std::string, const json*>> list{{"pre_tokenizer", &j}};
  if (type_of(j) == "Sequence") {
    const json* p = member(j, "pretokenizers");
    if (!p || !p->is_array()) bad("pre_tokenizer.pretokenizers", "expected an array");
    list.clear();
    for (size_t i = 0; i < p->size(); ++i)
      list.emplace_back(concat("pre_tokenizer.pretokenizers[", i, "]"), &(*p)[i]);
  }
  auto flag = [&](const json& o, const char* name, bool fallback, const std::string& key) {
    const json* f = member(o, name);
    if (f && !f->is_boolean()) bad(key + "." + name, "expected true or false");
    return f ? f->get<bool>() : fallback;
  };
  for (auto& [key, p] : list) {
    const std::string type = type_of(*p);
    if (!steps.empty() && steps.back().byte_level)
      bad(key, concat("a ", type, " step after ByteLevel is not supported"));
    Step s;
    if (type == "ByteLevel") {
      s.byte_level = true;
      s.add_prefix_space = flag(*p, "add_prefix_space", true, key);
      if (flag(*p, "use_regex", true, key))
        s.pattern = std::make_unique<bpe::Pattern>(bpe::gpt2_pattern(), "GPT-2 pattern");
    } else if (type == "Split") {
      const json* pat = member(*p, "pattern");
      const json* re = pat && pat->is_object() ? member(*pat, "Regex") : nullptr;
      const json* lit = pat && pat->is_object() ? member(*pat, "String") : nullptr;
      if (!(re && re->is_string()) && !(lit && lit->is_string()))
        bad(key + ".pattern", "expected {\"Regex\": \"...\"} or {\"String\": \"...\"}");
      std::string translated;
      try {
        translated = re ? onig_to_pcre2(re->get<std::string>()) : escape_literal(lit->get<std::string>());
      } catch (const UsageError& e) {
        bad(key + ".pattern.Regex", e.what());
      }
      s.pattern = std::make_unique<bpe::Pattern>(translated, concat(path, ": ", key, ".pattern"));
      const json* b = member(*p, "behavior");
      const std::string behavior = b && b->is_string() ? b->get<std::string>() : "";
      static const std::pair<const char*, Behavior> kBehaviors[] = {
          {"Removed", Behavior::removed},
          {"Isolated", Behavior::isolated},
          {"MergedWithPrevious", Behavior::merged_with_previous},
          {"MergedWithNext", Behavior::merged_with_next},
          {"Contiguous", Behavior::contiguous}};
      bool found = false;
      for (auto& [name, value] : kBehaviors)
        if (behavior == name) s.behavior = value, found = true;
      if (!found)
        bad(key + ".behavior", concat("'", behavior, "' is not one of Removed, Isolated, ",
                                      "MergedWithPrevious, MergedWithNext, Contiguous"));
      s.invert = flag(*p, "invert", false, key);
    } else if (type == "Metaspace") {
      bad(key + ".type", kSentencePiece);
    } else {
      bad(key + ".type", concat("'", type, "' is not supported (supported: Split, ByteLevel)"));
    }
    steps.push_back(std::move(s));
  }
  if (steps.empty() || !steps.back().byte_level)
    bad("pre_tokenizer", "no ByteLevel step: not a byte-level BPE tokenizer");
}

void HfTokenizer::Impl::load_model(const json& m) {
  if (!m.is_object()) bad("model", "expected an object");
  if (const json* t = member(m, "type"); t && *t != "BPE")
    bad("model.type", concat(t->dump(), " is not supported (supported: BPE)"));
  if (const json* f = member(m, "byte_fallback"); f && *f == true) bad("model.byte_fallback", kSentencePiece);
  if (const json* d = member(m, "dropout"); d && !(d->is_number() && d->get<double>() == 0))
    bad("model.dropout", concat(d->dump(), ": BPE dropout is not supported"));
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* s = member(m, key); s && !(s->is_string() && s->get<std::string>().empty()))
      bad(concat("model.", key), concat(s->dump(), " is not supported (byte-level BPE has none)"));

  const json* vocab = member(m, "vocab");
  if (!vocab || !vocab->is_object() || vocab->empty())
    bad("model.vocab", "expected an object {\"token\": id, ...}");
  std::vector<const std::string*> by_id;
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    const json& v = it.value();
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= (int64_t{1} << 31))
      bad("model.vocab", concat("id of '", it.key(), "' is ", v.dump(), ", expected an integer in [0, 2^31)"));
    const auto id = v.get<uint32_t>();
    if (id >= by_id.size()) by_id.resize(id + 1, nullptr);
    if (by_id[id]) bad("model.vocab", concat("id ", id, " given to both '", *by_id[id], "' and '", it.key(), "'"));
    by_id[id] = &it.key();
    ids.emplace(it.key(), id);
  }
  token_bytes.resize(by_id.size());
  known.assign(by_id.size(), false);
  std::unordered_map<std::string, uint32_t> whole;  // ignore_merges: bytes of a token -> its id
  for (size_t id = 0; id < by_id.size(); ++id) {
    if (!by_id[id]) continue;
    bool all_mapped = false;
    token_bytes[id] = bpe::symbol_bytes(*by_id[id], &all_mapped);
    if (!all_mapped) token_bytes[id] = *by_id[id];  // decoded as written, as ByteLevel does
    known[id] = true;
    if (all_mapped) whole.emplace(token_bytes[id], static_cast<uint32_t>(id));
  }
  for (int b = 0; b < 256; ++b) {
    auto it = ids.find(bpe::byte_symbol(static_cast<unsigned char>(b)));
    if (it == ids.end())
      bad("model.vocab", concat("no token for byte ", b, " ('", bpe::byte_symbol(static_cast<unsigned char>(b)),
                                "'), which ByteLevel needs"));
    merger.set_token(static_cast<uint32_t>(b), it->second);
  }
  if (const json* f = member(m, "ignore_merges")) {
    if (!f->is_boolean()) bad("model.ignore_merges", "expected true or false");
    if (f->get<bool>()) merger.set_whole_tokens(std::move(whole));
  }

  const json* merges = member(m, "merges");
  if (!merges || !merges->is_array()) bad("model.merges", "expected an array");
  for (size_t r = 0; r < merges->size(); ++r) {
    const json& e = (*merges)[r];
    const std::string key = concat("model.merges[", r, "]");
    std::string a, b;
    if (e.is_string()) {  // "a b": the older format, for tokens without spaces
      const std::string s = e.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || sp == 0 || sp + 1 == s.size() || s.find(' ', sp + 1) != std::string::npos)
        bad(key, concat("expected two tokens separated by one space, got ", e.dump()));
      a = s.substr(0, sp), b = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>(), b = e[1].get<std::string>();
    } else {
      bad(key, concat("expected \"a b\" or [\"a\", \"b\"], got ", e.dump()));
    }
    for (const std::string* t : {&a, &b})
      if (!ids.count(*t)) bad(key, concat("'", *t, "' names no token"));
    auto joined = ids.find(a + b);
    if (joined == ids.end()) bad(key, concat("the merged '", a + b, "' names no token"));
    const uint32_t left = merger.symbol(a), right = merger.symbol(b), result = merger.symbol(a + b);
    merger.set_token(left, ids.at(a));
    merger.set_token(right, ids.at(b));
    merger.set_token(result, joined->second);
    merger.add_merge(left, right, result, static_cast<uint32_t>(r));
  }
}

void HfTokenizer::Impl::load_added(const json& added) {
  if (!added.is_array()) bad("added_tokens", "expected an array");
  for (size_t i = 0; i < added.size(); ++i) {
    const json& a = added[i];
    const std::string key = concat("added_tokens[", i, "]");
    const json* id = a.is_object() ? member(a, "id") : nullptr;
    const json* content = a.is_object() ? member(a, "content") : nullptr;
    if (!id || !id->is_number_integer() || id->get<int64_t>() < 0 || id->get<int64_t>() >= (int64_t{1} << 31))
      bad(key + ".id", "expected an integer in [0, 2^31)");
    if (!content || !content->is_string() || content->get<std::string>().empty())
      bad(key + ".content", "expected a non-empty string");
    const auto n = id->get<uint32_t>();
    const std::string text = content->get<std::string>();
    const auto same = ids.find(text);
    if (same != ids.end() && same->second != n)
      bad(key, concat("'", text, "' has id ", n, " but already id ", same->second));
    if (n < known.size() && known[n] && same == ids.end())
      bad(key + ".id", concat(n, " is already another token"));
    if (n >= known.size()) {
      known.resize(n + 1, false);
      token_bytes.resize(n + 1);
    }
    if (!known[n]) token_bytes[n] = text;  // added tokens decode as their content
    known[n] = true;
    ids.emplace(text, n);
  }
}

void HfTokenizer::Impl::find_separator(const json& root) {
  // The post_processor's TemplateProcessing (alone or in a Sequence): a special token before
  // the text of a single sequence is the beginning-of-sequence token.
  const json* post = member(root, "post_processor");
  std::vector<const json*> procs;
  if (post && type_of(*post) == "Sequence" && member(*post, "processors") && (*post)["processors"].is_array())
    for (const json& p : (*post)["processors"]) procs.push_back(&p);
  else if (post)
    procs.push_back(post);
  for (const json* p : procs) {
    const json* single = type_of(*p) == "TemplateProcessing" ? member(*p, "single") : nullptr;
    if (!single || !single->is_array() || single->empty() || !(*single)[0].is_object()) continue;
    const json* special = member((*single)[0], "SpecialToken");
    const json* name = special && special->is_object() ? member(*special, "id") : nullptr;
    if (!name || !name->is_string()) continue;
    if (auto it = ids.find(name->get<std::string>()); it != ids.end()) {
      separator = it->second;
      return;
    }
  }
  for (const char* name : {"<|begin_of_text|>", "<|endoftext|>", "<|end_of_text|>"})
    if (auto it = ids.find(name); it != ids.end()) {
      separator = it->second;
      return;
    }
}

HfTokenizer::HfTokenizer(const std::string& path) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.path = path;
  const std::string bytes = bpe::read_file(path);
  m.sha256 = sha256_hex(bytes);
  json root;
  try {
    root = json::parse(bytes);
  } catch (const json::exception& e) {
    throw UsageError(concat(path, ": malformed JSON: ", e.what()));
  }
  if (!root.is_object()) throw UsageError(path + ": expected a JSON object (a tokenizer.json)");
  const json* model = member(root, "model");
  if (!model) m.bad("model", "missing");
  m.load_model(*model);
  if (const json* n = member(root, "normalizer")) m.load_normalizer(*n);
  const json* pre = member(root, "pre_tokenizer");
  if (!pre) m.bad("pre_tokenizer", "missing (a byte-level BPE tokenizer has a ByteLevel step)");
  m.load_pre_tokenizer(*pre);
  if (const json* d = member(root, "decoder"); d && type_of(*d) != "ByteLevel")
    m.bad("decoder.type", type_of(*d) == "Metaspace" ? kSentencePiece
                                                     : concat("'", type_of(*d), "' is not supported (supported: ByteLevel)"));
  if (const json* a = member(root, "added_tokens")) m.load_added(*a);
  m.find_separator(root);
}

HfTokenizer::~HfTokenizer() = default;
HfTokenizer::HfTokenizer(HfTokenizer&&) noexcept = default;
HfTokenizer& HfTokenizer::operator=(HfTokenizer&&) noexcept = default;

int64_t HfTokenizer::vocab_size() const { return static_cast<int64_t>(impl_->known.size()); }
const std::string& HfTokenizer::sha256() const { return impl_->sha256; }
const std::string& HfTokenizer::path() const { return impl_->path; }
std::optional<uint32_t> HfTokenizer::separator() const { return impl_->separator; }

std::optional<uint32_t> HfTokenizer::token_id(const std::string& token) const {
  auto it = impl_->ids.find(token);
  if (it == impl_->ids.end()) return std::nullopt;
  return it->second;
}

// ---- encoding ----------------------------------------------------------------------------------

std::string HfTokenizer::normalize(std::string_view text) const {
  if (const size_t bad = bpe::find_invalid_utf8(text); bad != std::string_view::npos)
    throw InvalidUtf8(bad, concat("invalid UTF-8 at byte ", bad));
  bool ascii = true;
  for (char c : text) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
  if (!impl_->nfc || ascii) return std::string(text);  // ASCII is its own NFC
  utf8proc_uint8_t* dst = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), static_cast<utf8proc_ssize_t>(text.size()),
                   &dst, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) throw Error(concat("utf8proc NFC: ", utf8proc_errmsg(n)));
  std::string out(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
  std::free(dst);
  return out;
}

// The `tokenizers` library's NormalizedString::split: the text as alternating matches and gaps
// (an empty match still cuts), kept or dropped and joined per the behaviour; empty pieces vanish.
void HfTokenizer::Impl::split(std::string_view text, const Step& s) {
  struct Cut {
    size_t begin, end;
    bool match;
  };
  std::vector<Cut> cuts;
  size_t prev = 0, begin = 0, end = 0;
  for (size_t pos = 0; pos <= text.size() && s.pattern->find(text, pos, begin, end);) {
    if (begin > prev) cuts.push_back({prev, begin, false});
    cuts.push_back({begin, end, true});
    prev = end;
    pos = end;
    if (begin == end) {  // step over one character after an empty match
      if (pos >= text.size()) break;
      do ++pos;
      while (pos < text.size() && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80);
    }
  }
  if (prev < text.size()) cuts.push_back({prev, text.size(), false});
  if (s.invert)
    for (Cut& c : cuts) c.match = !c.match;

  // The kept cuts are rewritten in place, [lo, hi) of `cuts` (no second vector: GCC 14 reported
  // a -Wfree-nonheap-object false positive on the copy and its std::reverse).
  size_t lo = 0, hi = 0;
  bool previous_match = false;
  switch (s.behavior) {
    case Behavior::removed:
      for (size_t i = 0; i < cuts.size(); ++i)
        if (!cuts[i].match) cuts[hi++] = cuts[i];
      break;
    case Behavior::isolated:
      hi = cuts.size();
      break;
    case Behavior::contiguous:
      for (size_t i = 0; i < cuts.size(); ++i) {
        const Cut c = cuts[i];
        if (hi > 0 && c.match == previous_match) cuts[hi - 1].end = c.end;
        else cuts[hi++] = c;
        previous_match = c.match;
      }
      break;
    case Behavior::merged_with_previous:
      for (size_t i = 0; i < cuts.size(); ++i) {
        const Cut c = cuts[i];
        if (hi > 0 && c.match && !previous_match) cuts[hi - 1].end = c.end;
        else cuts[hi++] = c;
        previous_match = c.match;
      }
      break;
    case Behavior::merged_with_next:  // from the back: a match joins the gap after it
      lo = hi = cuts.size();
      for (size_t i = cuts.size(); i-- > 0;) {
        const Cut c = cuts[i];
        if (lo < hi && c.match && !previous_match) cuts[lo].begin = c.begin;
        else cuts[--lo] = c;
        previous_match = c.match;
      }
      break;
  }
  for (size_t i = lo; i < hi; ++i)
    if (cuts[i].end > cuts[i].begin) next.push_back(text.substr(cuts[i].begin, cuts[i].end - cuts[i].begin));
}

void HfTokenizer::encode(std::string_view text, std::vector<uint32_t>& out) {
  Impl& m = *impl_;
  const std::string normal = normalize(text);
  m.pieces.assign(1, normal);
  m.owned.clear();
  for (const Step& s : m.steps) {
    m.next.clear();
    for (std::string_view p : m.pieces) {
      if (p.empty()) continue;
      if (s.byte_level && s.add_prefix_space && p[0] != ' ') {
        m.owned.push_back(" " + std::string(p));
        p = m.owned.back();
      }
      if (s.pattern)
        m.split(p, s);
      else
        m.next.push_back(p);
    }
    std::swap(m.pieces, m.next);
  }
  for (std::string_view p : m.pieces) m.merger.encode_piece(p, out);
}

std::vector<uint32_t> HfTokenizer::encode(std::string_view text) {
  std::vector<uint32_t> out;
  encode(text, out);
  return out;
}

std::string HfTokenizer::decode(const std::vector<uint32_t>& ids) const {
  std::string text;
  for (uint32_t id : ids) {
    if (id >= impl_->known.size() || !impl_->known[id])
      throw UsageError(concat(impl_->path, ": token ", id, " names no token"));
    text += impl_->token_bytes[id];
  }
  return text;
}

}  // namespace mpitrain
