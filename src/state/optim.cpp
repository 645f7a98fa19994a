// AdamW, gradient clipping and the learning-rate schedule (see optim.h).
#include "mpitrain/optim.h"

#include <algorithm>
#include <cmath>

#include "mpitrain/error.h"
#include "mpitrain/fused_ops.h"
#include "mpitrain/libtorch_version.h"
#include "mpitrain/tensor_parallel.h"

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

namespace {

bool bf16_state_of(const OptimConfig& cfg) {
  MPITRAIN_CHECK(cfg.state_dtype == "fp32" || cfg.state_dtype == "bf16",
                 concat("AdamW: optim.state_dtype '", cfg.state_dtype, "' (fp32 or bf16)"));
  return cfg.state_dtype == "bf16";
}

// splitmix64's constants (as int64 for torch's signed integer tensors, whose products wrap modulo
// 2^64 on every kernel path)
constexpr uint64_t kGoldenU = 0x9E3779B97F4A7C15ULL, kMix1U = 0xBF58476D1CE4E5B9ULL, kMix2U = 0x94D049BB133111EBULL;
constexpr int64_t kGolden = static_cast<int64_t>(kGoldenU);
constexpr int64_t kMix1 = static_cast<int64_t>(kMix1U);
constexpr int64_t kMix2 = static_cast<int64_t>(kMix2U);

// h ^ (h >>> s): a logical shift (torch's >> on int64 copies the sign bit, masked off here)
torch::Tensor xorshift(const torch::Tensor& h, int s) {
  const int64_t low = static_cast<int64_t>((~0ULL) >> s);
  return torch::bitwise_xor(h, torch::bitwise_and(h.__rshift__(s), low));
}

}  // namespace

torch::Tensor round_bf16_stochastic(const torch::Tensor& x, int64_t seed, int64_t key, int64_t begin,
                                    int64_t chunk) {
  MPITRAIN_CHECK(x.scalar_type() == torch::kFloat32, "round_bf16_stochastic: an fp32 tensor");
  torch::NoGradGuard no_grad;
  const torch::Tensor flat = x.detach().contiguous().view({-1});
  torch::Tensor out = torch::empty({flat.numel()}, flat.options().dtype(torch::kBFloat16));
  MPITRAIN_CHECK(chunk > 0, "round_bf16_stochastic: chunk > 0");
  const int64_t salt = static_cast<int64_t>((static_cast<uint64_t>(seed) * kGoldenU) ^
                                            ((static_cast<uint64_t>(key) + 1) * kMix2U));
  for (int64_t at = 0; at < flat.numel(); at += chunk) {
    const int64_t n = std::min(chunk, flat.numel() - at);
    torch::Tensor h = torch::arange(begin + at, begin + at + n, flat.options().dtype(torch::kInt64));
    h = torch::bitwise_xor(h.mul(kGolden), salt);  // splitmix64's finaliser over (index, salt)
    h = xorshift(h, 30).mul_(kMix1);
    h = xorshift(h, 27).mul_(kMix2);
    h = xorshift(h, 31);
    const torch::Tensor r = torch::bitwise_and(h, 0xFFFF).to(torch::kInt32);
    // fp32's bit pattern plus 16 random bits, the low 16 bits cleared: a carry out of them (with
    // probability = the dropped fraction) rounds the magnitude up, which is exact in bf16.
    const torch::Tensor bits = flat.narrow(0, at, n).view(torch::kInt32);
    const torch::Tensor rounded = torch::bitwise_and(bits.add(r), static_cast<int32_t>(0xFFFF0000u));
    out.narrow(0, at, n).copy_(rounded.view(torch::kFloat32));
  }
  return out.view(x.sizes());
}

