// Oniguruma Split patterns of tokenizer.json rewritten for PCRE2 (onig_pattern.h).
#include "mpitrain/onig_pattern.h"

#include <cctype>
#include <string_view>
#include <vector>

#include "mpitrain/error.h"

namespace mpitrain {

namespace {

bool is_ascii_letter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
char other_case(char c) { return static_cast<char>(c ^ 0x20); }

}  // namespace

std::string onig_to_pcre2(const std::string& re) {
  std::string out, extra;  // extra: the other-case letters a folded class gets before its ']'
  std::vector<bool> groups;  // the fold state outside each open group
  bool fold = false, in_class = false;
  size_t class_start = 0;
  for (size_t i = 0; i < re.size();) {
    const char c = re[i];
    if (c == '\\' && i + 1 < re.size()) {
      const char d = re[i + 1];
      if (d == 's' || d == 'S') {
        out += d == 's' ? "\\p{White_Space}" : "\\P{White_Space}";
        i += 2;
      } else if (d == 'h' || d == 'H') {
        if (in_class && d == 'H') throw UsageError("\\H inside a character class is not supported");
        out += in_class ? "0-9A-Fa-f" : d == 'h' ? "[0-9A-Fa-f]" : "[^0-9A-Fa-f]";
        i += 2;
      } else if (d == 'u' && re.size() - i >= 6) {
        out += "\\x{" + re.substr(i + 2, 4) + "}";
        i += 6;
      } else if ((d == 'p' || d == 'P' || d == 'x') && i + 2 < re.size() && re[i + 2] == '{') {
        const size_t close = re.find('}', i);
        if (close == std::string::npos) throw UsageError("unterminated \\" + std::string(1, d) + "{");
        out += re.substr(i, close + 1 - i);
        i = close + 1;
      } else {
        out += re.substr(i, 2);  // other escapes mean the same in PCRE2 (\r \n \p{L} \d ...)
        i += 2;
      }
      continue;
    }
    if (in_class) {
      if (c == ']' && i > class_start) {
        out += extra + "]";
        extra.clear();
        in_class = false;
      } else if (c == '[' && re.compare(i, 2, "[:") == 0) {
        const size_t close = re.find(":]", i);
        if (close == std::string::npos) throw UsageError("unterminated POSIX class");
        out += re.substr(i, close + 2 - i);
        i = close + 2;
        continue;
      } else if (c == '[' || re.compare(i, 2, "&&") == 0) {
        throw UsageError("nested character classes and && are not supported");
      } else {
        out += c;
        if (fold && is_ascii_letter(c)) {
          const bool range = i + 2 < re.size() && re[i + 1] == '-' && is_ascii_letter(re[i + 2]);
          if (range && (std::islower(c) != 0) == (std::islower(re[i + 2]) != 0)) {
            extra += std::string{other_case(c), '-', other_case(re[i + 2])};
            out += re.substr(i + 1, 2);
            i += 3;
            continue;
          }
          extra += other_case(c);
        }
      }
      ++i;
      continue;
    }
    if (c == '[') {
      in_class = true;
      out += c;
      ++i;
      if (i < re.size() && re[i] == '^') out += re[i++];
      class_start = i;  // a ']' right here is a literal
      continue;
    }
    if (c == '(') {
      groups.push_back(fold);
      if (re.compare(i, 4, "(?i:") == 0) {
        fold = true;
        out += "(?:";
        i += 4;
        continue;
      }
      if (re.compare(i, 2, "(?") == 0 && i + 2 < re.size() &&
          std::string_view(":=!<>").find(re[i + 2]) == std::string_view::npos)
        throw UsageError("inline flags other than (?i:...) are not supported");
    } else if (c == ')') {
      if (!groups.empty()) {
        fold = groups.back();
        groups.pop_back();
      }
    } else if (fold && is_ascii_letter(c)) {
      out += std::string{'[', c, other_case(c), ']'};
      ++i;
      continue;
    }
    out += c;
    ++i;
  }
  if (in_class) throw UsageError("unterminated character class");
  return out;
}

// A literal string as a PCRE2 pattern.
std::string escape_literal(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (static_cast<unsigned char>(c) < 0x80 && !std::isalnum(static_cast<unsigned char>(c)))
      out += '\\';
    out += c;
  }
  return out;
}

}  // namespace mpitrain
