// CUDA kernels for the elementwise work of a GPT block (see include/mpitrain/fused_kernels.h).
//
// LayerNorm (with the residual add that precedes it in a pre-LN block): one warp per row; the
// row is read once for the sum, the mean-centred variance is taken from the residual just
// written (L1/L2-resident), and the normalised row is written in the activation dtype the next
// matrix multiply reads, so the residual stream never goes through a separate add kernel, an
// fp32 LayerNorm output and a cast. The parameter gradients are column sums over all rows: a
// second kernel gives each block a slice of rows and every thread one column, and writes one
// partial sum per block; the caller adds the partials, so the result does not depend on
// scheduling (no atomics).
//
// Bias + GELU (tanh approximation): the MLP's first matrix multiply runs without its bias and
// this kernel adds it on the way into the GELU; the backward kernel computes the GELU
// derivative and the bias gradient's partial column sums in the same pass over d_out. Both read
// and write 16 bytes per thread where the width and the pointers allow it.
//
// Softmax cross-entropy (the classifier's loss, chunk by chunk, see linear_cross_entropy in
// src/model/model.cpp): one block per row of logits computes the log-sum-exp in one online pass and
// then overwrites the logits with the loss gradient in their own dtype, so a chunk costs two
// reads and one write of bf16 logits instead of an fp32 copy, a log-softmax, a softmax and
// casts.
//
// All arithmetic is fp32; inputs and outputs are converted at the loads and stores.
#include "mpitrain/fused_kernels.h"

