// The bytes of checkpoint tensors to and from an HDF5 file at disk speed (checkpoint.cpp uses it).
// HDF5 writes the structure: every tensor's dataset is created contiguous and allocated, and its
// bytes are then written at the dataset's offset in the file by large direct writes, with the
// CRC-32 computed on the way; loads read them back with large preads and verify them on a second
// thread. Any HDF5 reader sees ordinary datasets.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mpitrain/h5.h"

namespace mpitrain {

// Files written by write_tensors align their large datasets to this (h5::create(path, kDirectAlign)).
constexpr uint64_t kDirectAlign = 4096;  // the largest logical block size in use

// Bytes of a checkpoint being written and where they go in the file: a whole tensor, or (ranks
// writing their own shares of a checkpoint together) a run of its elements.
struct RawWrite {
  const uint8_t* data = nullptr;
  uint64_t bytes = 0;
  uint64_t offset = 0;
};

// Creates the fp32 dataset `name` of `shape` under `loc`, allocated in the file and not written,
// and returns it with the offset of its bytes in the file (where write_tensors puts them).
std::pair<h5::Dataset, uint64_t> allocate_dataset(hid_t loc, const std::string& name, const std::vector<int64_t>& shape);

// The bytes of `writes` into the file at their offsets, in the given order, each one's CRC32
// computed on the way. Where the filesystem allows it the bytes bypass the page cache (O_DIRECT): a
// copy thread moves them through aligned bounce buffers, computing the CRC32 from the copy while
// it is in the CPU cache, and this thread writes the filled buffers to the disk meanwhile. A
// checkpoint thus neither waits for the kernel to copy 1.5 GB into fresh page-cache pages nor
// evicts the page cache that training uses (the data shards). Runs too small for a block, the
// partial blocks at either end of a run (HDF5 aligns large datasets, h5::create, so whole tensors
// start on a block; a rank's share of one may not), and every write on a filesystem without
// O_DIRECT go through the page cache. `between(i)` runs after writes[i] is written (the test-only
// fault hook).
std::vector<uint32_t> write_tensors(const std::string& path, const std::vector<RawWrite>& writes,
                                    const std::function<void(size_t)>& between);

// One tensor of a checkpoint being loaded: its dataset, checked against the tensor it goes into.
struct TensorRead {
  std::string name;
  h5::Dataset ds;
  torch::Tensor into;
  std::optional<uint64_t> offset;  // its bytes in the file, when read directly (else H5Dread)
  uint32_t crc = 0;
};

// Reads and verifies every tensor of `reads` into its destination. Bytes that lie contiguous in the
// file are read with large pread()s straight into host fp32 destinations, and each tensor is
// verified on a second thread while the next one is read; others go through H5Dread and a host
// buffer. The first failure in file order is thrown; a failed load may leave the destinations
// partly written (every caller then fails or loads another checkpoint whole).
void read_tensors(const std::string& file, std::vector<TensorRead>& reads);

}  // namespace mpitrain
