// Crash-safe file steps (see durable.h).
#include "mpitrain/durable.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "mpitrain/error.h"

namespace mpitrain {

void fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) throw Error(concat(path, ": cannot open for fsync: ", std::strerror(errno)));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw Error(concat(path, ": fsync failed: ", std::strerror(errno)));
}

void rename_durably(const std::string& from, const std::string& to, const std::string& dir) {
  if (std::rename(from.c_str(), to.c_str()) != 0)
    throw Error(concat(to, ": cannot rename from ", from, ": ", std::strerror(errno)));
  fsync_path(dir, /*directory=*/true);
}

void write_file_durably(const std::string& path, const std::function<void(std::ostream&)>& write) {
  const std::string tmp = path + ".tmp";
  try {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (out) write(out);
    out.flush();
    if (!out) {
      const int err = errno;
      throw UsageError(concat("cannot write '", tmp, "': ", std::strerror(err)));
    }
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
  const std::string dir = std::filesystem::path(path).parent_path().string();
  try {
    fsync_path(tmp);
    rename_durably(tmp, path, dir.empty() ? "." : dir);
  } catch (const Error& e) {
    std::remove(tmp.c_str());
    throw UsageError(e.what());
  }
}

void write_file_durably(const std::string& path, const std::string& bytes) {
  write_file_durably(path, [&](std::ostream& out) { out.write(bytes.data(), static_cast<std::streamsize>(bytes.size())); });
}

}  // namespace mpitrain
