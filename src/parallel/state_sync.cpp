// Checkpoint state across ranks: ZeRO-1 gather and scatter, RNG streams, resume (see state_sync.h).
#include "mpitrain/state_sync.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <mutex>
#include <optional>
#include <tuple>

#include "mpitrain/durable.h"
#include "mpitrain/error.h"
#include "mpitrain/h5.h"
#include "mpitrain/log.h"
#include "mpitrain/mpi_env.h"
#include "mpitrain/tensor_io.h"
#include "mpitrain/pipeline.h"
#include "mpitrain/tensor_parallel.h"
#include "mpitrain/watchdog.h"

namespace mpitrain {
namespace {

// A generator's state as bytes (torch's own serialisation).
std::vector<uint8_t> generator_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  torch::Tensor s = gen.get_state();
  return std::vector<uint8_t>(s.data_ptr<uint8_t>(), s.data_ptr<uint8_t>() + s.numel());
}

void set_generator_state(at::Generator gen, const uint8_t* bytes, size_t n) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  torch::Tensor s = torch::empty({static_cast<int64_t>(n)}, torch::kUInt8);
  std::memcpy(s.data_ptr<uint8_t>(), bytes, n);
  gen.set_state(s);
}

// This rank's RNG state: the CPU generator's, followed on a GPU by the device generator's
// (dropout on the GPU draws from the latter).
std::vector<uint8_t> rng_state(const torch::Device& device) {
  std::vector<uint8_t> bytes = generator_state(at::detail::getDefaultCPUGenerator());
  if (device.is_cuda()) {
    auto gpu = generator_state(at::globalContext().defaultGenerator(device));
    bytes.insert(bytes.end(), gpu.begin(), gpu.end());
  }
  return bytes;
}

// Restores rng_state(device)'s bytes; false (nothing changed) when they were written on another
// kind of device (a CPU checkpoint resumed on a GPU or the reverse).
bool set_rng_state(const std::vector<uint8_t>& bytes, const torch::Device& device) {
  const size_t cpu = generator_state(at::detail::getDefaultCPUGenerator()).size();
  const size_t gpu = device.is_cuda() ? generator_state(at::globalContext().defaultGenerator(device)).size() : 0;
  if (bytes.size() != cpu + gpu) return false;
  set_generator_state(at::detail::getDefaultCPUGenerator(), bytes.data(), cpu);
  if (gpu > 0) set_generator_state(at::globalContext().defaultGenerator(device), bytes.data() + cpu, gpu);
  return true;
}

// Bucket b of `shards`' padded layout, assembled on rank 0 from whole tensors (`whole_of(k)`:
// parameter k's, called on rank 0 only) under agree() over `mpi_comm`, so that a read failing
// there ends every rank instead of leaving them in the broadcast; then broadcast over the world,
// each rank keeping its part (its place in the shards' communicator) in `mine`; with `keep`
// false a rank takes nothing (the bucket is another tp rank's).
template <class WholeOf>
void scatter_bucket(const GradSync& shards, size_t b, WholeOf&& whole_of, const torch::Tensor& mine,
                    Communicator& world, MpiComm mpi_comm, bool keep = true) {
  torch::Tensor bucket = torch::zeros({shards.padded_length(b)}, mine.options());
  agree(mpi_comm, [&] {
    if (world.rank() != 0) return;
    for (size_t k : shards.bucket_params(b)) {
      const torch::Tensor src = whole_of(k);
      bucket.narrow(0, shards.flat_offset(k), src.numel()).copy_(src.detach().reshape({-1}));
    }
  });
  // Over the world, not the shards' dp group: with DiLoCo's islands every island's dp group
  // takes its parts of the one copy rank 0 read (without islands at tp 1 the two are the same).
  world.broadcast(bucket, 0);
  const int part = shards.communicator().rank();
  if (keep) mine.copy_(bucket.narrow(0, part * mine.numel(), mine.numel()));
}

// Sharded AdamW at tp 1 (ZeRO-1/2/3): rank 0 reads each bucket's moments (and under ZeRO-3,
// `param_shards` given, first its parameters) from the checkpoint (`file`, verified whole
// already; null elsewhere), one tensor at a time, into the bucket's padded buffer, which goes to
// every rank, each keeping its part: rank 0 holds one bucket's buffer and one tensor, never the
// whole model's state.
void scatter_from_file(CheckpointParams* file, const std::vector<torch::Tensor>* param_shards, AdamW& opt,
                       const GradSync& shards, Communicator& world, MpiComm mpi_comm) {
  using Part = CheckpointParams::Part;
  for (size_t b = 0; b < shards.num_buckets(); ++b)
    for (Part part : {Part::param, Part::exp_avg, Part::exp_avg_sq}) {
      if (part == Part::param && !param_shards) continue;
      const torch::Tensor& mine = part == Part::param     ? param_shards->at(b)
                                  : part == Part::exp_avg ? opt.bucket_exp_avg(b)
                                                          : opt.bucket_exp_avg_sq(b);
      scatter_bucket(shards, b, [&](size_t k) { return file->read(k, part); }, mine, world, mpi_comm);
    }
}

// Rank 0's value of `dest` from the checkpoint (`file`, null elsewhere), then on every rank.
void broadcast_from_file(CheckpointParams* file, size_t k, CheckpointParams::Part part, torch::Tensor dest,
                         Communicator& comm, MpiComm mpi_comm) {
  agree(mpi_comm, [&] {
    if (file) dest.copy_(file->read(k, part));
  });
  comm.broadcast(dest, 0);
}

