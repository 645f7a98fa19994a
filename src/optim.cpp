// AdamW, gradient clipping and the learning-rate schedule (see optim.h).
#include "mpitrain/optim.h"

#include <cmath>

#include "mpitrain/error.h"

namespace mpitrain {

double lr_at(const OptimConfig& cfg, int64_t total_steps, int64_t step) {
  if (step < cfg.warmup_steps)
    return cfg.lr * static_cast<double>(step + 1) / static_cast<double>(cfg.warmup_steps);
  const int64_t decay_steps = total_steps - cfg.warmup_steps;
  if (decay_steps <= 1) return cfg.lr;
  const double progress =
      std::min(1.0, static_cast<double>(step - cfg.warmup_steps) / static_cast<double>(decay_steps - 1));
  const double coeff = 0.5 * (1.0 + std::cos(M_PI * progress));  // 1 -> 0
  return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr);
}

bool fused_adamw_available(torch::DeviceType device) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  if (device == torch::kCPU) return true;
#endif
#if defined(MPITRAIN_TORCH_CUDA) && TORCH_VERSION_MAJOR >= 2
  if (device == torch::kCUDA) return true;
#endif
  (void)device;
  return false;
}

std::string libtorch_version() {
  return concat("libtorch ", TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR, ".", TORCH_VERSION_PATCH);
}

AdamW::AdamW(std::vector<std::pair<std::string, torch::Tensor>> named_params, const OptimConfig& cfg, bool fused)
    : cfg_(cfg), fused_(fused) {
  MPITRAIN_CHECK(!fused_ || named_params.empty() || fused_adamw_available(named_params.front().second.device().type()),
                 concat("AdamW: no fused kernel for these parameters' device in ", libtorch_version()));
  for (auto& [name, p] : named_params) {
    names_.push_back(name);
    params_.push_back(p);
    exp_avg_.push_back(torch::zeros_like(p, torch::MemoryFormat::Contiguous));
    exp_avg_sq_.push_back(torch::zeros_like(p, torch::MemoryFormat::Contiguous));
    // Decay matrices (linear weights, embeddings); biases and LayerNorm gains are 1-D.
    decay_.push_back(p.dim() >= 2);
  }
}

void AdamW::step(double lr) {
  torch::NoGradGuard no_grad;
  ++t_;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, static_cast<double>(t_));
  const double bc2 = 1.0 - std::pow(cfg_.beta2, static_cast<double>(t_));
  const double step_size = lr / bc1;
  const double bc2_sqrt = std::sqrt(bc2);
  // Two groups (with and without weight decay), each updated by one fused kernel or by
  // multi-tensor kernels: a handful of launches per step instead of six per parameter. On CPU the
  // foreach ops loop over the same per-tensor kernels, so results equal the textbook
  // per-parameter loop bit for bit.
  for (bool decay : {true, false}) {
    std::vector<torch::Tensor> p, g, m, v;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (decay_[i] != decay || !params_[i].grad().defined()) continue;
      p.push_back(params_[i]);
      g.push_back(params_[i].grad());
      m.push_back(exp_avg_[i]);
      v.push_back(exp_avg_sq_[i]);
    }
    if (p.empty()) continue;
    const double wd = decay ? cfg_.weight_decay : 0.0;
#if TORCH_VERSION_MAJOR >= 2
    if (fused_) {  // one kernel for the whole group, as torch.optim.AdamW(fused=True)
      if (!step_tensor_.defined() || step_tensor_.device() != p.front().device())
        step_tensor_ = torch::zeros({}, torch::dtype(torch::kFloat32).device(p.front().device()));
      step_tensor_.fill_(static_cast<double>(t_));
      std::vector<torch::Tensor> steps(p.size(), step_tensor_);
      at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, steps, lr, cfg_.beta1, cfg_.beta2, wd, cfg_.eps,
                        /*amsgrad=*/false, /*maximize=*/false);
      continue;
    }
#endif
    if (wd > 0) at::_foreach_mul_(p, 1.0 - lr * wd);
    at::_foreach_mul_(m, cfg_.beta1);
    at::_foreach_add_(m, g, 1.0 - cfg_.beta1);
    at::_foreach_mul_(v, cfg_.beta2);
    at::_foreach_addcmul_(v, g, g, 1.0 - cfg_.beta2);
    std::vector<torch::Tensor> denom = at::_foreach_sqrt(v);
    at::_foreach_div_(denom, bc2_sqrt);
    at::_foreach_add_(denom, cfg_.eps);
    at::_foreach_addcdiv_(p, m, denom, -step_size);
  }
}

void AdamW::zero_grad() {
  for (auto& p : params_) p.mutable_grad() = torch::Tensor();
}

torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& params, double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads, norms;
  for (const auto& p : params)
    if (p.grad().defined()) {
      grads.push_back(p.grad());
      norms.push_back(p.grad().to(torch::kFloat32).norm());
    }
  if (grads.empty()) return torch::zeros({}, torch::kFloat32);
  torch::Tensor total = torch::stack(norms).norm();
  if (max_norm > 0) {
    // min(1, max_norm / norm) as a device scalar: no host synchronisation; exactly 1 (no change)
    // when the norm is within bounds.
    torch::Tensor coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
    for (auto& g : grads) g.mul_(coef);
  }
  return total;
}

double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm) {
  return clip_grad_norm_(params, max_norm).item<double>();
}

}  // namespace mpitrain
