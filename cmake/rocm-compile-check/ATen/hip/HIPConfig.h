// Stand-in for the header a ROCm build of libtorch generates from ATen/cuda/CUDAConfig.h.in
// (ATen/hip/impl/HIPGuardImplMasqueradingAsCUDA.h includes it; nothing mpitrain includes reads
// these). Used only by mpitrain_rocm_compile_check, which is never linked.
#pragma once
#define AT_CUDNN_ENABLED() 0
#define AT_CUSPARSELT_ENABLED() 0
#define AT_HIPSPARSELT_ENABLED() 0
#define AT_ROCM_ENABLED() 1
#define AT_MAGMA_ENABLED() 0