// Tensor parallel resume: rank 0 reads each whole parameter and its moments from the checkpoint
// (`file`, verified whole already; null elsewhere), one tensor at a time, and they go to every
// rank over `comm` (the world); each rank keeps its tp shard of them: its parameters, and its
// AdamW state (sharded: its owned slices of the shard). `zero3`: the parameters are not whole
// (ZeRO-3's units): each rank keeps its owned slices of the parameter's tp shard too, through
// AdamW's slots (views of its parameter shards), as of the moments.
void keep_tp_shards(CheckpointParams* file, GPT& model, AdamW& opt, const GradSync* shards, Communicator& comm,
                    MpiComm mpi_comm, bool zero3) {
  using Part = CheckpointParams::Part;
  const TpPlace& tp = model->tp();
  const auto params = model->named_params();
  // Slot i of an unsharded AdamW is parameter i; a sharded one's slots are owned slices.
  std::vector<std::vector<size_t>> slots(params.size());
  for (size_t i = 0; i < opt.size(); ++i) slots[shards ? shards->owned_slices()[i].param : i].push_back(i);
  for (size_t k = 0; k < params.size(); ++k) {
    const torch::Tensor& p = params[k].second;  // (a lambda may not capture a structured binding in C++17)
    const TpSplit split = model->tp_split(params[k].first);
    auto shard_of = [&](Part part) {
      torch::Tensor t = torch::empty(tp_whole_shape(p.sizes(), split, tp.size), torch::kFloat32);
      agree(mpi_comm, [&] {
        if (file) t = file->read(k, part);
      });
      comm.broadcast(t, 0);
      return tp_shard(t, split, tp.rank, tp.size).contiguous();
    };
    const torch::Tensor w = shard_of(Part::param);
    if (!zero3) p.copy_(w);
    const torch::Tensor m = shard_of(Part::exp_avg);
    const torch::Tensor v = shard_of(Part::exp_avg_sq);
    for (size_t i : slots[k]) {
      if (shards) {
        const GradSync::Slice& s = shards->owned_slices()[i];
        if (zero3) opt.param(i).copy_(w.view({-1}).narrow(0, s.begin, s.length));
        opt.exp_avg(i).copy_(m.view({-1}).narrow(0, s.begin, s.length));
        opt.exp_avg_sq(i).copy_(v.view({-1}).narrow(0, s.begin, s.length));
      } else {
        opt.exp_avg(i).copy_(m);
        opt.exp_avg_sq(i).copy_(v);
      }
    }
  }
}

// Expert parallelism: each parameter's whole slot in `opt` (an unsharded AdamW's slot k is
// parameter k; under ZeRO the experts' follow the shared parameters' slices), else none (-1).
std::vector<int64_t> whole_slots(AdamW& opt, size_t n_params) {
  std::vector<int64_t> slot(n_params, -1);
  for (size_t i = 0; i < opt.size(); ++i)
    if (opt.holds_whole(i)) slot.at(opt.param_index(i)) = static_cast<int64_t>(i);
  return slot;
}

// Expert parallelism with ZeRO: the parameters the shared (sharded) GradSync holds, in its
// order: every parameter that is not an expert's.
std::vector<size_t> shared_params(const std::vector<std::pair<std::string, torch::Tensor>>& params) {
  std::vector<size_t> ids;
  for (size_t k = 0; k < params.size(); ++k)
    if (expert_of(params[k].first) < 0) ids.push_back(k);
  return ids;
}

// Expert parallel resume: rank 0 reads each tensor (`file`, opened with the whole model's names;
// null elsewhere), an expert's parameter for every rank of an ep group at once, and broadcasts it
// over `comm` (the world); each rank keeps its experts' share and every other tensor. ZeRO-1/2/3
// (`shards`: the shared parameters' sharded GradSync): their moments (ZeRO-3, `param_shards`: and
// their values) go out one bucket at a time, each rank keeping its slices.
void keep_expert_shards(CheckpointParams* file, GPT& model, AdamW& opt, const GradSync* shards, Communicator& comm,
                        MpiComm mpi_comm, const std::vector<torch::Tensor>* param_shards) {
  using Part = CheckpointParams::Part;
  const GPTDims& d = model->dims();
  const TpPlace& tp = model->tp();
  const auto params = model->named_params();
  const std::vector<int64_t> slot = whole_slots(opt, params.size());
  MPITRAIN_CHECK(opt.sharded() == (shards != nullptr), "expert parallel resume: a sharded AdamW with its GradSync");
  std::map<std::string, size_t> at;  // rank 0: the file's tensors by name
  if (file)
    for (size_t k = 0; k < file->size(); ++k) at.emplace(file->name(k), k);
  auto read = [&](const std::string& name, Part part) {
    const auto it = at.find(name);
    MPITRAIN_CHECK(it != at.end(), concat("expert parallel resume: the checkpoint has no tensor '", name, "'"));
    return file->read(it->second, part);
  };
  for (size_t k = 0; k < params.size(); ++k) {
    const std::string& name = params[k].first;
    const int64_t e = expert_of(name);  // rank 0 holds experts 0 .. L - 1: rank q of a group, e + q L
    for (Part part : {Part::param, Part::exp_avg, Part::exp_avg_sq}) {
      if (slot[k] < 0 && (part != Part::param || param_shards)) continue;  // a slice's: by bucket, below
      torch::Tensor dest = part == Part::param     ? params[k].second
                           : part == Part::exp_avg ? opt.exp_avg(static_cast<size_t>(slot[k]))
                                                   : opt.exp_avg_sq(static_cast<size_t>(slot[k]));
      const int64_t copies = e < 0 ? 1 : d.ep;
      // (tensor parallel: the whole tensor travels, each rank keeping its tp shard of it)
      const TpSplit split = model->tp_split(name);
      const std::vector<int64_t> shape = tp_whole_shape(dest.sizes(), split, tp.size);
      const int64_t numel = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
      torch::Tensor all = torch::empty({copies, numel}, torch::kFloat32);
      agree(mpi_comm, [&] {
        if (!file) return;
        for (int64_t q = 0; q < copies; ++q)
          all[q].copy_(read(e < 0 ? name : with_expert(name, e + q * d.local_experts()), part).reshape({-1}));
      });
      comm.broadcast(all, 0);
      dest.detach().copy_(tp_shard(all[e < 0 ? 0 : d.ep_rank].view(shape), split, tp.rank, tp.size));
    }
  }
  if (!shards) return;
  // (tensor parallel: each tp rank's buckets hold its tp shards: one bucket per tp rank q, made
  // from q's shards, which the ranks at tp rank q keep)
  const std::vector<size_t> shared = shared_params(params);
  for (size_t b = 0; b < shards->num_buckets(); ++b)
    for (Part part : {Part::param, Part::exp_avg, Part::exp_avg_sq}) {
      if (part == Part::param && !param_shards) continue;
      for (int64_t q = 0; q < tp.size; ++q)
        scatter_bucket(
            *shards, b,
            [&](size_t j) {
              const auto& [name, p] = params[shared.at(j)];
              const TpSplit split = model->tp_split(name);
              return tp_shard(read(name, part).view(tp_whole_shape(p.sizes(), split, tp.size)), split, q, tp.size).contiguous();
            },
            part == Part::param     ? param_shards->at(b)
            : part == Part::exp_avg ? opt.bucket_exp_avg(b)
                                    : opt.bucket_exp_avg_sq(b),
            comm, mpi_comm, /*keep=*/tp.rank == q);
    }
}

