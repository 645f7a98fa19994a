// The run's parallelisms applied to its model and optimizer (parallelism.h): tensor parallelism
// and the data-parallel stage, the only place the training loop's stage-dependent work lives.
#include "mpitrain/parallelism.h"

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mpitrain/error.h"
#include "mpitrain/hf_format.h"
#include "mpitrain/log.h"
#include "mpitrain/memory_plan.h"
#include "mpitrain/mesh.h"
#include "mpitrain/mpi_env.h"
#include "mpitrain/watchdog.h"
#include "mpitrain/pipeline.h"
#include "mpitrain/tensor_parallel.h"

namespace mpitrain {
namespace {

// Whether MPI runs with MPI_THREAD_MULTIPLE (collectives from more than one thread).
bool mpi_thread_multiple() {
  return mpi::thread_multiple();
}

torch::ScalarType dtype_named(const std::string& name) { return precision_dtype(parse_precision(name)); }

}  // namespace

Parallelism::Parallelism(const Config& cfg, Mesh& mesh, const Topology& topo, const GPTDims& dims, const TpPlace& tp,
                         torch::Device device, int checkpoint_dir_blind_rank, MpiComm mpi_comm)
    : cfg_(cfg), mesh_(mesh), topo_(topo), dims_(dims), tp_place_(tp), mpi_comm_(mpi_comm), device_(device),
      tp_(mesh.layout().tp > 1), ep_(mesh.layout().ep > 1), pp_(mesh.layout().pp > 1), stage_(mesh.layout().dp > 1 ? static_cast<int>(cfg.optim.zero) : 0) {
  // Who writes checkpoints: the ranks that hold the state each its share, when all ranks see
  // checkpoint.dir (checkpoint.writers: auto): with a sharded optimizer every rank, under tensor
  // parallelism rank 0's tp group; else rank 0 the whole state, gathered to it. Async writes of
  // shares need MPI collectives on the writer's thread.
  const bool async_collectives = !cfg.checkpoint.async || mpi_thread_multiple();
  const bool zero = shards_optimizer();
  const bool spread = zero || tp_ || pp_ || ep_;  // state held in parts
  // DiLoCo's islands hold different states: rank 0 writes island 0's (the others' lie beside it,
  // diloco.h), which shares of every island's ranks would overwrite.
  const bool islands = mesh.layout().islands > 1;
  // (Pipeline stages: the first pipeline's ranks, each its stage's tensors. Expert parallelism:
  // the first ep group's ranks each its experts, its first rank the rest.)
  shares_ = spread && cfg.checkpoint.writers == "auto" && checkpoint_dir_blind_rank < 0 && async_collectives && !islands;
  const MeshLayout& l = mesh_.layout();
  writer_count_ = !shares_ ? 1 : zero ? topo_.size : static_cast<int>(l.pp * l.tp * (ep_ ? l.ep : 1));
  if (ep_ && !shares_ && topo_.rank == 0)
    log::info(concat("checkpoint: rank 0 writes whole checkpoints (",
                     pp_ ? concat("each of the ", mesh_.layout().pp, " stages' experts gathered from the ", mesh_.layout().ep,
                                  " ranks of its first ep group, then its tensors sent to rank 0 one at a time")
                         : concat("the experts gathered to it from the ", mesh_.layout().ep, " ranks of its ep group"),
                     tp_ ? concat(", each tensor made whole over the ", mesh_.layout().tp, " ranks of its tp group first") : std::string(),
                     zero ? concat(", the shared parameters' ZeRO-", stage_, " state from ", pp_ ? "the stage's dp group" : "every rank")
                          : std::string(), ")"));
  if (!spread || (ep_ && !shares_) || topo_.rank != 0) return;
  const std::string stage = concat("ZeRO-", stage_);  // (the log names the stage that runs)
  const std::string share = concat(zero && tp_ ? concat("every rank writes its ", stage, " slices of its tensor-parallel shards")
                                   : zero      ? concat("every rank writes its ", stage, " share")
                                   : pp_       ? std::string("the first pipeline's ranks write their stages' tensors")
                                   : tp_       ? std::string("the ranks of rank 0's tp group write their tensor-parallel shards")
                                               : std::string("rank 0 writes the parameters but the experts"),
                                   ep_ ? concat(", the ", l.ep, " ranks of the first ep group", pp_ ? " of each stage" : "",
                                                " each its experts whole")
                                       : std::string());
  const std::string state = pp_         ? concat("the ", mesh_.layout().pp, " stages' tensors, one at a time,")
                            : zero && tp_ ? concat("tensor-parallel shards and ", stage, " state")
                            : zero      ? concat(stage, " state")
                                        : "tensor-parallel shards";
  const int blind = checkpoint_dir_blind_rank;
  log::info(shares_ ? concat("checkpoint: ", share, " (", writer_count_, " writers; checkpoint.dir '",
                             cfg.checkpoint.dir, "' is seen by every rank)")
                    : concat("checkpoint: rank 0 writes whole checkpoints (", state, " gathered to it): ",
                             islands ? std::string("DiLoCo's islands (island 0's state; each rank's own beside it)")
                             : cfg.checkpoint.writers == "rank0" ? std::string("checkpoint.writers: rank0")
                             : !async_collectives ? std::string("MPI without MPI_THREAD_MULTIPLE for async writes")
                             : blind > 0 ? concat("rank ", blind, " (host ", topo_.hosts[topo_.host_of_rank[blind]],
                                                  ") does not see checkpoint.dir '", cfg.checkpoint.dir,
                                                  "' (not a shared filesystem?)")
                                         : std::string("checkpoint.dir is not locked, so no rank can check it sees it")));
}

// ---- start-up ----------------------------------------------------------------------------------

GPT Parallelism::make_model(const RunOptions& run) {
  // ZeRO-3: the model is made without its values (deferred; one block at a time exists while it
  // is made), which initial_weights() gives each rank's shards of once the units exist: no rank,
  // host or device, ever holds the whole model.
  GPT model(dims_, /*deferred=*/stage_ == 3);
  model->parallelize(tp_place_);
  model->apply(run);
  if (stage_ != 3) model->to(device_);
  return model;
}

void Parallelism::apply(GPT model) {
  model_ = std::move(model);
  for (auto& [name, p] : model_->named_params()) params_.push_back(p);
  // Tensor parallel or ZeRO-3: when rank 0 writes checkpoints alone, it keeps a whole copy of the
  // model in host memory, into which the shards are gathered (ZeRO-3: one unit at a time, so no
  // rank holds the whole model on its device for it).
  if ((tp_ || stage_ == 3 || ep_ || pp_) && topo_.rank == 0 && !shares_) {
    GPTDims d = dims_;
    d.ep = 1, d.ep_rank = 0, d.ep_comm = nullptr;
    d.pp = 1, d.pp_stage = 0, d.pp_virtual = 1;
    whole_model_.emplace(d);
  }
  if (pp_ || (ep_ && shares_))  // every rank: the whole model's names (the file's, when ranks write their shares)
    for (const auto& [name, p] : whole_model(dims_, /*deferred=*/true)->named_params()) whole_names_.emplace_back(name, p.sizes().vec());
  if (pp_) {
    const auto params = model_->named_params();
    if (!dims_.llama() || dims_.tie_embeddings)  // both ends hold wte.weight (the middle stages none)
      for (size_t k = 0; k < params.size(); ++k)
        if (params[k].first == "wte.weight") tied_ = k;
    if (!ep_)  // (expert parallelism's below)
      for (const auto& [name, p] : params) tp_replicated_.push_back(tp_ && model_->tp_split(name) == TpSplit::replicated);
  }
  // On CUDA the backward hooks run on autograd's device threads; MPI collectives (and their
  // watchdog scopes) stay on the main thread, so there the MPI backend reduces after backward.
  Communicator& dp = mesh_.dp();
  const bool overlap = cfg_.comm.overlap && !(device_.is_cuda() && dp.name() == "mpi");
  // ZeRO-3 gathers a block's parameters from its backward, which on a GPU runs on autograd's device
  // thread: the MPI backend may call MPI there only under MPI_THREAD_MULTIPLE (the main thread
  // waits in backward meanwhile).
  if (stage_ == 3 && device_.is_cuda() && dp.name() == "mpi" && !mpi_thread_multiple())
    agree(mpi_comm_, [&] {
      throw UsageError(concat("optim.zero: 3 on a GPU with comm.backend: mpi gathers parameters from autograd's "
                              "device thread, which needs MPI_THREAD_MULTIPLE, and this MPI does not provide it: set "
                              "comm.backend: nccl (or optim.zero: 2)"));
    });
  Units units;  // ZeRO-3's: of every parameter, or under expert parallelism of the shared ones
  // The experts' gradients apart from the shared parameters': under expert parallelism (each rank
  // holds its own experts), and under PowerSGD with any ep (which compresses the shared parameters'
  // only, so that ep 1 and ep k train alike).
  const bool powersgd = cfg_.comm.compress == "powersgd" && mesh_.layout().dp > 1;
  if (ep_ || (powersgd && dims_.has_experts() && stage_ == 0)) {
    std::vector<torch::Tensor> shared, experts;
    std::vector<std::string> shared_names;
    for (auto& [name, p] : model_->named_params()) {
      is_expert_.push_back(expert_of(name) >= 0);
      (is_expert_.back() ? experts : shared).push_back(p);
      if (!is_expert_.back()) shared_names.push_back(name);
      tp_replicated_.push_back(model_->tp_split(name) == TpSplit::replicated);
    }
    // ZeRO-3: the units hold the shared parameters only; each rank's experts live whole on the
    // device (the model was made without values: initial_weights() gives them theirs).
    if (stage_ == 3) {
      torch::NoGradGuard no_grad;
      for (auto& p : experts) p.set_data(torch::zeros(p.sizes(), p.options().device(device_)));
      units = model_units(shared_names, dims_.n_layer);
    }
    // Backward runs the experts' all-to-alls: on a GPU that is autograd's device thread, where the
    // MPI backend may call MPI only under MPI_THREAD_MULTIPLE.
    if (device_.is_cuda() && mesh_.ep().name() == "mpi" && !mpi_thread_multiple())
      agree(mpi_comm_, [&] {
        throw UsageError("parallel.ep on a GPU with comm.backend: mpi exchanges tokens from autograd's device thread, "
                         "which needs MPI_THREAD_MULTIPLE, and this MPI does not provide it: set comm.backend: nccl");
      });
    // ZeRO-1/2/3 shard the shared parameters' optimizer state (2, 3: and their gradients; 3: and
    // the parameters) over the dp group; each rank's experts stay whole, their state held by each
    // of their replicas.
    const torch::ScalarType wire = dtype_named(cfg_.comm.grad_dtype);
    grad_sync_.emplace(shared, dp, cfg_.comm.bucket_mb, overlap, shards_optimizer(), wire, stage_ >= 2, units.groups,
                       stage_ == 3 ? c10::optional<torch::Device>(device_) : c10::nullopt);
    if (shards_optimizer()) slice_owner_ = &*grad_sync_;
    expert_sync_.emplace(experts, ep_ ? mesh_.expert_replicas() : dp, cfg_.comm.bucket_mb, overlap, false, wire);
    if (stage_ == 3) {
      units_.emplace(shared, *grad_sync_, std::move(units), cfg_.optim.reshard_after_forward,
                     dtype_named(cfg_.comm.param_dtype));
      model_->set_unit_hooks(&*units_);
    }
    // PowerSGD compresses the shared parameters' gradients over the dp group; the experts' (each
    // rank's own, averaged over their replicas) travel whole.
    if (powersgd) powersgd_.emplace(shared, dp, cfg_.comm.powersgd_rank, cfg_.train.seed, shared_names);
    return;
  }
  if (stage_ == 3) {
    std::vector<std::string> names;
    for (const auto& [name, p] : model_->named_params()) names.push_back(name);
    units = model_units(names, dims_.n_layer);
  }
  // (comm.grad_dtype and comm.param_dtype are named as train.precision is, and validated)
  grad_sync_.emplace(params_, dp, cfg_.comm.bucket_mb, overlap, shards_optimizer(), dtype_named(cfg_.comm.grad_dtype),
                     stage_ >= 2, units.groups,
                     stage_ == 3 ? c10::optional<torch::Device>(device_) : c10::nullopt);
  if (shards_optimizer()) slice_owner_ = &*grad_sync_;
  if (powersgd) {
    std::vector<std::string> names;
    for (const auto& [name, p] : model_->named_params()) names.push_back(name);
    powersgd_.emplace(params_, dp, cfg_.comm.powersgd_rank, cfg_.train.seed, names);
  } else if (cfg_.comm.compress == "powersgd" && topo_.rank == 0)
    log::info("comm.compress: powersgd has nothing to compress with one data-parallel rank");
  if (stage_ == 3) {
    units_.emplace(params_, *grad_sync_, std::move(units), cfg_.optim.reshard_after_forward,
                   dtype_named(cfg_.comm.param_dtype));
    model_->set_unit_hooks(&*units_);
  }
}

int64_t Parallelism::initial_weights(const std::string& init_from) {
  Communicator& dp = mesh_.dp();
  // Who reads `init_from`: the first data-parallel replica (rank 0's tp group, on rank 0's host),
  // or under expert parallelism the first ep group (each its own experts, and the rest), each only
  // what it holds; a parameter then goes to the rest of its dp group, an expert to its replicas.
  const bool reader = mesh_.dp_rank() < mesh_.layout().ep;
  const auto expert = [&](size_t k) { return ep_ && is_expert_[k]; };
  const auto group_of = [&](size_t k) -> Communicator& { return expert(k) ? mesh_.expert_replicas() : dp; };
  if (!units_) {
    // The broadcast also gives every rank the drawn weights, whatever each rank's RNG did.
    int64_t n = 0;
    if (!init_from.empty())
      agree(mpi_comm_, [&] { naming_config_file(cfg_, [&] {
        if (reader) n = load_initial_weights(init_from, model_);
      }); });
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < params_.size(); ++k) group_of(k).broadcast(params_[k], 0);
    if (ep_) mpi::broadcast_value(n, 0, mpi_comm_);  // (every rank logs the first group's count)
    return n;
  }
  // ZeRO-3: each rank's shards, one parameter whole at a time (under expert parallelism its
  // experts whole, the units holding the shared parameters only). Drawn: every rank draws each
  // parameter as a model made whole would (GPT::initialize) and keeps its part, with no
  // communication. init_from: the readers read one tensor at a time, each its tp shard, and
  // broadcast it, each rank keeping its part; a read error found on the way ends every rank,
  // naming the file.
  std::vector<size_t> unit_index(params_.size(), 0);  // k's place among the units' parameters
  for (size_t k = 0, j = 0; k < params_.size(); ++k)
    if (!expert(k)) unit_index[k] = j++;
  const auto keep = [&](size_t k, const torch::Tensor& v) {
    torch::NoGradGuard no_grad;
    if (expert(k))
      params_[k].copy_(v);
    else
      units_->set_param(unit_index[k], v);
  };
  if (init_from.empty()) {
    model_->initialize(keep);
    return 0;
  }
  std::unique_ptr<InitialWeights> files;
  agree(mpi_comm_, [&] { naming_config_file(cfg_, [&] {
    if (reader) files = open_initial_weights(init_from, model_);
  }); });
  // (Pipeline stages hold different numbers of tensors, and each read's verdict is agreed over
  // every rank: as many rounds as the largest stage has tensors.)
  int64_t rounds = static_cast<int64_t>(params_.size());
  if (pp_) mpi::all_reduce(&rounds, 1, ReduceOp::max, mpi_comm_);
  for (size_t k = 0; k < static_cast<size_t>(rounds); ++k) {
    const bool mine = k < params_.size();
    torch::Tensor v;
    agree(mpi_comm_, [&] { naming_config_file(cfg_, [&] {
      if (files && mine) v = files->read(k).to(device_);
    }); });
    if (!mine) continue;
    if (!v.defined()) v = torch::empty(params_[k].sizes(), torch::dtype(torch::kFloat32).device(device_));
    group_of(k).broadcast(v, 0);
    keep(k, v);
  }
  return static_cast<int64_t>(params_.size());
}

