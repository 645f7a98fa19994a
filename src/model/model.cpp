// GPT-2 and Llama in libtorch (see model.h). Attention uses the fused scaled_dot_product_attention
// when libtorch >= 2.0 and an explicit masked softmax on older libtorch (Debian's 1.13).
#include "mpitrain/model.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "mpitrain/amp.h"
#include "mpitrain/checkpointing.h"
#include "mpitrain/comm.h"
#include "mpitrain/error.h"
#include "mpitrain/fused_ops.h"
#include "mpitrain/libtorch_version.h"
#include "mpitrain/tensor_parallel.h"

namespace mpitrain {

namespace F = torch::nn::functional;

int64_t block_of(const std::string& name) {
  if (name.rfind("h.", 0) != 0) return -1;
  return std::stoll(name.substr(2, name.find('.', 2) - 2));
}

int64_t vocab_pad_multiple(const ModelConfig& cfg, bool cuda, int64_t tp) {
  return (cfg.vocab_multiple > 0 ? cfg.vocab_multiple : cuda ? 64 : 1) * tp;
}

GPTDims model_dims(const ModelConfig& cfg, int64_t data_vocab_size, int64_t pad_multiple) {
  GPTDims d = dims_of_config(cfg);  // the architecture (model_fields.h)
  if (cfg.init_vocab > 0 && cfg.init_vocab < data_vocab_size)
    throw UsageError(concat("model.init_from: ", cfg.init_vocab_source, " is ", cfg.init_vocab,
                            ", smaller than the data's vocab_size ", data_vocab_size,
                            " (the weights have no row for the data's larger token ids)"));
  if (cfg.vocab_size > 0) {
    d.vocab_size = cfg.vocab_size;
  } else {
    // Automatic padding of the classes: the initial weights' (model.init_from: hf:), else the data's.
    MPITRAIN_CHECK(pad_multiple >= 1, "model_dims: the padding multiple must be >= 1");
    const int64_t classes = cfg.init_vocab > 0 ? cfg.init_vocab : data_vocab_size;
    d.vocab_size = (classes + pad_multiple - 1) / pad_multiple * pad_multiple;
    if (d.vocab_size > classes) d.vocab_live = classes;
  }
  if (d.vocab_size < data_vocab_size)
    throw UsageError(concat("model.vocab_size must be >= the data's vocab_size ", data_vocab_size,
                         ", got ", d.vocab_size));
  return d;
}

// ---- attention ---------------------------------------------------------------------------------

namespace {

// Tensor parallel: the input of a column-parallel layer (its gradient summed over the tp group)
// and the output of a row-parallel one (its partial sums summed, then the replicated bias added
// once). Without tp, the layer as it is.
torch::Tensor column_input(const torch::Tensor& x, Communicator* tp) { return tp ? tp_copy(x, *tp) : x; }

// A linear layer through ATen's linear, not libtorch's C++ functional one: that one computes a
// batched [B, T, C] input as matmul, then the bias as a separate broadcast add (one more pass over
// the output: 3.3 ms of a GPT-2 124M step on an H100, bench/RESULTS.md); ATen's folds B and T and
// calls addmm, whose GEMM adds the bias (on CUDA, cuBLASLt's bias epilogue), as PyTorch's
// nn.Linear does.
// Each block's linear layer goes through tape_linear: selective checkpointing keeps its output.
torch::Tensor apply_linear(const torch::nn::Linear& layer, const torch::Tensor& x) {
  return tape_linear(x, layer->weight, layer->bias, [&] {
    return at::linear(x, layer->weight, layer->bias.defined() ? c10::optional<torch::Tensor>(layer->bias) : c10::nullopt);
  });
}

// Tensor parallel: the product summed over the group is what selective checkpointing keeps (the
// sum's backward is the identity), so its second run makes no collective call here.
torch::Tensor row_parallel(const torch::Tensor& x, torch::nn::Linear& layer, Communicator* tp) {
  if (!tp) return apply_linear(layer, x);
  torch::Tensor y = tape_linear(x, layer->weight, torch::Tensor(), [&] { return tp_reduce(F::linear(x, layer->weight), *tp); });
  return layer->bias.defined() ? y + layer->bias : y;
}

torch::nn::Linear linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

}  // namespace

// ---- norm and rotary positions --------------------------------------------------------------

NormImpl::NormImpl(int64_t dim, bool rms_, double eps_, Communicator* partial_grad, bool unit_offset_)
    : rms(rms_), eps(eps_), unit_offset(unit_offset_), partial_grad_(partial_grad) {
  weight = register_parameter("weight", unit_offset ? torch::zeros({dim}) : torch::ones({dim}));
  if (!rms) bias = register_parameter("bias", torch::zeros({dim}));
}

torch::Tensor NormImpl::forward(const torch::Tensor& x) {
  if (!rms) return F::layer_norm(x, F::LayerNormFuncOptions({weight.size(0)}).weight(weight).bias(bias).eps(eps));
  torch::Tensor h = x.to(torch::kFloat32);
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  const torch::Tensor w = partial_grad_ ? tp_copy(weight, *partial_grad_) : weight;
  if (unit_offset) return (h * (w.to(torch::kFloat32) + 1.0)).to(x.scalar_type());  // Gemma's: in fp32, then cast
  return w * h.to(x.scalar_type());
}

std::pair<torch::Tensor, torch::Tensor> NormImpl::add_forward(const torch::Tensor& x, const torch::Tensor& delta,
                                                              c10::ScalarType out_dtype) {
  MPITRAIN_CHECK(!unit_offset, "the fused norms have no x (1 + w) form (Gemma's norms run unfused)");
  if (rms) return add_rmsnorm(x, delta, weight, eps, out_dtype);
  return add_layernorm(x, delta, weight, bias, eps, out_dtype);
}

// Hugging Face's rotary frequencies, in fp32 as there: inv_freq_i = theta^(-2i / head_dim), and
// for rope_scaling llama3 (Llama 3.1) wavelengths longer than original_max_position /
// low_freq_factor divided by factor, shorter than original_max_position / high_freq_factor kept,
// and those between interpolated smoothly.
// Gemma 3's local layers (`local`): rope_local_theta, unscaled; its global layers: rope_theta with
// rope_scaling linear, every frequency divided by rope_factor.
Rotary::Rotary(const GPTDims& d, bool local) : seq_len_(d.seq_len) {
  const int64_t dim = d.head_dim();
  const double theta = local && d.rope_local_theta > 0 ? d.rope_local_theta : d.rope_theta;
  inv_freq_ = 1.0 / torch::pow(torch::tensor(theta, torch::kFloat32),
                               torch::arange(0, dim, 2, torch::kInt64).to(torch::kFloat32) / static_cast<double>(dim));
  if (local) return;
  if (d.rope_scaling == "linear") inv_freq_ = inv_freq_ / d.rope_factor;
  if (d.rope_scaling == "llama3") {
    const double factor = d.rope_factor, low = d.rope_low_freq_factor, high = d.rope_high_freq_factor;
    const double old_len = static_cast<double>(d.rope_original_max_position);
    const double low_freq_wavelen = old_len / low, high_freq_wavelen = old_len / high;
    torch::Tensor wavelen = 2 * M_PI / inv_freq_;
    torch::Tensor scaled = torch::where(wavelen > low_freq_wavelen, inv_freq_ / factor, inv_freq_);
    torch::Tensor smooth = (old_len / wavelen - low) / (high - low);
    torch::Tensor smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
    torch::Tensor medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
    inv_freq_ = torch::where(medium, smoothed, scaled);
  }
}

torch::Tensor Rotary::apply(const torch::Tensor& x) {
  const int64_t T = x.size(1), D = x.size(3), half = D / 2;
  if (!cos_.defined() || cos_.device() != x.device()) {
    torch::Tensor pos = torch::arange(seq_len_, torch::kInt64).to(torch::kFloat32);
    torch::Tensor freqs = pos.unsqueeze(1).matmul(inv_freq_.unsqueeze(0));  // [seq_len, head_dim / 2]
    torch::Tensor emb = torch::cat({freqs, freqs}, -1);
    cos_ = emb.cos().to(x.device());
    sin_ = emb.sin().to(x.device());
  }
  if (fused_) return rotary(x, cos_, sin_);  // fused_ops.h: the same roundings, a hand-written backward
  // Hugging Face's: the tables in x's dtype, every op rounded to it.
  torch::Tensor cos = cos_.narrow(0, 0, T).to(x.scalar_type()).view({T, 1, D});
  torch::Tensor sin = sin_.narrow(0, 0, T).to(x.scalar_type()).view({T, 1, D});
  torch::Tensor rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

// ---- attention ---------------------------------------------------------------------------------

namespace {
// [T, T], true where query i may see key j: j <= i and, with a window, i - j < window.
torch::Tensor window_mask(int64_t T, int64_t window, const torch::Device& device) {
  const auto opts = torch::dtype(torch::kLong).device(device);
  const torch::Tensor i = torch::arange(T, opts).unsqueeze(1), j = torch::arange(T, opts).unsqueeze(0);
  torch::Tensor seen = j <= i;
  return window > 0 ? seen.logical_and(i - j < window) : seen;
}
}  // namespace

// Made whole; tensor parallel (parallelize): this rank holds n_head / tp query heads and n_kv_head
// / tp key/value heads (c_attn: 3 E / tp rows; q/k/v_proj: their heads' rows), c_proj their input
// columns and the whole bias (gpt2).
// Gemma's attention scores are computed as Hugging Face's eager attention computes them (capped_core),
// whatever their cap and scale, so that the two agree to the rounding.
CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTDims& d, std::shared_ptr<Rotary> rotary, int64_t layer)
    : n_head_(d.n_head),
      n_kv_head_(d.n_kv_head),
      head_dim_(d.head_dim()),
      dropout_(d.dropout),
      window_(d.window_of_layer(layer)),
      softcap_(d.attn_softcap),
      scale_(d.query_pre_attn_scalar > 0 ? 1.0 / std::sqrt(d.query_pre_attn_scalar)
             : d.family_row().gemma_norms ? 1.0 / std::sqrt(static_cast<double>(d.head_dim()))
                                                       : 0.0),
      rotary_(std::move(rotary)) {
  const int64_t q_width = n_head_ * head_dim_, kv_width = n_kv_head_ * head_dim_;
  if (d.llama()) {
    q_proj = register_module("q_proj", linear(d.n_embd, q_width, d.qkv_bias));
    k_proj = register_module("k_proj", linear(d.n_embd, kv_width, d.qkv_bias));
    v_proj = register_module("v_proj", linear(d.n_embd, kv_width, d.qkv_bias));
  } else {
    c_attn = register_module("c_attn", linear(d.n_embd, 3 * q_width, true));
  }
  c_proj = register_module("c_proj", linear(q_width, d.n_embd, !d.llama()));
  if (d.llama() && d.qk_norm) {  // after o_proj, as in Hugging Face's Qwen3Attention
    const bool gemma = d.family_row().gemma_norms;
    // OLMoE: over the whole projections (its experts refuse tp, whose shards would each see part)
    whole_qk_norm_ = d.family_row().qk_norm_whole;
    q_norm = register_module("q_norm", Norm(whole_qk_norm_ ? q_width : head_dim_, true, d.norm_eps, nullptr, gemma));
    k_norm = register_module("k_norm", Norm(whole_qk_norm_ ? kv_width : head_dim_, true, d.norm_eps, nullptr, gemma));
  }
  // Column-parallel by whole heads: [q; k; v] each in tp blocks (gpt2), or q and k/v (llama); the
  // output projection row-parallel (its input columns; its bias whole).
  if (d.llama())
    for (const char* m : {"q_proj", "k_proj", "v_proj"}) tp_declare(m, TpSplit::rows);
  else
    tp_declare("c_attn", TpSplit::qkv_rows);
  tp_declare("c_proj.weight", TpSplit::cols);
}

void CausalSelfAttentionImpl::parallelize(const TpPlace& tp) {
  // (OLMoE's whole-projection norms: the config refuses tp for them, args_conflict.)
  MPITRAIN_CHECK(!whole_qk_norm_ || !tp.sharded(), "tensor parallel: q/k norms over the whole projections");
  tp_ = tp.sharded() ? tp.comm : nullptr;
  n_head_ /= tp.size, n_kv_head_ /= tp.size;
  for (Norm* n : {&q_norm, &k_norm})
    if (*n) (*n)->set_partial_grad(tp_);
}

namespace {
// Whether attention on q (and k, v of its shape) runs a fused kernel, which keeps O(T) per head
// for backward (flash, memory-efficient, cuDNN: the output and the log-sum-exp), not the T x T
// weights (SDPA's math kernel; the explicit softmax of libtorch < 2.0).
bool fused_attention(const torch::Tensor& q, double p) {
#if TORCH_VERSION_MAJOR >= 2
  try {
    return at::_fused_sdp_choice(q, q, q, /*attn_mask=*/{}, p, /*is_causal=*/true) > 0;  // 0: math
  } catch (const c10::Error&) {
    return false;
  }
#else
  (void)q, (void)p;
  return false;
#endif
}
}  // namespace

// Attention proper on [B, heads, T, head_dim]: the causal softmax of the scaled products, dropout
// p on its weights. No parameters: selective checkpointing keeps its graph (tape_attention).
torch::Tensor CausalSelfAttentionImpl::core(const torch::Tensor& q, torch::Tensor k, torch::Tensor v, double p) {
  const int64_t B = q.size(0), T = q.size(2), hd = head_dim_;
  if (n_kv_head_ != n_head_) {  // grouped-query attention: kv head j serves query heads j rep .. (j + 1) rep - 1
    const int64_t rep = n_head_ / n_kv_head_;
    k = k.unsqueeze(2).expand({B, n_kv_head_, rep, T, hd}).reshape({B, n_head_, T, hd});
    v = v.unsqueeze(2).expand({B, n_kv_head_, rep, T, hd}).reshape({B, n_head_, T, hd});
  }
#if TORCH_VERSION_MAJOR >= 2
  if (!plain(T) && softcap_ == 0 && scale_ == 0)  // a window that cuts (Mistral): SDPA with the band as its mask
    return at::scaled_dot_product_attention(q, k, v, window_mask(T, window_, q.device()), p, /*is_causal=*/false);
#endif
  if (!plain(T)) return capped_core(q, k, v, p);
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, p, /*is_causal=*/true);
#else
  if (!causal_mask_.defined() || causal_mask_.size(0) < T || causal_mask_.device() != q.device())
    causal_mask_ = torch::ones({T, T}, torch::dtype(torch::kBool).device(q.device())).triu(1);
  auto mask = causal_mask_.index({torch::indexing::Slice(0, T), torch::indexing::Slice(0, T)});
  auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  // In place: the scores are nobody's saved input (the scalar product keeps nothing), so the
  // masked copy the out-of-place form allocates per layer is not needed; the values are the same.
  att = att.masked_fill_(mask, -std::numeric_limits<float>::infinity()).softmax(-1);
  if (p > 0) att = F::dropout(att, F::DropoutFuncOptions().p(p).training(true));
  return torch::matmul(att, v);
#endif
}

