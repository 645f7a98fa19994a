// Activation checkpointing, full and selective (see checkpointing.h).
#include "mpitrain/checkpointing.h"

#include <ATen/autocast_mode.h>

#include <atomic>
#include <memory>
#include <optional>
#include <utility>

#include "mpitrain/amp.h"
#include "mpitrain/error.h"
#include "mpitrain/fused_ops.h"

namespace mpitrain {

namespace {

std::atomic<int64_t> g_recomputed_blocks{0}, g_replayed_linear{0}, g_replayed_attention{0};
thread_local bool t_recomputing = false;

// ---- random state --------------------------------------------------------------------------------

torch::Tensor generator_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_generator_state(at::Generator gen, const torch::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// The states of the generators a block on `device` draws from: the CPU's, and the GPU's.
struct RngStates {
  torch::Device device{torch::kCPU};
  torch::Tensor cpu, gpu;

  static RngStates now(const torch::Device& device) {
    RngStates s;
    s.device = device;
    s.cpu = generator_state(at::detail::getDefaultCPUGenerator());
    if (device.is_cuda()) s.gpu = generator_state(at::globalContext().defaultGenerator(device));
    return s;
  }
  void restore() const {
    set_generator_state(at::detail::getDefaultCPUGenerator(), cpu);
    if (gpu.defined()) set_generator_state(at::globalContext().defaultGenerator(device), gpu);
  }
};

// For its lifetime, the generators are as `first` holds them; then back as they were.
class RngAsIn {
 public:
  explicit RngAsIn(const RngStates& first) : saved_(RngStates::now(first.device)) { first.restore(); }
  ~RngAsIn() { saved_.restore(); }
  RngAsIn(const RngAsIn&) = delete;
  RngAsIn& operator=(const RngAsIn&) = delete;

 private:
  RngStates saved_;
};

// ---- the tape of a selective block ----------------------------------------------------------------

// One op the first run recorded: a linear layer's output, or attention's output with its graph
// (from the detached inputs `leaves`) and the random state after it, or (kept false) that
// attention runs again.
struct TapeEntry : torch::CustomClassHolder {
  bool attention = false, kept = true;
  torch::Tensor out;
  std::vector<torch::Tensor> leaves;
  std::optional<RngStates> rng_after;
};

struct Tape {
  enum class Mode { record, replay } mode = Mode::record;
  std::vector<c10::intrusive_ptr<TapeEntry>> entries;
  size_t next = 0;  // replay: the entry the next op takes

  c10::intrusive_ptr<TapeEntry> take(bool attention) {
    MPITRAIN_CHECK(next < entries.size() && entries[next]->attention == attention,
                   "selective checkpointing: the block's second run reached other ops than its first");
    return entries[next++];
  }
};

thread_local Tape* t_tape = nullptr;  // the selective block running on this thread, if any

class TapeScope {
 public:
  TapeScope(Tape* tape, Tape::Mode mode) : previous_(t_tape) {
    if (tape) tape->mode = mode, tape->next = 0;
    t_tape = tape;
  }
  ~TapeScope() { t_tape = previous_; }
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;

 private:
  Tape* previous_;
};

// A replayed linear layer: forward hands out the recorded output; backward is the matmul's (and
// the bias add's) own, as libtorch's autograd computes it for at::linear and F::linear (both fold
// a [B, T, in] input into [B T, in] and multiply by weight.t(): addmm with a bias, mm without):
// torch/csrc/autograd/FunctionsManual.cpp's mm_mat1_backward and mm_mat2_backward with mat1 = the folded input,
// mat2 = weight.t(), alpha 1, and the engine's sum_to for the broadcast bias.
class ReplayLinear : public torch::autograd::Function<ReplayLinear> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                                const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
                                                c10::intrusive_ptr<TapeEntry> entry) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["bias"] = bias.has_value();
    return {std::exchange(entry->out, torch::Tensor())};  // the tape lets go of it
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &weight = saved[1];
    const torch::Tensor& grad = grads[0];
    if (!grad.defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    const torch::Tensor g = grad.reshape({-1, grad.size(-1)});  // the output's view back to 2-d
    const torch::Tensor mat1 = x.reshape({-1, x.size(-1)}), mat2 = weight.t();
    auto column_major = [](const torch::Tensor& t) { return t.stride(0) == 1 && t.stride(1) == t.size(0); };
    torch::Tensor grad_x, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) {
      grad_x = column_major(mat1) ? mat2.mm(g.t()).t() : g.mm(mat2.t());
      grad_x = grad_x.reshape(x.sizes());
    }
    if (ctx->needs_input_grad(1)) grad_weight = (column_major(mat2) ? g.t().mm(mat1).t() : mat1.t().mm(g)).t();
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2))
      grad_bias = g.sum({0}, /*keepdim=*/true).view({g.size(1)});
    return {grad_x, grad_weight, grad_bias, torch::Tensor()};
  }
};