std::string Parallelism::describe_initial_weights() const {
  return concat(pp_ ? concat("; each of the ", dims_.pp, " stages' first replica read its stage's tensors (rank 0's counted)")
                   : std::string(),
                tp_ ? concat("; each of the ", tp_place_.size, " ranks of rank 0's tp group read its shards") : std::string(),
                units_ ? "; one tensor at a time, broadcast over the dp group, each rank keeping its shard" : "");
}

void Parallelism::make_optimizer(bool fused) {
  std::vector<size_t> experts;  // expert parallelism with ZeRO: the parameters held whole
  if (ep_)
    for (size_t k = 0; k < is_expert_.size(); ++k)
      if (is_expert_[k]) experts.push_back(k);
  if (shards_optimizer())
    opt_.emplace(model_->named_params(), grad_sync_->grad_shards(), cfg_.optim, fused,
                 units_ ? &units_->param_shards() : nullptr, experts);
  else
    opt_.emplace(model_->named_params(), cfg_.optim, fused);
  if (topo_.rank != 0) return;
  const double mib = static_cast<double>(opt_->state_bytes()) / (1 << 20);
  log::info(shards_optimizer()
                ? concat("optimizer state: ", mib, " MiB per rank (ZeRO-", stage_, ": sharded over ", mesh_.layout().dp,
                         " data-parallel ranks",
                         ep_ ? "; the experts' whole on each of their replicas, the shared parameters' sharded" : "",
                         "; gradients reduce-scattered",
                         stage_ >= 2 ? " every micro-step, each rank keeping its shard only" : "",
                         units_ ? concat("; parameters sharded too, gathered per unit around its forward and "
                                         "backward: ", units_->num_units(), " units)")
                                : std::string(", parameters all-gathered)"))
                : concat("optimizer state: ", mib, " MiB per rank (replicated",
                         cfg_.optim.zero >= 1
                             ? concat("; optim.zero: ", cfg_.optim.zero, " has nothing to shard with one data-parallel rank")
                             : std::string(),
                         ")"));
}

