// A Hugging Face BPE tokenizer.json, byte-level or SentencePiece-style: loading and checking every
// key the encoding depends on, the added tokens cut out of the text first (the `tokenizers`
// library's AddedVocabulary: leftmost-longest matching, single_word, lstrip, rstrip, normalized),
// the normalizers (NFC through utf8proc, Prepend, Replace), the Oniguruma-style Split patterns
// rewritten for PCRE2, the pre-tokenizer pipeline with the `tokenizers` library's split
// behaviours, byte fallback, and the shared merge engine (bpe_merge.h) in Hugging Face's merge
// order.
#include "mpitrain/hf_tokenizer.h"

#include <openssl/evp.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <cstdio>
#include <deque>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "mpitrain/added_tokens.h"
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

namespace {
// One normalizer: NFC, Prepend (`text` before a non-empty string), Replace (every `text` by `with`).
struct NormalizerStep {
  enum Kind { nfc, prepend, replace } kind;
  std::string text, with;
};
}  // namespace

struct HfTokenizer::Impl {
  std::string path, sha256;
  std::vector<NormalizerStep> norms;
  std::vector<Step> steps;
  // SentencePiece-style BPE (model.byte_fallback): no pre-tokenizer, the normalized text's
  // characters are the first symbols; a character that is no token becomes the <0xXX> tokens of
  // its bytes, else the unknown token (fuse_unk: one for a run of them).
  bool byte_fallback = false, ignore_merges = false, fuse_unk = false;
  std::optional<uint32_t> unk_symbol, unk_id;
  std::vector<int64_t> byte_symbol;   // byte -> the symbol of its "<0xXX>" token, -1: none
  std::vector<int64_t> ascii_symbol;  // ASCII character -> its symbol when it is a token, -1: not
  std::vector<std::pair<std::string, std::string>> decode_replace;  // the decoder's Replace steps
  size_t decode_strip_start = 0;      // the decoder's Strip: leading characters it removes
  std::string decode_strip;
  std::vector<uint32_t> symbols;      // scratch of encode()
  bpe::Merger merger{bpe::Merger::Order::immediate};
  std::unordered_map<std::string, uint32_t> ids;  // vocab and added tokens, as written
  std::vector<std::string> token_bytes;           // id -> bytes (decode)
  std::vector<bool> known;                        // id -> names a token
  std::vector<bool> added;                        // id -> an added token (added_tokens)
  // Ids must stay below this: the number of entries (vocab and added tokens) plus kIdGap. The
  // tables are indexed by id, so a file claiming id 2^31 - 2 would otherwise size them at gigabytes.
  int64_t id_limit = 0;
  static constexpr int64_t kIdGap = 1 << 20;
  std::optional<uint32_t> separator;
  // Scratch of encode(): the pieces of one text, and the strings a prefix space made.
  std::vector<std::string_view> pieces, next;
  std::deque<std::string> owned;
  // The added tokens (one per id), found in the text as written (normalized: false) or in each
  // normalized piece (normalized: true, the entry normalized too); special ones only with
  // match_special. `plain`: some added token is not special.
  std::vector<AddedToken> added_tokens;
  AddedTokenTrie raw_trie, normalized_trie;
  bool plain = false, match_special = false;

