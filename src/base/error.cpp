// fail() and text helpers (MPI's error text: src/comm/mpi_ops.cpp).
#include "mpitrain/error.h"

#include "mpitrain/log.h"

namespace mpitrain {

void fail(std::string_view lib, std::string_view what, const char* file, int line) {
  std::string_view f(file);
  if (auto slash = f.rfind('/'); slash != std::string_view::npos) f.remove_prefix(slash + 1);
  throw Error(concat(log::identity(), " ", lib, " error at ", f, ":", line, ": ", what));
}

std::vector<std::string> split_list(const std::string& list, char sep) {
  std::vector<std::string> items;
  size_t pos = 0;
  while (true) {
    const size_t end = list.find(sep, pos);
    items.push_back(list.substr(pos, end == std::string::npos ? std::string::npos : end - pos));
    if (end == std::string::npos) return items;
    pos = end + 1;
  }
}

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\t' || c == '\r') c = ' ';
  std::string out;
  for (char c : s)
    if (!(c == ' ' && (out.empty() || out.back() == ' '))) out += c;
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

std::string first_few(const std::vector<std::string>& items) {
  std::string s;
  for (size_t i = 0; i < items.size() && i < 3; ++i) s += concat(i ? ", " : "", items[i]);
  if (items.size() > 3) s += concat(" and ", items.size() - 3, " more");
  return s;
}

}  // namespace mpitrain
