// Fused residual add + LayerNorm or RMSNorm, bias + GELU, SwiGLU and rotary embeddings as
// autograd functions (see fused_ops.h).
//
// Each op has two implementations of the same formulas: the CUDA kernels of fused_kernels.h
// (only in builds that have them, MPITRAIN_FUSED_KERNELS) and an ATen reference written out op
// by op, which runs on the CPU, for tensors the kernels do not take, and for
// FusedImpl::reference. The backward passes are hand-written rather than derived by autograd so
// that both implementations save the same few tensors and compute the same expressions.
#include "mpitrain/fused_ops.h"

#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <optional>

#include "mpitrain/error.h"

#ifdef MPITRAIN_FUSED_KERNELS
#include "mpitrain/fused_kernels.h"
#ifdef MPITRAIN_FUSED_EMULATION
// tests/test_fused_emu.cpp: this file with the kernels compiled for CPU threads
// (tests/cuda_emu.h), dispatching CPU tensors to them, so that the code below runs without a GPU.
#define MPITRAIN_KERNEL_DEVICE_GUARD(device)
#else
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define MPITRAIN_KERNEL_DEVICE_GUARD(device) c10::cuda::CUDAGuard device_guard(device)
#endif
#endif

namespace mpitrain {

bool fused_kernels_built() {
#ifdef MPITRAIN_FUSED_KERNELS
  return true;
#else
  return false;
#endif
}

bool fused_kernel_device(const torch::Tensor& t) {
#if defined(MPITRAIN_FUSED_EMULATION)
  return t.is_cpu();
#elif defined(MPITRAIN_FUSED_KERNELS)
  return t.is_cuda();
#else
  (void)t;
  return false;
#endif
}

namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

constexpr double kGeluK = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluC = 0.044715;

// Autocast would re-type the reference's ops (and it must not touch the kernels' inputs either):
// inside the functions every dtype is the one the formulas name.
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

int64_t rows_of(const Tensor& t) { return t.numel() / t.size(-1); }

// The reference evaluates the kernels' expressions in their order, and updates intermediates in
// place once their old value is dead: on the CPU each out-of-place op allocates a multi-MB
// temporary that glibc hands back to the OS and page-faults in again. Written out of place, the
// GELU forward pass took 40-70 ms for [16, 128, 512] on one thread, libtorch's gelu 3-4 ms;
// in place it takes 3-4 ms too (the backward pass, 4 temporaries, about 2x libtorch's).

// tanh(k * (u + c*u*u*u)), the GELU's inner term, for u = pre + bias (fp32).
Tensor gelu_tanh_inner(const Tensor& u) {
  Tensor t = u * kGeluC;
  t.mul_(u).mul_(u).add_(u);
  return t.mul_(kGeluK).tanh_();
}

// ---- CUDA kernels (fused_kernels.h) ------------------------------------------------------------

#ifdef MPITRAIN_FUSED_KERNELS

std::optional<kernels::DType> kernel_dtype(c10::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return kernels::DType::f32;
    case torch::kBFloat16: return kernels::DType::bf16;
    case torch::kFloat16: return kernels::DType::f16;
    default: return std::nullopt;
  }
}

// A CUDA tensor on `device` (the parameters are contiguous already; activations are made so).
bool on(const Tensor& t, const torch::Device& device) { return fused_kernel_device(t) && t.device() == device; }

bool fp32_vector(const Tensor& t, int64_t cols, const torch::Device& device) {
  return on(t, device) && t.scalar_type() == torch::kFloat32 && t.dim() == 1 && t.size(0) == cols &&
         t.is_contiguous();
}

void* current_stream(const torch::Device& device) {
#ifdef MPITRAIN_FUSED_EMULATION
  (void)device;
  return nullptr;
#else
  return static_cast<void*>(c10::cuda::getCurrentCUDAStream(device.index()).stream());
#endif
}

void kernel_check(const char* error, const char* kernel, int line) {
  if (error) fail("CUDA", concat(error, " (", kernel, ")"), __FILE__, line);
}

