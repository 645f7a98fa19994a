// TensorBoard event files (see tensorboard.h).
#include "mpitrain/tensorboard.h"

#include <isa-l/crc.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "mpitrain/error.h"
#include "mpitrain/log.h"

namespace mpitrain {
namespace {

// ---- protocol buffer encoding: the few wire types these messages use -------------------------

void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void key(std::string& out, int field, int wire_type) { varint(out, static_cast<uint64_t>(field << 3 | wire_type)); }

template <class T>
void little_endian(std::string& out, T v) {  // fixed32/fixed64 fields; x86-64 and arm64 are little-endian
  char bytes[sizeof v];
  std::memcpy(bytes, &v, sizeof v);
  out.append(bytes, sizeof v);
}

void bytes_field(std::string& out, int field, const std::string& value) {
  key(out, field, 2);
  varint(out, value.size());
  out += value;
}

// Event: wall_time = 1 (double), step = 2 (int64), file_version = 3, summary = 5, session_log = 6.
std::string event_head(double wall_time, int64_t step) {
  std::string e;
  key(e, 1, 1);
  little_endian(e, wall_time);
  if (step != 0) {  // proto3 leaves a field at its default out, as Google's serializer does
    key(e, 2, 0);
    varint(e, static_cast<uint64_t>(step));
  }
  return e;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const void* data, size_t size) {
  // ISA-L's iSCSI CRC is CRC32C without the final inversion.
  uint32_t crc = 0xffffffffu;
  const auto* p = static_cast<const unsigned char*>(data);
  while (size > 0) {  // its length is an int
    const int n = static_cast<int>(std::min<size_t>(size, 1u << 30));
    crc = crc32_iscsi(const_cast<unsigned char*>(p), n, crc);
    p += n;
    size -= static_cast<size_t>(n);
  }
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t c = crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tf_record(const std::string& payload) {
  std::string r;
  const uint64_t length = payload.size();
  little_endian(r, length);
  little_endian(r, masked_crc32c(r.data(), 8));
  r += payload;
  little_endian(r, masked_crc32c(payload.data(), payload.size()));
  return r;
}

std::string file_version_event(double wall_time) {
  std::string e = event_head(wall_time, 0);
  bytes_field(e, 3, "brain.Event:2");
  return e;
}

std::string scalars_event(double wall_time, int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  std::string summary;
  for (const auto& [tag, value] : values) {
    std::string v;  // Summary.Value: tag = 1, simple_value = 2 (float)
    bytes_field(v, 1, tag);
    key(v, 2, 5);
    little_endian(v, static_cast<float>(value));
    bytes_field(summary, 1, v);  // Summary: repeated value = 1
  }
  std::string e = event_head(wall_time, step);
  bytes_field(e, 5, summary);
  return e;
}

std::string session_start_event(double wall_time, int64_t step) {
  std::string log;  // SessionLog: status = 1, START = 1
  key(log, 1, 0);
  varint(log, 1);
  std::string e = event_head(wall_time, step);
  bytes_field(e, 6, log);
  return e;
}

// ---- the writer --------------------------------------------------------------------------------

TensorBoardWriter::TensorBoardWriter(const std::string& dir, const std::string& host, const std::string& key)
    : key_(key) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const auto seconds = static_cast<long long>(now_seconds());
  path_ = concat(dir, "/events.out.tfevents.", seconds, ".", host, ".", ::getpid());
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_)
    throw UsageError(concat(key_, ": cannot write '", path_, "': ", std::strerror(errno),
                            ec ? concat(" (creating '", dir, "': ", ec.message(), ")") : std::string()));
  write(file_version_event(now_seconds()));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::write(const std::string& payload) {
  // A full disk ends the run's TensorBoard view, not the run: the metrics file and the log go on.
  if (!file_) return;
  const std::string r = tf_record(payload);
  if (std::fwrite(r.data(), 1, r.size(), file_) != r.size() || std::fflush(file_) != 0) {
    log::warn(concat(key_, ": writing '", path_, "' failed (", std::strerror(errno),
                     "); no more TensorBoard events this run"));
    std::fclose(file_);
    file_ = nullptr;
  }
}

void TensorBoardWriter::scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  write(scalars_event(now_seconds(), step, values));
}

void TensorBoardWriter::restart(int64_t step) { write(session_start_event(now_seconds(), step)); }

}  // namespace mpitrain
