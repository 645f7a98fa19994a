// CUDA kernels for the elementwise work of a GPT-2 or Llama block (see
// include/mpitrain/fused_kernels.h). They also compile as HIP for AMD GPUs (hipcc; the runtime
// names through mpitrain/gpu_runtime.h), checked by cmake/rocm-compile-check but never run there.
//
// LayerNorm or RMSNorm (with the residual add that precedes it in a pre-norm block), one kernel
// template for both (kLayer: centred, with a bias): one warp per row; the row is read once for
// the sum (LayerNorm) or the sum of squares (RMSNorm), LayerNorm's mean-centred variance is
// taken from the residual just written (L1/L2-resident), and the normalised row is written in
// the activation dtype the next matrix multiply reads, so the residual stream never goes through
// a separate add kernel, an fp32 norm output and a cast. The parameter gradients are column sums
// over all rows: a second kernel gives each block a slice of rows and every thread one column,
// and writes one partial sum per block; the caller adds the partials, so the result does not
// depend on scheduling (no atomics).
//
// SwiGLU (Llama's MLP, silu(gate) * up) and rotary embeddings (q and k, Hugging Face's
// half-split layout): elementwise, 16 bytes per load and store where the sizes and pointers allow.
// The rotary kernel rounds as the ATen ops it replaces do (see fused_kernels.h), so the fused and
// unfused attention see the same q and k.
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
#define MPITRAIN_GPU_RUNTIME_DEVICE
#include "mpitrain/gpu_runtime.h"  // CUDA, or HIP under CUDA's names (hipcc: the ROCm build)
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

