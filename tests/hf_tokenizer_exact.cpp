// Compares mpitrain's Hugging Face tokenizer with reference ids (tests/hf_tokenizer_test.sh):
//   hf_tokenizer_exact TOKENIZER.json CORPUS.jsonl IDS.jsonl [text|match]
// CORPUS holds {"text": ...} per line, IDS the reference ids of the same line as a JSON array; the
// last argument is the special tokens' mode (HfTokenizer::set_special_tokens; default text).
// Every document must encode to exactly its reference ids, and decode back to its (normalized)
// text. Prints the counts; the first mismatches name the document, the position and the tokens
// around it. Exit status 0 when all agree, 1 otherwise.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "mpitrain/error.h"
#include "mpitrain/hf_tokenizer.h"

using mpitrain::HfTokenizer;

namespace {

std::string show(const HfTokenizer& tok, const std::vector<uint32_t>& ids, size_t at) {
  std::string s;
  for (size_t i = at > 3 ? at - 3 : 0; i < ids.size() && i < at + 4; ++i) {
    std::string text;
    try {
      text = tok.decode({ids[i]});
    } catch (const mpitrain::UsageError&) {
      text = "?";
    }
    s += mpitrain::concat(i == at ? " >" : " ", ids[i], nlohmann::json(text).dump(-1, ' ', false,
                                                  nlohmann::json::error_handler_t::replace));
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc == 5 ? argv[4] : "text";
  if ((argc != 4 && argc != 5) || (mode != "text" && mode != "match")) {
    std::fprintf(stderr, "usage: hf_tokenizer_exact TOKENIZER.json CORPUS.jsonl IDS.jsonl [text|match]\n");
    return 2;
  }
  try {
    HfTokenizer tok(argv[1]);
    tok.set_special_tokens(mode == "match" ? mpitrain::SpecialTokens::match : mpitrain::SpecialTokens::text);
    std::ifstream corpus(argv[2]), reference(argv[3]);
    if (!corpus || !reference) throw mpitrain::UsageError("cannot open the corpus or the ids");
    std::string line, ref_line;
    size_t docs = 0, bytes = 0, ids = 0, bad = 0;
    double seconds = 0;
    for (; std::getline(corpus, line); ++docs) {
      if (!std::getline(reference, ref_line))
        throw mpitrain::UsageError(mpitrain::concat(argv[3], ": fewer lines than the corpus"));
      const std::string text = nlohmann::json::parse(line).at("text").get<std::string>();
      const auto want = nlohmann::json::parse(ref_line).get<std::vector<uint32_t>>();
      const auto t0 = std::chrono::steady_clock::now();
      const std::vector<uint32_t> got = tok.encode(text);
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      bytes += text.size();
      ids += want.size();
      size_t at = 0;
      while (at < got.size() && at < want.size() && got[at] == want[at]) ++at;
      const bool round_trip = tok.decode(got) == tok.normalize(text);
      if (at == got.size() && at == want.size() && round_trip) continue;
      if (++bad <= 5) {
        std::printf("document %zu: %s at id %zu of %zu (reference %zu)\n", docs,
                    round_trip ? "differs" : "does not decode to its text", at, got.size(), want.size());
        std::printf("  mpitrain: %s\n  reference: %s\n", show(tok, got, at).c_str(), show(tok, want, at).c_str());
      }
    }
    std::printf("%s (special tokens: %s): %zu documents, %zu bytes, %zu reference ids: %zu documents differ "
                "(encoding took %.2f s, %.1f MB/s)\n",
                argv[1], mode.c_str(), docs, bytes, ids, bad, seconds, bytes / 1e6 / (seconds > 0 ? seconds : 1));
    return bad == 0 && docs > 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hf_tokenizer_exact: %s\n", e.what());
    return 1;
  }
}