// bias undefined: RMSNorm, which has none.
bool norm_kernel_applies(const Tensor& x, const Tensor& delta, const Tensor& weight, const Tensor& bias,
                         c10::ScalarType out_dtype) {
  const auto& dev = x.device();
  const int64_t cols = x.size(-1);
  return fused_kernel_device(x) && x.numel() > 0 && x.scalar_type() == torch::kFloat32 && fp32_vector(weight, cols, dev) &&
         (!bias.defined() || fp32_vector(bias, cols, dev)) && kernel_dtype(out_dtype) &&
         (!delta.defined() ||
          (on(delta, dev) && delta.sizes() == x.sizes() && kernel_dtype(delta.scalar_type())));
}

bool gelu_kernel_applies(const Tensor& pre, const Tensor& bias) {
  return fused_kernel_device(pre) && pre.numel() > 0 && kernel_dtype(pre.scalar_type()) &&
         fp32_vector(bias, pre.size(-1), pre.device());
}

bool swiglu_kernel_applies(const Tensor& gate, const Tensor& up) {
  return fused_kernel_device(gate) && gate.numel() > 0 && kernel_dtype(gate.scalar_type()) &&
         on(up, gate.device()) && up.scalar_type() == gate.scalar_type();
}

// x [B, T, heads, head_dim]; the tables fp32 [>= T, head_dim], contiguous, on x's device.
bool rotary_kernel_applies(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  auto table = [&](const Tensor& t) {
    return on(t, x.device()) && t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.size(0) >= x.size(1) &&
           t.size(1) == x.size(3) && t.is_contiguous();
  };
  return fused_kernel_device(x) && x.numel() > 0 && kernel_dtype(x.scalar_type()) && table(cos) && table(sin);
}

#endif  // MPITRAIN_FUSED_KERNELS

// ---- residual add + LayerNorm or RMSNorm -------------------------------------------------------