torch::Tensor CausalSelfAttentionImpl::capped_core(const torch::Tensor& q, const torch::Tensor& k,
                                                   const torch::Tensor& v, double p) {
  const int64_t T = q.size(2);
  torch::Tensor att = torch::matmul(q, k.transpose(-2, -1)) * (scale_ > 0 ? scale_ : 1.0 / std::sqrt(static_cast<double>(head_dim_)));
  if (softcap_ > 0) att = torch::tanh(att / softcap_) * softcap_;
  att = att.masked_fill(window_mask(T, window_, q.device()).logical_not(), -std::numeric_limits<float>::infinity()).softmax(-1, torch::kFloat32).to(q.scalar_type());
  if (p > 0) att = F::dropout(att, F::DropoutFuncOptions().p(p).training(true));
  return torch::matmul(att, v);
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), hd = head_dim_;
  auto heads = [&](const torch::Tensor& t, int64_t n) { return t.view({B, T, n, hd}); };  // [B, T, n, hd]
  const torch::Tensor in = column_input(x, tp_);
  torch::Tensor q, k, v;
  if (c_attn) {
    auto qkv = apply_linear(c_attn, in).split(n_head_ * hd, /*dim=*/2);
    q = heads(qkv[0], n_head_), k = heads(qkv[1], n_head_), v = heads(qkv[2], n_head_);
  } else {
    if (whole_qk_norm_) {  // OLMoE: each projection normalised as a whole, then split into heads
      q = heads(q_norm(apply_linear(q_proj, in)), n_head_), k = heads(k_norm(apply_linear(k_proj, in)), n_kv_head_);
    } else {
      q = heads(apply_linear(q_proj, in), n_head_), k = heads(apply_linear(k_proj, in), n_kv_head_);
      if (q_norm) q = q_norm(q), k = k_norm(k);  // Qwen3: each head normalised, before rotary
    }
    v = heads(apply_linear(v_proj, in), n_kv_head_);
  }
  if (rotary_) q = rotary_->apply(q), k = rotary_->apply(k);
  q = q.transpose(1, 2), k = k.transpose(1, 2), v = v.transpose(1, 2);  // [B, n, T, hd]
  const double p = is_training() ? dropout_ : 0.0;
  torch::Tensor y = tape_attention(
      q, k, v, /*uses_rng=*/p > 0,
      [this, p](const torch::Tensor& qh) { return plain(qh.size(2)) && fused_attention(qh, p); },
      [this, p](const torch::Tensor& qh, const torch::Tensor& kh, const torch::Tensor& vh) { return core(qh, kh, vh, p); });
  y = y.transpose(1, 2).contiguous().view({B, T, n_head_ * hd});
  y = row_parallel(y, c_proj, tp_);
  if (p > 0) y = F::dropout(y, F::DropoutFuncOptions().p(p).training(true));
  return y;
}

#if TORCH_VERSION_MAJOR >= 2
namespace {
std::string first_line_of(const std::string& text) { return text.substr(0, text.find('\n')); }
}  // namespace
#endif

std::string configure_attention(const std::string& choice, const GPTDims& d, int64_t tp, const torch::Device& device,
                                c10::ScalarType dtype) {
  const int64_t heads = d.n_head / tp, head_dim = d.head_dim();
  // Mistral's window where it cuts the context: a banded mask instead of SDPA's causal flag.
  const bool gemma = d.family_row().gemma_norms;
  const bool band = d.llama() && !gemma && d.sliding_window > 0 && d.sliding_window < d.seq_len;
  const std::string shapes = concat(c10::toString(dtype), ", ", heads, " heads x ", head_dim, ", causal",
                                    band ? concat(" within a window of ", d.sliding_window) : std::string());
  if (gemma) {  // CausalSelfAttentionImpl::capped_core, whatever the device
    if (choice != "auto" && choice != "math")
      throw UsageError(concat("model.attention: ", choice, " cannot run Gemma's attention (computed as Hugging Face's "
                              "eager attention: its scale, soft cap and windows): use auto or math"));
    (void)device;
    return concat("masked softmax + matmul as Hugging Face's eager attention (", shapes,
                  d.attn_softcap > 0 ? concat(", scores capped at ", d.attn_softcap) : std::string(),
                  d.sliding_window > 0 ? concat(", window ", d.sliding_window, " on ", d.local_layers()) : std::string(), ")");
  }
#if TORCH_VERSION_MAJOR >= 2
  if (choice != "auto") {
    auto& ctx = at::globalContext();
    ctx.setSDPUseFlash(choice == "flash");
    ctx.setSDPUseMemEfficient(choice == "efficient");
    ctx.setSDPUseMath(choice == "math");
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 3  // cuDNN attention came with libtorch 2.3
    ctx.setSDPUseCuDNN(choice == "cudnn");
#else
    if (choice == "cudnn")
      throw UsageError(concat("model.attention: cudnn needs libtorch >= 2.3; this is ", libtorch_version()));
#endif
  }
  // Which kernel libtorch picks for a training step's q, k and v (one sequence: the choice
  // depends on the dtype, head size, causality, dropout and gradients, not on the batch).
  auto q = torch::empty({1, heads, d.seq_len, head_dim}, torch::dtype(dtype).device(device).requires_grad(true));
  int64_t backend = -1;
  try {
    const c10::optional<torch::Tensor> mask =
        band ? c10::optional<torch::Tensor>(window_mask(d.seq_len, d.sliding_window, device)) : c10::nullopt;
    backend = at::_fused_sdp_choice(q, q, q, mask, d.dropout, /*is_causal=*/!band);
  } catch (const c10::Error& e) {
    if (choice == "auto") return concat("scaled_dot_product_attention (", shapes, "; ", libtorch_version(),
                                        " does not say which kernel)");
    throw UsageError(concat("model.attention: ", choice, " cannot run for ", shapes, " on ", device.str(), " with ",
                            libtorch_version(), ": ", first_line_of(e.what_without_backtrace())));
  }
  if (backend < 0 && choice != "auto")
    throw UsageError(concat("model.attention: ", choice, " cannot run for ", shapes, " on ", device.str(), " with ",
                            libtorch_version()));
  static const char* const names[] = {"math", "flash", "efficient (memory-efficient)", "cudnn", "overrideable"};
  const std::string kernel = backend >= 0 && backend < 5 ? names[backend] : concat("backend ", backend);
  return concat("SDPA ", kernel, " (", choice == "auto" ? "libtorch's choice" : "model.attention", "; ", shapes, ")");
#else
  if (choice != "auto" && choice != "math")
    throw UsageError(concat("model.attention: ", choice, " needs libtorch >= 2.0 (scaled_dot_product_attention); ",
                            libtorch_version(), " has only the explicit path: use auto or math"));
  (void)device;
  return concat("masked softmax + matmul (", libtorch_version(), " has no scaled_dot_product_attention; ", shapes, ")");
#endif
}