// A replayed attention core: forward hands out the first run's output; backward runs the first
// run's graph backward from it and returns what reached q, k and v.
class ReplayAttention : public torch::autograd::Function<ReplayAttention> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& /*q*/,
                                                const torch::Tensor& /*k*/, const torch::Tensor& /*v*/,
                                                c10::intrusive_ptr<TapeEntry> entry) {
    ctx->saved_data["entry"] = c10::IValue::make_capsule(entry);
    return {entry->out.detach()};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto entry = c10::static_intrusive_pointer_cast<TapeEntry>(ctx->saved_data["entry"].toCapsule());
    std::vector<torch::Tensor> out(4);
    if (grads[0].defined()) {
      const auto g = torch::autograd::grad({entry->out}, entry->leaves, {grads[0]}, /*retain_graph=*/false,
                                           /*create_graph=*/false, /*allow_unused=*/true);
      std::copy(g.begin(), g.end(), out.begin());
    }
    entry->out = torch::Tensor();
    entry->leaves.clear();
    return out;
  }
};

// ---- the checkpointed block -----------------------------------------------------------------------

// What a checkpointed block's second run needs: the block, the first run's random state and
// autocast, and (selective) the first run's tape.
struct Recompute : torch::CustomClassHolder {
  BlockRun run;
  RngStates rng;                               // before the first run
  c10::ScalarType autocast = torch::kFloat32;  // the first run's autocast dtype (fp32: none)
  std::unique_ptr<Tape> tape;                  // selective only
};

// Runs the block without keeping anything for backward but its inputs (x and delta, which may
// be undefined) and the tape. Backward runs the block again from them and backpropagates the
// incoming gradients through that second graph (a reentrant backward: the block's parameters get
// their gradients there, and their hooks, such as the data-parallel buckets', fire there), then
// returns the inputs' gradients.
class CheckpointedBlock : public torch::autograd::Function<CheckpointedBlock> {
 public:
  // delta: an optional (libtorch's autograd takes no undefined tensor as an input of a Function).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                                const c10::optional<torch::Tensor>& delta_opt,
                                                c10::intrusive_ptr<Recompute> r) {
    const torch::Tensor delta = delta_opt.has_value() ? *delta_opt : torch::Tensor();
    r->rng = RngStates::now(x.device());
    r->autocast = autocast_dtype_or(x.device().type(), torch::kFloat32);
    ctx->save_for_backward({x, delta});
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(r);
    TapeScope tape(r->tape.get(), Tape::Mode::record);
    return r->run({x, delta});  // autograd::Function runs forward without recording a graph
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto r = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    std::vector<torch::Tensor> in;
    for (const auto& t : saved) in.push_back(t.defined() ? t.detach().requires_grad_(true) : torch::Tensor());
    std::vector<torch::Tensor> outs;
    {
      RngAsIn rng(r->rng);
      torch::AutoGradMode grad_mode(true);
      std::optional<Autocast> autocast;
      if (r->autocast != torch::kFloat32)
        autocast.emplace(r->autocast == torch::kBFloat16 ? Precision::bf16 : Precision::fp16, r->rng.device);
      TapeScope tape(r->tape.get(), Tape::Mode::replay);
      t_recomputing = true;
      try {
        outs = r->run(in);
      } catch (...) {
        t_recomputing = false;
        throw;
      }
      t_recomputing = false;
      if (r->tape) {
        MPITRAIN_CHECK(r->tape->next == r->tape->entries.size(),
                       "selective checkpointing: the block's second run skipped ops of its first");
        r->tape->entries.clear();  // what was replayed is the second graph's now
      }
    }
    g_recomputed_blocks.fetch_add(1, std::memory_order_relaxed);
    std::vector<torch::Tensor> roots, root_grads;
    for (size_t i = 0; i < outs.size(); ++i)
      if (outs[i].defined() && outs[i].requires_grad() && i < grads.size() && grads[i].defined())
        roots.push_back(outs[i]), root_grads.push_back(grads[i]);
    torch::autograd::backward(roots, root_grads);
    auto grad_of = [](const torch::Tensor& t) { return t.defined() ? t.grad() : torch::Tensor(); };
    return {grad_of(in[0]), grad_of(in[1]), torch::Tensor()};
  }
};

