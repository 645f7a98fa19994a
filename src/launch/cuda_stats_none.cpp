// CPU builds: there is no CUDA caching allocator to ask (GPU builds: cuda_stats.cpp).
#include "mpitrain/device.h"

namespace mpitrain {

int64_t cuda_peak_allocated_bytes(int) { return -1; }

}  // namespace mpitrain
