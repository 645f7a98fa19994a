// Model FLOPs per token and the known GPUs' peaks (see mfu.h).
#include "mpitrain/mfu.h"

namespace mpitrain {

double model_flops_per_token(int64_t params, int64_t position_embedding_params, int64_t n_layer, int64_t attn_width,
                             int64_t seq_len) {
  const double n = static_cast<double>(params - position_embedding_params);
  return 6.0 * n + 12.0 * static_cast<double>(n_layer) * static_cast<double>(attn_width) * static_cast<double>(seq_len);
}

namespace {

struct Peak {
  const char* name;      // a part of CUDA's device name
  const char* variant;   // a second part that must also occur ("" = none)
  double half, single;   // dense bf16/fp16 tensor-core TFLOPS, fp32 TFLOPS
};

// NVIDIA's data sheets. First match wins, so the more specific entries come first.
const Peak kPeaks[] = {
    {"H100", "PCIe", 756.0, 51.2},   {"H100", "NVL", 835.0, 60.0},  {"H100", "", 989.4, 66.9},   // SXM
    {"H200", "NVL", 835.0, 60.0},    {"H200", "", 989.4, 66.9},     {"GH200", "", 989.4, 66.9},
    {"A100", "", 312.0, 19.5},       {"A800", "", 312.0, 19.5},     {"L40S", "", 362.1, 91.6},
    {"L40", "", 181.0, 90.5},
};

bool contains(const std::string& s, const char* part) { return *part == '\0' || s.find(part) != std::string::npos; }

}  // namespace

double known_peak_tflops(const std::string& gpu_name, const std::string& precision) {
  if (gpu_name.empty()) return 0;
  for (const Peak& p : kPeaks) {
    if (!contains(gpu_name, p.name) || !contains(gpu_name, p.variant)) continue;
    return precision == "fp32" ? p.single : p.half;
  }
  return 0;
}

}  // namespace mpitrain
