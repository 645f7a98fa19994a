// The Hugging Face tokenizer.json tokenizer (hf_tokenizer.h) on small hand-made files
// (tests/data/hf/, made by make_fixtures.py): both merges formats, NFC, ignore_merges, the split
// behaviours, the document separator, every bad-file message, the no-op Split of SentencePiece-style
// files (Gemma 3), added tokens as Hugging Face's AddedVocabulary cuts them (leftmost-longest,
// single_word, lstrip, rstrip, normalized, special ones plain text or matched); JSON Lines input;
// pack --special-tokens; and packing JSON
// Lines with it, whose shards (uint32, vocabulary 70001) must be the same under mpirun -np 2 as
// alone. Exactness on real tokenizer files against Hugging Face's code: tests/hf_tokenizer_test.sh.
#include <gtest/gtest.h>
#include <unistd.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "temp_dir.h"
#include "test_data.h"
#include "mpi_world.h"
#include "mpitrain/error.h"
#include "mpitrain/h5.h"
#include "mpitrain/hf_tokenizer.h"
#include "mpitrain/importers.h"
#include "mpitrain/jsonl.h"
#include "mpitrain/pack.h"
#include "mpitrain/shards.h"

using namespace mpitrain;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const std::string kHf = std::string(kTestDataDir) + "/hf";

#define SINGLETON_ONLY() \
  if (world_size() > 1) GTEST_SKIP() << "single-process test"

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

json fixture(const std::string& name) { return json::parse(std::ifstream(kHf + "/" + name)); }

// The fixture's ids: bytes are their own ids; the merged tokens follow (make_fixtures.py).
enum : uint32_t { kHello = 259, kWorld = 264, kSpaces = 265, kEAcute = 266, kADash = 267, kDashB = 268,
                  kDashDash = 269, kXyz = 270, kEot = 271 };

