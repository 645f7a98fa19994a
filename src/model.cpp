// GPT-2 in libtorch (see model.h). Attention uses the fused scaled_dot_product_attention when
// libtorch >= 2.0 and an explicit masked softmax on older libtorch (Debian's 1.13).
#include "mpitrain/model.h"

#include <cmath>

#include "mpitrain/error.h"

namespace mpitrain {

namespace F = torch::nn::functional;

GPTDims model_dims(const ModelConfig& cfg, int64_t data_vocab_size) {
  GPTDims d;
  d.n_layer = cfg.n_layer;
  d.n_head = cfg.n_head;
  d.n_embd = cfg.n_embd;
  d.seq_len = cfg.seq_len;
  d.dropout = cfg.dropout;
  d.vocab_size = cfg.vocab_size > 0 ? cfg.vocab_size : data_vocab_size;
  if (d.vocab_size < data_vocab_size)
    throw UsageError(concat("model.vocab_size must be >= the data's vocab_size ", data_vocab_size,
                         ", got ", d.vocab_size));
  return d;
}

// ---- attention ---------------------------------------------------------------------------------

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTDims& d)
    : n_head_(d.n_head), n_embd_(d.n_embd), dropout_(d.dropout) {
  c_attn = register_module("c_attn", torch::nn::Linear(d.n_embd, 3 * d.n_embd));
  c_proj = register_module("c_proj", torch::nn::Linear(d.n_embd, d.n_embd));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / n_head_;
  auto qkv = c_attn(x).split(n_embd_, /*dim=*/2);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, n_head_, hd}).transpose(1, 2); };
  torch::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  const double p = is_training() ? dropout_ : 0.0;
  torch::Tensor y;
#if TORCH_VERSION_MAJOR >= 2
  y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, p, /*is_causal=*/true);
#else
  if (!causal_mask_.defined() || causal_mask_.size(0) < T || causal_mask_.device() != x.device())
    causal_mask_ = torch::ones({T, T}, torch::dtype(torch::kBool).device(x.device())).triu(1);
  auto mask = causal_mask_.index({torch::indexing::Slice(0, T), torch::indexing::Slice(0, T)});
  auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  att = att.masked_fill(mask, -std::numeric_limits<float>::infinity()).softmax(-1);
  if (p > 0) att = F::dropout(att, F::DropoutFuncOptions().p(p).training(true));
  y = torch::matmul(att, v);
#endif
  y = y.transpose(1, 2).contiguous().view({B, T, C});
  y = c_proj(y);
  if (p > 0) y = F::dropout(y, F::DropoutFuncOptions().p(p).training(true));
  return y;
}

// ---- MLP and block -----------------------------------------------------------------------------

MLPImpl::MLPImpl(const GPTDims& d) {
  c_fc = register_module("c_fc", torch::nn::Linear(d.n_embd, 4 * d.n_embd));
  c_proj = register_module("c_proj", torch::nn::Linear(4 * d.n_embd, d.n_embd));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  return c_proj(F::gelu(c_fc(x), F::GELUFuncOptions().approximate("tanh")));
}

BlockImpl::BlockImpl(const GPTDims& d) : dropout_(d.dropout) {
  ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d.n_embd})));
  attn = register_module("attn", CausalSelfAttention(d));
  ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d.n_embd})));
  mlp = register_module("mlp", MLP(d));
}

torch::Tensor BlockImpl::forward(torch::Tensor x) {
  x = x + attn(ln_1(x));
  auto m = mlp(ln_2(x));
  if (is_training() && dropout_ > 0)
    m = F::dropout(m, F::DropoutFuncOptions().p(dropout_).training(true));
  return x + m;
}

// ---- GPT ---------------------------------------------------------------------------------------

GPTImpl::GPTImpl(const GPTDims& d) : dims_(d) {
  wte = register_module("wte", torch::nn::Embedding(d.vocab_size, d.n_embd));
  wpe = register_module("wpe", torch::nn::Embedding(d.seq_len, d.n_embd));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < d.n_layer; ++i) h->push_back(Block(d));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d.n_embd})));

  // GPT-2 initialisation. The residual projections (attn.c_proj, mlp.c_proj) add into the
  // residual stream once per layer each, so their std shrinks with depth to keep it bounded.
  torch::NoGradGuard no_grad;
  const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(d.n_layer));
  for (auto& [name, p] : named_params()) {
    const bool is_weight = name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0;
    const bool is_norm = name.find("ln_") != std::string::npos;
    if (is_norm) {
      is_weight ? p.fill_(1.0) : p.zero_();
    } else if (is_weight) {
      const bool residual = name.find("c_proj.weight") != std::string::npos;
      p.normal_(0.0, residual ? proj_std : 0.02);
    } else {
      p.zero_();
    }
  }
}

torch::Tensor GPTImpl::hidden(const torch::Tensor& idx) {
  const int64_t T = idx.size(1);
  MPITRAIN_CHECK(T <= dims_.seq_len, concat("sequence of ", T, " tokens exceeds seq_len ", dims_.seq_len));
  auto pos = torch::arange(T, torch::dtype(torch::kLong).device(idx.device()));
  torch::Tensor x = wte(idx) + wpe(pos);
  if (is_training() && dims_.dropout > 0)
    x = F::dropout(x, F::DropoutFuncOptions().p(dims_.dropout).training(true));
  for (const auto& block : *h) x = block->as<Block>()->forward(x);
  return ln_f(x);
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx) {
  return F::linear(hidden(idx), wte->weight);  // output layer tied to the token embedding
}

torch::Tensor GPTImpl::loss(const torch::Tensor& idx, const torch::Tensor& targets) {
  auto logits = forward(idx);
  return F::cross_entropy(logits.view({-1, logits.size(-1)}).to(torch::kFloat32),
                          targets.reshape({-1}));
}

std::vector<std::pair<std::string, torch::Tensor>> GPTImpl::named_params() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : named_parameters(/*recurse=*/true)) out.emplace_back(item.key(), item.value());
  return out;
}

int64_t GPTImpl::num_params() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

}  // namespace mpitrain