// One function for both norms: bias defined = LayerNorm, undefined = RMSNorm (mean taken as 0,
// no bias). Saved: residual, mean (LayerNorm; undefined for RMSNorm), rstd, weight. mean and
// rstd hold one value per row, as [..., 1] (reference) or [rows] (kernel); the backward passes
// view them as [rows, 1] / [rows].
class AddNorm : public torch::autograd::Function<AddNorm> {
 public:
  static tensor_list forward(AutogradContext* ctx, const Tensor& x, const c10::optional<Tensor>& delta_opt,
                             const Tensor& weight, const c10::optional<Tensor>& bias_opt, double eps,
                             c10::ScalarType out_dtype, FusedImpl impl) {
    NoAutocast no_autocast;
    const Tensor delta = delta_opt.has_value() ? *delta_opt : Tensor();
    const Tensor bias = bias_opt.has_value() ? *bias_opt : Tensor();
    const bool rms = !bias.defined();
    Tensor residual, normed, mean, rstd;
    bool kernel = false;
#ifdef MPITRAIN_FUSED_KERNELS
    kernel = impl == FusedImpl::automatic && norm_kernel_applies(x, delta, weight, bias, out_dtype);
    if (kernel) {
      MPITRAIN_KERNEL_DEVICE_GUARD(x.device());
      const int64_t cols = x.size(-1), rows = rows_of(x);
      const Tensor xc = x.contiguous();
      const Tensor dc = delta.defined() ? delta.contiguous() : Tensor();
      residual = torch::empty(x.sizes(), x.options().dtype(torch::kFloat32));
      normed = torch::empty(x.sizes(), x.options().dtype(out_dtype));
      if (!rms) mean = torch::empty({rows}, x.options().dtype(torch::kFloat32));
      rstd = torch::empty({rows}, x.options().dtype(torch::kFloat32));
      kernel_check(kernels::add_norm_forward(
                       rms ? kernels::NormKind::rms : kernels::NormKind::layer, xc.data_ptr<float>(),
                       dc.defined() ? dc.data_ptr() : nullptr,
                       dc.defined() ? *kernel_dtype(dc.scalar_type()) : kernels::DType::f32,
                       weight.data_ptr<float>(), rms ? nullptr : bias.data_ptr<float>(), static_cast<float>(eps),
                       residual.data_ptr<float>(), normed.data_ptr(), *kernel_dtype(out_dtype),
                       rms ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, cols,
                       current_stream(x.device())),
                   "add_norm_forward", __LINE__);
    }
#else
    (void)impl;
#endif
    if (!kernel) {
      residual = delta.defined() ? x.to(torch::kFloat32) + delta.to(torch::kFloat32) : x.to(torch::kFloat32);
      if (rms) {  // as NormImpl::forward (HF's LlamaRMSNorm): residual * rsqrt(mean(residual^2) + eps) * weight
        rstd = (residual * residual).mean(-1, /*keepdim=*/true).add_(eps).rsqrt_();
        normed = (residual * rstd).mul_(weight).to(out_dtype);
      } else {
        mean = residual.mean(-1, /*keepdim=*/true);
        Tensor centred = residual - mean;
        rstd = (centred * centred).mean(-1, /*keepdim=*/true).add_(eps).rsqrt_();  // biased variance
        normed = centred.mul_(rstd).mul_(weight).add_(bias).to(out_dtype);         // xhat * w + b
      }
    }
    ctx->save_for_backward({residual, mean, rstd, weight});
    ctx->saved_data["kernel"] = kernel;
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["delta_dtype"] =
        static_cast<int64_t>(delta.defined() ? delta.scalar_type() : c10::ScalarType::Undefined);
    ctx->saved_data["normed_dtype"] = static_cast<int64_t>(out_dtype);
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined: no zeros
    return {residual, normed};
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const Tensor &residual = saved[0], &mean = saved[1], &rstd = saved[2], &weight = saved[3];
    const Tensor &d_r = grads[0], &d_n = grads[1];
    const bool rms = ctx->saved_data["rms"].toBool();
    const auto delta_dtype = static_cast<c10::ScalarType>(ctx->saved_data["delta_dtype"].toInt());
    const bool has_delta = delta_dtype != c10::ScalarType::Undefined;
    const int64_t cols = residual.size(-1), rows = rows_of(residual);
    Tensor d_x, d_delta, d_gamma, d_beta;

    if (!d_n.defined()) {  // only the residual output was used: its gradient passes through
      d_x = d_r.defined() ? d_r.to(torch::kFloat32) : torch::zeros_like(residual);
      d_gamma = torch::zeros_like(weight);
      if (!rms) d_beta = torch::zeros_like(weight);
#ifdef MPITRAIN_FUSED_KERNELS
    } else if (ctx->saved_data["kernel"].toBool()) {
      MPITRAIN_KERNEL_DEVICE_GUARD(residual.device());
      const auto normed_dtype = static_cast<c10::ScalarType>(ctx->saved_data["normed_dtype"].toInt());
      const Tensor dn = d_n.to(normed_dtype).contiguous();
      const Tensor dr = d_r.defined() ? d_r.to(torch::kFloat32).contiguous() : Tensor();
      d_x = torch::empty(residual.sizes(), residual.options());
      if (has_delta) d_delta = torch::empty(residual.sizes(), residual.options().dtype(delta_dtype));
      const int64_t blocks = kernels::norm_param_grad_blocks(rows);
      Tensor partials = torch::empty({rms ? 1 : 2, blocks, cols}, residual.options());
      kernel_check(kernels::add_norm_backward(
                       rms ? kernels::NormKind::rms : kernels::NormKind::layer, residual.data_ptr<float>(),
                       rms ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(), weight.data_ptr<float>(),
                       dn.data_ptr(), *kernel_dtype(normed_dtype), dr.defined() ? dr.data_ptr<float>() : nullptr,
                       d_x.data_ptr<float>(), has_delta ? d_delta.data_ptr() : nullptr,
                       has_delta ? *kernel_dtype(delta_dtype) : kernels::DType::f32, partials.data_ptr<float>(),
                       rows, cols, current_stream(residual.device())),
                   "add_norm_backward", __LINE__);
      const Tensor sums = partials.sum(1);  // [1 or 2, cols]
      d_gamma = sums[0];
      if (!rms) d_beta = sums[1];
#endif
    } else {
      // Rows of the [rows, cols] view; mean/rstd as columns whichever shape the forward left.
      // d_residual = rstd * (dxhat - m1 - xhat * m2), m1 = mean(dxhat) (LayerNorm only: RMSNorm's
      // output does not shift with the mean), m2 = mean(dxhat * xhat).
      const Tensor r2 = residual.reshape({rows, cols});
      const Tensor rstd2 = rstd.reshape({rows, 1});
      Tensor xhat = rms ? r2 * rstd2 : (r2 - mean.reshape({rows, 1})).mul_(rstd2);
      const Tensor dn = d_n.to(torch::kFloat32).reshape({rows, cols});
      Tensor dxhat = dn * weight;
      Tensor tmp = dxhat * xhat;
      const Tensor m2 = tmp.mean(-1, /*keepdim=*/true);
      if (!rms) dxhat.sub_(dxhat.mean(-1, /*keepdim=*/true));
      torch::mul_out(tmp, xhat, m2);
      Tensor d_res = dxhat.sub_(tmp).mul_(rstd2);
      if (d_r.defined()) d_res.add_(d_r.to(torch::kFloat32).reshape({rows, cols}));
      d_x = d_res.reshape(residual.sizes());
      d_gamma = torch::mul_out(tmp, dn, xhat).sum(0);
      if (!rms) d_beta = dn.sum(0);
    }
    if (has_delta && !d_delta.defined()) d_delta = d_x.to(delta_dtype);
    // One gradient per forward argument: x, delta, weight, bias, eps, out_dtype, impl.
    return {d_x, d_delta, d_gamma, d_beta, Tensor(), Tensor(), Tensor()};
  }
};