void expect_usage(const std::function<void()>& f, const std::string& message) {
  try {
    f();
    ADD_FAILURE() << "no UsageError; expected '" << message << "'";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

// `fixture` changed by `edit`, written to a file in `dir` and loaded.
HfTokenizer load_edited(const TempDir& dir, const std::function<void(json&)>& edit,
                        const std::string& base = "pairs.json") {
  json j = fixture(base);
  edit(j);
  write_file(dir / "tokenizer.json", j.dump());
  return HfTokenizer(dir / "tokenizer.json");
}

void expect_bad(const std::function<void(json&)>& edit, const std::string& message,
                const std::string& base = "pairs.json") {
  TempDir dir;
  expect_usage([&] { load_edited(dir, edit, base); }, dir / ("tokenizer.json: " + message));
}

}  // namespace

// ---- encoding ----------------------------------------------------------------------------------

TEST(HfTokenizer, BothMergesFormatsGiveTheSameIds) {
  SINGLETON_ONLY();
  HfTokenizer pairs(kHf + "/pairs.json"), strings(kHf + "/strings.json");
  for (HfTokenizer* t : {&pairs, &strings}) {
    EXPECT_EQ(t->encode("hello world"), (std::vector<uint32_t>{kHello, kWorld}));
    EXPECT_EQ(t->vocab_size(), 272);
    EXPECT_EQ(t->separator(), kEot);
  }
  const std::string text = "hello  world, héllo\n\n  x 12345 <|endoftext|>\xF0\x9F\x98\x80";
  EXPECT_EQ(pairs.encode(text), strings.encode(text));
  EXPECT_EQ(pairs.decode(pairs.encode(text)), text);
}

TEST(HfTokenizer, NormalizesToNfc) {
  SINGLETON_ONLY();
  HfTokenizer t(kHf + "/pairs.json");
  // "e" + COMBINING ACUTE is "é" (C3 A9) after NFC, which a merge makes one token.
  EXPECT_EQ(t.encode("cafe\xCC\x81"), (std::vector<uint32_t>{'c', 'a', 'f', kEAcute}));
  EXPECT_EQ(t.normalize("cafe\xCC\x81"), "caf\xC3\xA9");
  TempDir dir;
  HfTokenizer raw = load_edited(dir, [](json& j) { j["normalizer"] = nullptr; });
  EXPECT_EQ(raw.encode("cafe\xCC\x81"), (std::vector<uint32_t>{'c', 'a', 'f', 'e', 0xCC, 0x81}));
}

TEST(HfTokenizer, SpecialTokenStringsArePlainText) {
  SINGLETON_ONLY();
  HfTokenizer t(kHf + "/pairs.json");
  const std::vector<uint32_t> ids = t.encode("<|endoftext|>");
  EXPECT_EQ(std::count(ids.begin(), ids.end(), kEot), 0);
  EXPECT_EQ(t.decode(ids), "<|endoftext|>");
  EXPECT_EQ(t.decode({kEot}), "<|endoftext|>");
}

TEST(HfTokenizer, IgnoreMergesTakesWholeTokens) {
  SINGLETON_ONLY();
  TempDir dir;
  HfTokenizer off(kHf + "/pairs.json");
  HfTokenizer on = load_edited(dir, [](json& j) { j["model"]["ignore_merges"] = true; });
  // " xyz" is one pre-token and a vocabulary entry ("Ġxyz") that no merge makes.
  EXPECT_EQ(off.encode("a xyz"), (std::vector<uint32_t>{'a', ' ', 'x', 'y', 'z'}));
  EXPECT_EQ(on.encode("a xyz"), (std::vector<uint32_t>{'a', kXyz}));
  EXPECT_EQ(on.encode("hello"), (std::vector<uint32_t>{kHello}));
}

TEST(HfTokenizer, InvalidUtf8) {
  SINGLETON_ONLY();
  HfTokenizer t(kHf + "/pairs.json");
  try {
    t.encode("good \xC3\x28 bad");
    ADD_FAILURE() << "no InvalidUtf8";
  } catch (const InvalidUtf8& e) {
    EXPECT_EQ(e.offset, 5u);
  }
  EXPECT_THROW(t.encode("surrogate \xED\xA0\x80"), InvalidUtf8);
  EXPECT_THROW(t.encode("overlong \xC0\xAF"), InvalidUtf8);
}

// The five behaviours of a Split on "-" (tokenizers' NormalizedString::split), seen through the
// merges "a -", "- b" and "- -", which join pieces only where a split left them together.
TEST(HfTokenizer, SplitBehaviours) {
  SINGLETON_ONLY();
  auto with = [](const std::string& behavior, bool invert) {
    TempDir dir;
    HfTokenizer t = load_edited(dir, [&](json& j) {
      j["pre_tokenizer"]["pretokenizers"][0] =
          json{{"type", "Split"}, {"pattern", {{"String", "-"}}}, {"behavior", behavior}, {"invert", invert}};
    });
    return t.encode("a-b--c");
  };
  using V = std::vector<uint32_t>;
  EXPECT_EQ(with("Isolated", false), (V{'a', '-', 'b', '-', '-', 'c'}));
  EXPECT_EQ(with("Removed", false), (V{'a', 'b', 'c'}));
  EXPECT_EQ(with("MergedWithPrevious", false), (V{kADash, 'b', '-', '-', 'c'}));
  EXPECT_EQ(with("MergedWithNext", false), (V{'a', kDashB, '-', '-', 'c'}));
  EXPECT_EQ(with("Contiguous", false), (V{'a', '-', 'b', kDashDash, 'c'}));
  EXPECT_EQ(with("Removed", true), (V{'-', '-', '-'}));  // inverted: the letters are the delimiters
}

TEST(HfTokenizer, ByteLevelPrefixSpaceAndRegex) {
  SINGLETON_ONLY();
  TempDir dir;
  // GPT-2's own tokenizer.json: ByteLevel alone, with its regex; add_prefix_space puts a space
  // before the text.
  HfTokenizer t = load_edited(dir, [](json& j) {
    j["pre_tokenizer"] = json{{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  });
  EXPECT_EQ(t.encode("world"), (std::vector<uint32_t>{kWorld}));
  EXPECT_EQ(t.encode("  world"), (std::vector<uint32_t>{' ', kWorld}));
}

TEST(HfTokenizer, DocumentSeparator) {
  SINGLETON_ONLY();
  TempDir dir;
  // Llama 3: the special token TemplateProcessing puts first wins over <|endoftext|>.
  HfTokenizer bos = load_edited(dir, [](json& j) {
    j["added_tokens"].push_back({{"id", 300}, {"content", "<|begin_of_text|>"}, {"special", true}});
    j["added_tokens"].push_back({{"id", 301}, {"content", "<s>"}, {"special", true}});
    j["post_processor"] = {{"type", "TemplateProcessing"},
                           {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                       {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}}};
  });
  EXPECT_EQ(bos.separator(), 301u);
  EXPECT_EQ(bos.vocab_size(), 302);
  HfTokenizer begin = load_edited(dir, [](json& j) {
    j["added_tokens"].push_back({{"id", 300}, {"content", "<|begin_of_text|>"}, {"special", true}});
  });
  EXPECT_EQ(begin.separator(), 300u);
  HfTokenizer none = load_edited(dir, [](json& j) { j["added_tokens"] = json::array(); });
  EXPECT_FALSE(none.separator().has_value());
  EXPECT_EQ(none.vocab_size(), 271);
}

// ---- bad files ---------------------------------------------------------------------------------

TEST(HfTokenizer, BadFiles) {
  SINGLETON_ONLY();
  expect_usage([] { HfTokenizer("/nonexistent/tokenizer.json"); },
               "/nonexistent/tokenizer.json: cannot open for reading");
  {
    TempDir dir;
    write_file(dir / "tokenizer.json", "{\"model\": ");
    expect_usage([&] { HfTokenizer t(dir / "tokenizer.json"); }, dir / "tokenizer.json: malformed JSON");
  }
  // Ids far beyond the number of tokens (the tables are indexed by id): refused naming the file and
  // the id (an added token of id 2^31 - 1 or a vocabulary id of 2^31 - 2 ended in std::bad_alloc).
  expect_bad([](json& j) { j["added_tokens"].push_back({{"id", 2147483647}, {"content", "<big>"}}); },
             "added_tokens[1].id: 2147483647 is far beyond the file's 273 tokens (ids must be below 1048849)");
  expect_bad([](json& j) { j["model"]["vocab"]["zz"] = 2147483646; },
             "model.vocab: id of 'zz' is 2147483646, far beyond the file's 273 tokens (ids must be below 1048849)");
  // Read only when it is a regular file of at most 256 MiB: /dev/zero was read until memory ran out
  // (std::bad_alloc, no file named), a 1 GiB file whole by every rank before being refused.
  expect_usage([] { HfTokenizer("/dev/zero"); }, "/dev/zero: not a regular file");
  {
    TempDir dir;
    write_file(dir / "tokenizer.json", "{}");
    ASSERT_EQ(truncate((dir / "tokenizer.json").c_str(), off_t{1} << 30), 0);  // sparse: no disk used
    expect_usage([&] { HfTokenizer t(dir / "tokenizer.json"); },
                 dir / "tokenizer.json: 1024 MiB, larger than the 256 MiB a tokenizer file may have");
  }
  expect_bad([](json& j) { j["model"]["merges"][2] = json{"he", "zz"}; }, "model.merges[2]: 'zz' names no token");
  expect_bad([](json& j) { j["model"]["merges"][12] = "\u0120a b"; }, "model.merges[12]: 'Ġa' names no token",
             "strings.json");
  expect_bad([](json& j) { j["model"]["vocab"].erase("he"); }, "model.merges[0]: the merged 'he' names no token");
  expect_bad([](json& j) { j["model"]["merges"][1] = "ll"; },
             "model.merges[1]: expected two tokens separated by one space, got \"ll\"", "strings.json");
  expect_bad([](json& j) { j["model"]["merges"][0] = 5; }, "model.merges[0]: expected \"a b\" or [\"a\", \"b\"], got 5");
  expect_bad([](json& j) { j["model"]["merges"] = json::object(); }, "model.merges: expected an array");
  expect_bad([](json& j) { j["model"]["vocab"]["h"] = -1; }, "model.vocab: id of 'h' is -1, expected an integer");
  expect_bad([](json& j) { j["model"]["vocab"]["h"] = 5; }, "model.vocab: id 5 given to both");
  expect_bad([](json& j) { j["model"]["vocab"].erase("a"); }, "model.vocab: no token for byte 97 ('a')");
  expect_bad([](json& j) { j["model"]["vocab"] = json::array(); }, "model.vocab: expected an object");
  expect_bad([](json& j) { j.erase("model"); }, "model: missing");
  expect_bad([](json& j) { j["model"]["type"] = "Unigram"; }, "model.type: \"Unigram\" is not supported");
  expect_bad([](json& j) { j["model"]["byte_fallback"] = true; },
             "pre_tokenizer.pretokenizers[0].pattern: a SentencePiece-style BPE (model.byte_fallback) accepts only a "
             "Split on a {\"String\": ...} that its normalizer removes");
  expect_bad([](json& j) { j["model"]["dropout"] = 0.1; }, "model.dropout: 0.1: BPE dropout is not supported");
  expect_bad([](json& j) { j["model"]["ignore_merges"] = "yes"; }, "model.ignore_merges: expected true or false");
  expect_bad([](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; },
             "pre_tokenizer.type: the Metaspace pre-tokenizer (older SentencePiece conversions) is not supported");
  expect_bad([](json& j) { j["decoder"] = {{"type", "WordPiece"}}; }, "decoder.type: 'WordPiece' is not supported");
  expect_bad([](json& j) { j["normalizer"] = {{"type", "NFKC"}}; }, "normalizer.type: 'NFKC' is not supported");
  expect_bad([](json& j) { j["pre_tokenizer"]["pretokenizers"].erase(1); }, "pre_tokenizer: no ByteLevel step");
  expect_bad([](json& j) { j["pre_tokenizer"]["pretokenizers"][1].erase("add_prefix_space"); },
             "pre_tokenizer.pretokenizers[1].add_prefix_space: missing (a ByteLevel step must say true or false");
  expect_bad([](json& j) { j.erase("pre_tokenizer"); }, "pre_tokenizer: missing");
  expect_bad([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Weird"; },
             "pre_tokenizer.pretokenizers[0].behavior: 'Weird' is not one of Removed, Isolated");
  expect_bad([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "(ab"}}; },
             "pre_tokenizer.pretokenizers[0].pattern: missing closing parenthesis at offset 3");
  expect_bad([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "[[a]b]"}}; },
             "pre_tokenizer.pretokenizers[0].pattern.Regex: nested character classes");
  expect_bad([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = 3; },
             "pre_tokenizer.pretokenizers[0].pattern: expected {\"Regex\": \"...\"} or {\"String\": \"...\"}");
  expect_bad([](json& j) { j["pre_tokenizer"]["pretokenizers"].push_back(j["pre_tokenizer"]["pretokenizers"][0]); },
             "pre_tokenizer.pretokenizers[2]: a Split step after ByteLevel is not supported");
  expect_bad([](json& j) { j["added_tokens"][0]["id"] = 5; }, "added_tokens[0].id: 5 is already another token");
  expect_bad([](json& j) { j["added_tokens"][0]["content"] = ""; }, "added_tokens[0].content: expected a non-empty string");
  expect_bad([](json& j) { j["added_tokens"][0].erase("special"); },
             "added_tokens[0].special: missing (true or false: whether it is a special token)");
  expect_bad([](json& j) { j["added_tokens"][0]["rstrip"] = 1; }, "added_tokens[0].rstrip: expected true or false");
  expect_bad([](json& j) {
               j["added_tokens"].push_back(j["added_tokens"][0]);
               j["added_tokens"][1]["lstrip"] = true;
             },
             "added_tokens[1]: '<|endoftext|>' is listed twice, with different flags");
}

