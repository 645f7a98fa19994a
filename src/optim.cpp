// AdamW, gradient clipping and the learning-rate schedule (see optim.h).
#include "mpitrain/optim.h"

#include <cmath>

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

AdamW::AdamW(std::vector<std::pair<std::string, torch::Tensor>> named_params, const OptimConfig& cfg)
    : cfg_(cfg) {
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
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor& p = params_[i];
    const torch::Tensor& g = p.grad();
    if (!g.defined()) continue;
    if (decay_[i] && cfg_.weight_decay > 0) p.mul_(1.0 - lr * cfg_.weight_decay);
    exp_avg_[i].mul_(cfg_.beta1).add_(g, 1.0 - cfg_.beta1);
    exp_avg_sq_[i].mul_(cfg_.beta2).addcmul_(g, g, 1.0 - cfg_.beta2);
    torch::Tensor denom = (exp_avg_sq_[i].sqrt() / bc2_sqrt).add_(cfg_.eps);
    p.addcdiv_(exp_avg_[i], denom, -step_size);
  }
}

void AdamW::zero_grad() {
  for (auto& p : params_) p.mutable_grad() = torch::Tensor();
}

double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> norms;
  for (const auto& p : params)
    if (p.grad().defined()) norms.push_back(p.grad().to(torch::kFloat32).norm());
  if (norms.empty()) return 0.0;
  const double total = torch::stack(norms).norm().item<double>();
  if (max_norm > 0 && total > max_norm) {
    const double scale = max_norm / (total + 1e-6);
    for (const auto& p : params)
      if (p.grad().defined()) p.grad().mul_(scale);
  }
  return total;
}

}  // namespace mpitrain