// Autocast's cast of an operand, as its wrapper of at::linear / matmul makes it: to `dtype` (the
// dtype the first run's op computed in) where autocast is on and the operand is another float.
torch::Tensor autocast_operand(const torch::Tensor& t, c10::ScalarType dtype) {
  if (!t.defined() || dtype == torch::kFloat32) return t;
  const c10::DeviceType type = t.device().type();
  if (autocast_dtype_or(type, torch::kFloat32) != dtype) return t;
  return at::autocast::cached_cast(dtype, t, type);
}

}  // namespace

std::vector<torch::Tensor> checkpointed_block(const BlockRun& run, const torch::Tensor& x, const torch::Tensor& delta,
                                              bool selective) {
  auto r = c10::make_intrusive<Recompute>();
  r->run = run;
  if (selective) r->tape = std::make_unique<Tape>();
  return apply_autograd_function<CheckpointedBlock>(x, delta.defined() ? c10::optional<torch::Tensor>(delta) : c10::nullopt,
                                                    r);
}

torch::Tensor tape_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                          const std::function<torch::Tensor()>& compute) {
  Tape* tape = t_tape;
  if (!tape) return compute();
  if (tape->mode == Tape::Mode::record) {
    auto entry = c10::make_intrusive<TapeEntry>();
    entry->out = compute();
    tape->entries.push_back(entry);
    return entry->out;
  }
  auto entry = tape->take(/*attention=*/false);
  const c10::ScalarType dtype = entry->out.scalar_type();
  g_replayed_linear.fetch_add(1, std::memory_order_relaxed);
  return apply_autograd_function<ReplayLinear>(
      autocast_operand(x, dtype), autocast_operand(weight, dtype),
      bias.defined() ? c10::optional<torch::Tensor>(autocast_operand(bias, dtype)) : c10::nullopt, entry)[0];
}

torch::Tensor tape_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool uses_rng,
                             const std::function<bool(const torch::Tensor&)>& keeps, const AttentionCore& core) {
  Tape* tape = t_tape;
  if (!tape) return core(q, k, v);
  if (tape->mode == Tape::Mode::record) {
    auto entry = c10::make_intrusive<TapeEntry>();
    entry->attention = true;
    for (const torch::Tensor* t : {&q, &k, &v}) entry->leaves.push_back(t->detach().requires_grad_(true));
    entry->kept = keeps(entry->leaves[0]);
    if (!entry->kept) {
      entry->leaves.clear();
      tape->entries.push_back(entry);
      return core(q, k, v);
    }
    {
      torch::AutoGradMode grad_mode(true);  // the core's own graph, from the leaves
      entry->out = core(entry->leaves[0], entry->leaves[1], entry->leaves[2]);
    }
    if (uses_rng) entry->rng_after = RngStates::now(q.device());
    tape->entries.push_back(entry);
    return entry->out.detach();
  }
  auto entry = tape->take(/*attention=*/true);
  if (!entry->kept) return core(q, k, v);
  if (entry->rng_after) entry->rng_after->restore();  // where the first run's core left the generators
  g_replayed_attention.fetch_add(1, std::memory_order_relaxed);
  return apply_autograd_function<ReplayAttention>(q, k, v, entry)[0];
}

int64_t recomputed_blocks() { return g_recomputed_blocks.load(std::memory_order_relaxed); }
bool recomputing() { return t_recomputing; }
int64_t replayed_linear_layers() { return g_replayed_linear.load(std::memory_order_relaxed); }
int64_t replayed_attention() { return g_replayed_attention.load(std::memory_order_relaxed); }

}  // namespace mpitrain
