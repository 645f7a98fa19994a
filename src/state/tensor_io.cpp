// Checkpoint tensors' bytes to and from the file (see tensor_io.h).
#include "mpitrain/tensor_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <thread>

#include "mpitrain/error.h"

namespace mpitrain {
namespace {

// pwrite/pread of a whole range (short transfers and EINTR continued). A read past the end of the
// file is a UsageError (a truncated checkpoint), a failed write an Error (write_checkpoint turns
// it into the disk-full message).
void write_all(int fd, const uint8_t* p, uint64_t n, uint64_t off) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, std::min<uint64_t>(n, 1u << 30), static_cast<off_t>(off));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw Error(concat("write failed: ", w < 0 ? std::strerror(errno) : "no progress"));
    p += w, n -= static_cast<uint64_t>(w), off += static_cast<uint64_t>(w);
  }
}

void read_all(int fd, uint8_t* p, uint64_t n, uint64_t off, const std::string& path, const std::string& name) {
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, std::min<uint64_t>(n, 1u << 30), static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      throw UsageError(concat(path, ": cannot read dataset '", name, "' (", r < 0 ? std::strerror(errno) : "end of file",
                              "; truncated or corrupt file?)"));
    p += r, n -= static_cast<uint64_t>(r), off += static_cast<uint64_t>(r);
  }
}

constexpr uint64_t kBounceBytes = 16u << 20;  // per bounce buffer; three of them

// Index of the first element of `v` that is NaN or infinite, or -1.
int64_t first_non_finite(const float* v, int64_t n) {
  constexpr int64_t kBlock = 1 << 16;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    uint32_t bad = 0;  // a branch-free pass the compiler vectorizes; the element is found after
    for (int64_t i = b; i < e; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &v[i], sizeof bits);
      bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
    }
    if (bad)
      for (int64_t i = b; i < e; ++i)
        if (!std::isfinite(v[i])) return i;
  }
  return -1;
}

// The values of `r` in `buf` (host fp32 contiguous, r.into's shape): checksum and finiteness. A
// NaN or inf with a valid checksum was saved so (a diverged run): training on would only spread
// it. The first such element is named.
void verify_tensor(const TensorRead& r, const std::string& file, const torch::Tensor& buf) {
  const auto* v = buf.data_ptr<float>();
  const int64_t n = buf.numel();
  // One pass over memory: each block's CRC and finiteness while it is in the CPU cache.
  constexpr int64_t kBlock = 64 << 10;  // floats
  uint32_t crc = h5::crc32(nullptr, 0);
  int64_t bad = -1;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t len = std::min(kBlock, n - b);
    crc = h5::crc32_update(crc, v + b, static_cast<size_t>(len) * sizeof(float));
    if (bad < 0)
      if (const int64_t at = first_non_finite(v + b, len); at >= 0) bad = b + at;
  }
  if (r.crc != crc) throw UsageError(concat(file, ": checksum mismatch in dataset '", r.name, "'"));
  if (bad >= 0) {
    const int64_t count = torch::logical_not(torch::isfinite(buf)).sum().item<int64_t>();
    throw UsageError(concat(file, ": dataset '", r.name, "' holds ", count, " non-finite value(s), the first ", v[bad],
                            " at flat index ", bad));
  }
}

}  // namespace

std::pair<h5::Dataset, uint64_t> allocate_dataset(hid_t loc, const std::string& name,
                                                 const std::vector<int64_t>& shape) {
  const std::vector<hsize_t> dims(shape.begin(), shape.end());
  h5::Dataset ds = h5::create_allocated(loc, name, H5T_NATIVE_FLOAT, dims);
  uint64_t bytes = sizeof(float);
  for (int64_t d : shape) bytes *= static_cast<uint64_t>(d);
  if (bytes == 0) return {std::move(ds), 0};
  auto at = h5::raw_offset(ds.get(), H5T_NATIVE_FLOAT, bytes);
  if (!at) throw Error(concat("HDF5: dataset ", name, " got no contiguous storage"));
  return {std::move(ds), *at};
}

