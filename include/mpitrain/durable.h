// Files that survive a crash or power loss whole or not at all: written to a temporary name,
// fsynced, renamed over the final name, and the directory fsynced (checkpoints, `latest`, the
// Hugging Face export).
#pragma once

#include <functional>
#include <ostream>
#include <string>

namespace mpitrain {

// fsync of a file (or, with directory, a directory) by path; Error naming it on failure.
void fsync_path(const std::string& path, bool directory = false);
// rename(from, to), then fsync of `dir`, the directory holding both; Error on failure.
void rename_durably(const std::string& from, const std::string& to, const std::string& dir);
// `bytes` into `path` through `<path>.tmp` (removed on failure): written, fsynced, renamed
// durably. UsageError naming the file when it cannot be written (a full disk, no permission).
void write_file_durably(const std::string& path, const std::string& bytes);
// The same, the bytes written by `write` as it goes (a file larger than memory holds at once); an
// exception from it removes the temporary file and leaves `path` as it was.
void write_file_durably(const std::string& path, const std::function<void(std::ostream&)>& write);

}  // namespace mpitrain
