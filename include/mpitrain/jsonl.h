// JSON Lines input of `mpitrain pack --format jsonl`: one JSON object per line, the document's
// text under one key (`--text-key`, default "text"). Read line by line, never whole.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace mpitrain {

// Calls `doc(text, line)` with the text of every line, in order (line numbers from 1). Empty and
// whitespace-only lines are skipped. A bad line is a UsageError naming the file and line:
//   "PATH: line 7: invalid UTF-8 at byte 12 of the line"
//   "PATH: line 7: not JSON: <the parser's message>"
//   "PATH: line 7: expected a JSON object, got an array"
//   "PATH: line 7: no key 'text'"
//   "PATH: line 7: 'text' is a number, expected a string"
void read_jsonl(const std::string& path, const std::string& key,
                const std::function<void(std::string_view text, uint64_t line)>& doc);

}  // namespace mpitrain
