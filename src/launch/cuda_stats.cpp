// GPU builds: memory statistics of libtorch's CUDA caching allocator (see device.h).
#include <c10/cuda/CUDACachingAllocator.h>

#include "mpitrain/device.h"

namespace mpitrain {

int64_t cuda_peak_allocated_bytes(int device) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  // Index 0 is StatType::AGGREGATE (all pools); the enum moved between namespaces across libtorch
  // versions, its first value did not.
  return stats.allocated_bytes[0].peak;
}

}  // namespace mpitrain