// Pipeline parallel resume: rank 0 reads each tensor of the whole model (`file`, opened with its
// names; null elsewhere) and broadcasts it over `comm` (the world); each stage keeps the ones it
// holds (the last stage its copy of a tied embedding too; tensor parallel: its tp shards).
// (zero3: the parameters are views of released units, and AdamW's slots those of this rank's
// shards, which take their part of each parameter as its moments do.)
void keep_stage_params(CheckpointParams* file, GPT& model, AdamW& opt, const GradSync* shards, const ParamShapes& names,
                       Communicator& comm, MpiComm mpi_comm, bool zero3) {
  using Part = CheckpointParams::Part;
  const auto params = model->named_params();
  MPITRAIN_CHECK(opt.sharded() == (shards != nullptr), "pipeline parallel resume: a sharded AdamW with its GradSync");
  std::vector<std::vector<size_t>> slots(params.size());  // each parameter's slots (ZeRO: its slices here)
  for (size_t i = 0; i < opt.size(); ++i) slots[opt.param_index(i)].push_back(i);
  std::map<std::string, size_t> mine, at;  // at: rank 0's file tensors by name
  for (size_t k = 0; k < params.size(); ++k) mine.emplace(params[k].first, k);
  if (file)
    for (size_t k = 0; k < file->size(); ++k) at.emplace(file->name(k), k);
  for (const auto& [name, shape] : names)
    for (Part part : {Part::param, Part::exp_avg, Part::exp_avg_sq}) {
      torch::Tensor t = torch::empty(shape, torch::kFloat32);
      agree(mpi_comm, [&] {
        if (!file) return;
        const auto it = at.find(name);
        MPITRAIN_CHECK(it != at.end(), concat("pipeline parallel resume: the checkpoint has no tensor '", name, "'"));
        t.copy_(file->read(it->second, part));
      });
      comm.broadcast(t, 0);
      const auto it = mine.find(name);
      if (it == mine.end()) continue;
      const size_t k = it->second;
      const TpPlace& tp = model->tp();  // (tensor parallel: this rank's shard of the whole tensor)
      const torch::Tensor held = tp.sharded() ? tp_shard(t, model->tp_split(name), tp.rank, tp.size).contiguous() : t;
      if (part == Part::param && !zero3) {
        params[k].second.detach().copy_(held.view(params[k].second.sizes()));
        continue;
      }
      for (size_t i : slots[k]) {
        torch::Tensor dest = part == Part::param ? opt.param(i) : part == Part::exp_avg ? opt.exp_avg(i) : opt.exp_avg_sq(i);
        // (a slice's run of the parameter; an expert's slot, after the slices, holds it whole)
        const int64_t begin = shards && !opt.holds_whole(i) ? shards->owned_slices()[i].begin : 0;
        dest.detach().copy_(held.view({-1}).narrow(0, begin, dest.numel()).view(dest.sizes()));
      }
    }
}

}  // namespace

void gather_ep_state(GPT& model, AdamW& opt, Communicator& ep, bool first_ep_group, GPT* whole,
                     FullOptimState* whole_state, const GradSync* shards, Communicator* tp, ParamShards* units) {
  torch::NoGradGuard no_grad;
  const GPTDims& d = model->dims();
  const auto params = model->named_params();
  const std::vector<int64_t> slot = whole_slots(opt, params.size());
  MPITRAIN_CHECK(opt.sharded() == (shards != nullptr), "gather_ep_state: a sharded AdamW with its GradSync");
  std::map<std::string, size_t> at;  // rank 0: the whole model's parameters by name
  std::vector<std::pair<std::string, torch::Tensor>> into;
  if (whole) {
    into = (*whole)->named_params();
    for (size_t k = 0; k < into.size(); ++k) at.emplace(into[k].first, k);
    whole_state->steps_taken = opt.steps_taken();
  }
  auto whole_index = [&](const std::string& n) {
    const auto it = at.find(n);
    MPITRAIN_CHECK(it != at.end(), concat("gather_ep_state: the whole model has no parameter '", n, "'"));
    return it->second;
  };
  if (shards) {  // ZeRO-1/2/3: the shared parameters' moments, one bucket at a time over the dp group
    const std::vector<size_t> shared = shared_params(params);
    if (units)  // ZeRO-3: their values too, one unit whole at a time (tensor parallel: made whole over tp)
      units->for_each_unit_whole([&](const std::vector<size_t>& js) {
        if (!whole && !tp) return;
        for (size_t j : js) {
          const auto& [name, p] = params[shared.at(j)];
          const torch::Tensor value = tp ? tp_unshard(p.detach(), model->tp_split(name), *tp) : p.detach();
          if (whole) into[whole_index(name)].second.detach().copy_(value);
        }
      });
    for (size_t b = 0; b < shards->num_buckets(); ++b)
      for (int which = 1; which < 3; ++which) {
        const torch::Tensor& mine = which == 1 ? opt.bucket_exp_avg(b) : opt.bucket_exp_avg_sq(b);
        torch::Tensor bucket = torch::empty({shards->padded_length(b)}, mine.options());
        shards->communicator().all_gather(mine, bucket);
        if (!whole && !tp) continue;
        for (size_t j : shards->bucket_params(b)) {  // (tensor parallel: each made whole over tp, every rank)
          const auto& [name, p] = params[shared.at(j)];
          torch::Tensor part = bucket.narrow(0, shards->flat_offset(j), p.numel()).view(p.sizes());
          if (tp) part = tp_unshard(part, model->tp_split(name), *tp);
          if (!whole) continue;
          auto& m = whole_state->moments[whole_index(name)];
          torch::Tensor& dst = which == 1 ? m.exp_avg : m.exp_avg_sq;
          dst.view({-1}).copy_(part.to(torch::kCPU, torch::kFloat32).reshape({-1}));
        }
      }
  }
  if (!first_ep_group) return;
  for (size_t k = 0; k < params.size(); ++k) {
    const std::string& name = params[k].first;
    const int64_t e = expert_of(name);
    for (int which = 0; which < 3; ++which) {
      if (slot[k] < 0 && (which > 0 || units)) continue;  // a slice's: gathered by bucket, above
      const size_t i = static_cast<size_t>(std::max<int64_t>(slot[k], 0));
      const torch::Tensor local = (which == 0 ? params[k].second : which == 1 ? opt.exp_avg(i) : opt.exp_avg_sq(i)).detach();
      // (tensor parallel: made whole over the tp group first, then the experts over the ep group)
      const torch::Tensor mine =
          (tp ? tp_unshard(local, model->tp_split(name), *tp) : local).to(torch::kFloat32).contiguous();
      torch::Tensor all = mine.reshape({1, -1});
      if (e >= 0) {
        all = torch::empty({ep.size(), mine.numel()}, mine.options());
        ep.all_gather(mine, all);
      }
      if (!whole) continue;
      for (int64_t q = 0; q < all.size(0); ++q) {  // (e's place among this rank's experts, on rank q)
        const size_t w = whole_index(e < 0 ? name : with_expert(name, e % d.local_experts() + q * d.local_experts()));
        auto& m = whole_state->moments[w];
        torch::Tensor dst = which == 0 ? into[w].second.detach() : which == 1 ? m.exp_avg : m.exp_avg_sq;
        dst.copy_(all[q].view(dst.sizes()));
      }
    }
  }
}

