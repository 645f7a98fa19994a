// Autocast regions and loss scaling (see amp.h).
#include "mpitrain/amp.h"

#include <ATen/autocast_mode.h>

#include <cmath>

#include "mpitrain/error.h"

namespace mpitrain {

Precision parse_precision(const std::string& name) {
  if (name == "fp32") return Precision::fp32;
  if (name == "bf16") return Precision::bf16;
  if (name == "fp16") return Precision::fp16;
  throw UsageError(concat("train.precision: must be one of fp32|bf16|fp16, got '", name, "'"));
}

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::fp32: return "fp32";
    case Precision::bf16: return "bf16";
    case Precision::fp16: return "fp16";
  }
  return "?";
}

c10::ScalarType precision_dtype(Precision p) {
  return p == Precision::bf16 ? torch::kBFloat16 : p == Precision::fp16 ? torch::kFloat16 : torch::kFloat;
}

// libtorch 2.4 made autocast's switches per device type; 1.13 (Debian) has one per backend.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define MPITRAIN_AUTOCAST_BY_DEVICE_TYPE 1
#endif

namespace {

bool autocast_enabled(c10::DeviceType type) {
#ifdef MPITRAIN_AUTOCAST_BY_DEVICE_TYPE
  return at::autocast::is_autocast_enabled(type);
#else
  return type == c10::DeviceType::CUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}

void set_autocast_enabled(c10::DeviceType type, bool on) {
#ifdef MPITRAIN_AUTOCAST_BY_DEVICE_TYPE
  at::autocast::set_autocast_enabled(type, on);
#else
  if (type == c10::DeviceType::CUDA) at::autocast::set_enabled(on);
  else at::autocast::set_cpu_enabled(on);
#endif
}

c10::ScalarType autocast_dtype(c10::DeviceType type) {
#ifdef MPITRAIN_AUTOCAST_BY_DEVICE_TYPE
  return at::autocast::get_autocast_dtype(type);
#else
  return type == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype()
                                       : at::autocast::get_autocast_cpu_dtype();
#endif
}

void set_autocast_dtype(c10::DeviceType type, c10::ScalarType dtype) {
#ifdef MPITRAIN_AUTOCAST_BY_DEVICE_TYPE
  at::autocast::set_autocast_dtype(type, dtype);
#else
  if (type == c10::DeviceType::CUDA) at::autocast::set_autocast_gpu_dtype(dtype);
  else at::autocast::set_autocast_cpu_dtype(dtype);
#endif
}

}  // namespace

c10::ScalarType autocast_dtype_or(c10::DeviceType type, c10::ScalarType fallback) {
  return autocast_enabled(type) ? autocast_dtype(type) : fallback;
}

Autocast::Autocast(Precision p, const torch::Device& device) {
  if (p == Precision::fp32) return;
  if (p == Precision::fp16 && !device.is_cuda())
    throw UsageError("train.precision: fp16 needs a CUDA device (CPU autocast supports bf16 only)");
  type_ = device.type();
  was_enabled_ = autocast_enabled(type_);
  was_dtype_ = autocast_dtype(type_);
  set_autocast_enabled(type_, true);
  set_autocast_dtype(type_, precision_dtype(p));
  at::autocast::increment_nesting();
  active_ = true;
}

Autocast::~Autocast() {
  if (!active_) return;
  // Leaving the outermost region drops autocast's cache of low-precision weight copies, which
  // would otherwise be stale after the optimizer step.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  set_autocast_enabled(type_, was_enabled_);
  set_autocast_dtype(type_, was_dtype_);
}

LossScaler::LossScaler(bool enabled, double init_scale, int64_t growth_interval)
    : enabled_(enabled), scale_(enabled ? init_scale : 1.0), growth_interval_(growth_interval) {}

void LossScaler::restore(double scale, int64_t good_steps) {
  if (!enabled_) return;
  if (!(scale > 0) || !std::isfinite(scale)) return;  // a checkpoint from an fp32/bf16 run: keep ours
  scale_ = scale;
  good_steps_ = good_steps;
}

torch::Tensor LossScaler::scale_loss(const torch::Tensor& loss) const {
  return enabled_ ? loss * scale_ : loss;
}

// Divides each gradient by the scale; one 0-dim "all finite" flag per gradient.
std::vector<torch::Tensor> LossScaler::unscale(const std::vector<torch::Tensor>& grads) const {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> finite;
  for (const auto& g : grads) {
    g.mul_(1.0 / scale_);
    finite.push_back(g.isfinite().all());
  }
  return finite;
}

bool LossScaler::unscale_and_check(const std::vector<torch::Tensor>& params) {
  if (!enabled_) return true;
  std::vector<torch::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  const std::vector<torch::Tensor> finite = unscale(grads);
  return finite.empty() || torch::stack(finite).all().item<bool>();
}

bool LossScaler::unscale_and_check(const std::vector<torch::Tensor>& grads, Communicator& group,
                                   const torch::Device& device) {
  if (!enabled_) return true;
  const std::vector<torch::Tensor> finite = unscale(grads);
  torch::Tensor ok = torch::ones({1}, torch::dtype(torch::kFloat32).device(device));
  if (!finite.empty()) ok = torch::stack(finite).all().to(torch::kFloat32).reshape({1});
  group.all_reduce(ok, ReduceOp::min);
  return ok.item<float>() > 0.5f;
}

void LossScaler::update(bool finite) {
  if (!enabled_) return;
  if (!finite) {
    scale_ = std::max(scale_ / 2.0, 1.0);
    good_steps_ = 0;
  } else if (++good_steps_ >= growth_interval_) {
    scale_ *= 2.0;
    good_steps_ = 0;
  }
}

}  // namespace mpitrain
