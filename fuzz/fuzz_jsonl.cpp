// libFuzzer target: JSON Lines documents (`mpitrain pack --format jsonl`, read_jsonl).
//
// Input: a key-selector byte, then the file's bytes. Expected outcomes: every document handed over,
// or a UsageError naming the file and a line. Oracle (besides no crash and no sanitizer report):
// only UsageError escapes; documents come in increasing line order, each line number within the
// file's line count; each document is valid UTF-8 (lines are checked before parsing) and is the
// JSON string value under the key on that line (parsed again here with nlohmann::json).
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "harness.h"
#include "mpitrain/bpe_merge.h"
#include "mpitrain/error.h"
#include "mpitrain/jsonl.h"

using namespace mpitrain;

const char* const kFuzzTarget = "fuzz_jsonl";

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = make_scratch_dir();
  static const std::string path = dir + "/docs.jsonl";
  if (size == 0) return 0;
  static const char* const kKeys[] = {"text", "content", "", "t\"x"};
  const std::string key = kKeys[data[0] % 4];
  const std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  std::vector<std::string> lines;
  {
    std::istringstream in(bytes);
    for (std::string l; std::getline(in, l);) lines.push_back(l);
  }
  uint64_t last = 0;
  try {
    read_jsonl(path, key, [&](std::string_view text, uint64_t line) {
      if (line <= last || line > lines.size()) bug(concat("line ", line, " after ", last, " of ", lines.size()));
      last = line;
      if (bpe::find_invalid_utf8(text) != std::string::npos) bug(concat("line ", line, ": a document that is not UTF-8"));
      const nlohmann::json j = nlohmann::json::parse(lines[line - 1]);
      if (!j.is_object() || !j.contains(key) || !j[key].is_string() || j[key].get<std::string>() != text)
        bug(concat("line ", line, ": the document is not the line's '", key, "' string"));
    });
  } catch (const UsageError& e) {
    if (std::string(e.what()).rfind(path + ": ", 0) != 0) bug(concat("an error that does not name the file: ", e.what()));
  } catch (const std::exception& e) {
    bug(concat("not a UsageError: ", e.what()));
  }
  return 0;
}
