// Whole small files read without trusting them: configuration and tokenizer files come from users
// and from downloads, and a path may name /dev/zero, a FIFO or a 1 GB file by mistake.
#pragma once

#include <cstdint>
#include <string>

namespace mpitrain {

// The bytes of `path`, which must be a regular file (checked before it is opened: a FIFO would
// block the open) of at most `max_bytes` (checked by its size first, and again while reading: a
// file that grows, or /proc files that report size 0). UsageError naming `path`, and `what` (the
// kind of file, e.g. "a tokenizer.json") where the bound is exceeded; nothing larger than the bound
// is ever allocated.
std::string read_bounded_file(const std::string& path, uint64_t max_bytes, const std::string& what);

}  // namespace mpitrain
