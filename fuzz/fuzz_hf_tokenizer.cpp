// libFuzzer target: the Hugging Face tokenizer (hf_tokenizer.h): its encoder on arbitrary bytes, its
// tokenizer.json loader on arbitrary files, and the Oniguruma-to-PCRE2 translation of Split patterns.
//
// Input layout: one mode byte, then the payload.
//   mode % 3 == 0: text, encoded by tests/data/hf/pairs.json (NFC, Llama-3-style Split) and by the
//                  same file with ignore_merges;
//   mode % 3 == 1: a whole tokenizer.json (seed: the fixtures);
//   mode % 3 == 2: a Split Regex replacing pairs.json's pattern (JSON-escaped by the harness).
//
// Expected outcomes: text that is valid UTF-8 encodes, every id is below vocab_size, and decodes
// back to its normalized form (decode(encode(t)) == normalize(t); not checked where a
// SentencePiece-style file used its unknown token; with the spaces left out of both sides where a
// ByteLevel step adds a prefix space to each piece, as Hugging Face's does and its decoder keeps);
// text that is not UTF-8 is refused with
// InvalidUtf8 at the first bad byte (the bytes before it are valid). A file or pattern is loaded or
// refused with one UsageError; a loaded one obeys the same round trip on a fixed text. Anything
// else (another exception, a crash, a sanitizer report) is a bug.
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "harness.h"
#include "mpitrain/bpe_merge.h"
#include "mpitrain/error.h"
#include "mpitrain/hf_tokenizer.h"

using namespace mpitrain;

const char* const kFuzzTarget = "fuzz_hf_tokenizer";

namespace {

const std::string kPairs = std::string(MPITRAIN_HF_FIXTURES) + "/pairs.json";

const std::string& scratch() {
  static const std::string dir = make_scratch_dir();
  return dir;
}

std::string write_scratch(const std::string& bytes) {
  const std::string path = scratch() + "/tokenizer.json";
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  return path;
}

// The round trip every loaded tokenizer keeps, or the refusal of text that is not UTF-8.
void check_text(HfTokenizer& tok, const std::string& text) {
  const size_t bad = bpe::find_invalid_utf8(text);
  std::vector<uint32_t> ids;
  try {
    ids = tok.encode(text);
  } catch (const InvalidUtf8& e) {
    if (bad == std::string::npos) bug("valid UTF-8 refused: " + std::string(e.what()));
    if (e.offset != bad) bug("InvalidUtf8 at " + std::to_string(e.offset) + ", first bad byte at " + std::to_string(bad));
    return;
  }
  if (bad != std::string::npos) bug("invalid UTF-8 at byte " + std::to_string(bad) + " accepted");
  for (uint32_t id : ids)
    if (id >= tok.vocab_size()) bug("id " + std::to_string(id) + " >= vocab_size");
  // A character a SentencePiece-style file has no token for becomes its unknown token, which
  // decodes as that token's own text.
  const auto unk = tok.unknown_token();
  if (unk && std::find(ids.begin(), ids.end(), *unk) != ids.end()) return;
  std::string decoded = tok.decode(ids), normal = tok.normalize(text);
  if (tok.adds_prefix_space())  // " " before every piece that lacks one: compared without spaces
    for (std::string* s : {&decoded, &normal}) s->erase(std::remove(s->begin(), s->end(), ' '), s->end());
  if (decoded != normal) bug("decode(encode(text)) != normalize(text)");
}

HfTokenizer& fixture(bool ignore_merges) {
  static HfTokenizer plain(kPairs);
  static HfTokenizer whole = [] {
    nlohmann::json j = nlohmann::json::parse(std::ifstream(kPairs));
    j["model"]["ignore_merges"] = true;
    return HfTokenizer(write_scratch(j.dump()));
  }();
  return ignore_merges ? whole : plain;
}

// A file or pattern that loads must encode; one that does not must say so with a UsageError.
void check_load(const std::string& bytes) {
  const std::string path = write_scratch(bytes);
  try {
    HfTokenizer tok(path);
    check_text(tok, "Hello world, it's 2024: caf\xC3\xA9 cafe\xCC\x81 \xE4\xB8\xAD\xE6\x96\x87 \xF0\x9F\x98\x80\n\n  x");
  } catch (const InvalidUtf8& e) {
    bug(std::string("InvalidUtf8 escaped from a load or a valid text: ") + e.what());
  } catch (const UsageError& e) {
    note(std::string("refused: ") + e.what());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string payload(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (data[0] % 3) {
      case 0:
        check_text(fixture(false), payload);
        check_text(fixture(true), payload);
        break;
      case 1:
        check_load(payload);
        break;
      default: {
        nlohmann::json j = nlohmann::json::parse(std::ifstream(kPairs));
        // Bytes that are not UTF-8 cannot be a JSON string: such patterns are out of scope.
        if (bpe::find_invalid_utf8(payload) != std::string::npos) return 0;
        j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", payload}};
        check_load(j.dump());
      }
    }
  } catch (const UsageError&) {
    bug("a UsageError escaped where none may");
  } catch (const std::exception& e) {
    bug(std::string("unexpected exception: ") + e.what());
  }
  return 0;
}
