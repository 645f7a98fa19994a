// GPU builds: memory statistics of libtorch's CUDA caching allocator, the GPU's name, and timing
// spans by CUDA events (see device.h).
#if defined(MPITRAIN_WITH_RCCL)
#include <rccl/rccl.h>
#else
#include <nccl.h>
#endif

#include <utility>
#include <vector>

#include "mpitrain/device.h"
#include "mpitrain/error.h"
#include "mpitrain/log.h"
#include "mpitrain/preflight.h"
#include "mpitrain/torch_gpu.h"  // CUDA, or ROCm under CUDA's names

namespace mpitrain {

int64_t cuda_peak_allocated_bytes(int device) {
  const auto stats = gpu::allocator_stats(static_cast<c10::DeviceIndex>(device));
  // Index 0 is StatType::AGGREGATE (all pools); the enum moved between namespaces across libtorch
  // versions, its first value did not.
  return stats.allocated_bytes[0].peak;
}

namespace {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(concat("CUDA ", what, " failed on ", log::identity(), ": ", cudaGetErrorString(e)));
}
}  // namespace

int64_t cuda_allocated_bytes(int device) {
  return gpu::allocator_stats(static_cast<c10::DeviceIndex>(device)).allocated_bytes[0].current;
}

int64_t cuda_total_memory_bytes(int device) {
  gpu::DeviceGuard guard(static_cast<c10::DeviceIndex>(device));  // cudaMemGetInfo asks the current device
  size_t free_bytes = 0, total = 0;
  check(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo");
  return static_cast<int64_t>(total);
}

std::string cuda_device_name(int device) {
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  return prop.name;
}

GpuFacts gpu_facts(int device) {
  GpuFacts f;
#if defined(MPITRAIN_GPU_HIP)
  auto version = [](int v) { return concat("HIP ", v / 10000000, ".", (v / 100000) % 100); };  // 50731921 -> "HIP 5.7"
#else
  auto version = [](int v) { return concat(v / 1000, ".", (v % 1000) / 10); };  // 13000 -> "13.0"
#endif
  int v = 0;
  if (cudaRuntimeGetVersion(&v) == cudaSuccess) f.cuda_runtime = version(v);
  if (cudaDriverGetVersion(&v) == cudaSuccess && v > 0) f.cuda_driver = version(v);
  if (ncclGetVersion(&v) == ncclSuccess)  // 22803 -> "2.28.3" (NCCL_VERSION_CODE since 2.9)
    f.nccl = concat(v / 10000, ".", (v % 10000) / 100, ".", v % 100);
  if (device >= 0) {
    f.gpu = cuda_device_name(device);
    char bus[32] = {};
    check(cudaDeviceGetPCIBusId(bus, sizeof bus, device), "cudaDeviceGetPCIBusId");
    f.bus_id = bus;
  }
  return f;
}

// A pool of event pairs, reused after every take: one pair per span between two reads.
struct CudaSpans {
  int device;
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> events;
  size_t used = 0;
};

CudaSpans* cuda_spans_new(int device) { return new CudaSpans{device, {}, 0}; }

void cuda_spans_delete(CudaSpans* spans) {
  for (auto& [a, b] : spans->events) {  // (void): HIP's calls are [[nodiscard]]
    (void)cudaEventDestroy(a);
    (void)cudaEventDestroy(b);
  }
  delete spans;
}

namespace {
cudaStream_t current_stream(const CudaSpans& s) {
  return gpu::current_stream(static_cast<c10::DeviceIndex>(s.device)).stream();
}
}  // namespace

void cuda_spans_begin(CudaSpans& s) {
  if (s.used == s.events.size()) {
    cudaEvent_t a = nullptr, b = nullptr;
    check(cudaEventCreate(&a), "cudaEventCreate");
    check(cudaEventCreate(&b), "cudaEventCreate");
    s.events.emplace_back(a, b);
  }
  check(cudaEventRecord(s.events[s.used].first, current_stream(s)), "cudaEventRecord");
}

void cuda_spans_end(CudaSpans& s) {
  check(cudaEventRecord(s.events[s.used].second, current_stream(s)), "cudaEventRecord");
  ++s.used;
}

double cuda_spans_take_seconds(CudaSpans& s) {
  double ms_total = 0;
  for (size_t i = 0; i < s.used; ++i) {
    float ms = 0;
    check(cudaEventSynchronize(s.events[i].second), "cudaEventSynchronize");
    check(cudaEventElapsedTime(&ms, s.events[i].first, s.events[i].second), "cudaEventElapsedTime");
    ms_total += ms;
  }
  s.used = 0;
  return ms_total / 1e3;
}

}  // namespace mpitrain