// ---- SentencePiece-style BPE (model.byte_fallback) ----------------------------------------------

namespace {

// A small Llama 2-shaped tokenizer.json: "▁" before the text and every space as "▁" (normalizer),
// no pre-tokenizer, <unk> <s> </s>, the 256 <0xXX> byte tokens, a few characters and merges.
enum : uint32_t { kUnk = 0, kBos = 1, kByte0 = 3, kMeta = 259, kH, kE, kL, kO, kW, kR, kD, kEAcuteSp, kHe, kLl, kHell,
                  kHelloSp, kMetaHello, kMetaW, kOr, kMetaWor, kLd, kMetaWorld };
json sentencepiece_json() {
  json vocab = {{"<unk>", kUnk}, {"<s>", kBos}, {"</s>", 2}};
  char name[8];
  for (int b = 0; b < 256; ++b) {
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab[name] = kByte0 + static_cast<uint32_t>(b);
  }
  const char* chars[] = {"\u2581", "h", "e", "l", "o", "w", "r", "d", "\u00e9"};
  for (uint32_t i = 0; i < 9; ++i) vocab[chars[i]] = kMeta + i;
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {"\u2581", "hello"}, {"\u2581", "w"},
      {"o", "r"}, {"\u2581w", "or"}, {"l", "d"}, {"\u2581wor", "ld"}};
  json m = json::array();
  uint32_t id = kHe;
  for (const auto& [a, b] : merges) {
    vocab[a + b] = id++;
    m.push_back(a + " " + b);
  }
  const json meta_replace = {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}};
  return {
      {"version", "1.0"},
      {"added_tokens", json::array({{{"id", 0}, {"content", "<unk>"}, {"special", true}},
                                    {{"id", 1}, {"content", "<s>"}, {"special", true}},
                                    {{"id", 2}, {"content", "</s>"}, {"special", true}}})},
      {"normalizer", {{"type", "Sequence"},
                      {"normalizers", json::array({{{"type", "Prepend"}, {"prepend", "\u2581"}}, meta_replace})}}},
      {"pre_tokenizer", nullptr},
      {"post_processor", {{"type", "TemplateProcessing"},
                          {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                                  {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})}}},
      {"decoder", {{"type", "Sequence"},
                   {"decoders", json::array({{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
                                             {{"type", "ByteFallback"}}, {{"type", "Fuse"}},
                                             {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}}},
      {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", "<unk>"}, {"fuse_unk", true},
                 {"byte_fallback", true}, {"vocab", vocab}, {"merges", m}}},
  };
}

HfTokenizer load_json(const TempDir& dir, const json& j) {
  write_file(dir / "tokenizer.json", j.dump());
  return HfTokenizer(dir / "tokenizer.json");
}

}  // namespace

TEST(HfTokenizer, SentencePieceStyleMergesCharactersAfterTheNormalizer) {
  SINGLETON_ONLY();
  TempDir dir;
  HfTokenizer t = load_json(dir, sentencepiece_json());
  EXPECT_EQ(t.normalize("hello world"), "\u2581hello\u2581world");
  EXPECT_EQ(t.encode("hello world"), (std::vector<uint32_t>{kMetaHello, kMetaWorld}));
  EXPECT_EQ(t.decode({kMetaHello, kMetaWorld}), "\u2581hello\u2581world");
  EXPECT_EQ(t.detokenize({kMetaHello, kMetaWorld}), "hello world");  // the leading space stripped
  EXPECT_EQ(t.separator(), kBos);  // the post_processor's <s>
  EXPECT_TRUE(t.encode("").empty());  // Prepend leaves an empty text empty
  // Equal ranks merge leftmost first: "lll" is "ll" then "l".
  EXPECT_EQ(t.encode("lll"), (std::vector<uint32_t>{kMeta, kLl, kL}));
  // Two spaces are two "▁": the second starts "▁world", the first stays alone.
  EXPECT_EQ(t.encode("hello  world"), (std::vector<uint32_t>{kMetaHello, kMeta, kMetaWorld}));
}