std::string Parallelism::resume(const std::vector<std::string>& candidates, TrainState& st) {
  // ZeRO-3: each rank keeps its part of each tensor (at tp 1 one unit's bucket at a time, under tp
  // its slices of its tp shard), with no unit made whole. Pipeline stages whose ranks write their
  // own shares have no whole copy on rank 0: it opens the file with the whole model's names.
  std::optional<GPT> names;
  if ((pp_ || ep_) && !whole_model_ && topo_.rank == 0) names.emplace(whole_model(dims_, /*deferred=*/true));
  GPT* whole = !(ep_ || pp_) ? nullptr : whole_model_ ? &*whole_model_ : names ? &*names : nullptr;
  return resume_from(candidates, model_, *opt_, slice_owner_, st, mesh_.world(), mpi_comm_, cfg_.train.seed, device_,
                     units_ ? &units_->param_shards() : nullptr, whole, pp_ ? &whole_names_ : nullptr);
}

std::string Parallelism::describe_buckets() const {
  return concat(grad_sync_->num_buckets(), shards_optimizer() ? " reduce-scatter buckets" : " all-reduce buckets",
                expert_sync_ ? concat(" and ", expert_sync_->num_buckets(), " of the experts' over their ",
                                      mesh_.layout().dp / mesh_.layout().ep, " replicas")
                             : std::string(),
                grad_sync_->overlapping() ? " (overlapped with backward)" : "");
}