// One butterfly step among kWarp lanes. AMD GPUs run 64-lane wavefronts (CDNA: MI200, MI300) or
// 32 (RDNA); HIP's __shfl_xor takes the width, so a "warp" here stays 32 lanes on both, and the
// kernels' geometry (one row per 32 lanes, kWarp-wide shared arrays) is the same as on NVIDIA.
__device__ __forceinline__ float shfl_xor(float v, int offset) {
#ifdef MPITRAIN_GPU_HIP
  return __shfl_xor(v, offset, kWarp);
#else
  return __shfl_xor_sync(0xffffffffu, v, offset);
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += shfl_xor(v, offset);
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

// kLayer: LayerNorm (mean, bias); else RMSNorm (mean taken as 0: xhat = residual * rstd).
template <bool kLayer, typename TD, typename TN>
__global__ void add_norm_forward_kernel(const float* __restrict__ x, const TD* __restrict__ delta,
                                        const float* __restrict__ gamma, const float* __restrict__ beta, float eps,
                                        float* residual, TN* __restrict__ normed, float* __restrict__ mean_out,
                                        float* __restrict__ rstd_out, int64_t rows, int cols) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerLnBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;
  const int64_t base = row * cols;
  float sum = 0.f, sq = 0.f;
  for (int c = lane; c < cols; c += kWarp) {
    float v = x[base + c];
    if (delta != nullptr) v += to_f32(delta[base + c]);
    residual[base + c] = v;
    if constexpr (kLayer) sum += v;
    else sq += v * v;
  }
  float mean = 0.f;
  if constexpr (kLayer) {
    mean = warp_sum(sum) / static_cast<float>(cols);
    for (int c = lane; c < cols; c += kWarp) {  // each lane re-reads only what it wrote
      const float d = residual[base + c] - mean;
      sq += d * d;
    }
  }
  const float rstd = rsqrtf(warp_sum(sq) / static_cast<float>(cols) + eps);
  for (int c = lane; c < cols; c += kWarp) {
    const float xhat = (residual[base + c] - mean) * rstd;
    float y = xhat * gamma[c];
    if constexpr (kLayer) y += beta[c];
    normed[base + c] = from_f32<TN>(y);
  }
  if (lane == 0) {
    if constexpr (kLayer) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// d_residual = d_out + rstd * (g - m1 - xhat * m2), g = d_normed * gamma, m1 = mean(g) (0 for
// RMSNorm, whose output does not shift with the mean), m2 = mean(g * xhat).
template <bool kLayer, typename TN, typename TD>
__global__ void add_norm_backward_kernel(const float* __restrict__ residual, const float* __restrict__ mean_in,
                                         const float* __restrict__ rstd_in, const float* __restrict__ gamma,
                                         const TN* __restrict__ d_normed, const float* __restrict__ d_out,
                                         float* __restrict__ d_x, TD* __restrict__ d_delta, int64_t rows, int cols) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerLnBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;
  const int64_t base = row * cols;
  const float mean = kLayer ? mean_in[row] : 0.f, rstd = rstd_in[row];
  float m1 = 0.f, m2 = 0.f;  // mean(dxhat), mean(dxhat * xhat)
  if (d_normed != nullptr) {
    for (int c = lane; c < cols; c += kWarp) {
      const float xhat = (residual[base + c] - mean) * rstd;
      const float g = to_f32(d_normed[base + c]) * gamma[c];
      m1 += g;
      m2 += g * xhat;
    }
    m1 = kLayer ? warp_sum(m1) / static_cast<float>(cols) : 0.f;
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

// partials[0][blockIdx.y][c] = sum of d_normed * xhat and (LayerNorm) partials[1][blockIdx.y][c]
// = sum of d_normed, over this block's rows (blockIdx.y * kColumnLanes + threadIdx.y, stride
// gridDim.y * kColumnLanes).
template <bool kLayer, typename TN>
__global__ void norm_param_grad_kernel(const float* __restrict__ residual, const float* __restrict__ mean_in,
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
      const float mean = kLayer ? mean_in[r] : 0.f;
      dg += dn * (residual[r * cols + c] - mean) * rstd_in[r];
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
    if constexpr (kLayer) partials[(blocks + blockIdx.y) * cols + c] = db;
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

// ---- SwiGLU ------------------------------------------------------------------------------------

__device__ __forceinline__ float sigmoid(float g) { return 1.f / (1.f + expf(-g)); }

// Each thread moves Packs of N elements of gate, up and out (n % N == 0).
template <typename T, int N>
__global__ void swiglu_forward_kernel(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out,
                                      int64_t packs) {
  using P = Pack<T, N>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < packs; p += step) {
    const P g = reinterpret_cast<const P*>(gate)[p], u = reinterpret_cast<const P*>(up)[p];
    P o;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float gf = to_f32(g.v[k]);
      o.v[k] = from_f32<T>(gf * sigmoid(gf) * to_f32(u.v[k]));
    }
    reinterpret_cast<P*>(out)[p] = o;
  }
}

template <typename T, int N>
__global__ void swiglu_backward_kernel(const T* __restrict__ gate, const T* __restrict__ up,
                                       const T* __restrict__ d_out, T* __restrict__ d_gate, T* __restrict__ d_up,
                                       int64_t packs) {
  using P = Pack<T, N>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < packs; p += step) {
    const P g = reinterpret_cast<const P*>(gate)[p], u = reinterpret_cast<const P*>(up)[p],
            d = reinterpret_cast<const P*>(d_out)[p];
    P dg, du;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float gf = to_f32(g.v[k]), df = to_f32(d.v[k]), s = sigmoid(gf);
      du.v[k] = from_f32<T>(df * gf * s);
      dg.v[k] = from_f32<T>(df * to_f32(u.v[k]) * s * (1.f + gf * (1.f - s)));
    }
    reinterpret_cast<P*>(d_gate)[p] = dg;
    reinterpret_cast<P*>(d_up)[p] = du;
  }
}

// ---- rotary embedding --------------------------------------------------------------------------

// v rounded to T and back (fp32: unchanged).
template <typename T>
__device__ __forceinline__ float round_to(float v) { return to_f32(from_f32<T>(v)); }