TEST(HfTokenizer, SentencePieceStyleFallsBackToBytesThenToTheUnknownToken) {
  SINGLETON_ONLY();
  TempDir dir;
  HfTokenizer t = load_json(dir, sentencepiece_json());
  // "é" is a token; "!" and the emoji are not: their UTF-8 bytes as <0xXX> tokens.
  const std::string text = "h\u00e9! \xF0\x9F\x98\x80";
  EXPECT_EQ(t.encode(text), (std::vector<uint32_t>{kMeta, kH, kEAcuteSp, kByte0 + '!', kMeta, kByte0 + 0xF0,
                                                   kByte0 + 0x9F, kByte0 + 0x98, kByte0 + 0x80}));
  EXPECT_EQ(t.decode(t.encode(text)), t.normalize(text));  // bytes back as they were
  EXPECT_EQ(t.detokenize(t.encode(text)), text);
  // Without the byte tokens: the unknown token, one per run with fuse_unk, one per character without.
  json j = sentencepiece_json();
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    j["model"]["vocab"].erase(name);
  }
  TempDir dir2;
  HfTokenizer fused = load_json(dir2, j);
  EXPECT_EQ(fused.encode("h!?\xF0\x9F\x98\x80h"), (std::vector<uint32_t>{kMeta, kH, kUnk, kH}));
  j["model"]["fuse_unk"] = false;
  TempDir dir3;
  HfTokenizer unfused = load_json(dir3, j);
  EXPECT_EQ(unfused.encode("h!?\xF0\x9F\x98\x80h"), (std::vector<uint32_t>{kMeta, kH, kUnk, kUnk, kUnk, kH}));
}

TEST(HfTokenizer, SentencePieceStyleBadFiles) {
  SINGLETON_ONLY();
  auto expect_sp_bad = [](const std::function<void(json&)>& edit, const std::string& message) {
    TempDir dir;
    json j = sentencepiece_json();
    edit(j);
    expect_usage([&] { load_json(dir, j); }, dir / ("tokenizer.json: " + message));
  };
  expect_sp_bad([](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\u2581"}}; },
                "pre_tokenizer: the Metaspace pre-tokenizer (older SentencePiece conversions) is not supported");
  expect_sp_bad([](json& j) { j["normalizer"]["normalizers"][1]["pattern"] = {{"Regex", " +"}}; },
                "normalizer.normalizers[1].pattern: expected {\"String\": \"...\"} (a Regex pattern is not supported)");
  expect_sp_bad([](json& j) { j["normalizer"]["normalizers"][0].erase("prepend"); },
                "normalizer.normalizers[0].prepend: expected a string");
  expect_sp_bad([](json& j) { j["model"]["unk_token"] = "<nope>"; }, "model.unk_token: \"<nope>\" names no token");
  expect_sp_bad([](json& j) { j["decoder"] = {{"type", "ByteLevel"}}; },
                "decoder.type: 'ByteLevel' is not supported for a SentencePiece-style BPE");
  expect_sp_bad([](json& j) { j["model"]["merges"][3] = "hell x"; }, "model.merges[3]: 'x' names no token");
}

// Gemma 3's pre-tokenizer: a Split on " " after the normalizer has made every space "▁" cannot
// cut, whatever its behaviour. A Split that could is refused, naming the key.
TEST(HfTokenizer, SentencePieceStyleTakesASplitThatCannotMatch) {
  SINGLETON_ONLY();
  auto split = [](const json& pattern, const std::string& behavior, bool invert = false) {
    return json{{"type", "Split"}, {"pattern", pattern}, {"behavior", behavior}, {"invert", invert}};
  };
  const std::string text = "hello world, hello  wor\u00e9ld!";
  TempDir plain_dir;
  HfTokenizer plain = load_json(plain_dir, sentencepiece_json());
  for (const char* behavior : {"MergedWithPrevious", "Isolated", "Removed", "MergedWithNext", "Contiguous"})
    for (const bool invert : {false, true}) {
      if (invert && std::string(behavior) == "Removed") continue;
      json j = sentencepiece_json();
      j["pre_tokenizer"] = split({{"String", " "}}, behavior, invert);
      TempDir dir;
      EXPECT_EQ(load_json(dir, j).encode(text), plain.encode(text)) << behavior << " invert " << invert;
    }
  json seq = sentencepiece_json();
  seq["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", json::array({split({{"String", " "}}, "Isolated")})}};
  TempDir seq_dir;
  EXPECT_EQ(load_json(seq_dir, seq).encode(text), plain.encode(text));

  auto expect_sp_bad = [](const std::function<void(json&)>& edit, const std::string& message) {
    TempDir dir;
    json j = sentencepiece_json();
    edit(j);
    expect_usage([&] { load_json(dir, j); }, dir / ("tokenizer.json: " + message));
  };
  // "l" survives the normalizer: a Split on it would cut "hello".
  expect_sp_bad([&](json& j) { j["pre_tokenizer"] = split({{"String", "l"}}, "MergedWithPrevious"); },
                "pre_tokenizer.pattern: \"l\" can match the normalized text, which a SentencePiece-style BPE "
                "(model.byte_fallback) takes whole");
  expect_sp_bad([&](json& j) { j["pre_tokenizer"] = split({{"String", ""}}, "Isolated"); },
                "pre_tokenizer.pattern: \"\" can match the normalized text");
  expect_sp_bad([&](json& j) { j["pre_tokenizer"] = split({{"Regex", " "}}, "Isolated"); },
                "pre_tokenizer.pattern: a SentencePiece-style BPE (model.byte_fallback) accepts only a Split on a "
                "{\"String\": ...} that its normalizer removes");
  // Inverted, Removed drops the whole text (all of it is the "match").
  expect_sp_bad([&](json& j) { j["pre_tokenizer"] = split({{"String", " "}}, "Removed", true); },
                "pre_tokenizer.invert: true with behavior Removed removes the whole text");
  // A later step that writes a space again (or NFC, which is not proven never to) undoes the removal.
  expect_sp_bad([&](json& j) {
                  j["pre_tokenizer"] = split({{"String", " "}}, "Isolated");
                  j["normalizer"]["normalizers"].push_back({{"type", "Prepend"}, {"prepend", " "}});
                },
                "pre_tokenizer.pattern: \" \" can match the normalized text");
  expect_sp_bad([&](json& j) {
                  j["pre_tokenizer"] = split({{"String", " "}}, "Isolated");
                  j["normalizer"]["normalizers"].push_back({{"type", "NFC"}});
                },
                "pre_tokenizer.pattern: \" \" can match the normalized text");
  expect_sp_bad([&](json& j) {
                  j["pre_tokenizer"] = {{"type", "Sequence"},
                                        {"pretokenizers", json::array({split({{"String", " "}}, "Isolated"),
                                                                       {{"type", "Digits"}}})}};
                },
                "pre_tokenizer.pretokenizers[1]: 'Digits': a SentencePiece-style BPE (model.byte_fallback) has none");
}

