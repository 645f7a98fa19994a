// Mixed precision: autocast regions and dynamic loss scaling (train.precision, docs/config.md).
//
// Parameters, gradients and AdamW state stay fp32 (the "master weights"); inside an Autocast
// region matrix multiplies run in bf16 or fp16 with fp32 accumulation, as torch.autocast does.
// fp16 needs loss scaling because its small range flushes small gradients to zero: the loss is
// multiplied by `scale` before backward, the gradients divided by it after the all-reduce; a
// step whose gradients hold inf/NaN is skipped and the scale halved, and after
// `growth_interval` good steps in a row it doubles.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "mpitrain/comm.h"

namespace mpitrain {

enum class Precision { fp32, bf16, fp16 };
Precision parse_precision(const std::string& name);  // fp32 | bf16 | fp16 (validated by config)
const char* precision_name(Precision p);
c10::ScalarType precision_dtype(Precision p);  // what autocast computes matmuls in: float, bf16, half

// The dtype autocast computes in on `type` when autocast is enabled there, else `fallback`.
c10::ScalarType autocast_dtype_or(c10::DeviceType type, c10::ScalarType fallback);

// Autocast to the precision's dtype on `device`'s type for the object's lifetime (fp32: nothing).
class Autocast {
 public:
  Autocast(Precision p, const torch::Device& device);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  bool active_ = false;
  bool was_enabled_ = false;
  c10::ScalarType was_dtype_ = c10::ScalarType::Undefined;
  c10::DeviceType type_ = c10::DeviceType::CPU;
};

class LossScaler {
 public:
  explicit LossScaler(bool enabled, double init_scale = 65536.0, int64_t growth_interval = 2000);

  bool enabled() const { return enabled_; }
  double scale() const { return scale_; }
  int64_t good_steps() const { return good_steps_; }
  void restore(double scale, int64_t good_steps);  // from a checkpoint

  // loss * scale (the loss itself when disabled).
  torch::Tensor scale_loss(const torch::Tensor& loss) const;
  // Divides every gradient by the scale and reports whether all are finite (one host
  // synchronisation per step, fp16 only). Disabled: true, nothing touched.
  bool unscale_and_check(const std::vector<torch::Tensor>& params);
  // ZeRO-1: the same for `grads`, this rank's disjoint part of the averaged gradients; the
  // verdict is agreed over `group` (every rank of it skips the step or none) on `device`.
  bool unscale_and_check(const std::vector<torch::Tensor>& grads, Communicator& group, const torch::Device& device);
  // Halves the scale after an overflow, doubles it after growth_interval good steps.
  void update(bool finite);

 private:
  std::vector<torch::Tensor> unscale(const std::vector<torch::Tensor>& grads) const;

  bool enabled_;
  double scale_;
  int64_t growth_interval_;
  int64_t good_steps_ = 0;
};

}  // namespace mpitrain