  [[noreturn]] void bad(const std::string& key, const std::string& what) const {
    throw UsageError(concat(path, ": ", key, ": ", what));
  }
  // Reading the file: the steps of `key` (the `array` member of a Sequence, else the object
  // alone), a true/false member (`fallback` when absent), a Replace step's {"pattern": {"String":
  // s}, "content": c} as (s, c) (a Regex pattern is refused); each names the key when wrong.
  std::vector<std::pair<std::string, const json*>> steps_of(const json& j, const std::string& key, const char* array) const;
  bool flag(const json& o, const char* name, bool fallback, const std::string& key) const;
  Behavior behavior_of(const json& split, const std::string& key) const;
  std::pair<std::string, std::string> replace_of(const json& j, const std::string& key) const;
  void load_normalizer(const json& j);
  void load_pre_tokenizer(const json& j);
  void load_model(const json& j);
  void load_added(const json& j);
  void load_sentencepiece_pre_tokenizer(const json& j);
  void load_decoder(const json& j);
  void find_separator(const json& root);
  void split(std::string_view text, const Step& s);
  void encode_sentencepiece(std::string_view text, std::vector<uint32_t>& out);
  // Encoding: the normalizers on one piece of text; the added tokens of `text` found with `trie`
  // (added_tokens.h) as `cuts`; encode's walk over a (valid UTF-8)
  // text, calling on_token(id) for each added token it cuts out and on_text(piece) for each
  // normalized piece between them; the pre-tokenizer and the model on one normalized piece.
  std::string normalize_piece(std::string_view text) const;
  template <class OnToken, class OnText>
  void walk(std::string_view text, OnToken on_token, OnText on_text) const;
  void encode_normalized(std::string_view normal, std::vector<uint32_t>& out);
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

constexpr const char* kMetaspace =
    "the Metaspace pre-tokenizer (older SentencePiece conversions) is not supported; SentencePiece-style "
    "files whose normalizer writes the spaces as U+2581 (Llama 2, Mistral, Gemma: Prepend and Replace) are";

// The byte a byte-fallback token stands for ("<0x0A>": 10; upper-case hex, as the `tokenizers`
// library writes them), or -1.
int byte_token(std::string_view t) {
  auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1; };
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>' || hex(t[3]) < 0 || hex(t[4]) < 0) return -1;
  return hex(t[3]) * 16 + hex(t[4]);
}

}  // namespace

// ---- loading -----------------------------------------------------------------------------------

std::vector<std::pair<std::string, const json*>> HfTokenizer::Impl::steps_of(const json& j, const std::string& key,
                                                                            const char* array) const {
  std::vector<std::pair<std::string, const json*>> list{{key, &j}};
  if (type_of(j) != "Sequence") return list;
  const json* n = member(j, array);
  if (!n || !n->is_array()) bad(concat(key, ".", array), "expected an array");
  list.clear();
  for (size_t i = 0; i < n->size(); ++i) list.emplace_back(concat(key, ".", array, "[", i, "]"), &(*n)[i]);
  return list;
}

bool HfTokenizer::Impl::flag(const json& o, const char* name, bool fallback, const std::string& key) const {
  const json* f = member(o, name);
  if (f && !f->is_boolean()) bad(key + "." + name, "expected true or false");
  return f ? f->get<bool>() : fallback;
}

std::pair<std::string, std::string> HfTokenizer::Impl::replace_of(const json& j, const std::string& key) const {
  const json* pat = member(j, "pattern");
  const json* lit = pat && pat->is_object() ? member(*pat, "String") : nullptr;
  const json* content = member(j, "content");
  if (!lit || !lit->is_string() || lit->get<std::string>().empty())
    bad(key + ".pattern", "expected {\"String\": \"...\"} (a Regex pattern is not supported)");
  if (!content || !content->is_string()) bad(key + ".content", "expected a string");
  return {lit->get<std::string>(), content->get<std::string>()};
}

void HfTokenizer::Impl::load_normalizer(const json& j) {
  for (auto& [key, n] : steps_of(j, "normalizer", "normalizers")) {
    const std::string type = type_of(*n);
    if (type == "NFC") {
      norms.push_back({NormalizerStep::nfc, "", ""});
    } else if (type == "Prepend") {
      const json* p = member(*n, "prepend");
      if (!p || !p->is_string()) bad(key + ".prepend", "expected a string");
      norms.push_back({NormalizerStep::prepend, p->get<std::string>(), ""});
    } else if (type == "Replace") {
      auto [text, with] = replace_of(*n, key);
      norms.push_back({NormalizerStep::replace, text, with});
    } else {
      bad(key + ".type", concat("'", type, "' is not supported (supported: NFC, Prepend, Replace with a String "
                                           "pattern, a Sequence of them, or none)"));
    }
  }
}

void HfTokenizer::Impl::load_decoder(const json& j) {
  if (!byte_fallback) {
    if (type_of(j) != "ByteLevel")
      bad("decoder.type", concat("'", type_of(j), "' is not supported for a byte-level BPE (supported: ByteLevel)"));
    return;
  }
  for (auto& [key, d] : steps_of(j, "decoder", "decoders")) {
    const std::string type = type_of(*d);
    if (type == "Replace") {
      decode_replace.push_back(replace_of(*d, key));
    } else if (type == "Strip") {
      const json* content = member(*d, "content");
      const json* start = member(*d, "start");
      if (!content || !content->is_string() || !start || !start->is_number_unsigned())
        bad(key, "expected a Strip with a content string and a start count");
      decode_strip = content->get<std::string>(), decode_strip_start = start->get<size_t>();
    } else if (type != "ByteFallback" && type != "Fuse") {
      bad(key + ".type", concat("'", type, "' is not supported for a SentencePiece-style BPE (supported: Replace, "
                                           "ByteFallback, Fuse, Strip)"));
    }
  }
}