// ---- bias + GELU (tanh approximation) ----------------------------------------------------------

// Saved: pre, bias; u = pre + bias is recomputed in the backward pass.
class BiasGelu : public torch::autograd::Function<BiasGelu> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& pre, const Tensor& bias, FusedImpl impl) {
    NoAutocast no_autocast;
    Tensor out;
    bool kernel = false;
#ifdef MPITRAIN_FUSED_KERNELS
    kernel = impl == FusedImpl::automatic && gelu_kernel_applies(pre, bias);
    if (kernel) {
      MPITRAIN_KERNEL_DEVICE_GUARD(pre.device());
      const Tensor pc = pre.contiguous();
      out = torch::empty(pre.sizes(), pre.options());
      kernel_check(kernels::bias_gelu_forward(pc.data_ptr(), bias.data_ptr<float>(), out.data_ptr(),
                                              *kernel_dtype(pre.scalar_type()), rows_of(pre), pre.size(-1),
                                              current_stream(pre.device())),
                   "bias_gelu_forward", __LINE__);
    }
#else
    (void)impl;
#endif
    if (!kernel) {
      Tensor u = pre.to(torch::kFloat32) + bias;
      const Tensor t = gelu_tanh_inner(u).add_(1.0);
      out = u.mul_(0.5).mul_(t).to(pre.scalar_type());  // 0.5 * u * (1 + t)
    }
    ctx->save_for_backward({pre, bias});
    ctx->saved_data["kernel"] = kernel;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const Tensor &pre = saved[0], &bias = saved[1];
    const int64_t cols = pre.size(-1), rows = rows_of(pre);
    Tensor d_pre, d_bias;
#ifdef MPITRAIN_FUSED_KERNELS
    if (ctx->saved_data["kernel"].toBool()) {
      MPITRAIN_KERNEL_DEVICE_GUARD(pre.device());
      const Tensor pc = pre.contiguous();
      const Tensor dc = grads[0].to(pre.scalar_type()).contiguous();
      d_pre = torch::empty(pre.sizes(), pre.options());
      const int64_t blocks = kernels::bias_gelu_grad_blocks(rows);
      Tensor partials = torch::empty({blocks, cols}, bias.options());
      kernel_check(kernels::bias_gelu_backward(pc.data_ptr(), bias.data_ptr<float>(), dc.data_ptr(),
                                               d_pre.data_ptr(), *kernel_dtype(pre.scalar_type()),
                                               partials.data_ptr<float>(), rows, cols,
                                               current_stream(pre.device())),
                   "bias_gelu_backward", __LINE__);
      d_bias = partials.sum(0);
    }
#endif
    if (!d_pre.defined()) {
      // gelu'(u) = 0.5 * (1 + t) + 0.5 * u * (1 - t * t) * k * (1 + 3c * u * u)
      Tensor u = pre.to(torch::kFloat32) + bias;
      Tensor t = gelu_tanh_inner(u);
      Tensor cubic_grad = u * (3.0 * kGeluC);
      cubic_grad.mul_(u).add_(1.0);
      Tensor tanh_grad = t * t;
      tanh_grad.neg_().add_(1.0);
      const Tensor second = u.mul_(0.5).mul_(tanh_grad).mul_(kGeluK).mul_(cubic_grad);
      const Tensor d = t.add_(1.0).mul_(0.5).add_(second).mul_(grads[0].to(torch::kFloat32));
      d_pre = d.to(pre.scalar_type());
      d_bias = d.reshape({rows, cols}).sum(0);
    }
    return {d_pre, d_bias, Tensor()};
  }
};

