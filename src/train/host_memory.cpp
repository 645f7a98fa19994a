// libtorch's CPU allocations counted (see host_memory.h).
#include "mpitrain/host_memory.h"

#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

namespace mpitrain {
namespace {

// c10::Allocator's interface changed in libtorch 2.3: allocate() lost its const, copy_data() came.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define MPITRAIN_ALLOCATOR_2_3 1
#define MPITRAIN_ALLOCATE_CONST
#else
#define MPITRAIN_ALLOCATE_CONST const
#endif

struct Live {
  size_t bytes;
  void* context;               // the wrapped allocator's context for this block
  c10::DeleterFnPtr deleter;   // and its deleter
};

struct Counts {
  std::mutex mutex;
  std::unordered_map<void*, Live> live;
  int64_t in_use = 0, peak = 0;
};

Counts& counts() {
  static Counts* c = new Counts;  // never destroyed: tensors may be freed during static destruction
  return *c;
}

// Frees a block the counter handed out (the data pointer is the key and the DataPtr's context).
void counted_delete(void* data) {
  Live l{};
  {
    Counts& c = counts();
    std::lock_guard<std::mutex> lock(c.mutex);
    auto it = c.live.find(data);
    if (it == c.live.end()) return;  // not ours: cannot happen (only our DataPtrs carry this deleter)
    l = it->second;
    c.live.erase(it);
    c.in_use -= static_cast<int64_t>(l.bytes);
  }
  if (l.deleter) l.deleter(l.context);
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) MPITRAIN_ALLOCATE_CONST override {
    c10::DataPtr block = inner_->allocate(n);
    void* data = block.get();
    if (data == nullptr) return block;  // zero bytes: nothing to count
    const c10::Device device = block.device();
    const c10::DeleterFnPtr deleter = block.get_deleter();
    void* context = block.release_context();
    {
      Counts& c = counts();
      std::lock_guard<std::mutex> lock(c.mutex);
      c.live[data] = Live{n, context, deleter};
      c.in_use += static_cast<int64_t>(n);
      c.peak = std::max(c.peak, c.in_use);
    }
    return {data, data, &counted_delete, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }

#ifdef MPITRAIN_ALLOCATOR_2_3
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#endif

 private:
  c10::Allocator* inner_;
};

std::atomic<bool> installed{false};

}  // namespace

void count_cpu_allocations() {
  static std::once_flag once;
  std::call_once(once, [] {
    static CountingAllocator counter(c10::GetCPUAllocator());
    c10::SetCPUAllocator(&counter, /*priority=*/UINT8_MAX);
    installed = true;
  });
}

bool cpu_allocations_counted() { return installed; }

int64_t cpu_allocated_bytes() {
  Counts& c = counts();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.in_use;
}

int64_t cpu_peak_allocated_bytes() {
  Counts& c = counts();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.peak;
}

void reset_cpu_peak() {
  Counts& c = counts();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.peak = c.in_use;
}

}  // namespace mpitrain