Behavior HfTokenizer::Impl::behavior_of(const json& split, const std::string& key) const {
  const json* b = member(split, "behavior");
  const std::string behavior = b && b->is_string() ? b->get<std::string>() : "";
  static const std::pair<const char*, Behavior> kBehaviors[] = {
      {"Removed", Behavior::removed},
      {"Isolated", Behavior::isolated},
      {"MergedWithPrevious", Behavior::merged_with_previous},
      {"MergedWithNext", Behavior::merged_with_next},
      {"Contiguous", Behavior::contiguous}};
  for (auto& [name, value] : kBehaviors)
    if (behavior == name) return value;
  bad(key + ".behavior", concat("'", behavior, "' is not one of Removed, Isolated, ",
                                "MergedWithPrevious, MergedWithNext, Contiguous"));
}

void HfTokenizer::Impl::load_pre_tokenizer(const json& j) {
  for (auto& [key, p] : steps_of(j, "pre_tokenizer", "pretokenizers")) {
    const std::string type = type_of(*p);
    if (!steps.empty() && steps.back().byte_level)
      bad(key, concat("a ", type, " step after ByteLevel is not supported"));
    Step s;
    if (type == "ByteLevel") {
      s.byte_level = true;
      // Required, as Hugging Face's tokenizers (Rust) deserialises the step: a file without it
      // does not load there, and a default would encode the first word of every text one way or
      // the other (" Hello" or "Hello") by guess.
      if (!member(*p, "add_prefix_space"))
        bad(key + ".add_prefix_space", "missing (a ByteLevel step must say true or false, as tokenizers requires)");
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
      s.behavior = behavior_of(*p, key);
      s.invert = flag(*p, "invert", false, key);
    } else if (type == "Metaspace") {
      bad(key + ".type", kMetaspace);
    } else {
      bad(key + ".type", concat("'", type, "' is not supported (supported: Split, ByteLevel)"));
    }
    steps.push_back(std::move(s));
  }
  if (steps.empty() || !steps.back().byte_level)
    bad("pre_tokenizer", "no ByteLevel step: not a byte-level BPE tokenizer");
}

// A SentencePiece-style BPE has no pre-tokenizer: the normalized text is one piece. A Split is
// accepted where it provably cannot cut that text: its String pattern holds a character that a
// Replace of the normalizer removes (replaces by text without it) and no later normalizer step can
// bring back (a Prepend or Replace writing it, or an NFC, which composes characters). Gemma 3's
// Split on " " after its Replace of " " by "▁" is such a no-op: with no match, every behaviour
// keeps the piece whole — except Removed with invert, where the whole text is the match.
void HfTokenizer::Impl::load_sentencepiece_pre_tokenizer(const json& j) {
  for (auto& [key, p] : steps_of(j, "pre_tokenizer", "pretokenizers")) {
    const std::string type = type_of(*p);
    if (type == "Metaspace") bad(key == "pre_tokenizer" ? key : key + ".type", kMetaspace);
    if (type != "Split")
      bad(key, concat("'", type, "': a SentencePiece-style BPE (model.byte_fallback) has none (accepted: a Split "
                                 "that cannot match the normalized text)"));
    const json* pat = member(*p, "pattern");
    const json* lit = pat && pat->is_object() ? member(*pat, "String") : nullptr;
    if (!lit || !lit->is_string())
      bad(key + ".pattern", "a SentencePiece-style BPE (model.byte_fallback) accepts only a Split on a {\"String\": "
                            "...} that its normalizer removes (a Regex or other pattern could cut the text)");
    const Behavior behavior = behavior_of(*p, key);
    if (flag(*p, "invert", false, key) && behavior == Behavior::removed)
      bad(key + ".invert", "true with behavior Removed removes the whole text");
    const std::string s = lit->get<std::string>();
    bool removed = false;
    for (size_t i = 0; i < s.size() && !removed;) {
      const auto c0 = static_cast<unsigned char>(s[i]);
      const size_t len = c0 < 0x80 ? 1 : c0 < 0xE0 ? 2 : c0 < 0xF0 ? 3 : 4;  // JSON strings are UTF-8
      const std::string c = s.substr(i, len);
      i += len;
      for (const NormalizerStep& n : norms) {  // the last step that writes or removes `c` decides
        if (n.kind == NormalizerStep::nfc) removed = false;
        else if (n.kind == NormalizerStep::prepend && n.text.find(c) != std::string::npos) removed = false;
        else if (n.kind == NormalizerStep::replace && n.with.find(c) != std::string::npos) removed = false;
        else if (n.kind == NormalizerStep::replace && n.text == c) removed = true;
      }
    }
    if (!removed)
      bad(key + ".pattern", concat(lit->dump(), " can match the normalized text, which a SentencePiece-style BPE "
                                   "(model.byte_fallback) takes whole: accepted only where a Replace of the "
                                   "normalizer removes one of its characters"));
  }
}