#ifdef MPITRAIN_CUDA_EMULATION
#include "cuda_emu.h"  // tests/: the kernels on CPU threads (tests/test_kernels_emu.cpp)
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define MPITRAIN_LAUNCH(kernel, grid, block, stream, ...) kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace mpitrain::kernels {
namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerLnBlock = 8;  // warps per block in the row kernels, one row each
constexpr int kColumnLanes = 8;     // threadIdx.y extent of the column-sum kernels

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// N consecutive elements moved as one load/store (16 bytes for the vectorised paths).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

const char* launch_status() {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

int64_t column_blocks(int64_t rows) {
  // Enough blocks to fill a large GPU with the columns of a GPT layer, each covering at least
  // ~16 rows per thread at GPT-2's batch; a fixed function of `rows` so the caller can size
  // the partials buffer.
  return std::clamp<int64_t>((rows + 127) / 128, 1, 128);
}

// ---- residual add + LayerNorm ------------------------------------------------------------------

template <typename TD, typename TN>
__global__ void add_layernorm_forward_kernel(const float* __restrict__ x, const TD* __restrict__ delta,
                                             const float* __restrict__ gamma, const float* __restrict__ beta,
                                             float eps, float* residual, TN* __restrict__ normed,
                                             float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                             int64_t rows, int cols) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerLnBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;
  const int64_t base = row * cols;
  float sum = 0.f;
  for (int c = lane; c < cols; c += kWarp) {
    float v = x[base + c];
    if (delta != nullptr) v += to_f32(delta[base + c]);
    residual[base + c] = v;
    sum += v;
  }
  const float mean = warp_sum(sum) / static_cast<float>(cols);
  float sq = 0.f;
  for (int c = lane; c < cols; c += kWarp) {  // each lane re-reads only what it wrote
    const float d = residual[base + c] - mean;
    sq += d * d;
  }
  const float rstd = rsqrtf(warp_sum(sq) / static_cast<float>(cols) + eps);
  for (int c = lane; c < cols; c += kWarp) {
    const float xhat = (residual[base + c] - mean) * rstd;
    normed[base + c] = from_f32<TN>(xhat * gamma[c] + beta[c]);
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

template <typename TN, typename TD>
__global__ void add_layernorm_backward_kernel(const float* __restrict__ residual, const float* __restrict__ mean_in,
                                              const float* __restrict__ rstd_in, const float* __restrict__ gamma,
                                              const TN* __restrict__ d_normed, const float* __restrict__ d_out,
                                              float* __restrict__ d_x, TD* __restrict__ d_delta, int64_t rows,
                                              int cols) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerLnBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;
  const int64_t base = row * cols;
  const float mean = mean_in[row], rstd = rstd_in[row];
  float m1 = 0.f, m2 = 0.f;  // mean(dxhat), mean(dxhat * xhat)
  if (d_normed != nullptr) {
    for (int c = lane; c < cols; c += kWarp) {
      const float xhat = (residual[base + c] - mean) * rstd;
      const float g = to_f32(d_normed[base + c]) * gamma[c];
      m1 += g;
      m2 += g * xhat;
    }
    m1 = warp_sum(m1) / static_cast<float>(cols);
    m2 = warp_sum(m2) / static_cast<float>(cols);
  }
  for (int c = lane; c < cols; c += kWarp) {
    float v = d_out != nullptr ? d_out[base + c] : 0.f;
    if (d_normed != nullptr) {
      const float xhat = (residual[base + c] - mean) * rstd;
      const float g = to_f32(d_normed[base + c]) * gamma[c];
      v += rstd * (g - m1 - xhat * m2);
    }
    d_x[base + c] = v;
    if (d_delta != nullptr) d_delta[base + c] = from_f32<TD>(v);
  }
}

// partials[0][blockIdx.y][c] = sum of d_normed * xhat, partials[1][blockIdx.y][c] = sum of
// d_normed, over this block's rows (blockIdx.y * kColumnLanes + threadIdx.y, stride
// gridDim.y * kColumnLanes).
template <typename TN>
__global__ void layernorm_param_grad_kernel(const float* __restrict__ residual, const float* __restrict__ mean_in,
                                            const float* __restrict__ rstd_in, const TN* __restrict__ d_normed,
                                            float* __restrict__ partials, int64_t rows, int cols) {
  __shared__ float s_gamma[kColumnLanes][kWarp];
  __shared__ float s_beta[kColumnLanes][kWarp];
  const int c = blockIdx.x * kWarp + threadIdx.x;
  float dg = 0.f, db = 0.f;
  if (c < cols) {
    const int64_t stride = static_cast<int64_t>(gridDim.y) * kColumnLanes;
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * kColumnLanes + threadIdx.y; r < rows; r += stride) {
      const float dn = to_f32(d_normed[r * cols + c]);
      dg += dn * (residual[r * cols + c] - mean_in[r]) * rstd_in[r];
      db += dn;
    }
  }
  s_gamma[threadIdx.y][threadIdx.x] = dg;
  s_beta[threadIdx.y][threadIdx.x] = db;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    for (int k = 1; k < kColumnLanes; ++k) {
      dg += s_gamma[k][threadIdx.x];
      db += s_beta[k][threadIdx.x];
    }
    const int64_t blocks = gridDim.y;
    partials[static_cast<int64_t>(blockIdx.y) * cols + c] = dg;
    partials[(blocks + blockIdx.y) * cols + c] = db;
  }
}

// ---- bias + GELU -------------------------------------------------------------------------------

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

__device__ __forceinline__ float gelu_tanh(float u) {
  const float t = tanhf(kSqrt2OverPi * (u + kGeluCubic * u * u * u));
  return 0.5f * u * (1.f + t);
}

__device__ __forceinline__ float gelu_tanh_grad(float u) {
  const float t = tanhf(kSqrt2OverPi * (u + kGeluCubic * u * u * u));
  return 0.5f * (1.f + t) + 0.5f * u * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kGeluCubic * u * u);
}

// Each thread moves one Pack of N elements; cols % N == 0, so a pack never crosses a row.
template <typename T, int N>
__global__ void bias_gelu_forward_kernel(const T* __restrict__ pre, const float* __restrict__ bias, T* __restrict__ out,
                                         int64_t packs, int cols) {
  using P = Pack<T, N>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < packs; p += step) {
    const P in = reinterpret_cast<const P*>(pre)[p];
    const int c0 = static_cast<int>((p * N) % cols);
    P o;
#pragma unroll
    for (int k = 0; k < N; ++k) o.v[k] = from_f32<T>(gelu_tanh(to_f32(in.v[k]) + bias[c0 + k]));
    reinterpret_cast<P*>(out)[p] = o;
  }
}