void gather_pp_state(GPT& model, AdamW& opt, MpiComm pp, const ParamShapes& names, GPT* whole, FullOptimState* whole_state,
                     const FullOptimState* stage_moments, Communicator* tp) {
  torch::NoGradGuard no_grad;
  const GPTDims& d = model->dims();
  const int me = mpi::rank(pp);  // (this rank's stage)
  const bool assembles = !tp || tp->rank() == 0;  // (tensor parallel: tp rank 0's pipeline sends and receives)
  const auto params = model->named_params();
  MPITRAIN_CHECK(stage_moments ? stage_moments->moments.size() == params.size() : !opt.sharded() && opt.size() == params.size(),
                 "gather_pp_state: AdamW's slot k is parameter k, or the stage's moments gathered");
  std::map<std::string, size_t> mine;
  for (size_t k = 0; k < params.size(); ++k) mine.emplace(params[k].first, k);
  std::vector<std::pair<std::string, torch::Tensor>> into;
  if (whole) {
    into = (*whole)->named_params();
    MPITRAIN_CHECK(into.size() == names.size(), "gather_pp_state: the whole model's names");
    whole_state->steps_taken = opt.steps_taken();
  }
  for (size_t w = 0; w < names.size(); ++w) {
    const auto& [name, shape] = names[w];
    const int64_t owner = stage_of(name, d);
    if (owner != me && (me != 0 || !assembles)) continue;
    for (int part = 0; part < 3; ++part) {
      torch::Tensor t;
      if (owner == me) {
        const size_t k = mine.at(name);
        const auto moment = [&](bool first) -> torch::Tensor {
          if (stage_moments) return first ? stage_moments->moments[k].exp_avg : stage_moments->moments[k].exp_avg_sq;
          return first ? opt.exp_avg(k) : opt.exp_avg_sq(k);
        };
        t = (part == 0 ? params[k].second : moment(part == 1))
                .detach()
                .to(torch::kCPU, torch::kFloat32)
                .contiguous();
        if (tp) t = tp_unshard(t, model->tp_split(name), *tp).contiguous();  // (every tp rank of the stage)
        if (!assembles) continue;
        if (me != 0) {  // to rank 0, which receives the tensors in this order
          Watchdog::Scope watch("pipeline: a checkpoint's tensor to rank 0");
          MpiRequest sent = mpi::isend(t.data_ptr<float>(), static_cast<size_t>(t.numel()) * sizeof(float), 0, part, pp);
          mpi::wait(sent);
          continue;
        }
      } else {
        t = torch::empty(shape, torch::kFloat32);
        Watchdog::Scope watch("pipeline: a checkpoint's tensor from its stage");
        mpi::recv(t.data_ptr<float>(), static_cast<size_t>(t.numel()) * sizeof(float), static_cast<int>(owner), part, pp);
      }
      if (!whole) continue;
      auto& m = whole_state->moments[w];
      torch::Tensor dst = part == 0 ? into[w].second.detach() : part == 1 ? m.exp_avg : m.exp_avg_sq;
      dst.copy_(t.view(dst.sizes()));
    }
  }
}

FullOptimState host_optim_state_like(GPT& model) {
  FullOptimState full;
  for (const auto& [name, p] : model->named_params())
    full.moments.push_back({name, torch::zeros(p.sizes(), torch::kFloat32), torch::zeros(p.sizes(), torch::kFloat32)});
  return full;
}

