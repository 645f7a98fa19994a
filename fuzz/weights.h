// What the weight-loading fuzz targets (fuzz_safetensors, fuzz_safetensors_index) share: the tiny
// GPT whose weights they write and load, and copies of a model's weights to compare.
#pragma once

#include <vector>

#include "mpitrain/model.h"

// 1 layer, 1 head, width 4, seq_len 4, vocab 8.
inline mpitrain::GPTDims tiny_dims() {
  mpitrain::GPTDims d;
  d.n_layer = 1, d.n_head = 1, d.n_embd = 4, d.seq_len = 4, d.vocab_size = 8;
  return d;
}

inline std::vector<torch::Tensor> snapshot(mpitrain::GPT& m) {
  std::vector<torch::Tensor> v;
  for (auto& [name, p] : m->named_params()) v.push_back(p.detach().clone());
  return v;
}

inline bool same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}