std::string Parallelism::describe_gradient_traffic(int64_t accum) const {
  if (mesh_.layout().dp <= 1) return {};
  const bool per_micro = stage_ >= 2;
  return concat(
      "gradient communication: ",
      static_cast<double>((grad_sync_->bytes_per_step() +
                           (expert_sync_ && mesh_.layout().dp > mesh_.layout().ep ? expert_sync_->bytes_per_step() : 0)) *
                          static_cast<uint64_t>(per_micro ? accum : 1)) /
          (1 << 20),
      " MiB per rank per step in ", cfg_.comm.grad_dtype,
      per_micro && accum > 1 ? concat(" (ZeRO-", stage_, ": ", accum, " reduce-scatters, one per micro-step)")
                             : std::string(),
      cfg_.comm.grad_dtype == "fp32" ? std::string()
                                     : " (comm.grad_dtype: half of fp32; summed in 16 bits, pre-divided by the group size)",
      powersgd_ ? concat("; PowerSGD rank ", cfg_.comm.powersgd_rank, " from step ", cfg_.comm.powersgd_start + 1, ": ",
                         static_cast<double>(powersgd_->bytes_per_step()) / (1 << 20), " MiB (",
                         static_cast<double>(powersgd_->uncompressed_bytes()) /
                             static_cast<double>(powersgd_->bytes_per_step()),
                         "x less; ", powersgd_->compressed_matrices(),
                         " weight matrices compressed, two all-reduces after backward, error feedback",
                         expert_sync_ && mesh_.layout().dp > mesh_.layout().ep
                             ? concat("; the experts' gradients whole: ",
                                      static_cast<double>(expert_sync_->bytes_per_step()) / (1 << 20), " MiB")
                             : std::string(),
                         ")")
                : std::string(),
      ep_ ? concat("; the experts' all-to-all: ", expert_exchange_mib(accum), " MiB sent per rank per step when the routing is balanced")
          : std::string());
}

