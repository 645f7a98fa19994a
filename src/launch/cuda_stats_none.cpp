// CPU builds: no CUDA caching allocator to ask, no GPU to name or time (GPU builds: cuda_stats.cpp).
#include "mpitrain/device.h"
#include "mpitrain/error.h"
#include "mpitrain/preflight.h"

namespace mpitrain {

int64_t cuda_peak_allocated_bytes(int) { return -1; }
int64_t cuda_allocated_bytes(int) { return -1; }
int64_t cuda_total_memory_bytes(int) { return -1; }
std::string cuda_device_name(int) { return ""; }
GpuFacts gpu_facts(int) { return {}; }

// A CPU build never trains on a GPU (start-up refuses train.device: cuda), so no span is CUDA's.
struct CudaSpans {};
CudaSpans* cuda_spans_new(int) { throw Error("CUDA timing spans in a CPU build"); }
void cuda_spans_delete(CudaSpans*) {}
void cuda_spans_begin(CudaSpans&) {}
void cuda_spans_end(CudaSpans&) {}
double cuda_spans_take_seconds(CudaSpans&) { return 0; }

}  // namespace mpitrain
