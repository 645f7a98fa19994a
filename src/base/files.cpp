// Bounded whole-file reads (see files.h).
#include "mpitrain/files.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "mpitrain/error.h"

namespace mpitrain {

namespace {
std::string size_text(uint64_t bytes) {
  return bytes >= (1u << 20) && bytes % (1u << 20) == 0 ? concat(bytes >> 20, " MiB") : concat(bytes, " bytes");
}
}  // namespace

std::string read_bounded_file(const std::string& path, uint64_t max_bytes, const std::string& what) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0)
    throw UsageError(concat(path, ": cannot open for reading (", std::strerror(errno), ")"));
  if (!S_ISREG(st.st_mode)) throw UsageError(concat(path, ": not a regular file"));
  auto too_large = [&](uint64_t seen) {
    return UsageError(concat(path, ": ", seen > static_cast<uint64_t>(st.st_size) ? "more than " : "",
                             size_text(seen), ", larger than the ", size_text(max_bytes), " ", what, " may have"));
  };
  if (static_cast<uint64_t>(st.st_size) > max_bytes) throw too_large(static_cast<uint64_t>(st.st_size));
  std::FILE* file = std::fopen(path.c_str(), "rb");  // stdio: reading a directory fails here, ferror says so
  if (!file) throw UsageError(concat(path, ": cannot open for reading (", std::strerror(errno), ")"));
  std::string text;
  text.reserve(static_cast<size_t>(st.st_size));
  char buf[65536];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, file)) > 0) {
    if (text.size() + n > max_bytes) {
      std::fclose(file);
      throw too_large(text.size() + n);
    }
    text.append(buf, n);
  }
  const bool failed = std::ferror(file) != 0;
  const int err = errno;
  std::fclose(file);
  if (failed) throw UsageError(concat(path, ": read error (", std::strerror(err), ")"));
  return text;
}

}  // namespace mpitrain