std::vector<uint32_t> write_tensors(const std::string& path, const std::vector<RawWrite>& writes,
                                    const std::function<void(size_t)>& between) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) throw Error(concat(path, ": cannot open for writing: ", std::strerror(errno)));
  int direct_fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_DIRECT);  // -1: no direct I/O here
  const bool direct = direct_fd >= 0;  // the copy thread's view (the writer may give up direct I/O)

  // What the copy thread hands over, in file order: a filled bounce buffer (buffer >= 0), bytes to
  // write from the tensor itself (buffer < 0), or the end of tensor `tensor`.
  struct Piece {
    int buffer = -1;
    const uint8_t* data = nullptr;
    uint64_t bytes = 0, offset = 0;
    size_t tensor = SIZE_MAX;  // set: tensor done
  };
  constexpr int kBuffers = 3;
  std::vector<std::unique_ptr<uint8_t, decltype(&std::free)>> bounce;
  if (direct)
    for (int b = 0; b < kBuffers; ++b)
      bounce.emplace_back(static_cast<uint8_t*>(std::aligned_alloc(kDirectAlign, kBounceBytes)), &std::free);
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Piece> ready;
  std::vector<int> free_buffers;
  for (int b = 0; b < static_cast<int>(bounce.size()); ++b) free_buffers.push_back(b);
  bool stop = false;  // the writer failed: the copy thread ends
  std::vector<uint32_t> crcs(writes.size());

  auto hand_over = [&](Piece p) {
    std::lock_guard<std::mutex> lock(mu);
    ready.push_back(p);
    cv.notify_all();
  };
  std::thread copier([&] {
    for (size_t i = 0; i < writes.size(); ++i) {
      const RawWrite& t = writes[i];
      uint32_t crc = h5::crc32(nullptr, 0);
      // [0, head) up to the first block boundary and [head + body, bytes) through the page cache,
      // the whole blocks between them directly.
      const uint64_t head =
          direct ? std::min(t.bytes, (kDirectAlign - t.offset % kDirectAlign) % kDirectAlign) : t.bytes;
      const uint64_t body = (t.bytes - head) / kDirectAlign * kDirectAlign;
      if (head > 0) {
        crc = h5::crc32_update(crc, t.data, head);
        hand_over({-1, t.data, head, t.offset});
      }
      for (uint64_t at = head; at < head + body; at += kBounceBytes) {
        int b;
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return stop || !free_buffers.empty(); });
          if (stop) return;
          b = free_buffers.back();
          free_buffers.pop_back();
        }
        const uint64_t n = std::min<uint64_t>(kBounceBytes, head + body - at);
        std::memcpy(bounce[b].get(), t.data + at, n);
        crc = h5::crc32_update(crc, bounce[b].get(), n);
        hand_over({b, nullptr, n, t.offset + at});
      }
      if (const uint64_t done = head + body; done < t.bytes) {
        crc = h5::crc32_update(crc, t.data + done, t.bytes - done);
        hand_over({-1, t.data + done, t.bytes - done, t.offset + done});
      }
      crcs[i] = crc;
      hand_over({-1, nullptr, 0, 0, i});
    }
  });

  std::exception_ptr failed;
  try {
    for (size_t done = 0; done < writes.size();) {
      Piece p;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return !ready.empty(); });
        p = ready.front();
        ready.pop_front();
      }
      if (p.tensor != SIZE_MAX) {
        between(p.tensor);
        ++done;
        continue;
      }
      if (p.buffer < 0) {
        write_all(fd, p.data, p.bytes, p.offset);
        continue;
      }
      const uint8_t* data = bounce[p.buffer].get();
      uint64_t written = 0;
      if (direct_fd >= 0) {
        const ssize_t w = ::pwrite(direct_fd, data, p.bytes, static_cast<off_t>(p.offset));
        if (w >= 0) {
          written = static_cast<uint64_t>(w);
        } else if (errno == EINVAL) {  // direct I/O refused after all (another alignment)
          ::close(direct_fd);
          direct_fd = -1;
        } else {
          throw Error(concat("write failed: ", std::strerror(errno)));
        }
      }
      // The rest through the page cache: all of it without direct I/O, the remainder of a short
      // direct write (the disk filling up: the plain write then reports why).
      write_all(fd, data + written, p.bytes - written, p.offset + written);
      std::lock_guard<std::mutex> lock(mu);
      free_buffers.push_back(p.buffer);
      cv.notify_all();
    }
  } catch (...) {
    failed = std::current_exception();
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
    cv.notify_all();
  }
  copier.join();
  if (direct_fd >= 0) ::close(direct_fd);
  if (::close(fd) != 0 && !failed) failed = std::make_exception_ptr(Error(concat("close failed: ", std::strerror(errno))));
  if (failed) std::rethrow_exception(failed);
  return crcs;
}

void read_tensors(const std::string& file, std::vector<TensorRead>& reads) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw UsageError(concat(file, ": cannot open: ", std::strerror(errno)));
  std::future<void> verifying;  // the previous tensor's verification
  auto finish = [&] {
    if (verifying.valid()) verifying.get();
  };
  try {
    torch::NoGradGuard no_grad;
    for (auto& r : reads) {
      const bool direct = r.into.device().is_cpu() && r.into.scalar_type() == torch::kFloat32 && r.into.is_contiguous();
      torch::Tensor buf = direct ? r.into : torch::empty(r.into.sizes(), torch::kFloat32);
      if (r.offset) {
        read_all(fd, static_cast<uint8_t*>(buf.data_ptr()), static_cast<uint64_t>(buf.numel()) * sizeof(float),
                 *r.offset, file, r.name);
      } else {
        try {
          h5::read(r.ds.get(), H5T_NATIVE_FLOAT, buf.data_ptr<float>());
        } catch (const UsageError&) {
          throw UsageError(concat(file, ": cannot read dataset '", r.name, "' (truncated or corrupt file?)"));
        }
      }
      finish();
      if (direct) {
        verifying = std::async(std::launch::async, [&r, &file, buf] { verify_tensor(r, file, buf); });
      } else {
        verify_tensor(r, file, buf);
        r.into.copy_(buf);
      }
    }
    finish();
  } catch (...) {
    ::close(fd);
    if (verifying.valid()) verifying.get();  // an earlier tensor's failure is the one to report
    throw;
  }
  ::close(fd);
}

}  // namespace mpitrain