FullOptimState gather_optim_state(AdamW& opt, const GradSync* shards, GPT& model, FullOptimState* reuse) {
  if (!opt.sharded()) return full_state_of(opt);
  MPITRAIN_CHECK(shards && shards->sharded(), "gather_optim_state: a sharded AdamW needs its GradSync");
  torch::NoGradGuard no_grad;
  Communicator& comm = shards->communicator();
  const bool root = comm.rank() == 0;
  FullOptimState full;
  if (root) {
    if (reuse && reuse->moments.empty()) *reuse = host_optim_state_like(model);
    full = reuse ? *reuse : host_optim_state_like(model);  // reuse: the same tensors, filled anew
  }
  full.steps_taken = opt.steps_taken();
  for (size_t b = 0; b < shards->num_buckets(); ++b)
    for (int which = 0; which < 2; ++which) {
      const torch::Tensor& mine = which == 0 ? opt.bucket_exp_avg(b) : opt.bucket_exp_avg_sq(b);
      torch::Tensor bucket = torch::empty({shards->padded_length(b)}, mine.options());
      comm.all_gather(mine, bucket);
      if (!root) continue;
      torch::Tensor host = bucket.to(torch::kCPU, torch::kFloat32);
      for (size_t k : shards->bucket_params(b)) {
        auto& m = full.moments[k];
        torch::Tensor& dst = which == 0 ? m.exp_avg : m.exp_avg_sq;
        dst.view({-1}).copy_(host.narrow(0, shards->flat_offset(k), dst.numel()));
      }
    }
  if (!root) full.moments.clear();
  return full;
}

// ---- ranks writing one checkpoint together ----

CommDup::CommDup(MpiComm comm) : comm_(mpi::dup(comm)) {}
CommDup::~CommDup() { mpi::free(comm_); }

void share_checkpoint(CheckpointShare& into, GPT& model, AdamW& opt, const GradSync* shards, bool holds_unsharded,
                      const TrainState& st, bool copy, const ParamShapes* whole, const std::vector<bool>* expert,
                      bool holds_experts) {
  // (Expert parallelism: AdamW's slots past the GradSync's slices hold the experts whole.)
  const size_t slices = shards ? shards->owned_slices().size() : 0;
  MPITRAIN_CHECK(!shards || (opt.sharded() && (expert ? slices <= opt.size() : slices == opt.size())),
                 "share_checkpoint: a sharded AdamW and its GradSync");
  torch::NoGradGuard no_grad;
  const GPTDims& d = model->dims();
  const TpPlace& tp = model->tp();
  const auto params = model->named_params();
  const size_t n_params = params.size();
  // The file's parameters: this model's, or (a pipeline stage) the whole model's, of which this
  // stage writes the ones it holds (a tied embedding: the first stage).
  std::vector<size_t> in_file(n_params);  // parameter k's place among the file's
  size_t n_file = n_params;
  if (!copy || !into.built) {
    into.tensors.clear();
    if (whole) {
      std::map<std::string, size_t> at;
      for (size_t w = 0; w < whole->size(); ++w) at.emplace((*whole)[w].first, w);
      for (size_t k = 0; k < n_params; ++k) in_file[k] = at.at(params[k].first);
      n_file = whole->size();
      for (const auto& [name, shape] : *whole) into.tensors.push_back({"model/" + name, shape});
      for (const auto& [name, shape] : *whole)
        for (const char* m : {"/exp_avg", "/exp_avg_sq"}) into.tensors.push_back({"optim/" + name + m, shape});
    } else {
      for (size_t k = 0; k < n_params; ++k) in_file[k] = k;
      for (const auto& [name, p] : params) into.tensors.push_back({"model/" + name, tp_whole_shape(p.sizes(), model->tp_split(name), tp.size)});
      for (const auto& [name, p] : params)
        for (const char* m : {"/exp_avg", "/exp_avg_sq"})
          into.tensors.push_back({"optim/" + name + m, tp_whole_shape(p.sizes(), model->tp_split(name), tp.size)});
    }
    into.pieces.clear();
    into.copies.clear();
    // Elements [begin, begin + n) of parameter k's shard, from `live` (w: 0 the parameter, 1 and 2
    // its moments), as runs of the whole tensor. A replicated parameter is written by tp rank 0.
    auto add = [&](size_t k, int64_t begin, const torch::Tensor& live, int w) {
      const TpSplit split = model->tp_split(params[k].first);
      if (split == TpSplit::replicated && tp.rank != 0) return;
      if (whole && stage_of(params[k].first, d) != d.pp_stage) return;  // (the last stage's tied embedding)
      const torch::Tensor flat = live.detach().reshape({-1});
      torch::Tensor host = copy ? torch::empty({flat.numel()}, torch::TensorOptions()
                                                                 .dtype(torch::kFloat32)
                                                                 .pinned_memory(flat.is_cuda()))
                                : flat.to(torch::kCPU, torch::kFloat32).contiguous();
      into.copies.emplace_back(flat, host);
      const size_t tensor = w == 0 ? in_file[k] : n_file + 2 * in_file[k] + static_cast<size_t>(w - 1);
      for (const TpRun& run : tp_runs(split, params[k].second.sizes(), tp.rank, tp.size, begin, flat.numel()))
        into.pieces.push_back({tensor, run.whole, host.narrow(0, run.local, run.length)});
    };
    const auto add_slot = [&](size_t i, int64_t begin) {
      const size_t k = opt.param_index(i);
      add(k, begin, opt.param(i), 0);
      add(k, begin, opt.exp_avg(i), 1);
      add(k, begin, opt.exp_avg_sq(i), 2);
    };
    if (shards) {
      for (size_t i = 0; i < slices; ++i) add_slot(i, shards->owned_slices()[i].begin);
      if (holds_experts)
        for (size_t i = slices; i < opt.size(); ++i) add_slot(i, 0);
    } else {
      for (size_t k = 0; k < n_params; ++k)
        if (expert && (*expert)[k] ? holds_experts : holds_unsharded) add_slot(k, 0);
    }
    into.built = copy;
  }
  if (copy) {
    int64_t gpu = -1;
    for (auto& [live, host] : into.copies) {
      if (live.is_cuda()) gpu = live.device().index();
      host.copy_(live, /*non_blocking=*/live.is_cuda());
    }
    if (gpu >= 0) torch::cuda::synchronize(gpu);
  }
  into.dims = d;
  into.dims.pp = 1, into.dims.pp_stage = 0, into.dims.pp_virtual = 1;  // the file's: the whole model's tensors
  into.dims.ep = 1, into.dims.ep_rank = 0, into.dims.ep_comm = nullptr;
  into.steps_taken = opt.steps_taken();
  into.state = st;
}