void HfTokenizer::Impl::load_model(const json& m) {
  if (!m.is_object()) bad("model", "expected an object");
  if (const json* t = member(m, "type"); t && *t != "BPE")
    bad("model.type", concat(t->dump(), " is not supported (supported: BPE)"));
  byte_fallback = flag(m, "byte_fallback", false, "model");
  fuse_unk = flag(m, "fuse_unk", false, "model");
  if (const json* d = member(m, "dropout"); d && !(d->is_number() && d->get<double>() == 0))
    bad("model.dropout", concat(d->dump(), ": BPE dropout is not supported"));
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* s = member(m, key); s && !(s->is_string() && s->get<std::string>().empty()))
      bad(concat("model.", key), concat(s->dump(), " is not supported (byte-level and SentencePiece-style BPE have none)"));

  const json* vocab = member(m, "vocab");
  if (!vocab || !vocab->is_object() || vocab->empty())
    bad("model.vocab", "expected an object {\"token\": id, ...}");
  std::vector<const std::string*> by_id;
  id_limit += static_cast<int64_t>(vocab->size()) + kIdGap;
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    const json& v = it.value();
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= (int64_t{1} << 31))
      bad("model.vocab", concat("id of '", it.key(), "' is ", v.dump(), ", expected an integer in [0, 2^31)"));
    if (v.get<int64_t>() >= id_limit)
      bad("model.vocab", concat("id of '", it.key(), "' is ", v.dump(), ", far beyond the file's ", id_limit - kIdGap,
                                " tokens (ids must be below ", id_limit, ")"));
    const auto id = v.get<uint32_t>();
    if (id >= by_id.size()) by_id.resize(id + 1, nullptr);
    if (by_id[id]) bad("model.vocab", concat("id ", id, " given to both '", *by_id[id], "' and '", it.key(), "'"));
    by_id[id] = &it.key();
    ids.emplace(it.key(), id);
  }
  token_bytes.resize(by_id.size());
  known.assign(by_id.size(), false);
  ignore_merges = flag(m, "ignore_merges", false, "model");
  if (byte_fallback) {  // SentencePiece-style: tokens are text; "<0xXX>" are single bytes
    byte_symbol.assign(256, -1);
    ascii_symbol.assign(128, -1);
    for (size_t id = 0; id < by_id.size(); ++id) {
      if (!by_id[id]) continue;
      const std::string& t = *by_id[id];
      const uint32_t sym = merger.symbol(t);
      merger.set_token(sym, static_cast<uint32_t>(id));
      known[id] = true;
      token_bytes[id] = t;
      if (const int b = byte_token(t); b >= 0) {
        byte_symbol[static_cast<size_t>(b)] = sym;
        token_bytes[id] = std::string(1, static_cast<char>(b));
      }
      if (t.size() == 1 && static_cast<unsigned char>(t[0]) < 0x80) ascii_symbol[static_cast<unsigned char>(t[0])] = sym;
    }
    if (const json* u = member(m, "unk_token")) {
      if (!u->is_string() || !ids.count(u->get<std::string>()))
        bad("model.unk_token", concat(u->dump(), " names no token"));
      unk_symbol = merger.symbol(u->get<std::string>());
      unk_id = ids.at(u->get<std::string>());
    }
  }
  std::unordered_map<std::string, uint32_t> whole;  // ignore_merges: bytes of a token -> its id
  for (size_t id = 0; id < by_id.size() && !byte_fallback; ++id) {
    if (!by_id[id]) continue;
    bool all_mapped = false;
    token_bytes[id] = bpe::symbol_bytes(*by_id[id], &all_mapped);
    if (!all_mapped) token_bytes[id] = *by_id[id];  // decoded as written, as ByteLevel does
    known[id] = true;
    if (all_mapped) whole.emplace(token_bytes[id], static_cast<uint32_t>(id));
  }
  for (int b = 0; b < 256 && !byte_fallback; ++b) {
    auto it = ids.find(bpe::byte_symbol(static_cast<unsigned char>(b)));
    if (it == ids.end())
      bad("model.vocab", concat("no token for byte ", b, " ('", bpe::byte_symbol(static_cast<unsigned char>(b)),
                                "'), which ByteLevel needs"));
    merger.set_token(static_cast<uint32_t>(b), it->second);
  }
  if (ignore_merges && !byte_fallback) merger.set_whole_tokens(std::move(whole));

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
    if (byte_fallback && byte_token(a + b) >= 0)
      bad(key, concat("the merged '", a + b, "' is a byte-fallback token, which no merge makes"));
    const uint32_t left = merger.symbol(a), right = merger.symbol(b), result = merger.symbol(a + b);
    merger.set_token(left, ids.at(a));
    merger.set_token(right, ids.at(b));
    merger.set_token(result, joined->second);
    merger.add_merge(left, right, result, static_cast<uint32_t>(r));
  }
}