// blockIdx.x * kWarp + threadIdx.x: the pack of columns; rows blockIdx.y * kColumnLanes +
// threadIdx.y, stride gridDim.y * kColumnLanes. partials[blockIdx.y][c]: column sums of d_pre.
template <typename T, int N>
__global__ void bias_gelu_backward_kernel(const T* __restrict__ pre, const float* __restrict__ bias,
                                          const T* __restrict__ d_out, T* __restrict__ d_pre,
                                          float* __restrict__ partials, int64_t rows, int cols) {
  using P = Pack<T, N>;
  __shared__ float s_sum[kColumnLanes][kWarp * N];
  const int packs_per_row = cols / N;
  const int cp = blockIdx.x * kWarp + threadIdx.x;
  float acc[N];
#pragma unroll
  for (int k = 0; k < N; ++k) acc[k] = 0.f;
  if (cp < packs_per_row) {
    float b[N];
#pragma unroll
    for (int k = 0; k < N; ++k) b[k] = bias[cp * N + k];
    const int64_t stride = static_cast<int64_t>(gridDim.y) * kColumnLanes;
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * kColumnLanes + threadIdx.y; r < rows; r += stride) {
      const int64_t p = r * packs_per_row + cp;
      const P u = reinterpret_cast<const P*>(pre)[p];
      const P g = reinterpret_cast<const P*>(d_out)[p];
      P o;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float d = to_f32(g.v[k]) * gelu_tanh_grad(to_f32(u.v[k]) + b[k]);
        o.v[k] = from_f32<T>(d);
        acc[k] += d;
      }
      reinterpret_cast<P*>(d_pre)[p] = o;
    }
  }
#pragma unroll
  for (int k = 0; k < N; ++k) s_sum[threadIdx.y][threadIdx.x * N + k] = acc[k];
  __syncthreads();
  if (threadIdx.y == 0 && cp < packs_per_row) {
    for (int lane = 1; lane < kColumnLanes; ++lane)
#pragma unroll
      for (int k = 0; k < N; ++k) acc[k] += s_sum[lane][threadIdx.x * N + k];
#pragma unroll
    for (int k = 0; k < N; ++k) partials[static_cast<int64_t>(blockIdx.y) * cols + cp * N + k] = acc[k];
  }
}

// ---- softmax cross-entropy over one chunk of logits, gradient in place ---------------------------