namespace {

// A piece's place in the file and checksum, as rank 0 gathers them: 4 x uint64 each.
struct PieceRecord {
  uint64_t tensor, begin_byte, bytes, crc;
};

// Rank 0: each tensor's CRC32 from its pieces' (every rank's records), after checking that they
// cover the tensor exactly once; Error otherwise (a bug: the slices of a layout partition it).
std::vector<uint32_t> combine_crcs(std::vector<PieceRecord> records, const std::vector<CheckpointTensor>& tensors) {
  std::sort(records.begin(), records.end(), [](const PieceRecord& a, const PieceRecord& b) {
    return std::tie(a.tensor, a.begin_byte) < std::tie(b.tensor, b.begin_byte);
  });
  std::vector<uint32_t> crcs(tensors.size(), h5::crc32(nullptr, 0));
  std::vector<uint64_t> covered(tensors.size(), 0);
  for (const PieceRecord& r : records) {
    if (r.tensor >= tensors.size() || r.begin_byte != covered[r.tensor])
      throw Error(concat("checkpoint pieces do not tile tensor ", r.tensor < tensors.size() ? tensors[r.tensor].path : "?",
                         " (a piece at byte ", r.begin_byte, ", expected ", covered[r.tensor], ")"));
    crcs[r.tensor] = h5::crc32_combine(crcs[r.tensor], static_cast<uint32_t>(r.crc), r.bytes);
    covered[r.tensor] += r.bytes;
  }
  for (size_t t = 0; t < tensors.size(); ++t)
    if (covered[t] != tensors[t].bytes())
      throw Error(concat("checkpoint pieces cover ", covered[t], " of the ", tensors[t].bytes(), " bytes of ",
                         tensors[t].path));
  return crcs;
}

// Rank 0's verdict (empty: success) to every rank; a failure is thrown, printed once.
void share_verdict(std::string verdict, MpiComm comm, int rank) {
  mpi::broadcast(verdict, 0, comm);
  if (verdict.empty()) return;
  if (rank == 0) throw UsageError(verdict);
  throw ReportedUsageError{2};
}

}  // namespace