AdamW::AdamW(std::vector<std::pair<std::string, torch::Tensor>> named_params, const OptimConfig& cfg, bool fused)
    : cfg_(cfg), bf16_state_(bf16_state_of(cfg)), fused_(fused) {
  MPITRAIN_CHECK(!fused_ || named_params.empty() || fused_adamw_available(named_params.front().second.device().type()),
                 concat("AdamW: no fused kernel for these parameters' device in ", libtorch_version()));
  MPITRAIN_CHECK(!fused_ || !bf16_state_, "AdamW: the fused kernel keeps fp32 moments");
  for (size_t k = 0; k < named_params.size(); ++k) add_whole(named_params[k].first, named_params[k].second, k);
}

void AdamW::add_whole(const std::string& name, const torch::Tensor& p, size_t k) {
  key_.push_back(static_cast<int64_t>(k));
  begin_.push_back(0);
  names_.push_back(name);
  params_.push_back(p);
  // The moments in the parameters' dtype (fp32 master weights), or bf16.
  const auto moment = bf16_state_ ? p.options().dtype(torch::kBFloat16) : p.options();
  exp_avg_.push_back(torch::zeros_like(p, moment, torch::MemoryFormat::Contiguous));
  exp_avg_sq_.push_back(torch::zeros_like(p, moment, torch::MemoryFormat::Contiguous));
  // Decay matrices (linear weights, embeddings); biases and LayerNorm gains are 1-D.
  decay_.push_back(p.dim() >= 2);
}

AdamW::AdamW(std::vector<std::pair<std::string, torch::Tensor>> named_params, const GradShards& shards,
             const OptimConfig& cfg, bool fused, const std::vector<torch::Tensor>* param_shards,
             const std::vector<size_t>& whole)
    : cfg_(cfg), bf16_state_(bf16_state_of(cfg)), fused_(fused) {
  MPITRAIN_CHECK(!shards.grads.empty() || named_params.empty(), "AdamW: ZeRO-1 needs a sharded GradSync's shards");
  MPITRAIN_CHECK(!fused_ || named_params.empty() || fused_adamw_available(named_params.front().second.device().type()),
                 concat("AdamW: no fused kernel for these parameters' device in ", libtorch_version()));
  MPITRAIN_CHECK(!fused_ || !bf16_state_, "AdamW: the fused kernel keeps fp32 moments");
  torch::NoGradGuard no_grad;
  for (const torch::Tensor& g : shards.grads) {
    const auto moment = bf16_state_ ? g.options().dtype(torch::kBFloat16) : g.options();
    bucket_exp_avg_.push_back(torch::zeros_like(g, moment));
    bucket_exp_avg_sq_.push_back(torch::zeros_like(g, moment));
  }
  std::vector<size_t> sliced;  // the shards' parameter j is named_params[sliced[j]]
  for (size_t k = 0, w = 0; k < named_params.size(); ++k)
    if (w < whole.size() && whole[w] == k)
      ++w;
    else
      sliced.push_back(k);
  for (const OwnedSlice& s : shards.slices) {
    const auto& [name, p] = named_params.at(sliced.at(s.param));
    key_.push_back(static_cast<int64_t>(sliced[s.param]));
    begin_.push_back(s.begin);
    names_.push_back(name);
    params_.push_back(param_shards ? param_shards->at(s.bucket).narrow(0, s.shard_offset, s.length)
                                   : p.detach().view({-1}).narrow(0, s.begin, s.length));
    grads_.push_back(shards.grads.at(s.bucket).narrow(0, s.shard_offset, s.length));
    exp_avg_.push_back(bucket_exp_avg_[s.bucket].narrow(0, s.shard_offset, s.length));
    exp_avg_sq_.push_back(bucket_exp_avg_sq_[s.bucket].narrow(0, s.shard_offset, s.length));
    decay_.push_back(p.dim() >= 2);  // the whole parameter's shape decides, as unsharded
  }
  for (size_t k : whole)  // held whole, as by the unsharded constructor (no gradient view: .grad())
    add_whole(named_params.at(k).first, named_params.at(k).second, k);
}