// ---- MLP and block -----------------------------------------------------------------------------

// Made whole; tensor parallel (parallelize): c_fc (gate_proj, up_proj) holds intermediate_size / tp
// of the hidden units, c_proj their input columns.
MLPImpl::MLPImpl(const GPTDims& d)
    : geglu_(d.llama() && std::string(d.family_row().mlp_act) == "gelu_pytorch_tanh") {
  const int64_t hidden = d.intermediate_size;
  if (d.llama()) {
    gate_proj = register_module("gate_proj", linear(d.n_embd, hidden, false));
    up_proj = register_module("up_proj", linear(d.n_embd, hidden, false));
  } else {
    c_fc = register_module("c_fc", linear(d.n_embd, hidden, true));
  }
  c_proj = register_module("c_proj", linear(hidden, d.n_embd, !d.llama()));
  // The hidden units column-parallel, the projection back row-parallel (its bias whole).
  for (const char* m : {"c_fc", "gate_proj", "up_proj"}) tp_declare(m, TpSplit::rows);
  tp_declare("c_proj.weight", TpSplit::cols);
}

torch::Tensor MLPImpl::gated(const torch::Tensor& in) {
  const torch::Tensor gate = apply_linear(gate_proj, in);
  return (geglu_ ? F::gelu(gate, F::GELUFuncOptions().approximate("tanh")) : F::silu(gate)) * apply_linear(up_proj, in);
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  const torch::Tensor in = column_input(x, tp_);
  if (gate_proj) return row_parallel(gated(in), c_proj, tp_);
  return row_parallel(F::gelu(apply_linear(c_fc, in), F::GELUFuncOptions().approximate("tanh")), c_proj, tp_);
}

torch::Tensor MLPImpl::forward_partial(const torch::Tensor& x) {
  MPITRAIN_CHECK(gate_proj && !c_proj->bias.defined(), "forward_partial: a llama block's MLP (no biases)");
  return apply_linear(c_proj, gated(x));
}

torch::Tensor MLPImpl::forward_fused(const torch::Tensor& x) {
  MPITRAIN_CHECK(!geglu_, "GeGLU has no fused op (Gemma's blocks run unfused)");
  const torch::Tensor in = column_input(x, tp_);
  if (gate_proj) return row_parallel(swiglu(apply_linear(gate_proj, in), apply_linear(up_proj, in)), c_proj, tp_);
  // The matmul alone (autocast casts it as it would c_fc); the bias add joins the GELU.
  const torch::Tensor pre = tape_linear(in, c_fc->weight, torch::Tensor(), [&] { return F::linear(in, c_fc->weight); });
  return row_parallel(bias_gelu(pre, c_fc->bias), c_proj, tp_);
}

// Experts: SwiGLU MLPs of moe_intermediate_size units, made as the dense MLP with that size.
MoEImpl::MoEImpl(const GPTDims& d, RouterLog* log)
    : top_k_(d.num_experts_per_tok), num_experts_(d.num_experts), norm_topk_(d.norm_topk_prob),
      ep_(d.ep > 1 ? d.ep_comm : nullptr), log_(log) {
  // (The config refuses these: args_conflict.)
  MPITRAIN_CHECK(top_k_ <= d.num_experts, "mixture of experts: more chosen than there are experts");
  MPITRAIN_CHECK(d.ep >= 1 && d.num_experts % d.ep == 0 && (d.ep == 1 || d.ep_comm),
                 "expert parallelism: ep must divide num_experts, with its communicator");
  gate = register_module("gate", linear(d.n_embd, d.num_experts, false));
  experts = register_module("experts", std::make_shared<torch::nn::Module>());
  GPTDims expert = d;
  expert.intermediate_size = d.moe_intermediate_size;
  first = d.ep_rank * d.local_experts();
  for (int64_t e = first; e < first + d.local_experts(); ++e)
    local.push_back(experts->register_module(std::to_string(e), MLP(expert)));
}

void MoEImpl::parallelize(const TpPlace& tp) { tp_ = tp.sharded() ? tp.comm : nullptr; }

void MoEImpl::configure(const RunOptions& run) {
  capacity_factor_ = run.capacity_factor;
  z_loss_ = run.z_loss_coef > 0;
  if (!run.routing_bias)
    routing_bias = torch::Tensor();
  else if (!routing_bias.defined())
    routing_bias = torch::zeros({num_experts_}, torch::kFloat32);
}

torch::Tensor MoEImpl::run_local(const torch::Tensor& grouped, const int64_t* count, size_t begin, size_t end) {
  end = std::min(end, local.size());
  if (begin >= end) return grouped.new_empty({0, grouped.size(1)});
  std::vector<torch::Tensor> outs;
  outs.reserve(end - begin);
  const torch::Tensor in = column_input(grouped, tp_);
  int64_t start = 0;
  for (size_t e = begin; e < end; start += count[e], ++e) {
    const torch::Tensor rows = in.narrow(0, start, count[e]);
    outs.push_back(tp_ ? local[e]->forward_partial(rows) : local[e]->forward(rows));
  }
  return tp_ ? tp_reduce(torch::cat(outs), *tp_) : torch::cat(outs);
}

// Each rank of the ep group sends rank q the rows for q's experts (contiguous: the rows are
// sorted by expert), learns first how many of each of its own experts every rank sends, runs its
// experts on what arrives (each expert's rows from every rank together) and sends the outputs back.
// Its own rows for its own experts need no exchange: those of its first half of experts run while
// the others' rows travel here, those of the second half while the outputs travel back (forward),
// and their backward while the gradients travel each way (EpExchange). (One expert per rank:
// its own rows overlap the dispatch only.)
torch::Tensor MoEImpl::run_parallel(const torch::Tensor& grouped, const torch::Tensor& host_counts) {
  Communicator& ep = *ep_;
  const int P = ep.size(), me = ep.rank();
  const auto L = static_cast<int64_t>(local.size());
  // counts[q][j]: this rank's rows for rank q's expert j; arriving[q][j]: rank q's rows for mine.
  const torch::Tensor counts = host_counts.view({P, L}).contiguous();
  const torch::Tensor arriving = ep_exchange_counts(counts, ep);
  const int64_t* c = counts.data_ptr<int64_t>();
  const int64_t* a = arriving.data_ptr<int64_t>();
  std::vector<int64_t> send(static_cast<size_t>(P), 0), recv(static_cast<size_t>(P), 0);
  std::vector<int64_t> per_expert(static_cast<size_t>(L), 0);  // the other ranks' rows for each of mine
  for (int q = 0; q < P; ++q)
    for (int64_t j = 0; j < L; ++j) {
      send[q] += c[q * L + j], recv[q] += a[q * L + j];
      if (q != me) per_expert[j] += a[q * L + j];
    }
  int64_t mine_at = 0;  // where my rows for my own experts begin in `grouped`
  for (int q = 0; q < me; ++q) mine_at += send[q];
  const int64_t mine = send[me];
  send[me] = recv[me] = 0;
  EpExchange dispatch(torch::cat({grouped.narrow(0, 0, mine_at), grouped.narrow(0, mine_at + mine, grouped.size(0) - mine_at - mine)}),
                      send, recv, ep);
  const size_t half = static_cast<size_t>(L + 1) / 2;  // own experts [0, half) during the dispatch, the rest during the return
  int64_t first_rows = 0;
  for (size_t j = 0; j < half; ++j) first_rows += c[me * L + static_cast<int64_t>(j)];
  const torch::Tensor own_first = run_local(grouped.narrow(0, mine_at, first_rows), c + me * L, 0, half);
  const torch::Tensor got = dispatch.wait();  // by sender, then by expert
  // Expert-major order (expert j: its rows from rank 0, then rank 1, ...) and back.
  std::vector<int64_t> order;
  order.reserve(static_cast<size_t>(got.size(0)));
  std::vector<int64_t> start(static_cast<size_t>(P * L));
  for (int64_t i = 0, off = 0; i < P * L; ++i) {
    start[i] = off;
    if (i / L != me) off += a[i];
  }
  for (int64_t j = 0; j < L; ++j)
    for (int q = 0; q < P; ++q)
      if (q != me)
        for (int64_t r = 0; r < a[q * L + j]; ++r) order.push_back(start[q * L + j] + r);
  const torch::Tensor perm = torch::tensor(order, torch::kInt64).to(grouped.device());
  const torch::Tensor out = run_local(got.index_select(0, perm), per_expert.data());
  const torch::Tensor back = torch::empty_like(perm).index_copy_(0, perm, torch::arange(perm.size(0), perm.options()));
  EpExchange ret(out.index_select(0, back), recv, send, ep);
  const torch::Tensor own_rest = run_local(grouped.narrow(0, mine_at + first_rows, mine - first_rows), c + me * L, half);
  const torch::Tensor returned = ret.wait();
  return torch::cat({returned.narrow(0, 0, mine_at), own_first, own_rest, returned.narrow(0, mine_at, returned.size(0) - mine_at)});
}