std::string write_checkpoint_shares(const std::string& dir, const CheckpointShare& share, int64_t keep, MpiComm comm) {
  const int rank = mpi::rank(comm), size = mpi::size(comm);
  const size_t n_tensors = share.tensors.size();

  // Rank 0 creates the file; every rank learns where each tensor's bytes go.
  std::optional<CheckpointFile> file;
  std::string failure;
  std::vector<uint64_t> offsets(n_tensors, 0);
  if (rank == 0) {
    try {
      file.emplace(dir, share.dims, share.steps_taken, share.state, share.tensors);
      for (size_t t = 0; t < n_tensors; ++t) offsets[t] = file->offset(t);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  share_verdict(failure, comm, rank);
  mpi::broadcast(offsets.data(), offsets.size() * sizeof(uint64_t), 0, comm);

  // This rank's pieces, in file order.
  std::vector<size_t> order(share.pieces.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::tie(share.pieces[a].tensor, share.pieces[a].begin) < std::tie(share.pieces[b].tensor, share.pieces[b].begin);
  });
  std::vector<RawWrite> writes;
  std::vector<PieceRecord> mine;
  size_t last_model_piece = SIZE_MAX;  // the test hook dies after it, half-way through the file
  const size_t n_model = n_tensors / 3;
  for (size_t i : order) {
    const CheckpointShare::Piece& p = share.pieces[i];
    MPITRAIN_CHECK(p.data.is_cpu() && p.data.scalar_type() == torch::kFloat32 && p.data.is_contiguous(),
                   "a checkpoint piece is host fp32 contiguous");
    const uint64_t begin = static_cast<uint64_t>(p.begin) * sizeof(float);
    const uint64_t bytes = static_cast<uint64_t>(p.data.numel()) * sizeof(float);
    if (p.tensor < n_model) last_model_piece = writes.size();
    writes.push_back({static_cast<const uint8_t*>(p.data.data_ptr()), bytes, offsets[p.tensor] + begin});
    mine.push_back({p.tensor, begin, bytes, 0});
  }
  const std::string tmp = dir + "/" + checkpoint_name(share.state.step) + ".tmp";
  failure.clear();
  try {
    const auto crcs = write_tensors(tmp, writes, [&](size_t i) {
      if (rank == 0 && i == last_model_piece) maybe_die_in_save_for_test(share.state.step);
    });
    for (size_t k = 0; k < mine.size(); ++k) mine[k].crc = crcs[k];
    // Rank 0's fsync of the whole file comes with finish(); another node's writes must reach the
    // (shared) filesystem first.
    if (rank != 0 && !writes.empty()) fsync_path(tmp);
  } catch (const std::exception& e) {
    failure = concat("rank ", rank, " (host ", mpi::processor_name(), "): ", e.what());
  }

  // Rank 0 learns every rank's outcome and its pieces' checksums.
  constexpr int kMessage = 1024;
  std::vector<char> message(kMessage, '\0');
  std::copy_n(failure.begin(), std::min<size_t>(failure.size(), kMessage - 1), message.begin());
  std::vector<char> messages(rank == 0 ? static_cast<size_t>(size) * kMessage : 0);
  mpi::gather(message.data(), messages.data(), kMessage, 0, comm);
  // The records as words (PieceRecord: 4 x uint64_t), none from a rank that failed.
  std::vector<uint64_t> words(failure.empty() ? mine.size() * 4 : 0);
  if (!words.empty()) std::memcpy(words.data(), mine.data(), words.size() * sizeof(uint64_t));
  std::vector<PieceRecord> all;
  for (const auto& list : mpi::gather_lists(words, 0, comm)) {
    const size_t at = all.size();
    all.resize(at + list.size() / 4);
    if (!list.empty()) std::memcpy(&all[at], list.data(), list.size() * sizeof(uint64_t));
  }

  std::string path = dir + "/" + checkpoint_name(share.state.step), verdict;
  if (rank == 0) {
    for (int r = 0; r < size && verdict.empty(); ++r)
      if (messages[static_cast<size_t>(r) * kMessage] != '\0') verdict = &messages[static_cast<size_t>(r) * kMessage];
    try {
      if (!verdict.empty()) throw file->failed(verdict);
      path = file->finish(combine_crcs(std::move(all), share.tensors), keep);
    } catch (const UsageError& e) {
      verdict = e.what();
    } catch (const std::exception& e) {
      verdict = file->failed(e.what()).what();
    }
  }
  share_verdict(verdict, comm, rank);
  return path;
}

std::string save_shares(AsyncCheckpointWriter& writer, CheckpointShare& buffers, GPT& model, AdamW& opt,
                        const GradSync* shards, bool holds_unsharded, const TrainState& st, MpiComm comm,
                        const ParamShapes* whole, const std::vector<bool>* expert, bool holds_experts) {
  if (!writer.async())
    return writer.save_with(st.step, [] {}, [&] {
      CheckpointShare share;
      share_checkpoint(share, model, opt, shards, holds_unsharded, st, /*copy=*/false, whole, expert, holds_experts);
      return write_checkpoint_shares(writer.dir(), share, writer.keep(), comm);
    });
  return writer.save_with(
      st.step,
      [&] { share_checkpoint(buffers, model, opt, shards, holds_unsharded, st, /*copy=*/true, whole, expert, holds_experts); },
      [&writer, &buffers, comm] { return write_checkpoint_shares(writer.dir(), buffers, writer.keep(), comm); });
}

void gather_tp_state(GPT& model, AdamW& opt, const GradSync* shards, Communicator& tp, bool first_tp_group,
                     GPT* whole, FullOptimState* whole_state, ParamShards* units) {
  torch::NoGradGuard no_grad;
  FullOptimState local = gather_optim_state(opt, shards, model);  // this tp rank's shards, whole over dp
  whole_state->steps_taken = opt.steps_taken();
  const bool root = whole != nullptr;
  const auto params = model->named_params();
  const auto into = root ? (*whole)->named_params() : decltype(params){};
  auto assemble = [&](size_t k) {
    if (!first_tp_group) return;
    const TpSplit split = model->tp_split(params[k].first);
    torch::Tensor p = tp_unshard(params[k].second.detach(), split, tp);
    torch::Tensor m = tp_unshard(local.moments[k].exp_avg.to(p.device()), split, tp);
    torch::Tensor v = tp_unshard(local.moments[k].exp_avg_sq.to(p.device()), split, tp);
    if (!root) return;
    into[k].second.detach().copy_(p);
    whole_state->moments[k].exp_avg.copy_(m);
    whole_state->moments[k].exp_avg_sq.copy_(v);
  };
  if (units) {  // every rank takes part in each unit's dp gather; rank 0's tp group unshards it
    units->for_each_unit_whole([&](const std::vector<size_t>& ks) {
      for (size_t k : ks) assemble(k);
    });
    return;
  }
  for (size_t k = 0; k < params.size(); ++k) assemble(k);
}

// Every rank's RNG state, gathered (all ranks call; rank 0 keeps them for the checkpoint).
std::vector<std::vector<uint8_t>> gather_rng_states(Communicator& comm, const torch::Device& device) {
  auto mine = rng_state(device);
  torch::Tensor in = torch::from_blob(mine.data(), {static_cast<int64_t>(mine.size())}, torch::kUInt8);
  torch::Tensor out = torch::empty({comm.size() * in.numel()}, torch::kUInt8);
  comm.all_gather(in, out);
  std::vector<std::vector<uint8_t>> all(comm.size());
  for (int r = 0; r < comm.size(); ++r) {
    const uint8_t* p = out.data_ptr<uint8_t>() + r * in.numel();
    all[r].assign(p, p + in.numel());
  }
  return all;
}

std::string resume_from(const std::vector<std::string>& candidates, GPT& model, AdamW& opt, const GradSync* shards,
                 TrainState& st, Communicator& comm, MpiComm mpi_comm, uint64_t seed, const torch::Device& device,
                 const std::vector<torch::Tensor>* param_shards, GPT* whole, const ParamShapes* pp_names) {
  std::string path;
  // Rank 0 reads and verifies every tensor of the file (a damaged one falls back to the next
  // candidate before any rank has taken anything), then reads them again one at a time while
  // handing them out: no rank holds the whole model or its state for a resume, in any layout (the
  // second read comes mostly from the page cache). Tensor parallel: every rank keeps its tp shards
  // of each tensor; ZeRO: each its part of each bucket; else the whole tensors.
  const bool tensor_parallel = model->tp().sharded();
  MPITRAIN_CHECK(!param_shards || (shards && opt.sharded()), "resume_from: ZeRO-3's shards with their GradSync");
  std::optional<CheckpointParams> file;
  // The data's tokenizer (st holds it until the checkpoint's state replaces it).
  const std::string data_tokenizer = st.tokenizer, data_sha256 = st.tokenizer_sha256;
  agree(mpi_comm, [&] {
    if (comm.rank() != 0) return;
    for (size_t i = 0; i < candidates.size() && path.empty(); ++i) {
      try {
        file.emplace(candidates[i], whole ? *whole : model, st, /*with_optim=*/true);
        file->verify_all();
        path = candidates[i];
      } catch (const ArchitectureMismatch&) {
        throw;  // the configuration differs: an older checkpoint of the same run would too
      } catch (const UsageError& e) {
        if (i + 1 == candidates.size()) throw;
        log::warn(concat("cannot resume from ", candidates[i], ": ", e.what(), "; falling back to ",
                         candidates[i + 1]));
      }
    }
    // A model continues only on its own tokenizer's ids: the same ids mean other text under
    // another tokenizer.json (the vocabulary sizes may well agree).
    const bool hf_either = st.tokenizer == "hf" || data_tokenizer == "hf";
    if ((hf_either && st.tokenizer != data_tokenizer) ||
        (!st.tokenizer_sha256.empty() && !data_sha256.empty() && st.tokenizer_sha256 != data_sha256))
      throw UsageError(concat("data.train: the shards were packed with the ", data_tokenizer, " tokenizer",
                              data_sha256.empty() ? std::string() : concat(" (tokenizer.json SHA-256 ", data_sha256.substr(0, 12), ")"),
                              ", but ", path, " was trained on ", st.tokenizer,
                              st.tokenizer_sha256.empty() ? std::string()
                                                          : concat(" (", st.tokenizer_file, ", SHA-256 ", st.tokenizer_sha256.substr(0, 12), ")"),
                              " ids: a resumed run must read the same tokenizer's shards"));
  });
  torch::NoGradGuard no_grad;
  using Part = CheckpointParams::Part;
  CheckpointParams* from = file ? &*file : nullptr;
  if (model->dims().pp > 1) {
    MPITRAIN_CHECK((comm.rank() != 0 || whole) && pp_names, "resume_from: a pipeline stage opens the file with the whole model");
    keep_stage_params(from, model, opt, shards, *pp_names, comm, mpi_comm, /*zero3=*/param_shards != nullptr);
  } else if (model->dims().ep > 1) {
    MPITRAIN_CHECK(comm.rank() != 0 || whole, "resume_from: expert parallelism opens the file with the whole model");
    keep_expert_shards(from, model, opt, shards, comm, mpi_comm, param_shards);
  } else if (tensor_parallel) {
    keep_tp_shards(from, model, opt, shards, comm, mpi_comm, /*zero3=*/param_shards != nullptr);
  } else {
    if (!param_shards) {
      const auto params = model->named_params();
      for (size_t k = 0; k < params.size(); ++k) broadcast_from_file(from, k, Part::param, params[k].second, comm, mpi_comm);
    }
    if (opt.sharded()) {
      scatter_from_file(from, param_shards, opt, *shards, comm, mpi_comm);
    } else {  // slot i is parameter i
      for (size_t i = 0; i < opt.size(); ++i) {
        broadcast_from_file(from, i, Part::exp_avg, opt.exp_avg(i), comm, mpi_comm);
        broadcast_from_file(from, i, Part::exp_avg_sq, opt.exp_avg_sq(i), comm, mpi_comm);
      }
    }
  }
  const int64_t steps_taken = file ? file->steps_taken() : 0;
  torch::Tensor scalars = torch::tensor({st.step, st.tokens_seen, static_cast<int64_t>(st.data_cursor),
                                         st.world_size, steps_taken, st.dp, st.tp, st.zero, st.islands}, torch::kInt64);
  comm.broadcast(scalars, 0);
  auto s = scalars.accessor<int64_t, 1>();
  st.step = s[0];
  st.tokens_seen = s[1];
  st.data_cursor = static_cast<uint64_t>(s[2]);
  st.world_size = s[3];
  opt.set_steps_taken(s[4]);
  st.dp = s[5];
  st.tp = s[6];
  st.zero = s[7];
  st.islands = s[8];
  torch::Tensor scale = torch::tensor({st.loss_scale, static_cast<double>(st.loss_scale_good_steps)}, torch::kFloat64);
  comm.broadcast(scale, 0);
  st.loss_scale = scale[0].item<double>();
  st.loss_scale_good_steps = static_cast<int64_t>(scale[1].item<double>());

  // RNG states follow their rank when the world size is unchanged; otherwise reseed per rank.
  int64_t n_states = comm.rank() == 0 ? static_cast<int64_t>(st.rng_states.size()) : 0;
  int64_t state_bytes = n_states > 0 ? static_cast<int64_t>(st.rng_states[0].size()) : 0;
  torch::Tensor dims = torch::tensor({n_states, state_bytes}, torch::kInt64);
  comm.broadcast(dims, 0);
  n_states = dims[0].item<int64_t>();
  state_bytes = dims[1].item<int64_t>();
  bool restored = false;
  if (n_states == comm.size() && state_bytes > 0) {
    torch::Tensor all = torch::empty({n_states, state_bytes}, torch::kUInt8);
    if (comm.rank() == 0)
      for (int64_t r = 0; r < n_states; ++r)
        std::memcpy(all[r].data_ptr<uint8_t>(), st.rng_states[r].data(), state_bytes);
    comm.broadcast(all, 0);
    torch::Tensor mine = all[comm.rank()].contiguous();
    restored = set_rng_state(std::vector<uint8_t>(mine.data_ptr<uint8_t>(), mine.data_ptr<uint8_t>() + state_bytes),
                             device);
    int all_restored = restored ? 1 : 0;  // one kind of device for all ranks, but be sure
    {
      Watchdog::Scope watch("all_reduce(rng restored)");
      mpi::all_reduce(&all_restored, 1, ReduceOp::min, mpi_comm);
    }
    if (!all_restored && comm.rank() == 0)
      log::warn("checkpoint's RNG states come from another kind of device (CPU/GPU): RNG streams are reseeded "
                "(the data order continues exactly)");
    restored = all_restored != 0;
  } else if (n_states > 0 && comm.rank() == 0) {
    log::warn(concat("checkpoint was written by ", n_states, " ranks, this run has ", comm.size(),
                     ": RNG streams are reseeded (the data order continues exactly)"));
  }
  // The routing bias (train.moe_bias_update_rate): the file's, else zero (a run that had none).
  if (model->run().routing_bias) {
    torch::Tensor bias = comm.rank() == 0 && st.routing_bias.defined() ? st.routing_bias.clone()
                                                                       : torch::zeros_like(model->routing_bias());
    comm.broadcast(bias, 0);
    model->set_routing_bias(bias);
  }
  // Reseeded per data-parallel rank, as at the start (the ranks of a tp group share a stream).
  const int dp_rank = comm.rank() / static_cast<int>(model->tp().size);
  if (!restored) torch::manual_seed(seed + 7919 * static_cast<uint64_t>(dp_rank + 1) + st.step);
  log::info(concat("resumed from ", path, " at step ", st.step, " (", st.tokens_seen, " tokens seen)"));
  return path;
}


}  // namespace mpitrain