// ---- added tokens ------------------------------------------------------------------------------
// Hugging Face's AddedVocabulary (the `tokenizers` library): the added tokens are cut out of the
// text before the normalizer, pre-tokenizer and model, which then see each piece between them on
// its own. The expectations are written as the pieces the library's semantics give, each encoded
// alone.

namespace {

json added(uint32_t id, const std::string& content, bool special, json flags = json::object()) {
  json t = {{"id", id},        {"content", content}, {"single_word", false}, {"lstrip", false},
            {"rstrip", false}, {"normalized", false}, {"special", special}};
  if (flags.is_object()) t.update(flags);
  return t;
}

// The ids of the pieces: a string is encoded alone, a number is an added token's id.
std::vector<uint32_t> pieces(HfTokenizer& t, const std::vector<json>& parts) {
  std::vector<uint32_t> ids;
  for (const json& p : parts) {
    if (p.is_number()) ids.push_back(p.get<uint32_t>());
    else t.encode(p.get<std::string>(), ids);
  }
  return ids;
}

}  // namespace

TEST(HfTokenizer, NonSpecialAddedTokensAreCutOutLeftmostLongest) {
  SINGLETON_ONLY();
  TempDir dir;
  HfTokenizer t = load_edited(dir, [](json& j) {
    j["added_tokens"].push_back(added(272, "<b>", false));
    j["added_tokens"].push_back(added(273, "<b>x", false));
    j["added_tokens"].push_back(added(274, "ab", false));
    j["added_tokens"].push_back(added(275, "bcd", false));
    j["added_tokens"].push_back(added(276, "\n", false));
    j["added_tokens"].push_back(added(277, "\n\n\n", false));
  });
  HfTokenizer base(kHf + "/pairs.json");
  EXPECT_EQ(t.encode("x<b>hello"), pieces(base, {"x", 272, "hello"}));
  EXPECT_EQ(t.encode("<b>xyz"), pieces(base, {273, "yz"}));     // the longest at the leftmost start
  EXPECT_EQ(t.encode("abcd"), pieces(base, {274, "cd"}));       // leftmost wins over longer later
  EXPECT_EQ(t.encode("a\n\n\n\nb"), pieces(base, {"a", 277, 276, "b"}));
  EXPECT_EQ(t.decode(t.encode("x<b>hello")), "x<b>hello");
  EXPECT_EQ(t.normalize("x<b>hello"), "x<b>hello");
  EXPECT_EQ(t.encode(""), std::vector<uint32_t>{});
  // Bounded on long texts: a megabyte of newlines is a third of a million tokens, in linear time.
  const std::string newlines(1 << 20, '\n');
  const std::vector<uint32_t> ids = t.encode(newlines);
  EXPECT_EQ(ids.size(), (newlines.size() + 2) / 3);
  EXPECT_EQ(t.decode(ids), newlines);
}

TEST(HfTokenizer, AddedTokenNormalizedFlag) {
  SINGLETON_ONLY();
  // pairs.json's normalizer is NFC: "caf\u00e9" written decomposed is matched only by a normalized
  // token (matched in the normalized text, its content normalized too).
  auto with = [](bool normalized) {
    TempDir dir;
    return load_edited(dir, [&](json& j) {
      j["added_tokens"].push_back(added(272, "caf\u00e9", false, {{"normalized", normalized}}));
    });
  };
  HfTokenizer yes = with(true), no = with(false), base(kHf + "/pairs.json");
  EXPECT_EQ(yes.encode("a cafe\u0301!"), pieces(base, {"a ", 272, "!"}));
  EXPECT_EQ(no.encode("a cafe\u0301!"), base.encode("a cafe\u0301!"));
  EXPECT_EQ(no.encode("a caf\u00e9!"), pieces(base, {"a ", 272, "!"}));
  EXPECT_EQ(yes.normalize("a cafe\u0301!"), "a caf\u00e9!");
  // A normalized token's content goes through the whole normalizer, Prepend included: with Llama 2's
  // "▁" before the text, "hello" is matched as "▁hello", and the pieces around it are normalized
  // alone (each gets its own "▁").
  json sp = sentencepiece_json();
  sp["added_tokens"].push_back(added(kHelloSp, "hello", false, {{"normalized", true}}));
  TempDir dir, plain_dir;
  HfTokenizer t = load_json(dir, sp), plain = load_json(plain_dir, sentencepiece_json());
  EXPECT_EQ(plain.encode("hello world"), (std::vector<uint32_t>{kMetaHello, kMetaWorld}));
  EXPECT_EQ(t.encode("hello world"), (std::vector<uint32_t>{kHelloSp, kMetaWorld}));
  EXPECT_EQ(t.encode("say hello"), pieces(plain, {"say", kHelloSp}));
  EXPECT_EQ(t.encode("xhello"), plain.encode("xhello"));  // "▁xhello" holds no "▁hello"
  // One whose normalized content is empty would match everywhere: refused.
  json empty = sentencepiece_json();
  empty["normalizer"]["normalizers"].push_back({{"type", "Replace"}, {"pattern", {{"String", "h"}}}, {"content", ""}});
  empty["normalizer"]["normalizers"].erase(0);
  empty["added_tokens"].push_back(added(kH, "h", false, {{"normalized", true}}));
  TempDir dir2;
  expect_usage([&] { load_json(dir2, empty); }, dir2 / "tokenizer.json: added_tokens[3].content: the normalizer makes it empty");
}