torch::Tensor MoEImpl::forward(const torch::Tensor& x) {
  const int64_t C = x.size(-1), E = num_experts_;
  const torch::Tensor rows = x.reshape({-1, C});
  const int64_t N = rows.size(0);
  // The router in fp32 from its logits (in autocast's dtype, as transformers' gate runs in the model's).
  const torch::Tensor logits = apply_linear(gate, rows).to(torch::kFloat32);
  const torch::Tensor probs = torch::softmax(logits, -1);
  torch::Tensor weights, chosen;
  if (routing_bias.defined()) {  // the bias chooses, the probabilities weigh
    chosen = std::get<1>((probs.detach() + routing_bias.to(probs.device())).topk(top_k_, -1));
    weights = probs.gather(-1, chosen);
  } else {
    std::tie(weights, chosen) = probs.topk(top_k_, -1);
  }
  if (norm_topk_) weights = weights / weights.sum(-1, /*keepdim=*/true);
  // The N k token copies grouped by expert (stable: a token's copies in expert order, as
  // transformers' loop over the experts adds them), each group through its expert.
  const torch::Tensor flat = chosen.reshape({-1});
  torch::Tensor order = std::get<1>(flat.sort(c10::optional<bool>(true), /*dim=*/0, /*descending=*/false));
  const torch::Tensor counts = torch::bincount(flat, {}, E);
  torch::Tensor host_counts = counts.cpu();
  int64_t dropped = 0;
  if (capacity_factor_ > 0) {  // each expert's first `cap` copies by position (the sort is stable)
    const auto cap = static_cast<int64_t>(std::ceil(capacity_factor_ * static_cast<double>(N) *
                                                    static_cast<double>(top_k_) / static_cast<double>(E)));
    torch::Tensor kept = host_counts.clamp_max(cap);
    std::vector<int64_t> keep;
    const int64_t *c = host_counts.data_ptr<int64_t>(), *k = kept.data_ptr<int64_t>();
    for (int64_t e = 0, start = 0; e < E; start += c[e], ++e)
      for (int64_t j = 0; j < k[e]; ++j) keep.push_back(start + j);
    dropped = N * top_k_ - static_cast<int64_t>(keep.size());
    order = order.index_select(0, torch::tensor(keep, torch::kInt64).to(order.device()));
    host_counts = kept;
  }
  const torch::Tensor token = order.div(top_k_, "floor");
  const torch::Tensor grouped = rows.index_select(0, token);
  torch::Tensor out = ep_ ? run_parallel(grouped, host_counts) : run_local(grouped, host_counts.data_ptr<int64_t>());
  out = out * weights.reshape({-1}).index_select(0, order).to(out.scalar_type()).unsqueeze(1);
  if (log_ && !recomputing()) log_->dropped += dropped, log_->copies += N * top_k_;
  if (is_training())
    prob_sums = z_loss_ ? torch::cat({probs.sum(0), logits.logsumexp(-1).square().sum().unsqueeze(0)}) : probs.sum(0);
  if (log_ && is_training() && !recomputing()) {
    log_->prob_sums.push_back(prob_sums);
    log_->counts.push_back(counts);
    log_->rows += N;
  } else if (log_ && !is_training()) {
    log_->counts.push_back(counts);
  }
  return torch::zeros({N, C}, out.options()).index_add(0, token, out).view(x.sizes());
}

BlockImpl::BlockImpl(const GPTDims& d, std::shared_ptr<Rotary> rotary, int64_t layer, RouterLog* log)
    : dropout_(d.dropout) {
  const bool gemma = d.family_row().gemma_norms;
  ln_1 = register_module("ln_1", Norm(d.n_embd, d.llama(), d.norm_eps, nullptr, gemma));
  attn = register_module("attn", CausalSelfAttention(d, std::move(rotary), layer));
  ln_2 = register_module("ln_2", Norm(d.n_embd, d.llama(), d.norm_eps, nullptr, gemma));
  if (d.moe_layer(layer)) moe = register_module("mlp", MoE(d, log));
  else mlp = register_module("mlp", MLP(d));
  if (gemma) {
    post_attn_norm = register_module("post_attn_norm", Norm(d.n_embd, true, d.norm_eps, nullptr, true));
    post_mlp_norm = register_module("post_mlp_norm", Norm(d.n_embd, true, d.norm_eps, nullptr, true));
  }
}

torch::Tensor BlockImpl::ffn(const torch::Tensor& x) { return moe ? moe(x) : mlp(x); }

torch::Tensor BlockImpl::forward(torch::Tensor x) {
  auto a = attn(ln_1(x));
  if (post_attn_norm) a = post_attn_norm(a);
  x = x + a;
  auto m = ffn(ln_2(x));
  if (post_mlp_norm) m = post_mlp_norm(m);
  if (is_training() && dropout_ > 0)
    m = F::dropout(m, F::DropoutFuncOptions().p(dropout_).training(true));
  return x + m;
}

std::pair<torch::Tensor, torch::Tensor> BlockImpl::forward_fused(const torch::Tensor& x, const torch::Tensor& delta,
                                                                 c10::ScalarType normed_dtype) {
  auto [r1, n1] = ln_1->add_forward(x, delta, normed_dtype);
  auto [r2, n2] = ln_2->add_forward(r1, attn(n1), normed_dtype);
  auto m = moe ? moe(n2) : mlp->forward_fused(n2);
  if (is_training() && dropout_ > 0)
    m = F::dropout(m, F::DropoutFuncOptions().p(dropout_).training(true));
  return {r2, m};
}

// ---- ZeRO-3's block boundaries ---------------------------------------------------------------

namespace {

constexpr int64_t kOutside = -1;  // BlockBoundary's "block" for the parameters outside the blocks

// ZeRO-3: the identity on a block's outputs (the residual stream, and the fused path's MLP output
// still to be added) whose backward, which runs before the block's own (it needs these
// gradients), asks for the block's parameters whole again. Tensor arguments, not a variable_list:
// libtorch 1.13 leaves a list's tensors returned as they came unconnected to the graph.
class BlockBoundary : public torch::autograd::Function<BlockBoundary> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                                const c10::optional<torch::Tensor>& delta, int64_t units,
                                                int64_t block) {
    ctx->saved_data["units"] = units;
    ctx->saved_data["block"] = block;
    if (delta.has_value()) return {x, *delta};
    return {x};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* units = reinterpret_cast<UnitHooks*>(ctx->saved_data["units"].toInt());
    const int64_t block = ctx->saved_data["block"].toInt();
    if (block == kOutside)
      units->need_outside_blocks();
    else
      units->need_block(block, /*backward=*/true);
    return {grads[0], grads.size() > 1 ? grads[1] : torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

void GPTImpl::before_block(int64_t block) {
  if (units_) units_->need_block(block, /*backward=*/false);
}

std::vector<torch::Tensor> GPTImpl::after_block(int64_t block, std::vector<torch::Tensor> outs) {
  if (!units_) return outs;
  units_->done_with_block(block);
  const bool wants_grad = torch::GradMode::is_enabled() &&
                          std::any_of(outs.begin(), outs.end(), [](const torch::Tensor& t) { return t.requires_grad(); });
  if (!wants_grad) return outs;
  return apply_autograd_function<BlockBoundary>(
      outs[0], outs.size() > 1 ? c10::optional<torch::Tensor>(outs[1]) : c10::nullopt,
      static_cast<int64_t>(reinterpret_cast<intptr_t>(units_)), block);
}

// A checkpointed sparse block's last output is its router's probability sums: they take the
// place of the first run's in the router log (which have no graph: the first run records none), so
// the aux loss's gradient reaches the router through the block's second run.
std::vector<torch::Tensor> GPTImpl::router_output(std::vector<torch::Tensor> outs, size_t block_outputs) {
  if (outs.size() > block_outputs) {
    MPITRAIN_CHECK(!router_log_.prob_sums.empty(), "checkpointed sparse block: no router log entry");
    router_log_.prob_sums.back() = outs.back();
    outs.pop_back();
  }
  return outs;
}

bool GPTImpl::checkpointed(int64_t block) const {
  return is_training() && torch::GradMode::is_enabled() && run_.ac != RunOptions::Ac::none &&
         (block + 1) % run_.ac_every == 0;
}

// ---- GPT ---------------------------------------------------------------------------------------

namespace {
// Dims filled in by hand (tests, tools) may leave GPT-2's derived sizes at 0.
GPTDims complete(GPTDims d) {
  if (d.n_kv_head == 0) d.n_kv_head = d.n_head;
  if (d.intermediate_size == 0) d.intermediate_size = 4 * d.n_embd;
  if (d.max_position == 0) d.max_position = d.seq_len;
  return d;
}
}  // namespace

int64_t expert_of(const std::string& name) {
  static const std::string mark = ".mlp.experts.";
  const size_t at = name.find(mark);
  if (at == std::string::npos) return -1;
  const size_t from = at + mark.size(), to = name.find('.', from);
  if (to == std::string::npos || to == from) return -1;
  int64_t e = 0;
  for (size_t i = from; i < to; ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    e = e * 10 + (name[i] - '0');
  }
  return e;
}

std::string with_expert(const std::string& name, int64_t e) {
  static const std::string mark = ".mlp.experts.";
  const size_t at = name.find(mark);
  MPITRAIN_CHECK(expert_of(name) >= 0, concat("with_expert: '", name, "' is no expert's parameter"));
  const size_t from = at + mark.size(), to = name.find('.', from);
  return name.substr(0, from) + std::to_string(e) + name.substr(to);
}

void drop_param_values(const torch::Tensor& p) { drop_param_values(p, p.sizes()); }

void drop_param_values(const torch::Tensor& p, c10::IntArrayRef shape) {
  torch::NoGradGuard no_grad;
  torch::Tensor param = p;  // (set_data swaps what the shared TensorImpl holds)
  param.set_data(torch::zeros({1}, p.options()).expand(shape));
}

bool param_has_values(const torch::Tensor& p) {
  return p.storage().nbytes() >= static_cast<size_t>(p.numel()) * p.element_size();
}

namespace {
// Every parameter of `m` without its values (GPT's deferred initialisation).
void drop_values(torch::nn::Module& m) {
  for (const auto& p : m.parameters()) drop_param_values(p);
}

// GPT-2 initialisation of one whole parameter, drawn from `gen` (none: the default generator).
// The residual projections (attn.c_proj, mlp.c_proj) add into the residual stream once per
// layer each, so their std shrinks with depth to keep it bounded.
void draw_initial(const std::string& name, torch::Tensor p, const GPTDims& d,
                  const c10::optional<at::Generator>& gen) {
  const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(d.n_layer));
  const bool unit_offset = d.family_row().gemma_norms;  // x (1 + w): w starts at 0
  const bool is_weight = name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0;
  const bool is_norm = name.find("ln_") != std::string::npos || name.find("_norm.") != std::string::npos;
  if (is_norm) {
    is_weight && !unit_offset ? p.fill_(1.0) : p.zero_();
  } else if (name == "wte.weight" || name == "lm_head.weight") {
    // The tokens' rows are drawn as an unpadded model's (the same generator draws: padding
    // changes no other initial value); padding rows are zero.
    p.zero_();
    p.narrow(0, 0, d.classes()).normal_(0.0, 0.02, gen);
  } else if (is_weight) {
    const bool residual = name.find("c_proj.weight") != std::string::npos;
    p.normal_(0.0, residual ? proj_std : 0.02, gen);
  } else {
    p.zero_();
  }
}

// The default CPU generator's state now, as a generator of its own.
at::Generator snapshot_of_default_generator() {
  at::Generator g = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.clone();
}
}  // namespace

GPT whole_model(const GPTDims& d, bool deferred, bool stage) {
  GPTDims whole = d;
  whole.ep = 1, whole.ep_rank = 0, whole.ep_comm = nullptr;
  if (!stage) whole.pp = 1, whole.pp_stage = 0, whole.pp_virtual = 1;
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  torch::Tensor rng;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng = gen.get_state();  // (making a model draws)
  }
  GPT model(whole, deferred);
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng);
  }
  return model;
}

