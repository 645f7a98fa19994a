// libtorch's GPU streams, device guard and caching allocator under one set of names for a CUDA
// and a ROCm libtorch (host sources of the GPU path: comm_nccl.cpp, cuda_stats.cpp).
//
// A ROCm PyTorch runs AMD GPUs as device type "cuda" (torch.cuda, tensor.is_cuda()) and ships c10's
// GPU classes hipified, under c10::hip. The HIP classes proper report device type HIP, so the
// ones that agree with the tensors are the "MasqueradingAsCUDA" wrappers in ATen/hip/impl: what
// PyTorch's hipify gives a C++ extension that uses c10::cuda, and what these aliases name.
#pragma once

#include "mpitrain/gpu_runtime.h"

#ifdef MPITRAIN_GPU_HIP
#include <ATen/hip/impl/HIPCachingAllocatorMasqueradingAsCUDA.h>
#include <ATen/hip/impl/HIPGuardImplMasqueradingAsCUDA.h>
#include <ATen/hip/impl/HIPStreamMasqueradingAsCUDA.h>
#else
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace mpitrain::gpu {

#ifdef MPITRAIN_GPU_HIP
using Stream = c10::hip::HIPStreamMasqueradingAsCUDA;
using DeviceGuard = c10::hip::HIPGuardMasqueradingAsCUDA;
inline Stream current_stream(c10::DeviceIndex device) { return c10::hip::getCurrentHIPStreamMasqueradingAsCUDA(device); }
inline Stream stream_from_pool(bool high_priority, c10::DeviceIndex device) {
  return c10::hip::getStreamFromPoolMasqueradingAsCUDA(high_priority, device);
}
// The allocator must not reuse the block for another stream's work before `stream`'s is done.
inline void record_stream(const c10::DataPtr& ptr, Stream stream) {
  c10::hip::HIPCachingAllocatorMasqueradingAsCUDA::recordStreamMasqueradingAsCUDA(ptr, stream);
}
inline auto allocator_stats(c10::DeviceIndex device) {
  return c10::hip::HIPCachingAllocator::getDeviceStats(device);
}
#else
using Stream = c10::cuda::CUDAStream;
using DeviceGuard = c10::cuda::CUDAGuard;
inline Stream current_stream(c10::DeviceIndex device) { return c10::cuda::getCurrentCUDAStream(device); }
inline Stream stream_from_pool(bool high_priority, c10::DeviceIndex device) {
  return c10::cuda::getStreamFromPool(high_priority, device);
}
// The allocator must not reuse the block for another stream's work before `stream`'s is done.
inline void record_stream(const c10::DataPtr& ptr, Stream stream) {
  c10::cuda::CUDACachingAllocator::recordStream(ptr, stream);
}
inline auto allocator_stats(c10::DeviceIndex device) {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(device);
}
#endif

}  // namespace mpitrain::gpu