TEST(HfTokenizer, AddedTokenStripFlags) {
  SINGLETON_ONLY();
  auto with = [](json flags) {
    TempDir dir;
    return load_edited(dir, [&](json& j) { j["added_tokens"].push_back(added(272, "<m>", false, flags)); });
  };
  HfTokenizer none = with({}), left = with({{"lstrip", true}}), right = with({{"rstrip", true}}),
              both = with({{"lstrip", true}, {"rstrip", true}}), base(kHf + "/pairs.json");
  const std::string text = "hello \t<m>  world";
  EXPECT_EQ(none.encode(text), pieces(base, {"hello \t", 272, "  world"}));
  EXPECT_EQ(left.encode(text), pieces(base, {"hello", 272, "  world"}));
  EXPECT_EQ(right.encode(text), pieces(base, {"hello \t", 272, "world"}));
  EXPECT_EQ(both.encode(text), pieces(base, {"hello", 272, "world"}));
  EXPECT_EQ(both.normalize(text), "hello<m>world");  // the whitespace taken is gone
  // The library's own case: Unicode White_Space (U+2000, "\t") is stripped; a token's lstrip stops
  // at the previous token's end.
  EXPECT_EQ(both.encode("Hi <m> there\t<m>\t<m>\u2000"), pieces(base, {"Hi", 272, "there", 272, 272}));
  // U+FEFF and U+200B are not White_Space (JavaScript's trim takes U+FEFF); U+0085 is.
  EXPECT_EQ(both.encode("a\uFEFF<m>\u0085b"), pieces(base, {"a\uFEFF", 272, "b"}));
  EXPECT_EQ(both.encode("a\u200B<m>"), pieces(base, {"a\u200B", 272}));
  // rstrip's whitespace can hold the next match, which the library still cuts (its search goes on
  // after the match, not after the stripped whitespace): "<m>" then both newlines.
  HfTokenizer nl = [] {
    TempDir dir;
    return load_edited(dir, [](json& j) {
      j["added_tokens"].push_back(added(272, "<m>", false, {{"rstrip", true}}));
      j["added_tokens"].push_back(added(273, "\n", false));
    });
  }();
  EXPECT_EQ(nl.encode("<m>\n\nx"), pieces(base, {272, 273, 273, "x"}));
  // A whitespace token that strips whitespace: the first match takes the whole run, and the later
  // matches inside it start at its end (lstrip never goes back before the previous cut) and end
  // there (rstrip): empty, they vanish, as in the library. In linear time on a megabyte of it.
  HfTokenizer ws = [] {
    TempDir dir;
    return load_edited(dir, [](json& j) {
      j["added_tokens"].push_back(added(272, "\n", false, {{"lstrip", true}, {"rstrip", true}}));
    });
  }();
  EXPECT_EQ(ws.encode(std::string(1 << 20, '\n')), std::vector<uint32_t>{272});
  EXPECT_EQ(ws.encode("a \n \n b"), pieces(base, {"a", 272, "b"}));
}

TEST(HfTokenizer, AddedTokenSingleWordFlag) {
  SINGLETON_ONLY();
  TempDir dir;
  HfTokenizer t = load_edited(dir, [](json& j) {
    j["added_tokens"].push_back(added(272, "<m>", false, {{"single_word", true}}));
    j["added_tokens"].push_back(added(273, "ab", false, {{"single_word", true}}));
    j["added_tokens"].push_back(added('b', "b", false));  // a vocabulary entry may be an added token too
  });
  HfTokenizer base(kHf + "/pairs.json");
  // The library's own cases: only between non-word characters (\w: letters, marks, digits, "_").
  EXPECT_EQ(t.encode("<m> My name <m> A<m> <m>ony <m>"),
            pieces(base, {272, " My name ", 272, " A<m> <m>ony ", 272}));
  EXPECT_EQ(t.encode("<m>, <m>- \u25CC\u0330<m>"), pieces(base, {272, ", ", 272, "- \u25CC\u0330<m>"}));
  EXPECT_EQ(t.encode("_<m> 1<m> \u24B6<m> \u00B2<m>"), pieces(base, {"_<m> 1<m> \u24B6<m> \u00B2", 272}));
  // A match refused as not a single word is not searched again for shorter tokens inside it.
  EXPECT_EQ(t.encode("xab"), pieces(base, {"xab"}));
  EXPECT_EQ(t.encode("x ab"), pieces(base, {"x ", 273}));
  EXPECT_EQ(t.encode("xb"), pieces(base, {"x", 'b'}));
  EXPECT_EQ(t.encode("xbc"), pieces(base, {"x", 'b', "c"}));  // "bc" would be one piece without it
}

TEST(HfTokenizer, SpecialTokensArePlainTextUnlessMatched) {
  SINGLETON_ONLY();
  TempDir dir;
  HfTokenizer t = load_edited(dir, [](json& j) { j["added_tokens"].push_back(added(272, "endoftext", false)); });
  HfTokenizer base(kHf + "/pairs.json");
  const std::string text = "a<|endoftext|>b";
  EXPECT_EQ(t.special_tokens(), SpecialTokens::text);
  // Plain text: the special token's match is skipped whole (as the library's
  // encode_special_tokens), which also hides the non-special "endoftext" inside it.
  EXPECT_EQ(t.encode(text), base.encode(text));
  EXPECT_EQ(t.encode("a endoftext"), pieces(base, {"a ", 272}));
  t.set_special_tokens(SpecialTokens::match);
  EXPECT_EQ(t.special_tokens(), SpecialTokens::match);
  EXPECT_EQ(t.encode(text), pieces(base, {"a", kEot, "b"}));
  EXPECT_EQ(t.decode(t.encode(text)), text);
  // Llama 2: each piece between matched tokens is normalized alone, so gets its own "▁".
  TempDir sp_dir;
  HfTokenizer sp = load_json(sp_dir, sentencepiece_json());
  EXPECT_NE(sp.encode("hello</s>world"), (std::vector<uint32_t>{kMetaHello, 2, kMetaWorld}));
  sp.set_special_tokens(SpecialTokens::match);
  EXPECT_EQ(sp.encode("hello</s>world"), (std::vector<uint32_t>{kMetaHello, 2, kMetaWorld}));
  EXPECT_EQ(sp.normalize("hello</s>world"), "\u2581hello</s>\u2581world");
  EXPECT_EQ(sp.encode("<s>"), (std::vector<uint32_t>{kBos}));
}

// ---- JSON Lines --------------------------------------------------------------------------------