std::vector<std::string> whole_model_names(const GPTDims& d) {
  std::vector<std::string> names;
  for (const auto& [name, p] : whole_model(d, /*deferred=*/true)->named_params()) names.push_back(name);
  return names;
}

GPTImpl::GPTImpl(const GPTDims& given, bool deferred) : dims_(complete(given)) {
  const GPTDims& d = dims_;
  MPITRAIN_CHECK(d.n_head % d.n_kv_head == 0, "model dims: n_kv_head must divide n_head");
  if (d.ep > 1 || d.pp > 1) {
    // Expert parallelism or a pipeline stage: the whole model's initial values from the same
    // generator state (made without values, so that at most one of its blocks exists at once),
    // drawn one parameter at a time in its order, each kept where this rank holds a parameter of
    // that name (its experts and every other one; a stage's blocks, the last stage's copy of a
    // tied embedding too). Deferred (ZeRO-3): initialize() makes those draws.
    GPTDims whole = d;
    whole.ep = 1, whole.ep_rank = 0, whole.ep_comm = nullptr;
    whole.pp = 1, whole.pp_stage = 0, whole.pp_virtual = 1;
    GPT dense(whole, /*deferred=*/true);
    build_modules(d, deferred);
    collect_tp_splits();
    if (deferred) {
      whole_draws_ = dense.ptr();
      return;
    }
    keep_draws(*dense);
    return;
  }
  build_modules(d, deferred);
  collect_tp_splits();
  if (deferred) {
    init_generator_ = snapshot_of_default_generator();
    return;
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : named_params()) draw_initial(name, p, d, c10::nullopt);
}

void GPTImpl::parallelize(const TpPlace& tp) {
  MPITRAIN_CHECK(!tp_.sharded(), "GPT::parallelize: the model is sharded already");
  if (!tp.sharded()) return;
  const GPTDims& d = dims_;
  MPITRAIN_CHECK(tp.comm && tp.rank >= 0 && tp.rank < tp.size, "GPT::parallelize: a tp place without its group");
  MPITRAIN_CHECK(d.n_head % tp.size == 0 && d.n_kv_head % tp.size == 0 && d.intermediate_size % tp.size == 0 &&
                     d.vocab_size % tp.size == 0 && (!d.has_experts() || d.moe_intermediate_size % tp.size == 0),
                 "tensor parallel: n_head, n_kv_head, intermediate_size (moe_intermediate_size) and vocab_size must "
                 "divide by tp");
  torch::NoGradGuard no_grad;
  for (const auto& [name, p] : named_params()) {
    const TpSplit split = tp_split(name);
    if (split == TpSplit::replicated) continue;
    torch::Tensor param = p;  // (set_data swaps what the shared TensorImpl holds)
    if (param_has_values(p))
      param.set_data(tp_shard(p.detach(), split, tp.rank, tp.size).clone(at::MemoryFormat::Contiguous));
    else  // deferred: initialize() gives the values
      drop_param_values(p, tp_shard_shape(p.sizes(), split, tp.size));
  }
  for (const auto& m : modules(/*include_self=*/false)) {
    if (auto* a = m->as<CausalSelfAttentionImpl>()) a->parallelize(tp);
    else if (auto* e = m->as<MoEImpl>()) e->parallelize(tp);
    else if (auto* f = m->as<MLPImpl>()) f->parallelize(tp);  // (the dense MLPs and the experts)
  }
  tp_ = tp;
}

void GPTImpl::apply(const RunOptions& run) {
  if (run.fused_kernels && dims_.family_row().gemma_norms)
    throw UsageError(concat("model.fused_kernels: the ", dims_.family_row().name, " family's norms have no fused ops (set it off)"));
  if (run.fused_loss && dims_.final_softcap > 0)
    throw UsageError("model.fused_loss: the fused loss has no soft cap for model.final_softcap (set it off)");
  MPITRAIN_CHECK(run.ac_every >= 1 && run.capacity_factor >= 0 && run.z_loss_coef >= 0,
                 "RunOptions: ac_every >= 1, a capacity factor and a z-loss coefficient >= 0");
  run_ = run;
  for (const auto& r : rotaries_) r->set_fused(run.fused_kernels);
  for (MoEImpl* m : moe_layers()) m->configure(run);
  routed_since_update_.clear();
}

void GPTImpl::keep_draws(GPTImpl& whole) {
  const auto params = named_params();
  draws_of(whole, [&](size_t k, const torch::Tensor& values) {
    torch::NoGradGuard no_grad;
    params[k].second.copy_(values);
  });
}

void GPTImpl::draws_of(GPTImpl& whole, const std::function<void(size_t, const torch::Tensor&)>& take) {
  std::map<std::string, size_t> mine;
  const auto params = named_params();
  for (size_t k = 0; k < params.size(); ++k) mine.emplace(params[k].first, k);
  std::vector<std::string> names;
  for (const auto& [name, p] : whole.named_params()) names.push_back(name);
  std::vector<torch::Tensor> held(params.size());  // the draws come in the whole model's order
  size_t next = 0;  // the next of this model's parameters to hand out
  whole.initialize([&](size_t k, const torch::Tensor& values) {
    const auto it = mine.find(names[k]);
    if (it == mine.end()) return;
    held[it->second] = values;
    for (; next < held.size() && held[next].defined(); ++next) {
      take(next, held[next]);
      held[next] = torch::Tensor();
    }
  });
  MPITRAIN_CHECK(next == params.size(), "the whole model lacks some of this rank's parameters");
}

void GPTImpl::initialize(const std::function<void(size_t, const torch::Tensor&)>& take) {
  const auto params = named_params();
  const auto shard = [&](size_t k, const torch::Tensor& whole) {  // (parallelize's shard of the whole draw)
    return tp_.sharded() ? tp_shard(whole, tp_split(params[k].first), tp_.rank, tp_.size) : whole;
  };
  if (whole_draws_) {  // the whole model's draws, each of this rank's parameters taken in its own order
    draws_of(*whole_draws_, [&](size_t k, const torch::Tensor& values) { take(k, shard(k, values)); });
    return;
  }
  MPITRAIN_CHECK(init_generator_.has_value(), "GPT::initialize: the model was not made deferred");
  torch::NoGradGuard no_grad;
  at::Generator gen = init_generator_->clone();  // initialize() draws the same values each time
  for (size_t k = 0; k < params.size(); ++k) {
    const auto& [name, p] = params[k];
    torch::Tensor whole = torch::empty(tp_whole_shape(p.sizes(), tp_split(name), tp_.size), p.options().requires_grad(false));
    draw_initial(name, whole, dims_, gen);
    take(k, shard(k, whole));
  }
}

