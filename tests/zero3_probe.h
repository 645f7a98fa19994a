// One forward and backward of a small model with a ZeRO-2 GradSync over ZeRO-3's units, with or
// without ParamShards (zero3.h) making the parameters shards: test_comm compares the two on CPU
// ranks, test_gpu on CUDA. Header-only: each test binary compiles its own copy.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mpitrain/amp.h"
#include "mpitrain/comm.h"
#include "mpitrain/grad_sync.h"
#include "mpitrain/model.h"
#include "mpitrain/zero3.h"

namespace mpitrain {

struct Zero3Probe {
  std::vector<torch::Tensor> grad_shards;  // per unit: this rank's averaged gradients (on the CPU)
  torch::Tensor loss;                      // this rank's loss (on the CPU)
  size_t max_whole = 0, whole_after = 0;   // ParamShards' units whole: at most during, and after backward
  bool gather_all_exact = false;  // zero3: after backward, gather_all() gave back the drawn fp32 parameters
};

// The model drawn from seed 3 on `device`; the batch from seed 10 + the rank, so ranks differ.
// `wire` (comm.param_dtype): zero3 gathers in it; without zero3 the weights are rounded to it
// first, which is what a 16-bit gather computes with. `from_host` (zero3): as train's start-up
// does, the model is made on the host without values (GPT deferred), ParamShards makes its units'
// buffers on `device`, and GPT::initialize's draws reach each rank's shards through set_param,
// one parameter at a time: the same values as the model drawn whole.
inline Zero3Probe zero3_probe(const GPTDims& d, const RunOptions& run, Communicator& c, const torch::Device& device, Precision precision,
                              bool zero3, c10::ScalarType wire = torch::kFloat32, bool from_host = false) {
  torch::manual_seed(3);
  const bool deferred = zero3 && from_host;
  GPT model(d, deferred);
  model->apply(run);
  if (!deferred) model->to(device);
  model->train();
  std::vector<torch::Tensor> params, drawn;
  std::vector<std::string> names;
  for (auto& [name, p] : model->named_params())
    params.push_back(p), names.push_back(name), drawn.push_back(deferred ? torch::Tensor() : p.detach().clone());
  if (!zero3 && wire != torch::kFloat32) {
    torch::NoGradGuard no_grad;
    for (auto& p : params) p.copy_(p.to(wire));
  }
  Units units = model_units(names, d.n_layer);
  GradSync sync(params, c, 25, /*overlap=*/true, /*shard=*/true, torch::kFloat32, /*free_grads=*/true, units.groups,
                device);
  std::optional<ParamShards> shards;
  if (zero3) {
    shards.emplace(params, sync, units, /*reshard_after_forward=*/true, wire);
    model->set_unit_hooks(&*shards);
    if (deferred)
      model->initialize([&](size_t k, const torch::Tensor& v) {
        shards->set_param(k, v);
        drawn[k] = v.clone();
      });
  }
  Zero3Probe out;
  torch::manual_seed(10 + c.rank());
  torch::Tensor idx = torch::randint(d.vocab_size, {2, d.seq_len}, torch::kLong).to(device);
  torch::Tensor tgt = torch::randint(d.vocab_size, {2, d.seq_len}, torch::kLong).to(device);
  sync.arm();
  torch::Tensor loss;
  {
    Autocast autocast(precision, device);
    loss = model->loss(idx, tgt);
  }
  out.loss = loss.detach().cpu();
  loss.backward();
  if (shards) out.max_whole = shards->max_units_whole(), out.whole_after = shards->units_whole();
  sync.all_reduce_grads();
  if (shards) {
    WholeParams whole(&*shards);
    out.gather_all_exact = true;
    for (size_t k = 0; k < params.size(); ++k)
      out.gather_all_exact = out.gather_all_exact && torch::equal(params[k].cpu(), drawn[k].cpu());
  }
  for (size_t b = 0; b < sync.num_buckets(); ++b) out.grad_shards.push_back(sync.grad_shard(b).cpu());
  return out;
}

}  // namespace mpitrain