struct MaxSum {  // a running max and the sum of exp(x - max) (online softmax)
  float max, sum;
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  if (a.max == -INFINITY) return b;
  if (b.max == -INFINITY) return a;
  const float m = fmaxf(a.max, b.max);
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

__device__ __forceinline__ MaxSum add_value(MaxSum a, float v) {
  if (v <= a.max) return {a.max, a.sum + expf(v - a.max)};
  return {v, a.sum * expf(a.max - v) + 1.f};  // also right for the initial max = -inf (sum 0)
}

// One block per row of `cols` logits. Pass 1 reads the row once for its log-sum-exp; the loss
// lse - x[target] is stored; pass 2 (with_grad) overwrites the row with
// scale * (softmax - onehot(target)), the gradient of scale * loss.
template <typename T, int N>
__global__ void softmax_xent_kernel(T* __restrict__ logits, const int64_t* __restrict__ targets,
                                    float* __restrict__ loss, int cols, float scale, bool with_grad) {
  using P = Pack<T, N>;
  __shared__ MaxSum s_part[32];
  __shared__ float s_lse;
  T* row = logits + static_cast<int64_t>(blockIdx.x) * cols;
  P* packs = reinterpret_cast<P*>(row);
  const int n_packs = cols / N;
  MaxSum acc{-INFINITY, 0.f};
  for (int p = threadIdx.x; p < n_packs; p += blockDim.x) {
    const P v = packs[p];
#pragma unroll
    for (int k = 0; k < N; ++k) acc = add_value(acc, to_f32(v.v[k]));
  }
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, acc.max, offset), __shfl_xor_sync(0xffffffffu, acc.sum, offset)};
    acc = combine(acc, other);
  }
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) s_part[warp] = acc;
  __syncthreads();
  const int64_t target = targets[blockIdx.x];
  const bool valid = target >= 0 && target < cols;
  if (threadIdx.x == 0) {
    MaxSum all{-INFINITY, 0.f};
    for (int w = 0; w < static_cast<int>(blockDim.x / kWarp); ++w) all = combine(all, s_part[w]);
    const float lse = all.max + logf(all.sum);
    s_lse = lse;
    loss[blockIdx.x] = valid ? lse - to_f32(row[target]) : NAN;  // read before pass 2 overwrites it
  }
  __syncthreads();
  if (!with_grad) return;
  const float lse = s_lse;
  for (int p = threadIdx.x; p < n_packs; p += blockDim.x) {
    P v = packs[p];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const int col = p * N + k;
      const float g = expf(to_f32(v.v[k]) - lse) - (valid && col == target ? 1.f : 0.f);
      v.v[k] = from_f32<T>(g * scale);
    }
    packs[p] = v;
  }
}

// ---- dtype dispatch ----------------------------------------------------------------------------

template <typename F>
void with_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: f(float{}); break;
    case DType::bf16: f(__nv_bfloat16{}); break;
    case DType::f16: f(__half{}); break;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

int64_t layernorm_param_grad_blocks(int64_t rows) { return column_blocks(rows); }

const char* softmax_cross_entropy(void* logits, DType t, const int64_t* targets, float* loss, float scale,
                                  bool with_grad, int64_t rows, int64_t cols, void* stream) {
  if (rows == 0 || cols == 0) return nullptr;
  if (rows > INT32_MAX || cols > INT32_MAX) return "softmax_cross_entropy: rows or cols over 2^31";
  auto s = static_cast<cudaStream_t>(stream);
  with_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    auto launch = [&](auto width) {
      constexpr int N = decltype(width)::value;
      const auto kernel = softmax_xent_kernel<T, N>;
      MPITRAIN_LAUNCH(kernel, dim3(static_cast<unsigned>(rows)), dim3(512), s, static_cast<T*>(logits), targets,
                      loss, static_cast<int>(cols), scale, with_grad);
    };
    // Every row starts 16-byte aligned when the base is and a row is a whole number of packs.
    if (cols % kVec == 0 && aligned16(logits))
      launch(std::integral_constant<int, kVec>{});
    else
      launch(std::integral_constant<int, 1>{});
  });
  return launch_status();
}
int64_t bias_gelu_grad_blocks(int64_t rows) { return column_blocks(rows); }

const char* add_layernorm_forward(const float* x, const void* delta, DType delta_t, const float* gamma,
                                  const float* beta, float eps, float* residual, void* normed, DType normed_t,
                                  float* mean, float* rstd, int64_t rows, int64_t cols, void* stream) {
  if (rows == 0 || cols == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerLnBlock - 1) / kRowsPerLnBlock));
  const dim3 block(kWarp * kRowsPerLnBlock);
  with_dtype(delta_t, [&](auto d) {
    using TD = decltype(d);
    with_dtype(normed_t, [&](auto n) {
      using TN = decltype(n);
      const auto kernel = add_layernorm_forward_kernel<TD, TN>;
      MPITRAIN_LAUNCH(kernel, grid, block, s, x, static_cast<const TD*>(delta), gamma, beta, eps, residual,
                      static_cast<TN*>(normed), mean, rstd, rows, static_cast<int>(cols));
    });
  });
  return launch_status();
}