// Made whole over tp (parallelize then keeps this rank's vocab_size / tp rows of wte and of Llama's
// untied lm_head).
// Vocabulary padding: the vocabulary's layers are made with the tokens'
// rows only and the zero padding rows appended after, so that making the modules draws what an
// unpadded model's draws (libtorch's modules initialise themselves when made) and the
// initialisation below then draws the same values too.
// `deferred`: each module's values are dropped as soon as it is made (its draws are made all the
// same), so that no more than one block and the embedding exist at once.
void GPTImpl::build_modules(const GPTDims& d, bool deferred) {
  const int64_t rows = d.vocab_size, made = d.classes();
  auto pad_rows = [&](torch::Tensor& w) {
    torch::NoGradGuard no_grad;
    if (made < rows) w.set_data(torch::cat({w, torch::zeros({rows - made, d.n_embd}, w.options())}));
  };
  // (A pipeline stage: the embedding on the first stage, and with tied embeddings on the last.)
  const bool first = d.first_stage(), last = d.last_stage(), tied = !d.llama() || d.tie_embeddings;
  if (first || (last && tied)) {
    wte = register_module("wte", torch::nn::Embedding(made, d.n_embd));
    pad_rows(wte->weight);
    if (deferred) drop_values(*wte);
  }
  if (!d.llama() && first) wpe = register_module("wpe", torch::nn::Embedding(d.seq_len, d.n_embd));
  auto rotary = d.llama() ? std::make_shared<Rotary>(d) : nullptr;  // one table for every block
  // Gemma 3's local (windowed) layers: a table of their own rotary base.
  auto local_rotary = d.llama() && d.rope_local_theta > 0 ? std::make_shared<Rotary>(d, /*local=*/true) : rotary;
  for (const auto& r : {rotary, local_rotary})
    if (r) rotaries_.push_back(r);
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < d.chunk_end(d.pp_virtual - 1); ++i) {
    if (!d.holds_block(i)) {  // another stage's block: an empty place, so that names stay h.<i>
      h->push_back(std::make_shared<torch::nn::Module>());
      continue;
    }
    h->push_back(Block(d, d.local_layer(i) ? local_rotary : rotary, i, &router_log_));
    if (deferred) drop_values(*h->ptr(static_cast<size_t>(i)));
  }
  for (const char* m : {"wte", "lm_head"}) tp_declare(m, TpSplit::rows);  // the vocabulary's rows
  if (!last) return;
  ln_f = register_module("ln_f", Norm(d.n_embd, d.llama(), d.norm_eps, nullptr, d.family_row().gemma_norms));
  if (d.llama() && !d.tie_embeddings) {
    lm_head = register_module("lm_head", linear(d.n_embd, made, false));
    pad_rows(lm_head->weight);
  }
  if (deferred) drop_values(*this);
}

torch::Tensor GPTImpl::hidden(const torch::Tensor& idx) {
  router_log_.clear();
  aux_loss_ = torch::Tensor(), z_loss_ = torch::Tensor();
  torch::Tensor x = embed(idx);
  if (!run_.fused_kernels) return ln_f(run_blocks(x));
  const c10::ScalarType normed_dtype = autocast_dtype_or(x.device().type(), torch::kFloat32);
  const auto [sum, delta] = run_blocks_fused(x, 0, INT64_MAX);
  return ln_f->add_forward(sum, delta, normed_dtype).second;
}

torch::Tensor GPTImpl::embed(const torch::Tensor& idx) {
  const int64_t T = idx.size(1);
  MPITRAIN_CHECK(T <= dims_.seq_len, concat("sequence of ", T, " tokens exceeds seq_len ", dims_.seq_len));
  if (units_) units_->need_outside_blocks();
  torch::Tensor x = tp_.sharded() ? vocab_parallel_embedding(idx, wte->weight, tp_.rank * wte->weight.size(0), *tp_.comm)
                                  : wte(idx);
  if (wpe) x = x + wpe(torch::arange(T, torch::dtype(torch::kLong).device(idx.device())));
  if (dims_.family_row().gemma_norms) x = x * std::sqrt(static_cast<double>(dims_.n_embd));
  if (is_training() && dims_.dropout > 0)
    x = F::dropout(x, F::DropoutFuncOptions().p(dims_.dropout).training(true));
  return x;
}

torch::Tensor GPTImpl::run_blocks(torch::Tensor x, int64_t begin, int64_t end) {
  for (auto i = static_cast<size_t>(begin); i < std::min(h->size(), static_cast<size_t>(end)); ++i) {
    const auto b = static_cast<int64_t>(i);
    auto block = (*h)[i]->as<Block>();
    if (!block) continue;  // (a pipeline stage: another stage's block)
    before_block(b);
    if (!checkpointed(b)) {
      x = after_block(b, {block->forward(x)})[0];
      continue;
    }
    const BlockRun run = [block](const std::vector<torch::Tensor>& in) {
      std::vector<torch::Tensor> out{block->forward(in[0])};
      if (block->moe) out.push_back(block->moe->prob_sums);  // the router's, for the aux loss's gradient
      return out;
    };
    x = after_block(b, router_output(checkpointed_block(run, x, torch::Tensor(), run_.ac == RunOptions::Ac::selective)))[0];
  }
  return x;
}

torch::Tensor GPTImpl::stage_forward(const torch::Tensor& in, int64_t chunk) {
  MPITRAIN_CHECK(dims_.pp > 1 && chunk >= 0 && chunk < dims_.pp_virtual, "stage_forward: a chunk of a pipeline stage");
  const bool first = dims_.first_stage() && chunk == 0, last = dims_.last_stage() && chunk + 1 == dims_.pp_virtual;
  router_log_.clear();
  aux_loss_ = torch::Tensor(), z_loss_ = torch::Tensor();
  const torch::Tensor x = first ? embed(in) : in;
  const int64_t begin = dims_.chunk_begin(chunk), end = dims_.chunk_end(chunk);
  if (last && units_) units_->need_outside_blocks();  // (ZeRO-3: the final norm and the output layer)
  if (!run_.fused_kernels) return last ? ln_f(run_blocks(x, begin, end)) : run_blocks(x, begin, end);
  // Fused: the chunk's last MLP output is added to the residual stream by ln_f's fused add on the
  // last stage, elsewhere by a plain fp32 add before it travels: the sum the next block's fused
  // add would have formed (fp32 + the block output promoted), so the stream is the unpipelined one.
  const c10::ScalarType normed_dtype = autocast_dtype_or(x.device().type(), torch::kFloat32);
  const auto [sum, delta] = run_blocks_fused(x, begin, end);
  if (last) return ln_f->add_forward(sum, delta, normed_dtype).second;
  return delta.defined() ? sum + delta : sum;
}

torch::Tensor GPTImpl::stage_loss(const torch::Tensor& out, const torch::Tensor& targets) {
  MPITRAIN_CHECK(dims_.last_stage(), "stage_loss: the last stage's");
  const torch::Tensor loss = lm_loss_of(out, targets);
  // ZeRO-3: another micro-batch's backward may have released the outside unit (its gradient
  // bucket filled) before this one's: its backward makes it whole again first.
  if (!units_ || !torch::GradMode::is_enabled() || !loss.requires_grad()) return loss;
  return apply_autograd_function<BlockBoundary>(loss, c10::nullopt, static_cast<int64_t>(reinterpret_cast<intptr_t>(units_)),
                                                kOutside)[0];
}

// The residual stream x stays fp32 (the embeddings are; add_layernorm / add_rmsnorm add the
// bf16/fp16 block outputs of an autocast region in fp32, as the unfused path's type promotion
// does); each block's MLP output is added by the next norm, the last one's by the caller (ln_f).
std::pair<torch::Tensor, torch::Tensor> GPTImpl::run_blocks_fused(torch::Tensor x, int64_t begin, int64_t end) {
  torch::Tensor delta;
  const c10::ScalarType normed_dtype = autocast_dtype_or(x.device().type(), torch::kFloat32);
  for (auto i = static_cast<size_t>(begin); i < std::min(h->size(), static_cast<size_t>(end)); ++i) {
    const auto b = static_cast<int64_t>(i);
    auto block = (*h)[i]->as<Block>();
    if (!block) continue;  // (another stage's)
    before_block(b);
    if (!checkpointed(b)) {
      std::tie(x, delta) = block->forward_fused(x, delta, normed_dtype);
      const auto outs = after_block(b, {x, delta});
      x = outs[0], delta = outs[1];
      continue;
    }
    const BlockRun run = [block, normed_dtype](const std::vector<torch::Tensor>& in) {
      auto [out, d] = block->forward_fused(in[0], in[1], normed_dtype);
      std::vector<torch::Tensor> outs{out, d};
      if (block->moe) outs.push_back(block->moe->prob_sums);
      return outs;
    };
    const auto outs = after_block(b, router_output(checkpointed_block(run, x, delta, run_.ac == RunOptions::Ac::selective), 2));
    x = outs[0], delta = outs[1];
  }
  return {x, delta};
}

int64_t GPTImpl::live_rows() const {
  const int64_t rows = output_weight().size(0), start = tp_.rank * rows;
  return std::clamp<int64_t>(dims_.classes() - start, 0, rows);
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx) {
  // hidden() first: it makes the output layer whole under ZeRO-3.
  return head(column_input(hidden(idx), tp_.comm));
}

// The output layer (tensor parallel: this rank's vocabulary columns), without padding rows.
torch::Tensor GPTImpl::head(const torch::Tensor& x) {
  torch::Tensor logits = F::linear(x, output_weight().narrow(0, 0, live_rows()));
  const double cap = dims_.final_softcap;
  return cap > 0 ? torch::tanh(logits / cap) * cap : logits;  // Gemma's soft cap
}

torch::Tensor GPTImpl::lm_loss(const torch::Tensor& idx, const torch::Tensor& targets) {
  return lm_loss_of(hidden(idx), targets);
}

torch::Tensor GPTImpl::lm_loss_of(const torch::Tensor& hidden, const torch::Tensor& targets) {
  Communicator* tp = tp_.comm;
  const int64_t vocab_start = tp_.rank * output_weight().size(0);
  auto x = column_input(hidden, tp);
  if (run_.fused_loss) {  // tensor parallel: not even this rank's slice of the logits exists whole
    const torch::Tensor weight = output_weight().narrow(0, 0, live_rows());
    return linear_cross_entropy(x.reshape({-1, x.size(-1)}), weight, targets.reshape({-1}).to(torch::kLong),
                                run_.fused_loss_rows, FusedImpl::automatic, tp, vocab_start);
  }
  auto logits = head(x);
  if (tp)
    return vocab_parallel_cross_entropy(logits.view({targets.numel(), logits.size(-1)}), targets.reshape({-1}),
                                        vocab_start, *tp);  // (numel, not -1: a slice of padding has 0 columns)
  return F::cross_entropy(logits.view({-1, logits.size(-1)}).to(torch::kFloat32),
                          targets.reshape({-1}).to(torch::kLong));
}

torch::Tensor GPTImpl::target_log_probs(const torch::Tensor& idx, const torch::Tensor& targets) {
  return stage_target_log_probs(hidden(idx), targets);
}

