// Thin RAII and helpers over the HDF5 C API: handles that close themselves, attributes, and
// whole-dataset reads and writes. Errors throw Error (internal) or UsageError (bad file),
// always naming the file and the object.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mpitrain/error.h"

namespace mpitrain::h5 {

// Owns one hid_t; closes it with the matching H5?close. Move-only.
template <herr_t (*Close)(hid_t)>
class Handle {
 public:
  Handle() = default;
  explicit Handle(hid_t id, const std::string& what = "HDF5 object") : id_(id) {
    if (id_ < 0) throw Error("HDF5: cannot open " + what);
  }
  Handle(Handle&& o) noexcept : id_(std::exchange(o.id_, H5I_INVALID_HID)) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = std::exchange(o.id_, H5I_INVALID_HID);
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { reset(); }  // destructors never throw
  hid_t get() const { return id_; }
  explicit operator bool() const { return id_ >= 0; }
  void reset() {
    if (id_ >= 0) Close(id_);
    id_ = H5I_INVALID_HID;
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
};

using File = Handle<H5Fclose>;
using Group = Handle<H5Gclose>;
using Dataset = Handle<H5Dclose>;
using Dataspace = Handle<H5Sclose>;
using Datatype = Handle<H5Tclose>;
using Attribute = Handle<H5Aclose>;
using PropList = Handle<H5Pclose>;

// Turns off HDF5's own error stack printing (we report errors ourselves). Idempotent.
void silence_errors();

// Opens an existing file read-only. Missing, unreadable or non-HDF5 files are UsageError
// "<path>: not an HDF5 file" etc.
File open_read(const std::string& path);
// Creates (truncates) a file for writing. alignment > 0: every object of at least 64 KiB starts at
// a multiple of `alignment` bytes in the file (blocks for direct I/O), and metadata is kept
// together in 1 MiB blocks.
File create(const std::string& path, uint64_t alignment = 0);

bool exists(hid_t loc, const std::string& path);  // link exists (intermediate groups checked)
Group create_group(hid_t loc, const std::string& name);
Group open_group(hid_t loc, const std::string& name);
// Names of the members of a group, in creation/name order.
std::vector<std::string> list(hid_t group);

// Attributes on any object (file root, group, dataset).
void set_attr(hid_t obj, const std::string& name, const std::string& value);
void set_attr(hid_t obj, const std::string& name, int64_t value);
void set_attr(hid_t obj, const std::string& name, double value);
void set_attr(hid_t obj, const std::string& name, const std::vector<uint8_t>& bytes);
bool has_attr(hid_t obj, const std::string& name);
std::optional<std::string> get_attr_string(hid_t obj, const std::string& name);
std::optional<int64_t> get_attr_int(hid_t obj, const std::string& name);
std::optional<double> get_attr_double(hid_t obj, const std::string& name);
std::optional<std::vector<uint8_t>> get_attr_bytes(hid_t obj, const std::string& name);

// Writes a contiguous dataset `name` under `loc` of `type` (a native type such as
// H5T_NATIVE_FLOAT) and shape `dims` from `data` (row-major, dims product elements).
Dataset write(hid_t loc, const std::string& name, hid_t type, const std::vector<hsize_t>& dims,
              const void* data);
// Creates a contiguous dataset whose storage is allocated at once and never filled: its bytes are
// at raw_offset() in the file, for the caller to write there itself (checkpoints write their
// tensors with large pwrite()s, the way dd does, instead of through H5Dwrite).
Dataset create_allocated(hid_t loc, const std::string& name, hid_t type, const std::vector<hsize_t>& dims);
// Where a dataset's bytes are in the file, when they can be read or written there directly as
// `mem_type`: contiguous layout, storage allocated, of exactly `bytes` bytes, and the file's type
// equal to mem_type. nullopt otherwise (chunked, compressed, another type: H5Dread converts).
std::optional<uint64_t> raw_offset(hid_t dataset, hid_t mem_type, uint64_t bytes);
// Shape of a dataset.
std::vector<hsize_t> shape(hid_t dataset);
// Reads the whole dataset converting to `type` into `out` (must hold product(shape) elements).
void read(hid_t dataset, hid_t type, void* out);

// CRC32 (zlib) of a byte range; used as the per-dataset checksum attribute.
uint32_t crc32(const void* data, size_t bytes);
// The CRC32 of the bytes before and then these: crc32_update(crc32(a), b) == crc32(a + b).
uint32_t crc32_update(uint32_t crc, const void* data, size_t bytes);
// The CRC32 of a + b from crc32(a), crc32(b) and b's length (pieces written by different ranks).
uint32_t crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t bytes_b);

}  // namespace mpitrain::h5

namespace mpitrain::h5 {
// A human-readable listing of a file: root attributes, then every dataset with its shape, type
// and attributes (`mpitrain inspect`). Long string attributes are shortened.
std::string describe(const std::string& path);
}  // namespace mpitrain::h5