const char* add_layernorm_backward(const float* residual, const float* mean, const float* rstd, const float* gamma,
                                   const void* d_normed, DType normed_t, const float* d_out, float* d_x,
                                   void* d_delta, DType delta_t, float* partials, int64_t rows, int64_t cols,
                                   void* stream) {
  if (rows == 0 || cols == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  const int c = static_cast<int>(cols);
  cudaError_t memset_status = cudaSuccess;
  with_dtype(normed_t, [&](auto n) {
    using TN = decltype(n);
    with_dtype(delta_t, [&](auto d) {
      using TD = decltype(d);
      const auto kernel = add_layernorm_backward_kernel<TN, TD>;
      MPITRAIN_LAUNCH(kernel, dim3(static_cast<unsigned>((rows + kRowsPerLnBlock - 1) / kRowsPerLnBlock)),
                      dim3(kWarp * kRowsPerLnBlock), s, residual, mean, rstd, gamma,
                      static_cast<const TN*>(d_normed), d_out, d_x, static_cast<TD*>(d_delta), rows, c);
    });
    if (d_normed == nullptr) {
      memset_status = cudaMemsetAsync(partials, 0, sizeof(float) * 2 * column_blocks(rows) * cols, s);
    } else {
      const dim3 grid(static_cast<unsigned>((cols + kWarp - 1) / kWarp), static_cast<unsigned>(column_blocks(rows)));
      const auto kernel = layernorm_param_grad_kernel<TN>;
      MPITRAIN_LAUNCH(kernel, grid, dim3(kWarp, kColumnLanes), s, residual, mean, rstd,
                      static_cast<const TN*>(d_normed), partials, rows, c);
    }
  });
  if (memset_status != cudaSuccess) return cudaGetErrorString(memset_status);
  return launch_status();
}

const char* bias_gelu_forward(const void* pre, const float* bias, void* out, DType t, int64_t rows, int64_t cols,
                              void* stream) {
  if (rows == 0 || cols == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  with_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const int64_t n = rows * cols;
    const unsigned block = 256;
    auto launch = [&](auto width) {
      constexpr int N = decltype(width)::value;
      const int64_t packs = n / N;
      const auto grid = static_cast<unsigned>(std::min<int64_t>((packs + block - 1) / block, int64_t{1} << 16));
      const auto kernel = bias_gelu_forward_kernel<T, N>;
      MPITRAIN_LAUNCH(kernel, grid, block, s, static_cast<const T*>(pre), bias, static_cast<T*>(out), packs,
                      static_cast<int>(cols));
    };
    if (cols % kVec == 0 && aligned16(pre) && aligned16(out))
      launch(std::integral_constant<int, kVec>{});
    else
      launch(std::integral_constant<int, 1>{});
  });
  return launch_status();
}

const char* bias_gelu_backward(const void* pre, const float* bias, const void* d_out, void* d_pre, DType t,
                               float* partials, int64_t rows, int64_t cols, void* stream) {
  if (rows == 0 || cols == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  with_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    auto launch = [&](auto width) {
      constexpr int N = decltype(width)::value;
      const int64_t packs_per_row = cols / N;
      const dim3 grid(static_cast<unsigned>((packs_per_row + kWarp - 1) / kWarp),
                      static_cast<unsigned>(column_blocks(rows)));
      const auto kernel = bias_gelu_backward_kernel<T, N>;
      MPITRAIN_LAUNCH(kernel, grid, dim3(kWarp, kColumnLanes), s, static_cast<const T*>(pre), bias,
                      static_cast<const T*>(d_out), static_cast<T*>(d_pre), partials, rows, static_cast<int>(cols));
    };
    if (cols % kVec == 0 && aligned16(pre) && aligned16(d_out) && aligned16(d_pre))
      launch(std::integral_constant<int, kVec>{});
    else
      launch(std::integral_constant<int, 1>{});
  });
  return launch_status();
}

}  // namespace mpitrain::kernels