int64_t AdamW::state_bytes() const {
  int64_t n = 0;
  for (size_t b = 0; b < bucket_exp_avg_.size(); ++b)  // the slices' moments: views of these
    n += bucket_exp_avg_[b].nbytes() + bucket_exp_avg_sq_[b].nbytes();
  for (size_t i = grads_.size(); i < exp_avg_.size(); ++i) n += exp_avg_[i].nbytes() + exp_avg_sq_[i].nbytes();
  return n;
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
    std::vector<size_t> slot;  // the slot of each entry of p, g, m, v
    for (size_t i = 0; i < params_.size(); ++i) {
      torch::Tensor gi = grad(i);
      if (decay_[i] != decay || !gi.defined()) continue;
      slot.push_back(i);
      p.push_back(params_[i]);
      g.push_back(gi);
      m.push_back(exp_avg_[i]);
      v.push_back(exp_avg_sq_[i]);
    }
    if (p.empty()) continue;
    const double wd = decay ? cfg_.weight_decay : 0.0;
    if (cfg_.name == "sgd") {  // optim.name: sgd: p = p (1 - lr wd) - lr g (the moments stay zero)
      if (wd > 0) at::_foreach_mul_(p, 1.0 - lr * wd);
      at::_foreach_add_(p, g, -lr);
      continue;
    }
    if (bf16_state_) {
      // bf16 moments: each slot's computed in fp32 from the stored values by the foreach path's
      // kernels in its order (one tensor at a time: the fp32 copies of one slot at once), the
      // update made with those fp32 moments, which are then stored stochastically rounded.
      for (size_t j = 0; j < p.size(); ++j) {
        const size_t i = slot[j];
        torch::Tensor mi = m[j].to(torch::kFloat32), vi = v[j].to(torch::kFloat32);
        if (wd > 0) p[j].mul_(1.0 - lr * wd);
        mi.mul_(cfg_.beta1).add_(g[j], 1.0 - cfg_.beta1);
        vi.mul_(cfg_.beta2).addcmul_(g[j], g[j], 1.0 - cfg_.beta2);
        torch::Tensor denom = vi.sqrt();
        denom.div_(bc2_sqrt).add_(cfg_.eps);
        p[j].addcdiv_(mi, denom, -step_size);
        m[j].copy_(round_bf16_stochastic(mi, 2 * t_, key_[i], begin_[i]).view(m[j].sizes()));
        v[j].copy_(round_bf16_stochastic(vi, 2 * t_ + 1, key_[i], begin_[i]).view(v[j].sizes()));
      }
      continue;
    }
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
  // (the slices' gradient shards are overwritten by the next reduce-scatter)
  for (size_t i = grads_.size(); i < params_.size(); ++i) params_[i].mutable_grad() = torch::Tensor();
}

namespace {

// ||g||^2 accumulated in fp64 (sum_of_squares: one kernel over all the gradients on CUDA): the
// global norm then rounds to the same fp32 value however the elements are partitioned (whole
// parameters, or ZeRO's slices summed across ranks), so the clip coefficient, and with it the whole
// run, does not depend on the layout.
torch::Tensor clip_by(std::vector<torch::Tensor>& grads, const torch::Tensor& squared_total, double max_norm) {
  torch::Tensor total = squared_total.sqrt().to(torch::kFloat32).reshape({});
  if (max_norm > 0 && !grads.empty()) {
    // min(1, max_norm / norm) as a device scalar: no host synchronisation; exactly 1 (no change)
    // when the norm is within bounds.
    torch::Tensor coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
    at::_foreach_mul_(grads, coef);  // a few multi-tensor launches instead of one per gradient
#else
    for (auto& g : grads) g.mul_(coef);
#endif
  }
  return total;
}

}  // namespace

torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& params, double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return torch::zeros({}, torch::kFloat32);
  return clip_by(grads, sum_of_squares(grads, grads.front().device()).sum(), max_norm);
}