// One thread per pack of N pairs (i, i + half) of one row; half % N == 0. The products and the
// sum go through __fmul_rn / __fadd_rn, which nvcc never contracts into a fused multiply-add, so
// each is rounded as ATen's separate mul and add kernels round it.
template <bool kInverse, typename T, int N>
__global__ void rotary_kernel(const T* __restrict__ x, const float* __restrict__ cos_t,
                              const float* __restrict__ sin_t, T* __restrict__ out, int64_t rows, int64_t seq,
                              int64_t heads, int half) {
  using P = Pack<T, N>;
  const int packs_per_row = half / N;
  const int64_t packs = rows * packs_per_row;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < packs; p += step) {
    const int64_t row = p / packs_per_row;
    const int i0 = static_cast<int>(p % packs_per_row) * N;
    const int64_t t = (row / heads) % seq;
    const int64_t base = row * 2 * half + i0;
    const float* c = cos_t + t * 2 * half + i0;
    const float* s = sin_t + t * 2 * half + i0;
    const P a = *reinterpret_cast<const P*>(x + base), b = *reinterpret_cast<const P*>(x + base + half);
    P oa, ob;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float xa = to_f32(a.v[k]), xb = to_f32(b.v[k]);
      const float ca = round_to<T>(c[k]), cb = round_to<T>(c[half + k]);
      const float sa = round_to<T>(s[k]), sb = round_to<T>(s[half + k]);
      // forward: (xa, xb) -> (xa ca - xb sa, xb cb + xa sb); inverse: (xa ca + xb sb, xb cb - xa sa)
      const float pa = round_to<T>(__fmul_rn(xa, ca)), pb = round_to<T>(__fmul_rn(xb, cb));
      const float qa = round_to<T>(kInverse ? __fmul_rn(xb, sb) : -__fmul_rn(xb, sa));
      const float qb = round_to<T>(kInverse ? -__fmul_rn(xa, sa) : __fmul_rn(xa, sb));
      oa.v[k] = from_f32<T>(__fadd_rn(pa, qa));
      ob.v[k] = from_f32<T>(__fadd_rn(pb, qb));
    }
    *reinterpret_cast<P*>(out + base) = oa;
    *reinterpret_cast<P*>(out + base + half) = ob;
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
    MaxSum other{shfl_xor(acc.max, offset), shfl_xor(acc.sum, offset)};
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

int64_t norm_param_grad_blocks(int64_t rows) { return column_blocks(rows); }

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

// The kernel templates for kind: f(std::true_type) for LayerNorm, f(std::false_type) for RMSNorm.
template <typename F>
void with_norm(NormKind kind, F&& f) {
  if (kind == NormKind::layer) f(std::true_type{});
  else f(std::false_type{});
}

const char* add_norm_forward(NormKind kind, const float* x, const void* delta, DType delta_t, const float* gamma,
                             const float* beta, float eps, float* residual, void* normed, DType normed_t,
                             float* mean, float* rstd, int64_t rows, int64_t cols, void* stream) {
  if (rows == 0 || cols == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerLnBlock - 1) / kRowsPerLnBlock));
  const dim3 block(kWarp * kRowsPerLnBlock);
  with_norm(kind, [&](auto layer) {
    with_dtype(delta_t, [&](auto d) {
      using TD = decltype(d);
      with_dtype(normed_t, [&](auto n) {
        using TN = decltype(n);
        const auto kernel = add_norm_forward_kernel<decltype(layer)::value, TD, TN>;
        MPITRAIN_LAUNCH(kernel, grid, block, s, x, static_cast<const TD*>(delta), gamma, beta, eps, residual,
                        static_cast<TN*>(normed), mean, rstd, rows, static_cast<int>(cols));
      });
    });
  });
  return launch_status();
}

