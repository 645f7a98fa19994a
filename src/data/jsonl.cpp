// JSON Lines documents for `mpitrain pack`: streamed with getline, each line checked for UTF-8
// before it is parsed, so that a bad byte is reported as such rather than as a JSON error.
#include "mpitrain/jsonl.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "mpitrain/bpe_merge.h"
#include "mpitrain/error.h"

namespace mpitrain {

namespace {
std::string a_type(const nlohmann::json& j) {
  const std::string t = j.type_name();
  return (t == "array" || t == "object" ? "an " : "a ") + t;
}
}  // namespace

void read_jsonl(const std::string& path, const std::string& key,
                const std::function<void(std::string_view text, uint64_t line)>& doc) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(path + ": cannot open for reading");
  std::string line;
  for (uint64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r\f\v") == std::string::npos) continue;
    auto bad = [&](const std::string& what) { return UsageError(concat(path, ": line ", n, ": ", what)); };
    if (const size_t at = bpe::find_invalid_utf8(line); at != std::string::npos)
      throw bad(concat("invalid UTF-8 at byte ", at, " of the line"));
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw bad(concat("not JSON: ", e.what()));
    }
    if (!j.is_object()) throw bad("expected a JSON object, got " + a_type(j));
    auto it = j.find(key);
    if (it == j.end()) throw bad("no key '" + key + "'");
    if (!it->is_string())
      throw bad(concat("'", key, "' is ", a_type(*it), ", expected a string"));
    doc(it->get_ref<const std::string&>(), n);
  }
  if (in.bad()) throw UsageError(path + ": read error");
}

}  // namespace mpitrain