double Parallelism::expert_exchange_mib(int64_t accum) const {
  return expert_exchange_bytes(dims_.sparse_layers(), dims_.routed_copies(cfg_.train.micro_batch * dims_.seq_len), dims_.n_embd,
                               4, cfg_.train.precision == "fp32" ? 4 : 2, mesh_.layout().ep, accum) /
         (1 << 20);
}

// ---- one step ------------------------------------------------------------------------------------

void Parallelism::begin_step(int64_t step) { compressed_ = powersgd_ && step >= cfg_.comm.powersgd_start; }

void Parallelism::before_backward(bool completes_step) {
  // This backward completes the step's gradients (ZeRO-2/3: every backward reduce-scatters its own).
  if ((completes_step || grad_sync_->frees_grads()) && !compressed_) grad_sync_->arm();
  if (completes_step && expert_sync_) expert_sync_->arm();
}

void Parallelism::after_backward(bool completes_step) {
  if (grad_sync_->frees_grads() && !completes_step) grad_sync_->reduce_micro_step();
}

void Parallelism::reduce_gradients() {
  // PowerSGD under pp: a tied embedding's two halves summed first (its error feedback and low-rank
  // approximation then those of the one gradient, as without stages: the compression is not linear).
  if (compressed_ && tied_) exchange_tied();
  if (compressed_)
    powersgd_->reduce_grads();
  else
    grad_sync_->all_reduce_grads();
  if (expert_sync_) {
    expert_sync_->all_reduce_grads();
    torch::NoGradGuard no_grad;
    const double ep = mesh_.layout().ep;
    for (size_t k = 0; k < params_.size(); ++k)
      if (is_expert_[k] && params_[k].grad().defined()) params_[k].grad().div_(ep);
  }
  if (tied_ && !compressed_) exchange_tied();
}