TEST(Jsonl, LinesAndErrors) {
  SINGLETON_ONLY();
  TempDir dir;
  write_file(dir / "ok.jsonl", "{\"text\": \"one\"}\n\n  \r\n{\"id\": 2, \"body\": \"caf\\u00e9\", \"text\": \"two\"}\r\n");
  std::vector<std::pair<std::string, uint64_t>> got;
  read_jsonl(dir / "ok.jsonl", "text", [&](std::string_view t, uint64_t line) { got.emplace_back(t, line); });
  EXPECT_EQ(got, (std::vector<std::pair<std::string, uint64_t>>{{"one", 1}, {"two", 4}}));
  got.clear();
  write_file(dir / "body.jsonl", "{\"body\": \"caf\\u00e9 \\ud83d\\ude00\"}\n");
  read_jsonl(dir / "body.jsonl", "body", [&](std::string_view t, uint64_t line) { got.emplace_back(t, line); });
  EXPECT_EQ(got.at(0).first, "caf\xC3\xA9 \xF0\x9F\x98\x80");

  auto bad = [&](const std::string& lines, const std::string& message) {
    write_file(dir / "bad.jsonl", lines);
    expect_usage([&] { read_jsonl(dir / "bad.jsonl", "text", [](std::string_view, uint64_t) {}); },
                 dir / "bad.jsonl: " + message);
  };
  const std::string ok = "{\"text\": \"fine\"}\n";
  bad(ok + "{\"text\": \"half\n", "line 2: not JSON: ");
  bad(ok + ok + "{\"title\": \"x\"}\n", "line 3: no key 'text'");
  bad(ok + "{\"text\": 5}\n", "line 2: 'text' is a number, expected a string");
  bad(ok + "{\"text\": [\"a\"]}\n", "line 2: 'text' is an array, expected a string");
  bad("[1, 2]\n", "line 1: expected a JSON object, got an array");
  bad(ok + ok + ok + "{\"text\": \"ab\xFF\"}\n", "line 4: invalid UTF-8 at byte 12 of the line");
  bad("{\"text\": \"\\ud800\"}\n", "line 1: not JSON: ");  // a lone surrogate escape
}

// ---- packing -----------------------------------------------------------------------------------

namespace {

std::vector<uint64_t> doc_offsets(const std::string& path) {
  h5::File f = h5::open_read(path);
  std::vector<uint64_t> out;
  if (!h5::exists(f.get(), "doc_offsets")) return out;
  h5::Dataset d(H5Dopen2(f.get(), "doc_offsets", H5P_DEFAULT));
  out.resize(h5::shape(d.get())[0]);
  h5::read(d.get(), H5T_NATIVE_UINT64, out.data());
  return out;
}

// Lines of mixed text, some blank, some decomposed (NFC changes them), in three files.
std::vector<std::string> write_corpus(const TempDir& dir) {
  // JSON string bodies: escapes as the JSON of a line spells them.
  const char* words[] = {"hello", "world", "caf\\u00e9", "cafe\\u0301", "xyz", "a-b--c", "12345",
                         "\\u4e2d\\u6587", "\\ud83d\\ude00", "<|endoftext|>", "  ", "\\n\\n", "\\t", "it's"};
  std::vector<std::string> files;
  uint64_t state = 7;
  auto next = [&](uint64_t n) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (state >> 33) % n;
  };
  for (int f = 0; f < 3; ++f) {
    std::string body;
    for (int line = 0; line < 150; ++line) {
      std::string text;
      for (uint64_t w = 0, n = 1 + next(30); w < n; ++w) text += std::string(w ? " " : "") + words[next(14)];
      body += (line % 11 == 5 ? std::string("{\"text\": \"   \"}") : "{\"text\": \"" + text + "\"}") + "\n";
    }
    files.push_back(dir / concat("part-", f, ".jsonl"));
    write_file(files.back(), body);
  }
  return files;
}

}  // namespace

// JSON Lines + a tokenizer.json with ids past 65535: uint32 shards that record the tokenizer, equal
// under mpirun -np 2 to a pack alone (shard for shard), and decoding back to the NFC text.
TEST(PackHf, JsonlSameShardsAsOneRank) {
  TempDir dir(/*shared=*/true);
  std::vector<std::string> files;
  if (world_rank() == 0) files = write_corpus(dir);
  mpi::barrier(mpi::world());
  PackOptions o;
  for (int f = 0; f < 3; ++f) o.inputs.push_back(dir / concat("part-", f, ".jsonl"));
  o.tokenizer = "hf";
  o.tokenizer_file = kHf + "/wide.json";
  o.shard_tokens = 997;
  o.val_fraction = 0.1;
  o.output_prefix = dir / "world/c";
  PackResult w = pack(o, mpi::world());
  if (world_rank() == 0) {
    o.output_prefix = dir / "self/c";
    PackResult s = pack(o, mpi::self());
    EXPECT_EQ(w.vocab_size, 70001);
    EXPECT_EQ(w.eot_token, 70000);
    EXPECT_EQ(w.documents, s.documents);
    EXPECT_GT(w.documents, 350u);
    ASSERT_EQ(w.train_shards.size(), s.train_shards.size());
    ASSERT_EQ(w.val_shards.size(), s.val_shards.size());
    EXPECT_GT(w.train_shards.size(), 2u);
    std::vector<std::string> ws = w.train_shards, ss = s.train_shards;
    ws.insert(ws.end(), w.val_shards.begin(), w.val_shards.end());
    ss.insert(ss.end(), s.val_shards.begin(), s.val_shards.end());
    HfTokenizer tok(kHf + "/wide.json");
    std::string decoded;
    for (size_t i = 0; i < ws.size(); ++i) {
      const std::vector<uint32_t> t = read_shard_tokens(ws[i]);
      EXPECT_EQ(t, read_shard_tokens(ss[i])) << ws[i];
      EXPECT_EQ(doc_offsets(ws[i]), doc_offsets(ss[i])) << ws[i];
      const ShardInfo info = read_shard_info(ws[i]);
      EXPECT_EQ(info.dtype_bytes, 4);
      EXPECT_EQ(info.meta.tokenizer, "hf");
      EXPECT_EQ(info.meta.tokenizer_file, kHf + "/wide.json");
      // sha256sum tests/data/hf/wide.json
      EXPECT_EQ(info.meta.tokenizer_sha256, "2c8eb07bea97c3e3e782a5b6501dcee97414e769b09c42b4ae5afd709a712501");
      EXPECT_EQ(read_shard_info(ss[i]).meta.source, info.meta.source);
    }
    // The train split decodes to its documents' NFC text, each after the separator.
    std::string expected;
    uint64_t k = 0;
    for (const std::string& f : files)
      read_jsonl(f, "text", [&](std::string_view text, uint64_t) {
        if (is_blank(text)) return;
        ++k;
        expected += "<|endoftext|>" + tok.normalize(text);
      });
    EXPECT_EQ(k, w.documents);
    std::vector<uint32_t> all;
    for (const std::string& p : w.train_shards) {
      auto t = read_shard_tokens(p);
      all.insert(all.end(), t.begin(), t.end());
    }
    const std::string train = tok.decode(all);
    EXPECT_NE(expected.find(train.substr(0, 200)), std::string::npos);
    EXPECT_GT(train.size(), expected.size() / 2);
  }
  mpi::barrier(mpi::world());  // rank 0 removes the directory only after everyone is done
}

