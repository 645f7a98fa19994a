// Checkpoint state across ranks: ZeRO-1 gather and scatter, RNG streams, resume (see state_sync.h).
#include "mpitrain/state_sync.h"

#include <cstring>
#include <mutex>

#include "mpitrain/error.h"
#include "mpitrain/log.h"
#include "mpitrain/mpi_env.h"
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

// Rank 0's whole-parameter moments (`full`) to every rank's slices: one padded bucket at a time
// is broadcast over the shards' communicator; each rank keeps its part.
void scatter_optim_state(const FullOptimState& full, AdamW& opt, const GradSync& shards) {
  Communicator& comm = shards.communicator();
  const bool root = comm.rank() == 0;
  for (size_t b = 0; b < shards.num_buckets(); ++b) {
    torch::Tensor& mine_m = opt.bucket_exp_avg(b);
    torch::Tensor& mine_v = opt.bucket_exp_avg_sq(b);
    const int64_t len = mine_m.numel();
    for (int which = 0; which < 2; ++which) {
      torch::Tensor bucket = torch::zeros({shards.padded_length(b)}, mine_m.options());
      if (root)
        for (size_t k : shards.bucket_params(b)) {
          const auto& m = full.moments[k];
          const torch::Tensor& src = which == 0 ? m.exp_avg : m.exp_avg_sq;
          bucket.narrow(0, shards.flat_offset(k), src.numel()).copy_(src.reshape({-1}));
        }
      comm.broadcast(bucket, 0);
      (which == 0 ? mine_m : mine_v).copy_(bucket.narrow(0, comm.rank() * len, len));
    }
  }
}

}  // namespace

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

void resume_from(const std::vector<std::string>& candidates, GPT& model, AdamW& opt, const GradSync* shards,
                 TrainState& st, Communicator& comm, MPI_Comm mpi_comm, uint64_t seed, const torch::Device& device) {
  std::string path;
  // Rank 0 loads AdamW's state into the optimizer itself, or (sharded) into whole-parameter host
  // tensors that are handed out below.
  FullOptimState full;
  if (comm.rank() == 0) full = opt.sharded() ? host_optim_state_like(model) : full_state_of(opt);
  agree(mpi_comm, [&] {
    if (comm.rank() != 0) return;
    for (size_t i = 0; i < candidates.size(); ++i) {
      try {
        load_checkpoint(candidates[i], model, &full, st);
        path = candidates[i];
        return;
      } catch (const ArchitectureMismatch&) {
        throw;  // the configuration differs: an older checkpoint of the same run would too
      } catch (const UsageError& e) {
        if (i + 1 == candidates.size()) throw;
        log::warn(concat("cannot resume from ", candidates[i], ": ", e.what(), "; falling back to ",
                         candidates[i + 1]));
      }
    }
  });
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : model->named_params()) comm.broadcast(p, 0);
  if (opt.sharded()) {
    scatter_optim_state(full, opt, *shards);
  } else {
    for (size_t i = 0; i < opt.size(); ++i) {
      comm.broadcast(opt.exp_avg(i), 0);
      comm.broadcast(opt.exp_avg_sq(i), 0);
    }
  }
  torch::Tensor scalars = torch::tensor({st.step, st.tokens_seen, static_cast<int64_t>(st.data_cursor),
                                         st.world_size, full.steps_taken, st.dp, st.tp, st.zero}, torch::kInt64);
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
      MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &all_restored, 1, MPI_INT, MPI_MIN, mpi_comm));
    }
    if (!all_restored && comm.rank() == 0)
      log::warn("checkpoint's RNG states come from another kind of device (CPU/GPU): RNG streams are reseeded "
                "(the data order continues exactly)");
    restored = all_restored != 0;
  } else if (n_states > 0) {
    log::warn(concat("checkpoint was written by ", n_states, " ranks, this run has ", comm.size(),
                     ": RNG streams are reseeded (the data order continues exactly)"));
  }
  if (!restored) torch::manual_seed(seed + 7919 * static_cast<uint64_t>(comm.rank() + 1) + st.step);
  log::info(concat("resumed from ", path, " at step ", st.step, " (", st.tokens_seen, " tokens seen)"));
}


}  // namespace mpitrain