// A tied embedding's two gradients (its use as the embedding and as the head) summed between the
// pipeline's first and last stage.
void Parallelism::exchange_tied() {
  torch::NoGradGuard no_grad;
  const size_t k = *tied_;
  const int64_t other = dims_.first_stage() ? dims_.pp - 1 : 0;
  constexpr int kTiedTag = kPipeTagEnd;  // (above every micro-batch's activation and gradient tags)
  PipeLink link(mesh_.pp_mpi());
  if (!shards_optimizer()) {
    torch::Tensor& g = params_[k].mutable_grad();
    link.send(g, other, kTiedTag);
    const torch::Tensor theirs = link.recv(g.sizes(), other, kTiedTag, g.device());
    link.finish();
    g.add_(theirs.to(g.scalar_type()));
    return;
  }
  // ZeRO-1/2: the averaged gradient lies in slices over the stage's dp group (each end's bucket
  // layout its own): gathered whole on each end, exchanged, and the partner's added to each
  // rank's part of the slices.
  // (Expert parallelism: grad_sync_ holds the parameters but the experts, in order.)
  const auto j = static_cast<size_t>(ep_ ? std::count(is_expert_.begin(), is_expert_.begin() + static_cast<std::ptrdiff_t>(k), false) : k);
  const size_t b = grad_sync_->bucket_of(j);
  const torch::Tensor& shard = grad_sync_->grad_shard(b);
  torch::Tensor bucket = torch::empty({grad_sync_->padded_length(b)}, shard.options());
  mesh_.dp().all_gather(shard, bucket);
  const int64_t off = grad_sync_->flat_offset(j), n = params_[k].numel();
  link.send(bucket.narrow(0, off, n), other, kTiedTag);
  const torch::Tensor theirs = link.recv({n}, other, kTiedTag, shard.device());
  link.finish();
  const int64_t lo = mesh_.dp().rank() * shard.numel();  // this rank's part of the bucket
  const int64_t from = std::max(lo, off), to = std::min(lo + shard.numel(), off + n);
  if (from < to) shard.narrow(0, from - lo, to - from).add_(theirs.narrow(0, from - off, to - from));
}

std::pair<bool, torch::Tensor> Parallelism::unscale_and_clip(LossScaler& scaler, double max_norm) {
  if (pp_ && ep_) {  // a stage's experts apart over its ep group (expert parallelism's norm), then
                    // the stages' summed over the pipeline
    std::vector<torch::Tensor> grads;
    for (size_t i = 0; i < opt_->size(); ++i) grads.push_back(opt_->grad(i));
    const bool finite = scaler.unscale_and_check(grads, mesh_.world(), device_);
    const std::optional<size_t> elsewhere = tied_ && dims_.last_stage() ? tied_ : std::nullopt;
    return {finite, clip_ep_grad_norm_(*opt_, is_expert_, max_norm, mesh_.ep(), mesh_.dp(), tp_ ? &mesh_.tp() : nullptr,
                                       tp_replicated_, &mesh_.pp(), elsewhere)};
  }
  if (pp_) {  // each stage holds its blocks' gradients (ZeRO: its rank its slices of them): the
             // verdict and the norm agreed over the pipeline (and the stage's dp group)
    std::vector<torch::Tensor> grads;
    std::vector<bool> counted;
    for (size_t i = 0; i < opt_->size(); ++i) {
      grads.push_back(opt_->grad(i));
      const size_t k = opt_->param_index(i);
      counted.push_back(!(tied_ && dims_.last_stage() && k == *tied_) &&  // (the first stage's counts)
                        !(tp_place_.rank != 0 && tp_replicated_[k]));      // (tp rank 0's counts)
    }
    const bool finite = scaler.unscale_and_check(grads, shards_optimizer() || tp_ ? mesh_.world() : mesh_.pp(), device_);
    return {finite, clip_pp_grad_norm_(grads, counted, max_norm, mesh_.pp(), shards_optimizer() ? &mesh_.dp() : nullptr,
                                       tp_ ? &mesh_.tp() : nullptr)};
  }
  if (ep_) {  // the experts' gradients differ over the ep group (ZeRO: the slices over the dp
             // group): the verdict and the norm agreed over it
    std::vector<torch::Tensor> grads;
    for (size_t i = 0; i < opt_->size(); ++i) grads.push_back(opt_->grad(i));
    // (with tp: over the island, whose ranks hold every tp shard, slice and expert)
    const bool finite =
        scaler.unscale_and_check(grads, tp_ ? mesh_.island() : shards_optimizer() ? mesh_.dp() : mesh_.ep(), device_);
    return {finite, clip_ep_grad_norm_(*opt_, is_expert_, max_norm, mesh_.ep(), mesh_.dp(), tp_ ? &mesh_.tp() : nullptr,
                                       tp_replicated_)};
  }
  if (!shards_optimizer() && !tp_) {
    const bool finite = scaler.unscale_and_check(params_);
    return {finite, clip_grad_norm_(params_, max_norm)};
  }
  // Each rank holds a part of the gradients: the verdict and the norm are agreed over the ranks
  // that hold the others (sharded optimizer: the dp group; tensor parallel: the island, which is
  // the world without DiLoCo's islands: each island trains, and skips steps, on its own).
  Communicator& dp = mesh_.dp();
  AdamW& opt = *opt_;
  std::vector<torch::Tensor> grads;
  for (size_t i = 0; i < opt.size(); ++i) grads.push_back(opt.grad(i));
  const bool finite = scaler.unscale_and_check(grads, tp_ ? mesh_.island() : dp, device_);
  return {finite, tp_ ? clip_tp_grad_norm_(opt, model_, max_norm, mesh_.tp(), dp)
                      : clip_sharded_grad_norm_(opt, max_norm, dp)};
}