torch::Tensor clip_sharded_grad_norm_(AdamW& opt, double max_norm, Communicator& group) {
  MPITRAIN_CHECK(opt.sharded(), "clip_sharded_grad_norm_ needs a sharded AdamW");
  torch::NoGradGuard no_grad;
  // Summed on the shards' device, also on a rank that owns no element (the all-reduce below must
  // take the same backend path on every rank).
  std::vector<torch::Tensor> grads;
  for (size_t i = 0; i < opt.size(); ++i) grads.push_back(opt.grad(i));
  torch::Tensor squared = sum_of_squares(grads, opt.bucket_exp_avg(0).device());
  group.all_reduce(squared, ReduceOp::sum);
  return clip_by(grads, squared, max_norm);
}

torch::Tensor clip_tp_grad_norm_(AdamW& opt, const GPT& model, double max_norm, Communicator& tp, Communicator& dp) {
  torch::NoGradGuard no_grad;
  const torch::Device on = (opt.sharded() ? opt.bucket_exp_avg(0) : opt.param(0)).device();
  std::vector<torch::Tensor> grads, counted;  // counted: replicated tensors on tp rank 0 only
  for (size_t i = 0; i < opt.size(); ++i) {
    torch::Tensor g = opt.grad(i);
    if (!g.defined()) continue;
    grads.push_back(g);
    if (tp.rank() == 0 || model->tp_split(opt.name(i)) != TpSplit::replicated) counted.push_back(g);
  }
  torch::Tensor squared = sum_of_squares(counted, on);
  if (opt.sharded()) dp.all_reduce(squared, ReduceOp::sum);
  tp.all_reduce(squared, ReduceOp::sum);
  return clip_by(grads, squared, max_norm);
}

torch::Tensor clip_ep_grad_norm_(AdamW& opt, const std::vector<bool>& expert, double max_norm, Communicator& ep,
                                 Communicator& dp, Communicator* tp, const std::vector<bool>& replicated,
                                 Communicator* pp, std::optional<size_t> elsewhere) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads, counted, slices;  // counted: summed over ep; slices: over dp
  for (size_t i = 0; i < opt.size(); ++i) {
    const torch::Tensor g = opt.grad(i);
    if (!g.defined()) continue;
    grads.push_back(g);
    if (elsewhere == opt.param_index(i)) continue;  // (counted by another stage)
    const bool once = !tp || tp->rank() == 0 || !replicated[opt.param_index(i)];  // (a replicated tensor on tp rank 0)
    if (!opt.holds_whole(i)) {
      if (once) slices.push_back(g);
    } else if ((expert[opt.param_index(i)] || ep.rank() == 0) && once) {
      counted.push_back(g);
    }
  }
  const torch::Device on = (opt.sharded() ? opt.bucket_exp_avg(0) : opt.param(0)).device();
  torch::Tensor squared = sum_of_squares(counted, on);
  ep.all_reduce(squared, ReduceOp::sum);
  if (opt.sharded()) {
    torch::Tensor sliced = sum_of_squares(slices, on);
    dp.all_reduce(sliced, ReduceOp::sum);
    squared = squared + sliced;
  }
  if (tp) tp->all_reduce(squared, ReduceOp::sum);
  if (pp) pp->all_reduce(squared, ReduceOp::sum);
  return clip_by(grads, squared, max_norm);
}

torch::Tensor clip_pp_grad_norm_(const std::vector<torch::Tensor>& grads, const std::vector<bool>& counted,
                                 double max_norm, Communicator& pp, Communicator* sliced, Communicator* tp) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> held, mine;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    held.push_back(grads[i]);
    if (counted[i]) mine.push_back(grads[i]);
  }
  torch::Tensor squared = sum_of_squares(mine, held.empty() ? torch::Device(torch::kCPU) : held.front().device());
  if (sliced) sliced->all_reduce(squared, ReduceOp::sum);
  if (tp) tp->all_reduce(squared, ReduceOp::sum);
  pp.all_reduce(squared, ReduceOp::sum);
  return clip_by(held, squared, max_norm);
}

double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm) {
  return clip_grad_norm_(params, max_norm).item<double>();
}

}  // namespace mpitrain
