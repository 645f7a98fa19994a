// TensorBoard event files, written directly: what `tensorboard --logdir` reads.
//
// The format (TensorFlow's TFRecord of `Event` protocol buffers) is small: each record is
//   uint64 length | uint32 masked CRC32C of the length | payload | uint32 masked CRC32C of payload
// (little-endian; mask(c) = ((c >> 15) | (c << 17)) + 0xa282ead8). Payloads are `Event` messages:
// the first holds file_version "brain.Event:2", then one per report with a `Summary` of scalar
// values (tag, simple_value) at a step. A `SessionLog` START at step s tells TensorBoard that the
// run restarted there, and it drops the older points at steps >= s (a resumed run: the points the
// crashed run logged after its last checkpoint). No protobuf library is needed for these four
// messages; CRC32C comes from ISA-L (Debian's libisal-dev).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace mpitrain {

class TensorBoardWriter {
 public:
  // Creates `dir` (and parents) and a new events.out.tfevents.<time>.<host>.<pid> in it, starting
  // with the file-version record. UsageError naming `key` when it cannot be written.
  TensorBoardWriter(const std::string& dir, const std::string& host, const std::string& key);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One event holding every (tag, value) at `step`, flushed to the file.
  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  // The run (re)starts at `step`: TensorBoard forgets the earlier files' points at steps >= step.
  void restart(int64_t step);
  const std::string& path() const { return path_; }

 private:
  void write(const std::string& payload);
  std::string path_;
  std::string key_;
  std::FILE* file_ = nullptr;
};

// ---- the building blocks (tests/test_tensorboard.cpp checks them against known bytes) ----
uint32_t crc32c(const void* data, size_t size);
uint32_t masked_crc32c(const void* data, size_t size);
// A payload framed as one record.
std::string tf_record(const std::string& payload);
// Event payloads.
std::string file_version_event(double wall_time);
std::string scalars_event(double wall_time, int64_t step, const std::vector<std::pair<std::string, double>>& values);
std::string session_start_event(double wall_time, int64_t step);

}  // namespace mpitrain