void Parallelism::after_update() {
  if (units_)  // the shards are the parameters: a unit still whole (evaluation's) is stale now
    units_->release_all();
  else if (shards_optimizer())  // every rank's updated slices to every rank
    grad_sync_->all_gather_params();
}

bool Parallelism::params_finite() {
  // One check of every parameter this rank holds (ZeRO-3: its shards; whole parameters exist only
  // around a unit's use), the same verdict on every rank.
  torch::Tensor all_finite;
  {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> ok;
    if (units_)
      for (size_t i = 0; i < opt_->size(); ++i) ok.push_back(torch::isfinite(opt_->param(i)).all());
    else
      for (const auto& p : params_) ok.push_back(torch::isfinite(p).all());
    all_finite = ok.empty() ? torch::ones({}, torch::kBool) : torch::stack(ok).all();
  }
  int finite = 1;
  {
    Watchdog::Scope watch("device synchronize (parameter check)");
    finite = all_finite.item<bool>() ? 1 : 0;
  }
  // Each rank checked its shards, or its island's parameters (DiLoCo: they differ between outer
  // steps): agree.
  if (tp_ || ep_ || pp_ || units_ || mesh_.layout().islands > 1) {
    Watchdog::Scope watch("all_reduce(parameter check)");
    mpi::all_reduce(&finite, 1, ReduceOp::min, mpi_comm_);
  }
  return finite != 0;
}

// ---- checkpoints and the end -------------------------------------------------------------------

void Parallelism::prepare_checkpoints(AsyncCheckpointWriter& writer, const TrainState& st) {
  if (shares_) checkpoint_comm_.emplace(mpi_comm_);
  // With checkpoint.async the loop stalls only for copies into host buffers allocated here, once
  // (a sharded optimizer through rank 0: also the whole moments rank 0 assembles, kept between
  // saves); synchronous saves allocate nothing between them.
  if (whole_model_) gathered_ = host_optim_state_like(*whole_model_);  // rank 0's whole state
  if (!writer.async()) return;
  // (ZeRO-3: the ranks' shares read the shards, AdamW's slots; rank 0 alone, its whole copy)
  if (shares_) {
    share_checkpoint(share_buffers_, model_, *opt_, slice_owner_, mesh_.dp_rank() == 0, st, /*copy=*/true,
                     pp_ || ep_ ? &whole_names_ : nullptr, ep_ ? &is_expert_ : nullptr, mesh_.dp_rank() < mesh_.layout().ep);
  } else if (whole_model_) {
    writer.prepare(*whole_model_, gathered_);
  } else if (topo_.rank == 0) {
    if (opt_->sharded()) gathered_ = host_optim_state_like(model_);
    writer.prepare(model_, opt_->sharded() ? gathered_ : full_state_of(*opt_));
  }
}

std::string Parallelism::save(AsyncCheckpointWriter& writer, const TrainState& st) {
  Mesh& mesh = mesh_;
  const bool first_replica = mesh.dp_rank() == 0;
  // ZeRO-3: each rank's share is read from its shards (AdamW's slots).
  if (shares_)  // collective: nobody runs ahead of a synchronous save that may yet fail
    return save_shares(writer, share_buffers_, model_, *opt_, slice_owner_, first_replica, st, checkpoint_comm_->get(),
                       pp_ || ep_ ? &whole_names_ : nullptr, ep_ ? &is_expert_ : nullptr,
                       mesh.dp_rank() < mesh.layout().ep);
  std::string path;
  if (pp_) {
    gather_stages(whole_model_ ? &*whole_model_ : nullptr, &gathered_);
    if (topo_.rank == 0) path = writer.save(*whole_model_, gathered_, st);
  } else if (ep_) {  // the experts assembled on rank 0
    gather_ep_state(model_, *opt_, mesh.ep(), mesh.dp_rank() < mesh.layout().ep, whole_model_ ? &*whole_model_ : nullptr,
                    &gathered_, slice_owner_, tp_ ? &mesh.tp() : nullptr, units());
    if (topo_.rank == 0) path = writer.save(*whole_model_, gathered_, st);
  } else if (tp_) {  // the shards assembled on rank 0 (tp + ZeRO-3: one unit at a time)
    gather_tp_state(model_, *opt_, slice_owner_, mesh.tp(), first_replica, whole_model_ ? &*whole_model_ : nullptr,
                    &gathered_, units());
    if (topo_.rank == 0) path = writer.save(*whole_model_, gathered_, st);
  } else {  // a sharded optimizer's state assembled on rank 0
    if (units_) {  // ZeRO-3: each unit gathered in turn, rank 0 copying it into its whole copy
      torch::NoGradGuard no_grad;
      std::vector<torch::Tensor> into;
      if (whole_model_)
        for (auto& [name, p] : (*whole_model_)->named_params()) into.push_back(p);
      units_->for_each_unit_whole([&](const std::vector<size_t>& ks) {
        if (whole_model_)
          for (size_t k : ks) into[k].copy_(params_[k]);
      });
    }
    FullOptimState optim_state = gather_optim_state(*opt_, slice_owner_, model_, writer.async() ? &gathered_ : nullptr);
    if (topo_.rank == 0) path = writer.save(whole_model_ ? *whole_model_ : model_, optim_state, st);
  }
  if (!writer.async()) mesh.world().barrier();  // nobody runs ahead of a checkpoint that may yet fail
  return path;
}