TEST(PackHf, BadOptionsAndInputs) {
  SINGLETON_ONLY();
  TempDir dir;
  write_file(dir / "a.jsonl", "{\"text\": \"hello\"}\n{\"text\": \"caf\xC3\"}\n");
  write_file(dir / "b.txt", "hello \xC3\x28 world");
  auto opts = [&](const std::string& input) {
    PackOptions o;
    o.inputs = {dir / input};
    o.output_prefix = dir / "out/x";
    o.tokenizer = "hf";
    o.tokenizer_file = kHf + "/pairs.json";
    return o;
  };
  expect_usage([&] { pack_text(opts("a.jsonl")); }, dir / "a.jsonl: line 2: invalid UTF-8 at byte 13 of the line");
  expect_usage([&] { pack_text(opts("b.txt")); }, dir / "b.txt: invalid UTF-8 at byte 6 (the hf tokenizer reads UTF-8 text)");
  PackOptions o = opts("a.jsonl");
  o.tokenizer_file.clear();
  expect_usage([&] { pack_text(o); }, "pack: the hf tokenizer needs --tokenizer-file tokenizer.json");
  o = opts("a.jsonl");
  o.tokenizer = "gpt2";
  expect_usage([&] { pack_text(o); }, "pack: --tokenizer-file is read by --tokenizer hf only");
  o = opts("a.jsonl");
  o.eot_token = 272;
  expect_usage([&] { pack_text(o); }, "pack: --eot 272 not in [0, vocab size 272)");
  o = opts("a.jsonl");
  o.text_key = "body";
  expect_usage([&] { pack_text(o); }, dir / "a.jsonl: line 1: no key 'body'");
  o = opts("a.jsonl");
  o.special_tokens = "yes";
  expect_usage([&] { pack_text(o); }, "pack: --special-tokens 'yes' is not text or match");
  o.tokenizer = "byte";
  o.tokenizer_file.clear();
  o.special_tokens = "match";
  expect_usage([&] { pack_text(o); }, "pack: --special-tokens is read by --tokenizer hf only");
}

// --special-tokens: the file's special tokens written in the text stay text (the default) or
// become their ids.
namespace {
// pack's options for one input through the test tokenizer pairs.json, every window for training.
PackOptions pairs_options(const std::string& input, const std::string& prefix) {
  PackOptions o;
  o.inputs = {input};
  o.output_prefix = prefix;
  o.tokenizer = "hf";
  o.tokenizer_file = kHf + "/pairs.json";
  o.val_fraction = 0;
  return o;
}
}  // namespace

TEST(PackHf, SpecialTokensOption) {
  SINGLETON_ONLY();
  TempDir dir;
  write_file(dir / "a.jsonl", "{\"text\": \"xyz<|endoftext|>\"}\n");
  PackOptions o = pairs_options(dir / "a.jsonl", "");
  HfTokenizer tok(kHf + "/pairs.json");
  std::map<std::string, std::string> shards;
  for (const std::string mode : {"", "text", "match"}) {
    o.special_tokens = mode;
    o.output_prefix = dir / ("out/" + mode + "x");
    std::vector<uint32_t> want = {kEot};
    tok.encode("xyz", want);
    if (mode == "match") want.push_back(kEot);
    else tok.encode("<|endoftext|>", want);
    const std::string shard = shards[mode] = pack_text(o).train_shards.at(0);
    EXPECT_EQ(read_shard_tokens(shard), want) << mode;
    // The shard records the mode (attribute tokenizer_special_tokens: absent = text).
    EXPECT_EQ(read_shard_info(shard).meta.special_tokens, mode == "match" ? "match" : "") << mode;
  }
  // Shards packed both ways are not one dataset: the same text has other ids.
  const std::string text = shards["text"], match = shards["match"];
  expect_usage([&] { TokenDataset({text, match}, 2, 1, true); },
               match + ": packed with --special-tokens match, " + text + " with --special-tokens text");
}

TEST(PackHf, EotOverridesTheFilesSeparator) {
  SINGLETON_ONLY();
  TempDir dir;
  write_file(dir / "a.jsonl", "{\"text\": \"hello world\"}\n{\"text\": \"xyz\"}\n");
  PackOptions o = pairs_options(dir / "a.jsonl", dir / "out/x");
  PackResult r = pack_text(o);
  EXPECT_EQ(r.eot_token, kEot);
  EXPECT_EQ(read_shard_tokens(r.train_shards.at(0)),
            (std::vector<uint32_t>{kEot, kHello, kWorld, kEot, 'x', 'y', 'z'}));
  EXPECT_EQ(read_shard_info(r.train_shards.at(0)).dtype_bytes, 2);
  // Another of the file's added tokens may be named instead of its separator...
  load_edited(dir, [](json& j) {
    j["added_tokens"].push_back({{"id", 272}, {"content", "<|sep|>"}, {"single_word", false}, {"lstrip", false},
                                 {"rstrip", false}, {"normalized", false}, {"special", true}});
  });
  o.tokenizer_file = dir / "tokenizer.json";
  o.eot_token = 272;
  o.output_prefix = dir / "out/sep";
  r = pack_text(o);
  EXPECT_EQ(read_shard_tokens(r.train_shards.at(0)), (std::vector<uint32_t>{272, kHello, kWorld, 272, 'x', 'y', 'z'}));
  // ...an ordinary token may not: each of its occurrences in the text would end a document (--eot 5
  // was '&' in GPT-2's vocabulary, and was used silently).
  o.eot_token = 'x';
  o.output_prefix = dir / "out/ordinary";
  expect_usage([&] { pack_text(o); }, concat("pack: --eot 120 is \"x\", an ordinary token of ", dir / "tokenizer.json",
                                             ", not one of its added_tokens: a document separator must be a special "
                                             "token (its own: 271 \"<|endoftext|>\", used when --eot is not given)"));
  EXPECT_FALSE(fs::exists(dir / "out/ordinary-train-00000.h5"));
}
