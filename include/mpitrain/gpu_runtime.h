// The GPU runtime under CUDA's names, for the sources that build for NVIDIA (CUDA) and for AMD
// (ROCm: HIP) GPUs: the fused kernels, the NCCL/RCCL backend and the device statistics.
//
// HIP's runtime API is CUDA's renamed call for call, so a ROCm build (MPITRAIN_GPU_HIP: clang or
// hipcc compiling HIP, or a host source with __HIP_PLATFORM_AMD__, as MPITRAIN_ROCM sets) maps the few names mpitrain uses onto HIP's here, and the sources keep one
// spelling instead of a hipified copy each (what PyTorch's own build and hipify'd extensions
// keep). Only the names below are mapped: a new CUDA call fails to compile in the ROCm check
// (CMake's mpitrain_rocm_compile_check) until it is added here.
//
// Kernels include this with MPITRAIN_GPU_RUNTIME_DEVICE defined (the whole runtime, bf16 and fp16
// types); host sources get the runtime API only.
#pragma once

#if defined(__HIP__) || defined(__HIP_PLATFORM_AMD__)
#define MPITRAIN_GPU_HIP 1

#ifdef MPITRAIN_GPU_RUNTIME_DEVICE
#include <hip/hip_bf16.h>
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
#else
#include <hip/hip_runtime_api.h>
#endif

#define cudaDeviceGetPCIBusId hipDeviceGetPCIBusId
#define cudaDeviceProp hipDeviceProp_t
#define cudaDriverGetVersion hipDriverGetVersion
#define cudaError_t hipError_t
#define cudaEvent_t hipEvent_t
#define cudaEventCreate hipEventCreate
#define cudaEventCreateWithFlags hipEventCreateWithFlags
#define cudaEventDestroy hipEventDestroy
#define cudaEventDisableTiming hipEventDisableTiming
#define cudaEventElapsedTime hipEventElapsedTime
#define cudaEventRecord hipEventRecord
#define cudaEventSynchronize hipEventSynchronize
#define cudaGetDeviceProperties hipGetDeviceProperties
#define cudaGetErrorString hipGetErrorString
#define cudaGetLastError hipGetLastError
#define cudaMemGetInfo hipMemGetInfo
#define cudaMemsetAsync hipMemsetAsync
#define cudaRuntimeGetVersion hipRuntimeGetVersion
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaStreamWaitEvent hipStreamWaitEvent
#define cudaStream_t hipStream_t
#define cudaSuccess hipSuccess

#ifdef MPITRAIN_GPU_RUNTIME_DEVICE
using __nv_bfloat16 = __hip_bfloat16;
// HIP's __float2bfloat16 rounds to nearest even, as CUDA's __float2bfloat16_rn (ROCm 5.7 has no _rn).
#define __float2bfloat16_rn __float2bfloat16
#endif

#else  // CUDA

#ifdef MPITRAIN_GPU_RUNTIME_DEVICE
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#else
#include <cuda_runtime_api.h>
#endif

#endif