// Each stage's tensors sent to rank 0 by the first pipeline's ranks (with islands: island 0's),
// one at a time (ZeRO: the moments first gathered to them over each stage's dp group; expert
// parallelism: the stage's experts first gathered from its first ep group into its host copy).
void Parallelism::gather_stages(GPT* into, FullOptimState* state) {
  Mesh& mesh = mesh_;
  if (ep_) {
    const bool assembles = mesh.replica() == 0 && mesh.tp_rank() == 0;  // (the first pipeline)
    if (assembles && !ep_stage_whole_) {  // made at the first save, kept
      ep_stage_whole_.emplace(whole_model(dims_, /*deferred=*/false, /*stage=*/true));
      ep_stage_state_ = host_optim_state_like(*ep_stage_whole_);
    }
    gather_ep_state(model_, *opt_, mesh.ep(), mesh.dp_rank() < mesh.layout().ep, assembles ? &*ep_stage_whole_ : nullptr,
                    &ep_stage_state_, slice_owner_, tp_ ? &mesh.tp() : nullptr, units());
    if (assembles) gather_pp_state(*ep_stage_whole_, *opt_, mesh.pp_mpi(), whole_names_, into, state, &ep_stage_state_, nullptr);
    return;
  }
  const FullOptimState stage = shards_optimizer() ? gather_optim_state(*opt_, slice_owner_, model_) : FullOptimState{};
  // ZeRO-3: the stage's units whole on its dp group while its first replica sends them (a
  // collective over it; the stage, not the model, on each rank).
  WholeParams whole(units());
  if (mesh.replica() == 0)
    gather_pp_state(model_, *opt_, mesh.pp_mpi(), whole_names_, into, state, shards_optimizer() ? &stage : nullptr,
                    tp_ ? &mesh.tp() : nullptr);
}

std::vector<std::pair<std::string, std::vector<float>>> Parallelism::whole_params() {
  std::vector<std::pair<std::string, std::vector<float>>> out;
  if (pp_) {  // the stages' tensors on rank 0 (the other ranks return none)
    std::optional<GPT> made;
    GPT* into = whole_model_ ? &*whole_model_ : nullptr;
    if (!into && topo_.rank == 0) into = &made.emplace(whole_model(dims_, /*deferred=*/false));
    FullOptimState state;
    if (into) state = host_optim_state_like(*into);
    gather_stages(into, &state);
    if (into)
      for (auto& [name, p] : (*into)->named_params()) {
        torch::Tensor c = p.detach().to(torch::kFloat32).contiguous();
        out.emplace_back(name, std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel()));
      }
    return out;
  }
  if (ep_) {  // each ep group's experts gathered within it
    GPT whole = whole_model(dims_, /*deferred=*/false);
    FullOptimState state = host_optim_state_like(whole);
    gather_ep_state(model_, *opt_, mesh_.ep(), true, &whole, &state, slice_owner_, tp_ ? &mesh_.tp() : nullptr, units());
    for (auto& [name, p] : whole->named_params()) {
      torch::Tensor c = p.detach().to(torch::kFloat32).contiguous();
      out.emplace_back(name, std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel()));
    }
    return out;
  }
  WholeParams whole(units());
  for (auto& [name, p] : model_->named_params()) {
    torch::Tensor c =
        tp_unshard(p.detach(), model_->tp_split(name), mesh_.tp()).to(torch::kCPU, torch::kFloat32).contiguous();
    out.emplace_back(name, std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel()));
  }
  return out;
}

}  // namespace mpitrain
