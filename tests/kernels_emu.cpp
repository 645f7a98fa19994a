// src/model/kernels/fused_kernels.cu compiled as C++ for CPU threads (tests/cuda_emu.h), linked into
// test_fused_emu in place of the nvcc-built kernels.
#define MPITRAIN_CUDA_EMULATION 1
#include "../src/model/kernels/fused_kernels.cu"
