// The Split patterns of a tokenizer.json are Oniguruma regexes (what the `tokenizers` library
// compiles); these turn them into PCRE2 patterns with the same meaning.
#pragma once

#include <string>

namespace mpitrain {

// An Oniguruma pattern as PCRE2 (UTF + UCP), following tokenizers.js's translation: \s and \S are
// Unicode White_Space (PCRE2's \s also takes U+180E), \h \H are hex digits, \uHHHH is a code point,
// and (?i:...) folds ASCII letters only. Nested classes, class intersections and inline flags
// other than (?i:...) are refused: UsageError with the reason (the caller adds file and key).
std::string onig_to_pcre2(const std::string& re);

// A literal string as a PCRE2 pattern (a Split's {"String": ...}).
std::string escape_literal(const std::string& s);

}  // namespace mpitrain
