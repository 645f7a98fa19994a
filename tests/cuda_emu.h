// A CPU emulation of the part of CUDA that src/model/kernels/fused_kernels.cu uses, so that the kernels
// (and their launchers) run on machines without a GPU: tests/test_kernels_emu.cpp compiles
// fused_kernels.cu as C++ with MPITRAIN_CUDA_EMULATION defined and this header in place of the
// CUDA runtime.
//
// Execution model: a launch runs its blocks one after another; the threads of a block are fibers
// switched at barriers (below). __syncthreads is a barrier over the block; __shfl_xor_sync is a
// barrier over the 32 lanes of a warp (linear thread id / 32, as on the hardware) with the
// values exchanged through a per-warp slot array. __shared__ variables are
// function-local statics, shared by the threads of the running block (blocks never overlap).
// bf16 and fp16 are stored as their bit patterns and converted with round-to-nearest-even, as
// __float2bfloat16_rn / __float2half_rn do.
//
// What it cannot show: timing, memory coalescing, bank conflicts, register pressure, races that
// only a GPU's scheduling exposes (threads here switch only at barriers), or nvcc's code
// generation (fused multiply-adds, fast math).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <ucontext.h>
#include <functional>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct emu_uint3 {
  unsigned x = 0, y = 0, z = 0;
};

inline thread_local emu_uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;

// ---- 16-bit float types ------------------------------------------------------------------------

struct __nv_bfloat16 {
  uint16_t bits = 0;
};
struct __half {
  uint16_t bits = 0;
};

inline float __bfloat162float(__nv_bfloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return {0x7fc0};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return {static_cast<uint16_t>(u >> 16)};
}
inline float __half2float(__half v) {
  _Float16 h;
  std::memcpy(&h, &v.bits, 2);
  return static_cast<float>(h);
}
inline __half __float2half_rn(float f) {
  const _Float16 h = static_cast<_Float16>(f);  // IEEE round to nearest even
  __half out;
  std::memcpy(&out.bits, &h, 2);
  return out;
}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// Rounded fp32 multiply and add that nvcc never contracts into a fused multiply-add; the
// emulation builds are compiled with -ffp-contract=off (tests/CMakeLists.txt), so that GCC does
// not contract them either where the target has FMA.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }

// ---- runtime API ------------------------------------------------------------------------------

using cudaStream_t = void*;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidConfiguration = 9 };
namespace cuda_emu {
inline cudaError_t& last_error() {
  static cudaError_t e = cudaSuccess;
  return e;
}
}  // namespace cuda_emu
inline cudaError_t cudaGetLastError() {
  const cudaError_t e = cuda_emu::last_error();
  cuda_emu::last_error() = cudaSuccess;
  return e;
}
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : "invalid configuration argument (emulated)";
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}

// ---- threads, barriers, warps -----------------------------------------------------------------
// The CUDA threads of a block are fibers (ucontext) on the calling thread, switched only at
// barriers: each runs until it reaches a barrier or ends, then the next one runs. Which thread
// runs when is therefore deterministic, but every thread of a warp or block really reaches a
// barrier before any passes it, so the kernels' shared-memory and shuffle exchanges are
// exercised as written.

namespace cuda_emu {

struct Fiber {
  ucontext_t ctx;
  emu_uint3 tid;
  int warp = 0, lane = 0;
  bool done = false;
};

inline thread_local ucontext_t scheduler;
inline thread_local Fiber* current = nullptr;
inline thread_local const std::function<void()>* current_body = nullptr;

inline void yield() { swapcontext(&current->ctx, &scheduler); }

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    const uint64_t gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      return;
    }
    while (gen_ == gen) yield();
  }

 private:
  int n_, count_ = 0;
  uint64_t gen_ = 0;
};

struct Warp {
  Barrier barrier{32};
  float slots[32] = {};
};

struct Block {
  explicit Block(int threads) : barrier(threads) {
    for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<Warp>());
  }
  Barrier barrier;
  std::vector<std::unique_ptr<Warp>> warps;
};

inline thread_local Block* current_block = nullptr;

inline void fiber_main() {
  (*current_body)();
  current->done = true;  // returning switches to uc_link: the scheduler
}

// getcontext returns twice: kept out of launch() so that its loop variables are not at risk.
[[gnu::noinline]] inline void start_fiber(Fiber& f, char* stack, size_t size) {
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = stack;
  f.ctx.uc_stack.ss_size = size;
  f.ctx.uc_link = &scheduler;
  makecontext(&f.ctx, fiber_main, 0);
}

// Runs body() as every thread of every block of the grid.
template <class Body>
void launch(dim3 grid, dim3 block, Body&& body) {
  const unsigned threads = block.x * block.y * block.z;
  if (threads == 0 || threads > 1024 || threads % 32 != 0 || grid.x == 0 || grid.y == 0 || grid.z == 0) {
    last_error() = cudaErrorInvalidConfiguration;  // (the kernels here always use whole warps)
    return;
  }
  constexpr size_t kStack = 64 * 1024;
  static thread_local std::vector<std::unique_ptr<char[]>> stacks;
  while (stacks.size() < threads) stacks.emplace_back(new char[kStack]);
  const std::function<void()> fn = [&] { body(); };
  std::vector<Fiber> fibers(threads);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block state(static_cast<int>(threads));
        for (unsigned t = 0; t < threads; ++t) {
          Fiber& f = fibers[t];
          f.tid = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
          f.warp = static_cast<int>(t / 32);
          f.lane = static_cast<int>(t % 32);
          f.done = false;
          start_fiber(f, stacks[t].get(), kStack);
        }
        blockIdx = {bx, by, bz};
        blockDim = block;
        gridDim = grid;
        current_block = &state;
        current_body = &fn;
        for (bool pending = true; pending;) {
          pending = false;
          for (Fiber& f : fibers) {
            if (f.done) continue;
            current = &f;
            threadIdx = f.tid;
            swapcontext(&scheduler, &f.ctx);
            pending = pending || !f.done;
          }
        }
        current_block = nullptr;  // `state` ends here
      }
  current_body = nullptr;  // and `fn` here
}

}  // namespace cuda_emu

inline void __syncthreads() { cuda_emu::current_block->barrier.wait(); }

inline float __shfl_xor_sync(unsigned /*mask: all lanes take part in these kernels*/, float v, int lane_mask) {
  cuda_emu::Warp& w = *cuda_emu::current_block->warps[cuda_emu::current->warp];
  w.slots[cuda_emu::current->lane] = v;
  w.barrier.wait();
  const float other = w.slots[cuda_emu::current->lane ^ lane_mask];
  w.barrier.wait();
  return other;
}

// kernel<<<grid, block, 0, stream>>>(args...) as the launchers write it (MPITRAIN_LAUNCH).
#define MPITRAIN_LAUNCH(kernel, grid, block, stream, ...)       \
  do {                                                            \
    (void)(stream);                                               \
    cuda_emu::launch((grid), (block), [&] { kernel(__VA_ARGS__); }); \
  } while (0)