// ---- SwiGLU: silu(gate) * up -----------------------------------------------------------------

// Saved: gate, up (the sigmoid is recomputed in the backward pass).
class SwiGlu : public torch::autograd::Function<SwiGlu> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& gate, const Tensor& up, FusedImpl impl) {
    NoAutocast no_autocast;
    Tensor out;
    bool kernel = false;
#ifdef MPITRAIN_FUSED_KERNELS
    kernel = impl == FusedImpl::automatic && swiglu_kernel_applies(gate, up);
    if (kernel) {
      MPITRAIN_KERNEL_DEVICE_GUARD(gate.device());
      const Tensor gc = gate.contiguous(), uc = up.contiguous();
      out = torch::empty(gate.sizes(), gate.options());
      kernel_check(kernels::swiglu_forward(gc.data_ptr(), uc.data_ptr(), out.data_ptr(),
                                           *kernel_dtype(gate.scalar_type()), gate.numel(),
                                           current_stream(gate.device())),
                   "swiglu_forward", __LINE__);
    }
#else
    (void)impl;
#endif
    if (!kernel) {
      const Tensor g = gate.to(torch::kFloat32);
      out = torch::sigmoid(g).mul_(g).mul_(up.to(torch::kFloat32)).to(gate.scalar_type());  // silu(g) * up
    }
    ctx->save_for_backward({gate, up});
    ctx->saved_data["kernel"] = kernel;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const Tensor &gate = saved[0], &up = saved[1];
    Tensor d_gate, d_up;
#ifdef MPITRAIN_FUSED_KERNELS
    if (ctx->saved_data["kernel"].toBool()) {
      MPITRAIN_KERNEL_DEVICE_GUARD(gate.device());
      const Tensor gc = gate.contiguous(), uc = up.contiguous();
      const Tensor dc = grads[0].to(gate.scalar_type()).contiguous();
      d_gate = torch::empty(gate.sizes(), gate.options());
      d_up = torch::empty(gate.sizes(), gate.options());
      kernel_check(kernels::swiglu_backward(gc.data_ptr(), uc.data_ptr(), dc.data_ptr(), d_gate.data_ptr(),
                                            d_up.data_ptr(), *kernel_dtype(gate.scalar_type()), gate.numel(),
                                            current_stream(gate.device())),
                   "swiglu_backward", __LINE__);
    }
#endif
    if (!d_gate.defined()) {
      // d_up = d * silu(g); d_gate = d * up * s * (1 + g * (1 - s)), s = sigmoid(g).
      const Tensor g = gate.to(torch::kFloat32), d = grads[0].to(torch::kFloat32);
      const Tensor s = torch::sigmoid(g);
      d_up = (d * g).mul_(s).to(up.scalar_type());
      Tensor t = 1 - s;
      t.mul_(g).add_(1.0);
      d_gate = (d * up.to(torch::kFloat32)).mul_(s).mul_(t).to(gate.scalar_type());
    }
    return {d_gate, d_up, Tensor()};
  }
};

// ---- rotary embedding (half-split layout) -----------------------------------------------------