const char* add_norm_backward(NormKind kind, const float* residual, const float* mean, const float* rstd,
                              const float* gamma, const void* d_normed, DType normed_t, const float* d_out,
                              float* d_x, void* d_delta, DType delta_t, float* partials, int64_t rows, int64_t cols,
                              void* stream) {
  if (rows == 0 || cols == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  const int c = static_cast<int>(cols);
  const int64_t n_partials = kind == NormKind::layer ? 2 : 1;
  cudaError_t memset_status = cudaSuccess;
  with_norm(kind, [&](auto layer) {
    constexpr bool kLayer = decltype(layer)::value;
    with_dtype(normed_t, [&](auto n) {
      using TN = decltype(n);
      with_dtype(delta_t, [&](auto d) {
        using TD = decltype(d);
        const auto kernel = add_norm_backward_kernel<kLayer, TN, TD>;
        MPITRAIN_LAUNCH(kernel, dim3(static_cast<unsigned>((rows + kRowsPerLnBlock - 1) / kRowsPerLnBlock)),
                        dim3(kWarp * kRowsPerLnBlock), s, residual, mean, rstd, gamma,
                        static_cast<const TN*>(d_normed), d_out, d_x, static_cast<TD*>(d_delta), rows, c);
      });
      if (d_normed == nullptr) {
        memset_status =
            cudaMemsetAsync(partials, 0, sizeof(float) * n_partials * column_blocks(rows) * cols, s);
      } else {
        const dim3 grid(static_cast<unsigned>((cols + kWarp - 1) / kWarp),
                        static_cast<unsigned>(column_blocks(rows)));
        const auto kernel = norm_param_grad_kernel<kLayer, TN>;
        MPITRAIN_LAUNCH(kernel, grid, dim3(kWarp, kColumnLanes), s, residual, mean, rstd,
                        static_cast<const TN*>(d_normed), partials, rows, c);
      }
    });
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

namespace {

// A grid-stride launch over `packs` elements (or packs of them): at most 2^16 blocks of 256.
unsigned stride_grid(int64_t packs, unsigned block) {
  return static_cast<unsigned>(std::clamp<int64_t>((packs + block - 1) / block, 1, int64_t{1} << 16));
}

}  // namespace

const char* swiglu_forward(const void* gate, const void* up, void* out, DType t, int64_t n, void* stream) {
  if (n == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  with_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    auto launch = [&](auto width) {
      constexpr int N = decltype(width)::value;
      const auto kernel = swiglu_forward_kernel<T, N>;
      MPITRAIN_LAUNCH(kernel, stride_grid(n / N, 256), dim3(256), s, static_cast<const T*>(gate),
                      static_cast<const T*>(up), static_cast<T*>(out), n / N);
    };
    if (n % kVec == 0 && aligned16(gate) && aligned16(up) && aligned16(out))
      launch(std::integral_constant<int, kVec>{});
    else
      launch(std::integral_constant<int, 1>{});
  });
  return launch_status();
}

const char* swiglu_backward(const void* gate, const void* up, const void* d_out, void* d_gate, void* d_up, DType t,
                            int64_t n, void* stream) {
  if (n == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  with_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    auto launch = [&](auto width) {
      constexpr int N = decltype(width)::value;
      const auto kernel = swiglu_backward_kernel<T, N>;
      MPITRAIN_LAUNCH(kernel, stride_grid(n / N, 256), dim3(256), s, static_cast<const T*>(gate),
                      static_cast<const T*>(up), static_cast<const T*>(d_out), static_cast<T*>(d_gate),
                      static_cast<T*>(d_up), n / N);
    };
    if (n % kVec == 0 && aligned16(gate) && aligned16(up) && aligned16(d_out) && aligned16(d_gate) &&
        aligned16(d_up))
      launch(std::integral_constant<int, kVec>{});
    else
      launch(std::integral_constant<int, 1>{});
  });
  return launch_status();
}

const char* rotary(const void* x, const float* cos, const float* sin, void* out, DType t, bool inverse, int64_t rows,
                   int64_t seq, int64_t heads, int64_t head_dim, void* stream) {
  if (rows == 0 || head_dim == 0) return nullptr;
  if (head_dim % 2 != 0 || head_dim > INT32_MAX || seq <= 0 || heads <= 0) return "rotary: bad shape";
  auto s = static_cast<cudaStream_t>(stream);
  const int half = static_cast<int>(head_dim / 2);
  with_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    auto launch = [&](auto width, auto inv) {
      constexpr int N = decltype(width)::value;
      const auto kernel = rotary_kernel<decltype(inv)::value, T, N>;
      MPITRAIN_LAUNCH(kernel, stride_grid(rows * (half / N), 256), dim3(256), s, static_cast<const T*>(x), cos, sin,
                      static_cast<T*>(out), rows, seq, heads, half);
    };
    // Every row and both halves start 16-byte aligned when the base is and half is whole packs.
    auto with_width = [&](auto inv) {
      if (half % kVec == 0 && aligned16(x) && aligned16(out))
        launch(std::integral_constant<int, kVec>{}, inv);
      else
        launch(std::integral_constant<int, 1>{}, inv);
    };
    if (inverse)
      with_width(std::true_type{});
    else
      with_width(std::false_type{});
  });
  return launch_status();
}

}  // namespace mpitrain::kernels