torch::Tensor GPTImpl::stage_target_log_probs(const torch::Tensor& out, const torch::Tensor& targets) {
  Communicator* tp = tp_.comm;
  const torch::Tensor logits = head(column_input(out, tp)).to(torch::kFloat32);  // [B, T, this rank's classes]
  const torch::Tensor t = targets.to(torch::kLong).to(logits.device());
  if (!tp) return torch::log_softmax(logits, -1).gather(-1, t.unsqueeze(-1)).squeeze(-1);
  const int64_t start = tp_.rank * output_weight().size(0), n = logits.size(-1);
  const auto options = logits.options();
  torch::Tensor top = n > 0 ? std::get<0>(logits.max(-1)) : torch::full(t.sizes(), -INFINITY, options);
  tp->all_reduce(top, ReduceOp::max);
  torch::Tensor sum = n > 0 ? (logits - top.unsqueeze(-1)).exp().sum(-1) : torch::zeros(t.sizes(), options);
  tp->all_reduce(sum, ReduceOp::sum);
  const torch::Tensor local = t - start, here = (local >= 0) & (local < n);  // the target's logit: one rank's
  torch::Tensor picked = n > 0 ? logits.gather(-1, local.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1) * here.to(torch::kFloat32)
                               : torch::zeros(t.sizes(), options);
  tp->all_reduce(picked, ReduceOp::sum);
  return picked - top - sum.log();
}

RouterLog GPTImpl::take_router_log() {
  RouterLog out = std::move(router_log_);
  router_log_.clear();
  return out;
}

torch::Tensor GPTImpl::router_counts(const RouterLog& log) const {
  torch::Tensor out = torch::zeros({dims_.num_experts + 1}, torch::kLong);
  for (const torch::Tensor& c : log.counts) out.narrow(0, 0, dims_.num_experts) += c.to(torch::kCPU, torch::kLong);
  out[dims_.num_experts] = log.rows;
  return out;
}

torch::Tensor GPTImpl::router_terms(const RouterLog& log, const torch::Tensor& routing) {
  const torch::Tensor counts = routing.narrow(0, 0, dims_.num_experts);
  const int64_t rows = routing[dims_.num_experts].item<int64_t>();
  // transformers' load_balancing_loss_func over every sparse layer's R tokens at once: E x sum_e
  // (choices of e / R) x (mean router probability of e), the choices constant (no gradient), the
  // probabilities the router's: this log's layers' probability sums against every layer's counts.
  if (log.prob_sums.empty()) {
    aux_loss_ = z_loss_ = torch::Tensor();
    return torch::zeros({}, torch::kFloat32);
  }
  const auto E = static_cast<double>(dims_.num_experts), R = static_cast<double>(rows);
  const torch::Tensor sums = torch::stack(log.prob_sums).sum(0);  // [E], or [E + 1] with the z-loss's
  const torch::Tensor share = counts.to(sums.device(), torch::kFloat32) / R;
  aux_loss_ = (share * sums.narrow(0, 0, dims_.num_experts)).sum() * (E / R);
  torch::Tensor terms = aux_loss_ * dims_.router_aux_loss_coef;
  z_loss_ = torch::Tensor();
  if (run_.z_loss_coef > 0) {
    z_loss_ = sums[dims_.num_experts] / R;
    terms = terms + z_loss_ * run_.z_loss_coef;
  }
  return terms;
}

torch::Tensor GPTImpl::loss(const torch::Tensor& idx, const torch::Tensor& targets) {
  torch::Tensor loss = lm_loss(idx, targets);
  if (router_log_.prob_sums.empty()) return loss;
  router_terms(router_log_, router_counts(router_log_));  // (aux_loss_, z_loss_)
  loss = loss + aux_loss_ * dims_.router_aux_loss_coef;
  if (z_loss_.defined()) loss = loss + z_loss_ * run_.z_loss_coef;
  count_routed(router_log_);  // (routing bias: the step's load, for update_routing_bias)
  return loss;
}

std::vector<MoEImpl*> GPTImpl::moe_layers() const {
  std::vector<MoEImpl*> out;
  for (size_t i = 0; i < h->size(); ++i)
    if (auto block = (*h)[i]->as<Block>(); block && block->moe) out.push_back(block->moe.get());
  return out;
}

std::vector<int64_t> GPTImpl::held_sparse_rows() const {
  std::vector<int64_t> rows;
  for (int64_t b = 0; b < dims_.n_layer; ++b)
    if (dims_.moe_layer(b) && dims_.holds_block(b)) rows.push_back(dims_.sparse_layers(b));
  return rows;
}

torch::Tensor GPTImpl::routing_bias() const {
  torch::Tensor out = torch::zeros({dims_.sparse_layers(), dims_.num_experts});
  const auto layers = moe_layers();
  const std::vector<int64_t> rows = held_sparse_rows();
  for (size_t i = 0; i < layers.size(); ++i)
    if (layers[i]->routing_bias.defined()) out[rows[i]] = layers[i]->routing_bias.cpu();
  return out;
}

void GPTImpl::set_routing_bias(const torch::Tensor& bias) {
  const auto layers = moe_layers();
  const std::vector<int64_t> rows = held_sparse_rows();
  MPITRAIN_CHECK(bias.dim() == 2 && bias.size(0) == dims_.sparse_layers() && bias.size(1) == dims_.num_experts &&
                     rows.size() == layers.size(),
                 "set_routing_bias: one row of every expert's bias per sparse layer of the whole model");
  for (size_t i = 0; i < layers.size(); ++i) {
    MoEImpl& m = *layers[i];
    m.routing_bias = bias[rows[i]].to(torch::kFloat32).clone();
  }
}

void GPTImpl::count_routed(const RouterLog& log, int64_t chunk) {
  if (!run_.routing_bias || log.counts.empty()) return;
  const size_t layers = moe_layers().size();
  if (routed_since_update_.size() != layers) {
    routed_since_update_.clear();
    for (size_t i = 0; i < layers; ++i) routed_since_update_.push_back(torch::zeros_like(log.counts[0]));
  }
  size_t at = 0;  // this chunk's first sparse layer among the model's (a pipeline stage: its chunks in block order)
  for (int64_t j = 0; j < chunk; ++j)
    at += static_cast<size_t>(dims_.sparse_layers(dims_.chunk_end(j)) - dims_.sparse_layers(dims_.chunk_begin(j)));
  MPITRAIN_CHECK(at + log.counts.size() <= layers, "count_routed: a chunk's sparse layers");
  for (size_t i = 0; i < log.counts.size(); ++i) routed_since_update_[at + i] += log.counts[i];
}

void GPTImpl::update_routing_bias(double rate, Communicator& dp) {
  const auto layers = moe_layers();
  if (!run_.routing_bias || layers.empty() || routed_since_update_.size() != layers.size()) return;  // (none since, or a stage without)
  torch::Tensor load = torch::stack(routed_since_update_).to(torch::kFloat32);  // [layers, E], this rank's tokens
  routed_since_update_.clear();
  dp.all_reduce(load, ReduceOp::sum);
  torch::NoGradGuard no_grad;
  torch::Tensor delta = rate * torch::sign(load.mean(1, /*keepdim=*/true) - load);
  delta = delta - delta.mean(1, /*keepdim=*/true);
  for (size_t i = 0; i < layers.size(); ++i) {
    MoEImpl& m = *layers[i];
    m.routing_bias = m.routing_bias.to(load.device()) + delta[static_cast<int64_t>(i)];
  }
}

double GPTImpl::dropped_share() const {
  if (run_.capacity_factor <= 0 || router_log_.copies == 0) return -1;
  return static_cast<double>(router_log_.dropped) / static_cast<double>(router_log_.copies);
}

std::vector<double> GPTImpl::expert_load() const { return expert_load(router_log_); }

std::vector<double> GPTImpl::expert_load(const RouterLog& log) {
  std::vector<double> load;
  for (const torch::Tensor& c : log.counts) {
    const torch::Tensor f = c.to(torch::kFloat64);
    load.push_back((f.max() / f.mean().clamp_min(1e-12)).item<double>());
  }
  return load;
}

// ---- fused, chunked classifier + cross-entropy -------------------------------------------------