// The reference is the unfused ops of Rotary::apply (model.cpp) on the [B, T, heads, head_dim]
// layout, and its backward pass the one autograd derives for them, so both round alike.
// Saved: cos, sin (x is not needed: the rotation is linear).
class RotaryEmbedding : public torch::autograd::Function<RotaryEmbedding> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& cos, const Tensor& sin, FusedImpl impl) {
    NoAutocast no_autocast;
    bool kernel = false;
#ifdef MPITRAIN_FUSED_KERNELS
    kernel = impl == FusedImpl::automatic && rotary_kernel_applies(x, cos, sin);
#else
    (void)impl;
#endif
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["kernel"] = kernel;
    return rotate(x, cos, sin, kernel, /*inverse=*/false);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const bool kernel = ctx->saved_data["kernel"].toBool();
    return {rotate(grads[0], saved[0], saved[1], kernel, /*inverse=*/true), Tensor(), Tensor(), Tensor()};
  }

 private:
  // x cos + rotate_half(x) sin, or with inverse its transpose, rotate_half^T(x sin) + x cos.
  static Tensor rotate(const Tensor& x, const Tensor& cos, const Tensor& sin, bool kernel, bool inverse) {
    const int64_t T = x.size(1), D = x.size(3), half = D / 2;
#ifdef MPITRAIN_FUSED_KERNELS
    if (kernel) {
      MPITRAIN_KERNEL_DEVICE_GUARD(x.device());
      const Tensor xc = x.contiguous();
      Tensor out = torch::empty(x.sizes(), x.options());
      kernel_check(kernels::rotary(xc.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr(),
                                   *kernel_dtype(x.scalar_type()), inverse, rows_of(x), T, x.size(2), D,
                                   current_stream(x.device())),
                   "rotary", __LINE__);
      return out;
    }
#else
    (void)kernel;
#endif
    const Tensor c = cos.narrow(0, 0, T).to(x.scalar_type()).view({T, 1, D});
    const Tensor s = sin.narrow(0, 0, T).to(x.scalar_type()).view({T, 1, D});
    if (!inverse) return x * c + torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1) * s;
    const Tensor xs = x * s;  // the gradient of rotate_half(x) * sin, then rotate_half's transpose
    return x * c + torch::cat({xs.narrow(-1, half, half), -xs.narrow(-1, 0, half)}, -1);
  }
};

}  // namespace

namespace {

std::pair<torch::Tensor, torch::Tensor> add_norm(const char* what, const torch::Tensor& x, const torch::Tensor& delta,
                                                 const torch::Tensor& weight, const torch::Tensor& bias, double eps,
                                                 c10::ScalarType out_dtype, FusedImpl impl) {
  const int64_t cols = x.size(-1);
  MPITRAIN_CHECK(weight.dim() == 1 && weight.size(0) == cols && (!bias.defined() || bias.sizes() == weight.sizes()),
                 concat(what, ": weight", bias.defined() ? " and bias" : "", " must be [", cols, "]"));
  MPITRAIN_CHECK(!delta.defined() || delta.sizes() == x.sizes(), concat(what, ": delta must have x's shape"));
  auto opt = [](const torch::Tensor& t) { return t.defined() ? c10::optional<Tensor>(t) : c10::nullopt; };
  auto out = apply_autograd_function<AddNorm>(x, opt(delta), weight, opt(bias), eps, out_dtype, impl);
  return {out[0], out[1]};
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> add_layernorm(const torch::Tensor& x, const torch::Tensor& delta,
                                                      const torch::Tensor& weight, const torch::Tensor& bias,
                                                      double eps, c10::ScalarType out_dtype, FusedImpl impl) {
  MPITRAIN_CHECK(bias.defined(), "add_layernorm: bias must be defined (add_rmsnorm has none)");
  return add_norm("add_layernorm", x, delta, weight, bias, eps, out_dtype, impl);
}

std::pair<torch::Tensor, torch::Tensor> add_rmsnorm(const torch::Tensor& x, const torch::Tensor& delta,
                                                    const torch::Tensor& weight, double eps, c10::ScalarType out_dtype,
                                                    FusedImpl impl) {
  return add_norm("add_rmsnorm", x, delta, weight, torch::Tensor(), eps, out_dtype, impl);
}

torch::Tensor bias_gelu(const torch::Tensor& pre, const torch::Tensor& bias, FusedImpl impl) {
  MPITRAIN_CHECK(bias.dim() == 1 && bias.size(0) == pre.size(-1),
                 concat("bias_gelu: bias must be [", pre.size(-1), "]"));
  return apply_autograd_function<BiasGelu>(pre, bias, impl);
}

torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up, FusedImpl impl) {
  MPITRAIN_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
                 "swiglu: gate and up must have the same shape and dtype");
  return apply_autograd_function<SwiGlu>(gate, up, impl);
}

torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, FusedImpl impl) {
  MPITRAIN_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, "rotary: x must be [B, T, heads, head_dim], head_dim even");
  for (const auto* t : {&cos, &sin})
    MPITRAIN_CHECK(t->dim() == 2 && t->size(0) >= x.size(1) && t->size(1) == x.size(3) &&
                       t->scalar_type() == torch::kFloat32,
                   concat("rotary: cos and sin must be fp32 [>= ", x.size(1), ", ", x.size(3), "]"));
  return apply_autograd_function<RotaryEmbedding>(x, cos, sin, impl);
}

torch::Tensor sum_of_squares(const std::vector<torch::Tensor>& ts, const torch::Device& device, FusedImpl impl) {
  torch::NoGradGuard no_grad;
  const torch::Device on_device = ts.empty() ? device : ts.front().device();
#ifdef MPITRAIN_FUSED_KERNELS
  const bool kernel = impl == FusedImpl::automatic && !ts.empty() &&
                      std::all_of(ts.begin(), ts.end(), [&](const Tensor& t) {
                        return on(t, on_device) && t.scalar_type() == torch::kFloat32 && t.is_contiguous();
                      });
  if (kernel) {
    std::vector<const float*> x;
    std::vector<int64_t> numel;
    for (const auto& t : ts) x.push_back(t.data_ptr<float>()), numel.push_back(t.numel());
    const int n = static_cast<int>(ts.size());
    const int64_t blocks = kernels::sum_squares_partials(numel.data(), n);
    if (blocks == 0) return torch::zeros({1}, torch::dtype(torch::kFloat64).device(on_device));
    Tensor partials = torch::empty({blocks}, torch::dtype(torch::kFloat64).device(on_device));
    MPITRAIN_KERNEL_DEVICE_GUARD(on_device);
    kernel_check(kernels::sum_squares(x.data(), numel.data(), n, partials.data_ptr<double>(), current_stream(on_device)),
                 "sum_squares", __LINE__);
    return partials.sum().reshape({1});
  }
#else
  (void)impl;
#endif
  Tensor sum = torch::zeros({1}, torch::dtype(torch::kFloat64).device(on_device));
  for (const auto& t : ts) sum += at::linalg_vector_norm(t, 2, c10::nullopt, false, torch::kFloat64).square();
  return sum;
}

bool softmax_cross_entropy_kernel_applies(const torch::Tensor& logits) {
#ifdef MPITRAIN_FUSED_KERNELS
  return fused_kernel_device(logits) && logits.dim() == 2 && logits.is_contiguous() &&
         kernel_dtype(logits.scalar_type()).has_value();
#else
  (void)logits;
  return false;
#endif
}

void fused_softmax_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets, const torch::Tensor& loss,
                                 double grad_scale, bool with_grad) {
#ifdef MPITRAIN_FUSED_KERNELS
  const auto dt = kernel_dtype(logits.scalar_type());
  MPITRAIN_CHECK(softmax_cross_entropy_kernel_applies(logits) && targets.scalar_type() == torch::kLong &&
                     targets.is_contiguous() && targets.numel() == logits.size(0) && on(targets, logits.device()) &&
                     loss.scalar_type() == torch::kFloat32 && loss.is_contiguous() && loss.numel() == logits.size(0) &&
                     on(loss, logits.device()),
                 "fused_softmax_cross_entropy: contiguous CUDA logits [rows, vocab] (fp32/bf16/fp16), int64 "
                 "targets [rows] and fp32 loss [rows] on the same device");
  MPITRAIN_KERNEL_DEVICE_GUARD(logits.device());
  kernel_check(kernels::softmax_cross_entropy(logits.data_ptr(), *dt, targets.data_ptr<int64_t>(),
                                              loss.data_ptr<float>(), static_cast<float>(grad_scale), with_grad,
                                              logits.size(0), logits.size(1), current_stream(logits.device())),
               "softmax_cross_entropy", __LINE__);
#else
  (void)logits, (void)targets, (void)loss, (void)grad_scale, (void)with_grad;
  throw Error("fused_softmax_cross_entropy: this build has no CUDA kernels (fused_kernels_built() is false)");
#endif
}

}  // namespace mpitrain