void HfTokenizer::Impl::load_added(const json& added) {
  if (!added.is_array()) bad("added_tokens", "expected an array");
  std::unordered_map<uint32_t, size_t> listed;  // id -> its entry in added_tokens
  std::vector<std::string> token_text;           // added_tokens[k]'s content
  std::vector<size_t> entry;                     // added_tokens[k]'s index in the file
  for (size_t i = 0; i < added.size(); ++i) {
    const json& a = added[i];
    const std::string key = concat("added_tokens[", i, "]");
    const json* id = a.is_object() ? member(a, "id") : nullptr;
    const json* content = a.is_object() ? member(a, "content") : nullptr;
    if (!id || !id->is_number_integer() || id->get<int64_t>() < 0 || id->get<int64_t>() >= (int64_t{1} << 31))
      bad(key + ".id", "expected an integer in [0, 2^31)");
    if (id->get<int64_t>() >= id_limit)
      bad(key + ".id", concat(id->get<int64_t>(), " is far beyond the file's ", id_limit - kIdGap,
                              " tokens (ids must be below ", id_limit, ")"));
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
    if (n >= this->added.size()) this->added.resize(n + 1, false);
    if (!known[n]) token_bytes[n] = text;  // added tokens decode as their content
    known[n] = true;
    this->added[n] = true;
    ids.emplace(text, n);

    // Where encode() matches it. `special` decides whether it is plain text by default, so it must
    // be stated (as the library writes it); the others default as the library's AddedToken::from.
    AddedToken t;
    t.id = n;
    if (!member(a, "special")) bad(key + ".special", "missing (true or false: whether it is a special token)");
    t.special = flag(a, "special", false, key);
    t.single_word = flag(a, "single_word", false, key);
    t.lstrip = flag(a, "lstrip", false, key);
    t.rstrip = flag(a, "rstrip", false, key);
    t.normalized = flag(a, "normalized", !t.special, key);
    if (auto [it, fresh] = listed.try_emplace(n, added_tokens.size()); !fresh) {
      const AddedToken& o = added_tokens[it->second];
      if (o.special != t.special || o.single_word != t.single_word || o.lstrip != t.lstrip || o.rstrip != t.rstrip ||
          o.normalized != t.normalized)
        bad(key, concat("'", text, "' is listed twice, with different flags"));
      continue;
    }
    added_tokens.push_back(t);
    token_text.push_back(text);
    entry.push_back(i);
    plain = plain || !t.special;
  }
  // The library's order: the special tokens, then the others, each in the file's order (of two
  // entries that read the same after normalizing, the first is matched).
  for (const bool special : {true, false})
    for (size_t k = 0; k < added_tokens.size(); ++k) {
      const AddedToken& t = added_tokens[k];
      if (t.special != special) continue;
      const std::string& text = token_text[k];
      if (!t.normalized) {
        raw_trie.add(text, static_cast<uint32_t>(k));
        continue;
      }
      const std::string normal = normalize_piece(text);
      if (normal.empty()) bad(concat("added_tokens[", entry[k], "].content"), "the normalizer makes it empty");
      normalized_trie.add(normal, static_cast<uint32_t>(k));
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
  // The ids' bound counts the added tokens too (load_model adds the vocabulary's entries).
  if (const json* a = member(root, "added_tokens"); a && a->is_array()) m.id_limit = static_cast<int64_t>(a->size());
  const json* model = member(root, "model");
  if (!model) m.bad("model", "missing");
  m.load_model(*model);
  if (const json* n = member(root, "normalizer")) m.load_normalizer(*n);
  const json* pre = member(root, "pre_tokenizer");
  if (m.byte_fallback) {
    if (pre) m.load_sentencepiece_pre_tokenizer(*pre);
  } else {
    if (!pre) m.bad("pre_tokenizer", "missing (a byte-level BPE tokenizer has a ByteLevel step)");
    m.load_pre_tokenizer(*pre);
  }
  if (const json* d = member(root, "decoder")) m.load_decoder(*d);
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
std::optional<uint32_t> HfTokenizer::unknown_token() const { return impl_->unk_id; }
bool HfTokenizer::is_added_token(uint32_t id) const { return id < impl_->added.size() && impl_->added[id]; }

bool HfTokenizer::adds_prefix_space() const {
  const auto& steps = impl_->steps;
  return std::any_of(steps.begin(), steps.end(), [](const Step& s) { return s.byte_level && s.add_prefix_space; });
}

std::optional<uint32_t> HfTokenizer::token_id(const std::string& token) const {
  auto it = impl_->ids.find(token);
  if (it == impl_->ids.end()) return std::nullopt;
  return it->second;
}

// ---- encoding ----------------------------------------------------------------------------------

namespace {

std::string nfc(const std::string& text) {
  bool ascii = true;
  for (char c : text) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
  if (ascii) return text;  // ASCII is its own NFC
  utf8proc_uint8_t* dst = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), static_cast<utf8proc_ssize_t>(text.size()),
                   &dst, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) throw Error(concat("utf8proc NFC: ", utf8proc_errmsg(n)));
  std::string out(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
  std::free(dst);
  return out;
}

// Every occurrence of `what` (non-empty) in `text` by `with`, left to right.
std::string replace_all(const std::string& text, const std::string& what, const std::string& with) {
  std::string out;
  size_t from = 0;
  for (size_t at; (at = text.find(what, from)) != std::string::npos; from = at + what.size())
    out.append(text, from, at - from).append(with);
  return out.append(text, from, std::string::npos);
}

}  // namespace

std::string HfTokenizer::Impl::normalize_piece(std::string_view text) const {
  std::string out(text);
  for (const NormalizerStep& n : norms) {
    if (n.kind == NormalizerStep::nfc) out = nfc(out);
    else if (n.kind == NormalizerStep::prepend && !out.empty()) out = n.text + out;
    else if (n.kind == NormalizerStep::replace) out = replace_all(out, n.text, n.with);
  }
  return out;
}

// The library's AddedVocabulary::extract_and_normalize, then the rest of the pipeline per piece:
// the tokens written as they are (normalized: false) cut out of the text first; each piece between
// them normalized on its own, and the normalized tokens cut out of that; what is left goes to the
// pre-tokenizer and the model. Empty pieces vanish.
template <class OnToken, class OnText>
void HfTokenizer::Impl::walk(std::string_view text, OnToken on_token, OnText on_text) const {
  if (!(plain || (match_special && !added_tokens.empty()))) {  // nothing to match: one piece
    on_text(std::string_view(normalize_piece(text)));
    return;
  }
  std::vector<AddedCut> outer, inner;
  find_added(text, raw_trie, added_tokens, match_special, outer);
  for (const AddedCut& c : outer) {
    if (c.end <= c.begin) continue;
    if (c.token >= 0) {
      on_token(added_tokens[static_cast<size_t>(c.token)].id);
      continue;
    }
    const std::string normal = normalize_piece(text.substr(c.begin, c.end - c.begin));
    find_added(normal, normalized_trie, added_tokens, match_special, inner);
    for (const AddedCut& d : inner) {
      if (d.end <= d.begin) continue;
      if (d.token >= 0)
        on_token(added_tokens[static_cast<size_t>(d.token)].id);
      else
        on_text(std::string_view(normal).substr(d.begin, d.end - d.begin));
    }
  }
}

std::string HfTokenizer::normalize(std::string_view text) const {
  require_utf8(text);
  std::string out;
  impl_->walk(
      text, [&](uint32_t id) { out += impl_->token_bytes[id]; }, [&](std::string_view piece) { out += piece; });
  return out;
}

void HfTokenizer::set_special_tokens(SpecialTokens mode) { impl_->match_special = mode == SpecialTokens::match; }
SpecialTokens HfTokenizer::special_tokens() const {
  return impl_->match_special ? SpecialTokens::match : SpecialTokens::text;
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

// The `tokenizers` library's BPE::merge_word for a SentencePiece-style model: each character a
// symbol when it is a token, else its bytes' <0xXX> tokens when all exist, else the unknown token
// (a run of them one, with fuse_unk); then the merges by (rank, position).
void HfTokenizer::Impl::encode_sentencepiece(std::string_view text, std::vector<uint32_t>& out) {
  if (text.empty()) return;
  if (ignore_merges && byte_token(text) < 0)
    if (auto it = ids.find(std::string(text)); it != ids.end()) {
      out.push_back(it->second);
      return;
    }
  symbols.clear();
  bool last_unknown = false;
  std::string ch;
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    const size_t len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;  // valid UTF-8 (normalize checked)
    std::optional<uint32_t> sym;
    if (c < 0x80) {
      if (ascii_symbol[c] >= 0) sym = static_cast<uint32_t>(ascii_symbol[c]);
    } else {
      ch.assign(text, i, len);
      sym = merger.find_symbol(ch);
      if (sym && !merger.is_token(*sym)) sym.reset();
    }
    if (sym) {
      symbols.push_back(*sym);
      last_unknown = false;
    } else if (std::all_of(text.begin() + static_cast<std::ptrdiff_t>(i), text.begin() + static_cast<std::ptrdiff_t>(i + len),
                           [&](char b) { return byte_symbol[static_cast<unsigned char>(b)] >= 0; })) {
      for (size_t k = i; k < i + len; ++k) symbols.push_back(static_cast<uint32_t>(byte_symbol[static_cast<unsigned char>(text[k])]));
      last_unknown = false;
    } else if (unk_symbol) {
      if (!(fuse_unk && last_unknown)) symbols.push_back(*unk_symbol);
      last_unknown = true;
    } else {
      throw UsageError(concat(path, ": the character '", text.substr(i, len),
                              "' is no token, has no byte-fallback tokens and the model has no unk_token"));
    }
    i += len;
  }
  merger.encode_symbols(symbols, out);
}

void HfTokenizer::Impl::encode_normalized(std::string_view normal, std::vector<uint32_t>& out) {
  if (byte_fallback) {  // no pre-tokenizer (or one that cannot cut): the whole piece is one
    encode_sentencepiece(normal, out);
    return;
  }
  pieces.assign(1, normal);
  owned.clear();
  for (const Step& s : steps) {
    next.clear();
    for (std::string_view p : pieces) {
      if (p.empty()) continue;
      if (s.byte_level && s.add_prefix_space && p[0] != ' ') {
        owned.push_back(" " + std::string(p));
        p = owned.back();
      }
      if (s.pattern)
        split(p, s);
      else
        next.push_back(p);
    }
    std::swap(pieces, next);
  }
  for (std::string_view p : pieces) merger.encode_piece(p, out);
}

void HfTokenizer::encode(std::string_view text, std::vector<uint32_t>& out) {
  require_utf8(text);
  Impl& m = *impl_;
  m.walk(
      text, [&](uint32_t id) { out.push_back(id); }, [&](std::string_view piece) { m.encode_normalized(piece, out); });
}

std::vector<uint32_t> HfTokenizer::encode(std::string_view text) {
  std::vector<uint32_t> out;
  encode(text, out);
  return out;
}

std::string HfTokenizer::detokenize(const std::vector<uint32_t>& ids) const {
  std::string text = decode(ids);
  for (const auto& [what, with] : impl_->decode_replace) text = replace_all(text, what, with);
  for (size_t k = 0; k < impl_->decode_strip_start && !impl_->decode_strip.empty() &&
                     text.compare(0, impl_->decode_strip.size(), impl_->decode_strip) == 0;
       ++k)
    text.erase(0, impl_->decode_strip.size());
  return text;
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