namespace {

// Rows per chunk: `rows` if given, else about 256 MiB of logits. The CUDA kernel keeps a chunk's
// logits in the autocast dtype (no fp32 copy), so 16-bit logits get twice the rows, halving the
// number of chunks and of the [vocab x C] weight-gradient additions between them.
int64_t chunk_rows(const torch::Tensor& h, int64_t vocab, int64_t rows, FusedImpl impl) {
  if (rows > 0) return rows;
  int64_t bytes = 4;
  if (impl == FusedImpl::automatic && fused_kernel_device(h) &&
      c10::elementSize(autocast_dtype_or(h.device().type(), torch::kFloat32)) == 2)
    bytes = 2;
  return std::max<int64_t>(1, ((int64_t{1} << 28) / bytes) / std::max<int64_t>(1, vocab));
}

// Sum over the chunk of logsumexp(logits) - logits[target].
torch::Tensor chunk_loss_sum(const torch::Tensor& logits, const torch::Tensor& lse, const torch::Tensor& t) {
  return (lse - logits.gather(1, t.unsqueeze(1)).squeeze(1)).sum();
}

// One chunk: the sum of its losses and, when `grad_scale` is set, the chunk's logits replaced by
// grad_scale * (softmax - onehot), the gradient of grad_scale * loss sum. On CUDA with the
// kernels built this is one kernel over the logits in their own (autocast) dtype; elsewhere, and
// for a tp rank's slice of the vocabulary, ATen ops over an fp32 copy.
struct ChunkResult {
  torch::Tensor loss_sum, grad;
};

ChunkResult softmax_cross_entropy(torch::Tensor logits, const torch::Tensor& t, std::optional<double> grad_scale,
                                  FusedImpl impl, Communicator* tp, int64_t vocab_start) {
  if (tp) {  // this rank's slice of the chunk's logits (tensor parallel)
    logits = logits.to(torch::kFloat32);
    torch::Tensor loss_sum = vocab_parallel_chunk_loss(logits, t, vocab_start, *tp, grad_scale.value_or(0.0));
    return {loss_sum, grad_scale ? logits : torch::Tensor()};
  }
  if (impl == FusedImpl::automatic && softmax_cross_entropy_kernel_applies(logits)) {
    torch::Tensor targets = t.to(torch::kLong).contiguous();
    torch::Tensor loss = torch::empty({logits.size(0)}, logits.options().dtype(torch::kFloat32));
    fused_softmax_cross_entropy(logits, targets, loss, grad_scale ? *grad_scale : 0.0, grad_scale.has_value());
    return {loss.sum(), grad_scale ? logits : torch::Tensor()};
  }
  logits = logits.to(torch::kFloat32);
  torch::Tensor lse = logits.logsumexp(1);
  torch::Tensor loss_sum = chunk_loss_sum(logits, lse, t);
  if (!grad_scale) return {loss_sum, torch::Tensor()};
  torch::Tensor g = logits.sub_(lse.unsqueeze(1)).exp_();  // in place over the fp32 copy
  g.scatter_add_(1, t.unsqueeze(1), torch::full({t.size(0), 1}, -1.0f, g.options()));
  g.mul_(*grad_scale);
  return {loss_sum, g};
}

// The weight as the chunks' products use it: under 16-bit autocast its 16-bit copy, made once.
// Autocast caches the copies of leaf parameters only, and the output layer reaches the loss as a
// view (narrowed to the live rows, or ZeRO-3's gathered buffer), so autocast cast it again for
// each of a chunk's two products with it: 2 x chunks casts of [vocab x C] per step, 14 for GPT-2
// 124M at 16 x 1024 tokens (the profile's 62 weight casts per step: 48 blocks' + these 14). The
// copy holds the values autocast's casts made, so the products are bitwise the same.
torch::Tensor weight_as_autocast_uses_it(const torch::Tensor& w) {
  const c10::ScalarType low = autocast_dtype_or(w.device().type(), w.scalar_type());
  return w.scalar_type() == torch::kFloat32 && low != torch::kFloat32 ? w.to(low) : w;
}

// grad_w += a b (grad_w starts at zero; `first`: the first product). Under 16-bit autocast on
// CUDA, where libtorch has addmm's out_dtype overload (2.8 and later; CMake looks for it in
// ATen/ops/addmm.h), one GEMM adds the fp32-accumulated product into the fp32 sum as cuBLAS's
// C = A B + C (the first as C = A B): the product is neither rounded to 16 bits nor written out
// and read back (for GPT-2 124M seven [50304 x 768] products per step, each a 16-bit write, then a
// read of it and of the sum and a write of the sum). Elsewhere the product as autocast makes it
// (16-bit there) is added.
void add_product_(torch::Tensor& grad_w, const torch::Tensor& a, const torch::Tensor& b, bool first) {
#ifdef MPITRAIN_ADDMM_OUT_DTYPE
  const c10::ScalarType low = autocast_dtype_or(grad_w.device().type(), torch::kFloat32);
  if (grad_w.is_cuda() && low != torch::kFloat32) {
    at::addmm_out(grad_w, grad_w, a.to(low), b.to(low), torch::kFloat32, first ? 0 : 1, 1);
    return;
  }
#endif
  (void)first;
  grad_w.add_(torch::matmul(a, b));
}

class LinearCrossEntropy : public torch::autograd::Function<LinearCrossEntropy> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& h,
                               const torch::Tensor& w, const torch::Tensor& t, int64_t chunk, int64_t impl,
                               int64_t tp, int64_t vocab_start) {
    const int64_t n = h.size(0), rows = chunk_rows(h, w.size(0), chunk, static_cast<FusedImpl>(impl));
    const double inv_n = 1.0 / static_cast<double>(n);
    torch::Tensor grad_h = torch::empty(h.sizes(), h.options().dtype(torch::kFloat32));
    torch::Tensor grad_w = torch::zeros(w.sizes(), w.options().dtype(torch::kFloat32));
    torch::Tensor total = torch::zeros({}, h.options().dtype(torch::kFloat32));
    const torch::Tensor wu = weight_as_autocast_uses_it(w);
    for (int64_t start = 0; start < n; start += rows) {
      const int64_t len = std::min(rows, n - start);
      auto hc = h.narrow(0, start, len), tc = t.narrow(0, start, len);
      // d(mean loss)/d(logits) = (softmax - onehot) / n, computed over the chunk's logits.
      auto [loss_sum, g] = softmax_cross_entropy(torch::matmul(hc, wu.t()), tc, inv_n, static_cast<FusedImpl>(impl),
                                                 tp ? &comm_from_handle(tp) : nullptr, vocab_start);
      total += loss_sum;
      grad_h.narrow(0, start, len).copy_(torch::matmul(g, wu));
      add_product_(grad_w, g.t(), hc, start == 0);
    }
    ctx->save_for_backward({grad_h, grad_w});
    ctx->saved_data["h_dtype"] = static_cast<int64_t>(h.scalar_type());
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    return total * inv_n;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_out) {
    auto saved = ctx->get_saved_variables();
    const torch::Tensor& g = grad_out[0];
    auto h_dtype = static_cast<torch::ScalarType>(ctx->saved_data["h_dtype"].toInt());
    auto w_dtype = static_cast<torch::ScalarType>(ctx->saved_data["w_dtype"].toInt());
    return {(saved[0] * g).to(h_dtype), (saved[1] * g).to(w_dtype), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                   const torch::Tensor& targets, int64_t rows_override, FusedImpl impl,
                                   Communicator* tp, int64_t vocab_start) {
  if (tp) impl = FusedImpl::reference;  // the kernel needs the whole vocabulary; chunks sized for fp32
  if (torch::GradMode::is_enabled() && (hidden.requires_grad() || weight.requires_grad()))
    return apply_autograd_function<LinearCrossEntropy>(hidden, weight, targets, rows_override, static_cast<int64_t>(impl),
                                                       tp ? comm_handle(*tp) : int64_t{0}, vocab_start);
  // No gradients wanted (evaluation): the loss alone, chunk by chunk.
  const int64_t n = hidden.size(0), rows = chunk_rows(hidden, weight.size(0), rows_override, impl);
  torch::Tensor total = torch::zeros({}, hidden.options().dtype(torch::kFloat32));
  const torch::Tensor wu = weight_as_autocast_uses_it(weight);
  for (int64_t start = 0; start < n; start += rows) {
    const int64_t len = std::min(rows, n - start);
    auto hc = hidden.narrow(0, start, len);
    total += softmax_cross_entropy(torch::matmul(hc, wu.t()), targets.narrow(0, start, len), std::nullopt, impl,
                                   tp, vocab_start)
                 .loss_sum;
  }
  return total / static_cast<double>(n);
}

std::vector<std::pair<std::string, torch::Tensor>> GPTImpl::named_params() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : named_parameters(/*recurse=*/true)) out.emplace_back(item.key(), item.value());
  return out;
}

void GPTImpl::collect_tp_splits() {
  // Full names of parameters or modules. (Its own: named_modules cannot include a module still
  // under construction, not yet held by a shared_ptr.)
  std::vector<std::pair<std::string, TpSplit>> declared = tp_declared();
  for (const auto& item : named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    const auto* module = dynamic_cast<const TpDeclared*>(item.value().get());
    if (!module) continue;
    for (const auto& [local, split] : module->tp_declared()) declared.emplace_back(item.key() + "." + local, split);
  }
  tp_splits_.clear();
  for (const auto& [name, p] : named_params()) {
    TpSplit split = TpSplit::replicated;
    for (const auto& [what, s] : declared)
      if (name == what || (name.size() > what.size() && name.compare(0, what.size(), what) == 0 && name[what.size()] == '.'))
        split = s;
    tp_splits_[name] = split;
  }
}

TpSplit GPTImpl::tp_split(const std::string& name) const {
  const auto it = tp_splits_.find(name);
  MPITRAIN_CHECK(it != tp_splits_.end(), concat("tp_split: the model has no parameter '", name, "'"));
  return it->second;
}

int64_t GPTImpl::num_params() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

// Per sparse layer, (the experts counted by `experts_left_out`) x one expert's parameters.
int64_t GPTImpl::expert_params_times(const std::function<int64_t(const MoEImpl&)>& experts_left_out) const {
  int64_t n = 0;
  for (size_t i = 0; i < h->size(); ++i)
    if (auto block = (*h)[i]->as<Block>(); block && block->moe) {
      const auto& moe = block->moe;
      int64_t expert = 0;
      for (const auto& p : moe->local.front()->parameters()) expert += p.numel();
      n += experts_left_out(*moe) * expert;
    }
  return n;
}

int64_t GPTImpl::remote_expert_params() const {
  return expert_params_times([&](const MoEImpl& moe) { return dims_.num_experts - static_cast<int64_t>(moe.local.size()); });
}

int64_t GPTImpl::inactive_params() const {
  return expert_params_times([&](const MoEImpl&) { return dims_.num_experts - dims_.num_experts_per_tok; });
}

std::vector<int64_t> generate(GPT& model, std::vector<int64_t> tokens, int64_t n, double temperature,
                              int64_t top_k, uint64_t seed, const std::function<torch::Tensor(const torch::Tensor&)>& last_logits) {
  MPITRAIN_CHECK(!tokens.empty(), "generate needs a non-empty prompt");
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  auto gen = at::detail::createCPUGenerator(seed);
  const torch::Device device = model->parameters().front().device();  // (a pipeline stage may have no embedding)
  const int64_t ctx = model->dims().seq_len;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t from = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - ctx);
    torch::Tensor idx = torch::tensor(std::vector<int64_t>(tokens.begin() + from, tokens.end()), torch::kInt64)
                            .view({1, -1})
                            .to(device);
    torch::Tensor logits = (last_logits ? last_logits(idx) : model->forward(idx).select(1, -1).squeeze(0))
                               .to(torch::kCPU, torch::kFloat32);
    logits = logits / temperature;
    if (top_k > 0 && top_k < logits.size(0)) {
      auto kth = std::get<0>(logits.topk(top_k)).index({top_k - 1});
      logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
    }
    torch::Tensor probs = logits.softmax(-1);
    tokens.push_back(at::multinomial(probs, 1, false, gen).item<int64_t>());
  }
  if (was_training) model->train();
  return tokens;
}

std::string decode_bytes(const std::vector<int64_t>& tokens, int64_t eot) {
  std::string out;
  for (int64_t t : tokens) {
    if (t == eot) out += "\n<|endoftext|>\n";
    else if (t == '\n' || t == '\t' || (t >= 32 && t < 256)) out += static_cast<char>(t);
    else out += concat("\\x", std::hex, t);
  }
  return out;
}

}  // namespace mpitrain
