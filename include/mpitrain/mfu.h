// How close a run comes to the hardware: model FLOPs utilisation (MFU).
//
// Model FLOPs per token of one training step (forward + backward), as in PaLM (appendix B),
// nanoGPT and llm.c:
//     6 N + 12 L d T
// N counts the parameters that take part in matrix products: all but the position embedding (the
// token embedding counts: it is also the output layer). 6 N: 2 FLOPs per multiply-add, forward
// once, backward twice. 12 L d T: attention's two T x T products (Q K^T and the weighted sum of V)
// per layer, 2 x 2 T d FLOPs per token forward, x 3 with backward, d being the attention's width
// (n_head x head_dim: n_embd but for Qwen3's wider heads); the causal mask is not
// subtracted (the usual convention). Activation recomputation is not counted: these are model
// FLOPs, not hardware FLOPs. Tensor parallelism does not change them (the same model, split).
//
// MFU = FLOPs per token x tokens/s / (ranks x peak FLOPS of one device).
#pragma once

#include <cstdint>
#include <string>

namespace mpitrain {

double model_flops_per_token(int64_t params, int64_t position_embedding_params, int64_t n_layer, int64_t attn_width,
                             int64_t seq_len);

// The dense (no sparsity) peak TFLOPS of a known NVIDIA data-centre GPU, by the name CUDA reports:
// tensor cores for bf16/fp16, the CUDA cores for fp32 (libtorch leaves TF32 off for matmuls).
// 0 when the GPU or the precision is not in the table (then log.peak_tflops gives it).
double known_peak_tflops(const std::string& gpu_name, const std::string& precision);

}  // namespace mpitrain