// ---- sum of squares (the global gradient norm of clipping) ---------------------------------------
// Every block sums the squares of one chunk of one tensor in fp64 (each fp32 value squared exactly)
// and writes one partial; the caller adds the partials in order. So the sum reads each gradient
// once, in fp32, instead of a converted fp64 copy per parameter and three kernels each (2.7 ms of a
// GPT-2 124M step on an H100 with the clip's multiply), and it depends only on how the elements are
// split into tensors, as the per-tensor fp64 norms it replaces did.

namespace mpitrain::kernels {
namespace {

constexpr int kSquaresTensors = 48;        // tensors per launch (the batch is a kernel argument)
constexpr int kSquaresThreads = 256;
constexpr int64_t kSquaresChunk = 1 << 16;  // elements per block

struct SquaresBatch {
  const float* x[kSquaresTensors];
  int64_t numel[kSquaresTensors];
  int64_t first_chunk[kSquaresTensors + 1];  // block b serves tensor t with first_chunk[t] <= b < first_chunk[t + 1]
  int count;
};

int64_t chunks_of(int64_t numel) { return (numel + kSquaresChunk - 1) / kSquaresChunk; }

__global__ void sum_squares_kernel(SquaresBatch b, double* partials) {
  const int64_t block = blockIdx.x;
  int t = 0;
  while (t + 1 < b.count && b.first_chunk[t + 1] <= block) ++t;
  const int64_t begin = (block - b.first_chunk[t]) * kSquaresChunk;
  const int64_t end = begin + kSquaresChunk < b.numel[t] ? begin + kSquaresChunk : b.numel[t];
  double acc = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kSquaresThreads) {
    const double v = b.x[t][i];
    acc += v * v;
  }
  __shared__ double s_acc[kSquaresThreads];
  s_acc[threadIdx.x] = acc;
  __syncthreads();
  for (int width = kSquaresThreads / 2; width > 0; width /= 2) {  // a fixed tree: deterministic
    if (static_cast<int>(threadIdx.x) < width) s_acc[threadIdx.x] += s_acc[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[block] = s_acc[0];
}

}  // namespace

int64_t sum_squares_partials(const int64_t* numel, int n) {
  int64_t blocks = 0;
  for (int i = 0; i < n; ++i) blocks += chunks_of(numel[i]);
  return blocks;
}

const char* sum_squares(const float* const* x, const int64_t* numel, int n, double* partials, void* stream) {
  SquaresBatch b{};
  auto flush = [&] {
    if (b.count == 0 || b.first_chunk[b.count] == 0) return;
    MPITRAIN_LAUNCH(sum_squares_kernel, static_cast<unsigned>(b.first_chunk[b.count]), kSquaresThreads,
                    static_cast<cudaStream_t>(stream), b, partials);
    partials += b.first_chunk[b.count];
    b = SquaresBatch{};
  };
  for (int i = 0; i < n; ++i) {
    if (numel[i] == 0) continue;
    b.x[b.count] = x[i];
    b.numel[b.count] = numel[i];
    b.first_chunk[b.count + 1] = b.first_chunk[b.count] + chunks_of(numel[i]);
    ++b.count;
    if (b.count == kSquaresTensors) flush();
  }
  flush();
  return launch_status();
}

}  // namespace mpitrain::kernels
