// .npy files written as numpy.save writes them, for the pack and model.init_from tests: magic,
// version, header length, the dict padded with spaces and a newline to a multiple of 64 bytes,
// the data. The tensor writer exists where libtorch's headers are on the include path.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

#if __has_include(<torch/torch.h>)
#include <torch/torch.h>
#define MPITRAIN_NPY_WRITER_TORCH 1
#endif

namespace mpitrain::npy_test {

inline void write_npy_bytes(const std::string& path, const std::string& dict, const std::string& data,
                            int major = 1) {
  const size_t pre = major == 1 ? 10 : 12;
  std::string h = dict;
  while ((pre + h.size() + 1) % 64 != 0) h += ' ';
  h += '\n';
  std::string bytes = std::string("\x93NUMPY", 6) + static_cast<char>(major) + '\0';
  const auto len = static_cast<uint32_t>(h.size());
  bytes.append(reinterpret_cast<const char*>(&len), major == 1 ? 2 : 4);
  std::ofstream(path, std::ios::binary) << bytes << h << data;
}

#ifdef MPITRAIN_NPY_WRITER_TORCH
// "(48, 16)", "(16,)"
inline std::string npy_shape(c10::IntArrayRef sizes) {
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + (sizes.size() == 1 ? ",)" : ")");
}

// `t` (any device) as `<descr>` ('<f4' float32, '<f8' float64, '<f2' float16) in C order.
inline void write_npy_tensor(const std::string& path, const torch::Tensor& t, const std::string& descr = "<f4",
                             int major = 1) {
  const auto dtype = descr == "<f8" ? torch::kFloat64 : descr == "<f2" ? torch::kFloat16 : torch::kFloat32;
  const torch::Tensor c = t.detach().to(torch::kCPU, dtype).contiguous();
  write_npy_bytes(path,
                  "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + npy_shape(c.sizes()) + ", }",
                  std::string(static_cast<const char*>(c.data_ptr()), c.nbytes()), major);
}
#endif

}  // namespace mpitrain::npy_test
